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

Policies (``Policy`` subclasses in ``policies``; write your own by implementing ``decide``):
  * ``PhaseSchedule``: named step ranges, e.g. dense early and sparse later (Ada-style); no communication.
  * ``ConsensusControl``: keeps the consensus distance under a target that scales like the critical consensus
    distance of Kong et al. (ICML 2021), moving to a better-mixing candidate when above it and to a cheaper one
    when comfortably below, with hysteresis.

``spec.parse(spec, world_size)`` (also reached through ``make("adaptive:...")``) builds one from a string:
``adaptive:consensus:one-peer-exp,exp,complete[:kappa=1,interval=10]`` or
``adaptive:phase:complete@0,exp@100,one-peer-exp@200``.
"""
from __future__ import annotations

import copy
import hashlib
import math
from typing import Callable, Optional, Sequence

import numpy as np

from .base import Peers, Topology
from .policies import AdaptStats, Policy
from .validation import check_world_size


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
        """A fresh bound copy for ``world_size`` ranks (empty history, a deep copy of the policy).
        ``local_world_size`` applies when this Adaptive was built without one."""
        candidates, policy, lws, name = self._spec
        return Adaptive(candidates, copy.deepcopy(policy), world_size=world_size,
                        local_world_size=lws if lws is not None else local_world_size, name=name)

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
        if step < 0:
            return self.history[0][1]
        if step >= self.history[-1][0]:  # the usual question: the step being taken
            return self.history[-1][1]
        # a binary search over the history itself: the list of starts it built per call made every call cost
        # linear in the switches (1.3 ms at 100,000; bisect's key= needs Python 3.10)
        lo, hi = 0, len(self.history)
        while lo < hi:
            mid = (lo + hi) // 2
            if self.history[mid][0] <= step:
                lo = mid + 1
            else:
                hi = mid
        return self.history[lo - 1][1]

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
        h.update(repr((self.name, self.world_size)).encode())  # the node layout counts through the candidates
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
