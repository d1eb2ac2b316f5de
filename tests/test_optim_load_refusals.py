"""Checkpoints a decentralized optimizer refuses to load, before anything is loaded (the optimizer stays as it
was), each with what to do: a group asking for what the kernels do not do, another weight decay, another
optimizer's state, another topology or cadence; and what still loads (a subset, a checkpoint lacking a group key).
The keys of the schedule entry are pinned: torch.distributed.checkpoint needs earlier checkpoints to hold them."""

import copy
import re

import pytest
import torch

import decent_comm

from test_optim_load import HP, assert_same, model, params, step


@pytest.mark.parametrize("ctor, flag", [(decent_comm.DAdamW, "amsgrad"), (decent_comm.DAdam, "maximize"),
                                        (decent_comm.DSGD, "maximize"), (decent_comm.AccumAdamW, "amsgrad"),
                                        (decent_comm.DSGD, "differentiable")])
def test_a_group_asking_for_what_the_kernels_do_not_do_is_refused(ctor, flag):
    """torch reads amsgrad / maximize per group: a group, a torch checkpoint or an edit of param_groups setting one
    must not train as plain Adam/SGD. The checkpoint is refused before anything is loaded, the edit at the next
    step, before anything moves."""
    m = model()
    ps = list(m.parameters())
    with pytest.raises(ValueError, match=rf"param group 1\): {flag}=True is not supported"):
        ctor([{"params": ps[:2]}, {"params": ps[2:], flag: True}], lr=0.01)
    opt = ctor(m.parameters(), lr=0.01)
    step(m, opt, 0)
    before = copy.deepcopy(opt.state_dict())
    saved = copy.deepcopy(before)
    saved["param_groups"][0][flag] = True
    with pytest.raises(ValueError, match=rf"param group 0\): {flag}=True is not supported"):
        opt.load_state_dict(saved)
    after = opt.state_dict()
    assert after["param_groups"] == before["param_groups"]
    for i, st in before["state"].items():
        for k, v in st.items():
            torch.testing.assert_close(after["state"][i][k], v, rtol=0, atol=0)
    opt.param_groups[0][flag] = True  # an edit between steps
    unchanged = params(m)
    with pytest.raises(ValueError, match=rf"param group 0\): {flag}=True is not supported"):
        step(m, opt, 1)
    assert_same(params(m), unchanged, exact=True)


@pytest.mark.parametrize("ctor, ref_ctor", [(decent_comm.DAdam, torch.optim.AdamW),
                                            (decent_comm.AccumAdamW, torch.optim.Adam)])
def test_a_checkpoint_with_the_other_weight_decay_is_refused(ctor, ref_ctor):
    """torch's Adam groups carry decoupled_weight_decay: an AdamW checkpoint loaded into DAdam would apply L2."""
    ref = model()
    ref_opt = ref_ctor(ref.parameters(), **HP)
    step(ref, ref_opt, 0)
    saved = copy.deepcopy(ref_opt.state_dict())
    if "decoupled_weight_decay" not in saved["param_groups"][0]:
        pytest.skip("this torch's Adam groups do not say which weight decay")
    opt = ctor(model().parameters(), **HP)
    with pytest.raises(ValueError, match=r"param group 0\): decoupled_weight_decay=(True|False) with weight_decay"):
        opt.load_state_dict(saved)
    saved["param_groups"][0]["weight_decay"] = 0.0  # no decay: nothing to disagree on
    opt.load_state_dict(saved)


def _mixed_decay(ps):
    return [{"params": ps[:2], "decoupled_weight_decay": True}, {"params": ps[2:]}]


@pytest.mark.parametrize("ctor, advice", [(decent_comm.DAdam, "DAdam(..., decoupled_weight_decay=True)"),
                                          (decent_comm.AccumAdam, "AccumAdamW for decoupled decay")])
