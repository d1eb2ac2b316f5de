"""What the topology layer refuses, and how fast: bad matrices and arguments, schedules that cannot average,
round-off, absurd world sizes, the environment (pure numpy; single process)."""
import ast
import os
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from decent_comm import topology as T


# ----------------------------------------------------------------------------- errors
def test_from_matrix_errors():
    with pytest.raises(ValueError, match="square"):
        T.from_matrix(np.ones((2, 3)) / 3)
    with pytest.raises(ValueError, match="step 0, row 0.*negative"):
        T.from_matrix([[1.5, -0.5], [-0.5, 1.5]])
    with pytest.raises(ValueError, match="step 0, row 1.*row-stochastic"):
        T.from_matrix([[0.5, 0.5], [0.5, 0.25]])
    with pytest.raises(ValueError, match="not finite"):
        T.from_matrix([[np.nan, 0.5], [0.5, 0.5]])
    biased = [[1.0, 0.0], [0.5, 0.5]]
    with pytest.raises(ValueError, match="step 0, column 0.*column-stochastic.*allow_biased"):
        T.from_matrix(biased)
    topo = T.from_matrix(biased, allow_biased=True)
    assert topo.allow_biased and topo.peers(1, 0).recv == [(0, 0.5)] and topo.peers(0, 0).send == [1]
    topo.validate()
    good = np.full((3, 3), 1 / 3)
    with pytest.raises(ValueError, match="step 1.*row 2"):
        T.from_matrix([good, [[1, 0, 0], [0, 1, 0], [0, 0, 0.5]]])
    with pytest.raises(ValueError, match="step 1.*3 x 3"):
        T.from_matrix([good, np.eye(2)])
    with pytest.raises(ValueError, match="step 1.*square"):
        T.from_matrix([good, np.ones((3, 2))])
    with pytest.raises(ValueError):
        T.from_matrix([])


def test_make_errors():
    with pytest.raises(ValueError, match="valid names: complete, ring, one-peer-ring, exp, one-peer-exp"):
        T.make("hypercube", 8)
    with pytest.raises(ValueError, match=r"3 nodes.*valid local_world_size values are \[3, 6, 12\]"):
        T.make("aer", 12, local_world_size=4)
    with pytest.raises(ValueError, match="divide world_size=10"):
        T.make("ring", 10, local_world_size=4)
    with pytest.raises(ValueError, match="valid values: \\[1, 2, 5, 10\\]"):
        T.make("aer", 10, local_world_size=3)
    for bad in (0, -1):
        with pytest.raises(ValueError, match="world_size must be >= 1"):
            T.make("ring", bad)
    with pytest.raises(ValueError, match="integer"):
        T.make("ring", 2.5)
    with pytest.raises(ValueError, match="option"):
        T.make("ring", 8, k=2)
    with pytest.raises(ValueError, match="k must be"):
        T.make("base-k", 8, k=0)
    with pytest.raises(ValueError, match="out of range"):
        T.make("ring", 4).peers(4, 0)
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        T.Topology(0)


def test_aer_error_lists_what_works():
    with pytest.raises(ValueError) as e:
        T.make("aer", 12, local_world_size=4)
    msg = str(e.value)
    assert "power of two" in msg and "3 nodes" in msg and "[3, 6, 12]" in msg


class Mismatched(T.Topology):
    """Rank 0 receives from rank 1 at odd steps, but rank 1 does not list rank 0 in send."""

    def __init__(self):
        super().__init__(3, period=2, allow_biased=True)   # isolate the send/recv check

    def peers(self, rank, step):
        if step % 2 == 1 and rank == 0:
            return T.Peers(0.5, [(1, 0.5)], [])
        return T.Peers(1.0, [], [])


class MismatchedSend(T.Topology):
    """Rank 0 lists rank 1 in send, but rank 1 does not receive from it."""

    def __init__(self):
        super().__init__(2)

    def peers(self, rank, step):
        return T.Peers(1.0, [], [1] if rank == 0 else [])


def test_validate_mismatched_send_recv():
    with pytest.raises(ValueError, match="step 1: rank 0 receives from rank 1 but rank 1 does not list rank 0"):
        Mismatched().validate()
    with pytest.raises(ValueError, match="step 0: rank 0 sends to rank 1 but rank 1 does not receive"):
        MismatchedSend().validate()


def _biased(topo):
    topo.allow_biased = True
    return topo


def test_validate_bad_peers():
    class SelfLoop(T.Topology):
        world_size = 2

        def peers(self, rank, step):
            return T.Peers(0.5, [(rank, 0.5)], [rank])

    with pytest.raises(ValueError, match="exclude rank"):
        SelfLoop().validate()

    class NotColumn(T.Topology):
        world_size = 2

        def peers(self, rank, step):
            return T.Peers(1.0, [], [1]) if rank == 0 else T.Peers(0.5, [(0, 0.5)], [])

    with pytest.raises(ValueError, match="column 0.*column-stochastic"):
        NotColumn().validate()
    _biased(NotColumn()).validate()


