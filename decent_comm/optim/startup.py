"""What an optimizer resolves once, at construction: its process group's (rank, world size), the topology
(from a name, a Topology or matrices, with ranks-per-node read here from torchrun's environment), and the
start-up checks that every rank holds the same replica and configuration."""

import contextlib
import itertools
import logging
import os
import pickle
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from .. import topology as topo_mod
from ..exchange import (ExchangeError, ExchangeTimeout, check_process_group, in_global_ranks, ranks_text, swap,
                        timeout_s, timeout_seconds, wait_for_ranks)
from .plan import consensus_factor
from .shared_memory import labelled_params

log = logging.getLogger(__name__)


def distributed_context(process_group):
    """(rank, world_size) of the group, or (0, 1) when torch.distributed is not initialized (RuntimeError then
    inside a launcher's job of several processes: each rank trained alone, silently). A `process_group` that is no
    ProcessGroup is refused first (check_process_group), untold: this rank has no group to meet its peers on."""
    check_process_group(process_group)
    if not (dist.is_available() and dist.is_initialized()):
        if process_group is not None:
            raise RuntimeError("a process_group was given but torch.distributed is not initialized")
        world = os.environ.get("WORLD_SIZE", "1").strip()
        if world.isdigit() and int(world) > 1:
            raise RuntimeError(f"torch.distributed is not initialized, but WORLD_SIZE={world} (a torchrun job of "
                               f"{world} processes): call torch.distributed.init_process_group() before building the "
                               "optimizer, or each rank trains alone (set WORLD_SIZE=1 for a single process)")
        return 0, 1
    return dist.get_rank(process_group), dist.get_world_size(process_group)


def usable_timeout(timeout):
    """`timeout` when it is a valid option value, else None (the process group's own): the meeting of a rank that
    refuses its options (verify_replicas) must still be bounded by something."""
    try:
        check_options(timeout=timeout, comm_dtype=None)
    except ValueError:
        return None
    return timeout


#: the wire dtypes the mix kernels read (float8 ones they do not)
COMM_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int8)


def check_options(*, timeout, comm_dtype, model=None, consensus=1.0, flags=()):
    """Options that are only used once there are peers, checked at any world size (a script that works on one
    rank must not fail on the first multi-rank run). `flags`: (name, value) of the on/off options, which must be
    True or False: "no" or "False" from a config file would be truthy."""
    for name, value in flags:
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be True or False, got {value!r}")
    if not hasattr(consensus, "factor"):  # a number, or a callable's step 0 (a schedule object is not called here:
        consensus_factor(consensus, 0, 0.0)  # it records the lr of its first call, and a scheduler may change it yet)
    if model is not None and not isinstance(model, torch.nn.Module):
        raise ValueError(f"model must be the torch.nn.Module whose forward uses the parameters (or None), got "
                         f"{type(model).__name__}")
    timeout_seconds(timeout)
    if comm_dtype is not None and comm_dtype not in COMM_DTYPES:
        raise ValueError(f"comm_dtype must be None, torch.float32, torch.float64, torch.bfloat16, torch.float16 or "
                         f"torch.int8 (the 8-bit wire with error feedback), got {comm_dtype!r}")


def check_materialized(param_groups, world_size: int) -> None:
    """At world size > 1, refuses parameters on the meta device and parameters on several devices (one process trains
    them as torch does)."""
    if world_size > 1:
        _refuse_meta(param_groups, world_size)
        _refuse_several_devices(param_groups)


def _refuse_several_devices(param_groups) -> None:
    """The exchange, its all-reduces and the warm-up run on one device (the first bucket's): a bucket on another
    (a CPU-offloaded embedding beside a body on cuda:k, a model split over two GPUs) was accepted, and the first step
    failed on every rank with "send is on <device> but this exchanger moves <device> buffers", naming no parameter."""
    first = {}
    for label, p in labelled_params(param_groups):
        first.setdefault(p.device, label)
    if len(first) > 1:
        listed = ", ".join(f"{device} (parameter {label} first)" for device, label in first.items())
        raise ValueError(f"the parameters are on {len(first)} devices: {listed}; a decentralized optimizer exchanges "
                         "the buffers of one device: build one optimizer per device (the CPU one over a gloo group, "
                         "process_group=dist.new_group(backend='gloo'), where the default group is NCCL)")


