"""What every rank of a bench/cluster.py (or bench/validate_model.py) job runs: one torchrun launch per
emulated cluster layout, then, inside it, several training runs one after the other on the same process
group, so the few seconds each torchrun start costs (4 ranks importing torch on 2 cores) are paid once.

    torchrun ... bench/cluster_worker.py PLAN.json

PLAN.json (written by the driver):

    {"workload": "synthetic" | "lm", "out": DIR, "compute_probe_steps": 12, "link_probe_bytes": 4194304,
     "phases": [{"name": "comm-bound", "bandwidth": "200Mbit",
                 "straggler": {"std": 0.3, "mean_over_std": 2.0},          # optional
                 "runs": [{"name": "allreduce", "argv": [...], "extra": "none" | "constant" | "random"}]}]}

Per phase: rank 0 asks the driver to shape the links (writes DIR/phase<k>.request, waits for
DIR/phase<k>.ready), then every rank measures the links (inter- and intra-node point-to-point bandwidth
and latency, all-reduce time of the model's parameters), then trains each run with decent_train.loop.run
(argv: the workload's flags). Once per job, before the first phase, every rank times its own training
steps with no communication at all (forward + backward + AdamW update: the compute time C the runtime
model takes), all ranks at once so they share the CPU as in the real runs.

Straggler emulation (--straggler-ms MEAN,STD, decent_train.loop.Straggler): a phase's `straggler` gives STD as a
fraction of the run's own mean compute (C + MEAN) and MEAN = mean_over_std x STD, so runs with extra
"constant" sleep MEAN every step (no variance) and runs with "random" sleep max(0, N(MEAN, STD)): the same
mean compute, only the variance differs (sigma^2 = Var[C] / E[C]^2 as in the runtime model).

Timing: decent_train.loop stops its stopwatch at each log point; here every rank first waits at a barrier,
so a run's training time lasts until its slowest rank has finished the step (rank 0 alone could be ahead of
its neighbours in a decentralized run). Runs log only at evaluation points (--log-every = --eval-every),
which are collectives anyway.

Rank 0 writes DIR/results.json: the probes and, per run, decent_train.loop.run's summary and rows.
"""

import importlib
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from decent_train.distributed import DistEnv, rank_seed
from decent_train.flags import resolve_defaults
from decent_train.loop import Stopwatch, train_step
from decent_train.loop import run as run_training  # not `run`: main() loops over the plan's runs as `run`
from decent_train.strategy import Strategy, torch_optimizer

WORKLOADS = ("lm", "synthetic", "digits")   # modules of decent_train.workloads


def workload_module(name: str):
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}")
    return importlib.import_module(f"decent_train.workloads.{name}")


class JobStopwatch(Stopwatch):
    """decent_train.loop.Stopwatch whose stop() waits for every rank first (see the module docstring)."""

    def stop(self) -> float:
        if dist.is_initialized():
            dist.barrier()
        return super().stop()


def wait_for_driver(out: str, k: int, bandwidth, timeout: float = 120.0):
    """Rank 0 asks the driver to shape the links for phase k and waits until it has."""
    if dist.get_rank() == 0:
        with open(os.path.join(out, f"phase{k}.request.tmp"), "w") as f:
            json.dump({"bandwidth": bandwidth}, f)
        os.replace(os.path.join(out, f"phase{k}.request.tmp"), os.path.join(out, f"phase{k}.request"))
        deadline = time.monotonic() + timeout
        while not os.path.exists(os.path.join(out, f"phase{k}.ready")):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the driver did not shape the links for phase {k} within {timeout:.0f} s")
            time.sleep(0.05)
    dist.barrier()


def compute_probe(mod, argv, steps: int) -> dict:
    """Per-step compute time (no communication) of every rank, all ranks at once; returns rank 0's view."""
    env = DistEnv(rank=dist.get_rank(), world_size=dist.get_world_size())
    args = mod.parse_args(argv)
    resolve_defaults(args, mod.LR_DEFAULTS, env.world_size)
    torch.manual_seed(args.seed)
    task = mod.build_task(args, env)
    opt = torch_optimizer(torch.optim.AdamW, task.model.parameters(), args)
    strategy = Strategy(opt, task.model, decentralized=False)
    gen = torch.Generator().manual_seed(rank_seed(args.seed, env.rank))
    times = []
    dist.barrier()
    for i in range(steps + 2):                      # 2 warm-up steps
        t0 = time.perf_counter()
        train_step(args, task, strategy, gen, torch.device("cpu"))
        if i >= 2:
            times.append(time.perf_counter() - t0)
    everyone = [None] * env.world_size
    dist.all_gather_object(everyone, times)
    n_params = sum(p.numel() for p in task.model.parameters())
    flat = [t for ts in everyone for t in ts]
    return {"per_rank": everyone, "mean_s": statistics.fmean(flat), "std_s": statistics.pstdev(flat),
            "params": n_params, "description": task.description}


def _pingpong(src: int, dst: int, x: torch.Tensor, reps: int) -> list:
    """Round-trip seconds of a message x from src to dst and back (as src sees them); others return []."""
    rank = dist.get_rank()
    out = []
    for _ in range(reps):
        if rank == src:
            t0 = time.perf_counter()
            dist.send(x, dst)
            dist.recv(x, dst)
            out.append(time.perf_counter() - t0)
        elif rank == dst:
            dist.recv(x, src)
            dist.send(x, src)
    return out


