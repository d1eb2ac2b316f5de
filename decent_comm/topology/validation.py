"""Argument and schedule validation shared by every topology.

Everything here raises ``ValueError`` with a message that names what is wrong
(the step of the period, the row/column or the ranks) and, where possible,
what would work instead.

Conventions: a gossip step is ``x_i <- sum_j W_ij x_j``.  ``W`` must be square
``n x n``, finite, non-negative and row-stochastic (``W 1 = 1``: every rank
takes a convex combination).  It must also be column-stochastic
(``1^T W = 1^T``) or the network average ``(1/n) 1^T x`` is not preserved by
gossip, which biases decentralized SGD; that check can be waived with
``allow_biased=True``.  Whether a schedule averages at all (its replicas
agree) is checked by ``connectivity.check_averages``.

Pure data: nothing here reads the environment; ranks per node are an argument.
"""
from __future__ import annotations

import math

import numpy as np

from .._args import integer

#: The one round-off tolerance of the topology layer (absolute; weights lie in [0, 1]):
#:
#: * a weight in ``[-TOL, 0)`` is round-off of 0 and accepted; ``check_matrix`` (hence
#:   ``from_matrix``) and the peers derived from ``matrix()`` set such an entry to exactly 0,
#:   so it creates no message.  A weight below ``-TOL`` is refused as negative.  A ``peers()``
#:   row is taken as written: a neighbour it lists with weight 0 or round-off below it is
#:   accepted and is still a message (and counts in ``comm_cost``'s degree): list only
#:   neighbours of positive weight.
#: * row and column sums must be within ``TOL`` of 1;
#: * ``peers()`` and ``matrix()`` of one topology must agree within ``TOL``;
#: * analysis: a contraction factor within ``TOL`` of 0 or 1 is reported as 0 or 1,
#:   ``finite_time_exact`` compares with ``TOL``, ``check_averages`` requires a margin of ``TOL``.
#:
#: Why accept tiny negative entries rather than refuse them: matrices computed in floating
#: point (``I - alpha L``, Sinkhorn scaling, products of schedules) carry entries of about
#: -1e-16 .. -1e-12 where the exact value is 0, and the row-sum check already tolerates the
#: same error; refusing would make users clip by hand.  1e-9 is far above double round-off
#: on such computations and far below any weight that matters to gossip.
TOL = 1e-9

#: Largest ``world_size`` any topology accepts: 2**24 = 16,777,216 ranks, about 100x the largest
#: training jobs.  Nothing can run a bigger schedule, and refusing at once keeps every
#: constructor fast (their O(sqrt(n)) divisor searches stay under a millisecond).
MAX_WORLD_SIZE = 2 ** 24


