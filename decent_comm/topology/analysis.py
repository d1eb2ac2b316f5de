"""Mixing quality over one period: ``period_product``, ``spectral_gap``, ``finite_time_exact``.

Dense linear algebra on ``n x n`` matrices: meant for analysis and tests,
not for the training hot path.
"""
from __future__ import annotations

import dataclasses
import itertools

import numpy as np

from .base import Topology
from .validation import TOL


def period_product(topology: Topology, start: int = 0) -> np.ndarray:
    """``P = W(start + T - 1) ... W(start + 1) W(start)`` with ``T = period``.

    ``W(start)`` is applied first: one period of gossip maps ``x`` to ``P x``.
    """
    n = topology.world_size
    P = np.eye(n)
    for t in range(start, start + topology.period):
        P = np.asarray(topology.matrix(t), dtype=np.float64) @ P
    return P


@dataclasses.dataclass(frozen=True)
class SpectralGap:
    """Contraction of the disagreement ``x - mean(x)`` by gossip.

    ``rho``: spectral norm (largest singular value) of ``P - 11^T/n``, ``P``
    the product of ``W`` over one period.  For a doubly stochastic ``P``,
    ``||P x - xbar|| <= rho ||x - xbar||`` for every ``x``: the worst-case
    contraction per period.  For a static symmetric ``W`` it equals the
    second largest eigenvalue magnitude ``max(|lambda_2|, |lambda_n|)``.

    ``gap = 1 - rho`` (per period; 1 = exact averaging, 0 = no contraction,
    can be negative for non-doubly-stochastic schedules).

    ``per_step = 1 - rho^(1/period)``: the equivalent per-step gap, to
    compare schedules with different periods.

    ``period``: the period used.
    """

    gap: float
    per_step: float
    rho: float
    period: int


def spectral_gap(topology: Topology) -> SpectralGap:
    """``SpectralGap`` of the product of ``W`` over one period (see its docstring)."""
    n = topology.world_size
    P = period_product(topology) - np.full((n, n), 1.0 / n)
    rho = float(np.linalg.norm(P, 2)) if n > 1 else 0.0
    if rho < TOL:
        rho = 0.0  # exact averaging up to round-off (validation.TOL)
    elif abs(rho - 1.0) < TOL:
        rho = 1.0  # no contraction (e.g. disconnected), up to round-off
    T = topology.period
    per_step = 1.0 - rho ** (1.0 / T)
    return SpectralGap(gap=1.0 - rho, per_step=per_step, rho=rho, period=T)


def finite_time_exact(topology: Topology, tol: float = TOL) -> bool:
    """True when the product over one period equals ``11^T / n`` (max abs error ``<= tol``)."""
    n = topology.world_size
    return bool(np.abs(period_product(topology) - 1.0 / n).max() <= tol)


#: Groups smaller than this gain nothing from an all-reduce over point-to-point gossip (same bytes); the
#: optimizers (decent_comm.optim.plan) and the runtime model's exchange="auto" both use it.
MIN_ALLREDUCE_GROUP = 3


def averaging_groups(topology: Topology, step: int, tol: float = 1e-9):
    """Averaging groups of a step, or ``None`` when ``W(step)`` is not block-uniform.

    Block-uniform: the ranks split into groups ``g`` and every rank of ``g``
    takes exactly ``1/|g|`` of every member of ``g`` (itself included), e.g.
    intra-node averaging or the node-pair averaging of the seed library's
    alternating exponential ring.  Such a step can be run as one all-reduce
    per group instead of point-to-point messages (the optimizers do, see
    ``decent_comm.optim.plan``; the runtime model with
    ``Workload.exchange = "group-allreduce"``).  Returns sorted tuples of
    ranks (singletons included).  Cost O(n * degree + n log n): one ``peers``
    call per rank, then ``uniform_groups`` on the collected arrays.
    """
    n = topology.world_size
    self_weight = np.empty(n)
    degree = np.empty(n, dtype=np.int64)
    recv = []
    for i in range(n):
        p = topology.peers(i, step)
        self_weight[i] = p.self_weight
        degree[i] = len(p.recv)
        recv.extend(p.recv)
    flat = np.fromiter(itertools.chain.from_iterable(recv), dtype=np.float64, count=2 * len(recv))
    src = flat[0::2].astype(np.int64)
    dst = np.repeat(np.arange(n, dtype=np.int64), degree)
    return uniform_groups(self_weight, src, dst, flat[1::2], tol)


def uniform_groups(self_weight, src, dst, weight, tol: float = 1e-9):
    """``averaging_groups`` of one step given as arrays: ``self_weight[i] = W_ii`` and one entry per
    message ``src[m] -> dst[m]`` with ``weight[m] = W_dst,src`` (``src != dst``, no duplicates).

    With ``N[i]`` rank i's closed neighbourhood (itself and its senders), the step is block-uniform iff
    every row takes ``1/|N[i]|`` of each member, every message joins ranks whose neighbourhoods have the
    same smallest rank ``r``, and exactly ``|N[i]|`` ranks have ``r`` as theirs: then each ``N[i]`` is
    the whole class of its ``r`` (a subset of the same size).  O(n log n + messages), vectorized.
    """
    self_weight = np.asarray(self_weight, dtype=np.float64)
    src, dst = np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64)
    n = self_weight.size
    size = np.bincount(dst, minlength=n) + 1
    expect = 1.0 / size
    if np.any(np.abs(self_weight - expect) > tol) or np.any(np.abs(np.asarray(weight) - expect[dst]) > tol):
        return None
    rep = np.arange(n, dtype=np.int64)
    np.minimum.at(rep, dst, src)
    if np.any(rep[src] != rep[dst]) or np.any(np.bincount(rep, minlength=n)[rep] != size):
        return None
    order = np.argsort(rep, kind="stable").tolist()  # by class, ranks ascending within one
    bounds = [0, *(np.flatnonzero(np.diff(rep[order])) + 1).tolist(), n]
    return [tuple(order[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
