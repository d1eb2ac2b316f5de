"""Time to a target validation loss on the emulated cluster: what users buy decentralized training for.

    sudo .venv/bin/python bench/time_to_target.py --quick                 # smoke run, ~4 min on 2 cores
    sudo .venv/bin/python bench/time_to_target.py --layouts 4x1,2x2 --seeds 0,1    # docs/time_to_target.md

For a workload (--workload lm: examples/train_lm.py's GPT; digits: the classifier), each cluster layout
(--layouts NODESxRANKS) and each link phase (--links comm: --comm-bw, default the workload's comm-bound bandwidth;
compute: unshaped links), one emulated-cluster job (bench/cluster.py's run_job and bench/cluster_worker.py: network
namespaces, tc tbf links, one torchrun per node) trains every configuration (--configs, specs of
bench/ttt_configs.py: DDP, periodic averaging, gossip graphs with their cadence, mode, wire and lr schedule; each
with its own step budget = schedule length) for every seed, and reports per phase:

* target: DDP's final validation loss x --target-factor (1.02) of the same seed, or --target LOSS;
* per configuration: mean step time (training time / steps after the first evaluation) and its ratio to DDP's;
  time to target (training time, evaluation excluded, linear between evaluations) and its ratio to DDP's time
  to target; steps to target; the validation loss at 0.25x DDP's time to target and at DDP's end (the loss each
  run has reached when DDP has finished); its final loss;
* the checks of issue #18: the best gossip configuration reaches the target in <= 0.25x DDP's time and no later
  than the best periodic-averaging configuration of the same run.

Every evaluation first completes the exchange in flight (decent_train.loop: charged to training time, as it would
be without the evaluation). Writes OUT.json, OUT.md (the tables) and OUT.png (validation loss against training
time, one panel per layout and phase; --out, default bench/results/time_to_target[_quick]).
"""

import argparse
import json
import logging
import os
import shutil
import statistics
import tempfile
import time

import ttt_configs
from bench_args import count, layout, link_bandwidth, listed, names, number, output_file  # bench/, as is cluster
from cluster import WORKLOAD_DEFAULTS, mean_step_s, run_job, time_to_loss
from decent_train.cluster import format_bits, parse_bandwidth_bits
from decent_train.flag_sets import extra_flags_for

HERE = os.path.dirname(os.path.abspath(__file__))
log = logging.getLogger("time_to_target")

QUICK_CONFIGS = "ddp/s40;periodic8/s60;one-peer-exp/awc/int8/s50"
# docs/time_to_target.md: the int8-wire recipes (the winners at 4 x 1 and 2 x 2), the bf16 recipe before them, and
# the best periodic averaging
DEFAULT_CONFIGS = ("ddp;periodic8/s400;one-peer-exp/awc/k2/bf16/delayed/s400;one-peer-exp/awc/int8/s300;"
                   "one-peer-hypercube/awc/int8/s300")


# ------------------------------------------------------------------------------------------ the jobs

def make_plan(args, configs, out: str) -> dict:
    """bench/cluster_worker.py's plan: one phase per --links entry, every (seed, config) run in each."""
    wl = WORKLOAD_DEFAULTS[args.workload]
    bandwidth = {"comm": args.comm_bw or wl["comm_bw"], "compute": args.compute_bw}
    phases = []
    for link in args.links:
        runs = []
        for seed in args.seeds:
            for cfg in configs:
                extra = extra_flags_for(cfg.optimizer, args.extra_flags)  # DDP's run refuses the gossip flags
                argv = [*wl["script_flags"], *extra, *cfg.flags, "--steps", str(cfg.steps),
                        "--eval-every", str(args.eval_every), "--log-every", str(args.eval_every), "--seed", str(seed)]
                runs.append({"name": f"{cfg.dir_name}.s{seed}", "argv": argv, "extra": "none",
                             "config": cfg.spec, "seed": seed})
        phases.append({"name": f"{link}-bound", "bandwidth": bandwidth[link], "runs": runs})
    return {"workload": args.workload, "out": out, "compute_probe_steps": args.probe_steps,
            "link_probe_bytes": 4 << 20, "phases": phases}


# ------------------------------------------------------------------------------------------ analysis

