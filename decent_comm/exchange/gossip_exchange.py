"""``GossipExchange``: the point-to-point ``Exchanger`` and the ``GroupAllReduce`` behind one interface.

    ex = GossipExchange(process_group, device, timeout=None, wire_dtype=None, groups=())
    ex.exchange(bucket, send, recvs, send_to=[...], recv_from=[...])   # point to point
    ex.exchange(bucket, send, [total], group=(0, 1, 2))                # total <- the group's sum of send
    ex.wait(bucket); ex.wait_all(); ex.synchronize(); ex.bytes_sent; ex.shutdown()

``groups`` lists every averaging group any rank will use (the same list on every rank); none: no group
all-reduce is set up. Construction is collective (the Exchanger over the group, the groups over the default
group), in this order on every rank.

``report(text)``: an error this rank is about to raise of its own (e.g. its owner found non-finite values): a rank
whose transfer or all-reduce then fails because this one stopped names that error (exchange.roster) instead of
taking this rank for dead. The point-to-point errors come from the C++ transport, so their words are added here;
the first of them is reported too (unless the owner reported one), so that a neighbour's neighbour whose transfer
with this rank fails next names the rank that failed first, not this one; and marked (``Roster.mark_failed``), so
that a rank whose point-to-point wait on this one blocks while this process lives on stops waiting within about a
second (exchange.peer_watch) instead of at its timeout. ``add_companion(other)``: another object exchanging over the
same ranks (the optimizer's whole-group all-reduces, exchange.bounded) is told these reports, and this object's own
failures' marks; its failures come back through ``companion_failed``.
"""
from __future__ import annotations

import contextlib
import weakref
from typing import Callable, Dict, Iterable, List, Optional, Sequence

import torch
import torch.distributed as dist

from .arrival import detached, in_global_ranks, members_of
from .exchanger import ExchangeError, ExchangeTimeout, Exchanger
from .group_allreduce import GroupAllReduce
from .peer_watch import PeerWatch
from .roster import Roster


