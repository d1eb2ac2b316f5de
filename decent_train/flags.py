"""Command-line flags every training script takes (the script adds its model and data flags), the checks across
flags made right after parsing (check_flags), and the defaults that depend on the optimizer family, the world size
or other flags (resolve_defaults)."""

import argparse
import inspect
import math
import os
from typing import Dict, Optional, Tuple

import torch

import decent_comm

from .flag_sets import DECENTRALIZED_ONLY
from .profiling import ACTIVE_STEPS, SKIP_STEPS, WARMUP_STEPS

# The steps of a run --profile records (1-based): the profiler skips SKIP_STEPS, discards WARMUP_STEPS, then records.
PROFILED = (SKIP_STEPS + WARMUP_STEPS + 1, SKIP_STEPS + WARMUP_STEPS + ACTIVE_STEPS)

# name -> (decent_comm class, optimizer family). The family picks the default lr, betas and weight decay (see
# resolve_defaults). AccumAdam has its own: its second moment is built from the mean gradient of each accumulation
# window, which has less noise than one step's gradient, and its betas act once per window.
FUSED = {"dsgd": ("DSGD", "sgd"), "dadam": ("DAdam", "adam"), "dadamw": ("DAdamW", "adam"),
         "accumadam": ("AccumAdam", "accum"), "accumadamw": ("AccumAdamW", "accum")}
TORCH_OPTIMIZERS = {name.lower(): cls for name, cls in vars(torch.optim).items()
                    if inspect.isclass(cls) and issubclass(cls, torch.optim.Optimizer) and cls is not torch.optim.Optimizer}
# torch optimizers the loop cannot drive, refused by --optimizer with the reason. One whose step() needs a closure
# (torch.optim.LBFGS) is found by its signature (not_drivable), so one torch adds later is refused too.
NOT_DRIVABLE = {"sparseadam": "it takes sparse gradients only, and the example models' gradients are dense",
                "muon": "it takes 2-D parameters only, and the example models also have biases, norm weights and (the "
                        "classifier's) conv kernels"}
# The runs whose lr and betas default to the all-reduce AdamW values translated by decentralized_adam_hparams
# (AccumAdam(W), family "accum", too).
DECENTRALIZED_ADAM = ("dadam", "dadamw", "decentralized-adam", "decentralized-adamw")
ADAM_BETAS = (0.9, 0.999)
# --resume auto: from --checkpoint's latest committed step when there is one, else afresh (decent_train.checkpoint)
RESUME_AUTO = "auto"


def not_drivable(name: str) -> Optional[str]:
    """Why the training loop cannot drive torch.optim's optimizer `name` (lower case), or None when it can."""
    if name in NOT_DRIVABLE:
        return NOT_DRIVABLE[name]
    closure = inspect.signature(TORCH_OPTIMIZERS[name].step).parameters.get("closure")
    if closure is not None and closure.default is inspect.Parameter.empty:
        return "its step() needs a closure that re-evaluates the loss, and the loop calls step() without one"
    return None


def drivable_torch_optimizers():
    return sorted(n for n in TORCH_OPTIMIZERS if not_drivable(n) is None)


def optimizer_name(value: str) -> str:
    """argparse type: allreduce[-<torch optimizer>], a fused decent_comm optimizer, or decentralized-<torch optimizer>;
    a torch optimizer the loop cannot drive is refused with the reason (not left to fail at its first step)."""
    v = value.strip().lower()
    if v in FUSED or v == "allreduce":
        return v
    for prefix in ("allreduce-", "decentralized-"):
        inner = v[len(prefix):]
        if v.startswith(prefix) and inner in TORCH_OPTIMIZERS:
            why = not_drivable(inner)
            if why:
                raise argparse.ArgumentTypeError(f"{value!r}: the training loop cannot drive "
                                                 f"torch.optim.{TORCH_OPTIMIZERS[inner].__name__}: {why}")
            return v
    raise argparse.ArgumentTypeError(
        f"unknown optimizer {value!r}: use allreduce, allreduce-<torch optimizer>, {', '.join(FUSED)}, or "
        f"decentralized-<torch optimizer> (torch optimizers: {', '.join(drivable_torch_optimizers())})")


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


def number(least: float = 0.0, strictly: bool = False, most: Optional[float] = None):
    """argparse type: a float >= least (> least when strictly) and <= most, NaN refused."""
    def parse(value: str) -> float:
        try:
            x = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {value!r}") from None
        if not (x > least if strictly else x >= least):  # NaN fails both
            raise argparse.ArgumentTypeError(f"must be {'>' if strictly else '>='} {least:g}, got {value}")
        if most is not None and not x <= most:
            raise argparse.ArgumentTypeError(f"must be in [{least:g}, {most:g}], got {value}")
        return x
    return parse


