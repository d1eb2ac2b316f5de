"""Network faults on an emulated cluster (root): 3 nodes of one rank each (decent_train.cluster with wires=True,
gloo over veth), a fault cut into node 2's link while the ranks train (bench/network_faults_worker.py), and what
each rank did; docs/reliability.md "Network faults (emulated nodes)" reads the result.

    sudo .venv/bin/python bench/network_faults.py [--quick] [--cells part3-awc-ring,...] [--timeout 10]

The matrix (timeout = 10 s, DAdamW awc unless named; p2p = ring + exchange="p2p", group = complete, one
all-reduce of the 3 per step):
  1 short partition: node 2 cut off for 3 s at step 20 (awc, atc, DSGD on p2p; awc on group): the job completes,
    every rank's final parameters bit-identical to the fault-free run of the same configuration (base-*).
  2 10% loss from step 10 on; a 200 kbit/s link from step 10 for 15 s: completes, bit-identical.
  3 node 2 cut off for 20 s (twice the timeout), at step 20 (p2p, group) or while every rank waits to build its
    optimizer or to enter global_average(); then the same with node 0, which hosts the store (rank 0's TCPStore),
    cut off (*-node0): every rank, the cut-off one too, raises a clear error within timeout + 5 s, the first error
    of another rank naming the cut-off one (or, node 0, the store on it).
  4 observed, not judged: a 7 s partition and 20% loss from step 10 on, DAdamW and plain DDP + AdamW (the
    process group's timeout = 10 s): TCP resends a lost segment after about 0.2, 0.6, 1.4, 3.0, 6.2, 12.6 s
    (its retransmission timeout doubles), so an outage longer than about timeout / 2 can leave the next resend
    past the timeout.

Writes bench/results/network_faults[_quick].{md,json} (not committed). The seconds are time.time() on the one
machine, from the fault (for a paused phase: from the release of the waiting ranks, 0.2 s after the cut)."""

import argparse
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import List, Optional

from bench_args import output_file  # bench/, this script's directory
from decent_train import REPO_ROOT
from decent_train.cluster import EmulatedCluster

WORKER = os.path.join(REPO_ROOT, "bench", "network_faults_worker.py")
NODES = 3
SLACK_S = 5.0          # docs/reliability.md's bound: a clear error within timeout + 5 s
CLEAR = ("ExchangeError", "ExchangeTimeout", "RuntimeError", "ValueError")


@dataclasses.dataclass
class Cell:
    name: str
    section: int
    expect: str                 # baseline | identical | clear_error | observe
    opt: str = "dadamw"
    mode: str = "awc"
    topo: str = "ring"
    fault: str = "none"         # none | partition | drop | throttle
    value: str = ""             # drop: the fraction; throttle: the rate
    node: int = 2
    at_step: Optional[int] = 20
    pause: str = "none"         # construct | global_average: cut while every rank waits there
    dur: Optional[float] = None  # seconds until healed (None: never, the cell ends with the cluster)

    @property
    def config(self):
        return "ddp" if self.opt == "ddp" else f"{self.opt}-{self.mode}-{self.topo}"

    @property
    def baseline(self):
        return f"base-{self.mode}-{self.topo}" if self.opt == "dadamw" else f"base-{self.opt}-{self.topo}"


def matrix() -> List[Cell]:
    cells = []
    for opt, mode, topo in (("dadamw", "awc", "ring"), ("dadamw", "atc", "ring"), ("dsgd", "awc", "ring"),
                            ("dadamw", "awc", "complete")):
        tag = f"{mode}-{topo}" if opt == "dadamw" else f"{opt}-{topo}"
        cells.append(Cell(f"base-{tag}", 1, "baseline", opt, mode, topo, at_step=None))
        cells.append(Cell(f"part3-{tag}", 1, "identical", opt, mode, topo, "partition", dur=3))
    cells += [Cell("loss10-awc-ring", 2, "identical", fault="drop", value="0.1", at_step=10),
              Cell("slow200k-awc-ring", 2, "identical", fault="throttle", value="200kbit", at_step=10, dur=15)]
    for node in (2, 0):
        n = "" if node == 2 else "-node0"
        cells += [Cell(f"part20-p2p{n}", 3, "clear_error", fault="partition", node=node, dur=20),
                  Cell(f"part20-group{n}", 3, "clear_error", topo="complete", fault="partition", node=node, dur=20),
                  Cell(f"part20-construct{n}", 3, "clear_error", fault="partition", node=node, at_step=None,
                       pause="construct", dur=20),
                  Cell(f"part20-global-average{n}", 3, "clear_error", fault="partition", node=node, at_step=None,
                       pause="global_average", dur=20)]
    cells += [Cell("part7-awc-ring", 4, "observe", fault="partition", dur=7),
              Cell("loss20-awc-ring", 4, "observe", fault="drop", value="0.2", at_step=10),
              Cell("part7-ddp", 4, "observe", "ddp", fault="partition", dur=7),
              Cell("loss20-ddp", 4, "observe", "ddp", fault="drop", value="0.2", at_step=10)]
    return cells


