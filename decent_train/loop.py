"""The training loop every workload runs (`run`): distributed start-up, the optimizer strategy, timed steps
(straggler emulation included), rank 0's log rows, evaluation on the global-average model, checkpoints and
resume, the summary. Everything the demo compares is measured here in the same way for every optimizer.

A workload supplies a `Task` builder and its all-reduce learning rates, and calls `run(args, build_task,
lr_defaults)` with flags from `decent_train.flags.add_common_args`. A value refused while the run is set up is a
`SetupError`, and Ctrl-C stops the run cleanly (`Interrupted`); decent_train.cli turns both into one line and an
exit code.
"""

import argparse
import contextlib
import json
import logging
import os
import random
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, Optional

import torch

from .checkpoint import (Progress, apply_resumed_hyperparameters, auto_resume_dir, load_checkpoint, must_match,
                         save_checkpoint)
from .distributed import (DistEnv, LaunchError, RendezvousTimeout, close_distributed, init_distributed, job_world_size,
                          rank_seed, setup_logging)
from .flags import PROFILED, RESUME_AUTO, resolve_defaults
from .lr_schedule import make_lr_scheduler
from .plot import plot_runs
from .profiling import step_profiler, step_range
from .runlog import RunLog
from .strategy import Strategy, build_strategy
from .task import Task, cross_entropy, evaluate

log = logging.getLogger(__name__)


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


class SetupError(ValueError):
    """A value refused while the run is set up (the defaults, the task, the optimizer, the resume), after the flags
    parsed: decent_train.cli reports it as one line and exit code 2, like a parse error. `rank`: the rank saying it;
    `same_on_every_rank`: found from the flags and the world size alone, so every rank says the same."""

    def __init__(self, message: str, rank: int = 0, same_on_every_rank: bool = False):
        super().__init__(message)
        self.rank, self.same_on_every_rank = rank, same_on_every_rank


class Interrupted(KeyboardInterrupt):
    """Ctrl-C (or a signal decent_train.cli turns into KeyboardInterrupt) stopped the run at `step`. `released`:
    the optimizer's shutdown and the process group's destruction finished within RELEASE_TIMEOUT_S."""

    def __init__(self, step: int, released: bool):
        super().__init__(f"interrupted at step {step}")
        self.step, self.released = step, released


# How long a stopped run waits for the optimizer's shutdown: a peer stopped too may leave an exchange in flight
# unanswered, and torchrun kills a worker 30 s after asking it to stop.
RELEASE_TIMEOUT_S = 10.0


@dataclass
class Job:
    """What a run builds, filled as the set-up goes (what to release if it stops part-way)."""
    args: argparse.Namespace
    env: DistEnv
    task: Optional[Task] = None
    strategy: Optional[Strategy] = None
    scheduler: object = None
    generator: Optional[torch.Generator] = None
    progress: Progress = field(default_factory=Progress)
    runlog: Optional[RunLog] = None
    config: Optional[dict] = None
    must_match: Optional[dict] = None  # what a resume from this run's checkpoints must match (checkpoint.must_match)


def set_up(job: Job, build_task, given):
    """Builds the task, the optimizer and the schedule, and resumes; `given`: the hyper-parameters given on the
    command line, which win over a checkpoint's."""
    args, env = job.args, job.env
    # --resume auto decided first: it is a collective (the ranks agree), before the optimizer's own traffic starts
    resume = auto_resume_dir(args.checkpoint, env) if args.resume == RESUME_AUTO else args.resume
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)  # the same initial model on every rank (the optimizers also broadcast it)
    job.task = build_task(args, env)
    model = job.task.model.to(env.device)
    job.must_match = must_match(args, job.task.model_flags)
    job.strategy = build_strategy(args, model, env)
    job.scheduler = make_lr_scheduler(job.strategy.optimizer, args)
    job.generator = torch.Generator().manual_seed(rank_seed(args.seed, env.rank))
    if resume:
        job.progress = load_checkpoint(resume, env, model, job.strategy, job.scheduler, job.generator, job.must_match)
        if job.progress.step >= args.steps and env.is_main:  # the loop below runs no step: said, not silent
            log.warning("--resume: the checkpoint is at step %d, at or past --steps %d: nothing is trained (give "
                        "--steps above %d to train on)", job.progress.step, args.steps, job.progress.step)
        changed = apply_resumed_hyperparameters(args, given, job.strategy.optimizer, job.scheduler,
                                                job.strategy.consensus)
        if changed:
            log.info("resumed with this command line's hyper-parameters, not the checkpoint's: %s", "; ".join(changed))
        if getattr(args, "profile", None) and args.steps - job.progress.step < PROFILED[0]:
            log.warning("--profile: this run resumes at step %d of %d, too few steps left to record any (it records "
                        "steps %d-%d of a run)", job.progress.step, args.steps, *PROFILED)
    job.runlog = RunLog(args.out if env.is_main else None, job.task.item_name, job.progress.rows)
    n_params = sum(p.numel() for p in model.parameters())
    job.config = {**vars(args), "world_size": env.world_size, "parameters": n_params, "data": job.task.description}
    log.info("%s | %d ranks on %s | %s, %.2fM parameters | %s%s", job.task.description, env.world_size, env.device,
             type(model).__name__, n_params / 1e6, args.optimizer,
             f" ({args.topology}, {args.mode})" if job.strategy.decentralized else " (DDP)")


