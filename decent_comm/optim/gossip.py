"""Who this rank mixes with at each step: the topology's peers, scaled by the consensus factor, and the
transport that moves the buffers. No tensor math here."""

import logging
from dataclasses import dataclass
from typing import List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist

from .. import topology as topo_mod

log = logging.getLogger("decent_comm")


@dataclass
class MixPlan:
    """Row `rank` of W'(t) = (1 - a) I + a W(t): x_rank <- self_weight * x_rank + sum_j weights[j] x_{recv[j]}."""

    step: int
    self_weight: float
    recv: List[int]
    weights: List[float]
    send: List[int]
    factor: float = 1.0  # the consensus factor a this plan was built with
    # A group step (decent_comm.optim.groups): the buffer is all-reduced over `group` and mixed as one
    # neighbour, the group's sum S, with weights == [a / len(group)]; recv and send are empty.
    group: Optional[Tuple[int, ...]] = None

    @property
    def silent(self) -> bool:
        return not self.recv and not self.send and self.group is None

    @property
    def num_buffers(self) -> int:
        """Receive buffers per bucket: one per neighbour, or the group's sum."""
        return 1 if self.group is not None else len(self.recv)


def resolve_topology(topology, world_size: int):
    """A Topology from a built-in name (or adaptive spec), a Topology, or a matrix / list of matrices. An
    ``Adaptive`` is bound to a fresh copy (its own decision history) for this optimizer."""
    if isinstance(topology, str):
        topology = topo_mod.make(topology, world_size)
    if isinstance(topology, topo_mod.Adaptive):
        # Each optimizer drives its own copy: the decisions taken are state of this training run.
        if topology.bound and topology.world_size != world_size:
            raise ValueError(f"topology {topology.name!r} is for {topology.world_size} ranks but the process group "
                             f"has {world_size}")
        return topology.bind(world_size)
    if isinstance(topology, topo_mod.Topology):
        if topology.world_size != world_size:
            raise ValueError(f"topology {topology.name!r} is for {topology.world_size} ranks but the process group "
                             f"has {world_size}")
        return topology
    if isinstance(topology, (np.ndarray, torch.Tensor, list, tuple)):
        mats = topology
        if isinstance(mats, torch.Tensor):
            mats = mats.detach().cpu().double().numpy()
        t = topo_mod.from_matrix(mats)
        if t.world_size != world_size:
            raise ValueError(f"the mixing matrix is {t.world_size}x{t.world_size} but the process group has "
                             f"{world_size} ranks")
        return t
    raise TypeError(f"topology must be a name ({', '.join(topo_mod.NAMES)}), a decent_comm.topology.Topology, or a "
                    f"matrix / list of matrices; got {type(topology).__name__}")


def consensus_factor(consensus, step: int, lr: float) -> float:
    """a(t) of DSGD-AC: a number, a callable of the step, or a schedule object with factor(step, lr)."""
    if hasattr(consensus, "factor"):
        a = consensus.factor(step, lr)
    elif callable(consensus):
        a = consensus(step)
    else:
        a = consensus
    a = float(a)
    if not 0.0 <= a <= 1.0:
        raise ValueError(f"the consensus factor must be in [0, 1], got {a} at step {step}")
    return a


def mix_plan(topology, rank: int, step: int, a: float, groups=None) -> MixPlan:
    """`groups`: a decent_comm.optim.groups.GroupAllReduce whose group steps replace point-to-point gossip."""
    if a == 0.0 or topology.world_size == 1:
        return MixPlan(step, 1.0, [], [], [], a)
    group = groups.group_of(step) if groups is not None else None
    if group is not None:
        return MixPlan(step, 1.0 - a, [], [a / len(group)], [], a, group=group)
    peers = topology.peers(rank, step)
    recv = [r for r, _ in peers.recv]
    weights = [a * w for _, w in peers.recv]
    return MixPlan(step, 1.0 - a + a * peers.self_weight, recv, weights, list(peers.send), a)


def make_exchanger(process_group, device, timeout: Optional[float], wire_dtype):
    """The native C++ scheduler when this build has it, else the Python isend/irecv one."""
    try:
        from ..exchange import Exchanger  # noqa: WPS433 (optional native component)
    except ImportError:
        Exchanger = None
    if Exchanger is not None:
        return Exchanger(process_group, device, timeout=timeout, wire_dtype=wire_dtype)
    from .p2p import PythonExchanger
    log.info("decent_comm: native exchange scheduler unavailable, using torch.distributed isend/irecv")
    return PythonExchanger(process_group, device, timeout=timeout, wire_dtype=wire_dtype)


def distributed_context(process_group):
    """(rank, world_size) of the group, or (0, 1) when torch.distributed is not initialized."""
    if not (dist.is_available() and dist.is_initialized()):
        if process_group is not None:
            raise RuntimeError("a process_group was given but torch.distributed is not initialized")
        return 0, 1
    return dist.get_rank(process_group), dist.get_world_size(process_group)
