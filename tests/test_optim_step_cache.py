"""A step skips its per-parameter checks when cheap keys prove nothing changed since the last one
(decent_comm.optim.step_cache). Every change the full checks handled must still be seen after such steps: each test
runs a few steps on the fast path (asserted), makes one change between steps, and trains on beside torch's own
optimizer making the same change (world size 1: the optimizers equal their torch counterparts to float rounding;
float64 parameters, so an ignored change is off by far more than the tolerance)."""

import copy

import pytest
import torch

import decent_comm
from decent_comm.optim import buckets as buckets_module
from decent_comm.optim import step_counts as step_counts_module

OPTIMIZERS = {  # ours, torch's
    "DAdamW": (lambda ps, **o: decent_comm.DAdamW(ps, lr=0.05, **o), lambda ps: torch.optim.AdamW(ps, lr=0.05)),
    "DSGD": (lambda ps, **o: decent_comm.DSGD(ps, lr=0.05, momentum=0.9, **o),
             lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9)),
    "Decentralized(AdamW)": (lambda ps, **o: decent_comm.Decentralized(torch.optim.AdamW(ps, lr=0.05), **o),
                             lambda ps: torch.optim.AdamW(ps, lr=0.05)),
}
LAYOUTS = {"one_bucket": {}, "bucket_each": dict(bucket_cap_mb=1e-6)}
SHAPES = [(4, 4), (4, 4), (3,), (2, 5)]
FAST_STEPS = 3


def _params():
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(*s, dtype=torch.float64)) for s in SHAPES]


def _backward(ps, t, set_to_none):
    """What backward does with step t's gradients: into the .grad there is, or a new tensor."""
    g = torch.Generator().manual_seed(100 + t)
    for p in ps:
        d = torch.randn(p.shape, generator=g, dtype=p.dtype)
        if p.grad is None or set_to_none:
            p.grad = d
        else:
            p.grad.add_(d)


def _fast(opt):
    """Whether the next step would skip its checks (every bucket's parameters and .grad as the last step left)."""
    return all(b.cache.params_unchanged() and b.cache.grads_unchanged() for b in opt._buckets)


def _run(name, layout, edit, ours, steps=FAST_STEPS + 3, set_to_none=False):
    ps = _params()
    opt = OPTIMIZERS[name][0](ps, **LAYOUTS[layout]) if ours else OPTIMIZERS[name][1](ps)
    for t in range(steps):
        opt.zero_grad(set_to_none=set_to_none)
        _backward(ps, t, set_to_none)
        if t == FAST_STEPS:
            if ours and not set_to_none:
                assert _fast(opt)  # the change below is made after steps that took the fast path
            edit(ps, opt)
        opt.step()
    return [p.detach().clone() for p in ps], opt


def _replace_grad(ps, opt):
    ps[0].grad = ps[0].grad * 2


def _grad_data(ps, opt):      # the cached view itself given other memory
    ps[0].grad.data = ps[0].grad.data * 3


def _grad_set(ps, opt):
    ps[0].grad.set_(ps[0].grad.clone() * 3)


def _grad_transposed_in_place(ps, opt):  # the cached view re-laid out over the same memory
    ps[0].grad.t_()


def _grads_swapped(ps, opt):
    ps[0].grad, ps[1].grad = ps[1].grad, ps[0].grad


def _grad_taken_by_another(ps, opt):
    ps[1].grad = ps[0].grad
    ps[0].grad = ps[0].grad * 0.5


def _frozen(ps, opt):
    ps[2].grad = None


def _param_data(ps, opt):     # new storage, same dtype and shape: adopted, as torch trains it
    ps[0].data = ps[0].data * 0.5


def _params_swapped(ps, opt):
    ps[0].data, ps[1].data = ps[1].data.clone(), ps[0].data.clone()


def _param_set(ps, opt):
    with torch.no_grad():
        ps[3].set_(ps[3].detach().clone() + 1)


def _count_written(ps, opt):
    opt.state[ps[0]]["step"].fill_(1)


def _count_written_through_data(ps, opt):  # .data has a version counter of its own: the count's is not bumped
    opt.state[ps[0]]["step"].data.fill_(1)


def _counts_written_through_numpy(ps, opt):  # every count, equal again, to another value: no version bumped either
    for p in ps:
        opt.state[p]["step"].numpy()[...] = 1


