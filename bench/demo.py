"""`make demo`: decentralized vs all-reduce training of a small byte-level GPT on 4 local CPU processes.

Runs examples/train_lm.py three times with torchrun (python -m torch.distributed.run --standalone,
--nproc_per_node 4), same model, data, seed and number of steps:

  allreduce    torch DDP + torch.optim.AdamW (gradient all-reduce every step) at --lr: the baseline
  dadamw       decent_comm.DAdamW on one-peer-exp (one neighbour per step) at sqrt(nproc) x --lr
               (decent_comm.decentralized_adam_hparams says why)
  accumadamw   decent_comm.AccumAdamW on aer, emulating 2 nodes x 2 ranks (--local-world-size 2), at
               sqrt(max(1, nproc / 4)) x --lr with per-window betas (0.9^4, 0.999^4) (lm_runs.decentralized_adam_flags)

The decentralized runs use --mode (default atc: each rank's local step is mixed with its neighbours' before the
next forward, with the exchange overlapping that forward; at equal steps it trains as well as all-reduce, awc
does not on this short run: docs/quality_results.md).

then prints the final validation loss (of the global-average model), mean step time and speedup over
all-reduce, writes the table to OUT/results.md and all three loss curves to OUT/demo.png.

Then the point of the product, when network namespaces can be made (root): a small emulated cluster (4 nodes, 50
Mbit links, bench/time_to_target.py) races DDP against periodic averaging and the configuration the README
recommends (CLUSTER_CONFIGS), and writes the validation loss against wall time to OUT/cluster.png. Without root it
prints the bench/time_to_target.py command that runs that race (its full size, also under --quick). Sized to
finish in under 10 minutes on a 2-core machine; the flags below trade time for fidelity.
"""

import argparse
import logging
import os
import time

import time_to_target  # bench/, this script's directory
from bench_args import count, even_ranks
from decent_comm.optim import MODES
from decent_train.cluster.net import netns_unavailable_reason
from decent_train.plot import plot_runs
from lm_runs import add_run_args, decentralized_adam_flags, run_train_lm  # bench/, this script's directory

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

log = logging.getLogger("demo")


ACCUM_STEPS = 4
# The cluster race: DDP's 200 steps set the target (its final loss x 1.02); periodic averaging every 8 steps is what
# torch's PostLocalSGDOptimizer offers; the last is the README's recommendation for slow links.
CLUSTER_CONFIGS = "ddp/s200;periodic8/s300;one-peer-hypercube/awc/int8/s250"
# what the race below runs (without --quick), for a user to run as root; {seed}: --seed
CLUSTER_COMMAND = ("sudo .venv/bin/python bench/time_to_target.py --layouts 4x1 --links comm --seeds {seed} "
                   f"--configs '{CLUSTER_CONFIGS}'")


def runs(args):
    """(label, train_lm flags) of the three runs."""
    return [
        ("allreduce", ["--optimizer", "allreduce", "--lr", f"{args.lr:.2g}"]),
        ("dadamw one-peer-exp",
         ["--optimizer", "dadamw", "--topology", "one-peer-exp", "--mode", args.mode,
          *decentralized_adam_flags(args.lr, args.nproc)]),
        ("accumadamw aer 2x2", ["--optimizer", "accumadamw", "--topology", "aer", "--local-world-size", "2",
                                "--mode", args.mode,
                                *decentralized_adam_flags(args.lr, args.nproc, accum_steps=ACCUM_STEPS)]),
    ]


def launch(label: str, flags, args, out_dir: str) -> dict:
    return run_train_lm(label, [*flags, "--warmup", str(args.warmup)], args, out_dir, "demo")


