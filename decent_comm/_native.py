"""Loads the compiled extension decent_comm._C once, with an error that says how to build it."""

try:
    from . import _C  # noqa: F401  (importing registers torch.ops.decent_comm.*)
except ImportError as exc:  # pragma: no cover - only without a build
    raise ImportError(
        "decent_comm's native extension (decent_comm._C) is not built or does not match this torch: "
        "run `make build` (or `pip install --no-build-isolation -e .`) in the repository. "
        f"Original error: {exc}"
    ) from exc

built_with_cuda = _C.built_with_cuda
nccl_version = _C.nccl_version
cpu_isa = _C.cpu_isa
