"""The parameters' .grad and the buckets' flat gradient buffers: gathering, zeroing, clipping.

After a step each .grad is a view of its slot in its bucket's flat gradient buffer (decent_comm.optim.buckets),
so the fused kernels read one buffer per bucket. User code may point a .grad elsewhere between steps (a hook, a
swap, autograd after zero_grad(set_to_none=True)); gather_grads copies those back in, as torch would train them.
"""

import operator
from typing import Callable, List, Optional

import torch

from .buckets import Bucket, adopt_storage, converted
from .step_counts import grads_present, segments


_is_sparse, _size, _data_ptr = operator.attrgetter("is_sparse"), torch.Tensor.size, torch.Tensor.data_ptr
_dtype, _device = operator.attrgetter("dtype"), operator.attrgetter("device")


def _is_own_view(g: torch.Tensor, view: torch.Tensor) -> bool:
    return g.data_ptr() == view.data_ptr() and g.shape == view.shape and g.stride() == view.stride()


@torch.no_grad()
def gather_grads(buckets: List[Bucket], sparse_ok: Callable[[Bucket], bool],
                 before_copy: Optional[Callable[[], None]] = None) -> None:
    """Makes the flat gradient buffers hold every parameter's current .grad.

    A .grad that is already our view costs nothing; one that user code replaced (or that autograd
    allocated after zero_grad(set_to_none=True)) is copied in, and .grad is pointed back at the view. A sparse
    gradient is densified when `sparse_ok(bucket)` (the update is the same as from its dense form), else refused.
    A parameter whose storage is no longer its bucket's is taken back or refused first (adopt_storage).
    A replaced .grad that lies in these buffers itself (a.grad, b.grad = b.grad, a.grad; b.grad = a.grad before
    a.grad = a.grad * 0.5; a.grad = a.grad.t()) is cloned before any slot is written, in every bucket: copied in
    order, an earlier slot's copy overwrote it before it was read (torch trains each parameter with what its .grad
    held when step() was called).
    A bucket whose parameters and .grad are as the last call left them (step_cache's keys) is not walked at all.
    """
    foreign = []  # (bucket, slot index, view, grad) of every .grad that is not its slot's view
    checked = []  # the buckets whose .grad were looked at one by one
    for b in buckets:
        c = b.cache
        if not c.params_unchanged():  # (step_cache: else adopt_storage would find every parameter its view)
            adopt_storage(b, before_copy, buckets)
            c.note_params()
        if c.grads_unchanged():  # every .grad is the view (or None) the last step left: nothing to copy
            continue
        checked.append(b)
        views = c.grad_views(b)
        for i, (p, view, address) in enumerate(zip(c.params, views, c.view_key[0])):
            g = p.grad
            if g is None or g is view:  # (grad_views' own, its layout checked)
                continue
            if g.is_sparse or g.data_ptr() != address or not _is_own_view(g, view):
                foreign.append((b, i, view, g))
    if foreign:
        _copy_in(buckets, foreign, sparse_ok)
    for b in checked:
        b.cache.note_grads()


def _clone_aliasing(buckets: List[Bucket], foreign: list, addresses: list) -> None:
    """Replaces each dense foreign .grad that lies in the buckets' gradient buffers (its storage is one of theirs) by
    a clone; `addresses`: their data_ptr (None: sparse). One outside every buffer's storage is not asked for its
    storage (~10x dearer than the address; a tensor of that storage starts inside it)."""
    storages = [b.grad.untyped_storage() for b in buckets]
    ours = {st.data_ptr() for st in storages}
    ranges = [(st.data_ptr(), st.data_ptr() + st.nbytes()) for st in storages]
    for k, address in enumerate(addresses):
        if address is None:
            continue
        for lo, hi in ranges:
            if lo <= address < hi:  # hi: one past the storage's last byte
                b, i, view, g = foreign[k]
                if g.untyped_storage().data_ptr() in ours:
                    foreign[k] = (b, i, view, g.clone())
                break


