"""Gossip steps that are uniform averaging within groups, run as one all-reduce per group.

When W(t) splits the ranks into groups and every member of a group takes exactly 1/|G| of every member
(``decent_comm.topology.averaging_groups``: ``complete``, intra-node averaging, ``aer`` with inter="pair",
``ring`` on 3 ranks, ...), point-to-point gossip makes each rank receive |G| - 1 whole buffers. An
all-reduce of the group moves 2 (|G| - 1) / |G| buffers per rank and, inside a node pair, about two buffers
per NIC whatever the number of ranks per node: the seed library (Decent-DP) runs every gossip step that way.

The mix is unchanged: x <- (1 - a) x + (a / |G|) * S with S the all-reduced sum of the group's buffers,
which is row `rank` of (1 - a) I + a W(t). Groups of two ranks stay point to point (same bytes, and the
exchanger's overlap and timeouts).
"""

import datetime
import logging
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from ..topology import Adaptive, Topology, averaging_groups
from ..topology.analysis import MIN_ALLREDUCE_GROUP

log = logging.getLogger("decent_comm")

EXCHANGES = ("auto", "p2p")
MIN_GROUP = MIN_ALLREDUCE_GROUP
MAX_SCAN = 1 << 16       # period * world_size beyond which the schedule is not scanned for groups


def scan_groups(topology: Topology, world_size: int) -> Dict[int, List[Tuple[int, ...]]]:
    """step in the period -> the step's averaging groups of >= MIN_GROUP ranks (steps without any: absent)."""
    table = {}
    for t in range(topology.period):
        groups = averaging_groups(topology, t)
        if groups:
            big = [g for g in groups if len(g) >= MIN_GROUP]
            if big:
                table[t] = big
    return table


class GroupAllReduce:
    """This rank's side of the group steps of a (static-schedule) topology: which group it averages in at a
    step, and the asynchronous all-reduces of its buckets' buffers in that group's process group."""

    def __init__(self, topology: Topology, tables, process_group, rank: int, timeout: Optional[float]):
        """`tables`: per candidate of an ``Adaptive`` topology (one table for any other), step in the period ->
        groups (``scan_groups``); the process groups of all candidates are created up front."""
        self.topology = topology
        self.rank = rank
        self.timeout = None if timeout is None else datetime.timedelta(seconds=float(timeout))
        self._mine: List[Dict[int, Tuple[int, ...]]] = [{} for _ in tables]
        self._pgs: Dict[Tuple[int, ...], object] = {}
        to_global = (lambda r: r) if process_group is None else (lambda r: dist.get_global_rank(process_group, r))
        backend = dist.get_backend(process_group)
        # dist.new_group is collective over the default group: every rank creates every group, in one order.
        for g in sorted({g for tb in tables for groups in tb.values() for g in groups}):
            pg = dist.new_group([to_global(r) for r in g], backend=backend)
            if rank in g:
                self._pgs[g] = pg
        for mine, tb in zip(self._mine, tables):
            for t, groups in tb.items():
                for g in groups:
                    if rank in g:
                        mine[t] = g
        self._work: Dict[int, Tuple[object, Tuple[int, ...]]] = {}
        self.bytes_sent = 0

    @classmethod
    def build(cls, topology, process_group, rank: int, world_size: int, timeout, exchange: str):
        """A GroupAllReduce when `exchange` allows it and the schedule has group steps, else None."""
        if exchange not in EXCHANGES:
            raise ValueError(f"exchange must be one of {EXCHANGES}, got {exchange!r}")
        if exchange == "p2p" or world_size < MIN_GROUP:
            return None
        # An Adaptive topology: each candidate is scanned; group_of follows the candidate decided for the step.
        parts = topology.candidates if isinstance(topology, Adaptive) else [topology]
        if any(p.period * world_size > MAX_SCAN for p in parts):
            log.info("decent_comm: schedule too long to scan for averaging groups; gossip stays point to point")
            return None
        if process_group is not None and dist.get_world_size(process_group) != dist.get_world_size():
            # new_group would need every rank of the default group, which a sub-group's ranks cannot promise.
            log.info("decent_comm: group all-reduce needs the default process group; gossip stays point to point")
            return None
        tables = [scan_groups(p, world_size) for p in parts]
        if not any(tables):
            return None
        return cls(topology, tables, process_group, rank, timeout)

    def group_of(self, step: int) -> Optional[Tuple[int, ...]]:
        """The group this rank averages in at `step`, or None when the step is point to point."""
        if isinstance(self.topology, Adaptive):
            i = self.topology.index_at(step)
            return self._mine[i].get(step % self.topology.candidates[i].period)
        return self._mine[0].get(step % self.topology.period)

    def start(self, bucket: int, buf: torch.Tensor, group: Tuple[int, ...]):
        """Launches the in-place sum of `buf` over `group` (every member issues its buckets in one order)."""
        if bucket in self._work:
            raise RuntimeError(f"decent_comm: bucket {bucket} already has a group all-reduce in flight")
        self._work[bucket] = (dist.all_reduce(buf, group=self._pgs[group], async_op=True), group)
        self.bytes_sent += 2 * (len(group) - 1) * buf.numel() * buf.element_size() // len(group)

    def wait(self, bucket: int):
        """Blocks until the bucket's sum is in its buffer; a no-op when that already happened (wait_all)."""
        if bucket not in self._work:
            return
        work, group = self._work.pop(bucket)
        try:
            ok = work.wait() if self.timeout is None else work.wait(timeout=self.timeout)
        except Exception as e:  # gloo / NCCL raise RuntimeError subclasses (DistBackendError, ...)
            raise RuntimeError(f"decent_comm: the all-reduce of bucket {bucket} among ranks {list(group)} failed "
                               f"(a peer died, is too slow, or runs a different schedule): {e}") from e
        if ok is False:
            raise RuntimeError(f"decent_comm: the all-reduce of bucket {bucket} among ranks {list(group)} did not "
                               f"complete within {self.timeout}")

    def wait_all(self):
        for bucket in list(self._work):
            self.wait(bucket)
