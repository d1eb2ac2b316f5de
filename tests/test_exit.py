"""A torchrun job whose script never calls opt.shutdown() nor dist.destroy_process_group() exits 0 on every
rank with nothing on stderr from C++ (issue #14.1): decent_comm drains and closes the exchanger when the
optimizer is collected (variant none: it dies when main() returns) or at interpreter exit (variant global: a
module global keeps it alive until then). bench/exit_stress.py runs the same script many times.

A script that does call opt.shutdown() and then dist.destroy_process_group() gets the process group really
destroyed, with the optimizer still referenced: gloo's threads are joined then, not left to the interpreter's
finalization (where one releasing the last all-reduce's Python tensors aborts the process)."""

import gc
import os
import re
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

import decent_comm

from dist_utils import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "bench", "exit_user_script.py")
# c10's TORCH_WARN / LOG(WARNING) prefix, e.g. "[rank0]:[W1126 13:44:58.367696914 exchanger.cpp:47]"
CPP_WARNING = re.compile(r"\[W\d{4} [\d:.]+ [\w./-]+:\d+\]")


@pytest.mark.parametrize("variant", ["none", "global", "interactive"])
def test_job_without_shutdown_exits_cleanly(variant):
    """interactive: `python -i`, whose REPL then reads the end of its input and exits; an error shown earlier left
    sys.last_value set, taken for a script dying of it: no drain, and a C++ warning per rank."""
    launch = ["--no-python", sys.executable, "-i", SCRIPT] if variant == "interactive" else [SCRIPT]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *launch, variant]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
           "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          stdin=subprocess.DEVNULL)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"torchrun exited {proc.returncode}:\n{out[-6000:]}"
    for rank in (0, 1):
        assert f"rank {rank} done ({variant})" in proc.stdout, out[-6000:]
    assert "terminate called" not in out, out[-6000:]
    assert not CPP_WARNING.search(out), f"a C++ warning on stderr:\n{out[-6000:]}"
    assert "Exchanger destroyed" not in out, out[-6000:]


def _threads():
    """This process's threads by name (/proc: gloo's workers are native threads Python does not list)."""
    names = []
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/comm") as f:
            names.append(f.read().strip())
    return names


def _shutdown_then_destroy(rank, n, options):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = decent_comm.DAdamW(model.parameters(), lr=1e-2, timeout=30, **options)
    for _ in range(4):
        opt.zero_grad()
        model(torch.randn(4, 8)).square().mean().backward()
        opt.step()
    opt.consensus_distance()  # a collective utility: the optimizer's whole-group all-reduce
    with_group = len(_threads())
    opt.shutdown()
    dist.destroy_process_group()
    gc.collect()
    after = _threads()
    try:
        opt.consensus_distance()
        late = "no error"
    except RuntimeError as e:
        late = str(e)
    return with_group, after, late, opt.state_dict()["state"] != {}  # opt is still alive here


@pytest.mark.parametrize("options", [
    {},
    {"topology": "ring", "mode": "atc"},
    {"warmup_steps": 2, "gossip_every": 2},
    {"topology": "adaptive:consensus:one-peer-exp,complete"},
    {"topology": "complete"},  # 3 ranks: one group all-reduce per step, on groups of its own
    {"topology": "ring", "comm_dtype": torch.int8},
], ids=["default", "atc", "warmup", "adaptive", "group-allreduce", "int8"])
def test_shutdown_lets_destroy_process_group_join_gloo_threads(options):
    """Held past shutdown() (as the warm-up's and the utilities' all-reduce held the default group), the group
    outlives destroy_process_group() and gloo's threads live into finalization: 1 in 10 runs of
    examples/train_lm.py then aborted at exit with "terminate called without an active exception"."""
    for with_group, after, late, alive in run_ranks(_shutdown_then_destroy, 3, options):
        assert with_group > 1 and alive
        assert after == [after[0]], f"threads left after destroy_process_group(): {after} (before: {with_group})"
        assert "shut down" in late, late


def _utilities_then_steps(rank, n):
    from decent_comm.exchange.bounded import HOLD_S
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])
    opt = decent_comm.DAdamW(model.parameters(), topology="ring", bucket_cap_mb=1e-6, timeout=20)  # 8 buckets
    for t in range(6):
        model(torch.ones(2, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
        if t == 1:
            opt.average_parameters()
            opt.replica_variance()  # a float64 copy of the model, all-reduced
            opt.consensus_distance()
            time.sleep(HOLD_S)
    kept = len(opt._schedule.all_reduce._held)
    start = time.monotonic()
    opt.shutdown()
    return kept, time.monotonic() - start


def test_all_reduce_tensors_are_kept_briefly_and_shutdown_waits_at_most_that_long():
    """The whole-group all-reduces keep their tensors for HOLD_S after they finish (gloo's worker may still hold
    them; see exchange/bounded.py). Kept by reference count, shutdown() waited 1 s per kept tensor that the
    exchanger also held (4 s with 4 buckets), and replica_variance's float64 copy stayed alive until 8 more
    all-reduces came."""
    for kept, seconds in run_ranks(_utilities_then_steps, 2, timeout=120):
        assert kept == 0 and seconds < 1.0, (kept, seconds)
