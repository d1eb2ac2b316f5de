"""What ranks tell each other through the default group's store, beside their collectives: a bucket's size and
dtype before a group's first all-reduce of it (``agree``, for GroupAllReduce), once a collective failed, which
members saw the failure too (``blame``, for GroupAllReduce and BoundedAllReduce; ``mark_failed`` for GossipExchange's
point-to-point failures, exchange.peer_watch), so that an error can name the rank that is dead or stuck and not only
the group, and a member left waiting for a failed one stops too, which member sent non-finite values into a sum
(``flag``/``flagged``, for check_finite), which the sum itself cannot tell, and the error a member raised of its own
(``report``: its owner's words, e.g. check_finite's), so that a member whose collective or transfer then fails
because that one stopped names that error, not a dead peer (``blame``, ``told``). Every store call is held to a
deadline (exchange.store_calls): a store that stops answering makes these say so instead of blocking the error.

All of it goes through the store rather than the groups: a header all-gathered on a group could meet another
member's data all-reduce (gloo then aborts the process), and a failed group carries nothing any more. Keys live under
the namespace of the owner's construction (exchange.arrival), the same on every rank.
"""
from __future__ import annotations

import datetime
from typing import Dict, List, Optional, Sequence, Tuple

import torch.distributed as dist

from .arrival import ExchangeError, ExchangeTimeout, ranks_text
from .store_calls import default_store

# How long a member that saw an all-reduce fail waits for the other members to report it too. Survivors of a dead
# member see the connection drop within milliseconds of each other; those of a silent one time out within the
# spread of their launch times (one step's skew). The member that has not reported by then is named as the
# likely cause; the error still comes within the timeout + BLAME_GRACE_S.
BLAME_GRACE_S = 2.0


def swap(base: str, rank: int, ranks: Sequence[int], mine, seconds: float) -> Tuple[Dict[int, bytes], List[int]]:
    """Puts `mine` (str or bytes) in the default group's store under `base` for this rank and waits up to `seconds`
    for every rank of `ranks` to do the same: (every rank's value, []), or ({}, the ranks whose value did not come).
    A failure of the store itself raises dist.DistError."""
    store = default_store()
    store.set(f"{base}/{rank}", mine)
    try:
        store.wait([f"{base}/{r}" for r in ranks], datetime.timedelta(seconds=seconds))
    except dist.DistStoreError:
        return {}, [r for r in ranks if not store.check([f"{base}/{r}"])]
    return {r: store.get(f"{base}/{r}") for r in ranks}, []


