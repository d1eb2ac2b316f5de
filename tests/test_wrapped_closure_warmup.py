"""Decentralized(LBFGS) in the warm-up, where each closure evaluation's gradients are averaged over the ranks: ranks
that evaluate the closure unequally often are told so (not that they took different numbers of steps), the advice
given makes the evaluations even (and the update torch's LBFGS on the ranks' mean loss), and check_finite names
only the rank whose own gradient was non-finite."""

import pytest
import torch

import decent_comm

from dist_utils import run_ranks

LBFGS = dict(lr=0.5, max_iter=4)


def _data(rank):
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(16, 2, generator=g)
    return x, x @ torch.tensor([[1.0], [-2.0]]) + 0.5 + 0.3 * rank


def _loss(model, rank):
    x, y = _data(rank)
    return ((model(x) - y) ** 2).mean()


def _wrapped_in_warmup(rank, n, lbfgs, nan_on_rank_1=False, steps=2):
    """Decentralized(LBFGS(**lbfgs)), or of Adam when `lbfgs` is None, stepped with a closure in the warm-up."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(2, 1)
    inner = torch.optim.LBFGS(lin.parameters(), **lbfgs) if lbfgs is not None else torch.optim.Adam(lin.parameters())
    opt = decent_comm.Decentralized(inner, warmup_steps=5, timeout=20, check_finite=nan_on_rank_1)

    def closure():
        opt.zero_grad()
        loss = _loss(lin, rank)
        if nan_on_rank_1 and rank == 1:
            loss = loss * float("nan")
        loss.backward()
        # Rank 1 reports a constant loss: LBFGS's tolerance_change on the loss ends its loop after one iteration
        # there (2 evaluations), while rank 0 goes on (the averaged gradients are the same on both)
        return loss * (rank == 0)

    try:
        for _ in range(steps):
            opt.step(closure)
    except RuntimeError as exc:
        return str(exc)
    return [p.detach().clone() for p in lin.parameters()]


def _torch_lbfgs_on_the_mean_loss(n, lbfgs, steps=2):
    torch.manual_seed(0)
    lin = torch.nn.Linear(2, 1)
    opt = torch.optim.LBFGS(lin.parameters(), **lbfgs)

    def closure():
        opt.zero_grad()
        loss = sum(_loss(lin, r) for r in range(n)) / n
        loss.backward()
        return loss

    for _ in range(steps):
        opt.step(closure)
    return [p.detach() for p in lin.parameters()]


def test_closure_evaluated_unequally_often_is_named_as_such_on_every_rank():
    """It said "the ranks have taken different numbers of optimizer steps (rank 1: 1 steps; rank 0: 0 steps). Every
    rank must call step() equally often", though every rank called step() once."""
    for rank, msg in enumerate(run_ranks(_wrapped_in_warmup, 2, LBFGS, timeout=120)):
        assert isinstance(msg, str), (rank, msg)
        assert "the wrapped optimizer evaluated the closure a different number of times on the ranks in warm-up " \
               "step 0 (rank 0: 3 times or more; rank 1: 2 times)" in msg, (rank, msg)
        assert "tolerance_change=0" in msg and "warmup_steps=0" in msg and "optimizer steps" not in msg, (rank, msg)


def test_the_advice_evens_the_evaluations_and_steps_as_torch_lbfgs_on_the_mean_loss():
    lbfgs = dict(LBFGS, tolerance_change=0)  # the message's advice: max_iter and the averaged gradient decide
    reference = _torch_lbfgs_on_the_mean_loss(2, lbfgs)
    for rank, params in enumerate(run_ranks(_wrapped_in_warmup, 2, lbfgs, timeout=120)):
        assert not isinstance(params, str), (rank, params)
        for p, ref in zip(params, reference):
            torch.testing.assert_close(p, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("inner", ["LBFGS", "Adam"])
def test_check_finite_names_only_the_rank_whose_closure_gradient_was_non_finite(inner):
    """LBFGS evaluates the closure again after the first evaluation's average carried rank 1's NaN to rank 0: rank
    0's own gradient was non-finite then too, and both ranks were named."""
    res = run_ranks(_wrapped_in_warmup, 2, LBFGS if inner == "LBFGS" else None, True, timeout=120)
    for rank, msg in enumerate(res):
        assert f"rank {rank}: the parameters of bucket(s) [0] are not finite after optimizer step 0, a warm-up step " \
               "whose gradient average carried the non-finite gradients of rank 1 (check_finite" in msg, (rank, msg)

