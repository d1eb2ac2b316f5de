"""DDP all-reduce vs decent_comm on an emulated multi-node cluster (network namespaces + shaped links).

    sudo .venv/bin/python bench/cluster.py --quick        # ~3 min: synthetic workload, 4 nodes x 1 rank
    sudo .venv/bin/python bench/cluster.py                # both workloads, layouts 4x1 and 2x2 (~50 min on
                                                          # 2 cores; --workloads synthetic: ~16 min)

For each workload and layout (NODESxRANKS) one torchrun job per node runs, in network namespaces joined by
a switch whose links are shaped with tc tbf (decent_train.cluster; without root: loopback, no shaping,
and the table says so). Inside the job (bench/cluster_worker.py) three phases run the same model:

* comm-bound: links at --comm-bw (chosen so one all-reduce of the parameters takes longer than a step's
  compute; the measured ratio gamma = T_allreduce / C is printed): DDP (`--optimizer allreduce`: torch DDP
  + AdamW) and the decentralized optimizer (--optimizer, default DAdamW) on each --topologies;
* compute-bound: links at --compute-bw (default unshaped veth): the same runs, every rank sleeping a
  constant extra MEAN per step;
* stragglers: as compute-bound, but the extra sleep is max(0, N(MEAN, STD)) with STD = --straggler-std x
  the mean compute (C + MEAN) and MEAN = 2 STD: same mean compute, only its variance differs, so
  slowdown = T(stragglers) / T(compute-bound) - 1 isolates the cost of waiting for slow ranks. These runs
  are interleaved with the compute-bound ones (same links; each method's pair back to back).

Workloads (--workloads): `synthetic` (decent_train/workloads/synthetic.py: compute is a sleep of --compute-ms, so
the comm/compute ratio is exactly what the flags say and sleeping ranks leave the CPU to communication, as GPUs
would) and `lm` (decent_train/workloads/lm.py, what examples/train_lm.py trains: the byte-level GPT with real CPU
compute; 4 ranks share 2 cores with the communication threads, so overlap gains are smaller than on real nodes).

Reported per run: mean step time = training wall time / steps over all steps after the first evaluation
interval (warm-up), the slowest rank included (not a median); speedup over DDP in the same phase; final
validation loss of the global average (and its gap to DDP's); time to the target validation loss (--target:
by default the highest final loss among the phase's runs, so every run reaches it and the times compare
speed and per-step progress together; `ddp` = DDP's final loss x 1.02, or a number), linearly interpolated
between evaluations. The issue's targets are checked and printed. Writes bench/results/cluster[_quick].json
and .png.
"""

import argparse
import json
import logging
import os
import shutil
import tempfile
import time

from bench_args import (count, decentralized_optimizer, layout, link_bandwidth, listed, loss_target,  # bench/
                        names, number, output_file, topology_on_wire)
from decent_train.cluster import EmulatedCluster, format_bits, parse_bandwidth_bits
from decent_train.flag_sets import extra_flags_for

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

log = logging.getLogger("cluster")

ONE_PEER = ("one-peer-exp", "one-peer-hypercube", "one-peer-ring", "aer")   # one (inter-node) peer per rank and step
STRAGGLER_SUFFIX = "+stragglers"
#: --topologies NAME:WIRE runs NAME over that wire (aer:int8, one-peer-exp:bf16); no suffix: the parameters' dtype
WIRE_FLAGS = {"": [], "bf16": ["--bf16-wire"], "int8": ["--int8-wire"]}
#: comm-bound targets per step over DDP: one-peer topologies, and those over the 8-bit wire (issue #19.4: aer 3x)
ONE_PEER_TARGET, INT8_TARGET = 1.5, 3.0

WORKLOAD_DEFAULTS = {
    # 250k parameters = 1 MB per message (1 MB at 50 Mbit/s: 160 ms); compute 100 ms of sleep + a few ms of
    # real arithmetic (kept small: 4 ranks share 2 cores).
    "synthetic": {"script_flags": ["--params", "250k", "--compute-ms", "100"], "comm_bw": "50Mbit"},
    # The default byte-level GPT (2 layers, d_model 128: 0.43M parameters = 1.7 MB), batch 8 per rank.
    "lm": {"script_flags": ["--batch-size", "8", "--eval-tokens", "16384"], "comm_bw": "50Mbit"},
    # examples/train_classifier.py: the digits CNN (width 16: 38k parameters = 0.15 MB), batch 16 per rank;
    # compute is a few ms, so 10 Mbit/s makes it communication-bound as the LM is at 50.
    "digits": {"script_flags": ["--batch-size", "16"], "comm_bw": "10Mbit"},
}


