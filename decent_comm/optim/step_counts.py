"""The buckets' step counts and the runs of slots one fused kernel call may update together.

A bucket's slots usually share one step count and all have gradients, so one kernel call spans the bucket. When some
parameters missed gradients in earlier steps, or have none now, the bucket splits into segments of equal (has a
gradient, step count); once the kernels keep the counts on the device (GradScaler: decent_comm.optim.amp) the host
tracks which slots' counts are equal (Bucket.classes) instead of reading them.
"""
from dataclasses import dataclass
from typing import List, Optional

import torch

from .buckets import Bucket


@dataclass
class Segment:
    """A run of consecutive parameters of one bucket that share (has a gradient, step count)."""

    start: int
    stop: int
    has_grad: bool
    step: int    # the slots' key: the step count (or the count class, see Bucket.classes)
    first: int   # the slots it spans: first .. last
    last: int



def segments(b: Bucket, steps: List[int], has: Optional[List[bool]] = None) -> List[Segment]:
    """Splits a bucket into runs over which one fused kernel call is valid. `steps[i]` is slot i's
    step count (it differs only when some parameters missed gradients in earlier steps); `has[i]`: whether its
    parameter has a gradient (read from the parameters when not given). Usually one segment spans the whole
    bucket."""
    if has is None:
        has = [s.param.grad is not None for s in b.slots]
    out: List[Segment] = []
    for i, s in enumerate(b.slots):
        start = s.offset
        stop = s.offset + s.numel
        if out and out[-1].has_grad == has[i] and out[-1].step == steps[i]:
            out[-1].stop = stop
            out[-1].last = i
        else:
            if out:
                # padding between parameters goes with the previous run
                out[-1].stop = start
            out.append(Segment(start, stop, has[i], steps[i], i, i))
    if out:
        out[0].start = 0
        out[-1].stop = b.numel
    return out


def grads_present(b: Bucket) -> List[bool]:
    """Per slot, whether its parameter has a gradient: within a step, as gather_grads found it (StepCache.has)."""
    return b.cache.has if b.cache.has is not None else [s.param.grad is not None for s in b.slots]


def step_segments(b: Bucket) -> List[Segment]:
    """segments(b, b.count_keys) for this step's update, with the gradients gather_grads found. When every parameter
    has one and the host counts are known all equal (nothing wrote them since they were found so: step_cache), the
    one segment that spans the bucket, without reading the counts."""
    c = b.cache
    has = grads_present(b)
    if b.classes is None and c.has is not None and c.all_have:
        k = c.uniform_count(b.step_count)
        if k is not None:
            return [Segment(0, b.numel, True, k, 0, len(b.slots) - 1)]
    out = segments(b, b.count_keys, has)
    if b.classes is None and len(out) == 1 and out[0].has_grad:  # every count is out[0].step
        c.note_counts(out[0].step)
    return out


def count_steps(b: Bucket) -> None:
    """One optimizer step was taken for every parameter of `b` that has a gradient (grads_present)."""
    has = grads_present(b)
    b.template = False
    if all(has):
        k = b.cache.uniform_count(b.step_count)
        b.step_count.add_(1)
        b.cache.note_counts(None if k is None else k + 1)  # (a float32 count stays at 2^24: uniform_count says so)
    else:
        b.step_count.add_(torch.tensor(has, dtype=torch.float32))
        b.cache.note_counts(None)


def count_classes(keys) -> List[int]:
    """Per slot, the index of its key among the distinct keys in order of first appearance: slots with equal keys
    (step counts, or histories of updates) get equal ids."""
    ids = {}
    return [ids.setdefault(k, len(ids)) for k in keys]


def refine_classes(b: Bucket) -> None:
    """After a step whose update the kernels may have skipped (found_inf, on the device): every slot with a
    gradient (grads_present) was updated, or none was. So slots that agreed before and agree on having had a
    gradient agree now."""
    b.classes = count_classes(zip(b.classes, grads_present(b)))
    b.template = False


def count_on_device(b: Bucket, state) -> None:
    """From now on the kernels keep `b`'s step counts (on the bucket's device, read and advanced there)."""
    if b.classes is not None:
        return
    b.classes = count_classes(b.steps)  # the counts are still on the host here: no device sync
    b.step_count = b.step_count.to(b.device)
    b.published = [dict(v, step=b.step_count[i]) if v else v for i, v in enumerate(b.published)]
    for s, views in zip(b.slots, b.published):
        if views:
            state[s.param]["step"] = views["step"]


def spread_count(b: Bucket, seg: Segment) -> None:
    """The kernel advanced the count of the segment's first slot: the others of the segment take it."""
    if seg.last > seg.first:
        b.step_count[seg.first + 1: seg.last + 1].copy_(b.step_count[seg.first])
