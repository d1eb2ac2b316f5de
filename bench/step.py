"""Per-step time of a full training step (forward, backward, optimizer, communication) on CPU ranks.

Candidates, all on the same MLP and data in the same run:
  ddp           torch DDP + torch.optim.AdamW(foreach)                      (the all-reduce baseline)
  ours-awc      decent_comm.DAdamW(topology=one-peer-exp, mode="awc")
  ours-atc      decent_comm.DAdamW(topology=one-peer-exp, mode="atc", model=...)
  python-dec    a pure-Python decentralized baseline the way the seed library Decent-DP does it: AdamW
                (foreach), then an async all_reduce of the flat parameters in a 2-rank sub-group (hypercube
                pairs), waited for at the start of the next step
  local         torch.optim.AdamW(foreach), no communication                 (the compute floor)
Reports the mean step time over the timed steps (wall time / steps, as CLUSTER-NOTES advises) and the
ratio to DDP, as a markdown table and JSON under bench/results/.

    python bench/step.py [--world-sizes 1,4] [--layers 6 --width 1024] [--steps 20]
"""

import argparse
import json
import math
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench_args import collect, count, listed, names, output_file  # bench/, this script's directory

CANDIDATES = ["ddp", "ours-awc", "ours-atc", "python-dec", "local"]


def make_mlp(layers, width):
    torch.manual_seed(0)
    mods = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.GELU()]
    return torch.nn.Sequential(*mods)


class PythonDecentralized:
    """Decent-DP-style baseline: local AdamW, then average with the hypercube partner of this step through
    an async all_reduce on a 2-rank sub-group (created up front for every pair, as Decent-DP does)."""

    def __init__(self, model, rank, world):
        self.params = [p for p in model.parameters()]
        self.opt = torch.optim.AdamW(self.params, lr=1e-4, foreach=True)
        self.flat = torch.cat([p.detach().reshape(-1) for p in self.params])
        offset = 0
        for p in self.params:
            p.data = self.flat[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
        self.dims = max(1, int(math.log2(world)))
        self.groups = {}
        for d in range(self.dims):
            for a in range(world):
                b = a ^ (1 << d)
                if a < b < world:
                    g = dist.new_group([a, b])
                    if rank in (a, b):
                        self.groups[d] = g
        self.t = 0
        self.work = None

    def step(self):
        if self.work is not None:
            self.work.wait()
            self.flat.div_(2)
        self.opt.step()
        g = self.groups.get(self.t % self.dims)
        self.work = dist.all_reduce(self.flat, group=g, async_op=True) if g is not None else None
        self.t += 1

    def zero_grad(self):
        self.opt.zero_grad()


def build(candidate, model, rank, world):
    import decent_comm
    if candidate == "ddp":
        ddp = torch.nn.parallel.DistributedDataParallel(model) if world > 1 else model
        return ddp, torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    if candidate in ("ours-awc", "ours-atc"):
        mode = candidate.split("-")[1]
        opt = decent_comm.DAdamW(model.parameters(), lr=1e-4, topology="one-peer-exp", mode=mode,
                                 model=model if mode == "atc" else None)
        return model, opt
    if candidate == "python-dec":
        return model, PythonDecentralized(model, rank, world)
    if candidate == "local":
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    raise ValueError(f"unknown candidate {candidate!r}; choose from {', '.join(CANDIDATES)}")  # was timed as local


def run_rank(rank, world, port, args, queue):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    results = {}
    for candidate in args.candidates:
        if candidate == "python-dec" and world & (world - 1):
            continue  # hypercube pairs need a power of two
        model = make_mlp(args.layers, args.width)
        net, opt = build(candidate, model, rank, world)
        x = torch.randn(args.batch, args.width, generator=torch.Generator().manual_seed(rank))
        for i in range(args.warmup + args.steps):
            if i == args.warmup:
                dist.barrier()
                start = time.perf_counter()
            opt.zero_grad()
            net(x).square().mean().backward()
            opt.step()
        if hasattr(opt, "synchronize"):
            opt.synchronize()
        elapsed = time.perf_counter() - start
        t = torch.tensor([elapsed / args.steps])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
        results[candidate] = float(t)
        if hasattr(opt, "shutdown"):
            opt.shutdown()
        del net, opt, model
        dist.barrier()
    if rank == 0:
        queue.put(results)
    dist.barrier()
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-sizes", type=listed(count(1)), default="1,4", help="comma-separated (default %(default)s)")
    ap.add_argument("--layers", type=count(1), default=6, help="the MLP's Linear+GELU layers (default %(default)s)")
    ap.add_argument("--width", type=count(1), default=1024, help="their width (default %(default)s)")
    ap.add_argument("--batch", type=count(1), default=32, help="batch per rank (default %(default)s)")
    ap.add_argument("--steps", type=count(1), default=15, help="timed steps (default %(default)s)")
    ap.add_argument("--warmup", type=count(0), default=3, help="untimed steps first (default %(default)s)")
    ap.add_argument("--candidates", type=names(CANDIDATES), default=",".join(CANDIDATES),
                    help="comma list of %(default)s; ratios are to ddp when it is listed")
    ap.add_argument("--json", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "step.json"),
                    help="where to write the results (default bench/results/step.json)")
    args = ap.parse_args()
    params = args.layers * (args.width * args.width + args.width)
    print(f"MLP {args.layers}x{args.width} ({params / 1e6:.1f}M params), batch {args.batch}, {args.steps} timed steps, "
          f"gloo on loopback, 1 thread per rank, {os.cpu_count()} cores")
    print("| world | " + " | ".join(args.candidates) + " |")
    print("|---" * (len(args.candidates) + 1) + "|")
    all_rows = {}
    for world in args.world_sizes:
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        port = free_port()
        procs = [ctx.Process(target=run_rank, args=(r, world, port, args, queue)) for r in range(world)]
        for p in procs:
            p.start()
        res = collect(queue, procs, "bench/step.py")
        for p in procs:
            p.join()
        all_rows[world] = res
        ddp = res.get("ddp")  # without ddp in --candidates: times only
        cells = [f"{res[c] * 1e3:.0f} ms" + (f" ({res[c] / ddp:.2f}x)" if ddp else "") if c in res else "-"
                 for c in args.candidates]
        print(f"| {world} | " + " | ".join(cells) + " |", flush=True)
    with open(output_file(args.json), "w") as f:
        json.dump(dict(layers=args.layers, width=args.width, batch=args.batch, params=params, seconds=all_rows), f,
                  indent=1)
    print(("ratios are step time / DDP step time (lower is faster); " if "ddp" in args.candidates else "") +
          "wrote", args.json)


if __name__ == "__main__":
    main()
