"""What an optimizer resolves once, at construction: its process group's (rank, world size), the topology
(from a name, a Topology or matrices, with ranks-per-node read here from torchrun's environment), and the
start-up checks that every rank holds the same replica and configuration."""

import os

import numpy as np
import torch
import torch.distributed as dist

from .. import topology as topo_mod


def distributed_context(process_group):
    """(rank, world_size) of the group, or (0, 1) when torch.distributed is not initialized."""
    if not (dist.is_available() and dist.is_initialized()):
        if process_group is not None:
            raise RuntimeError("a process_group was given but torch.distributed is not initialized")
        return 0, 1
    return dist.get_rank(process_group), dist.get_world_size(process_group)


def local_world_size_from_env(world_size: int):
    """Ranks per node from torchrun's LOCAL_WORLD_SIZE, else None (one node). The one place the optimizers
    read the environment; the topology layer takes the value as an argument (and says when it does not
    divide `world_size`)."""
    env = os.environ.get("LOCAL_WORLD_SIZE")
    if not env:
        return None
    try:
        value = int(env)
    except ValueError:
        raise ValueError(f"LOCAL_WORLD_SIZE={env!r} (environment) is not an integer") from None
    return value


def resolve_topology(topology, world_size: int):
    """A Topology from a built-in name (or adaptive spec), a Topology, or a matrix / list of matrices. An
    ``Adaptive`` is bound to a fresh copy (its own decision history) for this optimizer."""
    if isinstance(topology, str):
        topology = topo_mod.make(topology, world_size, local_world_size_from_env(world_size))
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


def verify_replicas(buckets, topology, mode, optimizer_name, process_group, world_size):
    """Every rank must hold the same parameter shapes/dtypes and topology; report who differs."""
    mine = dict(
        params=[(tuple(s.param.shape), str(s.param.dtype)) for b in buckets for s in b.slots],
        fingerprint=topology.fingerprint(), mode=mode, optimizer=optimizer_name,
    )
    everyone = [None] * world_size
    dist.all_gather_object(everyone, mine, group=process_group)
    ref = everyone[0]
    for r, other in enumerate(everyone):
        if other == ref:
            continue
        if len(other["params"]) != len(ref["params"]):
            what = f"{len(other['params'])} parameters but rank 0 has {len(ref['params'])}"
        elif other["params"] != ref["params"]:
            i = next(i for i, (a, b) in enumerate(zip(other["params"], ref["params"])) if a != b)
            what = f"parameter {i} is {other['params'][i]} but on rank 0 it is {ref['params'][i]}"
        elif other["fingerprint"] != ref["fingerprint"]:
            what = f"topology fingerprint {other['fingerprint']} differs from rank 0's {ref['fingerprint']}"
        else:
            what = f"optimizer/mode {other['optimizer']}/{other['mode']} differs from rank 0's " \
                   f"{ref['optimizer']}/{ref['mode']}"
        raise RuntimeError(f"decent_comm: replicas disagree: rank {r}: {what}")


@torch.no_grad()
def broadcast_from_rank0(buckets, process_group):
    src = dist.get_global_rank(process_group, 0) if process_group is not None else 0
    for b in buckets:
        dist.broadcast(b.flat, src=src, group=process_group)