def _refuse_meta(param_groups, world_size: int) -> None:
    """Parameters on the meta device have no values to exchange (the exchange failed with "process group has no
    backend for meta tensors", naming neither)."""
    meta = [f"parameter {label} (shape {tuple(p.shape)})" for label, p in labelled_params(param_groups)
            if p.device.type == "meta"]
    if meta:
        named = ", ".join(meta[:4]) + (f" and {len(meta) - 4} more" if len(meta) > 4 else "")
        raise ValueError(f"{named} {'is' if len(meta) == 1 else 'are'} on the meta device (no memory, no values), "
                         f"which a decentralized optimizer at world size {world_size} cannot exchange: materialize the "
                         "model first (model.to_empty(device=...), then initialize it, e.g. each module's "
                         "reset_parameters(), or load its weights) before building the optimizer at world size > 1")


def local_world_size_from_env(process_group=None):
    """Ranks per node of the group's ranks, from torchrun's LOCAL_WORLD_SIZE, else None (one node). The topology
    layer takes the value as an argument (the optimizers read the environment here and in distributed_context).

    torchrun puts global rank r on node r // LOCAL_WORLD_SIZE. The group's ranks lie on those nodes in runs: equal
    runs of consecutive group ranks, one per node, give the group's ranks per node; any other layout (a subgroup of
    3 ranks of 2 nodes of 2, a last node with fewer ranks) counts every rank as its own node, so each link is taken
    for a node link."""
    env = os.environ.get("LOCAL_WORLD_SIZE")
    if not env or not (dist.is_available() and dist.is_initialized()):
        return None  # one process (distributed_context): a LOCAL_WORLD_SIZE inherited from a launcher is not its own
    try:
        value = int(env)
    except ValueError:
        raise ValueError(f"LOCAL_WORLD_SIZE={env!r} (environment) is not an integer") from None
    if value < 1:
        return value
    members = dist.get_process_group_ranks(process_group or dist.group.WORLD)
    nodes = [r // value for r in members]
    runs = [len(list(run)) for _, run in itertools.groupby(nodes)]
    if len(set(runs)) == 1 and len(runs) == len(set(nodes)):
        return runs[0]
    log.info("decent_comm: the process group's ranks (global ranks %s) lie on nodes %s of LOCAL_WORLD_SIZE=%d ranks "
             "in no regular layout: every rank counts as its own node", members, nodes, value)
    return 1


def resolve_topology(topology, world_size: int, process_group=None):
    """A Topology from a built-in name (or adaptive spec), a Topology, or a matrix / list of matrices. An
    ``Adaptive`` is bound to a fresh copy (its own decision history) for this optimizer. A Topology built by the
    caller is validated here (make and from_matrix validate theirs): a schedule that is not doubly stochastic would
    move the replicas' mean, silently."""
    if isinstance(topology, str):
        topology = topo_mod.make(topology, world_size, local_world_size_from_env(process_group))
    if isinstance(topology, topo_mod.Adaptive):
        # Each optimizer drives its own copy: the decisions taken are state of this training run.
        if topology.bound and topology.world_size != world_size:
            raise ValueError(f"topology {topology.name!r} is for {topology.world_size} ranks but the process group "
                             f"has {world_size}")
        return topology.bind(world_size, local_world_size_from_env(process_group))
    if isinstance(topology, topo_mod.Topology):
        if topology.world_size != world_size:
            raise ValueError(f"topology {topology.name!r} is for {topology.world_size} ranks but the process group "
                             f"has {world_size}")
        return topology.validate()
    if isinstance(topology, (np.ndarray, torch.Tensor, list, tuple)):
        mats = topology
        if isinstance(mats, torch.Tensor):  # float32 stays float32, for from_matrix's message on its rounding
            mats = mats.detach().cpu()
            mats = mats.numpy() if mats.dtype in (torch.float32, torch.float64) else mats.double().numpy()
        t = topo_mod.from_matrix(mats)
        if t.world_size != world_size:
            raise ValueError(f"the mixing matrix is {t.world_size}x{t.world_size} but the process group has "
                             f"{world_size} ranks")
        return t
    raise TypeError(f"topology must be a name ({', '.join(topo_mod.NAMES)}), a decent_comm.topology.Topology, or a "
                    f"matrix / list of matrices; got {type(topology).__name__}")


def _plain(value):
    """A picklable, comparable stand-in for a configuration value."""
    if torch.is_tensor(value):
        return value.tolist()
    if isinstance(value, (int, float, str, bool, type(None))):
        return value
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, torch.dtype):
        return str(value)
    if callable(value) and not hasattr(value, "factor"):
        return f"callable {getattr(value, '__qualname__', type(value).__name__)}"  # behaviour cannot be compared
    return repr(value)


