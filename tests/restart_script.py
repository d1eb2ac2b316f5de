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

STEPS, CKPT_EVERY, KILL_AT = 12, 4, int(os.environ["KILL_AT"])
OUT = os.environ["OUT"]
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

# The recipe: an attempt's process group on keys of its own (torchrun reuses its store across attempts, and gloo
# read the previous attempt's peer addresses from it; decent_comm keeps its own keys in the same store). The agent
# hosts that store unless TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, then rank 0 does.
rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
agent_hosts = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                      is_master=not agent_hosts and rank == 0)
dist.init_process_group("gloo", store=dist.PrefixStore(f"attempt{attempt}", store), rank=rank,
                        world_size=world_size)

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