def _floats(value: str) -> Tuple[float, ...]:
    try:
        return tuple(float(v) for v in value.split(","))
    except ValueError:
        return ()


def betas_value(value: str) -> Tuple[float, float]:
    """argparse type of --betas: 'BETA1,BETA2', two numbers in [0, 1) (argparse named a lambda for bad text, and one
    number reached the optimizer as a traceback)."""
    b = _floats(value)
    if len(b) != 2 or not all(0.0 <= x < 1.0 for x in b):
        raise argparse.ArgumentTypeError(f"expected BETA1,BETA2: two numbers in [0, 1), got {value!r}")
    return b


def straggler_value(value: str) -> Tuple[float, float]:
    """argparse type of --straggler-ms: 'MEAN,STD' in milliseconds, or 'MEAN' (STD 0). A negative MEAN is allowed:
    max(0, N(MEAN, STD)) then sleeps in some steps only."""
    v = _floats(value)
    if not 1 <= len(v) <= 2 or not all(math.isfinite(x) for x in v) or (len(v) == 2 and v[1] < 0):
        raise argparse.ArgumentTypeError(f"expected MEAN,STD in milliseconds: finite numbers, STD >= 0 (MEAN alone: "
                                         f"STD 0), got {value!r}")
    return (v + (0.0,))[:2]


