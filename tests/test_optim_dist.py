"""Decentralized optimizers on real multi-process gloo groups, against a dense single-process simulation of
all ranks (tests/optim_reference.py), plus the behaviours the optimizer contract promises."""

import itertools
import time

import pytest
import torch
import torch.distributed as dist

import decent_comm
from decent_comm import topology as T

from dist_utils import run_ranks
from optim_cases import (OPTIMIZERS, batch, doubly_stochastic, flat_params, make_model, run_against_reference,
                         train_steps)



def topologies(n):
    out = {name: T.make(name, n) for name in ["one-peer-exp", "ring", "exp"]}
    if n in (2, 4):
        out["aer"] = T.make("aer", n, local_world_size=n // 2)
    if n == 4:  # its inter-node step averages all 4 ranks: run as a group all-reduce (decent_comm.optim.plan.GroupSteps)
        out["aer-pair"] = T.make("aer", n, local_world_size=2, inter="pair")
    out["custom"] = T.from_matrix([doubly_stochastic(n, 1), doubly_stochastic(n, 2)])
    return out


def _core_all_combinations(rank, n):
    errors = {}
    for opt_name, (topo_name, topo), mode in itertools.product(OPTIMIZERS, topologies(n).items(), ["awc", "atc"]):
        errors[(opt_name, topo_name, mode)] = run_against_reference(rank, n, opt_name, topo, mode)
    return errors


@pytest.mark.parametrize("n", [2, 3, 4])
def test_every_optimizer_mode_and_topology_matches_dense_simulation(n):
    results = run_ranks(_core_all_combinations, n, timeout=600)
    bad = {(r, k): e for r, errs in enumerate(results) for k, e in errs.items() if not e < 1e-5}
    assert not bad, f"replicas deviate from the dense simulation: {bad}"


def _special_cases(rank, n):
    topo = T.make("one-peer-exp", n)
    return dict(
        bf16_wire=run_against_reference(rank, n, "dadamw", topo, "awc", comm_dtype=torch.bfloat16),
        bf16_wire_atc=run_against_reference(rank, n, "dsgd", topo, "atc", comm_dtype=torch.bfloat16),
        # group steps (complete: one all-reduce of 4) sum unrounded, beside point-to-point ones (aer-pair, 2 x 2)
        bf16_wire_groups=run_against_reference(rank, n, "dadamw", T.make("complete", n), "awc",
                                               comm_dtype=torch.bfloat16, consensus=0.5),
        fp16_wire_groups_atc=run_against_reference(rank, n, "dadam", T.make("aer", n, local_world_size=2,
                                                                            inter="pair"), "atc",
                                                   comm_dtype=torch.float16),
        consensus_half=run_against_reference(rank, n, "dsgd", topo, "awc", consensus=0.5),
        consensus_callable=run_against_reference(rank, n, "dadam", topo, "atc", consensus=lambda t: 0.3 + 0.05 * (t % 3)),
    )


def _group_steps(rank, n):
    """aer inter="pair" on 2 nodes x 3 ranks: intra steps are two groups of 3, inter steps one group of 6, all
    run as group all-reduces (checked: bytes went through them), against the dense simulation."""
    topo = T.make("aer", n, local_world_size=3, inter="pair")
    used = []
    probe = lambda opt: used.append(opt._schedule.exchange.group_allreduce is not None  # noqa: E731
                                   and opt._schedule.exchange.group_allreduce.bytes_sent > 0)
    errs = {mode: run_against_reference(rank, n, "dadamw", topo, mode, steps=8, probe=probe) for mode in ("awc", "atc")}
    errs["consensus"] = run_against_reference(rank, n, "dsgd", topo, "awc", steps=6, consensus=0.5, probe=probe)
    errs["group path used"] = 0.0 if all(used) and len(used) == 3 else 1.0
    return errs


def test_group_allreduce_steps_match_dense_simulation():
    results = run_ranks(_group_steps, 6, timeout=300)
    for r, errs in enumerate(results):
        for k, e in errs.items():
            assert e < 1e-5, (r, k, e)


def test_wire_dtype_and_consensus_factor_match_dense_simulation():
    results = run_ranks(_special_cases, 4, timeout=300)
    for r, errs in enumerate(results):
        for k, e in errs.items():
            assert e < 1e-5, (r, k, e)


# ---------------------------------------------------------------------------------------------------------


def _average_and_consensus(rank, n):
    """Zero learning rate: a doubly-stochastic W preserves the replica mean, and the consensus distance decays
    at the rate the spectral gap predicts."""
    out = {}
    for name in ["ring", "one-peer-exp", "exp"]:
        topo = T.make(name, n)
        model = make_model(rank)
        opt = decent_comm.DSGD(model.parameters(), lr=0.0, topology=topo, broadcast_init=False, timeout=30)
        x0 = flat_params(model).double()
        mean0 = x0.clone()
        dist.all_reduce(mean0)
        d0 = opt.consensus_distance()
        period = topo.period
        dists = []
        for _ in range(3 * period):
            opt.zero_grad()
            model(torch.zeros(1, 4)).sum().backward()
            opt.step()
            dists.append(opt.consensus_distance())
        mean = flat_params(model).double()
        dist.all_reduce(mean)
        rho = T.spectral_gap(topo).rho
        out[name] = dict(mean_err=(mean - mean0).abs().max().item() / n, d0=d0, dists=dists, rho=rho, period=period)
        opt.shutdown()
    return out


def test_average_preserved_and_consensus_decays_at_spectral_rate():
    n = 4
    res = run_ranks(_average_and_consensus, n, timeout=300)[0]
    for name, r in res.items():
        assert r["mean_err"] < 1e-6, (name, r["mean_err"])
        # ||X(kP) - mean||_F^2 <= rho^(2k) ||X(0) - mean||_F^2 over whole periods
        for k in range(1, 4):
            assert r["dists"][k * r["period"] - 1] <= r["rho"] ** (2 * k) * r["d0"] * (1 + 1e-6) + 1e-12, (name, k, r)
        if name == "one-peer-exp":  # finite-time exact for n = 4
            assert r["dists"][r["period"] - 1] < 1e-10 * r["d0"]


# ---------------------------------------------------------------------------------------------------------


def _resume(rank, n, mode):
    topo = T.make("exp", n)

    def build(model):
        return decent_comm.AccumAdamW(model.parameters(), lr=0.02, accum_steps=2, topology=topo, mode=mode,
                                      model=model, consensus=decent_comm.AdaptiveConsensus(p=2, start_step=3),
                                      timeout=30)

    def train(model, opt, sched, steps, start):
        train_steps(rank, model, opt, steps, start, after_step=lambda t: sched.step())

    model = make_model(rank)
    opt = build(model)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.7)
    train(model, opt, sched, 12, 0)
    opt.synchronize()
    straight = flat_params(model)
    opt.shutdown()

    model = make_model(rank)
    opt = build(model)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.7)
    train(model, opt, sched, 6, 0)
    ckpt = dict(model=model.state_dict(), opt=opt.state_dict(), sched=sched.state_dict())
    ckpt = {k: {kk: (vv.clone() if torch.is_tensor(vv) else vv) for kk, vv in v.items()} if k == "model" else v
            for k, v in ckpt.items()}
    opt.shutdown()

    model = make_model(100 + rank)  # different weights: everything must come from the checkpoint
    opt = build(model)  # (broadcast_init runs here, so the replicas' own weights are loaded after it)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.7)
    sched.load_state_dict(ckpt["sched"])
    train(model, opt, sched, 6, 6)
    opt.synchronize()
    resumed = flat_params(model)
    opt.shutdown()
    return (straight - resumed).abs().max().item()


