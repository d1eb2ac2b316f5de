"""User-given graphs: ``from_matrix`` (dense W or a cycled list of W's) and ``from_networkx``."""
from __future__ import annotations

import numpy as np

from .base import Topology
from .connectivity import check_averages
from .validation import check_matrix


class MatrixTopology(Topology):
    """Topology from explicit matrices ``W(t) = Ws[t % len(Ws)]``; ``peers`` derived (cached per step)."""

    def __init__(self, matrices, *, allow_biased: bool = False, allow_disconnected: bool = False,
                 local_world_size: int | None = None, name: str = "custom"):
        mats = [check_matrix(W, step=t, allow_biased=allow_biased) for t, W in enumerate(matrices)]
        if not mats:
            raise ValueError("from_matrix needs at least one matrix")
        n = mats[0].shape[0]
        for t, W in enumerate(mats):
            if W.shape != (n, n):
                raise ValueError(f"step {t}: mixing matrix must be {n} x {n} like step 0, got shape {W.shape}")
            W.setflags(write=False)
        super().__init__(n, period=len(mats), local_world_size=local_world_size, name=name,
                         allow_biased=allow_biased, allow_disconnected=allow_disconnected)
        self._mats = mats
        check_averages(self, mats)

    def matrix(self, step):
        return self._mats[step % self.period].copy()


def _as_matrix_list(W) -> list:
    """A 2-D array-like is one (static) matrix; a 3-D one or a list of 2-D ones is a schedule."""
    if _complex(W):
        raise ValueError("from_matrix: the mixing matrix is complex; gossip weights are real numbers")
    try:
        arr = np.asarray(W, dtype=np.float64)
    except (TypeError, ValueError):
        arr = None  # ragged: a list (or object array) of matrices of different shapes
    if arr is not None and arr.ndim == 2:
        return [arr]
    if arr is not None and arr.ndim == 3:
        return list(arr)
    if arr is None and (isinstance(W, (list, tuple)) or (isinstance(W, np.ndarray) and W.ndim == 1)):
        return list(W)
    what = f"an array of shape {arr.shape}" if arr is not None else f"a {type(W).__name__} it cannot read as numbers"
    raise ValueError(f"from_matrix expects an n x n matrix or a list of them, got {what}")


def _complex(W) -> bool:
    """Whether `W` (a matrix, a list of them, possibly ragged) holds complex numbers, which float64 would truncate."""
    ragged = isinstance(W, (list, tuple)) or (isinstance(W, np.ndarray) and W.dtype == object)
    for part in (W if ragged else [W]):
        try:
            if np.iscomplexobj(part):
                return True
        except ValueError:  # a ragged part: its own matrices are checked where they are read
            pass
    return False


def _low_precision(W):
    """The dtype of `W` (or of its first matrix) when it is a floating dtype narrower than float64, else None (a bool
    or integer matrix has no rounding for float64 to cure)."""
    first = W[0] if isinstance(W, (list, tuple)) and W else W
    name = str(getattr(first, "dtype", "")).replace("torch.", "")
    return name if name in ("float32", "float16", "bfloat16", "half") else None


def from_matrix(W, *, allow_biased: bool = False, allow_disconnected: bool = False,
                local_world_size: int | None = None, name: str = "custom") -> Topology:
    """Topology from ``W`` (n x n: static, period 1) or ``[W0, W1, ...]`` (cycled, period = length).

    Each ``W(t)`` must be square, finite, real, non-negative (entries down to
    ``-TOL`` are round-off and become 0), row-stochastic and, unless
    ``allow_biased=True``, column-stochastic; else ``ValueError`` naming the
    step and row/column.  The schedule must average (``check_averages``: e.g.
    the identity or a block-diagonal ``W`` never do) unless
    ``allow_disconnected=True``.  ``local_world_size``: ranks per node
    (``None``: one node).  Give the weights in float64: float32 rounds 1/3 so
    that a row sums to 1 + 3e-8, which the checks refuse (the replicas' mean
    would drift by that much every step).
    """
    try:
        return MatrixTopology(_as_matrix_list(W), allow_biased=allow_biased, allow_disconnected=allow_disconnected,
                              local_world_size=local_world_size, name=name)
    except ValueError as e:
        narrow = _low_precision(W)
        if narrow is None or "sums to" not in str(e):
            raise
        raise ValueError(f"{e} (the matrix was given in {narrow}, whose rounding of weights such as 1/3 breaks the "
                         "sums: give it in float64, e.g. torch.tensor(W, dtype=torch.float64))") from None


def metropolis_hastings(G) -> np.ndarray:
    """Metropolis-Hastings weights of an undirected graph with nodes ``0..n-1``.

    ``W_ij = 1 / (1 + max(deg_i, deg_j))`` for every edge ``{i, j}`` (self
    loops ignored), ``W_ii = 1 - sum_{j != i} W_ij``.  Symmetric and doubly
    stochastic (Xiao & Boyd, "Fast linear iterations for distributed
    averaging", 2004).
    """
    if G.is_directed():
        raise ValueError("from_networkx needs an undirected graph (Metropolis-Hastings weights are symmetric)")
    nodes = list(G.nodes())
    n = len(nodes)
    if n == 0 or set(nodes) != set(range(n)):
        raise ValueError(f"from_networkx needs nodes labelled 0..n-1, got {nodes[:10]}"
                         " (use networkx.convert_node_labels_to_integers)")
    edges = {(min(i, j), max(i, j)) for i, j in G.edges() if i != j}
    deg = np.zeros(n, dtype=np.int64)
    for i, j in edges:
        deg[i] += 1
        deg[j] += 1
    W = np.zeros((n, n))
    for i, j in edges:
        W[i, j] = W[j, i] = 1.0 / (1 + max(deg[i], deg[j]))
    np.fill_diagonal(W, 1.0 - W.sum(axis=1))
    return W


def from_networkx(G, *, allow_disconnected: bool = False, local_world_size: int | None = None,
                  name: str = "networkx") -> Topology:
    """Static topology from an undirected graph (or a list of graphs, cycled) with MH weights.

    networkx is optional: any object with ``is_directed()``, ``nodes()`` and
    ``edges()`` works; nodes must be ``0..n-1``.  A disconnected graph (the
    union of the list's edges, for a list) is refused unless
    ``allow_disconnected=True``.
    """
    graphs = G if isinstance(G, (list, tuple)) else [G]
    return from_matrix([metropolis_hastings(g) for g in graphs], allow_disconnected=allow_disconnected,
                       local_world_size=local_world_size, name=name)
