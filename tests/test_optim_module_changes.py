"""A model changed under the optimizer after it was built, by torch's own conversions: under
torch.__future__.set_swap_module_params_on_conversion(True) a model.to(...) keeps each Parameter object and swaps a new
tensor into it. Misuse in general (model.half() with torch's default conversion, reshaped or tied parameters) is in
test_optim_misuse.py."""

import re
import time

import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.utils.parametrize as parametrize

import decent_comm

from dist_utils import run_ranks
from optim_cases import EVERY_UTILITY, batch, make_model, train_steps


def _converted_with_swapped_tensors(rank, n, mode, dtype):
    model = make_model(rank)
    opt = decent_comm.DAdamW(model.parameters(), topology="complete", mode=mode, model=model, timeout=10)
    train_steps(rank, model, opt, 2)  # no synchronize(): the last step's exchange is in flight
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model.to(dtype)
        x, y = batch(rank, 2)
        opt.zero_grad()
        ((model(x.to(dtype)) - y.to(dtype)) ** 2).mean().backward()
        opt.step()
        return "no error"
    except RuntimeError as exc:
        return str(exc)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(False)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("mode", ["awc", "atc"])
def test_a_conversion_swapping_tensors_while_in_flight_is_named_as_a_conversion(mode, dtype):
    """The swapped-in tensors have new version counters, which the check of a write while the exchange is in flight
    compared first: it said the parameters were written in place and to call opt.synchronize() first, which does not
    help; the conversion is named, with what to do, as it is after a synchronize()."""
    for r, m in enumerate(run_ranks(_converted_with_swapped_tensors, 2, mode, dtype, timeout=120)):
        assert m.startswith(f"decent_comm: parameter 0 is now {dtype} on cpu of shape (3, 4), where the "
                            "optimizer's buffer holds torch.float32"), (r, m)
        assert "Build the optimizer after moving the model" in m and "written in place" not in m, (r, m)


# ---------------------------------------------------------------- a Parameter object replaced in the model (model=)


def _overwrite(model):
    torch.__future__.set_overwrite_module_params_on_conversion(True)
    try:
        model.double()
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(False)


REPLACEMENTS = {  # what replaces the first Linear's weight (name '0.weight') with another Parameter object
    "new Parameter": lambda m: setattr(m[0], "weight", torch.nn.Parameter(m[0].weight.detach().clone())),
    "new module": lambda m: m.__setitem__(0, torch.nn.Linear(4, 3)),
    "load_state_dict(assign=True)": lambda m: m.load_state_dict({k: v.clone() for k, v in m.state_dict().items()},
                                                                assign=True),
    "model.double() overwriting": _overwrite,
}
OPTIMIZERS = {
    "DAdamW": lambda m: decent_comm.DAdamW(m.parameters(), lr=0.1, model=m),
    "DSGD": lambda m: decent_comm.DSGD(m.parameters(), lr=0.1, momentum=0.9, model=m),
    "Decentralized(AdamW)": lambda m: decent_comm.Decentralized(torch.optim.AdamW(m.parameters(), lr=0.1), model=m),
}


def _loss(model, t=0):
    x, y = batch(0, t)
    dtype = next(model.parameters()).dtype
    return ((model(x.to(dtype)) - y.to(dtype)) ** 2).mean()


@pytest.mark.parametrize("replace", REPLACEMENTS)
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_parameter_replaced_in_the_model_is_refused_naming_it(name, replace):
    """The optimizer's buckets hold the Parameter objects it was built with: after a replacement it went on updating
    and exchanging the old one, which the model no longer reads, and the new one moved by exactly 0.0, silently. The
    next step raises, naming the parameter and what to do, before it changes anything."""
    model = make_model(0)
    opt = OPTIMIZERS[name](model)
    for t in range(2):
        opt.zero_grad()
        _loss(model, t).backward()
        opt.step()
    held = [p.detach().clone() for p in opt.param_groups[0]["params"]]
    REPLACEMENTS[replace](model)
    opt.zero_grad()
    _loss(model, 2).backward()
    with pytest.raises(RuntimeError, match=rf"^decent_comm: {re.escape(type(opt).__name__)}\.step\(\): the model's "
                                           r"'0\.weight' is a Parameter the optimizer does not hold .* where it held "
                                           r"one of the optimizer's parameters.* Build the optimizer after replacing "
                                           r"parameters"):
        opt.step()
    for p, before in zip(opt.param_groups[0]["params"], held):
        assert torch.equal(p, before)


