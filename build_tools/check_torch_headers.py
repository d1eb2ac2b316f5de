"""Compiles every host C++ file of the extension (CUDA glue and NCCL transport included) against another torch's
headers, syntax only, with the flags and macros of a CUDA build: an API that the other torch lacks fails here, not
on the machine that runs it.

    python build_tools/check_torch_headers.py [--torch 2.11.0] [--cache build/torch-headers]

The default is the GPU machine's torch (2.11, /work/.library/device/KINDS.md): the GPU check builds there, and a
torch API newer than it stopped that build once (ProcessGroup::hasBackendForDeviceType). The wheel (about 530 MB,
from the package registry, without its dependencies) is kept in build/torch-wheels, which `make test-min-torch`
installs (build_tools/test_min_torch.py: the Python tests under that torch); only its headers are unpacked here. The
CUDA and NCCL headers are this machine's (build_tools/cuda_home.py, build_tools/nccl.py): the .cu files include no
torch header, so they do not depend on the torch version and are compiled by the build itself.
"""

import argparse
import concurrent.futures
import glob
import os
import subprocess
import sys
import sysconfig
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from build_tools import flags  # noqa: E402
from build_tools.cuda_home import find_cuda_home  # noqa: E402
from build_tools.nccl import find_nccl  # noqa: E402


WHEELS = os.path.join(ROOT, "build", "torch-wheels")


def fetch_wheel(version: str, where: str = WHEELS) -> str:
    """torch==`version`'s wheel for this Python, downloaded once into `where` and kept: the header check unpacks its
    headers, and build_tools/test_min_torch.py installs it (one download for both)."""
    os.makedirs(where, exist_ok=True)
    # torch-VERSION or torch-VERSION+LABEL (an index serving local-labelled wheels, +cpu / +cu130: pip's torch==VERSION
    # takes them too), for this Python
    tag = f"cp{sys.version_info[0]}{sys.version_info[1]}"
    pattern = [os.path.join(where, f"torch-{version}{label}-{tag}-*.whl") for label in ("", "+*")]
    found = lambda: sorted(f for p in pattern for f in glob.glob(p))  # noqa: E731
    if not found():
        # PIP_CONSTRAINT is cleared: a cap on the torch release installed here must not refuse a download of another
        cmd = [sys.executable, "-m", "pip", "download", "-q", f"torch=={version}", "--no-deps", "--only-binary=:all:",
               "-d", where]
        subprocess.run(cmd, check=True, env={**os.environ, "PIP_CONSTRAINT": ""})
    if not found():
        sys.exit(f"fetch_wheel: pip downloaded no torch {version} wheel for {tag} into {where} "
                 f"(it holds: {sorted(os.listdir(where))})")
    return found()[-1]


def torch_headers(version: str, cache: str) -> str:
    """The include directory of torch==`version`'s wheel for this Python, unpacked once."""
    where = os.path.join(cache, version)
    include = os.path.join(where, "torch", "include")
    if os.path.isdir(include):
        return include
    with zipfile.ZipFile(fetch_wheel(version)) as wheel:
        wheel.extractall(where, [n for n in wheel.namelist() if n.startswith("torch/include/")])
    return include


def compile_command(source: str, include: str, cuda_include: str, nccl_include: str):
    return ["c++", "-fsyntax-only", *flags.CXX_FLAGS, "-fPIC", "-I", os.path.join(ROOT, "csrc"), "-I", include,
            "-I", os.path.join(include, "torch", "csrc", "api", "include"), "-I", cuda_include, "-I", nccl_include,
            "-I", sysconfig.get_paths()["include"], f"-D{flags.CUDA_MACRO}", f"-D{flags.NCCL_MACRO}",
            "-DTORCH_API_INCLUDE_EXTENSION_H", "-DTORCH_EXTENSION_NAME=_C", source]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--torch", default="2.11.0", help="the torch release whose headers to compile against")
    ap.add_argument("--cache", default=os.path.join(ROOT, "build", "torch-headers"))
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args()
    cuda_home, nccl = find_cuda_home(), find_nccl()
    if cuda_home is None or nccl is None:
        sys.exit(f"check_torch_headers: needs the CUDA toolkit's headers (found {cuda_home!r}) and NCCL's (found "
                 f"{nccl!r}) to compile the CUDA glue and the NCCL transport")
    include = torch_headers(args.torch, args.cache)
    sources = flags.host_sources(ROOT, cuda=True, nccl=True)

    def check(source):
        run = subprocess.run(compile_command(source, include, os.path.join(cuda_home, "include"), nccl[0]),
                             capture_output=True, text=True)
        return source, run.returncode, run.stderr

    failed = 0
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        for source, rc, err in pool.map(check, sources):
            name = os.path.relpath(source, ROOT)
            if rc:
                failed += 1
                errors = [line for line in err.splitlines() if "error" in line]
                print(f"FAIL {name}\n  " + "\n  ".join(errors[:10] or err.splitlines()[-10:]))
            else:
                print(f"ok   {name}")
    print(f"check_torch_headers: {len(sources) - failed} of {len(sources)} host files compile against torch "
          f"{args.torch}'s headers")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