def table(results) -> str:
    base = results[0][1]["summary"]
    lines = ["| run | lr | val loss | vs allreduce | mean step time | speedup | tokens/s | consensus dist. | "
             "wall (launch incl.) |", "|---|---|---|---|---|---|---|---|---|"]
    for label, r in results:
        s = r["summary"]
        rel = 100 * (s["final_val_loss"] - base["final_val_loss"]) / base["final_val_loss"]
        lines.append(f"| {label} | {r['config']['lr']:g} | {s['final_val_loss']:.4f} | {rel:+.2f}% | {s['mean_step_time_ms']:.1f} ms | "
                     f"{base['mean_step_time_ms'] / s['mean_step_time_ms']:.2f}x | {s['tokens_per_s']:.0f} | "
                     f"{s['final_consensus_distance']:.2e} | {r['launch_wall_s']:.0f} s |")
    worst = max(100 * (r["summary"]["final_val_loss"] / base["final_val_loss"] - 1) for _, r in results[1:])
    lines.append(f"\nQuality target (decentralized within 2% of allreduce at equal steps): "
                 f"{'met' if worst <= 2.0 else 'NOT met'} (largest gap {worst:+.2f}%).")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "demo"), help="directory for logs, table and plot")
    p.add_argument("--nproc", type=even_ranks, default=4, help="local ranks (aer's 2 emulated nodes need an even count)")
    add_run_args(p, eval_every=50)
    p.add_argument("--warmup", type=count(0), default=None, help="warmup steps of every run (default: 30%% of --steps)")
    p.add_argument("--lr", type=float, default=3e-3,
                   help="peak lr of the allreduce (AdamW) run; the decentralized runs scale it (see above)")
    p.add_argument("--mode", choices=MODES, default="atc", help="mode of the decentralized runs")
    p.add_argument("--quick", action="store_true", help="30 steps, for checking the pipeline only")
    p.add_argument("--no-cluster", action="store_true", help="skip the emulated-cluster race (needs root)")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.eval_every = 30, 15
    if args.warmup is None:
        args.warmup = max(1, args.steps * 3 // 10)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s demo: %(message)s", datefmt="%H:%M:%S")

    start, load_before = time.perf_counter(), os.getloadavg()[0]
    results = []
    for i, (label, flags) in enumerate(runs(args)):
        results.append((label, launch(label, flags, args, os.path.join(args.out, f"run{i}"))))
    total, load_after = time.perf_counter() - start, os.getloadavg()[0]

    header = (f"train_lm: {args.layers} layers, d_model {args.d_model}, seq {args.seq_len}, batch {args.batch_size}"
              f"/rank, {args.steps} steps (warmup {args.warmup}), {args.nproc} CPU ranks (gloo), seed {args.seed}, decentralized mode {args.mode}; demo wall time {total:.0f} s "
              f"on {os.cpu_count()} cores (load average {load_before:.1f} before, {load_after:.1f} after)")
    text = f"{header}\n\n{table(results)}\n"
    print("\n" + text)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(text)
    plot = os.path.join(args.out, "demo.png")
    plot_runs({label: r["rows"] for label, r in results}, plot,
                     title=f"byte-level GPT on stdlib source, {args.nproc} ranks")
    print(f"plot: {plot}\ntable: {os.path.join(args.out, 'results.md')}")
    cluster_race(args)


def cluster_race(args):
    """DDP vs periodic averaging vs the recommended gossip on 4 emulated nodes, when namespaces can be made."""
    why = "--no-cluster" if args.no_cluster else netns_unavailable_reason()
    if why is not None:
        print(f"\nThe emulated-cluster race (time to DDP's loss on slow links) needs network namespaces ({why}): "
              f"{CLUSTER_COMMAND.format(seed=args.seed)}")
        return
    steps = ["--configs", "ddp/s20;periodic8/s30;one-peer-hypercube/awc/int8/s30", "--eval-every", "10"] \
        if args.quick else ["--configs", CLUSTER_CONFIGS]
    time_to_target.main(["--layouts", "4x1", "--links", "comm", "--seeds", str(args.seed), *steps,
                         "--out", os.path.join(args.out, "cluster")])


if __name__ == "__main__":
    main()
