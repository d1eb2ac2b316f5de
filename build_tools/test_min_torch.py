"""Runs the tests most sensitive to torch's internals against the oldest torch the project supports (pyproject:
torch>=2.11, the GPU machine's), in a venv of its own, with the extension built against that torch.

    python build_tools/test_min_torch.py [--torch 2.11.0] [--jobs 2] [test files...]

Why: the suite runs against the newest torch only (Makefile TORCH_SPEC), and code that traced under its Dynamo failed
under 2.11's (a setattr on the optimizer in a compiled step(); an assume_constant_result call taking an object), with
nothing here to say so; check_torch_headers compiles against 2.11's headers but runs no Python.

Nothing of the checkout's own build is touched: the venv (torch==VERSION and requirements-dev.txt) lives in
build/min-torch/VERSION/venv, and the sources are copied to build/min-torch/VERSION/src, where the extension is built
in place (ninja keeps the objects there, so a rerun rebuilds what changed) and the tests run; the checkout's
decent_comm/_C*.so stays the main venv's. Before the tests, the venv's python must import torch VERSION and the copy's
decent_comm (an import of the checkout's, or of another torch, is refused). The torch wheel is fetched through
check_torch_headers.fetch_wheel and kept in build/torch-wheels, which `make check-torch-headers` also reads: one
download for both.
"""

import argparse
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from build_tools.check_torch_headers import fetch_wheel  # noqa: E402

# compile/Dynamo (a compiled step, ATC's hooks traced into a compiled forward), torch.optim's conventions and hooks,
# ATC's module hooks, the updates against torch's own optimizers, DCP, AMP (GradScaler's step protocol), modules made
# or replaced while training, DDP's construction hooks, warnings attributed past torch's frames (and a step retried
# under GradScaler), the custom ops' opcheck and the build-time torch recorded by the extension.
DEFAULT_TESTS = ["tests/test_compiled_step.py", "tests/test_atc_compile.py", "tests/test_optim_module_changes.py",
                 "tests/test_optim_torch_conventions.py", "tests/test_atc.py", "tests/test_optim_local.py",
                 "tests/test_optim_dcp_migration.py", "tests/test_optim_amp.py", "tests/test_optim_ddp.py",
                 "tests/test_collected_during_hooks.py", "tests/test_user_warnings.py", "tests/test_ops.py",
                 "tests/test_build_info.py"]

# What is not copied: the checkout's own build (its .so is the main torch's), venvs, caches, git.
_NOT_COPIED = shutil.ignore_patterns(".git", ".venv*", "build", "*.so", "__pycache__", ".pytest_cache",
                                     ".hypothesis", "runs", "*.egg-info")


def _run(cmd, **kwargs):
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, **kwargs)


def make_venv(where: str, version: str) -> str:
    """The venv's python, torch==`version` and the test dependencies installed once (a stamp names what is)."""
    venv = os.path.join(where, "venv")
    python = os.path.join(venv, "bin", "python")
    with open(os.path.join(ROOT, "requirements-dev.txt")) as f:
        wanted = f"torch=={version}\n{f.read()}"
    stamp = os.path.join(venv, ".decent_comm-min-torch")
    if os.path.exists(stamp) and open(stamp).read() == wanted:
        return python
    if not os.path.exists(python):
        _run([sys.executable, "-m", "venv", venv])
    wheel = fetch_wheel(version)  # (kept in check_torch_headers.WHEELS, which that check reads too)
    # PIP_CONSTRAINT is cleared: it caps the main venv's torch (and pins what that torch needs), and this venv holds
    # another torch by design; a cap would refuse the install.
    _run([python, "-m", "pip", "install", "-q", wheel, "-r", os.path.join(ROOT, "requirements-dev.txt")],
         env={**os.environ, "PIP_CONSTRAINT": ""})
    with open(stamp, "w") as f:
        f.write(wanted)
    return python


def copy_sources(src: str) -> None:
    """The checkout's sources into `src`, replacing what an earlier run copied (a file deleted here must not linger
    there), except ninja's objects (src/build) and the extension built there: the build relinks, and recompiles what
    is newer than its object (copy2 keeps the files' times)."""
    if os.path.isdir(src):
        for dirpath, dirnames, filenames in os.walk(src):
            if dirpath == src and "build" in dirnames:
                dirnames.remove("build")
            for name in filenames:
                if not (name.startswith("_C") and name.endswith(".so")):
                    os.remove(os.path.join(dirpath, name))
    shutil.copytree(ROOT, src, ignore=_NOT_COPIED, dirs_exist_ok=True)


def check_imports(python: str, src: str, version: str) -> None:
    """Refuses to test anything but this torch and the copy's build: a venv that picked up another torch, or a
    decent_comm imported from the checkout (whose .so is the main torch's), would pass for the wrong reason."""
    probe = ("import torch, decent_comm, decent_comm._C as c; "
             "print(torch.__version__); print(decent_comm.__file__); print(c.__file__)")
    run = subprocess.run([python, "-c", probe], cwd=src, env=_test_env(src), capture_output=True, text=True)
    if run.returncode != 0:  # the reason (an ImportError of the extension built here) is the child's stderr
        sys.exit(f"test_min_torch: the venv's python cannot import torch and the copy's decent_comm:\n{run.stderr}")
    out = run.stdout.split()
    torch_version, package, extension = out[-3:]
    print(f"test_min_torch: torch {torch_version}, decent_comm from {package}, extension {extension}", flush=True)
    if torch_version.split("+")[0] != version:
        sys.exit(f"test_min_torch: the venv imports torch {torch_version}, not {version}")
    for path in (package, extension):
        if not os.path.realpath(path).startswith(os.path.realpath(src) + os.sep):
            sys.exit(f"test_min_torch: decent_comm is imported from {path}, not from the copy built here ({src})")


def _test_env(src: str) -> dict:
    # The CPU kernels only (the point is torch's Python side; CI compiles the CUDA glue against these headers in
    # check-torch-headers), one OpenMP thread per rank as `make test`.
    env = {**os.environ, "PYTHONPATH": src, "DECENT_COMM_CUDA": "0", "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONHOME", None)
    return env


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--torch", default="2.11.0", help="the torch release to test against")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="parallel compile jobs (MAX_JOBS)")
    ap.add_argument("--pytest-args", default="", help="more pytest arguments, space-separated")
    ap.add_argument("tests", nargs="*", default=DEFAULT_TESTS)
    args = ap.parse_args()
    where = os.path.join(ROOT, "build", "min-torch", args.torch)
    src = os.path.join(where, "src")
    started = time.monotonic()
    python = make_venv(where, args.torch)
    installed = time.monotonic()
    copy_sources(src)
    # --force: setuptools skips a build whose .so is newer than the .cpp files, blind to the headers; ninja's own
    # dependency files then recompile exactly what changed
    _run([python, "setup.py", "-q", "build_ext", "--inplace", "--force"], cwd=src,
         env={**_test_env(src), "MAX_JOBS": str(args.jobs)})
    built = time.monotonic()
    check_imports(python, src, args.torch)
    rc = subprocess.run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args.tests,
                         *args.pytest_args.split()], cwd=src, env=_test_env(src)).returncode
    done = time.monotonic()
    print(f"test_min_torch: torch {args.torch}: venv {installed - started:.0f} s, build {built - installed:.0f} s, "
          f"tests {done - built:.0f} s ({'passed' if rc == 0 else 'FAILED'})", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
