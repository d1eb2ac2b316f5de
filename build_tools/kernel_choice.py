"""Which kernels setup.py builds: the CPU kernels always, the CUDA kernels only when they can run or are asked for.

CUDA (nvcc on the kernels and the NCCL transport) takes most of the build time, so a machine with nvcc but no GPU
builds the CPU kernels only unless DECENT_COMM_CUDA=1 or TORCH_CUDA_ARCH_LIST asks for CUDA (CI compiles it that
way). Pure: everything it looks at is an argument, so the decision is tested without a toolchain.
"""


def want_cuda(env, have_toolchain, toolchain_text, gpu_visible):
    """(build the CUDA kernels?, why, in words). `env`: the environment (a mapping); `have_toolchain`: nvcc found
    and torch is a CUDA build; `toolchain_text`: what was found, for the messages; `gpu_visible`: a callable (only
    asked when it matters: it initializes CUDA)."""
    forced = env.get("DECENT_COMM_CUDA")
    if forced not in (None, "", "0", "1"):
        raise ValueError(f"DECENT_COMM_CUDA={forced!r}: use 0 (CPU kernels only) or 1 (CPU and CUDA kernels)")
    if forced == "0":
        return False, "DECENT_COMM_CUDA=0"
    if forced == "1":
        if not have_toolchain:
            raise RuntimeError(f"DECENT_COMM_CUDA=1 but no usable CUDA toolchain: {toolchain_text}")
        return True, "DECENT_COMM_CUDA=1"
    if not have_toolchain:
        return False, f"no CUDA toolchain ({toolchain_text})"
    if env.get("TORCH_CUDA_ARCH_LIST"):
        return True, f"TORCH_CUDA_ARCH_LIST={env['TORCH_CUDA_ARCH_LIST']}"
    if gpu_visible():
        return True, "a GPU is visible"
    return False, ("nvcc found but no GPU visible; set DECENT_COMM_CUDA=1 or TORCH_CUDA_ARCH_LIST to build the "
                   "CUDA kernels anyway")
