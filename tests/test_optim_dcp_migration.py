"""Moving a run between torch.optim and decent_comm through torch.distributed.checkpoint (DCP).

A torch optimizer's DCP checkpoint lacks the keys a decentralized optimizer's state_dict adds (the schedule entry
"decentralized", DSGD's count), so it loads with DefaultLoadPlanner(allow_partial_load=True): the keys the
checkpoint lacks keep the new optimizer's template values. The run must then continue as the torch optimizer's
would, as it does through the plain state_dict path (test_optim_load).
"""

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import decent_comm

from optim_cases import state_test_model as model, step_on_seeded_grads as step

HP = dict(lr=0.01, weight_decay=0.1)
PAIRS = {  # name: (ours, torch's)
    "SGD momentum": (lambda ps: decent_comm.DSGD(ps, momentum=0.9, **HP),
                     lambda ps: torch.optim.SGD(ps, momentum=0.9, **HP)),
    "SGD dampening": (lambda ps: decent_comm.DSGD(ps, momentum=0.9, dampening=0.3, **HP),
                      lambda ps: torch.optim.SGD(ps, momentum=0.9, dampening=0.3, **HP)),
    "SGD nesterov": (lambda ps: decent_comm.DSGD(ps, momentum=0.9, nesterov=True, **HP),
                     lambda ps: torch.optim.SGD(ps, momentum=0.9, nesterov=True, **HP)),
    "AdamW": (lambda ps: decent_comm.DAdamW(ps, **HP), lambda ps: torch.optim.AdamW(ps, **HP)),
    "Adam": (lambda ps: decent_comm.DAdam(ps, **HP), lambda ps: torch.optim.Adam(ps, **HP)),
}


def save(m, opt, where):
    msd, osd = get_state_dict(m, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=where, no_dist=True)


def load_partial(m, opt, where):
    """The recipe for another optimizer's checkpoint: the new optimizer's template, filled where the checkpoint has
    the key."""
    msd, osd = get_state_dict(m, opt)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=where, no_dist=True,
             planner=DefaultLoadPlanner(allow_partial_load=True))
    set_state_dict(m, opt, model_state_dict=msd, optim_state_dict=osd)


def continue_both(m, opt, ref, ref_opt, steps):
    for t in steps:
        step(m, opt, t)
        step(ref, ref_opt, t)
    for i, (a, b) in enumerate(zip(m.parameters(), ref.parameters())):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-6,
                                   msg=lambda msg: f"parameter {i}: {msg}")


@pytest.mark.parametrize("direction", ["torch to ours", "ours to torch"])
@pytest.mark.parametrize("name", sorted(PAIRS))
def test_a_dcp_checkpoint_continues_in_the_other_library(name, direction, tmp_path):
    """torch.optim.SGD saves momentum_buffer and no count: DSGD's template count 0 stayed beside the loaded buffer and
    the buffer restarted at the next gradient (the momentum dropped: 2.64 off torch's run after 5 steps)."""
    ours, theirs = PAIRS[name]
    saver, loader = (theirs, ours) if direction == "torch to ours" else (ours, theirs)
    ref = model()
    ref_opt = saver(ref.parameters())
    for t in range(3):
        step(ref, ref_opt, t)
    save(ref, ref_opt, str(tmp_path))
    m = model(seed=1)  # other values everywhere: the checkpoint must bring back the parameters and the state
    opt = loader(m.parameters())
    load_partial(m, opt, str(tmp_path))
    if "SGD" in name and direction == "torch to ours":
        assert [float(opt.state[p]["step"]) for p in m.parameters()] == [1.0] * 4  # the buffers have started
    continue_both(m, opt, ref, ref_opt, range(3, 8))


def test_a_fresh_dsgd_checkpoint_keeps_its_buffers_unstarted(tmp_path):
    """The other side of the rule above: a DSGD saved before any step (DCP's template: zero buffers, counts 0)
    loads with counts 0, so with dampening its first step starts the buffer at the gradient, as torch's first step."""
    ours, theirs = PAIRS["SGD dampening"]
    m = model()
    opt = ours(m.parameters())
    save(m, opt, str(tmp_path))
    m2 = model(seed=1)
    opt2 = ours(m2.parameters())
    load_partial(m2, opt2, str(tmp_path))
    assert [float(opt2.state.get(p, {}).get("step", 0)) for p in m2.parameters()] == [0.0] * 4  # (no state yet)
    ref = model()
    continue_both(m2, opt2, ref, theirs(ref.parameters()), range(3))


