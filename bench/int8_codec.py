"""Benchmark of the 8-bit wire's codec kernels (decent_comm.ops.int8_encode_ / int8_dequantize_add_) as same-run
ratios against named baselines and the memory roofline.

  encode   payload <- Q(x - copy); copy += deq(payload): reads x and copy, writes copy and the payload
           (13 bytes per element); roofline: x.add_(y) (the same 2 float reads and 1 float write).
  decode   copy += deq(payload): reads copy and the levels, writes copy (9 bytes per element); roofline: the
           faster of x.copy_(y) and x.add_(y).
  torch ops   the same codec as a chain of torch ops (what decent_comm ran before the fused kernels: sub, per-block
              absmax, div, mul, round, clamp, int8 cast, then cast, mul, add), bit-for-bit the same math except
              that 127 / absmax is computed as reciprocal * 127.
GB/s counts the bytes above. CPU: at 1 and 2 threads (--threads), and the instruction set the codec's loops picked.

    python bench/int8_codec.py [--device cpu|cuda] [--sizes 1M,16M] [--threads 1,2] [--json PATH]
"""

import argparse
import json
import os
import platform

import torch

import mix_kernels as mk
from bench_args import count, device_name, elements, listed, output_file  # bench/, this script's directory
from decent_comm import _native, ops

BLOCK = 512


def torch_encode(x, copy, payload):
    n = x.numel()
    q, scale = ops.int8_payload_views(payload, BLOCK)
    nb = scale.numel()
    delta = torch.zeros(nb * BLOCK, dtype=torch.float32, device=x.device)
    torch.sub(x, copy, out=delta[:n])
    d = delta.view(nb, BLOCK)
    amax = torch.linalg.vector_norm(d, float("inf"), dim=1)
    torch.div(amax, 127.0, out=scale)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q.copy_(d.mul_(inv[:, None]).round_().clamp_(-127.0, 127.0))
    torch_decode(copy, payload)


def torch_decode(copy, payload):
    n = copy.numel()
    q, scale = ops.int8_payload_views(payload, BLOCK)
    copy.add_(q.to(torch.float32).mul_(scale[:, None]).view(-1)[:n])


def bench(device, sizes, repeats):
    rows = []
    for n in sizes:
        x, copy, receiver = (torch.randn(n, device=device) for _ in range(3))
        payload = torch.empty(ops.int8_payload_nbytes(n), dtype=torch.uint8, device=device)
        srcs = [torch.randn(n, device=device) for _ in range(2)]
        out = torch.randn(n, device=device)
        for op, ours, baseline, nbytes, shape in [
            ("encode", lambda: ops.int8_encode_(x, copy, payload), lambda: torch_encode(x, copy, payload), 13, (2, 1)),
            ("decode", lambda: ops.int8_dequantize_add_(receiver, payload), lambda: torch_decode(receiver, payload),
             9, (1, 1)),
        ]:
            t = mk.time_all(device, {"ours": ours, "torch_ops": baseline, **mk.roofline_kernels(out, srcs)}, repeats)
            if op == "decode":  # the faster of the two one-read-one-write-ish kernels
                t["copy"] = min(t["copy"], t["add_"] * 8 / 12)
            roof = mk.roofline_bandwidth(n, t, *shape)
            gbps = nbytes * n / t["ours"] / 1e9
            rows.append(dict(op=op, n=n, threads=torch.get_num_threads(), gbps=gbps, roofline_gbps=roof / 1e9,
                             pct_roofline=100 * gbps / (roof / 1e9), vs_torch_ops=t["torch_ops"] / t["ours"],
                             seconds=t))
            r = rows[-1]
            print(f"| {op:<6} | {n / 2**20:>5.1f}M | {r['threads']} | {gbps:6.2f} | {r['pct_roofline']:5.1f}% | "
                  f"{r['vs_torch_ops']:6.1f}x |", flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", type=device_name, default="cuda" if torch.cuda.is_available() else "cpu",
                    help="cpu or cuda (default: cuda where torch sees a GPU, else cpu)")
    ap.add_argument("--sizes", type=listed(elements), default="1M,4M,16M,64M",
                    help="comma-separated element counts, M = 2^20 (default %(default)s)")
    ap.add_argument("--threads", type=listed(count(1)), default="1,2",
                    help="CPU thread counts to run at (default %(default)s)")
    ap.add_argument("--repeats", type=count(1), default=None,
                    help="timed rounds per row; the median counts (default 7 on cpu, 50 on cuda)")
    ap.add_argument("--inner", type=count(1), default=None, help="back-to-back calls per timing on CUDA (default 10)")
    ap.add_argument("--json", default=None,
                    help="where to write the results (default bench/results/int8_codec_<device>.json)")
    args = ap.parse_args()
    sizes = args.sizes
    mk.INNER = args.inner or (10 if args.device == "cuda" else 1)
    repeats = args.repeats or (7 if args.device == "cpu" else 50)
    name = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or platform.machine()
    print(f"device {args.device} ({name}), torch {torch.__version__}; CPU capability (torch) "
          f"{torch.backends.cpu.get_cpu_capability()}, codec loops {_native.cpu_isa()}")
    print("| op     |   size | threads | GB/s | roofline | vs torch ops |")
    print("|--------|--------|---|--------|----------|--------------|")
    rows = []
    for threads in (args.threads if args.device == "cpu" else [torch.get_num_threads()]):
        torch.set_num_threads(threads)
        rows += bench(args.device, sizes, repeats)
    path = args.json or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                     f"int8_codec_{args.device}.json")
    with open(output_file(path), "w") as f:
        json.dump(dict(device=args.device, device_name=name, torch=torch.__version__,
                       isa=_native.cpu_isa(), rows=rows), f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