def ignore_further_interrupts():
    """After the first Ctrl-C, SIGINT and SIGTERM are ignored for the rest of the process (an interrupted run is
    ending it): the terminal's SIGINT reaches every worker, torchrun then forwards its own and may send SIGTERM,
    and a second KeyboardInterrupt cut the shutdown short with a traceback. Until then SIGINT keeps Python's own
    handler, which decent_comm's step() holds while it launches and updates the buckets (optim/interrupts.py)."""
    if threading.current_thread() is threading.main_thread():
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, signal.SIG_IGN)


def release(job: Job, timeout: float) -> bool:
    """The optimizer's shutdown and the process group's destruction after the run stopped early, best effort and
    bounded (on a thread, given `timeout` seconds): returns whether they finished. A decentralized optimizer not
    shut down warned at exit about an exchange still in flight."""
    def work():
        try:
            if job.strategy is not None:
                job.strategy.shutdown()
            close_distributed(job.env)
        except Exception as e:  # noqa: BLE001 - the run is stopping anyway: say it, do not bury why it stopped
            log.warning("shutdown after the run stopped failed: %s: %s", type(e).__name__, e)
    thread = threading.Thread(target=work, name="decent_train-release", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        log.warning("the optimizer's shutdown did not finish within %g s; exiting without it", timeout)
    return not thread.is_alive()


def run(args, build_task: Callable[[argparse.Namespace, DistEnv], Task], lr_defaults: Dict[str, float],
        stopwatch_cls=None) -> dict:
    """Trains, evaluating and checkpointing as the flags say; returns the summary (also in log.json).
    stopwatch_cls (default Stopwatch) times the steps; a benchmark may pass one that synchronizes the ranks.
    Raises SetupError for a value refused before the first step, Interrupted on Ctrl-C (after logging the step on
    every rank and releasing the optimizer and the process group)."""
    # The hyper-parameters given on the command line (None: not given) win over a checkpoint's on resume.
    given = {k for k in ("lr", "weight_decay", "betas", "momentum") if getattr(args, k, None) is not None}
    try:
        resolve_defaults(args, lr_defaults, job_world_size())
    except ValueError as e:
        raise SetupError(" ".join(str(e).split()), int(os.environ.get("RANK", 0)), same_on_every_rank=True) from e
    setup_logging(int(os.environ.get("RANK", 0)))  # init_distributed may warn (restarts across nodes)
    try:
        env = init_distributed(args.device, getattr(args, "timeout", None))
    except (RendezvousTimeout, LaunchError) as e:  # one line, exit 2, instead of torch's key and traceback
        raise SetupError(str(e), int(os.environ.get("RANK", 0))) from e
    setup_logging(env.rank)
    job = Job(args, env)
    try:
        try:
            set_up(job, build_task, given)
        except ValueError as e:
            raise SetupError(" ".join(str(e).split()), env.rank) from e
        result = train(job, stopwatch_cls)
    except SetupError:
        release(job, RELEASE_TIMEOUT_S)
        raise
    except KeyboardInterrupt as e:
        ignore_further_interrupts()
        by = f" by {e}" if str(e).startswith("SIG") else ""  # decent_train.cli names SIGTERM
        # A decent_comm call that held the Ctrl-C and failed meanwhile raises it from that error (optim/interrupts.py):
        # typically a peer stopped first, and this rank's step waited for it. Said, not raised: the run was stopping.
        cause = e.__cause__
        failed = "" if cause is None else \
            f" (the call it was held in failed meanwhile: {type(cause).__name__}: {' '.join(str(cause).split())})"
        log.warning("interrupted%s at step %d of %d%s", by, job.progress.step, args.steps, failed)
        raise Interrupted(job.progress.step, release(job, RELEASE_TIMEOUT_S)) from None
    job.strategy.shutdown()
    close_distributed(env)
    return result


def train(job: Job, stopwatch_cls=None) -> dict:
    args, env, task, strategy, progress = job.args, job.env, job.task, job.strategy, job.progress
    runlog, scheduler, generator, model = job.runlog, job.scheduler, job.generator, job.task.model
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
                    runlog.write(job.config, summarize(args, task, env, strategy, progress))
            if do_ckpt:
                save_checkpoint(args.checkpoint, env, model, strategy, scheduler, generator, progress,
                                getattr(args, "keep_checkpoints", None), match=job.must_match)
            watch.start()  # evaluation and checkpointing are not training time

    result = summarize(args, task, env, strategy, progress)
    runlog.write(job.config, result)
    if env.is_main and args.out:
        plot_runs({args.optimizer: runlog.rows}, os.path.join(args.out, "loss.png"),
                  title=f"{task.description} ({env.world_size} ranks)")
    log.info("done: %s", json.dumps({k: round(v, 5) if isinstance(v, float) else v for k, v in result.items()}))
    return result
