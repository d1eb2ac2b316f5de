"""Shared checks for the topology tests: a schedule's structural properties, recomputed from its matrices."""
import numpy as np
import pytest

TOL = 1e-9


def divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def check_schedule(topo):
    """Row/column stochastic, non-negative, peers == matrix, send/recv symmetric, periodic."""
    n, period = topo.world_size, topo.period
    for t in range(period):
        W = topo.matrix(t)
        assert W.shape == (n, n) and W.dtype == np.float64
        assert (W >= 0).all()
        np.testing.assert_allclose(W.sum(axis=1), 1.0, atol=TOL)
        np.testing.assert_allclose(W.sum(axis=0), 1.0, atol=TOL)
        np.testing.assert_array_equal(W, topo.matrix(t + period))
        np.testing.assert_array_equal(W, topo.matrix(t + 3 * period))
        recv_sets, send_sets = [], []
        for i in range(n):
            p = topo.peers(i, t)
            assert p.self_weight == pytest.approx(W[i, i], abs=1e-12)
            ranks = [j for j, _ in p.recv]
            assert ranks == sorted(set(ranks)) and i not in ranks
            assert ranks == [j for j in range(n) if j != i and W[i, j] > 0]
            for j, w in p.recv:
                assert w == pytest.approx(W[i, j], abs=1e-12)
            assert p.send == [j for j in range(n) if j != i and W[j, i] > 0]
            recv_sets.append(set(ranks))
            send_sets.append(set(p.send))
            q = topo.peers(i, t + period)
            assert (q.self_weight, q.recv, q.send) == (p.self_weight, p.recv, p.send)
        for i in range(n):
            for j in range(n):
                assert (j in recv_sets[i]) == (i in send_sets[j])