@pytest.mark.parametrize("mode", ["awc", "atc"])
def test_state_dict_resume_continues_identical_trajectory(mode):
    errs = run_ranks(_resume, 3, mode, timeout=300)
    assert max(errs) < 1e-6, errs


# ---------------------------------------------------------------------------------------------------------


def _groups_scheduler_unused(rank, n):
    """Two param groups with different lr/weight decay, an lr scheduler, set_to_none grads, a parameter
    that gets no gradient (still mixed, never updated locally) and a frozen one."""
    torch.manual_seed(rank)
    a = torch.nn.Linear(4, 3)
    b = torch.nn.Linear(3, 2)
    unused = torch.nn.Parameter(torch.full((5,), float(rank)))
    frozen = torch.nn.Parameter(torch.full((2,), float(rank)), requires_grad=False)
    opt = decent_comm.DAdamW([{"params": list(a.parameters()) + [unused], "lr": 0.05, "weight_decay": 0.0},
                              {"params": list(b.parameters()) + [frozen], "lr": 0.01, "weight_decay": 0.1}],
                             topology="complete", broadcast_init=False, timeout=30)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)
    for t in range(4):
        x, y = batch(rank, t)
        opt.zero_grad(set_to_none=True)
        ((b(torch.tanh(a(x))) - y) ** 2).mean().backward()
        assert unused.grad is None
        opt.step()
        sched.step()
    opt.synchronize()
    state = opt.state_dict()["state"]
    return dict(unused=unused.detach().clone(), frozen=frozen.detach().clone(), lrs=[g["lr"] for g in opt.param_groups],
                n_state=len(state), a=torch.cat([p.detach().reshape(-1) for p in a.parameters()]))


