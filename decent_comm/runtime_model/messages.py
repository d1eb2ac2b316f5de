"""Who receives whose buffer at one step of a schedule, as arrays: ``step_builder``.

The model needs every message ``j -> i`` of a step (``W_ij > 0``, ``j != i``) with its weight and
``W_ii``.  ``Topology.peers`` gives that one rank at a time, a Python call per rank and step (100,000
ranks of one-peer-exp: 1.7 million calls per period), so for the built-in schedules the same arrays are
computed here with numpy from their definitions in ``decent_comm.topology``; tests check them against
``peers`` for every built-in, step and many layouts.  Any other topology goes through ``peers``.

* ``Messages``: ``self_weight`` (n), ``src``, ``dst``, ``weight`` (one entry per message, sorted by
  ``dst`` then ``src``, as ``peers(i).recv`` lists them rank by rank).
* ``step_builder(topology)``: ``(period, build(step) -> Messages)``.  ``complete`` is dense (n(n-1)
  messages): its builder refuses above ``MAX_MESSAGES``; the model uses its one averaging group instead
  (``known_groups``).  A ``ScheduleTopology`` (``base-k``) is read from its ``build_rounds()`` directly:
  its per-rank tables cost ~100x more than the rounds at 100,000 ranks.
"""
from __future__ import annotations

import dataclasses
import itertools

import numpy as np

from ..topology.aer import AlternatingExponentialRing
from ..topology.builtins import (Complete, Exponential, Local, OnePeerExponential, OnePeerHypercube, OnePeerRing,
                                Ring, Torus)
from ..topology.schedule import Round, ScheduleTopology

#: The most messages one step may have (int64 src/dst + float64 weight: ~400 MB at the limit).
MAX_MESSAGES = 1 << 24


class TooManyMessages(ValueError):
    """A step with more than ``MAX_MESSAGES`` messages (a dense schedule point to point on many ranks)."""


@dataclasses.dataclass(frozen=True)
class Messages:
    """One step: ``self_weight[i] = W_ii``; message ``m`` carries ``src[m]``'s buffer to ``dst[m]`` with
    weight ``weight[m] = W_dst,src``; sorted by ``dst`` then ``src``."""

    self_weight: np.ndarray
    src: np.ndarray
    dst: np.ndarray
    weight: np.ndarray


def _check_size(count: int, topology) -> None:
    if count > MAX_MESSAGES:
        raise TooManyMessages(
            f"{topology.name} on {topology.world_size} ranks sends {count} messages per step point to point,"
            f" more than the model handles ({MAX_MESSAGES}); model it as group all-reduces (exchange auto)")


def _stencil(cand: np.ndarray) -> Messages:
    """Uniform weights ``1/(d_i + 1)`` over the distinct ``cand[i]`` other than ``i`` (``_uniform`` in builtins)."""
    n = cand.shape[0]
    cand = np.sort(cand, axis=1)
    keep = cand != np.arange(n)[:, None]
    keep[:, 1:] &= cand[:, 1:] != cand[:, :-1]
    count = keep.sum(axis=1)
    w = 1.0 / (count + 1)
    dst = np.repeat(np.arange(n, dtype=np.int64), count)
    return Messages(w, cand[keep].astype(np.int64), dst, w[dst])


def _circulant(n: int, offsets) -> Messages:
    """Rank i receives from ``i - o mod n`` for each offset (ring, exp, one-peer-exp)."""
    r = np.arange(n, dtype=np.int64)
    return _stencil(np.stack([(r - o) % n for o in offsets] or [r], axis=1))


def _torus(topo: Torus) -> Messages:
    a, b = topo.shape
    r, c = np.divmod(np.arange(topo.world_size, dtype=np.int64), b)
    return _stencil(np.stack([((r + 1) % a) * b + c, ((r - 1) % a) * b + c, r * b + (c + 1) % b,
                              r * b + (c - 1) % b], axis=1))


