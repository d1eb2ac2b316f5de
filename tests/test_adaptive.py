"""Adaptive communication (issue 8): the fused kernels' disagreement output as the optimizers report it,
replica_variance, and Adaptive topologies switching during training, on real multi-process gloo groups.
(The decisions every rank must share and resume: test_adaptive_decisions.py; the policies and the spec in
one process: test_adaptive_policies.py.)

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

from adaptive_cases import (OPTIMIZERS, STEPS, RecordingReference, Scheduled, bucket_param_ranges,
                            candidate_topologies, per_bucket)
from dist_utils import run_ranks
from optim_cases import batch, flat_params, make_model
from optim_reference import Reference

# ------------------------------------------------------------------------------------------ disagreement

# (optimizer, mode, topology, consensus, gossip_every): between gossip rounds the value stays the last mix's
DISAGREEMENT_CASES = [("dadamw", "awc", "ring", 1.0, 1), ("dsgd-nesterov", "atc", "one-peer-exp", 1.0, 1),
                      ("wrapped-adam", "awc", "exp", 1.0, 1), ("accumadamw", "atc", "ring", 0.5, 1),
                      ("dadamw", "awc", "ring", 1.0, 2), ("wrapped-adam", "awc", "exp", 1.0, 3),
                      ("dsgd-nesterov", "atc", "one-peer-exp", 1.0, 2)]


def disagreement_topologies(n):
    return {"ring": T.make("ring", n), "one-peer-exp": T.make("one-peer-exp", n), "exp": T.make("exp", n)}


def _disagreement(rank, n):
    """What each rank's optimizer reports after every step (the parent holds the reference)."""
    topos = disagreement_topologies(n)
    out = {}
    for case in DISAGREEMENT_CASES:
        opt_name, mode, topo_name, a, every = case
        ctor = OPTIMIZERS[opt_name][0]
        model = make_model(rank)
        # a tiny bucket cap: one bucket per parameter, so the per-bucket values are checked too
        opt = ctor(model.parameters(), topology=topos[topo_name], mode=mode, model=model if mode == "atc" else None,
                   broadcast_init=False, consensus=a, bucket_cap_mb=1e-5, timeout=30, track_disagreement=True,
                   gossip_every=every)
        seen = [(opt.last_disagreement, None)]  # nothing mixed yet
        for t in range(STEPS):
            x, y = batch(rank, t)
            opt.zero_grad()
            ((model(x) - y) ** 2).mean().backward()
            opt.step()
            seen.append((opt.last_disagreement, opt.disagreement(per_bucket=True)))
        out[case] = dict(seen=seen, mean=opt.disagreement(all_reduce=True),
                                                ranges=bucket_param_ranges(opt, model))
        opt.shutdown()
    # tracking off
    model = make_model(rank)
    opt = decent_comm.DAdamW(model.parameters(), lr=0.01, topology=topos["ring"], broadcast_init=False,
                             track_disagreement=False, timeout=30)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    off = []
    for read in (lambda: opt.last_disagreement, opt.disagreement):  # not a 0.0 that reads as perfect agreement
        with pytest.raises(RuntimeError, match="tracking is off"):
            read()
        off.append("raised")
    opt.shutdown()
    return out, off


def test_fused_disagreement_matches_float64_reference():
    n = 3
    results = run_ranks(_disagreement, n, timeout=300)
    topos = disagreement_topologies(n)
    for key in DISAGREEMENT_CASES:
        opt_name, mode, topo_name, a, every = key
        _, kind, hp = OPTIMIZERS[opt_name]
        ref = RecordingReference(make_model(0), [flat_params(make_model(s)) for s in range(n)], topos[topo_name], mode,
                                 kind, hp, consensus=a, gossip_every=every)
        for t in range(STEPS):
            ref.step([batch(r, t) for r in range(n)])
        for rank, (out, off) in enumerate(results):
            assert off == ["raised", "raised"]
            r = out[key]
            ranges = r["ranges"]
            assert len(ranges) == 4 and r["seen"][0][0] == 0.0
            err = 0.0
            for t in range(STEPS):
                # awc: step t mixed x^t; atc: step t applied the mix launched at step t - 1, before its update;
                # the last gossip round's mix, whatever local steps came since
                k = t if mode == "awc" else t - 1
                k -= k % every
                if k < 0:
                    continue
                want = ref.mix_sq[k][rank]
                assert float(want.sum()) > 0, (key, k)  # a mix, not the identity of a local step
                total, buckets = r["seen"][t + 1]
                for g, w in zip([total] + buckets, [float(want.sum())] + per_bucket(want, ranges)):
                    err = max(err, abs(g - w) / (abs(w) + 1e-7))
            k = STEPS - 1 if mode == "awc" else STEPS - 2
            k -= k % every
            want_mean = sum(float(v.sum()) for v in ref.mix_sq[k]) / n
            err = max(err, abs(r["mean"] - want_mean) / want_mean)
            assert err < 1e-4, f"rank {rank}, {key}: disagreement deviates from the float64 reference by {err:.2e}"


