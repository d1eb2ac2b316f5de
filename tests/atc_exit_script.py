"""Run by tests/test_dropped_optimizer.py under torchrun (2 ranks, gloo): an ATC optimizer still alive at interpreter
exit, its last step's mix pending. A hook registered before decent_comm's exit hook runs after it (atexit is LIFO) and
prints the weight the script ends with, which must be the mixed x^1."""
import atexit
import os

import torch
import torch.distributed as dist

import decent_comm  # before the process group, as a script imports its libraries (see exchange/_closing.py)

dist.init_process_group("gloo")
RANK = dist.get_rank()
lin = torch.nn.Linear(1, 1, bias=False)
with torch.no_grad():
    lin.weight.fill_(float(RANK))


def report():
    print(f"rank {RANK}: pending {PENDING}, weight at exit {float(lin.weight.detach()):.6f}", flush=True)


atexit.register(report)  # before the optimizer creates the first exchanger, which registers decent_comm's hook
opt = decent_comm.DSGD(lin.parameters(), lr=0.25, topology="ring", mode="atc", broadcast_init=False, timeout=30)
lin(torch.ones(1, 1)).sum().backward()  # the forward lets the mix wait for the next one
opt.step()
PENDING = bool(opt._schedule.pending)
print(f"rank {os.environ.get('RANK')} stepped", flush=True)
