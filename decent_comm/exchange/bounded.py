"""``BoundedAllReduce``: the blocking whole-group all-reduces an optimizer runs inside step() - the warm-up's
gradient average, an adaptive topology's statistics - held to the same `timeout` as the gossip itself; and
``broadcast_from_rank0``, the optimizer's start-up copy of rank 0's parameters, held to it too.

    all_reduce = BoundedAllReduce(process_group, timeout=5, owner="optimizer")  # collective (an arrival barrier);
                                                              # owner: what its messages call the caller
    all_reduce(tensor, "the warm-up gradient average")        # sum in place, or raise within timeout

dist.all_reduce waits for the process group's own timeout (gloo: 30 min) for a rank that stopped stepping, so a
silent peer stalled a warm-up step for half an hour where a gossip step raises within `timeout`. Here a
rank that has not joined within `timeout` makes every waiting rank raise ``ExchangeTimeout``, naming the ranks that
did not report the failure too (exchange.roster); a rank that exited makes it raise ``ExchangeError``, and so does,
within about half a second, a rank left waiting for one that failed already (exchange.watched_wait). Either
makes the object unusable (every later call raises ``ExchangeError`` quoting the first error): the abandoned
all-reduce stays posted in the group, so a later one would be matched against it.

NCCL groups keep dist.all_reduce as it is (no bound here): bounding it would block the host on every call
(WorkNCCL.wait with a timeout synchronizes), and NCCL's own watchdog already ends a collective stuck past the
group's timeout. With timeout=None on gloo the wait has no bound, but still goes in slices that look for a rank's
failure report (exchange.watched_wait).

Ranks out of step on these all-reduces (one rank stepped once more during the warm-up, called a utility alone,
or averages GradScaler's overflow flag where another has no GradScaler) would pair tensors of different calls:
gloo aborts the process when their sizes differ ("Received data size doesn't match") and sums unrelated data
when they are equal. So a caller announces each batch of all-reduces with ``agree(what, label, sizes)``: one
all-reduce of 5 float64 per rank (the same size on every rank and for every batch) in which each rank writes
which object, which call, its label (the caller's step) and the sizes. On a difference every rank raises
``CollectiveMismatch``, naming what each rank was about to do, and nothing of the batch was posted, so the
group's collectives stay paired and the object usable.

The default group is never held: ``process_group=None`` stays None and torch looks the group up at each call.
Held, it would outlive dist.destroy_process_group() for as long as the optimizer lives, and so would gloo's
worker threads: one still releasing a finished all-reduce's Python tensors at interpreter exit needs the GIL
and aborts the process (issue #14.1's "terminate called without an active exception"). ``close()`` lets go
of a group that was given.
"""
from __future__ import annotations

import collections
import json
import sys
import time
import weakref
import zlib
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from . import _closing
from .arrival import ExchangeError, ExchangeTimeout, in_global_ranks, wait_for_ranks
from .roster import BLAME_GRACE_S, Roster, swap
from .timeouts import timeout_seconds
from .watched_wait import MembersFailed, WaitTimedOut, wait_watching


#: How long a finished all-reduce's tensor is kept. gloo's worker thread lets go of the work microseconds after the
#: wait returns, or milliseconds later when it is descheduled on a loaded machine; until then the caller keeps the
#: tensor. Else the worker may drop the last reference to a tensor whose Python object was let go of meanwhile, which
#: takes the GIL: if the script has just ended, during finalization, and the process aborts ("terminate called
#: without an active exception", see _closing.py). A script's last call is often a collective utility (the
#: README's global_average() before saving): 3 of 66 such runs aborted on this 2-core machine under load. Waiting
#: for the worker after every all-reduce cost 0.6-2.4 ms there (it needs a core to finish), and telling its
#: references from others by Tensor._use_count is unreliable (the exchanger's, views'): so the tensors are kept for
#: this long (pruned at the next all-reduce and at each optimizer step), and the owner's close, its collection and
#: the exit wait only for the rest of the newest one's time.
HOLD_S = 0.1


