"""An emulated multi-node cluster on one machine (network namespaces behind a switch, shaped links, one torchrun
per node; link faults with wires=True: faults.py), for the multi-node test and the cluster benchmarks; see
emulated.py. Imports no torch."""

from .emulated import EmulatedCluster
from .jobs import ClusterJobError, NodeResult
from .net import cleanup_stale, format_bits, parse_bandwidth_bits

__all__ = ["EmulatedCluster", "ClusterJobError", "NodeResult", "cleanup_stale", "format_bits", "parse_bandwidth_bits"]