def _disagreement_of_split_buckets(rank, n):
    """One bucket of 3 parameters, the middle one never given a gradient: the fused call runs per segment (update,
    plain mix, update), each writing its own slot. Returns (reported, reference) per step."""
    topo = T.make("one-peer-exp", n)
    torch.manual_seed(rank)
    a, unused, c = (torch.nn.Parameter(torch.randn(k)) for k in (5, 7, 3))
    opt = decent_comm.DAdamW([a, unused, c], lr=0.05, topology=topo, broadcast_init=False, track_disagreement=True,
                             timeout=30)
    assert len(opt._buckets) == 1
    out = []
    for t in range(4):
        x = torch.cat([a.detach(), unused.detach(), c.detach()]).double()
        xs = [torch.empty_like(x) for _ in range(n)]
        dist.all_gather(xs, x)
        W = torch.from_numpy(topo.matrix(t))
        mixed = sum(W[rank, j] * xs[j] for j in range(n))  # awc: step t mixes x^t
        opt.zero_grad()
        (a.square().sum() + c.sin().sum()).backward()
        opt.step()
        out.append((opt.last_disagreement, float(opt.disagreement(per_bucket=True)[0]),
                    float((mixed - x).square().sum())))
    opt.shutdown()
    return out


def test_disagreement_sums_every_segment_of_a_bucket():
    for rank, steps in enumerate(run_ranks(_disagreement_of_split_buckets, 3, timeout=120)):
        for t, (total, bucket, want) in enumerate(steps):
            assert want > 0
            for got in (total, bucket):
                assert abs(got - want) <= 1e-5 * want, (rank, t, got, want)


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


def _utilities_let_go(rank, n, dtype):
    from decent_comm.optim import replica_watch
    replica_watch._CHUNK = 7  # several chunks per bucket (1M elements in use)
    model = make_model(rank).to(dtype)
    opt = decent_comm.DAdamW(model.parameters(), lr=0.05, topology="ring", broadcast_init=False, timeout=30)

    def steps(ts):
        for t in ts:
            x, y = (v.to(dtype) for v in batch(rank, t))
            opt.zero_grad()
            ((model(x) - y) ** 2).mean().backward()
            opt.step()

    steps(range(2))
    opt.synchronize()
    got = opt.consensus_distance()
    x = torch.cat([p.detach().double().reshape(-1) for p in model.parameters()])
    parts = [torch.empty_like(x) for _ in range(n)]
    dist.all_gather(parts, x)
    X = torch.stack(parts)
    want = float(((X - X.mean(0)) ** 2).sum(1).mean())
    rv = opt.replica_variance()
    # what the whole-group all-reduce still holds (for its HOLD_S, until the next step): no float64 model copy
    held = [(t.numel(), t.untyped_storage().nbytes()) for _, t in opt._schedule.all_reduce._held]
    after = torch.cat([p.detach().double().reshape(-1) for p in model.parameters()])  # the parameters untouched
    steps([2])  # and still trainable
    opt.shutdown()
    return got, want, held, len(rv), x.numel(), torch.equal(after, x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_collective_utilities_compute_in_chunks_and_let_go_of_their_copies(dtype):
    """float64 parameters: b.flat.double() is b.flat itself, which a version averaged in place (consensus distance
    0.0) and then freed (the next read of the parameters died of SIGSEGV)."""
    for got, want, held, tensors, numel, untouched in run_ranks(_utilities_let_go, 3, dtype, timeout=120):
        assert untouched
        assert want > 0 and got == pytest.approx(want, rel=1e-12)
        copies = [nbytes for n, nbytes in held if n >= numel]  # the float64 copies of the model each all-reduced
        assert tensors == 4 and len(copies) == 2 and copies == [0, 0], held
