"""Per-rank checkpoints of a training run, and resuming from them.

Layout: CHECKPOINT/step_NNNNNNN/rank<r>.pt, one file per rank (decentralized replicas and every rank's data
stream differ), and CHECKPOINT/latest, the name of the newest step directory every rank has finished writing.

Loading is safe on files one did not write: a checkpoint holds tensors (RNG states included), numbers,
strings and plain containers only, and is read with torch.load(weights_only=True), which refuses anything
else instead of running it. Resuming reads only inside the directory --resume names: `latest` must hold the
bare name of one of its step directories (not a path), and no file read (`latest`, the step directory, the
rank file) may resolve, through symlinks, to a place outside it. `--resume auto` resumes from --checkpoint's
`latest` when there is one and starts afresh otherwise (auto_resume_dir), so that one command line serves every
attempt of `torchrun --max-restarts`.

A checkpoint also records what a resume must match (`must_match`: --optimizer and the flags that define the model,
Task.model_flags): a resume with other values is refused naming them (check_must_match), and a state that still
does not load is a CheckpointError naming the file; both are one line and exit code 2 (decent_train.cli), where
load_state_dict's RuntimeError or KeyError was a traceback on every rank, and DDP resumed a decentralized run's
differing replicas without a word. Checkpoints of earlier versions record none and load as before.
"""

import logging
import os
import pickle
import re
import shutil
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Set

import torch
import torch.distributed as dist

from .distributed import DistEnv
from .flags import canonical_optimizer, hyperparameters
from .strategy import Strategy

log = logging.getLogger(__name__)