def interp(rows, xkey: str, ykey: str, x: float):
    """y at x, linear between rows that have both keys; None before the first row, the last y after the last."""
    pts = [(r[xkey], r[ykey]) for r in rows if r.get(xkey) is not None and r.get(ykey) is not None]
    if not pts or x < pts[0][0]:
        return None
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x0 <= x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0) if x1 > x0 else y1
    return pts[-1][1]


def analyze(job: dict, args) -> list:
    """Per phase: the target, DDP's time to it, and per run the measures of the module docstring."""
    phases = []
    for planned, measured in zip(job["plan"]["phases"], job["phases"]):
        meta = {r["name"]: r for r in planned["runs"]}
        runs = [{**meta[r["name"]], "rows": r["rows"], "summary": r["summary"]} for r in measured["runs"]]
        out = []
        for seed in args.seeds:
            mine = [r for r in runs if r["seed"] == seed]
            ddp = next((r for r in mine if r["config"].split("/")[0] == "ddp"), None)
            if args.target is None and ddp is None:
                raise SystemExit("time_to_target: no ddp run to take the target from: add ddp to --configs or give --target")
            target = args.target if args.target is not None else ddp["summary"]["final_val_loss"] * args.target_factor
            t_ddp = time_to_loss(ddp["rows"], target) if ddp else None
            ddp_step = mean_step_s(ddp["rows"]) if ddp else None
            ddp_end = ddp["summary"]["train_time_s"] if ddp else None
            for r in mine:
                rows, step = r["rows"], mean_step_s(r["rows"])
                t = time_to_loss(rows, target)
                out.append({"config": r["config"], "seed": seed, "steps": r["summary"]["steps"], "target": target,
                            "mean_step_s": step, "speedup": ddp_step / step if ddp_step else None,
                            "time_to_target_s": t, "fraction": t / t_ddp if t is not None and t_ddp else None,
                            "steps_to_target": interp(rows, "train_time_s", "step", t) if t is not None else None,
                            "loss_at_quarter": interp(rows, "train_time_s", "val_loss", 0.25 * t_ddp) if t_ddp else None,
                            "loss_at_ddp_end": interp(rows, "train_time_s", "val_loss", ddp_end) if ddp_end else None,
                            "ended_before_ddp": bool(ddp_end and r["summary"]["train_time_s"] < ddp_end),
                            "final_val_loss": r["summary"]["final_val_loss"], "train_time_s": r["summary"]["train_time_s"],
                            "ddp_time_to_target_s": t_ddp, "rows": rows})
        phases.append({"name": measured["name"], "bandwidth": measured["bandwidth"], "link": measured["link"],
                       "gamma": measured["link"]["allreduce_s"] / job["compute"]["mean_s"], "runs": out})
    return phases


def by_config(runs) -> dict:
    """config -> its runs (one per seed), in the order first seen."""
    out = {}
    for r in runs:
        out.setdefault(r["config"], []).append(r)
    return out


def mean_fraction(runs):
    """Mean over seeds of time to target / DDP's; None when a seed missed the target."""
    fr = [r["fraction"] for r in runs]
    return None if not fr or any(f is None for f in fr) else statistics.fmean(fr)


def checks(phase: dict) -> list:
    """Issue #18 on a phase: the best gossip configuration <= 0.25x DDP and <= the best periodic averaging."""
    groups = by_config(phase["runs"])
    kind = {c: ttt_configs.parse(c, 1) for c in groups}
    periodic = [(mean_fraction(rs), c) for c, rs in groups.items() if kind[c].is_periodic]
    gossip = [(mean_fraction(rs), c) for c, rs in groups.items() if not kind[c].is_ddp and not kind[c].is_periodic]
    best_p = min((x for x in periodic if x[0] is not None), default=None)
    best_g = min((x for x in gossip if x[0] is not None), default=None)
    if best_g is None:
        return [{"met": False, "text": "no gossip configuration reached the target"}]
    out = [{"met": best_g[0] <= 0.25, "text": f"best gossip configuration {best_g[1]}: {best_g[0]:.2f}x DDP's time to "
                                              f"target (target <= 0.25x)"}]
    if best_p is not None:
        out.append({"met": best_g[0] <= best_p[0], "text": f"best periodic averaging {best_p[1]}: {best_p[0]:.2f}x "
                                                           f"(the gossip configuration must be no slower)"})
    return out


