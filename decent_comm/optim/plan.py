"""Who this rank mixes with at each step, as data: the topology's row of the step, scaled by the consensus
factor, and whether the step runs as an all-reduce within averaging groups; and the buffers a mix of one bucket
reads (MixInputs). No tensor math, no communication.
"""

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from .. import ops
from .._args import integer
from ..topology import Adaptive, Topology, averaging_groups
from ..topology.analysis import MIN_ALLREDUCE_GROUP
from ..topology.consensus import check_consensus_factor

EXCHANGES = ("auto", "p2p")
MAX_SCAN = 1 << 16       # period * world_size beyond which a schedule is not scanned for averaging groups


@dataclass
class MixPlan:
    """Row `rank` of W'(t) = (1 - a) I + a W(t): x_rank <- self_weight * x_rank + sum_j weights[j] x_{recv[j]}."""

    step: int
    self_weight: float
    recv: List[int]
    weights: List[float]
    send: List[int]
    factor: float = 1.0  # the consensus factor a this plan was built with
    # A group step: the buffer is all-reduced over `group` and mixed as one neighbour, the group's sum S, with
    # weights == [a / len(group)]; recv and send are empty.
    group: Optional[Tuple[int, ...]] = None

    # A correction, self_weight 1 (delayed_mix, see Cadence.delayed_mix; the int8 and lossy wires' mixes too): "sent":
    # the last buffer mixed is this rank's own copy z of what it sent, with the weight -(1 - self_weight) of the plan
    # launched: x <- x + sum_j w_j (y_j - z);
    # "checkpoint": the one buffer mixed is that sum as a checkpoint saved it (weight 1).
    correction: Optional[str] = None
    topo_step: Optional[int] = None  # the topology's step it mixes with (the gossip round)

    def as_correction(self, step: int) -> "MixPlan":
        """This plan applied at optimizer step `step` to parameters that moved on since its exchange was launched:
        x <- x + sum_j w_j y_j - (1 - self_weight) z = z' + (x - z), z' this plan's mix of the copies z sent.
        Also the int8 wire's mix, with y and z the public copies (decent_comm.optim.int8_wire)."""
        return MixPlan(step, 1.0, self.recv, self.weights + [-(1.0 - self.self_weight)], self.send, self.factor,
                       self.group, correction="sent", topo_step=self.topo_step)

    @property
    def silent(self) -> bool:
        return not self.recv and not self.send and self.group is None

    @property
    def mixes(self) -> bool:
        """Whether applying the plan changes x (a neighbour, a checkpoint's correction, or a self weight other than
        1): False on a warm-up or local step."""
        return bool(self.recv) or bool(self.weights) or self.group is not None or self.self_weight != 1.0

    @property
    def num_buffers(self) -> int:
        """Receive buffers per bucket: one per neighbour, or the group's sum."""
        return 1 if self.group is not None else len(self.recv)


@dataclass
class MixInputs:
    """The buffers one mix of a bucket reads, in the order of its plan's weights: `copies` first, then `neighbors`.
    With the 8-bit wire, `copies` are the neighbours' public copies, each still to be advanced by the payload in
    `payloads` that arrived for it: the fused ops do that in the pass that mixes (decent_comm.ops, ``copies=``), once.
    Without copies it is a plain list of neighbour buffers."""

    neighbors: List = field(default_factory=list)
    copies: List = field(default_factory=list)
    payloads: List = field(default_factory=list)
    block: int = ops.INT8_BLOCK

    def __bool__(self) -> bool:
        return bool(self.neighbors or self.copies)

    def at(self, sl: slice = slice(0, None)):
        """(neighbours, op keyword arguments) of the elements `sl` of the bucket (a slice with a step of 1)."""
        nbs = [y[sl] for y in self.neighbors]
        if not self.copies:
            return nbs, {}
        return nbs, dict(copies=[c[sl] for c in self.copies], payloads=self.payloads, payload_offset=sl.start or 0,
                         payload_block=self.block)


