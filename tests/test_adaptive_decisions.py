"""Adaptive topologies on real multi-process gloo groups: every rank takes the same decision at the same step
(recomputed in the parent process from the same random draws the ranks used), and a run resumed after a switch
continues identically (against the float64 dense simulation driven by a schedule written out here)."""

import torch

import decent_comm
from decent_comm import topology as T

from adaptive_cases import OPTIMIZERS, STEPS, Scheduled, candidate_topologies
from dist_utils import run_ranks
from optim_cases import ADAM_HP, batch, flat_params, make_model, train_steps
from optim_reference import Reference

# ----------------------------------------------------------------------- same decision on every rank

class ThresholdPolicy(T.Policy):
    """Test policy: candidate = floor(consensus_sq * number of candidates), clipped, every 2 steps."""

    needs_stats = True
    interval = 2

    def initial(self, adaptive):
        return 0

    def decide(self, step, stats, current, adaptive):
        k = len(adaptive.candidates)
        return min(k - 1, max(0, int(stats.consensus_sq * k)))


def random_local_stats(rank, t):
    g = torch.Generator().manual_seed(7919 * rank + 104729 * t + 1)
    v = torch.rand(3, generator=g, dtype=torch.float64)
    return [float(v[0]) * 2.0, 1.0 + float(int(v[1] * 3)), float(v[2])]  # [sum, count, step_sq]


def expected_random_schedule(n, steps, interval, k):
    """The decisions ThresholdPolicy must take, from the same draws, computed here in the parent."""
    sched, cur = [(0, 0)], 0
    for s in range(interval, steps + 1, interval):
        vals = [random_local_stats(r, s) for r in range(n)]
        consensus_sq = sum(v[0] for v in vals) / sum(v[1] for v in vals)
        new = min(k - 1, max(0, int(consensus_sq * k)))
        if new != cur:
            sched.append((s, new))
            cur = new
    return sched


def _same_decisions(rank, n):
    topos = candidate_topologies(n)
    out = {}
    for mode in ["awc", "atc"]:
        model = make_model(rank)
        opt = decent_comm.DAdamW(model.parameters(), lr=0.01, mode=mode, broadcast_init=False, timeout=30,
                                 topology=T.Adaptive(list(topos.values()), ThresholdPolicy()))
        opt._schedule.adaptive._local_stats = lambda: torch.tensor(random_local_stats(rank, opt._schedule.t)
                                                                   + [opt._lr0()], dtype=torch.float64)
        train_steps(rank, model, opt, STEPS)
        opt.synchronize()
        out[mode] = opt.topology.history
        opt.shutdown()

    # the real statistics: ConsensusControl on the kernels' disagreement; the ranks' own values differ, the
    # decisions may not. The recorded schedule then drives the dense simulation, which the run must match.
    models = [make_model(seed) for seed in range(n)]
    model = models[rank]
    policy = T.ConsensusControl(kappa=0.05, low=0.9, high=1.0, interval=2, min_dwell=2, initial="sparsest")
    opt = decent_comm.DAdamW(model.parameters(), weight_decay=0.1, **ADAM_HP, broadcast_init=False, timeout=30,
                             topology=T.Adaptive(["one-peer-exp", "ring", "complete"], policy))
    local = []
    train_steps(rank, model, opt, STEPS, after_step=lambda t: local.append(opt.last_disagreement))
    opt.synchronize()
    out["consensus"] = (opt.topology.schedule(), flat_params(model).double(), local)
    opt.shutdown()
    return out