def test_param_groups_scheduler_unused_and_frozen_parameters():
    n = 3
    res = run_ranks(_groups_scheduler_unused, n, timeout=120)
    mean = sum(range(n)) / n
    for r in res:
        # complete graph: after one mix every replica holds the mean; no local update ever touches them
        assert torch.allclose(r["unused"], torch.full((5,), mean)), r["unused"]
        assert torch.allclose(r["frozen"], torch.full((2,), mean)), r["frozen"]
        assert r["lrs"] == pytest.approx([0.05 * 0.5 ** 4, 0.01 * 0.5 ** 4])
        assert r["n_state"] == 4  # only the four parameters that had gradients have optimizer state
    # complete graph with equal starts after step 0: all replicas agree up to their own last update
    assert not torch.equal(res[0]["a"], res[1]["a"])


def test_adaptive_consensus_follows_the_decay_from_the_peak_of_a_warm_up():
    """The reference is the largest lr from start_step on: with the reference at step 0's lr (a warm-up's
    smallest) every later lr looked larger, and the factor stayed 1 through the whole decay."""
    lrs = [0.1, 0.4, 1.0, 0.5, 0.25, 0.8]
    consensus = decent_comm.AdaptiveConsensus(p=1.0)
    assert [consensus.factor(t, lr) for t, lr in enumerate(lrs)] == [1.0, 1.0, 1.0, 0.5, 0.25, 0.8]
    later = decent_comm.AdaptiveConsensus(p=2.0, start_step=3, min_factor=0.2)
    assert [later.factor(t, lr) for t, lr in enumerate(lrs)] == pytest.approx(
        [1.0, 1.0, 1.0, 1.0, 0.2 + 0.8 * 0.5 ** 2, 1.0])  # reference from step 3 on: 0.5, then 0.8
    assert later.state_dict() == {"lr_at_start": 0.8}  # the key earlier checkpoints (DCP included) hold
    old = decent_comm.AdaptiveConsensus(p=1.0)
    old.load_state_dict({"lr_at_start": 2.0})  # a checkpoint of the versions before the peak: taken as it
    assert old.factor(10, 0.5) == 0.25


