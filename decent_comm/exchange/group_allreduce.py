"""Averaging-group exchange: a bucket's buffer summed over a group of ranks with one all-reduce.

When a gossip step is uniform averaging within groups (``complete``, intra-node averaging, ``aer`` with
inter="pair", ``ring`` on 3 ranks, ...), point-to-point gossip makes each rank receive |G| - 1 whole buffers;
an all-reduce over the group moves 2 (|G| - 1) / |G| buffers per rank and, inside a node pair, about two
buffers per NIC whatever the number of ranks per node (the seed library, Decent-DP, runs every gossip step
that way). Which steps qualify is the topology's business (decent_comm.topology.averaging_groups); this
class only moves bytes.

Same contract and error family as the point-to-point ``Exchanger``:

    ga = GroupAllReduce(groups, process_group=None, timeout=None)   # collective over the default group
    ga.exchange(bucket, send, recvs, group)   # recvs[0] <- sum over `group` of every member's send; at once
    ga.wait(bucket); ga.wait_all(); ga.synchronize(); ga.bytes_sent; ga.shutdown()

Members must agree on a bucket: the same number of elements and the same dtype. The first time a bucket is
exchanged in a group, and again after its size or dtype changed, ``exchange`` swaps that (numel, dtype) with
the other members through the default group's store before any data moves (so that call blocks until they
reached the same exchange): gloo aborts the whole process on an all-reduce whose sizes differ ("Received data
size doesn't match expected size"), and nothing would check it in NCCL. A difference raises ``ExchangeError``
on every member, naming the bucket, the group and each member's side, and nothing is sent; a member that does
not reach the agreement within ``timeout`` makes it raise ``ExchangeTimeout`` naming that member. The
agreement goes through the store, not the group, so that a member that renegotiates while another goes
straight to the data (a size changed on one rank only) never has a header met by an all-reduce: both time out.

A member that exits raises ``ExchangeError``; so does, within about half a second, a member left waiting for one
that failed already (exchange.watched_wait; on gloo). One that does not answer within ``timeout`` raises
``ExchangeTimeout`` naming the bucket and the group (on NCCL the process group's own timeout and watchdog bound the
all-reduces: a bounded wait would block the host at every step). Either makes the object unusable: every later call
raises ``ExchangeError`` quoting the first error. Bad arguments raise ``ValueError`` and leave it usable.
"""
from __future__ import annotations

import datetime
import time
from typing import Dict, Iterable, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from . import _closing
from .arrival import group_timeout_s, wait_for_ranks
from .roster import Roster
from .exchanger import ExchangeError, ExchangeTimeout
from .timeouts import timeout_ms, timeout_seconds
from .watched_wait import MembersFailed, WaitTimedOut, wait_watching

Group = Tuple[int, ...]


