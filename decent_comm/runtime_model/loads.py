"""Which bytes go over which links at each step of a gossip schedule: ``schedule_of``.

Same model as ``decent_comm.topology.comm_cost``: at step ``t`` every rank ``i`` receives one buffer
from each ``j`` with ``W_ij > 0`` (a message ``j -> i``); it is inter-node when ``j // L != i // L``.
``comm_cost`` gives per-rank maxima; the runtime model also needs **per-node** inter-node traffic (a
node's ranks share its NIC), so ``StepLinks`` aggregates the messages per node and per rank.  Counts
are in messages; a message carries ``bytes_per_rank`` bytes.

``schedule_of(topology)`` (cached on the topology) holds one ``StepTable`` per step of the period:
its ``messages`` (``messages.step_builder``), its averaging ``groups`` when the step is uniform
averaging over groups, and its ``links``.  A step whose groups are known without its messages
(``complete``: n(n-1) messages, one group) gets its link counts in closed form from the groups::

    member r of group g (size s, c of its ranks on r's node):  intra sends = intra receives = c - 1
    node u:  egress = ingress = sum over its members of (s - c)
"""
from __future__ import annotations

import dataclasses
import functools

import numpy as np

from ..topology.analysis import uniform_groups
from .messages import known_groups, step_builder


@dataclasses.dataclass(frozen=True)
class StepLinks:
    """Messages of one step of the period (``step``) and their load per link.

    * ``node_egress`` / ``node_ingress``: inter-node messages leaving / entering each node (length N).
    * ``rank_intra_send`` / ``rank_intra_recv``: intra-node messages sent / received by each rank (length n).
    * ``messages``: how many; ``inter_messages``: how many cross nodes; ``max_indegree``: most buffers
      one rank receives.
    * ``src``, ``dst`` (sorted by ``dst``), ``inter`` (crosses nodes): one entry per message, or ``None``
      when the counts came from the step's groups.
    """

    step: int
    node_egress: np.ndarray
    node_ingress: np.ndarray
    rank_intra_send: np.ndarray
    rank_intra_recv: np.ndarray
    messages: int
    inter_messages: int
    max_indegree: int
    src: np.ndarray | None = None
    dst: np.ndarray | None = None
    inter: np.ndarray | None = None

    @property
    def shared(self) -> int:
        """Most transfers one resource carries (a NIC direction or a rank's intra-node receive port)."""
        return int(max(self.node_egress.max(initial=0), self.node_ingress.max(initial=0),
                       self.rank_intra_recv.max(initial=0)))


def links_from_messages(step: int, src, dst, n: int, L: int) -> StepLinks:
    """``StepLinks`` of the messages ``src -> dst`` (sorted by ``dst``) on ``n / L`` nodes of ``L`` ranks."""
    N = n // L
    inter = (src // L) != (dst // L)
    return StepLinks(
        step=step, node_egress=np.bincount(src[inter] // L, minlength=N),
        node_ingress=np.bincount(dst[inter] // L, minlength=N),
        rank_intra_send=np.bincount(src[~inter], minlength=n),
        rank_intra_recv=np.bincount(dst[~inter], minlength=n),
        messages=int(src.size), inter_messages=int(inter.sum()),
        max_indegree=int(np.bincount(dst, minlength=n).max()) if dst.size else 0,
        src=src, dst=dst, inter=inter)


def links_from_groups(step: int, members, sizes, n: int, L: int) -> StepLinks:
    """``StepLinks`` of uniform averaging over the groups (closed form in the module docstring)."""
    N = n // L
    gid = np.repeat(np.arange(sizes.size), sizes)
    node = members // L
    _, inv, count = np.unique(gid * N + node, return_inverse=True, return_counts=True)
    c = count[inv.ravel()]                       # per member: its group's ranks on its node
    s = sizes[gid]
    egress = np.bincount(node, weights=s - c, minlength=N).astype(np.int64)
    intra = np.zeros(n, dtype=np.int64)
    intra[members] = c - 1
    return StepLinks(step=step, node_egress=egress, node_ingress=egress.copy(), rank_intra_send=intra,
                     rank_intra_recv=intra.copy(), messages=int(np.sum(sizes * (sizes - 1))),
                     inter_messages=int(egress.sum()), max_indegree=int(sizes.max(initial=1)) - 1)


class StepTable:
    """One step of a schedule: ``messages``, ``groups`` and ``links``, each built on first use."""

    def __init__(self, topology, step: int, build):
        self.topology, self.step, self._build = topology, step, build
        self.n, self.L = topology.world_size, topology.local_world_size

    @functools.cached_property
    def messages(self):
        """``messages.Messages`` (raises ``messages.TooManyMessages`` for a dense step on many ranks)."""
        return self._build(self.step)

    @functools.cached_property
    def known_groups(self):
        """``messages.known_groups``: the groups when known without the messages, else ``None``."""
        return known_groups(self.topology, self.step)

    @functools.cached_property
    def groups(self):
        """``(members, sizes)`` when the step is uniform averaging over disjoint groups (singletons
        included, as ``decent_comm.topology.averaging_groups``), else ``None``."""
        if self.known_groups is not None:
            return self.known_groups
        m = self.messages
        groups = uniform_groups(m.self_weight, m.src, m.dst, m.weight)
        if groups is None:
            return None
        sizes = np.array([len(g) for g in groups], dtype=np.int64)
        return np.fromiter((r for g in groups for r in g), dtype=np.int64, count=self.n), sizes

    @functools.cached_property
    def links(self) -> StepLinks:
        """Link counts: from the known groups (closed form) when there are some, else ``message_links``."""
        if self.known_groups is not None:
            return links_from_groups(self.step, *self.groups, self.n, self.L)
        return self.message_links

    @functools.cached_property
    def message_links(self) -> StepLinks:
        """``StepLinks`` with the message arrays (what point-to-point steps need)."""
        m = self.messages
        return links_from_messages(self.step, m.src, m.dst, self.n, self.L)


class Schedule:
    """``period`` and one ``StepTable`` per step of it (``steps``)."""

    def __init__(self, topology):
        self.period, build = step_builder(topology)
        self.steps = [StepTable(topology, t, build) for t in range(self.period)]


def schedule_of(topology) -> Schedule:
    """The ``Schedule`` of ``topology``, cached on the topology object."""
    cache = topology.__dict__.get("_runtime_model_schedule")
    if cache is None:
        cache = topology.__dict__["_runtime_model_schedule"] = Schedule(topology)
    return cache


def schedule_links(topology) -> list:
    """``StepLinks`` of every step of ``topology``'s period."""
    return [t.links for t in schedule_of(topology).steps]
