"""Finds the CUDA toolkit root of the nvcc that really runs (used by setup.py, the Makefile and CMake).

    python build_tools/cuda_home.py      # prints the root, or nothing when there is no nvcc
"""

import os
import re
import shutil
import subprocess


def find_cuda_home():
    """Toolkit root of the nvcc that will really run.

    torch guesses CUDA_HOME from `which nvcc`, which is wrong when nvcc is a wrapper script (e.g.
    /usr/local/bin/nvcc exec'ing /usr/local/cuda-13.0/bin/nvcc). `nvcc --dryrun` prints the directory
    of the real binary, so ask it.
    """
    if os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH"):
        return os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        for candidate in ("/usr/local/cuda/bin/nvcc",):
            if os.path.exists(candidate):
                nvcc = candidate
        if nvcc is None:
            return None
    try:
        out = subprocess.run([nvcc, "--dryrun", "-E", "-x", "cu", os.devnull], capture_output=True, text=True, timeout=60)
        text = out.stdout + out.stderr
    except (OSError, subprocess.SubprocessError):
        text = ""
    match = re.search(r"_HERE_=(\S+)", text)
    bindir = match.group(1) if match else os.path.dirname(os.path.realpath(nvcc))
    return os.path.dirname(os.path.abspath(bindir))


if __name__ == "__main__":
    print(find_cuda_home() or "")
