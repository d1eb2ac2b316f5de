"""What torch.optim.Optimizer does around the update, done alike by the decentralized optimizers, each checked against
the torch optimizer doing the same: opt.state entries under keys that name no parameter survive a state_dict round
trip (any value, at 1 and 2 ranks), zero_grad() shows torch's profiler range, and a tensor option of several elements
is refused by name (torch's "Tensor lr must be 1-element")."""

import copy
import re

import pytest
import torch

import decent_comm

from optim_cases import state_test_model as model, step_on_seeded_grads as step

HP = dict(lr=0.01, weight_decay=0.1)
CASES = {  # name: (decentralized, its torch counterpart)
    "DAdamW": (lambda ps, **kw: decent_comm.DAdamW(ps, **HP, **kw), lambda ps: torch.optim.AdamW(ps, **HP)),
    "DSGD": (lambda ps, **kw: decent_comm.DSGD(ps, momentum=0.9, **HP, **kw),
             lambda ps: torch.optim.SGD(ps, momentum=0.9, **HP)),
    "AccumAdamW": (lambda ps, **kw: decent_comm.AccumAdamW(ps, accum_steps=1, **HP, **kw),  # AdamW's update at K=1
                   lambda ps: torch.optim.AdamW(ps, **HP)),
    "Decentralized(AdamW)": (lambda ps, **kw: decent_comm.Decentralized(torch.optim.AdamW(ps, **HP), **kw),
                             lambda ps: torch.optim.AdamW(ps, **HP)),
}


def notes():
    """What other code keeps in opt.state under keys that are no parameter: every kind of value (99: an index past
    the parameters', which torch keeps as it is too)."""
    return {"flag": True, "count": 3, "rate": 2.5, "none": None, "name": "abc", "seq": [1, 2.5],
            "meta": {"a": 1, "t": torch.ones(2)}, "scalar": torch.tensor(2.0), "vec": torch.arange(3.0), 99: "beyond"}


def others(mapping):
    """The entries of opt.state or of a state_dict's "state" that are no parameter's, in order."""
    return [(k, v) for k, v in mapping.items() if not torch.is_tensor(k) and k not in range(4)]


def assert_same_value(got, want, where):
    assert type(got) is type(want), (where, got, want)
    if torch.is_tensor(want):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    elif isinstance(want, (dict, list, tuple)):
        assert len(got) == len(want), (where, got, want)
        pairs = zip(got.items(), want.items()) if isinstance(want, dict) else zip(enumerate(got), enumerate(want))
        for (kg, g), (kw, w) in pairs:
            assert kg == kw, (where, kg, kw)
            assert_same_value(g, w, f"{where}[{kg!r}]")
    else:
        assert got == want, (where, got, want)


def assert_same_entries(got, want):
    assert [k for k, _ in got] == [k for k, _ in want]
    for (k, g), (_, w) in zip(got, want):
        assert_same_value(g, w, k)


def round_trip(ctor, before_first_step):
    """opt.state gets the notes (before its first step, or after two), then a deep copy of its state_dict loads into
    a new optimizer on other parameters, which then steps: (the state_dict, the new optimizer's entries after the
    load, those of its state_dict() after the step, its parameters)."""
    m = model()
    opt = ctor(m.parameters())
    if before_first_step:
        opt.state.update(notes())
    for t in range(2):
        step(m, opt, t)
    if not before_first_step:
        opt.state.update(notes())
    saved = copy.deepcopy(opt.state_dict())
    m2 = model(seed=1)
    m2.load_state_dict(m.state_dict())
    fresh = ctor(m2.parameters())
    fresh.load_state_dict(saved)
    loaded = others(fresh.state)
    step(m2, fresh, 2)
    return saved, loaded, others(fresh.state_dict()["state"]), [p.detach().clone() for p in m2.parameters()]


