"""Tests for decent_comm.topology (pure numpy; single process)."""
import math
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from decent_comm import topology as T

from topology_cases import check_schedule, divisors

SETTINGS = settings(max_examples=120, deadline=None)


# ----------------------------------------------------------------------------- helpers
def is_pow2(n):
    return n & (n - 1) == 0


def shift(n, m):
    """S^m with (S^m x)_i = x_{i-m}: row i has a 1 in column i - m (mod n)."""
    S = np.zeros((n, n))
    for i in range(n):
        S[i, (i - m) % n] = 1.0
    return S


def product(mats):
    P = np.eye(mats[0].shape[0])
    for W in mats:
        P = W @ P
    return P


@st.composite
def builtins(draw):
    name = draw(st.sampled_from(T.NAMES))
    if name in ("aer", "aer-pair"):
        L = draw(st.integers(1, 8))
        n = L * 2 ** draw(st.integers(0, 3))
        return T.make(name, n, local_world_size=L)
    if name == "one-peer-hypercube":   # defined on powers of two only
        n = 2 ** draw(st.integers(0, 6))
        return T.make(name, n, local_world_size=draw(st.sampled_from(divisors(n))))
    n = draw(st.integers(1, 64))
    L = draw(st.sampled_from(divisors(n)))
    options = {"k": draw(st.integers(1, 3))} if name == "base-k" else {}
    return T.make(name, n, local_world_size=L, **options)


def promised_exact(topo):
    n = topo.world_size
    return (n == 1 or topo.name in ("complete", "base-k", "aer", "aer-pair", "one-peer-hypercube")
            or (topo.name == "one-peer-exp" and is_pow2(n)))


# ----------------------------------------------------------------------------- properties of built-ins
@SETTINGS
@given(builtins())
def test_builtin_schedule_properties(topo):
    check_schedule(topo)
    topo.validate()


@SETTINGS
@given(builtins())
def test_builtin_mixing(topo):
    n = topo.world_size
    gap = T.spectral_gap(topo)
    if topo.name == "local" and n > 1:
        assert gap.gap == pytest.approx(0.0, abs=1e-12)
    else:
        assert gap.gap > 1e-6 and gap.per_step > 0
    if promised_exact(topo):
        assert T.finite_time_exact(topo)
        assert gap.gap == pytest.approx(1.0)
    if topo.name in ("one-peer-exp", "one-peer-hypercube", "one-peer-ring"):
        assert all(topo.peers(i, t).degree <= 1 for t in range(topo.period) for i in range(n))
    if topo.name == "base-k":
        k = topo.k
        assert all(topo.peers(i, t).degree <= k for t in range(topo.period) for i in range(n))


@pytest.mark.parametrize("k", [1, 2, 3])
def test_base_k_exact_for_every_n(k):
    for n in range(1, 65):
        for simple in (False, True):
            topo = T.make("base-k", n, k=k, simple=simple)
            assert T.finite_time_exact(topo), (n, k, simple)
            degs = [topo.peers(i, t).degree for t in range(topo.period) for i in range(n)]
            assert max(degs) <= k, (n, k, simple)
        if n == 1:
            assert topo.period == 1
        else:   # paper: O(log_{k+1} n) rounds
            assert topo.period <= 2 * math.ceil(math.log(n, k + 1) - 1e-12) + 2, (n, k)


def test_base_k_uses_its_degree_budget():
    # k = 1 on a power of two is the 1-peer hypercube: log2(n) perfect matchings
    topo = T.make("base-k", 16, k=1)
    assert topo.period == 4
    assert all(len(topo.peers(i, t).recv) == 1 for t in range(4) for i in range(16))
    topo = T.make("base-k", 27, k=2)
    assert topo.period == 3 and T.finite_time_exact(topo)
    topo = T.make("base-k", 6, k=1)   # not a power of two: still exact with one peer
    assert T.finite_time_exact(topo) and topo.period <= 2 * 3 + 2
    # a numpy integer, as world_size takes one (it was refused)
    assert T.make("base-k", 27, k=np.int64(2)).fingerprint() == T.make("base-k", 27, k=2).fingerprint()


