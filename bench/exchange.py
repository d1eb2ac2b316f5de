"""Per-step exchange time of decent_comm's C++ scheduler on gloo (loopback), against named baselines.

For each world size and buffer size (float32), every rank times one step of
  ours-<topology>    Exchanger.exchange + wait: the buffer to/from the step's gossip peers
  batch-<topology>   torch.distributed.batch_isend_irecv doing the same exchange (recvs posted first, like ours)
  all_reduce         dist.all_reduce of the same buffer (what data-parallel training does instead)
for topologies one-peer-exp, ring and exp. The candidates are interleaved round-robin within a
configuration (repetition r times every candidate once, at topology step r) so load drift on a shared
machine hits all of them alike; a step's time is the slowest rank's (a barrier starts every step), and the
table reports the median over repetitions and same-run ratios.

Targets: ours/batch <= 1.05 (no overhead over torch's p2p), and ours-one-peer-exp/all_reduce <= 0.6 at
8 ranks for >= 25 MB.

    python bench/exchange.py [--quick] [--world-sizes 2,4,8] [--sizes-mb 1,25,100] [--reps N] [--json PATH]

--nccl-self (one GPU): the NCCL transport's throughput, one rank exchanging with itself (the tests-only
loopback: a send to and a receive from the own rank in one NCCL group), fp32 and with a bf16 wire, at 16M and
64M elements; N back-to-back exchange+wait per pair of CUDA events, the median of the repetitions. GB/s counts
the bytes sent; beside it the device's copy bandwidth (x.copy_(y), bytes read + written) of the same run, and the
host's median microseconds in exchange() and in wait() (each pair after a synchronize).
"""
import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench_args import collect, count, listed, number, output_file  # bench/, this script's directory
from decent_comm import topology as T
from decent_comm.exchange import Exchanger

TOPOLOGIES = ["one-peer-exp", "ring", "exp"]


def peers(topo, rank, step):
    p = topo.peers(rank, step)
    return list(p.send), [r for r, _ in p.recv]


def candidates(rank, world_size, numel, ex):
    """name -> fn(step) running one exchange step of that candidate on this rank."""
    buf = torch.randn(numel)
    recvs = [torch.empty(numel) for _ in range(world_size - 1)]
    out = {}
    for name in TOPOLOGIES:
        topo = T.make(name, world_size)

        def ours(step, topo=topo):
            send_to, recv_from = peers(topo, rank, step)
            ex.exchange(0, buf, recvs[:len(recv_from)], send_to, recv_from)
            ex.wait(0)

        def batch(step, topo=topo):
            send_to, recv_from = peers(topo, rank, step)
            ops = [dist.P2POp(dist.irecv, recvs[i], src) for i, src in enumerate(recv_from)]
            ops += [dist.P2POp(dist.isend, buf, dst) for dst in send_to]
            for work in dist.batch_isend_irecv(ops):
                work.wait()

        out[f"ours-{name}"] = ours
        out[f"batch-{name}"] = batch
    out["all_reduce"] = lambda step: dist.all_reduce(buf)
    return out


def worker(rank, world_size, port, sizes_mb, reps, queue):
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=datetime.timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=600))
    rows = []
    with Exchanger(timeout=600) as ex:
        for mb in sizes_mb:
            numel = int(mb * 2**20) // 4
            cands = candidates(rank, world_size, numel, ex)
            # Warm-up: connections, first-touch of the buffers, and a whole period of every topology's steps, so
            # each (peer, direction) has made its one size/dtype handshake before the timed steps.
            for name, fn in cands.items():
                for step in range(world_size):
                    fn(step)
            samples = {name: [] for name in cands}
            # Small buffers are quick and noisier: more repetitions for the same confidence.
            for rep in range(reps * 4 if mb <= 1 else reps):
                for name, fn in cands.items():
                    dist.barrier()
                    t0 = time.perf_counter()
                    fn(rep + 1)
                    samples[name].append(time.perf_counter() - t0)
            gathered = [None] * world_size
            dist.all_gather_object(gathered, samples)
            if rank == 0:
                for name in cands:
                    slowest = [max(g[name][i] for g in gathered) for i in range(len(samples[name]))]
                    rows.append(dict(world_size=world_size, size_mb=mb, candidate=name,
                                     median_s=statistics.median(slowest), samples_s=slowest))
            del cands
    dist.barrier()
    if rank == 0:
        queue.put(rows)
    dist.destroy_process_group()