# --------------------------------------------------------------------------------------------- the jobs

def run_flags(args, workload: str, optimizer: str, topology=None):
    flags = list(WORKLOAD_DEFAULTS[workload]["script_flags"]) + extra_flags_for(optimizer, args.extra_flags or [])
    flags += ["--steps", str(args.steps), "--eval-every", str(args.eval_every), "--log-every", str(args.eval_every),
              "--seed", str(args.seed), "--optimizer", optimizer]
    if topology:
        topology, _, wire = topology.partition(":")
        flags += ["--topology", topology] + WIRE_FLAGS[wire]
    return flags


def make_plan(args, workload: str, out: str) -> dict:
    methods = [("allreduce", "allreduce", None)] + [(f"{args.optimizer} {t}", args.optimizer, t) for t in args.topologies]

    def runs(extras):
        # With stragglers, each method's constant and random runs follow each other, so that load drift on a
        # shared machine (minutes between runs) hardly enters the slowdown T(random) / T(constant).
        return [{"name": name.replace(" ", "_") + ("" if extra != "random" else STRAGGLER_SUFFIX),
                 "argv": run_flags(args, workload, opt, topo), "extra": extra}
                for name, opt, topo in methods for extra in extras]

    comm_bw = args.comm_bw or WORKLOAD_DEFAULTS[workload]["comm_bw"]
    phases = [{"name": "comm-bound", "bandwidth": comm_bw, "runs": runs(["none"])}]
    if not args.skip_compute_bound:
        spec = {"std": args.straggler_std, "mean_over_std": 2.0}
        phases.append({"name": "compute-bound", "bandwidth": args.compute_bw, "straggler": spec,
                       "runs": runs(["constant", "random"] if args.straggler_std > 0 else ["constant"])})
    return {"workload": workload, "out": out, "compute_probe_steps": args.probe_steps,
            "link_probe_bytes": 4 << 20, "phases": phases}


def run_job(plan: dict, nodes: int, ranks: int, timeout: float, rdzv: str = "static") -> dict:
    """Launches bench/cluster_worker.py on an emulated cluster; returns its results.json (+ cluster facts)."""
    out = plan["out"]
    os.makedirs(out, exist_ok=True)
    plan_path = os.path.join(out, "plan.json")
    with open(plan_path, "w") as f:
        json.dump(plan, f, indent=1)
    first_bw = plan["phases"][0].get("bandwidth")
    with EmulatedCluster(nodes, first_bw) as cluster:
        served = set()
        link_bytes = []

        def poll():  # the worker asks for each phase's bandwidth; shape, count the bytes so far, acknowledge
            for k, phase in enumerate(plan["phases"]):
                if k in served or not os.path.exists(os.path.join(out, f"phase{k}.request")):
                    continue
                cluster.set_bandwidth(phase.get("bandwidth"))
                link_bytes.append(cluster.link_bytes())
                open(os.path.join(out, f"phase{k}.ready"), "w").close()
                served.add(k)
                log.info("phase %d (%s): links %s", k, phase["name"],
                         format_bits(cluster.bandwidth_bits) if cluster.emulated else "loopback (unshaped)")

        t0 = time.perf_counter()
        log.info("%s: %s, %d ranks per node", plan["workload"], cluster.describe(), ranks)
        cluster.torchrun(os.path.join(HERE, "cluster_worker.py"), [plan_path], nproc_per_node=ranks,
                         timeout=timeout, log_dir=os.path.join(out, "logs"), poll=poll, rdzv=rdzv)
        link_bytes.append(cluster.link_bytes())
        with open(os.path.join(out, "results.json")) as f:
            results = json.load(f)
        where = ("network namespaces behind a switch, node links shaped with tc tbf as listed per phase"
                 if cluster.emulated else f"host loopback, NO bandwidth shaping ({cluster.reason})")
        results["cluster"] = {"nodes": nodes, "ranks_per_node": ranks, "emulated": cluster.emulated,
                              "fallback_reason": cluster.reason, "describe": where,
                              "link_bytes_at_phase_starts": link_bytes, "job_wall_s": time.perf_counter() - t0}
    return results


# ------------------------------------------------------------------------------------------- analysis