def _pairs(partner: np.ndarray) -> Messages:
    """Matching: ``partner[i]`` (or -1) with weight 1/2 each; unpaired ranks keep 1."""
    dst = np.flatnonzero(partner >= 0)
    return Messages(np.where(partner >= 0, 0.5, 1.0), partner[dst], dst, np.full(dst.size, 0.5))


def _one_peer_ring(topo: OnePeerRing, step: int) -> Messages:
    n, h = topo.world_size, step % 2
    r = np.arange(n, dtype=np.int64)
    j = np.where((r - h) % 2 == 0, r + 1, r - 1)
    j = np.where(j == n, 0 if n % 2 == 0 else -1, j)          # the wrap-around pair exists for even n only
    j = np.where(j < 0, n - 1 if n % 2 == 0 else -1, j)
    return _pairs(np.where(j == r, -1, j))


def _hypercube(topo: OnePeerHypercube, step: int) -> Messages:
    """Rank i pairs with ``i XOR 2^(step mod period)`` (no partner when n = 1)."""
    n = topo.world_size
    r = np.arange(n, dtype=np.int64)
    return _pairs(r ^ (1 << (step % topo.period)) if n > 1 else np.full(n, -1, dtype=np.int64))


def group_messages(n: int, members: np.ndarray, sizes: np.ndarray) -> Messages:
    """Uniform averaging within disjoint groups (``members`` concatenated, ``sizes`` per group; ranks in no
    group keep weight 1): every member receives ``1/|g|`` of each other member."""
    members = np.asarray(members, dtype=np.int64)
    sizes = np.asarray(sizes, dtype=np.int64)
    size_of = np.repeat(sizes, sizes)                         # per member
    start_of = np.repeat(np.cumsum(sizes) - sizes, sizes)     # per member: its group's first position
    total = int(size_of.sum())
    recv_pos = np.repeat(np.arange(members.size), size_of)    # one entry per (member, group member) pair
    k = np.arange(total) - np.repeat(np.cumsum(size_of) - size_of, size_of)
    src = members[start_of[recv_pos] + k]
    dst = members[recv_pos]
    keep = src != dst
    src, dst = src[keep], dst[keep]
    order = np.lexsort((src, dst))
    self_weight = np.ones(n)
    self_weight[members] = 1.0 / size_of
    w = np.zeros(n)
    w[members] = 1.0 / size_of
    return Messages(self_weight, src[order], dst[order], w[dst[order]])


def _aer_groups(topo: AlternatingExponentialRing, step: int):
    """``(members, sizes)`` of an aer step: node, node pair (``inter="pair"``) or counterpart pairs."""
    L, N = topo.local_world_size, topo.num_nodes
    u = np.arange(N, dtype=np.int64)
    v = np.array([topo.node_partner(x, step) for x in range(N)], dtype=np.int64)
    inter = np.array([topo.uses_inter(x, step) for x in range(N)], dtype=bool)
    local = np.arange(L, dtype=np.int64)
    own = u[~inter, None] * L + local                          # intra-node averaging: the node's L ranks
    lead = u[inter & (u < v)]
    a, b = lead[:, None] * L + local, v[lead, None] * L + local
    if topo.inter == "pair":
        members, sizes = np.concatenate([a, b], axis=1), np.full(lead.size, 2 * L)
    else:
        members, sizes = np.stack([a, b], axis=2), np.full(lead.size * L, 2)
    return (np.concatenate([own.ravel(), members.ravel()]),
            np.concatenate([np.full(own.shape[0], L), sizes]).astype(np.int64))


