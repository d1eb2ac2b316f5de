"""Which gossip configurations decent_comm's optimizers refuse at construction: ``check_mix_width``.

The planner skips them instead of pricing them. The rule is the optimizers' own
(``decent_comm.optim.plan.check_mix_width``): one call of the fused mix kernels reads at most
``MAX_MIX_BUFFERS`` buffers; a rank's mix of a point-to-point step reads one per in-neighbour, plus its own copy
with the 8-bit wire or ``delayed_mix``; a group step (one all-reduce per averaging group) reads one sum. Which
steps are group steps is what the model prices (``gossip.workload_step_groups``), except that under
``exchange="auto"`` the optimizers look for averaging groups only in schedules of at most ``MAX_GROUP_SCAN``
period x ranks: every step of a longer one runs point to point (``complete`` on more than 65,536 ranks).
"""
from __future__ import annotations

from .gossip import workload_step_groups
from .loads import schedule_of
from .workload import AUTO_MIN_GROUP

#: The most buffers one call of the fused mix kernels reads: ``decent_comm.ops.MAX_NEIGHBORS``, repeated because
#: the runtime model imports no torch (tests/test_runtime_model_mix_width.py checks that the two agree).
MAX_MIX_BUFFERS = 32
#: period x ranks above which the optimizers do not scan a schedule for averaging groups:
#: ``decent_comm.optim.plan.MAX_SCAN`` (checked equal by the same test).
MAX_GROUP_SCAN = 1 << 16


class MixTooWide(ValueError):
    """A configuration whose mix reads more buffers than the fused kernels take in one call: the optimizers refuse
    it at construction."""


def check_mix_width(workload, topology, delayed_mix: bool = False) -> None:
    """Raises ``MixTooWide`` (why, and what to do) when decent_comm's optimizers would refuse ``topology`` under
    ``workload``'s exchange and wire (``delayed_mix``: with a delayed mix too)."""
    # the 8-bit wire, a wire narrower than the parameters (mixed in difference form) and delayed_mix read the own copy
    own_copy = int(workload.wire_is_8bit or delayed_mix or workload.bytes_per_param < workload.param_bytes)
    n = topology.world_size
    if n - 1 + own_copy <= MAX_MIX_BUFFERS:  # no rank has more in-neighbours than n - 1
        return
    schedule = schedule_of(topology)  # its period: ScheduleTopology.period would build every rank's tables
    scanned = workload.exchange != "auto" or schedule.period * n <= MAX_GROUP_SCAN
    for table in schedule.steps:
        grouped = scanned and workload_step_groups(workload, topology, table.step) is not None
        neighbours = 1 if grouped else table.links.max_indegree
        if neighbours + own_copy > MAX_MIX_BUFFERS:
            why = "the 8-bit wire" if workload.wire_is_8bit else "delayed_mix" if delayed_mix else \
                "a wire narrower than the parameters, mixed in difference form"
            copy = f" and its own copy ({why})"
            raise MixTooWide(
                f"{topology.name} on {n} ranks: a rank mixes {neighbours} neighbours point to point at step "
                f"{table.step}{copy if own_copy else ''}, but one mix reads at most {MAX_MIX_BUFFERS} buffers: "
                f"decent_comm's optimizers refuse it; {_advice(workload, table, scanned)}")


def _advice(workload, table, scanned: bool) -> str:
    if workload.wire_is_8bit:
        return "the 8-bit wire runs every step point to point: use a bf16 wire or a sparser topology"
    if not scanned:
        return (f"under exchange auto they look for averaging groups only in schedules of period x ranks <= "
                f"{MAX_GROUP_SCAN} and run this one point to point: use a sparser topology")
    groups = table.groups
    if workload.exchange == "p2p" and groups is not None and groups[1].max() >= AUTO_MIN_GROUP:
        return "use exchange auto, which runs this step as one all-reduce per averaging group"
    return "use a sparser topology"
