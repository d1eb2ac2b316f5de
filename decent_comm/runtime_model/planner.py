"""Rank candidate topologies against All-Reduce and recommend one: ``plan``.

For each candidate: the closed-form ``Prediction``, a simulation
(``simulator.simulate``) unless disabled, and the spectral gap per step
(``decent_comm.topology.spectral_gap(...).per_step`` up to ``MAX_GAP_WORLD_SIZE``
ranks, ``mixing.sparse_gap_per_step`` above: how much of the disagreement one
gossip step removes; sparser graphs mix slower, so they may need more steps to
reach the same loss even when each step is faster).

**Recommendation rule.**  Among the gossip candidates whose ``gap/step >= gap_threshold`` (default 0.1; an
unknown gap counts as passing), take the one with the shortest step time (simulated when simulated, else closed
form; steps equal up to rounding, ``ROUNDING``, go to the first listed); if none reaches the threshold, all of
them compete.  It is recommended only when its step is faster than All-Reduce's by more than
``quality.TIE_MARGIN`` (5%): ``step x 1.05 < All-Reduce's step``, the margin by which a recipe must beat
All-Reduce to rank ahead of it in ``Plan.quality`` (one margin for both lists).  Otherwise All-Reduce: at equal
speed its exact average is strictly better than gossip's.

**Time to quality.**  Step time is not what a user buys: ``Plan.quality`` prices recipes (All-Reduce,
periodic averaging, and the fastest eligible one-peer topology, else gossip topology, with its mode, wire
(bf16 / int8), interval and delayed mix) by
their predicted time to All-Reduce's loss, step time x a measured steps multiplier (``quality``), and
``Plan.quality[0]`` is the cheapest: the configuration to train with when the goal is a given loss soonest.

**Bounded work.**  A simulation runs fewer steps when ``steps x work`` exceeds
``MAX_SIM_WORK`` (down to 4 periods + 20); when even that would cost more than
``MAX_SIM_COST`` for some candidate (large clusters), nothing is simulated and
every candidate is compared by its closed form (a note says so).

**What the optimizers refuse.**  A candidate whose mix reads more buffers than
the fused kernels take in one call (``mix_width``: more than 32 in-neighbours
on a point-to-point step, 31 with the 8-bit or a narrower wire; complete point to point on
34+ ranks) is skipped with the reason, before it is priced (so no step of a
candidate reaches ``messages.MAX_MESSAGES``), and no time-to-quality recipe is
priced that the optimizers would refuse (a wire's, delayed_mix's, or periodic
averaging's, which runs complete: with a note). The 8-bit wire's bucket limit (2^31 - 1 elements,
``decent_comm.ops.MAX_PAYLOAD_ELEMENTS``) is not checked: the workload has the parameter count, not the
parameters' sizes or the optimizers' ``bucket_cap_mb`` (at their default 25 MiB, only a parameter of 2^31
elements or more is refused).

Default candidates: one-peer-exp, one-peer-hypercube (only when the number of
ranks is a power of two), exp, ring, aer and aer-pair (only when the number of
nodes is a power of two >= 2), base-k, torus, complete.  A candidate
that cannot be built for the cluster (e.g. aer on 3 nodes) is skipped with the
reason in ``Plan.skipped``.
"""
from __future__ import annotations

import dataclasses
import functools

from .. import topology as _topology
from .closed_form import Prediction, predict_allreduce, predict_gossip
from .gossip import make_topology, workload_step_groups
from .loads import schedule_of
from .mix_width import MixTooWide, check_mix_width
from .mixing import sparse_gap_per_step
from .quality import RECIPES, TIE_MARGIN, WIRE_BYTES, price, wire_bytes
from .simulator import SimResult, simulate, simulate_allreduce

DEFAULT_TOPOLOGIES = ("one-peer-exp", "one-peer-hypercube", "exp", "ring", "aer", "aer-pair", "base-k", "torus",
                      "complete")