def divisors(n: int) -> list[int]:
    """All positive divisors of ``n`` in increasing order."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def check_world_size(world_size) -> int:
    """Return ``world_size`` as an ``int`` in ``[1, MAX_WORLD_SIZE]``, else raise ``ValueError``."""
    # the shared rule (_args.integer), as Topology.peers' rank: an integer tensor was refused here, taken there
    world_size = integer(world_size, "world_size")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if world_size > MAX_WORLD_SIZE:
        raise ValueError(f"world_size={world_size} is larger than any job can use; topologies accept at most"
                         f" MAX_WORLD_SIZE = 2**24 = {MAX_WORLD_SIZE} ranks")
    return world_size


def resolve_local_world_size(world_size: int, local_world_size=None) -> int:
    """Ranks per node, given as an argument: ``None`` means one node (``world_size``).

    The topology layer never reads the environment (torchrun's
    ``LOCAL_WORLD_SIZE`` is read by the optimizers, which pass it here), so the
    same call builds the same topology in every shell.  The result must divide
    ``world_size``.
    """
    if local_world_size is None:
        return world_size
    local_world_size = integer(local_world_size, "local_world_size")  # the rule world_size follows
    if local_world_size < 1 or world_size % local_world_size:
        raise ValueError(
            f"local_world_size={local_world_size} must be >= 1 and divide world_size={world_size}"
            f" (world_size not divisible by local_world_size); valid values: {divisors(world_size)}")
    return local_world_size


def drop_roundoff(W: np.ndarray) -> np.ndarray:
    """Set the entries of float array ``W`` in ``[-TOL, 0)`` to 0, in place (see ``TOL``); returns ``W``."""
    W[(W < 0) & (W >= -TOL)] = 0.0
    return W


def check_matrix(W, n: int | None = None, step: int = 0, allow_biased: bool = False) -> np.ndarray:
    """Validate one mixing matrix and return it as a float64 array.

    Checks, in order: 2-D and square (and ``n x n`` when ``n`` is given),
    finite, non-negative (entries in ``[-TOL, 0)`` are round-off: set to 0),
    row sums 1 (tolerance ``TOL``), and column sums 1 unless ``allow_biased``.
    The error names ``step`` and the offending row/column.
    """
    try:
        W = np.array(W, dtype=np.float64)
    except (TypeError, ValueError) as e:
        raise ValueError(f"step {step}: mixing matrix is not a numeric array ({e})") from None
    if W.ndim != 2 or W.shape[0] != W.shape[1]:
        raise ValueError(f"step {step}: mixing matrix must be square n x n, got shape {W.shape}")
    if n is not None and W.shape[0] != n:
        raise ValueError(f"step {step}: mixing matrix must be {n} x {n} (world_size {n}), got shape {W.shape}")
    bad = ~np.isfinite(W)
    if bad.any():
        i, j = np.argwhere(bad)[0]
        raise ValueError(f"step {step}, row {i}: entry W[{i},{j}] = {float(W[i, j])} is not finite")
    if (W < -TOL).any():
        i, j = np.argwhere(W < -TOL)[0]
        raise ValueError(f"step {step}, row {i}: entry W[{i},{j}] = {float(W[i, j]):.12g} is negative;"
                         f" mixing weights must be non-negative (entries down to -{TOL:g} count as round-off of 0)")
    drop_roundoff(W)
    rows = W.sum(axis=1)
    bad = np.flatnonzero(np.abs(rows - 1.0) > TOL)
    if bad.size:
        i = bad[0]
        raise ValueError(f"step {step}, row {i}: row sums to {float(rows[i]):.12g}, not 1"
                         " (W must be row-stochastic)")
    if not allow_biased:
        cols = W.sum(axis=0)
        bad = np.flatnonzero(np.abs(cols - 1.0) > TOL)
        if bad.size:
            j = bad[0]
            raise ValueError(
                f"step {step}, column {j}: column sums to {float(cols[j]):.12g}, not 1: W is not"
                " column-stochastic, so gossip does not preserve the average of the ranks;"
                " pass allow_biased=True if that is intended")
    return W


def check_peers_step(topology, step: int) -> None:
    """Check ``topology.peers(i, step)`` for all ranks ``i``.

    Per rank: ``recv`` sorted by rank, unique, excluding itself, weights and
    ``self_weight`` finite and ``>= -TOL``, ``self_weight + sum(recv)`` = 1;
    ``send`` sorted, unique, in range, excluding itself.  Across ranks:
    ``j in recv(i)  <=>  i in send(j)``; and column sums 1 unless
    ``topology.allow_biased``.
    """
    n = topology.world_size
    recv_of, send_of = [], []
    col = np.zeros(n)
    for i in range(n):
        p = topology.peers(i, step)
        s = float(p.self_weight)
        if not math.isfinite(s) or s < -TOL:
            raise ValueError(f"step {step}, row {i}: self_weight {s!r} must be finite and non-negative")
        total = s
        col[i] += s
        prev = -1
        ranks = set()
        for j, w in p.recv:
            if not (0 <= j < n) or j == i or j <= prev:
                raise ValueError(
                    f"step {step}, row {i}: recv ranks must be sorted, unique, in [0, {n}) and"
                    f" exclude rank {i} itself; got {[r for r, _ in p.recv]}")
            w = float(w)
            if not math.isfinite(w) or w < -TOL:
                raise ValueError(f"step {step}, row {i}: weight {w!r} for rank {j} must be finite and non-negative")
            prev = j
            ranks.add(j)
            total += w
            col[j] += w
        if abs(total - 1.0) > TOL:
            raise ValueError(f"step {step}, row {i}: self_weight + recv weights sum to {total:.12g}, not 1"
                             " (W must be row-stochastic)")
        send = list(p.send)
        if any(not (0 <= j < n) or j == i for j in send) or send != sorted(set(send)):
            raise ValueError(f"step {step}: send list of rank {i} must be sorted, unique, in [0, {n})"
                             f" and exclude rank {i}; got {send}")
        recv_of.append(ranks)
        send_of.append(set(send))
    for i in range(n):
        for j in sorted(recv_of[i]):
            if i not in send_of[j]:
                raise ValueError(f"step {step}: rank {i} receives from rank {j} but rank {j} does not"
                                 f" list rank {i} in send (mismatched send/recv)")
        for j in sorted(send_of[i]):
            if i not in recv_of[j]:
                raise ValueError(f"step {step}: rank {i} sends to rank {j} but rank {j} does not"
                                 f" receive from rank {i} (mismatched send/recv)")
    if not getattr(topology, "allow_biased", False):
        bad = np.flatnonzero(np.abs(col - 1.0) > TOL)
        if bad.size:
            j = bad[0]
            raise ValueError(
                f"step {step}, column {j}: column sums to {float(col[j]):.12g}, not 1: W is not column-stochastic,"
                " so gossip does not preserve the average; set allow_biased=True if intended")
