"""A new optimizer built over parameters that a live optimizer, never shut down, still holds: the old one's pending ATC
mix is applied first, so the new one reads the parameters at x^{t+1}, as after shutdown(), synchronize() or ``del``.

Why: ATC's last step leaves its mix pending (applied before the next forward, or by synchronize() / shutdown(), or
by teardown.py when the optimizer is collected). A notebook cell re-run evaluates ``opt = DAdamW(m.parameters(),
...)`` while the old ``opt`` is still bound: the constructor copied the parameters (each .data a view of the old
optimizer's flat buffer, holding the unmixed half step x^{t+1/2}) into its own buffers, broadcast_init copied rank
0's to every rank, and rank 1's last step was lost, silently; the old optimizer's teardown then mixed a buffer nobody
read any more. Applying the mix communicates only by waiting for what the neighbours already sent with that step
(every rank launched the same exchange), so no rank waits on another's construction. A mix that fails (a dead peer
within the exchange timeout; a parameter the user wrote in place while it was in flight: a re-initialization or a
model.load_state_dict() wins over the mix) is logged, the parameters are left as they were and the old optimizer is
shut down (its forward pre-hooks would retry the mix at every forward of the model, raising the same error), as its
collection (``del opt`` first) would leave them: the new optimizer then starts where it would have after ``del
opt``.

Otherwise the old optimizer is left alive and usable, as after its synchronize(): torch lets two optimizers share
parameters (its next step takes them back into its buffers: buckets.adopt_storage), and shutting it down would take
its exchange from a user who still holds it. AWC leaves nothing pending: its parameters are x^{t+1} when step()
returns, and the exchange of x^{t+1} it launched only feeds its own next step.
"""

import logging
import weakref
from typing import List

from . import fork_guard

log = logging.getLogger(__name__)

#: the gossip schedules of the optimizers alive at world size > 1 (teardown.shut_down_when_dropped registers them)
_live: "weakref.WeakSet" = weakref.WeakSet()


def register(schedule) -> None:
    _live.add(schedule)


def settle_pending_mixes(param_groups: List[dict]) -> None:
    """Before a new optimizer reads `param_groups`' parameters: every live ATC schedule holding one of them with its
    mix pending applies it (all its buckets, as synchronize() would). One whose exchange or earlier mix failed is not
    tried (that error was raised already; its shutdown() would not try either), and a mix that fails now is logged:
    either way the parameters stay as they are and that schedule is shut down, as after ``del opt`` (teardown.py)."""
    mine = {id(p) for group in param_groups for p in group["params"]}
    for schedule in list(_live):  # a copy: a collection during the mix may drop a schedule from the set
        if schedule.mode != "atc" or not schedule.pending or schedule._shut_down:
            continue
        if not any(id(s.param) in mine for b in schedule.buckets for s in b.slots):
            continue
        # A fork's child: the parent's mix can be neither applied nor given up here (its hooks stay on the model and
        # raise at the first forward), so the construction is refused with the fork's message, not logged past.
        fork_guard.check(schedule, "building an optimizer over parameters whose optimizer has a mix pending")
        ex = schedule.exchange
        failed = schedule.failed or schedule.mix_error or (ex.error if ex is not None else None)
        if failed is None:
            try:
                schedule.mix_pending()
                continue
            except Exception as e:  # noqa: BLE001 - the parameters are left as the old optimizer's collection would
                failed = e
        log.warning("decent_comm: rank %d: building an optimizer over parameters of another optimizer, not shut down, "
                    "whose last step's mix cannot be applied (%s): this rank's parameters are left as they are, and "
                    "that optimizer is shut down, as its collection (del opt) would", schedule.rank, failed)
        try:
            schedule.shutdown()  # else its forward pre-hooks retried the mix, raising at every forward of the model
        except Exception as e:  # noqa: BLE001 - its release failed (a dead peer): logged as teardown.py logs it
            log.warning("decent_comm: rank %d: shutting down the optimizer whose mix failed: %s", schedule.rank, e)