# ------------------------------------------------------------------------------------------ output

def _f(x, fmt):
    return "-" if x is None else fmt.format(x)


def report(jobs: list) -> str:
    lines = []
    for job in jobs:
        c = job["cluster"]
        lines.append(f"\n### {job['workload']} on {c['nodes']} nodes x {c['ranks_per_node']} ranks: {c['describe']}")
        lines.append(f"{job['compute']['description']}; compute C = {1e3 * job['compute']['mean_s']:.1f} ms/step "
                     f"(no communication, all ranks at once); load average {job['load'][0]:.1f} before, "
                     f"{job['load'][1]:.1f} after the job\n")
        for ph in job["analysis"]:
            link = format_bits(parse_bandwidth_bits(ph["bandwidth"])) if c["emulated"] else "loopback"
            seeds = sorted({r["seed"] for r in ph["runs"]})
            targets = ", ".join(f"seed {s}: {next(r['target'] for r in ph['runs'] if r['seed'] == s):.4f}" for s in seeds)
            lines.append(f"**{ph['name']}**, links {link}, gamma = T_allreduce / C = {ph['gamma']:.2f}; target loss "
                         f"{targets}\n")
            lines.append("| config | seed | steps | mean step | per step vs DDP | time to target | x DDP's | "
                         "steps to target | loss at 0.25x DDP's time | loss at DDP's end | final loss |")
            lines.append("|---|---|---|---|---|---|---|---|---|---|---|")
            for r in ph["runs"]:
                end = _f(r["loss_at_ddp_end"], "{:.4f}") + (" (ended)" if r["ended_before_ddp"] else "")
                lines.append(f"| {r['config']} | {r['seed']} | {r['steps']} | {1e3 * r['mean_step_s']:.0f} ms | "
                             f"{_f(r['speedup'], '{:.2f}x')} | {_f(r['time_to_target_s'], '{:.1f} s') if r['time_to_target_s'] is not None else 'not reached'} | "
                             f"{_f(r['fraction'], '{:.2f}')} | {_f(r['steps_to_target'], '{:.0f}')} | "
                             f"{_f(r['loss_at_quarter'], '{:.4f}')} | {end} | {r['final_val_loss']:.4f} |")
            if len(seeds) > 1:
                lines.append("\nmean over seeds, time to target / DDP's: " + ", ".join(
                    f"{c} {_f(mean_fraction(rs), '{:.2f}')}" for c, rs in by_config(ph["runs"]).items()))
            lines.append("")
            lines += [f"- [{'met' if k['met'] else 'MISSED'}] {k['text']}" for k in checks(ph)]
            lines.append("")
    return "\n".join(lines)