def add_common_args(parser: argparse.ArgumentParser, *, steps: int, batch_size: int, eval_every: int):
    """The flags every example takes; the example adds its model and data flags. A flag whose default is None is
    told apart from one given on the command line (check_flags refuses some combinations, a resumed run applies
    the hyper-parameters given); resolve_defaults fills it."""
    g = parser.add_argument_group("optimization")
    g.add_argument("--optimizer", type=optimizer_name, default="dadamw",
                   help="allreduce (torch DDP + AdamW; allreduce-sgd etc. for another torch optimizer), "
                        f"{', '.join(FUSED)} (fused decent_comm optimizers), or decentralized-<torch optimizer> "
                        "(decent_comm.Decentralized wrapping e.g. torch.optim.AdamW); torch optimizers: "
                        f"{', '.join(drivable_torch_optimizers())}")
    g.add_argument("--topology", type=topology_name, default=None,
                   help=f"decentralized: gossip topology: {', '.join(decent_comm.topology.NAMES)}, or an adaptive spec: "
                        "adaptive:consensus:one-peer-exp,exp,complete[:kappa=1,interval=10] or "
                        "adaptive:phase:complete@0,one-peer-exp@100 (decent_comm.topology.adaptive) "
                        "(default: one-peer-exp)")
    g.add_argument("--mode", choices=decent_comm.optim.MODES, default=None,
                   help="decentralized: awc: communicate while adapting (exchange overlaps forward+backward; fastest "
                        "when the network is the bottleneck); atc: adapt then combine (exchange overlaps the forward; "
                        "better loss at equal steps, docs/quality_results.md) (default: awc)")
    g.add_argument("--local-world-size", type=count(1), default=None,
                   help="decentralized: ranks per node for hierarchical topologies (aer); default: LOCAL_WORLD_SIZE "
                        "from torchrun. Smaller than --nproc_per_node emulates several nodes on one machine")
    g.add_argument("--consensus", type=consensus_value, default=None,
                   help="decentralized: consensus factor a in W -> (1-a) I + a W, or 'adaptive' (a follows the lr "
                        "schedule after warmup) (default: 1)")
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
                        "decent_comm.decentralized_adam_hparams; a resumed run: the checkpoint's)")
    g.add_argument("--lr-schedule", choices=("constant", "cosine", "warmup-cosine"), default="warmup-cosine",
                   help="learning-rate schedule over --steps")
    g.add_argument("--warmup", type=count(0), default=None,
                   help="linear lr warmup steps before the cosine decay of --lr-schedule warmup-cosine or cosine "
                        "(default: 30%% of --steps for warmup-cosine, 0 for cosine; refused with constant)")
    g.add_argument("--min-lr-ratio", type=number(0.0, most=1.0), default=0.1,
                   help="cosine schedules decay to this fraction of --lr, in [0, 1]")
    g.add_argument("--weight-decay", type=number(), default=None,
                   help="weight decay (default: 0 for SGD, else 0.01; a resumed run: the checkpoint's)")
    g.add_argument("--momentum", type=number(), default=None,
                   help="SGD momentum, for dsgd, allreduce-sgd, decentralized-sgd only (default: 0.9; a resumed run: "
                        "the checkpoint's)")
    g.add_argument("--betas", type=betas_value, default=None, metavar="BETA1,BETA2",
                   help="Adam betas, for the optimizers that take them (default: 0.9,0.999; AccumAdam: per window, "
                        "0.9^K,0.999^K; a resumed run: the checkpoint's)")
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
    g.add_argument("--out", default=None,
                   help="directory for the CSV/JSON logs and the PNG plot (rank 0) (default: none, no logs written)")
    g.add_argument("--checkpoint", default=None,
                   help="checkpoint directory: writes PATH/step_NNNNNNN/rank<r>.pt (one file per rank, replicas differ) "
                        "and PATH/latest, the newest step every rank finished; every step directory stays unless "
                        "--keep-checkpoints is given, as does one not committed (a rank killed mid-write leaves its "
                        "rank<r>.pt.tmp there) until a save of that step rewrites it (default: none, no checkpoints)")
    g.add_argument("--keep-checkpoints", type=count(1), default=None,
                   help="keep the newest N committed step directories (the one PATH/latest names always among them): "
                        "after each commit rank 0 deletes the older ones (default: keep all)")
    g.add_argument("--checkpoint-every", type=count(1), default=None, help="checkpoint every N steps (default: --eval-every)")
    g.add_argument("--resume", default=None,
                   help="resume from a checkpoint directory (its latest step) or one step_NNNNNNN directory; 'auto': "
                        "from --checkpoint's latest committed step when it has one, else start afresh (what a fixed "
                        "command line under torchrun --max-restarts needs; a directory named auto is ./auto); --lr, "
                        "--weight-decay, --betas and --momentum given now replace the checkpoint's; --optimizer and "
                        "the model's flags must be those it was written with (default: none, start afresh)")
    g.add_argument("--no-progress", action="store_true", help="no tqdm progress bar (it is off anyway when not a tty)")

    g = parser.add_argument_group("runtime")
    g.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: cuda:LOCAL_RANK with nccl when CUDA is available, else cpu with gloo")
    g.add_argument("--timeout", type=number(0.0, strictly=True, most=1e8), default=None, metavar="SECONDS",
                   help="how long a rank waits for another once the job has started before it raises: the "
                        "decentralized optimizers' timeout= (an exchange, warm-up all-reduce or global_average() "
                        "raises ExchangeTimeout naming the peer; also how far apart the ranks may reach the "
                        "optimizer's construction) and the process group's (DDP's all-reduce, evaluation, the "
                        "barrier after each checkpoint write: gloo's timeout error, naming no rank). Keep it above "
                        "the longest the ranks may drift apart, a slow checkpoint write included. The ranks' join "
                        "(init_process_group) keeps torch's default (default: the process group's, gloo 30 min, "
                        "nccl 10 min)")
    g.add_argument("--threads", type=count(1), default=1, help="torch intra-op threads per rank (1: ranks share the cores)")
    g.add_argument("--profile", default=None, metavar="DIR",
                   help=f"write a torch.profiler trace to DIR/trace_rank<r>.json of steps {PROFILED[0]}-{PROFILED[1]} "
                        f"of this run ({SKIP_STEPS} skipped, {WARMUP_STEPS} warm-up; a run of {SKIP_STEPS + WARMUP_STEPS}"
                        " steps or fewer would record nothing and is refused; decent_train/profiling.py; "
                        "bench/trace_picture.py draws it) (default: off)")
    g.add_argument("--straggler-ms", type=straggler_value, default=None,
                   metavar="MEAN,STD", help="straggler emulation: every rank sleeps max(0, N(MEAN, STD)) ms before "
                                            "each step's forward (its own random stream; data is unchanged) "
                                            "(default: off)")
    return parser


def canonical_optimizer(name: str) -> str:
    """--optimizer's name with the default spelled out: allreduce is allreduce-adamw (the same torch class)."""
    return "allreduce-adamw" if name == "allreduce" else name


def optimizer_family(name: str) -> str:
    if name in FUSED:
        return FUSED[name][1]
    inner = name.split("-", 1)[1] if "-" in name else "adamw"
    return "sgd" if inner == "sgd" else "adam"


def torch_class(name: str):
    """The torch.optim class of allreduce[-X] / decentralized-X."""
    return TORCH_OPTIMIZERS[name.split("-", 1)[1] if "-" in name else "adamw"]


def torch_hyperparameters(cls) -> Tuple[str, ...]:
    """The param-group hyper-parameters the flags set on torch optimizer class `cls`."""
    accepted = inspect.signature(cls.__init__).parameters
    names = ("lr",) + tuple(k for k in ("weight_decay", "betas") if k in accepted)
    # other optimizers' "momentum" (RMSprop, ...) means something else than SGD's
    return names + (("momentum",) if cls is torch.optim.SGD else ())