class GroupAllReduce:
    """Asynchronous in-group sums of flat buffers, one process group per averaging group."""

    transport = "group_allreduce"

    def __init__(self, groups: Iterable[Sequence[int]], process_group=None, *, timeout=None):
        """`groups`: every averaging group any rank will use (ranks of `process_group`); the same set on every
        rank. Creating the process groups is collective over the default group (dist.new_group), so the
        whole default group must construct this object, in the same order as its other groups."""
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("GroupAllReduce: torch.distributed is not initialized (call dist.init_process_group)")
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        if process_group is not None and self.world_size != dist.get_world_size():
            raise ValueError("GroupAllReduce needs the default process group (dist.new_group is collective over it)")
        ms = timeout_ms(timeout_seconds(timeout, "GroupAllReduce: "))  # whole ms, as the Exchanger beside it
        self.timeout = None if ms < 0 else datetime.timedelta(milliseconds=ms)
        to_global = (lambda r: r) if process_group is None else (lambda r: dist.get_global_rank(process_group, r))
        backend = dist.get_backend(process_group)
        # NCCL: wait() makes the current stream wait (no host sync) and NCCL's watchdog ends an all-reduce stuck past
        # the group's own timeout; a bounded wait would block the host at every group step (WorkNCCL.wait(timeout)
        # synchronizes), as BoundedAllReduce avoids too. So `timeout` bounds the all-reduces on other backends.
        self._bounded = "nccl" not in str(backend)
        # dist.new_group waits for every rank of the default group for the group's own timeout (gloo: 30 min).
        namespace = wait_for_ranks(None, None if self.timeout is None else self.timeout.total_seconds(),
                                   "creating the group all-reduce")
        self._roster = Roster(namespace, self.rank)
        self._agreed: Dict[Tuple[int, Group], Tuple[int, torch.dtype]] = {}  # (bucket, group) -> (numel, dtype)
        self._pgs: Dict[Group, object] = {}
        parent = process_group if process_group is not None else dist.distributed_c10d._get_default_group()
        parent_timeout = datetime.timedelta(seconds=group_timeout_s(parent))
        for g in sorted({tuple(sorted(int(r) for r in g)) for g in groups}):
            if len(g) < 2 or not all(0 <= r < self.world_size for r in g):
                raise ValueError(f"GroupAllReduce: group {list(g)} must list >= 2 ranks of the {self.world_size}")
            # the parent group's timeout (new_group's default is torch's, e.g. NCCL's 10 min): on NCCL the only bound
            pg = dist.new_group([to_global(r) for r in g], backend=backend, timeout=parent_timeout)
            if self.rank in g:
                self._pgs[g] = pg
        self._work: Dict[int, Tuple[object, Group, float]] = {}
        self._devices = set()  # of the buffers exchanged: synchronize() waits for these devices on NCCL
        self._error: Optional[str] = None
        self._closed = False
        self.bytes_sent = 0
        _closing.track(self)  # closed when collected or at exit if nobody shut it down (see _closing)

    def __del__(self):
        # Completes all-reduces still in flight, so no gloo worker still runs one for a dead owner.
        if not getattr(self, "_closed", True):
            _closing.close_on_collect(self)

    # ------------------------------------------------------------------------------------------- checks

    def _usable(self, call: str):
        if self._error is not None:
            raise ExchangeError(f"decent_comm GroupAllReduce.{call}: unusable after an earlier error; the error "
                                f"was: {self._error}")
        if self._closed:
            raise RuntimeError(f"decent_comm GroupAllReduce.{call}: it has been shut down")

    def _fail(self, exc: Exception) -> Exception:
        self._error = str(exc)
        self._work.clear()
        return exc

    # ---------------------------------------------------------------------------------------- interface

    def exchange(self, bucket: int, send: torch.Tensor, recvs: Sequence[torch.Tensor], group: Sequence[int]):
        """Starts recvs[0] <- sum over `group` of send (every member issues its buckets in one order)."""
        self._usable("exchange")
        g = tuple(group)
        where = f"decent_comm GroupAllReduce.exchange(bucket={bucket}): "
        if bucket in self._work:
            raise RuntimeError(where + f"bucket {bucket} is still in flight; wait for it before exchanging it again")
        if g not in self._pgs:
            raise ValueError(where + f"rank {self.rank} is not a member of a known group {list(g)}")
        if len(recvs) != 1:
            raise ValueError(where + f"takes one receive buffer (the group's sum), got {len(recvs)}")
        total = recvs[0]
        if total.numel() != send.numel() or total.device != send.device:
            raise ValueError(where + f"recvs[0] has {total.numel()} elements on {total.device}, send "
                             f"{send.numel()} on {send.device}")
        if self._agreed.get((bucket, g)) != (total.numel(), total.dtype):
            self._agree(bucket, g, (total.numel(), total.dtype))
        total.copy_(send)  # summed in place, in the receive buffer's dtype (optimizers: the bucket's, wire_buffers.py)
        try:
            work = dist.all_reduce(total, group=self._pgs[g], async_op=True)
        except Exception as e:  # noqa: BLE001 - c10d raises RuntimeError subclasses (DistBackendError, ...)
            raise self._fail(ExchangeError(f"decent_comm exchange: bucket {bucket}: starting the all-reduce among "
                                           f"ranks {list(g)} failed: {e}")) from e
        self._work[bucket] = (work, g, time.monotonic())
        self._devices.add(total.device)
        self.bytes_sent += 2 * (len(g) - 1) * total.numel() * total.element_size() // len(g)

    def _agree(self, bucket: int, g: Group, header: Tuple[int, torch.dtype]):
        seconds = self.timeout.total_seconds() if self.timeout is not None else group_timeout_s(self._pgs[g])
        problem = self._roster.agree(bucket, g, f"{header[0]} elements of {header[1]}", seconds)
        if problem is not None:
            raise self._fail(problem)
        self._agreed[(bucket, g)] = header

    def flag_nonfinite(self, bucket: int, step: int):
        """check_finite: this rank is about to send non-finite values of `bucket` at `step` (before exchange())."""
        self._roster.flag(f"nonfinite/{bucket}/{step}")

    def nonfinite_senders(self, bucket: int, step: int, group: Sequence[int]) -> list:
        """The members of `group` that flagged non-finite values of `bucket` at `step`: the sum cannot tell."""
        return self._roster.flagged(f"nonfinite/{bucket}/{step}", group)

    def report(self, text: str):
        """Leaves `text`, an error this rank is about to raise of its own, for the other members: one whose
        all-reduce then fails names it (exchange.roster's ``report``, ``blame``) instead of a dead member."""
        self._roster.report(text)

    def mark_failed(self, timed_out: bool = False):
        """Marks that this rank stopped (its other path failed, or its owner raised): a member waiting for it in an
        all-reduce stops too (watched_wait) instead of waiting for its exit or the timeout."""
        self._roster.mark_failed(timed_out)

    def wait(self, bucket: int):
        """Until the bucket's sum is in recvs[0]: blocks (NCCL: orders the current stream after it, no host sync);
        a no-op once that happened (wait_all, synchronize)."""
        self._usable("wait")
        entry = self._work.pop(bucket, None)
        if entry is None:
            return
        work, g, started = entry
        try:
            if self._bounded:  # slices, watching for a member that failed already (watched_wait)
                ok = wait_watching(work, None if self.timeout is None else self.timeout.total_seconds(),
                                   lambda: self._roster.failed(g))
            else:
                ok = work.wait()
        except WaitTimedOut:
            raise self._timed_out(bucket, g, "") from None
        except MembersFailed as e:  # a timeout of theirs is this rank's too: it waits for the same silent member
            raise self._fail((ExchangeTimeout if e.timed_out else ExchangeError)(
                f"decent_comm exchange: bucket {bucket}: the all-reduce among ranks {list(g)} {e.words()}"
                f"{self._roster.blame(g, timed_out=e.timed_out)}")) from None
        except Exception as e:  # noqa: BLE001
            elapsed = time.monotonic() - started
            if self._bounded and self.timeout is not None and elapsed + 0.01 >= self.timeout.total_seconds():
                raise self._timed_out(bucket, g, f"; transport: {e}") from e
            raise self._fail(ExchangeError(f"decent_comm exchange: bucket {bucket}: the all-reduce among ranks "
                                           f"{list(g)} failed{self._roster.blame(g)}: {e}")) from e
        if ok is False:
            raise self._fail(ExchangeTimeout(f"decent_comm exchange: bucket {bucket}: the all-reduce among ranks "
                                             f"{list(g)} did not complete within {self.timeout}"
                                             f"{self._roster.blame(g, timed_out=True)}"))

    def _timed_out(self, bucket: int, g, transport: str) -> ExchangeTimeout:
        """The error of a wait that ran out (the sliced wait's deadline, or gloo's own error at it: `transport`)."""
        return self._fail(ExchangeTimeout(
            f"decent_comm exchange: bucket {bucket} timed out after {self.timeout.total_seconds() * 1e3:.0f} ms in "
            f"the all-reduce among ranks {list(g)}{self._roster.blame(g, timed_out=True)}{transport}"))

    def wait_all(self):
        self._usable("wait_all")
        for bucket in list(self._work):
            self.wait(bucket)

    def synchronize(self):
        """Blocks the host until every exchange is complete (on NCCL wait_all() only orders the current stream)."""
        self.wait_all()
        if not self._bounded:  # buckets waited earlier may have been ordered after on another stream
            for device in self._devices:
                if device.type == "cuda":
                    torch.cuda.synchronize(device)

    @property
    def in_flight(self):
        return list(self._work)

    def shutdown(self):
        """Completes what is in flight (nothing after an error), destroys the groups this object created, and
        closes; idempotent."""
        if self._closed:
            return
        if self._error is None:
            self.synchronize()  # NCCL: the groups are destroyed below only once nothing runs on them
            # Ours (dist.new_group in __init__), so destroyed here: that joins their gloo worker threads now,
            # while the interpreter is alive, instead of leaving them to whoever ends the process (a worker
            # still releasing a finished all-reduce's tensors needs the GIL; see exchange/_closing.py).
            for pg in self._pgs.values():
                if dist.is_initialized():  # else destroy_process_group() already destroyed every group
                    try:
                        dist.destroy_process_group(pg)
                    except ValueError:  # no longer registered (the default group was destroyed and recreated)
                        pass
        self._pgs = {}
        self._closed = True
