"""What every decentralized optimizer shares on top of torch.optim.Optimizer: flat buckets, a
``GossipSchedule`` (decent_comm.optim.schedule) that does the communication, the AWC/ATC order of a step,
AMP, state_dict, and the collective utilities.

Semantics (t counts optimizer steps from 0; W'(t) = (1 - a_t) I + a_t W(t)):
  awc  x_i^{t+1} = sum_j W'_ij(t) x_j^t - lr * d_i^t          (one fused kernel per bucket; the exchange
       of x^{t+1} is launched at the end of step t and overlaps the whole next forward and backward)
  atc  x_i^{t+1} = sum_j W'_ij(t) (x_j^t - lr * d_j^t)         (local update, exchange, then the mix: in a
       forward pre-hook of the first module using each bucket - the modules of `model` when given, else those
       a global pre-hook sees run - or at the end of the step for a bucket no module covers)

Watching the replicas (decent_comm.optim.diagnostics): ``last_disagreement`` / ``disagreement()`` (from the
fused kernels' extra output), ``replica_variance(every=K)`` and ``consensus_distance()`` (collectives),
``bytes_sent``.
"""

import contextlib
from typing import Dict, List, Optional

import torch

from .. import ops
from . import diagnostics
from .adaptation import sq_dist, sum_scalars
from .buckets import (Bucket, build_buckets, clip_grad_norm, count_steps, gather_grads, gather_named_state, load_state,
                      publish_named_state, publish_state, segments, zero_grads)
from .plan import Cadence
from .schedule import CORRECTION, MODES, GossipSchedule
from .startup import (DDPGuard, broadcast_from_rank0, check_options, distributed_context, replica_config,
                      resolve_topology, verify_replicas)
from .tracing import traced

__all__ = ["DecentralizedMixin", "MODES"]


