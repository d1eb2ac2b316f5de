"""A model left in DDP is refused while the optimizer gossips (DDP would all-reduce the gradients the gossip mixes:
both would run), unless DDP is told to ignore our parameters (a hybrid: DDP all-reduces one part, the optimizer
gossips the rest); after shutdown() a DDP wrap is allowed."""

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import decent_comm

from dist_utils import run_ranks
from optim_cases import batch, make_model, flat_params

DDP_WRAPS = ("the DDP wrap", "none", "the inner model, wrapped before", "the inner model, wrapped after",
             "none, wrapped after the first step", "none, wrapped after the first step (atc)")


def _ddp_wrapped(rank, n):
    out = []
    for given in DDP_WRAPS:
        model = make_model(0)
        ddp = torch.nn.parallel.DistributedDataParallel(model) if "after" not in given else None
        try:
            opt = decent_comm.DSGD(model.parameters(), lr=0.1, timeout=20, model={
                "the DDP wrap": ddp}.get(given, None if given.startswith("none") else model),
                mode="atc" if "atc" in given else "awc")
            if "first step" in given:
                model(torch.zeros(1, 4)).sum().backward()
                opt.step()
            ddp = ddp or torch.nn.parallel.DistributedDataParallel(model)
            for _ in range(2):
                ddp(torch.zeros(1, 4)).sum().backward()
                opt.step()
            out.append("no error")
        except RuntimeError as exc:
            out.append(str(exc))
    return out


def test_model_left_in_ddp_is_refused():
    """Also when model= is the module DDP wraps: it trained with both DDP's all-reduce and the gossip (the check was
    the global hook's, which model= no longer installs). And a wrap after the first step without model=, once the
    global hook was gone: DDP's broadcast tripped the write-during-send check, whose advice (synchronize()) led to
    training with both."""
    for msgs in run_ranks(_ddp_wrapped, 2, timeout=120):
        assert len(msgs) == len(DDP_WRAPS), msgs
        for given, msg in zip(DDP_WRAPS, msgs):
            assert "wrapped in DistributedDataParallel" in msg, (given, msg)


def _ddp_after_shutdown(rank, n, give_model):
    """Decentralized training, shutdown(), then DDP fine-tuning with torch SGD: (the largest difference of DDP's
    parameters from SGD on the ranks' mean gradient from rank 0's parameters, computed here in float64)."""
    model = make_model(0)
    opt = decent_comm.DAdamW(model.parameters(), lr=0.05, timeout=60, model=model if give_model else None)
    for t in range(3):
        x, y = batch(rank, t)
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
    opt.shutdown()
    start = [p.detach().clone() for p in model.parameters()]
    torch.distributed.broadcast_object_list(start, src=0)  # DDP starts every replica from rank 0's parameters
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    sgd = torch.optim.SGD(ddp.parameters(), lr=0.1)
    reference = make_model(0).double()
    with torch.no_grad():
        for q, p0 in zip(reference.parameters(), start):
            q.copy_(p0)
    for t in range(3, 5):
        x, y = batch(rank, t)
        sgd.zero_grad()
        ((ddp(x) - y) ** 2).mean().backward()
        sgd.step()
        reference.zero_grad()
        for r in range(n):  # DDP's gradient: the mean of the ranks' own
            xr, yr = batch(r, t)
            (((reference(xr.double()) - yr.double()) ** 2).mean() / n).backward()
        with torch.no_grad():
            for q in reference.parameters():
                q -= 0.1 * q.grad
    return max((p.double() - q).abs().max().item() for p, q in zip(model.parameters(), reference.parameters()))


@pytest.mark.parametrize("give_model", [False, True], ids=["global-hook", "model"])
def test_ddp_fine_tuning_after_shutdown_is_allowed(give_model):
    """After shutdown() the optimizer gossips no more: a run that ends with DDP fine-tuning wraps the model in DDP
    (it was refused as 'wrapped in DistributedDataParallel' while the optimizer object lived)."""
    for err in run_ranks(_ddp_after_shutdown, 2, give_model, timeout=120):
        assert err < 1e-6, err


