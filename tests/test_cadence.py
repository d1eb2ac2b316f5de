"""A communication interval (gossip every k steps, local steps between) and an all-reduce warm-up (the first w
steps average the gradients, as torch's PostLocalSGDOptimizer), with and without delayed_mix, against the float64
dense simulation of all ranks, for every optimizer and both modes (delayed_mix: awc); they are kept in state_dict (a resume mid-interval continues exactly) and
checked at start-up like every option."""

import itertools

import pytest
import torch

import decent_comm
from decent_comm import topology as T

from dist_utils import run_ranks
from optim_cases import (OPTIMIZERS, assert_every_rank_close, make_model, resumed_vs_straight, run_against_reference,
                         train_steps)

CADENCES = {"every3": dict(gossip_every=3), "warmup4": dict(warmup_steps=4),
            "warmup3-every2": dict(gossip_every=2, warmup_steps=3),
            # delayed_mix (awc only): each round's exchange mixed in at the next round (tests/test_delayed_mix.py)
            "delayed-every1": dict(delayed_mix=True), "delayed-every3": dict(gossip_every=3, delayed_mix=True),
            "delayed-warmup2-every2": dict(gossip_every=2, warmup_steps=2, delayed_mix=True)}


def _every_optimizer(rank, n, cadence):
    topos = {"one-peer-exp": T.make("one-peer-exp", n), "complete": T.make("complete", n)}
    modes = ["awc"] if CADENCES[cadence].get("delayed_mix") else ["awc", "atc"]
    return {(o, name, mode): run_against_reference(rank, n, o, topo, mode, steps=11, **CADENCES[cadence])
            for o, (name, topo), mode in itertools.product(OPTIMIZERS, topos.items(), modes)}


@pytest.mark.parametrize("cadence", sorted(CADENCES))
def test_cadence_matches_dense_simulation(cadence):
    assert_every_rank_close(run_ranks(_every_optimizer, 3, cadence, timeout=900))


def _wrapped_with_a_closure(rank, n, mode):
    return {mode: run_against_reference(rank, n, "wrapped-adam", T.make("ring", n), mode, steps=6, closure=True,
                                        warmup_steps=3)}


@pytest.mark.parametrize("mode", ["awc", "atc"])
def test_the_warmup_averages_the_gradients_a_closure_computes(mode):
    """Decentralized(inner).step(closure) hands the closure to the wrapped optimizer: the warm-up averaged the
    gradients found before it ran, and the wrapped optimizer stepped on the closure's local ones (the replicas
    0.25 apart after 4 warm-up steps of Adam at 2 ranks)."""
    assert_every_rank_close(run_ranks(_wrapped_with_a_closure, 3, mode, timeout=300))


def _local_steps_send_nothing(rank, n):
    model = make_model(rank)
    opt = decent_comm.DSGD(model.parameters(), lr=0.1, topology="ring", gossip_every=4, warmup_steps=2, timeout=30)
    sent = []

    def after_step(t):
        opt.synchronize()
        sent.append(opt.bytes_sent)
    train_steps(rank, model, opt, 10, after_step=after_step)
    opt.shutdown()
    return sent


def test_only_gossip_rounds_move_bytes():
    sent = run_ranks(_local_steps_send_nothing, 3, timeout=120)[0]
    grew = [t for t in range(1, 10) if sent[t] > sent[t - 1]]
    # AWC launches round r's exchange at the end of the step before it: rounds at steps 2, 6 (and 10)
    assert grew == [1, 5, 9], sent


def _resume_mid_interval(rank, n, mode):
    def build(model):
        return decent_comm.DAdamW(model.parameters(), lr=0.02, topology="one-peer-exp", mode=mode, model=model,
                                  gossip_every=3, warmup_steps=2, timeout=30)

    err, ckpt, _ = resumed_vs_straight(rank, build, 12, 7)
    other = decent_comm.DAdamW(make_model(0).parameters(), topology="one-peer-exp", gossip_every=2, warmup_steps=2,
                               timeout=30)
    try:
        other.load_state_dict(ckpt[0])
        msg = "no error"
    except ValueError as exc:
        msg = str(exc)
    other.shutdown()
    return err, msg


@pytest.mark.parametrize("mode", ["awc", "atc"])
def test_cadence_resumes_mid_interval(mode):
    for err, msg in run_ranks(_resume_mid_interval, 4, mode, timeout=300):
        assert err < 1e-6
        assert "gossip_every=3" in msg, msg


