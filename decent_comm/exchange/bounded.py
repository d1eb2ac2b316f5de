"""``BoundedAllReduce``: the blocking whole-group all-reduces an optimizer runs inside step() - the warm-up's
gradient average, an adaptive topology's statistics - held to the same `timeout` as the gossip itself.

    all_reduce = BoundedAllReduce(process_group, timeout=5)   # collective (an arrival barrier)
    all_reduce(tensor, "the warm-up gradient average")        # sum in place, or raise within timeout

dist.all_reduce waits for the process group's own timeout (gloo: 30 min) for a rank that stopped stepping, so a
silent peer stalled a warm-up step for half an hour where a gossip step raises within `timeout`. Here a
rank that has not joined within `timeout` makes every waiting rank raise ``ExchangeTimeout``, naming the ranks that
did not report the failure too (exchange.roster); a rank that exited makes it raise ``ExchangeError``. Either
makes the object unusable (every later call raises ``ExchangeError`` quoting the first error): the abandoned
all-reduce stays posted in the group, so a later one would be matched against it.

NCCL groups keep dist.all_reduce as it is (no bound here): bounding it would block the host on every call
(WorkNCCL.wait with a timeout synchronizes), and NCCL's own watchdog already ends a collective stuck past the
group's timeout. With timeout=None the call is plain dist.all_reduce too.

The default group is never held: ``process_group=None`` stays None and torch looks the group up at each call.
Held, it would outlive dist.destroy_process_group() for as long as the optimizer lives, and so would gloo's
worker threads: one still releasing a finished all-reduce's Python tensors at interpreter exit needs the GIL
and aborts the process (issue #14.1's "terminate called without an active exception"). ``close()`` lets go
of a group that was given.
"""
from __future__ import annotations

import datetime
import time
from typing import Optional

import torch
import torch.distributed as dist

from .arrival import ExchangeError, ExchangeTimeout, wait_for_ranks
from .roster import Roster


class BoundedAllReduce:
    def __init__(self, process_group=None, *, timeout: Optional[float] = None):
        self.group = process_group  # None: the default group, looked up at each call (see above)
        self.rank, self.world_size = dist.get_rank(self.group), dist.get_world_size(self.group)
        self.timeout = None if timeout is None else float(timeout)
        self.bounded = self.timeout is not None and "nccl" not in str(dist.get_backend(self.group))
        namespace = wait_for_ranks(self.group, self.timeout, "setting up the optimizer's all-reduces")
        self._roster = Roster(namespace, self.rank)
        self._error: Optional[str] = None
        self._closed = False

    def close(self):
        """Lets go of the process group (the owner is shutting down); later calls raise RuntimeError."""
        self.group, self._closed = None, True

    def __call__(self, tensor: torch.Tensor, what: str):
        """Sums `tensor` over the group in place (`what` names it in errors)."""
        if self._closed:
            raise RuntimeError(f"decent_comm: {what}: the optimizer was shut down (shutdown() released its "
                               f"process group)")
        if self._error is not None:
            raise ExchangeError(f"decent_comm: {what}: unusable after an earlier error; the error was: {self._error}")
        if not self.bounded:
            dist.all_reduce(tensor, group=self.group)
            return
        started = time.monotonic()
        work = dist.all_reduce(tensor, group=self.group, async_op=True)
        try:
            if work.wait(timeout=datetime.timedelta(seconds=self.timeout)) is not False:
                return
            detail = "the all-reduce was aborted"
        except Exception as e:  # noqa: BLE001 - c10d raises RuntimeError subclasses (DistBackendError, ...)
            detail = str(e)
        everyone = list(range(self.world_size))
        if time.monotonic() - started + 0.01 >= self.timeout:
            error = ExchangeTimeout(f"decent_comm: {what}: the all-reduce over ranks {everyone} did not complete "
                                    f"within {self.timeout * 1e3:.0f} ms{self._roster.blame(everyone)}; transport: "
                                    f"{detail}")
        else:
            error = ExchangeError(f"decent_comm: {what}: the all-reduce over ranks {everyone} failed"
                                  f"{self._roster.blame(everyone)}: {detail}")
        self._error = str(error)
        raise error
