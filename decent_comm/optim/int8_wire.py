"""The 8-bit wire (``comm_dtype=torch.int8``): per-block absmax int8 quantization of what is sent, with
CHOCO-style error feedback (Koloskova et al., ICML 2019), so the replicas still reach consensus.

Each rank keeps public copies, float32, as optimizer state of the bucket:
- for every set S of ranks it sends to (one per step of a one-peer graph, one for a static graph), the copy
  s_S of itself that those receivers hold;
- for every neighbour j it receives from (with j's send set S_j at that step), its copy r_{j,S_j} of j.
A round sends q = Q(x - s_S): int8 values and one float32 scale (absmax / 127) per block of ops.INT8_BLOCK
elements, and both ends add deq(q) to their copy with the same float32 operations (`dequantize_add_`), so a
sender's s and its receivers' r stay bit-identical, on any mix of CPUs and GPUs. Encoding and decoding are one pass
over memory each: the fused codec kernels decent_comm.ops.int8_encode_ / int8_dequantize_add_; on the receiving
side the mix kernel itself adds the payloads to the copies it reads (the ops' ``copies=``/``payloads=``), so a
received round costs no pass of its own. The mix uses the copies in difference form,

    x_i <- x_i + sum_j w_ij r_j - (sum_j w_ij) s_i            (MixPlan.as_correction; AWC: inside the update)

which moves the mean of the replicas exactly as the full-precision mix (W doubly stochastic). As the copies
track the parameters (each round's quantization error is left in x - s and sent again at the next round), it
is the full-precision mix up to the quantization error of the last delta: at most |x - s|_max / 254 per element
of a block whose |x - s|_max is at least 3.73e-37 and whose copies stay finite (decent_comm.ops.int8_encode_ says
what happens outside). The first round sends x itself (the copies start at zero).

Bytes on the wire: numel (padded to a block) + 4 per block, about 0.25x fp32 and 0.5x bf16. Memory: one float32
copy of the bucket per send set and per (neighbour, send set): ring 3, one-peer-exp and one-peer-hypercube
2 log2(n) (`copies_per_rank`), allocated at construction for a static topology (`Int8Wire.allocate_copies`).
Group (all-reduce) steps do not apply: the int8 wire gossips point to point.
"""

from typing import Dict, List, Set

import torch

from .. import ops
from ..topology import Topology
from .plan import MixInputs

#: opt.state keys of the public copies start with this
PREFIX = "int8_wire"


def payload_nbytes(numel: int, block: int = ops.INT8_BLOCK) -> int:
    return ops.int8_payload_nbytes(numel, block)


@torch.no_grad()
def encode_(x: torch.Tensor, copy: torch.Tensor, payload: torch.Tensor, block: int = ops.INT8_BLOCK) -> None:
    """payload <- Q(x - copy), then copy += deq(payload) (the receivers' copy of x after this round): one pass of
    the fused codec kernel (decent_comm.ops.int8_encode_)."""
    ops.int8_encode_(x, copy, payload, block)


@torch.no_grad()
def dequantize_add_(copy: torch.Tensor, payload: torch.Tensor, block: int = ops.INT8_BLOCK) -> None:
    """copy += deq(payload): the one definition both ends of an edge run (decent_comm.ops.int8_dequantize_add_,
    the same IEEE operations on every CPU and GPU), so their copies stay identical."""
    ops.int8_dequantize_add_(copy, payload, block)


def check_bucket_sizes(buckets) -> None:
    """Refuses, with a ValueError saying what to do, a bucket the fused mix cannot take the payloads of: more than
    ops.MAX_PAYLOAD_ELEMENTS (2^31 - 1) elements, the kernels' 32-bit payload index. Called on the layout, before any
    buffer is allocated (buckets.build_buckets' check), at any world size as startup.check_options (a script that
    works on one rank must not fail on the first multi-rank run). Else the refusal came at the first mix, after the
    copies were allocated, saying to split a bucket even when it is one parameter."""
    limit = ops.MAX_PAYLOAD_ELEMENTS
    for b in buckets:
        if b.numel <= limit:
            continue
        wire = f"the 8-bit wire (comm_dtype=torch.int8) takes buckets of at most {limit} elements (the mix kernels " \
               "index its payloads in 32 bits)"
        # each slot's extent in the bucket (its parameter, aligned to 16 bytes): one beyond the limit fills a bucket
        ends = [s.offset for s in b.slots[1:]] + [b.numel]
        span, big = max(((end - s.offset, s) for end, s in zip(ends, b.slots)), key=lambda t: t[0])
        if span > limit:
            raise ValueError(
                f"a parameter of shape {big.shape} ({b.dtype}) in param group {b.group_index} has {big.numel} "
                f"elements{f' ({span} aligned in its bucket)' if span != big.numel else ''}, but {wire}, and a "
                "bucket holds a parameter whole: a parameter that large cannot use the 8-bit wire; use another "
                "comm_dtype (torch.bfloat16 sends half of float32's bytes) or split the parameter")
        raise ValueError(
            f"bucket {b.index} (param group {b.group_index}, {len(b.slots)} parameters of {b.dtype}) holds {b.numel} "
            f"elements, but {wire}: use a bucket_cap_mb below {(limit + 1) * b.dtype.itemsize / 2**20:g}, or "
            "another comm_dtype")


