"""Consensus factor: ``W_a(t) = (1 - a) I + a W(t)``.

Used by DSGD with an averaging/consensus step size (DSGD-AC): each rank moves
only a fraction ``a`` of the way towards the gossip average,
``x_i <- x_i + a (sum_j W_ij x_j - x_i)``.  ``a = 1`` is plain gossip,
``a = 0`` no communication at all (then no peers are listed, and the result
has ``allow_disconnected``, as deliberate as ``local``).  Row and column
sums, non-negativity and the sparsity pattern (for ``a > 0``) are inherited
from ``W``; for ``a < 1`` every self weight is positive.
"""
from __future__ import annotations

from .._args import describe, is_real
from .base import Peers, Topology


def check_consensus_factor(a, context: str = "") -> float:
    """``a`` as a float if it is a number (a real tensor of one element too) in [0, 1], else a ValueError (NaN too)
    saying so, ``context`` (e.g. " at step 5") after it: the check of every consensus factor, ``with_consensus``'s
    and the optimizer's per step, so that neither takes what the other refuses. A bool is no factor (True would be
    1.0), nor a string (float("0.5") would let a typo'd config value train)."""
    if not is_real(a, tensor=True):
        raise ValueError(f"the consensus factor must be a number in [0, 1], got {describe(a)}{context}")
    value = float(a)  # read once: of a CUDA tensor, each float() is a host synchronization (this runs every step)
    if not 0.0 <= value <= 1.0:  # False for NaN
        raise ValueError(f"the consensus factor must be in [0, 1], got {value!r}{context}")
    return value


class ConsensusTopology(Topology):
    """``base`` mixed with the identity: ``W = (1 - a) I + a W_base``."""

    def __init__(self, base: Topology, a: float):
        a = check_consensus_factor(a)
        super().__init__(base.world_size, period=base.period, local_world_size=base.local_world_size,
                         name=f"{base.name}+consensus({a:g})", allow_biased=base.allow_biased,
                         allow_disconnected=base.allow_disconnected or a == 0.0)
        self.base = base
        self.a = a

    def peers(self, rank: int, step: int) -> Peers:
        if self.a == 0.0:  # no peers whatever the base's row is (Peers.mixed): it is not computed
            rank = self._check_rank(rank)
            return Peers(1.0, [], [])
        return self.base.peers(rank, step).mixed(self.a)


def with_consensus(topology: Topology, a: float) -> Topology:
    """Return ``topology`` with consensus factor ``a``: ``W' = (1-a) I + a W`` (``a`` in [0, 1])."""
    return ConsensusTopology(topology, a)
