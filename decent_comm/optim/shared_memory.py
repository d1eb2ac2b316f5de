"""Parameters whose memory is shared, checked before the buckets copy them apart: torch.optim updates a parameter's
memory in place, seen through every tensor over it, while each slot of a bucket is a copy of its own. Shared by two
parameters (or within one): refused. Shared with another tensor, the one a parameter was sliced from: warned, as that
tensor keeps the old memory (as after p.data = t), which is all it can read."""

import sys
import warnings
import weakref
from typing import List

import torch


def check_no_shared_memory(params: List[torch.Tensor]) -> None:
    """Refuses parameters whose elements share memory, with each other (two Parameters over one tensor) or within
    one (an expanded, stride-0 tensor): torch.optim updates shared memory once per parameter through it (or refuses
    the in-place write), while each slot of a bucket would be a copy of its own, the tensor they shared left behind.
    (A Parameter used by several modules, weight tying, is one parameter and fine; so are disjoint views of one
    tensor, column halves included.)"""
    spans = []
    for i, p in enumerate(params):
        if p.numel() == 0 or p.device.type == "meta":
            continue
        if any(st == 0 and sz > 1 for sz, st in zip(p.shape, p.stride())):
            raise ValueError(f"parameter {i} (shape {tuple(p.shape)}, strides {p.stride()}) refers to some of its "
                             "memory more than once (an expanded tensor): torch.optim cannot update it in place either;"
                             " make it a tensor of its own (.contiguous()) before building the optimizer")
        start = p.untyped_storage().data_ptr() + p.storage_offset() * p.element_size()
        spans.append((start, start + _extent(p) * p.element_size(), i, p))
    spans.sort(key=lambda span: span[:3])
    active = []  # the spans still open at the current start: only these can share elements with it
    for lo, hi, i, p in spans:
        active = [a for a in active if a[1] > lo]
        for _, _, j, q in active:
            if _share_elements(p, q):
                (i, shape), (j, shape2) = sorted([(i, tuple(p.shape)), (j, tuple(q.shape))])
                raise ValueError(f"parameters {i} and {j} (shapes {shape} and {shape2}) share memory: the optimizer "
                                 "lays each parameter out in a flat buffer of its own, so the tensor they share would "
                                 "no longer be updated. Tie weights by using one Parameter object in both places, not "
                                 "two Parameters over one tensor")
        active.append((lo, hi, i, p))


def _extent(t: torch.Tensor) -> int:
    """Elements from t's first to its last in memory (its strides are >= 0)."""
    return 1 + sum((sz - 1) * st for sz, st in zip(t.shape, t.stride()))


#: The span (elements) up to which two strided parameters whose spans overlap are compared element by element
#: (a mask of that many bytes); beyond it they are taken to share memory.
_EXACT_SPAN = 1 << 26


def _share_elements(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `a` and `b`, whose address spans overlap, have an element in common (column halves of one matrix
    do not)."""
    if a.device != b.device:  # other memories, whatever their addresses
        return False
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr() or a.dtype != b.dtype:
        return True  # two storages over one memory (from_numpy twice), or one read as two dtypes
    lo = min(a.storage_offset(), b.storage_offset())
    span = max(t.storage_offset() + _extent(t) for t in (a, b)) - lo
    if span > _EXACT_SPAN:
        return True
    index = torch.arange(span, dtype=torch.int64)
    mask = torch.zeros(span, dtype=torch.bool)
    mask[index.as_strided(a.shape, a.stride(), a.storage_offset() - lo)] = True
    return bool(mask[index.as_strided(b.shape, b.stride(), b.storage_offset() - lo)].any())


#: the parameters a warning names (of a model loaded over one kept buffer there could be thousands)
_NAMED = 4
#: id -> the flat parameter buffer of a live optimizer's bucket. Weakly: a dropped optimizer's memory is freed.
_BUCKET_MEMORY = weakref.WeakValueDictionary()


def note_bucket_memory(flat: torch.Tensor) -> None:
    """`flat` holds parameters of a bucket: a later optimizer over them (rebuilt with other options) moves them out of
    it, which is the earlier optimizer's memory, not the user's (warn_aliased_storage)."""
    _BUCKET_MEMORY[id(flat)] = flat


def warn_aliased_storage(param_groups: List[dict]) -> None:
    """Warns (one UserWarning) of the parameters whose storage holds more bytes than they span while a tensor other
    than this optimizer's parameters holds that storage: the tensor a parameter was sliced from (base[:4]), the
    buffer it was loaded into and kept. The buckets move each parameter into a flat buffer of its own, so that
    tensor no longer sees the updates, where torch.optim's in-place updates reach it. A storage held by the
    parameters alone is no one else's: cuDNN's RNN weights (views of one buffer it discards), a slice of a
    temporary; nor is an earlier optimizer's bucket (note_bucket_memory), that of an optimizer rebuilt over the
    model. A view of a parameter's own size (emb.detach().t()) has nothing that tells it from the parameter here:
    docs/api.md says to read parameters through their Parameter. Meta and empty parameters have no memory to miss."""
    found, on_storage = [], {}
    buckets = {t.untyped_storage()._cdata for t in list(_BUCKET_MEMORY.values())}
    for gi, group in enumerate(param_groups):
        for j, p in enumerate(group["params"]):
            if p.numel() == 0 or p.device.type == "meta" or p.untyped_storage()._cdata in buckets:
                continue
            storage = p.untyped_storage()
            on_storage[storage._cdata] = on_storage.get(storage._cdata, 0) + 1
            if storage.nbytes() > _extent(p) * p.element_size():
                found.append((gi, j, p, storage._cdata))
    found = [f for f in found if _held_elsewhere(f[2], on_storage[f[3]])]
    if not found:
        return
    several = len(param_groups) > 1
    named = [f"parameter {j}{f' of param group {gi}' if several else ''} (shape {tuple(p.shape)}: "
             f"{_extent(p) * p.element_size()} bytes of a storage of {p.untyped_storage().nbytes()})"
             for gi, j, p, _ in found[:_NAMED]]
    more = f" and {len(found) - _NAMED} more" if len(found) > _NAMED else ""
    warnings.warn(
        f"decent_comm: {', '.join(named)}{more} {'is a view' if len(found) == 1 else 'are views'} into larger memory "
        "that another tensor holds (the tensor it was sliced from, a buffer it was loaded into): the optimizer "
        "moves each parameter into its flat buffer, so that tensor and its other views no longer see the updates "
        "(as after p.data = t). Read parameters through their Parameter (or module); .clone() the parameter before "
        "building the optimizer (nn.Parameter(base[:4].clone())) to silence this warning",
        UserWarning, stacklevel=_caller_level())


def _held_elsewhere(p: torch.Tensor, parameters: int) -> bool:
    """Whether a tensor other than the `parameters` of this optimizer over p's storage holds that storage: its use
    count, less what one tensor's reads as (the Python storage object kept with it adds its own), above theirs.
    Where torch does not tell the count, any may: True."""
    try:
        count, probe = torch._C._storage_Use_Count, torch.empty(1)  # the probe alive: its storage is counted
        one = count(probe.untyped_storage()._cdata)
        return count(p.untyped_storage()._cdata) - (one - 1) > parameters
    except (AttributeError, RuntimeError, TypeError):
        return True


def _caller_level() -> int:
    """The stacklevel of the first frame outside decent_comm: the line that built the optimizer."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_globals.get("__name__", "").startswith("decent_comm"):
        frame, level = frame.f_back, level + 1
    return level
