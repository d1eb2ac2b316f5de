"""The parameters' .grad and the buckets' flat gradient buffers: gathering, zeroing, clipping.

After a step each .grad is a view of its slot in its bucket's flat gradient buffer (decent_comm.optim.buckets),
so the fused kernels read one buffer per bucket. User code may point a .grad elsewhere between steps (a hook, a
swap, autograd after zero_grad(set_to_none=True)); gather_grads copies those back in, as torch would train them.
"""

from typing import Callable, List, Optional

import torch

from .buckets import Bucket, adopt_storage, converted, segments


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
    """
    foreign = []  # (bucket, slot index, view, grad) of every .grad that is not its slot's view
    for b in buckets:
        adopt_storage(b, before_copy, buckets)
        for i, s in enumerate(b.slots):
            g = s.param.grad
            if g is None:
                continue
            view = b.view(b.grad, s)
            if g.is_sparse or not _is_own_view(g, view):
                foreign.append((b, i, view, g))
    if not foreign:
        return
    buffers = {b.grad.untyped_storage().data_ptr() for b in buckets}
    for k, (b, i, view, g) in enumerate(foreign):
        if not g.is_sparse and g.untyped_storage().data_ptr() in buffers:
            foreign[k] = (b, i, view, g.clone())
    for b, i, view, g in foreign:
        s = b.slots[i]
        if g.is_sparse:
            if not sparse_ok(b):
                raise RuntimeError(f"decent_comm: this optimizer does not support sparse gradients (parameter {i}"
                                   f" of bucket {b.index}, shape {tuple(s.param.shape)}), as torch.optim.Adam(W) "
                                   "does not, nor SGD or Adagrad with weight_decay; use dense gradients (e.g. "
                                   "nn.Embedding(sparse=False)) or DSGD without weight decay")
            g = g.to_dense()
        if g.shape != s.param.shape:
            raise RuntimeError(f"decent_comm: parameter {i} of bucket {b.index}: its gradient has shape "
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
        return
    for b in buckets:
        for i, s in enumerate(b.slots):
            error = converted(b, i) if s.param.grad is not None else None
            if error is not None:
                raise error
    for b in buckets:
        b.grad.zero_()
        for s in b.slots:
            if s.param.grad is not None:
                s.param.grad = b.view(b.grad, s)


@torch.no_grad()
def clip_grad_norm(buckets: List[Bucket], max_norm: float, norm_type: float,
                   sparse_ok: Callable[[Bucket], bool]) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ over the buckets' flat gradients (parameters without one are ignored)."""
    gather_grads(buckets, sparse_ok)
    norms = []
    for b in buckets:
        for seg in segments(b, [0] * len(b.slots)):
            if seg.has_grad:
                norms.append(torch.linalg.vector_norm(b.grad[seg.start:seg.stop], norm_type))
    if not norms:
        return torch.tensor(0.0)
    total = torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]), norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for b in buckets:
        b.grad.mul_(coef.to(b.grad.device, b.grad.dtype))
    return total