def _rank0_checkpoint_on_every_rank(rank, n, root, saved_wire):
    """Every rank resumes from rank 0's DCP checkpoint with the int8 wire: rank 0's checkpoint has no copies under
    this rank's names (or none at all: `saved_wire` None), so it loads with allow_partial_load, and the schedule
    entry, another rank's, is dropped (what the refusal advises); the copies restart, logged."""
    import logging
    import torch.distributed as dist
    from optim_cases import flat_params, make_model, train_steps
    build = lambda model, wire: decent_comm.DAdamW(model.parameters(), lr=0.01, topology="ring",  # noqa: E731
                                                   comm_dtype=wire, timeout=30)
    model = make_model(rank)
    opt = build(model, saved_wire)
    train_steps(rank, model, opt, 3)
    if rank == 0:
        save(model, opt, root)
    dist.barrier()
    opt.shutdown()
    model = make_model(rank + 10)
    opt = build(model, torch.int8)
    msd, osd = get_state_dict(model, opt)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=root, no_dist=True,
             planner=DefaultLoadPlanner(allow_partial_load=True))
    for g in osd["param_groups"]:
        g.pop("decentralized", None)
    logged = []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())
    logging.getLogger("decent_comm").addHandler(handler)
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    for g in opt.param_groups:
        g["lr"] = 0.0  # from here on only the gossip moves the parameters: their mean over the ranks stays
    start = flat_params(model).double()  # rank 0's parameters on every rank: the replicas' mean
    train_steps(rank, model, opt, 10, start=3)
    opt.synchronize()
    y = flat_params(model).double()
    dist.all_reduce(y)
    opt.shutdown()
    return (y / n - start).abs().max().item(), any(f"rank {rank}: " in m and "restarts them from zero" in m
                                                   for m in logged)


@pytest.mark.parametrize("saved_wire", [torch.int8, None])
def test_another_ranks_dcp_checkpoint_resumes_the_int8_wire(saved_wire, tmp_path):
    """The documented way to resume every rank from one rank's checkpoint, through DCP: the new int8 optimizer's
    template names copies the checkpoint lacks, so a plain dcp.load raised 'Missing key'; with allow_partial_load
    every rank starts from rank 0's parameters and the replicas' mean stays at lr 0 (the copies restart alike)."""
    from dist_utils import run_ranks
    for drift, restarted in run_ranks(_rank0_checkpoint_on_every_rank, 3, str(tmp_path), saved_wire, timeout=180):
        assert drift < 1e-6, drift
        assert restarted


@pytest.mark.parametrize("edit", ["in place", "assigned"])
def test_a_dsgd_count_set_to_0_by_the_user_restarts_its_buffer_and_survives_a_resume(edit):
    """The rule above holds only for a DCP template: a count of 0 the user gave a parameter with a started buffer
    restarts that buffer at the next gradient (torch.optim.SGD with the buffer deleted), also after a save and load
    (the rule turned it into 1 there: 0.057 off the live run, and the assigned edit was 0.057 off torch's)."""
    import copy
    ours, theirs = PAIRS["SGD dampening"]
    m, ref = model(), model()
    opt, ref_opt = ours(m.parameters()), theirs(ref.parameters())
    for t in range(3):
        step(m, opt, t)
        step(ref, ref_opt, t)
    p0 = next(m.parameters())
    if edit == "in place":
        opt.state[p0]["step"].fill_(0)
    else:
        opt.state[p0]["step"] = torch.tensor(0.0)
    del ref_opt.state[next(ref.parameters())]["momentum_buffer"]
    resumed = model()
    resumed.load_state_dict(m.state_dict())
    resumed_opt = ours(resumed.parameters())
    resumed_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    for t in range(3, 6):
        step(resumed, resumed_opt, t)
    continue_both(m, opt, ref, ref_opt, range(3, 6))
    for a, b in zip(resumed.parameters(), m.parameters()):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=0, atol=0)
