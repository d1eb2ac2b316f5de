"""Benchmark of the fused gossip-mix kernels against named baselines, as same-run ratios.

For each size, neighbour count k and neighbour dtype it times
  ours        decent_comm.ops.gossip_mix_
  op chain    x.mul_(sw); x.add_(y_j, alpha=w_j) ...           (what a pure-PyTorch gossip step does)
  foreach     torch._foreach_mul_ / _foreach_add_ chain
  cupy        a CuPy ElementwiseKernel doing the same mix (GPU, when CuPy is installed)
and the memory roofline: the bandwidth of the in-place single-pass torch kernel with the op's stream shape
(x.add_(y) for k = 1, x.addcmul_(y, z) for k = 2), else the best of x.copy_(y), add_ and addcmul_ (see
roofline_bandwidth), plus lerp_ (one pass, k = 1) as a named baseline.
GB/s counts the minimum bytes an op must move (read x and every neighbour once, write x once).
mix_adam_ and mix_sgd_ (momentum) are compared with torch.optim.AdamW / SGD (foreach on CPU, fused on CUDA) followed by the same mix.
The 8-bit wire's mixes (neighbour "int8": the payloads dequantized inside the kernel) are compared with the two-pass
way, int8_dequantize_add_ then the op (see bench_int8_mix).

The CPU loops run with the best instruction set the CPU has (the header line names it and torch's); run with
DECENT_COMM_CPU_ISA=baseline to time the x86-64 baseline loops against the same torch kernels.

Our ops' operands are placed as the optimizers' buckets place their flat buffers (--layout optimizer, the default:
each starts in its own lane of the page, decent_comm/optim/flat_memory.py), or allocated one by one as plain torch
tensors (--layout separate: every buffer at the same page offset, as a user's own tensors usually are). The torch
baselines run on torch's own tensors either way.

    python bench/mix_kernels.py [--quick] [--device cpu|cuda] [--threads 1,2] [--json PATH]
"""

import argparse
import json
import os
import platform
import statistics
import time

import torch

from bench_args import count, device_name, elements, listed, output_file  # bench/, this script's directory
from decent_comm import _native, ops
from decent_comm.optim.flat_memory import flat_buffer


PARTS = ("mix", "adam", "sgd", "int8")  # what --only picks from
INNER = 1  # back-to-back calls per timing on CUDA (--inner): one call at 1M elements times its launch only
LAYOUT = "optimizer"  # --layout
_lanes_used = 0


def operand(n, device, dtype=torch.float32, zero=False):
    """One operand of our ops, normal random or zero, placed as LAYOUT says (see the module doc)."""
    global _lanes_used
    if LAYOUT == "separate":
        t = torch.empty(n, dtype=dtype, device=device)
    else:
        t = flat_buffer(n, dtype, device, _lanes_used, zero=False)
        _lanes_used += 1
    return t.zero_() if zero else t.normal_()


def _time_once(device, fn):
    if device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(INNER):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / INNER
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def time_all(device, fns, repeats, warmup=2):
    """Median seconds of each candidate, timed round-robin (one run of each per round) so that load
    changes on a shared machine hit every candidate alike; the ratios are what to read. A competitor that
    fails (CuPy's bf16 interop is experimental) is left out with a note, never the whole table."""
    for name, fn in list(fns.items()):
        try:
            for _ in range(warmup):
                fn()
        except Exception as exc:  # noqa: BLE001 - a competitor's failure is reported, not fatal
            if name == "ours":
                raise
            print(f"  [{name} left out: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}]", flush=True)
            del fns[name]
    samples = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            samples[name].append(_time_once(device, fn))
    return {name: statistics.median(v) for name, v in samples.items()}


