"""decent_comm.Decentralized: makes any torch.optim optimizer decentralized (unfused; correctness over
speed). The inner optimizer computes the local update; this wrapper adds the gossip mix around it."""

import torch

from .. import ops
from .base import DecentralizedMixin
from .fused import _split_options


class Decentralized(DecentralizedMixin, torch.optim.Optimizer):
    """Decentralized(inner_optimizer, *, topology=..., mode=..., ...) with the options of decent_comm.DAdamW.

    awc: x^{t+1} = mix(x^t) + (inner_step(x^t) - x^t); atc: x^{t+1} = mix(inner_step(x^t)).
    Disagreement tracking, replica_variance and Adaptive topologies work as in the fused optimizers (the
    disagreement comes from the separate mix kernel here).
    Param groups, lr schedulers (pass this object or the inner one) and state_dict work as usual.
    """

    def __init__(self, inner: torch.optim.Optimizer, **decentralized):
        if not isinstance(inner, torch.optim.Optimizer):
            raise TypeError(f"Decentralized wraps a torch.optim.Optimizer, got {type(inner).__name__}")
        opts = _split_options(decentralized)
        self.inner = inner
        # Share (not copy) the inner optimizer's groups and state, so schedulers and user code that touch
        # either object see the same values.
        self.defaults = inner.defaults
        self.param_groups = inner.param_groups
        self.state = inner.state
        self._optimizer_step_pre_hooks = {}
        self._optimizer_step_post_hooks = {}
        self._optimizer_state_dict_pre_hooks = {}
        self._optimizer_state_dict_post_hooks = {}
        self._optimizer_load_state_dict_pre_hooks = {}
        self._optimizer_load_state_dict_post_hooks = {}
        self._zero_grad_profile_name = "Optimizer.zero_grad#Decentralized.zero_grad"
        self._init_decentralized(**opts)

    def __repr__(self):
        return f"Decentralized({self.inner!r}, topology={self.topology.name!r}, mode={self.mode!r})"

    @torch.no_grad()
    def _step_awc(self, skip_update: bool):
        plan = self._inflight
        if plan is None or plan.step != self._t:
            plan = self._plan(self._t)
            self._launch(plan)
        deltas = []
        self._begin_disagreement()
        for b in self._buckets:
            nbs = self._wait(b, plan)
            mixed = b.flat.clone()
            ops.gossip_mix_(mixed, nbs, plan.self_weight, plan.weights, disagreement=self._dis_slot(b, 0))
            deltas.append(mixed.sub_(b.flat))
        self._end_disagreement(plan)
        measure = self._wants_step_sq(self._t + 1)
        refs = [b.flat.clone() for b in self._buckets] if measure else None
        if not skip_update:
            self.inner.step()
        if measure:
            self._step_sq = self._sum_scalars([self._sq_dist(b.flat, r) for b, r in zip(self._buckets, refs)])
        for b, delta in zip(self._buckets, deltas):
            b.flat.add_(delta)
        self._t += 1
        self._launch(self._plan(self._t))

    @torch.no_grad()
    def _step_atc(self, skip_update: bool):
        if self._pending_mix:
            self._apply_pending_mix()
        measure = self._wants_step_sq(self._t)
        refs = [b.flat.clone() for b in self._buckets] if measure else None
        if not skip_update:
            self.inner.step()
        if measure:
            self._step_sq = self._sum_scalars([self._sq_dist(b.flat, r) for b, r in zip(self._buckets, refs)])
        plan = self._plan(self._t)
        self._launch(plan)
        if plan.recv or plan.self_weight != 1.0:
            self._pending_mix = {b.index for b in self._buckets}
            self._atc_fresh = True
        self._t += 1

    def state_dict(self):
        self.synchronize()
        sd = self.inner.state_dict()
        next_plan = self._inflight if self._inflight is not None and self._inflight.step == self._t else None
        sd["decentralized"] = dict(step=self._t, next_factor=next_plan.factor if next_plan is not None else None,
                                   topology=self.topology.fingerprint(), mode=self.mode,
                                   consensus=self.consensus.state_dict() if hasattr(self.consensus, "state_dict")
                                   else None, adaptive=self._adaptive_state())
        return sd

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        extra = state_dict.pop("decentralized", None)
        self.inner.load_state_dict(state_dict)
        # torch's load_state_dict replaces the inner optimizer's param_groups (and state) by new objects: share
        # them again, or an lr scheduler attached to this wrapper would update groups the inner step never reads
        self.param_groups = self.inner.param_groups
        self.state = self.inner.state
        self._restore_schedule(extra)