def test_a_submodule_converted_overwriting_is_named_with_the_flag_on_or_reset():
    """model[2].double() under the overwrite flag replaces only that module's parameters, with no hook to see it; the
    flag reset before the step (or still set) makes no difference."""
    for keep_flag in (False, True):
        model = make_model(0)
        opt = decent_comm.DSGD(model.parameters(), lr=0.1, model=model)
        torch.__future__.set_overwrite_module_params_on_conversion(True)
        try:
            model[2].double()
            torch.__future__.set_overwrite_module_params_on_conversion(keep_flag)
            with pytest.raises(RuntimeError, match=r"the model's '2\.weight' is a Parameter the optimizer does "
                                                   r"not hold \(torch\.float64"):
                opt.step()
        finally:
            torch.__future__.set_overwrite_module_params_on_conversion(False)


@pytest.mark.parametrize("utility", ["global_average", "consensus_distance", "synchronize"])
def test_a_collective_utility_refuses_a_replaced_parameter(utility):
    model = make_model(0)
    opt = decent_comm.DAdamW(model.parameters(), model=model)
    _overwrite(model)
    with pytest.raises(RuntimeError, match=rf"{utility}\(\): the model's '0\.weight' is a Parameter the optimizer"):
        EVERY_UTILITY[utility](opt)


def _wrapped(m):
    class Wrapper(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return self.inner(x)
    m[0] = Wrapper(m[0])


KEPT = {  # changes after which the model still holds the optimizer's Parameter objects (under other names, or none)
    "parametrized": lambda m: parametrize.register_parametrization(m[0], "weight", torch.nn.Identity()),
    "orthogonal (set_ into the same object)": lambda m: torch.nn.utils.parametrizations.orthogonal(m[0]),
    "module wrapped": _wrapped,
    "module set again": lambda m: m.__setitem__(0, m[0]),
    "another model built": lambda m: torch.nn.Linear(4, 3),
    "a parameter left out of the optimizer replaced": lambda m: setattr(m[2], "bias", torch.nn.Parameter(m[2].bias)),
    "bias set to None": lambda m: setattr(m[0], "bias", None),
}


@pytest.mark.parametrize("change", KEPT)
def test_changes_keeping_the_parameter_objects_train_as_torch(change):
    """What moves, wraps or drops a parameter but assigns no other tensor to its name is no error: the same steps with
    torch.optim.AdamW give the same parameters."""
    models = [make_model(0), make_model(0)]
    opts = [decent_comm.DAdamW(models[0][:2].parameters() if "left out" in change else models[0].parameters(),
                               lr=0.1, model=models[0]),
            torch.optim.AdamW(models[1][:2].parameters() if "left out" in change else models[1].parameters(), lr=0.1)]
    for t in range(4):
        if t == 2:
            for m in models:
                KEPT[change](m)
        for m, opt in zip(models, opts):
            opt.zero_grad()
            _loss(m, t).backward()
            opt.step()
    for a, b in zip(opts[0].param_groups[0]["params"], opts[1].param_groups[0]["params"]):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_a_layer_deleted_renaming_the_next_trains_as_torch():
    """del model[0] moves the next layer's parameters (the optimizer's) to '0.weight' and '0.bias': no error."""
    models = [torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)) for _ in "ab"]
    models[1].load_state_dict(models[0].state_dict())
    opts = [decent_comm.DAdamW(models[0].parameters(), lr=0.1, model=models[0]),
            torch.optim.AdamW(models[1].parameters(), lr=0.1)]
    for t in range(4):
        if t == 2:
            for m in models:
                del m[0]
            torch.nn.Linear(2, 2)  # a Parameter assigned somewhere: the next step walks the model
        for m, opt in zip(models, opts):
            opt.zero_grad()
            _loss(m, t).backward()
            opt.step()
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def _counting_walks(monkeypatch):
    """The whole-model walks of module_watch (by their root), and every module visit."""
    from decent_comm.optim import module_watch
    walks, visits = [], []
    real_walk = module_watch._walk

    def counting_walk(module, prefix, *rest):  # (it recurses into each child)
        visits.append(module)
        if not prefix:
            walks.append(module)
        return real_walk(module, prefix, *rest)
    monkeypatch.setattr(module_watch, "_walk", counting_walk)
    return walks, visits