@dataclass(frozen=True)
class Cadence:
    """When the optimizer communicates, as torch's PostLocalSGDOptimizer / PeriodicModelAverager and Bagua's
    communication interval: the first `warmup_steps` steps all-reduce the gradients (DDP's update: the replicas
    stay identical), then every `gossip_every`-th step gossips and the steps between are local. Gossip round r
    (the r-th gossiping step) uses the topology's step r, so a time-varying graph keeps cycling through its
    peers whatever the interval.

    With `delayed_mix` the exchange of round r is launched at the end of round r's step, from a copy z of the
    parameters, and mixed in at round r + 1 as a correction, x <- x + sum_j w_j (z_j - z): the mix of the copies
    plus the local progress since. The transfer then overlaps all `gossip_every` steps of the interval instead of
    one forward and backward (Overlap Local-SGD, Wang et al. 2020; CO2, Sun et al. 2024), at the cost of mixing
    parameters one interval old and one more buffer per bucket (z)."""

    gossip_every: int = 1
    warmup_steps: int = 0
    delayed_mix: bool = False

    def __post_init__(self):
        for name, low in (("gossip_every", 1), ("warmup_steps", 0)):  # np.int64 taken, as a Python int
            object.__setattr__(self, name, integer(getattr(self, name), name, low=low))
        if not isinstance(self.delayed_mix, bool):
            raise ValueError(f"delayed_mix must be True or False, got {self.delayed_mix!r}")

    def in_warmup(self, step: int) -> bool:
        return step < self.warmup_steps

    def round_of(self, step: int) -> Optional[int]:
        """The gossip round of optimizer step `step`, or None for a warm-up or local step."""
        if step < self.warmup_steps or (step - self.warmup_steps) % self.gossip_every:
            return None
        return (step - self.warmup_steps) // self.gossip_every


def consensus_factor(consensus, step: int, lr: float) -> float:
    """a(t) of DSGD-AC: a number, a callable of the step, or a schedule object with factor(step, lr)."""
    if hasattr(consensus, "factor"):
        a = consensus.factor(step, lr)
    elif callable(consensus):
        a = consensus(step)
    else:
        a = consensus
    return check_consensus_factor(a, f" at step {step}")


def scan_groups(topology: Topology) -> Dict[int, List[Tuple[int, ...]]]:
    """step in the period -> the step's averaging groups of >= MIN_ALLREDUCE_GROUP ranks (steps without: absent)."""
    table = {}
    for t in range(topology.period):
        groups = averaging_groups(topology, t)
        big = [g for g in groups or [] if len(g) >= MIN_ALLREDUCE_GROUP]
        if big:
            table[t] = big
    return table


class GroupSteps:
    """The steps of a schedule that run as one all-reduce per averaging group (uniform averaging within groups
    of >= 3 ranks: complete, intra-node averaging, aer with inter="pair", ...), which moves 2 (|G| - 1) / |G|
    buffers per rank instead of |G| - 1. Groups of two ranks stay point to point (same bytes). For an
    ``Adaptive`` topology each candidate is scanned and the candidate decided for a step applies."""

    def __init__(self, topology: Topology, rank: int, tables: List[Dict[int, List[Tuple[int, ...]]]]):
        self.topology = topology
        self.tables = tables
        self._mine = [{t: g for t, groups in tb.items() for g in groups if rank in g} for tb in tables]

    @classmethod
    def scan(cls, topology: Topology, rank: int, world_size: int, exchange: str) -> Optional["GroupSteps"]:
        """The group steps when `exchange` allows them and the schedule has any, else None."""
        if exchange not in EXCHANGES:
            raise ValueError(f"exchange must be one of {EXCHANGES}, got {exchange!r}")
        if exchange == "p2p" or world_size < MIN_ALLREDUCE_GROUP:
            return None
        parts = topology.candidates if isinstance(topology, Adaptive) else [topology]
        if any(p.period * world_size > MAX_SCAN for p in parts):
            return None
        tables = [scan_groups(p) for p in parts]
        return cls(topology, rank, tables) if any(tables) else None

    @property
    def all_groups(self) -> List[Tuple[int, ...]]:
        """Every group of every step (and candidate), sorted: what the exchange must set up on every rank."""
        return sorted({g for tb in self.tables for groups in tb.values() for g in groups})

    def group_of(self, step: int) -> Optional[Tuple[int, ...]]:
        """The group this rank averages in at `step`, or None when the step is point to point."""
        if isinstance(self.topology, Adaptive):
            i = self.topology.index_at(step)
            return self._mine[i].get(step % self.topology.candidates[i].period)
        return self._mine[0].get(step % self.topology.period)

    def buffers_per_rank(self, candidate: int, world_size: int, group_width: float = 1.0) -> float:
        """Buffers moved per rank and step by candidate `candidate` (mean over ranks and up to 64 steps of its
        period): 2 (|G| - 1) / |G| on a group step, one per send peer otherwise. `group_width`: a group step's
        bytes per element over a point-to-point step's (its sums run in the buckets' dtype, wire_buffers.py)."""
        topo = self.topology.candidates[candidate] if isinstance(self.topology, Adaptive) else self.topology
        table = self.tables[candidate]
        steps = range(min(topo.period, 64))
        total = 0.0
        for t in steps:
            size = {r: len(g) for g in table.get(t, []) for r in g}
            total += sum(group_width * 2 * (size[r] - 1) / size[r] if r in size else len(topo.peers(r, t).send)
                         for r in range(world_size))
        return total / (world_size * len(steps))