# ----------------------------------------------------------------------------- a pure layer: no environment
@pytest.mark.parametrize("env", ["4", "3", "abc"])
def test_local_world_size_environment_is_ignored(monkeypatch, env):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    clean = T.make("aer", 8)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", env)
    topo = T.make("aer", 8)
    assert (topo.local_world_size, topo.num_nodes, topo.period) == (8, 1, 1)  # one node: aer is complete
    assert topo.fingerprint() == clean.fingerprint()
    assert T.make("ring", 16).local_world_size == 16
    assert T.from_matrix(np.full((4, 4), 0.25)).local_world_size == 4
    assert T.make("adaptive:phase:complete@0,aer@5", 8).candidates[0].local_world_size == 8
    assert T.make("aer", 8, local_world_size=4).num_nodes == 2  # the argument is what counts


def test_topology_code_imports_no_os_nor_torch():
    pkg = os.path.dirname(T.__file__)
    for name in sorted(os.listdir(pkg)):
        if name.endswith(".py"):
            with open(os.path.join(pkg, name)) as f:
                tree = ast.parse(f.read())
            imported = {a.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                        for a in node.names}
            imported |= {(node.module or "").split(".")[0] for node in ast.walk(tree)
                         if isinstance(node, ast.ImportFrom) and not node.level}
            used = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
            assert not imported & {"os", "torch"} and not used & {"environ", "getenv"}, name


# ----------------------------------------------------------------------------- absurd sizes answer at once
@pytest.mark.parametrize("name", T.NAMES)
def test_absurd_world_sizes_answer_at_once(name):
    for n, L in ((10 ** 18, None), (10 ** 18, 7), (T.MAX_WORLD_SIZE + 1, None), (2 ** 62, 2 ** 61)):
        t0 = time.perf_counter()
        with pytest.raises(ValueError, match=r"at most MAX_WORLD_SIZE = 2\*\*24"):
            T.make(name, n, local_world_size=L)
        assert time.perf_counter() - t0 < 0.05, (name, n, L)
    t0 = time.perf_counter()
    topo = T.make(name, T.MAX_WORLD_SIZE, local_world_size=8)  # the largest size: built lazily
    assert time.perf_counter() - t0 < 0.25, name
    assert topo.world_size == T.MAX_WORLD_SIZE and topo.local_world_size == 8
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match="divide world_size"):  # the error lists the valid values, still fast
        T.make(name, T.MAX_WORLD_SIZE - 1, local_world_size=2)
    assert time.perf_counter() - t0 < 0.25, name


def test_the_reported_size_and_subclasses():
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match="world_size=1000000000000000000 is larger than any job can use"):
        T.make("ring", 10 ** 18, 7)
    with pytest.raises(ValueError, match="MAX_WORLD_SIZE"):
        T.Topology(2 ** 40)
    assert time.perf_counter() - t0 < 0.05


# ----------------------------------------------------------------------------- schedules that cannot average
OPT_IN = "allow_disconnected=True"


def test_identity_block_diagonal_and_disconnected_graphs_are_refused():
    with pytest.raises(ValueError) as e:
        T.from_matrix(np.eye(4))
    msg = str(e.value)
    assert "topology 'custom' cannot average" in msg and "ranks [0] never reach ranks [1, 2, 3]" in msg
    assert OPT_IN in msg and "'local'" in msg
    block = np.kron(np.eye(2), np.full((2, 2), 0.5))
    with pytest.raises(ValueError, match=r"'blocks' cannot average.*ranks \[0, 1\] never reach ranks \[2, 3\]"):
        T.from_matrix(block, name="blocks")
    with pytest.raises(ValueError, match=r"ranks \[0, 1\] never reach ranks \[2, 3\]"):  # one step of two
        T.from_matrix([block, np.eye(4)])
    nx = pytest.importorskip("networkx")
    two_rings = nx.disjoint_union(nx.cycle_graph(3), nx.cycle_graph(4))
    with pytest.raises(ValueError, match=r"'networkx' cannot average.*ranks \[0, 1, 2\] never reach ranks"
                                         r" \[3, 4, 5, 6\].*allow_disconnected"):
        T.from_networkx(two_rings)
    with pytest.raises(ValueError, match=r"ranks \[0\] never reach ranks \[1, 2, 3, 4, 5, 6, 7, 8, \.\.\. \(19 ranks\)\]"):
        T.from_matrix(np.eye(20))