def _groups_lr(ps, opt):
    opt.param_groups[0]["lr"] = 0.01


EDITS = {"replace_grad": _replace_grad, "grad.data": _grad_data, "grad.set_": _grad_set,
         "grad.t_": _grad_transposed_in_place, "grads_swapped": _grads_swapped,
         "grad_taken_by_another": _grad_taken_by_another, "frozen": _frozen, "param.data": _param_data,
         "params_swapped": _params_swapped, "param.set_": _param_set, "count_written": _count_written,
         "count_written_through_data": _count_written_through_data,
         "counts_written_through_numpy": _counts_written_through_numpy, "lr": _groups_lr}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("edit", sorted(EDITS))
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_change_after_fast_steps_trains_as_torch(name, edit, layout):
    if edit.startswith("count") and name == "DSGD":
        pytest.skip("torch.optim.SGD keeps no step count")
    ours, opt = _run(name, layout, EDITS[edit], ours=True)
    theirs, _ = _run(name, layout, EDITS[edit], ours=False)
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-8)
    assert _fast(opt)  # the keys were taken again: the next step is fast once more


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_fresh_gradients_every_step_train_as_torch(name):
    """zero_grad(set_to_none=True) each step: autograd's new .grad are copied in (one _foreach_copy_ per bucket)."""
    ours, _ = _run(name, "bucket_each", lambda ps, opt: None, ours=True, set_to_none=True)
    theirs, _ = _run(name, "bucket_each", lambda ps, opt: None, ours=False, set_to_none=True)
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("name", ["DAdamW", "Decentralized(AdamW)"])
def test_a_parameter_frozen_for_a_while_keeps_its_own_count(name):
    """Frozen after fast steps, then unfrozen: its step count lags the others' (Adam's bias correction), so the
    counts are no longer all equal and the one-segment shortcut must not come back while they differ."""
    runs = []
    for ours in (True, False):
        ps = _params()
        opt = OPTIMIZERS[name][0](ps) if ours else OPTIMIZERS[name][1](ps)
        for t in range(10):
            opt.zero_grad(set_to_none=False)
            _backward(ps, t, False)
            if 3 <= t < 5:
                ps[1].grad = None
            opt.step()
        runs.append((ps, opt))
    (ps, opt), (ref, ropt) = runs
    for p, q in zip(ps, ref):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-8)
        assert float(opt.state[p]["step"]) == float(ropt.state[q]["step"])


@pytest.mark.parametrize("name", ["DAdamW", "DSGD"])
def test_load_state_dict_after_fast_steps_trains_as_torch(name):
    runs = []
    for ours in (True, False):
        ps = _params()
        opt = OPTIMIZERS[name][0](ps) if ours else OPTIMIZERS[name][1](ps)
        saved = None
        for t in range(8):
            opt.zero_grad(set_to_none=False)
            _backward(ps, t, False)
            if t == 5:
                opt.load_state_dict(saved)  # the state of two steps in: counts 2, other moments
            opt.step()
            if t == 1:
                saved = copy.deepcopy(opt.state_dict())
        runs.append(ps)
    for p, q in zip(*runs):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-8)


def test_momentum_switched_on_after_fast_steps_trains_as_torch():
    """DSGD's counts restart when momentum starts (its buffers start at g, as torch's): a write of the counts the
    one-segment shortcut must see."""
    runs = []
    for ours in (True, False):
        ps = _params()
        # (dampening: the buffer starts at g, not (1 - dampening) g, only if the count restarted)
        opt = decent_comm.DSGD(ps, lr=0.05, dampening=0.5) if ours else torch.optim.SGD(ps, lr=0.05, dampening=0.5)
        for t in range(8):
            opt.zero_grad(set_to_none=False)
            _backward(ps, t, False)
            if t == 4:
                opt.param_groups[0]["momentum"] = 0.9
            opt.step()
        runs.append(ps)
    for p, q in zip(*runs):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-8)


def _after_fast_steps(name="DAdamW"):
    ps = _params()
    opt = OPTIMIZERS[name][0](ps)
    for t in range(FAST_STEPS):
        opt.zero_grad(set_to_none=False)
        _backward(ps, t, False)
        opt.step()
    assert _fast(opt)
    return ps, opt


