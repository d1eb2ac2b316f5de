"""A picture of where the time of a training step goes, from torch.profiler traces of the demo's model: DDP
(torch AdamW + gradient all-reduce) next to decent_comm.DAdamW (one-peer-exp), 2 ranks under torchrun, rank 0.

    python bench/trace_picture.py                      # -> docs/trace_overlap.png + a table on stdout
    python bench/trace_picture.py --traces DIR         # draw traces already written (DIR/<run>/trace_rank0.json)

Each run is examples/train_lm.py with --profile (decent_train/profiling.py: 4 recorded steps after 5 others).
Lanes, top to bottom: the training phases (train::forward / backward / optimizer_step), decent_comm's own
ranges (decent_comm::exchange_launch / exchange_wait / mix_update ...) and, for DAdamW, "exchange in flight":
from the end of a launch to the end of the wait that collects it. That bar is an upper bound on the transfer
(the exchange may finish earlier, unseen by the host); what the host really lost to communication is the
wait. DDP's all-reduce runs inside backward (its gradient hooks), so DDP shows no separate lane: its cost is
in the backward bar.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

from bench_args import output_file  # bench/, this script's directory
from decent_train.profiling import ACTIVE_STEPS, SKIP_STEPS, WARMUP_STEPS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS = {  # label -> train_lm flags
    "DDP + AdamW": ["--optimizer", "allreduce"],
    "DAdamW one-peer-exp": ["--optimizer", "dadamw", "--topology", "one-peer-exp", "--mode", "awc"],
}
MODEL = ["--layers", "2", "--d-model", "128", "--seq-len", "64", "--batch-size", "16", "--corpus-mb", "0.5",
         "--eval-tokens", "2048", "--eval-every", "1000", "--no-progress"]
PHASES = ("train::forward", "train::backward", "train::optimizer_step")
COLORS = {"train::forward": "#4c72b0", "train::backward": "#55a868", "train::optimizer_step": "#c44e52",
          "decent_comm::exchange_launch": "#8172b2", "decent_comm::exchange_wait": "#dd8452",
          "in flight": "#bbbbbb"}


def run(label: str, flags, out_dir: str, steps: int):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           os.path.join(ROOT, "examples", "train_lm.py"), *flags, *MODEL, "--steps", str(steps),
           "--profile", out_dir]
    proc = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"trace_picture: the {label} run failed ({proc.returncode}):\n{proc.stderr[-4000:]}")


def ranges(path: str):
    """[(name, start_ms, end_ms)] of the main thread's train:: and decent_comm:: ranges, times from the first."""
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    ours = [e for e in events if e.get("ph") == "X" and str(e.get("name", "")).startswith(("train::", "decent_comm::"))]
    t0 = min(e["ts"] for e in ours)
    return sorted((e["name"], (e["ts"] - t0) / 1e3, (e["ts"] + e["dur"] - t0) / 1e3) for e in ours)


def in_flight(rs):
    """Launch end -> end of the first wait after it: when the host let the exchange run unattended."""
    out = []
    launches = [r for r in rs if r[0] == "decent_comm::exchange_launch"]
    waits = sorted((r for r in rs if r[0] == "decent_comm::exchange_wait"), key=lambda r: r[1])
    for _, _, end in launches:
        nxt = [w for w in waits if w[1] >= end]
        if nxt:
            out.append(("in flight", end, nxt[0][2]))
    return out


def summary(rs):
    total = max(r[2] for r in rs) - min(r[1] for r in rs)
    spent = {}
    for name, a, b in rs:
        spent[name] = spent.get(name, 0.0) + (b - a)
    return total, spent


def draw(traces, png: str):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(traces), 1, figsize=(12, 1.6 + 1.1 * len(traces)), squeeze=False,
                             sharex=True)
    for ax, (label, rs) in zip(axes[:, 0], traces.items()):
        lanes = [("phases", [r for r in rs if r[0] in PHASES]),
                 ("decent_comm", [r for r in rs if r[0].startswith("decent_comm::exchange")]),
                 ("exchange in flight", in_flight(rs))]
        lanes = [(n, items) for n, items in lanes if items]
        for y, (_, items) in enumerate(reversed(lanes)):
            for name, a, b in items:
                ax.broken_barh([(a, max(b - a, 0.05))], (y + 0.1, 0.8), color=COLORS.get(name, "#999999"))
        ax.set_yticks([y + 0.5 for y in range(len(lanes))], [n for n, _ in reversed(lanes)])
        ax.set_title(label, loc="left", fontsize=10)
        ax.set_xlabel("ms (rank 0, 4 profiled steps)")
    handles = [matplotlib.patches.Patch(color=c, label=n.split("::")[-1]) for n, c in COLORS.items()]
    fig.legend(handles=handles, loc="upper right", ncol=len(handles), fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    fig.savefig(output_file(png), dpi=110)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--traces", default=None, help="directory of traces already written (skips the runs)")
    parser.add_argument("--steps", type=int, default=12, help="steps per run (the profiler records steps 6-9)")
    parser.add_argument("--png", default=os.path.join(ROOT, "docs", "trace_overlap.png"),
                        help="where the picture goes (default docs/trace_overlap.png: replaces the one "
                             "docs/benchmarks.md shows)")
    args = parser.parse_args()
    if not args.traces and args.steps < SKIP_STEPS + WARMUP_STEPS + ACTIVE_STEPS:
        parser.error(f"--steps must be >= {SKIP_STEPS + WARMUP_STEPS + ACTIVE_STEPS}: the profiler skips "
                     f"{SKIP_STEPS + WARMUP_STEPS} steps and records {ACTIVE_STEPS} (decent_train/profiling.py)")
    base = args.traces or tempfile.mkdtemp(prefix="decent_comm_trace_")
    traces = {}
    for i, (label, flags) in enumerate(RUNS.items()):
        out = os.path.join(base, f"run{i}")
        if not args.traces:
            run(label, flags, out, args.steps)
        traces[label] = ranges(os.path.join(out, "trace_rank0.json"))
    draw(traces, args.png)
    print("| run | 4 steps (ms) | forward | backward | optimizer step | of it: exchange wait | launch |")
    print("|---|---|---|---|---|---|---|")
    for label, rs in traces.items():
        total, spent = summary(rs)
        cells = [spent.get(n, 0.0) for n in (*PHASES, "decent_comm::exchange_wait", "decent_comm::exchange_launch")]
        print(f"| {label} | {total:.1f} | " + " | ".join(f"{c:.1f}" for c in cells) + " |")
    print(f"picture: {args.png}; traces: {base}")


if __name__ == "__main__":
    main()
