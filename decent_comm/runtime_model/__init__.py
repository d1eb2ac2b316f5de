"""Runtime model: when, how much and with which topology gossip beats All-Reduce.

From a few measurable quantities (nodes x ranks per node, bytes per step,
intra/inter-node bandwidth and latency, compute time mean and std or a
measured sample, overlap mode) it predicts the mean step time of ring
All-Reduce (hierarchical across nodes as NCCL runs it, or one flat ring as gloo
does: ``ClusterConfig.backend``; bucketed overlap with the backward,
global barrier: expected max of n compute times) and of each gossip
topology (per-node NIC sharing, overlap with compute, neighbourhood-level
straggler effect), plus the ratios of Wang et al., "From Promise to
Practice: Realizing High-performance Decentralized Training", ICLR 2025:
``gamma`` (All-Reduce communication / compute), ``omega`` (gossip /
All-Reduce communication), ``sigma^2`` (compute variance / mean^2).

* ``ClusterConfig``, ``ComputeTime``, ``Workload``: the inputs (dataclasses).
* ``predict(cluster, workload, topology) -> Prediction``: closed form
  (ranks in phase) plus ``lower_bound_seconds`` (busiest link's load).
  ``Workload(exchange="group-allreduce")`` models gossip steps run as one
  all-reduce per averaging group (the seed library's way), else p2p.
* ``simulate(cluster, workload, topology) -> SimResult`` and
  ``simulate_allreduce``: discrete-event simulation of the exact schedule.
* ``plan(cluster, workload, topologies) -> Plan``: all candidates and a recommendation.
* ``units``: parsing "25Gbit", "65M", "120ms".

It predicts only: measured numbers (``plan --measure`` times a model and
probes links in ``decent_comm.cli.measure``) come in as data, e.g.
``ComputeTime.from_sample``.  Built-in schedules are read as numpy arrays
(``messages``), so 100,000 ranks plan in seconds; at most
``hardware.MAX_WORLD_SIZE`` ranks.

See docs/runtime_model_paper.md for the comparison with the paper and the
closed-form-vs-simulator agreement.

Pure Python + numpy (no torch); the compiled extension is not needed.
"""
from .allreduce import AllReduceCost, RingTerms, allreduce_cost, ring_allreduce
from .closed_form import Prediction, predict, predict_allreduce, predict_gossip
from .gossip import StepComm, schedule_comm, straggler_penalty
from .hardware import BACKENDS, ClusterConfig
from .planner import DEFAULT_TOPOLOGIES, Candidate, Plan, default_topologies, plan
from .simulator import SimResult, simulate, simulate_allreduce
from .stragglers import effective_sync_set, expected_max_normal, expected_max_sample
from .units import UnitError, parse_bandwidth, parse_count, parse_duration, parse_size
from .workload import WIRE_DTYPES, ComputeTime, Workload

__all__ = [
    "ClusterConfig", "BACKENDS", "ComputeTime", "Workload", "WIRE_DTYPES",
    "predict", "predict_allreduce", "predict_gossip", "Prediction",
    "simulate", "simulate_allreduce", "SimResult",
    "plan", "Plan", "Candidate", "DEFAULT_TOPOLOGIES", "default_topologies",
    "allreduce_cost", "AllReduceCost", "ring_allreduce", "RingTerms", "schedule_comm", "StepComm", "straggler_penalty",
    "expected_max_normal", "expected_max_sample", "effective_sync_set",
    "UnitError", "parse_bandwidth", "parse_count", "parse_duration", "parse_size",
]
