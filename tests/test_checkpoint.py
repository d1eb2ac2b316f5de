"""Resuming is safe on checkpoints one did not write (decent_train.checkpoint): files are read with
torch.load(weights_only=True), so a pickled object never runs, and only files inside the --resume directory are
read. And what the harness writes (every optimizer kind, adaptive topology and consensus included) loads that
way and restores the run's state. That a resumed run reproduces the uninterrupted one is
tests/test_examples.py::test_train_lm_decentralized_logs_and_resume."""

import argparse
import os

import pytest
import torch

from decent_train.checkpoint import (CheckpointError, Progress, auto_resume_dir, load_checkpoint,
                                     resolve_resume_dir, save_checkpoint)
from decent_train.distributed import DistEnv, init_distributed, rank_seed
from decent_train.flags import add_common_args, resolve_defaults
from decent_train.loop import train_step
from decent_train.lr_schedule import make_lr_scheduler
from decent_train.strategy import build_strategy
from decent_train.task import Task
from dist_utils import run_ranks

MARKER = []  # what a malicious pickle would append to if it ran


def _run_on_load(text):
    MARKER.append(text)
    return text


class Payload:
    """Unpickles by calling _run_on_load: what an attacker's checkpoint would do with os.system."""

    def __reduce__(self):
        return _run_on_load, ("unpickled code ran",)


def _step_dirs(root, *names):
    for name in names:
        os.makedirs(os.path.join(root, name))
        open(os.path.join(root, name, "rank0.pt"), "wb").close()


def _write_latest(root, text):
    with open(os.path.join(root, "latest"), "w") as f:
        f.write(text)


# ------------------------------------------------------------------------------------------ paths


def test_resume_dir_follows_latest_or_takes_the_step_dir(tmp_path):
    root = str(tmp_path / "ck")
    _step_dirs(root, "step_0000003", "step_0000006")
    _write_latest(root, "step_0000006\n")
    assert resolve_resume_dir(root) == os.path.join(root, "step_0000006")
    step = os.path.join(root, "step_0000003")
    assert resolve_resume_dir(step) == step
    # A symlink that stays inside the checkpoint directory is fine.
    os.symlink("step_0000003", os.path.join(root, "step_0000009"))
    _write_latest(root, "step_0000009")
    assert resolve_resume_dir(root) == os.path.join(root, "step_0000009")


@pytest.mark.parametrize("latest", ["../outside", "/tmp", "step_0000003/../../outside", "step_1/rank0.pt", "",
                                    "latest"])
def test_latest_must_name_a_step_dir_of_the_checkpoint(tmp_path, latest):
    root = str(tmp_path / "ck")
    _step_dirs(root, "step_0000003")
    os.makedirs(tmp_path / "outside")
    _write_latest(root, latest)
    with pytest.raises(CheckpointError, match="must be the name of a step directory"):
        resolve_resume_dir(root)


def test_symlinks_out_of_the_checkpoint_dir_are_refused(tmp_path):
    root, outside = str(tmp_path / "ck"), str(tmp_path / "outside")
    _step_dirs(root, "step_0000003")
    _step_dirs(outside, "step_0000042")
    # latest names a step directory that is a symlink to another directory
    os.symlink(os.path.join(outside, "step_0000042"), os.path.join(root, "step_0000006"))
    _write_latest(root, "step_0000006")
    with pytest.raises(CheckpointError, match="outside the checkpoint directory"):
        resolve_resume_dir(root)
    # latest itself is a symlink to a file elsewhere
    os.remove(os.path.join(root, "latest"))
    with open(os.path.join(outside, "latest"), "w") as f:
        f.write("step_0000003")
    os.symlink(os.path.join(outside, "latest"), os.path.join(root, "latest"))
    with pytest.raises(CheckpointError, match="outside the checkpoint directory"):
        resolve_resume_dir(root)
    # the rank file is a symlink to a file elsewhere (checked before anything is loaded)
    step = os.path.join(root, "step_0000003")
    os.remove(os.path.join(step, "rank0.pt"))
    os.symlink(os.path.join(outside, "step_0000042", "rank0.pt"), os.path.join(step, "rank0.pt"))
    with pytest.raises(CheckpointError, match="outside the checkpoint directory"):
        load_checkpoint(step, DistEnv(), None, None, None, None)


# ---------------------------------------------------------------------------------------- content


def test_a_checkpoint_holding_objects_is_refused_without_running_them(tmp_path):
    step = tmp_path / "step_0000001"
    step.mkdir()
    torch.save({"model": {}, "payload": Payload()}, step / "rank0.pt")
    MARKER.clear()
    with pytest.raises(CheckpointError, match="weights_only=True"):
        load_checkpoint(str(step), DistEnv(), None, None, None, None)
    assert MARKER == []
    # The same file under weights_only=False would have run it: the test's payload is real.
    torch.load(step / "rank0.pt", weights_only=False)
    assert MARKER == ["unpickled code ran"]


