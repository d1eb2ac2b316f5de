"""All-Reduce: ring alpha-beta cost (hierarchical for NCCL, flat for gloo) and bucket overlap.

Notation: ``B`` bytes per rank, ``N`` nodes of ``L`` ranks (``n = N L``),
``bw_a, a_a`` intra-node bandwidth / latency, ``bw_e, a_e`` inter-node
bandwidth (per node) / latency, ``k`` buckets.

``ring_allreduce`` prices one all-reduce of a group of ``s`` ranks spanning
``N_g`` nodes with at most ``L_g`` of them on one node; everything that
all-reduces uses it (``allreduce_cost`` below: the All-Reduce baseline, DDP,
and through it periodic averaging; ``gossip.group_costs``: group all-reduce
steps).  ``cluster.backend`` says which algorithm runs:

* ``"nccl"``, hierarchical (``N_g > 1``): intra-node reduce-scatter, ``L_g``
  concurrent inter-node ring all-reduces (one per local rank, each on a
  ``B/L_g`` shard, sharing the node's NIC), intra-node all-gather::

      T_AR = 2 (L_g-1)/L_g * B / bw_a  +  2 (N_g-1)/N_g * B / bw_e          (bandwidth)
           + k * (2 (L_g-1) * a_a + 2 (N_g-1) * a_e)                        (latency, per bucket)

  (``L_g = 1`` or ``N_g = 1`` give the flat ring).  The inter term is the NIC
  carrying ``L_g`` shard rings of ``2 (N_g-1)/N_g * B/L_g`` bytes each.
* ``"gloo"``: one flat ring over the ``s`` ranks in rank order
  (reduce-scatter then all-gather, ``2 (s-1)`` rounds of ``B/s`` per ring edge).
  A node's ranks are consecutive in that order, so every node the ring spans has
  one edge out and one in through its NIC, which therefore carries
  ``2 (s-1)/s * B`` (1.5 B at ``s = 4, N_g = 2``: measured on the emulated
  cluster, against 1 B hierarchically).  All edges work at once and each round
  waits for the slowest::

      T_AR = 2 (s-1)/s * B / min(bw_e, bw_a)  +  k * 2 (s-1) * max(a_e, a_a)    (N_g > 1, L_g > 1)
      T_AR = 2 (s-1)/s * B / bw_e             +  k * 2 (s-1) * a_e              (L_g = 1: no intra-node edge)
      T_AR = 2 (s-1)/s * B / bw_a             +  k * 2 (s-1) * a_a              (one node: NCCL's too)

With heterogeneous NICs ``bw_e`` is the slowest spanned node's (a ring is as
fast as its slowest link), divided by the groups sharing a NIC
(``gossip.group_costs``).

Overlap with the backward pass (PyTorch DDP buckets): ``k = ceil(B /
bucket_bytes)`` equal buckets become ready evenly during the backward of
length ``T_b`` (``backward_fraction * E[C]``) and are all-reduced one after
another; bucket ``j`` is ready at ``j T_b / k`` and costs ``c = T_AR / k``.
The last all-reduce finishes at ``max_j (j T_b/k + (k-j+1) c) =
max(T_b/k + T_AR, T_b + c)``, so the part exposed after the backward is::

      exposed = max(T_AR / k,  T_AR - (1 - 1/k) * T_b)

i.e. all but the last bucket can hide behind the backward.
"""
from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class RingTerms:
    """``ring_allreduce``'s answer, one entry per group (numpy arrays, seconds unless noted): ``port`` (what one
    member's intra-node port carries), ``nic_bytes`` (what one NIC direction carries for the group, bytes),
    ``nic`` (its NIC time, sharing included), ``latency``, ``seconds`` (the whole all-reduce)."""

    port: np.ndarray
    nic_bytes: np.ndarray
    nic: np.ndarray
    latency: np.ndarray
    seconds: np.ndarray


