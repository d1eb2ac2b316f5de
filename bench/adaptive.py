"""Adaptive communication on examples/train_lm.py: fixed one-peer-exp, exp and complete graphs against an
Adaptive topology, validation loss vs steps and vs bytes sent.

Each run is `python -m torch.distributed.run --standalone --nproc_per_node N examples/train_lm.py` with the same
model, data, seed, lr schedule and number of steps; only --topology differs. The validation loss is that of the
global average of the replicas (the same held-out bytes for every run); "MB sent" is the gossip traffic per
rank (mean over ranks) counted by the exchanger, evaluation excluded.

    python bench/adaptive.py                       # 8 ranks, 300 steps: the four runs of docs/adaptive_results.md
    python bench/adaptive.py --runs adaptive --reuse   # rerun only the adaptive run, reuse the others' logs
    python bench/adaptive.py --quick               # 4 ranks, 30 steps: checks the pipeline

Writes bench/results/adaptive.json (config, per-run rows and summary), bench/results/adaptive.png (plot) and prints
the markdown table. A full run into the default --results also copies the plot to docs/adaptive_results.png (the
picture docs/adaptive_results.md shows); --docs-png PATH copies it there instead, whatever --results says.
"""

import argparse
import json
import logging
import os
import shutil
import time

from bench_args import count, output_file  # bench/, this script's directory
from lm_runs import add_run_args, run_train_lm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")
DOCS_PNG = os.path.join(ROOT, "docs", "adaptive_results.png")
log = logging.getLogger("bench.adaptive")

DEFAULT_ADAPTIVE = "adaptive:consensus:one-peer-exp,exp,complete"


def run_specs(args):
    """label -> --topology value, sparsest fixed graph first, then the densest, then the adaptive ones."""
    specs = {"one-peer-exp": "one-peer-exp", "exp": "exp", "complete": "complete", "adaptive": args.adaptive}
    if args.phase:
        specs["phase"] = args.phase
    for v in args.variant or []:
        label, _, spec = v.partition("=")
        specs[label.strip()] = spec.strip()
    return specs


def launch(label, topology, args, out_dir):
    flags = ["--optimizer", args.optimizer, "--topology", topology, "--log-every", str(args.eval_every)]
    if args.lr is not None:
        flags += ["--lr", str(args.lr)]
    if args.warmup is not None:
        flags += ["--warmup", str(args.warmup)]
    result = run_train_lm(label, flags, args, out_dir, "bench/adaptive")
    result["topology_flag"] = topology
    return result


def evals(result):
    return [r for r in result["rows"] if r.get("val_loss") is not None]


def switches(result):
    """[(step of the evaluation row, topology)] each time the logged topology changes."""
    out, last = [], None
    for r in evals(result):
        if r.get("topology") != last:
            out.append((r["step"], r.get("topology")))
            last = r.get("topology")
    return out


def summarize(results, densest="complete", tolerance=0.01):
    ref = evals(results[densest])[-1]
    rows = {}
    for label, res in results.items():
        last = evals(res)[-1]
        rows[label] = dict(final_val_loss=last["val_loss"], vs_densest=last["val_loss"] / ref["val_loss"] - 1,
                           mb_sent=last.get("bytes_sent_mb"), bytes_vs_densest=last.get("bytes_sent_mb") /
                           ref["bytes_sent_mb"] if ref.get("bytes_sent_mb") else None,
                           mean_step_time_ms=res["summary"]["mean_step_time_ms"],
                           final_consensus_distance=last.get("consensus_distance"),
                           topologies=switches(res))
    target = {}
    for label in results:
        if label.startswith(("adaptive", "phase")):
            r = rows[label]
            target[label] = dict(within=r["vs_densest"] <= tolerance, fewer_bytes=r["bytes_vs_densest"] < 1.0,
                                 vs_densest=r["vs_densest"], bytes_vs_densest=r["bytes_vs_densest"])
    return rows, target


def table(rows):
    lines = ["| run | final val loss | vs complete | MB sent / rank | bytes vs complete | mean step time | "
             "consensus dist. (final) |", "|---|---|---|---|---|---|---|"]
    for label, r in rows.items():
        lines.append(f"| {label} | {r['final_val_loss']:.4f} | {100 * r['vs_densest']:+.2f}% | {r['mb_sent']:.0f} | "
                     f"{r['bytes_vs_densest']:.2f}x | {r['mean_step_time_ms']:.0f} ms | "
                     f"{r['final_consensus_distance']:.2e} |")
    return "\n".join(lines)