def mean_step_s(rows) -> float:
    """Training time / steps after the first logged interval (warm-up); all steps if there is only one."""
    if len(rows) >= 2:
        return (rows[-1]["train_time_s"] - rows[0]["train_time_s"]) / (rows[-1]["step"] - rows[0]["step"])
    return rows[-1]["train_time_s"] / rows[-1]["step"]


def time_to_loss(rows, target: float):
    """Training time at which the validation loss first reaches target (linear between evaluations)."""
    prev = None
    for r in rows:
        if r.get("val_loss") is None:
            continue
        if r["val_loss"] <= target:
            if prev is None:
                return r["train_time_s"]
            (t0, l0), (t1, l1) = prev, (r["train_time_s"], r["val_loss"])
            return t0 + (t1 - t0) * (l0 - target) / (l0 - l1) if l0 != l1 else t1
        prev = (r["train_time_s"], r["val_loss"])
    return None


def target_loss(runs, target: str) -> float:
    finals = {r["name"]: r["summary"]["final_val_loss"] for r in runs}
    if target == "worst":
        return max(finals.values())
    if target == "ddp":
        return finals["allreduce"] * 1.02
    return float(target)


def split_phases(job_phases):
    """The compute-bound phase's straggler runs (interleaved with its constant runs) as a phase of their own."""
    out = []
    for ph in job_phases:
        plain = [r for r in ph["runs"] if r["extra"] != "random"]
        strag = [{**r, "name": r["name"][:-len(STRAGGLER_SUFFIX)]} for r in ph["runs"] if r["extra"] == "random"]
        out.append({**ph, "runs": plain})
        if strag:
            out.append({**ph, "name": "stragglers", "runs": strag})
    return out


def analyze(job: dict, target_spec: str) -> dict:
    """Per phase: per run mean step time, speedup, loss, time to target; then the targets."""
    C = job["compute"]["mean_s"]
    phases = []
    for ph in split_phases(job["phases"]):
        runs = []
        ddp = next(r for r in ph["runs"] if r["name"] == "allreduce")
        target = target_loss(ph["runs"], target_spec)
        t_ddp = mean_step_s(ddp["rows"])
        for r in ph["runs"]:
            t = mean_step_s(r["rows"])
            runs.append({"name": r["name"], "label": r["name"].replace("_", " "), "mean_step_s": t,
                         "speedup": t_ddp / t, "final_val_loss": r["summary"]["final_val_loss"],
                         "loss_gap": r["summary"]["final_val_loss"] / ddp["summary"]["final_val_loss"] - 1,
                         "time_to_target_s": time_to_loss(r["rows"], target), "steps": r["summary"]["steps"],
                         "rows": r["rows"]})
        extra = ph.get("straggler_ms")
        compute = C + (extra[0] / 1e3 if extra else 0.0)
        phases.append({"name": ph["name"], "bandwidth": ph["bandwidth"], "link": ph["link"],
                       "straggler_ms": extra, "compute_s": compute,
                       "gamma": ph["link"]["allreduce_s"] / compute, "target_loss": target, "runs": runs})
    by = {p["name"]: p for p in phases}
    checks = []
    comm = by.get("comm-bound")
    if comm:
        bound = comm["gamma"] >= 1.0
        for r in comm["runs"]:
            topology, _, wire = r["name"].split("_", 1)[-1].partition(":")
            if topology in ONE_PEER and r["name"] != "allreduce":
                target = INT8_TARGET if wire == "int8" else ONE_PEER_TARGET
                what = "one-peer topology" + (" over the 8-bit wire" if wire == "int8" else "")
                checks.append({"target": f"comm-bound: {what} >= {target}x DDP per step", "run": r["label"],
                               "value": r["speedup"], "met": bool(r["speedup"] >= target),
                               "note": f"gamma = T_allreduce / C = {comm['gamma']:.2f}"
                                       + ("" if bound else " < 1: NOT communication-bound")})
    cb, st = by.get("compute-bound"), by.get("stragglers")
    if cb:
        for r in cb["runs"]:
            if r["name"] != "allreduce":
                checks.append({"target": "compute-bound: never > 5% slower than DDP", "run": r["label"],
                               "value": 1 / r["speedup"], "met": bool(1 / r["speedup"] <= 1.05),
                               "note": f"gamma = {cb['gamma']:.2f}"})
    if cb and st:
        base = {r["name"]: r["mean_step_s"] for r in cb["runs"]}
        slow = {r["name"]: r["mean_step_s"] / base[r["name"]] - 1 for r in st["runs"]}
        st["slowdown"] = slow
        for name, s in slow.items():
            if name != "allreduce" and name.split("_", 1)[-1] in ONE_PEER:
                ratio = s / slow["allreduce"] if slow["allreduce"] > 0 else float("inf")
                rel = st["straggler_ms"][1] / 1e3 / st["compute_s"]
                checks.append({"target": f"stragglers (std {rel:.2f} x compute): slowdown <= 1/2 of DDP's",
                               "run": name.replace("_", " "),
                               "value": ratio, "met": bool(ratio <= 0.5),
                               "note": f"ours {100 * s:+.1f}%, DDP {100 * slow['allreduce']:+.1f}%"})
    return {"phases": phases, "checks": checks, "compute_s": C}