def test_all_ranks_switch_at_the_same_step():
    n = 4
    results = run_ranks(_same_decisions, n, timeout=300)
    want = expected_random_schedule(n, STEPS, ThresholdPolicy.interval, len(candidate_topologies(n)))
    assert len(want) >= 4  # the draws do make it switch several times
    for mode in ["awc", "atc"]:
        for rank, r in enumerate(results):
            # awc decides step s at the end of step s - 1, atc during step s: the same steps, the same draws
            got = r[mode]
            assert got == want[:len(got)] and len(got) >= len(want) - 1, (mode, rank, got, want)

    schedule = results[0]["consensus"][0]
    assert len(schedule) >= 2, schedule  # it switched at least once
    for r in results:
        assert r["consensus"][0] == schedule
    assert len({tuple(round(v, 12) for v in r["consensus"][2]) for r in results}) == n  # the local values differ
    topos = {"one-peer-exp": T.make("one-peer-exp", n), "ring": T.make("ring", n), "complete": T.make("complete", n)}
    ref = Reference(make_model(0), [flat_params(make_model(s)) for s in range(n)], Scheduled(schedule, topos), "awc",
                    "adamw", dict(weight_decay=0.1, **ADAM_HP))
    for t in range(STEPS):
        ref.step([batch(r, t) for r in range(n)])
    for rank, r in enumerate(results):
        assert (r["consensus"][1] - ref.X[rank]).abs().max().item() < 1e-5


# ---------------------------------------------------------------------------------------------- resume

def alternating_target(stats, policy):
    """Gamma^2 from the measured statistics: q = 3 on steps 0-5 mod 12 (go denser), 0.2 otherwise (sparser)."""
    return stats.consensus_sq / (3.0 if (stats.step // 6) % 2 == 0 else 0.2)


def _resume(rank, n):
    return {case: _resume_case(rank, n, *case) for case in [("awc", "dadamw"), ("atc", "wrapped-adam")]}


def _resume_case(rank, n, mode, opt_name):
    ctor = OPTIMIZERS[opt_name][0]

    def build(model):
        policy = T.ConsensusControl(interval=3, min_dwell=3, target=alternating_target, initial="sparsest")
        return ctor(model.parameters(), topology=T.Adaptive(["one-peer-exp", "ring", "complete"], policy), mode=mode,
                    model=model, timeout=30)

    def train(model, opt, sched, start, stop, log):
        def after_step(t):
            sched.step()
            log.append((t, opt.topology.policy.last))
        train_steps(rank, model, opt, stop - start, start, after_step)

    model = make_model(rank)
    opt = build(model)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.7)
    straight_log = []
    train(model, opt, sched, 0, 20, straight_log)
    opt.synchronize()
    straight = (flat_params(model), opt.topology.schedule())
    opt.shutdown()

    model = make_model(rank)
    opt = build(model)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.7)
    train(model, opt, sched, 0, 10, [])  # switches at 3 and 6; the window of the decision at 12 has begun
    assert len(opt.topology.history) >= 2
    opt_state = opt.state_dict()  # first: in atc mode it applies the pending mix to the parameters
    ckpt = dict(model={k: v.clone() for k, v in model.state_dict().items()}, opt=opt_state, sched=sched.state_dict())
    opt.shutdown()

    model = make_model(100 + rank)
    opt = build(model)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.7)
    sched.load_state_dict(ckpt["sched"])
    resumed_log = []
    train(model, opt, sched, 10, 20, resumed_log)
    opt.synchronize()
    resumed = (flat_params(model), opt.topology.schedule())
    opt.shutdown()
    return dict(err=(straight[0] - resumed[0]).abs().max().item(), straight=straight[1], resumed=resumed[1],
                straight_log=straight_log[10:], resumed_log=resumed_log)


def test_resume_after_switch_continues_identically():
    results = run_ranks(_resume, 3, timeout=300)
    for case, r in [(c, res[c]) for res in results for c in res]:
        assert r["err"] == 0.0, (case, r["err"])  # bit-identical
        assert r["straight"] == r["resumed"], case
        assert [s for s, _ in r["straight"]] == [0, 3, 6, 12, 18], (case, r["straight"])  # before and after
        assert r["straight_log"] == r["resumed_log"], case  # the same statistics (restored window) at each decision
