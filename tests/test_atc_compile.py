"""ATC's mix-before-use hooks (optim/mix_hooks.py) under torch.compile with model=: the compiled forward is one graph
(the hooks traced into it broke the graph at every module holding parameters, 10 graphs of one op each, slower than
eager; fullgraph=True raised Dynamo's 'Encountered torch.is_inference_mode_enabled'), the trajectory is eager's, and
a mix deferred by eager forwards is still applied before a compiled forward reads the parameters."""

import torch

import decent_comm

from dist_utils import run_ranks
from optim_cases import batch, make_model


def _build(model):
    return decent_comm.DAdamW(model.parameters(), lr=0.05, topology="ring", mode="atc", timeout=60, model=model)


def _fullgraph_vs_eager(rank, n):
    runs, graphs = [], []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    for compiled in (False, True):
        model = make_model(0)
        opt = _build(model)
        forward = torch.compile(model, backend=backend, fullgraph=True) if compiled else model
        for t in range(4):
            x, y = batch(rank, t)
            opt.zero_grad()
            ((forward(x) - y) ** 2).mean().backward()
            opt.step()
        opt.synchronize()
        runs.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
        opt.shutdown()
    return (runs[0] - runs[1]).abs().max().item(), len(graphs)


def test_a_compiled_atc_forward_is_one_graph_and_trains_as_eager():
    assert run_ranks(_fullgraph_vs_eager, 2, timeout=300) == [(0.0, 1)] * 2


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
