"""``aer``: Alternating Exponential Ring for multi-node clusters.

After Wang et al., "From Promise to Practice: Realizing High-performance
Decentralized Training", ICLR 2025: alternate cheap intra-node averaging with
one-peer exponential (hypercube) exchanges between nodes, and keep every
inter-node link carrying exactly one buffer per rank.

Setting: ``n = world_size`` ranks on ``N = n / L`` nodes of ``L =
local_world_size`` ranks; rank ``r`` is ``(node u, local rank l) = divmod(r, L)``.
``N`` must be a power of two; ``d = log2 N``.

Schedule (period ``2 d``; one node: ``N = 1`` degrades to ``complete``):

* Step ``t`` (taken mod ``2d``) belongs to round ``s = t // 2`` (hypercube
  dimension ``s``) and phase ``h = t % 2``.  Node ``u`` is paired with node
  ``v = u XOR 2^s`` (a perfect matching of the nodes).
* Each node pair ``{u, v}`` has a class ``c = bit (s + 1) mod d of u`` (same
  for u and v since they differ only in bit s; ``c = 0`` when ``d = 1``).
  The pair goes **inter-node** at phase ``h != c`` and **intra-node** at
  phase ``h == c``.  So class-0 pairs are intra at even steps and inter at
  odd steps; class-1 pairs the other way round.  For ``N >= 4`` exactly half
  of the ``N / 2`` pairs are of each class, so every step half of the node
  pairs use the inter-node links while the other half average inside nodes.
* Intra-node: every rank of the node takes ``1/L`` of each of the ``L``
  ranks of its node (``11^T / L`` on the node block; nothing when L = 1).
* Inter-node, ``inter="counterpart"`` (default): rank ``(u, l)`` averages
  with its counterpart ``(v, l)``, weight 1/2 each, so every rank sends
  exactly one buffer over the network (L buffers per node).
* Inter-node, ``inter="pair"``: all ``2L`` ranks of the node pair average
  together (``11^T / 2L`` on the pair's block), the seed library's (Decent-DP)
  schedule.  Every step is then uniform averaging within groups (nodes or node
  pairs), which the optimizers run as one all-reduce per group
  (``averaging_groups``): about two buffers cross each NIC per inter-node step
  whatever L, instead of L point to point.

Every ``W(t)`` is symmetric, hence doubly stochastic.  **Exact average after
one period** (any L >= 1, N a power of two): on the ``2L`` ranks of a pair the
intra step is ``I_2 (x) J_L`` and the inter step ``J_2 (x) I_L``
(``J_m = 11^T / m``); they commute and their product in either order is
``J_2 (x) J_L``, the full average of the two nodes.  So the two steps of round
``s`` multiply to ``H_s (x) J_L`` with ``H_s`` the hypercube averaging along
dimension ``s``, and ``prod_s H_s (x) J_L = J_N (x) J_L = 11^T / n``.
"""
from __future__ import annotations

from .base import Peers, Topology
from .validation import check_world_size, divisors


class AlternatingExponentialRing(Topology):
    """See the module docstring for the exact schedule."""

    INTER = ("counterpart", "pair")

    def __init__(self, world_size: int, local_world_size: int | None = None, inter: str = "counterpart"):
        n = check_world_size(world_size)
        if inter not in self.INTER:
            raise ValueError(f"aer: inter must be one of {self.INTER}, got {inter!r}")
        super().__init__(n, local_world_size=local_world_size, name="aer" if inter == "counterpart" else "aer-pair")
        self.inter = inter
        L = self.local_world_size
        N = n // L
        if N & (N - 1):
            good_L = [q for q in divisors(n) if (n // q) & (n // q - 1) == 0]
            raise ValueError(
                f"aer needs the number of nodes world_size / local_world_size to be a power of two;"
                f" got {N} nodes (world_size={n}, local_world_size={L}). With local_world_size={L}"
                f" valid world sizes are {L} * 2^k, e.g. {[L << k for k in range(1, 6)]};"
                f" with world_size={n} valid local_world_size values are {good_L}")
        self.num_nodes = N
        self.dims = N.bit_length() - 1
        self.period = 2 * self.dims if N > 1 else 1

    # -- node-level schedule ----------------------------------------------------
    def node_partner(self, node: int, step: int) -> int:
        """Node paired with ``node`` at ``step`` (``node XOR 2^s``, ``s = (step mod period) // 2``)."""
        if self.num_nodes == 1:
            return node
        return node ^ (1 << ((step % self.period) // 2))

    def uses_inter(self, node: int, step: int) -> bool:
        """True when ``node`` exchanges with its partner node at ``step`` (else intra-node averaging)."""
        if self.num_nodes == 1:
            return False
        s, h = divmod(step % self.period, 2)
        c = (node >> ((s + 1) % self.dims)) & 1 if self.dims >= 2 else 0
        return h != c

    def inter_pairs(self, step: int) -> list[tuple[int, int]]:
        """Node pairs ``(u, v)``, ``u < v``, that use the inter-node links at ``step``."""
        return [(u, self.node_partner(u, step)) for u in range(self.num_nodes)
                if u < self.node_partner(u, step) and self.uses_inter(u, step)]

    # -- rank-level -----------------------------------------------------------------
    def peers(self, rank, step):
        rank = self._check_rank(rank)
        L = self.local_world_size
        u, l = divmod(rank, L)
        if self.uses_inter(u, step):
            v = self.node_partner(u, step)
            if self.inter == "pair":
                w = 1.0 / (2 * L)
                group = [m for node in sorted((u, v)) for m in range(node * L, (node + 1) * L) if m != rank]
                return Peers(w, [(j, w) for j in group], group)
            j = v * L + l
            return Peers(0.5, [(j, 0.5)], [j])
        w = 1.0 / L
        local = [u * L + m for m in range(L) if m != l]
        return Peers(w, [(j, w) for j in local], local)
