"""The fault matrix (issue #14.9): every fault x (point-to-point, group all-reduce) x (awc, atc) on 3 local CPU
ranks (gloo), each job judged by decent_train.faults.verdict; prints the tables and writes them to
bench/results/fault_matrix.{json,md} (docs/reliability.md explains them).

    python bench/fault_matrix.py [--timeout 5] [--scenarios dead,silent,...] [--paths p2p,group] [--modes awc,atc]

Faults (decent_train/faults/scenarios.py): dead (rank 1 exits mid-training), silent (rank 1 stops stepping;
silent-warmup: the same during the warm-up's gradient all-reduces), late (rank 1 builds its optimizer timeout + 3 s
late), options (rank 1 sets comm_dtype / accum_steps / broadcast_init / check_finite differently), size (rank 1's
parameters, then one bucket, differ in size), exit (a torchrun job whose script ends without shutdown() or
destroy_process_group), nan (rank 1's loss is NaN at step 3, check_finite=True), and nan-unchecked (the same without
check_finite: observed, not judged). The ranks keep the process group's default timeout (30 min): every error within
seconds comes from the optimizer's `timeout`.
"""

import argparse
import json
import os
import time

from bench_args import names, output_file  # bench/, this script's directory
from decent_train import REPO_ROOT
from decent_train.faults.launch import launch
from decent_train.faults.verdict import judge, summarize

SCENARIOS = ["dead", "silent", "silent-warmup", "late", "options", "size", "exit", "nan"]
WORLD_SIZE = 3


def _fmt_s(v):
    return "-" if v is None else f"{v:.1f}"


def run_cell(scenario, path, mode, timeout, deadline_s):
    started = time.monotonic()
    outcomes = launch(WORLD_SIZE, ["--scenario", scenario, "--path", path, "--mode", mode, "--timeout", str(timeout)],
                      deadline_s=deadline_s, torchrun=scenario == "exit")
    wall = time.monotonic() - started
    if scenario == "nan-unchecked":
        firsts = {o.rank: o.record.get("first_nonfinite_step") for o in outcomes}
        errors = {o.rank: [a["message"][:120] for a in o.record.get("attempts", []) if a.get("error")]
                  for o in outcomes}
        return dict(scenario=scenario, path=path, mode=mode, wall_s=wall, first_nonfinite_step=firsts, errors=errors,
                    exit_codes=[o.returncode for o in outcomes])
    v = judge(scenario, path, timeout, outcomes)
    # Seconds from the end of a rank's scenario (its error caught) to its process exit: not judged by the issue,
    # but a survivor that cannot exit while its peer is stuck is worth seeing (docs/reliability.md).
    exit_lag = {o.rank: round(o.exited_at - o.record["t_end"], 1) for o in outcomes if "t_end" in o.record}
    return dict(scenario=scenario, path=path, mode=mode, wall_s=wall, tried=v.tried, clear=v.clear, max_s=v.max_s,
                signal_deaths=v.signal_deaths, hung=v.hung, problems=v.problems, passed=v.passed,
                exit_codes=[o.returncode for o in outcomes], exit_lag_s=exit_lag,
                messages={o.rank: [(a["what"], a.get("message")) for a in o.record.get("attempts", [])]
                          for o in outcomes})


def tables(cells, timeout):
    judged = [c for c in cells if "tried" in c]
    lines = [f"timeout = {timeout:g} s; bound: timeout + 5 = {timeout + 5:g} s", "",
             "| fault | path | mode | tried | clear error | max s to error | signal deaths | hung | job wall s | "
             "max s error to exit |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for c in judged:
        lag = max(c["exit_lag_s"].values()) if c["exit_lag_s"] else None
        lines.append(f"| {c['scenario']} | {c['path']} | {c['mode']} | {c['tried']} | {c['clear']} | "
                     f"{_fmt_s(c['max_s'])} | {c['signal_deaths']} | {c['hung']} | {c['wall_s']:.0f} | {_fmt_s(lag)} |")
    lines += ["", "| fault | jobs | tried | clear error | max s to error (all live ranks) | signal deaths | hung |",
              "|---|---|---|---|---|---|---|"]
    for name in dict.fromkeys(c["scenario"] for c in judged):
        mine = [c for c in judged if c["scenario"] == name]
        total = summarize({i: _as_verdict(c) for i, c in enumerate(mine)})
        lines.append(f"| {name} | {len(mine)} | {total.tried} | {total.clear} | {_fmt_s(total.max_s)} | "
                     f"{total.signal_deaths} | {total.hung} |")
    for c in cells:
        if "first_nonfinite_step" in c:
            lines.append(f"\nnan-unchecked {c['path']} {c['mode']}: first step after which each rank's parameters "
                         f"are non-finite {c['first_nonfinite_step']}, errors {c['errors']}, exit codes "
                         f"{c['exit_codes']}")
    return "\n".join(lines)


def _as_verdict(c):
    from decent_train.faults.verdict import Verdict
    return Verdict(c["tried"], c["clear"], [c["max_s"]] if c["max_s"] is not None else [], c["signal_deaths"],
                   c["hung"], c["problems"])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--timeout", type=float, default=5.0, help="the optimizers' timeout= (s)")
    parser.add_argument("--scenarios", type=names(SCENARIOS + ["nan-unchecked"]),
                        default=",".join(SCENARIOS + ["nan-unchecked"]), help="comma list of %(default)s")
    parser.add_argument("--paths", type=names(["p2p", "group"]), default="p2p,group", help="comma list of %(default)s")
    parser.add_argument("--modes", type=names(["awc", "atc"]), default="awc,atc", help="comma list of %(default)s")
    parser.add_argument("--deadline", type=float, default=300.0, help="seconds a job may take before it is killed")
    parser.add_argument("--out", default=os.path.join(REPO_ROOT, "bench", "results", "fault_matrix"),
                        help="result prefix: PREFIX.json and PREFIX.md (default bench/results/fault_matrix)")
    args = parser.parse_args()
    cells = []
    load_at_start = os.getloadavg()[0]
    started = time.monotonic()
    for scenario in args.scenarios:
        for path in args.paths:
            for mode in args.modes:
                c = run_cell(scenario, path, mode, args.timeout, args.deadline)
                cells.append(c)
                verdict = "observed" if "passed" not in c else ("PASS" if c["passed"] else "FAIL")
                print(f"{scenario:14s} {path:5s} {mode}: {verdict} ({c['wall_s']:.0f} s)"
                      + "".join(f"\n    {p}" for p in c.get("problems", [])), flush=True)
    text = tables(cells, args.timeout)
    total = time.monotonic() - started
    text += (f"\n\n{len(cells)} jobs in {total:.0f} s (load average: {load_at_start:.1f} at the start, "
             f"{os.getloadavg()[0]:.1f} at the end; {os.cpu_count()} CPUs)")
    print("\n" + text)
    with open(output_file(args.out + ".json"), "w") as f:
        json.dump(dict(timeout=args.timeout, cells=cells, wall_s=total), f, indent=1, default=str)
    with open(args.out + ".md", "w") as f:
        f.write(text + "\n")
    failed = [c for c in cells if c.get("passed") is False]
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
