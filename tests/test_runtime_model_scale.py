"""The runtime model on large clusters: array tables against ``Topology.peers``, bounded work, and
plans of thousands of ranks in seconds (process CPU time is asserted, so a loaded machine does not
fail them; the bounds are ~10x what an idle core needs and far below what the O(n^2..n^3) code took)."""
import ast
import pathlib
import time

import numpy as np
import pytest

from decent_comm import topology as T
from decent_comm.runtime_model import ClusterConfig, ComputeTime, Workload, plan, predict, simulate
from decent_comm.runtime_model import planner as planner_mod
from decent_comm.runtime_model.gossip import make_topology
from decent_comm.runtime_model.hardware import MAX_WORLD_SIZE
from decent_comm.runtime_model.loads import links_from_groups, links_from_messages, schedule_of
from decent_comm.runtime_model.messages import MAX_MESSAGES, TooManyMessages, known_groups, step_builder
from decent_comm.runtime_model.mixing import sparse_gap_per_step
from decent_comm.topology.builtins import OnePeerExponential
from test_planner_recommendation import expected_recommendation

GBIT = 1e9 / 8
LAYOUTS = [(1, 1), (1, 2), (2, 1), (1, 3), (3, 1), (2, 2), (4, 1), (1, 5), (2, 3), (4, 2), (3, 4), (8, 2),
           (2, 8), (5, 3), (16, 1), (7, 1), (9, 1), (12, 1), (10, 3)]
VARIANTS = [(name, {}) for name in T.NAMES if name not in ("base-k", "aer")] + [
    ("aer", {}), ("aer", {"inter": "pair"}), ("base-k", {"k": 1}), ("base-k", {"k": 2}), ("base-k", {"k": 3}),
    ("base-k", {"k": 2, "simple": True})]


def cluster(nodes, L, **kw):
    return ClusterConfig(nodes, L, 25 * GBIT, 600 * GBIT, 10e-6, 3e-6, **kw)


def work(mu=0.12, sd=0.01, **kw):
    return Workload(params=65e6, compute=ComputeTime(mu, sd), **kw)


def peers_reference(topo, step):
    """Every message of a step from ``peers``, rank by rank: (self weights, src, dst, weights)."""
    selfw, src, dst, w = [], [], [], []
    for i in range(topo.world_size):
        p = topo.peers(i, step)
        selfw.append(p.self_weight)
        for j, x in p.recv:
            src.append(j)
            dst.append(i)
            w.append(x)
    return selfw, src, dst, w


def old_averaging_groups(topo, step, tol=1e-9):
    """The pre-vectorization definition (each member's sorted group compared): O(n degree^2)."""
    members = []
    for i in range(topo.world_size):
        p = topo.peers(i, step)
        g = tuple(sorted([i] + [j for j, _ in p.recv]))
        if abs(p.self_weight - 1 / len(g)) > tol or any(abs(x - 1 / len(g)) > tol for _, x in p.recv):
            return None
        members.append(g)
    if any(members[j] != g for g in members for j in g):
        return None
    return sorted(set(members))


@pytest.mark.parametrize("name,opts", VARIANTS, ids=[f"{n}{o}" for n, o in VARIANTS])
def test_array_tables_equal_peers(name, opts):
    for N, L in LAYOUTS:
        try:
            topo = T.make(name, N * L, L, **opts)
        except ValueError:
            continue
        period, build = step_builder(topo)
        assert period == topo.period
        for t in range(period):
            m = build(t)
            selfw, src, dst, w = peers_reference(topo, t)
            assert m.self_weight.tolist() == selfw and m.src.tolist() == src, (name, N, L, t)
            assert m.dst.tolist() == dst and m.weight.tolist() == w, (name, N, L, t)
            table = schedule_of(topo).steps[t]
            ref = T.averaging_groups(topo, t)
            if ref is None:
                assert table.groups is None
            else:
                members, sizes = table.groups
                got = sorted(tuple(sorted(g)) for g in np.split(members, np.cumsum(sizes)[:-1]))
                assert got == ref
            if known_groups(topo, t) is not None:   # closed-form link counts == counted from the messages
                a = links_from_groups(t, *known_groups(topo, t), N * L, L)
                b = links_from_messages(t, m.src, m.dst, N * L, L)
                for field in ("node_egress", "node_ingress", "rank_intra_send", "rank_intra_recv"):
                    assert np.array_equal(getattr(a, field), getattr(b, field)), (name, N, L, t, field)
                assert (a.messages, a.inter_messages, a.max_indegree) == (b.messages, b.inter_messages,
                                                                           b.max_indegree)


