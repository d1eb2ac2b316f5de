"""Hyper-parameters for a decentralized Adam-family run, translated from an all-reduce AdamW configuration.

Why the lr changes: all-reduce AdamW divides each coordinate by the root of the second moment of the n-rank
mean gradient. A decentralized rank divides by the second moment of its *own* gradient, which, once gradient
noise dominates the signal, is up to n times larger; each rank's step, and so their average, is up to sqrt(n)
times shorter, as if the run had a lower lr. Multiplying the lr by sqrt(n) gives it back. AccumAdam builds its
second moment from the mean gradient of a window of `accum_steps` steps, which already removes a factor
accum_steps of the noise: its factor is sqrt(n / accum_steps) (never below 1).

Why AccumAdam's betas change: they act once per window, so with the per-step values the moments remember
accum_steps times more steps than AdamW's; raising them to the power accum_steps keeps the memory in steps.

Measured on train_lm (docs/quality_results.md): with these rules and a 30% warmup, DAdamW and AccumAdamW in ATC
mode land within 2% of the all-reduce AdamW run at equal steps (4 and 8 ranks); without them DAdamW trails by
5-6% (4 ranks).
"""

import math
import sys
from typing import Optional, Tuple

from .._args import integer, is_real, real


def decentralized_adam_hparams(lr: float, world_size: Optional[int] = None, betas: Tuple[float, float] = (0.9, 0.999),
                               accum_steps: int = 1) -> dict:
    """lr and betas for DAdam(W) (accum_steps=1) or AccumAdam(W) (accum_steps=K) next to an all-reduce
    AdamW run at (`lr`, `betas`) on `world_size` ranks (default: the default process group's size). The dict holds
    `lr` and `betas` only: pass AccumAdamW the same K as its own `accum_steps` (default 4).

        opt = decent_comm.DAdamW(model.parameters(), **decentralized_adam_hparams(3e-4), topology="one-peer-exp")
    """
    if world_size is None:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("decentralized_adam_hparams: pass world_size, or initialize the default process group")
        world_size = dist.get_world_size()
    where = "decentralized_adam_hparams"
    world_size = integer(world_size, "world_size", low=1, where=where)
    k = integer(accum_steps, "accum_steps", low=1, where=where)
    # a one-element tensor lr or beta is taken as the optimizers take it, and comes back a tensor (lr * scale,
    # beta ** k), as before the shared check: the result is passed to them, which keep tensor options as given
    checked = real(lr, "lr", low=0, low_open=True, tensor=True, where=where)
    lr = lr if _is_tensor(lr) else checked
    if not _two_betas(betas):
        raise ValueError(f"{where}: betas must be two numbers in [0, 1), got {betas!r}")
    return {"lr": lr * math.sqrt(max(1.0, world_size / k)), "betas": (betas[0] ** k, betas[1] ** k)}


def _is_tensor(value) -> bool:
    torch = sys.modules.get("torch")  # this module does not import torch: a tensor exists only once it is imported
    return torch is not None and isinstance(value, torch.Tensor)


def _two_betas(betas) -> bool:
    """Two real numbers (one-element tensors too) in [0, 1): a pair, a numpy array or a tensor of two."""
    try:
        if isinstance(betas, str) or len(betas) != 2:
            return False
    except TypeError:  # no len(): a number, a 0-d tensor or array
        return False
    return all(is_real(b, tensor=True) and 0.0 <= float(b) < 1.0 for b in betas)
