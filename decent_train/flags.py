"""Command-line flags every training script takes (the script adds its model and data flags), and the defaults
that depend on the optimizer family, the world size or other flags."""

import argparse
import inspect
from typing import Dict

import torch

import decent_comm

# name -> (decent_comm class, optimizer family). The family picks the default lr, betas and weight decay (see
# resolve_defaults). AccumAdam has its own: its second moment is built from the mean gradient of each accumulation
# window, which has less noise than one step's gradient, and its betas act once per window.
FUSED = {"dsgd": ("DSGD", "sgd"), "dadam": ("DAdam", "adam"), "dadamw": ("DAdamW", "adam"),
         "accumadam": ("AccumAdam", "accum"), "accumadamw": ("AccumAdamW", "accum")}
TORCH_OPTIMIZERS = {name.lower(): cls for name, cls in vars(torch.optim).items()
                    if inspect.isclass(cls) and issubclass(cls, torch.optim.Optimizer) and cls is not torch.optim.Optimizer}
# The runs whose lr and betas default to the all-reduce AdamW values translated by decentralized_adam_hparams
# (AccumAdam(W), family "accum", too).
DECENTRALIZED_ADAM = ("dadam", "dadamw", "decentralized-adam", "decentralized-adamw")
ADAM_BETAS = (0.9, 0.999)


def optimizer_name(value: str) -> str:
    """argparse type: allreduce[-<torch optimizer>], a fused decent_comm optimizer, or decentralized-<torch optimizer>."""
    v = value.strip().lower()
    if v in FUSED or v == "allreduce":
        return v
    for prefix in ("allreduce-", "decentralized-"):
        if v.startswith(prefix) and v[len(prefix):] in TORCH_OPTIMIZERS:
            return v
    raise argparse.ArgumentTypeError(
        f"unknown optimizer {value!r}: use allreduce, allreduce-<torch optimizer>, {', '.join(FUSED)}, or "
        f"decentralized-<torch optimizer> (torch optimizers: {', '.join(sorted(TORCH_OPTIMIZERS))})")