def test_a_group_with_its_own_decoupled_weight_decay_is_refused_saying_the_flag_is_per_optimizer(ctor, advice):
    """torch.optim.Adam honours the flag per group; ours apply one decay to every group. The advice pointed to
    DAdamW only, not to DAdam's own constructor flag, nor to the wrapper for decay differing between groups; the
    wrapper named trains as torch with those groups, DAdam given the flag as torch's AdamW update."""
    with pytest.raises(ValueError, match=r"param group 0\): decoupled_weight_decay=True with weight_decay=0\.1, .*"
                       r"the flag is per optimizer here, not per param group\. Use " + re.escape(advice) + r".*"
                       r"decent_comm\.Decentralized\(torch\.optim\.Adam\(\.\.\.\)\)"):
        ctor(_mixed_decay(list(model().parameters())), **HP)
    for ours, theirs in [(lambda ps: decent_comm.Decentralized(torch.optim.Adam(_mixed_decay(ps), **HP)),
                          lambda ps: torch.optim.Adam(_mixed_decay(ps), **HP)),
                         (lambda ps: decent_comm.DAdam(ps, decoupled_weight_decay=True, **HP),
                          lambda ps: torch.optim.AdamW(ps, **HP))]:
        m, ref = model(), model()
        opt, ref_opt = ours(list(m.parameters())), theirs(list(ref.parameters()))
        for t in range(3):
            step(m, opt, t)
            step(ref, ref_opt, t)
        assert_same(params(m), params(ref), exact=False)


def test_accum_steps_missing_from_a_checkpoint_keeps_the_constructors():
    saved = decent_comm.DAdamW(model().parameters(), **HP).state_dict()
    opt = decent_comm.AccumAdamW(model().parameters(), accum_steps=3, **HP)
    opt.load_state_dict(saved)
    assert opt.param_groups[0]["accum_steps"] == 3


def test_a_capturable_edit_between_steps_is_still_refused():
    """Only a loaded checkpoint's capturable is dropped: asked for, in the constructor or by an edit, it is refused."""
    m = model()
    opt = decent_comm.DAdamW(m.parameters(), **HP)
    step(m, opt, 0)
    opt.param_groups[0]["capturable"] = True
    with pytest.raises(ValueError, match=r"param group 0\): capturable=True is not supported"):
        step(m, opt, 1)


@pytest.mark.parametrize("src, into, foreign", [
    (lambda ps: decent_comm.DSGD(ps, lr=0.05, momentum=0.9), decent_comm.DAdamW, "momentum_buffer"),
    (lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9), decent_comm.DAdam, "momentum_buffer"),
    (lambda ps: torch.optim.AdamW(ps, **HP), decent_comm.DSGD, "exp_avg"),
    (lambda ps: decent_comm.AccumAdamW(ps, **HP), decent_comm.DAdamW, "accum"),
    (lambda ps: decent_comm.DSGD(ps, lr=0.05), decent_comm.DAdamW, None),  # momentum 0: a count, no buffer
])
def test_another_optimizers_checkpoint_is_refused_before_anything_loads(src, into, foreign):
    """DAdamW took DSGD's state: its moments started at zero under the saved step's bias correction (a first
    update of 0.58 lr after 3 steps) and kept the foreign buffer for nothing; torch fails at the next step."""
    m = model()
    other = src(m.parameters())
    for t in range(3):
        step(m, other, t)
    saved = copy.deepcopy(other.state_dict())
    mine = model()
    opt = into(mine.parameters(), lr=0.05)
    step(mine, opt, 0)
    before = copy.deepcopy(opt.state_dict())
    match = rf"state \[[^]]*'{foreign}'[^]]*\] that {into.__name__} does not keep" if foreign else \
        rf"has a step count but not {into.__name__}'s \['exp_avg', 'exp_avg_sq'\]"
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(saved)
    after = opt.state_dict()
    assert all(torch.equal(before["state"][k][n], after["state"][k][n]) for k in before["state"]
               for n in before["state"][k])
    saved["state"] = {}  # what the message says: the groups (lr, ...) load, the state starts afresh
    opt.load_state_dict(saved)
    assert opt.param_groups[0]["lr"] == saved["param_groups"][0]["lr"] and not opt.state


def test_a_subset_of_the_state_loads():
    """AccumAdamW from torch AdamW: the moments load, the accumulator starts at zero (as before)."""
    m = model()
    ref = torch.optim.AdamW(m.parameters(), **HP)
    step(m, ref, 0)
    opt = decent_comm.AccumAdamW(model().parameters(), **HP)
    opt.load_state_dict(copy.deepcopy(ref.state_dict()))
    assert torch.equal(opt.state[next(iter(opt.state))]["exp_avg"], ref.state[next(iter(ref.state))]["exp_avg"])


