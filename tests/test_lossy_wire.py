"""bf16 / fp16 wires (comm_dtype below the parameters' float32): what the rounding must not do. The dense
simulations with these wires are in test_optim_dist.py and test_delayed_mix.py; these are the symptoms users saw.

- An update smaller than the wire's resolution is kept: a LayerNorm-like gain at 1.0 under DAdamW lr 3e-4, which
  the wire rounds to steps of 2^-8, moved 6e-4 in 100 steps over bf16 (the mix pulled it back to a bf16 value every
  round) instead of torch AdamW's 3e-2.
- A group step (complete: one all-reduce) neither drifts nor overflows: summed in the wire dtype, the replicas'
  mean moved by 1e-2 at lr 0 over bf16, and fp16 values of 3e4-6e4 summed over 3 ranks became inf.
"""

import pytest
import torch

import decent_comm

from dist_utils import run_ranks


def _gain_after_100_steps(rank, n, mode, wire):
    out = {}
    for label in ("torch", "decent_comm"):
        gain = torch.nn.Parameter(torch.ones(8))
        opt = torch.optim.AdamW([gain], lr=3e-4, weight_decay=0.0) if label == "torch" else \
            decent_comm.DAdamW([gain], lr=3e-4, weight_decay=0.0, topology="one-peer-exp", mode=mode,
                               comm_dtype=wire, timeout=30)
        for _ in range(100):
            gain.grad = torch.ones(8)  # the same on every rank: the replicas stay equal, as torch's single copy
            opt.step()
        if label == "decent_comm":
            opt.synchronize()
            opt.shutdown()
        out[label] = gain.detach().clone()
    return out


@pytest.mark.parametrize("mode,wire", [("awc", torch.bfloat16), ("atc", torch.bfloat16), ("awc", torch.float16)])
def test_updates_below_the_wire_resolution_are_kept(mode, wire):
    for r, out in enumerate(run_ranks(_gain_after_100_steps, 2, mode, wire, timeout=120)):
        moved = 1.0 - out["torch"][0].item()
        assert abs(moved - 0.03) < 1e-4, moved
        # float32 rounding only: the kernels add x + w z_j first, then - w z_i (at most 6e-8 a step here)
        assert torch.allclose(out["decent_comm"], out["torch"], rtol=0, atol=1e-5), (r, out)


