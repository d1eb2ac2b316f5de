"""What torch.optim code edits between steps (decent_comm.optim.user_edits), checked against torch.optim itself:
resetting state the torch way restarts it as torch's optimizers do, editing a group's parameters is refused, a
user's first step that looks like torch.distributed.checkpoint's state initialization is still a step, a refused
load_state_dict leaves the optimizer as it was, and a shut-down optimizer does not step."""

import collections
import copy

import pytest
import torch
from torch.optim.lr_scheduler import LambdaLR

import decent_comm

from optim_cases import batch, make_model, train_steps

PAIRS = {
    "adamw": (decent_comm.DAdamW, torch.optim.AdamW, ("exp_avg", "exp_avg_sq")),
    "sgd-momentum": (lambda ps, **kw: decent_comm.DSGD(ps, momentum=0.9, **kw),
                     lambda ps, **kw: torch.optim.SGD(ps, momentum=0.9, **kw), ("momentum_buffer",)),
}


def _first(opt):
    return opt.param_groups[0]["params"][0]


EDITS = {
    "clear": lambda opt: opt.state.clear(),
    "new-dict": lambda opt: setattr(opt, "state", collections.defaultdict(dict)),
    "del-one": lambda opt: opt.state.pop(_first(opt)),
    "empty-entry": lambda opt: opt.state.__setitem__(_first(opt), {}),
    "assign-tensor": lambda opt: opt.state[_first(opt)].__setitem__(
        next(k for k in ("exp_avg", "momentum_buffer") if k in opt.state[_first(opt)]),
        torch.full_like(_first(opt), 0.25)),
    "assign-step": lambda opt: opt.state[_first(opt)].__setitem__("step", torch.tensor(1.0)),
}


def _steps(model, opt, start, stop):
    for t in range(start, stop):
        x, y = batch(0, t)
        opt.zero_grad()
        ((model(x.double()) - y.double()) ** 2).mean().backward()
        opt.step()


@pytest.mark.parametrize("checkpoint", [False, True], ids=["", "then-state_dict"])
@pytest.mark.parametrize("edit", EDITS)
@pytest.mark.parametrize("pair", PAIRS)
def test_state_edits_between_steps_act_as_in_torch(pair, edit, checkpoint):
    ctor, ref_ctor, keys = PAIRS[pair]
    if edit == "assign-step" and pair == "sgd-momentum":
        pytest.skip("torch.optim.SGD keeps no step count")
    # float64 parameters, so that the fused kernels and torch's loops agree to the rounding of the float32 state
    # the kernels keep (~1e-8; an edit ignored is off by ~0.1)
    model, ref = make_model(0).double(), make_model(0).double()
    opt, ropt = ctor(model.parameters(), lr=0.05), ref_ctor(ref.parameters(), lr=0.05)
    _steps(model, opt, 0, 3)
    _steps(ref, ropt, 0, 3)
    EDITS[edit](opt)
    EDITS[edit](ropt)
    if checkpoint:  # what a checkpoint taken now holds is the edited state, as torch's
        saved, rsaved = opt.state_dict()["state"], ropt.state_dict()["state"]
        assert sorted(saved) == sorted(rsaved)
        for k, st in rsaved.items():
            for name, v in st.items():
                torch.testing.assert_close(saved[k][name].double(), v.double(), rtol=1e-5, atol=1e-7)
    _steps(model, opt, 3, 6)
    _steps(ref, ropt, 3, 6)
    for p, rp in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, rp, rtol=1e-6, atol=1e-7)
        for k in keys:
            torch.testing.assert_close(opt.state[p][k].double(), ropt.state[rp][k], rtol=1e-5, atol=1e-7)
        if "step" in ropt.state[rp]:
            assert float(opt.state[p]["step"]) == float(ropt.state[rp]["step"])
    # the state is the buckets' again: a checkpoint carries it, and an in-place write reaches the next step
    saved = opt.state_dict()["state"]
    assert len(saved) == len(list(model.parameters())) and all(keys[0] in st for st in saved.values())
    p = _first(opt)
    opt.state[p][keys[0]].fill_(7.0)
    assert float(opt.state_dict()["state"][0][keys[0]].min()) == 7.0


def test_a_state_edit_of_another_shape_is_refused_by_name():
    model = make_model(0)
    opt = decent_comm.DAdamW(model.parameters(), lr=0.05)
    train_steps(0, model, opt, 2)
    opt.state[_first(opt)]["exp_avg"] = torch.zeros(3)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"'exp_avg' of parameter 0 has shape \(3,\)"):
        train_steps(0, model, opt, 1, start=2)
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p, b)


