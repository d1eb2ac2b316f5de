"""A minimal user training script for bench/exit_stress.py and tests/test_exit.py: a few steps, then exit
the way the variant says. Launch with torchrun (gloo on CPU).

    torchrun --standalone --nproc_per_node 2 bench/exit_user_script.py VARIANT [--steps N]

Variants (what the script does before the interpreter exits):
    none        decent_comm DAdamW; neither opt.shutdown() nor dist.destroy_process_group(); the optimizer
                dies when main() returns (the usual shape of a script)
    global      as none, but the optimizer stays referenced from a module global until the interpreter exits
    average     as global, the README's ending: the last call is the collective opt.global_average() (saving
                rank 0's average), whose all-reduces gloo's worker thread may still be releasing at exit
    interactive as none, in an interactive session (run with python -i) in which an earlier line raised and showed
                its error (which sets sys.last_value, as an uncaught exception does)
    shutdown    decent_comm; opt.shutdown() only
    destroy     decent_comm; dist.destroy_process_group() only
    both        decent_comm; opt.shutdown(), then dist.destroy_process_group()
    ddp         plain torch DDP + AdamW (decent_comm never imported); no destroy_process_group()
    ddp-destroy plain torch DDP + AdamW; dist.destroy_process_group()
    ddp-hook    plain torch DDP + AdamW with torch's bf16_compress_hook (a Python comm hook, as
                decent_train/strategy.py registers for --bf16-wire); no destroy_process_group()
    callback    no training: torch and gloo only. Rank 0 leaves an all_reduce with a Python then() callback
                unfinished at exit (rank 1 joins it 2 s later), so a gloo worker thread needs the GIL while
                the interpreter finalizes: it aborts ("terminate called without an active exception")
                every run. The mechanism of issue #14.1's aborts, shown deterministically; not in the
                stress test's default variants.
"""
import argparse
import os
import time

import torch
import torch.distributed as dist

VARIANTS = ("none", "global", "average", "interactive", "shutdown", "destroy", "both", "ddp", "ddp-destroy", "ddp-hook", "callback")
KEEP = []  # variant global: what stays alive until the interpreter exits


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("variant", choices=VARIANTS)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    if args.variant == "callback":
        if dist.get_rank() == 1:
            time.sleep(2)  # rank 0 reaches interpreter exit with its all_reduce still pending
        work = dist.all_reduce(torch.ones(4), async_op=True)
        KEEP.append(work.get_future().then(lambda fut: fut.value()))  # runs on a gloo worker thread
        print(f"rank {os.environ.get('RANK')} done ({args.variant})", flush=True)
        return
    if args.variant == "interactive":
        import code
        code.InteractiveInterpreter().runsource("undefined_name")  # an earlier line's NameError, shown
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    if args.variant.startswith("ddp"):
        forward = torch.nn.parallel.DistributedDataParallel(model)
        if args.variant == "ddp-hook":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
            forward.register_comm_hook(None, default_hooks.bf16_compress_hook)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    else:
        import decent_comm

        forward = model
        opt = decent_comm.DAdamW(model.parameters(), lr=1e-3, topology="one-peer-exp")
    g = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(args.steps):
        x = torch.randn(8, 32, generator=g)
        loss = forward(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    if args.variant in ("global", "average"):
        KEEP.append(opt)
    if args.variant == "average":
        with opt.global_average():
            KEEP.append({k: v.clone() for k, v in model.state_dict().items()})
    if args.variant in ("shutdown", "both"):
        opt.shutdown()
    if args.variant in ("destroy", "both", "ddp-destroy"):
        dist.destroy_process_group()
    print(f"rank {os.environ.get('RANK')} done ({args.variant})", flush=True)


if __name__ == "__main__":
    main()
