"""Run by tests/test_torchrun_restart.py under `torchrun --max-restarts 1` (2 ranks, gloo): docs/restarts.md's
recipe for restarts, as a script would use it. The process group is created on a key space of its own per restart
attempt (TORCHELASTIC_RESTART_COUNT); every CKPT_EVERY steps each rank writes its own file of the step into a step
directory and, after a barrier, rank 0 commits the step (OUT/ck/latest names it); a restarted attempt resumes from
the committed step. In attempt 0, rank 1 is killed (SIGKILL) at step KILL_AT when KILL_AT >= 0, or, when
KILL_IN_SAVE >= 0, in the save of that step once rank 0 has written its file, before rank 1 writes its own and so
before the commit. Each rank writes its final parameters to OUT/rank{r}.pt."""
import os
import signal
import time

import torch
import torch.distributed as dist

import decent_comm
from decent_train.checkpoint import auto_resume_dir, commit, step_dir_name, write_rank_file
from decent_train.distributed import DistEnv, init_process_group_per_attempt, restart_attempt

STEPS, CKPT_EVERY = 12, 4
KILL_AT, KILL_IN_SAVE = int(os.environ.get("KILL_AT", "-1")), int(os.environ.get("KILL_IN_SAVE", "-1"))
OUT = os.environ["OUT"]
CK = os.path.join(OUT, "ck")
attempt = restart_attempt()

# The recipe: an attempt's process group on keys of its own (torchrun reuses its store across attempts, and gloo
# read the previous attempt's peer addresses from it; decent_comm keeps its own keys in the same store). The helpers
# are the training harness's (decent_train/distributed.py, checkpoint.py), so the test runs the code the examples run.
init_process_group_per_attempt("gloo")
env = DistEnv(rank=dist.get_rank(), world_size=dist.get_world_size())
rank = env.rank

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
opt = decent_comm.DAdamW(model.parameters(), lr=0.01, topology="ring", timeout=10)
start = 0
committed = auto_resume_dir(CK, env)  # the step CK/latest names, the same on every rank; None before the first commit
if committed is not None:  # every rank resumes its own replica and state, of that step
    saved = torch.load(os.path.join(committed, f"rank{rank}.pt"))
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
        step_dir = os.path.join(CK, step_dir_name(step + 1))
        if attempt == 0 and rank == 1 and step + 1 == KILL_IN_SAVE:
            while not os.path.exists(os.path.join(step_dir, "rank0.pt")):  # rank 0 saved; rank 1 dies before it does
                time.sleep(0.01)
            print(f"rank 1 killed in the save of step {step + 1}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        write_rank_file(step_dir, rank, {"model": model.state_dict(), "opt": opt.state_dict(), "step": step + 1})
        commit(CK, step_dir, env)  # after every rank's file: rank 0 makes CK/latest name this step
opt.shutdown()
torch.save([p.detach() for p in model.parameters()], os.path.join(OUT, f"rank{rank}.pt"))
dist.destroy_process_group()
