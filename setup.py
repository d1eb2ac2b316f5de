"""Builds decent_comm and its native extension decent_comm._C with torch.utils.cpp_extension + ninja.

The CPU kernels are always built. The CUDA kernels (and the NCCL transport) are built when nvcc is found,
torch is a CUDA build, and a GPU is visible or TORCH_CUDA_ARCH_LIST names the architectures (CI sets it to
compile CUDA without a GPU); DECENT_COMM_CUDA=0|1 forces either way.

    pip install --no-build-isolation -e .        # or: python setup.py build_ext --inplace
"""

import os
import sys

from setuptools import find_packages, setup

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from build_tools.cuda_home import find_cuda_home  # noqa: E402
from build_tools import flags, kernel_choice  # noqa: E402
from build_tools.nccl import find_nccl  # noqa: E402

ROOT = os.path.dirname(os.path.abspath(__file__))
DEFAULT_ARCH_LIST = "8.0;9.0+PTX"  # A100, H100, and PTX for anything newer


def log(msg):
    print(f"[decent_comm setup] {msg}", file=sys.stderr)


# Must be set before torch.utils.cpp_extension is imported: it reads CUDA_HOME at import time.
_cuda_home = find_cuda_home()
if _cuda_home and not os.environ.get("CUDA_HOME"):
    os.environ["CUDA_HOME"] = _cuda_home

import torch  # noqa: E402
from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension  # noqa: E402


def want_cuda():
    """(build the CUDA kernels?, why): build_tools/kernel_choice.py decides."""
    have = bool(_cuda_home) and os.path.exists(os.path.join(_cuda_home, "bin", "nvcc")) and bool(torch.version.cuda)
    found = f"CUDA_HOME={_cuda_home!r}, torch.version.cuda={torch.version.cuda!r}"
    return kernel_choice.want_cuda(os.environ, have, found, torch.cuda.is_available)


def build_extension():
    sources = flags.host_sources("", cuda=False, nccl=False)
    cxx_flags = list(flags.CXX_FLAGS)
    # Python's sysconfig adds -g: debug info for every torch header each file includes more than doubles the
    # compile time (op_call.cpp: 43 s with it, 16 s without). DECENT_COMM_DEBUG=1 keeps it.
    if os.environ.get("DECENT_COMM_DEBUG") != "1":
        cxx_flags.append("-g0")
    define_macros = []
    include_dirs = [os.path.join(ROOT, "csrc")]
    extra_link_args = list(flags.LINK_FLAGS)
    use_cuda, why = want_cuda()
    if not use_cuda:
        log(f"building the CPU kernels only: {why}")
        return CppExtension(
            "decent_comm._C",
            sources,
            include_dirs=include_dirs,
            define_macros=define_macros,
            extra_compile_args={"cxx": cxx_flags},
            extra_link_args=extra_link_args,
        )

    if not os.environ.get("TORCH_CUDA_ARCH_LIST") and not torch.cuda.is_available():
        os.environ["TORCH_CUDA_ARCH_LIST"] = DEFAULT_ARCH_LIST
    log(f"building the CPU and CUDA kernels ({why}; CUDA_HOME={_cuda_home}, archs "
        f"{os.environ.get('TORCH_CUDA_ARCH_LIST', 'of the visible GPU')})")
    define_macros.append((flags.CUDA_MACRO, None))
    nccl = None if os.environ.get("DECENT_COMM_NCCL") == "0" else find_nccl()
    if nccl is not None:
        nccl_include, nccl_lib = nccl
        log(f"NCCL transport: {nccl_lib}")
        define_macros.append((flags.NCCL_MACRO, None))
        include_dirs.append(nccl_include)
        extra_link_args += [nccl_lib, f"-Wl,-rpath,{os.path.dirname(nccl_lib)}"]
    else:
        log("NCCL not found: building without the NCCL transport")
    sources = flags.host_sources("", cuda=True, nccl=nccl is not None) + flags.cuda_sources("")
    nvcc_flags = list(flags.NVCC_FLAGS)
    return CUDAExtension(
        "decent_comm._C",
        sources,
        include_dirs=include_dirs,
        define_macros=define_macros,
        extra_compile_args={"cxx": cxx_flags, "nvcc": nvcc_flags},
        extra_link_args=extra_link_args,
    )


setup(
    name="decent_comm",
    version="0.1.0",
    description="Decentralized data-parallel training for PyTorch: fused gossip kernels, a C++ exchange "
    "scheduler, topologies and drop-in optimizers",
    packages=find_packages(include=["decent_comm", "decent_comm.*"]),
    ext_modules=[build_extension()],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
    python_requires=">=3.9",
    install_requires=["torch>=2.11", "numpy"],
)
