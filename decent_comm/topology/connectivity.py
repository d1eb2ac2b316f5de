"""Refuse schedules whose replicas never agree: ``check_averages(topology)``.

Gossip repeats the period product ``P = W(T-1) ... W(1) W(0)`` (``T`` = period).
``check_averages`` raises ``ValueError`` when repeating it never brings the
replicas together, i.e. ``P^k`` does not tend to a matrix of equal rows
(``11^T/n`` for a doubly stochastic schedule): e.g. ``from_matrix(np.eye(4))``,
a block-diagonal matrix, a disconnected graph (``spectral_gap`` 0 and no
contraction over any number of periods).  A schedule meant not to communicate
opts out with ``allow_disconnected=True`` (the built-in ``local`` does).  What
is checked, cheapest first:

1. Always, O(period * n * degree): in the *union graph* of the period (an edge
   ``j -> i`` when some ``W(t)_ij > 0``: rank i receives from rank j at some
   step) the values of one rank ``r`` must reach every rank, directly or
   through others.  Necessary for any row-stochastic schedule: otherwise the
   union graph has two source components (sets of ranks that receive from no
   rank outside themselves at any step); each evolves on its own, so ``P`` has
   the eigenvalue 1 twice and the replicas of the two settle on different
   values.  How ``r`` is found in linear time: mark the ranks reachable from
   each unmarked rank in turn; no rank outside the last start's set reaches
   that start (it would have been marked earlier), so if any rank reaches
   everyone, the last start does.
2. Sufficient when every self weight ``W(t)_ii`` is positive.  Then
   ``P_ij >= W(t)_ij prod_{s != t} W(s)_ii > 0`` for every union edge and
   ``P_ii > 0``: the graph of ``P`` contains the union graph, with self loops.
   * Doubly stochastic (the default): each ``W(t)`` is a convex combination of
     permutations (Birkhoff), so each of its edges lies on a cycle and a union
     graph that passes 1. is strongly connected.  ``P^T P`` is symmetric, doubly
     stochastic, has a positive diagonal and contains the graph of ``P``, so it
     is irreducible: its eigenvalue 1 is simple and the others lie in [0, 1).
     Hence ``||P - 11^T/n||_2 = sigma_2(P) < 1``: even one period contracts.
   * Row-stochastic only (``allow_biased``): ``P`` has a single closed class,
     aperiodic thanks to the self loops, so ``P^k -> 1 pi^T``: the replicas
     agree (on a weighted average, the price of a biased schedule).
3. With a zero self weight somewhere (a step that only moves values, such as
   the swap ``[[0, 1], [1, 0]]``, passes 1. and never averages) the dense
   product decides, O(period * n^3): every eigenvalue of ``P`` but one must lie
   inside the unit circle by ``TOL`` (``P^k`` then converges to equal rows).
   Done up to ``DENSE_CHECK_MAX_WORLD_SIZE`` ranks; above that only 1. is
   checked (no built-in has a zero self weight).  Such a schedule may need more
   than one period to contract: ``[[0, .5, .5], [1, 0, 0], [0, .5, .5]]`` is
   accepted (``P^2`` contracts) although ``||P - 11^T/n||_2 = 1``, so
   ``spectral_gap`` reports 0 for it.
"""
from __future__ import annotations

import numpy as np

from .validation import TOL

#: Largest world size for which a schedule with a zero self weight gets the dense check (3. above).
DENSE_CHECK_MAX_WORLD_SIZE = 512

OPT_OUT = ("pass allow_disconnected=True (from_matrix, from_networkx, Topology) if replicas that never agree are"
           " intended, as with the built-in 'local' (no communication)")


def _ranks(ranks) -> str:
    ranks = sorted(ranks)
    if len(ranks) <= 8:
        return str(ranks)
    return f"[{', '.join(map(str, ranks[:8]))}, ... ({len(ranks)} ranks)]"


