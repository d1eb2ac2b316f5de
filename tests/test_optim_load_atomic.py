"""A state_dict that cannot load leaves the optimizer exactly as it was: its "decentralized" entry (required keys,
a step that is a whole number of steps, numbers where numbers go) and every tensor (a meta, sparse or complex one)
are checked before anything is written, and what still raises once the load writes (a consensus schedule refusing its
saved state, a failing copy) puts everything back (decent_comm/optim/load_rollback.py).

Before, a bad step raised a bare KeyError or int()'s ValueError after the moments, counts and lr were the
checkpoint's while the gossip schedule stayed the optimizer's own, and a meta exp_avg raised after opt.state was
emptied and the counts zeroed: the next step() trained on that hybrid (Adam restarted silently). Each case here asserts
the ValueError, that the optimizer's state_dict (tensors bit for bit, param groups, the schedule's step) is what it
was, and that the next step is the one of a twin that never tried the load."""

import copy

import pytest
import torch

import decent_comm
from decent_comm.optim import checkpointing

from test_optim_load import model, params, step

CTORS = {
    "DAdamW": lambda ps, **kw: decent_comm.DAdamW(ps, lr=0.01, weight_decay=0.1, **kw),
    "DSGD": lambda ps, **kw: decent_comm.DSGD(ps, lr=0.01, momentum=0.9, **kw),
    "AccumAdamW": lambda ps, **kw: decent_comm.AccumAdamW(ps, lr=0.01, accum_steps=2, **kw),
    "Decentralized(Adam)": lambda ps, **kw: decent_comm.Decentralized(torch.optim.Adam(ps, lr=0.01), **kw),
}


def frozen(sd):
    return copy.deepcopy(sd)  # tensors cloned: the live state_dict holds views of the flat buffers