@pytest.mark.parametrize("change", ["append", "remove", "replace"])
def test_editing_a_groups_parameters_is_refused(change):
    model = make_model(0)
    opt = decent_comm.DAdamW(model.parameters(), lr=0.05)
    train_steps(0, model, opt, 1)
    params = opt.param_groups[0]["params"]
    extra = torch.nn.Parameter(torch.ones(3))
    {"append": lambda: params.append(extra), "remove": lambda: params.pop(),
     "replace": lambda: params.__setitem__(0, extra)}[change]()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="param group 0 holds other parameters than at construction"):
        train_steps(0, model, opt, 1, start=1)
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p, b)


def test_reordering_a_groups_parameters_is_refused_as_such():
    model = make_model(0)
    opt = decent_comm.DAdamW(model.parameters(), lr=0.05)
    train_steps(0, model, opt, 1)
    opt.param_groups[0]["params"].reverse()
    with pytest.raises(RuntimeError, match="param group 0 holds its parameters in another order"):
        train_steps(0, model, opt, 1, start=1)


@pytest.mark.parametrize("pair", PAIRS)
def test_a_first_step_at_lr_0_on_zero_gradients_is_a_step(pair):
    """A warm-up from lr 0 whose first batch gives zero gradients looks like torch.distributed.checkpoint's state
    initialization (test_optim_state checks that one) but must count, as in torch."""
    ctor, ref_ctor, keys = PAIRS[pair]
    runs = []
    for build in (ctor, ref_ctor):
        model = make_model(0)
        opt = build(model.parameters(), lr=0.05)
        sched = LambdaLR(opt, lambda t: t / 4)
        for t in range(4):
            x, y = batch(0, t)
            opt.zero_grad()
            ((0.0 if t == 0 else 1.0) * ((model(x) - y) ** 2).mean()).backward()
            opt.step()
            sched.step()
        runs.append((model, opt))
    (model, opt), (ref, ropt) = runs
    for p, rp in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, rp)
        if "step" in ropt.state[rp]:
            assert float(opt.state[p]["step"]) == float(ropt.state[rp]["step"]) == 4


@pytest.mark.parametrize("build", [
    lambda ps: decent_comm.DAdamW(ps, lr=0.0),
    lambda ps: decent_comm.Decentralized(torch.optim.AdamW(ps, lr=0.0)),
], ids=["dadamw", "wrapped"])
def test_a_closure_at_lr_0_is_called_and_its_loss_returned(build):
    model = make_model(0)
    opt = build(model.parameters())
    x, y = batch(0, 0)
    calls = []

    def closure():
        calls.append(1)
        opt.zero_grad()
        loss = 0.0 * ((model(x) - y) ** 2).mean()
        loss.backward()
        return loss

    assert opt.step(closure) is not None and len(calls) == 1
    assert all(float(st["step"]) == 1 for st in opt.state.values())


def _trained(lr, **kw):
    model = make_model(0)
    opt = decent_comm.DAdamW(model.parameters(), lr=lr, **kw)
    train_steps(0, model, opt, 3)
    return model, opt


def _bad_shape(sd):
    sd["state"][0]["exp_avg"] = torch.ones(4)  # parameter 0 is a (3, 4) weight: copy_ would broadcast this


@pytest.mark.parametrize("make_bad, error", [
    (lambda sd: None, "gossip_every=2"),  # the source runs gossip_every=2
    (_bad_shape, r"'exp_avg' of parameter 0 has shape \(4,\)"),
], ids=["other-cadence", "other-shape"])
def test_a_refused_state_dict_leaves_the_optimizer_as_it_was(make_bad, error):
    sd = copy.deepcopy(_trained(0.01, gossip_every=2 if error.startswith("gossip") else 1)[1].state_dict())
    make_bad(sd)
    model, opt = _trained(0.3)
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match=error):
        opt.load_state_dict(sd)
    after = opt.state_dict()
    assert after["param_groups"] == before["param_groups"] and opt.param_groups[0]["lr"] == 0.3
    for k, st in before["state"].items():
        for name, v in st.items():
            assert torch.equal(after["state"][k][name], v), (k, name)


def test_a_shut_down_optimizer_refuses_to_step():
    model, opt = _trained(0.05)
    opt.shutdown()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"step\(\) after shutdown\(\)"):
        train_steps(0, model, opt, 1, start=3)
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p, b)
    assert opt.state_dict()["state"]  # what it holds can still be saved


