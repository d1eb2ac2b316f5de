"""The optimizer's whole-group collectives outside the gossip - the start-up broadcast of rank 0's parameters, the
all-reduces of the warm-up, the adaptive statistics and the collective utilities (exchange.bounded) - end within the
timeout like the gossip does: a rank stalled before the broadcast is named."""
import time

import decent_comm

from dist_utils import run_ranks
from optim_cases import make_model


def _outcome(call):
    """(the error's class and words, or "no error"; seconds the call took)."""
    start = time.monotonic()
    try:
        call()
        return "no error", time.monotonic() - start
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}", time.monotonic() - start


def _stalled_before_the_broadcast(rank, n):
    import decent_comm.optim.base as base
    real = base.broadcast_from_rank0
    if rank == 1:  # silent between the construction's check of the replicas and the copy of rank 0's parameters
        base.broadcast_from_rank0 = lambda *args: (time.sleep(10), real(*args))
    return _outcome(lambda: decent_comm.DAdamW(make_model(rank).parameters(), topology="ring", timeout=3))


def test_a_rank_stalled_before_the_start_up_broadcast_is_named_within_the_timeout():
    """dist.broadcast waited for the stalled rank for the process group's own timeout (the 10 s stall here, 30 min
    for gloo's default): the ranks now meet first, within `timeout`."""
    res = run_ranks(_stalled_before_the_broadcast, 3, timeout=120)
    for rank in (0, 2):
        words, took = res[rank]
        assert words.startswith("ExchangeTimeout: ") and "copying rank 0's parameters" in words, words
        assert "rank 1 did not arrive within 3 s" in words, words
        assert took < 8, took
    assert res[1][0].startswith("ExchangeTimeout: ") and "arrived after the other ranks had stopped waiting" in \
        res[1][0], res[1]
