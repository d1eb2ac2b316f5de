"""Resuming a decentralized run at another world size (an elastic restart, 3 ranks -> 2 or 2 -> 3), by the recipe
of docs/state.md "Resuming at another world size or topology", run as written there: torch.save's form (the
replicas' average, saved inside global_average(), loaded before the optimizer is built; rank 0's optimizer state
with its "decentralized" entry dropped; the lr and the LR scheduler's base_lrs rescaled from
decentralized_adam_hparams' sqrt(world size)) and DCP's (rank 0's checkpoint on every rank; flattened, the
`param_groups.<fqn>.decentralized` keys set to None, since deleting them makes torch's set_state_dict raise a bare
KeyError; nested, the entry popped).

Checked: the replicas start identical, the loaded moments and counts are rank 0's saved ones, the gossip schedule
starts at step 0 (its warm-up runs again), and the continued run is tests/optim_reference.py's float64 simulation
of the new world size started from the loaded point.
"""

import logging
import math
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

import decent_comm
from decent_comm import topology as T
from dist_utils import run_ranks
from optim_cases import batch, flat_params, gather_flat, make_model, train_steps
from optim_reference import Reference

SAVED_STEPS, RESUMED_STEPS = 6, 8
BASE_LR = 0.01  # the all-reduce AdamW run's lr that decentralized_adam_hparams scales by sqrt(world size)
CASES = {  # name: (saved world, resumed world, options, reference kind, reference hyper-parameters)
    "dadamw awc ring int8 warm-up": (3, 2, dict(topology="ring", mode="awc", comm_dtype=torch.int8, warmup_steps=2),
                                     "adamw", dict(betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)),
    "dsgd atc one-peer-exp": (2, 3, dict(topology="one-peer-exp", mode="atc"), "sgd",
                              dict(lr=0.1, momentum=0.9, weight_decay=0.01)),
}


def lr_factor(t):
    return 1.0 / (1.0 + 0.1 * t)


def build(model, case, schedule=True):
    import torch.distributed as dist
    _, _, options, kind, hp = CASES[case]
    if kind == "adamw":  # lr x sqrt(world size), the advice the rescaling below follows
        hp = dict(hp, **decent_comm.decentralized_adam_hparams(BASE_LR, dist.get_world_size()))
        opt = decent_comm.DAdamW(model.parameters(), **hp, **options, timeout=30)
    else:
        opt = decent_comm.DSGD(model.parameters(), **hp, **options, model=model, timeout=30)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_factor) if schedule else None


def _save(rank, n, case, root):
    model = make_model(rank)
    opt, sched = build(model, case)
    train_steps(rank, model, opt, SAVED_STEPS, after_step=lambda t: sched.step())
    # what a run saves for a resume at its own world size: each rank its own replica and optimizer state
    torch.save({"model": model.state_dict(), "optim": opt.state_dict(), "sched": sched.state_dict()},
               f"{root}/rank{rank}.pt")
    for flat in (True, False):
        msd, osd = get_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=flat))
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=f"{root}/dcp{int(flat)}/rank{rank}", no_dist=True)
    own = flat_params(model).clone()
    with opt.global_average():  # the model: the replicas differ, their average is what the run trained
        average = flat_params(model).clone()
        if rank == 0:
            torch.save(model.state_dict(), f"{root}/average.pt")
    opt.shutdown()
    return own, average


def _resume_torch_save(rank, m, case, root):
    """docs/state.md's torch.save recipe, verbatim but for the names."""
    import torch.distributed as dist
    model = make_model(50 + rank)
    model.load_state_dict(torch.load(f"{root}/average.pt", weights_only=True))  # before building the optimizer
    opt, sched = build(model, case)
    ckpt = torch.load(f"{root}/rank0.pt", weights_only=True)
    saved = ckpt["optim"]["param_groups"][0].pop("decentralized")
    opt.load_state_dict(ckpt["optim"])
    sched.load_state_dict(ckpt["sched"])
    if CASES[case][3] == "adamw":  # its lr was scaled with the world size: load_state_dict restored the old one
        s = math.sqrt(dist.get_world_size() / saved["world_size"])
        for g in opt.param_groups:
            g["lr"] *= s
            if "initial_lr" in g:
                g["initial_lr"] *= s
        sched.base_lrs = [lr * s for lr in sched.base_lrs]
    return opt, model, sched


def _resume_dcp(rank, m, case, root, flat):
    """docs/state.md's DCP recipe: rank 0's checkpoint on every rank, the schedule entry dropped (flattened: None)."""
    import torch.distributed as dist
    model = make_model(50 + rank)
    opt, _ = build(model, case, schedule=False)
    options = StateDictOptions(flatten_optimizer_state_dict=flat)
    msd, osd = get_state_dict(model, opt, options=options)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=f"{root}/dcp{int(flat)}/rank0", no_dist=True,
             planner=DefaultLoadPlanner(allow_partial_load=True))  # the int8 copies are named by rank
    if flat:
        keys = [k for k in osd if k.startswith("param_groups.") and k.endswith(".decentralized")]
        saved = osd[keys[0]]
        for k in keys:
            osd[k] = None  # not del: set_state_dict looks up every key the live param group has
    else:
        saved = osd["param_groups"][0].pop("decentralized")
    saved_world = int(saved["world_size"])
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd, options=options)
    if CASES[case][3] == "adamw":
        s = math.sqrt(dist.get_world_size() / saved_world)
        for g in opt.param_groups:
            g["lr"] *= s
    return opt, model, None


