"""``Adaptive``: switch among candidate topologies during training (Ada / consensus-control ideas).

    topo = Adaptive(["one-peer-exp", "exp", "complete"], ConsensusControl())
    opt = decent_comm.DAdamW(model.parameters(), topology=topo)      # the optimizer binds its own copy
    opt.topology.current_name, opt.topology.history                  # what it chose, and when

An ``Adaptive`` holds a list of candidate topologies (sorted by the mean number of buffers a rank sends per step
point to point) and a policy that picks the candidate of each step.  Its schedule is
the record of those choices, ``history = [(first_step, candidate_index), ...]``: ``peers(rank, step)`` and
``matrix(step)`` are those of the candidate active at ``step`` (evaluated at the global ``step``, so a
time-varying candidate keeps its phase).  The steps already decided never change; steps after the last decision
use the current candidate.

How the optimizer drives it (every rank identically, so every rank switches at the same step):
  before it builds the mixing plan of step ``s`` it calls ``advance(s, stats_fn)``. When the policy is
  due at ``s`` it is asked for the candidate of ``s`` on; a policy that needs measurements
  (``needs_stats``) gets them from ``stats_fn()``, which all-reduces a few scalars (one small collective, only
  at those steps). In AWC mode this happens at the end of step ``s - 1``, before the exchange of
  ``x^s`` is launched; in ATC mode during step ``s``, before its exchange.
  The history, the last decided step and the policy's state are part of the optimizer's state_dict.

Policies (``Policy`` subclasses; write your own by implementing ``decide``):
  * ``PhaseSchedule``: named step ranges, e.g. dense early and sparse later (Ada-style); no communication.
  * ``ConsensusControl``: keeps the consensus distance under a target that scales like the critical consensus
    distance of Kong et al. (ICML 2021), moving to a better-mixing candidate when above it and to a cheaper one
    when comfortably below, with hysteresis.

``parse(spec, world_size)`` (also reached through ``make("adaptive:...")``) builds one from a string:
``adaptive:consensus:one-peer-exp,exp,complete[:kappa=1,interval=10]`` or
``adaptive:phase:complete@0,exp@100,one-peer-exp@200``.
"""
from __future__ import annotations

import bisect
import copy
import dataclasses
import hashlib
import math
from typing import Callable, Optional, Sequence

import numpy as np

from .base import Peers, Topology
from .validation import check_world_size


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
            ranges = sorted(((int(r[0]), r[1], name) for name, r in phases.items()), key=lambda x: x[0])
            out = []
            for k, (start, stop, name) in enumerate(ranges):
                nxt = ranges[k + 1][0] if k + 1 < len(ranges) else None
                if stop is None and nxt is not None:
                    raise ValueError(f"phase {name!r} is open-ended (stop=None) but phase {ranges[k + 1][2]!r} "
                                     f"starts at step {nxt}")
                if stop is not None and (nxt is None or int(stop) != nxt):
                    what = "the last phase must be open-ended (stop=None)" if nxt is None else \
                        f"it stops at {stop} but the next phase starts at {nxt}"
                    raise ValueError(f"phase {name!r}: step ranges must be contiguous: {what}")
                out.append((name, start))
        else:
            out = [(p[0], int(p[1])) for p in phases]
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


def _noise_model(topology: Topology, correlation: float = 0.0, max_steps: Optional[int] = None, tol: float = 1e-10):
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
    candidate's ``bias`` under a noise-driven model (``_noise_model``: the updates inject disagreement with
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
        if not kappa > 0:
            raise ValueError(f"kappa must be > 0, got {kappa}")
        if not 0 < low < high:
            raise ValueError(f"need 0 < low < high, got low={low}, high={high}")
        if int(interval) != interval or interval < 1:
            raise ValueError(f"interval must be a positive integer, got {interval}")
        self.kappa, self.low, self.high, self.interval = float(kappa), float(low), float(high), int(interval)
        self.min_dwell = 2 * self.interval if min_dwell is None else int(min_dwell)
        if not 0.0 <= correlation < 1.0:
            raise ValueError(f"correlation must be in [0, 1), got {correlation}")
        self.correlation = float(correlation)
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
                models.append(_noise_model(c, self.correlation))
                continue
            # dense n x n algebra gets slow: model a built-in candidate on 64 ranks; otherwise no calibration
            # and a gain that only ranks candidates by their traffic
            from .registry import canonical_name, make
            try:
                models.append(_noise_model(make(canonical_name(c.name), 64), self.correlation))
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


