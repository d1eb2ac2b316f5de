"""A parameter that holds inf or NaN (a diverged element, a masked weight) against torch.optim: torch skips a weight
decay of 0, so the element stays what it was and the optimizer state stays finite, and once the user repairs the
element the run goes on as torch's does. The fused kernels multiplied x_old by a zero decay coefficient, and 0 * inf
is NaN: the state went NaN for good (fused_math.h with_decay / without_decay)."""

import pytest
import torch

import decent_comm

INF, NAN = float("inf"), float("nan")

CASES = {
    "DAdamW-wd0": (decent_comm.DAdamW, torch.optim.AdamW, dict(lr=1e-3, weight_decay=0.0)),
    "DAdamW": (decent_comm.DAdamW, torch.optim.AdamW, dict(lr=1e-3, weight_decay=0.01)),
    "DAdam": (decent_comm.DAdam, torch.optim.Adam, dict(lr=1e-3)),
    "DSGD": (decent_comm.DSGD, torch.optim.SGD, dict(lr=1e-3)),
    "DSGD-momentum": (decent_comm.DSGD, torch.optim.SGD, dict(lr=1e-3, momentum=0.9, nesterov=True)),
}


def _steps(opt, p, n, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        p.grad = torch.randn(p.shape, generator=g)
        opt.step()


@pytest.mark.parametrize("name", list(CASES))
def test_a_non_finite_parameter_element_leaves_the_state_as_torchs(name):
    ours_cls, torch_cls, hp = CASES[name]
    x0 = torch.tensor([1.0, INF, -INF, NAN, 2.0, -0.5])
    p, q = torch.nn.Parameter(x0.clone()), torch.nn.Parameter(x0.clone())
    ours, ref = ours_cls([p], **hp), torch_cls([q], **hp)
    _steps(ours, p, 2, 0)
    _steps(ref, q, 2, 0)
    for key, theirs in ref.state[q].items():
        torch.testing.assert_close(ours.state[p][key], theirs, rtol=2e-5, atol=1e-7, msg=lambda m: f"{key}: {m}")
    if hp.get("weight_decay", 0) == 0:  # with decoupled decay, inf - lr * wd * inf is NaN here and inf in torch
        torch.testing.assert_close(p.detach(), q.detach(), rtol=2e-5, atol=1e-7, equal_nan=True)
    with torch.no_grad():  # the user repairs the elements; both runs go on alike
        for t in (p, q):
            t[1:4] = torch.tensor([0.25, -0.25, 0.5])
    _steps(ours, p, 3, 1)
    _steps(ref, q, 3, 1)
    torch.testing.assert_close(p.detach(), q.detach(), rtol=2e-5, atol=1e-7)