def test_hypercube_tables_are_vectorized():
    """The builder never asks ``peers`` (the per-rank path would be 2^20 x 20 Python calls here)."""
    n = 1 << 20
    topo = T.make("one-peer-hypercube", n, 8)

    def no_peers(rank, step):
        raise AssertionError("step_builder called peers")

    topo.peers = no_peers   # an instance attribute: the class (and so the vectorized path) stays the same
    t0 = time.process_time()
    period, build = step_builder(topo)
    assert period == 20
    r = np.arange(n)
    for t in (0, 3, 19):
        m = build(t)
        assert np.array_equal(m.dst, r) and np.array_equal(m.src, r ^ (1 << t))
        assert (m.self_weight == 0.5).all() and (m.weight == 0.5).all()
    assert time.process_time() - t0 < 10   # ~0.1 s on one idle core


def test_averaging_groups_on_large_schedules():
    t0 = time.process_time()
    assert T.averaging_groups(T.make("complete", 2000), 0) == [tuple(range(2000))]
    assert T.averaging_groups(T.make("complete", 2000).mixed(0.5), 0) is None   # weights 1/2 + 1/4000
    aer = T.make("aer", 8192, 8)
    for t in range(aer.period):
        groups = T.averaging_groups(aer, t)
        assert sorted(len(g) for g in groups) == [2] * 2048 + [8] * 512   # half the nodes pair up rank by rank
        if t < 3:
            assert groups == old_averaging_groups(aer, t)
    assert time.process_time() - t0 < 60    # ~4 s on one idle core; the O(n^3) version took hours


def test_averaging_groups_checks_closure_not_just_sizes():
    # every row averages 3 ranks uniformly and every row contains rank 0, yet the rows are different sets
    rows = [(0, 1, 2), (0, 1, 3), (0, 2, 4), (0, 3, 4), (0, 4, 1)]
    W = np.zeros((5, 5))
    for i, r in enumerate(rows):
        W[i, list(r)] = 1 / 3
    assert T.averaging_groups(T.from_matrix(W, allow_biased=True), 0) is None
    two_blocks = T.from_matrix(np.kron(np.eye(2), np.full((3, 3), 1 / 3)), allow_disconnected=True)  # never mixes
    assert T.averaging_groups(two_blocks, 0) == [(0, 1, 2), (3, 4, 5)]


def test_sparse_gap_matches_dense():
    for name in T.NAMES:
        for N, L in [(1, 1), (3, 1), (4, 4), (5, 3), (16, 4), (7, 1), (10, 10)]:
            try:
                topo = make_topology(name, N * L, L)
            except ValueError:
                continue
            sparse = sparse_gap_per_step(topo)
            if sparse is None:   # neither circulant nor finite-time exact
                assert name in ("torus", "one-peer-ring") and not T.finite_time_exact(topo)
            else:
                assert sparse == pytest.approx(T.spectral_gap(topo).per_step, abs=1e-9), (name, N, L)


def test_plan_of_16k_ranks():
    c, w = cluster(2048, 8), work()
    t0 = time.process_time()
    p = plan(c, w)
    assert time.process_time() - t0 < 120   # ~6 s on one idle core
    assert [x.name for x in p.candidates] == ["allreduce", *planner_mod.DEFAULT_TOPOLOGIES] and not p.skipped
    gap = {x.name: x.gap_per_step for x in p.candidates}
    assert gap["ring"] < 1e-6 and gap["torus"] is None
    assert all(gap[name] == 1.0 for name in ("aer", "aer-pair", "base-k", "complete", "one-peer-exp",
                                             "one-peer-hypercube"))
    assert not p.candidate("ring").eligible
    # the array path gives what the per-rank peers path gives
    generic = type("Generic", (OnePeerExponential,), {"peers": lambda self, r, s: OnePeerExponential.peers(self, r, s)})
    slow = generic(16384, 8)
    assert predict(c, w, slow) == predict(c, w, make_topology("one-peer-exp", 16384, 8))


