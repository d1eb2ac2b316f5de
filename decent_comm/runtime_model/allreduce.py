"""All-Reduce baseline: ring (hierarchical across nodes) alpha-beta cost and bucket overlap.

Notation: ``B`` bytes per rank, ``N`` nodes of ``L`` ranks (``n = N L``),
``bw_a, a_a`` intra-node bandwidth / latency, ``bw_e, a_e`` inter-node
bandwidth (per node) / latency, ``k`` buckets.

Communication time of one all-reduce of ``B`` bytes:

* flat ring over ``n`` ranks on one link: ``2 (n-1)/n * B / bw + 2 (n-1) * a``
* hierarchical (``N > 1``): intra-node reduce-scatter, ``L`` concurrent
  inter-node ring all-reduces (one per local rank, each on a ``B/L`` shard,
  sharing the node's NIC), intra-node all-gather::

      T_AR = 2 (L-1)/L * B / bw_a  +  2 (N-1)/N * B / bw_e                (bandwidth)
           + k * (2 (L-1) * a_a + 2 (N-1) * a_e)                          (latency, per bucket)

  (``L = 1`` or ``N = 1`` give the flat ring).  The inter term is the NIC
  carrying ``L`` shard rings of ``2 (N-1)/N * B/L`` bytes each.  With
  heterogeneous NICs ``bw_e`` is the slowest node's (a ring is as fast as
  its slowest link).

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


@dataclasses.dataclass(frozen=True)
class AllReduceCost:
    """``comm_seconds`` = T_AR (whole all-reduce), split into ``intra_seconds`` +
    ``inter_seconds`` (bandwidth terms) + ``latency_seconds``; ``exposed_seconds``
    is what the backward cannot hide; ``buckets`` = k; ``hierarchical``: N > 1 and L > 1.
    """

    comm_seconds: float
    intra_seconds: float
    inter_seconds: float
    latency_seconds: float
    exposed_seconds: float
    buckets: int
    hierarchical: bool


def allreduce_cost(cluster, workload) -> AllReduceCost:
    """``AllReduceCost`` of one step of ``workload`` on ``cluster`` (formulas in the module docstring)."""
    N, L = cluster.nodes, cluster.ranks_per_node
    B = workload.bytes_per_rank
    k = workload.buckets
    if N * L == 1 or B == 0:
        return AllReduceCost(0.0, 0.0, 0.0, 0.0, 0.0, k, False)
    intra = 2.0 * (L - 1) / L * B / cluster.intra_bandwidth
    inter = 2.0 * (N - 1) / N * B / cluster.inter_bandwidth
    latency = k * (2.0 * (L - 1) * cluster.intra_latency + 2.0 * (N - 1) * cluster.inter_latency)
    total = intra + inter + latency
    t_b = workload.compute.backward_fraction * workload.compute.mean
    exposed = max(total / k, total - (1.0 - 1.0 / k) * t_b)
    return AllReduceCost(comm_seconds=total, intra_seconds=intra, inter_seconds=inter,
                         latency_seconds=latency, exposed_seconds=exposed, buckets=k,
                         hierarchical=N > 1 and L > 1)
