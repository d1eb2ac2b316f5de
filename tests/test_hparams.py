"""decent_comm.decentralized_adam_hparams: the lr / betas translation from an all-reduce AdamW run."""

import math

import pytest

import decent_comm


@pytest.mark.parametrize("world_size,accum_steps,lr_factor", [
    (1, 1, 1.0), (4, 1, 2.0), (8, 1, math.sqrt(8)),       # DAdam(W): sqrt(n)
    (8, 4, math.sqrt(2)), (4, 4, 1.0), (4, 8, 1.0),       # AccumAdam(W): sqrt(n / K), never below 1
])
def test_lr_factor(world_size, accum_steps, lr_factor):
    hp = decent_comm.decentralized_adam_hparams(3e-3, world_size, accum_steps=accum_steps)
    assert hp["lr"] == pytest.approx(3e-3 * lr_factor, rel=1e-12)


def test_betas_act_per_window():
    hp = decent_comm.decentralized_adam_hparams(1e-3, 8, betas=(0.9, 0.99), accum_steps=4)
    assert hp["betas"] == pytest.approx((0.9 ** 4, 0.99 ** 4), rel=1e-12)
    assert decent_comm.decentralized_adam_hparams(1e-3, 8, betas=(0.9, 0.99))["betas"] == (0.9, 0.99)


def test_result_builds_the_optimizers():
    import torch

    p = torch.nn.Parameter(torch.zeros(3))
    decent_comm.DAdamW([p], **decent_comm.decentralized_adam_hparams(1e-3, 4))
    decent_comm.AccumAdamW([p], accum_steps=4, **decent_comm.decentralized_adam_hparams(1e-3, 4, accum_steps=4))


@pytest.mark.parametrize("kwargs,pattern", [
    (dict(world_size=0), "world_size must be an integer >= 1"),
    (dict(world_size=2.5), "world_size must be an integer >= 1"),
    (dict(world_size=4, accum_steps=0), "accum_steps must be an integer >= 1"),
    (dict(world_size=4, lr=-1.0), "lr must be a finite number > 0"),
    (dict(world_size=4, lr=float("nan")), "lr must be a finite number > 0"),
    (dict(world_size=4, betas=(0.9, 1.0)), r"betas must be two numbers in \[0, 1\)"),
])
def test_bad_input_names_the_argument(kwargs, pattern):
    kwargs = {"lr": 1e-3, **kwargs}
    with pytest.raises(ValueError, match=pattern):
        decent_comm.decentralized_adam_hparams(**kwargs)


def test_world_size_defaults_to_the_process_group(monkeypatch):
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    with pytest.raises(RuntimeError, match="pass world_size, or initialize the default process group"):
        decent_comm.decentralized_adam_hparams(1e-3)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 9)
    assert decent_comm.decentralized_adam_hparams(1e-3)["lr"] == pytest.approx(3e-3)