# --------------------------------------------------------------------------------------------- Adaptive

def _sends_per_step(topo: Topology) -> float:
    """Mean number of buffers one rank sends per step (over the period; ranks sampled when n * period is large)."""
    n, T = topo.world_size, topo.period
    ranks = range(n) if n * T <= 4096 else range(0, n, max(1, n // 64))
    steps = range(T) if T <= 64 else range(64)
    total = sum(len(topo.peers(r, t).send) for r in ranks for t in steps)
    return total / (len(ranks) * len(steps))


class Adaptive(Topology):
    """Switches among ``candidates`` (names of built-ins or ``Topology`` objects) as ``policy`` decides.

    ``world_size``: needed only when a candidate is a name and the object is used outside an optimizer
    (optimizers bind it to their process group). Binding (``bind(world_size)``, done by every optimizer)
    returns a fresh copy with its own history and a deep copy of the policy, so one spec can serve several
    optimizers or runs.

    Attributes of a bound instance: ``candidates`` (sorted by the mean number of buffers a rank sends per step
    point to point, fewest first), ``names``, ``costs`` (buffers moved per rank and step; an optimizer that runs
    a candidate's steps as group all-reduces replaces them by what it really moves), ``history``
    [(first_step, index)], ``decided`` (last step decided), ``current``, ``current_name``, ``last_switch_step``.
    """

    def __init__(self, candidates: Sequence, policy: Policy, *, world_size: Optional[int] = None,
                 local_world_size: Optional[int] = None, name: str = "adaptive"):
        if not candidates:
            raise ValueError("Adaptive needs at least one candidate topology")
        if not isinstance(policy, Policy):
            raise TypeError(f"policy must be a decent_comm.topology.Policy (PhaseSchedule, ConsensusControl, ...), "
                            f"got {type(policy).__name__}")
        self._spec = (list(candidates), policy, local_world_size, name)
        self.policy = policy
        self.__dict__["_name"] = name
        self.bound = False
        if world_size is None:
            sizes = {c.world_size for c in candidates if isinstance(c, Topology)}
            if len(sizes) > 1:
                raise ValueError(f"candidate topologies have different world sizes: {sorted(sizes)}")
            if sizes and all(isinstance(c, Topology) for c in candidates):
                world_size = sizes.pop()
        if world_size is not None:
            self._bind_in_place(check_world_size(world_size))

    # -- binding ---------------------------------------------------------------------------------------
    def bind(self, world_size: int, local_world_size: Optional[int] = None) -> "Adaptive":
        """A fresh bound copy for ``world_size`` ranks (empty history, a deep copy of the policy)."""
        candidates, policy, lws, name = self._spec
        return Adaptive(candidates, copy.deepcopy(policy), world_size=world_size,
                        local_world_size=local_world_size if local_world_size is not None else lws, name=name)

    def _bind_in_place(self, n: int):
        from .registry import make
        candidates, policy, lws, name = self._spec
        topos = []
        for c in candidates:
            if isinstance(c, Topology):
                if c.world_size != n:
                    raise ValueError(f"candidate {c.name!r} is for {c.world_size} ranks, not {n}")
                if isinstance(c, Adaptive):
                    raise ValueError("an Adaptive topology cannot be a candidate of another one")
                topos.append(c)
            else:
                topos.append(make(str(c), n, local_world_size=lws))
        names = [t.name for t in topos]
        if len(set(names)) != len(names):
            raise ValueError(f"candidate names must be distinct, got {names}")
        costs = [_sends_per_step(t) for t in topos]
        order = sorted(range(len(topos)), key=lambda i: costs[i])  # stable: ties keep the given order
        self.candidates = [topos[i] for i in order]
        self.names = [names[i] for i in order]
        self.costs = [costs[i] for i in order]
        Topology.__init__(self, n, local_world_size=self.candidates[0].local_world_size, name=name,
                          allow_biased=any(t.allow_biased for t in self.candidates))
        self.period = math.lcm(*[t.period for t in self.candidates])
        self.bound = True
        policy.bind(self)
        first = int(policy.initial(self))
        self._check_index(first)
        self.history = [(0, first)]
        self.decided = 0

    def _require_bound(self):
        if not self.bound:
            raise RuntimeError("this Adaptive topology is not bound to a world size yet: pass world_size=, call "
                               "bind(world_size), or give it to an optimizer (which binds its own copy)")

    def _check_index(self, i):
        if not (isinstance(i, (int, np.integer)) and 0 <= i < len(self.candidates)):
            raise ValueError(f"the policy chose candidate {i!r}; valid: 0..{len(self.candidates) - 1} ({self.names})")

    def index_of(self, name_or_topology) -> int:
        """Index (in the sorted ``candidates``) of a candidate given by name or object."""
        self._require_bound()
        if isinstance(name_or_topology, Topology):
            for i, c in enumerate(self.candidates):
                if c is name_or_topology:
                    return i
            name_or_topology = name_or_topology.name
        from .registry import canonical_name
        key = str(name_or_topology)
        for i, nm in enumerate(self.names):
            if nm == key:
                return i
        try:
            key = canonical_name(key)
        except ValueError:
            pass
        for i, nm in enumerate(self.names):
            if nm == key:
                return i
        raise ValueError(f"{name_or_topology!r} is not a candidate; candidates: {self.names}")

    # -- the schedule ----------------------------------------------------------------------------------
    def index_at(self, step: int) -> int:
        """Candidate index active at ``step`` (the current one for steps not decided yet)."""
        self._require_bound()
        starts = [s for s, _ in self.history]
        return self.history[bisect.bisect_right(starts, step) - 1][1] if step >= 0 else self.history[0][1]

    def topology_at(self, step: int) -> Topology:
        i = self.index_at(step)  # checks that it is bound
        return self.candidates[i]

    @property
    def current(self) -> int:
        self._require_bound()
        return self.history[-1][1]

    @property
    def current_name(self) -> str:
        return self.names[self.current]

    @property
    def last_switch_step(self) -> int:
        return self.history[-1][0]

    def schedule(self):
        """The decided schedule as [(first_step, candidate name)]."""
        return [(s, self.names[i]) for s, i in self.history]

    def advance(self, step: int, stats_fn: Optional[Callable[[], AdaptStats]] = None) -> bool:
        """Decides the candidate of ``step`` (once; later calls for steps already decided do nothing). Calls
        ``stats_fn`` (a collective in an optimizer) only when the policy needs statistics and is due. Returns
        True when the candidate changed at ``step``."""
        self._require_bound()
        if step <= self.decided:
            return False
        self.decided = step
        if not self.policy.due(step):
            return False
        stats = None
        if self.policy.needs_stats:
            if stats_fn is None:
                raise RuntimeError(f"{self.policy!r} needs statistics: drive this topology from an optimizer")
            stats = stats_fn()
        new = self.policy.decide(step, stats, self.current, self)
        self._check_index(new)
        if new == self.current:
            return False
        self.history.append((step, int(new)))
        return True

    def force(self, step: int, candidate) -> None:
        """Records a switch to ``candidate`` (name, object or index) from ``step`` on; ``step`` must be after
        every step already decided. Every rank must call it identically (before the optimizer plans ``step``)."""
        self._require_bound()
        idx = candidate if isinstance(candidate, (int, np.integer)) else self.index_of(candidate)
        self._check_index(idx)
        if step == 0:
            if self.decided > 0 or len(self.history) > 1:
                raise ValueError("step 0 is already in use; force a later step")
            self.history = [(0, int(idx))]
            return
        if step <= self.decided:
            raise ValueError(f"step {step} is already decided (through step {self.decided})")
        self.decided = step  # the policy is not consulted for the steps up to this one
        if idx != self.current:
            self.history.append((step, int(idx)))

    def peers(self, rank: int, step: int) -> Peers:
        return self.topology_at(step).peers(rank, step)

    def matrix(self, step: int) -> np.ndarray:
        return self.topology_at(step).matrix(step)

    # -- checks, identity, state ---------------------------------------------------------------------
    def validate(self) -> "Adaptive":
        """Validates every candidate."""
        self._require_bound()
        for c in self.candidates:
            c.validate()
        return self

    def fingerprint(self) -> str:
        """The configuration (candidates' fingerprints and the policy), not the decisions taken so far."""
        self._require_bound()
        h = hashlib.sha256()
        h.update(repr((self.name, self.world_size, self.local_world_size)).encode())
        for c in self.candidates:
            h.update(c.fingerprint().encode())
        h.update(self.policy.describe().encode())
        return h.hexdigest()[:16]

    def state_dict(self) -> dict:
        self._require_bound()
        return {"history": [list(h) for h in self.history], "decided": self.decided, "names": list(self.names),
                "policy": self.policy.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self._require_bound()
        if list(state["names"]) != self.names:
            raise ValueError(f"the checkpoint's candidates {state['names']} differ from {self.names}")
        self.history = [(int(s), int(i)) for s, i in state["history"]]
        self.decided = int(state["decided"])
        self.policy.load_state_dict(state.get("policy", {}))

    def __repr__(self):
        if not self.bound:
            return f"Adaptive(candidates={self._spec[0]!r}, policy={self.policy!r}, unbound)"
        return (f"Adaptive(candidates={self.names}, policy={self.policy!r}, world_size={self.world_size}, "
                f"current={self.current_name!r})")


# ----------------------------------------------------------------------------------------------- parsing

def _value(text: str):
    t = text.strip()
    for conv in (int, float):
        try:
            return conv(t)
        except ValueError:
            pass
    return t


def parse(spec: str, world_size: Optional[int] = None, local_world_size: Optional[int] = None) -> Adaptive:
    """``adaptive:consensus:<c1>,<c2>,...[:key=value,...]`` (ConsensusControl keywords: kappa, low, high,
    interval, min_dwell, initial) or ``adaptive:phase:<name>@<start>,<name>@<start>,...`` (PhaseSchedule)."""
    parts = str(spec).strip().split(":")
    if parts[0].lower() != "adaptive" or len(parts) < 3:
        raise ValueError(f"adaptive spec must look like 'adaptive:consensus:one-peer-exp,exp,complete[:kappa=1]' or "
                         f"'adaptive:phase:complete@0,one-peer-exp@100', got {spec!r}")
    kind, body = parts[1].lower(), parts[2]
    options = {}
    if len(parts) > 3:
        for item in ":".join(parts[3:]).split(","):
            if item.strip():
                key, _, val = item.partition("=")
                if not _:
                    raise ValueError(f"adaptive spec option {item!r} is not key=value")
                options[key.strip().replace("-", "_")] = _value(val)
    if kind == "consensus":
        candidates = [c.strip() for c in body.split(",") if c.strip()]
        return Adaptive(candidates, ConsensusControl(**options), world_size=world_size,
                        local_world_size=local_world_size)
    if kind == "phase":
        if options:
            raise ValueError(f"adaptive:phase takes no options, got {sorted(options)}")
        phases = []
        for item in body.split(","):
            name, at, start = item.partition("@")
            if not at:
                raise ValueError(f"phase {item!r} must be <topology>@<first step>")
            phases.append((name.strip(), int(start)))
        candidates = list(dict.fromkeys(name for name, _ in phases))
        return Adaptive(candidates, PhaseSchedule(phases), world_size=world_size, local_world_size=local_world_size)
    raise ValueError(f"unknown adaptive policy {parts[1]!r}: use 'consensus' or 'phase'")
