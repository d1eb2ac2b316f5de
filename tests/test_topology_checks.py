"""What the topology layer refuses: bad matrices, arguments and peer lists (pure numpy; single process)."""
import numpy as np
import pytest

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
