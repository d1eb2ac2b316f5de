"""Loading a state dict as a torch optimizer does, although the state lives in flat buckets that opt.state and
state_dict() only view: loading the optimizer's own state_dict() (or torch.distributed.checkpoint writing into
get_state_dict's tensors in place) keeps the step counts, a parameter the saved state does not cover starts afresh,
and torch.optim.SGD's momentum (saved without a step) is used. References: torch's optimizers fed the same
gradients, and a twin that never reloaded."""

import copy

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import decent_comm

HP = dict(lr=0.01, weight_decay=0.1)
CASES = {  # name: (decentralized, torch counterpart or None)
    "DSGD": (lambda ps: decent_comm.DSGD(ps, momentum=0.9, **HP), lambda ps: torch.optim.SGD(ps, momentum=0.9, **HP)),
    "DAdamW": (lambda ps: decent_comm.DAdamW(ps, **HP), lambda ps: torch.optim.AdamW(ps, **HP)),
    "DAdam": (lambda ps: decent_comm.DAdam(ps, **HP), lambda ps: torch.optim.Adam(ps, **HP)),
    "AccumAdamW": (lambda ps: decent_comm.AccumAdamW(ps, accum_steps=3, **HP), None),
}


def model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))


def step(m, opt, t, only=None):
    """One step on gradients drawn from t; `only`: the indices of the parameters that get one (others None)."""
    g = torch.Generator().manual_seed(100 + t)
    for i, p in enumerate(m.parameters()):
        grad = torch.randn(p.shape, generator=g)
        p.grad = grad if only is None or i in only else None
    opt.step()


def params(m):
    return [p.detach().clone() for p in m.parameters()]


def assert_same(got, want, exact):
    for i, (a, b) in enumerate(zip(got, want)):
        tol = dict(rtol=0, atol=0) if exact else dict(rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(a, b, **tol, msg=lambda msg: f"parameter {i}: {msg}")


@pytest.mark.parametrize("name", sorted(CASES))
def test_loading_its_own_state_dict_changes_nothing(name):
    ctor, ref_ctor = CASES[name]
    m, twin = model(), model()
    opt, twin_opt = ctor(m.parameters()), ctor(twin.parameters())
    ref = model()
    ref_opt = ref_ctor(ref.parameters()) if ref_ctor else None
    for t in range(6):
        if t == 3:  # the saved tensors are the live views: the load must read them before it writes
            opt.load_state_dict(opt.state_dict())
            assert [float(opt.state[p]["step"]) for p in m.parameters()] == [3.0] * 4
        for mm, o in ((m, opt), (twin, twin_opt)) + (((ref, ref_opt),) if ref_opt else ()):
            step(mm, o, t)
    assert_same(params(m), params(twin), exact=True)
    if ref_opt:
        assert_same(params(m), params(ref), exact=False)


@pytest.mark.parametrize("name", ["DAdamW", "AccumAdamW"])
def test_dcp_load_in_place_resumes_exactly(name, tmp_path):
    """The torch.distributed.checkpoint recipe: get_state_dict, dcp.load writes into its tensors (the live views),
    set_state_dict. Resuming from step 3 after 2 more steps must continue as a run that never took them."""
    ctor = CASES[name][0]
    m, twin = model(), model()
    opt, twin_opt = ctor(m.parameters()), ctor(twin.parameters())
    for t in range(3):
        step(m, opt, t)
        step(twin, twin_opt, t)
    msd, osd = get_state_dict(m, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path), no_dist=True)
    for t in range(3, 5):  # then diverge: the checkpoint must bring these back
        step(m, opt, 50 + t)
    msd, osd = get_state_dict(m, opt)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path), no_dist=True)
    set_state_dict(m, opt, model_state_dict=msd, optim_state_dict=osd)
    assert [float(opt.state[p]["step"]) for p in m.parameters()] == [3.0] * 4
    for t in range(3, 6):
        step(m, opt, t)
        step(twin, twin_opt, t)
    assert_same(params(m), params(twin), exact=True)


@pytest.mark.parametrize("name", ["DSGD", "DAdamW", "DAdam"])
def test_a_parameter_the_checkpoint_does_not_cover_starts_afresh(name):
    """A checkpoint from before parameter 2 and 3 got gradients, loaded into an optimizer that has stepped them
    since: their moments and counts must be fresh again, as in torch's optimizer loading the same checkpoint."""
    ctor, ref_ctor = CASES[name]
    m, ref = model(), model()
    opt, ref_opt = ctor(m.parameters()), ref_ctor(ref.parameters())
    for mm, o in ((m, opt), (ref, ref_opt)):
        step(mm, o, 0, only={0, 1})
    early = copy.deepcopy(opt.state_dict()), copy.deepcopy(ref_opt.state_dict())
    for t in range(1, 4):
        for mm, o in ((m, opt), (ref, ref_opt)):
            step(mm, o, t)
    opt.load_state_dict(early[0])
    ref_opt.load_state_dict(early[1])
    with_state = [[i for i, p in enumerate(mm.parameters()) if p in o.state] for mm, o in ((m, opt), (ref, ref_opt))]
    assert with_state == [[0, 1], [0, 1]]
    for t in range(4, 8):
        for mm, o in ((m, opt), (ref, ref_opt)):
            step(mm, o, t)
    assert_same(params(m), params(ref), exact=False)


