"""Communication volume of a schedule: ``comm_cost(topology, bytes_per_rank)``.

Model: at each step every rank sends its whole buffer (``bytes_per_rank``
bytes) once to each rank in ``Peers.send`` and receives one buffer from each
rank in ``Peers.recv``.  A message is *inter-node* when sender and receiver
are on different nodes (node of rank r = ``r // local_world_size``), else
*intra-node*.  Cost O(period * n * degree).
"""
from __future__ import annotations

import dataclasses

from .base import Topology


@dataclasses.dataclass(frozen=True)
class StepCost:
    """Bytes moved at one step of the period (``step`` in ``0 .. period-1``).

    ``max_*``: maximum over ranks (the busiest rank bounds the step time).
    ``total_*``: sum over all ranks (the whole cluster's traffic).

    * ``max_send_bytes`` / ``max_recv_bytes``: bytes one rank sends / receives.
    * ``max_degree``: max over ranks of ``max(len(recv), len(send))``.
    * ``max_inter_send_bytes`` / ``max_intra_send_bytes``: bytes one rank sends
      to other nodes / inside its node.
    * ``max_inter_recv_bytes`` / ``max_intra_recv_bytes``: same, received.
    * ``total_send_bytes`` = ``total_inter_bytes + total_intra_bytes``: all
      messages of the step, split by inter-node and intra-node.
    """

    step: int
    max_send_bytes: int
    max_recv_bytes: int
    max_degree: int
    max_inter_send_bytes: int
    max_intra_send_bytes: int
    max_inter_recv_bytes: int
    max_intra_recv_bytes: int
    total_send_bytes: int
    total_inter_bytes: int
    total_intra_bytes: int


@dataclasses.dataclass(frozen=True)
class CommCost:
    """Per-step ``steps`` and their summary over one period.

    * ``topology``, ``world_size``, ``local_world_size``, ``period``,
      ``bytes_per_rank``: what was measured.
    * ``steps``: one ``StepCost`` per step of the period.
    * ``max_degree``: max over the period of ``StepCost.max_degree``.
    * ``max_send_bytes``, ``max_inter_send_bytes``: max over the period of the
      per-step maxima.
    * ``mean_max_send_bytes``, ``mean_max_recv_bytes``,
      ``mean_max_inter_send_bytes``, ``mean_max_intra_send_bytes``: mean over
      the period of the per-step maxima (busiest rank, average step).
    * ``mean_total_inter_bytes``, ``mean_total_intra_bytes``: mean over the
      period of the cluster-wide totals per step.
    * ``mean_inter_bytes_per_rank``, ``mean_intra_bytes_per_rank``: the same
      divided by ``world_size`` (average rank, average step).
    """

    topology: str
    world_size: int
    local_world_size: int
    period: int
    bytes_per_rank: int
    steps: list
    max_degree: int
    max_send_bytes: int
    max_inter_send_bytes: int
    mean_max_send_bytes: float
    mean_max_recv_bytes: float
    mean_max_inter_send_bytes: float
    mean_max_intra_send_bytes: float
    mean_total_inter_bytes: float
    mean_total_intra_bytes: float
    mean_inter_bytes_per_rank: float
    mean_intra_bytes_per_rank: float


def _step_cost(topology: Topology, t: int, B) -> StepCost:
    n, L = topology.world_size, topology.local_world_size
    m = dict(send=0, recv=0, deg=0, isend=0, asend=0, irecv=0, arecv=0)
    tot_inter = tot_intra = 0
    for i in range(n):
        p = topology.peers(i, t)
        node = i // L
        inter_s = sum(1 for j in p.send if j // L != node)
        inter_r = sum(1 for j, _ in p.recv if j // L != node)
        intra_s, intra_r = len(p.send) - inter_s, len(p.recv) - inter_r
        tot_inter += inter_s
        tot_intra += intra_s
        for key, v in (("send", len(p.send)), ("recv", len(p.recv)), ("deg", p.degree),
                       ("isend", inter_s), ("asend", intra_s), ("irecv", inter_r), ("arecv", intra_r)):
            if v > m[key]:
                m[key] = v
    return StepCost(step=t, max_send_bytes=m["send"] * B, max_recv_bytes=m["recv"] * B, max_degree=m["deg"],
                    max_inter_send_bytes=m["isend"] * B, max_intra_send_bytes=m["asend"] * B,
                    max_inter_recv_bytes=m["irecv"] * B, max_intra_recv_bytes=m["arecv"] * B,
                    total_send_bytes=(tot_inter + tot_intra) * B, total_inter_bytes=tot_inter * B,
                    total_intra_bytes=tot_intra * B)


def comm_cost(topology: Topology, bytes_per_rank) -> CommCost:
    """``CommCost`` of ``topology`` when each rank's buffer has ``bytes_per_rank`` bytes."""
    T = topology.period
    steps = [_step_cost(topology, t, bytes_per_rank) for t in range(T)]

    def mean(field):
        return sum(getattr(s, field) for s in steps) / T

    n = topology.world_size
    return CommCost(
        topology=topology.name, world_size=n, local_world_size=topology.local_world_size, period=T,
        bytes_per_rank=bytes_per_rank, steps=steps,
        max_degree=max(s.max_degree for s in steps),
        max_send_bytes=max(s.max_send_bytes for s in steps),
        max_inter_send_bytes=max(s.max_inter_send_bytes for s in steps),
        mean_max_send_bytes=mean("max_send_bytes"), mean_max_recv_bytes=mean("max_recv_bytes"),
        mean_max_inter_send_bytes=mean("max_inter_send_bytes"),
        mean_max_intra_send_bytes=mean("max_intra_send_bytes"),
        mean_total_inter_bytes=mean("total_inter_bytes"), mean_total_intra_bytes=mean("total_intra_bytes"),
        mean_inter_bytes_per_rank=mean("total_inter_bytes") / n,
        mean_intra_bytes_per_rank=mean("total_intra_bytes") / n)
