"""Gossip topologies for decentralized data-parallel training (pure Python + numpy).

A ``Topology`` is a periodic schedule of mixing matrices ``W(t)``; at step t
rank i computes ``x_i <- sum_j W(t)_ij x_j``.  ``peers(rank, step)`` gives one
rank's part of it (``self_weight``, ``recv`` and ``send``) cheaply; the
optimizer and scheduler consume that.

* ``make(name, world_size, local_world_size=None, **options)``: built-ins
  ``NAMES`` = complete, ring, one-peer-ring, exp, one-peer-exp,
  one-peer-hypercube, aer, aer-pair, torus, base-k, local.
* ``from_matrix(W | [W0, W1, ...])``, ``from_networkx(G)``, or subclass
  ``Topology`` implementing ``peers`` or ``matrix``.
* ``with_consensus(topology, a)`` / ``topology.mixed(a)``: ``(1-a) I + a W``.
* ``Adaptive(candidates, policy)`` (``adaptive``): switches among candidates
  during training; policies ``PhaseSchedule`` and ``ConsensusControl``
  (``policies``, with ``noise``); ``make("adaptive:consensus:one-peer-exp,exp,complete")``
  (``spec.parse``).
* Analysis: ``spectral_gap``, ``finite_time_exact``, ``period_product``,
  ``comm_cost``.

Pure data: no environment variables, no torch.distributed.  Every schedule is
checked to average (``connectivity.check_averages``) unless built with
``allow_disconnected=True`` (as ``local`` is).  One round-off tolerance,
``validation.TOL``, serves every check.
"""
from .adaptive import Adaptive
from .analysis import SpectralGap, averaging_groups, finite_time_exact, period_product, spectral_gap
from .base import Peers, Topology
from .consensus import ConsensusTopology, with_consensus
from .cost import CommCost, StepCost, comm_cost
from .custom import MatrixTopology, from_matrix, from_networkx, metropolis_hastings
from .policies import AdaptStats, ConsensusControl, PhaseSchedule, Policy
from .registry import NAMES, canonical_name, make
from .validation import MAX_WORLD_SIZE, TOL, check_matrix

__all__ = [
    "Topology", "Peers", "make", "NAMES", "canonical_name",
    "from_matrix", "from_networkx", "metropolis_hastings", "MatrixTopology",
    "with_consensus", "ConsensusTopology", "check_matrix", "TOL", "MAX_WORLD_SIZE",
    "spectral_gap", "SpectralGap", "finite_time_exact", "period_product", "averaging_groups",
    "comm_cost", "CommCost", "StepCost",
    "Adaptive", "AdaptStats", "Policy", "PhaseSchedule", "ConsensusControl",
]
