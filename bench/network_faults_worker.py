"""One rank of bench/network_faults.py: trains a small MLP with DAdamW / DSGD (or DDP + AdamW) on gloo and writes
what happens to `<out>/rank<r>.jsonl`, one event a line with its time.time(): start, pg, pause/go, constructed,
step (the iteration's seconds), trained, ga_done, error (where, type, message), done (a sha256 of the final parameters,
which the driver compares with the fault-free run's), main_end.

Environment (the driver's): RANK, WORLD_SIZE, MASTER_ADDR (node 0: rank 0 hosts the store), MASTER_PORT.
--pause PHASE: wait at that phase (construct, global_average) until `<out>/go` exists, so the driver can cut a
node off while every rank waits there. SIGUSR1 dumps every thread's stack to `<out>/rank<r>.stack` (the driver
sends it to a rank still running at the cell's limit)."""

import argparse
import datetime
import faulthandler
import hashlib
import json
import os
import signal
import time


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--opt", choices=["dadamw", "dsgd", "ddp"], default="dadamw")
    p.add_argument("--mode", choices=["awc", "atc"], default="awc")
    p.add_argument("--topo", choices=["ring", "complete"], default="ring")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--timeout", type=float, default=10.0)
    p.add_argument("--sleep", type=float, default=0.05, help="seconds between steps (lets the driver act on a step)")
    p.add_argument("--pause", choices=["none", "construct", "global_average"], default="none")
    p.add_argument("--out", required=True)
    return p.parse_args(argv)


def main(argv=None):
    a = parse(argv)
    rank = int(os.environ["RANK"])
    log = open(os.path.join(a.out, f"rank{rank}.jsonl"), "a", buffering=1)

    def event(kind, **kw):
        log.write(json.dumps({"t": time.time(), "ev": kind, **kw}) + "\n")

    event("start", pid=os.getpid())
    stacks = open(os.path.join(a.out, f"rank{rank}.stack"), "w")
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)

    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    # DDP's collectives are bounded by the process group's timeout; decent_comm's by the optimizer's own
    # (the group keeps gloo's default, 30 min, as in docs/reliability.md's fault matrix).
    dist.init_process_group("gloo", **({"timeout": datetime.timedelta(seconds=a.timeout)} if a.opt == "ddp" else {}))
    event("pg")
    import decent_comm

    def pause(phase):
        if a.pause == phase:
            event("pause", phase=phase)
            while not os.path.exists(os.path.join(a.out, "go")):
                time.sleep(0.02)
            event("go", phase=phase)

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    opt = None
    try:
        pause("construct")
        if a.opt == "ddp":
            net = torch.nn.parallel.DistributedDataParallel(model)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        else:
            net = model
            kw = dict(mode=a.mode, topology=a.topo, timeout=a.timeout, exchange="p2p" if a.topo == "ring" else "auto")
            if a.mode == "atc":
                kw["model"] = model
            opt = (decent_comm.DAdamW(model.parameters(), lr=1e-3, **kw) if a.opt == "dadamw"
                   else decent_comm.DSGD(model.parameters(), lr=1e-2, momentum=0.9, **kw))
        event("constructed")
        data = torch.Generator().manual_seed(1000 + rank)
        for step in range(a.steps):
            x, y = torch.randn(16, 32, generator=data), torch.randint(0, 10, (16,), generator=data)
            started = time.time()  # the whole iteration: DDP's all-reduce runs in backward(), decent_comm's in step()
            loss = torch.nn.functional.cross_entropy(net(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            event("step", step=step, s=round(time.time() - started, 4))
            time.sleep(a.sleep)
        event("trained")
        pause("global_average")
        if a.pause == "global_average":
            with opt.global_average():
                pass
            event("ga_done")
        if a.opt != "ddp":
            opt.synchronize()  # ATC: the pending mix applied, so each rank's parameters are final
        digest = hashlib.sha256()
        for q in model.parameters():
            digest.update(q.detach().contiguous().numpy().tobytes())
        event("done", params_sha256=digest.hexdigest())
    except BaseException as e:  # noqa: BLE001 - every failure is the measurement
        event("error", where="main", type=f"{type(e).__module__}.{type(e).__qualname__}", msg=str(e)[:2000])
    finally:
        if opt is not None and a.opt != "ddp":
            try:
                opt.shutdown()
            except BaseException as e:  # noqa: BLE001
                event("error", where="shutdown", type=f"{type(e).__module__}.{type(e).__qualname__}",
                      msg=str(e)[:2000])
        event("main_end")
        log.flush()


if __name__ == "__main__":
    main()