def mix_plan(topology: Topology, rank: int, step: int, a: float, groups: Optional[GroupSteps] = None,
             topo_step: Optional[int] = None) -> MixPlan:
    """The plan of optimizer step `step`, which mixes with the topology's step `topo_step` (default: `step`;
    the gossip round under a Cadence)."""
    topo_step = step if topo_step is None else topo_step
    if a == 0.0 or topology.world_size == 1:
        return MixPlan(step, 1.0, [], [], [], a, topo_step=topo_step)
    group = groups.group_of(topo_step) if groups is not None else None
    if group is not None:
        # The same mix with W the group's average, written with the group's sum S (this rank's buffer in it): self
        # weight 1 - a, S weighted a / |G| (not Peers.mixed's a * (1 / |G|), which may round otherwise).
        return MixPlan(step, 1.0 - a, [], [a / len(group)], [], a, group=group, topo_step=topo_step)
    peers = topology.peers(rank, topo_step).mixed(a)
    return MixPlan(step, peers.self_weight, [r for r, _ in peers.recv], [w for _, w in peers.recv], peers.send, a,
                   topo_step=topo_step)


def check_mix_width(topology: Topology, rank: int, world_size: int, groups: Optional[GroupSteps], extra: int,
                    limit: int) -> None:
    """Refuses a schedule whose mix would read more than `limit` buffers in one call of the fused kernels
    (ops.MAX_NEIGHBORS): a rank's in-neighbours of a point-to-point step plus `extra` (1: the own copy that the
    mix of the 8-bit wire, of a bf16/fp16 wire below the parameters' dtype and of delayed_mix reads too); a group
    step reads one sum. At construction, with what to do,
    instead of at the first step. Every rank's row is checked, so all ranks refuse together, unless the schedule is
    too long to scan (period * world_size > MAX_SCAN): then this rank's own."""
    if world_size - 1 + extra <= limit:
        return
    parts = topology.candidates if isinstance(topology, Adaptive) else [topology]
    for i, topo in enumerate(parts):
        table = groups.tables[i] if groups is not None else {}
        ranks = range(world_size) if topo.period * world_size <= MAX_SCAN else [rank]
        for t in range(topo.period):
            grouped = {r for g in table.get(t, ()) for r in g}
            for r in ranks:
                width = (1 if r in grouped else len(topo.peers(r, t).recv)) + extra
                if width > limit:
                    raise ValueError(
                        f"topology {topo.name!r}: rank {r} mixes {width - extra} neighbours at step {t}"
                        f"{' and its own copy' if extra else ''}, but one mix reads at most {limit} buffers: "
                        "use a sparser topology, or exchange='auto' where the step averages in groups (complete runs "
                        f"as one all-reduce; the 8-bit wire is point to point only, and groups are looked for only in "
                        f"schedules of period x world size <= {MAX_SCAN})")
