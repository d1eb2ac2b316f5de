"""An optimizer nobody shut down is shut down as ``shutdown()`` would, when it is garbage collected or, if it is still
alive then, at interpreter exit.

What that adds to the exchangers closing themselves (decent_comm/exchange/_closing.py): ATC's last step leaves its mix
pending (applied before the next forward, or by synchronize() / shutdown()), yet a torch.optim step is finished when
step() returns: x^{t+1} = W'(x^t - lr d^t). A script that let the optimizer go and then saved the model (an optimizer
local to a train() function returning the model; ``del opt``) saved the unmixed half step x^{t+1/2}: the exchangers
only drained, and the model's state_dict pre-hook that applies the mix went with the optimizer. So the schedule's
shutdown() runs first, mixing what arrived, then drains and closes the exchange; every rank launched the same exchange,
so each rank's mix finds its neighbours' buffers posted. A failure (a dead peer: the wait raises within the exchange
timeout) is logged (decent_comm.exchange._closing's logger), never raised from a finalizer.

The finalizer holds the schedule, never the optimizer, so the optimizer is still collected when its last reference
goes (or in a cyclic collection); and its reference keeps the schedule, and the exchangers the schedule holds, out of
the garbage until it has run, so their own close-on-collect cannot drain and close them before the mix. Nothing the
schedule holds may refer back to the optimizer: an error it keeps after a failure is kept without its traceback, whose
step() frames hold the optimizer (exchange.arrival.detached; it kept a failed optimizer alive until the process exited).
"""

import weakref

from ..exchange import close_on_collect, track_owner
from . import fork_guard
from .handover import register

LABEL = "an optimizer nobody shut down"  # what the log calls the schedule when its shutdown fails


def shut_down_when_dropped(optimizer, schedule) -> None:
    """schedule.shutdown() when `optimizer` is collected (a no-op after an explicit shutdown()), or at exit."""
    fork_guard.stamp(schedule, type(optimizer).__name__)  # its users raise in a fork's child (fork_guard)
    if schedule.exchange is None:  # one rank: nothing pending, nothing to close
        return
    finalizer = weakref.finalize(optimizer, close_on_collect, schedule, LABEL)
    # At exit the exchange layer shuts the schedule down before any exchanger (weakref.finalize's own exit hook runs
    # at an order of its own, possibly after the exchangers closed), and not at all when the process dies of an
    # exception.
    finalizer.atexit = False
    track_owner(schedule, LABEL)
    register(schedule)  # a new optimizer over its parameters applies its pending mix first (handover.py)
