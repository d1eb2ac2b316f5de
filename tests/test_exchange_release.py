"""An exchanger shut down after a failure lets go of its process group, as after a healthy run: the C++ transport held
on to it, so dist.destroy_process_group() did not destroy the group and its gloo worker threads ran for the rest of
the process (a retry after each caught failure added two). What the timed-out transfers may still write into stays
kept (docs/reliability.md); the group's worker threads do not depend on it."""
import datetime
import gc
import os

import torch
import torch.distributed as dist

from decent_comm.exchange import Exchanger

from dist_utils import run_ranks
from exchange_support import errors

TIMEOUT_S = 2


def _threads():
    """This process's threads (a new gloo group adds its device loop and its 'pt_gloo_runloop' workers; counted by
    number, as a thread may not carry its name yet right after it started)."""
    return len(os.listdir("/proc/self/task"))


def _fails_then_destroys(rank, world_size, fail):
    before = _threads()
    group = dist.new_group([0, 1])
    with_group = _threads()
    ex = Exchanger(group, timeout=TIMEOUT_S)
    x, r = torch.ones(64), torch.empty(64)
    ex.exchange(0, x, [r], [1 - rank], [1 - rank])
    ex.wait(0)
    kind, msg = "none", ""
    if fail:  # rank 0 exchanges bucket 0 again, which rank 1 never posts; rank 1 receives a new bucket rank 0 never
        # sends: both time out (equal deadlines; test_exchange.py's mismatch)
        if rank == 0:
            kind, msg = errors(lambda: (ex.exchange(0, x, [r], [1], [1]), ex.wait(0)))
        else:
            kind, msg = errors(lambda: (ex.exchange(1, x, [torch.empty(64)], [], [0]), ex.wait_all()))
        store = dist.distributed_c10d._get_default_store()  # neither closes the connection under the other's wait
        if store.add("test_exchange_release/timed_out", 1) == 2:
            store.set("test_exchange_release/both", "1")
        store.wait(["test_exchange_release/both"], datetime.timedelta(seconds=30))
    ex.shutdown()
    dist.destroy_process_group(group)
    del group
    gc.collect()
    return dict(kind=kind, msg=msg if fail else "", before=before, with_group=with_group, after=_threads())


def test_a_failed_exchanger_releases_its_process_group():
    for fail in (False, True):
        for rank, r in enumerate(run_ranks(_fails_then_destroys, 2, fail, timeout=120)):
            assert r["kind"] == ("ExchangeTimeout" if fail else "none"), (fail, rank, r)
            assert r["with_group"] > r["before"], r  # the check sees the group's threads
            # after a failure the timed-out transfers keep the group's gloo device (its loop thread): kept by design
            assert r["after"] <= r["before"] + fail, (f"rank {rank} (failure: {fail}): the destroyed group's gloo "
                                                      "threads still run", r)
