"""The collective utilities that replace the replicas by their exact global average, for a while (global_average(),
for evaluation or saving) or for good (average_parameters()). Mixed into DecentralizedMixin, whose schedule and
buckets they use.

A Ctrl-C is held (interrupts.HeldInterrupt) until the average, and the restore after it, is whole: raised between
two buckets' all-reduces it left this rank half averaged, the exchange in flight not forgotten (the next step mixed
it), and the other ranks waiting for the next bucket's all-reduce until their timeout, blaming this live rank."""

import contextlib

import torch

from .interrupts import HeldInterrupt
from .param_versions import written
from .replica_watch import all_reduce_mean_


class ReplicaAverages:
    @contextlib.contextmanager
    def global_average(self):
        """Swaps in the exact global average of the replicas (for evaluation or saving) and restores each
        rank's own parameters on exit. A collective: every rank must enter it."""
        self._announce("global_average()", [b.flat.numel() for b in self._buckets])
        with HeldInterrupt():
            self._schedule.synchronize()
            saved = [b.flat.clone() for b in self._buckets]
        try:
            with HeldInterrupt():  # raised in the try: the restore below runs
                self._average_()
            yield self
        finally:
            with HeldInterrupt(), torch.no_grad():
                for b, s in zip(self._buckets, saved):
                    b.flat.copy_(s)
                written(self._buckets)

    def average_parameters(self):
        """Permanently replaces every replica by the global average (e.g. before final evaluation)."""
        self._announce("average_parameters()", [b.flat.numel() for b in self._buckets])
        with HeldInterrupt():
            self._schedule.synchronize()
            self._average_()
            self._schedule.forget_inflight()  # what neighbours sent before the average is stale now

    @torch.no_grad()
    def _average_(self):
        if self.world_size > 1:
            for b in self._buckets:
                all_reduce_mean_(b.flat, self._schedule.all_reduce, self.world_size,
                                 f"the global average of bucket {b.index}")
            written(self._buckets)