GAP_THRESHOLD = 0.1
#: spectral gaps are dense n x n linear algebra up to this world size; above, ``mixing.sparse_gap_per_step``
MAX_GAP_WORLD_SIZE = 1024
#: simulation budget in work units per run (steps x (messages + 40 x most transfers sharing one link));
#: steps are reduced above it (the complete graph on 64 ranks gets ~90 steps), down to 4 periods + 20
MAX_SIM_WORK = 2_000_000
#: what the simulator really does per run, steps x (ranks + transfers served or group members per step), at
#: most (2.5-7 million units per second of one core measured on 8000 ranks); if a candidate needs more,
#: nothing is simulated and the plan is closed form
MAX_SIM_COST = 20_000_000
#: two step times closer than this (relative) are one number summed in a different order (1 rank: 0.11999999999999884
#: s against 0.12000000000000004 s): the first listed candidate wins, not the rounding
ROUNDING = 1e-9


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One row of the plan: ``prediction`` (closed form), ``simulated`` (or None),
    ``gap_per_step`` (None when not computed), ``eligible`` (passes the gap threshold),
    ``simulated_speedup`` (All-Reduce's simulated step over this one's, or None)."""

    name: str
    prediction: Prediction
    simulated: SimResult | None
    gap_per_step: float | None
    eligible: bool
    simulated_speedup: float | None = None

    @property
    def best_step_seconds(self) -> float:
        """Simulated step time when available, else the closed form."""
        return self.simulated.step_seconds if self.simulated else self.prediction.step_seconds

    def to_dict(self) -> dict:
        d = self.prediction.to_dict()
        d["simulated_step_seconds"] = self.simulated.step_seconds if self.simulated else None
        d["simulated_speedup"] = self.simulated_speedup
        d["spectral_gap_per_step"] = self.gap_per_step
        d["eligible"] = self.eligible
        return d


@dataclasses.dataclass(frozen=True)
class Plan:
    """``candidates`` (All-Reduce first), ``skipped`` (``(name, reason)``),
    ``recommended`` (a candidate name), ``rule`` (the rule in words), ``notes``, ``quality`` (``quality.Priced``
    recipes, cheapest time to All-Reduce's loss first)."""

    candidates: tuple
    skipped: tuple
    recommended: str
    rule: str
    gap_threshold: float
    notes: tuple = ()
    quality: tuple = ()

    def candidate(self, name: str) -> Candidate:
        for c in self.candidates:
            if c.name == name:
                return c
        raise KeyError(name)


def default_topologies(cluster) -> list:
    """``DEFAULT_TOPOLOGIES``, without aer / aer-pair unless ``nodes`` is a power of two >= 2 and without
    one-peer-hypercube unless the world size is a power of two (the schedules exist only there)."""
    N, n = cluster.nodes, cluster.world_size
    aer_ok = N >= 2 and N & (N - 1) == 0
    hypercube_ok = n & (n - 1) == 0
    return [t for t in DEFAULT_TOPOLOGIES
            if (aer_ok or not t.startswith("aer")) and (hypercube_ok or t != "one-peer-hypercube")]


@functools.lru_cache(maxsize=256)
def gap_per_step(name: str, world_size: int, local_world_size: int) -> float | None:
    """``spectral_gap(make(name, ...)).per_step``; above ``MAX_GAP_WORLD_SIZE`` ranks
    ``mixing.sparse_gap_per_step`` (None when it cannot tell)."""
    topo = make_topology(name, world_size, local_world_size)
    if world_size > MAX_GAP_WORLD_SIZE:
        return sparse_gap_per_step(topo)
    return float(_topology.spectral_gap(topo).per_step)


def _sim_steps(topo, workload, steps: int, warmup: int) -> tuple:
    """``(steps, warmup, cost)`` of simulating ``topo``: fewer steps above ``MAX_SIM_WORK``; ``cost`` in
    ``MAX_SIM_COST`` units."""
    schedule = schedule_of(topo)
    work, per_step = 1, 0
    for table in schedule.steps:
        links = table.links
        work = max(work, links.messages + 40 * links.shared)
        groups = workload_step_groups(workload, topo, table.step)
        per_step = max(per_step, groups[1].sum() if groups is not None else links.messages + 40 * links.shared)
    if steps * work > MAX_SIM_WORK:
        steps = max(4 * schedule.period + 20, MAX_SIM_WORK // work)
        warmup = min(warmup, steps // 5)
    return steps, warmup, steps * (topo.world_size + int(per_step))


def _allreduce_sim_steps(n: int, steps: int, warmup: int) -> tuple:
    """``_sim_steps`` for All-Reduce, whose simulation draws ``n`` compute times per step."""
    if steps * n > MAX_SIM_WORK:
        steps = max(100, MAX_SIM_WORK // n)
        warmup = min(warmup, steps // 5)
    return steps, warmup, steps * n


def plan(cluster, workload, topologies=None, simulate_steps: int = 500, warmup: int = 50, seed: int = 0,
         run_simulation: bool = True, gap_threshold: float = GAP_THRESHOLD, allreduce_workload=None) -> Plan:
    """Predict (and simulate) every candidate and recommend one (rule in the module docstring).
    `allreduce_workload`: what the All-Reduce baseline is priced with when it differs from the gossip's (DDP has no
    8-bit wire: the CLI prices it with fp32 gradients then); default `workload`."""
    names = list(topologies) if topologies is not None else default_topologies(cluster)
    n, L = cluster.world_size, cluster.ranks_per_node
    notes, skipped, gossip = [], [], []
    ar_workload = workload if allreduce_workload is None else allreduce_workload
    ar_pred = predict_allreduce(cluster, ar_workload)
    seen = {"allreduce"}
    for raw in names:
        try:
            name = _topology.canonical_name(raw)
        except ValueError as e:
            skipped.append((str(raw), str(e)))
            continue
        if name in seen:
            continue
        seen.add(name)
        try:
            topo = make_topology(name, n, L)
            check_mix_width(workload, topo)  # before pricing: complete point to point builds n (n - 1) messages
            gossip.append((name, topo, predict_gossip(cluster, workload, topo, ar_workload)))
        except ValueError as e:  # cannot be built for this cluster, too dense (TooManyMessages), refused (MixTooWide)
            skipped.append((name, str(e)))
    sims = _simulate_all(cluster, workload, ar_workload, gossip, simulate_steps, warmup, seed, notes) \
        if run_simulation else {}
    ar_sim = sims.get("allreduce")

    def sim_speedup(sim):
        if ar_sim is None or sim is None or sim.step_seconds <= 0:
            return None
        return ar_sim.step_seconds / sim.step_seconds

    cands = [Candidate("allreduce", ar_pred, ar_sim, 1.0, True, sim_speedup(ar_sim))]
    for name, _, pred in gossip:
        gap = gap_per_step(name, n, L)
        sim = sims.get(name)
        cands.append(Candidate(name, pred, sim, gap, gap is None or gap >= gap_threshold, sim_speedup(sim)))
    unknown = [c.name for c in cands if c.gap_per_step is None]
    if unknown:
        notes.append(f"spectral gap not computed for {', '.join(unknown)}: above {MAX_GAP_WORLD_SIZE} ranks only"
                     " circulant and finite-time exact schedules get one (counted as eligible)")
    # A schedule that never averages (gap 0: local) never reaches All-Reduce's loss: it does not compete even when
    # no topology reaches the threshold (it was recommended, and priced with the one-peer multipliers).
    gossip_cands = [c for c in cands[1:] if c.gap_per_step is None or c.gap_per_step > 0]
    eligible = [c for c in gossip_cands if c.eligible] or gossip_cands
    basis = "simulated" if sims else "closed-form"
    best = _recommend(cands[0], eligible)
    rule = (f"fastest {basis} step time among the topologies with spectral gap/step >= {gap_threshold:g}"
            + ("" if any(c.eligible for c in gossip_cands) or not gossip_cands
               else " (none reaches it: all topologies compete)")
            + f", if more than {TIE_MARGIN:.0%} faster than allreduce; else allreduce")
    # The steps multipliers were measured on one-peer graphs: price the fastest of those when there is one.
    priced = [c for c in eligible if c.name.startswith("one-peer")] or eligible
    fastest_gossip = min(priced, key=lambda c: c.best_step_seconds) if priced else None
    by_wire, refused = (None, []) if fastest_gossip is None else \
        _price_wires(cluster, workload, ar_workload, make_topology(fastest_gossip.name, n, L), notes)
    try:  # periodic averaging is complete (atc, gossip_every=k): point to point, refused, beyond the group scan
        check_mix_width(workload.with_(bytes_per_param=workload.param_bytes, exchange="auto"),
                        make_topology("complete", n, L))
    except MixTooWide as e:
        refused.extend((k.family, k.wire, k.delayed_mix) for k in RECIPES if k.family == "periodic")
        notes.append(f"periodic averaging recipes not listed: {e}")
    quality = price(ar_pred, by_wire, workload.compute.mean, ar_workload.bytes_per_param,
                    workload.compute.forward_fraction, param_bytes=workload.param_bytes, refused=refused)
    return Plan(candidates=tuple(cands), skipped=tuple(skipped), recommended=best.name, rule=rule,
                gap_threshold=gap_threshold, notes=tuple(notes), quality=tuple(quality))


def _recommend(allreduce: Candidate, gossip: list) -> Candidate:
    """The fastest of ``gossip`` (in their order: a tie up to ``ROUNDING`` keeps the first) when its step beats
    All-Reduce's by more than ``TIE_MARGIN``, else ``allreduce``: a plain ``min`` let float rounding recommend
    gossip on 1 rank (no communication at all) and at 1.00x, against the time-to-loss list's All-Reduce first."""
    fastest = None
    for c in gossip:
        if fastest is None or c.best_step_seconds < fastest.best_step_seconds * (1.0 - ROUNDING):
            fastest = c
    if fastest is not None and fastest.best_step_seconds * (1.0 + TIE_MARGIN) < allreduce.best_step_seconds:
        return fastest
    return allreduce


def _price_wires(cluster, workload, ar_workload, topo, notes: list) -> tuple:
    """``({wire: Prediction or None}, refused ("gossip", wire, delayed_mix))`` of the gossip recipes on ``topo``, each
    wire as the optimizers run it (exchange "auto"), whatever the plan's; a recipe the optimizers would refuse
    (``mix_width``) is left unpriced, with a note. What they accept has at most 32 messages per rank and step,
    below ``messages.MAX_MESSAGES`` on every cluster the model takes."""
    by_wire, refused = {}, []
    for wire in WIRE_BYTES:
        wire_workload = workload.with_(bytes_per_param=wire_bytes(wire, workload.param_bytes), exchange="auto")
        by_wire[wire] = None
        try:
            check_mix_width(wire_workload, topo)
            by_wire[wire] = predict_gossip(cluster, wire_workload, topo, ar_workload)
        except MixTooWide as e:  # the 8-bit wire runs complete point to point: 33+ ranks read too many buffers
            notes.append(f"{wire} wire recipes not priced on {topo.name}: {e}")
        if by_wire[wire] is not None and any(k.delayed_mix and k.wire == wire for k in RECIPES):
            try:  # delayed_mix reads the rank's own copy too: one buffer fewer for neighbours
                check_mix_width(wire_workload, topo, delayed_mix=True)
            except MixTooWide as e:
                refused.append(("gossip", wire, True))
                notes.append(f"{wire} wire recipes with delayed_mix not priced on {topo.name}: {e}")
    return by_wire, refused


def _simulate_all(cluster, workload, ar_workload, gossip, steps: int, warmup: int, seed: int, notes: list) -> dict:
    """``{name: SimResult}`` for All-Reduce and every gossip candidate, or ``{}`` (with a note) when one of
    them would cost more than ``MAX_SIM_COST``: the plan then compares closed forms only."""
    runs = {"allreduce": _allreduce_sim_steps(cluster.world_size, steps, warmup)}
    for name, topo, _ in gossip:
        runs[name] = _sim_steps(topo, workload, steps, warmup)
    over = [name for name, (_, _, cost) in runs.items() if cost > MAX_SIM_COST]
    if over:
        notes.append(f"not simulated: {', '.join(over)} would exceed the simulation budget on"
                     f" {cluster.world_size} ranks; step times and the recommendation are closed form")
        return {}
    topos = {name: topo for name, topo, _ in gossip}
    sims = {}
    for name, (st, wu, _) in runs.items():
        if st != steps:
            notes.append(f"{name}: simulated {st} steps (simulation budget)")
        sims[name] = (simulate_allreduce(cluster, ar_workload, steps=st, warmup=wu, seed=seed) if name == "allreduce"
                      else simulate(cluster, workload, topos[name], steps=st, warmup=wu, seed=seed))
    return sims