def _resume(rank, m, case, form, root):
    logged = []  # the int8 copies' restart is logged (the package logger sees its modules' records), naming the rank
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())
    logging.getLogger("decent_comm").addHandler(handler)
    if form == "torch.save":
        opt, model, sched = _resume_torch_save(rank, m, case, root)
    else:
        opt, model, sched = _resume_dcp(rank, m, case, root, flat=form == "dcp flattened")
    restarted = any(f"rank {rank}: " in r and "restarts them from zero" in r for r in logged)
    n, _, options, kind, hp = CASES[case]
    X0 = gather_flat(model, m)
    entry = opt.state_dict()["param_groups"][0]["decentralized"]
    saved = torch.load(f"{root}/rank0.pt", weights_only=True)["optim"]
    params = list(model.parameters())
    state_diff = {}  # every saved state tensor (the int8 copies restart) against what this rank loaded
    for i, p in enumerate(params):
        for name, v in saved["state"][i].items():
            if not str(name).startswith("int8_wire"):
                state_diff[(i, name)] = (opt.state[p][name].float() - v.float()).abs().max().item()
    lr_now = opt.param_groups[0]["lr"]

    # the float64 simulation of m ranks from the loaded point: rank 0's moments and counts on every rank, the
    # schedule (and its warm-up) from step 0
    ref_hp = dict(hp)
    if kind == "adamw":
        ref_hp["lr"] = decent_comm.decentralized_adam_hparams(BASE_LR, m)["lr"]
    base_lr = ref_hp["lr"]
    cadence = {k: options[k] for k in ("warmup_steps",) if k in options}
    ref = Reference(make_model(0), X0, T.make(options["topology"], m), options["mode"], kind, ref_hp,
                    wire_dtype=options.get("comm_dtype"), **cadence)
    ref.counts = [int(saved["state"][0]["step"])] * m
    whole = lambda key: torch.cat([saved["state"][i][key].reshape(-1) for i in range(len(params))])  # noqa: E731
    for st in ref.state:
        if kind == "adamw":
            st["m"], st["v"] = whole("exp_avg").double(), whole("exp_avg_sq").double()
        else:
            st["b"] = whole("momentum_buffer").double()
    observe = (lambda: gather_flat(model, m)) if options.get("comm_dtype") == torch.int8 else (lambda: None)
    before = observe()
    lr_off = 0.0
    for t in range(SAVED_STEPS, SAVED_STEPS + RESUMED_STEPS):
        # the lr each step should use: the new world size's, on the scheduler's curve (DCP's form: no scheduler)
        ref.hp["lr"] = base_lr * lr_factor(t if sched is not None else SAVED_STEPS)
        lr_off = max(lr_off, abs(opt.param_groups[0]["lr"] - ref.hp["lr"]) / ref.hp["lr"])
        train_steps(rank, model, opt, 1, start=t, after_step=None if sched is None else lambda t: sched.step())
        after = observe()
        ref.step([batch(r, t) for r in range(m)], observed_before=before, observed_after=after)
        before = after
    opt.synchronize()
    err = (flat_params(model).double() - ref.X[rank]).abs().max().item()
    opt.shutdown()
    return dict(X0=X0, state_diff=state_diff, schedule_step=entry["step"], world=entry["world_size"],
                lr_off=lr_off, lr_now=lr_now, err=err, restarted=restarted)


@pytest.mark.parametrize("case,form", [("dadamw awc ring int8 warm-up", "torch.save"),
                                       ("dadamw awc ring int8 warm-up", "dcp flattened"),
                                       ("dadamw awc ring int8 warm-up", "dcp nested"),
                                       ("dsgd atc one-peer-exp", "torch.save")])
def test_a_run_resumes_at_another_world_size_by_the_documented_recipe(case, form, tmp_path):
    n, m, options = CASES[case][:3]
    root = str(tmp_path)
    saved = run_ranks(_save, n, case, root, timeout=180)
    out = run_ranks(_resume, m, case, form, root, timeout=180)
    start = saved[0][1] if form == "torch.save" else saved[0][0]  # the average, or rank 0's replica
    for r, res in enumerate(out):
        assert all(torch.equal(x, start) for x in res["X0"]), (r, "the replicas start identical")
        assert res["state_diff"] and max(res["state_diff"].values()) == 0.0, (r, res["state_diff"])
        assert (res["schedule_step"], res["world"]) == (0, m), r
        assert res["lr_off"] < 1e-12, (r, res["lr_off"], res["lr_now"])
        assert res["err"] < 1e-5, (r, res["err"])
        assert res["restarted"] == (options.get("comm_dtype") == torch.int8), r
    assert os.path.exists(f"{root}/average.pt")
