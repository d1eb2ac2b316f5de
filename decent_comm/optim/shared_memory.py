"""Parameters that share memory are refused before the buckets copy them apart: torch.optim updates memory that two
Parameters share through each of them, while each slot of a bucket is a copy of its own."""

from typing import List, Optional, Tuple

import torch


def labelled_params(param_groups: List[dict]) -> List[Tuple[str, torch.Tensor]]:
    """Each parameter with the name errors give it: its place in `param_groups`, the user's order ("3", or "3 of param
    group 1" where there are several groups). The buckets' order differs where a group mixes dtypes or devices, so
    their indices would name other parameters than the user's."""
    several = len(param_groups) > 1
    return [(f"{j} of param group {gi}" if several else str(j), p)
            for gi, group in enumerate(param_groups) for j, p in enumerate(group["params"])]


def check_no_shared_memory(param_groups: List[dict]) -> None:
    """Refuses parameters whose elements share memory, with each other (two Parameters over one tensor) or within
    one (an expanded, stride-0 tensor): torch.optim updates shared memory once per parameter through it (or refuses
    the in-place write), while each slot of a bucket would be a copy of its own, the tensor they shared left behind.
    (A Parameter used by several modules, weight tying, is one parameter and fine; so are disjoint views of one
    tensor, column halves included.) Parameters are named as labelled_params() names them."""
    labelled = labelled_params(param_groups)

    def name(i: int) -> str:
        return labelled[i][0]

    spans = []
    for i, (_, p) in enumerate(labelled):
        if p.numel() == 0 or p.device.type == "meta":
            continue
        if _overlaps_itself(p):
            raise ValueError(f"parameter {name(i)} (shape {tuple(p.shape)}, strides {p.stride()}) refers to some of "
                             "its memory more than once (an expanded or self-overlapping as_strided tensor): "
                             "torch.optim cannot update it in place either, or updates the shared elements once per "
                             "index; make it a tensor of its own (.contiguous()) before building the optimizer")
        start = p.untyped_storage().data_ptr() + p.storage_offset() * p.element_size()
        spans.append((start, start + _extent(p) * p.element_size(), i, p))
    spans.sort(key=lambda span: span[:3])
    active = []  # the spans still open at the current start: only these can share elements with it
    for lo, hi, i, p in spans:
        active = [a for a in active if a[1] > lo]
        for _, _, j, q in active:
            if _share_elements(p, q):
                (i, shape), (j, shape2) = sorted([(i, tuple(p.shape)), (j, tuple(q.shape))])
                raise ValueError(f"parameters {name(i)} and {name(j)} (shapes {shape} and {shape2}) share memory: the "
                                 "optimizer lays each parameter out in a flat buffer of its own, so the tensor they "
                                 "share would no longer be updated. Tie weights by using one Parameter object in both "
                                 "places, not two Parameters over one tensor")
        active.append((lo, hi, i, p))


def _overlaps_itself(t: torch.Tensor) -> bool:
    """Whether two indices of `t` reach one element. Stride 0 was the only case looked for, and as_strided((4, 4),
    (2, 1)) over 10 elements went into a bucket as 16 independent ones (a shared element updated once where
    torch.optim updates it through each index). Fast and sufficient first: the dimensions sorted by stride, each
    stride past the extent of the smaller ones (contiguous, permuted, channels_last and sliced tensors all pass);
    only a layout failing it (an interleaving: shape (3, 2), strides (2, 3) reaches 0, 3, 2, 5, 4, 7, no offset
    twice) has every element's offset computed and counted."""
    dims = sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz > 1)
    reach = 0  # the largest offset the dimensions so far add
    for st, sz in dims:
        if st <= reach:
            break
        reach += st * (sz - 1)
    else:
        return False
    if any(st == 0 for st, _ in dims):
        return True
    offsets = torch.zeros((), dtype=torch.int64)
    for st, sz in dims:
        offsets = offsets.unsqueeze(-1) + torch.arange(sz, dtype=torch.int64) * st
    return offsets.unique().numel() != t.numel()


def _extent(t: torch.Tensor) -> int:
    """Elements from t's first to its last in memory (its strides are >= 0)."""
    return 1 + sum((sz - 1) * st for sz, st in zip(t.shape, t.stride()))


#: Nodes of the exact search (_common_offsets) before it gives up on a pair, and the span (elements) up to which a
#: pair it gave up on is compared element by element instead (a mask of that many bytes); beyond both the pair is
#: taken to share memory and refused (strides no layout of one tensor has: not met in practice).
_SEARCH_NODES = 100_000
_EXACT_SPAN = 1 << 26


def _common_offsets(a: torch.Tensor, b: torch.Tensor) -> Optional[bool]:
    """Whether some index i of `a` and j of `b` reach one element: a.offset + sum(i_k a.stride_k) == b.offset +
    sum(j_k b.stride_k), an integer equation solved exactly: terms of equal stride merge into one variable (i - j for
    the matching dimensions of two slices of one tensor), and a depth-first search over the strides, largest first,
    keeps only the values that leave a remainder the smaller strides can still make up. Slices of one tensor take
    a node or two per dimension. None: the search ran past _SEARCH_NODES (strides no layout of one tensor has)."""
    ranges = {}  # stride -> [lowest, highest] multiple of it
    for t, sign in ((a, 1), (b, -1)):
        for size, stride in zip(t.shape, t.stride()):
            if size > 1 and stride > 0:
                lo, hi = ranges.get(stride, (0, 0))
                ranges[stride] = (lo, hi + size - 1) if sign > 0 else (lo - (size - 1), hi)
    terms = sorted(((st, lo, hi) for st, (lo, hi) in ranges.items()), reverse=True)
    low, high = [0] * (len(terms) + 1), [0] * (len(terms) + 1)  # what the terms from k on can sum to
    for k in range(len(terms) - 1, -1, -1):
        st, lo, hi = terms[k]
        low[k], high[k] = low[k + 1] + st * lo, high[k + 1] + st * hi
    nodes = 0

    def reach(k: int, rest: int) -> bool:
        nonlocal nodes
        nodes += 1
        if nodes > _SEARCH_NODES:
            raise OverflowError
        if k == len(terms):
            return rest == 0
        st, lo, hi = terms[k]
        first = max(lo, -(-(rest - high[k + 1]) // st))  # ceil((rest - high[k+1]) / st)
        last = min(hi, (rest - low[k + 1]) // st)
        return any(reach(k + 1, rest - v * st) for v in range(first, last + 1))

    try:
        return reach(0, b.storage_offset() - a.storage_offset())
    except OverflowError:
        return None


def _share_elements(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `a` and `b`, whose address spans overlap, have an element in common (column halves of one matrix
    do not)."""
    if a.device != b.device:  # other memories, whatever their addresses
        return False
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr() or a.dtype != b.dtype:
        return True  # two storages over one memory (from_numpy twice), or one read as two dtypes
    common = _common_offsets(a, b)
    if common is not None:
        return common
    lo = min(a.storage_offset(), b.storage_offset())
    span = max(t.storage_offset() + _extent(t) for t in (a, b)) - lo
    if span > _EXACT_SPAN:
        return True
    index = torch.arange(span, dtype=torch.int64)
    mask = torch.zeros(span, dtype=torch.bool)
    mask[index.as_strided(a.shape, a.stride(), a.storage_offset() - lo)] = True
    return bool(mask[index.as_strided(b.shape, b.stride(), b.storage_offset() - lo)].any())