def _stream(a: int, b: int, nbytes: int, reps: int) -> float:
    """Seconds for `reps` back-to-back exchanges of nbytes between a and b in both directions at once (a's
    view; the token buckets are drained after the first message, so this is the sustained full-duplex rate)."""
    rank = dist.get_rank()
    if rank not in (a, b):
        return 0.0
    peer = b if rank == a else a
    x, y = torch.ones(nbytes // 4), torch.empty(nbytes // 4)
    t0 = 0.0
    for i in range(reps + 1):
        if i == 1:
            t0 = time.perf_counter()
        works = [dist.irecv(y, peer), dist.isend(x, peer)]
        for w in works:
            w.wait()
    return time.perf_counter() - t0


def link_probe(nbytes: int, params: int, local_world_size: int) -> dict:
    """Inter-node (rank 0 <-> first rank of node 1) and intra-node (rank 0 <-> 1) bandwidth per direction under
    full-duplex load and one-way latency (half the round trip of a 4-byte message), and the time of one
    all-reduce of `params` floats (what DDP moves per step), as rank 0 sees them."""
    world = dist.get_world_size()
    L = local_world_size
    result = {}
    small = torch.ones(1)
    pairs = {"inter": (0, L) if world > L else None, "intra": (0, 1) if L > 1 else None}
    for kind, pair in pairs.items():
        dist.barrier()
        if pair is None:
            continue
        _pingpong(*pair, small, 3)
        lat = _pingpong(*pair, small, 20)
        reps = 3
        seconds = _stream(*pair, nbytes, reps)
        if dist.get_rank() == 0:
            one_way = statistics.median(lat) / 2
            result[f"{kind}_latency_s"] = one_way
            result[f"{kind}_bandwidth_Bps"] = reps * nbytes / max(1e-9, seconds - reps * one_way)
    dist.barrier()
    x = torch.ones(params)
    dist.all_reduce(x)
    dist.barrier()
    ts = []
    for _ in range(3):
        t0 = time.perf_counter()
        dist.all_reduce(x)
        ts.append(time.perf_counter() - t0)
    everyone = [None] * world
    dist.all_gather_object(everyone, statistics.fmean(ts))
    result["allreduce_s"] = max(everyone)
    result["allreduce_bytes"] = 4 * params
    return result


def straggler_ms(spec: dict, compute_s: float) -> tuple:
    """(MEAN, STD) in ms: STD = std x (C + MEAN), MEAN = k x STD  =>  STD = std C / (1 - std k)."""
    f, k = float(spec["std"]), float(spec.get("mean_over_std", 2.0))
    if f * k >= 1:
        raise ValueError(f"straggler std {f} x mean_over_std {k} must be < 1")
    std = f * compute_s / (1.0 - f * k)
    return 1e3 * k * std, 1e3 * std


def main(plan_path: str):
    with open(plan_path) as f:
        plan = json.load(f)
    out = plan["out"]
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    L = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    mod = workload_module(plan["workload"])

    first_argv = plan["phases"][0]["runs"][0]["argv"]
    results = {"plan": plan, "world_size": dist.get_world_size(), "local_world_size": L, "phases": []}
    results["compute"] = compute_probe(mod, first_argv, plan.get("compute_probe_steps", 12))
    compute_s = results["compute"]["mean_s"]
    for k, phase in enumerate(plan["phases"]):
        wait_for_driver(out, k, phase.get("bandwidth"))
        rec = {"name": phase["name"], "bandwidth": phase.get("bandwidth"), "runs": []}
        rec["link"] = link_probe(plan.get("link_probe_bytes", 4 << 20), results["compute"]["params"], L)
        extra = straggler_ms(phase["straggler"], compute_s) if phase.get("straggler") else None
        rec["straggler_ms"] = extra
        for run in phase["runs"]:
            argv = list(run["argv"])
            kind = run.get("extra", "none")
            if kind != "none":
                argv += ["--straggler-ms", f"{extra[0]:.3f},{0.0 if kind == 'constant' else extra[1]:.3f}"]
            run_out = os.path.join(out, f"phase{k}", run["name"])
            argv += ["--out", run_out, "--no-progress"]
            dist.barrier()
            t0 = time.perf_counter()
            summary = run_training(mod.parse_args(argv), mod.build_task, mod.LR_DEFAULTS, stopwatch_cls=JobStopwatch)
            wall = time.perf_counter() - t0
            if rank == 0:
                with open(os.path.join(run_out, "log.json")) as f:
                    log = json.load(f)
                rec["runs"].append({"name": run["name"], "extra": kind, "argv": argv, "summary": summary,
                                    "rows": log["rows"], "wall_s": wall})
        results["phases"].append(rec)
        if rank == 0:  # after every phase, so a job killed later keeps what it measured
            with open(os.path.join(out, "results.json.tmp"), "w") as f:
                json.dump(results, f, indent=1)
            os.replace(os.path.join(out, "results.json.tmp"), os.path.join(out, "results.json"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
