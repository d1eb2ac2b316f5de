"""Closed-form communication and straggler terms of one gossip schedule.

**Communication per rank and step** ``D_i(t)`` (``B`` bytes per message):
rank ``i``'s update at step ``t`` waits for its slowest incoming message.
Transfers sharing a link share its bandwidth, so a message ``j -> i`` takes::

    inter-node:  a_e + max(egress_u(t) * B / bw_e(u), ingress_v(t) * B / bw_e(v))    u = node(j), v = node(i)
    intra-node:  a_a + max(send_j(t), recv_i(t)) * B / bw_a        (intra_sharing = "rank")
                 a_a + B / bw_a                                    (intra_sharing = "pair")
    D_i(t) = max over i's incoming messages (0 without peers)

``egress_u`` / ``ingress_u``: inter-node messages leaving / entering node
``u`` (all its ranks share one NIC: per-node bytes, ``loads.StepLinks``);
``send_j`` / ``recv_i``: intra-node messages of a rank.  The per-rank
maxima over ranks agree with ``decent_comm.topology.comm_cost``; the
per-node sums are what ``comm_cost`` does not give.

**Group all-reduce exchange** (``Workload.exchange = "group-allreduce"``,
how the seed library Decent-DP runs a step whose ``W`` is uniform averaging
over groups): each group ``g`` of ``s_g`` ranks spanning ``N_g`` nodes with
``L_g`` of its ranks per node runs one all-reduce as ``cluster.backend`` does
(``allreduce.ring_allreduce``); NCCL's is hierarchical::

    c_g = 2 (L_g-1)/L_g * B / bw_a + k 2 (L_g-1) a_a
        + [N_g > 1] (2 (N_g-1)/N_g * B * q_g / bw_e + k 2 (N_g-1) a_e)

and gloo's one flat ring, whose edge out of each spanned node carries
``2 (s_g-1)/s_g * B`` (``c_g = 2 (s_g-1)/s_g * B / min(bw_e / q_g, bw_a) +
k 2 (s_g-1) max(a_e, a_a)`` when ``N_g > 1``), with ``q_g`` the number of
multi-node groups sharing the busiest NIC of ``g`` and ``k`` the workload's
buckets (one all-reduce per bucket, its latency paid per bucket, as
``allreduce.py`` charges ring all-reduce: a group of all ranks costs what
all-reduce does); every member waits for it: ``D_i(t) = c_g``.  Other steps
stay point-to-point.

**Step time.**  Rank ``i`` needs ``(1 - f) mu + max(f mu, D_i(t))`` at step
``t`` when its neighbours are in phase with it; the schedule runs at the
pace of its slowest rank averaged over the period::

    T = max_i mean_t [ (1 - f) mu + max(f mu, D_i(t)) + sigma * g(k, s_i(t)) ],   s_i(t) = (f mu - D_i(t)) / sigma

Averaging per rank matters for schedules whose heavy steps move around:
with ``aer`` half the nodes use the network at any step, so "slowest rank at
every step" would charge the inter-node exchange every step, while each rank
pays it only every other step.  For ``sigma = 0`` this matches the simulator
exactly on static schedules and on ``aer``; on ``one-peer-exp`` /
``base-k`` the neighbours' phases differ and it can be a few percent off
either way (see docs/runtime_model_paper.md).

**Stragglers.**  In AWC rank ``i``'s update ``t`` waits for the buffers its
neighbours produced at the end of step ``t-1``, one whole compute time
earlier, so a slow neighbour stalls it only when it lags by more than the
*slack* ``f mu - D``.  Simulations show the mean penalty is ``sigma * g(s)``
with ``s`` the slack in units of ``sigma`` and ``g`` depending only on ``s``
and the schedule (the max-plus recursion is invariant under shifting and
scaling time).  We use::

    g(s) = G(k) * (1 + (s / s0)^p)^(-1/p)     s >= 0   (compute-bound side)
    g(s) = G(k) * exp(-(s / w)^2 / 2)          s <  0   (communication-bound side)
    G(k) = c0 + c1 * e(k),   k = 1 + mean_t max_i indegree_i(t) + 0.5 [period > 1]   (capped at n)

with ``e(k)`` the expected max of ``k`` standard normals, ``G`` the penalty
(in ``sigma``) when communication exactly matches compute, ``k`` the
neighbourhood of one step, amortised: +0.5 for time-varying schedules, whose
peers change every step so the set of ranks a rank depends on grows.
``c0 = 0.376, c1 = 0.382, s0 = 1.6, p = 1.5, w = 0.75`` were fitted once
(least squares, not per topology) to 336 simulations (8 topologies x n = 8,
16, 64 x 14 slacks ``s`` in [-3, 20], fixed message time); residual 0.05
``sigma`` RMS, 0.22 ``sigma`` at worst (complete graph, n = 64, just
communication-bound).  ``g = 0`` without peers.  The reported ``sync_set``
is ``e^{-1}(g)``: the step costs the expected max of that many compute
times.  The naive "wait for the slowest of degree + 1" rule would give
``e(degree + 1)`` at every slack, several times too much when compute-bound
(``s = 10``: ring ``e(3) = 0.85`` vs ``0.10`` simulated).
"""
from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

