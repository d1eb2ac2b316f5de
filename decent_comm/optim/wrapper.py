"""decent_comm.Decentralized: makes any torch.optim optimizer decentralized (unfused; correctness over
speed). The inner optimizer computes the local update; the shared gossip schedule mixes around it."""

from collections import OrderedDict

import torch

from .. import ops
from .device_scalars import sq_dist, sum_scalars
from .base import DecentralizedMixin
from .fused import _split_options
from .startup import refusal_told
from .state_views import cast_problem, saved_param
from .tracing import traced


class Decentralized(DecentralizedMixin, torch.optim.Optimizer):
    """Decentralized(inner_optimizer, *, topology=..., mode=..., ...) with the options of decent_comm.DAdamW.

    awc: x^{t+1} = mix(x^t) + (inner_step(x^t) - x^t); atc: x^{t+1} = mix(inner_step(x^t)).
    Disagreement tracking, replica_variance and Adaptive topologies work as in the fused optimizers (the
    disagreement comes from the separate mix kernel here).
    Param groups, lr schedulers (pass this object or the inner one) and state_dict work as usual.
    """

    # The wrapped optimizer sees dense gradient views: a sparse gradient densified gives torch's update for the
    # optimizers that take sparse gradients (SGD, Adagrad: a zero row changes nothing but what decays anyway);
    # the others refuse sparse gradients in torch, and here too.
    _sparse_grads_ok = property(lambda self: isinstance(self.inner, (torch.optim.SGD, torch.optim.Adagrad)))
    # The round state (delayed_mix's correction, the int8 wire's copies) only for parameters that have state: a
    # wrapped torch optimizer initializes a parameter's state only when it finds none (see publish_named_state), so
    # a state holding only them would keep its own state from being created.
    _round_state_for_stateless_params = False

    def __init__(self, inner: torch.optim.Optimizer, **decentralized):
        with refusal_told(decentralized):
            if not isinstance(inner, torch.optim.Optimizer):
                raise TypeError(f"Decentralized wraps a torch.optim.Optimizer, got {type(inner).__name__}")
            if isinstance(inner, DecentralizedMixin):
                # (accepted, it failed at its second rank's first step, saying parameters were written while sent)
                raise ValueError(f"Decentralized wraps a torch.optim optimizer, got decent_comm's "
                                 f"{type(inner).__name__}, which is decentralized already: step it directly (two "
                                 "gossip schedules over the same parameters cannot work)")
            if isinstance(inner, torch.optim.SparseAdam):
                raise ValueError("Decentralized cannot wrap torch.optim.SparseAdam: it takes sparse gradients only, "
                                 "and the flat buckets hold every gradient dense; wrap torch.optim.Adam, or use DSGD / "
                                 "Decentralized(torch.optim.SGD), which take sparse gradients")
            opts = _split_options(decentralized)
        self.inner = inner
        self.defaults = inner.defaults
        # What torch.optim.Optimizer.__init__ sets up besides the groups: hook tables (OrderedDicts, which the
        # hooks' RemovableHandles reference weakly) and the step wrapper that runs the step hooks.
        self._optimizer_step_pre_hooks = OrderedDict()
        self._optimizer_step_post_hooks = OrderedDict()
        self._optimizer_state_dict_pre_hooks = OrderedDict()
        self._optimizer_state_dict_post_hooks = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()
        self._optimizer_load_state_dict_post_hooks = OrderedDict()
        self._patch_step_function()
        self._warned_capturable_if_run_uncaptured = True
        self._init_decentralized(**opts)

    # The inner optimizer's groups and state, shared (not copied) and looked up at each use: schedulers and user
    # code that touch either object see the same values, also after torch's load_state_dict on the inner optimizer
    # replaced them by new objects.
    param_groups = property(lambda self: self.inner.param_groups,
                            lambda self, groups: setattr(self.inner, "param_groups", groups))
    state = property(lambda self: self.inner.state, lambda self, state: setattr(self.inner, "state", state))

    def __repr__(self):
        # the inner optimizer's repr shows the shared param group 0, with its schedule entry: refreshed first (it
        # showed the entry of the last state_dict(), 'step': 0 after two steps)
        self._refresh_shown_schedule()
        return f"Decentralized({self.inner!r}, topology={self.topology.name!r}, mode={self.mode!r})"

    def _optimizer_name(self) -> str:
        return f"Decentralized({type(self.inner).__name__})"

    @traced("mix_update")
    def _update_awc(self, plan, skip_update: bool, measure: bool):
        """mix(x^t) - x^t per bucket, then the inner step at x^t, then the mix added on top."""
        deltas = []
        for b in self._buckets:
            nbs, wire = self._schedule.mix_inputs(b, plan).at()
            if not plan.mixes:  # a local or warm-up step: nothing to add on top (nor a disagreement to measure)
                continue
            mixed = b.flat.clone()
            ops.gossip_mix_(mixed, nbs, plan.self_weight, plan.weights, disagreement=self._schedule.meter.slot(b, 0),
                            **wire)
            deltas.append(mixed.sub_(b.flat))
        refs = [b.flat.clone() for b in self._buckets] if measure else None
        self._update_local(skip_update)
        step_sq = sum_scalars([sq_dist(b.flat, r) for b, r in zip(self._buckets, refs)]) if measure else None
        for b, delta in zip(self._buckets, deltas):
            b.flat.add_(delta)
        return step_sq

    def _inner_closure(self, closure):
        # In a warm-up step every evaluation's gradients are averaged before the wrapped optimizer reads them (DDP's
        # backward): averaged before the closure ran, the stale .grad were, and the replicas drifted apart (0.25 in 4
        # steps of Adam at 2 ranks). An optimizer that evaluates it a data-dependent number of times (LBFGS) must do
        # so alike on every rank, as under DDP: else the average's announcement raises on every rank, saying so (it
        # carries the evaluation's number).
        if not self._schedule.cadence.in_warmup(self._schedule.t):
            return closure

        evaluations = 0

        def averaged():
            nonlocal evaluations
            evaluations += 1
            with torch.enable_grad():
                loss = closure()
            with torch.no_grad():
                self._gather_grads()
                self._schedule.average_gradients(self._schedule.t, evaluation=evaluations)
            return loss
        averaged.averages = True
        return averaged

    def _average_gradients(self, found_inf, grad_scale):
        if not getattr(self._this_step.closure, "averages", False):  # else after each evaluation of the closure
            return super()._average_gradients(found_inf, grad_scale)
        return grad_scale

    def _initialize_state(self):
        self.inner.step()  # the wrapped optimizer initializes its own state (torch semantics), without gossip

    def _adopt_state_edits(self):
        """Nothing to adopt: the wrapped optimizer keeps its own state in opt.state and reads it at every step."""

    def _note_state(self):
        pass

    @traced("local_update")
    def _update_local(self, skip_update: bool):
        if not skip_update:
            now = self._this_step
            now.closure_loss = self.inner.step(now.closure) if now.closure is not None else self.inner.step()

    def _optimizer_state_dict(self) -> dict:
        # this wrapper's state_dict hooks run around the whole (DecentralizedMixin.state_dict); the inner
        # optimizer's state_dict runs the inner optimizer's
        sd = self.inner.state_dict()
        # The round state of the parameters the wrapped optimizer keeps no state for (SGD without momentum, LBFGS's
        # all but its first, a parameter without a gradient yet) stays out of opt.state (_round_state_for_stateless_
        # params), so it goes into the saved state alone: without it a resume was refused for a torch.save "made
        # by torch.distributed.checkpoint", or went on 2e-4 to 0.12 off the uninterrupted run (review GE).
        left_out = self.__dict__.pop("_round_state_left_out", {})  # (views: held on, a dropped buffer would live)
        if left_out:
            index = {p: i for group, saved in zip(self.inner.param_groups, sd["param_groups"])
                     for p, i in zip(group["params"], saved["params"])}
            for p, entries in left_out.items():
                sd["state"][index[p]] = {**sd["state"].get(index[p], {}), **entries}  # (a new dict: not the live one)
        return sd

    def _read_optimizer_state(self, saved_state: dict, param_of: dict):
        """The wrapped optimizer's load casts each saved entry to its parameter's dtype and device: what it cannot
        cast (a meta tensor; a complex one into a real parameter, whose imaginary part it drops) is refused here,
        before anything is loaded. Its step does the rest of the checking, as torch's optimizers do."""
        for key, st in saved_state.items():
            p = saved_param(param_of, key)
            for name, value in (st or {}).items():
                problem = cast_problem(value, p)
                if problem:
                    raise ValueError(f"state {name!r} of parameter {key!r} {problem}: nothing was loaded")

    def _write_optimizer_state(self, state_dict: dict, loaded, param_of: dict):
        # The round state (the int8 wire's copies, delayed_mix's correction) is float32 whatever the parameters' dtype,
        # but the wrapped optimizer's load casts every floating entry to its parameter's: over bf16 parameters the
        # copies came back rounded, and the resumed run left the uninterrupted one (0.0625 after 4 steps of SGD at 2
        # ranks over the int8 wire). So the wrapped optimizer loads the rest, and the round state is put back beside
        # it as saved, only moved to the parameter's device (_gather_round_state copies it into the flat buffers).
        if "state" not in state_dict:  # torch's load says what is missing
            return self.inner.load_state_dict(state_dict)
        state, round_state = {}, {}
        for key, st in state_dict["state"].items():
            p = saved_param(param_of, key)
            if p is None or not st:
                state[key] = st
                continue
            is_round = {n: torch.is_tensor(v) and self._is_buffer_name(n) for n, v in st.items()}
            rest = {n: v for n, v in st.items() if not is_round[n]}
            if rest or not any(is_round.values()):  # (round state alone: the wrapped optimizer has none for it)
                state[key] = rest
            round_state[p] = {n: v.to(device=p.device) for n, v in st.items() if is_round[n]}
        self.inner.load_state_dict(dict(state_dict, state=state))
        for p, entries in round_state.items():
            if entries:
                self.state[p].update(entries)

    def _gather_round_state(self):
        super()._gather_round_state()
        # In the flat buffers now: a parameter whose state was round state alone (or nothing, once a restart dropped
        # the copies) is given none again, or the wrapped optimizer, which initializes a parameter's state only when
        # it finds none, would not create its own.
        for p in [p for p, st in self.state.items() if torch.is_tensor(p) and isinstance(st, dict)
                  and all(self._is_buffer_name(n) for n in st)]:
            del self.state[p]