def _resume_with_consensus(rank, n, gossip_every, consensus):
    """A consensus factor other than 1 under a communication interval: the checkpoint saves the factor of the round
    in flight, which a resume must mix into that round only (it once saved a local step's 1.0, which the resume then
    mixed into the next gossip round)."""
    def build(model):
        a = decent_comm.AdaptiveConsensus(p=2, min_factor=0.2) if consensus == "adaptive" else 0.5
        return decent_comm.DSGD(model.parameters(), lr=0.05, momentum=0.9, topology="one-peer-exp", consensus=a,
                                gossip_every=gossip_every, timeout=30)

    def decay(opt):  # an lr that changes between launching a round and mixing it (AdaptiveConsensus reads it)
        return torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.7)

    def as_saved_before(opt_sd):  # before a local step, earlier versions saved its plan's factor, 1.0
        opt_sd["param_groups"][0]["decentralized"]["next_factor"] = 1.0

    def next_factor(opt):
        return opt.state_dict()["param_groups"][0]["decentralized"]["next_factor"]

    # gossip_every=2: rounds at 0, 2, 4, 6; 3: at 0, 3, 6. `stop` steps done, the next one local or a round.
    stops = {2: dict(local=5, round=4), 3: dict(local=4, local_later=5, round=6)}[gossip_every]
    results = {}
    for name, stop in stops.items():
        err, (opt_sd, _), again = resumed_vs_straight(rank, build, 12, stop, serialize=True, schedule=decay,
                                                      on_load=next_factor)
        results[name] = err, opt_sd["param_groups"][0]["decentralized"]["next_factor"], again
    # a checkpoint of an earlier version, taken before a local step, resumes exactly too
    results["local_saved_before"] = resumed_vs_straight(rank, build, 12, stops["local"], schedule=decay,
                                                        before_load=as_saved_before)[0], None, None
    return results


@pytest.mark.parametrize("consensus", ["0.5", "adaptive"])
@pytest.mark.parametrize("gossip_every", [2, 3])
def test_consensus_factor_resumes_exactly_at_local_and_gossip_steps(gossip_every, consensus):
    for results in run_ranks(_resume_with_consensus, 3, gossip_every, consensus, timeout=300):
        for name, (err, saved, again) in results.items():
            assert err == 0.0, (name, err)  # bit-exact: every factor and mix as in the straight run
            # a local step has no round in flight (old versions saved its 1.0); a checkpoint taken right after the
            # resume saves the restored factor again
            assert (saved is None) == name.startswith("local") and again == saved, (name, saved, again)


@pytest.mark.parametrize("bad", [dict(gossip_every=0), dict(gossip_every=1.5), dict(warmup_steps=-1),
                                 dict(warmup_steps=True)])
def test_cadence_arguments_checked(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        decent_comm.DSGD(torch.nn.Linear(2, 2).parameters(), lr=0.1, **bad)



class _TwoHeads(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk, self.a, self.b = torch.nn.Linear(6, 6), torch.nn.Linear(6, 1), torch.nn.Linear(6, 1)

    def forward(self, x, use_b: bool):
        h = self.trunk(x)
        return self.a(h) + self.b(h) if use_b else self.a(h)


def _warmup_with_parameters_unused_on_some_ranks(rank, n):
    torch.manual_seed(0)
    model, ref = _TwoHeads(), _TwoHeads()
    ref.load_state_dict(model.state_dict())
    ddp = torch.nn.parallel.DistributedDataParallel(ref, find_unused_parameters=True)
    opt = decent_comm.DAdamW(model.parameters(), lr=0.05, weight_decay=0.1, topology="ring", warmup_steps=6,
                             timeout=30)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.05, weight_decay=0.1)
    g = torch.Generator().manual_seed(rank)
    for t in range(6):
        x, y = torch.randn(4, 6, generator=g), torch.randn(4, 1, generator=g)
        use_b = t < 5 and (rank + t) % 3 == 0  # head b: used by some ranks at steps 0-4, by none at step 5
        for forward, o in ((model, opt), (ddp, ref_opt)):
            o.zero_grad()  # set_to_none: the flat buffer keeps older gradients, which must not be averaged in
            torch.nn.functional.mse_loss(forward(x, use_b), y).backward()
            o.step()
    return [p.detach().clone() for p in model.parameters()], [p.detach().clone() for p in ref.parameters()]


def test_warmup_averages_a_locally_unused_parameter_as_ddp_does():
    """DDP(find_unused_parameters=True) + AdamW: a parameter a rank did not use adds a zero gradient and is
    updated with the mean like everywhere; the warm-up once averaged in its stale gradient of an earlier step and
    left it alone on that rank, so the replicas parted."""
    results = run_ranks(_warmup_with_parameters_unused_on_some_ranks, 3, timeout=300)
    for rank, (ours, ddp) in enumerate(results):
        for p, q, r0 in zip(ours, ddp, results[0][0]):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {rank} vs DDP: {m}")
            torch.testing.assert_close(p, r0, rtol=0, atol=0, msg=lambda m: f"rank {rank} vs rank 0: {m}")


def test_every_plan_of_a_gossip_round_records_its_round():
    """MixPlan.topo_step is the topology step a plan mixes with (the gossip round): point-to-point, group, a = 0 and
    one-rank plans alike (the group and a = 0 plans left it None)."""
    from decent_comm.optim.plan import GroupSteps, mix_plan
    ring, complete = T.make("ring", 4), T.make("complete", 4)
    groups = GroupSteps.scan(complete, 1, 4, "auto")
    plans = {"p2p": mix_plan(ring, 1, 9, 0.5, topo_step=3),
             "group": mix_plan(complete, 1, 9, 0.5, groups, topo_step=3),
             "a=0": mix_plan(ring, 1, 9, 0.0, topo_step=3),
             "one rank": mix_plan(T.make("ring", 1), 0, 9, 1.0, topo_step=3)}
    assert plans["group"].group == (0, 1, 2, 3) and plans["p2p"].recv and plans["a=0"].silent
    assert {kind: p.topo_step for kind, p in plans.items()} == dict.fromkeys(plans, 3)
    assert mix_plan(ring, 1, 9, 0.0).topo_step == 9  # without a cadence the step is the round
