"""How the training scripts read the environment a launcher leaves (decent_train/distributed.py): WORLD_SIZE=1 alone
is one process, as docs/api.md says to set it; a larger WORLD_SIZE without torchrun's other variables is one line
and exit code 2 (it reached torch's env:// rendezvous: a traceback naming RANK); a LOCAL_WORLD_SIZE inherited
without a job is not this process's own (the library ignores it too); and Python warnings are log lines, which
rank 0's progress bar is kept clear of (written by the warnings module, they landed on the bar's line)."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--layers", "1", "--d-model", "32", "--heads", "2", "--seq-len", "16", "--batch-size", "4", "--corpus-mb", "0.2",
        "--eval-tokens", "1024", "--no-progress", "--steps", "2", "--eval-every", "2"]
LAUNCHER = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_WORLD_SIZE",
            "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS")


def run(env_vars, tmp_path, argv=TINY):
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER}
    env.update(OMP_NUM_THREADS="1", **env_vars)
    cmd = [sys.executable, os.path.join(ROOT, "examples", "train_lm.py"), *argv, "--out", str(tmp_path / "out")]
    return subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("env_vars", [{"WORLD_SIZE": "1"}, {"LOCAL_WORLD_SIZE": "2"},
                                      {"WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "2"}])
def test_one_process_with_a_launchers_variable_left_in_the_shell(env_vars, tmp_path):
    proc = run(env_vars, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("env_vars, missing", [({"WORLD_SIZE": "2"}, "RANK, MASTER_ADDR, MASTER_PORT are"),
                                               ({"WORLD_SIZE": "4", "RANK": "0", "MASTER_ADDR": "127.0.0.1"},
                                                "MASTER_PORT is")])
def test_several_processes_without_torchrun_is_one_line(env_vars, missing, tmp_path):
    proc = run(env_vars, tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert f"WORLD_SIZE={env_vars['WORLD_SIZE']} but {missing} not set: launch the job with torchrun" in lines[0], lines


def test_python_warnings_are_log_lines_tagged_with_the_rank():
    code = ("import warnings\nfrom decent_train.distributed import setup_logging\nsetup_logging(1)\n"
            "warnings.warn('decent_comm: the warning')\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0, proc.stderr
    line, = [ln for ln in proc.stderr.splitlines() if "the warning" in ln]
    assert "[rank 1] WARNING py.warnings:" in line, proc.stderr
