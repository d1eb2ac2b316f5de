"""``base-k``: the Base-(k+1) graph of Takezawa, Sato, Niwa and Yamada,
"Beyond Exponential Graph: Communication-Efficient Topologies for
Decentralized Learning via Finite-time Convergence", NeurIPS 2023.

A time-varying schedule in which every rank talks to at most ``k`` peers
per step and the product of the mixing matrices over one period is exactly
``11^T / n`` for **every** n (not only powers of two).  Written from the
paper's construction; three layers:

1. **k-peer hyper-hypercube** (``hyper_hypercube``), for ``m`` whose prime
   factors are all ``<= k + 1``: write ``m = f_1 f_2 ... f_R`` with every
   ``f_r <= k + 1`` (greedy, largest factors first) and index the nodes in
   mixed radix ``(f_1, ..., f_R)``.  Round ``r`` averages uniformly each group
   of ``f_r`` nodes that differ only in digit ``r`` (degree ``f_r - 1 <= k``).
   After the R rounds every node holds the average.

2. **Simple Base-(k+1) graph** (``simple_base_rounds``), any ``m``: write
   ``m = sum_l a_l (k+1)^{p_l}`` in base ``k+1`` (``p_1 > p_2 > ...``,
   ``1 <= a_l <= k``) and split the nodes into consecutive groups ``V_l`` of
   size ``a_l (k+1)^{p_l}``, each cut into ``a_l`` subgroups ``V_{l,s}`` of
   size ``(k+1)^{p_l}``.

   * Rounds ``0 .. M-1``: each ``V_l`` runs its own hyper-hypercube
     (``M`` = longest of them); afterwards ``V_l`` holds its own mean.
   * Round ``M + q`` (``q = 0 .. #groups-2``): every node ``i`` of
     ``R_q = V_{q+1} u V_{q+2} u ...`` gets an edge of weight
     ``alpha_q / a_q`` to one not yet used node of each subgroup ``V_{q,s}``,
     with ``alpha_q = |V_q| / (|V_q| + |R_q|)`` (possible because
     ``|V_{q,s}| = (k+1)^{p_q} > |R_q|``).  Then ``R_q`` holds
     ``(1 - alpha_q) x + alpha_q * mean(V_q)``, so the weighted mean of
     ``V_{q+1}, V_{q+2}, ...`` stays the global mean, and the mean of every
     subgroup ``V_{q,s}`` becomes the global mean.  The unused nodes of
     ``V_q`` (all equal then) average in chunks of ``k + 1`` (the paper's
     extra edges; no effect on exact averaging, extra mixing otherwise).
   * From round ``M + q + 1`` on, each subgroup ``V_{q,s}`` runs its
     hyper-hypercube (``p_q`` rounds) and so reaches the global mean; the
     last group already holds it after round ``M + #groups - 2``.

   Length ``M + 1 + p_1`` rounds; degree ``<= k`` in every round (a node of
   ``R_q`` has ``a_q <= k`` edges, a used node of ``V_q`` one).

3. **Base-(k+1) graph** (``base_rounds``): split ``n = n_s * n_r`` with
   ``n_s`` the largest divisor of n whose prime factors are ``<= k + 1``.
   Run the simple Base-(k+1) graph inside each of the ``n_s`` blocks of
   ``n_r`` consecutive ranks, then the hyper-hypercube across the ``n_s``
   blocks (ranks ``j, j + n_r, j + 2 n_r, ...``).  Use whichever of this and
   the simple graph on all n ranks is shorter (the paper's rule).
"""
from __future__ import annotations

import numbers

from .schedule import Round, ScheduleTopology


def smooth_factors(m: int, k: int) -> list[int]:
    """Factor ``m`` into factors ``<= k + 1`` (largest first); ``[]`` for m = 1.

    Raises ``ValueError`` when m has a prime factor ``> k + 1``.
    """
    factors, rest = [], m
    for f in range(k + 1, 1, -1):
        while rest % f == 0:
            factors.append(f)
            rest //= f
    if rest != 1:
        raise ValueError(f"{m} has a prime factor > {k + 1}")
    return factors


def smooth_part(n: int, k: int) -> int:
    """Largest divisor of ``n`` whose prime factors are all ``<= k + 1``."""
    part, rest = 1, n
    for f in range(2, k + 2):
        while rest % f == 0:
            part *= f
            rest //= f
    return part


