"""torch.optim conventions the optimizers keep although their state lives in flat buckets: ``opt.state[p]`` holds
per-parameter views (the values torch's own optimizer holds), and torch.distributed.checkpoint's
get/set_state_dict round-trip exactly, with no side effect, the gossip schedule included."""

import copy
import logging
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

import decent_comm

from dist_utils import run_ranks
from optim_cases import batch, flat_params, make_model, train_steps


@pytest.mark.parametrize("ctor, ref_ctor, keys", [
    (decent_comm.DAdamW, torch.optim.AdamW, ("exp_avg", "exp_avg_sq")),
    (lambda ps, **kw: decent_comm.DSGD(ps, momentum=0.9, **kw), lambda ps, **kw: torch.optim.SGD(ps, momentum=0.9, **kw),
     ("momentum_buffer",)),
])
def test_state_holds_per_parameter_views_equal_to_torch(ctor, ref_ctor, keys):
    model, ref = make_model(0), make_model(0)
    opt, ropt = ctor(model.parameters(), lr=0.01), ref_ctor(ref.parameters(), lr=0.01)
    assert not opt.state  # torch semantics: no state before the first step
    for t in range(3):
        for m, o in ((model, opt), (ref, ropt)):
            x, y = batch(0, t)
            o.zero_grad()
            ((m(x) - y) ** 2).mean().backward()
            o.step()
    for p, rp in zip(model.parameters(), ref.parameters()):
        for k in keys:
            torch.testing.assert_close(opt.state[p][k], ropt.state[rp][k])
            assert opt.state[p][k].shape == p.shape
        if "step" in ropt.state[rp]:
            assert float(opt.state[p]["step"]) == float(ropt.state[rp]["step"]) == 3
    # a view, not a copy: what a tool writes into opt.state is what the next step uses
    p = next(model.parameters())
    opt.state[p][keys[0]].zero_()
    assert opt.state_dict()["state"][0][keys[0]].abs().sum() == 0


def _int8_with_a_frozen_bias(model):
    """torch.distributed.checkpoint drops the state of a parameter with requires_grad=False: its copies are lost."""
    model[0].bias.requires_grad_(False)
    return decent_comm.DAdamW(model.parameters(), lr=0.01, topology="ring", timeout=30, comm_dtype=torch.int8)


CASES = {
    "dadamw-awc": lambda ps, model: decent_comm.DAdamW(ps, lr=0.01, topology="ring", timeout=30),
    "accumadamw-atc": lambda ps, model: decent_comm.AccumAdamW(ps, lr=0.01, accum_steps=2, topology="ring",
                                                               mode="atc", model=model, timeout=30,
                                                               consensus=decent_comm.AdaptiveConsensus(p=2)),
    "wrapped-adam": lambda ps, model: decent_comm.Decentralized(torch.optim.Adam(ps, lr=0.01), topology="ring",
                                                                timeout=30),
    "dadamw-int8": lambda ps, model: decent_comm.DAdamW(ps, lr=0.01, topology="ring", timeout=30,
                                                        comm_dtype=torch.int8),
    "dadamw-int8-frozen": lambda ps, model: _int8_with_a_frozen_bias(model),
    "dadamw-int8-delayed": lambda ps, model: decent_comm.DAdamW(ps, lr=0.01, topology="ring", timeout=30,
                                                                comm_dtype=torch.int8, gossip_every=2,
                                                                delayed_mix=True),
    "dadamw-delayed": lambda ps, model: decent_comm.DAdamW(ps, lr=0.01, topology="ring", timeout=30, gossip_every=2,
                                                           delayed_mix=True),
}