def topology_name(value: str) -> str:
    """argparse type: a built-in topology name (canonical form), or an adaptive spec (checked when the topology is
    built for the world size)."""
    if value.strip().lower().startswith("adaptive:"):
        return value
    try:
        return decent_comm.topology.canonical_name(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def consensus_value(value: str):
    """argparse type: a float in [0, 1] or 'adaptive' (decent_comm.AdaptiveConsensus)."""
    if value.strip().lower() == "adaptive":
        return "adaptive"
    try:
        a = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--consensus must be a number in [0, 1] or 'adaptive', got {value!r}")
    if not 0.0 <= a <= 1.0:
        raise argparse.ArgumentTypeError(f"--consensus must be in [0, 1], got {a}")
    return a


def count(least: int):
    """argparse type: an integer >= least, named in the error (--steps 0 ran nothing and reported success; a negative
    --gossip-every reached the optimizer's own check as a traceback on every rank)."""
    def parse(value: str) -> int:
        try:
            n = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {value!r}") from None
        if n < least:
            raise argparse.ArgumentTypeError(f"must be at least {least}, got {n}")
        return n
    return parse


def number(least: float = 0.0, strictly: bool = False):
    """argparse type: a float >= least (> least when strictly), NaN refused."""
    def parse(value: str) -> float:
        try:
            x = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {value!r}") from None
        if not (x > least if strictly else x >= least):  # NaN fails both
            raise argparse.ArgumentTypeError(f"must be {'>' if strictly else '>='} {least:g}, got {value}")
        return x
    return parse


def add_common_args(parser: argparse.ArgumentParser, *, steps: int, batch_size: int, eval_every: int):
    """The flags every example takes; the example adds its model and data flags."""
    g = parser.add_argument_group("optimization")
    g.add_argument("--optimizer", type=optimizer_name, default="dadamw",
                   help="allreduce (torch DDP + AdamW; allreduce-sgd etc. for another torch optimizer), "
                        f"{', '.join(FUSED)} (fused decent_comm optimizers), or decentralized-<torch optimizer> "
                        "(decent_comm.Decentralized wrapping e.g. torch.optim.AdamW)")
    g.add_argument("--topology", type=topology_name, default="one-peer-exp",
                   help=f"gossip topology: {', '.join(decent_comm.topology.NAMES)}, or an adaptive spec: "
                        "adaptive:consensus:one-peer-exp,exp,complete[:kappa=1,interval=10] or "
                        "adaptive:phase:complete@0,one-peer-exp@100 (decent_comm.topology.adaptive)")
    g.add_argument("--mode", choices=decent_comm.optim.MODES, default="awc",
                   help="awc: communicate while adapting (exchange overlaps forward+backward; fastest when the network "
                        "is the bottleneck); atc: adapt then combine (exchange overlaps the forward; better loss at "
                        "equal steps, docs/quality_results.md)")
    g.add_argument("--local-world-size", type=count(1), default=None,
                   help="ranks per node for hierarchical topologies (aer); default: LOCAL_WORLD_SIZE from torchrun. "
                        "Smaller than --nproc_per_node emulates several nodes on one machine")
    g.add_argument("--consensus", type=consensus_value, default=1.0,
                   help="consensus factor a in W -> (1-a) I + a W, or 'adaptive' (a follows the lr schedule after warmup)")
    g.add_argument("--gossip-every", type=count(1), default=1,
                   help="decentralized: gossip every k-th step, local steps between (gossip_every; with --topology "
                        "complete: periodic averaging, one all-reduce of the parameters every k-th step)")
    g.add_argument("--warmup-steps", type=count(0), default=0,
                   help="decentralized: all-reduce the gradients for the first N steps (DDP's update), then gossip "
                        "(warmup_steps; not the lr warmup, which is --warmup)")
    g.add_argument("--delayed-mix", action="store_true",
                   help="decentralized, awc: each gossip round's exchange overlaps the whole interval and is mixed in "
                        "at the next round as a correction (delayed_mix)")
    wire = g.add_mutually_exclusive_group()
    wire.add_argument("--bf16-wire", action="store_true",
                      help="send parameters (decentralized) or gradients (allreduce, DDP bf16 compress hook) as "
                           "bfloat16")
    wire.add_argument("--int8-wire", action="store_true",
                      help="decentralized: the 8-bit wire with error feedback (comm_dtype=torch.int8)")
    g.add_argument("--steps", type=count(1), default=steps, help="optimizer steps in total (a resumed run continues to this)")
    g.add_argument("--lr", type=number(), default=None,
                   help="peak learning rate (default: the example's all-reduce lr for the optimizer family; "
                        "decentralized Adam-family runs scale it by sqrt(n), AccumAdam by sqrt(n / K): "
                        "decent_comm.decentralized_adam_hparams)")
    g.add_argument("--lr-schedule", choices=("constant", "cosine", "warmup-cosine"), default="warmup-cosine",
                   help="learning-rate schedule over --steps")
    g.add_argument("--warmup", type=count(0), default=None, help="warmup steps of warmup-cosine (default: 30%% of --steps)")
    g.add_argument("--min-lr-ratio", type=number(), default=0.1, help="cosine schedules decay to this fraction of --lr")
    g.add_argument("--weight-decay", type=number(), default=None, help="weight decay (default: 0 for SGD, else 0.01)")
    g.add_argument("--momentum", type=number(), default=0.9, help="SGD momentum (dsgd, allreduce-sgd, decentralized-sgd)")
    g.add_argument("--betas", type=lambda s: tuple(float(b) for b in s.split(",")), default=None,
                   help="Adam betas, 'beta1,beta2' (default 0.9,0.999; AccumAdam: per window, 0.9^K,0.999^K)")
    g.add_argument("--accum-steps", type=count(1), default=4, help="AccumAdam(W): steps per moment-accumulation window")
    g.add_argument("--grad-clip", type=number(), default=1.0,
                   help="clip the gradient norm (allreduce: of the averaged gradient; decentralized: of each rank's "
                        "own gradient); 0: off")
    g.add_argument("--batch-size", type=count(1), default=batch_size, help="batch size per rank")
    g.add_argument("--seed", type=int, default=0, help="model init seed; rank r draws data with a seed derived from (seed, r)")

    g = parser.add_argument_group("logging and checkpoints")
    g.add_argument("--eval-every", type=count(1), default=eval_every,
                   help="validate the global-average model (and measure consensus distance) every N steps")
    g.add_argument("--log-every", type=count(1), default=10, help="record rank 0's training loss every N steps")
    g.add_argument("--out", default=None, help="directory for the CSV/JSON logs and the PNG plot (rank 0)")
    g.add_argument("--checkpoint", default=None,
                   help="checkpoint directory: writes PATH/step_NNNNNNN/rank<r>.pt (one file per rank, replicas differ)")
    g.add_argument("--checkpoint-every", type=count(1), default=None, help="checkpoint every N steps (default: --eval-every)")
    g.add_argument("--resume", default=None,
                   help="resume from a checkpoint directory (its latest step) or one step_NNNNNNN directory")
    g.add_argument("--no-progress", action="store_true", help="no tqdm progress bar (it is off anyway when not a tty)")

    g = parser.add_argument_group("runtime")
    g.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: cuda:LOCAL_RANK with nccl when CUDA is available, else cpu with gloo")
    g.add_argument("--threads", type=count(1), default=1, help="torch intra-op threads per rank (1: ranks share the cores)")
    g.add_argument("--profile", default=None, metavar="DIR",
                   help="write a torch.profiler trace of a few steps per rank to DIR/trace_rank<r>.json "
                        "(decent_train/profiling.py; bench/trace_picture.py draws it)")
    g.add_argument("--straggler-ms", type=lambda s: tuple(float(v) for v in s.split(",")), default=None,
                   metavar="MEAN,STD", help="straggler emulation: every rank sleeps max(0, N(MEAN, STD)) ms before "
                                            "each step's forward (its own random stream; data is unchanged)")
    return parser


def optimizer_family(name: str) -> str:
    if name in FUSED:
        return FUSED[name][1]
    inner = name.split("-", 1)[1] if "-" in name else "adamw"
    return "sgd" if inner == "sgd" else "adam"


def resolve_defaults(args, lr_defaults: Dict[str, float], world_size: int = 1):
    """Fills the flags whose default depends on the optimizer family, the world size or other flags.

    lr_defaults holds the example's all-reduce lr per family ("adam", "sgd"). A decentralized Adam-family run
    (dadam(w), accumadam(w), decentralized-adam(w)) that leaves --lr / --betas unset gets the all-reduce Adam
    values translated by decent_comm.decentralized_adam_hparams: lr x sqrt(n) (AccumAdam: sqrt(n / K)) and, for
    AccumAdam, per-window betas (0.9^K, 0.999^K)."""
    if args.local_world_size is not None and world_size % args.local_world_size:
        raise ValueError(f"--local-world-size {args.local_world_size} does not divide the {world_size} ranks of this "
                         "job into nodes of equal size")
    family = optimizer_family(args.optimizer)
    if family == "accum" or args.optimizer in DECENTRALIZED_ADAM:
        hp = decent_comm.decentralized_adam_hparams(lr_defaults["adam"], world_size,
                                                   accum_steps=args.accum_steps if family == "accum" else 1)
    else:
        hp = {"lr": lr_defaults.get(family, lr_defaults["adam"]), "betas": ADAM_BETAS}
    if args.lr is None:
        args.lr = hp["lr"]
    if args.betas is None:
        args.betas = hp["betas"]
    if args.weight_decay is None:
        args.weight_decay = 0.0 if family == "sgd" else 0.01
    if args.warmup is None:
        # 30%: the larger lr of the decentralized Adam runs needs it (docs/quality_results.md), and the all-reduce
        # baseline gains from it too.
        args.warmup = max(1, args.steps * 3 // 10) if args.lr_schedule == "warmup-cosine" else 0
    if args.checkpoint_every is None:
        args.checkpoint_every = args.eval_every
    return args