def hyper_hypercube(nodes: list[int], k: int) -> list[Round]:
    """k-peer hyper-hypercube rounds on ``nodes`` (size must be (k+1)-smooth)."""
    m = len(nodes)
    rounds, stride = [], 1
    for f in smooth_factors(m, k):
        groups = [[nodes[x + j * stride] for j in range(f)]
                  for x in range(m) if (x // stride) % f == 0]
        rounds.append(Round(groups=groups))
        stride *= f
    return rounds


def _merge_into(rounds: list[Round], parts: list[Round], start: int) -> None:
    for r, rnd in enumerate(parts):
        rounds[start + r].extend(rnd)


def simple_base_rounds(nodes: list[int], k: int) -> list[Round]:
    """Simple Base-(k+1) graph on ``nodes`` (see the module docstring)."""
    m, b = len(nodes), k + 1
    if m == 1:
        return []
    if smooth_part(m, k) == m:
        return hyper_hypercube(nodes, k)
    digits, p = [], 0                     # (a_l, p_l) with p decreasing
    while b ** (p + 1) <= m:
        p += 1
    rest = m
    for e in range(p, -1, -1):
        a, rest = divmod(rest, b ** e)
        if a:
            digits.append((a, e))
    groups, subgroups, pos = [], [], 0
    for a, e in digits:
        size = b ** e
        groups.append(nodes[pos:pos + a * size])
        subgroups.append([nodes[pos + s * size:pos + (s + 1) * size] for s in range(a)])
        pos += a * size
    phase1 = [hyper_hypercube(g, k) for g in groups]
    M = max(len(h) for h in phase1)
    rounds = [Round() for _ in range(M + 1 + digits[0][1])]
    for h in phase1:
        _merge_into(rounds, h, 0)
    G = len(groups)
    for q in range(G - 1):
        rest_nodes = [i for g in groups[q + 1:] for i in g]
        a_q = digits[q][0]
        alpha = len(groups[q]) / (len(groups[q]) + len(rest_nodes))
        rnd = rounds[M + q]
        for idx, i in enumerate(rest_nodes):
            for sub in subgroups[q]:
                rnd.edges.append((i, sub[idx], alpha / a_q))
        unused = [i for sub in subgroups[q] for i in sub[len(rest_nodes):]]
        rnd.groups.extend(c for c in (unused[x:x + b] for x in range(0, len(unused), b)) if len(c) > 1)
    for q in range(G):
        start = M + q + 1 if q < G - 1 else M + G - 1
        for sub in subgroups[q]:
            _merge_into(rounds, hyper_hypercube(sub, k), start)
    return rounds


def base_rounds(n: int, k: int, simple: bool = False) -> list[Round]:
    """Base-(k+1) graph on ranks ``0..n-1`` (``simple=True``: only the simple one)."""
    candidate = simple_base_rounds(list(range(n)), k)
    n_s = smooth_part(n, k)
    n_r = n // n_s
    if simple or n_s == 1 or n_r == 1:
        return candidate
    first = [Round() for _ in range(len(simple_base_rounds(list(range(n_r)), k)))]
    for blk in range(n_s):
        _merge_into(first, simple_base_rounds(list(range(blk * n_r, (blk + 1) * n_r)), k), 0)
    second = [Round() for _ in range(len(smooth_factors(n_s, k)))]
    for j in range(n_r):
        _merge_into(second, hyper_hypercube(list(range(j, n, n_r)), k), 0)
    full = first + second
    return candidate if len(candidate) < len(full) else full


class BaseGraph(ScheduleTopology):
    """``base-k``: Base-(k+1) graph, max degree ``k``, exact average after one period for every n.

    Options: ``k`` (int >= 1, default 1), ``simple`` (bool, default False:
    use only the simple Base-(k+1) construction).
    """

    def __init__(self, world_size: int, local_world_size: int | None = None, k: int = 1,
                 simple: bool = False):
        if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 1:  # numpy integers too, as world_size
            raise ValueError(f"base-k: k must be an integer >= 1 (max peers per step), got {k!r}")
        k = int(k)
        super().__init__(world_size, name="base-k", local_world_size=local_world_size,
                         options={"k": k, "simple": bool(simple)})
        self.k = k
        self.simple = bool(simple)

    def build_rounds(self):
        return base_rounds(self.world_size, self.k, self.simple)

    def _schedule_digest_items(self):
        yield repr(sorted(self.options.items())).encode()
        yield from super()._schedule_digest_items()
