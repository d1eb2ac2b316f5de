"""ATC's mix-before-use hooks (optim/mix_hooks.py) under torch.compile with model=: the compiled forward is one graph
(the hooks traced into it broke the graph at every module holding parameters, 10 graphs of one op each, slower than
eager; fullgraph=True raised Dynamo's 'Encountered torch.is_inference_mode_enabled'), the trajectory is eager's, and
a mix deferred by eager forwards is still applied before a compiled forward reads the parameters."""

import warnings

import pytest
import torch

import decent_comm

from dist_utils import run_ranks
from optim_cases import batch, make_model


def _build(model, give_model=True):
    return decent_comm.DAdamW(model.parameters(), lr=0.05, topology="ring", mode="atc", timeout=60,
                              model=model if give_model else None)


def _compiled_vs_eager(rank, n, give_model, backend, fullgraph):
    """The largest difference between the parameters trained eagerly and through torch.compile(model), and the
    graphs a counting backend saw (None for the named backend)."""
    runs, graphs = [], []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    for compiled in (False, True):
        model = make_model(0)
        opt = _build(model, give_model)
        forward = torch.compile(model, backend=backend or counting, fullgraph=fullgraph) if compiled else model
        for t in range(4):
            x, y = batch(rank, t)
            opt.zero_grad()
            ((forward(x) - y) ** 2).mean().backward()
            opt.step()
        opt.synchronize()
        runs.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
        opt.shutdown()
    return (runs[0] - runs[1]).abs().max().item(), None if backend else len(graphs)


def test_a_compiled_atc_forward_is_one_graph_and_trains_as_eager():
    assert run_ranks(_compiled_vs_eager, 2, True, None, True, timeout=300) == [(0.0, 1)] * 2


@pytest.mark.parametrize("give_model", [True, False], ids=["model", "global-hook"])
def test_atc_under_torch_compile_equals_eager(give_model):
    """torch.compile(model) with the mix-before-use hooks: the global hook (no model=) failed the compile inside
    Dynamo; it now runs eagerly (a graph break per module), and both follow the eager trajectory exactly."""
    assert run_ranks(_compiled_vs_eager, 2, give_model, "aot_eager", False, timeout=300) == [(0.0, None)] * 2


def _eager_training_then_compiled_evaluation(rank, n):
    model = make_model(0)
    opt = _build(model)
    for t in range(3):  # eager: the hooks learn the modules, so the mixes are deferred to the next forward
        x, y = batch(rank, t)
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
    deferred = bool(opt._schedule.pending)
    model.eval()
    with torch.no_grad():
        compiled = torch.compile(model, backend="aot_eager")(batch(rank, 9)[0])
        opt.synchronize()
        eager = model(batch(rank, 9)[0])  # at the mixed point
    opt.shutdown()
    return deferred, (compiled - eager).abs().max().item()


def test_a_compiled_evaluation_after_eager_training_reads_the_mixed_parameters():
    assert run_ranks(_eager_training_then_compiled_evaluation, 2, timeout=300) == [(True, 0.0)] * 2


def _eager_then_compiled_training(rank, n):
    """Three eager training steps (the hooks learn the modules and defer the mixes to the next forward), then three
    through torch.compile(model, fullgraph=True): (the largest difference from six eager steps, the graphs compiled,
    whether a mix was deferred after the eager steps, and after the compiled ones)."""
    graphs, runs, deferred = [], [], []

    def counting(gm, example_inputs):  # through AOTAutograd, where the parameters are the graph's inputs
        graphs.append(gm)
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    for compiled in (False, True):
        model = make_model(0)
        opt = _build(model)
        forward = model
        for t in range(6):
            if t == 3:
                deferred.append(bool(opt._schedule.pending))
                forward = torch.compile(model, backend=counting, fullgraph=True) if compiled else model
            x, y = batch(rank, t)
            opt.zero_grad()
            ((forward(x) - y) ** 2).mean().backward()
            opt.step()
        deferred.append(bool(opt._schedule.pending))
        opt.synchronize()
        runs.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
        opt.shutdown()
    return (runs[0] - runs[1]).abs().max().item(), len(graphs), deferred