def test_a_file_that_is_not_a_checkpoint_is_named(tmp_path):
    step = tmp_path / "step_0000001"
    step.mkdir()
    torch.save({"model": {}, "step": 1}, step / "rank0.pt")
    with pytest.raises(CheckpointError, match="missing optimizer, scheduler, data_rng"):
        load_checkpoint(str(step), DistEnv(), None, None, None, None)


@pytest.mark.parametrize("rank,world_size", [(2, 3), (0, 1)])
def test_a_resume_at_another_world_size_is_refused_on_every_rank_pointing_at_the_recipe(tmp_path, rank, world_size):
    """A rank with no file of its own (rank 2 of 3, from 2 ranks' files) said only "no checkpoint for rank 2"."""
    step = tmp_path / "step_0000001"
    step.mkdir()
    for r in (0, 1):
        torch.save({"model": {}}, step / f"rank{r}.pt")
    with pytest.raises(ValueError, match=f"written by 2 ranks, this job has {world_size}: .*docs/state.md"):
        load_checkpoint(str(step), DistEnv(rank=rank, world_size=world_size), None, None, None, None)


def test_resume_auto_goes_on_from_the_commit_or_starts_afresh(tmp_path):
    """--resume auto (one command line for every attempt of torchrun --max-restarts): the step directory `latest`
    names; None (afresh) with no checkpoint directory yet, and with step directories but no `latest` (a run stopped
    before its first commit: not every rank's file need be there); a `latest` that cannot be used is refused."""
    root = str(tmp_path / "ck")
    assert auto_resume_dir(root, DistEnv()) is None
    _step_dirs(root, "step_0000002")
    assert auto_resume_dir(root, DistEnv()) is None
    _write_latest(root, "step_0000002")
    assert auto_resume_dir(root, DistEnv()) == os.path.join(root, "step_0000002")
    _write_latest(root, "../elsewhere")
    with pytest.raises(CheckpointError, match="--resume auto: the latest checkpoint in .* cannot be read: rank 0: "
                                              "CheckpointError: .*must be the name of a step directory"):
        auto_resume_dir(root, DistEnv())


def _auto_with_own_directory(rank, world_size, root, latest):
    """Each rank its own directory, as nodes without a shared file system have: rank 0's holds `latest`."""
    mine = os.path.join(root, f"node{rank}")
    _step_dirs(mine, "step_0000004")
    open(os.path.join(mine, "step_0000004", f"rank{rank}.pt"), "wb").close()  # its own file (which is checked)
    if latest[rank] is not None:
        _write_latest(mine, latest[rank])
    try:
        return auto_resume_dir(mine, DistEnv(rank=rank, world_size=world_size))
    except CheckpointError as e:
        return str(e)


def test_resume_auto_is_decided_by_every_rank_alike(tmp_path):
    """Ranks that see different `latest` files would resume on some ranks and start afresh on others (an all-reduce
    run then waits forever at the end); every rank raises instead, naming what each saw. One rank's unreadable
    `latest` is raised by every rank too."""
    said = run_ranks(_auto_with_own_directory, 2, str(tmp_path), ["step_0000004", None])
    for text in said:
        assert "--resume auto: the ranks see different latest checkpoints" in text, said
        assert "(rank 0: step_0000004, rank 1: none)" in text, said
    said = run_ranks(_auto_with_own_directory, 2, str(tmp_path / "bad"), [None, "/etc"])
    assert all("cannot be read: rank 1: CheckpointError" in text for text in said), said
    agreed = run_ranks(_auto_with_own_directory, 2, str(tmp_path / "same"), ["step_0000004"] * 2)
    assert [os.path.basename(d) for d in agreed] == ["step_0000004"] * 2


def _auto_missing_step(rank, world_size, root):
    try:
        return auto_resume_dir(root, DistEnv(rank=rank, world_size=world_size))
    except CheckpointError as e:
        return str(e)


def test_a_latest_naming_a_missing_step_dir_is_one_error_on_every_rank(tmp_path):
    """`latest` naming a step directory that is gone (cleaned by hand): os.listdir's FileNotFoundError was a
    traceback on every rank, at every torchrun restart; now a CheckpointError (the harness's one line, exit 2)
    naming the directory, from --resume auto on every rank and from --resume DIR."""
    root = str(tmp_path / "ck")
    _step_dirs(root, "step_0000002")
    _write_latest(root, "step_0000004")
    gone = os.path.join(root, "step_0000004")
    said = run_ranks(_auto_missing_step, 2, root)
    for text in said:
        assert f"{gone} does not exist" in text and f"{os.path.join(root, 'latest')} names it" in text, said
    with pytest.raises(CheckpointError, match=f"{gone} does not exist"):
        load_checkpoint(root, DistEnv(), None, None, None, None)
    step = tmp_path / "step_0000006"
    step.mkdir()
    step.rmdir()  # --resume step_0000006 checked at parse time, removed before the load
    with pytest.raises(CheckpointError, match=f"{step} does not exist"):
        load_checkpoint(str(step), DistEnv(), None, None, None, None)


