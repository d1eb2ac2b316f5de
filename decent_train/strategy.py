"""How the replicas are kept in agreement: the optimizer factory that builds either the DDP all-reduce baseline
(a torch optimizer plus DDP's gradient all-reduce) or a decent_comm optimizer gossiping parameters, behind the
one interface the training loop talks to."""

import contextlib

import torch
import torch.distributed as dist

import decent_comm

from .distributed import DistEnv
from .flags import FUSED, hyperparameters, refuse_decentralized_only, torch_class, torch_hyperparameters


class Strategy:
    """How the replicas are kept in agreement: the torch optimizer plus DDP gradient all-reduce, or a
    decent_comm optimizer gossiping parameters. The loop talks only to this interface."""

    def __init__(self, optimizer, forward_module, decentralized: bool):
        self.optimizer = optimizer
        self.forward_module = forward_module   # what training calls (the DDP wrapper for all-reduce)
        self.decentralized = decentralized
        self.bytes_before = 0  # bytes this rank sent in the runs a resumed job continues (its checkpoint's)
        self.consensus = None  # the AdaptiveConsensus given to the optimizer (--consensus adaptive), if any

    def eval_context(self):
        """Evaluation sees the exact global average of the replicas (a collective for decentralized runs;
        DDP replicas are identical already)."""
        return self.optimizer.global_average() if self.decentralized else contextlib.nullcontext()

    def drain(self):
        """Completes the communication in flight (decentralized), so that a stopwatch stopped now charges it to
        training: evaluation would otherwise complete it off the clock (a collective)."""
        if self.decentralized:
            self.optimizer.synchronize()

    def consensus_distance(self) -> float:
        return self.optimizer.consensus_distance() if self.decentralized else 0.0

    @property
    def bytes_sent(self) -> int:
        """Bytes this rank has gossiped over the whole job, the runs before a resume included."""
        return self.bytes_before + (self.optimizer.bytes_sent if self.decentralized else 0)

    def comm_metrics(self, env) -> dict:
        """Gossip traffic so far (MB sent per rank, mean over ranks: a collective), the topology in use and rank 0's
        last disagreement with its neighbours; empty for all-reduce."""
        if not self.decentralized:
            return {}
        sent = torch.tensor([float(self.bytes_sent)], dtype=torch.float64, device=env.device)
        if env.distributed:
            dist.all_reduce(sent)
        topo = self.optimizer.topology
        out = {"bytes_sent_mb": float(sent[0]) / env.world_size / 2**20,
               "topology": getattr(topo, "current_name", topo.name),
               "disagreement": self.optimizer.last_disagreement if self.optimizer.track_disagreement else None}
        last = getattr(getattr(topo, "policy", None), "last", None)
        if last is not None:  # ConsensusControl: q = Xi^2 / Gamma^2 at its last decision
            out["adapt_q"] = last[0]
        return out

    def clip_grad_(self, model: torch.nn.Module, max_norm: float):
        if self.decentralized:  # the fused optimizers keep gradients in flat buckets: clip those directly
            self.optimizer.clip_grad_norm_(max_norm)
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)

    def shutdown(self):
        if self.decentralized:
            self.optimizer.shutdown()
        else:  # DDP's Reducer holds the process group: let go of it, so close_distributed() really destroys it
            self.forward_module = None


def torch_optimizer(cls, params, args):
    """cls(params, lr, ...) with the hyper-parameters from the flags that cls accepts (flags.torch_hyperparameters)."""
    return cls(params, **{k: getattr(args, k) for k in torch_hyperparameters(cls)})


def _consensus(args):
    if args.consensus == "adaptive":
        # Start adapting after warmup (AdaptiveConsensus's reference is the peak lr from start_step on, so the
        # factor would be 1 through the warmup anyway; starting there keeps full averaging explicit).
        return decent_comm.AdaptiveConsensus(start_step=args.warmup)
    return args.consensus


def _wire_dtype(args):
    if getattr(args, "int8_wire", False):
        return torch.int8
    return torch.bfloat16 if args.bf16_wire else None


def build_strategy(args, model: torch.nn.Module, env: DistEnv) -> Strategy:
    name = args.optimizer
    if name.startswith("allreduce"):
        # refused, not ignored: a comparison of recipes must not think they took effect
        refuse_decentralized_only(args, ("gossip_every", "warmup_steps", "delayed_mix", "int8_wire"))
        cls = torch_class(name)
        forward = model
        if env.distributed:
            forward = torch.nn.parallel.DistributedDataParallel(
                model, device_ids=[env.device.index] if env.device.type == "cuda" else None)
            if args.bf16_wire:
                from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
                forward.register_comm_hook(None, default_hooks.bf16_compress_hook)
        return Strategy(torch_optimizer(cls, model.parameters(), args), forward, decentralized=False)

    # Ranks per node: --local-world-size (emulated nodes), else torchrun's LOCAL_WORLD_SIZE (env.local_world_size).
    local = args.local_world_size if args.local_world_size is not None else env.local_world_size
    topology = decent_comm.topology.make(args.topology, env.world_size, local_world_size=local)
    consensus = _consensus(args)
    options = dict(topology=topology, mode=args.mode, consensus=consensus, model=model,
                   comm_dtype=_wire_dtype(args), gossip_every=args.gossip_every,
                   warmup_steps=args.warmup_steps, delayed_mix=args.delayed_mix,
                   timeout=getattr(args, "timeout", None))  # None: the process group's (init_distributed sets it)
    if name in FUSED:
        cls = getattr(decent_comm, FUSED[name][0])
        kw = {**{k: getattr(args, k) for k in hyperparameters(name)}, **options}
        if name.startswith("accum"):
            kw["accum_steps"] = args.accum_steps
        opt = cls(model.parameters(), **kw)
    else:
        inner = torch_optimizer(torch_class(name), model.parameters(), args)
        opt = decent_comm.Decentralized(inner, **options)
    strategy = Strategy(opt, model, decentralized=True)
    strategy.consensus = consensus if isinstance(consensus, decent_comm.AdaptiveConsensus) else None
    return strategy
