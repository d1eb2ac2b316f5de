"""torch.amp.GradScaler's protocol for the decentralized optimizers.

GradScaler.step(opt) sets ``opt.grad_scale`` (its scale; None once ``scaler.unscale_(opt)`` ran) and
``opt.found_inf`` (the sum of its per-device overflow flags) and calls ``opt.step()`` even on overflow, so a rank
that skips its update still keeps the exchange schedule in lockstep with its neighbours.

Two ways to honour it:
- in the kernel (the fused optimizers, when both are float32 one-element tensors on the parameters' device, as
  GradScaler makes them): the fused ops unscale the gradient, skip the update and count the step on the device,
  as torch's fused Adam does, so a step under GradScaler never waits for the device. The step counts then live
  on the device (``opt.state[p]["step"]``, as torch's fused Adam keeps them) and the host no longer knows them;
  it only knows which parameters had gradients at which steps, which is enough to group the parameters whose
  counts agree (``step_counts.refine_classes``);
- on the host (the wrapped torch optimizer, or scalars the kernels cannot take): read found_inf (one
  synchronization) and unscale the flat gradients before the update.
"""

import functools
from dataclasses import dataclass
from typing import List, Optional

import torch


@dataclass
class KernelAmp:
    """GradScaler's scalars as the fused ops take them (keyword arguments grad_scale / found_inf)."""

    grad_scale: Optional[torch.Tensor]
    found_inf: torch.Tensor

    def op_kwargs(self) -> dict:
        return dict(grad_scale=self.grad_scale, found_inf=self.found_inf)


def overflow_flag(found_inf, device: torch.device) -> Optional[torch.Tensor]:
    """GradScaler's found_inf as a tensor. It is the sum of the optimizer's per-device flags, which is the int 0
    when no parameter of this optimizer had a gradient on this rank (an expert no token was routed to): then a
    zero flag on `device`, so that this rank averages the same warm-up batch as the ranks that have one (it
    announced a batch without the flag, and every rank raised a mismatch) and its kernels take it as theirs do."""
    if found_inf is None or torch.is_tensor(found_inf):
        return found_inf
    return torch.full((), float(found_inf), dtype=torch.float32, device=device)


def _kernel_scalar(t, device: torch.device) -> bool:
    return torch.is_tensor(t) and t.dtype == torch.float32 and t.numel() == 1 and t.device == device


def kernel_amp(grad_scale, found_inf, devices: List[torch.device]) -> Optional[KernelAmp]:
    """The scalars for the kernels when they can read them where the parameters live (one device), else None."""
    if found_inf is None or len(set(devices)) != 1:
        return None
    device = devices[0]
    if not _kernel_scalar(found_inf, device) or not (grad_scale is None or _kernel_scalar(grad_scale, device)):
        return None
    return KernelAmp(grad_scale, found_inf)


@torch.no_grad()
def host_unscale_and_check(grad_scale, found_inf, grads: List[torch.Tensor]) -> bool:
    """The host path: True when this step's update must be skipped; else `grads` are unscaled in place."""
    if found_inf is not None and float(found_inf) != 0:  # != 0: a NaN flag skips too, as in the kernels
        return True
    unscale_(grad_scale, grads)
    return False


@torch.no_grad()
def unscale_(grad_scale, grads: List[torch.Tensor]) -> None:
    """Divides `grads` in place by GradScaler's scale (None: unscaled already), by its float64 reciprocal as
    GradScaler.unscale_ does; on the device, no host read. An inf or NaN gradient stays so."""
    if grad_scale is None:
        return
    inv = 1.0 / grad_scale.double() if torch.is_tensor(grad_scale) else 1.0 / grad_scale
    for g in grads:
        g.mul_(inv.to(g.device) if torch.is_tensor(inv) else inv)


def forgets_scaler_on_error(step):
    """step() that drops GradScaler's ``opt.grad_scale`` / ``opt.found_inf`` when it raises. GradScaler.step sets them
    before calling step() and deletes them only when it returns: after a raise they stayed, and the retried
    scaler.step multiplied its scale into the stale one (grad_scale: scale**2), so the retry unscaled the gradients
    by the square (0.1 off the warned run after one step retried under -W error, review DG); a plain opt.step()
    retry unscaled by a scale no scaler had set for it. A grad_scale set by hand (GradScaler multiplies one in) is
    dropped too when step() raises: set it again before a retry."""
    @functools.wraps(step)
    def step_forgetting_scaler(self, *args, **kwargs):
        try:
            return step(self, *args, **kwargs)
        except BaseException:
            _forget_scaler(self)
            raise
    return step_forgetting_scaler


@torch.compiler.disable  # torch 2.11's Dynamo refuses attribute changes on an optimizer (optim/step_vars.py)
def _forget_scaler(opt) -> None:
    for name in ("grad_scale", "found_inf"):
        opt.__dict__.pop(name, None)
