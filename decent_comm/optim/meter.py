"""``DisagreementMeter``: the disagreement of each mix, which the fused kernels measure in the same pass as the mix
(sum((mixed - x_old)^2) per bucket segment), kept on the device until asked for (last_disagreement, disagreement(),
an adaptive topology's statistics)."""

import logging
from typing import Dict, Optional

import torch

from .device_scalars import sum_scalars

log = logging.getLogger(__name__)

#: what last_disagreement and disagreement() raise without the meter
OFF = ("disagreement tracking is off (track_disagreement=False; pass track_disagreement=True to the optimizer to "
       "measure it)")


class DisagreementMeter:
    """Per device, one float32 scratch with a slot per (bucket, segment): the fused kernels write each call's
    sum((mixed - x_old)^2) there in the same pass as the mix, and nothing is read back unless asked."""

    def __init__(self, buckets, enabled: bool):
        self.enabled = bool(enabled)
        self._buckets = buckets
        self._buf: Dict[torch.device, torch.Tensor] = {}
        self._off: Dict[int, int] = {}
        self.valid = False  # a mix has been measured
        if self.enabled:
            sizes: Dict[torch.device, int] = {}
            for b in buckets:
                self._off[b.index] = sizes.get(b.device, 0)
                sizes[b.device] = sizes.get(b.device, 0) + max(1, len(b.slots))
            self._buf = {d: torch.zeros(n, dtype=torch.float32, device=d) for d, n in sizes.items()}

    def slot(self, b, k: int) -> Optional[torch.Tensor]:
        """The 1-element output of segment k of bucket b, or None when not tracking."""
        if not self.enabled:
            return None
        off = self._off[b.index] + k
        return self._buf[b.device][off:off + 1]

    def begin(self):
        for buf in self._buf.values():
            buf.zero_()

    def total(self) -> torch.Tensor:
        """Sum over every slot, as a device scalar (no host sync)."""
        total = sum_scalars([buf.sum() for buf in self._buf.values()])
        return torch.zeros(()) if total is None else total

    def finish(self, step: int):
        """A mix is complete: its value is the one reported from now on."""
        if not self.enabled:
            return
        self.valid = True
        if log.isEnabledFor(logging.DEBUG):  # reading the value synchronizes with the device: only when asked
            log.debug("decent_comm: step %d: local disagreement %.6g", step, float(self.total()))

    def last(self) -> float:
        if not self.enabled:  # a 0.0 here read as perfect agreement
            raise RuntimeError(OFF)
        return float(self.total()) if self.valid else 0.0

    def values(self, per_bucket: bool, device) -> torch.Tensor:
        """float64 on `device`: the total (shape [1]) or one entry per bucket; zeros before the first mix."""
        if not self.enabled:
            raise RuntimeError(OFF)
        if per_bucket:
            vals = [self._buf[b.device][self._off[b.index]:self._off[b.index] + max(1, len(b.slots))].sum().to(device)
                    for b in self._buckets]
            out = torch.stack(vals).double() if vals else torch.zeros(0, dtype=torch.float64, device=device)
        else:
            out = self.total().double().to(device).reshape(1)
        if not self.valid:
            out.zero_()
        return out
