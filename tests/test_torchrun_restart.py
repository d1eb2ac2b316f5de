"""docs/reliability.md's recipe for `torchrun --max-restarts`: a rank killed mid-run, torchrun restarts both ranks,
they resume from their checkpoints and end with the parameters of an uninterrupted run, bit for bit (the state dict
holds the flat moments, the counts and the schedule's position; the CPU kernels repeat the same operations)."""
import os
import signal
import subprocess
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "restart_script.py")


def _run(out, kill_at):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "--max-restarts", "1", "--monitor-interval", "0.1", SCRIPT]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OUT": str(out), "KILL_AT": str(kill_at),
           "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
           "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    # A session of its own: on a timeout the workers are killed with the agent (killing the agent alone left them)
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        raise AssertionError("torchrun did not finish within 300 s:\n" + (stdout + stderr)[-6000:])
    assert proc.returncode == 0, (stdout + stderr)[-6000:]
    return [torch.load(os.path.join(out, f"rank{r}.pt")) for r in range(2)], stdout


def test_a_run_restarted_after_a_killed_rank_ends_as_an_uninterrupted_one(tmp_path):
    (tmp_path / "plain").mkdir()
    (tmp_path / "killed").mkdir()
    plain, _ = _run(tmp_path / "plain", -1)
    restarted, stdout = _run(tmp_path / "killed", 6)
    for rank in range(2):
        assert f"attempt 1 rank {rank}: starts at step 4" in stdout, stdout
        for p, q in zip(plain[rank], restarted[rank]):
            assert torch.equal(p, q), (rank, (p - q).abs().max())
