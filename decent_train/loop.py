"""The training loop every workload runs (`run`): distributed start-up, the optimizer strategy, timed steps
(straggler emulation included), rank 0's log rows, evaluation on the global-average model, checkpoints and
resume, the summary. Everything the demo compares is measured here in the same way for every optimizer.

A workload supplies a `Task` builder and its all-reduce learning rates, and calls `run(args, build_task,
lr_defaults)` with flags from `decent_train.flags.add_common_args`.
"""

import argparse
import contextlib
import json
import logging
import os
import random
import sys
import time
from typing import Callable, Dict

import torch

from .checkpoint import Progress, load_checkpoint, save_checkpoint
from .distributed import DistEnv, close_distributed, init_distributed, rank_seed, setup_logging
from .flags import resolve_defaults
from .lr_schedule import make_lr_scheduler
from .plot import plot_runs
from .profiling import step_profiler, step_range
from .runlog import RunLog
from .strategy import Strategy, build_strategy
from .task import Task, cross_entropy, evaluate

log = logging.getLogger("decent_train")


class Stopwatch:
    """Training time only: stopped around evaluation and checkpointing. CUDA is synchronized at the edges
    (only there), so queued GPU work is charged to the steps that queued it."""

    def __init__(self, device: torch.device):
        self.device = device
        self.start()

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def start(self):
        self._sync()
        self.t0 = time.perf_counter()

    def stop(self) -> float:
        self._sync()
        return time.perf_counter() - self.t0


class Interval:
    """Rank 0's training loss and time since the last log point. The loss is summed on the device and read
    only at log points: a .item() per step would make the host wait for the GPU every step."""

    def __init__(self, device: torch.device, items_per_step: int, item_name: str):
        self.loss = torch.zeros((), device=device)
        self.items_per_step, self.key = items_per_step, f"{item_name}_per_s"
        self.steps, self.seconds = 0, 0.0

    def add(self, loss: torch.Tensor):
        self.loss += loss.detach()
        self.steps += 1

    def flush(self) -> dict:
        row = {"train_loss": float(self.loss) / self.steps, "step_time_ms": 1e3 * self.seconds / self.steps,
               self.key: self.steps * self.items_per_step / self.seconds}
        self.loss.zero_()
        self.steps, self.seconds = 0, 0.0
        return row


@contextlib.contextmanager
def progress_bar(env: DistEnv, args, start: int):
    """A tqdm bar on rank 0 when stderr is a terminal (log lines are routed around it), else None."""
    if not env.is_main or args.no_progress or not sys.stderr.isatty():
        yield None
        return
    from tqdm import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm
    with logging_redirect_tqdm(), tqdm(total=args.steps, initial=start, dynamic_ncols=True, desc=args.optimizer) as bar:
        yield bar


def train_step(args, task: Task, strategy: Strategy, generator: torch.Generator, device) -> torch.Tensor:
    x, y = task.sample_batch(generator)
    with step_range("forward"):
        loss = cross_entropy(strategy.forward_module(x.to(device)), y.to(device))
    with step_range("backward"):
        loss.backward()
    with step_range("optimizer_step"):
        if args.grad_clip > 0:
            strategy.clip_grad_(task.model, args.grad_clip)
        strategy.optimizer.step()
        strategy.optimizer.zero_grad()
    return loss


class Straggler:
    """--straggler-ms MEAN,STD: a random extra compute time per step and rank, from a stream of its own so the
    data and the model see exactly the same numbers as without it."""

    def __init__(self, spec, seed: int, rank: int):
        self.mean, self.std = (tuple(spec or ()) + (0.0, 0.0))[:2]
        self.rng = random.Random(rank_seed(seed, rank) ^ 0x5EED)

    def __call__(self):
        if self.mean or self.std:
            time.sleep(max(0.0, self.rng.gauss(self.mean, self.std)) / 1e3)


def summarize(args, task: Task, env: DistEnv, strategy: Strategy, progress: Progress) -> dict:
    evals = [r for r in progress.rows if r.get("val_loss") is not None]
    last = evals[-1] if evals else {}
    steps, seconds = progress.step, max(1e-9, progress.train_time)
    return {"optimizer": args.optimizer, "topology": args.topology if strategy.decentralized else "allreduce",
            "steps": steps, "world_size": env.world_size, "train_time_s": progress.train_time,
            "mean_step_time_ms": 1e3 * progress.train_time / max(1, steps),
            f"{task.item_name}_per_s": steps * task.items_per_batch * env.world_size / seconds,
            "final_val_loss": last.get("val_loss"), "final_val_acc": last.get("val_acc"),
            "final_consensus_distance": last.get("consensus_distance"), "bytes_sent_mb": last.get("bytes_sent_mb")}


