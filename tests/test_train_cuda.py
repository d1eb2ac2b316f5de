"""The training harness end to end on a GPU: examples/train_lm.py under torchrun with --device cuda (a NCCL process
group, the fused optimizers' CUDA kernels, the exchanger's NCCL transport, ATC's hooks, checkpoints on the GPU),
one rank (one GPU: the two-rank NCCL path needs two, or NCCL >= 2.30). Skipped without a GPU; bench/gpu_check.sh
runs it.

References: the same job on the CPU (gloo), whose float32 numbers the GPU's must follow closely from the same
initial weights and data; and the GPU job itself, resumed from its step-3 checkpoint, which must continue where it
was (close, not bitwise: CUDA's embedding backward adds with atomics, in no fixed order).
"""
import os

import pytest
import torch

from test_examples import LM_TINY, read_log, torchrun

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")

CASES = [("dadamw", "atc"), ("accumadamw", "awc")]


def _job(tmp_path, name, device, flags):
    out = str(tmp_path / name)
    torchrun("train_lm.py", [*flags, "--device", device, "--out", out], nproc=1, timeout=120)
    return read_log(out)


def _losses(log):
    return [r["train_loss"] for r in log["rows"]]


@pytest.mark.parametrize("optimizer, mode", CASES)
def test_train_lm_on_the_gpu_follows_the_cpu_and_resumes(tmp_path, optimizer, mode):
    ck = str(tmp_path / "ck")
    flags = ["--optimizer", optimizer, "--mode", mode, "--steps", "6", "--eval-every", "3", "--log-every", "1",
             "--lr", "2e-3", *LM_TINY]
    gpu = _job(tmp_path, "gpu", "cuda", [*flags, "--checkpoint", ck, "--checkpoint-every", "3"])
    cpu = _job(tmp_path, "cpu", "cpu", flags)
    assert gpu["config"]["world_size"] == 1 and [r["step"] for r in gpu["rows"]] == [1, 2, 3, 4, 5, 6]
    # Step 1's loss is the forward of identical weights on identical data; later ones carry float32 rounding.
    assert _losses(gpu)[0] == pytest.approx(_losses(cpu)[0], rel=1e-5)
    assert _losses(gpu) == pytest.approx(_losses(cpu), rel=2e-3)
    assert _losses(gpu)[-1] < _losses(gpu)[0]
    assert sorted(os.listdir(os.path.join(ck, "step_0000003"))) == ["rank0.pt"]

    resumed = _job(tmp_path, "resumed", "cuda", [*flags, "--resume", os.path.join(ck, "step_0000003")])
    assert [r["step"] for r in resumed["rows"]] == [1, 2, 3, 4, 5, 6]
    assert _losses(resumed) == pytest.approx(_losses(gpu), rel=1e-4)
    val = [r["val_loss"] for r in gpu["rows"] if "val_loss" in r]
    assert [r["val_loss"] for r in resumed["rows"] if "val_loss" in r] == pytest.approx(val, rel=1e-4)
