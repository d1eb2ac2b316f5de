"""An error a rank raises of its own (``report``, e.g. check_finite's), named by the ranks whose next transfer or
all-reduce fails because that rank stopped: on every path of the exchange layer (GossipExchange's point-to-point
and group all-reduce, BoundedAllReduce), in the words the owner passed, instead of taking it for a dead peer; and a rank's first point-to-point failure,
which stops its transfers with its other peers, named by those peers; and a rank late for the construction."""
import re
import time

import pytest
import torch

from decent_comm.exchange import BoundedAllReduce, ExchangeError, GossipExchange
from decent_comm.exchange.roster import BLAME_GRACE_S

from dist_utils import exit_now, run_ranks
from exchange_support import Ring

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


def _second_hop(rank, n, linger):
    """A 4-rank point-to-point ring: rank 3 exits; ranks 0 and 2 fail on it, then exit (or live on for `linger` s, a
    script saving a checkpoint); rank 1, a neighbour of neither failure, fails on them next."""
    step = Ring(rank, n, TIMEOUT_S)
    step()
    if rank == 3:
        exit_now("exited")
    try:
        for _ in range(3):  # ranks 0 and 2 fail in the first; rank 1's first completes (their sends were posted)
            step()
        msg = "no error"
    except ExchangeError as exc:
        msg = str(exc)
    if rank != 1:
        time.sleep(linger)
    return msg


@pytest.mark.parametrize("linger", [0, TIMEOUT_S + 2])
def test_a_neighbours_neighbour_names_the_first_failure_not_the_rank_that_stopped_because_of_it(linger):
    """Rank 1 named rank 0 ("receive from rank 0 (rank 0 may have exited or failed) failed") or, with ranks 0 and 2
    alive, timed out naming them, and nothing said rank 3: a rank's first point-to-point failure is reported too."""
    res = run_ranks(_second_hop, 4, linger, timeout=120)
    assert res[3] == "exited"
    for rank in (0, 2):  # (either may quote rank 1's report too if it was descheduled through the other's exit)
        assert "receive from rank 3" in res[rank], (rank, res[rank])
    first = re.search(r"(rank \d|ranks \[0, 2\]) raised an error of (its|their) own before \(the likely cause\): "
                      r"rank [02]: decent_comm exchange: bucket 0: receive from rank 3", res[1])
    assert first, res[1]


def _late_for_construction(rank, n, groups):
    if rank == 1:
        time.sleep(3 * TIMEOUT_S)  # stalled before the construction: the others' meeting runs out first
    start = time.monotonic()
    try:
        GossipExchange(None, torch.device("cpu"), timeout=TIMEOUT_S, groups=groups)
        return "no error", time.monotonic() - start
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}", time.monotonic() - start


@pytest.mark.parametrize("groups", [(), [(0, 1, 2)]])
def test_a_construction_that_times_out_names_the_late_rank(groups):
    """The construction's error was an AttributeError (its naming read state set after the construction)."""
    res = run_ranks(_late_for_construction, 3, groups, timeout=120)
    for rank in (0, 2):
        words, took = res[rank]
        assert words.startswith("ExchangeTimeout: ") and "rank 1 did not arrive" in words, words
        assert took < TIMEOUT_S + 3, took
