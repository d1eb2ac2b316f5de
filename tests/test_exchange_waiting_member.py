"""A member of a gloo all-reduce left waiting for a member that failed already (exchange.watched_wait).

Rank 0 posts the next all-reduce, rank 2 exits, and rank 1 posts it and fails at once (its link to rank 2 dropped).
gloo has rank 0 wait for rank 1's part, which never comes: rank 0 used to wait until rank 1's
process exited or the timeout passed (forever for a rank 1 that lives on, e.g. saving a checkpoint), and rank 1's
error named rank 0 beside the dead rank 2 ("ranks [0, 2] did not report this failure"). Rank 1 here lives on until
rank 0 raised. Both must raise within a few seconds, rank 2 named as the one that did not report.
"""
import datetime
import time

import pytest
import torch
import torch.distributed as dist

from decent_comm.exchange import BoundedAllReduce, ExchangeError, GroupAllReduce
from decent_comm.exchange.roster import BLAME_GRACE_S
from decent_comm.exchange.watched_wait import POLL_S, MembersFailed, WaitTimedOut, wait_watching

from dist_utils import exit_now, run_ranks

N = 1000
# Rank 0 posts the all-reduce at once, rank 2 exits while it waits, rank 1 posts once rank 2 is gone. Seen with plain
# gloo in every run (also with rank 2 exiting before rank 0 posted): rank 0 waits for rank 1's part, not rank 2's.
RANK2_EXITS_S = 0.3
RANK1_LATE_S = 1.0


def _all_reduce(path, timeout):
    """A function running one all-reduce of N elements over the 3 ranks on `path` (constructed here: collective)."""
    ga = GroupAllReduce([(0, 1, 2)], timeout=timeout) if path == "group" else None
    all_reduce = BoundedAllReduce(None, timeout=timeout) if path == "bounded" else None
    x = torch.ones(N)

    def once():
        if ga is not None:
            ga.exchange(0, x, [torch.empty(N)], group=(0, 1, 2))
            ga.wait(0)
        else:
            all_reduce(x, "the test's all-reduce")
    return once


def _member_left_waiting(rank, n, path, timeout):
    once = _all_reduce(path, timeout)
    once()  # every rank joined: the data path from here on
    if rank == 2:
        time.sleep(RANK2_EXITS_S)
        exit_now("exited")
    if rank == 1:
        time.sleep(RANK1_LATE_S)
    start = time.monotonic()
    try:
        once()
        msg = "no error"
    except ExchangeError as exc:
        msg = str(exc)
    elapsed = time.monotonic() - start
    store = dist.distributed_c10d._get_default_store()
    if rank == 0:
        store.set("test/rank0_raised", "1")
    else:  # lives on (a script saving its checkpoint) until rank 0 raised
        store.wait(["test/rank0_raised"], datetime.timedelta(seconds=90))
    return msg, elapsed


@pytest.mark.parametrize("timeout", [20, None])
@pytest.mark.parametrize("path", ["group", "bounded"])
def test_a_member_left_waiting_for_a_failed_one_raises_and_is_not_blamed(path, timeout):
    res = run_ranks(_member_left_waiting, 3, path, timeout, timeout=80)
    assert res[2] == "exited"
    (msg0, elapsed0), (msg1, elapsed1) = res[:2]
    for rank, msg in ((0, msg0), (1, msg1)):
        assert "rank 2 did not report this failure" in msg, (rank, msg)
    assert "failed on rank 1 first, while this rank waited for it" in msg0, msg0
    # rank 1: its own error at once, then the grace for reports; rank 0: rank 1's start, a poll slice after rank 1's
    # report, then the grace for rank 2: ~3.5 s (a 5 s margin for a loaded machine, still far from the old wait's
    # 20 s timeout or forever)
    assert elapsed1 < BLAME_GRACE_S + 5, (msg1, elapsed1)
    assert elapsed0 < RANK1_LATE_S + POLL_S + BLAME_GRACE_S + 5, (msg0, elapsed0)


def _member_waiting_for_a_silent_one(rank, n, path):
    """Rank 2 is silent (it sleeps past everyone's timeout, then exits); rank 1 posts the all-reduce at once, rank 0
    a second later: rank 1 times out first, and rank 0, waiting for rank 2 too, learns it before its own timeout."""
    once = _all_reduce(path, 3)
    once()
    if rank == 2:
        time.sleep(8)
        exit_now("slept")
    time.sleep(1.0 if rank == 0 else 0.0)
    start = time.monotonic()
    try:
        once()
    except ExchangeError as exc:
        return type(exc).__name__, str(exc), time.monotonic() - start
    return "no error", "", time.monotonic() - start


