"""The all-reduce warm-up (``warmup_steps``): the first steps average the gradients over the ranks, DDP's update,
so the replicas start identical and stay so (as torch's PostLocalSGDOptimizer); under GradScaler each rank's
gradient is unscaled by its own scale first, since the ranks' scales part after an overflow on some. Blocking
whole-group all-reduces through the schedule's BoundedAllReduce, announced first (agreement.announce), since a rank
out of step would pair them with another call's."""

from typing import Optional

import torch

from ..exchange import ranks_text
from .agreement import announce
from .amp import unscale_
from .replica_watch import all_reduce_mean_
from .tracing import traced


class WarmupAverage:
    def __init__(self, buckets, all_reduce, world_size: int, device: torch.device, check_finite: bool, cadence):
        self.buckets, self.all_reduce, self.world_size = buckets, all_reduce, world_size
        self.device, self.check_finite, self.cadence = device, check_finite, cadence
        self._evaluations = (None, 1)  # (step, the closure evaluations averaged in it so far): for culprits()

    @traced("warmup_allreduce")
    @torch.no_grad()
    def average(self, step: int, found_inf: Optional[torch.Tensor], evaluation: Optional[int] = None,
                grad_scale=None):
        """Replaces every bucket's gradient by the mean over the ranks: one all-reduce per bucket, plus one of the
        count of the ranks that have each gradient, and one of `found_inf` so every rank skips an overflow together.

        DDP(find_unused_parameters=True)'s update: a parameter this rank did not use (.grad None) adds a zero
        gradient, not what its slot of the flat buffer still holds from an earlier step, and takes the mean like
        every rank (.grad set), so the replicas stay identical; one no rank used keeps no gradient.

        `evaluation`: the wrapped optimizer's closure evaluation of this step (Decentralized(LBFGS) averages after
        each), announced with it, so that ranks evaluating it unequally often are told so.

        `grad_scale`: GradScaler's scale of this rank (opt.grad_scale; None once unscale_ ran), undone before the
        average, which is then unscaled (the caller must not unscale again). Each scaler backs off from its own
        overflow flag, so after an overflow on some ranks the scales differ: averaged scaled, s*g0 + s/2*g1 was
        unscaled by each rank's own scale and the replicas parted (consensus distance 5e-4 after one overflow).
        The mean of the unscaled gradients is DDP's update, which all-reduces under a scale every rank shares."""
        slots = [(b, s) for b in self.buckets for s in b.slots]
        absent = [k for k, (_, s) in enumerate(slots) if s.param.grad is None]
        scaler = [found_inf.numel()] if found_inf is not None else []
        what = "the warm-up gradient average" + (" with GradScaler's overflow flag" if scaler else "")
        announce(self.all_reduce, what, step, [len(slots)] + [b.grad.numel() for b in self.buckets] + scaler,
                 evaluation)
        self._evaluations = (step, evaluation or 1)
        if self.check_finite and not all(torch.isfinite(b.grad).all() for b in self.buckets):
            # the average cannot tell whose it was (culprits()); flagged per evaluation, as a later one's gradients
            # are non-finite on every rank once an earlier one's average carried them
            self.all_reduce.flag(f"nonfinite-gradient/{step}/{evaluation or 1}")
        used = torch.ones(len(slots), dtype=torch.float32, device=self.device)
        if absent:
            used[absent] = 0
        self.all_reduce(used, "the warm-up's count of the ranks that have each gradient")
        for k in absent:
            b, s = slots[k]
            b.view(b.grad, s).zero_()
        unscale_(grad_scale, [b.grad for b in self.buckets])
        for b in self.buckets:  # bf16/fp16 gradients summed in float32 (an fp16 sum overflows at 65504)
            all_reduce_mean_(b.grad, self.all_reduce, self.world_size,
                             f"the warm-up gradient average of bucket {b.index}")
        if absent:  # else nothing to learn from the counts: no host read of them
            used_anywhere = (used > 0).tolist()
            given = set()
            for k in absent:
                if used_anywhere[k]:
                    b, s = slots[k]
                    s.param.grad = b.view(b.grad, s)
                    given.add(b.index)
            for b in self.buckets:  # the rest of the step reads which parameters have a gradient from the cache
                if b.index in given:
                    b.cache.note_grads()
        if found_inf is not None:
            self.all_reduce(found_inf, "the warm-up's overflow flag (found_inf)")

    def culprits(self, step: Optional[int]) -> str:
        """For check_finite's message after step `step`, when a warm-up step: the ranks whose own gradients were
        non-finite (every rank's parameters are, once the average carried them); "" otherwise. With several
        closure evaluations in the step, those of the first evaluation any rank flagged: at the later ones every
        rank's gradients are non-finite, computed at the parameters the carried values made non-finite (LBFGS
        named every rank)."""
        if step is None or not self.cadence.in_warmup(step):
            return ""
        last, evaluations = self._evaluations
        for evaluation in range(1, (evaluations if last == step else 1) + 1):  # store look-ups on this path only
            ranks = self.all_reduce.flagged(f"nonfinite-gradient/{step}/{evaluation}")
            if ranks:
                return (", a warm-up step whose gradient average carried the non-finite gradients of "
                        f"{ranks_text(ranks)}")
        return ""
