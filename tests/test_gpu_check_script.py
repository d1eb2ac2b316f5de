"""bench/gpu_check.sh's `bounded` helper, run as the script defines it, on the CPU: a pytest step cut at its bound
keeps the results of the tests it finished (it got SIGTERM before, on which pytest writes no JUnit XML, so
bench/gpu_check_summary.py lost the step's every result), and the summary fails the verdict for the cut step
instead of passing on the tests that ran. The whole script needs a GPU (or DRY_RUN=1, which rebuilds the
extension in place); its header states the run call's timeout it needs."""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "bench", "gpu_check.sh")
SUMMARY = os.path.join(ROOT, "bench", "gpu_check_summary.py")

SLEEPY = """
import time

def test_fast_one():
    pass

def test_fast_two():
    pass

def test_sleeps_past_the_bound():
    time.sleep(120)

def test_never_reached():
    pass
"""


def _script():
    with open(SCRIPT, encoding="utf-8") as f:
        return f.read()


def _bounded_function() -> str:
    """The text of `bounded() { ... }` in the script."""
    match = re.search(r"^bounded\(\) \{\n.*?^\}\n", _script(), re.S | re.M)
    assert match, "bounded() not found in bench/gpu_check.sh"
    return match.group(0)


def _bounded_pytest(tmp_path, budget_s):
    """Runs a pytest of SLEEPY under `bounded budget_s`, as the script runs its test steps; returns (rc, output)."""
    (tmp_path / "test_sleepy.py").write_text(SLEEPY)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # not the repository's configuration
    xml = tmp_path / "steps.xml"
    command = (f"W={tmp_path}; DEADLINE=600; SUMMARY_RESERVE=0; SECONDS=0\n{_bounded_function()}\n"
               f"bounded {budget_s} {sys.executable} -m pytest -q -p no:cacheprovider -c {tmp_path}/pytest.ini "
               f"{tmp_path}/test_sleepy.py --junitxml {xml}")
    done = subprocess.run(["bash", "-c", command], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    return done.returncode, done.stdout + done.stderr, xml


def test_a_pytest_step_cut_at_its_bound_keeps_its_finished_tests_and_fails_the_verdict(tmp_path):
    rc, output, xml = _bounded_pytest(tmp_path, budget_s=10)  # pytest starts in 1-3 s on this loaded machine
    assert rc == 124, (rc, output)
    assert "gpu_check: timed out" in output, output
    assert xml.exists(), f"no JUnit XML from the cut step:\n{output}"
    text = xml.read_text()
    assert 'name="test_fast_one"' in text and 'name="test_fast_two"' in text, text
    assert (tmp_path / "gpu_check_cut.txt").read_text().split() == [str(xml)]
    summary = subprocess.run([sys.executable, SUMMARY, "--junit", str(xml), "--cut",
                              str(tmp_path / "gpu_check_cut.txt")], capture_output=True, text=True, timeout=60)
    assert summary.returncode == 1, summary.stdout + summary.stderr
    assert f"stopped by its time limit: {xml}" in summary.stdout, summary.stdout
    # the two finished tests; the one SIGINT stopped (pytest records it without a name) is not taken for a pass
    assert "tests: 2 passed, 1 failed, 0 skipped" in summary.stdout, summary.stdout
    assert "gpu_check: FAIL" in summary.stdout
    # the same XML without the cut listed (no --cut file) would pass: the cut is what fails it
    alone = subprocess.run([sys.executable, SUMMARY, "--junit", str(xml), "--cut", str(tmp_path / "absent.txt")],
                           capture_output=True, text=True, timeout=60)
    assert alone.returncode == 0 and "tests: 2 passed, 0 failed" in alone.stdout, alone.stdout


def test_the_header_asks_for_a_run_timeout_covering_the_kill_grace():
    script = _script()
    grace = int(re.search(r"timeout -s INT -k (\d+) ", _bounded_function()).group(1))
    slack = int(re.search(r"timeout_s must be at least GPU_CHECK_SECONDS \+ (\d+) s", script).group(1))
    default = int(re.search(r'DEADLINE="\$\{GPU_CHECK_SECONDS:-(\d+)\}"', script).group(1))
    assert slack >= grace + 15, (slack, grace)  # the kill grace, python start-ups and the archive
    assert f"({default + slack} by default)" in script
    assert default + slack <= 600  # the device tool's limit for one command
