"""Drives an ``Adaptive`` topology from inside an optimizer: the statistics its policy reads (a consensus
estimate from the fused kernels' disagreement, the length of the local update, the lr), gathered with one
small all-reduce at each decision, so every rank takes the same decision at the same step.

An Adaptive topology is decided before the plan of each step is built (AWC: at the end of the previous step,
before its exchange is launched; ATC: during the step, before its exchange). See decent_comm.topology.adaptive.
"""

import logging
from typing import Callable, Optional

import torch

from ..topology import Adaptive, AdaptStats
from .agreement import announce

log = logging.getLogger(__name__)


class AdaptiveDriver:
    def __init__(self, topology: Adaptive, all_reduce: Optional[Callable], world_size: int, device: torch.device,
                 lr: Callable[[], float]):
        """`all_reduce(tensor, what)`: the schedule's whole-group sum (exchange.BoundedAllReduce, held to the
        optimizer's timeout); None at world size 1."""
        self.topology = topology
        self._all_reduce = all_reduce
        self.world_size = world_size
        self.device = device
        self._lr = lr
        self.needs_stats = topology.policy.needs_stats
        self._sum = None      # sum over mixes since the last decision of the consensus estimate (device)
        self._count = 0.0     # number of those mixes
        self._step_sq = None  # ||local update||^2 of the last step, when a decision needs it

    def decide(self, step: int) -> bool:
        """Decides the candidate of `step` (same inputs, hence same result, on every rank); True on a switch."""
        before = self.topology.current_name
        if not self.topology.advance(step, lambda: self._collect(step)):
            return False
        last = getattr(self.topology.policy, "last", None)
        log.info("decent_comm: step %d: topology %s -> %s%s", step, before, self.topology.current_name,
                 "" if last is None else " (q = %.3g)" % last[0])
        return True

    def wants_step_sq(self, decision_step: int) -> bool:
        """Whether the step about to run must measure ||local update||^2 for a decision at decision_step."""
        return (self.needs_stats and decision_step > self.topology.decided
                and self.topology.policy.due(decision_step))

    def record_step_sq(self, value: Optional[torch.Tensor]):
        self._step_sq = value

    def observe_mix(self, plan, disagreement: torch.Tensor):
        """A mix is complete: accumulate its consensus estimate (on the device, no sync). The kernels'
        disagreement D_i is divided by c_i, what it is in units of an isotropic per-replica deviation."""
        if not self.needs_stats:
            return
        if plan.group is not None:  # row of (1 - a) I + a W with uniform weight 1/|G| on the group's members
            c = plan.factor ** 2 * (len(plan.group) - 1) / len(plan.group)
        else:
            c = (1.0 - plan.self_weight) ** 2 + sum(w * w for w in plan.weights)
        if c > 0:
            est = disagreement.double() * ((self.world_size - 1) / self.world_size / c)
            self._sum = est if self._sum is None else self._sum + est
            self._count += 1.0

    def _local_stats(self) -> torch.Tensor:
        """[sum of consensus estimates since the last decision, their count, ||update||^2, lr] of this rank."""
        local = torch.zeros(4, dtype=torch.float64, device=self.device)
        if self._sum is not None:
            local[0] = self._sum.to(self.device)
        local[1] = self._count
        if self._step_sq is not None:
            local[2] = self._step_sq.to(self.device)
        local[3] = self._lr()
        return local

    def _collect(self, step: int) -> AdaptStats:
        """One all-reduce of the four local scalars: every rank gets the same statistics."""
        local = self._local_stats()
        if self._all_reduce is not None:
            announce(self._all_reduce, "the adaptive topology's statistics", step, [local.numel()])
            self._all_reduce(local, f"the adaptive topology's statistics at step {step}")
        total, count, step_sq, lr = local.tolist()
        n = self.world_size
        self._sum, self._count, self._step_sq = None, 0.0, None
        return AdaptStats(step=step, lr=lr / n, consensus_sq=total / count if count > 0 else 0.0,
                          step_sq=step_sq / n, window=count)

    def state_dict(self):
        return dict(topology=self.topology.state_dict(), sum=float(self._sum) if self._sum is not None else None,
                    count=self._count)

    def load_state_dict(self, state):
        if state is None:
            return
        self.topology.load_state_dict(state["topology"])
        self._sum = None if state["sum"] is None else torch.tensor(state["sum"], dtype=torch.float64,
                                                                   device=self.device)
        self._count = float(state["count"])
        self._step_sq = None