@pytest.mark.parametrize("name", T.NAMES)
def test_world_size_one(name):
    topo = T.make(name, 1, local_world_size=1)
    assert topo.period == 1
    p = topo.peers(0, 0)
    assert (p.self_weight, p.recv, p.send) == (1.0, [], [])
    np.testing.assert_array_equal(topo.matrix(5), [[1.0]])


@pytest.mark.parametrize("name", T.NAMES)
def test_large_world_size_is_fast(name):
    best = min(_timed(lambda: T.make(name, 4096, local_world_size=8)) for _ in range(3))
    assert best < 0.05, f"make({name!r}, 4096) took {best:.3f}s"
    topo = T.make(name, 4096, local_world_size=8)
    p = topo.peers(4095, 7)
    assert p.degree <= 4095
    if name != "complete":
        best = min(_timed(lambda: topo.peers(1234, 5)) for _ in range(5))
        assert best < 1e-3


def _timed(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def test_aliases_and_names():
    assert T.make("one_peer_exp", 8).name == "one-peer-exp"
    assert T.make("One-Peer_Ring", 8).name == "one-peer-ring"
    assert T.make("BASE_K", 8, k=2).name == "base-k"
    assert set(T.NAMES) == {"complete", "ring", "one-peer-ring", "exp", "one-peer-exp", "one-peer-hypercube", "aer",
                            "aer-pair", "torus", "base-k", "local"}
    assert T.make("aer_pair", 8, local_world_size=2).inter == "pair"


# ----------------------------------------------------------------------------- independent references
@pytest.mark.parametrize("n", [2, 3, 4, 5, 7, 8, 13, 16, 31, 32, 64])
def test_exp_matches_dense_reference(n):
    tau = math.ceil(math.log2(n))
    W = (np.eye(n) + sum(np.linalg.matrix_power(shift(n, 1), 2 ** k) for k in range(tau))) / (tau + 1)
    np.testing.assert_allclose(T.make("exp", n).matrix(0), W, atol=1e-15)


@pytest.mark.parametrize("n", [2, 3, 5, 8, 12, 16, 64])
def test_one_peer_exp_matches_reference(n):
    topo = T.make("one-peer-exp", n)
    tau = math.ceil(math.log2(n))
    assert topo.period == tau
    for t in range(2 * tau):
        np.testing.assert_allclose(topo.matrix(t), (np.eye(n) + shift(n, 2 ** (t % tau))) / 2)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 9, 10])
def test_ring_matches_reference(n):
    if n >= 3:
        W = (np.eye(n) + np.roll(np.eye(n), 1, axis=1) + np.roll(np.eye(n), -1, axis=1)) / 3
    else:
        W = np.full((n, n), 1.0 / n)
    np.testing.assert_allclose(T.make("ring", n).matrix(0), W)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6, 8, 9, 12, 16, 18, 25, 36, 64])
def test_torus_matches_kron_reference(n):
    a = max(d for d in divisors(n) if d * d <= n)
    b = n // a

    def cyc(m):
        return np.roll(np.eye(m), 1, axis=1) + np.roll(np.eye(m), -1, axis=1)

    A = (np.kron(cyc(a), np.eye(b)) + np.kron(np.eye(a), cyc(b))) > 0
    np.fill_diagonal(A, False)
    deg = A.sum(axis=1)
    assert (deg == deg[0]).all()
    W = (np.eye(n) + A) / (deg[0] + 1)
    np.testing.assert_allclose(T.make("torus", n).matrix(0), W)
    if a >= 3:
        assert np.isclose(W[0, 0], 1 / 5)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 7, 8])
def test_one_peer_ring_matches_reference(n):
    topo = T.make("one-peer-ring", n)
    for t in range(4):
        pairs = [(i, i + 1) for i in range(t % 2, n - 1, 2)]
        if t % 2 == 1 and n % 2 == 0:
            pairs.append((n - 1, 0))   # wrap-around; for n = 2 the same pair as (0, 1)
        W = np.eye(n)
        for i, j in pairs:
            W[i, i] = W[j, j] = W[i, j] = W[j, i] = 0.5
        np.testing.assert_array_equal(topo.matrix(t), W)