from .. import topology as _topology
from .allreduce import ring_allreduce
from .loads import schedule_of
from .stragglers import expected_max_normal
from .workload import AUTO_MIN_GROUP

#: Fitted constants of the straggler penalty ``g`` (see the module docstring).
G_C0, G_C1, G_S0, G_P, G_W = 0.376, 0.382, 1.6, 1.5, 0.75


@dataclasses.dataclass(frozen=True)
class StepComm:
    """Closed-form communication of one step of the period (seconds).

    ``rank_seconds``: ``D_i(t)`` for every rank (array); ``seconds``: the
    slowest rank's; ``inter_seconds`` / ``intra_seconds``: the slowest
    inter- / intra-node message; ``max_node_inter_bytes``: the busiest NIC
    direction; ``max_indegree``: most buffers one rank receives;
    ``nic_seconds`` (per node) / ``port_seconds`` (per rank): bandwidth time
    of the busier NIC direction / of the rank's intra-node port (or busiest
    pair link) this step, without latency (for ``throughput_bound``).
    """

    step: int
    rank_seconds: np.ndarray
    seconds: float
    inter_seconds: float
    intra_seconds: float
    max_node_inter_bytes: float
    max_indegree: int
    nic_seconds: np.ndarray = None
    port_seconds: np.ndarray = None


@dataclasses.dataclass(frozen=True)
class GroupCosts:
    """The multi-rank groups of one step run as all-reduces (formula in the module docstring).

    ``members`` (concatenated, group by group), ``sizes``, ``starts`` (each group's slice of
    ``members``); per group: ``cost`` (``c_g``), ``nic`` / ``port`` (the bandwidth terms: what one NIC
    direction / one rank's port carries for it), ``multi_node`` (spans several nodes), ``min_bw``
    (its slowest NIC); ``node_group`` / ``node`` list every (group, node) it spans.
    """

    members: np.ndarray
    sizes: np.ndarray
    starts: np.ndarray
    cost: np.ndarray
    nic: np.ndarray
    port: np.ndarray
    multi_node: np.ndarray
    min_bw: np.ndarray
    node_group: np.ndarray
    node: np.ndarray