@pytest.mark.parametrize("before_first_step", [False, True])
@pytest.mark.parametrize("name", sorted(CASES))
def test_state_under_keys_no_parameter_has_round_trips_as_in_torch(name, before_first_step):
    """torch.optim's load_state_dict keeps a saved key it cannot map to a parameter as it is (state[k] = v). Read as
    a parameter's state, a bool or a tensor failed to iterate, and a string or a dict was dropped."""
    ctor, ref_ctor = CASES[name]
    saved, loaded, saved_again, params = round_trip(ctor, before_first_step)
    ref_saved, ref_loaded, ref_saved_again, ref_params = round_trip(ref_ctor, before_first_step)
    assert_same_entries(others(saved["state"]), others(ref_saved["state"]))
    assert_same_entries(loaded, ref_loaded)
    assert_same_entries(loaded, list(notes().items()))
    assert_same_entries(saved_again, ref_saved_again)
    assert [k if not torch.is_tensor(k) else "p" for k in saved["state"]] == \
        [k if not torch.is_tensor(k) else "p" for k in ref_saved["state"]]
    for i, (a, b) in enumerate(zip(params, ref_params)):  # the notes change nothing of the update
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda msg: f"parameter {i}: {msg}")


@pytest.mark.parametrize("name", sorted(CASES))
def test_torch_hooks_that_write_opt_state_round_trip(name):
    """torch's own test_optim hooks: a state_dict pre-hook writes state["test"] = 1, a load post-hook
    state["ran_load_state_dict_post_hook"] = True; the loaded optimizer's state_dict carries both into the next."""
    ctor, ref_ctor = CASES[name]
    results = []
    for make in (ctor, ref_ctor):
        m = model()
        opt = make(m.parameters())
        step(m, opt, 0)
        opt.register_state_dict_pre_hook(lambda o: o.state.__setitem__("test", 1))
        second = make(model(seed=1).parameters())
        second.register_load_state_dict_post_hook(lambda o: o.state.__setitem__("ran_load_state_dict_post_hook", True))
        second.load_state_dict(copy.deepcopy(opt.state_dict()))
        third = make(model(seed=2).parameters())
        third.load_state_dict(copy.deepcopy(second.state_dict()))
        results.append(others(third.state))
    assert_same_entries(results[0], results[1])
    assert_same_entries(results[0], [("test", 1), ("ran_load_state_dict_post_hook", True)])


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_parameters_state_that_is_not_a_dict_is_refused_before_loading(name):
    """A parameter's key holding no dict of state names cannot be read (it failed with TypeError: 'bool' object is
    not iterable); refused by name, and the optimizer keeps what it had."""
    m = model()
    opt = CASES[name][0](m.parameters())
    step(m, opt, 0)
    saved = copy.deepcopy(opt.state_dict())
    saved["state"][1] = True
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match="the state of parameter 1 is a bool, not a dict"):
        opt.load_state_dict(saved)
    after = opt.state_dict()
    for key, st in before["state"].items():
        for n, v in st.items():
            torch.testing.assert_close(after["state"][key][n], v, rtol=0, atol=0)


def _notes_resume(rank, n, name):
    from optim_cases import flat_params, make_model, train_steps

    def build(m):
        return CASES[name][0](m.parameters(), topology="ring", timeout=30)

    m = make_model(rank)
    opt = build(m)
    train_steps(rank, m, opt, 2)
    opt.state.update(notes())
    saved = copy.deepcopy(opt.state_dict())
    model_sd = copy.deepcopy(m.state_dict())
    train_steps(rank, m, opt, 2, start=2)
    opt.synchronize()
    straight = flat_params(m)
    opt.shutdown()
    m = make_model(10 + rank)
    opt = build(m)
    m.load_state_dict(model_sd)
    opt.load_state_dict(saved)
    loaded = others(opt.state)
    train_steps(rank, m, opt, 2, start=2)
    opt.synchronize()
    saved_again = others(opt.state_dict()["state"])
    err = (flat_params(m) - straight).abs().max().item()
    opt.shutdown()
    return err, loaded, saved_again


@pytest.mark.parametrize("name", ["DAdamW", "DSGD", "Decentralized(AdamW)"])
def test_state_under_keys_no_parameter_has_resumes_on_two_ranks(name):
    """At 2 ranks the state_dict also carries the gossip schedule; the notes load as they are, and the resumed run
    continues the straight one exactly."""
    from dist_utils import run_ranks
    for err, loaded, saved_again in run_ranks(_notes_resume, 2, name, timeout=300):
        assert err == 0.0
        assert_same_entries(loaded, list(notes().items()))
        assert_same_entries(saved_again, list(notes().items()))


