"""The extension's link flags (build_tools/flags.py LINK_FLAGS) keep a statically linked C++ runtime private.

On the GPU machine the compiler (/opt/gcc) put libstdc++ code inside _C.so, and the first C++ error message that
formatted an integer segfaulted (Exchanger.exchange refusing a peer outside the world): torch had loaded
libstdc++.so process-wide first, and it took over part of the exported static copy. Here the same mix loses the
integer and the rest of the message. This links a small library that formats an integer the way c10::str does,
with -static-libstdc++ and the build's flags, and calls it in a process that imported torch first.
"""
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from build_tools import flags

SOURCE = textwrap.dedent("""
    #include <sstream>
    #include <string>
    static std::string last;
    extern "C" const char* format_bucket(long bucket) {
      std::ostringstream os;
      os << "Exchanger.exchange(bucket=" << bucket << "): refused";
      last = os.str();
      return last.c_str();
    }
""")

CALL = textwrap.dedent("""
    import ctypes, sys
    import torch  # first, as in any process that imports decent_comm: its libstdc++.so is loaded process-wide
    lib = ctypes.CDLL(sys.argv[1])
    lib.format_bucket.restype = ctypes.c_char_p
    print(lib.format_bucket(7).decode())
""")


def _link(tmp_path, link_flags):
    cxx = os.environ.get("CXX", "c++")  # the compiler torch.utils.cpp_extension builds the extension with
    if shutil.which(cxx) is None:
        pytest.skip(f"no C++ compiler {cxx!r}")
    src, lib = tmp_path / "fmt.cpp", tmp_path / f"fmt{len(list(tmp_path.iterdir()))}.so"
    src.write_text(SOURCE)
    cmd = [cxx, "-O2", "-fPIC", "-shared", "-static-libstdc++", str(src), "-o", str(lib), *link_flags]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0 and "lstdc++" in proc.stderr:
        pytest.skip(f"{cxx} cannot link libstdc++ statically here (no libstdc++.a): {proc.stderr[-300:]}")
    assert proc.returncode == 0, proc.stderr
    return lib


def _format_in_a_torch_process(lib):
    proc = subprocess.run([sys.executable, "-c", CALL, str(lib)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])  # -11 on the GPU machine
    return proc.stdout.strip()


def test_a_static_cpp_runtime_linked_with_the_build_flags_formats_integers(tmp_path):
    assert _format_in_a_torch_process(_link(tmp_path, flags.LINK_FLAGS)) == "Exchanger.exchange(bucket=7): refused"


def test_the_mix_the_flags_prevent_is_real_here(tmp_path):
    """Without --exclude-libs the same library loses the integer here: the check above is not vacuous."""
    out = _format_in_a_torch_process(_link(tmp_path, [f for f in flags.LINK_FLAGS if "exclude-libs" not in f]))
    if out == "Exchanger.exchange(bucket=7): refused":
        pytest.skip("this torch's libstdc++ does not take over a static copy (nothing to show here)")
    assert "bucket=7" not in out, out