def test_dsgd_uses_the_momentum_of_a_torch_sgd_checkpoint():
    """torch.optim.SGD saves momentum_buffer and no step: loaded into DSGD the buffer must be used, not replaced by
    the next gradient as on a first step."""
    ctor, ref_ctor = CASES["DSGD"]
    ref = model()
    ref_opt = ref_ctor(ref.parameters())
    for t in range(2):
        step(ref, ref_opt, t)
    saved = copy.deepcopy(ref_opt.state_dict())
    assert "step" not in saved["state"][0]
    m = model()
    m.load_state_dict(ref.state_dict())
    opt = ctor(m.parameters())
    opt.load_state_dict(saved)
    for t in range(2, 5):
        step(m, opt, t)
        step(ref, ref_opt, t)
    assert_same(params(m), params(ref), exact=False)


@pytest.mark.parametrize("into", ["DAdamW", "DAdamW from a GPU run", "AccumAdamW"])
def test_a_torch_checkpoint_loads_and_continues_as_torch(into):
    """Its groups carry amsgrad=False, maximize=False, foreach, capturable...: none of them refused. A GPU run's
    capturable=True does not change the update: it loads (it was refused). AccumAdamW keeps its accum_steps,
    which torch's groups lack (the next step raised KeyError); with accum_steps=1 it is AdamW."""
    ref = model()
    ref_opt = torch.optim.AdamW(ref.parameters(), foreach=False, **HP)
    for t in range(2):
        step(ref, ref_opt, t)
    m = model()
    m.load_state_dict(ref.state_dict())
    opt = decent_comm.AccumAdamW(m.parameters(), accum_steps=1, **HP) if into == "AccumAdamW" else \
        decent_comm.DAdamW(m.parameters(), **HP)
    saved = copy.deepcopy(ref_opt.state_dict())
    assert {"amsgrad", "maximize", "capturable", "foreach"} <= set(saved["param_groups"][0])
    if into == "DAdamW from a GPU run":
        saved["param_groups"][0]["capturable"] = True
    opt.load_state_dict(saved)
    if into == "AccumAdamW":
        assert opt.param_groups[0]["accum_steps"] == 1
    assert not opt.param_groups[0]["capturable"]
    for t in range(2, 4):
        step(m, opt, t)
        step(ref, ref_opt, t)
    assert_same(params(m), params(ref), exact=False)


@pytest.mark.parametrize("wrap", [False, True])
def test_deepcopy_and_pickle_say_to_use_the_state_dict(wrap):
    import pickle
    m = model()
    opt = decent_comm.Decentralized(torch.optim.SGD(m.parameters(), lr=0.1)) if wrap else \
        decent_comm.DAdamW(m.parameters())
    for copier in (copy.deepcopy, pickle.dumps):
        with pytest.raises(TypeError, match="cannot be pickled or deep-copied.*state_dict"):
            copier(opt)


def test_param_groups_reused_from_another_optimizer_pass_the_replica_check():
    """torch keeps the group dicts it is given: a new optimizer over old.param_groups finds the old one's schedule
    entry (its rank and step) in group 0, which the ranks must not compare."""
    from decent_comm.optim.startup import replica_config
    m = model()
    old = decent_comm.DAdamW(m.parameters(), **HP)
    step(m, old, 0)
    new = decent_comm.DAdamW(old.param_groups, **HP)
    mine, peer = ([dict(new.param_groups[0], decentralized={"rank": r, "step": 7})] for r in (0, 1))
    topo = new._schedule.topology
    assert replica_config(new._buckets, topo, mine) == replica_config(new._buckets, topo, peer)


HOOKED = {"DAdamW": CASES["DAdamW"][0], "DSGD": CASES["DSGD"][0],
          "Decentralized(AdamW)": lambda ps: decent_comm.Decentralized(torch.optim.AdamW(ps, **HP))}


