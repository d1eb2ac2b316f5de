"""``python -m decent_comm info``: how this copy of decent_comm was built, and what it can run here.

A build without a visible GPU compiles the CPU kernels only (setup.py: CUDA takes most of the build time); this is
where a user finds out which one they have, without reading the build log pip hides.
"""
from __future__ import annotations

import platform

from .registry import Subcommand, register


def build_summary() -> dict:
    """What the native extension holds and what this machine offers, as plain values."""
    import torch

    from .. import _native
    nccl = _native.nccl_version()
    return {
        "decent_comm": _package_version(),
        "torch": torch.__version__,
        "kernels": "CPU and CUDA" if _native.built_with_cuda() else "CPU only",
        "nccl_transport": ".".join(map(str, nccl)) if nccl else None,
        "cuda_devices_visible": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "cpu": f"{platform.machine()}, torch CPU capability {torch.backends.cpu.get_cpu_capability()}, "
               f"decent_comm CPU loops {_cpu_loops()}",
    }


def _cpu_loops() -> str:
    """The instruction set decent_comm's CPU loops run with, or why none (a bad DECENT_COMM_CPU_ISA)."""
    from .. import _native
    try:
        return _native.cpu_isa()
    except ValueError as exc:
        return f"none: {exc}"


def _package_version() -> str:
    from importlib import metadata
    try:
        return metadata.version("decent_comm")
    except metadata.PackageNotFoundError:  # an in-place build (make build), not installed
        return "in-place build"


def run(args, parser) -> int:
    info = build_summary()
    for key, value in info.items():
        print(f"{key}: {value if value is not None else 'not built'}")
    if info["kernels"] == "CPU only" and info["cuda_devices_visible"]:
        print("note: a GPU is visible but the CUDA kernels were not built; rebuild with DECENT_COMM_CUDA=1 "
              "(or TORCH_CUDA_ARCH_LIST=<archs>) to use it")
    elif info["kernels"] == "CPU only":
        print("note: the CUDA kernels are built when the build sees a GPU, TORCH_CUDA_ARCH_LIST=<archs> or "
              "DECENT_COMM_CUDA=1 (and nvcc and a CUDA build of torch); the build log says which it found "
              "(pip install -v)")
    return 0


register(Subcommand(name="info", help="say which kernels this build holds (CPU only, or CPU and CUDA) and what "
                                      "builds the others",
                    add_arguments=lambda p: None, run=run))
