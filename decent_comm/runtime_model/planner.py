"""Rank candidate topologies against All-Reduce and recommend one: ``plan``.

For each candidate: the closed-form ``Prediction``, a simulation
(``simulator.simulate``) unless disabled, and the spectral gap per step
(``decent_comm.topology.spectral_gap(...).per_step``: how much of the
disagreement one gossip step removes; sparser graphs mix slower, so they may
need more steps to reach the same loss even when each step is faster).

**Recommendation rule.**  Among All-Reduce and the gossip candidates whose
``gap/step >= gap_threshold`` (default 0.1), pick the one with the shortest
step time (simulated when simulated, else closed form).  If no gossip
candidate reaches the threshold, all of them compete.  All-Reduce (exact
averaging, gap 1) wins when nothing beats it.

Default candidates: one-peer-exp, exp, ring, aer (only when the number of
nodes is a power of two >= 2), base-k, torus, complete.  A candidate that
cannot be built for the cluster (e.g. aer on 3 nodes) is skipped with the
reason in ``Plan.skipped``.
"""
from __future__ import annotations

import dataclasses
import functools

from .. import topology as _topology
from .closed_form import Prediction, make_topology, predict_allreduce, predict_gossip
from .loads import schedule_links
from .simulator import SimResult, simulate, simulate_allreduce

DEFAULT_TOPOLOGIES = ("one-peer-exp", "exp", "ring", "aer", "aer-pair", "base-k", "torus", "complete")
GAP_THRESHOLD = 0.1
#: spectral gaps are dense n x n linear algebra: skipped above this world size
MAX_GAP_WORLD_SIZE = 1024
#: simulation budget in work units per run (steps x (messages + 40 x most transfers sharing one link));
#: steps are reduced above it (the complete graph on 64 ranks gets ~150 steps)
MAX_SIM_WORK = 2_000_000


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
    ``recommended`` (a candidate name), ``rule`` (the rule in words), ``notes``."""

    candidates: tuple
    skipped: tuple
    recommended: str
    rule: str
    gap_threshold: float
    notes: tuple = ()

    def candidate(self, name: str) -> Candidate:
        for c in self.candidates:
            if c.name == name:
                return c
        raise KeyError(name)


def default_topologies(cluster) -> list:
    """``DEFAULT_TOPOLOGIES``, without aer / aer-pair unless ``nodes`` is a power of two >= 2."""
    N = cluster.nodes
    aer_ok = N >= 2 and N & (N - 1) == 0
    return [t for t in DEFAULT_TOPOLOGIES if not t.startswith("aer") or aer_ok]


@functools.lru_cache(maxsize=256)
def gap_per_step(name: str, world_size: int, local_world_size: int) -> float | None:
    """``spectral_gap(make(name, ...)).per_step`` (None above ``MAX_GAP_WORLD_SIZE``)."""
    if world_size > MAX_GAP_WORLD_SIZE:
        return None
    return float(_topology.spectral_gap(make_topology(name, world_size, local_world_size)).per_step)


def _sim_steps(topo, steps: int, warmup: int) -> tuple:
    work = 1
    for links in schedule_links(topo):
        shared = max(links.node_egress.max(initial=0), links.node_ingress.max(initial=0),
                     links.rank_intra_recv.max(initial=0))
        work = max(work, links.src.size + 40 * int(shared))
    if steps * work <= MAX_SIM_WORK:
        return steps, warmup
    s = max(4 * topo.period + 20, MAX_SIM_WORK // work)
    return s, min(warmup, s // 5)


def plan(cluster, workload, topologies=None, simulate_steps: int = 500, warmup: int = 50, seed: int = 0,
         run_simulation: bool = True, gap_threshold: float = GAP_THRESHOLD) -> Plan:
    """Predict (and simulate) every candidate and recommend one (rule in the module docstring)."""
    names = list(topologies) if topologies is not None else default_topologies(cluster)
    n, L = cluster.world_size, cluster.ranks_per_node
    notes, skipped = [], []
    ar_pred = predict_allreduce(cluster, workload)
    ar_sim = (simulate_allreduce(cluster, workload, steps=simulate_steps, warmup=warmup, seed=seed)
              if run_simulation else None)

    def sim_speedup(sim):
        if ar_sim is None or sim is None or sim.step_seconds <= 0:
            return None
        return ar_sim.step_seconds / sim.step_seconds

    cands = [Candidate("allreduce", ar_pred, ar_sim, 1.0, True, sim_speedup(ar_sim))]
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
        except ValueError as e:
            skipped.append((name, str(e)))
            continue
        pred = predict_gossip(cluster, workload, topo)
        sim = None
        if run_simulation:
            st, wu = _sim_steps(topo, simulate_steps, warmup)
            if st != simulate_steps:
                notes.append(f"{name}: simulated {st} steps (simulation budget)")
            sim = simulate(cluster, workload, topo, steps=st, warmup=wu, seed=seed)
        gap = gap_per_step(name, n, L)
        cands.append(Candidate(name, pred, sim, gap, gap is None or gap >= gap_threshold, sim_speedup(sim)))
    if n > MAX_GAP_WORLD_SIZE:
        notes.append(f"spectral gaps not computed above {MAX_GAP_WORLD_SIZE} ranks")
    gossip = cands[1:]
    eligible = [c for c in gossip if c.eligible] or gossip
    basis = "simulated" if run_simulation else "closed-form"
    pool = [cands[0]] + eligible
    best = min(pool, key=lambda c: c.best_step_seconds)
    rule = (f"fastest {basis} step time among allreduce and the topologies with spectral gap/step >="
            f" {gap_threshold:g}" + ("" if any(c.eligible for c in gossip) or not gossip
                                     else " (none reaches it: all topologies compete)"))
    return Plan(candidates=tuple(cands), skipped=tuple(skipped), recommended=best.name, rule=rule,
                gap_threshold=gap_threshold, notes=tuple(notes))