def test_complete_on_100k_ranks_is_one_group_allreduce():
    """As the seed library runs it (group-allreduce): decent_comm's optimizers look for averaging groups only up to
    65,536 ranks x steps, so under exchange auto they refuse it (tests/test_runtime_model_mix_width.py)."""
    c, w = cluster(12500, 8), work(mu=0.12, sd=0.0, exchange="group-allreduce")
    B, N, L, k = w.bytes_per_rank, 12500, 8, w.buckets  # one all-reduce per bucket
    c_g = (2 * (L - 1) / L * B / c.intra_bandwidth + k * 2 * (L - 1) * c.intra_latency
           + 2 * (N - 1) / N * B / c.inter_bandwidth + k * 2 * (N - 1) * c.inter_latency)
    t0 = time.process_time()
    p = plan(c, w, ["complete"])
    assert time.process_time() - t0 < 60
    assert p.candidate("complete").prediction.step_seconds == pytest.approx(max(0.12, c_g), rel=1e-12)
    assert p.candidate("complete").gap_per_step == 1.0
    # the recipes run as the optimizers do, point to point here (10^10 messages a step): not priced, and said so
    assert not any(q.kind.family == "gossip" for q in p.quality)
    assert any("int8 wire recipes not priced on complete" in note for note in p.notes)
    p = plan(c, w.with_(exchange="auto"), ["complete"])
    assert [x.name for x in p.candidates] == ["allreduce"] and "period x ranks" in dict(p.skipped)["complete"]


def test_dense_point_to_point_is_skipped_not_built():
    n = 4100
    assert n * (n - 1) > MAX_MESSAGES
    p = plan(cluster(1025, 4), work(exchange="p2p"), ["complete", "ring"], run_simulation=False)
    assert [x.name for x in p.candidates] == ["allreduce", "ring"]
    # 4099 neighbours a mix: the optimizers refuse it, so the plan skips it before counting its messages
    assert p.skipped[0][0] == "complete" and "refuse it" in p.skipped[0][1]
    with pytest.raises(TooManyMessages, match="messages per step"):
        predict(cluster(1025, 4), work(exchange="p2p"), "complete")


def test_simulation_steps_are_bounded(monkeypatch):
    monkeypatch.setattr(planner_mod, "MAX_SIM_WORK", 100_000)   # 1/20 of the real budget: a quicker test
    c, w = cluster(2, 2), work()
    p = plan(c, w, ["ring"], simulate_steps=10 ** 9, warmup=10)
    for x in p.candidates:
        assert x.simulated.steps * c.world_size <= planner_mod.MAX_SIM_WORK
        assert x.simulated.step_seconds == pytest.approx(x.prediction.step_seconds, rel=0.05)
    assert any("ring: simulated" in note and "simulation budget" in note for note in p.notes)


def test_over_budget_plans_are_closed_form(monkeypatch):
    monkeypatch.setattr(planner_mod, "MAX_SIM_COST", 1000)
    p = plan(cluster(4, 4), work(), ["ring", "one-peer-exp", "complete"])
    assert all(x.simulated is None for x in p.candidates)
    assert "closed-form" in p.rule and any("not simulated" in note for note in p.notes)
    assert p.recommended == expected_recommendation(p)


def test_cluster_size_is_bounded():
    with pytest.raises(ValueError, match="at most"):
        ClusterConfig(MAX_WORLD_SIZE, 2, GBIT, GBIT)


def test_plan_ignores_local_world_size_environment(monkeypatch):
    before = plan(cluster(4, 4), work(), ["aer", "ring"], run_simulation=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    make_topology.cache_clear()
    planner_mod.gap_per_step.cache_clear()
    assert plan(cluster(4, 4), work(), ["aer", "ring"], run_simulation=False) == before


def test_runtime_model_runs_nothing():
    """The runtime model predicts only: none of its modules imports torch (measurement lives in the CLI)."""
    root = pathlib.Path(__file__).resolve().parents[1] / "decent_comm" / "runtime_model"
    for path in root.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n.split(".")[0] == "torch" for n in names), (path.name, names)


def test_simulate_takes_a_topology_name_as_predict_does():
    """simulate(cluster, workload, "ring") failed with AttributeError ('str' has no world_size)."""
    c, w = cluster(2, 2), work(sd=0.0)
    assert simulate(c, w, "ring", steps=60, warmup=5).step_seconds == pytest.approx(
        predict(c, w, "ring").step_seconds, rel=1e-9)
    with pytest.raises(ValueError, match="unknown topology 'ring-x'"):
        simulate(c, w, "ring-x")
    with pytest.raises(ValueError, match="cluster is 2 nodes x 2 ranks"):
        simulate(c, w, make_topology("ring", 8, 4))