def _dcp_round_trip(rank, n, case, flatten, directory):
    """directory None: set_state_dict from the saved dicts; else dcp.save each rank's, and dcp.load into what a new
    optimizer's get_state_dict gives (the template holds only the keys it has) after one state_dict() of it."""
    options = StateDictOptions(flatten_optimizer_state_dict=flatten)
    model = make_model(rank)
    opt = CASES[case](model.parameters(), model)
    train_steps(rank, model, opt, 3, 0)
    opt.synchronize()  # ATC: state_dict() applies the pending mix first (the same x^{t+1} the next forward uses)
    before, t_before = flat_params(model).clone(), opt._schedule.t
    msd, osd = get_state_dict(model, opt, options=options)
    side_effect = (flat_params(model) - before).abs().max().item() + abs(opt._schedule.t - t_before)
    ckpt = copy.deepcopy((msd, osd))
    if directory is not None:
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=f"{directory}/rank{rank}", no_dist=True)
    ckpt_x = flat_params(model).clone()
    train_steps(rank, model, opt, 3, 3)
    opt.synchronize()
    straight = flat_params(model).clone()
    opt.shutdown()

    model = make_model(50 + rank)  # other weights: everything must come from the checkpoint
    opt = CASES[case](model.parameters(), model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            if directory is not None:
                opt.state_dict()  # a step-0 checkpoint or log line: must not keep DCP from initializing the template
                msd, osd = get_state_dict(model, opt, options=options)
                dcp.load({"model": msd, "optim": osd}, checkpoint_id=f"{directory}/rank{rank}", no_dist=True)
                ckpt = (msd, osd)
            set_state_dict(model, opt, model_state_dict=ckpt[0], optim_state_dict=ckpt[1], options=options)
        except ValueError as e:
            opt.shutdown()
            return dict(side_effect=side_effect, refused=str(e))
    # (message, the file it is attributed to) of decent_comm's warnings
    warned = [(str(w.message), w.filename) for w in caught if str(w.message).startswith("decent_comm: ")]
    restored_t = opt._schedule.t
    train_steps(rank, model, opt, 3, 3)
    opt.synchronize()
    err = (flat_params(model) - straight).abs().max().item()
    moved = (straight - ckpt_x).abs().max().item()
    opt.shutdown()
    return dict(side_effect=side_effect, err=err, restored_t=restored_t, moved=moved, warned=warned)


@pytest.mark.parametrize("via", ["set_state_dict", "dcp.save/load"])
@pytest.mark.parametrize("flatten", [False, True], ids=["nested", "flattened"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_dcp_get_set_state_dict_round_trip_is_exact(case, flatten, via, tmp_path):
    """Both forms: flatten_optimizer_state_dict=True (torchtitan's) rebuilds the state dict from the keys of the
    live param groups and opt.state, so the schedule's entry must be in the live group 0. What a new optimizer has
    no state name for yet cannot come back that way (as in any DCP load into a new optimizer): a delayed_mix round
    in flight is refused. The int8 wire's copies are allocated at construction, so they come back (exact); DCP drops
    a frozen parameter's state, and its copies keep their values (a warning, at the user's set_state_dict line, not
    exact). Through dcp.load the int8
    wire's round in flight came back only if its entry had the keys of a new optimizer's (one value, not a dict
    the template lacked: "Missing key ... int8_wire_round"), and a new int8 optimizer's state_dict() made opt.state
    hold its copies, so DCP skipped initializing the state and the moments were not loaded."""
    directory = str(tmp_path) if via == "dcp.save/load" else None
    for rank, r in enumerate(run_ranks(_dcp_round_trip, 3, case, flatten, directory, timeout=300)):
        assert r["side_effect"] == 0, r
        if (flatten or directory) and case == "dadamw-delayed" and "refused" in r:
            assert "delayed_mix round in flight" in r["refused"], r
            continue
        assert r["restored_t"] == 3, r
        if case == "dadamw-int8-frozen":  # both forms drop the frozen parameter's state
            assert [f for m, f in r["warned"] if f"rank {rank}: the state dict has all the int8 wire copies of 3 of "
                    "the 4" in m] == [__file__], r
            assert r["err"] < 0.02 * r["moved"], r  # a quantization error, not a lost or zero-mixed round
            continue
        assert not any("int8 wire copies" in m for m, _ in r.get("warned", [])), r
        assert r["err"] < 1e-6, r


def _profiled(rank, n, mode):
    from torch.profiler import profile
    model = make_model(rank)
    opt = decent_comm.DAdamW(model.parameters(), topology="ring", mode=mode, warmup_steps=1, timeout=30)
    with profile() as prof:
        train_steps(rank, model, opt, 3)
    opt.shutdown()
    return sorted({e.name for e in prof.events() if e.name.startswith("decent_comm::")})


@pytest.mark.parametrize("mode", ["awc", "atc"])
def test_profiler_shows_the_gossip_ranges(mode):
    names = run_ranks(_profiled, 2, mode, timeout=120)[0]
    want = {"decent_comm::warmup_allreduce", "decent_comm::exchange_launch", "decent_comm::exchange_wait"}
    want |= {"decent_comm::mix_update"} if mode == "awc" else {"decent_comm::local_update", "decent_comm::atc_mix"}
    assert want <= set(names), names


def _mix_kernel_ranges(rank, n):
    """For each mix_adam_ kernel of 3 profiled DAdamW steps: the decent_comm ranges it ran inside, innermost first."""
    from torch.profiler import profile
    model = make_model(rank)
    opt = decent_comm.DAdamW(model.parameters(), topology="ring", timeout=30)
    train_steps(rank, model, opt, 1)  # (the first step only initializes the state)
    # a new lr before each step: a step checks only the groups edited since the last check
    opt.param_groups[0]["lr"] = 2e-3
    with profile() as prof:
        train_steps(rank, model, opt, 3, start=1, after_step=lambda t: opt.param_groups[0].update(lr=1e-3 * (t + 2)))
    buckets = len(opt._buckets)
    opt.shutdown()
    chains = []
    for e in prof.events():
        if e.name == "decent_comm::mix_adam_":
            chain, p = [], e.cpu_parent
            while p is not None:
                if p.name.startswith("decent_comm::"):
                    chain.append(p.name)
                p = p.cpu_parent
            chains.append(chain)
    return buckets, chains


def test_profiler_counts_the_real_mix_kernels_apart_from_the_hyper_parameter_check():
    """A step checks edited hyper-parameters by a mix_adam_ call on a one-element meta stand-in (_check_values): in a
    trace it was a second top-level decent_comm::mix_adam_ per step, doubling the kernel count. Now it lies inside
    decent_comm::check_values, and the kernels inside mix_update are the real ones: one per bucket and step."""
    for buckets, chains in run_ranks(_mix_kernel_ranges, 2, timeout=120):
        checks = [c for c in chains if c and c[0] == "decent_comm::check_values"]
        real = [c for c in chains if c and c[0] == "decent_comm::mix_update"]
        assert len(checks) == 3 and len(real) == 3 * buckets and len(chains) == len(checks) + len(real), chains
        assert not any("decent_comm::mix_update" in c for c in checks), chains


def _setup_lines(rank, n, topology, comm_dtype):
    lines = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger("decent_comm")
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    model = make_model(rank)
    opt = decent_comm.DAdamW(model.parameters(), topology=topology, comm_dtype=comm_dtype, timeout=30)
    logger.removeHandler(handler)
    opt.shutdown()
    return [line for line in lines if "topology" in line and "bucket" in line]


@pytest.mark.parametrize("topology, comm_dtype, path, wire", [
    ("complete", None, "group all-reduce", "wire the parameters' dtype"),
    ("ring", torch.bfloat16, "point to point", "wire bfloat16"),
    ("complete", torch.int8, "point to point", "wire int8 with error feedback"),  # the int8 wire never groups
])
def test_debug_log_says_how_each_rank_gossips(topology, comm_dtype, path, wire):
    per_rank = run_ranks(_setup_lines, 3, topology, comm_dtype, timeout=120)
    for rank, lines in enumerate(per_rank):
        assert len(lines) == 1, lines
        line = lines[0]
        assert f"rank {rank} of 3" in line and f"topology {topology}" in line and path in line and wire in line, line
        n = sum(p.numel() for p in make_model(0).parameters())
        assert f"; {n} parameter element(s) in 1 bucket(s)" in line, line


@pytest.mark.parametrize("wrapped", [False, True], ids=["DAdamW", "Decentralized(AdamW)"])
def test_repr_shows_where_the_schedule_stands(wrapped):
    """Decentralized's own __repr__ (the inner optimizer's, which shows the shared param group 0) showed the entry of
    construction, 'step': 0, after any number of steps."""
    model = make_model(0)
    opt = decent_comm.Decentralized(torch.optim.AdamW(model.parameters(), lr=1e-3)) if wrapped else \
        decent_comm.DAdamW(model.parameters(), lr=1e-3)
    train_steps(0, model, opt, 2)
    assert "'step': 2" in repr(opt) and "'step': 0" not in repr(opt), repr(opt)
    train_steps(0, model, opt, 1, start=2)
    assert "'step': 3" in repr(opt), repr(opt)