class CollectiveMismatch(RuntimeError):
    """Ranks announced different batches of all-reduces (``BoundedAllReduce.agree``). ``sides``: rank -> (what,
    label, number of tensors, elements[, sub]), or None for a rank whose words did not come through the store."""

    def __init__(self, message: str, sides: Dict[int, Optional[Tuple]]):
        super().__init__(message)
        self.sides = sides


# agree() calls so far per process group (the same count on every rank while their collectives stay paired): names
# the store keys through which the ranks of a mismatch, possibly on different objects, put their sides into words.
_agreements: Dict[str, int] = {}


def _crc(text: str) -> float:
    return float(zlib.crc32(text.encode()))  # < 2^32: exact in float64


def broadcast_from_rank0(tensors: Sequence[torch.Tensor], group, timeout, what: str) -> None:
    """Copies each of `tensors` from rank 0 of `group` (None: the default group) to the other ranks, in place, held to
    `timeout` like the all-reduces below: the ranks meet first (wait_for_ranks: one that does not come within
    `timeout` is named on every rank that did, ExchangeTimeout), and on gloo each broadcast's wait is bounded too
    (ExchangeTimeout; a rank that exited: ExchangeError), naming the ranks that did not report its failure, as the
    all-reduces' errors do (exchange.roster). A plain dist.broadcast waited for a rank stalled before it for the
    process group's own timeout (gloo: 30 min). `what` names the call in the errors."""
    seconds = timeout_seconds(timeout, f"{what}: ")
    roster = Roster(wait_for_ranks(group, seconds, what), dist.get_rank(group))  # a namespace of this call's own
    everyone = list(range(dist.get_world_size(group)))
    src = dist.get_global_rank(group, 0) if group is not None else 0
    gloo = "nccl" not in str(dist.get_backend(group))
    for i, tensor in enumerate(tensors):
        work = dist.broadcast(tensor, src=src, group=group, async_op=True)
        if not gloo:
            work.wait()  # NCCL: stream-ordered, ended by its own watchdog (see the module's docstring)
            continue
        said = f"decent_comm: {what}: the broadcast of tensor {i} from rank 0"
        try:
            wait_watching(work, seconds, lambda: roster.failed(everyone))
            continue
        except WaitTimedOut:
            kind, said, cause = ExchangeTimeout, f"{said} did not complete within {seconds:g} s", None
        except MembersFailed as e:
            kind, said, cause = ExchangeTimeout if e.timed_out else ExchangeError, f"{said} {e.words()}", None
        except Exception as e:  # noqa: BLE001 - c10d raises RuntimeError subclasses (DistBackendError, ...)
            kind, said, cause = ExchangeError, f"{said} failed", e
        # the members that did not report this failure too are named (the likely cause: a rank stalled or died)
        words = said + roster.blame(everyone, timed_out=kind is ExchangeTimeout) + (f": {cause}" if cause else "")
        raise in_global_ranks(kind(words), group) from cause


