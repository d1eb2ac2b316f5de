"""Finds the NCCL that torch's CUDA wheel depends on (used by setup.py and CMakeLists.txt).

    python build_tools/nccl.py      # prints "<include dir>;<library file>", or nothing when there is none
"""

import glob
import importlib.util
import os


def find_nccl():
    """(include_dir, lib_file) of NCCL_HOME or of the nvidia-nccl-cu* package, or None.

    The package is a namespace package without __init__.py and ships only libnccl.so.2 (no unversioned
    .so), so it is located through importlib and linked by full path.
    """
    env_home = os.environ.get("NCCL_HOME")
    candidates = [env_home] if env_home else []
    spec = importlib.util.find_spec("nvidia")
    if spec is not None and spec.submodule_search_locations:
        candidates += [os.path.join(p, "nccl") for p in spec.submodule_search_locations]
    for home in candidates:
        header = os.path.join(home, "include", "nccl.h")
        libs = sorted(glob.glob(os.path.join(home, "lib", "libnccl.so*")))
        if os.path.exists(header) and libs:
            return os.path.join(home, "include"), libs[0]
    return None


if __name__ == "__main__":
    found = find_nccl()
    if found:
        print(";".join(found))
