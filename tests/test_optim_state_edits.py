"""Edits of opt.state that torch.optim code makes and test_optim_user_edits does not cover, checked against torch.optim
itself: a state tensor given other storage (t.data = u, t.set_(u)), a step count written in place while the kernels
count on the device (GradScaler), a dropped SGD momentum buffer under dampening, and entries of other libraries
(timm's Lookahead keeps its slow weights in its base optimizer's state)."""

import copy
import io

import pytest
import torch

import decent_comm

from optim_cases import batch, make_model

PAIRS = {
    "adamw": (decent_comm.DAdamW, torch.optim.AdamW, ("exp_avg", "exp_avg_sq")),
    "sgd-momentum": (lambda ps, **kw: decent_comm.DSGD(ps, momentum=0.9, dampening=0.3, **kw),
                     lambda ps, **kw: torch.optim.SGD(ps, momentum=0.9, dampening=0.3, **kw), ("momentum_buffer",)),
}


def _steps(model, opt, start, stop, scaler=None):
    for t in range(start, stop):
        x, y = batch(0, t)
        opt.zero_grad()
        loss = ((model(x.to(model[0].weight.dtype)) - y.to(model[0].weight.dtype)) ** 2).mean()
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()


def _assert_same_run(model, opt, ref, ropt, keys, rtol=1e-6, atol=1e-7):
    for p, rp in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, rp, rtol=rtol, atol=atol)
        for k in keys:
            torch.testing.assert_close(opt.state[p][k].to(rp.dtype), ropt.state[rp][k], rtol=10 * rtol, atol=atol)
        if "step" in ropt.state[rp]:
            assert float(opt.state[p]["step"]) == float(ropt.state[rp]["step"])


STORAGE_EDITS = {
    "data": lambda t, new: setattr(t, "data", new),
    "set_": lambda t, new: t.set_(new),
}


@pytest.mark.parametrize("how", STORAGE_EDITS)
@pytest.mark.parametrize("pair", PAIRS)
def test_a_state_tensor_given_other_storage_is_what_the_next_step_uses(pair, how):
    """opt.state[p]["exp_avg"].data = zeros was ignored: the optimizer kept its moments, and opt.state and
    state_dict() showed the detached tensor, never updated (a resume started from moments training never used)."""
    ctor, ref_ctor, keys = PAIRS[pair]
    model, ref = make_model(0).double(), make_model(0).double()
    opt, ropt = ctor(model.parameters(), lr=0.05), ref_ctor(ref.parameters(), lr=0.05)
    _steps(model, opt, 0, 3)
    _steps(ref, ropt, 0, 3)
    held = []
    for o, m in ((opt, model), (ropt, ref)):
        p = list(m.parameters())[1]
        t = o.state[p][keys[0]]
        STORAGE_EDITS[how](t, torch.full_like(t, 0.25))
        if pair == "adamw":  # (torch.optim.SGD keeps no count)
            STORAGE_EDITS[how](o.state[p]["step"], torch.tensor(1.0))
        held.append((o, p, t))
    saved, rsaved = opt.state_dict()["state"], ropt.state_dict()["state"]  # what a checkpoint now holds
    for k, st in rsaved.items():
        for name, v in st.items():
            torch.testing.assert_close(saved[k][name].double(), v.double(), rtol=1e-5, atol=1e-7)
    _steps(model, opt, 3, 6)
    _steps(ref, ropt, 3, 6)
    _assert_same_run(model, opt, ref, ropt, keys)
    # the tensor the user holds is still opt.state's, and live: what a checkpoint carries, where writes go
    o, p, t = held[0]
    assert o.state[p][keys[0]] is t
    t.fill_(7.0)
    assert float(o.state_dict()["state"][1][keys[0]].min()) == 7.0


def _stack(seed):
    """Three hidden layers of one width: three biases of one shape, whose state tensors can be swapped."""
    torch.manual_seed(seed)
    layers = [torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 4),
              torch.nn.Tanh(), torch.nn.Linear(4, 2)]
    return torch.nn.Sequential(*layers).double()


def _skewed_steps(model, opt, start, stop):
    """Steps in which bias k has no gradient before step k: the three biases' step counts differ."""
    biases = [m.bias for m in model if isinstance(m, torch.nn.Linear)][:3]
    for t in range(start, stop):
        x, y = batch(0, t)
        opt.zero_grad()
        ((model(x.double()) - y.double()) ** 2).mean().backward()
        for k, b in enumerate(biases):
            if t < k:
                b.grad = None
        opt.step()


