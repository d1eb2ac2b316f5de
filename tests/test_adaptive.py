"""Adaptive communication (issue 8): the fused kernels' disagreement output as the optimizers report it,
replica_variance, and Adaptive topologies switching during training, on real multi-process gloo groups.

Every expectation comes from an independent computation: the float64 dense simulation of all ranks
(tests/optim_reference.py) driven by a schedule written out here (not by the Adaptive object), the replicas
gathered and reduced directly in float64, closed-form gains, or decisions recomputed in the parent process
from the same random draws the ranks used.
"""


import numpy as np
import pytest
import torch
import torch.distributed as dist

import decent_comm
from decent_comm import topology as T
from decent_comm.topology.noise import noise_model
from decent_comm.topology.policies import AdaptStats

from dist_utils import run_ranks
from optim_cases import ADAM_HP, batch, doubly_stochastic, flat_params, make_model  # noqa: F401
from optim_cases import OPTIMIZERS as ALL_OPTIMIZERS
from optim_reference import Reference

STEPS = 20
# the cases whose disagreement and schedules these tests check
OPTIMIZERS = {k: ALL_OPTIMIZERS[k] for k in ("dadamw", "dsgd-nesterov", "accumadamw", "wrapped-adam")}


class RecordingReference(Reference):
    """The dense simulation, also recording every mix's per-rank squared displacement (mixed - x_old)^2."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.mix_sq = []  # per mix: [per rank: float64 vector of (mixed - x_old)^2]

    def _mix(self, W, X):
        out = super()._mix(W, X)
        self.mix_sq.append([(o - x) ** 2 for o, x in zip(out, X)])
        return out


class Scheduled:
    """An independent reference schedule: the matrix of the named topology active at each step."""

    def __init__(self, phases, topologies):
        self.phases = phases          # [(first step, name)], sorted
        self.topologies = topologies  # name -> Topology

    def name_at(self, t):
        return [name for start, name in self.phases if start <= t][-1]

    def matrix(self, t):
        return self.topologies[self.name_at(t)].matrix(t)

    def peers(self, rank, t):
        return self.topologies[self.name_at(t)].peers(rank, t)


def bucket_param_ranges(opt, model):
    """Per bucket: the [start, stop) ranges of its parameters in the reference's concatenated flat vector."""
    offsets, off = {}, 0
    for p in model.parameters():
        offsets[id(p)] = (off, off + p.numel())
        off += p.numel()
    return [[offsets[id(s.param)] for s in b.slots] for b in opt._buckets]


def per_bucket(vec, ranges):
    return [sum(float(vec[a:b].sum()) for a, b in rs) for rs in ranges]


# ------------------------------------------------------------------------------------------ disagreement

DISAGREEMENT_CASES = [("dadamw", "awc", "ring", 1.0), ("dsgd-nesterov", "atc", "one-peer-exp", 1.0),
                      ("wrapped-adam", "awc", "exp", 1.0), ("accumadamw", "atc", "ring", 0.5)]


def disagreement_topologies(n):
    return {"ring": T.make("ring", n), "one-peer-exp": T.make("one-peer-exp", n), "exp": T.make("exp", n)}


def _disagreement(rank, n):
    """What each rank's optimizer reports after every step (the parent holds the reference)."""
    topos = disagreement_topologies(n)
    out = {}
    for opt_name, mode, topo_name, a in DISAGREEMENT_CASES:
        ctor = OPTIMIZERS[opt_name][0]
        model = make_model(rank)
        # a tiny bucket cap: one bucket per parameter, so the per-bucket values are checked too
        opt = ctor(model.parameters(), topology=topos[topo_name], mode=mode, model=model if mode == "atc" else None,
                   broadcast_init=False, consensus=a, bucket_cap_mb=1e-5, timeout=30, track_disagreement=True)
        seen = [(opt.last_disagreement, None)]  # nothing mixed yet
        for t in range(STEPS):
            x, y = batch(rank, t)
            opt.zero_grad()
            ((model(x) - y) ** 2).mean().backward()
            opt.step()
            seen.append((opt.last_disagreement, opt.disagreement(per_bucket=True)))
        out[(opt_name, mode, topo_name)] = dict(seen=seen, mean=opt.disagreement(all_reduce=True),
                                                ranges=bucket_param_ranges(opt, model))
        opt.shutdown()
    # tracking off
    model = make_model(rank)
    opt = decent_comm.DAdamW(model.parameters(), lr=0.01, topology=topos["ring"], broadcast_init=False,
                             track_disagreement=False, timeout=30)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    off = opt.last_disagreement
    with pytest.raises(RuntimeError, match="tracking is off"):
        opt.disagreement()
    opt.shutdown()
    return out, off