def test_model_must_be_a_module():
    with pytest.raises(ValueError, match="model must be the torch.nn.Module"):
        decent_comm.DAdamW(make_model(0).parameters(), lr=0.1, mode="atc", model="net")


def test_nesterov_edited_after_construction_trains_as_torch_sgd():
    """torch.optim.SGD checks nesterov against momentum and dampening at construction only: with momentum set to 0
    later it steps plainly (the kernel refused, mid-step), and with momentum back and a dampening it steps a damped
    Nesterov (DSGD refused it)."""
    runs = []
    for build in (decent_comm.DSGD, torch.optim.SGD):
        model = make_model(0)
        opt = build(model.parameters(), lr=0.05, momentum=0.9, nesterov=True)
        train_steps(0, model, opt, 2)
        opt.param_groups[0]["momentum"] = 0.0
        train_steps(0, model, opt, 2, start=2)
        opt.param_groups[0].update(momentum=0.9, dampening=0.3)
        train_steps(0, model, opt, 3, start=4)
        runs.append([p.detach().clone() for p in model.parameters()])
    for ours, torchs in zip(*runs):
        torch.testing.assert_close(ours, torchs, rtol=1e-6, atol=1e-7)


# A value the fused kernels refuse (torch.optim's loops take most of them, torch.optim.AdamW's betas=(1, .) not),
# set in param group 1 between steps; the reference never sees the edit (AccumAdamW, without a torch counterpart:
# its own run).
REFUSED_VALUES = {
    "DSGD": (lambda ps: decent_comm.DSGD(ps, lr=0.05, momentum=0.9),
             lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
             dict(lr=-0.01, momentum=-0.5, weight_decay=-0.1)),
    "DAdamW": (lambda ps: decent_comm.DAdamW(ps, lr=0.05), lambda ps: torch.optim.AdamW(ps, lr=0.05),
               dict(lr=-0.01, eps=-1.0, weight_decay=-0.1, betas=(1.0, 0.999))),
    "AccumAdamW": (lambda ps: decent_comm.AccumAdamW(ps, lr=0.05, accum_steps=2),
                   lambda ps: decent_comm.AccumAdamW(ps, lr=0.05, accum_steps=2),
                   dict(lr=-0.01, eps=-1.0, weight_decay=-0.1, accum_steps=0)),
}


def _two_groups(model):
    ps = list(model.parameters())
    return [{"params": ps[:2]}, {"params": ps[2:]}]


@pytest.mark.parametrize("name, key", [(n, k) for n, (_, _, bad) in REFUSED_VALUES.items() for k in bad])
def test_a_value_the_kernels_refuse_is_refused_before_any_group_steps(name, key):
    """Each group's kernel checked its own values, so group 0 had stepped (parameters, moments, step counts) when
    group 1's raised. Now every group is checked first: nothing moves, and once the value is set back the run goes
    on as one that never saw it. A refused load leaves the optimizer as it was too."""
    build, build_ref, bad = REFUSED_VALUES[name]
    model, ref = make_model(0).double(), make_model(0).double()
    opt, ropt = build(_two_groups(model)), build_ref(_two_groups(ref))
    _steps(model, opt, 0, 2)
    before, saved = [p.detach().clone() for p in model.parameters()], copy.deepcopy(opt.state_dict())
    good, opt.param_groups[1][key] = opt.param_groups[1][key], bad[key]
    shown, value = ("beta1", bad[key][0]) if key == "betas" else (key, bad[key])
    refused = rf"^{name} \(param group 1\): {shown} must be .*, got {value:g}$"
    with pytest.raises(ValueError, match=refused):
        _steps(model, opt, 2, 3)
    loaded = copy.deepcopy(saved)
    loaded["param_groups"][1][key] = bad[key]
    with pytest.raises(ValueError, match=refused):  # a checkpoint's, before anything loads
        opt.load_state_dict(loaded)
    with pytest.raises(ValueError, match=refused):  # a constructor's group
        build([dict(group, **{key: bad[key]}) if i else group for i, group in enumerate(_two_groups(make_model(1)))])
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p, b)
    after = opt.state_dict()
    assert after["param_groups"][0] == saved["param_groups"][0]  # the schedule's step too
    assert sorted(after["state"]) == sorted(saved["state"])
    for i, st in saved["state"].items():
        assert sorted(after["state"][i]) == sorted(st)
        for k, v in st.items():
            assert torch.equal(after["state"][i][k], v), (i, k)
    opt.param_groups[1][key] = good
    _steps(model, opt, 2, 4)
    _steps(ref, ropt, 0, 4)
    for p, rp in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, rp, rtol=1e-6, atol=1e-7)
