"""Where a ``GossipSchedule`` stands, for state_dict and resume: the step, the consensus state, adaptive decisions,
the cadence, and an AWC round in flight, so that a resumed run continues exactly: with delayed_mix its mix (the
CORRECTION state); with the int8 wire the public copies it has advanced (optimizer state) and the round's step and
consensus factor, from which the resumed run rebuilds the plan and mixes the copies as this run would have. Mixed
into GossipSchedule, whose attributes it reads."""

import copy
import logging
from collections.abc import Mapping
from typing import Callable, Optional

import torch

from .. import ops
from .._args import integer, real
from .._warn import warn_user, who
from .agreement import agree_on_step
from .int8_wire import PREFIX as WIRE_PREFIX
from .plan import mix_plan

#: opt.state key of a round in flight when a checkpoint was taken (its mix, added at the next round)
CORRECTION = "delayed_mix_correction"

log = logging.getLogger(__name__)

#: What loading without the "decentralized" entry does to the schedule (load_state_dict leaves it where it is)
_WITHOUT_ENTRY = (": a new optimizer's gossip schedule then starts at step 0 of its topology and cadence (its warm-up "
                  "runs again); one that has stepped keeps its own position.")


def _whole(value) -> Optional[int]:
    """A saved step as a non-negative int that the ops' int64 step arguments hold (a Python or numpy integer, or a
    float of a whole number), else None (10**400 raised OverflowError; 2**70 loaded, to fail in a later op)."""
    try:
        return integer(value, "step", low=0, high=2 ** 63 - 1)
    except ValueError:
        return None


def _real(value) -> bool:
    """A saved consensus factor: a finite number (the shared rule, _args.real; an int beyond float's range too)."""
    try:
        real(value, "factor")
        return True
    except ValueError:
        return False


def check_entry(where) -> None:
    """ValueError, naming the key, for a "decentralized" entry that cannot load: not a dict, without "step" or
    "topology", a step that is not a non-negative whole number, a consensus factor or round in flight that is no
    number. Checked before anything is loaded: the step used to be read last, so a bad one raised a bare KeyError or
    int()'s ValueError after the moments, counts and lr were already the checkpoint's and the schedule still the
    optimizer's own (and a negative one loaded: the schedule ran from it)."""
    if not where:  # None (no entry, or one set to None for DCP's flattened form) or empty: the schedule stays
        return
    said = "the state_dict's 'decentralized' entry (param_groups[0]['decentralized'], where the gossip schedule stands)"
    if not isinstance(where, Mapping):
        raise ValueError(f"{said} is a {type(where).__name__}, not the dict state_dict() saves: nothing was loaded")
    missing = [k for k in ("step", "topology") if k not in where]
    bad = ""
    if missing:
        bad = f"lacks {missing}, which state_dict() always saves"
    elif _whole(where["step"]) is None:
        bad = f"has step {where['step']!r}, not a number of optimizer steps (a whole number, 0 or more)"
    elif not isinstance(where["topology"], str) or len(where["topology"]) < 16:
        bad = f"has topology {where['topology']!r}, not a topology fingerprint and name"
    elif where.get("next_factor") is not None and not _real(where["next_factor"]):
        bad = f"has next_factor {where['next_factor']!r}, not a consensus factor (a finite number)"
    elif not _wire_round_ok(where.get("int8_wire_round")):
        bad = f"has int8_wire_round {where['int8_wire_round']!r}, not [step, factor] of a round in flight"
    else:
        bad = next((f"has {k} {where[k]!r}, not a dict" for k in ("consensus", "adaptive")
                    if where.get(k) is not None and not isinstance(where[k], Mapping)), "")
    if bad:
        raise ValueError(f"{said} {bad}: nothing was loaded. To go on from the state_dict's optimizer state under "
                         "this optimizer's schedule, drop the entry before loading" + _WITHOUT_ENTRY)


def _wire_round_ok(saved) -> bool:
    if saved is None:
        return True
    if isinstance(saved, Mapping):
        saved = [saved.get("step"), saved.get("factor")]
    return isinstance(saved, (list, tuple)) and len(saved) == 2 and _whole(saved[0]) is not None and _real(saved[1])