def run_world(world_size, sizes_mb, reps):
    ctx = mp.get_context("spawn")
    store = dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True, wait_for_workers=False)
    queue = ctx.Queue()
    os.environ["OMP_NUM_THREADS"] = "1"
    procs = [ctx.Process(target=worker, args=(r, world_size, store.port, sizes_mb, reps, queue), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    rows = collect(queue, procs, "bench/exchange.py")
    for p in procs:
        p.join(timeout=60)
    return rows


def table(rows):
    by = {}
    for r in rows:
        by.setdefault((r["world_size"], r["size_mb"]), {})[r["candidate"]] = r["median_s"]
    lines = ["| ranks | MB | topology | ours ms | batch_isend_irecv ms | ours/batch | all_reduce ms "
             "| ours/all_reduce |",
             "|---:|---:|---|---:|---:|---:|---:|---:|"]
    for (ws, mb), c in sorted(by.items()):
        for name in TOPOLOGIES:
            ours, batch, ar = c[f"ours-{name}"], c[f"batch-{name}"], c["all_reduce"]
            lines.append(f"| {ws} | {mb:g} | {name} | {ours * 1e3:.2f} | {batch * 1e3:.2f} | {ours / batch:.2f} | "
                         f"{ar * 1e3:.2f} | {ours / ar:.2f} |")
    return "\n".join(lines)


def host_us(ex, send, recv, n):
    """Median host microseconds of exchange() and of wait() on the NCCL self-exchange: the GPU time per exchange
    barely grew with the bytes on the H200 (136 us at 64 MB, 153 us at 256 MB), so where the fixed part goes
    (the host's enqueue, or the GPU) is the next question. Synchronized before each pair: an exchange waits for
    nothing in front of it."""
    exchange, wait = [], []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        ex.exchange(0, send, [recv], [0], [0])
        t1 = time.perf_counter()
        ex.wait(0)
        wait.append(time.perf_counter() - t1)
        exchange.append(t1 - t0)
    torch.cuda.synchronize()
    return statistics.median(exchange) * 1e6, statistics.median(wait) * 1e6


def nccl_self(reps, inner=10, sizes=(1 << 24, 1 << 26)):
    """Rows of the NCCL self-exchange (see the module docstring) and the device copy bandwidth in GB/s."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)

    def median_s(fn):
        fn()  # warm-up: connection, handshake, first-touch
        torch.cuda.synchronize()
        samples = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(inner):
                fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3 / inner)
        return statistics.median(samples)

    src, dst = torch.randn(sizes[-1], device="cuda"), torch.empty(sizes[-1], device="cuda")
    copy_gbps = 2 * src.nbytes / median_s(lambda: dst.copy_(src)) / 1e9
    rows = []
    for wire in (None, torch.bfloat16):
        with Exchanger(device="cuda", timeout=120, wire_dtype=wire, _allow_self_exchange=True) as ex:
            for numel in sizes:
                send = torch.randn(numel, device="cuda")
                recv = torch.empty(numel, dtype=wire or send.dtype, device="cuda")

                def one():
                    ex.exchange(0, send, [recv], [0], [0])
                    ex.wait(0)

                seconds = median_s(one)
                host_exchange, host_wait = host_us(ex, send, recv, reps * inner)
                rows.append(dict(numel=numel, wire=str(wire or send.dtype).replace("torch.", ""), median_s=seconds,
                                 gbps=recv.nbytes / seconds / 1e9, host_exchange_us=host_exchange,
                                 host_wait_us=host_wait))
    dist.destroy_process_group()
    return dict(device=torch.cuda.get_device_name(), copy_gbps=copy_gbps, inner=inner, reps=reps, rows=rows)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="2 and 4 ranks, 1 and 25 MB, 5 repetitions (< 1 min)")
    ap.add_argument("--world-sizes", type=listed(count(2)), default=None, help="comma-separated (default 2,4,8)")
    ap.add_argument("--sizes-mb", type=listed(number(0.0, strictly=True)), default=None,
                    help="comma-separated buffer sizes in MB (default 1,25,100)")
    ap.add_argument("--reps", type=count(1), default=None,
                    help="repetitions per candidate (default 9; 4x that for buffers <= 1 MB)")
    ap.add_argument("--json", default=None, help="output (default bench/results/exchange_cpu[_quick].json, "
                                                  "exchange_nccl_self.json)")
    ap.add_argument("--nccl-self", action="store_true", help="one GPU: the NCCL transport exchanging with itself")
    args = ap.parse_args()
    results = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    if args.nccl_self:
        out = nccl_self(args.reps or 9)
        print(f"| NCCL self-exchange ({out['device']}) | elements | wire | GB/s sent | % of copy "
              f"({out['copy_gbps']:.0f} GB/s) |")
        for r in out["rows"]:
            print(f"| | {r['numel'] >> 20}M | {r['wire']} | {r['gbps']:.0f} | {100 * r['gbps'] / out['copy_gbps']:.0f}% |")
        path = args.json or os.path.join(results, "exchange_nccl_self.json")
        with open(output_file(path), "w") as f:
            json.dump(out, f, indent=1)
        return
    world_sizes = args.world_sizes or ([2, 4] if args.quick else [2, 4, 8])
    sizes_mb = args.sizes_mb or ([1.0, 25.0] if args.quick else [1.0, 25.0, 100.0])
    reps = args.reps or (5 if args.quick else 9)  # --reps 0 is refused above: `or` only fills the default

    rows = []
    for ws in world_sizes:
        t0 = time.time()
        rows += run_world(ws, sizes_mb, reps)
        print(f"[bench/exchange] {ws} ranks done in {time.time() - t0:.0f} s", file=sys.stderr)
    print(table(rows))
    path = args.json or os.path.join(results, f"exchange_cpu{'_quick' if args.quick else ''}.json")
    with open(output_file(path), "w") as f:
        json.dump(dict(torch=torch.__version__, machine=platform.processor() or platform.machine(),
                       cpus=os.cpu_count(), load_avg=os.getloadavg(), reps=reps, rows=rows), f, indent=1)
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
