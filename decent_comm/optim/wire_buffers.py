"""``WireBuffers``: the buffers a GossipSchedule's exchanges write and read, per bucket: one receive buffer per
neighbour (in the wire dtype), a group step's sum, and the copy z of what this rank sent.

A lossy wire (``comm_dtype`` bf16/fp16 below a bucket's dtype) sends z = wire(x) on point-to-point steps and those
steps mix in difference form, x <- x + sum_j w_j (z_j - z) (MixPlan.as_correction). Mixed as
self_weight x + sum_j w_j z_j, every round pulled x back towards a value the wire can hold, so an update below
about half a wire ulp times (1 - self_weight) was lost: a LayerNorm gain at 1.0 trained by DAdamW at lr 3e-4 over
bf16 moved 6e-4 in 100 steps instead of 3e-2. Equal replicas now stay put, and the mean of the replicas moves
only by float32 rounding (a doubly stochastic W's corrections sum to zero).

A group step's sum runs in the bucket's dtype (unless the wire is wider): summed in the wire dtype, every partial
sum was rounded (the replicas' mean drifted by 1e-2 at lr 0 over bf16) and fp16 overflowed at 65504 / |G|. Over a
bf16/fp16 wire a group step therefore moves the bucket's bytes, 2 (|G| - 1) / |G| buffers per rank.

fp16 buckets sum in float32 (twice their bytes): an fp16 sum overflows once the replicas' values pass 65504 / |G|
(4 ranks, values near 3e4: 1333 of 4000 parameters became inf in one step at lr 0). bf16 buckets keep bf16 sums
(bf16 has float32's range; DDP's bf16 all-reduce moves the same bytes): identical replicas at lr 0 move by one bf16
ulp on about 14% of the elements at the first group step (the rounded sum divided by |G|) and then stay put (3
ranks, 500 steps: still at most 1 ulp from where they started).
"""

from typing import Dict, List, Optional

import torch

from .plan import MixPlan


def wire_rounds(dtype: torch.dtype, wire: Optional[torch.dtype]) -> bool:
    """Whether sending `dtype` values as `wire` rounds them (a coarser float, or one of a narrower range)."""
    if wire is None or wire == dtype or not wire.is_floating_point:
        return False
    return torch.finfo(wire).eps > torch.finfo(dtype).eps or torch.finfo(wire).max < torch.finfo(dtype).max


class WireBuffers:
    def __init__(self, buckets, comm_dtype: Optional[torch.dtype], int8_wire=None):
        self.comm_dtype = comm_dtype
        self.int8_wire = int8_wire  # decent_comm.optim.int8_wire.Int8Wire: its payloads replace the wire buffers
        self.lossy = int8_wire is None and any(wire_rounds(b.dtype, comm_dtype) for b in buckets)
        self._recv: Dict[int, List[torch.Tensor]] = {b.index: [] for b in buckets}
        self._sums: Dict[int, torch.Tensor] = {}
        self._sent: Dict[tuple, torch.Tensor] = {}  # (bucket, group step?) -> the copy z last sent

    def group_width(self, buckets) -> float:
        """A group step's bytes over a point-to-point step's (2 for fp32 buckets over a bf16 wire, and for fp16
        buckets, whose sums run in float32)."""
        def size(dtype):
            return torch.empty(0, dtype=dtype).element_size()
        summed = sum(b.numel * size(self._sum_dtype(b)) for b in buckets)
        sent = sum(b.numel * size(self.comm_dtype or b.dtype) for b in buckets)
        return summed / sent if sent else 1.0

    def _sum_dtype(self, b) -> torch.dtype:
        """A group step's dtype: the bucket's, or the wire's when that is wider; float32 instead of fp16 (whose
        sum overflows at 65504)."""
        wider = self.comm_dtype is not None and not wire_rounds(b.dtype, self.comm_dtype)
        dtype = self.comm_dtype if wider else b.dtype
        return torch.float32 if dtype == torch.float16 else dtype

    def _wire_buffer(self, b) -> torch.Tensor:
        if self.int8_wire is not None:
            return self.int8_wire.payload_buffer(b)
        return b.new_flat(self.comm_dtype or b.dtype, zero=False)

    def received(self, b, plan: MixPlan) -> List[torch.Tensor]:
        """Bucket b's receive buffers for `plan`: one per neighbour, or the group's sum."""
        if plan.group is not None:
            total = self._sums.get(b.index)
            if total is None:
                total = self._sums[b.index] = b.new_flat(self._sum_dtype(b), zero=False)
            return [total]
        bufs = self._recv[b.index]
        while len(bufs) < plan.num_buffers:
            bufs.append(self._wire_buffer(b))
        return bufs[:plan.num_buffers]

    def mixes_copies(self, plan: MixPlan) -> bool:
        """Whether `plan` mixes in difference form against the copies z sent: a lossy wire's point-to-point steps."""
        return self.lossy and plan.group is None

    def sends_copy(self, plan: MixPlan, delayed_mix: bool) -> bool:
        """Whether `plan` sends the copy z rather than the flat buffer: delayed_mix (the parameters move on for a
        whole interval), and the steps that mix the copies."""
        return delayed_mix or self.mixes_copies(plan)

    def copy_of(self, b, plan: MixPlan) -> torch.Tensor:
        """The copy z of bucket b that `plan` sent."""
        return self._sent[(b.index, plan.group is not None)]

    def send_copy(self, b, plan: MixPlan) -> torch.Tensor:
        """z <- bucket b's flat buffer, in the dtype `plan` sends (the wire's; a group step's: its sum's, as the
        kernels mix one dtype of neighbours); returns z."""
        key = (b.index, plan.group is not None)
        z = self._sent.get(key)
        if z is None:
            z = self._sent[key] = b.new_flat(self._sum_dtype(b), zero=False) if key[1] else self._wire_buffer(b)
        return z.copy_(b.flat)

    def trim(self, neighbours: int, groups: bool):
        """After an adaptive switch: keep `neighbours` receive buffers per bucket, and the group sums if `groups`."""
        for bufs in self._recv.values():
            del bufs[neighbours:]
        if not groups:
            self._sums.clear()
            for key in [k for k in self._sent if k[1]]:
                del self._sent[key]