QUICK = ["base-awc-ring", "part3-awc-ring", "part20-p2p"]


def events(out, rank):
    try:
        with open(os.path.join(out, f"rank{rank}.jsonl")) as f:
            return [json.loads(line) for line in f if line.endswith("\n")]
    except FileNotFoundError:
        return []


def inject(cluster, cell):
    if cell.fault == "partition":
        cluster.partition(cell.node)
    elif cell.fault == "drop":
        cluster.drop(cell.node, float(cell.value))
    elif cell.fault == "throttle":
        cluster.throttle(cell.node, cell.value)


def run_cell(cell: Cell, args, out: str) -> dict:
    """Launches the 3 ranks of `cell`, cuts its fault in when due, heals it after `dur`, and returns each rank's
    events, exit code and whether it was still running at the limit (killed, after a stack dump)."""
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    flags = ["--opt", cell.opt, "--mode", cell.mode, "--topo", cell.topo, "--steps", str(args.steps),
             "--timeout", str(args.timeout), "--pause", cell.pause, "--out", out]
    t = {}
    with EmulatedCluster(NODES, wires=True, fallback=False) as cluster:
        procs = []
        for r in range(NODES):
            env = {"RANK": str(r), "WORLD_SIZE": str(NODES), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                   "MASTER_ADDR": cluster.master_addr, "MASTER_PORT": str(cluster.master_port),
                   "PYTHONPATH": REPO_ROOT, "DECENT_COMM_CUDA": "0", "PYTHONUNBUFFERED": "1"}
            with open(os.path.join(out, f"rank{r}.log"), "w") as log:
                procs.append(cluster.popen(r, [sys.executable, WORKER, *flags], env=env, stdout=log,
                                           stderr=subprocess.STDOUT, cwd=REPO_ROOT))
        t["launch"] = time.time()
        deadline = t["launch"] + args.startup_limit
        while any(p.poll() is None for p in procs) and time.time() < deadline:
            if cell.fault != "none" and "fault" not in t:
                if cell.pause != "none":
                    due = all(any(e["ev"] == "pause" for e in events(out, r)) for r in range(NODES))
                else:
                    due = any(e["ev"] == "step" and e["step"] >= cell.at_step for e in events(out, cell.node))
                if due:
                    inject(cluster, cell)
                    t["fault"] = time.time()
                    if cell.pause != "none":
                        time.sleep(0.2)
                        open(os.path.join(out, "go"), "w").close()
                        t["go"] = time.time()
                    deadline = t["fault"] + (cell.dur or args.open_limit) + args.after_limit
            if "fault" in t and "heal" not in t and cell.dur is not None and time.time() - t["fault"] >= cell.dur:
                cluster.heal(cell.node)
                t["heal"] = time.time()
            time.sleep(0.02)
        hung = [r for r, p in enumerate(procs) if p.poll() is None]
        for r in hung:
            os.kill(procs[r].pid, signal.SIGUSR1)  # the worker's faulthandler: rank<r>.stack
        time.sleep(1.0 if hung else 0)
        t["end"] = time.time()
    # the cluster's close() killed the hung ranks' process groups
    ranks = []
    for r, p in enumerate(procs):
        with open(os.path.join(out, f"rank{r}.log"), errors="replace") as f:
            tail = f.read()[-1500:]
        ranks.append({"rank": r, "exit": None if r in hung else p.returncode, "hung": r in hung,
                      "events": events(out, r), "log_tail": tail})
    return {"cell": dataclasses.asdict(cell), "times": t, "ranks": ranks}


