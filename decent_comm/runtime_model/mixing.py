"""Spectral gap per step of large schedules without dense matrices: ``sparse_gap_per_step``.

``decent_comm.topology.spectral_gap`` multiplies and decomposes dense n x n matrices (O(n^3)), so the
planner uses it up to ``planner.MAX_GAP_WORLD_SIZE`` ranks only.  Above, two cases are exact from the
step messages (O(period x messages)):

* **circulant** steps (every rank receives from the same offsets ``i - o mod n`` with the same
  weights: ring, exp, one-peer-exp, complete): circulant matrices commute and are normal, so the
  singular values of the period product are ``|prod_t lambda_t(f)|`` with ``lambda_t = FFT`` of the
  step's first column, and ``rho = max over f != 0`` of them;
* **finite-time exact** schedules (the product over one period is ``11^T / n``: base-k, aer): ``rho = 0``,
  found by running one period of gossip on random vectors (a product other than ``11^T / n`` leaves a
  random vector unaveraged with probability 1).

Anything else (torus, one-peer-ring, custom graphs) gives ``None``: not computed.
"""
from __future__ import annotations

import numpy as np

from ..topology.validation import TOL
from .loads import schedule_of


def _circulant_column(m, n: int):
    """First column of the step's matrix if it is circulant, else ``None``."""
    deg = np.bincount(m.dst, minlength=n)
    if np.any(deg != deg[0]) or np.any(m.self_weight != m.self_weight[0]):
        return None
    off = (m.dst - m.src) % n
    order = np.lexsort((off, m.dst))
    off, w = off[order].reshape(n, -1), m.weight[order].reshape(n, -1)
    if np.any(off != off[0]) or np.any(w != w[0]):
        return None
    col = np.zeros(n)
    col[0] = m.self_weight[0]
    col[off[0]] = w[0]
    return col


def _gossip(x: np.ndarray, table, groups) -> np.ndarray:
    """One step on the columns of ``x``: the group means when its groups are known, else
    ``x_i <- W_ii x_i + sum_j W_ij x_j`` from its messages."""
    if groups is not None:
        members, sizes = groups
        y = x.copy()
        y[members] = np.repeat(np.add.reduceat(x[members], np.cumsum(sizes) - sizes) / sizes[:, None], sizes, axis=0)
        return y
    m = table.messages
    y = m.self_weight[:, None] * x
    np.add.at(y, m.dst, m.weight[:, None] * x[m.src])
    return y


def sparse_gap_per_step(topology, probes: int = 2, tol: float = 1e-9) -> float | None:
    """``spectral_gap(topology).per_step`` for circulant or finite-time exact schedules, else ``None``."""
    tables = schedule_of(topology).steps
    n, T = topology.world_size, len(tables)
    known = [t.known_groups for t in tables]
    cols = [None] if any(k is not None for k in known) else [_circulant_column(t.messages, n) for t in tables]
    if all(c is not None for c in cols):
        lam = np.ones(n, dtype=complex)
        for c in cols:
            lam *= np.fft.fft(c)
        rho = float(np.abs(lam[1:]).max(initial=0.0))
    else:
        x = np.random.default_rng(0).standard_normal((n, probes))
        y = x
        for table, groups in zip(tables, known):
            y = _gossip(y, table, groups)
        if np.abs(y - x.mean(axis=0)).max() > tol * np.abs(x).max():
            return None
        rho = 0.0
    rho = 0.0 if rho < TOL else 1.0 if abs(rho - 1.0) < TOL else rho  # as spectral_gap rounds (validation.TOL)
    return 1.0 - rho ** (1.0 / T)