def _adaptive_consensus_under_a_scheduler(rank, n, mode):
    x = torch.nn.Parameter(torch.zeros(3))
    consensus = decent_comm.AdaptiveConsensus(p=1)
    opt = decent_comm.DSGD([x], lr=1.0, topology="ring", mode=mode, consensus=consensus, timeout=30)
    with torch.no_grad():
        x.fill_(rank)  # after the construction's broadcast: replicas 0 and 1, whose mean is 0.5
    torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5)  # sets lr 0.5 at its construction, for every step
    for _ in range(2):
        opt.zero_grad()
        (0 * x).sum().backward()
        opt.step()
    opt.synchronize()
    opt.shutdown()
    return consensus.lr_peak, x.detach().clone()


@pytest.mark.parametrize("mode", ["awc", "atc"])
def test_adaptive_consensus_starts_from_the_lr_of_step_0_that_a_scheduler_set(mode):
    """lr_t / lr_peak is 1 at every step here, so each round's factor is 1 and one round makes the 2 replicas
    equal (W = 1/2 everywhere). Built before the scheduler, the optimizer recorded its constructor's lr (1.0) as
    the lr at start, and mixed with factor 0.5: the replicas stayed apart."""
    for lr_peak, x in run_ranks(_adaptive_consensus_under_a_scheduler, 2, mode, timeout=120):
        assert lr_peak == 0.5
        assert torch.equal(x, torch.full((3,), 0.5)), x


# ---------------------------------------------------------------------------------------------------------


def _mismatch(rank, n):
    model = torch.nn.Linear(4, 3 if rank != 2 else 5)
    try:
        decent_comm.DSGD(model.parameters(), lr=0.1, topology="ring")
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def test_mismatched_replicas_raise_on_every_rank():
    msgs = run_ranks(_mismatch, 3, timeout=120)
    for m in msgs:
        assert "rank 2" in m and "parameter 0" in m, m


def _topology_mismatch(rank, n):
    model = torch.nn.Linear(2, 2)
    try:
        decent_comm.DSGD(model.parameters(), lr=0.1, topology="ring" if rank == 0 else "exp")
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def test_mismatched_topology_raises_on_every_rank():
    for m in run_ranks(_topology_mismatch, 4, timeout=120):
        assert "topology fingerprint" in m and "rank 1" in m, m


def _peer_dies(rank, n):
    model = make_model(0)
    opt = decent_comm.DAdamW(model.parameters(), lr=0.01, topology="ring", timeout=4)
    for t in range(3):
        opt.zero_grad()
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
    if rank == 1:
        import os
        os._exit(0)  # dies mid-training, without any goodbye
    start = time.monotonic()
    try:
        for t in range(3, 50):
            opt.zero_grad()
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
    except RuntimeError as exc:
        return dict(elapsed=time.monotonic() - start, msg=str(exc))
    return dict(elapsed=time.monotonic() - start, msg="no error")


def test_dead_peer_raises_within_timeout():
    res = run_ranks(_peer_dies, 3, timeout=120, allow_failures=True)
    for r in (0, 2):
        assert "no error" not in res[r]["msg"], res[r]
        assert res[r]["elapsed"] < 4 + 10, res[r]


def _grad_scaler(rank, n):
    model = make_model(rank)
    opt = decent_comm.DAdamW(model.parameters(), lr=0.01, topology="one-peer-exp", broadcast_init=False, timeout=30)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    steps = []
    for t in range(4):
        x, y = batch(rank, t)
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        if rank == 1 and t == 2:
            loss = loss * float("inf")  # this rank overflows at step 2: it must skip its update, not the exchange
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        steps.append(int(opt.state_dict()["state"][0]["step"]))
    opt.shutdown()
    return steps


def test_grad_scaler_skip_keeps_exchange_schedule():
    steps = run_ranks(_grad_scaler, 2, timeout=120)
    assert steps[0] == [1, 2, 3, 4]
    assert steps[1] == [1, 2, 2, 3]