def fmt_s(s):
    return "not reached" if s is None else f"{s:.1f} s"


def report(jobs: list) -> str:
    lines = []
    for job in jobs:
        a, c = job["analysis"], job["cluster"]
        lines.append(f"\n### {job['workload']} on {c['nodes']} nodes x {c['ranks_per_node']} ranks: {c['describe']}")
        lines.append(f"{job['compute']['description']}; compute C = {1e3 * a['compute_s']:.1f} ms/step "
                     f"(measured, no communication, all ranks at once; std {1e3 * job['compute']['std_s']:.1f} ms)\n")
        lines.append("| phase | links | gamma | run | mean step | speedup vs DDP | final val loss (vs DDP) | "
                     "time to target |")
        lines.append("|---|---|---|---|---|---|---|---|")
        for ph in a["phases"]:
            link = format_bits(parse_bandwidth_bits(ph["bandwidth"])) if c["emulated"] else "loopback"
            name = ph["name"]
            if ph["straggler_ms"] and ph["straggler_ms"][0] > 0:
                m, s = ph["straggler_ms"]
                name += f" (+{m:.0f} ms" + (f" +- {s:.0f} ms)" if ph["name"] == "stragglers" else ")")
            for r in ph["runs"]:
                extra = ""
                if ph.get("slowdown"):
                    extra = f" (slowdown {100 * ph['slowdown'][r['name']]:+.1f}%)"
                lines.append(f"| {name} | {link} | {ph['gamma']:.2f} | {r['label']} | {1e3 * r['mean_step_s']:.1f} ms{extra} | "
                             f"{r['speedup']:.2f}x | {r['final_val_loss']:.4f} ({100 * r['loss_gap']:+.1f}%) | "
                             f"{fmt_s(r['time_to_target_s'])} |")
        lines.append("")
        lines.append("target loss per phase: " + ", ".join(f"{p['name']} {p['target_loss']:.4f}" for p in a["phases"]))
        lines.append("")
        for chk in a["checks"]:
            lines.append(f"- [{'met' if chk['met'] else 'MISSED'}] {chk['target']}: {chk['run']} = {chk['value']:.2f}"
                         f" ({chk['note']})")
    return "\n".join(lines)