@pytest.mark.parametrize("how", STORAGE_EDITS)
@pytest.mark.parametrize("names", [("exp_avg",), ("exp_avg", "step")], ids=["moments", "moments-and-counts"])
@pytest.mark.parametrize("rotate", [2, 3], ids=["swap", "rotation"])
def test_state_tensors_given_each_others_storage_take_each_others_values(rotate, names, how):
    """ea.data, eb.data = eb.data, ea.data (or a rotation over three parameters): each new storage was another
    state tensor's view, which the copy-in of an earlier one overwrote before it was read, so two parameters
    stepped with one's moments (and counts)."""
    model, ref = _stack(0), _stack(0)
    opt, ropt = decent_comm.DAdamW(model.parameters(), lr=0.05), torch.optim.AdamW(ref.parameters(), lr=0.05)
    _skewed_steps(model, opt, 0, 4)
    _skewed_steps(ref, ropt, 0, 4)
    for o, m in ((opt, model), (ropt, ref)):
        biases = [l.bias for l in m if isinstance(l, torch.nn.Linear)][:rotate]
        for name in names:
            ts = [o.state[b][name] for b in biases]
            news = [t.data for t in ts[1:] + ts[:1]]
            for t, new in zip(ts, news):
                STORAGE_EDITS[how](t, new)
    counts = [float(opt.state[l.bias]["step"]) for l in model if isinstance(l, torch.nn.Linear)][:3]
    assert counts == [float(ropt.state[l.bias]["step"]) for l in ref if isinstance(l, torch.nn.Linear)][:3]
    _skewed_steps(model, opt, 4, 7)
    _skewed_steps(ref, ropt, 4, 7)
    _assert_same_run(model, opt, ref, ropt, ("exp_avg", "exp_avg_sq"))


def test_a_state_tensor_given_storage_of_another_shape_is_refused_by_name():
    model = make_model(0)
    opt = decent_comm.DAdamW(model.parameters(), lr=0.05)
    _steps(model, opt, 0, 2)
    opt.state[list(model.parameters())[1]]["exp_avg"].set_(torch.zeros(5))
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"'exp_avg' of parameter 1 has shape \(5,\)"):
        _steps(model, opt, 2, 3)
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p, b)


STEP_EDITS = {
    "fill_": lambda st, p: st[p]["step"].fill_(1.0),
    "+=": lambda st, p: st[p].__setitem__("step", st[p]["step"].__iadd__(-2.0)),
    "data": lambda st, p: setattr(st[p]["step"], "data", torch.tensor(1.0)),
    "assign": lambda st, p: st[p].__setitem__("step", torch.tensor(1.0)),
}


@pytest.mark.parametrize("index", [0, 2])
@pytest.mark.parametrize("how", STEP_EDITS)
@pytest.mark.parametrize("ctor, ref_ctor", [(decent_comm.DAdamW, torch.optim.AdamW),
                                            (decent_comm.DAdam, torch.optim.Adam)], ids=["adamw", "adam"])
def test_a_step_count_edit_under_grad_scaler_changes_that_parameter_only(ctor, ref_ctor, how, index):
    """Under GradScaler the kernels keep the counts on the device and run a bucket's parameters of equal history
    as one call, reading its first parameter's count: an in-place edit of one count spread to all (edit of the
    first) or was lost (of another)."""
    runs = []
    for build in (ctor, ref_ctor):
        model = make_model(0)
        opt = build(model.parameters(), lr=0.01, weight_decay=0.05)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        _steps(model, opt, 0, 4, scaler)
        STEP_EDITS[how](opt.state, list(model.parameters())[index])
        _steps(model, opt, 4, 7, scaler)
        runs.append((model, opt))
    (model, opt), (ref, ropt) = runs
    _assert_same_run(model, opt, ref, ropt, ("exp_avg", "exp_avg_sq"), rtol=1e-5, atol=1e-6)
    assert sorted({float(opt.state[p]["step"]) for p in model.parameters()}) == [2.0 + 3 if how == "+=" else 4.0, 7.0]


DROPS = {
    "None": lambda st, p: st[p].__setitem__("momentum_buffer", None),
    "del": lambda st, p: st[p].__delitem__("momentum_buffer"),
}


@pytest.mark.parametrize("scaled", [False, True], ids=["", "grad-scaler"])
@pytest.mark.parametrize("drop", DROPS)
def test_a_dropped_momentum_buffer_restarts_at_the_gradient_as_torch_sgd(drop, scaled):
    """torch.optim.SGD restarts a missing buffer at g; DSGD kept the parameter's count, so its buffer restarted at
    (1 - dampening) g (7e-3 off torch after 3 steps at dampening 0.3). Only the parameter dropped restarts."""
    runs = []
    for build in (decent_comm.DSGD, torch.optim.SGD):
        model = make_model(0)
        opt = build(model.parameters(), lr=0.05, momentum=0.9, dampening=0.3)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0) if scaled else None
        _steps(model, opt, 0, 3, scaler)
        DROPS[drop](opt.state, list(model.parameters())[2])
        _steps(model, opt, 3, 6, scaler)
        runs.append((model, opt))
    _assert_same_run(*runs[0], *runs[1], ("momentum_buffer",), rtol=1e-5, atol=1e-6)


