"""Policies of an ``Adaptive`` topology: which candidate runs at each step.

* ``AdaptStats``: the all-reduced measurements a statistics-driven policy sees at a decision.
* ``Policy``: the interface (``decide``; ``needs_stats``, ``interval``, state for resumption).
* ``PhaseSchedule``: named step ranges, e.g. dense early and sparse later (Ada-style); no communication.
* ``ConsensusControl``: keeps the consensus distance under a target that scales like the critical consensus
  distance of Kong et al. (ICML 2021), with hysteresis; its gains and estimator calibration come from
  ``noise.noise_model``.

Policies know candidates only through the ``Adaptive`` they are bound to (``adaptive.candidates``,
``costs``, ``index_of``); they run nothing and read no environment.
"""
from __future__ import annotations

import bisect
import dataclasses
import math
from typing import TYPE_CHECKING, Callable, Optional

from .._args import integer, real
from .noise import noise_model

if TYPE_CHECKING:
    from .adaptive import Adaptive


# ------------------------------------------------------------------------------------------------ stats

@dataclasses.dataclass(frozen=True)
class AdaptStats:
    """What a statistics-driven policy sees at a decision; every field is already averaged over the ranks
    (the same values on every rank).

    step: the step being decided (the first step the choice applies to).
    lr: learning rate of the first param group at the last step taken.
    consensus_sq: estimate of the consensus distance Xi^2 = (1/n) sum_i ||x_i - xbar||^2 over the steps since
        the previous decision: each rank's fused-kernel disagreement D_i = ||sum_j W'_ij x_j - x_i||^2 divided by
        c_i = (1 - W'_ii)^2 + sum_j W'_ij^2 (what D_i is in units of an isotropic per-replica deviation),
        times (n - 1) / n. Exact for ``complete``; the policy applies a per-topology calibration on top.
    step_sq: mean over ranks of ||u_i||^2, u_i the local optimizer update of the last step taken (lr times
        the update direction; the mix not included).
    window: number of (rank, step) mixes the estimate averages over (0: no information).
    """

    step: int
    lr: float
    consensus_sq: float
    step_sq: float
    window: float


# ---------------------------------------------------------------------------------------------- policies

class Policy:
    """Chooses the candidate of each step. Subclasses implement ``decide`` and set:

    needs_stats: True when ``decide`` reads ``AdaptStats`` (costs one small all-reduce per decision).
    interval: decisions happen at steps that are positive multiples of ``interval`` (plus step 0, where
        ``initial`` picks the starting candidate).

    A policy must be deterministic given (step, stats, its state): every rank runs it on the same inputs.
    Mutable state belongs in ``state_dict`` / ``load_state_dict`` so that a resumed run decides identically.
    """

    needs_stats = False
    interval = 1

    def bind(self, adaptive: "Adaptive") -> None:
        """Called once when the Adaptive is bound to a world size (candidates resolved)."""

    def initial(self, adaptive: "Adaptive") -> int:
        """Candidate index of step 0 (default: the densest)."""
        return len(adaptive.candidates) - 1

    def due(self, step: int) -> bool:
        return step > 0 and step % self.interval == 0

    def decide(self, step: int, stats: Optional[AdaptStats], current: int, adaptive: "Adaptive") -> int:
        raise NotImplementedError

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def describe(self) -> str:
        """A stable description of the configuration (part of the topology fingerprint all ranks compare).
        Default: the class name and its public attributes of plain types (override when that is not enough)."""
        plain = (int, float, str, bool, type(None), tuple, list)
        attrs = {k: v for k, v in sorted(vars(self).items()) if not k.startswith("_") and isinstance(v, plain)}
        return f"{type(self).__qualname__}(interval={self.interval}, needs_stats={self.needs_stats}, {attrs})"