def plot(jobs: list, path: str):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(len(jobs), 2, figsize=(12, 3.8 * len(jobs)), squeeze=False)
    for (ax_bar, ax_loss), job in zip(axes, jobs):
        a, c = job["analysis"], job["cluster"]
        title = f"{job['workload']}, {c['nodes']}x{c['ranks_per_node']}"
        names = [r["label"] for r in a["phases"][0]["runs"]]
        width = 0.8 / len(a["phases"])
        for i, ph in enumerate(a["phases"]):
            xs = [j + i * width for j in range(len(names))]
            ax_bar.bar(xs, [1e3 * r["mean_step_s"] for r in ph["runs"]], width, label=f"{ph['name']} (gamma {ph['gamma']:.2f})")
        ax_bar.set_xticks([j + width * (len(a["phases"]) - 1) / 2 for j in range(len(names))], names, rotation=15, fontsize=8)
        ax_bar.set_ylabel("mean step time (ms)")
        ax_bar.set_title(title)
        ax_bar.legend(fontsize=8)
        ph = a["phases"][0]
        for i, r in enumerate(ph["runs"]):
            val = [x for x in r["rows"] if x.get("val_loss") is not None]
            ax_loss.plot([x["train_time_s"] for x in val], [x["val_loss"] for x in val], marker="o", ms=3,
                         color=f"C{i}", label=r["label"])
        ax_loss.axhline(ph["target_loss"], color="gray", ls="--", lw=1, label="target")
        ax_loss.set_xlabel("training time (s)")
        ax_loss.set_ylabel("validation loss")
        ax_loss.set_title(f"{title}: {ph['name']}")
        ax_loss.legend(fontsize=8)
        for ax in (ax_bar, ax_loss):
            ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------- main

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="synthetic workload, 4x1, topologies one-peer-exp, aer, ring, 30 steps (~3 min)")
    p.add_argument("--workloads", type=names(list(WORKLOAD_DEFAULTS)), default="synthetic,lm",
                   help="comma-separated: synthetic, lm, digits")
    p.add_argument("--layouts", type=listed(layout), default="4x1,2x2", help="comma-separated NODESxRANKS_PER_NODE")
    p.add_argument("--topologies", type=listed(topology_on_wire(WIRE_FLAGS)), default=None,
                   help="decentralized topologies to run (default one-peer-exp,aer,ring,exp; --quick: without exp); "
                   "NAME:int8 or NAME:bf16 runs NAME over that wire")
    p.add_argument("--optimizer", type=decentralized_optimizer, default="dadamw",
                   help="decentralized optimizer (examples' --optimizer name)")
    p.add_argument("--steps", type=count(1), default=None, help="steps per run (default 60; --quick 30)")
    p.add_argument("--eval-every", type=count(1), default=None, help="evaluation interval (default steps / 6)")
    p.add_argument("--comm-bw", type=link_bandwidth, default=None,
                   help="link bandwidth of the comm-bound phase (default: synthetic 50Mbit, lm 50Mbit)")
    p.add_argument("--compute-bw", type=link_bandwidth, default=None,
                   help="link bandwidth of the compute-bound phases (default: unshaped)")
    p.add_argument("--straggler-std", type=number(0.0), default=0.3,
                   help="straggler std as a fraction of the mean compute (0: no straggler phase)")
    p.add_argument("--skip-compute-bound", action="store_true", help="comm-bound phase only")
    p.add_argument("--target", type=loss_target, default="worst",
                   help="target validation loss: 'worst' (highest final loss of the phase's runs), 'ddp' (DDP's final "
                        "loss x 1.02) or a number")
    p.add_argument("--probe-steps", type=count(1), default=12, help="steps of the compute probe")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=number(0.0, strictly=True), default=1800, help="seconds per torchrun job")
    p.add_argument("--rdzv", choices=("static", "c10d"), default="static", help="torchrun rendezvous")
    p.add_argument("--out", default=None, help="result prefix (default bench/results/cluster[_quick])")
    p.add_argument("--keep-logs", action="store_true", help="keep the per-run logs (printed directory)")
    p.add_argument("extra_flags", nargs="*", help="after --: flags passed to every training run")
    args = p.parse_args(argv)
    # the types above refuse 0 for --steps / --eval-every: `or` only fills in an absent flag's default
    if args.quick:
        args.workloads, args.layouts = ["synthetic"], [(4, 1)]
        args.topologies = args.topologies or ["one-peer-exp", "aer", "ring"]
        args.steps = args.steps or 30
    args.steps = args.steps or 60
    args.topologies = args.topologies or ["one-peer-exp", "aer", "ring", "exp"]
    args.eval_every = args.eval_every or max(1, args.steps // 6)
    args.out = args.out or os.path.join(HERE, "results", "cluster_quick" if args.quick else "cluster")
    return args


def main(argv=None):
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    work = tempfile.mkdtemp(prefix="decent_cluster_")
    jobs, t0 = [], time.perf_counter()
    try:
        for workload in args.workloads:
            for nodes, ranks in args.layouts:
                plan = make_plan(args, workload, os.path.join(work, f"{workload}_{nodes}x{ranks}"))
                job = run_job(plan, nodes, ranks, args.timeout, args.rdzv)
                job["workload"] = workload
                job["analysis"] = analyze(job, args.target)
                jobs.append(job)
                print(report([job]), flush=True)
    finally:
        if args.keep_logs:
            print(f"logs kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    text = (f"bench/cluster.py{' --quick' if args.quick else ''}: {args.steps} steps per run, {os.cpu_count()} CPU "
            f"cores, total {time.perf_counter() - t0:.0f} s\n" + report(jobs))
    print("\n" + text)
    slim = [{k: v for k, v in j.items() if k != "plan"} for j in jobs]
    with open(output_file(args.out + ".json"), "w") as f:
        json.dump({"args": {k: v for k, v in vars(args).items()}, "report": text, "jobs": slim}, f, indent=1,
                  default=str)
    plot(jobs, args.out + ".png")
    print(f"\nwrote {args.out}.json and {args.out}.png")
    return jobs


if __name__ == "__main__":
    main()
