"""Launching examples/train_lm.py under torchrun from a benchmark script (bench/demo.py, quality.py, adaptive.py): the
same model, data and evaluation flags for every run of a comparison, and its log.json read back."""

import json
import logging
import os
import subprocess
import sys
import time

import decent_comm
from bench_args import count  # bench/, this script's directory

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

log = logging.getLogger("bench")


def decentralized_adam_flags(allreduce_lr: float, nproc: int, accum_steps=None, rule: str = "sqrt"):
    """train_lm's --lr (two significant digits, so the lr in a table is the lr that ran) and, for AccumAdamW
    (`accum_steps` given), --accum-steps and the per-window --betas, of a decentralized Adam-family run next to an
    all-reduce AdamW baseline at (`allreduce_lr`, betas (0.9, 0.999)). rule "sqrt" scales the lr as
    decent_comm.decentralized_adam_hparams says (sqrt(n), or sqrt(max(1, n / accum_steps))); "none" keeps it."""
    if rule not in ("sqrt", "none"):
        raise ValueError(f"unknown lr rule {rule!r} (use 'sqrt' or 'none')")
    hp = decent_comm.decentralized_adam_hparams(allreduce_lr, nproc, accum_steps=accum_steps or 1)
    flags = ["--lr", f"{hp['lr'] if rule == 'sqrt' else allreduce_lr:.2g}"]
    if accum_steps is not None:
        flags += ["--accum-steps", str(accum_steps), "--betas", f"{hp['betas'][0]:.4g},{hp['betas'][1]:.4g}"]
    return flags


def add_run_args(parser, eval_every: int):
    """The flags run_train_lm passes to every run of a comparison (model, data, steps, evaluation, seed)."""
    parser.add_argument("--steps", type=count(1), default=300, help="optimizer steps per run")
    parser.add_argument("--eval-every", type=count(1), default=eval_every, help="validation interval")
    parser.add_argument("--layers", type=count(1), default=2, help="transformer blocks")
    parser.add_argument("--d-model", type=count(1), default=128, help="model width")
    parser.add_argument("--seq-len", type=count(1), default=64, help="context length")
    parser.add_argument("--batch-size", type=count(1), default=16, help="batch per rank")
    parser.add_argument("--seed", type=int, default=0, help="seed shared by every run")


def run_train_lm(label: str, flags, args, out_dir: str, caller: str) -> dict:
    """One `torchrun --standalone --nproc_per_node args.nproc` job of train_lm with `flags` plus the shared flags
    in `args` (steps, eval_every, seed, layers, d_model, seq_len, batch_size); returns its log.json with
    launch_wall_s (launch included). Exits naming `caller` and the run when the job fails."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.nproc),
           os.path.join(ROOT, "examples", "train_lm.py"), *flags,
           "--steps", str(args.steps), "--eval-every", str(args.eval_every), "--seed", str(args.seed),
           "--layers", str(args.layers), "--d-model", str(args.d_model), "--seq-len", str(args.seq_len),
           "--batch-size", str(args.batch_size), "--out", out_dir, "--no-progress"]
    log.info("%s: %s", label, " ".join(cmd[1:]))
    # One intra-op thread per rank: the ranks already oversubscribe the cores.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"{caller}: the {label} run failed (exit code {proc.returncode}); its output is above")
    with open(os.path.join(out_dir, "log.json")) as f:
        result = json.load(f)
    result["launch_wall_s"] = time.perf_counter() - start
    return result