def check_schedule_state(where: Optional[dict], saved_state: dict, has_int8_wire: bool, num_params: int,
                         rank: Optional[int] = None):
    """Before a state dict loads: (where, restart_copies), the schedule entry to load and whether the int8 wire's
    copies must restart. torch.distributed.checkpoint loads only the state names the destination optimizer has, and
    a new one has no delayed_mix round yet (nor, with an adaptive topology, every copy), so a checkpoint may lack
    them. A round in flight is refused (its mix would be lost). Missing copies restart from zero on every rank alike
    (each rank's copy of a peer still equals the peer's own; its first send is then the whole of x, quantized), and
    the round in flight at the checkpoint is dropped (mixing it would read the zero copies as the neighbours'
    parameters): the resumed run is sane but not exact, which is warned of. Copies of only some of the `num_params`
    parameters (DCP drops the state of parameters with requires_grad=False; a wrapped torch optimizer has none for a
    parameter that never had a gradient) are loaded as they are: the others keep their values, equal on every rank
    in a new optimizer (the round in flight mixes them as no change) and on both ends of each edge in a live one
    (complete_wire_round); also not exact, also warned of. Without the entry and without copies the live copies stay
    too: a torch.optim checkpoint, rank 0's state from a run without the int8 wire. The warnings (warnings.warn: the
    user can save or load otherwise), naming `rank`, come before anything is loaded: under -W error they refuse it.
    The restart without the entry is logged instead: the documented resume from rank 0's state asks for it."""
    check_entry(where)
    names = {name for st in saved_state.values() for name in (st or {})}
    wire = {n for n in names if n.startswith(WIRE_PREFIX)}
    if not where:
        # Without the entry (dropped to start a schedule afresh, e.g. from rank 0's state on every rank) the copies
        # cannot be told to be this rank's: another rank's, under its names, made the two ends of an edge differ
        # (by 0.3 on a ring), and the replicas' mean drifted at lr 0. They restart, as every rank loading so does.
        restart = has_int8_wire and bool(wire)
        if restart:  # logged, not warned: the documented resume from rank 0's state does this on purpose
            log.warning(who(rank) + "the state dict has no 'decentralized' entry (where the gossip schedule stands): "
                        "its int8 wire copies may be another rank's, so every rank loading it restarts them from zero")
        return None, restart
    if where.get("delayed_pending") and CORRECTION not in names:
        raise ValueError(f"the state dict's gossip schedule has a delayed_mix round in flight but no '{CORRECTION}' "
                         "state: torch.distributed.checkpoint loads only the state names the destination optimizer "
                         "has (a new one has none in flight; the flattened form, only those its live opt.state "
                         "shows); save with torch.save or DCP's nested form, or where no round is in flight")
    corrected = sum(1 for st in saved_state.values() if isinstance(st, dict) and CORRECTION in st)
    if where.get("delayed_pending") and corrected < num_params:
        # The missing ones' round is dropped (their slots start at zero): silently 0.0087-0.12 off before.
        warn_user(f"the state dict's delayed_mix round in flight has a '{CORRECTION}' for {corrected} of the "
                  f"{num_params} parameters (torch.distributed.checkpoint drops the state of parameters with "
                  "requires_grad=False; Decentralized(inner) saved it only for parameters with inner state before "
                  "2026-11-30): the others' round is dropped, so the resumed run is exact only if their replicas were "
                  "equal (frozen parameters)", rank)
    if has_int8_wire and not wire:
        # Before the first step the copies are zero and a state dict holds none of them: loading it restarts them
        # too (a rollback to step 0), silently.
        if int(where.get("step", 0)) > 0:
            warn_user("the state dict has no int8 wire copies (a run without the int8 wire saved it, or "
                      "torch.distributed.checkpoint loaded only the state names the destination optimizer has, and a "
                      "new one has none yet): every rank restarts them from zero and drops the round in flight, so the "
                      "resumed run is not exact; torch.save'd state dicts of an int8 wire run carry them", rank)
        return dict(where, int8_wire_round=None), True
    complete = sum(1 for st in saved_state.values() if st and wire <= set(st))
    if has_int8_wire and wire and complete < num_params:
        warn_user(f"the state dict has all the int8 wire copies of {complete} of the {num_params} parameters "
                  "(torch.distributed.checkpoint drops the state of parameters with requires_grad=False): the others "
                  "keep the copies they have, so the resumed run is not exact", rank)
    return where, False


