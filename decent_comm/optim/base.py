"""What every decentralized optimizer shares on top of torch.optim.Optimizer: flat buckets, a
``GossipSchedule`` (decent_comm.optim.schedule) that does the communication, the AWC/ATC order of a step,
AMP, state_dict (decent_comm.optim.checkpointing), what users edit between steps (decent_comm.optim.user_edits), and
the collective utilities.

Semantics (t counts optimizer steps from 0; W'(t) = (1 - a_t) I + a_t W(t)):
  awc  x_i^{t+1} = sum_j W'_ij(t) x_j^t - lr * d_i^t          (one fused kernel per bucket; the exchange
       of x^{t+1} is launched at the end of step t and overlaps the whole next forward and backward)
  atc  x_i^{t+1} = sum_j W'_ij(t) (x_j^t - lr * d_j^t)         (local update, exchange, then the mix: in a
       forward pre-hook of the first module using each bucket - the modules of `model` when given, else those
       a global pre-hook sees run - or at the end of the step for a bucket no module covers)

Watching the replicas (decent_comm.optim.replica_watch): ``last_disagreement`` / ``disagreement()`` (from the fused
kernels' extra output), ``replica_variance(every=K)`` and ``consensus_distance()`` (collectives), ``bytes_sent``.
"""

import weakref
from typing import List, Optional

import torch

from .. import ops
from ..exchange import MAX_BUCKETS, broadcast_from_rank0
from . import amp, handover, int8_wire
from .averaging import ReplicaAverages
from .device_scalars import sq_dist, sum_scalars
from .interrupts import holds_interrupt
from .buckets import Bucket, build_buckets
from .param_versions import check_unwritten, note_in_flight, written
from .step_vars import StepVars
from .step_counts import count_on_device, count_steps, grads_present, refine_classes, spread_count, step_segments
from .checkpointing import StateDictMixin
from .ddp_guard import DDPGuard
from .module_watch import ModuleWatch
from .grads import clip_grad_norm, gather_grads, zero_grads
from .plan import Cadence, MixInputs
from .replica_watch import ReplicaWatch
from .schedule import MODES, GossipSchedule
from .state_views import publish_state
from .teardown import shut_down_when_dropped
from .startup import (check_materialized, check_options, distributed_context, refusal_told, replica_config,
                      resolve_topology, usable_timeout, verify_replicas)
from .tracing import traced
from .user_edits import StateWatch, adopt_state_edits, called_by_checkpoint_init, check_param_groups, group_layout

__all__ = ["DecentralizedMixin", "MODES"]


def _lr_of(optimizer: "weakref.ref"):
    """The lr of param group 0 at each call, for the schedule: through a weak reference, as the schedule the
    optimizer holds would otherwise hold it back, a cycle that kept a dropped optimizer and its buffers alive until
    the cyclic collector ran (a sweep rebuilding 20 optimizers of 4M parameters peaked at twice torch's memory)."""
    return lambda: optimizer()._lr0()


