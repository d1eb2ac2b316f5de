"""Topologies given as an explicit list of symmetric rounds, built lazily.

A ``Round`` is a set of disjoint operations on ranks:

* ``groups``: lists of ranks that average uniformly (weight ``1/|g|`` on
  each member, self included);
* ``edges``: ``(i, j, w)`` symmetric weighted edges, ``W_ij = W_ji = w``;
  a rank touched only by edges keeps ``1 - sum(w)`` of its own buffer.

Ranks in no operation keep weight 1.  Every round is symmetric, so doubly
stochastic as long as weights are non-negative.  The per-rank tables are
built on first use (so construction is O(1), which keeps ``make`` fast for
large n) and then ``peers`` is a table lookup.
"""
from __future__ import annotations

import dataclasses
from .base import Peers, Topology


@dataclasses.dataclass
class Round:
    """One step: disjoint uniform ``groups`` and weighted symmetric ``edges``."""

    groups: list = dataclasses.field(default_factory=list)
    edges: list = dataclasses.field(default_factory=list)

    def extend(self, other: "Round") -> None:
        self.groups.extend(other.groups)
        self.edges.extend(other.edges)


def round_tables(rnd: Round, n: int):
    """Per-rank ``(self_weight, recv, send)`` tuples of one ``Round``."""
    selfw = [1.0] * n
    nbrs = [[] for _ in range(n)]
    for g in rnd.groups:
        w = 1.0 / len(g)
        for i in g:
            selfw[i] = w
            nbrs[i].extend((j, w) for j in g if j != i)
    touched = set()
    for i, j, w in rnd.edges:
        nbrs[i].append((j, w))
        nbrs[j].append((i, w))
        touched.update((i, j))
    for i in touched:
        selfw[i] = 1.0 - sum(w for _, w in nbrs[i])
    table = []
    for i in range(n):
        recv = tuple(sorted(nbrs[i]))
        table.append((selfw[i], recv, tuple(j for j, _ in recv)))
    return table


class ScheduleTopology(Topology):
    """Topology from ``build_rounds() -> list[Round]`` (subclasses implement it;
    an empty list means ``W = I``, period 1).  ``period`` is the number of rounds."""

    def __init__(self, world_size: int, *, name: str, local_world_size: int | None = None,
                 options: dict | None = None):
        super().__init__(world_size, local_world_size=local_world_size, name=name)
        self._tables = None
        self.options = dict(options or {})

    def build_rounds(self) -> list:
        raise NotImplementedError

    def _schedule(self):
        if self._tables is None:
            rounds = self.build_rounds() or [Round()]
            self._tables = [round_tables(r, self.world_size) for r in rounds]
        return self._tables

    @property
    def period(self) -> int:
        return len(self._schedule())

    def peers(self, rank, step):
        rank = self._check_rank(rank)
        tables = self._schedule()
        s, recv, send = tables[step % len(tables)][rank]
        return Peers(s, list(recv), list(send))