#: the steps at which a consensus callable's values are compared across the ranks
_CONSENSUS_COMPARED_AT = (*range(16), 100, 1_000, 10_000, 100_000, 1_000_000)


def _sampled(consensus, t: int) -> str:
    """consensus(t) in words, for the comparison only: a schedule valid for the run's length may fail beyond it (a
    table lookup, (1 - t / T) ** 0.5), which is the same on every rank, so a failure is a value like any other."""
    try:
        return repr(float(consensus(t)))
    except Exception as exc:  # noqa: BLE001 - compared, not raised: the step() that reaches t raises it
        return f"raises {type(exc).__name__}"


def replica_config(buckets, topology, param_groups, model=None, **options) -> dict:
    """Everything every rank must agree on, in the order a mismatch is reported: what shapes the bytes on the
    wire (parameters, bucket layout, wire dtype, exchange), and what changes the math (optimizer and its
    hyper-parameters, mode, topology, consensus). `options`: name -> value of the optimizer's other settings.
    With `model`, each parameter's name too: parameters of equal shapes passed in another order on one rank (a
    list built from a set of names, whose order follows the per-process hash seed) would otherwise be averaged
    with other parameters' replicas, silently."""
    names = {id(p): n for n, p in model.named_parameters()} if model is not None else {}
    config = {"parameter": [((names.get(id(s.param)),) if model is not None else ()) + (tuple(s.param.shape),
                                                                                       str(s.param.dtype))
                            + ((f"strides {s.stride}",) if s.stride is not None else ())  # the flat layout
                            for b in buckets for s in b.slots]}
    config.update({name: _plain(value) for name, value in options.items()})
    consensus = options.get("consensus")
    if callable(consensus) and not hasattr(consensus, "factor"):
        # a function's behaviour is compared where it can be: its values at the steps of a run's start and beyond
        config["consensus"] = [config["consensus"], [_sampled(consensus, t) for t in _CONSENSUS_COMPARED_AT]]
    config["topology fingerprint"] = topology.fingerprint()
    # not "decentralized": where a schedule stands (per rank), left in a group dict reused from another optimizer
    config["param group"] = [_plain({k: v for k, v in g.items() if k not in ("params", "decentralized")})
                             for g in param_groups]
    config["bucket"] = [(b.numel, str(b.dtype), b.device.type) for b in buckets]  # follows from the above
    return config


# the config of a rank that refused its options: the reason
_REFUSED = "refused"


def _difference(name, mine, ref) -> str:
    if name == "consensus" and _is_sampled(mine) and _is_sampled(ref):
        t = next((t for t, a, b in zip(_CONSENSUS_COMPARED_AT, mine[1], ref[1]) if a != b), None)
        if t is not None:
            return (f"consensus factor at step {t} is {mine[1][_CONSENSUS_COMPARED_AT.index(t)]} ({mine[0]}) but on "
                    f"rank 0 it is {ref[1][_CONSENSUS_COMPARED_AT.index(t)]} ({ref[0]})")
        return f"consensus is a {mine[0]} but on rank 0 a {ref[0]}"
    if isinstance(mine, list) and isinstance(ref, list):
        if len(mine) != len(ref):
            return f"{len(mine)} {name}s but rank 0 has {len(ref)}"
        i = next(i for i, (a, b) in enumerate(zip(mine, ref)) if a != b)
        if isinstance(mine[i], dict) and isinstance(ref[i], dict):
            key = next(k for k in sorted(set(mine[i]) | set(ref[i])) if mine[i].get(k) != ref[i].get(k))
            return f"{name} {i} has {key}={mine[i].get(key)!r} but on rank 0 {key}={ref[i].get(key)!r}"
        return f"{name} {i} is {mine[i]} but on rank 0 it is {ref[i]}"
    if name == "topology fingerprint":
        return (f"topology fingerprint {mine} differs from rank 0's {ref} (another topology or options, or a node "
                "layout it depends on: torchrun's LOCAL_WORLD_SIZE differs between the ranks)")
    return f"{name} is {mine!r} but on rank 0 it is {ref!r}"


