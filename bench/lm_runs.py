"""Launching examples/train_lm.py under torchrun from a benchmark script (bench/demo.py, bench/adaptive.py): the
same model, data and evaluation flags for every run of a comparison, and its log.json read back."""

import json
import math
import logging
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
log = logging.getLogger("bench")


def decentralized_adam_lr(allreduce_lr: float, nproc: int, rule: str = "sqrt", accum_steps: int = 1) -> float:
    """The lr a decentralized Adam-family run gets next to an all-reduce AdamW baseline at `allreduce_lr`.

    All-reduce Adam divides by the second moment of the n-rank mean gradient; each decentralized rank divides by
    that of its own gradient, which, once gradient noise dominates, is up to n times larger, so the averaged
    step is up to sqrt(n) times shorter. AccumAdam builds its second moment from the mean gradient of a window
    of `accum_steps` steps, which takes back a factor accum_steps. rule "sqrt" scales the lr by
    sqrt(max(1, n / accum_steps)); "none" keeps it."""
    if rule not in ("sqrt", "none"):
        raise ValueError(f"unknown lr rule {rule!r} (use 'sqrt' or 'none')")
    return allreduce_lr * (math.sqrt(max(1.0, nproc / accum_steps)) if rule == "sqrt" else 1.0)


def accum_flags(accum_steps: int):
    """train_lm flags of an AccumAdamW run next to an AdamW baseline with betas (0.9, 0.999). AccumAdam's betas act
    once per window of accum_steps steps; raised to the power accum_steps they keep the moments' memory in *steps*
    equal to AdamW's. With the per-step values the momentum spans accum_steps times more steps, which a run of a few
    hundred steps cannot afford (measured in docs/quality_results.md)."""
    k = accum_steps
    return ["--accum-steps", str(k), "--betas", f"{0.9 ** k:.4g},{0.999 ** k:.4g}"]


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