def rank_summary(rank: dict, t0: Optional[float]) -> dict:
    ev = rank["events"]
    steps = [e for e in ev if e["ev"] == "step"]
    done = [e for e in ev if e["ev"] == "done"]
    errors = [{"where": e["where"], "type": e["type"].rsplit(".", 1)[-1], "msg": e["msg"],
               "s": None if t0 is None else round(e["t"] - t0, 2)} for e in ev if e["ev"] == "error"]
    return {"rank": rank["rank"], "exit": rank["exit"], "hung": rank["hung"],
            "last_step": steps[-1]["step"] if steps else None, "max_step_s": max((e["s"] for e in steps), default=0),
            "sha256": done[0]["params_sha256"] if done else None, "errors": errors}


def judge(result: dict, baselines: dict, timeout: float) -> dict:
    cell = Cell(**result["cell"])
    t = result["times"]
    t0 = t.get("go", t.get("fault"))
    ranks = [rank_summary(r, t0) for r in result["ranks"]]
    completed = all(r["sha256"] and not r["errors"] and r["exit"] == 0 for r in ranks)
    first_errors = sorted((r["errors"][0]["s"], r["rank"], r["errors"][0]) for r in ranks if r["errors"])
    verdict, identical = "", None
    if cell.expect in ("identical", "observe") and completed and cell.baseline in baselines:
        identical = [r["sha256"] for r in ranks] == baselines[cell.baseline]
    if cell.fault != "none" and "fault" not in t:
        verdict = "FAIL: the fault was never injected"
    elif cell.expect == "baseline":
        verdict = "pass" if completed else "FAIL: did not complete"
    elif cell.expect == "identical":
        verdict = ("pass" if completed and identical else "FAIL: " + (
            "no baseline to compare" if completed and identical is None else
            "parameters differ from the fault-free run" if completed else "did not complete"))
    elif cell.expect == "clear_error":
        why = [f"rank {r['rank']} still running at the limit" for r in ranks if r["hung"]]
        why += [f"rank {r['rank']} raised nothing" for r in ranks if not r["errors"] and not r["hung"]]
        why += [f"rank {r['rank']}: {r['errors'][0]['type']} is not a clear error" for r in ranks
                if r["errors"] and r["errors"][0]["type"] not in CLEAR]
        why += [f"rank {r['rank']} raised after {r['errors'][0]['s']} s" for r in ranks
                if r["errors"] and r["errors"][0]["s"] > timeout + SLACK_S]
        # Some other rank must name the cut-off one, or (node 0) the store on it. Not necessarily the first to
        # raise: on a ring the two live ranks time out together, and one may first meet the other's exit.
        live = [e[2]["msg"] for e in first_errors if e[1] != cell.node]
        if live and not any(f"rank {cell.node}" in m or "process group's store" in m for m in live):
            why.append(f"no other rank's error names rank {cell.node} (or the store on its node)")
        verdict = "pass" if not why else "FAIL: " + "; ".join(why)
    if completed:
        outcome = "completed" + {True: ", bit-identical", False: ", parameters DIFFER", None: ""}[identical]
    else:
        raised, running = sum(bool(r["errors"]) for r in ranks), sum(r["hung"] for r in ranks)
        outcome = (f"{raised} of {NODES} ranks raised" + (f", first at {first_errors[0][0]} s" if first_errors else "")
                   + (f", {running} still running at the limit (killed)" if running else ""))
    return {"cell": result["cell"], "times": t, "ranks": ranks, "completed": completed, "identical": identical,
            "outcome": outcome, "verdict": verdict or "observed",
            "wall_s": round(t["end"] - t["launch"], 1), "max_step_s": max(r["max_step_s"] for r in ranks)}


def fault_text(c: dict) -> str:
    if c["fault"] == "none":
        return "none"
    what = ("partition" if c["fault"] == "partition" else c["value"] if c["fault"] == "throttle" else
            f"{float(c['value']):.0%} loss")
    when = f"at step {c['at_step']}" if c["pause"] == "none" else f"in {c['pause']}"
    return f"node {c['node']} {what} {when}" + (f", {c['dur']:g} s" if c["dur"] else ", to the end")


