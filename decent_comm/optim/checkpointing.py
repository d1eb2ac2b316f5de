"""state_dict and load_state_dict of the decentralized optimizers, mixed into DecentralizedMixin: torch.optim's
format (per-parameter state, views of the flat buffers, and param groups), with where the gossip schedule stands in
param group 0 and, for an exact resume, a delayed round's correction and the 8-bit wire's public copies as
per-parameter state. A state_dict that cannot load is refused before anything is loaded, and a load that raises
once it writes puts the optimizer back as it was (load_rollback.py).
"""

import torch

from .._warn import job_rank
from . import state_dict_hooks
from .int8_wire import PREFIX as WIRE_PREFIX
from .int8_wire import Int8Wire
from .load_rollback import LoadRollback
from .schedule import CORRECTION
from .schedule_state import check_schedule_state
from .state_views import (StateLayout, drop_named_state, gather_named_state, param_states, publish_named_state,
                          read_state, saved_param, split_saved_state, write_state)

#: param_groups[0] key of where the gossip schedule stands (GossipSchedule.state_dict())
SCHEDULE_KEY = "decentralized"

#: The per-parameter state names of the optimizers of this package and of torch.optim's (which Decentralized wraps;
#: LBFGS keeps its own in its first parameter's state): under one of them, state this class does not keep is another
#: optimizer's checkpoint, refused. Any other name is a foreign entry that another library keeps in the optimizer's
#: state (timm's Lookahead: "lookahead_slow_buff"), saved and loaded as torch.optim does.
OPTIMIZER_STATE_NAMES = frozenset({
    "step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "accum", "momentum_buffer", "exp_inf", "mu_product", "sum",
    "square_avg", "acc_delta", "grad_avg", "prev", "step_size", "eta", "mu", "ax", "row_var", "col_var", "variance",
    "func_evals", "n_iter", "d", "t", "old_dirs", "old_stps", "ro", "H_diag", "prev_flat_grad", "prev_loss", "al"})


