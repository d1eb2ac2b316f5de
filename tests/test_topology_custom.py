"""Tests for user-defined topologies (from_matrix, from_networkx, Topology subclasses), the consensus
factor and fingerprints (pure numpy; single process)."""
import numpy as np
import pytest

from decent_comm import topology as T
from topology_cases import check_schedule


# ----------------------------------------------------------------------------- custom graphs
def test_from_matrix_static():
    W = T.make("ring", 6).matrix(0)
    topo = T.from_matrix(W)
    assert topo.period == 1 and topo.world_size == 6 and topo.name == "custom"
    check_schedule(topo)
    np.testing.assert_array_equal(topo.matrix(4), W)
    assert T.from_matrix(W.tolist()).period == 1


def test_from_matrix_list_cycles():
    mats = [T.make("one-peer-exp", 8).matrix(t) for t in range(3)]
    topo = T.from_matrix(mats, local_world_size=4)
    assert topo.period == 3 and topo.local_world_size == 4
    check_schedule(topo)
    assert T.finite_time_exact(topo)
    np.testing.assert_array_equal(topo.matrix(4), mats[1])
    assert T.from_matrix(np.stack(mats)).period == 3


def test_from_matrix_inputs_that_cannot_be_weights_are_named():
    third = np.full((3, 3), 1 / 3)
    with pytest.raises(ValueError, match="given in float32.*give it in float64"):  # rows sum to 1 + 3e-8
        T.from_matrix(third.astype(np.float32))
    with pytest.raises(ValueError, match="complex"):  # np.asarray(..., float64) dropped the imaginary parts
        T.from_matrix(third + 1j * np.eye(3))
    with pytest.raises(ValueError, match="must be 3 x 3 like step 0"):  # an object array: an AttributeError
        T.from_matrix(np.array([third, [[1.0]]], dtype=object))
    with pytest.raises(ValueError, match="cannot read as numbers"):
        T.from_matrix({"W": third})
    assert T.from_matrix(np.array([third, third], dtype=object)).period == 2
    # a bool (or integer) matrix has no rounding that float64 would cure: its sums are named, without that hint
    with pytest.raises(ValueError, match="row 0: row sums to 2, not 1") as told:
        T.from_matrix(np.ones((2, 2), dtype=bool))
    assert "float64" not in str(told.value)


def test_from_networkx():
    nx = pytest.importorskip("networkx")
    topo = T.from_networkx(nx.cycle_graph(7))
    np.testing.assert_allclose(topo.matrix(0), T.make("ring", 7).matrix(0))
    star = T.from_networkx(nx.star_graph(4))   # center 0 with degree 4, leaves degree 1
    W = star.matrix(0)
    assert W[0, 1] == pytest.approx(1 / 5) and W[1, 1] == pytest.approx(4 / 5) and W[0, 0] == pytest.approx(1 / 5)
    check_schedule(star)
    assert T.spectral_gap(star).gap > 0
    with pytest.raises(ValueError, match="0..n-1"):
        T.from_networkx(nx.relabel_nodes(nx.path_graph(3), {0: "a"}))
    with pytest.raises(ValueError, match="undirected"):
        T.from_networkx(nx.DiGraph([(0, 1)]))


class PairSwap(T.Topology):
    """Only peers, world_size and period as class attributes; no __init__ call."""
    world_size = 4
    period = 2

    def peers(self, rank, step):
        j = rank ^ (1 << (step % 2))
        return T.Peers(0.5, [(j, 0.5)], [j])


class MatrixOnly(T.Topology):
    def __init__(self):
        super().__init__(4, period=2, name="matrix-only")
        self.calls = 0

    def matrix(self, step):
        self.calls += 1
        return np.kron(np.eye(2), np.full((2, 2), 0.5)) if step % 2 == 0 else \
            np.kron(np.full((2, 2), 0.5), np.eye(2))


def test_subclass_with_only_peers():
    topo = PairSwap()
    topo.validate()
    check_schedule(topo)
    assert topo.local_world_size == 4 and topo.name == "PairSwap"
    assert T.finite_time_exact(topo)
    assert len(topo.fingerprint()) == 16


