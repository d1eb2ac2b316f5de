"""Resuming the training scripts from a checkpoint of another configuration (decent_train/checkpoint.py, loop.py):
a checkpoint records --optimizer and the flags that define the model, and a resume with other values is one line
naming the flag with both values and exit code 2 (it was load_state_dict's RuntimeError, or torch's KeyError 'step'
for another optimizer's state, as a traceback on every rank, and DDP resumed a decentralized run's replicas without
a word, each rank training its own as if they were identical); a checkpoint of an earlier version (no record) loads
as before, and a state that still does not load is the same one line naming the file. A resume already at or past
--steps trains nothing and says so. Single-process except the last test (2 ranks, DDP)."""

import contextlib
import io
import os
import shutil

import pytest
import torch

from decent_train.distributed import DistEnv
from decent_train.workloads import digits, lm, synthetic
from dist_utils import run_ranks
from harness_support import signal_handlers_restored  # noqa: F401 (autouse)

FLAGS = ["--batch-size", "8", "--eval-every", "2", "--lr-schedule", "constant", "--no-progress"]
MLP4 = ["--model", "mlp", "--width", "4"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Checkpoints of 2 steps (step_0000002) of the digits MLP of width 4, one per optimizer."""
    root = tmp_path_factory.mktemp("ck")
    for name in ("dadamw", "allreduce-sgd", "allreduce"):
        digits.main([*FLAGS, *MLP4, "--optimizer", name, "--steps", "2", "--checkpoint", str(root / name)])
    return root


def refused(argv, capsys) -> str:
    """digits.main(argv) must exit 2 with one line on stderr (the run's own INFO lines aside); returns it."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        digits.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "] INFO " not in line and not line.startswith("[W")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("written, resumed, says", [
    ("dadamw", ["--model", "cnn", "--width", "4"], "was written with --model mlp, this run has --model cnn"),
    ("dadamw", ["--model", "mlp", "--width", "8"], "was written with --width 4, this run has --width 8"),
    ("dadamw", [*MLP4, "--optimizer", "allreduce"],
     "was written with --optimizer dadamw, this run has --optimizer allreduce"),
    ("allreduce-sgd", [*MLP4, "--optimizer", "allreduce"],
     "was written with --optimizer allreduce-sgd, this run has --optimizer allreduce"),
    ("allreduce", ["--model", "cnn", "--width", "8", "--optimizer", "allreduce-adamw"],
     "was written with --model mlp, --width 4, this run has --model cnn, --width 8"),
])
def test_a_resume_with_another_model_or_optimizer_is_one_line_naming_the_flag(saved, written, resumed, says, capsys):
    step_dir = saved / written / "step_0000002"
    line = refused([*FLAGS, *resumed, "--steps", "4", "--resume", str(saved / written)], capsys)
    assert line.endswith(f": error: {step_dir} {says}: a run resumes with the optimizer and model it was written "
                         f"with (--optimizer {written}, --model mlp, --width 4), or starts afresh"), line


def test_allreduce_resumes_an_allreduce_adamw_checkpoint(saved):
    """--optimizer allreduce is allreduce-adamw (the same torch class): not refused as another optimizer."""
    result = digits.main([*FLAGS, *MLP4, "--optimizer", "allreduce-adamw", "--steps", "4",
                          "--resume", str(saved / "allreduce")])
    assert result["steps"] == 4


def _without_record(src, dst):
    """A copy of checkpoint `src` as this harness wrote it before it recorded what a resume must match."""
    shutil.copytree(src, dst)
    for dirpath, _, files in os.walk(dst):
        for name in files:
            if name.endswith(".pt"):
                state = torch.load(os.path.join(dirpath, name), weights_only=True)
                assert state.pop("must_match") == {"optimizer": os.path.basename(src), "model": "mlp", "width": 4}
                torch.save(state, os.path.join(dirpath, name))


def test_a_checkpoint_without_the_record_loads_as_before_and_a_failed_load_names_the_file(saved, tmp_path, capsys):
    """Without a record the checks are load_state_dict's: the same configuration resumes to the same result as from
    the recorded checkpoint; another one is the one line naming the file and torch's first words, not a traceback."""
    for name in ("dadamw", "allreduce-sgd"):
        _without_record(saved / name, tmp_path / name)
    for name in ("dadamw", "allreduce-sgd"):
        old, new = ([*FLAGS, *MLP4, "--optimizer", name, "--steps", "4", "--resume", str(root / name)]
                    for root in (tmp_path, saved))
        outcome = [{k: v for k, v in digits.main(argv).items() if "time" not in k and "_per_s" not in k}
                   for argv in (old, new)]
        assert outcome[0] == outcome[1] and outcome[0]["steps"] == 4, outcome
    file = tmp_path / "dadamw" / "step_0000002" / "rank0.pt"
    line = refused([*FLAGS, "--model", "mlp", "--width", "8", "--steps", "4", "--resume", str(tmp_path / "dadamw")],
                   capsys)
    assert (f": error: {file}: its model does not load into this run's Sequential (RuntimeError: Error(s) in "
            "loading state_dict for Sequential: size mismatch for 1.weight: copying a param with shape "
            "torch.Size([16, 64]) from checkpoint, the shape in current model is torch.Size([32, 64]). ...)") in line
    file = tmp_path / "allreduce-sgd" / "step_0000002" / "rank0.pt"
    line = refused([*FLAGS, *MLP4, "--optimizer", "allreduce", "--steps", "4",
                    "--resume", str(tmp_path / "allreduce-sgd")], capsys)
    assert line.endswith(f": error: {file}: its optimizer state does not load into this run's AdamW (KeyError: "
                         "'step')"), line