def test_an_unchanged_model_is_not_walked(monkeypatch):
    """The per-step cost: a step walks the model only after a Parameter or module was assigned on one of its modules
    (torch's registration hooks see them), and compares entries only while the overwrite flag is set. A module built
    elsewhere (in a forward, an eval copy) made every later step walk the model twice (2,000 tensors: 2.4 ms)."""
    model = make_model(0)
    opt = decent_comm.DAdamW(model.parameters(), model=model)
    walks, _ = _counting_walks(monkeypatch)
    for t in range(3):
        opt.zero_grad()
        _loss(model, t).backward()
        opt.step()
        torch.nn.Linear(2, 2)  # elsewhere: no walk
    assert walks == []
    model[0].extra = torch.nn.Linear(2, 2)  # on the model: the next step walks once
    opt.step()
    opt.step()
    assert walks == [model, model]  # the check's walk, and the new record's


def test_a_module_shared_at_every_level_is_visited_once(monkeypatch):
    """A module held twice by its parent, 16 levels deep, was walked once per path (65,536 visits, 0.56 s to build
    the optimizer and 1.3 s per step after a change); named_modules visits it once, and so does the watch."""
    leaf = torch.nn.Linear(2, 2)
    top = leaf
    for _ in range(16):
        parent = torch.nn.Module()
        parent.a, parent.b = top, top
        top = parent
    walks, visits = _counting_walks(monkeypatch)
    opt = decent_comm.DSGD(top.parameters(), lr=0.1, model=top)
    top.a.extra = torch.nn.Linear(1, 1)
    opt.step()
    # build, check and record: each of the 18 modules once, and once more as its parent's second child (returning)
    assert len(walks) == 3 and len(visits) <= 3 * 2 * 18, (len(walks), len(visits))


def test_a_compiled_step_does_not_recompile_when_modules_are_made(monkeypatch):
    """torch.compile traced the check into a compiled step(), its state a guard: every step after a module was made
    anywhere recompiled it, up to torch's recompile limit (then the frame ran uncompiled)."""
    from torch._dynamo.testing import CompileCounter
    torch._dynamo.reset()
    model = make_model(0)
    opt = decent_comm.DSGD(model.parameters(), lr=0.1, model=model)
    counter = CompileCounter()
    step = torch.compile(opt.step, backend=counter)
    compiled = []
    for t in range(6):
        opt.zero_grad()
        _loss(model, t).backward()
        step()
        torch.nn.Linear(2, 2)
        compiled.append(counter.frame_count)
    assert compiled[2:] == [compiled[2]] * 4, compiled


def _replaced_on_rank_0(rank, n, where):
    model = make_model(0)
    opt = decent_comm.DAdamW(model.parameters(), topology="complete", model=model, timeout=3)
    train_steps(rank, model, opt, 2)
    if rank == 0:
        model[0].weight = torch.nn.Parameter(model[0].weight.detach().clone())
    start = time.monotonic()
    try:
        if where == "step":  # AWC: rank 1's next step mixes the round rank 0 sent before; the one after waits for it
            train_steps(rank, model, opt, 3, start=2)
        else:
            with opt.global_average():
                pass
        out = ("no error", "")
    except Exception as exc:  # noqa: BLE001
        out = (type(exc).__name__, str(exc))
    seconds = time.monotonic() - start
    # Rank 0 stays until rank 1 has its error, so that rank 1 sees a timeout, not a closed connection (through the
    # store: a barrier on the group would meet the exchange's traffic still in flight).
    store = dist.distributed_c10d._get_default_store()
    store.set(f"done{rank}", "1")
    store.wait([f"done{1 - rank}"])
    return out + (seconds,)


@pytest.mark.parametrize("where", ["step", "global_average"])
def test_a_parameter_replaced_on_one_rank_is_named_there_and_its_peers_time_out_naming_it(where):
    """Only rank 0 replaced a parameter: rank 0 raises naming it, as a model converted on one rank is refused there;
    rank 1, which goes on into the exchange (or the utility's announcement), raises within the timeout naming rank 0
    instead of waiting for it forever."""
    (kind0, msg0, _), (kind1, msg1, seconds) = run_ranks(_replaced_on_rank_0, 2, where, timeout=120)
    assert kind0 == "RuntimeError" and "the model's '0.weight' is a Parameter the optimizer does not hold" in msg0, msg0
    assert kind1 == "ExchangeTimeout" and "rank 0" in msg1 and seconds < 30, (kind1, msg1, seconds)