class BoundedAllReduce:
    def __init__(self, process_group=None, *, timeout=None, device=None,
                 owner: str = "bounded all-reduce"):
        self.owner = owner  # what the messages call the object that runs these all-reduces ("optimizer")
        self.group = process_group  # None: the default group, looked up at each call (see above)
        self.rank, self.world_size = dist.get_rank(self.group), dist.get_world_size(self.group)
        self.timeout = timeout_seconds(timeout, "BoundedAllReduce: ")
        self.gloo = "nccl" not in str(dist.get_backend(self.group))
        self.bounded = self.timeout is not None and self.gloo
        self.device = torch.device("cpu") if device is None else torch.device(device)
        namespace = wait_for_ranks(self.group, self.timeout, f"setting up the {owner}'s all-reduces")
        self._namespace = namespace  # the same on every rank, and distinct per object: tells two objects apart
        self._roster = Roster(namespace, self.rank)
        self._error: Optional[str] = None
        self._closed = False
        self._companions: List[weakref.ref] = []  # add_companion's objects, weakly: they may hold this one
        # (finish time, tensor) of the gloo all-reduces finished in the last HOLD_S seconds (see HOLD_S)
        self._held: collections.deque = collections.deque()
        _closing.track(self)

    def close(self):
        """Lets go of the process group (the owner is shutting down); later calls raise RuntimeError."""
        self.release()
        self.group, self._closed = None, True

    shutdown = close  # what _closing calls at exit

    def prune(self, now: Optional[float] = None):
        """Lets go of the tensors of all-reduces that finished HOLD_S ago or earlier."""
        now = time.monotonic() if now is None else now
        while self._held and now - self._held[0][0] >= HOLD_S:
            self._held.popleft()

    def let_go(self, tensor: torch.Tensor):
        """Frees the memory of `tensor`, a finished all-reduce's that its caller no longer reads (a collective
        utility's float64 temporary: twice the model's float32 bytes, else resident until the next step prunes it).
        Its Python object stays held for the rest of HOLD_S, which is all the hold is for: the worker is done with
        the data once the wait returned. CPU only: a device tensor's memory is stream-ordered by its allocator."""
        if tensor.device.type == "cpu" and any(held is tensor for _, held in self._held):
            tensor.untyped_storage().resize_(0)

    def release(self):
        """Returns once the newest all-reduce finished HOLD_S ago (at most that long), letting go of every tensor."""
        if self._held:
            time.sleep(max(0.0, HOLD_S - (time.monotonic() - self._held[-1][0])))
            self._held.clear()

    def __del__(self):
        if not sys.is_finalizing():
            self.release()

    def flag(self, what: str):
        """Marks `what` as true of this rank, beside the sums (which cannot say whose values they hold): called
        before the all-reduce it concerns, so every rank that sees that all-reduce complete can see the mark."""
        self._roster.flag(what)

    def flagged(self, what: str):
        """The ranks that marked `what` ([] when none did, or the store cannot tell)."""
        return self._roster.flagged(what, range(self.world_size))

    def report(self, text: str):
        """Leaves `text`, an error this rank is about to raise of its own, for the other ranks: one whose all-reduce
        then fails names it (exchange.roster's ``report``, ``blame``) instead of taking this rank for dead."""
        self._roster.report(text)

    def mark_failed(self, timed_out: bool = False):
        """Marks that this rank stopped exchanging (another object's failure, GossipExchange.add_companion): a rank
        waiting for it in one of these all-reduces stops (exchange.watched_wait) instead of waiting for its exit."""
        self._roster.mark_failed(timed_out)

    def add_companion(self, other):
        """`other` (the optimizer's GossipExchange: ``companion_failed(text, timed_out)``) is told when one of these
        all-reduces fails, so that a rank waiting for this one there stops too, quoting `text`."""
        self._companions.append(weakref.ref(other))

    def _check_usable(self, what: str):
        if self._closed:
            raise RuntimeError(f"decent_comm: {what}: the {self.owner} was shut down (shutdown() released its "
                               f"process group)")
        if self._error is not None:
            raise ExchangeError(f"decent_comm: {what}: unusable after an earlier error; the error was: {self._error}")

    def agree(self, what: str, label: int, sizes: Sequence[int], sub: Optional[int] = None) -> None:
        """Before a batch of all-reduces (`sizes`: their element counts; `label`: e.g. the step): returns when every
        rank announced the same batch on this object, else raises CollectiveMismatch on every rank (see above).
        `sub`: which of several batches under one label this is (e.g. the closure evaluation of a step), only put
        into words on a mismatch: ranks whose earlier batches all agreed are at the same one when at the same label."""
        self._check_usable(what)
        mine = [_crc(self._namespace), _crc(what), float(label), float(len(sizes)), float(sum(sizes))]
        rows = torch.zeros((self.world_size, len(mine)), dtype=torch.float64, device=self.device)
        rows[self.rank] = torch.tensor(mine, dtype=torch.float64)
        group_name = (self.group or dist.distributed_c10d._get_default_group()).group_name
        seq = _agreements[group_name] = _agreements.get(group_name, 0) + 1
        # A rank that never comes is most often not dead but doing something else: still stepping while this one
        # evaluates (`if rank == 0: with opt.global_average(): ...`), or in another call.
        self(rows.view(-1), f"{what}: announcing it to the other ranks, which must all make this call at this step "
                            f"(a rank still stepping, or in another call, never joins it)")
        rows = rows.tolist()
        if all(r == rows[0] for r in rows):
            return
        # Every rank saw the same rows, so each gets here at this same call: put each side into words through
        # the store (a few ms, on this path only).
        sides: Dict[int, Optional[Tuple]] = {r: None for r in range(self.world_size)}
        try:
            said, _ = swap(f"decent_comm/agree/{group_name}/{seq}", self.rank, range(self.world_size),
                           json.dumps([what, int(label), len(sizes), int(sum(sizes))] + ([] if sub is None else [sub])),
                           BLAME_GRACE_S)
            sides.update({r: tuple(json.loads(v)) for r, v in said.items()})
        except dist.DistError:  # the store failed: a side unknown in words is still known to differ
            pass
        for r, row in enumerate(rows):
            if row[0] != rows[self.rank][0] and sides[r] is not None:  # another object of this process group
                sides[r] = (sides[r][0] + f" (of another {self.owner})",) + sides[r][1:]
        listed = "; ".join(f"rank {r}{' (this rank)' if r == self.rank else ''}: "
                           + (f"{s[0]}, label {s[1]}, {s[2]} tensors of {s[3]} elements" if s else "(unknown)")
                           for r, s in sides.items())
        raise in_global_ranks(CollectiveMismatch(f"decent_comm: {what}: the ranks are not about to run the same "
                                                 f"all-reduces ({listed}); none of them was started", sides),
                              self.group)

    def __call__(self, tensor: torch.Tensor, what: str):
        """Sums `tensor` over the group in place (`what` names it in errors)."""
        self._check_usable(what)
        if not self.gloo:
            dist.all_reduce(tensor, group=self.group)
            return
        started = time.monotonic()
        work = dist.all_reduce(tensor, group=self.group, async_op=True)
        first = None  # MembersFailed: members failed while this rank still waited (watched_wait)
        try:
            if wait_watching(work, self.timeout, lambda: self._roster.failed(range(self.world_size))) is not False:
                del work
                now = time.monotonic()
                self.prune(now)
                self._held.append((now, tensor))
                return
            detail = "the all-reduce was aborted"
        except WaitTimedOut:
            detail = ""
        except MembersFailed as e:
            first, detail = e, ""
        except Exception as e:  # noqa: BLE001 - c10d raises RuntimeError subclasses (DistBackendError, ...)
            detail = str(e)
        everyone = list(range(self.world_size))
        said = f"decent_comm: {what}: the all-reduce over ranks {everyone}"
        if first is not None:  # a timeout of theirs is this rank's too: it waits for the same silent member
            kind, said, after = ExchangeTimeout if first.timed_out else ExchangeError, f"{said} {first.words()}", ""
        elif self.bounded and time.monotonic() - started + 0.01 >= self.timeout:
            kind, said = ExchangeTimeout, f"{said} did not complete within {self.timeout * 1e3:.0f} ms"
            after = f"; transport: {detail}" if detail else ""
        else:
            kind, said, after = ExchangeError, f"{said} failed", f": {detail}"
        # The companions first (a rank waiting for this one in the gossip stops, and marks itself, within the grace
        # that blame() waits for the members' marks: not named as missing), then the members' words.
        for other in (ref() for ref in self._companions):
            if other is not None:
                other.companion_failed(said + after, timed_out=kind is ExchangeTimeout)
        error = kind(said + self._roster.blame(everyone, timed_out=kind is ExchangeTimeout) + after)
        self._error = str(in_global_ranks(error, self.group))
        raise error