@pytest.mark.parametrize("steps", [1, 2])
def test_a_resume_at_or_past_steps_warns_that_nothing_is_trained(saved, steps, capsys):
    """It trained nothing and exited 0 without a word."""
    capsys.readouterr()
    result = digits.main([*FLAGS, *MLP4, "--steps", str(steps), "--resume", str(saved / "dadamw")])
    err = capsys.readouterr().err
    assert result["steps"] == 2
    assert (f"WARNING decent_train.loop: --resume: the checkpoint is at step 2, at or past --steps {steps}: nothing "
            "is trained (give --steps above 2 to train on)") in err, err


def test_a_count_spelled_otherwise_is_the_same_model(tmp_path, capsys):
    """The synthetic workload records --params: 4.02k parsed as 4019.9999999999995 and a resume with 4020 was refused
    although both build the same model."""
    argv = [*FLAGS, "--compute-ms", "0", "--checkpoint", str(tmp_path)]
    synthetic.main([*argv, "--params", "4.02k", "--steps", "2"])
    assert synthetic.main([*argv, "--params", "4020", "--steps", "3", "--resume", str(tmp_path)])["steps"] == 3
    assert synthetic.parse_args(["--params", "4.02k"]).params == 4020


def test_a_refusal_of_decent_comm_is_shown_whole(saved, capsys):
    """A load that decent_comm refuses (another --gossip-every) is one line with its whole message: it was cut at
    300 characters, mid-word."""
    line = refused([*FLAGS, *MLP4, "--gossip-every", "2", "--steps", "3", "--resume", str(saved / "dadamw")], capsys)
    assert "its optimizer state does not load into this run's" in line and "gossip_every" in line, line
    assert len(line) > 330 and not line.endswith(" ...)"), line


@pytest.mark.parametrize("module, argv", [(digits, []), (lm, ["--corpus-mb", "0.2"]), (synthetic, [])])
def test_every_workload_names_flags_of_its_own_that_change_the_model(module, argv):
    """A flag named that is not the parser's would be recorded as an AttributeError; one that is, changes the model's
    parameters (all of them do here but --heads, which changes what the attention computes)."""
    args = module.parse_args(argv)
    task = module.build_task(args, DistEnv())
    assert task.model_flags and all(hasattr(args, name) for name in task.model_flags)
    shapes = {k: v.shape for k, v in task.model.state_dict().items()}
    for name in task.model_flags:
        value = getattr(args, name)
        other = type(args)(**{**vars(args), name: {"cnn": "mlp"}.get(value, value * 2 if name != "heads" else 2)})
        changed = {k: v.shape for k, v in module.build_task(other, DistEnv()).model.state_dict().items()}
        assert (changed != shapes) == (name != "heads"), name


def _main(rank, world_size, runs):
    """Each of `runs` (argv) by digits.main on this rank, in turn: [(exit code, this rank's stderr)]."""
    said = []
    for argv in runs:
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            try:
                digits.main(argv)
                code = 0
            except SystemExit as e:
                code = e.code
        said.append((code, err.getvalue()))
    return said


def test_ddp_resumes_ddp_with_identical_replicas_and_refuses_a_decentralized_checkpoint(tmp_path):
    """2 ranks. DDP resumed from its own step 2 ends step 4 with the uninterrupted run's parameters, identical on
    both ranks. DDP from DAdamW's checkpoint loaded each rank's own replica after DDP's broadcast (at construction)
    and trained on, consensus 0 logged; now every rank refuses it, naming both optimizers. The warning of a resume
    past --steps is rank 0's alone."""
    ddp, dec, again = (str(tmp_path / name) for name in ("ddp", "dec", "again"))
    common = [*FLAGS, *MLP4]
    runs = [[*common, "--optimizer", "allreduce", "--steps", "4", "--checkpoint", ddp],
            [*common, "--optimizer", "allreduce", "--steps", "4", "--checkpoint", again,
             "--resume", os.path.join(ddp, "step_0000002")],
            [*common, "--optimizer", "allreduce", "--steps", "4", "--resume", ddp],
            [*common, "--optimizer", "dadamw", "--steps", "2", "--checkpoint", dec],
            [*common, "--optimizer", "allreduce", "--steps", "4", "--resume", dec]]
    said = run_ranks(_main, 2, runs, timeout=240)
    for rank, rank_said in enumerate(said):
        assert [code for code, _ in rank_said] == [0, 0, 0, 0, 2], rank_said
        assert ("nothing is trained" in rank_said[2][1]) == (rank == 0), rank_said[2][1]
        err = rank_said[4][1]
        who = "" if rank == 0 else " (rank 1)"
        assert (f"{who}: error: {dec}/step_0000002 was written with --optimizer dadamw, this run has --optimizer "
                "allreduce") in err and "Traceback" not in err, err
    models = {(run, r): torch.load(os.path.join(run, "step_0000004", f"rank{r}.pt"), weights_only=True)["model"]
              for run in (ddp, again) for r in (0, 1)}
    reference = models[(ddp, 0)]
    for key, model in models.items():
        assert model.keys() == reference.keys() and all(torch.equal(model[k], reference[k]) for k in model), key