def _pair(value, name, form):
    """A phase given as a pair `form`, else a ValueError naming the phase (indexing it raised IndexError)."""
    if isinstance(value, (str, bytes)) or not hasattr(value, "__len__") or len(value) != 2:
        who = "each phase" if name is None else f"phase {name!r}"
        raise ValueError(f"PhaseSchedule: {who} must be a pair {form}, got {value!r}")
    return value


def _start(name, value, what="start"):
    return integer(value, f"the {what} step of phase {name!r}", low=0, where="PhaseSchedule")


class PhaseSchedule(Policy):
    """Candidate by step range (e.g. dense early, sparse later). ``phases`` is either a list of
    ``(name, start)`` pairs (each phase lasts until the next one starts; the first must start at 0) or a
    mapping ``{name: (start, stop)}`` of contiguous ranges from 0 whose last ``stop`` is None. A name may
    appear several times in the list form. No communication: the choice is a function of the step.

        PhaseSchedule([("complete", 0), ("exp", 100), ("one-peer-exp", 200)])
        PhaseSchedule({"complete": (0, 100), "one-peer-exp": (100, None)})
    """

    needs_stats = False
    interval = 1

    def __init__(self, phases):
        self.phases = self._normalize(phases)

    @staticmethod
    def _normalize(phases):
        if isinstance(phases, dict):
            ranges = sorted(((_start(name, _pair(r, name, "(start, stop)")[0]), r[1], name)
                             for name, r in phases.items()), key=lambda x: x[0])
            out = []
            for k, (start, stop, name) in enumerate(ranges):
                nxt = ranges[k + 1][0] if k + 1 < len(ranges) else None
                if stop is None and nxt is not None:
                    raise ValueError(f"phase {name!r} is open-ended (stop=None) but phase {ranges[k + 1][2]!r} "
                                     f"starts at step {nxt}")
                if stop is not None and (nxt is None or _start(name, stop, "stop") != nxt):
                    what = "the last phase must be open-ended (stop=None)" if nxt is None else \
                        f"it stops at {stop} but the next phase starts at {nxt}"
                    raise ValueError(f"phase {name!r}: step ranges must be contiguous: {what}")
                out.append((name, start))
        else:
            # a string's characters were taken as phases (IndexError)
            if isinstance(phases, (str, bytes)) or not hasattr(phases, "__iter__"):
                raise ValueError(f"PhaseSchedule: phases must be a list of (name, start) pairs or a dict "
                                 f"{{name: (start, stop)}}, got {phases!r}")
            out = [(p[0], _start(p[0], p[1])) for p in (_pair(p, None, "(name, start)") for p in phases)]
        if not out:
            raise ValueError("PhaseSchedule needs at least one phase")
        if out[0][1] != 0:
            raise ValueError(f"the first phase must start at step 0, got {out[0][1]}")
        for (a, sa), (b, sb) in zip(out, out[1:]):
            if sb <= sa:
                raise ValueError(f"phase {b!r} starts at step {sb}, not after phase {a!r} (step {sa})")
        return out

    @property
    def names(self):
        return [name for name, _ in self.phases]

    def bind(self, adaptive):
        self._index = [adaptive.index_of(name) for name in self.names]
        self._starts = [s for _, s in self.phases]

    def _at(self, step):
        return self._index[bisect.bisect_right(self._starts, step) - 1]

    def initial(self, adaptive):
        return self._at(0)

    def due(self, step):
        return step > 0

    def decide(self, step, stats, current, adaptive):
        return self._at(step)

    def describe(self):
        return f"PhaseSchedule({self.phases})"

    __repr__ = describe


