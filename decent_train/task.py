"""What a workload provides to the training loop (a `Task`) and how the loop scores it: validation loss (and
accuracy) of the global-average model."""

from dataclasses import dataclass
from typing import Callable, Dict, List, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .distributed import DistEnv
from .strategy import Strategy


@dataclass
class Task:
    """What an example provides. Batches are (inputs, class targets); the model returns logits whose last
    dimension is the class (or next-byte) dimension, so one cross-entropy serves both examples."""
    model: torch.nn.Module
    sample_batch: Callable[[torch.Generator], Tuple[torch.Tensor, torch.Tensor]]
    val_batches: List[Tuple[torch.Tensor, torch.Tensor]]   # this rank's shard of the validation set
    items_per_batch: int                                  # tokens or samples per rank and step
    item_name: str = "tokens"
    report_accuracy: bool = False
    description: str = ""
    # The flags (argparse dests) that define the model: a checkpoint records their values and a resume with other
    # values is refused naming them (decent_train.checkpoint.check_must_match), not left to load_state_dict.
    model_flags: Tuple[str, ...] = ()


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction=reduction)


@torch.no_grad()
def evaluate(task: Task, strategy: Strategy, env: DistEnv) -> Dict[str, float]:
    """Validation loss (and accuracy) of the global-average model over the whole held-out set; each rank
    evaluates its shard and the sums are all-reduced."""
    model = task.model
    with strategy.eval_context():
        model.eval()
        sums = torch.zeros(3, dtype=torch.float64, device=env.device)  # loss, correct, count
        for x, y in task.val_batches:
            x, y = x.to(env.device), y.to(env.device)
            logits = model(x)
            sums[0] += cross_entropy(logits, y, reduction="sum").double()
            sums[1] += (logits.argmax(-1) == y).sum()
            sums[2] += y.numel()
        model.train()
    if env.distributed:
        dist.all_reduce(sums)
    out = {"val_loss": float(sums[0] / sums[2])}
    if task.report_accuracy:
        out["val_acc"] = float(sums[1] / sums[2])
    return out