def _copy_in(buckets: List[Bucket], foreign: list, sparse_ok: Callable[[Bucket], bool]) -> None:
    """gather_grads' copies of the foreign .grad into their slots, every .grad pointed at its view after."""
    grads = [g for _, _, _, g in foreign]
    if not any(map(_is_sparse, grads)):
        _clone_aliasing(buckets, foreign, list(map(_data_ptr, grads)))
        grads = [g for _, _, _, g in foreign]
        if list(map(_size, grads)) == [b.cache.view_key[2][i] for b, i, _, _ in foreign] and \
                list(map(_dtype, grads)) == [b.dtype for b, _, _, _ in foreign] and \
                list(map(_device, grads)) == [b.device for b, _, _, _ in foreign]:
            # The usual case (autograd's fresh gradients after zero_grad(set_to_none=True)): one call per bucket
            # copies them, as copy_ would one by one (same dtype: the same bytes; the sources in the buffers are
            # clones).
            per_bucket = {}
            for b, _, view, g in foreign:
                per_bucket.setdefault(b.index, ([], []))
                per_bucket[b.index][0].append(view)
                per_bucket[b.index][1].append(g)
            for views, sources in per_bucket.values():
                torch._foreach_copy_(views, sources)
            for b, i, view, _ in foreign:
                b.slots[i].param.grad = view
            return
    else:
        _clone_aliasing(buckets, foreign, [None if g.is_sparse else g.data_ptr() for g in grads])
    for b, i, view, g in foreign:
        s = b.slots[i]
        if g.is_sparse:
            if not sparse_ok(b):
                raise RuntimeError(f"decent_comm: this optimizer does not support sparse gradients (parameter "
                                   f"{s.label}, shape {tuple(s.param.shape)}), as torch.optim.Adam(W) "
                                   "does not, nor SGD or Adagrad with weight_decay; use dense gradients (e.g. "
                                   "nn.Embedding(sparse=False)) or DSGD without weight decay")
            g = g.to_dense()
        if g.shape != s.param.shape:
            raise RuntimeError(f"decent_comm: parameter {s.label}: its gradient has shape "
                               f"{tuple(g.shape)} but the parameter has {tuple(s.param.shape)}")
        view.copy_(g)
        s.param.grad = view


def zero_grads(buckets: List[Bucket], set_to_none: bool) -> None:
    """zero_grad: one fill of each flat buffer instead of a kernel per parameter. A model converted after the
    optimizer was built is refused here as in step() (its .grad could not point at the buffer's dtype), before
    anything is written."""
    if set_to_none:
        for b in buckets:
            for s in b.slots:
                s.param.grad = None
            b.cache.note_grads()
        return
    for b in buckets:
        if b.cache.params_unchanged():  # every parameter as adopt_storage last found it: none converted
            continue
        for i, s in enumerate(b.slots):
            error = converted(b, i) if s.param.grad is not None else None
            if error is not None:
                raise error
    for b in buckets:
        b.grad.zero_()
        for p, view in zip(b.cache.params, b.cache.grad_views(b)):
            if p.grad is not None:
                p.grad = view
        b.cache.note_grads()


@torch.no_grad()
def clip_grad_norm(buckets: List[Bucket], max_norm: float, norm_type: float,
                   sparse_ok: Callable[[Bucket], bool]) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ over the buckets' flat gradients (parameters without one are ignored): the
    norm of the parameters' norms, each gradient scaled by min(1, max_norm / (norm + 1e-6))."""
    max_norm, norm_type = float(max_norm), float(norm_type)  # as torch does: "inf", True, a 0-d tensor are taken
    gather_grads(buckets, sparse_ok)
    norms = []
    for b in buckets:
        if norm_type > 0:
            # One norm per run of parameters (usually the whole bucket): the alignment padding's zeros between them
            # add nothing to a positive order's sum, nor to inf's maximum.
            norms.extend(torch.linalg.vector_norm(b.grad[seg.start:seg.stop], norm_type)
                         for seg in segments(b, [0] * len(b.slots), b.cache.has) if seg.has_grad)
        else:
            # Negative orders and -inf: a padding zero collapses the norm to 0 (1/|0|^p is inf; -inf's minimum). 0:
            # torch's 0-"norm" of the norms counts the parameters whose gradient is not all zero, not runs of them.
            # So each parameter's own elements are measured, as torch measures each .grad.
            views = [v for v, has in zip(b.cache.grad_views(b), grads_present(b)) if has]
            norms.extend(torch._foreach_norm(views, norm_type) if views else ())
    if not norms:
        return torch.tensor(0.0)
    total = torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]), norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for b in buckets:
        # the coefficient in the total's dtype, as torch multiplies it (a bfloat16 bucket among float32 ones: the
        # float32 coefficient, not its bfloat16 rounding)
        b.grad.mul_(coef.to(b.grad.device))
    return total
