"""Builds decent_comm with its CUDA kernels emulated on the CPU, and runs the kernel tests against that build.

    .venv/bin/python tests/cuda_emulation/run.py [pytest arguments]    (make test-cuda-emulation)

The build compiles csrc/cuda/*.cu with g++ against shim/ (the CUDA runtime and device API the kernels use, emulated:
emulated_runtime.cpp), and its CPU entry points run those kernels (emulated_entry.cpp). Every CPU case of the kernel
tests (float64 references, torch.optim, the int8 codec's bit-exact model, AMP's device scalars) then checks the CUDA
kernels' own code: their index math, vector widths and tails, the 8-bit wire's scales, the resolved device-scalar
path, the block reductions and barriers. No GPU, nvcc or CUDA headers are needed. What only a GPU shows is listed in
shim/cuda_runtime.h.

Options (environment): ASAN=1 adds AddressSanitizer (about 1.5x the time; clean as of this writing), COVERAGE=1 gcov
counters, DC_EMULATION_LAUNCH_LOG=<file> the symbol of every kernel instantiation launched.

The build goes to build/cuda_emulation (ninja: incremental). Its package, build/cuda_emulation/pkg/decent_comm, links
the checkout's Python files and holds the emulated _C; pytest runs from there, so `import decent_comm` finds it.
"""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
OUT = REPO / "build" / "cuda_emulation"

# The tests whose CPU cases run the emulated kernels. float64 has no CUDA kernel (the emulation refuses it, and
# op_inputs.DTYPES leaves it out).
TESTS = ["test_ops.py", "test_ops_amp.py", "test_ops_bad_input.py", "test_ops_fuzz.py", "test_int8_codec.py",
         "test_dequantizing_mix.py", "test_optim_local.py", "test_optim_amp.py", "test_int8_wire.py"]

# kernel<<<grid, block, shared, stream>>>(args);  ->  ::dc_emu::launch(kernel, grid, block, shared, stream, args);
LAUNCH = re.compile(r"([\w:]+(?:<[^<>;]*>)?)<<<([^;]*?)>>>\(([^;]*?)\);")
# __shared__ T name[N];  ->  the same, then ::dc_emu::poison_shared(name, sizeof(name));
SHARED = re.compile(r"(__shared__\s+[\w:]+\s+(\w+)\s*\[[^\]]*\]\s*;)")


def emulated_kernel_sources():
    """csrc/cuda's kernel files, launches rewritten as calls, under OUT/src/cuda (csrc/kernels linked beside)."""
    src = OUT / "src"
    (src / "cuda").mkdir(parents=True, exist_ok=True)
    kernels = src / "kernels"
    if kernels.is_symlink() and kernels.readlink() != REPO / "csrc" / "kernels":
        kernels.unlink()  # a build directory copied or moved from another checkout
    if not kernels.is_symlink():
        kernels.symlink_to(REPO / "csrc" / "kernels", target_is_directory=True)
    sources = []
    for path in sorted((REPO / "csrc" / "cuda").glob("*.cu*")):
        text, launches = LAUNCH.subn(r"::dc_emu::launch(\1, \2, \3);", path.read_text())
        text = SHARED.sub(r"\1 ::dc_emu::poison_shared(\2, sizeof(\2));", text)
        if "<<<" in text:
            raise SystemExit(f"{path}: a kernel launch this script cannot rewrite")
        target = src / "cuda" / (path.stem + ".cpp" if path.suffix == ".cu" else path.name)
        header = f"// Generated from csrc/cuda/{path.name} by tests/cuda_emulation/run.py ({launches} launches).\n"
        if path.suffix == ".cu":
            header += "#define __CUDA_ARCH__ 900  // the kernels' device branches (int8_codec_math.h)\n"
        if not target.exists() or target.read_text() != header + text:  # unchanged files keep ninja's work
            target.write_text(header + text)
        if path.suffix == ".cu":
            sources.append(target)
    return sources


