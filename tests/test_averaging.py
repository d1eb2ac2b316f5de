"""average_parameters(): every replica becomes the global average of the replicas, and stays it. Once they are all
equal, a step at lr=0 mixes identical replicas (a doubly-stochastic mix of equal vectors is the identity), so the
replicas must still be the average after it: what neighbours sent before the average must not be mixed in."""

import pytest
import torch
import torch.distributed as dist

import decent_comm

from dist_utils import run_ranks


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _average_then_steps_at_lr_0(rank, n, options, steps_at_0):
    torch.manual_seed(rank)  # replicas that differ
    model = torch.nn.Linear(4, 3)
    opt = decent_comm.DSGD(model.parameters(), lr=0.1, topology="one-peer-exp", broadcast_init=False, timeout=30,
                           **options)
    for t in range(3):
        opt.zero_grad()
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(10 * t + rank))
        model(x).pow(2).sum().backward()
        opt.step()
    opt.synchronize()
    before = _flat(model).double()
    gathered = [torch.empty_like(before) for _ in range(n)]
    dist.all_gather(gathered, before)  # the replicas as they were just before the average
    opt.average_parameters()
    averaged = _flat(model).clone()
    for g in opt.param_groups:
        g["lr"] = 0.0
    for _ in range(steps_at_0):
        opt.zero_grad()
        model(torch.ones(1, 4)).sum().backward()
        opt.step()
    opt.synchronize()
    after = _flat(model).clone()
    opt.shutdown()
    return torch.stack(gathered).mean(0), averaged, after


@pytest.mark.parametrize("options, steps_at_0, floor", [
    ({}, 1, 0.0),
    ({"mode": "atc"}, 1, 0.0),
    ({"comm_dtype": torch.bfloat16}, 1, 0.0),
    ({"comm_dtype": torch.int8}, 1, 2e-3),  # the int8 wire's rounding of the replicas' (equal) values
    ({"gossip_every": 2, "delayed_mix": True}, 2, 0.0),
], ids=["awc", "atc", "bf16-wire", "int8-wire", "delayed-every2"])
def test_replicas_stay_the_global_average_after_average_parameters(options, steps_at_0, floor):
    """3 ranks on one-peer-exp: point-to-point transfers (a 3-rank ring runs as a group all-reduce, which keeps no
    neighbour buffer). Mixing what neighbours sent before the average moved the replicas 0.2-0.47 apart."""
    results = run_ranks(_average_then_steps_at_lr_0, 3, options, steps_at_0, timeout=120)
    mean = results[0][0]
    for reference, averaged, after in results:
        assert torch.equal(reference, mean)
        torch.testing.assert_close(averaged.double(), mean, rtol=0, atol=1e-6)
        spread = (after.double() - mean).abs().max().item()
        assert spread <= floor + 1e-6, (options, spread)


def _near_3e4(rank, n, dtype):
    """Values in [2.4e4, 4e4), distinct per rank: each finite in fp16, a pair of them past 65504 about 1 time in 5;
    their float32 sum over at most 4 ranks is exact (fp16 steps of 16 and 32)."""
    return (2.4e4 + 1.6e4 * torch.rand(2000, generator=torch.Generator().manual_seed(rank),
                                       dtype=torch.float64)).to(dtype)


def _rounded_mean(n, dtype):
    """The independent reference: the float64 mean of every rank's values, rounded once to `dtype`."""
    return (sum(_near_3e4(r, n, dtype).double() for r in range(n)) / n).to(dtype)


def _half_precision_averages(rank, n, dtype):
    from decent_comm.optim import replica_watch
    replica_watch._CHUNK = 300  # float32 copies of 300 elements, a short one last: the chunks cover the bucket
    p = torch.nn.Parameter(_near_3e4(rank, n, dtype))
    opt = decent_comm.DSGD([p], lr=0.0, topology="ring", broadcast_init=False, timeout=30)
    with opt.global_average():
        inside = p.detach().clone()
    restored = p.detach().clone()
    opt.average_parameters()
    averaged = p.detach().clone()
    opt.shutdown()
    return inside, restored, averaged


@pytest.mark.parametrize("n, dtype", [(2, torch.float16), (4, torch.float16), (4, torch.bfloat16)],
                         ids=["2-fp16", "4-fp16", "4-bf16"])  # 2 bf16 ranks: round(a + b) / 2 is round(mean) already
def test_half_precision_parameters_average_to_their_rounded_mean(n, dtype):
    """Summed in the parameters' dtype, fp16 averages were inf wherever the sum passed 65504 (values near 3e4: 455
    of 4000 at 2 ranks, 1333 at 4), and bf16 averages rounded every partial sum. Summed in float32 (exact here)
    they are the float64 mean rounded once."""
    want = _rounded_mean(n, dtype)
    for r, (inside, restored, averaged) in enumerate(run_ranks(_half_precision_averages, n, dtype, timeout=120)):
        assert torch.equal(inside, want), (r, int((~torch.isfinite(inside)).sum()), int((inside != want).sum()))
        assert torch.equal(restored, _near_3e4(r, n, dtype)), r
        assert torch.equal(averaged, want), (r, int((averaged != want).sum()))


def _warmup_gradient(rank, n):
    p = torch.nn.Parameter(torch.zeros(2000, dtype=torch.float16))
    opt = decent_comm.DSGD([p], lr=1.0, topology="ring", warmup_steps=1, timeout=30)
    p.grad = _near_3e4(rank, n, torch.float16)
    opt.step()
    opt.synchronize()
    averaged = p.grad.detach().clone()
    moved = p.detach().clone()
    opt.shutdown()
    return averaged, moved


@pytest.mark.parametrize("n", [2, 4])
def test_the_warmup_averages_fp16_gradients_without_overflow(n):
    """The warm-up's gradient all-reduce summed fp16 gradients in fp16: inf past 65504, so lr 1 from zero moved the
    parameters to -inf. Every rank now takes the rounded float64 mean."""
    want = _rounded_mean(n, torch.float16)
    for r, (averaged, moved) in enumerate(run_ranks(_warmup_gradient, n, timeout=120)):
        assert torch.equal(averaged, want), (r, int((~torch.isfinite(averaged)).sum()))
        assert torch.equal(moved, -want), r
