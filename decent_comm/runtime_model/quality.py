"""The planner's quality term: time to All-Reduce's loss, not step time.

Gossip and periodic averaging need more steps than All-Reduce to reach its loss (between averages each replica
follows its own batches), so a configuration is worth its step time times a steps multiplier m = (steps to DDP's
final loss x 1.02) / (DDP's steps to it). The multipliers are measured, not derived: bench/time_to_target.py on
train_lm, 4 emulated nodes x 1 rank, 50 Mbit links, 400-step schedules (docs/time_to_target.md). They carry over to
other workloads only roughly; near a tie, measure with that benchmark.

The step time of a recipe comes from the closed form's per-step communication of its topology (``Prediction``),
rescaled to the recipe's wire, and the mean compute time C:

* the wire: fp32, bf16 (2 bytes) or the int8 wire (1 byte and a float32 scale per 512 parameters);
* interval k without delay: a round's transfer overlaps the next step's compute (awc) or only its forward (atc,
  the fraction f of C): C + mean_r max(0, D_r - C) / k, with f C in place of C for atc;
* interval k with delayed_mix: it overlaps the whole interval: C + mean_r max(0, D_r - k C) / k;
* periodic averaging every k steps (an all-reduce of the parameters, as torch's PostLocalSGDOptimizer):
  C + max(0, T_AR - C) / k;
* All-Reduce: the closed form's step (m = 1).
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional

from .workload import WIRE_DTYPES

#: bytes per parameter on the wire of a recipe (int8: one byte plus a float32 scale per 512)
WIRE_BYTES = {wire: float(WIRE_DTYPES[wire]) for wire in ("fp32", "bf16", "int8")}
#: how much faster than All-Reduce something must be predicted to go ahead of it: a recipe in this list, a topology
#: in the planner's recommendation (one margin, so the two agree on a near tie)
TIE_MARGIN = 0.05
WIRE_OPTION = {"fp32": None, "bf16": "comm_dtype=torch.bfloat16", "int8": "comm_dtype=torch.int8"}


@dataclasses.dataclass(frozen=True)
class RecipeKind:
    """A configuration the quality term prices: ``family`` gossip / periodic / allreduce, its optimizer options,
    and its measured steps multiplier with where it was measured."""

    family: str
    mode: str
    gossip_every: int
    delayed_mix: bool
    wire: str
    steps_multiplier: float
    measured: str

    @property
    def bf16_wire(self) -> bool:
        return self.wire == "bf16"


#: train_lm, 4 x 1 emulated nodes, 50 Mbit, seed 0: DDP reached its target in 270 steps (bench/time_to_target.py)
RECIPES = (
    RecipeKind("allreduce", "-", 1, False, "fp32", 1.0, "the reference"),
    RecipeKind("gossip", "awc", 1, False, "bf16", 285 / 270, "one-peer-exp awc bf16, 285 steps"),
    RecipeKind("gossip", "awc", 1, False, "int8", 274 / 270, "one-peer-exp awc int8, 274 steps (s300)"),
    RecipeKind("gossip", "atc", 2, False, "bf16", 288 / 270, "one-peer-exp atc k2 bf16, 288 steps"),
    RecipeKind("gossip", "awc", 2, True, "bf16", 340 / 270, "one-peer-exp awc k2 delayed bf16, 340 steps"),
    RecipeKind("gossip", "awc", 4, True, "bf16", 509 / 270, "one-peer-exp awc k4 delayed bf16, 509 steps (s600)"),
    RecipeKind("periodic", "atc", 4, False, "fp32", 293 / 270, "complete atc k4, 293 steps"),
    RecipeKind("periodic", "atc", 8, False, "fp32", 357 / 270, "complete atc k8, 357 steps"),
)


@dataclasses.dataclass(frozen=True)
class Priced:
    """A recipe on this cluster: ``topology`` (None for All-Reduce), predicted ``step_seconds`` and
    ``time_vs_allreduce`` (time to All-Reduce's loss as a fraction of All-Reduce's)."""

    kind: RecipeKind
    topology: Optional[str]
    step_seconds: float
    time_vs_allreduce: float

    @property
    def label(self) -> str:
        k = self.kind
        if k.family == "allreduce":
            return "allreduce (DDP)"
        if k.family == "periodic":
            return f"periodic averaging every {k.gossip_every} steps (complete, {k.mode})"
        opts = [k.mode] + ([f"gossip_every={k.gossip_every}"] if k.gossip_every > 1 else []) + \
            (["delayed_mix=True"] if k.delayed_mix else []) + ([WIRE_OPTION[k.wire]] if WIRE_OPTION[k.wire] else [])
        return f"{self.topology}: " + ", ".join(opts)

    def to_dict(self) -> dict:
        return dict(label=self.label, family=self.kind.family, topology=self.topology, mode=self.kind.mode,
                    gossip_every=self.kind.gossip_every, delayed_mix=self.kind.delayed_mix,
                    bf16_wire=self.kind.bf16_wire, wire=self.kind.wire, steps_multiplier=self.kind.steps_multiplier,
                    measured=self.kind.measured, step_seconds=self.step_seconds,
                    time_vs_allreduce=self.time_vs_allreduce)


def _gossip_step(per_round_comm, compute: float, k: int, delayed: bool, hidden_fraction: float) -> float:
    hidden = k * compute if delayed else hidden_fraction * compute
    rounds = list(per_round_comm) or [0.0]
    return compute + sum(max(0.0, d - hidden) for d in rounds) / len(rounds) / k


def wire_bytes(wire: str, param_bytes: float = 4) -> float:
    """Bytes per element a recipe's wire moves for parameters of `param_bytes`: "fp32" is the optimizers' default
    wire (comm_dtype=None, WIRE_OPTION), the parameters' own dtype; bf16 is never wider than them; the 8-bit wire is
    its own."""
    if wire == "fp32":
        return float(param_bytes)
    return WIRE_BYTES[wire] if wire == "int8" else min(WIRE_BYTES[wire], float(param_bytes))


def price(allreduce, gossip: Optional[Dict[str, object]], compute: float, allreduce_bytes_per_param: float,
          forward_fraction: float, param_bytes: float = 4, refused=()) -> List[Priced]:
    """Every recipe, cheapest time to All-Reduce's loss first. `allreduce`: its ``Prediction``, made for
    `allreduce_bytes_per_param` (periodic averaging all-reduces the parameters: rescaled from it); `gossip`:
    per wire of WIRE_BYTES, the ``Prediction`` of the topology gossip recipes use over that wire (what the step
    moves depends on the wire, not only its bytes: the 8-bit wire never groups, a bf16 wire's group steps sum
    float32; None: that wire's recipes are not priced), or None (only All-Reduce and periodic averaging); `compute`:
    the mean compute time per step, `forward_fraction` its forward's share; `param_bytes`: the parameters' bytes per
    element (periodic averaging all-reduces them in their dtype); `refused`: ``(family, wire, delayed_mix)`` of the
    recipes the optimizers would refuse on their topology (``mix_width``): left out."""
    ar_step = allreduce.step_seconds
    out = []
    for kind in RECIPES:
        if (kind.family, kind.wire, kind.delayed_mix) in refused:
            continue
        if kind.family == "allreduce":
            step, topo = ar_step, None
        elif kind.family == "periodic":
            comm = allreduce.comm_seconds * wire_bytes(kind.wire, param_bytes) / allreduce_bytes_per_param
            step, topo = compute + max(0.0, comm - compute) / kind.gossip_every, "complete"
        elif gossip is None or gossip[kind.wire] is None:
            continue
        else:
            pred = gossip[kind.wire]
            rounds = list(pred.per_step_comm_seconds or (pred.comm_seconds,))
            hidden = forward_fraction if kind.mode == "atc" else 1.0
            step = _gossip_step(rounds, compute, kind.gossip_every, kind.delayed_mix, hidden)
            topo = pred.name
        out.append(Priced(kind, topo, step, kind.steps_multiplier * step / ar_step if ar_step > 0 else 1.0))
    # A recipe goes ahead of All-Reduce only when predicted faster by more than the multipliers' noise (seeds differ
    # by up to 10% in time to target): on a near tie All-Reduce is the simpler choice.
    return sorted(out, key=lambda p: p.time_vs_allreduce * (1.0 if p.kind.family == "allreduce" else 1.0 + TIE_MARGIN))