@pytest.mark.parametrize("name", sorted(HOOKED))
def test_state_dict_hooks_see_what_torch_hooks_see(name):
    """torch runs the state_dict hooks around the whole method: a state_dict post-hook sees (and may replace) the
    finished dict, a load pre-hook sees (and may replace) the dict being loaded, a load post-hook the loaded state."""
    m = model()
    opt = HOOKED[name](m.parameters())
    for t in range(2):
        step(m, opt, t)
    seen = {}
    opt.register_state_dict_pre_hook(lambda o: seen.setdefault("sd_pre", True))
    opt.register_state_dict_post_hook(lambda o, sd: {**sd, "seen": "decentralized" in sd["param_groups"][0]})
    saved = copy.deepcopy(opt.state_dict())
    assert seen["sd_pre"] and saved["seen"] is True

    m2 = model(seed=1)
    fresh = HOOKED[name](m2.parameters())

    def load_pre(o, sd):
        seen["states_given"] = len(sd["state"])
        return {**sd, "param_groups": [{**g, "lr": 0.5} for g in sd["param_groups"]]}

    def load_post(o):
        seen["steps_after"] = [float(o.state[p]["step"]) for p in m2.parameters()]
        seen["lr_after"] = [g["lr"] for g in o.param_groups]
        if isinstance(o, decent_comm.Decentralized):
            seen["shared"] = o.param_groups is o.inner.param_groups and o.state is o.inner.state

    fresh.register_load_state_dict_pre_hook(load_pre)
    fresh.register_load_state_dict_post_hook(load_post)
    fresh.load_state_dict(saved)
    assert seen["states_given"] == 4
    assert seen["steps_after"] == [2.0] * 4
    assert seen["lr_after"] == [0.5] and fresh.param_groups[0]["lr"] == 0.5
    assert seen.get("shared", True)


def test_the_wrapper_follows_a_load_into_its_inner_optimizer():
    """torch's load_state_dict replaces an optimizer's param_groups and state by new objects: the wrapper must read
    the inner optimizer's current ones, or an lr scheduler attached to it would update groups nobody reads."""
    m = model()
    inner = torch.optim.AdamW(m.parameters(), **HP)
    opt = decent_comm.Decentralized(inner)
    step(m, opt, 0)
    inner.load_state_dict(copy.deepcopy(inner.state_dict()))
    assert opt.param_groups is inner.param_groups and opt.state is inner.state
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 0.1)
    assert inner.param_groups[0]["lr"] == pytest.approx(HP["lr"] * 0.1)
    step(m, opt, 1)
    sched.step()
    assert float(opt.state[next(iter(m.parameters()))]["step"]) == 2.0


@pytest.mark.parametrize("name", ["DAdamW", "DSGD"])
def test_a_tensor_lr_trains_as_torch_does(name):
    """torch.optim takes lr as a 0-dim tensor (schedulers then fill_ it in place; DCP keeps it a tensor)."""
    ctor, ref_ctor = CASES[name]
    m, ref = model(), model()
    opt, ref_opt = ctor(m.parameters()), ref_ctor(ref.parameters())
    for o in (opt, ref_opt):
        o.param_groups[0]["lr"] = torch.tensor(HP["lr"])
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5) for o in (opt, ref_opt)]
    for t in range(5):
        for mm, o, s in ((m, opt, scheds[0]), (ref, ref_opt, scheds[1])):
            step(mm, o, t)
            s.step()
    assert isinstance(opt.param_groups[0]["lr"], torch.Tensor)
    assert_same(params(m), params(ref), exact=False)


def _dcp_per_rank_resume(rank, n, root):
    import os

    from optim_cases import make_model, resumed_vs_straight  # noqa: F401 - the shared regression problem
    from optim_cases import train_steps

    def build(m):
        return decent_comm.DAdamW(m.parameters(), lr=0.05, topology="ring", mode="atc", timeout=30, model=m)

    m = make_model(0)
    opt = build(m)
    train_steps(rank, m, opt, 8)
    opt.synchronize()
    straight = params(m)
    opt.shutdown()
    m = make_model(0)
    opt = build(m)
    train_steps(rank, m, opt, 4)
    msd, osd = get_state_dict(m, opt)
    where = os.path.join(root, f"rank{rank}")  # the documented recipe: each rank its own checkpoint_id
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=where, no_dist=True)
    opt.shutdown()
    m = make_model(5)
    opt = build(m)
    msd, osd = get_state_dict(m, opt)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=where, no_dist=True)
    set_state_dict(m, opt, model_state_dict=msd, optim_state_dict=osd)
    train_steps(rank, m, opt, 4, start=4)
    opt.synchronize()
    resumed = params(m)
    opt.shutdown()
    return max((a - b).abs().max().item() for a, b in zip(resumed, straight))


def test_dcp_per_rank_checkpoints_resume_every_replica_exactly(tmp_path):
    """Replicas differ, so DCP's save under one checkpoint_id (one copy per name) would blend them; the recipe in
    docs/state.md saves each rank under its own, and every rank resumes its own trajectory exactly."""
    from dist_utils import run_ranks
    assert run_ranks(_dcp_per_rank_resume, 3, str(tmp_path), timeout=300) == [0.0] * 3