def test_fused_disagreement_matches_float64_reference():
    n = 3
    results = run_ranks(_disagreement, n, timeout=300)
    topos = disagreement_topologies(n)
    for opt_name, mode, topo_name, a in DISAGREEMENT_CASES:
        _, kind, hp = OPTIMIZERS[opt_name]
        ref = RecordingReference(make_model(0), [flat_params(make_model(s)) for s in range(n)], topos[topo_name], mode,
                                 kind, hp, consensus=a)
        for t in range(STEPS):
            ref.step([batch(r, t) for r in range(n)])
        key = (opt_name, mode, topo_name)
        for rank, (out, off) in enumerate(results):
            assert off == 0.0
            r = out[key]
            ranges = r["ranges"]
            assert len(ranges) == 4 and r["seen"][0][0] == 0.0
            err = 0.0
            for t in range(STEPS):
                # awc: step t mixed x^t; atc: step t applied the mix launched at step t - 1, before its update
                k = t if mode == "awc" else t - 1
                if k < 0:
                    continue
                want = ref.mix_sq[k][rank]
                total, buckets = r["seen"][t + 1]
                for g, w in zip([total] + buckets, [float(want.sum())] + per_bucket(want, ranges)):
                    err = max(err, abs(g - w) / (abs(w) + 1e-7))
            k = STEPS - 1 if mode == "awc" else STEPS - 2
            want_mean = sum(float(v.sum()) for v in ref.mix_sq[k]) / n
            err = max(err, abs(r["mean"] - want_mean) / want_mean)
            assert err < 1e-4, f"rank {rank}, {key}: disagreement deviates from the float64 reference by {err:.2e}"


# -------------------------------------------------------------------------------------- replica variance

def _replica_variance(rank, n):
    return {mode: _replica_variance_mode(rank, n, mode) for mode in ("awc", "atc")}


def _replica_variance_mode(rank, n, mode):
    model = make_model(rank)
    opt = decent_comm.DAdamW(model.parameters(), lr=0.05, topology="one-peer-exp", mode=mode, broadcast_init=False,
                             bucket_cap_mb=1e-5, timeout=30)
    out = []
    for t in range(7):
        x, y = batch(rank, t)
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
        rv = opt.replica_variance(every=3, names=model)
        if rv is None:
            out.append((opt._schedule.t, None))
            continue
        # the reference: every replica gathered, statistics straight from the definitions, in float64
        mine = [p.detach().double().reshape(-1).clone() for p in model.parameters()]
        gathered = []
        for v in mine:
            parts = [torch.empty_like(v) for _ in range(n)]
            dist.all_gather(parts, v)
            gathered.append(torch.stack(parts))  # (n, numel)
        want = {}
        for (name, _), X, v in zip(model.named_parameters(), gathered, mine):
            want[name] = dict(variance=float(X.var(0, unbiased=False).mean()), norm=float(v.norm()),
                              norm_rms=float(X.norm(dim=1).pow(2).mean().sqrt()), avg_norm=float(X.mean(0).norm()),
                              numel=X.shape[1])
        out.append((opt._schedule.t, (rv, want, opt.consensus_distance())))
    opt.shutdown()
    return out


def test_replica_variance_matches_gathered_replicas():
    results = run_ranks(_replica_variance, 3, timeout=120)
    for rank, mode, out in [(r, m, res[m]) for r, res in enumerate(results) for m in res]:
        assert [t for t, v in out if v is not None] == [3, 6], out  # due every 3 steps, None otherwise
        for t, v in out:
            if v is None:
                continue
            rv, want, cd = v
            assert list(rv) == list(want)  # names and order from the model
            for name, w in want.items():
                for key, val in w.items():
                    assert rv[name][key] == pytest.approx(val, rel=1e-9, abs=1e-15), (mode, rank, t, name, key)
            total = sum(r["variance"] * r["numel"] for r in rv.values())
            assert total == pytest.approx(cd, rel=1e-6), (total, cd)
            assert total > 0


# ------------------------------------------------------------------------------- forced switch sequence

PHASES = [(0, "complete"), (3, "one-peer-exp"), (7, "custom"), (10, "ring"), (13, "complete"), (15, "one-peer-exp")]


