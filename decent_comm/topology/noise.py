"""``noise_model``: how much disagreement a topology leaves when local updates keep injecting it.

``ConsensusControl`` uses it to rank candidates (gain: consensus distance per unit of injected noise) and to
calibrate the kernels' disagreement estimate per candidate (bias).  Dense n x n algebra: for analysis and
policy set-up, never on the training hot path.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from .base import Topology


def noise_model(topology: Topology, correlation: float = 0.0, max_steps: Optional[int] = None, tol: float = 1e-10):
    """Steady state of x^{t+1} = W(t) x^t + e^t, where e^t is the disagreement the local updates inject each step:
    zero-mean noise of unit variance per replica, orthogonal to the consensus direction, and autocorrelated across
    steps, e^{t+1} = c e^t + sqrt(1 - c^2) w^t with c = ``correlation`` (momentum makes consecutive updates of a
    replica alike: c about beta1; 0 gives independent steps).

    Returns (gain, bias): gain = mean over the period of Xi^2 (the consensus distance at the point where gradients
    are taken) per unit of injected noise; bias = E[estimate] / Xi^2 for the estimator of ``AdaptStats``.
    Complete graph: gain (n - 1) / n and bias 1 whatever c. Dense n x n algebra: O(n^3) per step, iterated to
    convergence or ``max_steps`` (default: about 3e8 / n^3 steps, so slowly mixing graphs such as a large ring
    stop early and are under-estimated, still as poor mixers).
    """
    n = topology.world_size
    if n == 1:
        return 0.0, 1.0
    if max_steps is None:
        max_steps = int(min(4000, max(50, 3e8 / n ** 3)))
    c = float(correlation)
    P = np.eye(n) - 1.0 / n
    Sxx = np.zeros((n, n))  # Cov(x^t)
    Sxe = np.zeros((n, n))  # Cov(x^t, e^t)
    T = topology.period
    mats = [np.asarray(topology.matrix(t), dtype=np.float64) for t in range(T)]

    def step(W, Sxx, Sxe):
        WSxe = W @ Sxe
        return W @ Sxx @ W.T + WSxe + WSxe.T + P, c * (WSxe + P)

    prev, done = None, 0
    while done < max_steps:
        for W in mats:
            Sxx, Sxe = step(W, Sxx, Sxe)
        done += T
        cur = np.trace(Sxx)
        if prev is not None and abs(cur - prev) <= tol * max(1.0, cur):
            break
        prev = cur
    xi, est = [], []
    I = np.eye(n)
    for W in mats:
        xi.append(np.trace(P @ Sxx @ P) / n)
        M = W - I
        D = np.einsum("ij,jk,ik->i", M, Sxx, M)
        cw = (1.0 - np.diag(W)) ** 2 + (W ** 2).sum(1) - np.diag(W) ** 2
        mask = cw > 1e-15
        est.append(np.mean(D[mask] / cw[mask]) * (n - 1) / n if mask.any() else 0.0)
        Sxx, Sxe = step(W, Sxx, Sxe)
    gain = float(np.mean(xi))
    bias = float(np.mean(est) / gain) if gain > 0 and np.mean(est) > 0 else 1.0
    return gain, bias
