"""A rank that os.fork()s while its optimizer lives (the copy-on-write asynchronous checkpoint): the child's use of the
optimizer raises RuntimeError at once instead of waiting forever on the parent's gloo threads, its exit (the optimizer
collected, the atexit hooks, os._exit) neither drains nor closes the parent's exchangers, and the parent trains on to
exactly the parameters of a run that never forked (decent_comm.optim.fork_guard, decent_comm.exchange._closing).

The old code hung in the child (the pending ATC mix, state_dict(), synchronize()) and in its exit drain, and the
child's drain took gloo's loop down in the parent (SIGABRT): each rank here kills a child still running after CHILD_S.
"""
import atexit
import gc
import json
import os
import signal
import time

import pytest
import torch
import torch.nn as nn

import decent_comm
from dist_utils import run_ranks

CHILD_S = 20.0  # a child that has not exited by then hung (the old code waited forever)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))


def _train(m, opt, steps, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 2, generator=g)
        nn.functional.mse_loss(m(x), y).backward()
        opt.step()
        opt.zero_grad()


def _attempt(fn):
    """'ok' or the error's type and message."""
    try:
        fn()
        return "ok"
    except Exception as e:  # noqa: BLE001 - reported to the parent
        return f"{type(e).__name__}: {e}"


def _global_average(opt):
    with opt.global_average():
        pass


def _in_child(m, opt, synced, exit_how, write_fd, solo):
    """Everything the child tries (each entry point twice: every call raises), then its exit."""
    snapshot = [p.detach().clone() for p in m.parameters()]
    x = torch.randn(4, 8)
    out = {}

    def model_state():  # read-only: the parameters as they were at the fork
        sd = m.state_dict()
        assert all(torch.equal(a, b) for a, b in zip(sd.values(), snapshot))

    def evaluate():
        with torch.no_grad():
            m.eval()(x)
        m.train()

    calls = {"model.state_dict": model_state, "eval_forward": evaluate, "opt.state_dict": opt.state_dict,
             "step": opt.step, "synchronize": opt.synchronize, "global_average": lambda: _global_average(opt),
             "average_parameters": opt.average_parameters, "shutdown": opt.shutdown,
             # a new optimizer over the parameters on a one-rank group: the pending mix is the parent's (handover.py)
             "new_optimizer": lambda: decent_comm.DSGD(m.parameters(), lr=0.1, process_group=solo)}
    for name, fn in calls.items():
        out[name] = [_attempt(fn), _attempt(fn)]
    os.write(write_fd, json.dumps(out).encode())
    os.close(write_fd)
    if exit_how == "os_exit":
        os._exit(0)
    # What ending the child's interpreter does (a SystemExit here would unwind into the test harness's rank frame):
    # the optimizer collected (its finalizer shut the schedule down), then the atexit hooks (the exchangers' drain).
    del opt, calls
    gc.collect()
    atexit._run_exitfuncs()
    os._exit(0)


def _rank(rank, world, mode, fork, synced, exit_how):
    solo = [torch.distributed.new_group([r]) for r in range(world)][rank]
    m = _model()
    opt = decent_comm.DAdamW(m.parameters(), lr=1e-2, mode=mode, model=m, timeout=10)
    _train(m, opt, 3, seed=1)
    if synced:
        opt.synchronize()
    report = None
    if fork:
        r, w = os.pipe()
        t0 = time.monotonic()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            try:
                _in_child(m, opt, synced, exit_how, w, solo)
            finally:
                os._exit(3)
        os.close(w)
        status = None
        while time.monotonic() - t0 < CHILD_S:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            time.sleep(0.05)
        else:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        elapsed = time.monotonic() - t0
        with os.fdopen(r, "rb") as f:
            text = f.read().decode()
        report = {"calls": json.loads(text) if text else None, "status": status, "seconds": elapsed}
    _train(m, opt, 3, seed=2)
    opt.shutdown()
    return report, [p.detach().clone() for p in m.parameters()]


@pytest.mark.parametrize("mode,synced,exit_how", [("atc", False, "exit"), ("awc", False, "exit"),
                                                  ("atc", True, "os_exit")])
def test_fork_child_raises_exits_and_leaves_the_parent_training(mode, synced, exit_how):
    forked = run_ranks(_rank, 2, mode, True, synced, exit_how, timeout=180)
    reference = run_ranks(_rank, 2, mode, False, synced, exit_how, timeout=120)
    for rank, ((report, params), (_, ref)) in enumerate(zip(forked, reference)):
        assert report["status"] == 0, f"rank {rank}: the child did not exit cleanly: {report}"
        assert report["seconds"] < 10, f"rank {rank}: the child took {report['seconds']:.1f} s to exit"
        calls = report["calls"]
        readable = {"model.state_dict", "eval_forward", "new_optimizer"} if mode == "awc" or synced else set()
        for name, results in calls.items():
            for result in results:
                if name in readable:
                    assert result == "ok", (rank, name, result)
                else:
                    assert result.startswith("RuntimeError:") and "this is a fork of it" in result, \
                        (rank, name, result)
                    assert "DAdamW was built in process" in result and "opt.synchronize() before forking" in result
        # the parent went on exactly as if it had never forked
        assert all(torch.equal(a, b) for a, b in zip(params, ref)), f"rank {rank}: parameters differ after the fork"