@pytest.mark.parametrize("change, error", [
    (lambda ps: setattr(ps[0], "data", ps[0].data.float()), r"parameter 0 is now torch.float32 .* model "
                                                           "was converted"),
    (lambda ps: setattr(ps[0], "data", ps[0].data.view(torch.complex64)),
     r"parameter 0 is now torch.complex64"),
    (lambda ps: setattr(ps[3], "data", ps[3].data.view(5, 2)), r"parameter 3 is now torch.float64 on cpu "
                                                               r"of shape \(5, 2\)"),
    (lambda ps: ps[0].t_(), r"parameter 0 .* a view of its own memory in another layout"),
    (lambda ps: setattr(ps[0], "data", ps[0].data.t()), r"parameter 0 .* its own memory in another"),
    (lambda ps: setattr(ps[1], "data", ps[0].data), r"parameter 1 .* now shares memory with another"),
    (lambda ps: ps[0].grad.resize_(2, 8), r"parameter 0: its gradient has shape \(2, 8\)"),
    (lambda ps: setattr(ps[2], "grad", ps[2].grad.to_sparse()), r"does not support sparse gradients \(parameter 2"),
], ids=["converted", "reinterpreted", "reshaped", "param.t_", "param.data=t()", "tied", "grad.resize_", "sparse"])
def test_a_change_the_checks_refuse_is_refused_after_fast_steps(change, error):
    ps, opt = _after_fast_steps()
    with torch.no_grad():
        change(ps)
    with pytest.raises(RuntimeError, match=error):
        opt.step()



@pytest.mark.parametrize("change, error", [
    (lambda a, b, c: setattr(c, "data", c.data.float()), r"parameter 2 is now torch.float32"),
    (lambda a, b, c: c.grad.resize_(2, 3), r"parameter 2: its gradient has shape \(2, 3\)"),
    (lambda a, b, c: setattr(c, "data", a.data), r"parameter 2 \(shape \(6,\)\) now shares memory"),
], ids=["converted", "grad.resize_", "tied"])
def test_a_refusal_names_the_users_parameter_where_dtypes_split_a_group(change, error):
    """float64, float32, float64 in one group: the third parameter is the float64 bucket's second, and these
    refusals said "parameter 1 of bucket 0" (the bucket's slot) where the user's list holds it at 2."""
    a, b, c = (torch.nn.Parameter(torch.ones(n, dtype=d)) for n, d in ((6, torch.float64), (5, torch.float32),
                                                                        (6, torch.float64)))
    opt = decent_comm.DSGD([a, b, c], lr=0.1)
    for p in (a, b, c):
        p.grad = torch.ones_like(p)
    opt.step()
    with torch.no_grad():
        change(a, b, c)
    with pytest.raises(RuntimeError, match=error):
        opt.step()

def test_a_groups_parameters_edited_after_fast_steps_are_refused_as_before():
    ps, opt = _after_fast_steps()
    opt.param_groups[0]["params"].reverse()
    with pytest.raises(RuntimeError, match="param group 0 holds its parameters in another order"):
        opt.step()
    opt.param_groups[0]["params"].reverse()
    opt.param_groups[0]["params"].append(torch.nn.Parameter(torch.ones(3)))
    with pytest.raises(RuntimeError, match=r"param group 0 holds other parameters than at construction \(4 then, 5 "):
        opt.step()


def test_an_unchanged_step_skips_the_per_parameter_checks(monkeypatch):
    """What the cache is for: once nothing changes between steps, a step neither re-checks each parameter's storage
    (converted) nor reads the step counts (Bucket.steps) nor rebuilds the bucket's runs (segments)."""
    ps, opt = _after_fast_steps("DAdamW")
    calls = []
    for module, fn in ((buckets_module, "converted"), (step_counts_module, "segments")):
        real = getattr(module, fn)
        monkeypatch.setattr(module, fn, lambda *a, _real=real, _fn=fn: calls.append(_fn) or _real(*a))
    monkeypatch.setattr(buckets_module.Bucket, "steps", property(lambda b: calls.append("steps") or
                                                                 [int(v) for v in b.step_count.tolist()]))
    for t in range(FAST_STEPS, FAST_STEPS + 3):
        opt.zero_grad(set_to_none=False)
        _backward(ps, t, False)
        opt.step()
    assert calls == []
    ps[2].grad = None  # a change: the full checks run once, then the shortcut again
    opt.step()
    assert "segments" in calls