def hyperparameters(name: str) -> Tuple[str, ...]:
    """The param-group hyper-parameters (lr, weight_decay, betas, momentum: each the flag of that name) that
    --optimizer `name` is built with, and that a resumed run applies again when they are given."""
    if name in FUSED:
        return ("lr", "weight_decay", "momentum" if name == "dsgd" else "betas")
    return torch_hyperparameters(torch_class(name))


def _not_a_directory(flag: str, path: Optional[str]):
    if path is not None and os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{flag} {path}: it exists and is not a directory")


def refuse_decentralized_only(args, dests=None):
    """ValueError naming the decentralized-only flags (DECENTRALIZED_ONLY; `dests`: only those) given to an
    all-reduce run, which would ignore them. build_strategy checks the cadence flags again for flags parsed without
    check_flags (resolve_defaults has filled --topology and the like by then, so it checks only those)."""
    name = args.optimizer
    if not name.startswith("allreduce"):
        return
    given = [flag for flag, dest, unset in DECENTRALIZED_ONLY
             if (dests is None or dest in dests) and getattr(args, dest, unset) != unset]
    if given:
        why = ("DDP has no 8-bit gradient hook here; --bf16-wire compresses its gradients"
               if given == ["--int8-wire"] else "DDP all-reduces the gradients every step")
        raise ValueError(f"{', '.join(given)}: for the decentralized optimizers only, not for --optimizer {name} "
                         f"({why})")


def check_flags(args):
    """The checks across flags that need no process group, made right after parsing (decent_train.cli), so that a
    bad combination is one line before any rank starts. Flags given where they do not apply are refused, not
    ignored: a comparison of recipes must not think they took effect. Paths are checked before the run writes to
    them (--out naming a file failed at the first evaluation). ValueError naming the flag."""
    name = args.optimizer
    refuse_decentralized_only(args)
    taken = hyperparameters(name)
    for key in ("weight_decay", "betas", "momentum"):
        if getattr(args, key) is not None and key not in taken:
            raise ValueError(f"--{key.replace('_', '-')}: --optimizer {name} does not take it (it takes "
                             f"{', '.join('--' + k.replace('_', '-') for k in taken)})")
    if args.warmup is not None and args.lr_schedule == "constant":
        raise ValueError(f"--warmup {args.warmup}: --lr-schedule constant has no warmup (use cosine or warmup-cosine)")
    if args.profile and args.steps <= SKIP_STEPS + WARMUP_STEPS:
        raise ValueError(f"--profile records steps {PROFILED[0]}-{PROFILED[1]} of a run: --steps {args.steps} would "
                         f"record nothing; give --steps {PROFILED[0]} or more")
    for flag, path in (("--out", args.out), ("--checkpoint", args.checkpoint), ("--profile", args.profile)):
        _not_a_directory(flag, path)
    if args.resume == RESUME_AUTO and args.checkpoint is None:
        raise ValueError("--resume auto resumes from --checkpoint's latest committed step: give --checkpoint DIR (the "
                         "directory this run writes its checkpoints to)")
    if args.resume not in (None, RESUME_AUTO) and not os.path.isdir(args.resume):
        raise ValueError(f"--resume {args.resume}: no such directory (give a checkpoint directory or one of its "
                         "step_NNNNNNN directories)")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available here (torch.cuda.is_available() is False); "
                         "use --device cpu or auto")


def resolve_defaults(args, lr_defaults: Dict[str, float], world_size: int = 1):
    """Fills the flags whose default depends on the optimizer family, the world size or other flags.

    lr_defaults holds the example's all-reduce lr per family ("adam", "sgd"). A decentralized Adam-family run
    (dadam(w), accumadam(w), decentralized-adam(w)) that leaves --lr / --betas unset gets the all-reduce Adam
    values translated by decent_comm.decentralized_adam_hparams: lr x sqrt(n) (AccumAdam: sqrt(n / K)) and, for
    AccumAdam, per-window betas (0.9^K, 0.999^K)."""
    if args.local_world_size is not None and world_size % args.local_world_size:
        raise ValueError(f"--local-world-size {args.local_world_size} does not divide the {world_size} ranks of this "
                         "job into nodes of equal size")
    for dest, value in (("topology", "one-peer-exp"), ("mode", "awc"), ("consensus", 1.0), ("momentum", 0.9)):
        if getattr(args, dest) is None:
            setattr(args, dest, value)
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
