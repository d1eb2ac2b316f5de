"""Which bytes go over which links at each step of a gossip schedule.

Same model as ``decent_comm.topology.comm_cost``: at step ``t`` every rank
``i`` receives one buffer from each ``j`` in ``peers(i, t).recv`` (a message
``j -> i``); it is inter-node when ``j // L != i // L``.  ``comm_cost`` gives
per-rank maxima; the runtime model also needs **per-node** inter-node
traffic (a node's ranks share its NIC), so ``step_links`` keeps the message
list and aggregates it per node and per rank.  Counts are in messages; a
message carries ``bytes_per_rank`` bytes.
"""
from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class StepLinks:
    """Messages of one step of the period (``step``) and their load per link.

    * ``src``, ``dst``: int arrays, one entry per message ``src -> dst``,
      sorted by ``dst``; ``inter``: bool array, message crosses nodes.
    * ``node_egress`` / ``node_ingress``: inter-node messages leaving /
      entering each node (length N).
    * ``rank_intra_send`` / ``rank_intra_recv``: intra-node messages sent /
      received by each rank (length n).
    """

    step: int
    src: np.ndarray
    dst: np.ndarray
    inter: np.ndarray
    node_egress: np.ndarray
    node_ingress: np.ndarray
    rank_intra_send: np.ndarray
    rank_intra_recv: np.ndarray

    @property
    def any_inter(self) -> bool:
        return bool(self.inter.any())

    @property
    def any_intra(self) -> bool:
        return bool((~self.inter).any())


def step_links(topology, step: int) -> StepLinks:
    """``StepLinks`` of ``topology`` at ``step`` (taken modulo its period)."""
    n, L = topology.world_size, topology.local_world_size
    N = n // L
    src, dst = [], []
    for i in range(n):
        for j, _w in topology.peers(i, step).recv:
            src.append(j)
            dst.append(i)
    src = np.asarray(src, dtype=np.int64)
    dst = np.asarray(dst, dtype=np.int64)
    inter = (src // L) != (dst // L)
    return StepLinks(
        step=step % topology.period, src=src, dst=dst, inter=inter,
        node_egress=np.bincount(src[inter] // L, minlength=N),
        node_ingress=np.bincount(dst[inter] // L, minlength=N),
        rank_intra_send=np.bincount(src[~inter], minlength=n),
        rank_intra_recv=np.bincount(dst[~inter], minlength=n))


def schedule_links(topology) -> list:
    """``[step_links(topology, t) for t in range(period)]``, cached on the topology object."""
    cache = topology.__dict__.setdefault("_runtime_model_links", None)
    if cache is None:
        cache = [step_links(topology, t) for t in range(topology.period)]
        topology.__dict__["_runtime_model_links"] = cache
    return cache
