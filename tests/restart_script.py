"""Run by tests/test_torchrun_restart.py under `torchrun --max-restarts 1` (2 ranks, gloo): docs/reliability.md's
recipe for restarts, as a script would use it. The process group is created on a key space of its own per restart
attempt (TORCHELASTIC_RESTART_COUNT), checkpoints are saved every CKPT_EVERY steps, and in attempt 0 rank 1 is killed
(SIGKILL) at step KILL_AT when KILL_AT >= 0. The restarted attempt resumes from the last checkpoint. Each rank writes
its final parameters to OUT/rank{r}.pt."""
import os
import signal

import torch
import torch.distributed as dist

import decent_comm
from decent_train.distributed import init_process_group_per_attempt, restart_attempt

STEPS, CKPT_EVERY, KILL_AT = 12, 4, int(os.environ["KILL_AT"])
OUT = os.environ["OUT"]
attempt = restart_attempt()

# The recipe: an attempt's process group on keys of its own (torchrun reuses its store across attempts, and gloo
# read the previous attempt's peer addresses from it; decent_comm keeps its own keys in the same store). The helper
# is the training harness's (decent_train/distributed.py), so the test runs the code the examples run.
init_process_group_per_attempt("gloo")
rank = dist.get_rank()

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
opt = decent_comm.DAdamW(model.parameters(), lr=0.01, topology="ring", timeout=10)
ckpt = os.path.join(OUT, f"ckpt_rank{rank}.pt")
start = 0
if os.path.exists(ckpt):  # every rank resumes its own replica and state (its checkpoint of the same step)
    saved = torch.load(ckpt)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    start = saved["step"]
print(f"attempt {attempt} rank {rank}: starts at step {start}", flush=True)
for step in range(start, STEPS):
    if attempt == 0 and rank == 1 and step == KILL_AT:
        os.kill(os.getpid(), signal.SIGKILL)
    g = torch.Generator().manual_seed(1000 * step + rank)  # each (step, rank) its own batch
    x = torch.randn(16, 8, generator=g)
    y = x.sum(dim=1, keepdim=True)
    opt.zero_grad()
    ((model(x) - y) ** 2).mean().backward()
    opt.step()
    if (step + 1) % CKPT_EVERY == 0:
        state = {"model": model.state_dict(), "opt": opt.state_dict(), "step": step + 1}
        torch.save(state, ckpt + ".tmp")
        os.replace(ckpt + ".tmp", ckpt)  # a rank killed while saving leaves the last whole checkpoint
opt.shutdown()
torch.save([p.detach() for p in model.parameters()], os.path.join(OUT, f"rank{rank}.pt"))
dist.destroy_process_group()
