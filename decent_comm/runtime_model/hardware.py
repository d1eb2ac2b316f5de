"""The cluster: nodes, ranks per node and the two link classes.

``ClusterConfig`` (frozen dataclass, base units: bytes/s and seconds):

* ``nodes`` (N) and ``ranks_per_node`` (L): ``world_size = n = N * L``;
  rank ``r`` lives on node ``r // L`` (as in ``decent_comm.topology``).
* ``inter_bandwidth`` / ``inter_latency``: the inter-node link.  The
  bandwidth is **per node**: the ranks of a node share its NIC, so a node
  whose L ranks each send ``B`` bytes to other nodes needs ``L * B / bw``.
  The NIC is full duplex (egress and ingress are separate resources).
  ``node_inter_bandwidths`` optionally gives one bandwidth per node
  (heterogeneous clusters); ``inter_bandwidth`` is then their minimum.
* ``intra_bandwidth`` / ``intra_latency``: the intra-node link (NVLink,
  PCIe, shared memory).  ``intra_sharing`` says what the bandwidth belongs to:

  - ``"rank"`` (default): each rank's own intra-node port (egress and
    ingress separately); concurrent intra-node transfers of one rank share
    it.  This is how per-GPU NVLink/NVSwitch or PCIe bandwidth is quoted
    ("600 GB/s per GPU").
  - ``"pair"``: every ordered rank pair has its own link of that bandwidth
    (a full mesh of dedicated links); concurrent transfers to different
    peers do not interfere.

* ``backend``: the collective library every all-reduce runs on (the All-Reduce
  baseline, group all-reduce gossip steps, periodic averaging), which decides
  how its bytes cross the nodes (``allreduce.ring_allreduce``):

  - ``"nccl"`` (default; GPU clusters): hierarchical, a node's NIC carries
    ``2 (N-1)/N`` buffers per all-reduce over ``N`` nodes.
  - ``"gloo"`` (CPU clusters): one flat ring over all the group's ranks,
    a node's NIC carries ``2 (n-1)/n`` buffers (``n`` ranks): 1.5 instead of 1
    on 2 nodes x 2 ranks, as measured on the emulated cluster.

A transfer of ``b`` bytes over a link costs ``latency + b / bandwidth``
(the alpha-beta model); concurrent transfers overlap their latencies.
"""
from __future__ import annotations

import dataclasses

from .._args import integer, real

INTRA_SHARING = ("rank", "pair")
#: How an all-reduce is priced: "nccl" hierarchical, "gloo" one flat ring (module docstring).
BACKENDS = ("nccl", "gloo")
#: The most ranks the model takes (2^18): its tables are numpy arrays of ranks x peers per step; planning
#: 262,144 ranks with the default candidates took 20 s of CPU and 2.2 GB here (100,000 ranks: 14 s, 1.2 GB).
MAX_WORLD_SIZE = 1 << 18


@dataclasses.dataclass(frozen=True)
class ClusterConfig:
    """See the module docstring.  Validated on construction (``ValueError``)."""

    nodes: int
    ranks_per_node: int
    inter_bandwidth: float
    intra_bandwidth: float
    inter_latency: float = 10e-6  # the command line's defaults too (it reads them from here)
    intra_latency: float = 3e-6
    intra_sharing: str = "rank"
    node_inter_bandwidths: tuple | None = None
    backend: str = "nccl"

    def __post_init__(self):
        for name in ("nodes", "ranks_per_node"):
            v = getattr(self, name)
            object.__setattr__(self, name, integer(v, name, low=1))  # np.int64 taken, as a Python int
        if self.nodes * self.ranks_per_node > MAX_WORLD_SIZE:
            raise ValueError(f"nodes x ranks_per_node = {self.nodes * self.ranks_per_node} ranks; the model takes at"
                             f" most {MAX_WORLD_SIZE}")
        for name in ("inter_bandwidth", "intra_bandwidth"):
            v = getattr(self, name)
            # inf allowed: an ideal link; True is not 1 byte/s
            object.__setattr__(self, name, real(v, f"{name} (bytes/s)", low=0, low_open=True, finite=False))
        for name in ("inter_latency", "intra_latency"):
            v = getattr(self, name)
            object.__setattr__(self, name, real(v, f"{name} (seconds)", low=0))
        if self.intra_sharing not in INTRA_SHARING:
            raise ValueError(f"intra_sharing must be one of {INTRA_SHARING}, got {self.intra_sharing!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS} (how all-reduces are priced), got {self.backend!r}")
        if self.node_inter_bandwidths is not None:
            bws = tuple(float(b) for b in self.node_inter_bandwidths)
            if len(bws) != self.nodes or min(bws) <= 0:
                raise ValueError(f"node_inter_bandwidths needs {self.nodes} positive values, got {bws}")
            object.__setattr__(self, "node_inter_bandwidths", bws)
            object.__setattr__(self, "inter_bandwidth", min(bws))

    @property
    def world_size(self) -> int:
        """``n = nodes * ranks_per_node``."""
        return self.nodes * self.ranks_per_node

    def node_bandwidths(self) -> tuple:
        """Inter-node bandwidth of every node (``inter_bandwidth`` repeated unless heterogeneous)."""
        return self.node_inter_bandwidths or (self.inter_bandwidth,) * self.nodes

    def with_(self, **changes) -> "ClusterConfig":
        """A copy with ``changes`` applied (``dataclasses.replace``)."""
        return dataclasses.replace(self, **changes)
