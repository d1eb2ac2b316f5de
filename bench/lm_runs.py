"""Launching examples/train_lm.py under torchrun from a benchmark script (bench/demo.py, bench/adaptive.py): the
same model, data and evaluation flags for every run of a comparison, and its log.json read back."""

import json
import logging
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import decent_comm  # noqa: E402

log = logging.getLogger("bench")


def decentralized_adam_lr(allreduce_lr: float, nproc: int, rule: str = "sqrt", accum_steps: int = 1) -> float:
    """The lr of a decentralized Adam-family run next to an all-reduce AdamW baseline at `allreduce_lr`: rule
    "sqrt" is decent_comm.decentralized_adam_hparams (sqrt(n), or sqrt(n / accum_steps) for AccumAdam, which
    says why); "none" keeps the baseline's lr."""
    if rule not in ("sqrt", "none"):
        raise ValueError(f"unknown lr rule {rule!r} (use 'sqrt' or 'none')")
    if rule == "none":
        return allreduce_lr
    return decent_comm.decentralized_adam_hparams(allreduce_lr, nproc, accum_steps=accum_steps)["lr"]


def accum_flags(accum_steps: int):
    """train_lm flags of an AccumAdamW run next to an AdamW baseline with betas (0.9, 0.999): the per-window betas
    of decent_comm.decentralized_adam_hparams, which keep the moments' memory in steps equal to AdamW's."""
    betas = decent_comm.decentralized_adam_hparams(1.0, 1, accum_steps=accum_steps)["betas"]
    return ["--accum-steps", str(accum_steps), "--betas", f"{betas[0]:.4g},{betas[1]:.4g}"]


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
