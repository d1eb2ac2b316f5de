"""The learning-rate schedules the training scripts offer (--lr-schedule)."""

import math

import torch


def make_lr_scheduler(optimizer, args) -> torch.optim.lr_scheduler.LambdaLR:
    """constant, cosine (peak -> min_lr_ratio * peak), or linear warmup then cosine."""
    total, warmup, floor = max(1, args.steps), args.warmup, args.min_lr_ratio

    def factor(step: int) -> float:
        if args.lr_schedule == "constant":
            return 1.0
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