def test_fullgraph_compiled_training_after_eager_training_is_one_graph_and_trains_as_eager():
    """The first compiled forward stops the deferral for good (step() mixes every bucket, exactly ATC) and applies
    the mix the last eager step deferred while Dynamo traces, so nothing runs outside the graph: the deferred mix was
    a torch.compiler.disable'd call in it (a graph break per deferring module; fullgraph=True raised Dynamo's "Skip
    calling torch.compiler.disable()'d function"). An eager-only run keeps deferring (the overlap)."""
    assert run_ranks(_eager_then_compiled_training, 2, timeout=300) == [(0.0, 1, [True, True, True, False])] * 2


def _compiled_before_warnings(caught, rank) -> list:
    """The files the caught warnings that this rank's model was compiled before its optimizer are attributed to."""
    said = f"decent_comm: rank {rank}: ATC with model=: this model was compiled (torch.compile) before the optimizer"
    return [w.filename for w in caught if w.category is UserWarning and str(w.message).startswith(said)]


def _compiled_before_the_optimizer(rank, n, reset):
    """A compiled evaluation run before the ATC optimizer exists, eager training, then the compiled evaluation again:
    (the files the warnings at construction are attributed to, the largest difference of the compiled output from the
    eager one at the mixed point)."""
    model = make_model(0)
    compiled = torch.compile(model, backend="aot_eager")
    model.eval()
    with torch.no_grad():
        compiled(batch(rank, 99)[0])  # a baseline evaluation before training
    model.train()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = _build(model)
    warned = _compiled_before_warnings(caught, rank)
    if reset:  # the warning's remedy
        torch._dynamo.reset()
    for t in range(3):
        x, y = batch(rank, t)
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        out = compiled(batch(rank, 9)[0])
        opt.synchronize()
        eager = model(batch(rank, 9)[0])
    opt.shutdown()
    return warned, (out - eager).abs().max().item()


def test_a_model_compiled_before_the_optimizer_is_warned_of_and_the_remedy_works():
    """Dynamo does not guard on a module's hooks (skip_nnmodule_hook_guards): a graph compiled before the ATC hooks
    existed never runs them, and the compiled evaluation read the unmixed parameters (0.138 off), silently. Now a
    warning (warnings.warn, naming the rank, at the user's line that builds the optimizer: _build here) names it,
    and its remedy (torch._dynamo.reset() after building the optimizer) reads the mixed ones."""
    warned, off = zip(*run_ranks(_compiled_before_the_optimizer, 2, False, timeout=300))
    assert warned == ([__file__], [__file__]) and min(off) > 1e-3, (warned, off)  # what the warning is about
    assert run_ranks(_compiled_before_the_optimizer, 2, True, timeout=300) == [([__file__], 0.0)] * 2


def _compiled_after_the_optimizer(rank, n):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.compile(torch.nn.Linear(2, 2), backend="aot_eager")(torch.ones(1, 2))  # another graph in the process
        model = make_model(0)
        opt = _build(model)
        compiled = torch.compile(model, backend="aot_eager")
        compiled(batch(rank, 0)[0])
        opt.shutdown()
    return _compiled_before_warnings(caught, rank)


def test_a_model_compiled_after_the_optimizer_is_not_warned_of():
    assert run_ranks(_compiled_after_the_optimizer, 2, timeout=300) == [[], []]


@pytest.mark.skipif("reason" not in __import__("inspect").signature(torch.compiler.disable).parameters,
                    reason="this torch's torch.compiler.disable takes no reason")
def test_fullgraph_refused_under_a_global_atc_hook_says_to_pass_model():
    """Without model= the ATC hook is global and never traced, so fullgraph=True fails for any model of the process,
    an unrelated teacher too; Dynamo's hint was only "Remove the torch.compiler.disable call"."""
    torch._dynamo.reset()
    opt = decent_comm.DSGD(torch.nn.Linear(4, 4).parameters(), lr=0.1, mode="atc")
    teacher = torch.compile(torch.nn.Linear(4, 4), fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match=r"(?s)built without model=.*pass model= to the optimizer"):
        teacher(torch.randn(2, 4))
    opt.shutdown()