def build():
    from torch.utils import cpp_extension

    sources = sorted(REPO.glob("csrc/*.cpp")) + sorted(REPO.glob("csrc/comm/*.cpp")) + [
        REPO / "csrc" / "cpu" / "cpu_isa.cpp", HERE / "emulated_entry.cpp", HERE / "emulated_runtime.cpp",
        HERE / "selftest_kernels.cpp", HERE / "selftest_ops.cpp",
    ] + emulated_kernel_sources()
    (OUT / "obj").mkdir(parents=True, exist_ok=True)
    # A misaligned vector load or store faults on a GPU ("misaligned address"); x86 would do it silently, so UBSan's
    # alignment check stops the process there. COVERAGE=1: gcov counters (read them with gcov in OUT/obj after a run);
    # ASAN=1: AddressSanitizer too (sanitizer_env).
    checks = ["-fsanitize=alignment", "-fno-sanitize-recover=alignment"]
    checks += ["--coverage"] if os.environ.get("COVERAGE") == "1" else []
    checks += ["-fsanitize=address"] if os.environ.get("ASAN") == "1" else []
    # Loading it here registers the ops in this process: the build runs in a process of its own.
    cpp_extension.load(
        name="_C", sources=[str(s) for s in sources], build_directory=str(OUT / "obj"),
        extra_include_paths=[str(HERE / "shim"), str(REPO / "csrc")],
        extra_cflags=["-std=c++20", "-O2", "-g0", "-fno-math-errno", "-ffp-contract=off", "-fno-trapping-math",
                      "-fopenmp", "-Wall", "-Wno-unknown-pragmas", *checks],
        extra_ldflags=["-fopenmp", *checks], verbose=os.environ.get("VERBOSE") == "1")
    package = OUT / "pkg" / "decent_comm"
    if package.exists():
        shutil.rmtree(package)
    package.mkdir(parents=True)
    for entry in (REPO / "decent_comm").iterdir():
        if not entry.name.startswith("_C") and entry.name != "__pycache__":
            (package / entry.name).symlink_to(entry, target_is_directory=entry.is_dir())
    shutil.copy2(OUT / "obj" / "_C.so", package / "_C.so")


def sanitizer_env():
    """ASAN=1: the build is instrumented by AddressSanitizer (an access outside a tensor's memory, which a GPU may make
    silently, stops the process), whose runtime must be loaded before python's own libraries, libstdc++ with it."""
    if os.environ.get("ASAN") != "1":
        return {}
    libs = [subprocess.run(["g++", f"-print-file-name={lib}"], capture_output=True, text=True,
                           check=True).stdout.strip() for lib in ["libasan.so", "libstdc++.so.6"]]
    return {"LD_PRELOAD": " ".join(libs), "ASAN_OPTIONS": f"detect_leaks=0:log_path={OUT / 'sanitizer'}"}


def main(pytest_args):
    if os.environ.get("DC_EMULATION_CHILD") == "1":
        build()
        return 0
    sanitizers = sanitizer_env()
    subprocess.run([sys.executable, __file__], env={**os.environ, "DC_EMULATION_CHILD": "1", **sanitizers}, check=True)
    package = OUT / "pkg"
    env = {**os.environ, "PYTHONPATH": f"{package}{os.pathsep}{HERE}", "DECENT_COMM_TEST_CUDA_EMULATION": "1",
           "DC_EMULATED_PACKAGE": str(package / "decent_comm"), "DECENT_COMM_CUDA": "0",
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **sanitizers}
    tests = [str(HERE / "test_emulated_runtime.py")] + [str(REPO / "tests" / t) for t in TESTS]
    args = pytest_args or ["-q", "-p", "no:cacheprovider"]
    # pyproject.toml's pythonpath puts the checkout first; here the emulated package comes first, and the guard
    # plugin checks that it is the one imported.
    args = ["-o", f"pythonpath={package} {REPO / 'tests'}", "-p", "emulation_guard", *args]
    # pytest captures stderr, where a sanitizer would report the access that stopped the process: it goes to a file.
    for old in OUT.glob("sanitizer.*"):
        old.unlink()
    env["UBSAN_OPTIONS"] = f"print_stacktrace=1:log_path={OUT / 'sanitizer'}"
    code = subprocess.run([sys.executable, "-m", "pytest", *args, *tests], env=env, cwd=package).returncode
    for report in OUT.glob("sanitizer.*"):
        print(f"\n{report}:\n{report.read_text()}", file=sys.stderr)
        code = code or 1
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
