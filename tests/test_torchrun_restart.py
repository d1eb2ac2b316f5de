"""docs/restarts.md's recipe for `torchrun --max-restarts`: a rank killed mid-run, torchrun restarts both ranks,
they resume from their checkpoints and end with the parameters of an uninterrupted run, bit for bit (the state dict
holds the flat moments, the counts and the schedule's position; the CPU kernels repeat the same operations), also
when the rank is killed between rank 0's save and the step's commit. And the training harness (examples/train_lm.py)
under the same restart."""
import os
import signal
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "restart_script.py")
HARNESS = os.path.join(ROOT, "tests", "harness_restart_script.py")
LM_TINY = ["--layers", "1", "--d-model", "32", "--heads", "2", "--seq-len", "16", "--batch-size", "4",
           "--corpus-mb", "0.3", "--eval-tokens", "1024", "--no-progress"]


def _torchrun(script, args=(), **env_vars):
    """torchrun --max-restarts 1 of `script` on 2 ranks; returns its stdout + stderr, after asserting exit code 0."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "--max-restarts", "1", "--monitor-interval", "0.1", script, *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
           "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), **env_vars}
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
    return stdout + stderr


def _run(out, **kill):
    os.makedirs(out)
    said = _torchrun(SCRIPT, OUT=str(out), **{k: str(v) for k, v in kill.items()})
    return [torch.load(os.path.join(out, f"rank{r}.pt")) for r in range(2)], said


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("restart") / "plain")[0]


def _assert_same(plain, restarted):
    for rank in range(2):
        for p, q in zip(plain[rank], restarted[rank]):
            assert torch.equal(p, q), (rank, (p - q).abs().max())


def test_a_run_restarted_after_a_killed_rank_ends_as_an_uninterrupted_one(tmp_path, uninterrupted):
    restarted, said = _run(tmp_path / "killed", KILL_AT=6)
    for rank in range(2):
        assert f"attempt 1 rank {rank}: starts at step 4" in said, said
    _assert_same(uninterrupted, restarted)


def test_a_rank_killed_between_its_peers_save_and_the_commit_resumes_the_previous_commit(tmp_path, uninterrupted):
    """Rank 1 killed in the step-8 save, after rank 0 wrote its file: the recipe overwrote one file per rank, so rank
    0 resumed at step 8 and rank 1 at step 4; the optimizer's step agreement refused that on both ranks, and every
    restart loaded the same files again (the job could never recover). With step directories and rank 0's commit
    after a barrier, step 8 was never committed: both ranks resume at step 4 and end as the uninterrupted run."""
    restarted, said = _run(tmp_path / "killed", KILL_IN_SAVE=8)
    assert "rank 1 killed in the save of step 8" in said, said
    for rank in range(2):
        assert f"attempt 1 rank {rank}: starts at step 4" in said, said
    _assert_same(uninterrupted, restarted)


def _final_models(ck):
    return [torch.load(os.path.join(ck, "step_0000008", f"rank{r}.pt"))["model"] for r in range(2)]


def test_the_harness_comes_back_after_a_restart_and_goes_on_from_its_last_commit(tmp_path):
    """examples/train_lm.py under torchrun --max-restarts 1, rank 1 killed after the step-4 checkpoint and late to
    join the restarted attempt (3 s): the restart's process group used to fail in gloo's connectFullMesh, rank 0
    having read rank 1's address of attempt 0 (the harness's plain init_process_group; 3 of 4 restarts by chance,
    this one always). One command line serves both attempts: `--resume auto` starts afresh in attempt 0 (`--resume
    DIR` refused a DIR not there yet) and goes on from step 4 in attempt 1 (without it, the restart began again at
    step 0 and rewrote the step directories). The job ends as an uninterrupted run does, bit for bit."""
    flags = ["--steps", "8", "--checkpoint-every", "2", "--eval-every", "4", "--resume", "auto", *LM_TINY]
    plain, ck = str(tmp_path / "plain"), str(tmp_path / "ck")
    said = _torchrun(HARNESS, [*flags, "--checkpoint", plain])
    assert f"--resume auto: no committed checkpoint in {plain}" in said and "resumed from" not in said, said
    said = _torchrun(HARNESS, [*flags, "--checkpoint", ck], KILL_AFTER="4", LATE_S="3")
    assert "rank 1 killed after the commit of step 4" in said and "attempt 1 rank 1: started" in said, said
    assert said.count(f"--resume auto: no committed checkpoint in {ck}") == 1, said  # attempt 0 only
    assert f"--resume auto: resuming from {ck}/step_0000004" in said, said
    assert f"resumed from {ck}/step_0000004 at step 4" in said, said
    for step in (2, 4, 6, 8):  # none written again by the restarted attempt
        assert said.count(f"checkpoint written: {ck}/step_{step:07d}\n") == 1, (step, said)
    for rank, (p, q) in enumerate(zip(_final_models(plain), _final_models(ck))):
        assert p.keys() == q.keys() and all(torch.equal(p[k], q[k]) for k in p), rank