def curve_table(results):
    labels = list(results)
    steps = [r["step"] for r in evals(results[labels[0]])]
    lines = ["| step | " + " | ".join(labels) + " |", "|---" * (len(labels) + 1) + "|"]
    for i, s in enumerate(steps):
        cells = []
        for label in labels:
            e = evals(results[label])
            if i < len(e):
                cell = f"{e[i]['val_loss']:.4f}"
                if label.startswith(("adaptive", "phase")):
                    cell += f" ({e[i].get('topology')})"
                cells.append(cell)
            else:
                cells.append("")
        lines.append(f"| {s} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(results, path, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    ref = {r["step"]: r["val_loss"] for r in evals(results["complete"])}
    for i, (label, res) in enumerate(results.items()):
        e = evals(res)
        kw = dict(color=f"C{i}", marker="o", ms=3, label=label, lw=2 if label.startswith("adaptive") else 1.2)
        axes[0].plot([r["step"] for r in e], [100 * (r["val_loss"] / ref[r["step"]] - 1) for r in e], **kw)
        axes[1].plot([r["bytes_sent_mb"] for r in e], [r["val_loss"] for r in e], **kw)
    axes[0].axhline(1.0, color="gray", ls="--", lw=1)
    axes[0].set_xlabel("step")
    axes[0].set_ylabel("validation loss vs complete at the same step (%)")
    axes[1].set_xlabel("MB sent per rank (gossip)")
    axes[1].set_xscale("log")
    axes[1].set_ylabel("validation loss (nats, global average)")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(output_file(path), dpi=110)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "adaptive"), help="directory of the runs' logs")
    p.add_argument("--results", default=RESULTS, help="where the JSON and PNG go (default bench/results)")
    p.add_argument("--docs-png", default=None, metavar="PATH",
                   help="also copy the plot to PATH (default: docs/adaptive_results.png for a run without --quick "
                        "into the default --results, else no copy)")
    p.add_argument("--nproc", type=count(1), default=8, help="local ranks")
    add_run_args(p, eval_every=25)
    p.add_argument("--optimizer", default="dadamw")
    p.add_argument("--lr", type=float, default=None,
                   help="peak lr (default: train_lm's for the optimizer and world size; docs/adaptive_results.md ran 3e-3)")
    p.add_argument("--warmup", type=count(0), default=None,
                   help="warmup steps (default: train_lm's, 30%% of --steps; docs/adaptive_results.md ran 30)")
    p.add_argument("--adaptive", default=DEFAULT_ADAPTIVE, help="--topology of the adaptive run")
    p.add_argument("--phase", default=None, help="also run this adaptive:phase:... schedule (label 'phase')")
    p.add_argument("--variant", action="append", metavar="LABEL=SPEC",
                   help="also run --topology SPEC under LABEL (labels starting with 'adaptive' or 'phase' are "
                        "checked against the target); repeatable")
    p.add_argument("--runs", default=None, help="comma-separated labels to (re)run (default: all)")
    p.add_argument("--reuse", action="store_true", help="reuse the logs of runs not listed in --runs")
    p.add_argument("--quick", action="store_true", help="4 ranks, 30 steps: pipeline check only")
    args = p.parse_args(argv)
    # Only the run of the default results replaces the committed picture: a run with --results elsewhere (a
    # second seed, a trial) overwrote it too.
    docs_png = args.docs_png or (DOCS_PNG if not args.quick and os.path.abspath(args.results) == RESULTS else None)
    if args.quick:
        args.nproc, args.steps, args.eval_every = 4, 30, 10
        args.out, args.results = args.out + "_quick", os.path.join(args.results, "quick")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s adaptive: %(message)s", datefmt="%H:%M:%S")

    specs = run_specs(args)
    chosen = set(args.runs.split(",")) if args.runs else set(specs)
    if chosen - set(specs):  # an unknown label ran nothing, then failed for want of the complete run
        p.error(f"--runs: unknown {sorted(chosen - set(specs))}; the runs are {', '.join(specs)}")
    results, start, load_before = {}, time.perf_counter(), os.getloadavg()[0]
    for label, topology in specs.items():
        out_dir = os.path.join(args.out, label)
        logfile = os.path.join(out_dir, "log.json")
        if label not in chosen:
            if args.reuse and os.path.isfile(logfile):
                with open(logfile) as f:
                    results[label] = {**json.load(f), "topology_flag": topology, "reused": True}
            continue
        if os.path.isdir(out_dir):
            shutil.rmtree(out_dir)
        results[label] = launch(label, topology, args, out_dir)
    total, load_after = time.perf_counter() - start, os.getloadavg()[0]
    if "complete" not in results:
        raise SystemExit("bench/adaptive: the complete run is the reference: run it or --reuse its log")

    rows, target = summarize(results)
    header = (f"train_lm ({args.optimizer}): {args.layers} layers, d_model {args.d_model}, seq {args.seq_len}, "
              f"batch {args.batch_size}/rank, {args.steps} steps, {args.nproc} CPU ranks (gloo), seed {args.seed}; "
              f"wall {total:.0f} s on {os.cpu_count()} cores (load {load_before:.1f} before, {load_after:.1f} after)")
    text = f"{header}\n\n{table(rows)}\n\nValidation loss by step:\n\n{curve_table(results)}\n"
    for label, t in target.items():
        text += (f"\nTarget for {label} (final val loss within 1% of complete with fewer bytes): "
                 f"{'met' if t['within'] and t['fewer_bytes'] else 'NOT met'} ({100 * t['vs_densest']:+.2f}%, "
                 f"{t['bytes_vs_densest']:.2f}x the bytes)")
    print("\n" + text)
    os.makedirs(args.results, exist_ok=True)
    name = "adaptive"
    with open(os.path.join(args.results, f"{name}.json"), "w") as f:
        json.dump({"config": vars(args), "summary": rows, "target": target,
                   "runs": {k: {"topology": v["topology_flag"], "rows": v["rows"], "summary": v["summary"],
                                "launch_wall_s": v.get("launch_wall_s")} for k, v in results.items()}}, f, indent=1)
    png = os.path.join(args.results, f"{name}.png")
    plot(results, png, f"byte-level GPT on stdlib source, {args.nproc} ranks, {args.optimizer}")
    if docs_png:
        shutil.copyfile(png, output_file(docs_png))
    print(f"json: {os.path.join(args.results, name + '.json')}\nplot: {png}"
          + (f" (copied to {docs_png})" if docs_png else ""))


if __name__ == "__main__":
    main()