def message_head(msg: str, n: int = 150) -> str:
    head = msg.split("; transport:")[0].replace("|", "/").replace("\n", " ")
    return head if len(head) <= n else head[:n] + "..."


def markdown(judged: List[dict], args, wall: float) -> str:
    lines = [f"`bench/network_faults.py{' --quick' if args.quick else ''}`: {len(judged)} cells, 3 emulated nodes x 1 "
             f"rank (gloo over veth), timeout={args.timeout:g} s, {args.steps} steps, {wall:.0f} s in all.", "",
             "| cell | config | fault | outcome | max step s | verdict |", "|---|---|---|---|---|---|"]
    for j in judged:
        c = j["cell"]
        lines.append(f"| {c['name']} | {Cell(**c).config} | {fault_text(c)} | {j['outcome']} | {j['max_step_s']:.2f} "
                     f"| {j['verdict']} |")
    errs = [(j, r) for j in judged for r in j["ranks"] if r["errors"] or r["hung"]]
    if errs:
        lines += ["", "Each rank's first error (s: after the fault; for a paused phase after the ranks' release):", "",
                  "| cell | rank | exception | s | message head |", "|---|---|---|---|---|"]
        for j, r in errs:
            e = r["errors"][0] if r["errors"] else None
            lines.append(f"| {j['cell']['name']} | {r['rank']}{' (cut off)' if r['rank'] == j['cell']['node'] else ''}"
                         f" | {e['type'] if e else 'none: killed at the limit'} | {e['s'] if e else '-'} | "
                         f"{message_head(e['msg']) if e else '-'} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)} (about 2 min)")
    p.add_argument("--cells", default=None, help="comma-separated cell names (default: the whole matrix)")
    p.add_argument("--timeout", type=float, default=10.0, help="the optimizer's (DDP: the process group's) timeout")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--startup-limit", type=float, default=150.0, help="seconds from launch a cell may run unfaulted")
    p.add_argument("--after-limit", type=float, default=30.0,
                   help="seconds after the heal before ranks still running are killed")
    p.add_argument("--open-limit", type=float, default=150.0,
                   help="a fault never healed (loss to the end): seconds after it before the heal's --after-limit")
    p.add_argument("--out", default=None, help="result prefix (default bench/results/network_faults[_quick])")
    args = p.parse_args(argv)
    cells = matrix()
    wanted = args.cells.split(",") if args.cells else QUICK if args.quick else None
    if wanted:
        unknown = set(wanted) - {c.name for c in cells}
        if unknown:
            p.error(f"unknown cells {sorted(unknown)}; known: {', '.join(c.name for c in cells)}")
        cells = [c for c in cells if c.name in wanted]
    # the baselines first, so each faulted cell is compared as soon as it ends
    cells.sort(key=lambda c: c.expect != "baseline")
    out = args.out or os.path.join(REPO_ROOT, "bench", "results", "network_faults_quick" if args.quick else
                                   "network_faults")
    output_file(out + ".json")  # its directory, made before the cells run
    work = tempfile.mkdtemp(prefix="network_faults_")
    judged, baselines, started = [], {}, time.time()
    for cell in cells:
        j = judge(run_cell(cell, args, os.path.join(work, cell.name)), baselines, args.timeout)
        if cell.expect == "baseline" and j["completed"]:
            baselines[cell.name] = [r["sha256"] for r in j["ranks"]]
        judged.append(j)
        print(f"{cell.name}: {j['outcome']}; {j['verdict']} ({j['wall_s']} s)", flush=True)
    judged.sort(key=lambda j: (j["cell"]["section"], [c.name for c in matrix()].index(j["cell"]["name"])))
    with open(out + ".json", "w") as f:
        json.dump({"args": vars(args), "cells": judged, "logs": work, "wall_s": time.time() - started}, f, indent=1)
    text = markdown(judged, args, time.time() - started)
    with open(out + ".md", "w") as f:
        f.write(text)
    print(text + f"\nwrote {out}.md and .json (rank logs: {work})")
    return 0 if all(not j["verdict"].startswith("FAIL") for j in judged) else 1


if __name__ == "__main__":
    sys.exit(main())
