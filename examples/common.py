"""What the training examples share: command-line flags, distributed start-up from torchrun's environment,
the optimizer factory (DDP all-reduce baseline or a decent_comm optimizer), the training loop with
evaluation on the global-average model, CSV/JSON logs, the loss plot and checkpoint/resume.

An example supplies a `Task` (model, a batch sampler, its validation shard) and calls `run(args, build_task)`;
everything else, including the timing that the demo compares, is measured here in the same way for every
optimizer.
"""

import argparse
import contextlib
import csv
import inspect
import json
import logging
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

# The examples run from a source checkout where decent_comm is built in place at the repository root.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import decent_comm  # noqa: E402

log = logging.getLogger("examples")

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


# ------------------------------------------------------------------------------------------------ flags

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


def add_common_args(parser: argparse.ArgumentParser, *, steps: int, batch_size: int, eval_every: int):
    """The flags every example takes; the example adds its model and data flags."""
    g = parser.add_argument_group("optimization")
    g.add_argument("--optimizer", type=optimizer_name, default="dadamw",
                   help="allreduce (torch DDP + AdamW; allreduce-sgd etc. for another torch optimizer), "
                        f"{', '.join(FUSED)} (fused decent_comm optimizers), or decentralized-<torch optimizer> "
                        "(decent_comm.Decentralized wrapping e.g. torch.optim.AdamW)")
    g.add_argument("--topology", default="one-peer-exp",
                   help=f"gossip topology: {', '.join(decent_comm.topology.NAMES)}, or an adaptive spec: "
                        "adaptive:consensus:one-peer-exp,exp,complete[:kappa=1,interval=10] or "
                        "adaptive:phase:complete@0,one-peer-exp@100 (decent_comm.topology.adaptive)")
    g.add_argument("--mode", choices=decent_comm.optim.MODES, default="awc",
                   help="awc: communicate while adapting (exchange overlaps forward+backward; fastest when the network "
                        "is the bottleneck); atc: adapt then combine (exchange overlaps the forward; better loss at "
                        "equal steps, docs/quality_results.md)")
    g.add_argument("--local-world-size", type=int, default=None,
                   help="ranks per node for hierarchical topologies (aer); default: LOCAL_WORLD_SIZE from torchrun. "
                        "Smaller than --nproc_per_node emulates several nodes on one machine")
    g.add_argument("--consensus", type=consensus_value, default=1.0,
                   help="consensus factor a in W -> (1-a) I + a W, or 'adaptive' (a follows the lr schedule after warmup)")
    g.add_argument("--bf16-wire", action="store_true",
                   help="send parameters (decentralized) or gradients (allreduce, DDP bf16 compress hook) as bfloat16")
    g.add_argument("--steps", type=int, default=steps, help="optimizer steps in total (a resumed run continues to this)")
    g.add_argument("--lr", type=float, default=None,
                   help="peak learning rate (default: the example's all-reduce lr for the optimizer family; "
                        "decentralized Adam-family runs scale it by sqrt(n), AccumAdam by sqrt(n / K): "
                        "decent_comm.decentralized_adam_hparams)")
    g.add_argument("--lr-schedule", choices=("constant", "cosine", "warmup-cosine"), default="warmup-cosine",
                   help="learning-rate schedule over --steps")
    g.add_argument("--warmup", type=int, default=None, help="warmup steps of warmup-cosine (default: 30%% of --steps)")
    g.add_argument("--min-lr-ratio", type=float, default=0.1, help="cosine schedules decay to this fraction of --lr")
    g.add_argument("--weight-decay", type=float, default=None, help="weight decay (default: 0 for SGD, else 0.01)")
    g.add_argument("--momentum", type=float, default=0.9, help="SGD momentum (dsgd, allreduce-sgd, decentralized-sgd)")
    g.add_argument("--betas", type=lambda s: tuple(float(b) for b in s.split(",")), default=None,
                   help="Adam betas, 'beta1,beta2' (default 0.9,0.999; AccumAdam: per window, 0.9^K,0.999^K)")
    g.add_argument("--accum-steps", type=int, default=4, help="AccumAdam(W): steps per moment-accumulation window")
    g.add_argument("--grad-clip", type=float, default=1.0,
                   help="clip the gradient norm (allreduce: of the averaged gradient; decentralized: of each rank's "
                        "own gradient); 0: off")
    g.add_argument("--batch-size", type=int, default=batch_size, help="batch size per rank")
    g.add_argument("--seed", type=int, default=0, help="model init seed; rank r draws data with a seed derived from (seed, r)")

    g = parser.add_argument_group("logging and checkpoints")
    g.add_argument("--eval-every", type=int, default=eval_every,
                   help="validate the global-average model (and measure consensus distance) every N steps")
    g.add_argument("--log-every", type=int, default=10, help="record rank 0's training loss every N steps")
    g.add_argument("--out", default=None, help="directory for the CSV/JSON logs and the PNG plot (rank 0)")
    g.add_argument("--checkpoint", default=None,
                   help="checkpoint directory: writes PATH/step_NNNNNNN/rank<r>.pt (one file per rank, replicas differ)")
    g.add_argument("--checkpoint-every", type=int, default=None, help="checkpoint every N steps (default: --eval-every)")
    g.add_argument("--resume", default=None,
                   help="resume from a checkpoint directory (its latest step) or one step_NNNNNNN directory")
    g.add_argument("--no-progress", action="store_true", help="no tqdm progress bar (it is off anyway when not a tty)")

    g = parser.add_argument_group("runtime")
    g.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: cuda:LOCAL_RANK with nccl when CUDA is available, else cpu with gloo")
    g.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank (1: ranks share the cores)")
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


