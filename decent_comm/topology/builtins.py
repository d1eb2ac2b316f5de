"""Built-in topologies with a closed-form ``peers`` (O(degree) per call, O(1) to build).

Every class here accepts ``world_size = 1`` (self weight 1, no peers).  All
schedules are doubly stochastic; the matrix is derived from ``peers`` by the
base class.

* ``complete``: ``W = 11^T / n``.
* ``ring``: ``W_ii = W_{i,i+-1} = 1/3`` (n = 2: 1/2 each, n = 1: 1).
* ``one-peer-ring``: alternating perfect matchings of the ring (period 2).
* ``exp``: static exponential graph of Ying et al., "Exponential Graph is
  Provably Efficient for Decentralized Deep Training", NeurIPS 2021.
* ``one-peer-exp``: one-peer exponential graph (same paper), period
  ``ceil(log2 n)``; exact averaging after one period when n is a power of 2.
  A directed shift: rank i sends to ``i + 2^k`` and receives from ``i - 2^k``.
* ``one-peer-hypercube``: rank i averages with ``i XOR 2^k`` (symmetric
  pairs, the seed library Decent-DP's one-peer exponential graph); n must be
  a power of 2; exact averaging after one period.
* ``torus``: 2-D torus on the most square factorization ``n = a * b``.
* ``local``: no communication (``allow_disconnected``: deliberately never averages).
"""
from __future__ import annotations

import math

import numpy as np

from .base import Peers, Topology
from .validation import check_world_size


def _uniform(recv: list[int], send: list[int] | None = None) -> Peers:
    """Peers with weight ``1 / (len(recv) + 1)`` on self and every in-neighbour."""
    w = 1.0 / (len(recv) + 1)
    return Peers(w, [(j, w) for j in recv], list(recv if send is None else send))


def ceil_log2(n: int) -> int:
    """``ceil(log2 n)`` for ``n >= 1`` (0 for n = 1)."""
    return (n - 1).bit_length()


class Complete(Topology):
    """All-to-all averaging, ``W = 11^T / n`` (exact average every step)."""

    def __init__(self, world_size: int, local_world_size: int | None = None):
        super().__init__(world_size, local_world_size=local_world_size, name="complete")

    def peers(self, rank, step):
        rank = self._check_rank(rank)
        n = self.world_size
        others = [j for j in range(n) if j != rank]
        w = 1.0 / n
        return Peers(w, [(j, w) for j in others], others)

    def matrix(self, step):
        n = self.world_size
        return np.full((n, n), 1.0 / n)

    def _schedule_digest_items(self):
        return iter(())  # fully determined by (name, world_size)


class Local(Topology):
    """No communication: ``W = I``."""

    def __init__(self, world_size: int, local_world_size: int | None = None):
        super().__init__(world_size, local_world_size=local_world_size, name="local", allow_disconnected=True)

    def peers(self, rank, step):
        rank = self._check_rank(rank)
        return Peers(1.0, [], [])


class Ring(Topology):
    """Static ring: rank i averages with ``i - 1`` and ``i + 1`` (mod n).

    ``W_ii = W_{i,i-1} = W_{i,i+1} = 1/3``; with n = 2 both neighbours are the
    same rank, so ``W = [[1/2, 1/2], [1/2, 1/2]]``; n = 1: ``W = [1]``.
    Symmetric, hence doubly stochastic.
    """

    def __init__(self, world_size: int, local_world_size: int | None = None):
        super().__init__(world_size, local_world_size=local_world_size, name="ring")

    def peers(self, rank, step):
        rank = self._check_rank(rank)
        n = self.world_size
        nb = sorted({(rank - 1) % n, (rank + 1) % n} - {rank})
        return _uniform(nb)


class OnePeerRing(Topology):
    """Alternating matchings of the ring, weight 1/2, period 2.

    Even steps: pairs ``(i, i+1)`` for even ``i`` (``i + 1 < n``).  Odd
    steps: pairs ``(i, i+1 mod n)`` for odd ``i``; the wrap-around pair
    ``(n-1, 0)`` exists only when n is even.  For odd n one rank is unpaired
    each step (rank ``n-1`` at even steps, rank 0 at odd steps) and keeps
    weight 1.  n <= 2: the two steps coincide, so the period is 1.
    """

    def __init__(self, world_size: int, local_world_size: int | None = None):
        n = check_world_size(world_size)
        super().__init__(n, local_world_size=local_world_size, name="one-peer-ring",
                         period=1 if n <= 2 else 2)

    def partner(self, rank: int, step: int) -> int | None:
        """Rank paired with ``rank`` at ``step``, or ``None``."""
        n, h = self.world_size, step % 2
        if (rank - h) % 2 == 0:
            j = rank + 1
            if j == n:
                j = 0 if n % 2 == 0 else None
        else:
            j = rank - 1
            if j < 0:
                j = n - 1 if n % 2 == 0 else None
        return None if j == rank else j

    def peers(self, rank, step):
        rank = self._check_rank(rank)
        j = self.partner(rank, step)
        return Peers(1.0, [], []) if j is None else Peers(0.5, [(j, 0.5)], [j])