def _hybrid(rank, n, wrap, ignored):
    """decent_comm's DSGD gossips the first layer (model[0]), DDP all-reduces the rest, DDP ignoring `ignored`;
    returns the refusal, or the largest deviation of the parameters after 3 steps from a float64 simulation of
    both ranks: x_r <- mean(x) - lr g_r for model[0] (DSGD over "complete": at 2 ranks W averages), the head shared
    and stepped by SGD on the ranks' mean gradient (DDP's all-reduce)."""
    model = make_model(rank)  # distinct first layers (broadcast_init=False); DDP broadcasts rank 0's head
    DDP._set_params_and_buffers_to_ignore_for_model(model, ignored)
    try:
        ddp = DDP(model) if wrap == "before" else None  # seen at the first forward, by model='s hook
        opt = decent_comm.DSGD(model[0].parameters(), lr=0.1, topology="complete", broadcast_init=False, timeout=30,
                               model=model if wrap == "before" else None)
        ddp = ddp or DDP(model)  # seen in DDP's constructor, then at the forward by the global hook
        head = torch.optim.SGD([p for p in model.parameters() if all(p is not q for q in model[0].parameters())],
                               lr=0.1)
        start = [torch.empty_like(flat_params(model)) for _ in range(n)]
        torch.distributed.all_gather(start, flat_params(model))
        sims = [make_model(0).double() for _ in range(n)]
        for sim, flat in zip(sims, start):
            torch.nn.utils.vector_to_parameters(flat.double(), sim.parameters())
        for t in range(3):
            x, y = batch(rank, t)
            opt.zero_grad()
            head.zero_grad()
            ((ddp(x) - y) ** 2).mean().backward()
            opt.step()
            head.step()
            for r, sim in enumerate(sims):
                sim.zero_grad()
                xr, yr = batch(r, t)
                ((sim(xr.double()) - yr.double()) ** 2).mean().backward()
            with torch.no_grad():
                mean_first = [sum(s[0].get_parameter(k) for s in sims) / n for k in ("weight", "bias")]
                mean_head = [sum(s[2].get_parameter(k).grad for s in sims) / n for k in ("weight", "bias")]
                for sim in sims:
                    for k, mean in zip(("weight", "bias"), mean_first):
                        sim[0].get_parameter(k).copy_(mean - 0.1 * sim[0].get_parameter(k).grad)
                    for k, g in zip(("weight", "bias"), mean_head):
                        sim[2].get_parameter(k).sub_(0.1 * g)
        opt.synchronize()
        err = (flat_params(model).double() - flat_params(sims[rank])).abs().max().item()
        opt.shutdown()
        return err
    except RuntimeError as exc:
        return str(exc)


@pytest.mark.parametrize("wrap", ["before", "after"])
def test_ddp_ignoring_our_parameters_is_allowed(wrap):
    """It was refused as 'wrapped in DistributedDataParallel' though DDP neither broadcast nor all-reduced them (the
    guard looked at every parameter of the wrapped module, not at DDP's ignore list)."""
    for err in run_ranks(_hybrid, 2, wrap, ["0.weight", "0.bias"], timeout=120):
        assert isinstance(err, float) and err < 1e-6, err


def test_ddp_ignoring_only_some_of_our_parameters_is_refused():
    """DDP would all-reduce model[0]'s bias, which the optimizer gossips."""
    for msg in run_ranks(_hybrid, 2, "after", ["0.weight"], timeout=120):
        assert "wrapped in DistributedDataParallel" in str(msg), msg


@pytest.mark.parametrize("give_model", [True, False])
def test_an_optimizer_collected_while_torch_runs_registration_hooks(give_model):
    """Each optimizer's DDP guard registered a global submodule-registration hook of its own and removed it when the
    optimizer was collected. torch's add_module iterates that dict itself, so a cyclic GC started inside a
    registration hook (any allocation in one, as module_watch's) that collected a dropped optimizer raised
    "OrderedDict mutated during iteration" from the user's nn.Sequential(...) (seen in CI). Here a hook collects
    garbage at each registration while an optimizer kept alive only by a reference cycle waits to be collected."""
    import gc
    from torch.nn.modules.module import register_module_module_registration_hook
    collect = register_module_module_registration_hook(lambda parent, name, module: gc.collect())
    try:
        for _ in range(3):
            model = torch.nn.Linear(2, 2)
            opt = decent_comm.DSGD(model.parameters(), lr=0.1, model=model if give_model else None)
            opt.own_cycle = opt  # only the cyclic GC frees it
            del opt
            torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    finally:
        collect.remove()
    # the guard still refuses a DDP wrap made while an optimizer lives (its hook is shared now)
    model = torch.nn.Linear(2, 2)
    opt = decent_comm.DSGD(model.parameters(), lr=0.1, model=model)
    from decent_comm.optim.ddp_guard import _on_module_registration
    with pytest.raises(RuntimeError, match="wrapped in DistributedDataParallel"):
        _on_module_registration(DDP.__new__(DDP), "module", model)  # DDP.__init__'s `self.module = module`
    opt.shutdown()