def cupy_mix(k):
    """A CuPy ElementwiseKernel computing x = sw*x + sum_j w_j*y_j in float32, or None without CuPy."""
    try:
        import cupy
    except ImportError:
        return None
    # One type placeholder for every neighbour: CuPy takes a single letter as a placeholder (T0 is read as a dtype
    # name and refused); the neighbours of one call share a dtype.
    params = ", ".join([f"raw T y{j}" for j in range(k)])
    weights = ", ".join([f"float32 w{j}" for j in range(k)])
    body = "float acc = sw * (float)x;" + "".join(f" acc += w{j} * (float)y{j}[i];" for j in range(k)) + " x = acc;"
    try:
        kernel = cupy.ElementwiseKernel(f"float32 sw, {weights}, {params}", "float32 x", body, f"dc_mix_{k}")
    except Exception as exc:  # noqa: BLE001 - a competitor CuPy cannot build is left out, like one that fails to run
        print(f"  [cupy left out: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}]", flush=True)
        return None

    def run(x, ys, sw, ws):
        kernel(sw, *ws, *[cupy.from_dlpack(y) for y in ys], cupy.from_dlpack(x))

    return run


# name -> (read streams, write streams) of the single-pass float32 torch kernels that measure the roofline. The
# fused ops update x in place, so the matching kernels do too: a CPU writes a cache line it has just read for
# free, but must first read a line it only writes, so an out-of-place kernel moves more bytes than it names.
ROOFLINE_STREAMS = {"copy": (1, 1), "add_": (2, 1), "addcmul_": (3, 1)}


def roofline_kernels(out, srcs):
    """The roofline kernels, updating `out` from distinct tensors `srcs` (a tensor read twice would come from
    cache the second time); timed in the same rounds as the candidates."""
    a, b = srcs[0], srcs[1]
    return {"copy": lambda: out.copy_(a), "add_": lambda: out.add_(a, alpha=0.5),
            "addcmul_": lambda: out.addcmul_(a, b, value=0.5)}


def roofline_bandwidth(n, seconds, reads: int, writes: int):
    """Bytes/s of the roofline of an op with `reads` input streams (x included) and `writes` output streams;
    removes the roofline kernels' entries from `seconds`. It is the torch kernel with the op's exact stream
    shape when there is one (gossip_mix_ k = 1: x.add_(y), k = 2: x.addcmul_(y, z)), else the fastest."""
    bw = {name: (r + w) * n * 4 / seconds.pop(name) for name, (r, w) in ROOFLINE_STREAMS.items()}
    same_shape = [name for name, shape in ROOFLINE_STREAMS.items() if shape == (reads, writes)]
    return bw[same_shape[0]] if same_shape else max(bw.values())