def assert_identical(a, b, where="state_dict"):
    """Bit for bit (tensors compared as bytes: -0.0 and NaN payloads too), the same types and keys."""
    assert type(a) is type(b), f"{where}: {type(a).__name__} != {type(b).__name__}"
    if torch.is_tensor(a):
        assert a.dtype == b.dtype and a.shape == b.shape and a.device == b.device, where
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), where
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{where}: keys {list(a)} != {list(b)}"
        for k in a:
            assert_identical(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_identical(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def other_checkpoint(name, **kw):
    """Another run's state_dict (other seed, 2 steps, lr 0.5): loading any of it would show."""
    m = model(seed=7)
    opt = CTORS[name](m.parameters(), **kw)
    for t in range(2):
        step(m, opt, 50 + t)
    opt.param_groups[0]["lr"] = 0.5
    return frozen(opt.state_dict())


def live(name, **kw):
    """An optimizer 5 steps in, and a twin that will never load anything."""
    pair = []
    for _ in range(2):
        m = model()
        opt = CTORS[name](m.parameters(), **kw)
        for t in range(5):
            step(m, opt, t)
        pair.append((m, opt))
    return pair


def first_tensor_name(sd):
    return next(n for n, v in sd["state"][1].items() if n != "step" and torch.is_tensor(v))


def _entry(sd):
    return sd["param_groups"][0]["decentralized"]


ENTRY_CASES = {
    "no step": (lambda sd: _entry(sd).pop("step"), r"lacks \['step'\]"),
    "step 'x'": (lambda sd: _entry(sd).__setitem__("step", "x"), r"has step 'x', not a number of optimizer steps"),
    "step -5": (lambda sd: _entry(sd).__setitem__("step", -5), r"has step -5, not a number of optimizer steps"),
    # beyond int64, the ops' step argument (2**70 loaded, to fail in a later op), or float's range (OverflowError)
    "step 2**70": (lambda sd: _entry(sd).__setitem__("step", 2 ** 70), r"has step 1180591620717411303424, not a"),
    "step 10**400": (lambda sd: _entry(sd).__setitem__("step", 10 ** 400), r"has step 1000000000000.*, not a"),
    "next_factor 10**400": (lambda sd: _entry(sd).__setitem__("next_factor", 10 ** 400), r"has next_factor 1000000"),
    "step 2.5": (lambda sd: _entry(sd).__setitem__("step", 2.5), r"has step 2\.5, not a number of optimizer steps"),
    "no topology": (lambda sd: _entry(sd).pop("topology"), r"lacks \['topology'\]"),
    "entry a list": (lambda sd: sd["param_groups"][0].__setitem__("decentralized", [2, 1]), r"is a list, not the dict"),
    "next_factor 'x'": (lambda sd: _entry(sd).__setitem__("next_factor", "x"), r"has next_factor 'x'"),
    "consensus a str": (lambda sd: _entry(sd).__setitem__("consensus", "x"), r"has consensus 'x', not a dict"),
}


def _set_first(sd, value_of):
    name = first_tensor_name(sd)
    sd["state"][1][name] = value_of(sd["state"][1][name])


TENSOR_CASES = {  # (the fused optimizers', Decentralized's): each refused before anything is loaded
    "meta": (lambda sd: _set_first(sd, lambda v: torch.empty_like(v, device="meta")), r"is (\(or holds\) )?a meta tensor"),
    "complex": (lambda sd: _set_first(sd, lambda v: torch.complex(v, v)), r"is (\(or holds\) a )?complex"),
    "step of 2 elements": (lambda sd: sd["state"][1].__setitem__("step", torch.tensor([2.0, 2.0])), None),
}


def _refused_as_it_was(name, spoil, match, **kw):
    (m, opt), (twin, twin_opt) = live(name, **kw)
    bad = other_checkpoint(name, **kw)
    spoil(bad)
    before = frozen(opt.state_dict())
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(bad)
    assert_identical(frozen(opt.state_dict()), before)
    assert opt._schedule.t == 5 and opt.param_groups[0]["lr"] == 0.01
    step(m, opt, 5)
    step(twin, twin_opt, 5)
    assert_identical(params(m), params(twin), "parameters after the next step")
    assert_identical(frozen(opt.state_dict()), frozen(twin_opt.state_dict()))


@pytest.mark.parametrize("case", sorted(ENTRY_CASES))
@pytest.mark.parametrize("name", sorted(CTORS))
def test_a_bad_schedule_entry_is_refused_before_anything_is_loaded(name, case):
    spoil, match = ENTRY_CASES[case]
    _refused_as_it_was(name, spoil, match)


@pytest.mark.parametrize("case", sorted(TENSOR_CASES))
@pytest.mark.parametrize("name", sorted(CTORS))
def test_a_tensor_that_cannot_be_copied_is_refused_before_anything_is_loaded(name, case):
    spoil, match = TENSOR_CASES[case]
    if case == "step of 2 elements":
        if name.startswith("Decentralized"):
            pytest.skip("the wrapped torch optimizer keeps its step tensors as they are, as torch does")
        match = r"state 'step' of parameter 1 is a tensor of shape \(2,\)"
    _refused_as_it_was(name, spoil, match)


@pytest.mark.parametrize("name", ["DAdamW", "DSGD"])
def test_a_sparse_state_tensor_is_refused_before_anything_is_loaded(name):
    _refused_as_it_was(name, lambda sd: _set_first(sd, lambda v: v.to_sparse()), r"is a torch\.sparse_coo tensor")


@pytest.mark.parametrize("name", sorted(CTORS))
def test_a_consensus_state_refused_while_loading_puts_everything_back(name):
    """AdaptiveConsensus refuses a saved peak that is no lr while the load writes (the schedule's part comes last,
    after the moments, counts and groups): everything is put back, the optimizer steps on as its twin."""
    kw = dict(consensus=decent_comm.AdaptiveConsensus(p=2.0))
    spoil = lambda sd: _entry(sd).__setitem__("consensus", {"lr_at_start": "x"})  # noqa: E731
    _refused_as_it_was(name, spoil, r"'consensus' this optimizer cannot load .*lr_at_start is 'x'", **kw)


@pytest.mark.parametrize("name", sorted(CTORS))
def test_an_error_while_writing_puts_everything_back(name, monkeypatch):
    """Whatever raises once the load has written (here: after torch's load replaced the groups and state and the
    flat buffers and counts took the checkpoint's, a device error, injected) leaves the optimizer as it was."""
    cls = checkpointing.StateDictMixin if not name.startswith("Decentralized") else decent_comm.Decentralized
    real = cls._write_optimizer_state

    def failing(self, *args):
        real(self, *args)
        raise RuntimeError("injected: CUDA error while copying")
    monkeypatch.setattr(cls, "_write_optimizer_state", failing)
    _refused = pytest.raises(RuntimeError, match="injected")
    (m, opt), (twin, twin_opt) = live(name)
    bad = other_checkpoint(name)
    before = frozen(opt.state_dict())
    state_obj, groups_obj = opt.state, opt.param_groups
    with _refused:
        opt.load_state_dict(bad)
    assert opt.state is state_obj and opt.param_groups is groups_obj  # views and schedulers' references stay valid
    assert_identical(frozen(opt.state_dict()), before)
    monkeypatch.undo()
    step(m, opt, 5)
    step(twin, twin_opt, 5)
    assert_identical(params(m), params(twin), "parameters after the next step")
    assert_identical(frozen(opt.state_dict()), frozen(twin_opt.state_dict()))
    opt.load_state_dict(bad)  # and the same state_dict, unspoilt, still loads
    assert opt._schedule.t == 2 and opt.param_groups[0]["lr"] == 0.5


WIRES = {  # at 2 ranks: what the load puts back includes the int8 wire's copies and the round in flight
    "DSGD-awc-int8": lambda m, c: decent_comm.DSGD(m.parameters(), lr=0.05, momentum=0.9, topology="ring",
                                                   comm_dtype=torch.int8, consensus=c, timeout=10),
    "DAdamW-atc-int8": lambda m, c: decent_comm.DAdamW(m.parameters(), lr=0.01, topology="ring", mode="atc", model=m,
                                                       comm_dtype=torch.int8, consensus=c, timeout=10),
    "DAdamW-awc-delayed_mix": lambda m, c: decent_comm.DAdamW(m.parameters(), lr=0.01, topology="ring",
                                                              delayed_mix=True, consensus=c, timeout=10),
}


def _refused_mid_run(rank, n, variant, attempt):
    """5 steps, a state_dict (both runs take it), `attempt`: a load of it with a consensus state that is refused
    while the load writes; then 3 more steps. Returns the state_dicts around the attempt and the final parameters."""
    from optim_cases import make_model, train_steps
    m = make_model(0)
    opt = WIRES[variant](m, decent_comm.AdaptiveConsensus(p=2.0))
    train_steps(rank, m, opt, 5)
    before = frozen(opt.state_dict())
    error = None
    if attempt:
        bad = frozen(before)
        bad["param_groups"][0]["decentralized"]["consensus"] = {"lr_at_start": "x"}
        try:
            opt.load_state_dict(bad)
        except ValueError as e:
            error = str(e)
    after = frozen(opt.state_dict())
    train_steps(rank, m, opt, 3, start=5)
    opt.shutdown()
    return before, after, error, params(m)


@pytest.mark.parametrize("variant", sorted(WIRES))
def test_a_load_refused_while_writing_puts_back_the_wire_copies_and_the_round_in_flight(variant):
    from dist_utils import run_ranks
    tried = run_ranks(_refused_mid_run, 2, variant, True, timeout=120)
    never = run_ranks(_refused_mid_run, 2, variant, False, timeout=120)
    for rank, ((before, after, error, final), (_, _, _, twin_final)) in enumerate(zip(tried, never)):
        assert error is not None and "lr_at_start is 'x'" in error, (rank, error)
        assert_identical(after, before, f"rank {rank}: state_dict")
        assert_identical(final, twin_final, f"rank {rank}: parameters 3 steps later")