@pytest.mark.parametrize("path", ["group", "bounded"])
def test_a_member_waiting_for_a_silent_one_raises_a_timeout_when_another_timed_out_first(path):
    """The silent rank's fault is a timeout on every waiting member, whichever learns of it from another's report."""
    res = run_ranks(_member_waiting_for_a_silent_one, 3, path, timeout=80)
    assert res[2] == "slept"
    (kind0, msg0, elapsed0), (kind1, msg1, _) = res[:2]
    assert kind0 == kind1 == "ExchangeTimeout", (msg0, msg1)
    for rank, msg in ((0, msg0), (1, msg1)):
        assert "rank 2 did not report this failure" in msg, (rank, msg)
    assert "timed out on rank 1 first, while this rank waited for it" in msg0, msg0
    assert elapsed0 < 3.0 + BLAME_GRACE_S + 5, (msg0, elapsed0)  # its own timeout and grace at most (+ margin)


class _Work:
    """A gloo Work's wait/is_completed as c10d has them: wait(timeout) raises "Operation timed out!" while the
    collective runs and leaves it running; once it completed, wait() returns True or raises its error."""

    def __init__(self, done_after_waits=None, error=None, completes_during_raise=False):
        self.waits, self.done_after, self.error = 0, done_after_waits, error
        self.completes_during_raise = completes_during_raise
        self.completed = False

    def is_completed(self):
        return self.completed

    def wait(self, timeout=None):
        self.waits += 1
        if self.done_after is not None and self.waits > self.done_after:
            self.completed = True
        if self.completed:
            if self.error:
                raise RuntimeError(self.error)
            return True
        if self.completes_during_raise:  # completes between the slice's end and the caller's look
            self.completed = True
        time.sleep(timeout.total_seconds() if timeout is not None else 0)
        raise RuntimeError("Operation timed out!")


def test_wait_watching_slices_asks_between_them_and_keeps_the_collectives_own_outcome():
    asked = []
    assert wait_watching(_Work(done_after_waits=2), 10, lambda: asked.append(1) or {}) is True
    assert len(asked) == 2  # once after each slice that ended with the collective running
    with pytest.raises(RuntimeError, match="Connection closed"):  # its own error, not a slice's "timed out"
        wait_watching(_Work(done_after_waits=1, error="Connection closed by peer"), 10, lambda: {})
    assert wait_watching(_Work(completes_during_raise=True), 10, lambda: {3: "error"}) is True  # done: none asked
    with pytest.raises(MembersFailed) as failed:
        wait_watching(_Work(), None, lambda: {1: "error", 3: "error"})
    assert not failed.value.timed_out and failed.value.words().startswith("failed on ranks [1, 3] first")
    with pytest.raises(MembersFailed) as failed:
        wait_watching(_Work(), None, lambda: {1: "error", 3: "timeout"})
    assert failed.value.timed_out and failed.value.words().startswith("timed out on ranks [1, 3] first")
    start = time.monotonic()
    with pytest.raises(WaitTimedOut):
        wait_watching(_Work(), 0.8, lambda: {})
    assert 0.8 <= time.monotonic() - start < 0.8 + POLL_S
    asked.clear()  # a store that cannot tell (None) is not asked again in this wait: each failed call logs a trace
    assert wait_watching(_Work(done_after_waits=4), 10, lambda: asked.append(1)) is True and len(asked) == 1


def test_ctrl_c_between_slices_is_raised_once_the_collective_is_done():
    """A KeyboardInterrupt between slices (here: while the store is asked) left the collective writing into tensors
    its caller reuses at once (the next all-reduce of the bucket copies into the same buffer)."""
    work, asked = _Work(done_after_waits=3), []

    def interrupted():
        asked.append(work.completed)
        if len(asked) == 1:
            raise KeyboardInterrupt
        return {}

    with pytest.raises(KeyboardInterrupt):
        wait_watching(work, 10, interrupted)
    assert work.completed and asked == [False, False, False], asked  # asked after each of the 3 slices