def _repointed_between_steps(rank, n, mode, how):
    model = make_model(0)
    opt = decent_comm.DSGD(model.parameters(), lr=0.1, topology="complete", mode=mode, model=model, timeout=20)
    for t in range(5):
        if t == 2:  # no synchronize(): the last step's exchange (AWC) or pending mix (ATC) is in flight
            p = model[0].weight
            if how == "set_":
                with torch.no_grad():
                    p.set_(p.detach().clone())
            else:
                p.data = p.detach().clone()
        train_steps(rank, model, opt, 1, start=t)
    opt.synchronize()
    return [p.detach().double().clone() for p in model.parameters()]


def _dsgd_simulation(mode, n=2, steps=5):
    """float64 DSGD (lr 0.1) of n replicas mixed with the complete topology's uniform weights."""
    ms = [make_model(0).double() for _ in range(n)]
    for t in range(steps):
        before, after = [[p.detach().clone() for p in m.parameters()] for m in ms], []
        for r, m in enumerate(ms):
            x, y = batch(r, t)
            m.zero_grad()
            ((m(x.double()) - y.double()) ** 2).mean().backward()
            after.append([p.detach() - 0.1 * p.grad for p in m.parameters()])
        with torch.no_grad():
            for i, m in enumerate(ms):
                for k, p in enumerate(m.parameters()):
                    mix = sum((after if mode == "atc" else before)[j][k] for j in range(n)) / n
                    p.copy_(mix if mode == "atc" else mix + after[i][k] - before[i][k])
    return [[p.detach() for p in m.parameters()] for m in ms]


@pytest.mark.parametrize("how", ["set_", "data="])
@pytest.mark.parametrize("mode", ["awc", "atc"])
def test_new_storage_while_in_flight_is_taken_into_the_bucket(mode, how):
    """set_() (which torch.nn.utils.parametrize calls too) bumps the version counter: it was refused as a write to
    the buffer on the wire, which it does not write, and in ATC left the mix unapplied. p.data = t in ATC lost the
    pending mix of that parameter (the mix went to the buffer it no longer read; 1.2e-3 off). Both train as torch."""
    ref = _dsgd_simulation(mode)
    for r, got in enumerate(run_ranks(_repointed_between_steps, 2, mode, how, timeout=120)):
        for a, b in zip(got, ref[r]):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_weight_norm_registered_after_construction_is_refused_naming_it():
    """weight_norm makes new Parameters (original0, original1) from the weight: the optimizer went on training the old
    one, which nothing reads, and the new ones stayed frozen, silently. orthogonal keeps the same object (KEPT)."""
    model = make_model(0)
    opt = decent_comm.DSGD(model.parameters(), lr=0.1, model=model)
    torch.nn.utils.parametrizations.weight_norm(model[0])
    _loss(model).backward()
    with pytest.raises(RuntimeError, match=r"DSGD\.step\(\): the model's '0\.weight' was made into Parameters .*"
                                           r"'0\.parametrizations\.weight\.original0'.* before building the optimizer"):
        opt.step()


def test_the_old_weight_norm_registered_after_construction_is_refused():
    """torch.nn.utils.weight_norm (deprecated, common in older code) deletes `weight` for new Parameters weight_g and
    weight_v, with no `parametrizations.` in their names: it went unnoticed, weight_v frozen."""
    model = make_model(0)
    opt = decent_comm.DSGD(model.parameters(), lr=0.1, model=model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # (its deprecation)
        torch.nn.utils.weight_norm(model[0])
    _loss(model).backward()
    with pytest.raises(RuntimeError, match=r"the model's '0\.weight' was made into Parameters .*'0\.weight_g'"):
        opt.step()


def test_a_module_removed_beside_one_parametrized_before_construction_is_no_error():
    """weight_norm on the second layer before construction, then del model[0] (Sequential renumbers: '0.weight' is
    gone, '0.parametrizations.weight.original0' is the optimizer's own) and a module assignment: it was refused as
    a parametrization of the dropped weight. The remaining layer trains as torch.optim.SGD trains it."""
    torch.manual_seed(0)
    models = [torch.nn.Sequential(torch.nn.Linear(4, 4, bias=False), torch.nn.Linear(4, 1, bias=False))
              for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    opts = []
    for model, make in zip(models, (lambda ps, m: decent_comm.DSGD(ps, lr=0.1, model=m),
                                    lambda ps, m: torch.optim.SGD(ps, lr=0.1))):
        torch.nn.utils.parametrizations.weight_norm(model[1])
        opts.append(make(model.parameters(), model))
        del model[0]
        model.extra = torch.nn.Identity()
    x = torch.randn(8, 4)
    for model, opt in zip(models, opts):
        for _ in range(2):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        torch.testing.assert_close(a, b)
