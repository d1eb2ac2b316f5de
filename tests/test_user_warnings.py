"""What a user should act on is a warnings.warn UserWarning (decent_comm/_warn.py), not a logging record: `python -W
error`, pytest.warns, warnings.catch_warnings and filterwarnings see it, it names the rank, and it is attributed to
the user's line (here: this file's), past decent_comm's and torch's frames. The ATC warning of a bucket used without
its module's hook, at the step that finds it: once per bucket, and under -W error raised before the step changed
anything, so that a retried step trains as the warned run does. (The others: the model compiled before the optimizer,
test_atc_compile.py; the int8 wire's copies restarted or incomplete at a load, test_int8_wire.py,
test_optim_dcp_migration.py, test_optim_state.py, test_elastic_resume.py.)"""

import sys
import warnings

import pytest
import torch

import decent_comm

from dist_utils import run_ranks


def _train(rank, n, action):
    """3 ATC steps of a Linear: the first through its forward (its hook defers the bucket), the next two reading its
    parameters directly. Under `action` "error" a step that raises the warning is retried. (the warnings caught as
    (message, file, line), the lines of this file's opt.step() calls that raised, the trained parameters)."""
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 2)
    opt = decent_comm.DSGD(m.parameters(), lr=0.1, topology="ring", mode="atc", model=m, timeout=30)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(rank))
    raised = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter(action)
        for t in range(3):
            opt.zero_grad()
            (m(x).sum() if t == 0 else m.weight.square().sum() + m.bias.sum()).backward()
            try:
                line = sys._getframe().f_lineno + 1
                opt.step()
            except UserWarning as e:
                raised.append((str(e), line))
                opt.step()  # the retry
    params = torch.cat([p.detach().reshape(-1) for p in m.parameters()])
    opt.shutdown()
    return [(str(w.message), w.filename, w.lineno) for w in caught], raised, line, params


def test_a_bucket_used_without_its_modules_hook_is_warned_of_once_at_the_users_step():
    said = "rank {}: ATC: parameters of shapes [(2, 4), (2,)] were used in a forward without the module holding them"
    for rank, (caught, raised, line, _) in enumerate(run_ranks(_train, 2, "always", timeout=120)):
        ours = [w for w in caught if w[0].startswith("decent_comm: ")]
        assert len(ours) == 1 and said.format(rank) in ours[0][0], ours  # once, though two steps read directly
        assert ours[0][1:] == (__file__, line), (ours, line)  # the opt.step() line (the loop's last is the same)
        assert raised == []


def test_under_warnings_as_errors_it_raises_and_a_retried_step_trains_as_the_warned_run():
    always = run_ranks(_train, 2, "always", timeout=120)
    error = run_ranks(_train, 2, "error", timeout=120)
    for rank, ((_, _, _, warned_params), (caught, raised, line, params)) in enumerate(zip(always, error)):
        assert caught == [] and len(raised) == 1, (caught, raised)
        assert raised[0][0].startswith(f"decent_comm: rank {rank}: ATC: parameters of shapes"), raised
        assert torch.equal(params, warned_params), (params, warned_params)


def _train_scaled(rank, n, kind, action):
    """_train under torch.amp.GradScaler, the step being scaler.step(opt): (the number of raises, the parameters)."""
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 2)
    if kind == "DSGD":
        opt = decent_comm.DSGD(m.parameters(), lr=0.1, topology="ring", mode="atc", model=m, timeout=30)
    else:
        opt = decent_comm.Decentralized(torch.optim.SGD(m.parameters(), lr=0.1), topology="ring", mode="atc",
                                        model=m, timeout=30)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(rank))
    raised = 0
    with warnings.catch_warnings(record=True):
        warnings.simplefilter(action)
        for t in range(3):
            opt.zero_grad()
            scaler.scale(m(x).sum() if t == 0 else m.weight.square().sum() + m.bias.sum()).backward()
            try:
                scaler.step(opt)
            except UserWarning:
                raised += 1
                scaler.step(opt)  # the retry
            scaler.update()
    params = torch.cat([p.detach().reshape(-1) for p in m.parameters()])
    opt.shutdown()
    return raised, params


@pytest.mark.parametrize("kind", ["DSGD", "Decentralized(SGD)"])
def test_a_retried_gradscaler_step_trains_as_the_warned_run(kind):
    """Review DG: the wrapped optimizer's gradients were unscaled on the host before the warning raised, and unscaled
    again by the retry; and torch's GradScaler.step keeps opt.grad_scale when step() raises, so its retry multiplied
    the scale in twice (both: 0.1 off the warned run)."""
    always = run_ranks(_train_scaled, 2, kind, "always", timeout=120)
    error = run_ranks(_train_scaled, 2, kind, "error", timeout=120)
    for (_, warned_params), (raised, params) in zip(always, error):
        assert raised == 1
        assert torch.equal(params, warned_params), (params - warned_params).abs().max()