def footprint_roofline_kernels(nbytes: int, n: int, device, cap: int = 2**24):
    """The roofline kernels of an op that moves `nbytes` over buffers of n elements and has no same-shape torch
    kernel: each over buffers sized to move about as much (at least n, at most max(n, cap) elements: 64 MiB
    buffers are out of any cache), so that no kernel runs from a last-level cache the op's larger working set does
    not fit in (at 4M elements an op with copies moves 70-120 MB, copy_ over 4M-element buffers 32 MB).
    Returns ({name: fn}, {name: bytes it moves})."""
    fns, moved = {}, {}
    for name, (reads, writes) in ROOFLINE_STREAMS.items():
        m = min(max(n, nbytes // (4 * (reads + writes))), max(n, cap))
        out, a, b = (torch.randn(m, device=device) for _ in range(3))
        fns[name] = roofline_kernels(out, [a, b])[name]
        moved[name] = m * 4 * (reads + writes)
    return fns, moved


def bench_mix(device, sizes, ks, nb_dtypes, repeats):
    rows = []
    for n in sizes:
        x = operand(n, device)
        srcs = [torch.randn(n, device=device) for _ in range(2)]
        for nb_dtype in nb_dtypes:
            for k in ks:
                ys = [operand(n, device, nb_dtype) for _ in range(k)]
                sw, ws = 1.0 / (k + 1), [1.0 / (k + 1)] * k
                min_bytes = n * 4 * 2 + n * ys[0].element_size() * k

                def ours():
                    ops.gossip_mix_(x, ys, sw, ws)

                def chain():
                    x.mul_(sw)
                    for y, w in zip(ys, ws):
                        x.add_(y, alpha=w)

                def foreach():
                    torch._foreach_mul_([x], sw)
                    for y, w in zip(ys, ws):
                        torch._foreach_add_([x], [y], alpha=w)

                fns = {"ours": ours, "op_chain": chain, "foreach": foreach, **roofline_kernels(x, srcs)}
                if k == 1 and nb_dtype == torch.float32:
                    fns["lerp"] = lambda: x.lerp_(ys[0], 0.5)
                cp = cupy_mix(k) if device == "cuda" else None
                if cp is not None:
                    fns["cupy"] = lambda: cp(x, ys, sw, ws)
                t = time_all(device, fns, repeats)
                copy_bw = roofline_bandwidth(n, t, reads=k + 1, writes=1)
                gbs = min_bytes / t["ours"] / 1e9
                rows.append(result_row("gossip_mix_", n, k, str(nb_dtype).replace("torch.", ""), t, gbs, copy_bw))
                print(format_row(rows[-1]), flush=True)
    return rows


def bench_fused_update(device, sizes, ks, repeats, op, baseline, make_torch, make_ours, n_state):
    """A fused optimizer op against its torch optimizer `baseline` (foreach on CPU, fused on CUDA) followed by the
    same mix, and against that optimizer's step alone. `make_torch(params, **kw)` builds the torch optimizer,
    `make_ours(x, ys, sw, ws, g, state)` returns one call of the op; the op reads x, g, its `n_state` float32 state
    buffers and k neighbours, and writes x and the state."""
    rows = []
    for n in sizes:
        srcs = [torch.randn(n, device=device) for _ in range(2)]
        x_copy = torch.randn(n, device=device)
        for k in ks:
            p = torch.nn.Parameter(torch.randn(n, device=device))
            p.grad = torch.randn(n, device=device)
            ys = [operand(n, device) for _ in range(k)]
            sw, ws = 1.0 / (k + 1), [1.0 / (k + 1)] * k
            opt = make_torch([p], **(dict(fused=True) if device == "cuda" else dict(foreach=True)))
            x, g = operand(n, device), operand(n, device).copy_(p.grad)
            ours = make_ours(x, ys, sw, ws, g, [operand(n, device, zero=True) for _ in range(n_state)])

            def torch_step_then_mix():
                # AWC needs the pre-update x for the mix; the unfused way keeps a copy of it.
                with torch.no_grad():
                    x_old = p.detach().clone()
                    opt.step()
                    delta = p.detach().sub_(x_old)
                    p.detach().copy_(x_old).mul_(sw)
                    for y, w in zip(ys, ws):
                        p.detach().add_(y, alpha=w)
                    p.detach().add_(delta)

            t = time_all(device, {"ours": ours, f"{baseline}+mix": torch_step_then_mix, f"{baseline}_only": opt.step,
                                  **roofline_kernels(x_copy, srcs)}, repeats)
            copy_bw = roofline_bandwidth(n, t, reads=2 + n_state + k, writes=1 + n_state)
            gbs = n * 4 * (3 + 2 * n_state + k) / t["ours"] / 1e9  # the minimum bytes: see the docstring
            rows.append(result_row(op, n, k, "float32", t, gbs, copy_bw))
            print(format_row(rows[-1]), flush=True)
    return rows


def bench_adam(device, sizes, ks, repeats):
    def make_ours(x, ys, sw, ws, g, state):
        step = [0]

        def ours():
            step[0] += 1
            ops.mix_adam_(x, ys, sw, ws, g, *state, step[0], 1e-3, 0.9, 0.999, 1e-8, 0.01, True)
        return ours
    return bench_fused_update(device, sizes, ks, repeats, "mix_adam_", "adamw",
                              lambda ps, **kw: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01, **kw), make_ours, 2)


def bench_sgd(device, sizes, ks, repeats):
    """mix_sgd_ with momentum (the DSGD step) against torch.optim.SGD followed by the same mix."""
    def make_ours(x, ys, sw, ws, g, state):
        return lambda: ops.mix_sgd_(x, ys, sw, ws, g, state[0], 1e-3, momentum=0.9, weight_decay=0.01)
    return bench_fused_update(device, sizes, ks, repeats, "mix_sgd_", "sgd",
                              lambda ps, **kw: torch.optim.SGD(ps, lr=1e-3, momentum=0.9, weight_decay=0.01, **kw),
                              make_ours, 1)


def bench_int8_mix(device, sizes, ks, repeats):
    """The 8-bit wire's mixes with the payloads dequantized inside the kernel (ops' copies=/payloads=): the AWC step
    (mix_adam_ over k neighbours' public copies and this rank's own copy) and the ATC mix (gossip_mix_), against the
    two-pass way (int8_dequantize_add_ of each copy, then the same op reading the copies back), at the roofline of
    their bytes: x, grad, m, v as mix_adam_; each copy read and written (8 B), its levels (1 B) and scales; the own
    copy read (4 B). No torch kernel has that stream shape, so the roofline is the best of copy_/add_/addcmul_, each
    over buffers as large as the op's (footprint_roofline_kernels)."""
    rows = []
    for n in sizes:
        for k in ks:
            x, g = operand(n, device), operand(n, device)
            m, v = operand(n, device, zero=True), operand(n, device, zero=True)
            copies = [operand(n, device) for _ in range(k)]
            own = operand(n, device)
            payloads = []
            for _ in range(k):
                p = torch.empty(ops.int8_payload_nbytes(n), dtype=torch.uint8, device=device)
                ops.int8_encode_(torch.randn(n, device=device) * 1e-6, torch.zeros(n, device=device), p)
                payloads.append(p)
            ws = [0.5 / k] * k + [-0.5]  # as_correction's weights: the copies, then minus their sum on the own copy
            wire_bytes = n * 9 * k + 4 * k * (-(-n // 512)) + n * 4  # copies r+w, levels, scales; own copy read

            def adam_fused():
                ops.mix_adam_(x, [own], 1.0, ws, g, m, v, 1, 1e-3, 0.9, 0.999, 1e-8, 0.01, True, copies=copies,
                              payloads=payloads)

            def adam_two_pass():
                for c, p in zip(copies, payloads):
                    ops.int8_dequantize_add_(c, p)
                ops.mix_adam_(x, copies + [own], 1.0, ws, g, m, v, 1, 1e-3, 0.9, 0.999, 1e-8, 0.01, True)

            def mix_fused():
                ops.gossip_mix_(x, [own], 1.0, ws, copies=copies, payloads=payloads)

            def mix_two_pass():
                for c, p in zip(copies, payloads):
                    ops.int8_dequantize_add_(c, p)
                ops.gossip_mix_(x, copies + [own], 1.0, ws)

            for op, fused, two_pass, base_bytes in (("mix_adam_", adam_fused, adam_two_pass, n * 4 * 7),
                                                    ("gossip_mix_", mix_fused, mix_two_pass, n * 4 * 2)):
                roof, roof_bytes = footprint_roofline_kernels(base_bytes + wire_bytes, n, device)
                t = time_all(device, {"ours": fused, "decode+mix": two_pass, **roof}, repeats)
                del roof
                copy_bw = max(roof_bytes[name] / t.pop(name) for name in roof_bytes)
                gbs = (base_bytes + wire_bytes) / t["ours"] / 1e9
                rows.append(result_row(op, n, k, "int8", t, gbs, copy_bw))
                print(format_row(rows[-1]), flush=True)
    return rows


def result_row(op, n, k, nb_dtype, t, gbs, copy_bw):
    """One measured row: `t` the seconds of "ours" and of each baseline, `gbs` ours in GB/s, `copy_bw` the
    roofline's bytes/s."""
    return dict(op=op, n=n, k=k, nb_dtype=nb_dtype, seconds=t, gbps=gbs, roofline_gbps=copy_bw / 1e9,
                pct_roofline=100 * gbs / (copy_bw / 1e9),
                speedup={name: t[name] / t["ours"] for name in t if name != "ours"})


def format_row(r):
    sp = "  ".join(f"{name} {s:.2f}x" for name, s in r["speedup"].items())
    return (f"| {r['op']:<12} | {r['n'] / 2**20:>5.0f}M | {r['k']} | {r['nb_dtype']:<8} | {r['gbps']:6.2f} | "
            f"{r['pct_roofline']:5.1f}% | {sp} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", type=device_name, default="cuda" if torch.cuda.is_available() else "cpu",
                    help="cpu or cuda (default: cuda where torch sees a GPU, else cpu)")
    ap.add_argument("--quick", action="store_true", help="two sizes, k = 1, 2 (about a minute on 2 CPU cores)")
    ap.add_argument("--repeats", type=count(1), default=None,
                    help="timed rounds per row; the median counts (default 5 on cpu, 50 on cuda)")
    ap.add_argument("--sizes", type=listed(elements), default=None,
                    help="comma-separated element counts, M = 2^20 (e.g. 16M,64M)")
    ap.add_argument("--inner", type=count(1), default=None, help="back-to-back calls per timing on CUDA (default 10)")
    ap.add_argument("--json", default=None, help="where to write results (default bench/results/mix_kernels_<device>.json)")
    ap.add_argument("--only", default=None, help="comma-separated parts to run: mix,adam,sgd,int8 (default: all)")
    ap.add_argument("--layout", choices=["optimizer", "separate"], default="optimizer",
                    help="where our ops' operands lie (see the module doc)")
    ap.add_argument("--threads", type=listed(count(1)), default=None, help="CPU: comma-separated thread counts to run every row at (default: "
                    "torch's current count)")
    args = ap.parse_args()
    only = set(args.only.split(",")) if args.only else set(PARTS)
    if not only <= set(PARTS):  # an unknown part ran nothing and wrote an empty table
        ap.error(f"--only: unknown part(s) {sorted(only - set(PARTS))}; choose from {','.join(PARTS)}")

    sizes = args.sizes or ([2**20, 2**24] if args.quick else [2**20, 2**22, 2**24, 2**26])
    global INNER, LAYOUT
    INNER = args.inner or (10 if args.device == "cuda" else 1)
    LAYOUT = args.layout
    ks = [1, 2] if args.quick else [1, 2, 4]
    repeats = args.repeats or (5 if args.device == "cpu" else 50)
    nb_dtypes = [torch.float32, torch.bfloat16]
    print(f"device {args.device} ({torch.cuda.get_device_name() if args.device == 'cuda' else platform.processor() or platform.machine()}), "
          f"torch {torch.__version__}; CPU capability: torch {torch.backends.cpu.get_cpu_capability()}, decent_comm "
          f"{_native.cpu_isa()} (DECENT_COMM_CPU_ISA picks a lower one); operands: --layout {LAYOUT}")
    print("speedup = baseline time / our time; roofline = same-shape in-place torch kernel (k=1: add_, k=2: "
          "addcmul_), else the best of copy_/add_/addcmul_")
    threads = args.threads if args.threads and args.device == "cpu" else [None]
    rows = []
    for n_threads in threads:
        if n_threads is not None:
            torch.set_num_threads(n_threads)
        print(f"\nthreads {torch.get_num_threads()}")
        print("| op           |  size | k | neighbor | GB/s   | roofline | speedup vs baselines |")
        print("|--------------|-------|---|----------|--------|----------|----------------------|")
        part = bench_mix(args.device, sizes, ks, nb_dtypes, repeats) if "mix" in only else []
        if "adam" in only:
            part += bench_adam(args.device, sizes, [0, 1] if args.quick else [0, 1, 2], repeats)
        if "sgd" in only:
            part += bench_sgd(args.device, sizes, [0, 1] if args.quick else [0, 1, 2], repeats)
        if "int8" in only:
            part += bench_int8_mix(args.device, sizes, [1] if args.quick else [1, 2], repeats)
        for r in part:
            r["threads"] = torch.get_num_threads()
        rows += part
    path = args.json or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                     f"mix_kernels_{args.device}.json")
    with open(output_file(path), "w") as f:
        json.dump(dict(device=args.device, torch=torch.__version__, cpu_isa=_native.cpu_isa(),
                       torch_cpu_capability=torch.backends.cpu.get_cpu_capability(), layout=LAYOUT, rows=rows), f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