class DecentralizedMixin(StateDictMixin, ReplicaWatch, ReplicaAverages):
    """Mixed into a torch.optim.Optimizer subclass. A fused subclass implements `_local_update(bucket, seg_slice,
    group, step, neighbors, self_weight, weights, disagreement, **op_kwargs)`, one fused kernel call over a slice of
    a bucket (step: the host count before it, or None with the ops' state_step / grad_scale / found_inf keywords in
    op_kwargs, which also carry the 8-bit wire's copies and payloads); ``Decentralized`` overrides `_update_awc` and
    `_update_local` instead."""

    def __getstate__(self):
        # torch.optim.Optimizer pickles defaults, state and param_groups only: a copy would lack the buckets, the
        # schedule and the exchange, and fail at its first step. Say so now, and what to do instead.
        raise TypeError(f"{type(self).__name__} cannot be pickled or deep-copied (it holds flat buckets, a process "
                        f"group and exchanges in flight): save opt.state_dict() and load it into a new optimizer")

    # GradScaler calls step() even on overflow, with grad_scale / found_inf (optim/amp.py) the kernels read on device
    _step_supports_amp_scaling = True
    _amp_in_kernel = False
    # Whether a sparse gradient may be densified: the update equals torch's from the sparse one (SGD), or the
    # wrapped optimizer sees dense gradients anyway; Adam-family fused kernels refuse them, as torch.optim.Adam.
    _sparse_grads_ok = False

    def _init_decentralized(self, *, topology, mode, process_group, bucket_cap_mb, comm_dtype, consensus, model,
                            broadcast_init, timeout, track_disagreement=False, exchange="auto", check_finite=False,
                            gossip_every=1, warmup_steps=0, delayed_mix=False):
        self.rank, self.world_size = distributed_context(process_group)  # plain values: kept past shutdown()
        # What this rank refuses is told to the others when they meet in verify_replicas, so that every rank raises
        # at once, naming this rank and why, instead of waiting for it until the timeout.
        config = None
        with refusal_told(dict(process_group=process_group, timeout=timeout)):
            if mode not in MODES:
                raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
            check_options(timeout=timeout, comm_dtype=comm_dtype, model=model, consensus=consensus,
                          flags=(("broadcast_init", broadcast_init), ("track_disagreement", track_disagreement),
                                 ("check_finite", check_finite)))
            cadence = Cadence(gossip_every, warmup_steps, delayed_mix)
            if delayed_mix and mode != "awc":
                raise ValueError("delayed_mix=True needs mode='awc': the delayed mix is applied inside the fused "
                                 "update of the next gossip round (ATC mixes before the next forward, which a delay "
                                 "defeats)")
            self._check_group_options(self.param_groups)
            handover.settle_pending_mixes(self.param_groups)  # a live optimizer's pending ATC mix, before the copy
            topology = resolve_topology(topology, self.world_size, process_group)
            self._buckets: List[Bucket] = build_buckets(
                self.param_groups, bucket_cap_mb, int8_wire.check_bucket_sizes if comm_dtype == torch.int8 else None)
            check_materialized(self.param_groups, self.world_size)
            if self.world_size > 1 and len(self._buckets) > MAX_BUCKETS:  # else the step that reached it failed
                raise ValueError(f"{len(self._buckets)} buckets (bucket_cap_mb={bucket_cap_mb}): the exchange takes "
                                 f"at most {MAX_BUCKETS}; raise bucket_cap_mb (or use fewer param groups)")
            self._ddp_guard = DDPGuard(self, self._buckets, model)
            if self.world_size > 1:
                config = replica_config(self._buckets, topology, self.param_groups, model,
                                        optimizer=self._optimizer_name(), mode=mode, comm_dtype=comm_dtype,
                                        exchange=exchange, consensus=consensus, bucket_cap_mb=bucket_cap_mb,
                                        gossip_every=gossip_every, warmup_steps=warmup_steps, delayed_mix=delayed_mix,
                                        broadcast_init=broadcast_init, check_finite=check_finite)
        if self.world_size > 1:
            verify_replicas(config, process_group, self.world_size, usable_timeout(timeout))
        self._groups_built = group_layout(self.param_groups)
        self._state_watch = StateWatch()
        self._this_step, self._model = StepVars(), model  # closure, its loss, AMP scalars (not on self: step_vars)
        self._module_watch = ModuleWatch(model, self._param_list())  # a Parameter the model replaced: refused
        if self.world_size > 1 and broadcast_init:
            with torch.no_grad():
                broadcast_from_rank0([b.flat for b in self._buckets], process_group, timeout,
                                     "building the optimizer: copying rank 0's parameters (broadcast_init=True)")
        self._schedule = GossipSchedule(
            self._buckets, topology, mode=mode, rank=self.rank, world_size=self.world_size,
            process_group=process_group, consensus=consensus, lr=_lr_of(weakref.ref(self)), comm_dtype=comm_dtype,
            timeout=timeout, exchange=exchange, track_disagreement=track_disagreement, check_finite=check_finite,
            cadence=cadence)
        shut_down_when_dropped(self, self._schedule)  # ATC: the pending mix, applied even without shutdown()
        if mode == "atc":
            self._schedule.attach(model)
        self._show_schedule()
        self._note_state()

    # ----------------------------------------------------------------------------------- configuration

    def _optimizer_name(self) -> str:
        return type(self).__name__

    @property
    def process_group(self):
        """The group the optimizer gossips in (None: the default group), held by its schedule until shutdown(), None
        after it: held on, an explicit group outlived dist.destroy_process_group(), gloo's threads with it, for as
        long as the optimizer was referenced. `rank` and `world_size` stay."""
        schedule = self.__dict__.get("_schedule")
        return schedule.process_group if schedule is not None else None

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

    def _amp_for_step(self, found_inf: Optional[torch.Tensor], grad_scale):
        """GradScaler's scalars (decent_comm.optim.amp; found_inf as amp.overflow_flag made it, grad_scale as
        _average_gradients left it): those the kernels read (or None), and whether the host path says to skip."""
        in_kernel = amp.kernel_amp(grad_scale, found_inf, [b.device for b in self._buckets]) \
            if self._amp_in_kernel else None
        if in_kernel is not None:
            for b in self._buckets:
                count_on_device(b, self.state)
            return in_kernel, False
        return None, amp.host_unscale_and_check(grad_scale, found_inf, [b.grad for b in self._buckets])

    def add_param_group(self, param_group: dict):
        if hasattr(self, "_schedule"):  # torch's __init__ adds the initial groups before the buckets exist
            raise RuntimeError(
                "decent_comm: add_param_group after construction is not supported: the parameters are laid out in "
                "flat buckets at construction, the same on every rank, and exchanged bucket by bucket. Pass every "
                "param group to the constructor (parameters that should not train yet can have lr=0 or "
                "requires_grad=False: they are still averaged), or build a new optimizer.")
        super().add_param_group(param_group)

    def _inner_closure(self, closure):
        """The closure the update evaluates (Decentralized: hands on to the wrapped optimizer, LBFGS evaluates it
        several times); None: step() evaluates it first."""
        return None

    def _average_gradients(self, found_inf, grad_scale):
        """The warm-up's gradient average (Decentralized: after each evaluation of the closure it hands on); returns
        GradScaler's scale still to undo: None after an average, which unscaled each rank's gradients first."""
        return None if self._schedule.average_gradients(self._schedule.t, found_inf, grad_scale=grad_scale) \
            else grad_scale

    @torch.compiler.disable  # a compiled training step runs step() eagerly: why in tests/test_compiled_step.py
    @amp.forgets_scaler_on_error  # (outside the hold: it sees the KeyboardInterrupt the hold raises, drops the scale)
    @holds_interrupt  # Ctrl-C: raised once the step is taken or refused, never between two checks or buckets
    @torch.no_grad()
    def step(self, closure=None):
        self._schedule.check_running(f"{type(self).__name__}.step()")  # CUDA graph capture, after shutdown()
        if self._ddp_guard.watching_forwards:  # a wrap made before the optimizer would have shown in a forward by now
            self._ddp_guard.remove()
        check_param_groups(self.param_groups, self._groups_built)
        self._module_watch.check(f"{type(self).__name__}.step()")
        self._check_group_options(self.param_groups, changed_only=True)  # torch reads them at every step
        if closure is None and self._is_state_initialization():
            self._initialize_state()
            self._note_state()
            return None
        self._schedule.agree_position()  # the first step after construction or load_state_dict: the same on all ranks
        self._adopt_state_edits()
        check_unwritten(self._buckets)
        now = self._this_step
        loss, now.closure_loss = None, None
        now.closure = self._inner_closure(closure) if closure is not None else None
        if closure is not None and now.closure is None:
            with torch.enable_grad():
                loss = closure()
            check_unwritten(self._buckets, "in the closure step() evaluated")  # (it ran with the buckets on the wire)
        if self.mode == "atc" and now.closure is None:  # (not with a closure the wrapped optimizer runs after the mix)
            self._schedule.check_deferred_used()  # a bypassed hook, warned of before anything changes (see there)
        self._gather_grads()
        found_inf = amp.overflow_flag(getattr(self, "found_inf", None), self._schedule.device)
        grad_scale = self._average_gradients(found_inf, getattr(self, "grad_scale", None))
        now.amp, skip_update = self._amp_for_step(found_inf, grad_scale)
        if self.mode == "awc":
            self._step_awc(skip_update)
        else:
            self._step_atc(skip_update)
        written(self._buckets)
        note_in_flight(self._buckets, self._schedule.sending_parameters())
        self._let_go()
        now.closure = None
        self._note_state()
        return loss if now.closure_loss is None else now.closure_loss

    def _gather_grads(self):
        """The flat gradient buffers take every .grad (grads.gather_grads); a parameter whose storage must be copied
        back into its bucket first waits for the bucket's transfers (the copy writes it)."""
        gather_grads(self._buckets, self._takes_sparse, before_copy=self._schedule.complete_transfers)

    def _is_state_initialization(self) -> bool:
        """torch.distributed.checkpoint's get/set_state_dict initialize an optimizer whose state is empty with a
        step() at lr 0 on zero gradients. Such a step must neither communicate nor advance the schedule."""
        if self.state or any(float(g["lr"]) != 0.0 for g in self.param_groups):
            return False
        return all(p.grad is None or not p.grad.any() for p in self._param_list()) and called_by_checkpoint_init()

    def _adopt_state_edits(self):
        """opt.state edited since the optimizer last handed it back (user_edits): the flat buffers take it, as
        torch.optim would."""
        if self._state_watch.needs_reload(self.state, self._buckets):
            adopt_state_edits(self._buckets, self._param_list(), self.state, self._state_layout())

    def _note_state(self):
        """What opt.state holds now, to tell the user's edits from it at the next step."""
        self._state_watch.note(self._buckets, self.state, self._bucket_state_names)

    def _bucket_state_names(self, b: Bucket) -> List[str]:
        return self._state_names(self.param_groups[b.group_index])

    def _initialize_state(self):
        """The state of every parameter DCP gave a gradient (as torch's optimizers: not a frozen one, which a saved
        state has none of, so a template with it failed dcp.load), zero, as views (the next step is the first)."""
        for b in self._buckets:
            for name in self._bucket_state_names(b):
                b.state_buffer(name)
            publish_state(b, self.state, stepped=[s.param.grad is not None for s in b.slots])
            b.template = True

    def _check_group_options(self, groups: List[dict], changed_only: bool = False) -> None:
        """Raises ValueError for a param group asking for what this optimizer's update does not do (torch.optim
        reads such options per group: {"params": ..., "amsgrad": True}, or a torch optimizer's checkpoint)."""

    def _complete_loaded_groups(self, groups: List[dict]) -> None:
        """Fills in a loaded checkpoint's param groups what this optimizer needs and the saver had no key for."""

    def _state_names(self, group) -> List[str]:
        """Names of the flat state buffers the fused kernel of this optimizer keeps for `group`."""
        raise NotImplementedError

    def _prepare_bucket(self, b: Bucket, group: dict) -> None:
        """Before a step updates bucket `b` (before it is split into segments by step count): class-specific set-up."""

    def _step_awc(self, skip_update: bool):
        s = self._schedule
        plan = s.awc_plan()
        measure = s.wants_step_sq(s.t + 1)  # the decision for step t+1 is taken at the end of this one
        if plan.mixes:  # a local or warm-up step keeps the last mix's disagreement (it reported 0.0, unlike ATC)
            s.meter.begin()
        step_sq = self._update_awc(plan, skip_update, measure)
        if plan.mixes:
            s.end_mix(plan)
        s.record_step_sq(step_sq)
        s.finish_step()

    @traced("mix_update")
    def _update_awc(self, plan, skip_update: bool, measure: bool) -> Optional[torch.Tensor]:
        """The fused mix + update of every bucket; ||x^{t+1} - mix(x^t)||^2 when `measure`."""
        step_sq = []
        for b in self._buckets:
            # Measuring mixes twice, so the 8-bit wire's payloads are added to the copies before, not inside.
            mix = self._schedule.mix_inputs(b, plan, fuse=not measure)
            ref = None
            if measure:  # the mixed point, so that x^{t+1} - ref is the local update alone
                ref = b.flat.clone()
                if plan.mixes:
                    ops.gossip_mix_(ref, mix.neighbors, plan.self_weight, plan.weights)
            self._update_bucket(b, mix, plan.self_weight, plan.weights, skip_update)
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
            self._update_bucket(b, MixInputs(), 1.0, [], skip_update)

    def _update_bucket(self, b: Bucket, neighbors: MixInputs, self_weight, weights, skip_update: bool):
        """One fused call per segment of the bucket: update where gradients exist, plain mix elsewhere. When
        mixing and tracking, segment k's disagreement goes to the bucket's slot k. With the step counts on the
        device the kernel reads and advances the segment's count (and GradScaler's scalars, when this step has
        them); the host passes no step."""
        group = self.param_groups[b.group_index]
        mixing = bool(neighbors) or self_weight != 1.0
        if not skip_update:
            self._prepare_bucket(b, group)
        on_device = b.classes is not None
        for k, seg in enumerate(step_segments(b)):
            sl = slice(seg.start, seg.stop)
            nbs, wire = neighbors.at(sl)  # wire: the 8-bit wire's copies and payloads of this segment
            dis = self._schedule.meter.slot(b, k) if mixing else None
            if seg.has_grad and not skip_update:
                # the device count (and GradScaler's scalars) replace the host step
                counts = dict(self._this_step.amp.op_kwargs() if self._this_step.amp else {},
                              state_step=b.step_count[seg.first:seg.first + 1]) if on_device else {}
                self._local_update(b, sl, group, None if on_device else seg.step, nbs, self_weight, weights,
                                   disagreement=dis, **counts, **wire)
                if on_device:
                    spread_count(b, seg)
            elif mixing:
                ops.gossip_mix_(b.flat[sl], nbs, self_weight, weights, disagreement=dis, **wire)
        if not skip_update:
            refine_classes(b) if on_device else count_steps(b)
            publish_state(b, self.state, stepped=grads_present(b) if on_device else None)

    # ------------------------------------------------------------------------------------------ grad utils

    def zero_grad(self, set_to_none: bool = True):
        # torch.optim's profiler range, under the name torch.optim.Optimizer.__init__ (or Decentralized) set
        with torch.autograd.profiler.record_function(self._zero_grad_profile_name):
            zero_grads(self._buckets, set_to_none)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Local gradient-norm clipping over the flat gradient buffers (torch.nn.utils.clip_grad_norm_
        semantics; parameters without a gradient are ignored)."""
        return clip_grad_norm(self._buckets, max_norm, norm_type, self._takes_sparse)

    def _takes_sparse(self, b: Bucket) -> bool:
        """Bucket b's sparse gradients may be densified: the class's update from them is torch's, and its group has
        no weight decay (torch's SGD and Adagrad refuse sparse gradients with weight decay)."""
        return self._sparse_grads_ok and not self.param_groups[b.group_index].get("weight_decay", 0)

    # ---------------------------------------------------------------------------------------- collectives

    def synchronize(self):
        """Completes all pending communication (ATC: applies the pending mix, so the parameters are x^{t+1}; AWC:
        the neighbours' x^t stays valid for the next step). A collective, announced as the other utilities: ranks
        at different step counts raise RuntimeError naming them (they waited for a round never sent)."""
        self._announce("synchronize()", [])
        self._schedule.synchronize()

    def _param_list(self):
        return [p for g in self.param_groups for p in g["params"]]

    # ----------------------------------------------------------------------------------------- teardown

    def shutdown(self):
        """Completes pending communication (ATC: applies the pending mix, so the parameters are x^{t+1}) and releases
        the exchanger and the process group (call before destroying the group)."""
        self._schedule.shutdown()
        self._ddp_guard.close()