class DecentralizedMixin:
    """Mixed into a torch.optim.Optimizer subclass. A fused subclass implements `_local_update(bucket, seg_slice,
    group, step, neighbors, self_weight, weights, disagreement)`, one fused kernel call over a slice of a bucket;
    ``Decentralized`` overrides `_update_awc` and `_update_local` instead."""

    # GradScaler then calls step() even on overflow (passing grad_scale / found_inf), so a rank that skips
    # its update still keeps the exchange schedule in lockstep with its neighbours.
    _step_supports_amp_scaling = True
    # Whether a sparse gradient may be densified: the update equals torch's from the sparse one (SGD), or the
    # wrapped optimizer sees dense gradients anyway; Adam-family fused kernels refuse them, as torch.optim.Adam.
    _sparse_grads_ok = False

    def _init_decentralized(self, *, topology, mode, process_group, bucket_cap_mb, comm_dtype, consensus, model,
                            broadcast_init, timeout, track_disagreement=False, exchange="auto", check_finite=False,
                            gossip_every=1, warmup_steps=0, delayed_mix=False):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        check_options(timeout=timeout, comm_dtype=comm_dtype)
        cadence = Cadence(gossip_every, warmup_steps, delayed_mix)
        if delayed_mix and mode != "awc":
            raise ValueError("delayed_mix=True needs mode='awc': the delayed mix is applied inside the fused update "
                             "of the next gossip round (ATC mixes before the next forward, which a delay defeats)")
        self.process_group = process_group
        self.rank, self.world_size = distributed_context(process_group)
        topology = resolve_topology(topology, self.world_size)
        self._buckets: List[Bucket] = build_buckets(self.param_groups, bucket_cap_mb)
        self._ddp_guard = DDPGuard(self, self._buckets, model)
        self._num_groups = len(self.param_groups)
        self._closure, self._closure_loss = None, None
        self._model = model
        if self.world_size > 1:
            config = replica_config(self._buckets, topology, self.param_groups, optimizer=self._optimizer_name(),
                                    mode=mode, comm_dtype=comm_dtype, exchange=exchange, consensus=consensus,
                                    bucket_cap_mb=bucket_cap_mb, gossip_every=gossip_every, warmup_steps=warmup_steps,
                                    delayed_mix=delayed_mix,
                                    broadcast_init=broadcast_init, check_finite=check_finite)
            verify_replicas(config, process_group, self.world_size, timeout)
            if broadcast_init:
                broadcast_from_rank0(self._buckets, process_group)
        self._schedule = GossipSchedule(
            self._buckets, topology, mode=mode, rank=self.rank, world_size=self.world_size,
            process_group=process_group, consensus=consensus, lr=self._lr0, comm_dtype=comm_dtype, timeout=timeout,
            exchange=exchange, track_disagreement=track_disagreement, check_finite=check_finite, cadence=cadence)
        if mode == "atc":
            self._schedule.attach(model)

    # ----------------------------------------------------------------------------------- configuration

    def _optimizer_name(self) -> str:
        return type(self).__name__

    @property
    def topology(self):
        return self._schedule.topology

    @property
    def mode(self) -> str:
        return self._schedule.mode

    @property
    def consensus(self):
        return self._schedule.consensus

    @property
    def comm_dtype(self):
        return self._schedule.comm_dtype

    @property
    def track_disagreement(self) -> bool:
        return self._schedule.meter.enabled

    def _lr0(self) -> float:
        return float(self.param_groups[0]["lr"])

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

    def add_param_group(self, param_group: dict):
        if hasattr(self, "_schedule"):  # torch's __init__ adds the initial groups before the buckets exist
            raise RuntimeError(
                "decent_comm: add_param_group after construction is not supported: the parameters are laid out in "
                "flat buckets at construction, the same on every rank, and exchanged bucket by bucket. Pass every "
                "param group to the constructor (parameters that should not train yet can have lr=0 or "
                "requires_grad=False: they are still averaged), or build a new optimizer.")
        super().add_param_group(param_group)

    def _closure_for_inner(self) -> bool:
        """Decentralized passes the closure to the wrapped optimizer (LBFGS evaluates it several times)."""
        return False

    @torch.no_grad()
    def step(self, closure=None):
        if self._ddp_guard is not None:  # a DDP wrap would have shown in the forward before the first step
            self._ddp_guard.remove()
            self._ddp_guard = None
        if len(self.param_groups) != self._num_groups:
            raise RuntimeError(f"decent_comm: the optimizer was built with {self._num_groups} param group(s) and now "
                               f"has {len(self.param_groups)}: groups added later (e.g. to the wrapped optimizer) "
                               "would be neither updated nor averaged; pass every group at construction")
        if self._is_state_initialization():
            self._initialize_state()
            return None
        loss, self._closure_loss = None, None
        self._closure = closure if self._closure_for_inner() else None
        if closure is not None and self._closure is None:
            with torch.enable_grad():
                loss = closure()
        for b in self._buckets:
            gather_grads(b, self._sparse_grads_ok)
        found_inf = getattr(self, "found_inf", None)
        self._schedule.average_gradients(self._schedule.t, found_inf if torch.is_tensor(found_inf) else None)
        skip_update = self._amp_unscale_and_check()
        if self.mode == "awc":
            self._step_awc(skip_update)
        else:
            self._step_atc(skip_update)
        self._closure = None
        return loss if self._closure_loss is None else self._closure_loss

    def _is_state_initialization(self) -> bool:
        """torch.distributed.checkpoint's get/set_state_dict initialize an optimizer whose state is empty with a
        step() at lr 0 on zero gradients. Such a step must neither communicate nor advance the schedule."""
        if self.state or any(float(g["lr"]) != 0.0 for g in self.param_groups):
            return False
        return all(p.grad is None or not p.grad.any() for p in self._param_list())

    def _initialize_state(self):
        """Every parameter's state, zero, as views (its step count stays 0: the next step is the first)."""
        for b in self._buckets:
            for name in self._state_names(self.param_groups[b.group_index]):
                b.state_buffer(name)
            publish_state(b, self.state, include_unstepped=True)

    def _state_names(self, group) -> List[str]:
        """Names of the flat state buffers the fused kernel of this optimizer keeps for `group`."""
        raise NotImplementedError

    def _step_awc(self, skip_update: bool):
        s = self._schedule
        plan = s.awc_plan()
        measure = s.wants_step_sq(s.t + 1)  # the decision for step t+1 is taken at the end of this one
        s.begin_mix()
        step_sq = self._update_awc(plan, skip_update, measure)
        s.end_mix(plan)
        s.record_step_sq(step_sq)
        s.finish_step()

    @traced("mix_update")
    def _update_awc(self, plan, skip_update: bool, measure: bool) -> Optional[torch.Tensor]:
        """The fused mix + update of every bucket; ||x^{t+1} - mix(x^t)||^2 when `measure`."""
        step_sq = []
        for b in self._buckets:
            nbs = self._schedule.received(b, plan)
            ref = None
            if measure:  # the mixed point, so that x^{t+1} - ref is the local update alone
                ref = b.flat.clone()
                if plan.mixes:
                    ops.gossip_mix_(ref, nbs, plan.self_weight, plan.weights)
            self._update_bucket(b, nbs, plan.self_weight, plan.weights, skip_update)
            if measure:
                step_sq.append(sq_dist(b.flat, ref))
        return sum_scalars(step_sq)

    def _step_atc(self, skip_update: bool):
        s = self._schedule
        s.mix_pending()
        measure = s.wants_step_sq(s.t)  # decided below, before this step's exchange
        refs = [b.flat.clone() for b in self._buckets] if measure else None
        self._update_local(skip_update)
        if measure:
            s.record_step_sq(sum_scalars([sq_dist(b.flat, r) for b, r in zip(self._buckets, refs)]))
        s.atc_launch()

    @traced("local_update")
    def _update_local(self, skip_update: bool):
        """The local update alone (ATC's adapt half)."""
        for b in self._buckets:
            self._update_bucket(b, [], 1.0, [], skip_update)

    def _update_bucket(self, b: Bucket, neighbors, self_weight, weights, skip_update: bool):
        """One fused call per segment of the bucket: update where gradients exist, plain mix elsewhere. When
        mixing and tracking, segment k's disagreement goes to the bucket's slot k."""
        group = self.param_groups[b.group_index]
        mixing = bool(neighbors) or self_weight != 1.0
        for k, seg in enumerate(segments(b, b.steps)):
            sl = slice(seg.start, seg.stop)
            nbs = [y[sl] for y in neighbors]
            dis = self._schedule.meter.slot(b, k) if mixing else None
            if seg.has_grad and not skip_update:
                self._local_update(b, sl, group, seg.step, nbs, self_weight, weights, disagreement=dis)
            elif mixing:
                ops.gossip_mix_(b.flat[sl], nbs, self_weight, weights, disagreement=dis)
        if not skip_update:
            count_steps(b)
            publish_state(b, self.state)

    # -------------------------------------------------------------------------------------- diagnostics

    @property
    def last_disagreement(self) -> float:
        """This rank's disagreement with its neighbours at the last mix: sum over all parameters of
        ||mixed - x_old||^2, mixed = sum_j W'_ij x_j (the squared distance to the neighbourhood average, scaled by
        the consensus factor), computed by the fused kernels in the same pass as the mix. Local (no
        communication); reading it waits for the device. 0.0 before the first mix or without mixing. In ATC
        mode it is that of the last exchange once every bucket has been mixed (the mix runs at the next step or
        in the forward pre-hooks). ``disagreement(all_reduce=True)`` gives the mean over ranks."""
        return self._schedule.meter.last()

    @torch.no_grad()
    def disagreement(self, all_reduce: bool = False, per_bucket: bool = False):
        """``last_disagreement`` (a float), or per bucket (a list, bucket order) with ``per_bucket=True``.
        ``all_reduce=True`` returns the mean over ranks (a collective: every rank must call it)."""
        out = self._schedule.meter.values(per_bucket, self._schedule.device)
        if all_reduce and self.world_size > 1:
            diagnostics.all_reduce_mean_(out, self.process_group, self.world_size)
        return out.tolist() if per_bucket else float(out[0])

    @property
    def bytes_sent(self) -> int:
        """Bytes this rank has put on the wire for gossip so far (0 without communication)."""
        return self._schedule.bytes_sent

    @torch.no_grad()
    def replica_variance(self, every: int = 1, *, names=None) -> Optional[Dict[str, Dict[str, float]]]:
        """DBench-style per-tensor statistics of the replicas, exact, with one collective.

        Due when the number of optimizer steps taken is a multiple of ``every`` (step 0 included); returns None
        (and communicates nothing) otherwise. When due it is a collective: call it at the same point of the loop
        on every rank (the due steps then agree). ATC: the pending mix is applied first.

        Returns ``{name: {"variance", "norm", "norm_rms", "avg_norm", "numel"}}`` in param-group order:
          variance: mean over the tensor's elements of the variance across replicas,
                    (1 / (n numel)) sum_i ||x_i - xbar||^2 (sum over the tensors times numel gives the consensus
                    distance of ``consensus_distance()``);
          norm:     ||x_i||, this rank's tensor before averaging;
          norm_rms: sqrt((1/n) sum_i ||x_i||^2), the replicas' norms before averaging;
          avg_norm: ||xbar||, the norm of the averaged tensor.
        Names come from ``names`` (an nn.Module, a dict name -> parameter, or (name, parameter) pairs), else
        from the ``model`` given to the optimizer, else "group{g}.param{i}". One all-reduce of a float64 buffer
        of the parameters plus one scalar per tensor (about twice the fp32 model's bytes).
        """
        if isinstance(every, bool) or int(every) != every or every < 1:
            raise ValueError(f"every must be a positive integer, got {every!r}")
        if self._schedule.t % int(every):
            return None
        self.synchronize()
        names_of = diagnostics.param_names(self.param_groups, names if names is not None else self._model)
        return diagnostics.replica_variance(self._buckets, self._param_list(), names_of, self.process_group,
                                            self.world_size)

    @torch.no_grad()
    def consensus_distance(self) -> float:
        """(1/n) sum_i ||x_i - mean||^2 over all parameters (a collective: every rank must call it)."""
        self.synchronize()
        return diagnostics.consensus_distance(self._buckets, self.process_group, self.world_size)

    # ------------------------------------------------------------------------------------------ grad utils

    def zero_grad(self, set_to_none: bool = True):
        for b in self._buckets:
            zero_grads(b, set_to_none)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Local gradient-norm clipping over the flat gradient buffers (torch.nn.utils.clip_grad_norm_
        semantics; parameters without a gradient are ignored)."""
        return clip_grad_norm(self._buckets, max_norm, norm_type, self._sparse_grads_ok)

    # ---------------------------------------------------------------------------------------- collectives

    def synchronize(self):
        """Completes all pending communication. In ATC mode it applies the pending mix, so the parameters
        are exactly x^{t+1}. In AWC mode the received x^t of the neighbours stays valid for the next step."""
        self._schedule.synchronize()

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
        self._schedule.forget_inflight()  # what neighbours sent before the average is stale now

    @torch.no_grad()
    def _average_(self):
        if self.world_size > 1:
            for b in self._buckets:
                diagnostics.all_reduce_mean_(b.flat, self.process_group, self.world_size)

    # ---------------------------------------------------------------------------------------- state_dict

    def _param_list(self):
        return [p for g in self.param_groups for p in g["params"]]

    def _optimizer_state_dict(self) -> dict:
        """torch.optim's state_dict: opt.state already holds per-parameter views of the flat state."""
        return super().state_dict()

    def _load_optimizer_state_dict(self, state_dict: dict):
        saved_state = state_dict.get("state", {})
        # As torch.optim: the saved groups' "params" (indices, or FQNs from torch.distributed.checkpoint) name the
        # current parameters by position.
        saved_ids = [k for g in state_dict["param_groups"] for k in g["params"]]
        param_of = dict(zip(saved_ids, self._param_list()))
        super().load_state_dict({"state": {}, "param_groups": state_dict["param_groups"]})
        load_state(self._buckets, saved_state, param_of, self.state)

    def state_dict(self):
        self.synchronize()
        self._publish_correction(self._schedule.checkpoint_correction())
        sd = self._optimizer_state_dict()
        # Where the gossip schedule stands travels in param group 0: torch.distributed.checkpoint keeps only
        # "state" (keyed by parameter) and "param_groups" of an optimizer's state_dict.
        sd["param_groups"][0]["decentralized"] = self._schedule.state_dict()
        return sd

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        groups = [dict(g) for g in state_dict["param_groups"]]
        extra = state_dict.pop("decentralized", None)
        extra = groups[0].pop("decentralized", extra) if groups else extra
        state_dict["param_groups"] = groups
        self._load_optimizer_state_dict(state_dict)
        self._gather_correction()
        self._schedule.load_state_dict(extra)

    # A wrapped torch optimizer initializes a parameter's state only when it finds none (see publish_named_state).
    _correction_for_stateless_params = True

    def _publish_correction(self, pending: bool):
        """A delayed_mix round in flight travels as per-parameter state, so torch.save and DCP carry it."""
        publish_named_state(self._buckets, self.state, CORRECTION, pending, self._correction_for_stateless_params)

    def _gather_correction(self):
        gather_named_state(self._buckets, self.state, CORRECTION)

    # ----------------------------------------------------------------------------------------- teardown

    def shutdown(self):
        """Completes pending communication and releases the exchanger (call before destroying the group)."""
        self._schedule.shutdown()
