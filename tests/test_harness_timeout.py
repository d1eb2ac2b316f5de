"""--timeout bounds how long the examples' ranks wait for a peer that stopped (decent_train/flags.py,
distributed.py, strategy.py). Without it every rank of a 2 x 2 job whose node 1 lost its link waited gloo's
30-minute default (87 s without a word, review DB). Two ranks are started as torchrun starts them (its
environment, without torchrun, whose own ending would be timed too); rank 1 freezes itself with SIGSTOP before
step STOP_AT (a hung process or a dead link: its connections stay open, so nothing but a timeout can tell), and
rank 0 must exit with a timeout error within --timeout + SLACK_S of the freeze."""
import os
import re
import socket
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--layers", "1", "--d-model", "32", "--heads", "2", "--seq-len", "16", "--batch-size", "4", "--corpus-mb", "0.2",
        "--eval-tokens", "1024", "--no-progress"]
TIMEOUT_S = 5
# decent_comm's own bound is timeout + 5 s (docs/reliability.md); a few more for this shared 2-core machine
SLACK_S = 10
# How long the test waits before calling it a hang: far below gloo's 30 minutes, well above TIMEOUT_S + SLACK_S
HANG_S = 60
STOP_AT = 20  # not an evaluation step (--eval-every 1000): the freeze meets rank 0 inside a training step

# examples/train_lm.py's main, with rank 1 stopping itself (SIGSTOP) before its STOP_AT-th training step
CHILD = """
import os, signal, sys
from decent_train import loop
from decent_train.workloads import lm
if os.environ["RANK"] == "1":
    step, calls = loop.train_step, [0]
    def stop_before_step(*args, **kwargs):
        calls[0] += 1
        if calls[0] == int(os.environ["STOP_AT"]):
            print("rank 1 stops", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)
        return step(*args, **kwargs)
    loop.train_step = stop_before_step
lm.main(sys.argv[1:])
"""


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stopped(pid):
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


@pytest.mark.parametrize("optimizer, says", [
    # decent_comm names the peer it waited for
    ("dadamw", [r"ExchangeTimeout: .*timed out after %d ms waiting for [^(]*\brank 1\b" % (TIMEOUT_S * 1000)]),
    # DDP's all-reduce: gloo's error, which names no rank
    ("allreduce", [r"Timed out waiting %dms for (recv|send) operation" % (TIMEOUT_S * 1000)]),
])
def test_a_frozen_peer_ends_the_live_rank_within_the_timeout(tmp_path, optimizer, says):
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "DECENT_COMM_CUDA": "0", "WORLD_SIZE": "2",
           "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
           "STOP_AT": str(STOP_AT)}
    argv = [*TINY, "--optimizer", optimizer, "--steps", "1000000", "--eval-every", "1000", "--device", "cpu",
            "--timeout", str(TIMEOUT_S)]
    procs, logs = [], []
    for rank in range(2):
        logs.append(open(tmp_path / f"rank{rank}.log", "w+"))
        procs.append(subprocess.Popen([sys.executable, "-c", CHILD, *argv], cwd=tmp_path, stdout=logs[-1],
                                      stderr=subprocess.STDOUT, env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}))
    read = lambda rank: (tmp_path / f"rank{rank}.log").read_text()  # noqa: E731
    try:
        deadline = time.monotonic() + 120
        while not _stopped(procs[1].pid):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), \
                f"rank 1 did not reach step {STOP_AT}:\n{read(0)[-3000:]}\n{read(1)[-3000:]}"
            time.sleep(0.05)
        frozen = time.monotonic()
        try:
            code = procs[0].wait(timeout=HANG_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"rank 0 still waits {HANG_S} s after rank 1 froze (--timeout {TIMEOUT_S}):\n{read(0)[-3000:]}")
        waited = time.monotonic() - frozen
    finally:
        for p in procs:
            p.kill()  # SIGKILL ends a stopped process too
            p.wait()
        for f in logs:
            f.close()
    out = read(0)
    assert "rank 1 stops" in read(1)
    assert code != 0, out[-3000:]
    # it waited the timeout (rank 0 may have begun waiting just before the freeze was seen), and not much longer
    assert TIMEOUT_S - 1 <= waited <= TIMEOUT_S + SLACK_S, (waited, out[-3000:])
    for pattern in says:
        assert re.search(pattern, out), (pattern, out[-3000:])