def test_subclass_with_only_matrix_caches_peers():
    topo = MatrixOnly().validate()
    check_schedule(topo)
    topo.calls = 0
    for step in range(20):
        for r in range(4):
            topo.peers(r, step)
    assert topo.calls == 0   # cached per step of the period (filled by check_schedule)
    fresh = MatrixOnly()
    for step in range(20):
        for r in range(4):
            fresh.peers(r, step)
    assert fresh.calls == 2
    assert fresh.peers(0, 1).recv == [(2, 0.5)] and fresh.peers(0, 1).send == [2]
    assert T.finite_time_exact(fresh)


def test_topologies_pickle():
    import pickle
    for topo in (T.make("base-k", 12, k=2), T.make("aer", 16, local_world_size=4), MatrixOnly(), PairSwap(),
                 T.from_matrix(np.full((3, 3), 1 / 3)), T.make("exp", 9).mixed(0.5)):
        assert pickle.loads(pickle.dumps(topo)).fingerprint() == topo.fingerprint()


def test_subclass_with_neither_fails():
    class Nothing(T.Topology):
        pass
    with pytest.raises(NotImplementedError):
        Nothing(4).peers(0, 0)
    with pytest.raises(NotImplementedError):
        Nothing(4).matrix(0)


# ----------------------------------------------------------------------------- consensus factor
@pytest.mark.parametrize("a", [0.0, 0.3, 1.0])
def test_with_consensus(a):
    base = T.make("one-peer-exp", 8)
    topo = T.with_consensus(base, a)
    check_schedule(topo)
    assert topo.period == base.period
    for t in range(3):
        np.testing.assert_allclose(topo.matrix(t), (1 - a) * np.eye(8) + a * base.matrix(t))
    if a == 0:
        assert topo.peers(3, 1).recv == [] and topo.peers(3, 1).send == []
    np.testing.assert_allclose(base.mixed(a).matrix(1), topo.matrix(1))


def test_with_consensus_bad_factor():
    for a in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="consensus"):
            T.with_consensus(T.make("ring", 4), a)


# ----------------------------------------------------------------------------- fingerprint
def test_fingerprint():
    fp = T.make("ring", 8).fingerprint()
    assert len(fp) == 16 and int(fp, 16) >= 0
    assert fp == T.make("ring", 8).fingerprint()
    others = [T.make("ring", 9), T.make("exp", 8), T.make("aer", 8, local_world_size=4),
              T.make("base-k", 8, k=1), T.make("base-k", 8, k=2), T.make("complete", 8),
              T.from_matrix(T.make("ring", 8).matrix(0)), T.with_consensus(T.make("ring", 8), 0.5)]
    fps = [o.fingerprint() for o in others]
    assert fp not in fps and len(set(fps)) == len(fps)
    assert fp == T.make("ring", 8, local_world_size=4).fingerprint()  # the same schedule on any node layout
    W = T.make("torus", 9).matrix(0)
    assert T.from_matrix(W).fingerprint() == T.from_matrix(W.copy()).fingerprint()
    W2 = W.copy()
    W2[[0, 1]] = W2[[1, 0]]
    W2[:, [0, 1]] = W2[:, [1, 0]]   # relabelled graph: a different schedule
    assert T.from_matrix(W2).fingerprint() != T.from_matrix(W).fingerprint()
    assert T.make("aer", 16, local_world_size=4).fingerprint() == T.make("aer", 16, local_world_size=4).fingerprint()


@pytest.mark.parametrize("name, layout_matters", [("ring", False), ("exp", False), ("complete", False),
                                                  ("one-peer-exp", False), ("one-peer-hypercube", False), ("aer", True)])
def test_the_fingerprint_sees_the_node_layout_only_through_the_schedule(name, layout_matters):
    """Ranks on nodes of different sizes (torchrun's LOCAL_WORLD_SIZE 2, 1, 1) build the topology with different
    local_world_size; they must agree on one whose schedule does not depend on it, and not on one whose does."""
    fps = {L: T.make(name, 8, local_world_size=L).fingerprint() for L in (1, 2, 4)}
    schedules = {L: [T.make(name, 8, local_world_size=L).matrix(t) for t in range(4)] for L in (1, 2, 4)}
    differ = any(not np.array_equal(a, b) for a, b in zip(schedules[1], schedules[2]))
    assert differ == layout_matters
    assert (fps[1] != fps[2]) == differ
    assert T.make(f"adaptive:phase:complete@0,{name}@5", 8, local_world_size=1).fingerprint() == \
        T.make(f"adaptive:phase:complete@0,{name}@5", 8, local_world_size=2).fingerprint() or layout_matters