class ConsensusControl(Policy):
    """Keeps the consensus distance Xi^2 under a target Gamma^2, moving to a denser candidate when it is above
    (``q = Xi^2 / Gamma^2 > high``) and to a sparser one when comfortably below (``q < low``), with hysteresis.

    Default target, after the critical consensus distance (CCD) of Kong et al., "Consensus Control for
    Decentralized Deep Learning", ICML 2021: decentralized SGD keeps the speed of centralized training while
    Xi_t^2 stays below Gamma_t^2 ~ ||grad f||^2 / L^2 + lr_t sigma^2 / (n L). Both terms are squared step lengths
    scaled by 1 / (lr_t L): with U_t^2 the mean squared length of one local update (about lr_t^2 (||grad f||^2 +
    sigma^2) for SGD; ``AdaptStats.step_sq``), the noise term is U_t^2 / (n lr_t L). L is unknown, so the
    target is written relative to the peak learning rate:

        Gamma_t^2 = kappa * U_t^2 * lr_peak / lr_t

    kappa = 1 / (n lr_peak L) in the CCD's terms; kappa = 1 (the default) allows, at peak lr, the consensus
    distance that exact averaging every step leaves in the noise-dominated regime ((n-1)/n U^2): the densest
    candidate is then within the band and sparser ones are taken as the learning rate decays (the CCD grows
    like 1 / lr_t relative to the step length), or while the update is dominated by its common (signal) part.
    ``target=callable(stats, policy) -> Gamma^2`` replaces the default.

    The measured Xi^2 is the kernels' disagreement estimate (``AdaptStats.consensus_sq``), divided by the
    candidate's ``bias`` under a noise-driven model (``noise.noise_model``: the updates inject disagreement with
    step-to-step ``correlation``, about the momentum coefficient beta1, default 0.9); moves are chosen with that
    model's gain ratio between candidates (predicted q after the move = q * gain_new / gain_now): to the cheapest
    candidate predicted at or below ``(low + high) / 2`` (see ``decide``). A move is allowed ``min_dwell`` steps (default two
    intervals: the first window after a switch is a transient) after the previous one at the earliest. Decisions
    every ``interval`` steps, from the mean over that window (one all-reduce of four scalars per decision).
    ``initial``: "densest" (the best mixer, default), "sparsest" (the worst), or a candidate name.
    ``hold_while_lr_rises`` (default True): no move to a cheaper graph while the learning rate is still rising
    (warmup): the target's reference lr_peak is not known yet, and Kong et al. find the initial phase the one
    where consensus matters most. Moves to a better mixer are always allowed.
    """

    needs_stats = True

    def __init__(self, kappa: float = 1.0, *, low: float = 0.5, high: float = 1.0, interval: int = 10,
                 min_dwell: Optional[int] = None, initial="densest", correlation: float = 0.9,
                 hold_while_lr_rises: bool = True,
                 target: Optional[Callable[[AdaptStats, "ConsensusControl"], float]] = None,
                 calibrate: bool = True):
        # _args.real first: a bool passed the bare comparisons below as 1.0 or 0.0, a string raised TypeError
        kappa, low, high = real(kappa, "kappa"), real(low, "low"), real(high, "high")
        if not kappa > 0:
            raise ValueError(f"kappa must be > 0, got {kappa}")
        if not 0 < low < high:
            raise ValueError(f"need 0 < low < high, got low={low}, high={high}")
        self.kappa, self.low, self.high = kappa, low, high
        self.interval = integer(interval, "interval", low=1)  # inf raised OverflowError, 2.5 was truncated
        self.min_dwell = 2 * self.interval if min_dwell is None else integer(min_dwell, "min_dwell", low=0)
        correlation = real(correlation, "correlation")
        if not 0.0 <= correlation < 1.0:
            raise ValueError(f"correlation must be in [0, 1), got {correlation}")
        self.correlation = correlation
        self.initial_choice = initial
        self.target = target
        self.calibrate = bool(calibrate)
        self.hold_while_lr_rises = bool(hold_while_lr_rises)
        self.lr_peak = None
        self.lr_prev = None    # lr at the previous decision
        self.last = None       # (q, Xi^2, Gamma^2) of the last decision, for logging

    def bind(self, adaptive):
        n = adaptive.world_size
        models = []
        for c in adaptive.candidates:
            if n <= 64:
                models.append(noise_model(c, self.correlation))
                continue
            # dense n x n algebra gets slow: model a built-in candidate on 64 ranks; otherwise no calibration
            # and a gain that only ranks candidates by their traffic
            from .registry import canonical_name, make
            try:
                models.append(noise_model(make(canonical_name(c.name), 64), self.correlation))
            except ValueError:
                models.append((1.0 + 1.0 / max(adaptive.costs[len(models)], 1e-9), 1.0))
        self.gains = [g for g, _ in models]
        self.biases = [b if self.calibrate else 1.0 for _, b in models]

    def initial(self, adaptive):
        c = self.initial_choice
        if c == "densest":  # the best mixer
            return min(range(len(adaptive.candidates)), key=lambda k: (self.gains[k], adaptive.costs[k]))
        if c == "sparsest":  # the worst mixer
            return max(range(len(adaptive.candidates)), key=lambda k: (self.gains[k], -adaptive.costs[k]))
        return adaptive.index_of(c)

    def gamma_sq(self, stats: AdaptStats) -> float:
        if self.target is not None:
            return float(self.target(stats, self))
        if stats.lr <= 0:
            return math.inf
        return self.kappa * stats.step_sq * self.lr_peak / stats.lr

    def decide(self, step, stats, current, adaptive):
        """Above the band: the cheapest candidate predicted at or below the middle of the band (else the best
        mixer). Below it: the cheapest candidate cheaper than the current one predicted at or below the middle, if
        any. Costs are ``adaptive.costs`` (bytes per step as the optimizer moves them: an all-reduce for uniform
        group averaging such as ``complete``, one buffer per peer otherwise)."""
        rising = self.lr_prev is None or stats.lr > self.lr_prev
        self.lr_prev = stats.lr
        if stats.lr > 0:
            self.lr_peak = stats.lr if self.lr_peak is None else max(self.lr_peak, stats.lr)
        if stats.window <= 0 or not stats.step_sq > 0 or self.lr_peak is None:
            return current
        xi_sq = stats.consensus_sq / self.biases[current]
        gamma = self.gamma_sq(stats)
        q = xi_sq / gamma if gamma > 0 else math.inf
        self.last = (q, xi_sq, gamma)
        if step - adaptive.last_switch_step < self.min_dwell:
            return current
        aim = 0.5 * (self.low + self.high)
        g_now = max(self.gains[current], 1e-30)
        ks = range(len(adaptive.candidates))
        predicted = {k: q * self.gains[k] / g_now for k in ks}
        costs = adaptive.costs
        ok = [k for k in ks if predicted[k] <= aim]
        if q > self.high:
            if ok:
                return min(ok, key=lambda k: (costs[k], predicted[k]))
            return min(ks, key=lambda k: (self.gains[k], costs[k]))
        if q < self.low and not (self.hold_while_lr_rises and rising):
            cheaper = [k for k in ok if costs[k] < costs[current]]
            if cheaper:
                return min(cheaper, key=lambda k: (costs[k], predicted[k]))
        return current

    def state_dict(self):
        return {"lr_peak": self.lr_peak, "lr_prev": self.lr_prev, "last": self.last}

    def load_state_dict(self, state):
        self.lr_peak = state.get("lr_peak")
        self.lr_prev = state.get("lr_prev")
        last = state.get("last")
        self.last = tuple(last) if last is not None else None

    def describe(self):
        return (f"ConsensusControl(kappa={self.kappa!r}, low={self.low!r}, high={self.high!r}, "
                f"interval={self.interval}, min_dwell={self.min_dwell}, initial={self.initial_choice!r}, "
                f"correlation={self.correlation!r}, hold_while_lr_rises={self.hold_while_lr_rises}, "
                f"target={'default' if self.target is None else getattr(self.target, '__name__', 'custom')}, "
                f"calibrate={self.calibrate})")

    __repr__ = describe