def aer_reference(N, L, t):
    """Dense W(t) of aer built from its documented schedule with Kronecker blocks."""
    d = int(math.log2(N))
    s, h = (t % (2 * d)) // 2, t % 2
    A, B = np.zeros((N, N)), np.zeros((N, N))
    for u in range(N):
        v = u ^ (1 << s)
        inter = h != ((u >> ((s + 1) % d)) & 1 if d >= 2 else 0)
        if inter:
            A[u, u] = A[u, v] = 0.5
        else:
            B[u, u] = 1.0
    return np.kron(A, np.eye(L)) + np.kron(B, np.full((L, L), 1.0 / L))


@pytest.mark.parametrize("N,L", [(2, 1), (2, 3), (4, 1), (4, 2), (8, 4), (16, 2), (32, 1)])
def test_aer_matches_reference_and_is_exact(N, L):
    topo = T.make("aer", N * L, local_world_size=L)
    d = int(math.log2(N))
    assert topo.period == 2 * d
    for t in range(2 * topo.period):
        np.testing.assert_allclose(topo.matrix(t), aer_reference(N, L, t))
    assert T.finite_time_exact(topo)


@pytest.mark.parametrize("N,L", [(2, 1), (2, 3), (4, 2), (8, 4), (16, 2)])
def test_aer_pair_averages_whole_node_pairs_in_groups(N, L):
    """inter="pair": the inter-node step averages all 2L ranks of a node pair (Kronecker reference), and every
    step is uniform averaging within groups (nodes or node pairs) that averaging_groups reports."""
    topo = T.make("aer", N * L, local_world_size=L, inter="pair")
    assert topo.period == 2 * int(math.log2(N)) and topo.name == "aer-pair"
    for t in range(topo.period):
        ref = aer_reference(N, L, t)
        # the counterpart schedule's inter block J_2 (x) I_L becomes J_2 (x) J_L
        W = np.zeros_like(ref)
        groups = []
        for u in range(N):
            inter = topo.uses_inter(u, t)
            v = topo.node_partner(u, t) if inter else u
            members = sorted(set(range(u * L, u * L + L)) | set(range(v * L, v * L + L)))
            W[np.ix_(range(u * L, u * L + L), members)] = 1.0 / len(members)
            groups.append(tuple(members))
        np.testing.assert_allclose(topo.matrix(t), W)
        # the same node pairing and phases as the default (counterpart) schedule
        np.testing.assert_array_equal((ref > 0) & (W > 0), ref > 0)
        assert T.averaging_groups(topo, t) == sorted(set(groups))
    assert T.finite_time_exact(topo)


def test_averaging_groups_of_builtins():
    assert T.averaging_groups(T.make("complete", 5), 0) == [tuple(range(5))]
    assert T.averaging_groups(T.make("local", 3), 0) == [(0,), (1,), (2,)]  # W = I: singletons
    assert T.averaging_groups(T.make("ring", 3), 0) == [(0, 1, 2)]  # 1/3 each: J_3
    assert T.averaging_groups(T.make("ring", 5), 0) is None
    assert T.averaging_groups(T.make("one-peer-exp", 8), 0) is None  # a shift, not pairs
    assert T.averaging_groups(T.make("one-peer-ring", 4), 0) == [(0, 1), (2, 3)]
    with pytest.raises(ValueError, match="inter must be one of"):
        T.make("aer", 8, local_world_size=2, inter="all")


@pytest.mark.parametrize("N,L", [(2, 2), (4, 2), (4, 4), (8, 3), (16, 2)])
def test_aer_traffic_only_in_advertised_steps(N, L):
    topo = T.make("aer", N * L, local_world_size=L)
    seen_inter = seen_intra = False
    for t in range(topo.period):
        W = topo.matrix(t)
        advertised = set(topo.inter_pairs(t))
        inter_nodes = {u for pair in advertised for u in pair}
        found = set()
        for i in range(N * L):
            for j in range(N * L):
                if i != j and W[i, j] > 0:
                    u, v = i // L, j // L
                    if u != v:
                        found.add((min(u, v), max(u, v)))
                        assert j % L == i % L  # counterpart of the same local rank
                    else:
                        assert u not in inter_nodes  # no intra traffic on a node doing inter
                        seen_intra = True
        assert found == advertised
        seen_inter |= bool(found)
        # every node does exactly one of the two
        for u in range(N):
            assert topo.uses_inter(u, t) == (u in inter_nodes)
            assert topo.uses_inter(topo.node_partner(u, t), t) == topo.uses_inter(u, t)
        if N >= 4:
            assert len(advertised) == N // 4  # half of the N/2 node pairs
    assert seen_inter and seen_intra