class Exponential(Topology):
    """Static exponential graph (Ying et al., NeurIPS 2021).

    Rank i receives from ``i - 2^k mod n`` for ``k = 0 .. ceil(log2 n) - 1``
    (distinct offsets only; they never collide since ``2^k < n``) and sends to
    ``i + 2^k``.  ``W_ij = 1 / (tau + 1)`` for those ``j`` and ``j = i``, where
    ``tau`` = number of distinct offsets.  ``W`` is circulant, so
    column-stochastic too.
    """

    def __init__(self, world_size: int, local_world_size: int | None = None):
        super().__init__(world_size, local_world_size=local_world_size, name="exp")
        n = self.world_size
        self.offsets = sorted({(1 << k) % n for k in range(ceil_log2(n))} - {0})

    def peers(self, rank, step):
        rank = self._check_rank(rank)
        n = self.world_size
        return _uniform(sorted((rank - o) % n for o in self.offsets),
                        sorted((rank + o) % n for o in self.offsets))


class OnePeerExponential(Topology):
    """One-peer exponential graph (Ying et al., NeurIPS 2021).

    ``tau = ceil(log2 n)``; at step t rank i receives from ``i - 2^(t mod tau)``
    and sends to ``i + 2^(t mod tau)`` (mod n), weight 1/2 each (self 1/2):
    ``W(t) = (I + S^(2^(t mod tau))) / 2`` with S the cyclic shift.  Period
    ``tau`` (1 when n = 1).  When n is a power of two the product over one
    period is exactly ``11^T / n``.
    """

    def __init__(self, world_size: int, local_world_size: int | None = None):
        n = check_world_size(world_size)
        super().__init__(n, local_world_size=local_world_size, name="one-peer-exp",
                         period=max(1, ceil_log2(n)))

    def peers(self, rank, step):
        rank = self._check_rank(rank)
        n = self.world_size
        if n == 1:
            return Peers(1.0, [], [])
        o = 1 << (step % self.period)
        src, dst = (rank - o) % n, (rank + o) % n
        return Peers(0.5, [(src, 0.5)], [dst])


class OnePeerHypercube(Topology):
    """One-peer hypercube: at step t rank i averages with ``i XOR 2^(t mod d)``, ``d = log2 n``.

    Pairs exchange both ways with weight 1/2 each (self 1/2), so every
    ``W(t)`` is a symmetric perfect matching: ``W(t) = I_(n/2^(k+1)) (x) J_2
    (x) I_(2^k)`` with ``k = t mod d`` and ``J_2 = 11^T / 2``.  These commute
    and their product over one period is ``J_2 (x) ... (x) J_2 = 11^T / n``:
    exact averaging after ``d`` steps.  Only defined when n is a power of two
    (a XOR partner must exist for every rank); ``ValueError`` otherwise.

    Why low bits first: node ``u`` holds ranks ``u L .. u L + L - 1`` and L
    divides the power of two n, so L is a power of two and ranks of one node
    differ only in their low ``log2 L`` bits.  Steps ``0 .. log2(L) - 1``
    therefore pair ranks inside a node and the remaining steps pair whole
    nodes rank by counterpart rank: a node link carries L buffers per
    direction on those steps and none on the others, against
    ``one-peer-exp``, whose shifts cross node boundaries at every step.  The
    schedule does not depend on L, so it is the same on every rank whatever
    layout is passed.  On powers of two it equals ``base-k`` with ``k = 1``
    (the 1-peer hyper-hypercube), which builds it as explicit rounds.
    """

    def __init__(self, world_size: int, local_world_size: int | None = None):
        n = check_world_size(world_size)
        if n & (n - 1):
            lo = 1 << (n.bit_length() - 1)
            raise ValueError(
                f"one-peer-hypercube pairs rank i with rank i XOR 2^k, so world_size must be a power of two"
                f" (1, 2, 4, 8, ...); got world_size={n} (nearest: {lo} or {2 * lo}). For {n} ranks use"
                f" base-k with k=1 (one peer per step, exact averaging for every world size) or one-peer-exp")
        super().__init__(n, local_world_size=local_world_size, name="one-peer-hypercube",
                         period=max(1, n.bit_length() - 1))

    def partner(self, rank: int, step: int) -> int:
        """The rank ``rank`` averages with at ``step`` (``rank`` itself when n = 1)."""
        return rank if self.world_size == 1 else rank ^ (1 << (step % self.period))

    def peers(self, rank, step):
        rank = self._check_rank(rank)
        j = self.partner(rank, step)
        return Peers(1.0, [], []) if j == rank else Peers(0.5, [(j, 0.5)], [j])


def torus_shape(n: int) -> tuple[int, int]:
    """Most square factorization ``n = a * b``: a = largest divisor <= sqrt(n)."""
    a = max(d for d in range(1, math.isqrt(n) + 1) if n % d == 0)
    return a, n // a


class Torus(Topology):
    """2-D torus on ``n = a * b`` (``torus_shape``), rank ``i = r * b + c``.

    Neighbours: ``(r +- 1 mod a, c)`` and ``(r, c +- 1 mod b)``.  When a
    dimension has size 1 or 2 some neighbours coincide (or equal the rank
    itself); duplicates are merged and the rank itself dropped.  Weight
    ``1 / (d + 1)`` on self and each of the ``d`` distinct neighbours, e.g.
    1/5 for a, b >= 3.  Every rank has the same ``d`` and the graph is
    symmetric, so ``W`` is symmetric and doubly stochastic.  n prime gives
    ``a = 1``, i.e. the ring.
    """

    def __init__(self, world_size: int, local_world_size: int | None = None):
        super().__init__(world_size, local_world_size=local_world_size, name="torus")
        self.shape = torus_shape(self.world_size)

    def peers(self, rank, step):
        rank = self._check_rank(rank)
        a, b = self.shape
        r, c = divmod(rank, b)
        nb = {((r + 1) % a) * b + c, ((r - 1) % a) * b + c, r * b + (c + 1) % b, r * b + (c - 1) % b}
        nb.discard(rank)
        return _uniform(sorted(nb))
