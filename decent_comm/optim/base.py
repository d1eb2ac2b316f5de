"""The machinery every decentralized optimizer shares: flat buckets, the gossip schedule and its exchange,
AWC/ATC step orchestration, forward pre-hooks, state_dict, and the collective utilities.

Semantics (t counts optimizer steps from 0; W'(t) = (1 - a_t) I + a_t W(t)):
  awc  x_i^{t+1} = sum_j W'_ij(t) x_j^t - lr * d_i^t          (one fused kernel per bucket; the exchange
       of x^{t+1} is launched at the end of step t and overlaps the whole next forward and backward)
  atc  x_i^{t+1} = sum_j W'_ij(t) (x_j^t - lr * d_j^t)         (local update, exchange, then the mix: in a
       forward pre-hook of the first module using each bucket when `model` is given, else at the next step)
"""

import contextlib
import logging
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from .. import ops
from .buckets import Bucket, build_buckets, gather_grads, segments, zero_grads
from .gossip import consensus_factor, distributed_context, make_exchanger, mix_plan, resolve_topology

log = logging.getLogger("decent_comm")

MODES = ("awc", "atc")


class DecentralizedMixin:
    """Mixed into a torch.optim.Optimizer subclass. The subclass implements `_local_update(bucket, seg_slice,
    group, step, neighbors, self_weight, weights)`, one fused kernel call over a slice of a bucket."""

    # GradScaler then calls step() even on overflow (passing grad_scale / found_inf), so a rank that skips
    # its update still keeps the exchange schedule in lockstep with its neighbours.
    _step_supports_amp_scaling = True

    def _init_decentralized(self, *, topology, mode, process_group, bucket_cap_mb, comm_dtype, consensus, model,
                            broadcast_init, timeout):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.mode = mode
        self.process_group = process_group
        self.rank, self.world_size = distributed_context(process_group)
        self.topology = resolve_topology(topology, self.world_size)
        self.consensus = consensus
        consensus_factor(consensus, 0, self.param_groups[0]["lr"])  # validate early
        self.comm_dtype = comm_dtype
        self._buckets: List[Bucket] = build_buckets(self.param_groups, bucket_cap_mb)
        self._t = 0                      # optimizer steps taken (the topology phase)
        self._inflight = None            # MixPlan of the exchange in flight (awc: of x^t; atc: of x^{t+1/2})
        self._pending_mix: set = set()   # atc: buckets received but not yet mixed
        self._resume_factor = None       # consensus factor of step _t restored from a checkpoint
        self._recv: Dict[int, List[torch.Tensor]] = {b.index: [] for b in self._buckets}
        self._hooks = []
        self._exchanger = None
        if self.world_size > 1:
            self._verify_replicas()
            if broadcast_init:
                self._broadcast_from_rank0()
            device = self._buckets[0].device if self._buckets else torch.device("cpu")
            self._exchanger = make_exchanger(process_group, device, timeout, comm_dtype)
        if model is not None:
            self._register_forward_hooks(model)

    # ------------------------------------------------------------------------------------------ start-up

    def _verify_replicas(self):
        """Every rank must hold the same parameter shapes/dtypes and topology; report who differs."""
        mine = dict(
            params=[(tuple(s.param.shape), str(s.param.dtype)) for b in self._buckets for s in b.slots],
            fingerprint=self.topology.fingerprint(), mode=self.mode, optimizer=type(self).__name__,
        )
        everyone = [None] * self.world_size
        dist.all_gather_object(everyone, mine, group=self.process_group)
        ref = everyone[0]
        for r, other in enumerate(everyone):
            if other == ref:
                continue
            if len(other["params"]) != len(ref["params"]):
                what = f"{len(other['params'])} parameters but rank 0 has {len(ref['params'])}"
            elif other["params"] != ref["params"]:
                i = next(i for i, (a, b) in enumerate(zip(other["params"], ref["params"])) if a != b)
                what = f"parameter {i} is {other['params'][i]} but on rank 0 it is {ref['params'][i]}"
            elif other["fingerprint"] != ref["fingerprint"]:
                what = f"topology fingerprint {other['fingerprint']} differs from rank 0's {ref['fingerprint']}"
            else:
                what = f"optimizer/mode {other['optimizer']}/{other['mode']} differs from rank 0's " \
                       f"{ref['optimizer']}/{ref['mode']}"
            raise RuntimeError(f"decent_comm: replicas disagree: rank {r}: {what}")

    def _broadcast_from_rank0(self):
        src = dist.get_global_rank(self.process_group, 0) if self.process_group is not None else 0
        with torch.no_grad():
            for b in self._buckets:
                dist.broadcast(b.flat, src=src, group=self.process_group)

    def _register_forward_hooks(self, model: torch.nn.Module):
        where = {id(s.param): b.index for b in self._buckets for s in b.slots}
        for module in model.modules():
            ids = sorted({where[id(p)] for p in module.parameters(recurse=False) if id(p) in where})
            if ids:
                self._hooks.append(module.register_forward_pre_hook(self._make_hook(ids)))

    def _make_hook(self, bucket_ids):
        def hook(module, args):
            if self._pending_mix:
                self._apply_pending_mix(bucket_ids)
        return hook

    # ---------------------------------------------------------------------------------------- scheduling

    def _lr0(self) -> float:
        lr = self.param_groups[0]["lr"]
        return float(lr)

    def _plan(self, step: int):
        # After a resume, the factor the interrupted run had already chosen for this step (from the lr in
        # effect when it launched the exchange) keeps the trajectory identical.
        if self._resume_factor is not None and step == self._t:
            a, self._resume_factor = self._resume_factor, None
        else:
            a = consensus_factor(self.consensus, step, self._lr0())
        return mix_plan(self.topology, self.rank, step, a)

    def _recv_buffers(self, b: Bucket, k: int) -> List[torch.Tensor]:
        bufs = self._recv[b.index]
        while len(bufs) < k:
            bufs.append(torch.empty(b.numel, dtype=self.comm_dtype or b.dtype, device=b.device))
        return bufs[:k]

    def _launch(self, plan):
        """Starts the exchange of every bucket's current flat buffer for `plan` (same order on all ranks)."""
        if self._exchanger is not None and not plan.silent:
            with torch.no_grad():
                for b in self._buckets:
                    self._exchanger.exchange(b.index, b.flat, self._recv_buffers(b, len(plan.recv)), plan.send,
                                             plan.recv)
        self._inflight = plan

    def _wait(self, b: Bucket, plan) -> List[torch.Tensor]:
        if self._exchanger is not None and not plan.silent:
            self._exchanger.wait(b.index)
        return self._recv_buffers(b, len(plan.recv)) if plan.recv else []

    def _apply_pending_mix(self, bucket_ids=None):
        """ATC: mix the received half-step buffers into the parameters (all pending, or those listed)."""
        plan = self._inflight
        ids = list(self._pending_mix) if bucket_ids is None else [i for i in bucket_ids if i in self._pending_mix]
        with torch.no_grad():
            for i in ids:
                b = self._buckets[i]
                nbs = self._wait(b, plan)
                ops.gossip_mix_(b.flat, nbs, plan.self_weight, plan.weights)
                self._pending_mix.discard(i)

    # ---------------------------------------------------------------------------------------------- step

    def _amp_unscale_and_check(self) -> bool:
        """GradScaler protocol: unscale when asked, and tell whether this step's update must be skipped."""
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        if found_inf is not None and float(found_inf) > 0:
            return True
        if grad_scale is not None:
            inv = 1.0 / grad_scale.double() if torch.is_tensor(grad_scale) else 1.0 / grad_scale
            for b in self._buckets:
                b.grad.mul_(inv.to(b.grad.device) if torch.is_tensor(inv) else inv)
        return False

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for b in self._buckets:
            gather_grads(b)
        skip_update = self._amp_unscale_and_check()
        if self.mode == "awc":
            self._step_awc(skip_update)
        else:
            self._step_atc(skip_update)
        return loss

    def _update_bucket(self, b: Bucket, neighbors, self_weight, weights, skip_update: bool, disagreement=None):
        """One fused call per segment of the bucket: update where gradients exist, plain mix elsewhere."""
        group = self.param_groups[b.group_index]
        mixing = bool(neighbors) or self_weight != 1.0
        for seg in segments(b, b.steps):
            sl = slice(seg.start, seg.stop)
            nbs = [y[sl] for y in neighbors]
            if seg.has_grad and not skip_update:
                self._local_update(b, sl, group, seg.step, nbs, self_weight, weights)
            elif mixing:
                ops.gossip_mix_(b.flat[sl], nbs, self_weight, weights)
        if not skip_update:
            for i, s in enumerate(b.slots):
                if s.param.grad is not None:
                    b.steps[i] += 1

    def _step_awc(self, skip_update: bool):
        plan = self._inflight
        if plan is None or plan.step != self._t:
            plan = self._plan(self._t)
            self._launch(plan)
        for b in self._buckets:
            nbs = self._wait(b, plan)
            self._update_bucket(b, nbs, plan.self_weight, plan.weights, skip_update)
        self._t += 1
        self._launch(self._plan(self._t))

    def _step_atc(self, skip_update: bool):
        if self._pending_mix:
            self._apply_pending_mix()
        for b in self._buckets:
            self._update_bucket(b, [], 1.0, [], skip_update)
        plan = self._plan(self._t)
        self._launch(plan)
        if plan.recv or plan.self_weight != 1.0:
            self._pending_mix = {b.index for b in self._buckets}
        self._t += 1

    # ------------------------------------------------------------------------------------------ grad utils

    def zero_grad(self, set_to_none: bool = True):
        for b in self._buckets:
            zero_grads(b, set_to_none)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Local gradient-norm clipping over the flat gradient buffers (torch.nn.utils.clip_grad_norm_
        semantics; parameters without a gradient are ignored)."""
        norms = []
        for b in self._buckets:
            gather_grads(b)
            for seg in segments(b, b.steps):
                if seg.has_grad:
                    norms.append(torch.linalg.vector_norm(b.grad[seg.start:seg.stop], norm_type))
        if not norms:
            return torch.tensor(0.0)
        total = torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]), norm_type)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for b in self._buckets:
            b.grad.mul_(coef.to(b.grad.device, b.grad.dtype))
        return total

    # ---------------------------------------------------------------------------------------- collectives

    def synchronize(self):
        """Completes all pending communication. In ATC mode it applies the pending mix, so the parameters
        are exactly x^{t+1}. In AWC mode the received x^t of the neighbours stays valid for the next step."""
        if self.mode == "atc" and self._pending_mix:
            self._apply_pending_mix()
        if self._exchanger is not None:
            self._exchanger.synchronize()

    def _all_reduce_mean_(self, t: torch.Tensor):
        dist.all_reduce(t, group=self.process_group)
        t.div_(self.world_size)

    @torch.no_grad()
    def consensus_distance(self) -> float:
        """(1/n) sum_i ||x_i - mean||^2 over all parameters (a collective: every rank must call it)."""
        self.synchronize()
        if self.world_size == 1:
            return 0.0
        total = torch.zeros((), dtype=torch.float64, device=self._buckets[0].device)
        for b in self._buckets:
            x = b.flat.double()
            mean = x.clone()
            self._all_reduce_mean_(mean)
            total += ((x - mean) ** 2).sum()
        dist.all_reduce(total, group=self.process_group)
        return float(total) / self.world_size

    @contextlib.contextmanager
    def global_average(self):
        """Swaps in the exact global average of the replicas (for evaluation or saving) and restores each
        rank's own parameters on exit. A collective: every rank must enter it."""
        self.synchronize()
        saved = [b.flat.clone() for b in self._buckets]
        try:
            self._average_()
            yield self
        finally:
            with torch.no_grad():
                for b, s in zip(self._buckets, saved):
                    b.flat.copy_(s)

    def average_parameters(self):
        """Permanently replaces every replica by the global average (e.g. before final evaluation)."""
        self.synchronize()
        self._average_()
        self._inflight = None  # what neighbours sent before the average is stale now

    @torch.no_grad()
    def _average_(self):
        if self.world_size > 1:
            for b in self._buckets:
                self._all_reduce_mean_(b.flat)

    # ---------------------------------------------------------------------------------------- state_dict

    def _param_list(self):
        return [p for g in self.param_groups for p in g["params"]]

    def _slot_of(self):
        return {id(s.param): (b, i) for b in self._buckets for i, s in enumerate(b.slots)}

    def state_dict(self):
        self.synchronize()
        slot_of = self._slot_of()
        for p in self._param_list():
            b, i = slot_of[id(p)]
            if b.steps[i] > 0:  # torch.optim semantics: state only for parameters that were updated
                st = self.state[p]
                for name in b.state:
                    st[name] = b.view(b.state[name], b.slots[i])
                st["step"] = torch.tensor(float(b.steps[i]))
        sd = super().state_dict()
        # atc: the in-flight plan is of step _t - 1 and already applied; awc: of step _t, still to be used
        next_plan = self._inflight if self._inflight is not None and self._inflight.step == self._t else None
        sd["decentralized"] = dict(
            step=self._t, next_factor=next_plan.factor if next_plan is not None else None, topology=self.topology.fingerprint(), mode=self.mode, world_size=self.world_size,
            rank=self.rank,
            consensus=self.consensus.state_dict() if hasattr(self.consensus, "state_dict") else None,
        )
        return sd

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        extra = state_dict.pop("decentralized", None)
        saved_state = state_dict.get("state", {})
        super().load_state_dict({"state": {}, "param_groups": state_dict["param_groups"]})
        slot_of = self._slot_of()
        with torch.no_grad():
            for idx, p in enumerate(self._param_list()):
                st = saved_state.get(idx, saved_state.get(str(idx)))
                if not st:
                    continue
                b, i = slot_of[id(p)]
                for name, value in st.items():
                    if name == "step":
                        b.steps[i] = int(value)
                        continue
                    view = b.view(b.state_buffer(name), b.slots[i])
                    view.copy_(value)
                    self.state[p][name] = view
        self._restore_schedule(extra)

    def _restore_schedule(self, extra):
        """Restores the step counter, consensus state and the pending exchange from a checkpoint's extras."""
        if extra is not None:
            if extra["topology"] != self.topology.fingerprint():
                raise ValueError("the checkpoint was written with another topology (fingerprint "
                                 f"{extra['topology']}, this optimizer has {self.topology.fingerprint()})")
            self._t = int(extra["step"])
            self._resume_factor = extra.get("next_factor")
            if extra.get("consensus") is not None and hasattr(self.consensus, "load_state_dict"):
                self.consensus.load_state_dict(extra["consensus"])
        # Whatever was in flight carried the old parameters: start the next exchange afresh.
        if self._exchanger is not None:
            self._exchanger.synchronize()
        self._inflight = None
        self._pending_mix = set()

    # ----------------------------------------------------------------------------------------- teardown

    def shutdown(self):
        """Completes pending communication and releases the exchanger (call before destroying the group)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self._exchanger is not None:
            self._exchanger.synchronize()
            self._exchanger.shutdown()
            self._exchanger = None
