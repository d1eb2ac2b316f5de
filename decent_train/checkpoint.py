"""Per-rank checkpoints of a training run (CHECKPOINT/step_NNNNNNN/rank<r>.pt and CHECKPOINT/latest, the newest
step every rank has finished writing), and resuming from them."""

import logging
import os
from dataclasses import dataclass, field
from typing import List

import torch
import torch.distributed as dist

from .distributed import DistEnv
from .strategy import Strategy

log = logging.getLogger("decent_train")


@dataclass
class Progress:
    step: int = 0
    train_time: float = 0.0      # seconds spent training (evaluation and checkpointing excluded)
    rows: List[dict] = field(default_factory=list)


def save_checkpoint(root: str, env: DistEnv, model, strategy: Strategy, scheduler, generator, progress: Progress):
    """Every rank writes its own file: decentralized replicas (and every rank's data stream) differ."""
    step_dir = os.path.join(root, f"step_{progress.step:07d}")
    os.makedirs(step_dir, exist_ok=True)
    state = {
        "model": {k: v.detach().clone() for k, v in model.state_dict().items()},  # copies, not bucket views
        "optimizer": strategy.optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "data_rng": generator.get_state(),
        "torch_rng": torch.get_rng_state(),
        "step": progress.step, "train_time": progress.train_time, "rows": progress.rows,
        "world_size": env.world_size,
    }
    path = os.path.join(step_dir, f"rank{env.rank}.pt")
    torch.save(state, path + ".tmp")
    os.replace(path + ".tmp", path)  # a run killed mid-write leaves the previous checkpoint intact
    if env.distributed:
        dist.barrier()  # "latest" may only name a step every rank has finished writing
    if env.is_main:
        with open(os.path.join(root, "latest.tmp"), "w") as f:
            f.write(os.path.basename(step_dir))
        os.replace(os.path.join(root, "latest.tmp"), os.path.join(root, "latest"))
    log.info("checkpoint written: %s", step_dir)


def resolve_resume_dir(path: str) -> str:
    latest = os.path.join(path, "latest")
    if os.path.isfile(latest):
        return os.path.join(path, open(latest).read().strip())
    return path


def load_checkpoint(path: str, env: DistEnv, model, strategy: Strategy, scheduler, generator) -> Progress:
    step_dir = resolve_resume_dir(path)
    file = os.path.join(step_dir, f"rank{env.rank}.pt")
    if not os.path.isfile(file):
        raise FileNotFoundError(f"no checkpoint for rank {env.rank} in {step_dir}")
    state = torch.load(file, map_location=env.device, weights_only=False)
    if state["world_size"] != env.world_size:
        raise ValueError(f"{step_dir} was written by {state['world_size']} ranks, this job has {env.world_size}")
    model.load_state_dict(state["model"])
    strategy.optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    generator.set_state(state["data_rng"])
    torch.set_rng_state(state["torch_rng"])
    log.info("resumed from %s at step %d", step_dir, state["step"])
    return Progress(state["step"], state["train_time"], state["rows"])