def union_graph(topology, matrices=None):
    """``(receivers, self_loops)``: ``receivers[j]`` = int array of the ranks that receive rank j's buffer with
    a positive weight at some step of the period; ``self_loops``: every self weight of the period is positive.
    From ``topology.peers`` (O(period * n * degree)), or from dense ``matrices`` (the period's ``W(t)``) with
    numpy when given (O(period * n^2) without a Python loop over entries)."""
    n = topology.world_size
    if matrices is not None:
        support = np.zeros((n, n), dtype=bool)  # support[j, i]: i receives from j
        for W in matrices:
            support |= np.asarray(W).T > 0
        self_loops = all(bool((np.diagonal(W) > 0).all()) for W in matrices)
        np.fill_diagonal(support, False)
        return [np.flatnonzero(row) for row in support], self_loops
    receivers = [set() for _ in range(n)]
    self_loops = True
    for t in range(topology.period):
        for i in range(n):
            p = topology.peers(i, t)
            self_loops = self_loops and p.self_weight > 0
            for j, w in p.recv:
                if w > 0:
                    receivers[j].add(i)
    return [np.fromiter(r, dtype=np.int64, count=len(r)) for r in receivers], self_loops


def _reach(receivers, start: int, seen: np.ndarray) -> np.ndarray:
    """Ranks reachable from ``start`` that were not ``seen`` yet (marks them), breadth first."""
    seen[start] = True
    frontier, found = np.array([start]), [np.array([start])]
    hit = np.zeros(len(receivers), dtype=bool)
    while frontier.size:
        hit[:] = False
        hit[np.concatenate([receivers[j] for j in frontier.tolist()])] = True
        frontier = np.flatnonzero(hit & ~seen)
        seen[frontier] = True
        found.append(frontier)
    return np.concatenate(found)


def unreached(receivers):
    """``(R, U)``: a set ``R`` of ranks whose values reach no rank of ``U`` (``U`` empty when the values of one
    rank reach every rank; see 1. in the module docstring)."""
    n = len(receivers)
    seen = np.zeros(n, dtype=bool)
    root = 0
    for s in range(n - 1, -1, -1):  # downwards, so that a disconnected schedule reports rank 0's component
        if not seen[s]:
            root = s
            _reach(receivers, s, seen)
    reached = np.zeros(n, dtype=bool)
    _reach(receivers, root, reached)
    return np.flatnonzero(reached).tolist(), np.flatnonzero(~reached).tolist()


def second_eigenvalue(topology) -> float:
    """Second largest ``|eigenvalue|`` of the dense period product (3. in the module docstring)."""
    from .analysis import period_product
    return float(np.sort(np.abs(np.linalg.eigvals(period_product(topology))))[-2])


def check_averages(topology, matrices=None) -> None:
    """Raise ``ValueError`` unless repeating ``topology``'s period brings the replicas together (see the module
    docstring for what is checked and why).  Skipped when ``topology.allow_disconnected``.  ``matrices``: the
    period's dense ``W(t)`` when the caller has them (faster than going through ``peers``)."""
    if getattr(topology, "allow_disconnected", False) or topology.world_size == 1:
        return
    receivers, self_loops = union_graph(topology, matrices)
    where = f"topology {topology.name!r} cannot average"
    period = f"{topology.period} step{'s' if topology.period > 1 else ''}"
    R, U = unreached(receivers)
    if U:
        raise ValueError(
            f"{where}: over its period ({period}) the values of ranks {_ranks(R)} never reach ranks {_ranks(U)},"
            f" directly or through other ranks, so the replicas never agree (spectral gap 0). Connect them, or"
            f" {OPT_OUT}")
    if self_loops or topology.world_size > DENSE_CHECK_MAX_WORLD_SIZE:
        return
    second = second_eigenvalue(topology)
    if not second < 1.0 - TOL:
        raise ValueError(
            f"{where}: its graph is connected but some rank has self weight 0, and repeating the product P of"
            f" its {period} never contracts the disagreement (second largest |eigenvalue| of P = {second:.6g}):"
            f" steps that only move values around never average them. Give every rank a positive self weight,"
            f" or {OPT_OUT}")
