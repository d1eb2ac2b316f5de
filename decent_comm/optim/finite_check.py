"""check_finite: the buffers a GossipSchedule sends and receives, looked at for non-finite values, and the error
that follows (functions of the schedule `s`: its buckets, exchange, all_reduce, warmup and rank).

A rank whose own parameters are non-finite raises once the exchange it posted completed; a rank that received
non-finite values raises in the step that mixes them. Either first leaves its error in the store (the exchange
layer's ``report``: on this failure only, nothing on the per-step path), so that a rank which saw nothing - a
neighbour of neither, whose next transfer or whole-group all-reduce then fails because those ranks stopped - names
it too ("rank 2 raised an error of its own before (the likely cause): ... not finite ...") instead of a dead peer;
and once what its peers are to receive from it went out, it marks that it stops (``_stopping``), so that a peer
waiting for it while its process lives on stops waiting too.
"""
import logging
from typing import List, Optional

import torch

from ..exchange import ranks_text
from .plan import MixPlan

log = logging.getLogger("decent_comm")


def before_sending(s, plan: MixPlan) -> List[int]:
    """The buckets whose buffers are non-finite; on a group step each is flagged first, as a group's sum cannot
    say who sent what (GroupAllReduce.flag_nonfinite)."""
    bad = [b.index for b in s.buckets if not torch.isfinite(b.flat).all()]
    if bad and plan.group is not None and s.exchange is not None and not plan.silent:
        for i in bad:
            s.exchange.group_allreduce.flag_nonfinite(i, plan.step)
    return bad


def raise_sent(s, plan: MixPlan, bad: List[int], made_by: Optional[int]):
    """Raises this rank's error for its non-finite buckets `bad` once the exchange just posted completed (reported
    first: a peer whose transfer fails meanwhile names it). `made_by`: the step whose update made them."""
    when = "before the first step" if made_by is None else f"after optimizer step {made_by}"
    when += s.warmup.culprits(made_by) if s.warmup else ""
    error = _reported(s, f"the parameters of bucket(s) {bad} are not finite {when} (check_finite=True; steps "
                         "count from 0)")
    _complete_before_raising(s, plan)
    _stopping(s)
    raise error


def check_received(s, b, plan: MixPlan, neighbors: List[torch.Tensor]):
    """Raises when a buffer that bucket `b` received for `plan` holds a non-finite value."""
    for k, y in enumerate(neighbors[:plan.num_buffers]):
        if not torch.isfinite(y).all():
            who = f"rank {plan.recv[k]}" if plan.group is None else _nonfinite_in_group(s, b, plan)
            error = _reported(s, f"step {plan.step}: bucket {b.index} received non-finite values from {who} "
                                 "(check_finite=True)")
            _stopping(s)
            raise error


def _reported(s, body: str) -> RuntimeError:
    """Leaves `body` for the other ranks and returns this rank's error for it."""
    if s.exchange is not None:  # and the whole-group all-reduces (its companion): where another rank may fail next
        s.exchange.report(body)
    return RuntimeError(f"decent_comm: rank {s.rank}: {body}")


def _stopping(s):
    """Marks that this rank stops exchanging (GossipExchange.stopped), once what its peers are to receive from it
    went out: a peer whose transfer with it blocks while this process lives on (the error caught to save a
    checkpoint, a notebook) stops waiting (exchange.peer_watch) instead of waiting out its timeout."""
    if s.exchange is not None:
        s.exchange.stopped()


def _complete_before_raising(s, plan: MixPlan):
    """Lets the exchange just posted finish first. The process usually ends with the error, and an exit with the
    transfer in flight fails it on the peers' side ("the all-reduce among ranks [...] failed"), so they could not
    see the values, nor in a group the flag naming this rank. Every rank posted the same exchange, so this takes
    about one exchange; if it fails (a peer is gone too), the peers' own errors say so and this rank's error stays
    the one raised."""
    if s.exchange is None or plan.silent:
        return
    try:
        s.exchange.wait_all()
    except Exception as e:  # noqa: BLE001 - the non-finite values are this rank's error to report
        log.warning("decent_comm: rank %d: the exchange of non-finite values did not complete: %s", s.rank, e)


def _nonfinite_in_group(s, b, plan: MixPlan) -> str:
    # The members that flagged their own values in before_sending(); none did when the sum itself overflowed. This
    # rank's own part was finite (raise_sent() raised otherwise), so the culprit is one of the others.
    senders = s.exchange.group_allreduce.nonfinite_senders(b.index, plan.step, plan.group)
    others = [r for r in plan.group if r != s.rank]
    return f"the all-reduce among ranks {list(plan.group)} (" + (
        f"{ranks_text(senders)} sent non-finite values)" if senders else
        f"this rank sent finite values and none of ranks {others} flagged any: the sum itself likely "
        "overflowed)")