class Roster:
    def __init__(self, namespace: str, rank: int):
        self.namespace, self.rank = namespace, rank
        self._rounds: Dict[Tuple[int, Tuple[int, ...]], int] = {}  # agreements so far, the same on every member

    @staticmethod
    def _store():
        return default_store()  # each call bounded (store_calls): these run where an error is due within a timeout

    def agree(self, bucket: int, g: Sequence[int], mine: str, seconds: float) -> Optional[Exception]:
        """Swaps `mine` ("<numel> elements of <dtype>") for `bucket` with every member of `g`. Returns the error to
        raise (the same words on every member: each side listed; or the members that did not come within
        `seconds`), or None when all sides are equal."""
        g = tuple(g)
        n = self._rounds[(bucket, g)] = self._rounds.get((bucket, g), 0) + 1
        base = f"{self.namespace}/agree/{bucket}/{'-'.join(map(str, g))}/{n}"
        where = f"decent_comm exchange: bucket {bucket}"
        try:
            sides, missing = swap(base, self.rank, g, mine, seconds)
            if missing:
                return ExchangeTimeout(
                    f"{where} timed out after {seconds * 1e3:.0f} ms in the size/dtype agreement of the all-reduce "
                    f"among ranks {list(g)}: {ranks_text(missing)} did not reach it (a member died, is stuck, or "
                    f"runs another schedule){self.told(g)}; nothing was sent")
            sides = {r: v.decode() for r, v in sides.items()}
        except dist.DistError as e:  # the store itself failed
            return ExchangeError(f"{where}: the size/dtype agreement of the all-reduce among ranks {list(g)} failed: "
                                 f"{e}")
        if len(set(sides.values())) == 1:
            return None
        listed = "; ".join(f"rank {r}{' (this rank)' if r == self.rank else ''}: {v}" for r, v in sides.items())
        return ExchangeError(f"{where}: the members of the all-reduce among ranks {list(g)} disagree on its size or "
                             f"dtype ({listed}); nothing was sent (every member must build the same buckets with the "
                             "same wire dtype)")

    def blame(self, g: Sequence[int], timed_out: bool = False) -> str:
        """Reports this rank's failure (`timed_out`: its wait ran out, else the transport failed; a member still
        waiting learns which, ``failed``) and waits up to BLAME_GRACE_S for the other members of `g` to report
        theirs. Returns the words naming the members that raised an error of their own (``report``: the likely cause, not
        waited for) and those that did not report ("" when all did), or saying the store failed."""
        store = self._store()
        reported, lost = self._reports(g)
        others = [r for r in g if r != self.rank and r not in reported]
        absent = []
        try:
            if lost:  # the store failed already: each later call would fail too (at once, when it stopped answering)
                raise dist.DistStoreError(lost)
            self._mark(store, timed_out)
            if others:
                try:
                    store.wait([f"{self.namespace}/failed/{r}" for r in others],
                               datetime.timedelta(seconds=BLAME_GRACE_S))
                except dist.DistStoreError:  # timed out (a store that stopped answering fails the check too)
                    absent = [r for r in others if not store.check([f"{self.namespace}/failed/{r}"])]
            if absent:  # one may have reported its own error while this rank waited (it raises that, not this)
                late, lost = self._reports(absent)
                reported.update(late)
                absent = [r for r in absent if r not in late]
        except dist.DistError as e:
            lost = str(e)
        return self._told(reported) + (
            f"; {ranks_text(absent)} did not report this failure within {BLAME_GRACE_S:g} s of this rank (the "
            "likely cause: it died, is stuck, or runs another schedule)" if absent else "") + (
            f"; which members failed too is unknown: {lost}" if lost else "")

    def mark_failed(self, timed_out: bool = False):
        """Marks that this rank failed and stops exchanging (`timed_out`: its wait ran out, else its transport failed)
        for the members still waiting for it (``failed``; exchange.peer_watch). On the failure path only."""
        try:
            self._mark(self._store(), timed_out)
        except dist.DistError:  # the store is gone: those waiting then wait for their own error or timeout
            pass

    def _mark(self, store, timed_out: bool):
        store.set(f"{self.namespace}/failed/{self.rank}", "timeout" if timed_out else "error")
        store.add(f"{self.namespace}/failures", 1)  # one look tells a waiting member (``failed``) to stop

    def failed(self, g: Sequence[int]) -> Optional[Dict[int, str]]:
        """The other members of `g` that reported a failure (``blame``), each with "timeout" or "error": {} when
        none did, None when the store cannot tell. One store call while no member of the namespace failed; asked by
        a member still waiting for the collective (exchange.watched_wait) or transfer (exchange.peer_watch), which
        else waits for the failed one to exit."""
        marks, lost = self._marks("failures", "failed", g)
        return None if lost else marks  # None: the store is gone, and the wait goes on to its own error or timeout

    def report(self, text: str):
        """Leaves `text`, an error this rank is about to raise of its own (its owner's words), where the other
        members look once a collective or transfer with this rank fails (``blame``, ``told``): their error then
        names it instead of taking this rank for dead. On the failure path only (a few store calls)."""
        try:
            store = self._store()
            store.set(f"{self.namespace}/report/{self.rank}", text)
            store.add(f"{self.namespace}/reports", 1)  # one look tells a reader whether any member reported
        except dist.DistError:  # the store is gone: the others' errors then name the peer only
            pass

    def _reports(self, g: Sequence[int]) -> Tuple[Dict[int, str], str]:
        """The errors the other members of `g` reported ({} when none did), and "" or the store's error when it could
        not be read."""
        return self._marks("reports", "report", g)

    def _marks(self, count: str, key: str, g: Sequence[int]) -> Tuple[Dict[int, str], str]:
        """What the other members of `g` left under `key`/<rank> ({} when none did), and "" or the store's error when
        it could not be read. Every writer adds 1 to `count`: while it is 0 (no member of the namespace wrote), one
        store call answers."""
        try:
            store = self._store()
            if store.add(f"{self.namespace}/{count}", 0) == 0:
                return {}, ""
            keys = {r: f"{self.namespace}/{key}/{r}" for r in g if r != self.rank}
            return {r: store.get(k).decode() for r, k in keys.items() if store.check([k])}, ""
        except dist.DistError as e:
            return {}, str(e)

    def told(self, g: Sequence[int]) -> str:
        """The words naming the errors the other members of `g` reported ("" when none did), or saying the store
        could not tell."""
        reported, lost = self._reports(g)
        return self._told(reported) + (f"; whether another rank raised an error of its own first is unknown: {lost}"
                                       if lost else "")

    @staticmethod
    def _told(reported: Dict[int, str]) -> str:
        if not reported:
            return ""
        one = len(reported) == 1
        return (f"; {ranks_text(sorted(reported))} raised an error of {'its' if one else 'their'} own before (the "
                "likely cause): " + "; ".join(f"rank {r}: {text}" for r, text in sorted(reported.items())))

    def flag(self, what: str):
        """Marks `what` (e.g. "nonfinite/<bucket>/<step>") as true of this rank. Called before the collective it
        concerns is issued, so a member that sees that collective complete also sees the mark."""
        try:
            self._store().set(f"{self.namespace}/flag/{what}/{self.rank}", "1")
        except dist.DistError:  # the store is gone: the error then names the group only
            pass

    def flagged(self, what: str, g: Sequence[int]) -> List[int]:
        """The members of `g` that marked `what` ([] when none did, or the store cannot tell)."""
        try:
            return [r for r in g if self._store().check([f"{self.namespace}/flag/{what}/{r}"])]
        except dist.DistError:
            return []