def plot(jobs: list, path: str):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels = [(job, ph) for job in jobs for ph in job["analysis"]]
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 4.2 * len(panels)), squeeze=False)
    for ax, (job, ph) in zip(axes[:, 0], panels):
        colors = {c: f"C{i}" for i, c in enumerate(by_config(ph["runs"]))}
        first = min(r["seed"] for r in ph["runs"])
        for r in ph["runs"]:
            val = [x for x in r["rows"] if x.get("val_loss") is not None]
            ax.plot([x["train_time_s"] for x in val], [x["val_loss"] for x in val], color=colors[r["config"]],
                    ls="-" if r["seed"] == first else "--", marker="o", ms=2.5,
                    label=r["config"] if r["seed"] == first else None)
        r0 = next(r for r in ph["runs"] if r["seed"] == first)
        ax.axhline(r0["target"], color="gray", ls=":", lw=1, label=f"target {r0['target']:.4f}")
        if r0["ddp_time_to_target_s"]:
            for x, what in ((r0["ddp_time_to_target_s"], "DDP"), (0.25 * r0["ddp_time_to_target_s"], "0.25x DDP")):
                ax.axvline(x, color="black", ls=":", lw=1)
                ax.text(x, ax.get_ylim()[1], f" {what}", fontsize=7, va="top")
        c = job["cluster"]
        ax.set_title(f"{job['workload']}, {c['nodes']}x{c['ranks_per_node']}, {ph['name']} (gamma {ph['gamma']:.1f}); "
                     f"dashed: other seeds", fontsize=9)
        ax.set_xlabel("training time (s, evaluation excluded)")
        ax.set_ylabel("validation loss (global average)")
        ax.set_ylim(top=min(ax.get_ylim()[1], r0["target"] * 1.25))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ------------------------------------------------------------------------------------------ main

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help=f"smoke run: 4x1, comm-bound, {QUICK_CONFIGS}")
    p.add_argument("--workload", default="lm", choices=sorted(WORKLOAD_DEFAULTS), help="what trains")
    p.add_argument("--layouts", type=listed(layout), default="4x1,2x2", help="comma-separated NODESxRANKS_PER_NODE")
    p.add_argument("--links", type=names(["comm", "compute"]), default="comm",
                   help="comma-separated phases: comm (--comm-bw), compute (unshaped)")
    p.add_argument("--configs", default=None, help=f"';'-separated specs (bench/ttt_configs.py; default {DEFAULT_CONFIGS})")
    p.add_argument("--steps", type=count(1), default=300, help="steps of a config without s<N>")
    p.add_argument("--seeds", default="0", help="comma-separated seeds (each config runs once per seed)")
    p.add_argument("--eval-every", type=count(1), default=None, help="evaluation interval in steps (default 25; --quick 10)")
    p.add_argument("--target", type=float, default=None, help="target validation loss (default: DDP's final x factor)")
    p.add_argument("--target-factor", type=float, default=1.02, help="target = DDP's final loss x this (default 1.02)")
    p.add_argument("--comm-bw", type=link_bandwidth, default=None, help="links of the comm phase (default: the workload's, lm 50Mbit)")
    p.add_argument("--compute-bw", type=link_bandwidth, default=None, help="links of the compute phase (default: unshaped)")
    p.add_argument("--probe-steps", type=count(1), default=12, help="steps of the compute probe")
    p.add_argument("--timeout", type=number(0.0, strictly=True), default=7200, help="seconds per torchrun job")
    p.add_argument("--out", default=None, help="result prefix (default bench/results/time_to_target[_quick])")
    p.add_argument("--keep-logs", action="store_true", help="keep the per-run logs (printed directory)")
    p.add_argument("extra_flags", nargs="*", help="after --: flags passed to every training run")
    args = p.parse_args(argv)
    if args.quick:
        args.layouts, args.links = [(4, 1)], ["comm"]
        args.configs = args.configs or QUICK_CONFIGS
        args.eval_every = args.eval_every or 10
    args.eval_every = args.eval_every or 25  # --eval-every 0 is refused above: `or` only fills in the default
    args.configs = ttt_configs.parse_list(args.configs or DEFAULT_CONFIGS, args.steps)
    args.seeds = [int(s) for s in args.seeds.split(",") if s]
    args.out = args.out or os.path.join(HERE, "results", "time_to_target_quick" if args.quick else "time_to_target")
    return args


def run(args) -> list:
    """Every layout's job, analysed (the caller reports); logs in a temporary directory."""
    work = tempfile.mkdtemp(prefix="decent_ttt_")
    jobs = []
    try:
        for nodes, ranks in args.layouts:
            load = os.getloadavg()[0]
            plan = make_plan(args, args.configs, os.path.join(work, f"{args.workload}_{nodes}x{ranks}"))
            job = run_job(plan, nodes, ranks, args.timeout)
            job.update(workload=args.workload, plan=plan, load=(load, os.getloadavg()[0]))
            job["analysis"] = analyze(job, args)
            jobs.append(job)
            print(report([job]), flush=True)
    finally:
        if args.keep_logs:
            print(f"logs kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    return jobs


def main(argv=None):
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    t0 = time.perf_counter()
    jobs = run(args)
    text = (f"bench/time_to_target.py{' --quick' if args.quick else ''} --workload {args.workload}: "
            f"{os.cpu_count()} CPU cores, total {time.perf_counter() - t0:.0f} s\n" + report(jobs))
    print("\n" + text)
    with open(output_file(args.out + ".md"), "w") as f:
        f.write(text + "\n")
    with open(args.out + ".json", "w") as f:
        json.dump({"args": {k: (v if k != "configs" else [c.spec for c in v]) for k, v in vars(args).items()},
                   "report": text, "jobs": jobs}, f, indent=1, default=str)
    plot(jobs, args.out + ".png")
    print(f"\nwrote {args.out}.md, .json and .png")
    return jobs


if __name__ == "__main__":
    main()