def test_another_topology_or_cadence_is_refused_naming_both_and_what_to_do():
    m = model()
    src = decent_comm.DAdamW(m.parameters(), topology="ring", **HP)
    step(m, src, 0)
    saved = copy.deepcopy(src.state_dict())
    opt = decent_comm.DAdamW(model().parameters(), topology="one-peer-exp", **HP)
    with pytest.raises(ValueError, match=r"another topology \('ring', fingerprint [0-9a-f]{16}; this optimizer has "
                                         r"'one-peer-exp', fingerprint [0-9a-f]{16}\)\. To go on from its moments"):
        opt.load_state_dict(copy.deepcopy(saved))
    cadence = decent_comm.DAdamW(model().parameters(), topology="ring", gossip_every=2, **HP)
    with pytest.raises(ValueError, match=r"gossip_every=1, this optimizer has gossip_every=2\. To go on .* drop the "
                                         r"'decentralized' entry"):
        cadence.load_state_dict(copy.deepcopy(saved))
    warm_model = model()
    warm = decent_comm.DAdamW(warm_model.parameters(), topology="ring", warmup_steps=2, **HP)
    step(warm_model, warm, 0)  # still warming up: its next step would all-reduce, the loader's would gossip
    with pytest.raises(ValueError, match=r"warmup_steps=2, this optimizer has warmup_steps=0\. To go on .* drop the "
                                         r"'decentralized' entry"):
        decent_comm.DAdamW(model().parameters(), topology="ring", **HP).load_state_dict(warm.state_dict())
    # (delayed_mix: tests/test_delayed_mix.py, test_delayed_mix_resumes_exactly)
    stepped = decent_comm.DAdamW(m.parameters(), topology="one-peer-exp", **HP)
    for t in range(3):
        step(m, stepped, t)
    with pytest.raises(ValueError) as refused:
        stepped.load_state_dict(copy.deepcopy(saved))
    # what the message says the advice does (it said "the gossip schedule then starts afresh (step 0 ...)", which a
    # load into an optimizer that has stepped does not do: load_state_dict without the entry leaves the schedule)
    assert str(refused.value).endswith("drop the 'decentralized' entry before loading: a new optimizer's gossip "
                                       "schedule then starts at step 0 of its topology and cadence (its warm-up runs "
                                       "again); one that has stepped keeps its own position."), refused.value
    saved["param_groups"][0].pop("decentralized")  # as advised: the moments load, the schedule starts afresh
    opt.load_state_dict(copy.deepcopy(saved))
    assert torch.equal(opt.state[next(iter(opt.state))]["exp_avg"], src.state[next(iter(src.state))]["exp_avg"])
    stepped.load_state_dict(saved)
    schedule_step = lambda o: o.state_dict()["param_groups"][0]["decentralized"]["step"]  # noqa: E731
    assert (schedule_step(src), schedule_step(opt), schedule_step(stepped)) == (1, 0, 3)


def test_the_schedule_entry_keeps_the_keys_earlier_checkpoints_hold():
    """torch.distributed.checkpoint loads the keys the live optimizer has and requires the checkpoint to hold them:
    a key added to the "decentralized" entry (or to a consensus schedule's state) makes every earlier DCP checkpoint
    fail to load ("Missing key in checkpoint state_dict"). A change here needs a migration, not a new key."""
    opt = decent_comm.DAdamW(model().parameters(), consensus=decent_comm.AdaptiveConsensus(), **HP)
    entry = opt.state_dict()["param_groups"][0]["decentralized"]
    assert set(entry) == {"step", "next_factor", "gossip_every", "warmup_steps", "delayed_mix", "delayed_pending",
                          "int8_wire_round", "topology", "mode", "world_size", "rank", "consensus", "adaptive"}
    assert set(entry["consensus"]) == {"lr_at_start"}
    # the topology's fingerprint first, then its name; earlier versions saved the fingerprint alone
    other = decent_comm.DAdamW(model().parameters(), topology="ring", **HP)
    old = copy.deepcopy(opt.state_dict())
    old["param_groups"][0]["decentralized"]["topology"] = entry["topology"][:16]
    with pytest.raises(ValueError, match=r"another topology \(fingerprint [0-9a-f]{16}; this optimizer has 'ring'"):
        other.load_state_dict(old)
