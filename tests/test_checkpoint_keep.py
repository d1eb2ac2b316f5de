"""--keep-checkpoints N (decent_train.checkpoint.commit / prune_step_dirs): after a commit, rank 0 deletes the
committed step directories older than the newest N, never the one `latest` names nor a save newer than it (not
committed); without the flag every step directory stays, as before. Checked against the directory listings one
expects by hand, and through the harness's command line (a run that resumes from what was kept)."""

import os
import shutil

import pytest

from decent_train.checkpoint import commit
from decent_train.distributed import DistEnv
from decent_train.workloads import lm

TINY = ["--layers", "1", "--d-model", "32", "--heads", "2", "--seq-len", "16", "--batch-size", "4", "--corpus-mb",
        "0.2", "--eval-tokens", "1024", "--no-progress", "--lr-schedule", "constant"]


def _layout(root):
    """step 1..4 written by every rank; step 5 a save not committed (a rank killed mid-write: its .pt.tmp)."""
    for step in range(1, 6):
        d = os.path.join(root, f"step_{step:07d}")
        os.makedirs(d)
        open(os.path.join(d, "rank0.pt"), "wb").close()
    open(os.path.join(root, "step_0000005", "rank1.pt.tmp"), "wb").close()
    os.symlink("step_0000001", os.path.join(root, "step_0000000"))  # not followed, not deleted


def _listing(root):
    return sorted(os.listdir(root))


@pytest.mark.parametrize("keep,kept", [
    (None, [1, 2, 3, 4, 5]),  # the default: everything stays
    (1, [4, 5]),
    (2, [3, 4, 5]),
    (10, [1, 2, 3, 4, 5]),
])
def test_commit_keeps_the_newest_committed_steps(tmp_path, keep, kept):
    root = str(tmp_path / "ck")
    _layout(root)
    commit(root, os.path.join(root, "step_0000004"), DistEnv(), keep)
    with open(os.path.join(root, "latest")) as f:
        assert f.read() == "step_0000004"
    expected = sorted(["latest", "step_0000000"] + [f"step_{s:07d}" for s in kept])
    assert _listing(root) == expected
    assert os.path.isfile(os.path.join(root, "step_0000005", "rank1.pt.tmp"))  # not committed: stays
    if 1 not in kept:  # the symlink's target went; the link itself was not followed into a deletion
        assert os.path.islink(os.path.join(root, "step_0000000"))


def test_the_harness_keeps_n_checkpoints_and_resumes_from_them(tmp_path, capsys):
    ck = str(tmp_path / "ck")
    lm.main([*TINY, "--checkpoint", ck, "--checkpoint-every", "1", "--steps", "3", "--eval-every", "3",
             "--keep-checkpoints", "2", "--device", "cpu"])
    assert _listing(ck) == ["latest", "step_0000002", "step_0000003"]
    shutil.rmtree(os.path.join(ck, "step_0000002"))  # only the step `latest` names is needed to resume
    summary = lm.main([*TINY, "--checkpoint", ck, "--resume", "auto", "--checkpoint-every", "1", "--steps", "4",
                       "--eval-every", "4", "--keep-checkpoints", "1", "--device", "cpu"])
    assert summary["steps"] == 4
    assert _listing(ck) == ["latest", "step_0000004"]
    with pytest.raises(SystemExit) as e:
        lm.main([*TINY, "--keep-checkpoints", "0"])
    assert e.value.code == 2 and "--keep-checkpoints: must be at least 1" in capsys.readouterr().err