def _group_average(rank, n, wire):
    base = 3e4 + 3e4 * torch.rand(3000, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    x0 = [base + 1e3 * r for r in range(n)]  # distinct replicas, each value within fp16's range (65504)
    p = torch.nn.Parameter(x0[rank].float())
    opt = decent_comm.DSGD([p], lr=0.0, topology="complete", comm_dtype=wire, timeout=30, consensus=0.5,
                           broadcast_init=False)
    for _ in range(3):
        p.grad = torch.zeros_like(p)
        opt.step()
    opt.synchronize()
    group_allreduce = opt._schedule.exchange.group_allreduce
    used_groups = group_allreduce is not None and group_allreduce.bytes_sent > 0
    sent = opt.bytes_sent
    opt.shutdown()
    # consensus 0.5 on complete: x_i <- x_i / 2 + mean / 2, so x_i - mean halves each step and the mean stays
    mean = sum(x0) / n
    expected = mean + (x0[rank] - mean) / 8
    return (p.detach().double() - expected).abs().max().item() / mean.abs().max().item(), used_groups, sent


@pytest.mark.parametrize("wire", [torch.bfloat16, torch.float16])
def test_group_steps_sum_unrounded_in_the_parameters_dtype(wire):
    for r, (err, used_groups, sent) in enumerate(run_ranks(_group_average, 3, wire, timeout=120)):
        assert used_groups, r
        assert err < 1e-6, (r, err)
        # 4 all-reduces (AWC: each step launches the next one's) of 4-byte elements among 3 ranks
        assert sent == 4 * 3000 * 4 * 2 * (3 - 1) // 3, (r, sent)


def _fp16_group_step(rank, n):
    x0 = (2e4 + 1.2e4 * torch.rand(3000, generator=torch.Generator().manual_seed(rank), dtype=torch.float64))
    p = torch.nn.Parameter(x0.half())
    opt = decent_comm.DSGD([p], lr=0.0, topology="complete", broadcast_init=False, timeout=30)
    p.grad = torch.zeros_like(p)
    opt.step()
    opt.synchronize()
    group_allreduce = opt._schedule.exchange.group_allreduce
    used_groups = group_allreduce is not None and group_allreduce.bytes_sent > 0
    sent, width = opt.bytes_sent, opt._schedule.buffers.group_width(opt._buckets)
    opt.shutdown()
    return x0.half(), p.detach().clone(), used_groups, sent, width


def test_fp16_parameters_sum_group_steps_in_float32():
    """fp16 parameters with no comm_dtype summed a group step in fp16: values near 3e4 over 4 ranks passed 65504
    and a third of the parameters became inf at lr 0. The sum now runs in float32 (exact here: same binade, 4
    ranks), so one step of complete (consensus 1) gives the float64 mean rounded once, and moves 4-byte elements."""
    results = run_ranks(_fp16_group_step, 4, timeout=120)
    want = (sum(x0.double() for x0, *_ in results) / 4).half()
    for r, (_, x, used_groups, sent, width) in enumerate(results):
        assert used_groups, r
        assert torch.equal(x, want), (r, int((~torch.isfinite(x)).sum()), int((x != want).sum()))
        # 2 all-reduces (AWC: the step launches the next one's) of 4-byte elements among 4 ranks
        assert sent == 2 * 3000 * 4 * 2 * (4 - 1) // 4, (r, sent)
        assert width == 2.0, (r, width)  # an adaptive topology prices a group step at twice a p2p step's bytes


def _replicas_at_lr_0(rank, n):
    x0 = 1.25 + 1e-3 * torch.linspace(-1, 1, 500, dtype=torch.float64) * (rank - 1)  # replicas 1e-3 apart
    p = torch.nn.Parameter(x0.float())
    opt = decent_comm.DSGD([p], lr=0.0, topology="ring", comm_dtype=torch.bfloat16, exchange="p2p", timeout=30,
                           broadcast_init=False)
    for _ in range(40):
        p.grad = torch.zeros_like(p)
        opt.step()
    opt.synchronize()
    opt.shutdown()
    return p.detach().double()


def test_replicas_agree_to_half_a_wire_step_and_keep_their_mean():
    """What the difference form gives up without error feedback (docs/api.md, comm_dtype): replicas whose values
    round to the same bf16 number send equal copies, so they agree only to about half a bf16 step (2^-8 = 3.9e-3 in
    [1, 2)), not to float32 as over an fp32 wire; their mean stays put to float32 rounding."""
    xs = run_ranks(_replicas_at_lr_0, 3, timeout=120)
    mean = sum(xs) / 3
    x0_mean = torch.full_like(mean, 1.25)
    assert (mean - x0_mean).abs().max().item() < 1e-6
    spread = max((x - mean).abs().max().item() for x in xs)
    assert spread <= 2 ** -8, spread


FLOATS = [torch.float64, torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: f"params-{str(d)[6:]}")
@pytest.mark.parametrize("wire", FLOATS, ids=lambda d: f"wire-{str(d)[6:]}")
def test_a_wire_rounds_when_a_value_of_the_parameters_dtype_does_not_survive_it(dtype, wire):
    """The reference: the casts themselves, on the dtype's largest value and on 1 + its eps (bf16 parameters over
    an fp16 wire: finer, but 65504 at most)."""
    from decent_comm.optim.wire_buffers import wire_rounds
    info = torch.finfo(dtype)
    probes = torch.tensor([info.max, 1 + info.eps], dtype=dtype)
    want = not torch.equal(probes.to(wire).to(dtype), probes)
    assert wire_rounds(dtype, wire) == want


def _bf16_over_fp16_group_steps(rank, n):
    model = torch.nn.Linear(4, 2).to(torch.bfloat16)
    with torch.no_grad():
        model.weight.fill_(1.0 + rank)
        model.weight[0, 0] = 1e5  # bf16 holds it (99840); fp16 does not (65504 at most)
    opt = decent_comm.DSGD(model.parameters(), lr=0.0, topology="ring", comm_dtype=torch.float16,
                           broadcast_init=False, timeout=30)
    for _ in range(2):
        opt.zero_grad()
        model(torch.ones(1, 4, dtype=torch.bfloat16)).float().sum().backward()
        opt.step()
    opt.synchronize()
    opt.shutdown()
    return model.weight.detach().double()


def test_bf16_parameters_over_an_fp16_wire_sum_group_steps_in_bf16():
    """A ring of 3 runs as a group all-reduce: summed in fp16, a weight of 1e5 became inf."""
    weights = run_ranks(_bf16_over_fp16_group_steps, 3, timeout=120)
    mean = sum(torch.full((2, 4), 1.0 + r, dtype=torch.float64) for r in range(3)) / 3
    mean[0, 0] = torch.tensor(1e5, dtype=torch.bfloat16).double()
    for r, w in enumerate(weights):
        assert torch.equal(w, mean), (r, w)
