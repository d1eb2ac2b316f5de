"""Discrete-event simulation of the exact gossip schedule (and of All-Reduce).

**Gossip (AWC / ATC).**  ``U_i(t)``: time rank ``i`` finishes the update of
step ``t`` (``x_i^{t+1}`` ready).  Right then it starts sending ``x_i^{t+1}``
to its step-``t+1`` out-neighbours and starts computing step ``t+1``
(forward + backward, ``C_i(t+1)``).  The update of step ``t+1`` needs the
buffers of its step-``t+1`` in-neighbours ``j``, which arrive at
``A_ji(t+1)`` (transfer started at ``U_j(t)``)::

    R_i(t+1) = max_j A_ji(t+1)                               (-inf if no peer)
    U_i(t+1) = max(U_i(t) + f C_i(t+1), R_i(t+1)) + (1 - f) C_i(t+1)

with overlap fraction ``f = 1`` for AWC (the exchange overlaps forward and
backward; the update waits for the receives) and ``f = forward_fraction``
for ATC (the forward waits for the mixed parameters, the backward follows).
The update itself is counted in ``C``.

**Links.**  Every message is a transfer of ``B`` bytes through resources:
inter-node messages through the sender node's NIC egress and the receiver
node's NIC ingress (bandwidth per node, shared by the node's ranks);
intra-node messages through the sender's and receiver's intra-node ports
(``intra_sharing = "rank"``) or a dedicated link per ordered rank pair
(``"pair"``).  Each resource shares its bandwidth equally among the
transfers in progress (processor sharing, as concurrent TCP/NCCL
connections on one NIC do; exact, vectorised over resources), so ``L``
simultaneous ``B``-byte transfers through one NIC all end after
``L B / bw``, while a transfer that starts alone gets the whole link until
others join.  A message ends when both its resources have carried it (each
resource computed on its own: no max-min coupling between a flow's two
ends), plus the link latency.  Steps are processed in order: a step's
transfers start on a resource only after the backlog of earlier steps has
drained (``free_at``).

**Group all-reduce steps** (``Workload.exchange = "group-allreduce"`` and a
block-uniform ``W``): a collective per group, which starts when its last
member launches it: ``R_i(t+1) = max_{j in g} U_j(t) + c_g`` with the
closed-form group cost ``c_g`` (``gossip.group_costs``; NIC sharing
between groups included there, no further contention).

**Compute times** ``C_i(t)``: independent draws, normal clipped at 0 or
resampled from a measured sample (``ComputeTime.draw``).

**All-Reduce**: a global barrier per step: ``step(t) = max_i C_i(t) +
exposed`` with ``exposed`` the all-reduce time not hidden behind the backward
(``allreduce.allreduce_cost``).

The reported step time is the mean over ranks of ``(U_i(T) - U_i(w)) /
(T - w)`` after ``w`` warm-up steps.  Cost per step: a few numpy calls on
arrays of ``n * degree`` messages plus ``2 m`` vectorised iterations of
processor sharing when ``m`` transfers share a resource at staggered times
(``n = 64`` one-peer-exp, 500 steps: ~0.2 s on one idle core).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from .._args import integer
from .allreduce import allreduce_cost
from .gossip import group_costs, resolve_topology, workload_step_groups
from .loads import schedule_of


@dataclasses.dataclass(frozen=True)
class SimResult:
    """``step_seconds``: mean step time after ``warmup`` of ``steps`` steps;
    ``step_std``: std of the per-step increments of the mean progress;
    ``comm_wait_seconds``: mean time per step a rank waited for receives
    (0 for All-Reduce: its communication is in ``step_seconds`` directly).
    """

    name: str
    step_seconds: float
    step_std: float
    comm_wait_seconds: float
    steps: int
    warmup: int


@dataclasses.dataclass
class _GroupPlan:
    """A group all-reduce step: ``order`` (the ranks of the multi-rank groups,
    group by group), ``starts`` / ``sizes`` (each group's slice of ``order``),
    ``cost`` (``c_g`` per group)."""

    order: np.ndarray
    starts: np.ndarray
    cost: np.ndarray
    sizes: np.ndarray


@dataclasses.dataclass
class _StepPlan:
    F: int
    src: np.ndarray
    lat: np.ndarray
    e_res: np.ndarray
    e_dur: np.ndarray
    e_src: np.ndarray
    two: np.ndarray          # flows with a second entry (entries F: map to these flows)
    recv_ranks: np.ndarray
    recv_starts: np.ndarray


def _plan_step(links, cluster, B: float) -> _StepPlan:
    N, L = cluster.nodes, cluster.ranks_per_node
    n = N * L
    src, dst, inter = links.src, links.dst, links.inter
    F = src.size
    node_bw = np.asarray(cluster.node_bandwidths(), dtype=np.float64)
    with np.errstate(divide="ignore"):
        dur_intra = B / cluster.intra_bandwidth
    lat = np.where(inter, cluster.inter_latency, cluster.intra_latency)
    # first entry: sender side (egress NIC or intra port / pair link)
    res1 = np.where(inter, src // L, 2 * N + src)
    dur1 = np.where(inter, B / node_bw[src // L], dur_intra)
    if cluster.intra_sharing == "pair":  # one resource per ordered pair of ranks of a node
        res1 = np.where(inter, res1, 2 * N + src * L + dst % L)
        two = np.flatnonzero(inter)
    else:
        two = np.arange(F)
    # second entry: receiver side (ingress NIC or intra port)
    res2 = np.where(inter, N + dst // L, 2 * N + n + dst)[two]
    dur2 = np.where(inter, B / node_bw[dst // L], dur_intra)[two]
    e_res = np.concatenate([res1, res2]).astype(np.int64)
    e_dur = np.concatenate([dur1, dur2]).astype(np.float64)
    e_src = np.concatenate([src, src[two]])
    recv_ranks, recv_starts = np.unique(dst, return_index=True)
    return _StepPlan(F, src, lat, e_res, e_dur, e_src, two, recv_ranks, recv_starts)


def _processor_sharing(arr: np.ndarray, dur: np.ndarray) -> np.ndarray:
    """Exact departure times of equal-size jobs under processor sharing, many servers at once.

    ``arr``: ``(R, m)`` sorted arrival times per server (padded with +inf:
    a server's job count), ``dur``: ``(R,)`` service time of one job alone.
    All present jobs of a server get an equal share of it, so with
    equal sizes they leave in arrival order; virtual time ``V`` (the service
    one present job has received) grows at ``1 / present`` and job ``j``
    leaves when ``V`` reaches ``V(arr_j) + dur``.  One event loop vectorised
    over the servers: ``2 m`` iterations.
    """
    R, m = arr.shape
    rows = np.arange(R)
    arr = np.concatenate([arr, np.full((R, 1), np.inf)], axis=1)
    tag = np.full((R, m + 1), np.inf)
    dep = np.full((R, m + 1), np.inf)
    t = arr[:, 0].copy()
    V = np.zeros(R)
    present = np.zeros(R)
    ia = np.zeros(R, dtype=np.int64)
    idp = np.zeros(R, dtype=np.int64)
    for _ in range(2 * m):
        share = np.maximum(present, 1.0)
        t_arr = arr[rows, ia]
        t_dep = t + (tag[rows, idp] - V) * share          # inf while the server is idle
        is_arr = t_arr <= t_dep
        t_ev = np.minimum(t_arr, t_dep)
        ok = t_ev < np.inf
        t_ev = np.where(ok, t_ev, t)
        V += (t_ev - t) / share
        t = t_ev
        a = np.flatnonzero(ok & is_arr)
        d = np.flatnonzero(ok & ~is_arr)
        tag[a, ia[a]] = V[a] + dur[a]
        dep[d, idp[d]] = t[d]
        present[a] += 1.0
        present[d] -= 1.0
        ia[a] += 1
        idp[d] += 1
    return dep[:, :m]


def _serve(plan: _StepPlan, start_rank: np.ndarray, free_at: np.ndarray) -> np.ndarray:
    """Finish time of every flow of one step; updates ``free_at`` (per resource) in place.

    Per resource, transfers start at ``max(start, free_at)`` (after the
    backlog of earlier steps) and share the bandwidth equally
    (``_processor_sharing``; a shortcut when they all start together: they
    all end after ``count * dur``).  A flow ends when both its resources have
    carried it, plus its latency.
    """
    F = plan.F
    if F == 0:
        return np.empty(0)
    res = plan.e_res
    s_all = np.maximum(start_rank[plan.e_src], free_at[res])
    order = np.lexsort((s_all, res))
    r = res[order]
    s = s_all[order]
    dur = plan.e_dur[order]
    new_grp = np.empty(r.size, dtype=bool)
    new_grp[0] = True
    new_grp[1:] = r[1:] != r[:-1]
    gid = np.cumsum(new_grp) - 1
    gstart = np.flatnonzero(new_grp)
    gend = np.append(gstart[1:] - 1, r.size - 1)
    counts = gend - gstart + 1
    together = s[gstart] == s[gend]                       # sorted: first == last <=> all equal
    fin = s + (counts * dur[gstart])[gid]
    stag = np.flatnonzero(~together)
    if stag.size:
        m = int(counts[stag].max())
        row_of = np.full(gstart.size, -1)
        row_of[stag] = np.arange(stag.size)
        sel = np.flatnonzero(~together[gid])
        pos = sel - gstart[gid[sel]]
        arr = np.full((stag.size, m), np.inf)
        arr[row_of[gid[sel]], pos] = s[sel]
        dep = _processor_sharing(arr, dur[gstart[stag]])
        fin[sel] = dep[row_of[gid[sel]], pos]
    free_at[r[gend]] = fin[gend]
    e_fin = np.empty_like(fin)
    e_fin[order] = fin
    flow_fin = e_fin[:F].copy()
    if plan.two.size:
        flow_fin[plan.two] = np.maximum(flow_fin[plan.two], e_fin[F:])
    return flow_fin + plan.lat


def _plan_group_step(cluster, B: float, groups, buckets: int) -> _GroupPlan | None:
    gc = group_costs(cluster, B, *groups, buckets)
    if not gc.sizes.size:
        return None
    return _GroupPlan(gc.members, gc.starts, gc.cost, gc.sizes)


def _steps(steps, warmup):
    """(steps, warmup) as ints, warmup >= 0 and steps > warmup: a negative warmup gave a NaN step_std, and 2.5
    steps failed inside numpy."""
    steps, warmup = integer(steps, "steps", low=1), integer(warmup, "warmup", low=0)
    if steps <= warmup:
        raise ValueError(f"steps ({steps}) must exceed warmup ({warmup})")
    return steps, warmup


def simulate(cluster, workload, topology, steps: int = 500, warmup: int = 50, seed: int = 0) -> SimResult:
    """Simulate ``steps`` steps of gossip on ``topology`` (a built-in name or a ``Topology``, as ``predict``
    takes); see the module docstring."""
    steps, warmup = _steps(steps, warmup)
    n = cluster.world_size
    topology = resolve_topology(topology, cluster)
    rng = np.random.default_rng(seed)
    B = workload.bytes_per_rank
    plans = []
    for table in schedule_of(topology).steps:
        groups = workload_step_groups(workload, topology, table.step)
        plans.append(_plan_step(table.message_links, cluster, B) if groups is None
                     else _plan_group_step(cluster, workload.group_bytes_per_rank, groups, workload.group_buckets))
    f = workload.overlap_fraction
    N, L = cluster.nodes, cluster.ranks_per_node
    n_res = 2 * N + (n * L if cluster.intra_sharing == "pair" else 2 * n)
    free_at = np.full(n_res, -np.inf)
    U = np.zeros(n)
    C_all = workload.compute.draw(rng, (steps, n))
    progress = np.empty(steps + 1)
    progress[0] = 0.0
    wait = 0.0
    U_warm = None
    for t in range(steps):
        plan = plans[t % len(plans)]
        C = C_all[t]
        ready = U + f * C
        if isinstance(plan, _GroupPlan):
            R = np.full(n, -np.inf)
            done = np.maximum.reduceat(U[plan.order], plan.starts) + plan.cost
            R[plan.order] = np.repeat(done, plan.sizes)
            new = np.maximum(ready, R)
            if t >= warmup:
                wait += float(np.mean(new - ready))
        elif plan is not None and plan.F:
            fin = _serve(plan, U, free_at)
            R = np.full(n, -np.inf)
            R[plan.recv_ranks] = np.maximum.reduceat(fin, plan.recv_starts)
            new = np.maximum(ready, R)
            if t >= warmup:
                wait += float(np.mean(new - ready))
        else:
            new = ready
        U = new + (1.0 - f) * C
        progress[t + 1] = U.mean()
        if t + 1 == warmup:
            U_warm = U.copy()
    if U_warm is None:
        U_warm = np.zeros(n)
    rate = float(np.mean((U - U_warm) / (steps - warmup)))
    inc = np.diff(progress[warmup:])
    return SimResult(name=topology.name, step_seconds=rate, step_std=float(inc.std()),
                     comm_wait_seconds=wait / (steps - warmup), steps=steps, warmup=warmup)


def simulate_allreduce(cluster, workload, steps: int = 500, warmup: int = 50, seed: int = 0) -> SimResult:
    """All-Reduce with a global barrier per step: ``max_i C_i(t) + exposed``."""
    steps, warmup = _steps(steps, warmup)
    rng = np.random.default_rng(seed)
    n = cluster.world_size
    C = workload.compute.draw(rng, (steps, n)).max(axis=1)[warmup:]
    exposed = allreduce_cost(cluster, workload).exposed_seconds if n > 1 else 0.0
    step = C + exposed
    return SimResult(name="allreduce", step_seconds=float(step.mean()), step_std=float(step.std()),
                     comm_wait_seconds=0.0, steps=steps, warmup=warmup)
