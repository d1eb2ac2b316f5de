"""Waiting for a gloo collective while watching whether another member already gave up on it.

A member of a gloo all-reduce learns that a peer died only from its own connection to that peer, and only while it
waits on that connection. Once a live member failed (its own link to the dead one dropped), it never sends its part,
and a member that waits for that part waits until the failed member's process exits or the wait's timeout passes.
Measured with plain gloo (3 ranks, one dead, one failed 0.3 s before the other posted the all-reduce): the late
member raised only when the failed one's process exited, 9.4 s later in that run and never while it lives (a
script that catches the error to save a checkpoint, a notebook); meanwhile the failed member's error named both as
missing ("ranks [0, 2] did not report this failure"), since the waiting one could not report within the grace.

So the wait goes in slices of POLL_S: after each slice with the collective still running, one store call asks
whether a member of the group reported a failure (exchange.roster: ``blame`` marks it before its grace wait), and the
waiter stops too. Nothing extra happens while collectives finish within a slice; a longer one costs a store call
(about 0.3 ms) per slice.
"""
from __future__ import annotations

import contextlib
import datetime
import time
from typing import Callable, Dict, Optional

from .arrival import ranks_text

#: How long a wait runs before it looks at the store: well inside the 2 s in which a failed member waits for the
#: others' reports (roster.BLAME_GRACE_S), so that the member it left waiting is not named as missing.
POLL_S = 0.5


class WaitTimedOut(Exception):
    """The collective did not complete within the wait's `seconds`."""


class MembersFailed(Exception):
    """Other members reported that this collective failed for them: `ranks` maps each to "timeout" (its wait ran
    out: a member is silent, and this rank waits for it too) or "error" (its transport failed: a member died)."""

    def __init__(self, ranks: Dict[int, str]):
        super().__init__(f"ranks {sorted(ranks)} failed first")
        self.ranks = ranks
        self.timed_out = "timeout" in ranks.values()

    def words(self) -> str:
        """E.g. "timed out on rank 2 first, while this rank waited for it"."""
        return (f"{'timed out' if self.timed_out else 'failed'} on {ranks_text(sorted(self.ranks))} first, while "
                "this rank waited for it")


def wait_watching(work, seconds: Optional[float], failed_members: Callable[[], Optional[Dict[int, str]]]):
    """Returns work.wait()'s result (a gloo Work) once the collective completed, or raises its own error;
    ``WaitTimedOut`` once `seconds` passed (None: no bound), ``MembersFailed`` when `failed_members()` (asked after
    each slice in which the collective is still running) names members (``Roster.failed``); once it returns None
    (the store cannot tell) it is not asked again in this wait."""
    deadline = None if seconds is None else time.monotonic() + seconds
    try:
        return _slices(work, deadline, failed_members)
    except KeyboardInterrupt:
        # Ctrl-C (Python's default handler) lands between slices, with the collective still writing into its
        # tensors, which the caller would reuse for its next one. So the interrupt waits, as it did for one
        # unsliced wait: until the collective is done, fails, times out, or a member reports a failure.
        with contextlib.suppress(Exception):
            _slices(work, deadline, failed_members)
        raise


def _slices(work, deadline: Optional[float], failed_members: Callable[[], Optional[Dict[int, str]]]):
    asking = True  # until the store fails: a dead store fails each call at once, and c10d logs a stack trace for it
    while True:
        left = None if deadline is None else deadline - time.monotonic()
        piece = POLL_S if left is None else max(min(POLL_S, left), 0.001)
        try:
            return work.wait(timeout=datetime.timedelta(seconds=piece))
        except Exception:  # noqa: BLE001 - c10d raises RuntimeError ("Operation timed out!") for a slice that ended
            if work.is_completed():  # its own error, or it completed just as the slice ended: wait() says which
                return work.wait()
        if deadline is not None and time.monotonic() >= deadline:
            raise WaitTimedOut()
        failed = failed_members() if asking else {}
        if failed is None:
            asking = False
        elif failed:
            raise MembersFailed(failed)
