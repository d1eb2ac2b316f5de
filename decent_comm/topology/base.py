"""``Topology`` (a periodic gossip schedule) and ``Peers`` (one rank's view of a step).

A topology over ``n = world_size`` ranks is a sequence of mixing matrices
``W(0), W(1), ...`` with ``W(t + period) = W(t)``.  At step ``t`` every rank
``i`` computes ``x_i <- sum_j W(t)_ij x_j``: it keeps ``self_weight = W_ii`` of
its own buffer, receives the buffers of the ranks ``j != i`` with
``W_ij > 0`` (``Peers.recv``) and sends its buffer to every rank ``k`` with
``W_ki > 0`` (``Peers.send``).

A subclass implements either ``peers(rank, step)`` (cheap, used on the hot
path) or ``matrix(step)`` (dense); the base class derives the other one:
``matrix`` from ``peers`` by filling the rows, ``peers`` from ``matrix`` by
reading row ``i`` (recv) and column ``i`` (send), cached once per step of the
period.  Implementing both is allowed; ``validate()`` then checks they agree.
"""
from __future__ import annotations

import dataclasses
import hashlib

import numpy as np

from .._args import integer
from .connectivity import check_averages
from .validation import (TOL, check_matrix, check_peers_step, check_world_size, drop_roundoff,
                         resolve_local_world_size)


@dataclasses.dataclass(frozen=True)
class Peers:
    """What one rank does at one step.

    ``self_weight``: ``W_ii``.  ``recv``: ``[(j, W_ij), ...]`` for ``j != i``
    with ``W_ij > 0``, sorted by ``j``.  ``send``: sorted ranks ``k != i``
    with ``W_ki > 0`` (the ranks that need this rank's buffer).  Every listed
    rank is a message: ``validate()`` accepts a weight of 0 or round-off below it
    (``validation.TOL``) but does not drop its message.
    """

    self_weight: float
    recv: list
    send: list

    @property
    def degree(self) -> int:
        """``max(len(recv), len(send))``: peers this rank talks to in one direction."""
        return max(len(self.recv), len(self.send))

    def mixed(self, a: float) -> "Peers":
        """This row of ``W`` as a row of the consensus mix ``(1 - a) I + a W`` (``a`` in [0, 1]; the one place
        that formula is written: ``ConsensusTopology`` and the optimizer's plans use it): self weight
        ``(1 - a) + a W_ii``, neighbour weights ``a W_ij``, the same senders.  ``a = 0`` lists no peers: no
        communication at all, not neighbours of weight 0."""
        if a == 0.0:
            return Peers(1.0, [], [])
        return Peers((1.0 - a) + a * self.self_weight, [(j, a * w) for j, w in self.recv], list(self.send))