def _round_messages(rnd: Round, n: int) -> Messages:
    """``schedule.round_tables`` as arrays: uniform groups, then symmetric weighted edges."""
    sizes = np.fromiter(map(len, rnd.groups), dtype=np.int64, count=len(rnd.groups))
    members = np.fromiter(itertools.chain.from_iterable(rnd.groups), dtype=np.int64, count=int(sizes.sum()))
    g = group_messages(n, members, sizes)
    if not rnd.edges:
        return g
    e = np.array(rnd.edges, dtype=np.float64).reshape(-1, 3)
    a, b = e[:, 0].astype(np.int64), e[:, 1].astype(np.int64)
    ends = np.stack([a, b], axis=1).ravel()                   # i, j per edge: the order round_tables sums in
    acc = np.zeros(n)
    touched = np.zeros(n, dtype=bool)
    np.add.at(acc, g.dst, g.weight)                           # group neighbours first, as round_tables
    np.add.at(acc, ends, np.repeat(e[:, 2], 2))
    touched[ends] = True
    self_weight = np.where(touched, 1.0 - acc, g.self_weight)
    src = np.concatenate([g.src, b, a])
    dst = np.concatenate([g.dst, a, b])
    w = np.concatenate([g.weight, e[:, 2], e[:, 2]])
    order = np.lexsort((w, src, dst))
    return Messages(self_weight, src[order], dst[order], w[order])


def _generic(topo, step: int) -> Messages:
    n = topo.world_size
    self_weight, deg, recv = np.empty(n), np.empty(n, dtype=np.int64), []
    for i in range(n):
        p = topo.peers(i, step)
        self_weight[i] = p.self_weight
        deg[i] = len(p.recv)
        recv.extend(p.recv)
    arr = np.array(recv, dtype=np.float64).reshape(-1, 2)
    return Messages(self_weight, arr[:, 0].astype(np.int64), np.repeat(np.arange(n, dtype=np.int64), deg), arr[:, 1])


def _own(topo, cls) -> bool:
    """``topo`` is a ``cls`` whose schedule methods are ``cls``'s own (a subclass may redefine them)."""
    return isinstance(topo, cls) and type(topo).peers is cls.peers


def step_builder(topology):
    """``(period, build)`` with ``build(step) -> Messages`` for ``step`` in ``0 .. period-1``."""
    n = topology.world_size
    if _own(topology, ScheduleTopology) and type(topology).period is ScheduleTopology.period:
        rounds = topology.build_rounds() or [Round()]
        return len(rounds), lambda t: _round_messages(rounds[t], n)
    period = topology.period
    if _own(topology, OnePeerExponential):
        return period, lambda t: _circulant(n, [1 << (t % period)])
    if _own(topology, Exponential):
        return period, lambda t: _circulant(n, topology.offsets)
    if _own(topology, Ring):
        return period, lambda t: _circulant(n, [1, -1])
    if _own(topology, Torus):
        return period, lambda t: _torus(topology)
    if _own(topology, OnePeerRing):
        return period, lambda t: _one_peer_ring(topology, t)
    if _own(topology, OnePeerHypercube):
        return period, lambda t: _hypercube(topology, t)
    if _own(topology, Local):
        return period, lambda t: Messages(np.ones(n), *(np.empty(0, dtype=np.int64),) * 2, np.empty(0))
    if _own(topology, AlternatingExponentialRing):
        return period, lambda t: group_messages(n, *_aer_groups(topology, t))
    if _own(topology, Complete):
        def complete(t):
            _check_size(n * (n - 1), topology)
            return group_messages(n, np.arange(n), np.array([n]))
        return period, complete
    return period, lambda t: _generic(topology, t)


def known_groups(topology, step: int):
    """``(members, sizes)`` of a step known to be uniform averaging over groups without building its
    messages (``complete``: one group; ``aer`` / ``aer-pair``: nodes, node pairs, counterpart pairs), or
    ``None`` (then ``decent_comm.topology.analysis.uniform_groups`` decides from the messages)."""
    if _own(topology, Complete):
        return np.arange(topology.world_size, dtype=np.int64), np.array([topology.world_size])
    if _own(topology, AlternatingExponentialRing):
        return _aer_groups(topology, step)
    return None