def _key(ranks) -> str:
    return "_".join(str(r) for r in ranks)


def _own_name(send) -> str:
    """The state name of this rank's copy of itself held by the receivers `send`."""
    return f"{PREFIX}_to_{_key(send)}"


def _peer_name(j: int, send_of_j) -> str:
    """The state name of this rank's copy of neighbour j, which j sends to `send_of_j` at that step."""
    return f"{PREFIX}_from_{j}_to_{_key(send_of_j)}"


def copy_names(topology: Topology, rank: int) -> Set[str]:
    """The state names of every public copy `rank` keeps for a (static) topology, over its period (at most 4096
    steps)."""
    names = set()
    for t in range(min(topology.period, 4096)):
        peers = topology.peers(rank, t)
        if peers.send:
            names.add(_own_name(peers.send))
        names.update(_peer_name(j, topology.peers(j, t).send) for j, _ in peers.recv)
    return names


def copies_per_rank(topology: Topology, rank: int) -> int:
    """Float32 copies of the parameters the int8 wire keeps on `rank` for a (static) topology, over its period."""
    return len(copy_names(topology, rank))


class Int8Wire:
    """The public copies and payloads of every bucket (see the module doc). `plan`s are MixPlans of p2p steps."""

    def __init__(self, topology: Topology, rank: int, block: int = ops.INT8_BLOCK):
        self.topology, self.rank, self.block = topology, rank, block
        self._payload: Dict[int, torch.Tensor] = {}   # bucket -> its send buffer (reused for every exchange)
        self._undecoded: Set[int] = set()            # buckets whose last exchange's payloads are not added yet
        self._names_of = (None, [])                  # _peer_names' last (topology step, neighbours) and its names

    def payload_buffer(self, b) -> torch.Tensor:
        return torch.empty(payload_nbytes(b.numel, self.block), dtype=torch.uint8, device=b.device)

    def allocate_copies(self, buckets) -> None:
        """Every copy of a static topology's period in every bucket, zero (as on first use), at construction: opt.state
        then names them from the start, so torch.distributed.checkpoint, which loads only the state names the
        destination optimizer has, brings them back into a new optimizer, and the resume is exact."""
        names = sorted(copy_names(self.topology, self.rank))
        for b in buckets:
            for name in names:
                b.state_buffer(name)

    def _peer_names(self, plan) -> List[str]:
        # Every bucket of a round asks with the same plan: the names of the last one are kept (one topology.peers
        # call per neighbour and round, not per bucket).
        key = (plan.topo_step, tuple(plan.recv))
        if self._names_of[0] != key:
            self._names_of = (key, [_peer_name(j, self.topology.peers(j, plan.topo_step).send) for j in plan.recv])
        return self._names_of[1]

    def encode(self, b, plan) -> torch.Tensor:
        """The payload of bucket b for `plan` (its copy for the plan's receivers advances)."""
        payload = self._payload.get(b.index)
        if payload is None:
            payload = self._payload[b.index] = self.payload_buffer(b)
        encode_(b.flat, self.own_copy(b, plan), payload, self.block)
        self._undecoded.add(b.index)
        return payload

    def own_copy(self, b, plan) -> torch.Tensor:
        """Bucket b's copy of itself that the receivers of `plan` hold (what encode(b, plan) advanced)."""
        return b.state_buffer(_own_name(plan.send))

    def inputs(self, b, plan, payloads: List[torch.Tensor], fuse: bool) -> MixInputs:
        """What the mix of bucket b for `plan` reads (plan.as_correction's order): the neighbours' copies, then this
        rank's own copy. The payloads of the last exchange launched are added to the copies once: by the mix kernel
        that reads them when `fuse` (returned as MixInputs.copies with their payloads), else here, now."""
        copies = [b.state_buffer(n) for n in self._peer_names(plan)]
        own = self.own_copy(b, plan)
        if b.index not in self._undecoded:
            return MixInputs(copies + [own])
        self._undecoded.discard(b.index)
        if fuse:
            return MixInputs([own], copies, list(payloads), self.block)
        for copy, payload in zip(copies, payloads):
            dequantize_add_(copy, payload, self.block)
        return MixInputs(copies + [own])

    def forget(self):
        """A checkpoint was loaded: nothing in flight is decoded any more (the round in flight was added to the
        copies before the load, GossipSchedule.complete_wire_round; the load then replaced, restarted or kept them)."""
        self._undecoded.clear()
        self._names_of = (None, [])

    @staticmethod
    def state_names(buckets) -> List[str]:
        return sorted({name for b in buckets for name in b.state if name.startswith(PREFIX)})
