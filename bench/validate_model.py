"""Checks decent_comm.runtime_model against step times measured on the emulated cluster.

    sudo .venv/bin/python bench/validate_model.py            # 40 configurations, ~10 min on 2 cores
    sudo .venv/bin/python bench/validate_model.py --quick    # 20 configurations (4x1 only), ~5 min
    .venv/bin/python bench/validate_model.py --from-json bench/results/validate_model.json   # re-evaluate only

Grid: layouts (NODESxRANKS) x link bandwidths x {allreduce, one-peer-exp, aer, aer-pair, ring} x straggler std
{0, 0.3}, the synthetic workload (bench/synthetic_train.py: 250k parameters = 1 MB per message, 100 ms of
sleep compute, DDP / DAdamW in AWC mode) in network namespaces with tc-tbf-shaped node links
(decent_train/cluster, jobs run by bench/cluster_worker.py as in bench/cluster.py).

The model's inputs are measured in the same job, the way the runtime model defines them:
* compute C: per-step forward + backward + optimizer update with no communication, every rank at once
  (cluster_worker.compute_probe); the model gets the measured sample (ComputeTime.from_sample). For straggler
  runs the sample is convolved with the emulated extra sleep max(0, N(MEAN, STD)) (STD = 0.3 x mean compute,
  MEAN = 2 STD; see cluster_worker.py).
* inter_bandwidth: per-direction rate of one node link under full-duplex load (back-to-back exchanges
  between a rank of node 0 and one of node 1), inter_latency: half a small-message round trip; intra_*: the
  same between two ranks of node 0 (loopback inside the namespace).
* params (bytes on the wire / 4), mode awc, DDP bucket 25 MiB (the model's default, as DDP).
Measured: mean step time = training wall time / steps after a warm-up interval, slowest rank included
(bench/cluster.py: mean_step_s).

Predictions: `predict` (closed form) and `simulate` / `simulate_allreduce` (discrete-event simulator). By
default (`ClusterConfig.backend = "nccl"`, what `plan` prints without --backend) the model prices an all-reduce
as a hierarchical ring (intra-node reduce-scatter, inter-node rings, all-gather), as NCCL does; gloo's DDP and
group all-reduces run one flat ring over all ranks, whose node links carry 2 (n-1)/n B instead of 2 (N-1)/N B.
The column "gloo" is the closed form with `backend="gloo"` (`runtime_model.allreduce.ring_allreduce`, what
`plan --backend gloo` prints) for every run; the headline errors use the default.

Writes docs/runtime_model_validation.md (table + summary), docs/runtime_model_validation.png (predicted vs
measured) and bench/results/validate_model[_quick].json. Targets: median |error| <= 15%, worst <= 30%.
"""

import argparse
import json
import logging
import os
import shutil
import statistics
import tempfile
import time

import numpy as np

import cluster as bench_cluster  # bench/, this script's directory
from bench_args import count, layout, link_bandwidth, listed, number, output_file
from decent_comm import runtime_model as rm
from decent_comm import topology as dc_topology
from decent_train.cluster import format_bits, parse_bandwidth_bits
from decent_train.flags import topology_name

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

log = logging.getLogger("validate_model")
SCRIPT_FLAGS = ["--params", "250k", "--compute-ms", "100"]
STRAGGLER = {"std": 0.3, "mean_over_std": 2.0}


def make_plan(args, out: str) -> dict:
    phases = []
    for bw in args.bandwidths:
        for std in args.stds:
            runs = []
            for topo in ["allreduce", *args.topologies]:
                flags = SCRIPT_FLAGS + ["--steps", str(args.steps), "--eval-every", str(args.eval_every),
                                        "--log-every", str(args.eval_every), "--seed", str(args.seed)]
                flags += ["--optimizer", "allreduce"] if topo == "allreduce" else ["--optimizer", "dadamw", "--topology", topo]
                runs.append({"name": topo, "argv": flags, "extra": "random" if std > 0 else "none"})
            phase = {"name": f"{bw} std {std:g}", "bandwidth": bw, "runs": runs}
            if std > 0:
                phase["straggler"] = {**STRAGGLER, "std": std}
            phases.append(phase)
    return {"workload": "synthetic", "out": out, "compute_probe_steps": args.probe_steps,
            "link_probe_bytes": 2 << 20, "phases": phases}