class Topology:
    """A periodic gossip schedule.  See the module docstring.

    ``period=None`` keeps the class attribute ``period`` (default 1).

    Attributes: ``world_size`` (n), ``local_world_size`` (ranks per node;
    rank ``r`` lives on node ``r // local_world_size``; ``None`` = one node:
    only the argument counts, the environment is never read), ``period`` (the
    schedule repeats after ``period`` steps; 1 if static), ``name`` (str),
    ``allow_biased`` (skip the column-stochastic check), ``allow_disconnected``
    (accept a schedule whose replicas never agree, e.g. no communication at
    all; see ``connectivity.check_averages``).

    Subclasses that do not call ``Topology.__init__`` (or set ``world_size``
    as a class attribute) only need the attributes ``world_size`` and
    ``period`` (default 1); the others then default to
    ``local_world_size = world_size``, ``name`` = class name.
    """

    period = 1
    allow_biased = False
    allow_disconnected = False

    def __init__(self, world_size: int | None = None, *, period: int | None = None,
                 local_world_size: int | None = None, name: str | None = None, allow_biased: bool = False,
                 allow_disconnected: bool = False):
        if world_size is None:  # a subclass that sets world_size as a class attribute
            world_size = getattr(type(self), "world_size", None)
            if world_size is None:
                raise ValueError("world_size must be >= 1, got None")
        self.world_size = check_world_size(world_size)
        if local_world_size is None and isinstance(getattr(type(self), "local_world_size"), int):
            local_world_size = type(self).local_world_size  # a class attribute of the subclass
        self.local_world_size = resolve_local_world_size(self.world_size, local_world_size)
        if period is not None:
            if isinstance(period, bool) or not isinstance(period, (int, np.integer)) or period < 1:
                raise ValueError(f"period must be an integer >= 1, got {period!r}")
            self.period = int(period)
        if name is not None:
            self.name = name
        self.allow_biased = bool(allow_biased)
        self.allow_disconnected = bool(allow_disconnected)

    # -- attributes with defaults that survive a subclass skipping __init__ --
    @property
    def name(self) -> str:
        return self.__dict__.get("_name") or type(self).__name__

    @name.setter
    def name(self, value: str) -> None:
        self.__dict__["_name"] = str(value)

    @property
    def local_world_size(self) -> int:
        return self.__dict__.get("_local_world_size") or self.world_size

    @local_world_size.setter
    def local_world_size(self, value: int) -> None:
        self.__dict__["_local_world_size"] = int(value)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(name={self.name!r}, world_size={self.world_size},"
                f" local_world_size={self.local_world_size}, period={self.period})")

    # -- the schedule ---------------------------------------------------------
    def _overrides(self, method: str) -> bool:
        return getattr(type(self), method) is not getattr(Topology, method)

    def _check_rank(self, rank: int) -> int:
        """`rank` as a Python int in [0, world_size), else ValueError. Use the result: a tensor or np.int64 rank
        passed the check but came back in the neighbour ranks computed from it; 0.5 gave fractional ones."""
        rank = integer(rank, "rank")
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} out of range for world_size {self.world_size}")
        return rank

    def peers(self, rank: int, step: int) -> Peers:
        """``Peers`` of ``rank`` at ``step`` (any integer; taken modulo ``period``).

        Default: derived from ``matrix(step)``, computed once per step of the
        period and cached, so each call is O(degree).
        """
        if not self._overrides("matrix"):
            raise NotImplementedError(f"{type(self).__name__} must implement peers() or matrix()")
        rank = self._check_rank(rank)
        s, recv, send = self._derived_peers(step % self.period)[rank]
        return Peers(s, list(recv), list(send))

    def _derived_peers(self, t: int):
        cache = self.__dict__.setdefault("_peers_cache", {})
        table = cache.get(t)
        if table is None:
            n = self.world_size
            W = drop_roundoff(np.array(self.matrix(t), dtype=np.float64))
            if W.shape != (n, n):
                raise ValueError(f"step {t}: matrix() must return a {n} x {n} array, got shape {W.shape}")
            off = W.copy()
            np.fill_diagonal(off, 0.0)
            nz = off != 0
            table = []
            for i in range(n):
                r = np.flatnonzero(nz[i])
                table.append((float(W[i, i]), tuple(zip(r.tolist(), off[i, r].tolist())),
                              tuple(np.flatnonzero(nz[:, i]).tolist())))
            cache[t] = table
        return table

    def matrix(self, step: int) -> np.ndarray:
        """Dense ``n x n`` float64 mixing matrix ``W(step)`` (row i: how rank i combines).

        Default: assembled from ``peers(i, step)`` for every rank, O(n * degree).
        """
        if not self._overrides("peers"):
            raise NotImplementedError(f"{type(self).__name__} must implement peers() or matrix()")
        n = self.world_size
        W = np.zeros((n, n))
        for i in range(n):
            p = self.peers(i, step)
            W[i, i] = p.self_weight
            for j, w in p.recv:
                W[i, j] = w
        return W

    # -- checks ---------------------------------------------------------------
    def validate(self) -> "Topology":
        """Check every step of the period; raise ``ValueError`` naming step and row/ranks.

        For a ``peers``-defined topology: ``recv``/``send`` well formed,
        ``j in recv(i) <=> i in send(j)``, rows (and, unless ``allow_biased``,
        columns) summing to 1, non-negative weights.  For a
        ``matrix``-defined one: ``check_matrix`` on each ``W(t)``.  When both
        are implemented, also that they agree.  Then, unless
        ``allow_disconnected``, that the schedule averages
        (``connectivity.check_averages``).  Cost O(period * n * degree) (plus
        O(period * n^2) for matrices, and O(period * n^3) for a schedule with
        a zero self weight on at most ``DENSE_CHECK_MAX_WORLD_SIZE`` ranks).
        Returns ``self``.
        """
        n = check_world_size(self.world_size)
        period = self.period
        if isinstance(period, bool) or not isinstance(period, (int, np.integer)) or period < 1:
            raise ValueError(f"period must be an integer >= 1, got {period!r}")
        has_peers, has_matrix = self._overrides("peers"), self._overrides("matrix")
        if not (has_peers or has_matrix):
            raise NotImplementedError(f"{type(self).__name__} must implement peers() or matrix()")
        for t in range(period):
            if has_matrix:
                check_matrix(self.matrix(t), n, step=t, allow_biased=self.allow_biased)
            if has_peers:
                check_peers_step(self, t)
            if has_peers and has_matrix:
                diff = np.abs(self.matrix(t) - Topology.matrix.__get__(self)(t))
                if diff.max() > TOL:
                    i, j = np.unravel_index(np.argmax(diff), diff.shape)
                    raise ValueError(f"step {t}, row {i}: peers() and matrix() disagree at W[{i},{j}]")
        check_averages(self)
        return self

    def fingerprint(self) -> str:
        """16 hex chars of sha256 over (name, world_size, period) and the
        schedule: for every step of the period and every rank its
        ``self_weight``, ``recv`` and ``send`` (weights rounded to 12
        decimals).  Equivalent to hashing the matrices, but O(period * n *
        degree) so it stays cheap for large n.  All ranks must agree on it.
        ``local_world_size`` counts only through the schedule it shapes, so
        the ranks of a job on nodes of different sizes (torchrun's
        ``LOCAL_WORLD_SIZE`` differs) agree on a ring, which ignores it.
        """
        h = hashlib.sha256()
        h.update(repr((self.name, self.world_size, self.period)).encode())
        for chunk in self._schedule_digest_items():
            h.update(chunk)
        return h.hexdigest()[:16]

    def _schedule_digest_items(self):
        n = self.world_size
        for t in range(self.period):
            selfw, nrecv, recv, weights, nsend, send = [], [], [], [], [], []
            for i in range(n):
                p = self.peers(i, t)
                selfw.append(p.self_weight)
                nrecv.append(len(p.recv))
                for j, w in p.recv:
                    recv.append(j)
                    weights.append(w)
                nsend.append(len(p.send))
                send.extend(p.send)
            yield f"step {t};".encode()
            for ints in (nrecv, recv, nsend, send):
                yield np.asarray(ints, dtype=np.int64).tobytes() + b";"
            for floats in (selfw, weights):
                yield np.round(np.asarray(floats, dtype=np.float64), 12).tobytes() + b";"

    def mixed(self, a: float) -> "Topology":
        """``W' = (1 - a) I + a W`` (consensus factor ``a`` in [0, 1]); see ``with_consensus``."""
        from .consensus import with_consensus
        return with_consensus(self, a)
