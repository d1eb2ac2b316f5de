"""A compute-controlled training workload for the cluster benchmarks: the examples' training loop
(decent_train.loop: same flags, optimizers, DDP baseline, logs) on a model whose size and compute time are
set independently.

    torchrun --standalone --nproc_per_node 4 bench/synthetic_train.py --params 1M --compute-ms 100 \\
        --optimizer dadamw --topology one-peer-exp

The model is `--layers` square Linear+GELU blocks and a linear head (about --params parameters in all) that
learns a fixed random linear "teacher" classifier (--classes classes) of the first 8 of its Gaussian inputs, so the
validation loss falls as with a real task. Its compute is `time.sleep`: each block sleeps --compute-ms / 3
/ layers in its forward and 2 x that in its backward (autograd), so

* the compute time is what the flag says, whatever else runs on the machine: sleeping ranks leave the CPU
  to communication, as a GPU's compute leaves the host's network stack alone (on 2 shared cores, real CPU
  compute and the communication threads would slow each other down);
* DDP's bucketed all-reduce can overlap the backward's sleeps, and the decentralized exchange the whole
  forward + backward, exactly as the runtime model (decent_comm.runtime_model) assumes: forward 1/3,
  backward 2/3.

The real arithmetic is kept small (batch --batch-size, default 8): a few ms per step for 1M parameters.
"""

import argparse
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from decent_comm.runtime_model.units import parse_count

from .. import cli
from ..flags import add_common_args, count, number
from ..task import Task

# Peak lr: Adam family from {1e-3, 2e-3, 4e-3, 8e-3} (250k parameters, 4 ranks x batch 8, 60 steps; final validation
# loss DDP 1.12 / 0.90 / 0.76 / 0.75, DAdamW one-peer-exp 1.24 / 1.03 / 0.79 / 0.71): 4e-3 is near the best for both.
# At 1e-3 the decentralized run trails by 10%: every rank's Adam normalizes its own noisier gradient, so its steps are
# smaller than those of Adam on the averaged gradient. AccumAdam and SGD: reasonable, untuned.
LR_DEFAULTS = {"adam": 4e-3, "accum": 2e-3, "sgd": 0.05}
TEACHER_SEED = 12345


class _Sleep(torch.autograd.Function):
    """Identity whose forward and backward each take a fixed wall-clock time."""

    @staticmethod
    def forward(ctx, x, forward_s: float, backward_s: float):
        ctx.backward_s = backward_s
        if forward_s > 0:
            time.sleep(forward_s)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if ctx.backward_s > 0:
            time.sleep(ctx.backward_s)
        return grad, None, None


class Block(nn.Module):
    """x + gelu(linear(x)), then the compute sleep (skipped under no_grad: evaluation is not timed)."""

    def __init__(self, width: int, forward_s: float, backward_s: float):
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.forward_s, self.backward_s = forward_s, backward_s

    def forward(self, x):
        y = x + F.gelu(self.linear(x))
        return _Sleep.apply(y, self.forward_s, self.backward_s) if torch.is_grad_enabled() else y


class SyntheticNet(nn.Module):
    def __init__(self, width: int, layers: int, classes: int, compute_s: float):
        super().__init__()
        per_block = compute_s / max(1, layers)
        self.blocks = nn.ModuleList(Block(width, per_block / 3, 2 * per_block / 3) for _ in range(layers))
        self.head = nn.Linear(width, classes)
        for b in self.blocks:
            nn.init.normal_(b.linear.weight, std=0.5 / math.sqrt(width))
            nn.init.zeros_(b.linear.bias)
        nn.init.zeros_(self.head.weight)  # the loss starts at ln(classes)
        nn.init.zeros_(self.head.bias)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def width_for(params: float, layers: int, classes: int) -> int:
    """Width w with layers * (w^2 + w) + classes * (w + 1) ~ params."""
    a, b, c = layers, layers + classes, classes - params
    return max(4, int((-b + math.sqrt(b * b - 4 * a * c)) / (2 * a)))


def whole_count(text: str) -> int:
    """--params as a whole number: a checkpoint records it (must_match), and 4.1M, parsed as 4099999.9999999995, was
    refused on a resume with 4100k."""
    return round(parse_count(text))


def build_task(args, env) -> Task:
    width = width_for(args.params, args.layers, args.classes)
    model = SyntheticNet(width, args.layers, args.classes, args.compute_ms / 1e3)
    # The labels depend on the first 8 input features only, so a few hundred samples already teach something.
    teacher = torch.zeros(width, args.classes)
    teacher[:8] = torch.randn(min(8, width), args.classes, generator=torch.Generator().manual_seed(TEACHER_SEED))

    def sample(g: torch.Generator):
        x = torch.randn(args.batch_size, width, generator=g)
        return x, (x @ teacher).argmax(-1)

    # The validation set: the same fixed draws on every run, sharded over the ranks.
    vg = torch.Generator().manual_seed(TEACHER_SEED + 1)
    xs = torch.randn(args.eval_samples, width, generator=vg)
    ys = (xs @ teacher).argmax(-1)
    shard = range(env.rank * 256, args.eval_samples, env.world_size * 256)
    val = [(xs[i:i + 256], ys[i:i + 256]) for i in shard]
    n = sum(p.numel() for p in model.parameters())
    return Task(model=model, sample_batch=sample, val_batches=val, items_per_batch=args.batch_size,
                       item_name="samples", report_accuracy=True,
                       description=f"synthetic teacher task: width {width} x {args.layers} blocks, {n / 1e6:.2f}M "
                                   f"parameters, {args.compute_ms:g} ms of sleep compute per step",
                       model_flags=("params", "layers", "classes"))  # --compute-ms: the sleeps only


def build_parser() -> argparse.ArgumentParser:
    parser = cli.make_parser(__doc__)
    add_common_args(parser, steps=100, batch_size=8, eval_every=20)
    g = parser.add_argument_group("synthetic model")
    g.add_argument("--params", type=whole_count, default=1_000_000, help="parameters (e.g. 1M, 250k) (default: 1M)")
    g.add_argument("--layers", type=count(1), default=4, help="square blocks (DDP buckets form along them)")
    g.add_argument("--classes", type=count(2), default=4, help="teacher classes")
    g.add_argument("--compute-ms", type=number(), default=100.0,
                   help="forward + backward time per step (sleep; 1/3 forward, 2/3 backward)")
    g.add_argument("--eval-samples", type=count(1), default=1024, help="validation samples (all ranks together)")
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    return cli.parse(build_parser(), argv)


def main(argv=None) -> dict:
    return cli.main(parse_args, build_task, LR_DEFAULTS, argv)
