"""The collective utilities that replace the replicas by their exact global average, for a while (global_average(),
for evaluation or saving) or for good (average_parameters()). Mixed into DecentralizedMixin, whose schedule and
buckets they use."""

import contextlib

import torch

from .param_versions import written
from .replica_watch import all_reduce_mean_


class ReplicaAverages:
    @contextlib.contextmanager
    def global_average(self):
        """Swaps in the exact global average of the replicas (for evaluation or saving) and restores each
        rank's own parameters on exit. A collective: every rank must enter it."""
        self._announce("global_average()", [b.flat.numel() for b in self._buckets])
        self._schedule.synchronize()
        saved = [b.flat.clone() for b in self._buckets]
        try:
            self._average_()
            yield self
        finally:
            with torch.no_grad():
                for b, s in zip(self._buckets, saved):
                    b.flat.copy_(s)
                written(self._buckets)

    def average_parameters(self):
        """Permanently replaces every replica by the global average (e.g. before final evaluation)."""
        self._announce("average_parameters()", [b.flat.numel() for b in self._buckets])
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