class GossipExchange:
    def __init__(self, process_group, device: torch.device, *, timeout=None, wire_dtype=None,
                 groups: Iterable[Sequence[int]] = ()):
        # The group's global ranks, to name ranks in errors: never the group itself, which the paths let go of at
        # shutdown (a traceback kept after a failure, the optimizer's error, still reaches this object).
        self._members = members_of(process_group)
        # The first transfer failure of either path (a dead or late peer): every later call raises it again, so a
        # caller cleaning up after it (shutdown() of an ATC step's pending mix) can tell it was raised already. A
        # copy without the traceback (arrival.detached): the one raised holds the caller's frames, the optimizer's.
        self.error: Optional[ExchangeError] = None
        self._reported = False  # an error of this rank is in the store already (report: the first one stays)
        self._companions: List[weakref.ref] = []  # add_companion's objects, weakly: they may hold this one
        # Set before the construction's errors are named (_named reads them).
        self._roster: Optional[Roster] = None
        self.group_allreduce: Optional[GroupAllReduce] = None
        with self._named():
            self.p2p = Exchanger(process_group, device, timeout=timeout, wire_dtype=wire_dtype)
            self._roster = Roster(self.p2p._store_namespace, self.p2p.rank) \
                if self.p2p._store_namespace is not None else None
            groups = list(groups)
            if groups:
                self.group_allreduce = GroupAllReduce(groups, process_group, timeout=timeout)
        self._route: Dict[int, object] = {}  # bucket -> the path its last exchange took
        self._peers: Dict[int, Sequence[int]] = {}  # p2p bucket in flight -> the ranks it exchanges with
        if self._roster is not None and self.p2p.transport == "process_group":
            # gloo's transfers wait in C++ up to their deadline: meanwhile, a peer that stopped is looked for
            # (peer_watch), for as long as the Exchanger can wait (its drain at exit too: it closes the watch)
            self.p2p.watch_peers(PeerWatch(self.p2p._transport, self._roster.failed))

    @contextlib.contextmanager
    def _named(self, path=None, peers: Callable[[], Iterable[int]] = tuple):
        """Errors name the ranks of the process group; on a subgroup they also say which global ranks those are.
        A failed point-to-point transfer (`path` the Exchanger) also names the errors its peers (`peers()`, asked on
        failure only) reported (the group all-reduce's own errors do: roster.blame); a rank that failed at the same
        moment on a peer of its own, not one of these, is not news to this error."""
        try:
            yield
        except (ExchangeError, ValueError) as e:
            worded = isinstance(e, ExchangeError) and self._roster is not None and len(e.args) == 1 and \
                isinstance(e.args[0], str)
            own = e.args[0] if worded else ""
            if worded and path is self.p2p:
                e.args = (own + self._roster.told(sorted(set(peers()))),)
            if worded and self.error is None:
                # This rank stops exchanging on both paths. A neighbour's failure stops its transfers with its other
                # neighbours: theirs then fail on this rank ("receive from rank 0 ... failed") and name the first
                # failure by its words, or stop waiting for it at once (the mark: peer_watch) if it lives on. A
                # group failure is reported to the point-to-point peers (and the companions) only: the group's members
                # name it by blame.
                if not self._reported:
                    self._tell(own, group=path is self.p2p)
                    self._reported = True
                self.stopped(timed_out=isinstance(e, ExchangeTimeout))
                for other in self._others():  # a failed exchange ends the optimizer: its all-reduces too
                    other.mark_failed(isinstance(e, ExchangeTimeout))
            named = in_global_ranks(e, self._members)
            if isinstance(e, ExchangeError) and self.error is None:
                self.error = detached(named)
            raise named

    def exchange(self, bucket: int, send: torch.Tensor, recvs: Sequence[torch.Tensor], *,
                 send_to: Sequence[int] = (), recv_from: Sequence[int] = (), group: Optional[Sequence[int]] = None):
        if group is not None:
            if self.group_allreduce is None:
                raise ValueError(f"GossipExchange.exchange(bucket={bucket}): group {list(group)} given but no "
                                 "averaging groups were set up")
            if send_to or recv_from:
                raise ValueError(f"GossipExchange.exchange(bucket={bucket}): a group step has no send_to/recv_from")
            with self._named():
                self.group_allreduce.exchange(bucket, send, recvs, group)
            self._route[bucket] = self.group_allreduce
        else:
            peers = list(send_to) + list(recv_from)
            with self._named(self.p2p, lambda: peers):
                self.p2p.exchange(bucket, send, list(recvs), list(send_to), list(recv_from))
            self._route[bucket] = self.p2p
            self._peers[bucket] = peers

    def wait(self, bucket: int):
        path = self._route.get(bucket) or self.p2p
        with self._named(path, lambda: self._peers.get(bucket, ())):
            path.wait(bucket)  # an unknown bucket: the Exchanger's error names it
        self._peers.pop(bucket, None)

    def _paths(self):
        return [self.p2p] + ([self.group_allreduce] if self.group_allreduce is not None else [])

    def _in_flight_peers(self):
        return [r for peers in self._peers.values() for r in peers]

    def wait_all(self):
        for path in self._paths():
            with self._named(path, self._in_flight_peers):
                path.wait_all()
        self._peers.clear()

    def synchronize(self):
        for path in self._paths():
            with self._named(path, self._in_flight_peers):
                path.synchronize()
        self._peers.clear()

    def add_companion(self, other):
        """`other`, another object exchanging over these ranks with ``report(text)`` and ``mark_failed(timed_out)``
        (the optimizer's BoundedAllReduce), is told what this one reports, and marked when this one fails: a rank
        waiting there for one whose exchange failed stops too (exchange.watched_wait), instead of waiting until that
        process exits."""
        self._companions.append(weakref.ref(other))

    def _others(self) -> list:
        return [other for other in (ref() for ref in self._companions) if other is not None]

    def report(self, text: str):
        """Leaves `text`, an error this rank is about to raise of its own, for the other ranks (see above)."""
        self._reported = True
        self._tell(text, group=True)

    def _tell(self, text: str, group: bool, companions: bool = True):
        if self._roster is not None:
            self._roster.report(text)
        if group and self.group_allreduce is not None:
            self.group_allreduce.report(text)
        for other in self._others() if companions else ():
            other.report(text)

    def companion_failed(self, text: str, timed_out: bool = False):
        """A companion's collective failed on this rank (`text`, its error before the blame): reported (unless an
        error was already) and marked on this object's paths, so that a peer whose wait for this rank blocks stops
        (exchange.peer_watch) quoting `text`; not told back to the companion, whose members name it themselves."""
        if not self._reported:
            self._tell(text, group=True, companions=False)
            self._reported = True
        self.stopped(timed_out)

    def stopped(self, timed_out: bool = False):
        """Marks that this rank stops exchanging (an error of its own, ``report`` first; this object's own errors mark
        themselves), for the peers whose wait for it would else block until its process exits or their timeout
        passes. On both paths: a point-to-point peer's watch (exchange.peer_watch) and a group member's sliced wait
        (exchange.watched_wait) look for it in their own path's store namespace (Roster.mark_failed). Not on the
        companions': an owner's error (check_finite's) leaves the whole-group all-reduces usable, and a mark there
        would stop every later one that takes longer than a look (review BQ)."""
        if self._roster is not None:
            self._roster.mark_failed(timed_out)
        if self.group_allreduce is not None:
            self.group_allreduce.mark_failed(timed_out)

    def check_group(self, what: str):
        """RuntimeError when the process group was destroyed (dist.destroy_process_group()) while this exchange,
        which still holds it, was open: gloo's point-to-point transfers went on over the destroyed group, while the
        optimizer's all-reduces looked the default group up and failed with torch's "Default process group has not
        been initialized", or ran on a group created since. A dict lookup: 0.7 us per step (a loaded 2-core CPU)."""
        group = self.p2p.process_group  # None once shut down (the caller says so in its own words)
        if group is not None and group not in dist.distributed_c10d._world.pg_map:
            raise RuntimeError(f"decent_comm: {what}: the optimizer's process group was destroyed "
                               "(dist.destroy_process_group()) while the optimizer was still running; call "
                               "opt.shutdown() before destroy_process_group() (ATC: it applies the last step's "
                               "mix), and build a new optimizer to train on in a new process group")

    @property
    def bytes_sent(self) -> int:
        return sum(int(path.bytes_sent) for path in self._paths())

    def shutdown(self):
        """Completes what is in flight and releases both paths (idempotent); the first error is raised after
        both were released."""
        first = None
        for path in self._paths():
            try:
                # A drain fails like a wait, on either path (named, reported and marked: a peer waiting for this
                # rank on either path stops too)
                with self._named(path, self._in_flight_peers):
                    path.shutdown()
            except Exception as e:  # noqa: BLE001 - release the other path before raising
                first = first or e
        if first is not None:
            raise in_global_ranks(first, self._members)