# --------------------------------------------------------------------------------------------- logging

def setup_logging(rank: int):
    """INFO from rank 0, warnings and errors from every rank, each line tagged with its rank."""
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, force=True,
                        format=f"%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")


# ---------------------------------------------------------------------------------------- distributed

@dataclass
class DistEnv:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    device: torch.device = torch.device("cpu")
    owns_group: bool = False     # we created the process group, so we destroy it

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def init_distributed(device: str = "auto") -> DistEnv:
    """Joins the job torchrun describes (RANK, WORLD_SIZE, MASTER_ADDR, ... in the environment; works the
    same for --standalone and multi-node c10d rendezvous). gloo on CPU, nccl on GPU. A group that already
    exists (tests) is reused; without torchrun the example runs as a single process."""
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    env = DistEnv(local_rank=local_rank, local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    if use_cuda:
        torch.cuda.set_device(local_rank)
        env.device = torch.device("cuda", local_rank)
    if not dist.is_initialized() and "WORLD_SIZE" in os.environ:
        dist.init_process_group("nccl" if use_cuda else "gloo",
                                device_id=env.device if use_cuda else None)
        env.owns_group = True
    if dist.is_initialized():
        env.rank, env.world_size = dist.get_rank(), dist.get_world_size()
        if "LOCAL_WORLD_SIZE" not in os.environ:
            env.local_world_size = env.world_size
    return env


def close_distributed(env: DistEnv):
    if env.owns_group and dist.is_initialized():
        dist.destroy_process_group()


def rank_seed(seed: int, rank: int) -> int:
    """Each rank draws different data; a large odd multiplier keeps (seed, rank) pairs from colliding."""
    return (seed * 1_000_003 + rank * 7919 + 1) % (2 ** 63)


# ----------------------------------------------------------------------------------- optimizer factory

class Strategy:
    """How the replicas are kept in agreement: the torch optimizer plus DDP gradient all-reduce, or a
    decent_comm optimizer gossiping parameters. The loop talks only to this interface."""

    def __init__(self, optimizer, forward_module, decentralized: bool):
        self.optimizer = optimizer
        self.forward_module = forward_module   # what training calls (the DDP wrapper for all-reduce)
        self.decentralized = decentralized

    def eval_context(self):
        """Evaluation sees the exact global average of the replicas (a collective for decentralized runs;
        DDP replicas are identical already)."""
        return self.optimizer.global_average() if self.decentralized else contextlib.nullcontext()

    def consensus_distance(self) -> float:
        return self.optimizer.consensus_distance() if self.decentralized else 0.0

    def comm_metrics(self, env) -> dict:
        """Gossip traffic so far (MB sent per rank, mean over ranks: a collective), the topology in use and rank 0's
        last disagreement with its neighbours; empty for all-reduce."""
        if not self.decentralized:
            return {}
        sent = torch.tensor([float(self.optimizer.bytes_sent)], dtype=torch.float64, device=env.device)
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


def torch_optimizer(cls, params, args):
    """cls(params, lr, ...) with the hyper-parameters from the flags that cls accepts."""
    accepted = inspect.signature(cls.__init__).parameters
    kw = {"lr": args.lr}
    if "weight_decay" in accepted:
        kw["weight_decay"] = args.weight_decay
    if cls is torch.optim.SGD:  # other optimizers' "momentum" (RMSprop, ...) means something else
        kw["momentum"] = args.momentum
    if "betas" in accepted:
        kw["betas"] = args.betas
    return cls(params, **kw)


def _consensus(args):
    if args.consensus == "adaptive":
        # Start adapting after warmup: AdaptiveConsensus takes the lr at start_step as its reference, and the
        # warmup lr would make every later lr look "large" (factor stuck at 1).
        return decent_comm.AdaptiveConsensus(start_step=args.warmup)
    return args.consensus


def build_strategy(args, model: torch.nn.Module, env: DistEnv) -> Strategy:
    name = args.optimizer
    if name.startswith("allreduce"):
        cls = TORCH_OPTIMIZERS[name.split("-", 1)[1] if "-" in name else "adamw"]
        forward = model
        if env.distributed:
            forward = torch.nn.parallel.DistributedDataParallel(
                model, device_ids=[env.device.index] if env.device.type == "cuda" else None)
            if args.bf16_wire:
                from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
                forward.register_comm_hook(None, default_hooks.bf16_compress_hook)
        return Strategy(torch_optimizer(cls, model.parameters(), args), forward, decentralized=False)

    # local_world_size=None lets decent_comm read LOCAL_WORLD_SIZE (set by torchrun) itself.
    topology = decent_comm.topology.make(args.topology, env.world_size, local_world_size=args.local_world_size)
    options = dict(topology=topology, mode=args.mode, consensus=_consensus(args), model=model,
                   comm_dtype=torch.bfloat16 if args.bf16_wire else None)
    if name in FUSED:
        cls = getattr(decent_comm, FUSED[name][0])
        kw = dict(lr=args.lr, weight_decay=args.weight_decay, **options)
        if name == "dsgd":
            kw["momentum"] = args.momentum
        else:
            kw["betas"] = args.betas
        if name.startswith("accum"):
            kw["accum_steps"] = args.accum_steps
        opt = cls(model.parameters(), **kw)
    else:
        inner = torch_optimizer(TORCH_OPTIMIZERS[name.split("-", 1)[1]], model.parameters(), args)
        opt = decent_comm.Decentralized(inner, **options)
    return Strategy(opt, model, decentralized=True)


def make_lr_scheduler(optimizer, args) -> torch.optim.lr_scheduler.LambdaLR:
    """constant, cosine (peak -> min_lr_ratio * peak), or linear warmup then cosine."""
    total, warmup, floor = max(1, args.steps), args.warmup, args.min_lr_ratio

    def factor(step: int) -> float:
        if args.lr_schedule == "constant":
            return 1.0
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


# ------------------------------------------------------------------------------------------- run log

@dataclass
class RunLog:
    """Rows of metrics (rank 0), written as CSV and JSON after every evaluation, so a killed run keeps its log."""
    out: Optional[str]
    item_name: str
    rows: List[dict] = field(default_factory=list)

    @property
    def columns(self):
        return ["step", "train_time_s", "lr", "train_loss", "val_loss", "val_acc", "consensus_distance",
                "step_time_ms", f"{self.item_name}_per_s", "bytes_sent_mb", "topology", "disagreement"]

    def write(self, config: dict, summary: dict):
        if self.out is None:
            return
        os.makedirs(self.out, exist_ok=True)
        with open(os.path.join(self.out, "log.csv"), "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=self.columns, extrasaction="ignore")
            w.writeheader()
            w.writerows(self.rows)
        with open(os.path.join(self.out, "log.json"), "w") as f:
            json.dump({"config": config, "summary": summary, "rows": self.rows}, f, indent=1)


def plot_runs(runs: Dict[str, List[dict]], path: str, title: str = ""):
    """Loss vs step and vs training wall-clock time, one colour per run (validation solid with markers,
    rank 0's training loss faint)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for i, (label, rows) in enumerate(runs.items()):
        color = f"C{i}"
        train = [r for r in rows if r.get("train_loss") is not None]
        val = [r for r in rows if r.get("val_loss") is not None]
        for ax, x in zip(axes, ("step", "train_time_s")):
            ax.plot([r[x] for r in train], [r["train_loss"] for r in train], color=color, alpha=0.3, lw=1)
            ax.plot([r[x] for r in val], [r["val_loss"] for r in val], color=color, marker="o", ms=3,
                    label=f"{label} (val)")
    axes[0].set_xlabel("step")
    axes[1].set_xlabel("training wall-clock time (s)")
    for ax in axes:
        ax.set_ylabel("loss (nats)")
        ax.grid(alpha=0.3)
        ax.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------------------- checkpoints

@dataclass
class Progress:
    step: int = 0
    train_time: float = 0.0      # seconds spent training (evaluation and checkpointing excluded)
    rows: List[dict] = field(default_factory=list)


def save_checkpoint(root: str, env: DistEnv, model, strategy: Strategy, scheduler, generator, progress: Progress):
    """Every rank writes its own file: decentralized replicas (and every rank's data stream) differ."""
    step_dir = os.path.join(root, f"step_{progress.step:07d}")
    os.makedirs(step_dir, exist_ok=True)
    state = {
        "model": {k: v.detach().clone() for k, v in model.state_dict().items()},  # copies, not bucket views
        "optimizer": strategy.optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "data_rng": generator.get_state(),
        "torch_rng": torch.get_rng_state(),
        "step": progress.step, "train_time": progress.train_time, "rows": progress.rows,
        "world_size": env.world_size,
    }
    path = os.path.join(step_dir, f"rank{env.rank}.pt")
    torch.save(state, path + ".tmp")
    os.replace(path + ".tmp", path)  # a run killed mid-write leaves the previous checkpoint intact
    if env.distributed:
        dist.barrier()  # "latest" may only name a step every rank has finished writing
    if env.is_main:
        with open(os.path.join(root, "latest.tmp"), "w") as f:
            f.write(os.path.basename(step_dir))
        os.replace(os.path.join(root, "latest.tmp"), os.path.join(root, "latest"))
    log.info("checkpoint written: %s", step_dir)


def resolve_resume_dir(path: str) -> str:
    latest = os.path.join(path, "latest")
    if os.path.isfile(latest):
        return os.path.join(path, open(latest).read().strip())
    return path


def load_checkpoint(path: str, env: DistEnv, model, strategy: Strategy, scheduler, generator) -> Progress:
    step_dir = resolve_resume_dir(path)
    file = os.path.join(step_dir, f"rank{env.rank}.pt")
    if not os.path.isfile(file):
        raise FileNotFoundError(f"no checkpoint for rank {env.rank} in {step_dir}")
    state = torch.load(file, map_location=env.device, weights_only=False)
    if state["world_size"] != env.world_size:
        raise ValueError(f"{step_dir} was written by {state['world_size']} ranks, this job has {env.world_size}")
    model.load_state_dict(state["model"])
    strategy.optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    generator.set_state(state["data_rng"])
    torch.set_rng_state(state["torch_rng"])
    log.info("resumed from %s at step %d", step_dir, state["step"])
    return Progress(state["step"], state["train_time"], state["rows"])


# ----------------------------------------------------------------------------------------------- loop

@dataclass
class Task:
    """What an example provides. Batches are (inputs, class targets); the model returns logits whose last
    dimension is the class (or next-byte) dimension, so one cross-entropy serves both examples."""
    model: torch.nn.Module
    sample_batch: Callable[[torch.Generator], Tuple[torch.Tensor, torch.Tensor]]
    val_batches: List[Tuple[torch.Tensor, torch.Tensor]]   # this rank's shard of the validation set
    items_per_batch: int                                  # tokens or samples per rank and step
    item_name: str = "tokens"
    report_accuracy: bool = False
    description: str = ""


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction=reduction)


@torch.no_grad()
def evaluate(task: Task, strategy: Strategy, env: DistEnv) -> Dict[str, float]:
    """Validation loss (and accuracy) of the global-average model over the whole held-out set; each rank
    evaluates its shard and the sums are all-reduced."""
    model = task.model
    with strategy.eval_context():
        model.eval()
        sums = torch.zeros(3, dtype=torch.float64, device=env.device)  # loss, correct, count
        for x, y in task.val_batches:
            x, y = x.to(env.device), y.to(env.device)
            logits = model(x)
            sums[0] += cross_entropy(logits, y, reduction="sum").double()
            sums[1] += (logits.argmax(-1) == y).sum()
            sums[2] += y.numel()
        model.train()
    if env.distributed:
        dist.all_reduce(sums)
    out = {"val_loss": float(sums[0] / sums[2])}
    if task.report_accuracy:
        out["val_acc"] = float(sums[1] / sums[2])
    return out


class Stopwatch:
    """Training time only: stopped around evaluation and checkpointing. CUDA is synchronized at the edges
    (only there), so queued GPU work is charged to the steps that queued it."""

    def __init__(self, device: torch.device):
        self.device = device
        self.start()

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def start(self):
        self._sync()
        self.t0 = time.perf_counter()

    def stop(self) -> float:
        self._sync()
        return time.perf_counter() - self.t0


class Interval:
    """Rank 0's training loss and time since the last log point. The loss is summed on the device and read
    only at log points: a .item() per step would make the host wait for the GPU every step."""

    def __init__(self, device: torch.device, items_per_step: int, item_name: str):
        self.loss = torch.zeros((), device=device)
        self.items_per_step, self.key = items_per_step, f"{item_name}_per_s"
        self.steps, self.seconds = 0, 0.0

    def add(self, loss: torch.Tensor):
        self.loss += loss.detach()
        self.steps += 1

    def flush(self) -> dict:
        row = {"train_loss": float(self.loss) / self.steps, "step_time_ms": 1e3 * self.seconds / self.steps,
               self.key: self.steps * self.items_per_step / self.seconds}
        self.loss.zero_()
        self.steps, self.seconds = 0, 0.0
        return row


@contextlib.contextmanager
def progress_bar(env: DistEnv, args, start: int):
    """A tqdm bar on rank 0 when stderr is a terminal (log lines are routed around it), else None."""
    if not env.is_main or args.no_progress or not sys.stderr.isatty():
        yield None
        return
    from tqdm import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm
    with logging_redirect_tqdm(), tqdm(total=args.steps, initial=start, dynamic_ncols=True, desc=args.optimizer) as bar:
        yield bar


def train_step(args, task: Task, strategy: Strategy, generator: torch.Generator, device) -> torch.Tensor:
    x, y = task.sample_batch(generator)
    loss = cross_entropy(strategy.forward_module(x.to(device)), y.to(device))
    loss.backward()
    if args.grad_clip > 0:
        strategy.clip_grad_(task.model, args.grad_clip)
    strategy.optimizer.step()
    strategy.optimizer.zero_grad()
    return loss


class Straggler:
    """--straggler-ms MEAN,STD: a random extra compute time per step and rank, from a stream of its own so the
    data and the model see exactly the same numbers as without it."""

    def __init__(self, spec, seed: int, rank: int):
        self.mean, self.std = (tuple(spec or ()) + (0.0, 0.0))[:2]
        self.rng = random.Random(rank_seed(seed, rank) ^ 0x5EED)

    def __call__(self):
        if self.mean or self.std:
            time.sleep(max(0.0, self.rng.gauss(self.mean, self.std)) / 1e3)


def summarize(args, task: Task, env: DistEnv, strategy: Strategy, progress: Progress) -> dict:
    evals = [r for r in progress.rows if r.get("val_loss") is not None]
    last = evals[-1] if evals else {}
    steps, seconds = progress.step, max(1e-9, progress.train_time)
    return {"optimizer": args.optimizer, "topology": args.topology if strategy.decentralized else "allreduce",
            "steps": steps, "world_size": env.world_size, "train_time_s": progress.train_time,
            "mean_step_time_ms": 1e3 * progress.train_time / max(1, steps),
            f"{task.item_name}_per_s": steps * task.items_per_batch * env.world_size / seconds,
            "final_val_loss": last.get("val_loss"), "final_val_acc": last.get("val_acc"),
            "final_consensus_distance": last.get("consensus_distance"), "bytes_sent_mb": last.get("bytes_sent_mb")}


def run(args, build_task: Callable[[argparse.Namespace, DistEnv], Task], lr_defaults: Dict[str, float],
        stopwatch_cls=None) -> dict:
    """Trains, evaluating and checkpointing as the flags say; returns the summary (also in log.json).
    stopwatch_cls (default Stopwatch) times the steps; a benchmark may pass one that synchronizes the ranks."""
    env = init_distributed(args.device)
    setup_logging(env.rank)
    torch.set_num_threads(args.threads)
    resolve_defaults(args, lr_defaults, env.world_size)
    torch.manual_seed(args.seed)  # the same initial model on every rank (the optimizers also broadcast it)
    task = build_task(args, env)
    model = task.model.to(env.device)
    strategy = build_strategy(args, model, env)
    scheduler = make_lr_scheduler(strategy.optimizer, args)
    generator = torch.Generator().manual_seed(rank_seed(args.seed, env.rank))
    progress = Progress()
    if args.resume:
        progress = load_checkpoint(args.resume, env, model, strategy, scheduler, generator)
    runlog = RunLog(args.out if env.is_main else None, task.item_name, progress.rows)
    n_params = sum(p.numel() for p in model.parameters())
    config = {**vars(args), "world_size": env.world_size, "parameters": n_params, "data": task.description}
    log.info("%s | %d ranks on %s | %s, %.2fM parameters | %s%s", task.description, env.world_size, env.device,
             type(model).__name__, n_params / 1e6, args.optimizer,
             f" ({args.topology}, {args.mode})" if strategy.decentralized else " (DDP)")

    interval = Interval(env.device, task.items_per_batch * env.world_size, task.item_name)
    straggle = Straggler(getattr(args, "straggler_ms", None), args.seed, env.rank)
    with progress_bar(env, args, progress.step) as bar:
        watch = (stopwatch_cls or Stopwatch)(env.device)
        while progress.step < args.steps:
            lr = strategy.optimizer.param_groups[0]["lr"]  # the lr this step uses
            straggle()
            interval.add(train_step(args, task, strategy, generator, env.device))
            scheduler.step()
            progress.step += 1
            step = progress.step
            if bar is not None:
                bar.update(1)
            do_eval = step % args.eval_every == 0 or step == args.steps
            do_log = do_eval or step % args.log_every == 0
            do_ckpt = args.checkpoint and (step % args.checkpoint_every == 0 or step == args.steps)
            if not (do_log or do_ckpt):
                continue
            seconds = watch.stop()
            progress.train_time += seconds
            interval.seconds += seconds
            if do_log:
                row = {"step": step, "train_time_s": round(progress.train_time, 4), "lr": lr, **interval.flush()}
                if do_eval:
                    row.update(evaluate(task, strategy, env), consensus_distance=strategy.consensus_distance())
                    row.update(strategy.comm_metrics(env))
                    log.info("step %d | train %.4f | val %.4f%s | consensus %.3g | %.1f ms/step | %.0f %s/s",
                             step, row["train_loss"], row["val_loss"],
                             f" | acc {row['val_acc']:.4f}" if "val_acc" in row else "", row["consensus_distance"],
                             row["step_time_ms"], row[interval.key], task.item_name)
                runlog.rows.append(row)
                if bar is not None:
                    bar.set_postfix(loss=f"{row['train_loss']:.3f}")
                if do_eval:  # rewritten at every evaluation, so a killed run keeps its log
                    runlog.write(config, summarize(args, task, env, strategy, progress))
            if do_ckpt:
                save_checkpoint(args.checkpoint, env, model, strategy, scheduler, generator, progress)
            watch.start()  # evaluation and checkpointing are not training time

    result = summarize(args, task, env, strategy, progress)
    runlog.write(config, result)
    if env.is_main and args.out:
        plot_runs({args.optimizer: runlog.rows}, os.path.join(args.out, "loss.png"),
                  title=f"{task.description} ({env.world_size} ranks)")
    log.info("done: %s", json.dumps({k: round(v, 5) if isinstance(v, float) else v for k, v in result.items()}))
    strategy.shutdown()
    close_distributed(env)
    return result