def test_aer_one_node_is_complete():
    topo = T.make("aer", 6, local_world_size=6)
    assert topo.period == 1
    np.testing.assert_allclose(topo.matrix(0), np.full((6, 6), 1 / 6))


def test_complete_and_local():
    np.testing.assert_allclose(T.make("complete", 5).matrix(3), np.full((5, 5), 0.2))
    np.testing.assert_array_equal(T.make("local", 5).matrix(3), np.eye(5))
    assert T.make("local", 5).peers(2, 0).recv == []


# ----------------------------------------------------------------------------- analysis
def test_spectral_gap_static_ring():
    n = 8
    g = T.spectral_gap(T.make("ring", n))
    lam2 = (1 + 2 * math.cos(2 * math.pi / n)) / 3
    assert g.gap == pytest.approx(1 - lam2)
    assert g.per_step == pytest.approx(g.gap) and g.period == 1
    W = T.make("ring", n).matrix(0)
    eig = np.sort(np.abs(np.linalg.eigvalsh(W)))[::-1]
    assert g.rho == pytest.approx(eig[1])


def test_spectral_gap_time_varying():
    topo = T.make("one-peer-exp", 6)   # not a power of two: not exact
    g = T.spectral_gap(topo)
    P = topo.matrix(2) @ topo.matrix(1) @ topo.matrix(0)
    rho = np.linalg.svd(P - 1 / 6, compute_uv=False)[0]
    assert g.rho == pytest.approx(rho) and 0 < g.gap < 1
    assert g.per_step == pytest.approx(1 - rho ** (1 / 3))
    assert not T.finite_time_exact(topo)
    np.testing.assert_allclose(T.period_product(topo), P)


def test_comm_cost_ring():
    c = T.comm_cost(T.make("ring", 8, local_world_size=4), 100)
    assert c.period == 1 and len(c.steps) == 1
    s = c.steps[0]
    assert (s.max_send_bytes, s.max_recv_bytes, s.max_degree) == (200, 200, 2)
    assert (s.max_inter_send_bytes, s.max_intra_send_bytes) == (100, 200)  # rank 1 sends 2 intra
    assert (s.total_inter_bytes, s.total_intra_bytes, s.total_send_bytes) == (400, 1200, 1600)
    assert c.mean_max_send_bytes == 200 and c.max_degree == 2
    assert c.mean_inter_bytes_per_rank == 50 and c.mean_intra_bytes_per_rank == 150


def test_comm_cost_one_peer_exp():
    c = T.comm_cost(T.make("one-peer-exp", 8, local_world_size=4), 100)
    assert [s.total_inter_bytes for s in c.steps] == [200, 400, 800]   # offsets 1, 2, 4
    assert [s.total_intra_bytes for s in c.steps] == [600, 400, 0]
    assert [s.max_inter_send_bytes for s in c.steps] == [100, 100, 100]
    assert [s.max_intra_send_bytes for s in c.steps] == [100, 100, 0]
    assert all(s.max_send_bytes == s.max_recv_bytes == 100 and s.max_degree == 1 for s in c.steps)
    assert c.mean_max_send_bytes == 100
    assert c.mean_max_intra_send_bytes == pytest.approx(200 / 3)
    assert c.mean_total_inter_bytes == pytest.approx(1400 / 3)


def test_comm_cost_aer():
    c = T.comm_cost(T.make("aer", 16, local_world_size=4), 100)
    assert c.period == 4
    for s in c.steps:   # 2 nodes (8 ranks) inter, 2 nodes intra, every step
        assert s.max_inter_send_bytes == 100
        assert s.max_intra_send_bytes == 300
        assert s.max_send_bytes == 300 and s.max_degree == 3
        assert s.total_inter_bytes == 800 and s.total_intra_bytes == 2400
    assert c.mean_inter_bytes_per_rank == 50 and c.mean_intra_bytes_per_rank == 150
    assert c.max_inter_send_bytes == 100
