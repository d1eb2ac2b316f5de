"""``one-peer-hypercube`` against dense float64 references built here from its definition (rank i averages
with i XOR 2^k at step k), and its node-aware ordering (pure numpy; single process)."""
import numpy as np
import pytest

from decent_comm import topology as T

from topology_cases import check_schedule, divisors

POWERS = [1, 2, 4, 8, 16, 32, 64]
LAYOUTS = [(n, L) for n in POWERS for L in divisors(n)]


def xor_matrix(n, k):
    """Dense W of step k: 1/2 on the diagonal and on (i, i XOR 2^k), by explicit loops."""
    W = np.zeros((n, n), dtype=np.float64)
    for i in range(n):
        W[i, i] += 0.5
        W[i, i ^ (1 << k)] += 0.5
    return W


def log2(n):
    return n.bit_length() - 1


@pytest.mark.parametrize("n,L", LAYOUTS)
def test_matches_dense_reference_and_is_a_valid_schedule(n, L):
    topo = T.make("one-peer-hypercube", n, local_world_size=L)
    assert topo.period == max(1, log2(n))
    check_schedule(topo)   # peers == matrix, rows and columns sum to 1, send/recv symmetric, periodic
    topo.validate()
    for t in range(2 * topo.period):
        ref = np.eye(1) if n == 1 else xor_matrix(n, t % log2(n))
        np.testing.assert_array_equal(topo.matrix(t), ref)
        np.testing.assert_array_equal(ref, ref.T)   # symmetric pairs: each sends exactly what it receives
        for i in range(n):
            p = topo.peers(i, t)
            assert p.degree == (n > 1) and [j for j, _ in p.recv] == p.send


@pytest.mark.parametrize("n", POWERS)
def test_exact_average_after_one_period_and_not_before(n):
    topo = T.make("one-peer-hypercube", n)
    assert T.finite_time_exact(topo)
    assert T.spectral_gap(topo).gap == pytest.approx(1.0) and T.spectral_gap(topo).per_step == pytest.approx(1.0)
    x = np.random.default_rng(n).standard_normal((n, 3))
    y = x.copy()
    d = log2(n)
    for k in range(d):                   # the float64 reference, one step at a time
        if n > 1 and k == d - 1:         # one step short of a period the replicas still differ
            assert np.abs(y - x.mean(axis=0)).max() > 1e-3
        y = xor_matrix(n, k) @ y
    np.testing.assert_allclose(y, np.broadcast_to(x.mean(axis=0), y.shape), rtol=0, atol=1e-12)
    for start in range(topo.period):     # any phase: the matrices commute
        np.testing.assert_allclose(T.period_product(topo, start), np.full((n, n), 1.0 / n), atol=1e-15)


@pytest.mark.parametrize("n,L", [(n, L) for n, L in LAYOUTS if n > 1])
def test_pairs_inside_a_node_come_first(n, L):
    """Steps 0 .. log2(L)-1 keep every message inside a node; the remaining steps pair whole nodes,
    node u with u XOR 2^(t - log2 L), rank by counterpart rank."""
    topo = T.make("one-peer-hypercube", n, local_world_size=L)
    for t in range(topo.period):
        for i in range(n):
            (j, _), = topo.peers(i, t).recv
            if t < log2(L):
                assert j // L == i // L, (n, L, t, i, j)
            else:
                assert j // L == (i // L) ^ (1 << (t - log2(L))) and j % L == i % L, (n, L, t, i, j)
        assert T.averaging_groups(topo, t) == sorted({tuple(sorted((i, i ^ (1 << t)))) for i in range(n)})


def test_two_nodes_of_two_put_one_buffer_per_step_on_the_node_link():
    # the issue's case: one-peer-exp's shift-2 step sends both ranks' buffers across, 1.5 per step on average
    B = 100
    for name, per_step, mean in (("one-peer-hypercube", [0, 2], 1.0), ("one-peer-exp", [1, 2], 1.5)):
        cost = T.comm_cost(T.make(name, 4, local_world_size=2), B)
        # 2 nodes: a step's inter-node messages split evenly over the two directions of the one link
        assert [s.total_inter_bytes / 2 / B for s in cost.steps] == per_step, name
        assert cost.mean_total_inter_bytes / 2 / B == mean, name


@pytest.mark.parametrize("n", [3, 5, 6, 7, 12, 24, 100, 2 ** 24 - 1])
def test_non_powers_of_two_are_refused_with_what_works(n):
    with pytest.raises(ValueError) as e:
        T.make("one-peer-hypercube", n)
    msg = str(e.value)
    lo = 1 << (n.bit_length() - 1)
    assert "power of two" in msg and f"world_size={n}" in msg and f"{lo} or {2 * lo}" in msg and "base-k" in msg
    with pytest.raises(ValueError, match="power of two"):
        T.make("one_peer_hypercube", n, local_world_size=1)


def test_name_alias_and_fingerprint():
    assert "one-peer-hypercube" in T.NAMES
    assert T.make("One_Peer_Hypercube", 8).name == "one-peer-hypercube"
    fp = T.make("one-peer-hypercube", 16, local_world_size=4).fingerprint()
    assert fp == T.make("one-peer-hypercube", 16, local_world_size=4).fingerprint()
    # base-k with k = 1 runs the same matrices on powers of two, but under another name (and the directed
    # one-peer-exp other matrices): the ranks of one job must not mix them up
    others = [T.make("base-k", 16, local_world_size=4, k=1), T.make("one-peer-exp", 16, local_world_size=4),
              T.make("one-peer-hypercube", 8, local_world_size=4)]
    assert len({fp, *(o.fingerprint() for o in others)}) == 4
    # nodes of 2 or 4 ranks: the in-node pairs (XOR 1, then 2) come first either way, the same schedule
    assert fp == T.make("one-peer-hypercube", 16, local_world_size=2).fingerprint()
    np.testing.assert_array_equal(T.period_product(others[0]), T.period_product(T.make("one-peer-hypercube", 16)))