def run(args, build_task: Callable[[argparse.Namespace, DistEnv], Task], lr_defaults: Dict[str, float],
        stopwatch_cls=None) -> dict:
    """Trains, evaluating and checkpointing as the flags say; returns the summary (also in log.json).
    stopwatch_cls (default Stopwatch) times the steps; a benchmark may pass one that synchronizes the ranks."""
    env = init_distributed(args.device)
    setup_logging(env.rank)
    torch.set_num_threads(args.threads)
    resolve_defaults(args, lr_defaults, env.world_size)
    torch.manual_seed(args.seed)  # the same initial model on every rank (the optimizers also broadcast it)
    task = build_task(args, env)
    model = task.model.to(env.device)
    strategy = build_strategy(args, model, env)
    scheduler = make_lr_scheduler(strategy.optimizer, args)
    generator = torch.Generator().manual_seed(rank_seed(args.seed, env.rank))
    progress = Progress()
    if args.resume:
        progress = load_checkpoint(args.resume, env, model, strategy, scheduler, generator)
    runlog = RunLog(args.out if env.is_main else None, task.item_name, progress.rows)
    n_params = sum(p.numel() for p in model.parameters())
    config = {**vars(args), "world_size": env.world_size, "parameters": n_params, "data": task.description}
    log.info("%s | %d ranks on %s | %s, %.2fM parameters | %s%s", task.description, env.world_size, env.device,
             type(model).__name__, n_params / 1e6, args.optimizer,
             f" ({args.topology}, {args.mode})" if strategy.decentralized else " (DDP)")

    interval = Interval(env.device, task.items_per_batch * env.world_size, task.item_name)
    straggle = Straggler(getattr(args, "straggler_ms", None), args.seed, env.rank)
    with progress_bar(env, args, progress.step) as bar, \
            step_profiler(getattr(args, "profile", None), env.rank, env.device) as profiler_step:
        watch = (stopwatch_cls or Stopwatch)(env.device)
        while progress.step < args.steps:
            lr = strategy.optimizer.param_groups[0]["lr"]  # the lr this step uses
            straggle()
            interval.add(train_step(args, task, strategy, generator, env.device))
            profiler_step()
            scheduler.step()
            progress.step += 1
            step = progress.step
            if bar is not None:
                bar.update(1)
            do_eval = step % args.eval_every == 0 or step == args.steps
            do_log = do_eval or step % args.log_every == 0
            do_ckpt = args.checkpoint and (step % args.checkpoint_every == 0 or step == args.steps)
            if not (do_log or do_ckpt):
                continue
            if do_eval or do_ckpt:
                strategy.drain()  # evaluation and checkpoints synchronize: charge the exchange in flight to training
            seconds = watch.stop()
            progress.train_time += seconds
            interval.seconds += seconds
            if do_log:
                row = {"step": step, "train_time_s": round(progress.train_time, 4), "lr": lr, **interval.flush()}
                if do_eval:
                    row.update(evaluate(task, strategy, env), consensus_distance=strategy.consensus_distance())
                    row.update(strategy.comm_metrics(env))
                    log.info("step %d | train %.4f | val %.4f%s | consensus %.3g | %.1f ms/step | %.0f %s/s",
                             step, row["train_loss"], row["val_loss"],
                             f" | acc {row['val_acc']:.4f}" if "val_acc" in row else "", row["consensus_distance"],
                             row["step_time_ms"], row[interval.key], task.item_name)
                runlog.rows.append(row)
                if bar is not None:
                    bar.set_postfix(loss=f"{row['train_loss']:.3f}")
                if do_eval:  # rewritten at every evaluation, so a killed run keeps its log
                    runlog.write(config, summarize(args, task, env, strategy, progress))
            if do_ckpt:
                save_checkpoint(args.checkpoint, env, model, strategy, scheduler, generator, progress)
            watch.start()  # evaluation and checkpointing are not training time

    result = summarize(args, task, env, strategy, progress)
    runlog.write(config, result)
    if env.is_main and args.out:
        plot_runs({args.optimizer: runlog.rows}, os.path.join(args.out, "loss.png"),
                  title=f"{task.description} ({env.world_size} ranks)")
    log.info("done: %s", json.dumps({k: round(v, 5) if isinstance(v, float) else v for k, v in result.items()}))
    strategy.shutdown()
    close_distributed(env)
    return result