def ring_allreduce(cluster, B: float, size, nodes, per_node, inter_bw, nic_share=1, buckets: int = 1) -> RingTerms:
    """One all-reduce of ``B`` bytes per rank for each group of ``size`` ranks on ``nodes`` nodes, at most
    ``per_node`` on one, as ``cluster.backend`` runs it (formulas in the module docstring); ``inter_bw``: the
    slowest NIC the group spans; ``nic_share``: all-reduces sharing that NIC; ``buckets``: one latency each."""
    s, Ng, Lg = (np.asarray(x, dtype=np.int64) for x in (size, nodes, per_node))
    q, bw = np.asarray(nic_share), np.asarray(inter_bw, dtype=np.float64)
    multi = Ng > 1
    if cluster.backend == "gloo":
        frac = 2.0 * (s - 1) / s
        port = np.where(Lg > 1, frac * B / cluster.intra_bandwidth, 0.0)
        # a round waits for its slowest edge: inter-node when the ring spans nodes, intra-node when a node holds two
        a_e, a_a = cluster.inter_latency, cluster.intra_latency
        hop = np.where(multi, np.where(Lg > 1, max(a_e, a_a), a_e), a_a)
        latency = buckets * 2.0 * (s - 1) * hop
    else:  # nccl: hierarchical
        frac = 2.0 * (Ng - 1) / Ng
        port = 2.0 * (Lg - 1) / Lg * B / cluster.intra_bandwidth
        latency = buckets * (2.0 * (Lg - 1) * cluster.intra_latency
                             + np.where(multi, 2.0 * (Ng - 1) * cluster.inter_latency, 0.0))
    nic_bytes = np.where(multi, frac * B, 0.0)
    with np.errstate(invalid="ignore", divide="ignore"):  # for the entries np.where drops (groups on one node)
        nic = np.where(multi, nic_bytes * q / bw, 0.0)
    # NCCL's phases run one after the other; a flat ring's edges all at once, at its slowest edge's pace
    bandwidth = np.maximum(port, nic) if cluster.backend == "gloo" else port + nic
    return RingTerms(port=port, nic_bytes=nic_bytes, nic=nic, latency=latency, seconds=bandwidth + latency)


@dataclasses.dataclass(frozen=True)
class AllReduceCost:
    """``comm_seconds`` = T_AR (whole all-reduce), split into ``intra_seconds`` +
    ``inter_seconds`` (bandwidth terms; a flat gloo ring's edges run at once, so there ``inter_seconds`` is the
    NIC's time and ``intra_seconds`` what the intra-node edges take beyond it) + ``latency_seconds``;
    ``exposed_seconds`` is what the backward cannot hide; ``buckets`` = k; ``hierarchical``: NCCL with N > 1 and
    L > 1; ``node_inter_bytes``: what one NIC direction carries; ``backend``: the cluster's.
    """

    comm_seconds: float
    intra_seconds: float
    inter_seconds: float
    latency_seconds: float
    exposed_seconds: float
    buckets: int
    hierarchical: bool
    node_inter_bytes: float = 0.0
    backend: str = "nccl"


def allreduce_cost(cluster, workload) -> AllReduceCost:
    """``AllReduceCost`` of one step of ``workload`` on ``cluster``: one all-reduce over every rank
    (``ring_allreduce``, formulas in the module docstring)."""
    N, L = cluster.nodes, cluster.ranks_per_node
    B = workload.bytes_per_rank
    k = workload.buckets
    if N * L == 1 or B == 0:
        return AllReduceCost(0.0, 0.0, 0.0, 0.0, 0.0, k, False, backend=cluster.backend)
    r = ring_allreduce(cluster, B, N * L, N, L, cluster.inter_bandwidth, buckets=k)
    port, nic, latency, total = (float(x) for x in (r.port, r.nic, r.latency, r.seconds))
    intra = port if cluster.backend == "nccl" else max(0.0, port - nic)
    t_b = workload.compute.backward_fraction * workload.compute.mean
    exposed = max(total / k, total - (1.0 - 1.0 / k) * t_b)
    return AllReduceCost(comm_seconds=total, intra_seconds=intra, inter_seconds=nic,
                         latency_seconds=latency, exposed_seconds=exposed, buckets=k,
                         hierarchical=cluster.backend == "nccl" and N > 1 and L > 1,
                         node_inter_bytes=float(r.nic_bytes), backend=cluster.backend)