@pytest.mark.parametrize("name", sorted(CASES))
def test_zero_grad_shows_torchs_profiler_range(name):
    """torch.optim.Optimizer.zero_grad runs in record_function("Optimizer.zero_grad#<class>.zero_grad")."""
    ctor, ref_ctor = CASES[name]
    seen = []
    for make in (ctor, ref_ctor):
        m = model()
        opt = make(m.parameters())
        step(m, opt, 0)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            opt.zero_grad()
            step(m, opt, 1)
        names = {e.name for e in prof.events()}
        seen.append({kind: f"Optimizer.{kind}#{type(opt).__name__}.{kind}" in names for kind in ("zero_grad", "step")})
    assert seen[0] == seen[1] == {"zero_grad": True, "step": True}


TENSOR_OPTIONS = {  # name: (constructor, torch's, options)
    "DAdamW": (decent_comm.DAdamW, torch.optim.AdamW, {}),
    "DAdam": (decent_comm.DAdam, torch.optim.Adam, {}),
    "AccumAdamW": (decent_comm.AccumAdamW, torch.optim.AdamW, {}),
    "DSGD": (decent_comm.DSGD, torch.optim.SGD, dict(momentum=0.9)),
}


@pytest.mark.parametrize("name", sorted(TENSOR_OPTIONS))
def test_a_tensor_lr_of_several_elements_is_refused_as_torch_refuses_it(name):
    """torch: ValueError("Tensor lr must be 1-element"); the comparison 0.0 <= lr raised RuntimeError("Boolean
    value of Tensor with more than one value is ambiguous") before."""
    ctor, ref_ctor, kw = TENSOR_OPTIONS[name]
    errors = []
    for make in (ctor, ref_ctor):
        with pytest.raises(Exception) as info:
            make(model().parameters(), lr=torch.tensor([0.1, 0.2]), **kw)
        errors.append((type(info.value), str(info.value)))
    assert errors[0] == errors[1] == (ValueError, "Tensor lr must be 1-element")


@pytest.mark.parametrize("options, named", [
    (dict(betas=(torch.tensor([0.9, 0.8]), torch.tensor(0.999))), "betas[0]"),
    (dict(betas=(torch.tensor(0.9), torch.tensor([0.99, 0.999]))), "betas[1]"),
    (dict(eps=torch.tensor([1e-8, 1e-8])), "eps"),
    (dict(weight_decay=torch.tensor([0.1, 0.1])), "weight_decay"),
])
def test_other_tensor_options_of_several_elements_are_refused_by_name(options, named):
    """torch names lr so, and its betas check would (it compares them first, raising the ambiguous RuntimeError):
    here each option of several elements is named, in the constructor and in a param group alike."""
    with pytest.raises(ValueError, match=rf"^Tensor {re.escape(named)} must be 1-element$"):
        decent_comm.DAdamW(model().parameters(), **options)
    with pytest.raises(ValueError, match=rf"^DAdamW \(param group 1\): Tensor {re.escape(named)} must be"):
        m = model()
        decent_comm.DAdamW([{"params": m[0].parameters()}, {"params": m[2].parameters(), **options}])


@pytest.mark.parametrize("options", [dict(momentum=torch.tensor([0.9, 0.9])), dict(dampening=torch.tensor([0.0, 0.1]))])
def test_dsgds_tensor_options_of_several_elements_are_refused_by_name(options):
    (named,) = options
    with pytest.raises(ValueError, match=f"^Tensor {named} must be 1-element$"):
        decent_comm.DSGD(model().parameters(), lr=0.1, **options)


def test_one_element_betas_are_kept_0_dim_as_torch_keeps_them():
    """torch's Adam squeezes a one-element tensor beta (_to_scalar); its state_dict and the update see a 0-dim one."""
    betas = (torch.tensor([0.9]), torch.tensor([0.99]))
    ours = decent_comm.DAdamW(model().parameters(), betas=betas).defaults["betas"]
    theirs = torch.optim.AdamW(model().parameters(), betas=betas).defaults["betas"]
    assert [b.shape for b in ours] == [b.shape for b in theirs] == [torch.Size([])] * 2
    assert [float(b) for b in ours] == [float(b) for b in theirs]
