"""One rank of a faulty job: `python -m decent_train.faults.worker --scenario NAME --path p2p|group --mode awc|atc
--timeout S --out DIR`, in torchrun's worker environment (decent_train.faults.launch, or torchrun itself).

It imports torch._dynamo first: torch.optim.Optimizer imports it lazily when the first optimizer is built, which
takes 2 s on an idle machine and 20 s on a loaded one, and would otherwise skew the ranks' arrival at the
optimizer's construction (which waits `timeout` for the slowest) by that much. It joins the job with
`dist.init_process_group("gloo")` and the process group's default timeout (30 min), so every error it sees within
seconds comes from the optimizer's own `timeout`, runs the scenario, writes its record to DIR/rank<r>.json and ends
like a script whose main returned: no opt.shutdown(), no destroy_process_group.
"""

import argparse
import json
import os
import time


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", required=True)
    parser.add_argument("--path", choices=["p2p", "group"], required=True)
    parser.add_argument("--mode", choices=["awc", "atc"], required=True)
    parser.add_argument("--timeout", type=float, required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    import torch
    import torch._dynamo  # noqa: F401 - torch.optim imports it at the first optimizer; here, before the rendezvous
    import torch.distributed as dist

    from .scenarios import SCENARIOS, Ctx

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])

    def write(record):
        tmp = os.path.join(args.out, f".rank{rank}.json")
        with open(tmp, "w") as f:
            json.dump(record, f)
        os.replace(tmp, os.path.join(args.out, f"rank{rank}.json"))  # whole or absent, never half-written

    dist.init_process_group("gloo")
    ctx = Ctx(rank, dist.get_world_size(), args.path, args.mode, args.timeout, write)
    SCENARIOS[args.scenario](ctx)
    ctx.record["t_end"] = time.time()  # the exit scenario reads how long the interpreter takes to exit from here
    write(ctx.record)


if __name__ == "__main__":
    main()