def candidate_topologies(n):
    return {"one-peer-exp": T.make("one-peer-exp", n), "ring": T.make("ring", n), "complete": T.make("complete", n),
            "custom": T.from_matrix([doubly_stochastic(n, 1), doubly_stochastic(n, 2)])}


def uniform_group(W, rank):
    """The group rank averages uniformly with at step W (every member takes 1/|G| of every member), else None."""
    support = lambda i: tuple(np.flatnonzero(W[i] > 1e-12))
    g = support(rank)
    if any(abs(W[rank, j] - 1 / len(g)) > 1e-9 for j in g) or any(support(j) != g for j in g):
        return None
    return g


def expected_bytes(schedule, rank, steps, bucket_bytes):
    """Point to point: one buffer per send peer; a uniform averaging group of >= 3 ranks is one all-reduce,
    2 (|G| - 1) / |G| buffers (decent_comm.optim.plan.GroupSteps)."""
    total = 0
    for t in steps:
        g = uniform_group(np.asarray(schedule.matrix(t)), rank)
        if g is not None and len(g) >= 3:
            total += sum(2 * (len(g) - 1) * nb // len(g) for nb in bucket_bytes)
        else:
            total += len(schedule.peers(rank, t).send) * sum(bucket_bytes)
    return total


FORCED_CASES = [("dadamw", "awc"), ("dsgd-nesterov", "atc"), ("wrapped-adam", "awc"), ("accumadamw", "atc"),
                ("dadamw", "force")]


def forced_phases(mode):
    if mode == "force":  # plus switches forced by hand at steps 17 (ring) and 19 (complete); the phase policy,
        # consulted every step, takes the step after each forced one back to its own choice
        return PHASES + [(17, "ring"), (18, "one-peer-exp"), (19, "complete"), (20, "one-peer-exp")]
    return PHASES


def _forced(rank, n):
    topos = candidate_topologies(n)
    spec = T.Adaptive(list(topos.values()), T.PhaseSchedule([(name, start) for start, name in PHASES]))
    out = {}
    for opt_name, mode in FORCED_CASES:
        model = make_model(rank)
        real_mode = "awc" if mode == "force" else mode
        opt = OPTIMIZERS[opt_name][0](model.parameters(), topology=spec, mode=real_mode, broadcast_init=False,
                                      model=model if real_mode == "atc" else None, timeout=30)
        assert opt.topology is not spec and spec.history == [(0, spec.index_of("complete"))]
        names = []
        for t in range(STEPS):
            if mode == "force" and t == 16:  # awc: the end of step 16 decides step 17, so force before it
                opt.topology.force(17, "ring")
            if mode == "force" and t == 18:
                opt.topology.force(19, "complete")
            x, y = batch(rank, t)
            opt.zero_grad()
            ((model(x) - y) ** 2).mean().backward()
            opt.step()
            names.append(opt.topology.topology_at(t).name)
        opt.synchronize()
        out[(opt_name, mode)] = dict(x=flat_params(model).double(), schedule=opt.topology.schedule(), names=names,
                                     bytes=opt.bytes_sent,
                                     bucket_bytes=[b.numel * b.flat.element_size() for b in opt._buckets])
        opt.shutdown()
    return out


def test_forced_switch_sequence_matches_dense_simulation():
    n = 4
    results = run_ranks(_forced, n, timeout=300)
    topos = candidate_topologies(n)
    for opt_name, mode in FORCED_CASES:
        phases = forced_phases(mode)
        ref_sched = Scheduled(phases, topos)
        real_mode = "awc" if mode == "force" else mode
        _, kind, hp = OPTIMIZERS[opt_name]
        ref = Reference(make_model(0), [flat_params(make_model(s)) for s in range(n)], ref_sched, real_mode, kind, hp)
        for t in range(STEPS):
            ref.step([batch(r, t) for r in range(n)])
        launched = range(STEPS + 1) if real_mode == "awc" else range(STEPS)  # awc also launched x^{STEPS}
        for rank, out in enumerate(results):
            r = out[(opt_name, mode)]
            err = (r["x"] - ref.X[rank]).abs().max().item()
            assert err < 1e-5, (rank, opt_name, mode, err)
            assert r["schedule"] == phases, (rank, opt_name, mode)
            assert r["names"] == [ref_sched.name_at(t) for t in range(STEPS)], (rank, opt_name, mode)
            # on the wire: what the scheduled topology needs at every step, nothing else
            assert r["bytes"] == expected_bytes(ref_sched, rank, launched, r["bucket_bytes"]), (rank, opt_name, mode)


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
        for t in range(STEPS):
            x, y = batch(rank, t)
            opt.zero_grad()
            ((model(x) - y) ** 2).mean().backward()
            opt.step()
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
    for t in range(STEPS):
        x, y = batch(rank, t)
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
        local.append(opt.last_disagreement)
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
        for t in range(start, stop):
            x, y = batch(rank, t)
            opt.zero_grad()
            ((model(x) - y) ** 2).mean().backward()
            opt.step()
            sched.step()
            log.append((t, opt.topology.policy.last))

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


# ----------------------------------------------------------------------------------- single process

def test_noise_model_closed_forms():
    # complete graph: the update noise is all that remains, Xi^2 = (n - 1) / n per unit of noise; exact estimator
    for n in (2, 5, 8):
        gain, bias = noise_model(T.make("complete", n))
        assert gain == pytest.approx((n - 1) / n) and bias == pytest.approx(1.0)
    # two ranks mixing with weight w: delta = x1 - x2 follows delta' = (1 - 2w) delta + e, Var e = 2, so
    # Xi^2 = Var(delta) / 4 = 1 / (2 (1 - (1 - 2w)^2)); D/c = delta^2 / 2 makes the estimator exact too
    for w in (0.1, 0.25, 0.4):
        gain, bias = noise_model(T.from_matrix([[1 - w, w], [w, 1 - w]]))
        assert gain == pytest.approx(1 / (2 * (1 - (1 - 2 * w) ** 2)), rel=1e-6) and bias == pytest.approx(1.0)
        # noise autocorrelated across steps (AR(1), coefficient c): the AR(1)-filtered variance
        # Var(delta) = 2 (1 + a c) / ((1 - a^2) (1 - a c)), a = 1 - 2w
        for c in (0.5, 0.9):
            a = 1 - 2 * w
            gain, bias = noise_model(T.from_matrix([[1 - w, w], [w, 1 - w]]), correlation=c)
            assert gain == pytest.approx(0.5 * (1 + a * c) / ((1 - a * a) * (1 - a * c)), rel=1e-6)
            assert bias == pytest.approx(1.0)
    assert noise_model(T.make("complete", 8), correlation=0.9)[0] == pytest.approx(7 / 8)


def stats(step, q_times_gamma, step_sq=1.0, lr=1.0):
    return AdaptStats(step=step, lr=lr, consensus_sq=q_times_gamma, step_sq=step_sq, window=4)


def test_consensus_control_decisions():
    w = 0.1
    slow = T.from_matrix([[1 - w, w], [w, 1 - w]])  # gain 1 / (2 (1 - 0.64)) = 1.3889; complete: 0.5
    g_slow, g_complete = 1 / (2 * (1 - (1 - 2 * w) ** 2)), 0.5
    # independent steps (correlation 0): the closed-form gains above
    a = T.Adaptive([slow, T.make("complete", 2)], T.ConsensusControl(kappa=2.0, interval=5, min_dwell=5,
                                                                       correlation=0.0))
    assert a.names == ["custom", "complete"] and a.current_name == "complete"  # equal costs: given order kept
    assert a.costs == [1.0, 1.0]
    a.costs = [1.0, 2.0]  # as if complete were dearer: moves to a sparser graph must save bytes
    pol = a.policy
    # Gamma^2 = kappa * step_sq * lr_peak / lr; at the peak lr: Gamma^2 = 2. q = 0.45: comfortably below, but the
    # slow graph would give q * g_slow / g_complete = 1.25 > (low + high) / 2: stay
    assert not a.advance(5, lambda: stats(5, 0.9))
    assert pol.last[0] == pytest.approx(0.45)
    # q = 0.2 -> predicted 0.556 <= 0.75: go sparser
    assert a.advance(10, lambda: stats(10, 0.4)) and a.current_name == "custom"
    # within the band [0.5, 1]: stay; above: denser; the learning rate halves: Gamma^2 doubles
    assert not a.advance(15, lambda: stats(15, 1.9))
    assert a.advance(20, lambda: stats(20, 2.2)) and a.current_name == "complete"
    assert pol.last[0] == pytest.approx(1.1)
    assert not a.advance(25, lambda: stats(25, 1.2, lr=0.5))  # q = 1.2 / 4 = 0.3 -> predicted 0.83: stay
    assert a.advance(30, lambda: stats(30, 1.0, lr=0.5)) and a.current_name == "custom"  # 0.25 -> 0.69
    assert pol.lr_peak == 1.0
    # min_dwell: a decision right after a switch keeps the candidate whatever q is
    b = T.Adaptive([slow, T.make("complete", 2)], T.ConsensusControl(interval=1, min_dwell=3, correlation=0.0))
    b.costs = [1.0, 2.0]
    assert not b.advance(1, lambda: stats(1, 0.01)) and not b.advance(2, lambda: stats(2, 0.01))
    assert b.advance(3, lambda: stats(3, 0.01)) and b.current_name == "custom"
    assert not b.advance(4, lambda: stats(4, 100.0)) and not b.advance(5, lambda: stats(5, 100.0))
    assert b.advance(6, lambda: stats(6, 100.0)) and b.current_name == "complete"
    assert b.schedule() == [(0, "complete"), (3, "custom"), (6, "complete")]
    # a sparser graph that saves nothing is never taken; above the band the cheapest adequate one is
    c = T.Adaptive([slow, T.make("complete", 2)], T.ConsensusControl(interval=1, min_dwell=1, correlation=0.0))
    assert not c.advance(1, lambda: stats(1, 0.01))
    c.costs = [2.0, 1.0]  # complete cheaper and better: the slow graph is dominated
    c.force(2, "custom")
    assert c.advance(3, lambda: stats(3, 0.01)) and c.current_name == "complete"
    assert g_slow > g_complete


def test_adaptive_spec_binding_and_state():
    a = T.make("adaptive:consensus:complete,one-peer-exp,exp:kappa=2,interval=5", 8)
    assert a.names == ["one-peer-exp", "exp", "complete"]  # sorted by buffers sent per step
    assert a.costs == [1.0, 3.0, 7.0]
    assert a.policy.kappa == 2.0 and a.policy.interval == 5 and a.current_name == "complete"
    p = T.make("adaptive:phase:complete@0,one-peer-exp@10,complete@30", 8)
    for s in range(1, 40):
        p.advance(s)
    assert p.schedule() == [(0, "complete"), (10, "one-peer-exp"), (30, "complete")]
    assert p.topology_at(12).peers(0, 12) == T.make("one-peer-exp", 8).peers(0, 12)
    assert np.array_equal(p.matrix(35), T.make("complete", 8).matrix(35))
    # the fingerprint is the configuration, not the decisions; the state round-trips
    fresh = T.make("adaptive:phase:complete@0,one-peer-exp@10,complete@30", 8)
    assert fresh.fingerprint() == p.fingerprint() != a.fingerprint()
    fresh.load_state_dict(p.state_dict())
    assert fresh.schedule() == p.schedule() and fresh.decided == 39
    # an unbound spec; bind() gives independent copies
    spec = T.Adaptive(["ring", "complete"], T.PhaseSchedule({"complete": (0, 5), "ring": (5, None)}))
    with pytest.raises(RuntimeError, match="not bound"):
        spec.peers(0, 0)
    b1, b2 = spec.bind(4), spec.bind(4)
    b1.advance(5)
    assert b1.current_name == "ring" and b2.current_name == "complete" and b1.policy is not b2.policy
    with pytest.raises(ValueError, match="already decided"):
        b1.force(3, "complete")
    # parse errors: tests/test_topology_spec.py
    with pytest.raises(ValueError, match="contiguous"):
        T.PhaseSchedule({"complete": (0, 5), "ring": (6, None)})
    with pytest.raises(ValueError, match="not a candidate"):
        T.Adaptive(["ring"], T.PhaseSchedule([("complete", 0)]), world_size=4)


def test_single_process_is_torch_with_adaptive_topology():
    model = make_model(0)
    twin = make_model(0)
    opt = decent_comm.DAdamW(model.parameters(), **ADAM_HP, topology="adaptive:consensus:ring,complete:interval=2")
    ref = torch.optim.AdamW(twin.parameters(), **ADAM_HP)
    for t in range(5):
        for m, o in ((model, opt), (twin, ref)):
            x, y = batch(0, t)
            o.zero_grad()
            ((m(x) - y) ** 2).mean().backward()
            o.step()
    assert torch.allclose(flat_params(model), flat_params(twin), atol=1e-6)
    assert opt.last_disagreement == 0.0 and opt.bytes_sent == 0
    rv = opt.replica_variance()
    assert all(v["variance"] == 0.0 for v in rv.values()) and list(rv) == ["group0.param0", "group0.param1",
                                                                           "group0.param2", "group0.param3"]
