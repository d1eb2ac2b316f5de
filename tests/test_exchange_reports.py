"""An error a rank raises of its own (``report``, e.g. check_finite's), named by the ranks whose next transfer or
all-reduce fails because that rank stopped: on every path of the exchange layer (GossipExchange's point-to-point
and group all-reduce, BoundedAllReduce), in the words the owner passed, instead of taking it for a dead peer."""
import time

import pytest
import torch

from decent_comm.exchange import BoundedAllReduce, ExchangeError, GossipExchange
from decent_comm.exchange.roster import BLAME_GRACE_S

from dist_utils import exit_now, run_ranks

WORDS = "the owner's own words for why rank 2 stopped"
TIMEOUT_S = 3


def _reporter_exits(rank, n, path, reports):
    """Rank 2 reports (or not) and exits; ranks 0 and 1 then meet its exit on `path` ("group-agreement": a
    bucket's first all-reduce in the group, whose size/dtype agreement rank 2 never reaches)."""
    ex = GossipExchange(None, torch.device("cpu"), timeout=TIMEOUT_S, groups=[(0, 1, 2)])
    all_reduce = BoundedAllReduce(None, timeout=TIMEOUT_S)
    x = torch.ones(100)
    if path == "group":  # agreed with rank 2 before: the data path
        ex.exchange(0, x, [torch.empty(100)], group=(0, 1, 2))
        ex.wait(0)
    if rank == 2:
        if reports:
            ex.report(WORDS)
            all_reduce.report(WORDS)
        exit_now("exited")  # like a script dying of its error: no teardown at all
    start = time.monotonic()
    try:
        if path == "p2p":
            ex.exchange(0, x, [torch.empty(100)], send_to=[2], recv_from=[2])
            ex.wait(0)
        elif path in ("group", "group-agreement"):
            ex.exchange(0, x, [torch.empty(100)], group=(0, 1, 2))
            ex.wait(0)
        else:
            all_reduce(x, "the test's all-reduce")
    except ExchangeError as exc:
        return str(exc), time.monotonic() - start
    return "no error", time.monotonic() - start


@pytest.mark.parametrize("path", ["p2p", "group", "group-agreement", "bounded"])
def test_a_reported_error_is_named_by_the_ranks_that_meet_the_exit(path):
    res = run_ranks(_reporter_exits, 3, path, True, timeout=120)
    assert res[2] == "exited"
    for rank, (msg, elapsed) in enumerate(res[:2]):
        assert f"rank 2 raised an error of its own before (the likely cause): rank 2: {WORDS}" in msg, (rank, msg)
        # a failed transfer or all-reduce names it without waiting BLAME_GRACE_S for a report of the failure that
        # rank 2 will never make (it would then come after the grace: the bound is the grace itself, the margin for a
        # loaded machine); the agreement waits for rank 2 for the timeout
        bound = TIMEOUT_S + BLAME_GRACE_S if path == "group-agreement" else BLAME_GRACE_S
        assert "did not report this failure" not in msg and elapsed < bound, (rank, msg, elapsed)


@pytest.mark.parametrize("path", ["group", "group-agreement", "bounded"])
def test_an_unreported_exit_is_still_taken_for_a_dead_rank(path):
    for rank, (msg, _) in enumerate(run_ranks(_reporter_exits, 3, path, False, timeout=120)[:2]):
        dead = "rank 2 did not reach it" if path == "group-agreement" else "rank 2 did not report this failure"
        assert dead in msg and "own before" not in msg, (rank, msg)