def test_resume_auto_names_the_ranks_without_a_file_on_every_rank(tmp_path):
    """A middle rank's file missing (rank 1 of 3): load_checkpoint's world-size check passed on ranks 0 and 2 (the
    highest file is rank2.pt), which went on and waited for rank 1 in the optimizer's set-up until the timeout.
    auto_resume_dir gathers whether each rank's own file is there, and every rank raises naming rank 1."""
    root = str(tmp_path / "ck")
    os.makedirs(os.path.join(root, "step_0000004"))
    for r in (0, 2):
        open(os.path.join(root, "step_0000004", f"rank{r}.pt"), "wb").close()
    _write_latest(root, "step_0000004")
    said = run_ranks(_auto_missing_step, 3, root)
    for text in said:
        assert isinstance(text, str) and "has no file of rank(s) 1 (rank<r>.pt) of this job's 3" in text, said


# -------------------------------------------------------------------- what the harness writes loads

CASES = [
    ("allreduce", []),
    ("dsgd", ["--topology", "ring"]),
    ("accumadamw", ["--mode", "atc", "--bf16-wire"]),
    ("dadamw", ["--topology", "adaptive:consensus:one-peer-exp,complete:interval=2", "--consensus", "adaptive"]),
    ("decentralized-adamw", []),
]
STEPS = 4


def _args(name, flags, world_size):
    parser = add_common_args(argparse.ArgumentParser(), steps=STEPS, batch_size=4, eval_every=2)
    return resolve_defaults(parser.parse_args(["--optimizer", name, *flags]), {"adam": 1e-2, "sgd": 0.1}, world_size)


def _build(args, env, seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    strategy = build_strategy(args, model, env)
    return model, strategy, make_lr_scheduler(strategy.optimizer, args)


def _sample(g):
    return torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)


def _equal(a, b, where="") -> list:
    """Paths at which two nested containers of tensors and plain values differ."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
        return [] if same else [where]
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{where} keys {sorted(map(str, a))} != {sorted(map(str, b))}"]
        return [d for k in a for d in _equal(a[k], b[k], f"{where}/{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _equal(x, y, f"{where}[{i}]")]
    return [] if a == b else [f"{where}: {a!r} != {b!r}"]


def _optimizer_state(opt):
    sd = dict(opt.state_dict())
    groups = [dict(g) for g in sd["param_groups"]]
    extra = groups[0].get("decentralized")
    if extra is not None:  # the in-flight exchange's factor: a resumed optimizer starts the next exchange afresh
        groups[0]["decentralized"] = {k: v for k, v in extra.items() if k != "next_factor"}
    sd["param_groups"] = groups
    return sd


def _save_and_load(rank, world_size, root):
    env = init_distributed("cpu")
    task = Task(model=None, sample_batch=_sample, val_batches=[], items_per_batch=4)
    diffs = {}
    for name, flags in CASES:
        args = _args(name, flags, world_size)
        model, strategy, scheduler = _build(args, env, seed=0)
        task.model = model
        generator = torch.Generator().manual_seed(rank_seed(0, rank))
        for _ in range(STEPS):
            train_step(args, task, strategy, generator, env.device)
            scheduler.step()
        rows = [{"step": STEPS, "train_loss": 1.25, "val_loss": None, "topology": "ring"}]
        ck = os.path.join(root, name)
        save_checkpoint(ck, env, model, strategy, scheduler, generator, Progress(STEPS, 0.5, rows))
        expected = {"model": model.state_dict(), "optimizer": _optimizer_state(strategy.optimizer),
                    "scheduler": scheduler.state_dict(), "data_rng": generator.get_state(),
                    "torch_rng": torch.get_rng_state()}

        model2, strategy2, scheduler2 = _build(args, env, seed=1)
        generator2 = torch.Generator()
        torch.manual_seed(123)
        progress = load_checkpoint(ck, env, model2, strategy2, scheduler2, generator2)
        got = {"model": model2.state_dict(), "optimizer": _optimizer_state(strategy2.optimizer),
               "scheduler": scheduler2.state_dict(), "data_rng": generator2.get_state(),
               "torch_rng": torch.get_rng_state()}
        diffs[name] = _equal(expected, got) + _equal((STEPS, 0.5, rows), (progress.step, progress.train_time,
                                                                         progress.rows), "progress")
        if name.startswith("dadamw"):  # the adaptive topology decided at steps 2 and 4: its history is restored
            diffs[name] += [] if expected["optimizer"]["param_groups"][0]["decentralized"]["adaptive"] else ["no adaptive state saved"]
        strategy.shutdown()
        strategy2.shutdown()
    return diffs


def test_every_checkpoint_the_harness_writes_loads_weights_only(tmp_path):
    for rank, diffs in enumerate(run_ranks(_save_and_load, 2, str(tmp_path), timeout=240)):
        assert diffs == {name: [] for name, _ in CASES}, f"rank {rank}"
