"""An optimizer built with an explicit ``process_group=g`` lets go of g at shutdown(), as it did of the default group
(test_exit.py): opt.process_group and its schedule's kept g, so dist.destroy_process_group(g) left the group
registered nowhere yet alive, and its gloo threads (device loop, two workers) ran for as long as the optimizer was
referenced. After a caught exchange failure too (the schedule's kept error still points into the exchange's frames).

Threads are counted by number (/proc/self/task): a new thread may not carry its name yet right after it started."""
import gc
import os
import time

import pytest
import torch
import torch.distributed as dist

import decent_comm
from decent_comm.exchange import ExchangeError

from dist_utils import run_ranks

TIMEOUT_S = 2


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _referrers_of(group) -> list:
    """What still refers to `group` (this frame's own variable aside), for the failure message."""
    return sorted(type(r).__name__ for r in gc.get_referrers(group) if type(r).__name__ != "frame")


def _train_shutdown_destroy(rank, world_size, cls_name, options, fail):
    before = _threads()
    g = dist.new_group(list(range(world_size)))
    with_group = _threads()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = getattr(decent_comm, cls_name)(model.parameters(), lr=1e-2, process_group=g, timeout=TIMEOUT_S, **options)
    grouped = opt._schedule.group_steps is not None  # the exchange made subgroups of its own
    error = ""
    for t in range(4):
        if fail and t == 1 and rank == 1:  # rank 0 then waits at step 2 for the exchange rank 1 launches at step 1
            time.sleep(3 * TIMEOUT_S)
        try:
            opt.zero_grad()
            model(torch.randn(4, 8)).square().mean().backward()  # ATC: the pending mix is applied here
            opt.step()
        except ExchangeError as e:
            error = type(e).__name__
            break
    if fail:  # neither rank tears its group down under the other's wait
        dist.barrier()
    opt.shutdown()
    dist.destroy_process_group(g)
    gc.collect()
    held = _referrers_of(g)
    del g
    gc.collect()
    after = _threads()
    late = {}
    for call in ("step", "synchronize", "consensus_distance"):
        try:
            getattr(opt, call)()
            late[call] = "no error"
        except RuntimeError as e:
            late[call] = str(e)
    saved = opt.state_dict()  # still works after shutdown: it needs no group (rank and world size stay)
    try:
        opt.load_state_dict(saved)
        late["load_state_dict"] = "loaded"
    except RuntimeError as e:
        late["load_state_dict"] = str(e)
    return dict(before=before, with_group=with_group, after=after, held=held, error=error, late=late,
                process_group=repr(opt.process_group), rank=opt.rank, world_size=opt.world_size,
                state=bool(saved["state"]), alive=opt is not None, grouped=grouped)


@pytest.mark.parametrize("cls_name,world_size,options", [
    ("DSGD", 2, {"topology": "ring"}),
    ("DAdamW", 2, {"topology": "ring", "mode": "atc"}),
    ("DAdamW", 2, {"warmup_steps": 1, "gossip_every": 2}),  # the whole-group all-reduce of the warm-up
    ("DSGD", 3, {"topology": "complete"}),  # one group all-reduce per step, on subgroups the exchange creates
], ids=["dsgd-awc", "dadamw-atc", "warmup", "group-allreduce"])
def test_shutdown_lets_go_of_an_explicit_process_group(cls_name, world_size, options):
    for rank, r in enumerate(run_ranks(_train_shutdown_destroy, world_size, cls_name, options, False, timeout=180)):
        assert r["with_group"] > r["before"], r  # the count sees the group's threads
        assert r["after"] == r["before"], (f"rank {rank}: the destroyed group's gloo threads still run while the "
                                           f"optimizer lives", r)
        assert r["held"] == [], (rank, r["held"])
        assert r["process_group"] == "None" and r["rank"] == rank and r["world_size"] == world_size, r
        assert r["state"] and r["alive"] and r["grouped"] == (options.get("topology") == "complete"), r
        assert r["late"].pop("load_state_dict") == "loaded", r["late"]  # local: it needs no group either
        for call, words in r["late"].items():
            assert "shut down" in words or "shutdown()" in words, (call, words)


@pytest.mark.parametrize("mode", ["awc", "atc"])
def test_shutdown_after_a_caught_failure_lets_go_of_the_process_group(mode):
    for rank, r in enumerate(run_ranks(_train_shutdown_destroy, 2, "DSGD", {"topology": "ring", "mode": mode}, True,
                                       timeout=180)):
        assert r["error"] or rank == 1, r  # the rank that waited timed out
        # The timed-out transfers keep the group's gloo device (its loop thread) by design (test_exchange_release.py);
        # its two workers go with the group.
        assert r["after"] <= r["before"] + 1, (f"rank {rank}: the destroyed group's gloo threads still run", r)
        assert r["held"] == [], (rank, r["held"])
        assert r["process_group"] == "None" and r["state"], r