def group_costs(cluster, B: float, members, sizes, buckets: int = 1) -> GroupCosts:
    """``GroupCosts`` of the groups ``(members, sizes)`` of one step (singletons dropped); ``buckets``: the
    all-reduces per group, each paying the latency terms."""
    L, N = cluster.ranks_per_node, cluster.nodes
    node_bw = np.asarray(cluster.node_bandwidths(), dtype=np.float64)
    gid = np.repeat(np.arange(sizes.size), sizes)
    keep = sizes[gid] > 1
    members, sizes = members[keep], sizes[sizes > 1]
    G = sizes.size
    gid = np.repeat(np.arange(G), sizes)
    key, count = np.unique(gid * N + members // L, return_counts=True)
    kg, ku = key // N, key % N                      # every (group, node) pair the groups span
    Ng = np.bincount(kg, minlength=G)
    Lg = np.zeros(G, dtype=np.int64)
    np.maximum.at(Lg, kg, count)
    multi = Ng > 1
    share = np.bincount(ku[multi[kg]], minlength=N)  # multi-node groups on each node
    q = np.zeros(G, dtype=np.int64)
    np.maximum.at(q, kg, share[ku])
    bw = np.full(G, np.inf)
    np.minimum.at(bw, kg, node_bw[ku])
    r = ring_allreduce(cluster, B, sizes, Ng, Lg, bw, nic_share=q, buckets=buckets)
    return GroupCosts(members, sizes, np.cumsum(sizes) - sizes, r.seconds, r.nic, r.port, multi, bw, kg, ku)


def throughput_bound(mu: float, steps: list) -> float:
    """Lower bound on the mean step: ``max(mu, max over links of their mean busy time per step)``.

    Every link must carry its period's bytes whatever the ranks' phases, so
    no schedule runs faster; ranks drifting out of phase (stragglers, ATC)
    can approach it by pipelining transfers through a shared NIC.
    """
    nic = np.mean([s.nic_seconds for s in steps], axis=0).max(initial=0.0)
    port = np.mean([s.port_seconds for s in steps], axis=0).max(initial=0.0)
    return float(max(mu, nic, port))


def workload_step_groups(workload, topology, step):
    """The step's averaging groups ``(members, sizes)`` when it runs as group all-reduces under
    ``workload.exchange``, else ``None`` (point to point): "group-allreduce" whenever the step is uniform
    averaging over groups, "auto" only when one of its groups has at least ``AUTO_MIN_GROUP`` ranks and the
    wire is not the 8-bit one (as the optimizers decide), "p2p" never.  A group of ``s`` ranks gives each member
    ``s - 1`` senders, so "auto" needs no group check on steps whose ranks have fewer than ``AUTO_MIN_GROUP - 1``."""
    if workload.exchange == "p2p" or (workload.exchange == "auto" and workload.wire_is_8bit):
        return None
    table = schedule_of(topology).steps[step]
    if workload.exchange == "auto" and table.links.max_indegree < AUTO_MIN_GROUP - 1:
        return None
    groups = table.groups
    if groups is not None and workload.exchange == "auto" and groups[1].max() < AUTO_MIN_GROUP:
        return None
    return groups


def _group_step(cluster, B: float, step: int, groups, indeg: int, buckets: int) -> StepComm:
    n, N = cluster.world_size, cluster.nodes
    gc = group_costs(cluster, B, *groups, buckets)
    gid = np.repeat(np.arange(gc.sizes.size), gc.sizes)
    D, port, nic = np.zeros(n), np.zeros(n), np.zeros(N)
    D[gc.members] = gc.cost[gid]
    port[gc.members] = gc.port[gid]
    spans = gc.multi_node[gc.node_group]
    np.maximum.at(nic, gc.node[spans], gc.nic[gc.node_group[spans]])
    multi = gc.multi_node
    with np.errstate(invalid="ignore"):  # an infinite NIC gives 0 s x inf = nan: left out (fmax)
        node_load = np.fmax.reduce(gc.nic[multi] * gc.min_bw[multi], initial=0.0)
    return StepComm(step=step, rank_seconds=D, seconds=float(D.max(initial=0.0)),
                    inter_seconds=float(gc.cost[multi].max(initial=0.0)),
                    intra_seconds=float(gc.cost[~multi].max(initial=0.0)),
                    max_node_inter_bytes=float(node_load),
                    max_indegree=indeg, nic_seconds=nic, port_seconds=port)


def _p2p_step(cluster, B: float, links) -> StepComm:
    n, L = cluster.world_size, cluster.ranks_per_node
    node_bw = np.asarray(cluster.node_bandwidths(), dtype=np.float64)
    src, dst, inter = links.src, links.dst, links.inter
    egress = links.node_egress * B / node_bw
    ingress = links.node_ingress * B / node_bw
    t_inter = cluster.inter_latency + np.maximum(egress[src // L], ingress[dst // L])
    if cluster.intra_sharing == "pair":
        t_intra = np.full(src.size, cluster.intra_latency + B / cluster.intra_bandwidth)
    else:
        busiest = np.maximum(links.rank_intra_send[src], links.rank_intra_recv[dst])
        t_intra = cluster.intra_latency + busiest * B / cluster.intra_bandwidth
    t_msg = np.where(inter, t_inter, t_intra)
    D = np.zeros(n)
    if src.size:
        np.maximum.at(D, dst, t_msg)
    node_load = np.maximum(links.node_egress, links.node_ingress) * B
    if cluster.intra_sharing == "pair":
        port = np.where((links.rank_intra_send + links.rank_intra_recv) > 0, B / cluster.intra_bandwidth, 0.0)
    else:
        port = np.maximum(links.rank_intra_send, links.rank_intra_recv) * B / cluster.intra_bandwidth
    return StepComm(
        step=links.step, rank_seconds=D, seconds=float(D.max(initial=0.0)),
        inter_seconds=float(t_msg[inter].max(initial=0.0)),
        intra_seconds=float(t_msg[~inter].max(initial=0.0)),
        max_node_inter_bytes=float(node_load.max(initial=0.0)), max_indegree=links.max_indegree,
        nic_seconds=node_load / node_bw, port_seconds=port)


@functools.lru_cache(maxsize=256)
def make_topology(name: str, world_size: int, local_world_size: int):
    """``decent_comm.topology.make`` with a cache (the link tables are cached on the object)."""
    return _topology.make(name, world_size, local_world_size)


def resolve_topology(topology, cluster):
    """A ``Topology`` for ``cluster`` from a name or a ``Topology`` (checked against the cluster)."""
    if isinstance(topology, str):
        return make_topology(_topology.canonical_name(topology), cluster.world_size, cluster.ranks_per_node)
    if not isinstance(topology, _topology.Topology):  # None, a number, a matrix raised AttributeError
        raise TypeError(f"topology must be a built-in name or a decent_comm.topology.Topology, got "
                        f"{type(topology).__name__}")
    if topology.world_size != cluster.world_size or topology.local_world_size != cluster.ranks_per_node:
        raise ValueError(f"topology {topology.name!r} has world_size={topology.world_size},"
                         f" local_world_size={topology.local_world_size}; the cluster is"
                         f" {cluster.nodes} nodes x {cluster.ranks_per_node} ranks")
    return topology


def schedule_comm(cluster, workload, topology) -> list:
    """``StepComm`` for every step of ``topology``'s period (a name or a ``Topology``; formulas in the module
    docstring)."""
    topology = resolve_topology(topology, cluster)
    B = workload.bytes_per_rank
    out = []
    for table in schedule_of(topology).steps:
        groups = workload_step_groups(workload, topology, table.step)
        if groups is None:
            out.append(_p2p_step(cluster, B, table.message_links))
        else:
            out.append(_group_step(cluster, workload.group_bytes_per_rank, table.step, groups,
                                   table.links.max_indegree, workload.group_buckets))
    return out


def sync_set_size(topology, steps: list) -> float:
    """``k = 1 + mean_t max indegree + 0.5 [period > 1]``, capped at n (1 without peers);
    ``steps``: the ``StepComm`` of every step of the period."""
    degs = [s.max_indegree for s in steps]
    if max(degs, default=0) == 0:
        return 1.0
    k = 1.0 + float(np.mean(degs)) + (0.5 if len(steps) > 1 else 0.0)
    return min(k, float(topology.world_size))


def straggler_penalty(k: float, slack: float) -> float:
    """``g(s)`` in units of sigma for sync-set size ``k`` and slack ``s`` (module docstring)."""
    if k <= 1.0:
        return 0.0
    G = G_C0 + G_C1 * expected_max_normal(round(k, 6))
    if slack >= 0:
        return G * (1.0 + (slack / G_S0) ** G_P) ** (-1.0 / G_P)
    return G * math.exp(-0.5 * (slack / G_W) ** 2)
