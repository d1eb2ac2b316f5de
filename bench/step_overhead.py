"""The optimizers' per-step host overhead on models of many small parameters: step() of DAdamW and DSGD against
torch.optim.AdamW / SGD (fused and foreach) on the same parameters, one process (world size 1, no communication).

Shapes: 200 tensors of 4096 elements, 2000 of 16, one of 16M (where the update's memory traffic dominates).
Modes: "keep" (the .grad stays what the last step left, as with zero_grad(set_to_none=False) or accumulating into
it) and "fresh" (a new .grad tensor before each step, as autograd allocates after zero_grad(set_to_none=True); not
timed). Each round steps every optimizer once, in turn, so load drift hits all alike; the time is the thread's CPU
time (time.thread_time: a loaded machine deschedules the thread without counting it), the minimum over rounds, and
the ratio is to the torch optimizer of the same family in the same run.

    python bench/step_overhead.py [--shapes 200x4096,2000x16,1x16777216] [--modes keep,fresh] [--rounds 40]
                                  [--json bench/results/step_overhead.json]
"""

import argparse
import json
import time

import torch

import decent_comm
from bench_args import count, listed, names, output_file  # bench/, this script's directory

OPTIMIZERS = {  # name: (family, factory)
    "torch.AdamW(fused)": ("adamw", lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True)),
    "torch.AdamW(foreach)": ("adamw", lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True)),
    "DAdamW": ("adamw", lambda ps: decent_comm.DAdamW(ps, lr=1e-3)),
    "torch.SGD(fused, m=0.9)": ("sgd", lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9, fused=True)),
    "torch.SGD(foreach, m=0.9)": ("sgd", lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9, foreach=True)),
    "DSGD(m=0.9)": ("sgd", lambda ps: decent_comm.DSGD(ps, lr=1e-3, momentum=0.9)),
}
BASELINES = {"adamw": ("torch.AdamW(fused)", "torch.AdamW(foreach)"),
             "sgd": ("torch.SGD(fused, m=0.9)", "torch.SGD(foreach, m=0.9)")}


def run(n: int, size: int, mode: str, rounds: int) -> dict:
    g = torch.Generator().manual_seed(0)
    init = [torch.randn(size, generator=g) for _ in range(n)]
    grads = [torch.randn(size, generator=g) * 1e-2 for _ in range(n)]
    opts = {}
    for name, (_, factory) in OPTIMIZERS.items():
        ps = [torch.nn.Parameter(t.clone()) for t in init]
        for p, gr in zip(ps, grads):
            p.grad = gr.clone()
        opt = factory(ps)
        for _ in range(2):  # state allocated, buckets' views in place
            opt.step()
        opts[name] = (opt, ps, [])
    for _ in range(rounds):
        for opt, ps, times in opts.values():
            if mode == "fresh":
                for p, gr in zip(ps, grads):
                    p.grad = gr.clone()
            t0 = time.thread_time()
            opt.step()
            times.append(time.thread_time() - t0)
    best = {name: min(times) for name, (_, _, times) in opts.items()}
    for opt, _, _ in opts.values():
        if hasattr(opt, "shutdown"):
            opt.shutdown()
    rows = {}
    for name, (family, _) in OPTIMIZERS.items():
        fused, foreach = BASELINES[family]
        rows[name] = dict(us=best[name] * 1e6, vs_fused=best[name] / best[fused], vs_foreach=best[name] / best[foreach])
    return rows


def shape(text):
    """argparse type: NxSIZE, N tensors of SIZE elements, both >= 1."""
    n, x, size = text.partition("x")
    if not x:
        raise argparse.ArgumentTypeError("expected NxSIZE, e.g. 200x4096")
    return count(1)(n), count(1)(size)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", type=listed(shape), default="200x4096,2000x16,1x16777216",
                    help="comma list of NxSIZE: N tensors of SIZE elements (default %(default)s)")
    ap.add_argument("--modes", type=names(["keep", "fresh"]), default="keep,fresh", help="comma list of %(default)s")
    ap.add_argument("--rounds", type=count(1), default=40, help="rounds per shape (the 16M shape takes a fifth)")
    ap.add_argument("--threads", type=count(1), default=1, help="torch threads (default %(default)s)")
    ap.add_argument("--json", default=None, help="also write the results here (default: none)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    results = []
    for n, size in args.shapes:
        rounds = args.rounds if n * size < 2**22 else max(3, args.rounds // 5)
        for mode in args.modes:
            rows = run(n, size, mode, rounds)
            results.append(dict(n=n, size=size, mode=mode, rounds=rounds, rows=rows))
            print(f"\n{n} x {size}, .grad {mode}, {rounds} rounds: step() thread CPU time (min), ratio to torch's "
                  "fused / foreach of the family")
            for name, r in rows.items():
                print(f"  {name:26s} {r['us']:10.0f} us   x{r['vs_fused']:5.2f}  x{r['vs_foreach']:5.2f}", flush=True)
    if args.json:
        with open(output_file(args.json), "w") as f:
            json.dump(dict(torch=torch.__version__, threads=args.threads, results=results), f, indent=1)


if __name__ == "__main__":
    main()