def _cast_like_torch(param, value):
    """A foreign entry as torch.optim.Optimizer.load_state_dict gives it to the optimizer: tensors (also inside
    dicts, lists and tuples) to the parameter's device and (a floating-point parameter) dtype, the same tensor when
    that changes nothing. Other values stay as they are (torch's rebuilds a string from a generator of its
    characters, which makes it the generator's repr)."""
    if torch.is_tensor(value):
        return value.to(dtype=param.dtype, device=param.device) if param.is_floating_point() else \
            value.to(device=param.device)
    if isinstance(value, dict):
        return {k: _cast_like_torch(param, v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_cast_like_torch(param, v) for v in value)
    return value


class StateDictMixin:
    """Reads the optimizer's _buckets, _schedule, state, param_groups, _state_names and _check_group_options."""

    #: every per-parameter state buffer the class keeps (None: a wrapped torch optimizer's, its own to judge), and
    #: those a parameter that has stepped always has
    _STATE_NAMES = None
    _STATE_NEEDED = ()
    #: whether the step count restarts with the state buffers (DSGD's: the steps since the momentum buffer started)
    _COUNT_FOLLOWS_BUFFERS = False

    def _state_layout(self) -> StateLayout:
        return StateLayout(self._bucket_state_names, self._is_buffer_name, self._COUNT_FOLLOWS_BUFFERS)

    def _is_buffer_name(self, name) -> bool:
        """Whether opt.state[p][name] is a view of a flat buffer, not a foreign entry."""
        return name in (self._STATE_NAMES or ()) or name == CORRECTION or str(name).startswith(WIRE_PREFIX)

    def _optimizer_state_dict(self) -> dict:
        """torch.optim's state_dict: opt.state already holds per-parameter views of the flat state."""
        with state_dict_hooks.suspended(self):
            return super().state_dict()

    def _saved_param_of(self, state_dict: dict) -> dict:
        """As torch.optim: the saved groups' "params" (indices, or FQNs from torch.distributed.checkpoint) name the
        current parameters by position."""
        saved_ids = [k for g in state_dict["param_groups"] for k in g["params"]]
        return dict(zip(saved_ids, self._param_list()))

    def _read_optimizer_state(self, saved_state: dict, param_of: dict):
        """The checking half of loading the parameters' state (state_views.read_state): ValueError for what cannot
        load, nothing written; what it returns _write_optimizer_state writes."""
        return read_state(self._buckets, saved_state, param_of, self._state_layout(), foreign_value=_cast_like_torch)

    def _write_optimizer_state(self, state_dict: dict, loaded, param_of: dict):
        _, others = split_saved_state(state_dict.get("state", {}), param_of)
        with state_dict_hooks.suspended(self):  # torch keeps the keys that name no parameter as they are
            super().load_state_dict({"state": others, "param_groups": state_dict["param_groups"]})
        write_state(self._buckets, loaded, self.state, self._state_layout())
        # opt.state (and so the next state_dict()) in the saved order, as torch's load builds it: write_state put the
        # parameters' entries after the others
        for saved_key in state_dict.get("state", {}):
            p = saved_param(param_of, saved_key)
            key = saved_key if p is None else p
            if key in self.state:
                self.state[key] = self.state.pop(key)

    def state_dict(self):
        return state_dict_hooks.state_dict_with_hooks(self, self._state_dict)

    def _state_dict(self):
        self._adopt_state_edits()  # what the user edited since the last step is what a torch.optim checkpoint holds
        # not announced: a state_dict() on some ranks only (rank 0 saving) works
        self._schedule.synchronize("state_dict()")
        self._publish_round_state(self._schedule.checkpoint_correction())
        sd = self._optimizer_state_dict()
        # Where the gossip schedule stands travels in param group 0: torch.distributed.checkpoint keeps only
        # "state" (keyed by parameter) and "param_groups" of an optimizer's state_dict.
        sd["param_groups"][0][SCHEDULE_KEY] = self._show_schedule()
        self._note_state()
        return sd

    def __repr__(self):
        self._refresh_shown_schedule()
        return super().__repr__()

    def _refresh_shown_schedule(self) -> None:
        """For repr(): where the schedule stands now, not at the last state_dict() (a subclass's own __repr__, which
        shows param group 0, calls this too)."""
        if hasattr(self, "_schedule"):  # (not during construction)
            self._show_schedule()

    def _show_schedule(self) -> dict:
        """Puts where the schedule stands into the live param group 0 too: torch.distributed.checkpoint's flattened
        form (flatten_optimizer_state_dict=True) restores only the group keys the live optimizer has."""
        where = self._schedule.state_dict()
        self.param_groups[0][SCHEDULE_KEY] = where
        return dict(where)

    def load_state_dict(self, state_dict):
        state_dict_hooks.load_with_hooks(self, state_dict, self._load_state_dict)

    def _load_state_dict(self, state_dict):
        # Any load, refused or not, has the next step agree where the ranks stand (schedule.agree_position): every
        # rank loads together, and one that caught its refusal must meet the others whose loads went through.
        self._schedule.note_load()
        groups = [dict(g) for g in state_dict["param_groups"]]
        extra = state_dict.pop(SCHEDULE_KEY, None)
        extra = groups[0].pop(SCHEDULE_KEY, extra) if groups else extra
        state_dict["param_groups"] = groups
        # Everything that can refuse the state_dict, before anything is loaded:
        self._complete_loaded_groups(groups)
        self._check_group_options(groups)
        has_int8_wire = self._schedule.int8_wire is not None
        # only the parameters' entries are checked: the other keys are kept as they are (split_saved_state)
        param_of = self._saved_param_of(state_dict)
        saved_state, _ = split_saved_state(state_dict.get("state", {}), param_of)
        extra, restart_copies = check_schedule_state(extra, saved_state, has_int8_wire, len(self._param_list()),
                                                     job_rank(self))
        self._schedule.check_loadable(extra)
        self._check_state_names(saved_state)
        # The int8 wire's round in flight goes into the live copies first, on every rank: a state dict without
        # copies and without the schedule entry (a torch.optim checkpoint, rank 0's state at another world size)
        # keeps them, and the senders' own copies already hold that round. Loaded or restarted copies replace them.
        # It is what the next mix would do anyway, so a load refused after it leaves the optimizer as it was.
        self._schedule.complete_wire_round()
        loaded = self._read_optimizer_state(saved_state, param_of)  # its tensors and counts: read, checked
        with LoadRollback(self):  # what still raises puts the optimizer back as it was (load_rollback.py)
            self._write_optimizer_state(state_dict, loaded, param_of)
            if restart_copies or not has_int8_wire:  # without the int8 wire, copies loaded would be kept for nothing
                drop_named_state(self._buckets, self.state, WIRE_PREFIX)
            self._gather_round_state()
            self._schedule.load_state_dict(extra)
            self._show_schedule()
            self._note_state()

    def _check_state_names(self, saved: dict):
        """Refuses per-parameter state this class never keeps: another optimizer's checkpoint (DSGD's or SGD's
        momentum_buffer in DAdamW, Adam's moments in DSGD). Loaded, the foreign buffers were kept for nothing and
        the saved step counts applied to state that started at zero (DAdamW's first update after a DSGD
        checkpoint of 3 steps: 0.58 lr, Adam's bias correction of step 4 on zero moments); torch's optimizers fail
        at the next step instead. A subset loads (AccumAdamW from AdamW: its accumulator starts at zero), and so do
        names no optimizer keeps (OPTIMIZER_STATE_NAMES): another library's entries, kept as they are, as in torch."""
        if self._STATE_NAMES is None:
            return
        name, mine = type(self).__name__, set(self._STATE_NAMES) | {"step"}
        for key, st in saved.items():
            st = st or {}
            foreign = sorted(str(n) for n in st if n in OPTIMIZER_STATE_NAMES and n not in mine)
            lacking = [n for n in self._STATE_NEEDED if n not in st] if "step" in st else []
            if foreign or lacking:
                what = f"has state {foreign} that {name} does not keep" if foreign else \
                    f"has a step count but not {name}'s {lacking} (DSGD without momentum keeps only a count)"
                raise ValueError(f"{name}.load_state_dict: parameter {key!r} {what}: the state_dict is another "
                                 f"optimizer's ({name} keeps {sorted(self._STATE_NAMES)} and step). Nothing was "
                                 "loaded; drop those entries from each parameter's state to load the rest, or empty "
                                 "its 'state' to start this optimizer's state afresh")

    # Whether the round state (delayed_mix's correction, the int8 wire's copies) goes into opt.state for parameters
    # that have no state yet too (Decentralized: False).
    _round_state_for_stateless_params = True

    def _publish_round_state(self, pending: bool):
        """A round in flight (delayed_mix, the int8 wire) and the int8 wire's public copies travel as per-parameter
        state, so torch.save and DCP carry them. What is left out of opt.state (parameters without state, under
        Decentralized) is kept in _round_state_left_out for the state_dict."""
        # Not before the first step of an optimizer without state (its copies are zero, as a new one's): a state
        # that holds only them made torch.distributed.checkpoint skip its state initialization (a non-empty
        # opt.state), so a template without Adam's moments loaded none of them.
        # Decentralized keeps the copies of parameters without state out of opt.state (_round_state_for_stateless_
        # params), so the guard is not needed there, and a template without them loaded none under DCP (not exact).
        copies = self._schedule.t > 0 or any(param_states(self.state)) or not self._round_state_for_stateless_params
        self._round_state_left_out = {}
        for name, present in [(CORRECTION, pending)] + [(n, copies) for n in Int8Wire.state_names(self._buckets)]:
            left_out = publish_named_state(self._buckets, self.state, name, present,
                                           self._round_state_for_stateless_params)
            for p, view in left_out.items():
                self._round_state_left_out.setdefault(p, {})[name] = view

    def _let_go(self):
        """After a step, what it no longer needs: the last whole-group all-reduces' tensors (exchange.bounded), and
        a checkpoint's delayed_mix correction, which only a run resumed from that checkpoint reads (at its next
        round): this run mixes that round from what it received, and the next state_dict() computes the correction
        afresh. Kept, it was one more buffer of every bucket for the rest of the run."""
        if self._schedule.all_reduce is not None:
            self._schedule.all_reduce.prune()
        if not self._schedule.correction_due and any(CORRECTION in b.state for b in self._buckets):
            drop_named_state(self._buckets, self.state, CORRECTION)

    def _gather_round_state(self):
        wire = {k for st in param_states(self.state) for k in st if isinstance(k, str) and k.startswith(WIRE_PREFIX)}
        for name in [CORRECTION] + sorted(wire):
            gather_named_state(self._buckets, self.state, name)