def test_opting_in_to_no_communication():
    for topo in (T.from_matrix(np.eye(4), allow_disconnected=True), T.make("local", 8), T.make("ring", 8).mixed(0),
                 T.with_consensus(T.make("exp", 5), 0.0)):
        assert topo.allow_disconnected
        topo.validate()
        assert T.spectral_gap(topo).gap == 0.0
    nx = pytest.importorskip("networkx")
    assert T.from_networkx(nx.empty_graph(3), allow_disconnected=True).matrix(0).tolist() == np.eye(3).tolist()
    assert not T.make("ring", 8).mixed(0.5).allow_disconnected
    a = T.make("adaptive:phase:local@0,complete@5", 4)  # candidates are validated one by one
    assert a.validate() is a and a.candidates[a.index_of("local")].allow_disconnected


class Halves(T.Topology):
    """Ranks 0..1 and 2..3 each swap-average inside their half: never across."""

    def __init__(self, **kw):
        super().__init__(4, name="halves", **kw)

    def peers(self, rank, step):
        j = rank ^ 1
        return T.Peers(0.5, [(j, 0.5)], [j])


def test_subclasses_are_refused_by_validate():
    topo = Halves()  # construction stays lazy; validate() checks
    with pytest.raises(ValueError, match=r"'halves' cannot average.*\[0, 1\] never reach ranks \[2, 3\]"):
        topo.validate()
    Halves(allow_disconnected=True).validate()


def test_periodic_schedules_that_contract_over_the_period_are_accepted():
    n = 8
    mats = [np.eye(n)] * 7 + [np.full((n, n), 1 / n)]  # every step but the last is disconnected
    topo = T.from_matrix(mats)
    assert topo.period == 8 and T.finite_time_exact(topo)
    ope = T.make("one-peer-exp", 6)  # every step is a disjoint set of cycles; the period connects them
    assert T.from_matrix([ope.matrix(t) for t in range(ope.period)]).validate()
    pairs = T.make("one-peer-ring", 8)
    assert T.spectral_gap(T.from_matrix([pairs.matrix(0), pairs.matrix(1)])).gap > 0


def test_zero_self_weights_need_the_dense_product():
    swap = [[0.0, 1.0], [1.0, 0.0]]  # connected, but it only moves the values
    with pytest.raises(ValueError, match=r"self weight 0.*never contracts.*second largest \|eigenvalue\| of P = 1"):
        T.from_matrix(swap)
    shift = np.roll(np.eye(5), 1, axis=1)
    with pytest.raises(ValueError, match="never contracts"):
        T.from_matrix([shift, shift])
    others = (np.ones((3, 3)) - np.eye(3)) / 2  # average of the other ranks: contracts (rho = 1/2)
    assert T.spectral_gap(T.from_matrix(others)).rho == pytest.approx(0.5)
    T.from_matrix([swap, np.full((2, 2), 0.5)])  # the product is the average
    # ||P - J||_2 = 1, so one period does not contract in the worst case, but P is primitive: P^2 does
    P = np.array([[0, 0.5, 0.5], [1, 0, 0], [0, 0.5, 0.5]])
    assert T.spectral_gap(T.from_matrix(P)).gap == 0.0 and T.spectral_gap(T.from_matrix([P, P])).gap > 0


def test_biased_schedules_must_reach_agreement():
    follow = [[1.0, 0.0], [0.5, 0.5]]  # rank 1 follows rank 0: they agree (on x_0)
    T.from_matrix(follow, allow_biased=True)
    two_leaders = [[1, 0, 0], [0, 1, 0], [1 / 3, 1 / 3, 1 / 3]]  # ranks 0 and 1 never hear from each other
    with pytest.raises(ValueError, match=r"ranks \[0, 2\] never reach ranks \[1\]"):
        T.from_matrix(two_leaders, allow_biased=True)
    T.from_matrix(two_leaders, allow_biased=True, allow_disconnected=True)
    # zero self weights: cycles of lengths 3 and 2 make it aperiodic, so it settles; a class of period 2 does not
    T.from_matrix([[0, 1, 0], [0, 0, 1], [0.5, 0.5, 0]], allow_biased=True)
    with pytest.raises(ValueError, match="second largest \\|eigenvalue\\| of P = 1"):
        T.from_matrix([[0, 1, 0], [0, 0, 1], [0, 1, 0]], allow_biased=True)


def product(mats):
    P = np.eye(len(mats[0]))
    for W in mats:
        P = np.asarray(W) @ P
    return P


def birkhoff_step(draw, n):
    """A convex combination of 1-3 random permutations (Birkhoff), the identity included or not."""
    perms = [draw(st.permutations(range(n))) for _ in range(draw(st.integers(1, 3)))]
    if draw(st.booleans()):
        perms.append(list(range(n)))
    weights = [draw(st.integers(1, 4)) for _ in perms]
    return sum(w * np.eye(n)[list(p)] for w, p in zip(weights, perms)) / sum(weights)


