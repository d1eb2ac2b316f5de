"""How far DAdam(W)'s state is from torch's, as docs/api.md states it: for beta1 <= 0.5 exp_avg is computed in the
other lerp form than torch's (an ulp of the previous exp_avg, all of a gradient far below it at beta1 = 0) while the
parameters agree to float32 rounding; float64 parameters keep float32 state, torch's float64 state to its rounding."""

import pytest
import torch

import decent_comm

N, LR = 4096, 1e-3


@pytest.mark.parametrize("beta1", [0.0, 0.3, 0.5])
@pytest.mark.parametrize("ours_cls, torch_cls", [(decent_comm.DAdamW, torch.optim.AdamW),
                                                 (decent_comm.DAdam, torch.optim.Adam)])
def test_beta1_at_most_half_differs_by_an_ulp_of_exp_avg_and_not_in_the_parameters(beta1, ours_cls, torch_cls):
    """Each step from torch's own state (copied into opt.state, as torch takes edits), gradients alternating 1e6 and
    1e-2 in scale (|g| << |exp_avg|): exp_avg within an ulp of max(|previous|, |g|), the parameters within a few ulps
    of |p| + lr."""
    torch.manual_seed(0)
    p1 = torch.nn.Parameter(torch.randn(N))
    p2 = torch.nn.Parameter(p1.detach().clone())
    ours, ref = ours_cls([p1], lr=LR, betas=(beta1, 0.99)), torch_cls([p2], lr=LR, betas=(beta1, 0.99))
    for t in range(20):
        g = torch.randn(N) * (1e6 if t % 2 == 0 else 1e-2)
        if t:
            with torch.no_grad():
                for k in ("exp_avg", "exp_avg_sq"):
                    ours.state[p1][k].copy_(ref.state[p2][k])
                p1.copy_(p2)
        prev = ref.state[p2]["exp_avg"].clone() if t else torch.zeros(N)
        p1.grad, p2.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
        ulp = torch.maximum(prev.abs(), g.abs()).double() * 2 ** -23
        dm = (ours.state[p1]["exp_avg"].double() - ref.state[p2]["exp_avg"].double()).abs()
        assert (dm <= 1.5 * ulp).all(), (t, (dm / ulp).max().item())
        dp = (p1.detach().double() - p2.detach().double()).abs() / ((p2.detach().double().abs() + LR) * 2 ** -23)
        assert dp.max().item() <= 4, t


def test_beta1_zero_loses_a_gradient_far_below_the_previous_one():
    """The example of docs/api.md: exp_avg 0 where torch's is the gradient 1.0, the parameters equal."""
    p1, p2 = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
    ours = decent_comm.DAdamW([p1], lr=LR, betas=(0.0, 0.99), weight_decay=0.0)
    ref = torch.optim.AdamW([p2], lr=LR, betas=(0.0, 0.99), weight_decay=0.0)
    for g in (1e8, 1.0):
        p1.grad, p2.grad = torch.tensor([g]), torch.tensor([g])
        ours.step()
        ref.step()
    assert ours.state[p1]["exp_avg"].item() == 0.0 and ref.state[p2]["exp_avg"].item() == 1.0
    assert torch.equal(p1.detach(), p2.detach())


@pytest.mark.parametrize("scale", [1e-3, 1.0, 1e3])
def test_float64_parameters_keep_torchs_float64_state_to_float32_rounding(scale):
    """api.md: exp_avg_sq within 2.3e-7 (10 steps) and 5.8e-7 (100 steps) of itself, exp_avg within 1e-7 of
    max|exp_avg|, at gradient scales 1e-3 to 1e3 (the limits here: the measured values and a margin)."""
    torch.manual_seed(0)
    x0 = torch.randn(N, dtype=torch.float64)
    p1, p2 = torch.nn.Parameter(x0.clone()), torch.nn.Parameter(x0.clone())
    ours, ref = decent_comm.DAdamW([p1], lr=1e-2), torch.optim.AdamW([p2], lr=1e-2)
    for t in range(1, 101):
        g = torch.randn(N, dtype=torch.float64) * scale
        p1.grad, p2.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
        if t in (10, 100):
            m1, m2 = ours.state[p1]["exp_avg"].double(), ref.state[p2]["exp_avg"]
            v1, v2 = ours.state[p1]["exp_avg_sq"].double(), ref.state[p2]["exp_avg_sq"]
            assert ((v1 - v2).abs() / v2).max().item() <= (3e-7 if t == 10 else 7e-7), t
            assert (m1 - m2).abs().max().item() <= 1.2e-7 * m2.abs().max().item(), t
            assert (p1.detach() - p2.detach()).abs().max().item() <= 5e-8, t
