"""Launching examples/train_lm.py under torchrun from a benchmark script (bench/demo.py, bench/adaptive.py): the
same model, data and evaluation flags for every run of a comparison, and its log.json read back."""

import json
import logging
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
log = logging.getLogger("bench")


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