def _wire_round_of(extra: Optional[dict]) -> Optional[dict]:
    """The saved round in flight (the entry's "int8_wire_round"): dict(step, factor), or None. Saved as a list
    [step, factor]: torch.distributed.checkpoint takes a list of numbers for one value, which a new optimizer's None
    receives, but a dict for keys of its own, which that None lacks (every dcp.load of an AWC int8 run failed);
    torch.save'd state dicts of earlier versions hold the dict."""
    saved = (extra or {}).get("int8_wire_round")
    if saved is None or isinstance(saved, dict):
        return saved
    step, factor = saved
    return dict(step=step, factor=factor)


def _topology_entry(topology) -> str:
    """The entry's "topology": its 16-hex-digit fingerprint (what a resume must match), a space and its name (for the
    refusal's message). Not a key of its own: torch.distributed.checkpoint loads the keys a live optimizer has and
    requires the checkpoint to hold them, so a new key made every earlier DCP checkpoint unloadable; earlier
    versions saved the fingerprint alone."""
    return f"{topology.fingerprint()} {topology.name}"


class ScheduleCheckpoint:

    #: Why the next step agrees on where the schedule stands with the other ranks (agree_position): "built" (the
    #: optimizer's first step), "loaded" (the first after load_state_dict), None once they agreed
    _agree_due: Optional[str] = "built"

    @property
    def correction_due(self) -> bool:
        """Whether a loaded checkpoint's delayed_mix correction (b.state[CORRECTION]) is still to be mixed."""
        return self._restored

    @torch.no_grad()
    def checkpoint_correction(self) -> bool:
        """AWC with delayed_mix, after synchronize(): puts the mix of the round in flight, sum_j w_j (y_j - z), into
        every bucket's CORRECTION state buffer and says whether there is one (a resumed run adds it at its next
        round, where this run will mix the same values). Without one, the buffers are dropped. With the int8 wire,
        the round in flight is added to the copies instead (once: this run mixes the same copies later)."""
        pending = self._restored
        prev = self.inflight
        self._wire_round = None
        if self.int8_wire is not None and self.mode == "awc" and prev is not None and not prev.silent:
            # AWC only: ATC's plan in flight is step t - 1's, which synchronize() has just mixed (adding its payloads
            # to the copies), so there is no round for a resume to mix, and complete_wire_round would change nothing.
            self.complete_wire_round()
            self._wire_round = dict(step=prev.step, factor=prev.factor)
        elif self.cadence.delayed_mix and not pending and prev is not None and not prev.silent:
            plan = prev.as_correction(self.t)
            for b in self.buckets:
                c = b.state_buffer(CORRECTION)
                c.zero_()
                ops.gossip_mix_(c, self.decoded_inputs(b, plan), 0.0, plan.weights)
            pending = True
        if not pending:
            for b in self.buckets:
                b.state.pop(CORRECTION, None)
        self._checkpointed = pending
        return pending

    def state_dict(self) -> dict:
        return dict(step=self.t, next_factor=self._next_factor(),
                    gossip_every=self.cadence.gossip_every, warmup_steps=self.cadence.warmup_steps,
                    delayed_mix=self.cadence.delayed_mix, delayed_pending=self._checkpointed,
                    int8_wire_round=None if self._wire_round is None else [self._wire_round["step"],
                                                                           self._wire_round["factor"]],
                    topology=_topology_entry(self.topology), mode=self.mode, world_size=self.world_size, rank=self.rank,
                    consensus=self.consensus.state_dict() if hasattr(self.consensus, "state_dict") else None,
                    adaptive=self.adaptive.state_dict() if self.adaptive is not None else None)

    def _next_factor(self) -> Optional[float]:
        """The consensus factor of step t's gossip round when it is already chosen: awc's exchange in flight (atc's
        plan is of step t - 1, already applied), or one a checkpoint restored and no step has used yet (a checkpoint
        right after a resume). A warm-up or local step has none (its plan's 1.0 is no round's)."""
        if self.cadence.round_of(self.t) is None:
            return None
        if self.inflight is not None and self.inflight.step == self.t:
            return self.inflight.factor
        if self._resume_factor is not None and self._resume_factor[0] == self.t:
            return self._resume_factor[1]
        return None

    def _take_resume_factor(self, step: int) -> Optional[float]:
        """After a resume, the factor the interrupted run had already chosen for the round of the checkpoint's step
        (from the lr in effect when it launched that exchange, at the end of the step before), for that step alone:
        every later round is planned at the same point of the step as the interrupted run planned it, from the same
        lr, so it computes its own. (A checkpoint of earlier versions taken before a local step saved the local
        step's 1.0, which had been mixed into the next gossip round.)"""
        if self._resume_factor is None or step < self._resume_factor[0]:
            return None
        (saved_step, factor), self._resume_factor = self._resume_factor, None
        return factor if step == saved_step else None

    def check_loadable(self, extra: Optional[dict]):
        """ValueError when a checkpoint's extras are another schedule's (rank, world size, cadence, topology); called
        before the optimizer loads anything, so a refused state_dict leaves it as it was."""
        check_entry(extra)
        if not extra:
            return
        for key, mine in (("world_size", self.world_size), ("rank", self.rank)):
            if key in extra and extra[key] != mine:
                raise ValueError(f"this state_dict was saved by {key} {extra[key]}, this optimizer has {key} {mine}:"
                                 " every rank loads its own state_dict (its optimizer state and where the gossip "
                                 "schedule stands). To go on from another rank's moments (at another world size: "
                                 "rank 0's on every rank, docs/state.md 'Resuming at another world size or "
                                 "topology'), drop the 'decentralized' entry before loading" + _WITHOUT_ENTRY +
                                 " (torch.distributed.checkpoint saving every rank under one checkpoint_id keeps a "
                                 "single rank's copy of each entry, parameters included, as if the replicas were "
                                 "identical: save each rank under its own checkpoint_id with no_dist=True, "
                                 "docs/state.md.)")
        afresh = (" To go on from its moments under this optimizer's schedule, drop the 'decentralized' entry before "
                  "loading" + _WITHOUT_ENTRY)
        for key in ("gossip_every", "warmup_steps", "delayed_mix"):
            if key in extra and extra[key] != getattr(self.cadence, key):
                raise ValueError(f"the checkpoint was written with {key}={extra[key]}, this optimizer has "
                                 f"{key}={getattr(self.cadence, key)}." + afresh)
        fingerprint, name = extra["topology"][:16], extra["topology"][17:]
        if fingerprint != self.topology.fingerprint():
            saved = f"{name!r}, " if name else ""
            raise ValueError(f"the checkpoint was written with another topology ({saved}fingerprint {fingerprint}; "
                             f"this optimizer has {self.topology.name!r}, fingerprint {self.topology.fingerprint()})."
                             + afresh)

    def complete_wire_round(self):
        """The int8 wire: adds the payloads of the round in flight (and, ATC, of its buckets not mixed yet) to this
        rank's copies of its neighbours, where its mix would have: each sender advanced its own copy when it launched
        the round (encode), so a round dropped without this leaves the two ends of every edge differing by its
        payload, and each later mix (x_i + sum_j w_ij r_j - (sum_j w_ij) s_i) moves the replicas' mean by it."""
        plan = self.inflight
        if self.int8_wire is not None and plan is not None and not plan.silent:
            for b in self.buckets:
                self.decoded_inputs(b, self._mix_form(plan))

    def load_state_dict(self, extra: Optional[dict]):
        """Restores the step counter, consensus state and adaptive decisions from a checkpoint's extras. What can
        refuse them comes first (the optimizer's LoadRollback puts back the rest of a load this refuses)."""
        self.check_loadable(extra)
        extra = extra or None
        restored = bool(extra and extra.get("delayed_pending"))
        missing = [b.index for b in self.buckets if CORRECTION not in b.state]
        if restored and missing:
            raise ValueError(f"the checkpoint has a delayed_mix round in flight but no '{CORRECTION}' state for the "
                             f"parameters of bucket(s) {missing}: load the optimizer state and its 'decentralized' "
                             "entry from the same state_dict")
        if extra is not None:
            for key, part in (("consensus", self.consensus), ("adaptive", self.adaptive)):
                state = extra.get(key)
                if part is None or not hasattr(part, "load_state_dict") or (state is None and key == "consensus"):
                    continue
                try:  # their own classes' (a user's policy too): what they refuse, whatever its type, named here
                    part.load_state_dict(state)
                except Exception as e:  # noqa: BLE001
                    raise ValueError(f"the state_dict's 'decentralized' entry has a {key!r} this optimizer cannot "
                                     f"load ({type(e).__name__}: {e}): nothing was loaded") from e
            self.t = _whole(extra["step"])
            factor = extra.get("next_factor")  # step t's round's, when its exchange was in flight
            self._resume_factor = None if factor is None else (self.t, float(factor))
        self._restored = restored
        # Whatever was in flight carried the old parameters: start the next exchange afresh (the int8 wire's round
        # was added to the copies before the load, complete_wire_round: the copies the load leaves agree).
        self.complete_transfers()
        self.inflight = None
        self.pending = set()
        self._fresh = False
        if self.int8_wire is not None:
            self.int8_wire.forget()
            self._restore_wire_round(_wire_round_of(extra))
        self._agree_due = "loaded"

    def note_load(self):
        """A load_state_dict began (the optimizer's, before its checks): the next step agrees where the ranks stand,
        whether the load goes through or is refused and caught (a rollback keeps this). Every rank loads together:
        a rank whose load was refused at step 3 while the others' went through must meet them there, not go on into
        the gossip exchange while they wait for the agreement (before: a stall until the timeout, 30 min on gloo's
        default). "refused" until the load goes through (load_state_dict), and again if it is rolled back."""
        self._agree_due = "refused"

    #: What load_state_dict sets (load_snapshot); not _agree_due (note_load), which a rolled-back load keeps
    _LOADED = ("t", "_resume_factor", "_restored", "inflight", "pending", "_fresh", "_wire_restored")

    def load_snapshot(self) -> Callable[[], None]:
        """A function that puts back what load_state_dict changes (the optimizer's LoadRollback, for a load that
        fails part-way): the attributes it sets, the consensus schedule's and adaptive topology's state, and the int8
        wire's record of what it has decoded. The transfers it completed stay complete (their data stays valid)."""
        attrs = {k: getattr(self, k) for k in self._LOADED}  # load_state_dict rebinds them all, changes none
        consensus = copy.deepcopy(self.consensus.state_dict()) if hasattr(self.consensus, "load_state_dict") and \
            hasattr(self.consensus, "state_dict") else None
        adaptive = None if self.adaptive is None else (dict(vars(self.adaptive)),
                                                       copy.deepcopy(self.adaptive.topology.state_dict()))
        wire = None if self.int8_wire is None else (set(self.int8_wire._undecoded), self.int8_wire._names_of)

        def restore():
            for k, v in attrs.items():
                setattr(self, k, v)
            self._agree_due = "refused"  # rolled back: the next step still agrees, this rank's load named refused
            if consensus is not None:
                self.consensus.load_state_dict(consensus)
            if adaptive is not None:
                self.adaptive.topology.load_state_dict(adaptive[1])
                vars(self.adaptive).update(adaptive[0])
            if wire is not None:
                self.int8_wire._undecoded, self.int8_wire._names_of = wire
        return restore

    def agree_position(self):
        """At the first step after the optimizer was built or loaded a state_dict (where the schedule stands may then
        differ between ranks: each loaded its own checkpoint), all ranks agree on the step they are at, or each raises
        RuntimeError naming them (agreement.agree_on_step): one small all-reduce, not at the steps after it. Without
        it, ranks resumed from checkpoints of different steps (a save that did not finish on every rank, a wrong path,
        a refused load caught on one rank) gossiped with no error, each mixing its neighbours' parameters of other
        steps under its own schedule phase, until a collective utility noticed."""
        if self._agree_due and self.all_reduce is not None:
            agree_on_step(self.all_reduce, self.t, self._agree_due)
        self._agree_due = None

    def _restore_wire_round(self, saved: Optional[dict]):
        """The int8 wire's round in flight at the checkpoint: its plan, to be mixed from the restored copies
        without an exchange (mix_inputs() skips the wait until the next launch)."""
        if saved is None:
            return
        step = int(saved["step"])
        self.inflight = mix_plan(self.topology, self.rank, step, float(saved["factor"]), self.group_steps,
                                 topo_step=self.cadence.round_of(step))
        self._wire_restored = True
        self._resume_factor = None  # the restored plan carries step t's factor