def compute_model(job: dict, phase: dict, rng: np.random.Generator) -> rm.ComputeTime:
    """The measured compute sample, plus the emulated straggler sleep when the phase has one."""
    base = np.array([t for ts in job["compute"]["per_rank"] for t in ts])
    if not phase.get("straggler_ms"):
        return rm.ComputeTime.from_sample(base.tolist())
    m, s = (v / 1e3 for v in phase["straggler_ms"])
    draws = rng.choice(base, 4000) + np.maximum(0.0, rng.normal(m, s, 4000))
    return rm.ComputeTime.from_sample(draws.tolist())


def cluster_model(job: dict, phase: dict) -> rm.ClusterConfig:
    c, link = job["cluster"], phase["link"]
    N, L = c["nodes"], c["ranks_per_node"]
    return rm.ClusterConfig(nodes=N, ranks_per_node=L,
                            inter_bandwidth=link.get("inter_bandwidth_Bps", 1e12),
                            intra_bandwidth=link.get("intra_bandwidth_Bps", 1e12),
                            inter_latency=link.get("inter_latency_s", 0.0),
                            intra_latency=link.get("intra_latency_s", 0.0))


def predictions(cl: rm.ClusterConfig, wl: rm.Workload, name: str, sim_steps: int) -> dict:
    topo = "allreduce" if name == "allreduce" else dc_topology.make(name, cl.world_size, cl.ranks_per_node)
    closed = rm.predict(cl, wl, topo).step_seconds
    # gloo's flat ring, which these runs use: the model's own backend (DDP and any group all-reduce step)
    flat = rm.predict(cl.with_(backend="gloo"), wl, topo).step_seconds
    if name == "allreduce":
        sim = rm.simulate_allreduce(cl, wl, steps=sim_steps, warmup=sim_steps // 10).step_seconds
        return {"closed_form_s": closed, "simulator_s": sim, "flat_ring_s": flat}
    sim = rm.simulate(cl, wl, topo, steps=sim_steps, warmup=sim_steps // 10).step_seconds
    return {"closed_form_s": closed, "simulator_s": sim, "flat_ring_s": flat}


def evaluate(jobs: list, sim_steps: int) -> list:
    rng = np.random.default_rng(0)
    rows = []
    for job in jobs:
        c = job["cluster"]
        for ph in job["phases"]:
            cl = cluster_model(job, ph)
            comp = compute_model(job, ph, rng)
            wl = rm.Workload(params=job["compute"]["params"], compute=comp, bytes_per_param=4, mode="awc")
            for run in ph["runs"]:
                measured = bench_cluster.mean_step_s(run["rows"])
                pred = predictions(cl, wl, run["name"], sim_steps)
                rows.append({
                    "layout": f"{c['nodes']}x{c['ranks_per_node']}", "bandwidth": ph["bandwidth"],
                    "straggler_std": (ph["straggler_ms"][1] / 1e3 / comp.mean) if ph.get("straggler_ms") else 0.0,
                    "topology": run["name"], "measured_s": measured, **pred,
                    "compute_mean_s": comp.mean, "compute_std_s": comp.std,
                    "inter_bandwidth_Bps": cl.inter_bandwidth, "allreduce_probe_s": ph["link"]["allreduce_s"],
                    "error": pred["closed_form_s"] / measured - 1, "error_sim": pred["simulator_s"] / measured - 1,
                    "error_flat": pred["flat_ring_s"] / measured - 1})
    return rows


def summary(rows: list, key: str) -> dict:
    errs = [abs(r[key]) for r in rows]
    worst = max(rows, key=lambda r: abs(r[key]))
    return {"median": statistics.median(errs), "worst": max(errs),
            "worst_config": f"{worst['layout']} {format_bits(parse_bandwidth_bits(worst['bandwidth']))} "
                            f"{worst['topology']} std {worst['straggler_std']:.2f}"}


def markdown(rows: list, meta: dict, emulated: bool) -> str:
    s_cf, s_sim, s_flat = summary(rows, "error"), summary(rows, "error_sim"), summary(rows, "error_flat")

    def verdict(s):
        return (f"median {100 * s['median']:.1f}% ({'met' if s['median'] <= 0.15 else 'MISSED'} <= 15%), "
                f"worst {100 * s['worst']:.1f}% ({'met' if s['worst'] <= 0.30 else 'MISSED'} <= 30%; {s['worst_config']})")

    lines = ["# Runtime model vs measured step times (emulated cluster)", "",
             "Generated by `bench/validate_model.py`" + (" --quick" if meta["quick"] else "") +
             f" on {meta['date']} ({os.cpu_count()} CPU cores; {meta['wall_s']:.0f} s). "
             + ("Nodes are network namespaces whose links are shaped with tc tbf (decent_train/cluster)."
                if emulated else "**No namespaces were available: loopback, unshaped; the bandwidth column is "
                                 "nominal only.**"),
             "",
             "Workload: bench/synthetic_train.py, 250k parameters (1 MB per message), 100 ms of sleep compute "
             "per step; DDP (`allreduce`, gloo) or DAdamW (AWC) on the topology. Measured: training wall time / "
             f"steps over steps {meta['eval_every']}..{meta['steps']} (slowest rank included). Model inputs measured "
             "in the same job (see the script's docstring): compute sample, link bandwidth under full-duplex load, "
             "latency. Errors are (predicted - measured) / measured.", "",
             f"- closed form (`predict`): {verdict(s_cf)}",
             f"- simulator (`simulate`): {verdict(s_sim)}",
             f"- closed form with backend gloo (its flat-ring all-reduces): {verdict(s_flat)}", "",
             "| layout | link | measured link | straggler std | run | compute C | measured step | closed form | err | simulator | err | gloo | err |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        flat = f"{1e3 * r['flat_ring_s']:.0f} ms | {100 * r['error_flat']:+.0f}%"
        lines.append(
            f"| {r['layout']} | {format_bits(parse_bandwidth_bits(r['bandwidth']))} | "
            f"{8 * r['inter_bandwidth_Bps'] / 1e6:.0f} Mbit/s | {r['straggler_std']:.2f} | {r['topology']} | "
            f"{1e3 * r['compute_mean_s']:.0f} ms | {1e3 * r['measured_s']:.0f} ms | {1e3 * r['closed_form_s']:.0f} ms | "
            f"{100 * r['error']:+.0f}% | {1e3 * r['simulator_s']:.0f} ms | {100 * r['error_sim']:+.0f}% | {flat} |")
    return "\n".join(lines) + "\n"


def scatter(rows: list, path: str):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.5, 6))
    markers = {"allreduce": "s", "one-peer-exp": "o", "aer": "^", "ring": "D", "exp": "v"}
    for i, topo in enumerate(dict.fromkeys(r["topology"] for r in rows)):
        sel = [r for r in rows if r["topology"] == topo]
        for strag, fill in ((False, None), (True, "none")):
            pts = [r for r in sel if (r["straggler_std"] > 0) == strag]
            if pts:
                ax.scatter([1e3 * r["measured_s"] for r in pts], [1e3 * r["closed_form_s"] for r in pts],
                           marker=markers.get(topo, "o"), color=f"C{i}", facecolors=fill,
                           label=f"{topo}{' + stragglers' if strag else ''}")
    lo = min(min(r["measured_s"], r["closed_form_s"]) for r in rows) * 1e3 * 0.8
    hi = max(max(r["measured_s"], r["closed_form_s"]) for r in rows) * 1e3 * 1.2
    xs = np.linspace(lo, hi, 10)
    ax.plot(xs, xs, "k-", lw=1)
    for f in (0.85, 1.15):
        ax.plot(xs, f * xs, "k--", lw=0.7)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured mean step time (ms)")
    ax.set_ylabel("runtime model, closed form (ms)")
    ax.set_title("runtime model vs emulated cluster (dashed: +-15%)")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def earlier_run(path: str) -> dict:
    """argparse type of --from-json: the JSON an earlier run wrote, read now (a missing file, or another script's
    JSON, was a traceback after the parsing: KeyError 'jobs')."""
    try:
        with open(path) as f:
            old = json.load(f)
    except (OSError, ValueError) as e:
        raise argparse.ArgumentTypeError(f"cannot read {path!r}: {e}") from None
    if not isinstance(old, dict) or not {"jobs", "meta"} <= set(old):
        raise argparse.ArgumentTypeError(f"{path!r} has no 'jobs' and 'meta': not a JSON bench/validate_model.py wrote")
    return old


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="layout 4x1 only (20 configurations)")
    p.add_argument("--layouts", type=listed(layout), default="4x1,2x2", help="comma-separated NODESxRANKS_PER_NODE")
    p.add_argument("--bandwidths", type=listed(link_bandwidth), default="50Mbit,200Mbit")
    p.add_argument("--topologies", type=listed(topology_name), default="one-peer-exp,aer,aer-pair,ring")
    p.add_argument("--stds", type=listed(number(0.0)), default="0,0.3",
                   help="straggler std values (fraction of the mean compute)")
    p.add_argument("--steps", type=count(1), default=40)
    p.add_argument("--eval-every", type=count(1), default=10)
    p.add_argument("--probe-steps", type=count(1), default=12)
    p.add_argument("--sim-steps", type=count(1), default=2000, help="steps the simulator runs per prediction")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=number(0.0, strictly=True), default=1800)
    p.add_argument("--docs", default=os.path.join(ROOT, "docs", "runtime_model_validation"),
                   help="prefix of the markdown and PNG outputs (default docs/runtime_model_validation: replaces "
                        "the committed page and picture)")
    p.add_argument("--json", default=None, help="JSON output (default bench/results/validate_model[_quick].json)")
    p.add_argument("--from-json", type=earlier_run, default=None,
                   help="re-evaluate the model on the measurements of an earlier JSON")
    args = p.parse_args(argv)
    if args.quick:
        args.layouts = [(4, 1)]
    args.json = args.json or os.path.join(HERE, "results", "validate_model_quick.json" if args.quick else "validate_model.json")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")

    t0 = time.perf_counter()
    if args.from_json:
        jobs, meta = args.from_json["jobs"], args.from_json["meta"]
    else:
        work = tempfile.mkdtemp(prefix="decent_validate_")
        jobs = []
        try:
            for nodes, ranks in args.layouts:
                plan = make_plan(args, os.path.join(work, f"{nodes}x{ranks}"))
                job = bench_cluster.run_job(plan, nodes, ranks, args.timeout)
                job.pop("plan", None)
                jobs.append(job)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        meta = {"quick": args.quick, "steps": args.steps, "eval_every": args.eval_every,
                "date": time.strftime("%Y-%m-%d"), "wall_s": time.perf_counter() - t0}
    rows = evaluate(jobs, args.sim_steps)
    emulated = all(j["cluster"]["emulated"] for j in jobs)
    text = markdown(rows, meta, emulated)
    print(text)
    with open(output_file(args.docs + ".md"), "w") as f:
        f.write(text)
    scatter(rows, args.docs + ".png")
    with open(output_file(args.json), "w") as f:
        json.dump({"meta": meta, "rows": rows, "summary": {k: summary(rows, k) for k in ("error", "error_sim", "error_flat")},
                   "jobs": jobs}, f, indent=1)
    print(f"wrote {args.docs}.md, {args.docs}.png and {args.json}")


if __name__ == "__main__":
    main()