def _is_sampled(value) -> bool:
    """A consensus callable as replica_config compares it: [its name, its values at _CONSENSUS_COMPARED_AT]."""
    return isinstance(value, list) and len(value) == 2 and isinstance(value[1], list)


def verify_replicas(config: Optional[dict], process_group, world_size: int, timeout=None,
                    refusal: Optional[Exception] = None):
    """Every rank gathers every rank's `config` (replica_config) and raises the same error naming the first
    rank and the first option that differ from rank 0, so no rank goes on to exchange mismatched buffers.
    A rank that refused its own options (`refusal`, which it raises itself afterwards) sends that instead, and every
    other rank raises a ValueError naming it and its reason, as soon as all have met.
    The first meeting of a construction: the ranks meet within `timeout` (seconds; None: the group's own), else
    every rank raises ExchangeTimeout naming the ranks that did not come (exchange.arrival). The configs travel
    through the default group's store, not a gloo collective: gloo's worker thread drops its references to a
    collective's tensors just after the caller's wait returns, and in a script that ends right after a refused
    construction that could fall into interpreter finalization, where taking the GIL kills the process
    ("terminate called without an active exception", seen in the fault matrix's options cell)."""
    seconds = timeout_seconds(timeout)
    base = wait_for_ranks(process_group, seconds, "building the optimizer")
    if world_size == 1:
        return
    # every rank has arrived and puts its config next (one that dies in between is named after the wait)
    seconds = timeout_s(process_group, seconds)
    mine = config if refusal is None else {_REFUSED: f"{type(refusal).__name__}: {refusal}"}
    try:
        sides, missing = swap(f"{base}/config", dist.get_rank(process_group), range(world_size), pickle.dumps(mine),
                              seconds)
    except dist.DistError as exc:  # the store failed (its server gone, or no longer answering: store_calls)
        raise ExchangeError(f"decent_comm: building the optimizer: the store of the default process group failed "
                            f"while the ranks exchanged their configurations: {exc}") from exc
    if missing:
        raise in_global_ranks(ExchangeTimeout(f"decent_comm: building the optimizer: {ranks_text(missing)} arrived but "
                                              f"did not send its configuration within {seconds:g} s"), process_group)
    if refusal is not None:
        return
    everyone = [pickle.loads(sides[r]) for r in range(world_size)]
    refused = [r for r, c in enumerate(everyone) if _REFUSED in c]
    if refused:
        raise in_global_ranks(ValueError(
            f"decent_comm: {ranks_text(refused)} refused to build the optimizer (rank {refused[0]}: "
            f"{everyone[refused[0]][_REFUSED]}); every rank must build it with the same valid options"), process_group)
    ref = everyone[0]
    for r, other in enumerate(everyone):
        for name, value in other.items():
            if value != ref.get(name):
                raise in_global_ranks(RuntimeError(
                    f"decent_comm: replicas disagree: rank {r}: {_difference(name, value, ref.get(name))} (every rank "
                    "must build the optimizer with the same parameters and options)"), process_group)


@contextlib.contextmanager
def refusal_told(options: dict):
    """Around what an optimizer's constructor checks before the ranks compare their configurations (torch's own
    argument checks, torch.optim.Optimizer.__init__'s, then decent_comm's options: _init_decentralized): a refusal
    there is told to the other ranks at the meeting they wait in (verify_replicas), so that every rank raises at once,
    naming this one, instead of waiting for it until the timeout or meeting its next attempt, pairing their first
    construction with its second (review BQ). `options`: the constructor's decentralized keyword arguments
    (process_group, timeout), as given."""
    try:
        yield
    except Exception as exc:
        group, timeout = options.get("process_group"), options.get("timeout")
        try:
            _, world_size = distributed_context(group)
            if world_size > 1:
                verify_replicas(None, group, world_size, usable_timeout(timeout), refusal=exc)
        except Exception:  # noqa: BLE001 - no group to tell, or the others' verdict: this rank's own refusal is raised
            pass
        raise
