"""Closed-form step time of All-Reduce and of a gossip schedule: ``predict``.

Notation: compute time ``C`` per rank and step with mean ``mu`` and std
``sigma_C``; ``n`` ranks; ``f`` the fraction of compute a gossip exchange
overlaps (AWC 1, ATC ``forward_fraction``).

* All-Reduce (``allreduce.allreduce_cost`` for ``T_AR`` and ``exposed``)::

      T_allreduce = E[max of n draws of C] + exposed

  the global barrier waits for the slowest of the n ranks
  (``mu + sigma_C * e(n)`` for normal C, exact resampling for a sample).
* Gossip (``gossip.schedule_comm`` for ``D_i(t)``, ``gossip.straggler_penalty``
  for ``g``), averaged over the ``period`` steps of the schedule::

      T_gossip = max_i mean_t [ (1 - f) mu + max(f mu, D_i(t)) + sigma_C * g(k, s_i(t)) ],
      s_i(t) = (f mu - D_i(t)) / sigma_C

  (``D_i(t)``: rank i's slowest incoming message at step t; the slowest
  rank, averaged over the period, sets the pace)

* The paper's ratios (Wang et al., ICLR 2025)::

      gamma   = T_AR / mu                       (communication over computation)
      omega   = mean_t D_i*(t) / T_AR          (gossip over all-reduce communication, i* the slowest rank)
      sigma^2 = Var[C] / mu^2                   (compute-time variance, normalised)

  and ``speedup = T_allreduce / T_gossip``.

``predict(cluster, workload, topology)`` returns a ``Prediction``;
``topology`` is ``"allreduce"``, a built-in name (``decent_comm.topology.make``)
or a ``Topology`` for ``cluster.world_size`` ranks.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from .allreduce import allreduce_cost
from .gossip import resolve_topology, schedule_comm, straggler_penalty, sync_set_size, throughput_bound
from .stragglers import effective_sync_set


@dataclasses.dataclass(frozen=True)
class Prediction:
    """Predicted mean step time of one candidate (seconds unless noted).

    * ``name``: ``"allreduce"`` or the topology name; ``kind``: ``"allreduce"`` / ``"gossip"``.
    * ``step_seconds``: predicted mean step time; ``speedup`` =
      ``allreduce_step_seconds / step_seconds``.
    * ``comm_seconds``: communication per step (All-Reduce: ``T_AR``; gossip:
      the slowest rank's ``mean_t D_i(t)``); ``exposed_comm_seconds``: the part
      not hidden behind compute (gossip: ``mean_t max(0, D_i(t) - f mu)``).
    * ``compute_seconds``: ``mu``; ``straggler_seconds``: time lost waiting for
      slower ranks (All-Reduce: ``E[max_n C] - mu``; gossip: ``sigma_C * mean_t g``).
    * ``sync_set``: number of ranks whose expected max compute time the
      straggler term equals (All-Reduce: n).
    * ``gamma``, ``omega`` (``None`` when ``T_AR = 0``), ``sigma2``: the paper's ratios.
    * ``world_size``, ``period``, ``max_degree``; ``max_node_inter_bytes``:
      busiest NIC direction per step, mean over the period;
      ``per_step_comm_seconds``: ``max_i D_i(t)`` for each step of the period.
    * ``lower_bound_seconds``: no schedule can be faster (``max(mu, busiest
      link's mean busy time per step)``, ``gossip.throughput_bound``); the
      closed form assumes ranks in phase, the truth lies between the two
      (the simulator says where).
    """

    name: str
    kind: str
    step_seconds: float
    speedup: float
    allreduce_step_seconds: float
    comm_seconds: float
    exposed_comm_seconds: float
    compute_seconds: float
    straggler_seconds: float
    sync_set: float
    gamma: float
    omega: float | None
    sigma2: float
    world_size: int
    period: int = 1
    max_degree: int = 0
    max_node_inter_bytes: float = 0.0
    per_step_comm_seconds: tuple = ()
    lower_bound_seconds: float = 0.0

    def to_dict(self) -> dict:
        """Plain-JSON dict of every field."""
        d = dataclasses.asdict(self)
        d["per_step_comm_seconds"] = list(self.per_step_comm_seconds)
        return d




def _allreduce(cluster, workload):
    """``(step_seconds, AllReduceCost)`` of All-Reduce."""
    n = cluster.world_size
    ar = allreduce_cost(cluster, workload)
    return workload.compute.expected_max(n) + ar.exposed_seconds, ar


def predict_allreduce(cluster, workload) -> Prediction:
    """``Prediction`` for ring All-Reduce (hierarchical for NCCL, flat for gloo: ``cluster.backend``) with bucketed
    backward overlap."""
    comp = workload.compute
    step, ar = _allreduce(cluster, workload)
    gamma = ar.comm_seconds / comp.mean if comp.mean > 0 else float("inf") if ar.comm_seconds else 0.0
    return Prediction(
        name="allreduce", kind="allreduce", step_seconds=step, speedup=1.0, allreduce_step_seconds=step,
        comm_seconds=ar.comm_seconds, exposed_comm_seconds=ar.exposed_seconds, compute_seconds=comp.mean,
        straggler_seconds=comp.expected_max(cluster.world_size) - comp.mean,
        sync_set=float(cluster.world_size), gamma=gamma, omega=1.0 if ar.comm_seconds > 0 else None,
        sigma2=comp.cv2, world_size=cluster.world_size, period=1, lower_bound_seconds=step,
        max_degree=min(2, cluster.world_size - 1), max_node_inter_bytes=ar.node_inter_bytes)


def predict_gossip(cluster, workload, topology, allreduce_workload=None) -> Prediction:
    """``Prediction`` for the gossip schedule ``topology`` (name or ``Topology``); its ``speedup``, ``gamma`` and
    ``omega`` are against All-Reduce of ``allreduce_workload`` (default ``workload``: DDP has no 8-bit wire, so
    the planner prices it with fp32 gradients then)."""
    topo = resolve_topology(topology, cluster)
    comp = workload.compute
    mu, sd = comp.mean, comp.std
    f = workload.overlap_fraction
    steps = schedule_comm(cluster, workload, topo)
    k = sync_set_size(topo, steps)
    D = np.stack([s.rank_seconds for s in steps])               # (period, n)
    if sd > 0:  # D takes few distinct values (links of a few kinds): evaluate g once per value
        slack, where = np.unique((f * mu - D) / sd, return_inverse=True)
        g = np.array([straggler_penalty(k, x) for x in slack.tolist()])[where.reshape(D.shape)]
    else:
        g = np.zeros_like(D)
    per_rank = ((1.0 - f) * mu + np.maximum(f * mu, D) + sd * g).mean(axis=0)
    slow = int(np.argmax(per_rank))
    T = float(per_rank[slow])
    D_slow = float(D[:, slow].mean())
    pen = float(sd * g[:, slow].mean())
    ar_step, ar = _allreduce(cluster, workload if allreduce_workload is None else allreduce_workload)
    gamma = ar.comm_seconds / mu if mu > 0 else float("inf") if ar.comm_seconds else 0.0
    return Prediction(
        name=topo.name, kind="gossip", step_seconds=T, speedup=ar_step / T if T > 0 else 1.0,
        allreduce_step_seconds=ar_step, comm_seconds=D_slow,
        exposed_comm_seconds=float(np.maximum(0.0, D[:, slow] - f * mu).mean()), compute_seconds=mu,
        straggler_seconds=pen, sync_set=effective_sync_set(0.0, sd, pen) if sd > 0 else k,
        gamma=gamma, omega=D_slow / ar.comm_seconds if ar.comm_seconds > 0 else None, sigma2=comp.cv2,
        world_size=cluster.world_size, period=len(steps), max_degree=max(s.max_indegree for s in steps),
        max_node_inter_bytes=sum(s.max_node_inter_bytes for s in steps) / len(steps),
        per_step_comm_seconds=tuple(s.seconds for s in steps),
        lower_bound_seconds=throughput_bound(mu, steps))


def predict(cluster, workload, topology="allreduce") -> Prediction:
    """``Prediction`` for ``topology``: ``"allreduce"``, a built-in name or a ``Topology``."""
    if isinstance(topology, str) and topology.strip().lower() in ("allreduce", "all-reduce", "all_reduce"):
        return predict_allreduce(cluster, workload)
    return predict_gossip(cluster, workload, topology)
