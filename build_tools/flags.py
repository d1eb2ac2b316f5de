"""What the extension is compiled from and with: shared by setup.py and check_torch_headers.py, so the header
check compiles exactly what a build compiles."""

import glob
import os

# torch 2.14 headers need C++20; torch 2.11 (the GPU machine's) builds with it too.
CXX_STD = "-std=c++20"

# -fopenmp: at::parallel_for is inline header code that only runs in parallel when compiled with OpenMP.
# -ffp-contract=off: the 8-bit wire's copies must be bit-identical on every rank (int8_codec_math.h); a user's
# -march with FMA would otherwise let g++ fuse their multiply-adds. -fno-trapping-math: no code here reads the
# floating-point exception flags, and without it g++ keeps the codec's clamps and maxima as branches (scalar).
CXX_FLAGS = [CXX_STD, "-O3", "-fno-math-errno", "-ffp-contract=off", "-fno-trapping-math", "-fopenmp", "-Wall",
             "-Wno-unknown-pragmas"]
# --exclude-libs,ALL: what the link takes from static archives stays private to the library. A compiler that links
# libstdc++ statically (the GPU machine's /opt/gcc put std::ostream code inside _C.so) otherwise exports that copy's
# symbols, and the libstdc++.so that torch loaded first, process-wide, takes part of them over: the two copies'
# locales mix, and formatting an integer into a C++ error message lost the integer and the rest of the message
# (here) or segfaulted (there: Exchanger.exchange refusing a peer outside the world). With a dynamic libstdc++ it
# changes nothing. tests/test_build_link.py links a library so, with and without these flags.
LINK_FLAGS = ["-fopenmp", "-Wl,--exclude-libs,ALL"]
NVCC_FLAGS = [CXX_STD, "-O3", "-lineinfo", "--expt-relaxed-constexpr"]
CUDA_MACRO = "DECENT_COMM_WITH_CUDA"
NCCL_MACRO = "DECENT_COMM_WITH_NCCL"


def _sorted_glob(root, *patterns):
    return sorted(p for pattern in patterns for p in glob.glob(os.path.join(root, pattern)))


def host_sources(root: str, cuda: bool, nccl: bool):
    """The C++ files compiled by the host compiler (relative to `root` when it is "" or "."): always the CPU
    kernels, the ops and the exchange; with `cuda` the CUDA kernels' host glue; with `nccl` the NCCL transport."""
    patterns = ["csrc/*.cpp", "csrc/cpu/*.cpp", "csrc/comm/*.cpp"]
    out = _sorted_glob(root, *patterns)
    if cuda:
        out += _sorted_glob(root, "csrc/cuda/*.cpp")
    if nccl:
        out += _sorted_glob(root, "csrc/comm/nccl/*.cpp")
    return out


def cuda_sources(root: str):
    """The .cu files (device code; they include no torch header)."""
    return _sorted_glob(root, "csrc/cuda/*.cu")
