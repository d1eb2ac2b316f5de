"""The straggler effect: expected maximum of k independent compute times.

A step that waits on k ranks lasts the **maximum** of their compute times.

* Normal ``C ~ N(mu, s^2)``: ``E[max_k C] = mu + s * e(k)`` with

      e(k) = E[max of k standard normals] = integral x * k * phi(x) * Phi(x)^(k-1) dx

  computed by the trapezoidal rule on a fixed grid ``x in [-12, 12]``
  (step 1e-3; error < 1e-6 for k <= 1e6).  ``e(1) = 0``, ``e(2) =
  1/sqrt(pi) = 0.5642``, ``e(4) = 1.0294``, ``e(16) = 1.7660``; it grows like
  ``sqrt(2 ln k)``.  The formula is the expectation of ``X`` with CDF
  ``Phi^k``, so it is defined for fractional ``k >= 1`` too (used for the
  effective synchronisation-set sizes of gossip schedules).
* A measured sample ``x_(1) <= ... <= x_(m)`` resampled with replacement:

      E[max_k] = sum_i x_(i) * ((i/m)^k - ((i-1)/m)^k)

  exactly (no Monte Carlo).
"""
from __future__ import annotations

import functools
import math

import numpy as np

_GRID = np.linspace(-12.0, 12.0, 24001)


@functools.lru_cache(maxsize=1)
def _phi_Phi():
    x = _GRID
    phi = np.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)
    Phi = np.array([0.5 * math.erfc(-v / math.sqrt(2.0)) for v in x.tolist()])
    return phi, Phi


@functools.lru_cache(maxsize=4096)
def expected_max_normal(k: float) -> float:
    """``e(k) = E[max of k iid N(0, 1)]`` for real ``k >= 1`` (see the module docstring)."""
    k = float(k)
    if not k >= 1:
        raise ValueError(f"expected_max_normal needs k >= 1, got {k}")
    if k == 1:
        return 0.0
    phi, Phi = _phi_Phi()
    with np.errstate(divide="ignore", invalid="ignore"):
        dens = k * phi * np.where(Phi > 0, np.exp((k - 1.0) * np.log(np.maximum(Phi, 1e-300))), 0.0)
    return float(np.trapezoid(_GRID * dens, _GRID))


def expected_max_sample(sample, k: float) -> float:
    """``E[max of k draws with replacement from sample]`` (exact; real ``k >= 1``)."""
    x = np.sort(np.asarray(sample, dtype=np.float64).ravel())
    if x.size == 0:
        raise ValueError("expected_max_sample needs a non-empty sample")
    k = float(k)
    if not k >= 1:
        raise ValueError(f"expected_max_sample needs k >= 1, got {k}")
    m = x.size
    q = np.arange(m + 1, dtype=np.float64) / m
    w = np.diff(q ** k)
    return float(np.dot(x, w))


def effective_sync_set(mean: float, std: float, step_seconds: float) -> float:
    """Invert ``step = mean + std * e(k)`` for ``k`` (bisection; 1 when ``std = 0``).

    Used to express a simulated compute-bound step time as "waits on the
    slowest of k ranks" when calibrating the closed form.
    """
    if std <= 0:
        return 1.0
    target = (step_seconds - mean) / std
    if target <= 0:
        return 1.0
    lo, hi = 1.0, 2.0
    while expected_max_normal(hi) < target and hi < 1e6:
        lo, hi = hi, hi * 2
    for _ in range(60):
        mid = math.sqrt(lo * hi)
        if expected_max_normal(round(mid, 6)) < target:
            lo = mid
        else:
            hi = mid
    return math.sqrt(lo * hi)