STEP_DIR = re.compile(r"step_[0-9]+")
KEYS = ("model", "optimizer", "scheduler", "data_rng", "torch_rng", "step", "train_time", "rows", "world_size")


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed from safely (paths leaving its directory, unexpected content)."""


@dataclass
class Progress:
    step: int = 0
    train_time: float = 0.0      # seconds spent training (evaluation and checkpointing excluded)
    rows: List[dict] = field(default_factory=list)


def step_dir_name(step: int) -> str:
    return f"step_{step:07d}"


def must_match(args, model_flags: Sequence[str]) -> Dict[str, object]:
    """What a resume of this run must match, flag dest -> value: --optimizer (another one's state loaded into torch's
    AdamW with a KeyError, or into DDP without one, which then trained each rank's own decentralized replica as if
    they were identical) and the flags that define the model (`model_flags`, the workload's Task.model_flags)."""
    return {"optimizer": args.optimizer, **{name: getattr(args, name) for name in model_flags}}


def _flags(values: dict, keys) -> str:
    return ", ".join(f"--{k.replace('_', '-')} {values[k]}" if k in values else f"no --{k.replace('_', '-')}"
                     for k in keys)


def _same(key: str, saved, mine) -> bool:
    return canonical_optimizer(saved) == canonical_optimizer(mine) if key == "optimizer" else saved == mine


def check_must_match(step_dir: str, saved: Optional[dict], mine: Optional[dict]):
    """A CheckpointError naming each flag whose value differs between the run that wrote the checkpoint (`saved`,
    its must_match) and this one (`mine`), with both values; nothing when either is None (a checkpoint of an earlier
    version records none, and a caller may pass none)."""
    if saved is None or mine is None:
        return
    keys = list(saved) + [k for k in mine if k not in saved]
    differ = [k for k in keys if k not in saved or k not in mine or not _same(k, saved[k], mine[k])]
    if differ:
        raise CheckpointError(f"{step_dir} was written with {_flags(saved, differ)}, this run has "
                              f"{_flags(mine, differ)}: a run resumes with the optimizer and model it was written with "
                              f"({_flags(saved, saved)}), or starts afresh")


def save_checkpoint(root: str, env: DistEnv, model, strategy: Strategy, scheduler, generator, progress: Progress,
                    keep: Optional[int] = None, match: Optional[dict] = None):
    """Every rank writes its own file: decentralized replicas (and every rank's data stream) differ. `keep`
    (--keep-checkpoints): how many committed steps to keep (None: all), see commit. `match`: what a resume must
    match (must_match), recorded as the file's "must_match"."""
    step_dir = os.path.join(root, step_dir_name(progress.step))
    # The optimizer first: a decentralized one synchronizes, which in ATC mode applies the pending mix to the
    # parameters. Copied before it, the model would lack that mix, and a resumed run (whose optimizer starts
    # the next exchange afresh) would never apply it.
    optimizer_state = strategy.optimizer.state_dict()
    state = {
        "model": {k: v.detach().clone() for k, v in model.state_dict().items()},  # copies, not bucket views
        "optimizer": optimizer_state,
        "scheduler": scheduler.state_dict(),
        "data_rng": generator.get_state(),
        "torch_rng": torch.get_rng_state(),
        "step": progress.step, "train_time": progress.train_time, "rows": progress.rows,
        "world_size": env.world_size, "bytes_sent": strategy.bytes_sent,
    }
    if match is not None:
        state["must_match"] = dict(match)
    write_rank_file(step_dir, env.rank, state)
    commit(root, step_dir, env, keep)
    log.info("checkpoint written: %s", step_dir)


def write_rank_file(step_dir: str, rank: int, state: dict):
    """step_dir/rank<r>.pt: written whole or not at all (a rank killed mid-write leaves no partial file)."""
    os.makedirs(step_dir, exist_ok=True)
    path = os.path.join(step_dir, f"rank{rank}.pt")
    torch.save(state, path + ".tmp")
    os.replace(path + ".tmp", path)


def commit(root: str, step_dir: str, env: DistEnv, keep: Optional[int] = None):
    """Called by every rank once it wrote its file of step_dir: after a barrier, rank 0 makes root/latest name it.
    `latest` thus only names a step every rank finished writing: a rank killed while the others saved (before the
    barrier) leaves the previous commit, and a resume loads the same step on every rank. Overwriting one file per
    rank in place instead left rank 0 at the new step and a rank killed before its own save at the old one, and
    every restart loaded those same mismatched files again. With `keep` (N >= 1), rank 0 then deletes the
    committed step directories older than the newest N (prune_step_dirs)."""
    if env.distributed:
        dist.barrier()
    if env.is_main:
        with open(os.path.join(root, "latest.tmp"), "w") as f:
            f.write(os.path.basename(step_dir))
        os.replace(os.path.join(root, "latest.tmp"), os.path.join(root, "latest"))
        if keep is not None:
            prune_step_dirs(root, os.path.basename(step_dir), keep)


def prune_step_dirs(root: str, latest: str, keep: int):
    """Deletes root's step directories up to `latest` (the step just committed) but the newest `keep` of them,
    never `latest` itself; without it every checkpoint stayed on disk. A step directory after `latest` is a save not
    committed (of an attempt before a restart, or of a rank killed mid-write, with its rank<r>.pt.tmp): a later save
    of that step rewrites it, so it stays. Symlinks are not followed, nor deleted; a deletion that fails is logged
    and the run goes on (a full disk should not also stop training)."""
    number = int(latest[len("step_"):])
    steps = sorted((int(n[len("step_"):]), n) for n in os.listdir(root) if STEP_DIR.fullmatch(n)
                   and not os.path.islink(os.path.join(root, n)) and os.path.isdir(os.path.join(root, n)))
    older = [n for step, n in steps if step <= number and n != latest]
    for name in older[:max(0, len(older) - (keep - 1))]:
        try:
            shutil.rmtree(os.path.join(root, name))
        except OSError as e:
            log.warning("--keep-checkpoints: could not delete %s: %s", os.path.join(root, name), e)


def inside(path: str, directory: str) -> str:
    """`path` with every symlink resolved; a CheckpointError when that is not within `directory` (resolved too)."""
    real, real_dir = os.path.realpath(path), os.path.realpath(directory)
    if os.path.commonpath([real, real_dir]) != real_dir:
        raise CheckpointError(f"{path} resolves to {real}, outside the checkpoint directory {real_dir}")
    return real


def resolve_resume_dir(path: str) -> str:
    """The step directory `--resume path` means: the one path/latest names when there is such a file (a
    checkpoint directory), else path itself (one step directory)."""
    latest = os.path.join(path, "latest")
    if not os.path.lexists(latest):
        return path
    inside(latest, path)
    with open(latest) as f:
        name = f.read().strip()
    if not STEP_DIR.fullmatch(name):
        raise CheckpointError(f"{latest} holds {name[:200]!r}: it must be the name of a step directory of {path} "
                              "(step_ and digits, as the training script writes it), not a path")
    step_dir = os.path.join(path, name)
    inside(step_dir, path)
    return step_dir


def auto_resume_dir(root: str, env: DistEnv) -> Optional[str]:
    """`--resume auto`: the step directory root/latest names (the newest step every rank finished writing), or None
    when root has no `latest` (no such directory yet, or a run stopped before its first checkpoint was committed: its
    step directories may lack ranks), to start afresh. Under torchrun --max-restarts every attempt runs the same
    command line: the first starts afresh, a restarted one goes on from the last commit (a fixed `--resume DIR`
    refused the first attempt, and without it a restart began again at step 0, rewriting the step directories). The
    ranks decide together: one that sees another `latest` (a directory not shared between the nodes) or cannot read
    it makes every rank raise, naming what each saw, instead of some ranks resuming and the others not."""
    try:
        name = os.path.basename(resolve_resume_dir(root)) if os.path.lexists(os.path.join(root, "latest")) else None
        # whether this rank's own file is there: a rank without one (rank 1 of 3) was refused by load_checkpoint
        # alone, and the others, their files found, waited for it in the optimizer's set-up until the timeout
        seen = ("ok", name, name is not None and os.path.isfile(os.path.join(root, name, f"rank{env.rank}.pt")))
        if name is not None and not os.path.isdir(os.path.join(root, name)):
            # said by every rank here: load_checkpoint's os.listdir raised FileNotFoundError, a traceback on
            # every rank at every torchrun restart
            seen = ("error", missing_step_dir(os.path.join(root, name), os.path.join(root, "latest")), False)
    except (OSError, ValueError) as e:
        seen = ("error", f"{type(e).__name__}: {e}", False)
    everyone = [seen]
    if env.distributed:
        everyone = [None] * env.world_size
        dist.all_gather_object(everyone, seen)
    errors = [f"rank {r}: {text}" for r, (kind, text, _) in enumerate(everyone) if kind == "error"]
    if errors:
        raise CheckpointError(f"--resume auto: the latest checkpoint in {root} cannot be read: {'; '.join(errors)}")
    if len({text for _, text, _ in everyone}) > 1:
        views = ", ".join(f"rank {r}: {text or 'none'}" for r, (_, text, _) in enumerate(everyone))
        raise CheckpointError(f"--resume auto: the ranks see different latest checkpoints in {root} ({views}); every "
                              "rank must read the directory rank 0 commits to (a shared file system)")
    without = [str(r) for r, (_, _, has_file) in enumerate(everyone) if name is not None and not has_file]
    if without:
        raise CheckpointError(f"--resume auto: {os.path.join(root, name)} has no file of rank(s) {', '.join(without)} "
                              f"(rank<r>.pt) of this job's {env.world_size}; every rank resumes from its own file")
    if name is None:
        log.info("--resume auto: no committed checkpoint in %s (no %s): starting afresh", root,
                 os.path.join(root, "latest"))
        return None
    log.info("--resume auto: resuming from %s, the latest committed checkpoint", os.path.join(root, name))
    return os.path.join(root, name)


def read_checkpoint(file: str, device) -> dict:
    """torch.load with weights_only=True, and the keys a checkpoint must have."""
    try:
        state = torch.load(file, map_location=device, weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointError(f"{file} holds more than tensors and plain containers; not loading it "
                              f"(torch.load(weights_only=True) refused: {e})") from e
    missing = [k for k in KEYS if not isinstance(state, dict) or k not in state]
    if missing:
        raise CheckpointError(f"{file} is not a checkpoint of this training script (missing {', '.join(missing)})")
    return state


#: what a resume at another world size takes instead (a decentralized run's ranks each hold their own replica)
OTHER_WORLD_SIZE = ("a run resumes from these files at the world size that wrote them only; to go on at another "
                    "world size, start from the replicas' average as docs/state.md's \"Resuming at another world size "
                    "or topology\" shows")


def missing_step_dir(step_dir: str, named_by: Optional[str] = None) -> str:
    return (f"{step_dir} does not exist (or is not a directory)" + (f", yet {named_by} names it" if named_by else "")
            + ": give --resume a checkpoint directory whose latest step is there, or remove its 'latest' to start "
              "afresh")


def _load_into(file: str, what: str, target, state: dict):
    """target.load_state_dict(state); a failure (torch's RuntimeError for other shapes or names, KeyError for
    another optimizer's state, ValueError for another group layout or decent_comm's schedule) is a CheckpointError
    naming the file, the first two lines of the error kept whole (a size mismatch lists every parameter)."""
    try:
        target.load_state_dict(state)
    except (RuntimeError, KeyError, ValueError, TypeError, IndexError) as e:
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        # Whole lines: a cut at 300 characters ended decent_comm's own one-line refusals mid-word.
        text = " ".join(lines[:2]) + (" ..." if len(lines) > 2 else "")
        raise CheckpointError(f"{file}: its {what} does not load into this run's {type(target).__name__} "
                              f"({type(e).__name__}: {text})") from e


def load_checkpoint(path: str, env: DistEnv, model, strategy: Strategy, scheduler, generator,
                    match: Optional[dict] = None) -> Progress:
    """Loads this rank's file of `path` (a checkpoint directory or one step directory) into the run's objects.
    `match`: this run's must_match, refused (check_must_match) before anything is loaded when the file's differs."""
    step_dir = resolve_resume_dir(path)
    if not os.path.isdir(step_dir):  # a CheckpointError: one line (exit 2), not os.listdir's FileNotFoundError
        raise CheckpointError(missing_step_dir(step_dir, os.path.join(path, "latest") if step_dir != path else None))
    file = os.path.join(step_dir, f"rank{env.rank}.pt")
    ranks = [int(m.group(1)) for m in map(re.compile(r"rank(\d+)\.pt").fullmatch, os.listdir(step_dir)) if m]
    if ranks and max(ranks) + 1 != env.world_size:  # said by every rank, one without a file of its own too
        raise ValueError(f"{step_dir} was written by {max(ranks) + 1} ranks, this job has {env.world_size}: "
                         f"{OTHER_WORLD_SIZE}")
    if not os.path.isfile(file):  # a CheckpointError (ValueError): the command line reports it in one line
        raise CheckpointError(f"no checkpoint for rank {env.rank} in {step_dir}" + (
            "" if ranks else " (it holds no rank files, nor a 'latest' naming a step directory that does)"))
    state = read_checkpoint(inside(file, step_dir), env.device)
    if state["world_size"] != env.world_size:
        raise ValueError(f"{step_dir} was written by {state['world_size']} ranks, this job has {env.world_size}: "
                         f"{OTHER_WORLD_SIZE}")
    check_must_match(step_dir, state.get("must_match"), match)
    _load_into(file, "model", model, state["model"])
    _load_into(file, "optimizer state", strategy.optimizer, state["optimizer"])
    _load_into(file, "lr schedule", scheduler, state["scheduler"])
    # RNG states are CPU byte tensors; map_location moved them to the training device.
    generator.set_state(state["data_rng"].cpu())
    torch.set_rng_state(state["torch_rng"].cpu())
    strategy.bytes_before = int(state.get("bytes_sent", 0))  # absent in checkpoints of earlier versions
    log.info("resumed from %s at step %d", step_dir, state["step"])
    return Progress(state["step"], state["train_time"], state["rows"])


def _flag_value(value):
    return tuple(float(v) for v in value) if isinstance(value, (tuple, list)) else float(value)


def apply_resumed_hyperparameters(args, given: Set[str], optimizer, scheduler, consensus=None) -> List[str]:
    """After load_checkpoint: the hyper-parameters given on this command line (`given`: lr, weight_decay, betas,
    momentum; flags.hyperparameters says which the optimizer takes) replace the checkpoint's, as a torch recipe
    applies a new lr to a loaded run (the loaded param groups and the scheduler's base_lrs had put the checkpoint's
    back silently while the run's config named the flags); those not given keep the checkpoint's, and `args` is
    set to them, so the config records what the run uses. The lr this step uses is recomputed from the base lr and
    this command line's schedule. `consensus`: the run's AdaptiveConsensus, whose reference (the peak lr it loaded)
    is scaled with a new lr, so that the factor follows the new schedule as it followed the old (kept, a peak of
    2e-3 under --lr 1e-4 made the factor 1.25e-4 where a fresh run has 1.0: gossip nearly off). Returns
    "--flag old -> new" for each given value that differs."""
    groups, changed = optimizer.param_groups, []
    for key in hyperparameters(args.optimizer):
        old = _flag_value(scheduler.base_lrs[0] if key == "lr" else groups[0][key])
        if key not in given:
            setattr(args, key, old)
            continue
        new = _flag_value(getattr(args, key))
        if new != old:
            changed.append(f"--{key.replace('_', '-')} {old} -> {new}")
        for group in groups:
            group["initial_lr" if key == "lr" else key] = new
        if key == "lr":
            scheduler.base_lrs = [new] * len(groups)
            if consensus is not None and consensus.lr_peak is not None and old > 0:
                consensus.lr_peak *= new / old
    for group, base, factor in zip(groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["lr"] = base * factor(scheduler.last_epoch)  # as LambdaLR.get_lr computes it
    scheduler._last_lr = [group["lr"] for group in groups]
    return changed
