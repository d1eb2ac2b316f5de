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
