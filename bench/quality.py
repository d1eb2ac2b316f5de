"""Quality at equal steps: decentralized optimizers against the all-reduce baseline on train_lm.

For each world size n (default 4 and 8 local CPU ranks) it runs examples/train_lm.py with

  allreduce               torch DDP + torch.optim.AdamW at --lr (the baseline)
  dadamw one-peer-exp     decent_comm.DAdamW, one neighbour per step
  dadamw aer              DAdamW on aer, emulating n/2 nodes x 2 ranks (--local-world-size 2)
  accumadamw one-peer-exp decent_comm.AccumAdamW, with per-window betas (0.9^K, 0.999^K) (see lm_runs.decentralized_adam_flags)
  accumadamw aer          AccumAdamW on aer (n/2 nodes x 2 ranks)

each decentralized run in both modes, atc (adapt then combine: the local step is mixed before the next forward)
and awc (communicate while adapting: the mix of x^t overlaps the whole next forward+backward), all with the same
model, data, seed, warmup-cosine schedule and number of steps, and prints one table per n:
final validation loss of the global-average model and its gap to all-reduce (target: within 2%).

The lr rule (--lr-rule sqrt, the default; decent_comm.decentralized_adam_hparams says why) gives DAdamW sqrt(n) times
the baseline lr and AccumAdamW sqrt(n / accum_steps) times it; `--lr-rule none` runs every optimizer at --lr.

With --wires fp32,int8 (or bf16) every decentralized run also runs over that wire, and a line per run gives its
final loss against the same run over the fp32 wire.

    python bench/quality.py [--nprocs 4,8] [--modes atc,awc] [--wires fp32,int8] [--steps 300] [--lr 3e-3]
                            [--lr-rule sqrt|none] [--quick]
"""

import argparse
import json
import logging
import os

from bench_args import count, even_ranks, listed, names  # bench/, this script's directory
from decent_comm.optim import MODES
from demo import table
from lm_runs import add_run_args, decentralized_adam_flags, run_train_lm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

log = logging.getLogger("quality")

OPTIMIZERS = ("dadamw", "accumadamw")
TOPOLOGIES = {"one-peer-exp": [], "aer": ["--local-world-size", "2"]}
#: --wires: what a decentralized run sends (fp32: the parameters' dtype)
WIRES = {"fp32": [], "bf16": ["--bf16-wire"], "int8": ["--int8-wire"]}


def runs(args, nproc: int):
    """(label, train_lm flags) of the runs at world size nproc, the baseline first."""
    out = [("allreduce", ["--optimizer", "allreduce", "--lr", f"{args.lr:g}"])]
    for opt in args.optimizers:
        hp_flags = decentralized_adam_flags(args.lr, nproc, args.accum_steps if opt.startswith("accum") else None,
                                            args.lr_rule)
        for topo in args.topologies:
            for mode in args.modes:
                for wire in args.wires:
                    label = f"{opt} {topo} {mode}" + ("" if wire == "fp32" else f" {wire}")
                    out.append((label, ["--optimizer", opt, "--topology", topo, "--mode", mode, *hp_flags,
                                        *TOPOLOGIES[topo], *WIRES[wire]]))
    return out


def wire_gaps(results, wires):
    """Markdown lines: each narrower wire's final validation loss against the same run over the fp32 wire."""
    loss = {label: r["summary"].get("final_val_loss") for label, r in results}
    lines = []
    for label, value in loss.items():
        wire = label.rsplit(" ", 1)[-1]
        base = loss.get(label.rsplit(" ", 1)[0]) if wire in wires and wire != "fp32" else None
        if base and value is not None:
            lines.append(f"- {label}: {value:.4f} vs {base:.4f} over fp32 ({100 * (value / base - 1):+.2f}%)")
    return lines


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "quality"), help="directory for logs and tables")
    p.add_argument("--nprocs", type=listed(even_ranks), default="4,8",
                   help="comma-separated world sizes (even: aer pairs ranks into nodes)")
    add_run_args(p, eval_every=50)
    p.add_argument("--warmup", type=count(0), default=None, help="warmup steps (default: 30%% of --steps)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak lr of the all-reduce AdamW baseline")
    p.add_argument("--lr-rule", choices=("sqrt", "none"), default="sqrt",
                   help="decentralized Adam-family lr: sqrt(n) x --lr, or --lr itself")
    p.add_argument("--accum-steps", type=count(1), default=4, help="AccumAdamW's accumulation window")
    p.add_argument("--optimizers", type=names(OPTIMIZERS), default=",".join(OPTIMIZERS),
                   help="decentralized optimizers to run")
    p.add_argument("--topologies", type=names(list(TOPOLOGIES)), default=",".join(TOPOLOGIES),
                   help="topologies to run them on")
    p.add_argument("--modes", type=names(MODES), default="atc,awc",
                   help=f"decentralized modes to run each in ({', '.join(MODES)})")
    p.add_argument("--wires", type=names(list(WIRES)), default="fp32",
                   help=f"wires to run each decentralized run over ({', '.join(WIRES)}); "
                   "a narrower one is also compared with the fp32 run")
    p.add_argument("--quick", action="store_true", help="30 steps at 4 ranks, for checking the pipeline only")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.eval_every, args.nprocs = 30, 15, [4]
    if args.warmup is None:
        args.warmup = max(1, args.steps * 3 // 10)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s quality: %(message)s", datefmt="%H:%M:%S")

    sections, summary = [], {}
    for nproc in args.nprocs:
        args.nproc = nproc
        results = []
        for i, (label, flags) in enumerate(runs(args, nproc)):
            out_dir = os.path.join(args.out, f"n{nproc}_run{i}")
            results.append((label, run_train_lm(label, [*flags, "--warmup", str(args.warmup)], args, out_dir,
                                                "quality")))
        gaps = wire_gaps(results, args.wires)
        sections.append(f"### {nproc} ranks\n\n{table(results)}\n" + ("\n" + "\n".join(gaps) + "\n" if gaps else ""))
        summary[nproc] = {label: r["summary"] for label, r in results}

    header = (f"train_lm: {args.layers} layers, d_model {args.d_model}, seq {args.seq_len}, batch {args.batch_size}"
              f"/rank, {args.steps} steps (warmup {args.warmup}, cosine to 0.1x), seed {args.seed}; allreduce lr "
              f"{args.lr:g}, decentralized lr rule '{args.lr_rule}'")
    text = header + "\n\n" + "\n".join(sections)
    print("\n" + text)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(text)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"args": {k: v for k, v in vars(args).items()}, "summary": summary}, f, indent=1)
    print(f"table: {os.path.join(args.out, 'results.md')}")


if __name__ == "__main__":
    main()