def random_rows_step(draw, n):
    """Every row a random support (self included or not) with integer weights 1..3."""
    W = np.zeros((n, n))
    for i in range(n):
        for j in draw(st.sets(st.integers(0, n - 1), min_size=1, max_size=n)):
            W[i, j] = draw(st.integers(1, 3))
    return W / W.sum(axis=1, keepdims=True)


@st.composite
def schedules(draw, step, max_n, max_period):
    n, period = draw(st.integers(2, max_n)), draw(st.integers(1, max_period))
    return [step(draw, n) for _ in range(period)]


def accepted(mats, **kw):
    try:
        T.from_matrix(mats, **kw)
    except ValueError as e:
        assert "cannot average" in str(e)
        return False
    return True


def agree(mats):
    """Independent reference: P^(2^60) has equal rows exactly when repeated periods bring the replicas together
    (else its limit is split between closed classes, or periodic)."""
    Q = product(mats)
    for _ in range(60):
        Q = Q @ Q
        Q /= Q.sum(axis=1, keepdims=True)  # round-off would otherwise grow like (1 + eps)^(2^k)
    return np.ptp(Q, axis=0).max() < 1e-6


@settings(max_examples=300, deadline=None)
@given(schedules(birkhoff_step, 6, 3))
def test_doubly_stochastic_refused_exactly_when_the_replicas_never_agree(mats):
    assert accepted(mats) == agree(mats)


@settings(max_examples=300, deadline=None)
@given(schedules(random_rows_step, 5, 2))
def test_biased_refused_exactly_when_the_replicas_never_agree(mats):
    assert accepted(mats, allow_biased=True) == agree(mats)


# ----------------------------------------------------------------------------- one round-off tolerance
def test_roundoff_negative_entries_count_as_zero():
    W = T.make("ring", 4).matrix(0)  # W[0, 2] = W[2, 0] = 0
    for tiny in (-1e-12, -T.TOL):
        W[0, 2] = W[2, 0] = tiny
        topo = T.from_matrix(W)
        assert topo.matrix(0)[0, 2] == 0.0 and topo.matrix(0)[2, 0] == 0.0  # no message for round-off
        assert [j for j, _ in topo.peers(0, 0).recv] == [1, 3] and topo.peers(2, 0).send == [1, 3]
    for bad in (-1e-6, -2 * T.TOL):
        W[0, 2] = bad
        with pytest.raises(ValueError, match=r"step 0, row 0: entry W\[0,2\] = .* is negative"):
            T.from_matrix(W)


class Weights(T.Topology):
    """W = [[2/3 - w, 1/3, w], [1/3, 1/3, 1/3], [0, 1/3, 2/3]] as peers: rank 0 lists rank 2 with weight w.
    Column sums 1 - w, 1, 1 + w."""

    def __init__(self, w):
        super().__init__(3, name="weights")
        self.w = w

    def peers(self, rank, step):
        third = 1 / 3
        return [T.Peers(2 * third - self.w, [(1, third), (2, self.w)], [1]),
                T.Peers(third, [(0, third), (2, third)], [0, 2]),
                T.Peers(2 * third, [(1, third)], [0, 1])][rank]


def test_one_tolerance_for_peers_sums_and_analysis():
    for w in (0.0, 1e-12, -1e-12, 0.5 * T.TOL, -0.5 * T.TOL):  # round-off: negative weights and sums
        Weights(w).validate()
    with pytest.raises(ValueError, match="row 0: weight -1e-06 for rank 2 must be finite and non-negative"):
        Weights(-1e-6).validate()
    for w in (2 * T.TOL, 1e-6):
        with pytest.raises(ValueError, match="column 0: column sums to"):
            Weights(w).validate()
    W = np.full((3, 3), 1 / 3)
    W[0, 0] += 2 * T.TOL
    with pytest.raises(ValueError, match="row 0: row sums to"):
        T.from_matrix(W, allow_biased=True)
    W[0, 0] -= 1.5 * T.TOL
    T.from_matrix(W, allow_biased=True)
    # analysis: a product within TOL of the average is exact, and its contraction factor snaps to 0
    J = np.full((3, 3), 1 / 3)
    for eps, exact in ((0.5 * T.TOL, True), (3 * T.TOL, False)):
        topo = T.from_matrix(J + eps * (np.eye(3) - J))  # ||P - J||_2 = eps, max entry error 2 eps / 3
        assert T.finite_time_exact(topo) == exact
        assert T.spectral_gap(topo).rho == (0.0 if exact else pytest.approx(eps))
