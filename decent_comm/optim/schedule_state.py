"""Where a ``GossipSchedule`` stands, for state_dict and resume: the step, the consensus state, adaptive decisions,
the cadence, and an AWC round in flight, so that a resumed run continues exactly: with delayed_mix its mix (the
CORRECTION state); with the int8 wire the public copies it has advanced (optimizer state) and the round's step and
consensus factor, from which the resumed run rebuilds the plan and mixes the copies as this run would have. Mixed
into GossipSchedule, whose attributes it reads."""

from typing import Optional

import torch

from .. import ops
from .plan import mix_plan

#: opt.state key of a round in flight when a checkpoint was taken (its mix, added at the next round)
CORRECTION = "delayed_mix_correction"


def check_state_names(where: Optional[dict], saved_state: dict) -> None:
    """Raises ValueError when the per-parameter state the saved schedule needs back is not in the state dict."""
    have = {name for st in saved_state.values() for name in (st or {})}
    missing = sorted(set((where or {}).get("state_names", ())) - have)
    if missing:
        raise ValueError(f"the state dict's gossip schedule needs per-parameter state {missing}, which the state dict "
                         "lacks. torch.distributed.checkpoint's flattened form (flatten_optimizer_state_dict=True) "
                         "keeps only the state names a newly built optimizer has: save and load with the nested form "
                         "(the default), or save where no round is in flight and without comm_dtype=torch.int8")


class ScheduleCheckpoint:

    @torch.no_grad()
    def checkpoint_correction(self) -> bool:
        """AWC with delayed_mix, after synchronize(): puts the mix of the round in flight, sum_j w_j (y_j - z), into
        every bucket's CORRECTION state buffer and says whether there is one (a resumed run adds it at its next
        round, where this run will mix the same values). Without one, the buffers are dropped. With the int8 wire,
        the round in flight is added to the copies instead (once: this run mixes the same copies later)."""
        pending = self._restored
        prev = self.inflight
        self._wire_round = None
        if self.wire is not None and self.mode == "awc" and prev is not None and not prev.silent:
            for b in self.buckets:
                self.received(b, self._mix_form(prev))
            self._wire_round = dict(step=prev.step, factor=prev.factor)
        elif self.cadence.delayed_mix and not pending and prev is not None and not prev.silent:
            plan = prev.as_correction(self.t)
            for b in self.buckets:
                c = b.state_buffer(CORRECTION)
                c.zero_()
                ops.gossip_mix_(c, self.received(b, plan), 0.0, plan.weights)
            pending = True
        if not pending:
            for b in self.buckets:
                b.state.pop(CORRECTION, None)
        self._checkpointed = pending
        return pending

    def state_dict(self) -> dict:
        # atc: the in-flight plan is of step t - 1 and already applied; awc: of step t, still to be used
        nxt = self.inflight if self.inflight is not None and self.inflight.step == self.t else None
        return dict(step=self.t, next_factor=nxt.factor if nxt is not None else None,
                    gossip_every=self.cadence.gossip_every, warmup_steps=self.cadence.warmup_steps,
                    delayed_mix=self.cadence.delayed_mix, delayed_pending=self._checkpointed,
                    int8_wire_round=self._wire_round,
                    topology=self.topology.fingerprint(), mode=self.mode, world_size=self.world_size, rank=self.rank,
                    consensus=self.consensus.state_dict() if hasattr(self.consensus, "state_dict") else None,
                    adaptive=self.adaptive.state_dict() if self.adaptive is not None else None)

    def load_state_dict(self, extra: Optional[dict]):
        """Restores the step counter, consensus state and adaptive decisions from a checkpoint's extras."""
        if extra is not None:
            for key, mine in (("world_size", self.world_size), ("rank", self.rank)):
                if key in extra and extra[key] != mine:
                    raise ValueError(f"this state_dict was saved by {key} {extra[key]}, this optimizer has {key} {mine}:"
                                     " every rank loads its own state_dict (its optimizer state and where the gossip "
                                     "schedule stands). To start a schedule afresh from another rank's moments, drop "
                                     "the 'decentralized' entry before loading.")
            for key in ("gossip_every", "warmup_steps", "delayed_mix"):
                if key in extra and extra[key] != getattr(self.cadence, key):
                    raise ValueError(f"the checkpoint was written with {key}={extra[key]}, this optimizer has "
                                     f"{key}={getattr(self.cadence, key)}")
            if extra["topology"] != self.topology.fingerprint():
                raise ValueError("the checkpoint was written with another topology (fingerprint "
                                 f"{extra['topology']}, this optimizer has {self.topology.fingerprint()})")
            self.t = int(extra["step"])
            self._resume_factor = extra.get("next_factor")
            if extra.get("consensus") is not None and hasattr(self.consensus, "load_state_dict"):
                self.consensus.load_state_dict(extra["consensus"])
            if self.adaptive is not None:
                self.adaptive.load_state_dict(extra.get("adaptive"))
        self._restored = bool(extra and extra.get("delayed_pending"))
        missing = [b.index for b in self.buckets if CORRECTION not in b.state]
        if self._restored and missing:
            raise ValueError(f"the checkpoint has a delayed_mix round in flight but no '{CORRECTION}' state for the "
                             f"parameters of bucket(s) {missing}: load the optimizer state and its 'decentralized' "
                             "entry from the same state_dict")
        # Whatever was in flight carried the old parameters: start the next exchange afresh.
        self.complete_transfers()
        self.inflight = None
        self.pending = set()
        self._fresh = False
        if self.wire is not None:
            self.wire.forget()
            self._restore_wire_round(extra.get("int8_wire_round") if extra else None)

    def _restore_wire_round(self, saved: Optional[dict]):
        """The int8 wire's round in flight at the checkpoint: its plan, to be mixed from the restored copies
        without an exchange (received() skips the wait until the next launch)."""
        if saved is None:
            return
        step = int(saved["step"])
        self.inflight = mix_plan(self.topology, self.rank, step, float(saved["factor"]), self.groups,
                                 topo_step=self.cadence.round_of(step))
        self._wire_restored = True
        self._resume_factor = None  # the restored plan carries step t's factor