def test_a_checkpoint_without_a_momentum_buffer_restarts_it_as_torch_sgd():
    """What the refusal of another optimizer's state advises (drop those entries) leaves a count without a buffer."""
    src = make_model(0)
    opt = decent_comm.DSGD(src.parameters(), lr=0.05, momentum=0.9, dampening=0.3)
    _steps(src, opt, 0, 3)
    saved = copy.deepcopy(opt.state_dict())
    del saved["state"][0]["momentum_buffer"]
    saved["param_groups"][0].pop("decentralized")
    runs = []
    for build in (decent_comm.DSGD, torch.optim.SGD):
        model = make_model(0)
        model.load_state_dict(src.state_dict())
        o = build(model.parameters(), lr=0.05, momentum=0.9, dampening=0.3)
        _steps(model, o, 0, 1)  # a buffer of its own for parameter 0 too, which the load must drop
        loaded = copy.deepcopy(saved)
        if build is torch.optim.SGD:  # which would keep DSGD's counts, unused
            loaded["state"] = {k: {n: v for n, v in st.items() if n != "step"} for k, st in loaded["state"].items()}
        o.load_state_dict(loaded)
        _steps(model, o, 3, 6)
        runs.append((model, o))
    _assert_same_run(*runs[0], *runs[1], ("momentum_buffer",))


class Lookahead:
    """The pattern of timm.optim.lookahead.Lookahead: its slow weights live in the base optimizer's state."""

    def __init__(self, base, alpha=0.5, k=2, n=0):
        self.base, self.alpha, self.k, self.n = base, alpha, k, n

    def zero_grad(self):
        self.base.zero_grad()

    @torch.no_grad()
    def step(self):
        self.base.step()
        self.n += 1
        if self.n % self.k == 0:
            for g in self.base.param_groups:
                for p in g["params"]:
                    st = self.base.state[p]
                    if "lookahead_slow_buff" not in st:
                        st["lookahead_slow_buff"] = p.detach().clone()
                    slow = st["lookahead_slow_buff"]
                    slow.add_(p - slow, alpha=self.alpha)
                    p.copy_(slow)


@pytest.mark.parametrize("serialize", [False, True], ids=["", "torch.save"])
def test_another_librarys_state_entries_are_kept_saved_and_loaded_as_torch(serialize):
    """DAdamW refused its own checkpoint with Lookahead's entries as "another optimizer's", and a non-tensor entry
    made every step after a moment reset raise."""
    runs = []
    for build in (decent_comm.DAdamW, torch.optim.AdamW):
        model = make_model(0)
        la = Lookahead(build(model.parameters(), lr=0.01))
        _steps(model, la, 0, 4)
        sd = copy.deepcopy(la.base.state_dict())
        assert all("lookahead_slow_buff" in st for st in sd["state"].values())
        la.base.load_state_dict(copy.deepcopy(sd))  # its own, back
        if serialize:
            buf = io.BytesIO()
            torch.save(sd, buf)
            buf.seek(0)
            sd = torch.load(buf, weights_only=True)
        resumed = make_model(1)
        resumed.load_state_dict(model.state_dict())
        la2 = Lookahead(build(resumed.parameters(), lr=0.01), n=4)
        la2.base.load_state_dict(sd)
        _steps(resumed, la2, 4, 9)
        # a note of another kind and a moment reset by replacement, then a step and a checkpoint
        p0 = next(iter(resumed.parameters()))
        la2.base.state[p0]["note"] = "frozen-at-step-9"
        la2.base.state[p0]["exp_avg"] = torch.zeros_like(p0)
        _steps(resumed, la2, 9, 10)
        assert la2.base.state_dict()["state"][0]["note"] == "frozen-at-step-9"
        runs.append((resumed, la2.base))
    (model, opt), (ref, ropt) = runs
    _assert_same_run(model, opt, ref, ropt, ("exp_avg", "exp_avg_sq", "lookahead_slow_buff"), rtol=1e-5,
                     atol=1e-6)


def test_a_hook_counting_under_a_key_of_its_own_reloads_nothing(monkeypatch):
    """A step hook writing opt.state["n"] (a non-parameter key, as torch's own tests do) replaced an entry of
    opt.state at every step, so every step reloaded the whole state (22x slower with 2,000 parameters). Only the
    parameters' entries are looked at now; a real edit of one is still adopted, as torch.optim.AdamW reads it."""
    import decent_comm.optim.base as base
    reloads = []
    adopt = base.adopt_state_edits
    monkeypatch.setattr(base, "adopt_state_edits", lambda *a, **k: (reloads.append(1), adopt(*a, **k))[1])
    model, ref = make_model(0), make_model(0)
    opt, ropt = decent_comm.DAdamW(model.parameters(), lr=1e-2), torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for o in (opt, ropt):
        o.register_step_post_hook(lambda o, a, k: o.state.__setitem__("n", o.state.get("n", 0) + 1))
    _steps(model, opt, 0, 3)
    _steps(ref, ropt, 0, 3)
    assert reloads == [] and opt.state["n"] == 3
    for o in (opt, ropt):  # a parameter's entry replaced: adopted at the next step
        p = next(iter(o.param_groups[0]["params"]))
        o.state[p] = {k: (v.clone() * 0.5 if k != "step" else v.clone()) for k, v in o.state[p].items()}
    _steps(model, opt, 3, 5)
    _steps(ref, ropt, 3, 5)
    assert len(reloads) == 1 and opt.state["n"] == 5
    _assert_same_run(model, opt, ref, ropt, ("exp_avg", "exp_avg_sq"))
