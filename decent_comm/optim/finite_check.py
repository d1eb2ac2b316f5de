"""check_finite: the buffers a GossipSchedule sends and receives, looked at for non-finite values, and the error
that follows (functions of the schedule `s`: its buckets, exchange, all_reduce, warmup and rank).

A rank whose own parameters are non-finite raises once the exchange it posted completed; a rank that received
non-finite values raises in the step that mixes them; either is then unusable (check_usable). Either first leaves
its error in the store (the exchange layer's ``report``: on this failure only, nothing on the per-step path), so that
a rank which saw nothing - a neighbour of neither, whose next transfer or whole-group all-reduce then fails because
those ranks stopped - names it too ("rank 2 raised an error of its own before (the likely cause): ... not finite
...") instead of a dead peer; and once what its peers are to receive from it went out, it marks that it stops
(``_stopping``), so that a peer waiting for it while its process lives on stops waiting too.

On a round of the 8-bit wire the sender looks at its own public copy once encoded, in place of its parameters (the
same cost): the copy is non-finite where the parameters are, and also where the parameters are finite but the
change x - copy, or the new copy, is beyond float32's range (a float64 parameter above FLT_MAX; a float32 change of
3e38 - (-3e38)). That block's copies are then NaN on the sender and its receivers, and the error names the wire's
range as the cause instead of blaming the next optimizer step for the NaN parameters the mix makes of them.
"""
import logging
from typing import List, Optional, Sequence, Tuple

import torch

from ..exchange import ranks_text
from . import fork_guard
from .plan import MixPlan

log = logging.getLogger(__name__)


#: the largest float32, beyond which the 8-bit wire's change x - copy or its copy cannot go
FLT_MAX = torch.finfo(torch.float32).max


def encodes(s, plan: MixPlan) -> bool:
    """Whether launching `plan` encodes the buckets for the 8-bit wire (GossipSchedule._send_buffer)."""
    return s.int8_wire is not None and s.exchange is not None and not plan.silent


def before_sending(s, plan: MixPlan) -> List[int]:
    """The buckets whose buffers are non-finite; on a group step each is flagged first, as a group's sum cannot
    say who sent what (GroupAllReduce.flag_nonfinite). None on a round of the 8-bit wire: after_encoding looks."""
    if encodes(s, plan):
        return []
    bad = [b.index for b in s.buckets if not torch.isfinite(b.flat).all()]
    if bad and plan.group is not None and s.exchange is not None and not plan.silent:
        for i in bad:
            s.exchange.group_allreduce.flag_nonfinite(i, plan.step)
    return bad


def after_encoding(s, plan: MixPlan) -> Tuple[List[int], List[str]]:
    """On a round of the 8-bit wire (once every bucket was encoded): the buckets whose parameters are non-finite, and
    a description of each bucket whose public copy went non-finite although its parameters are finite (the wire's
    float32 range). Looks at the parameters only where the copy is non-finite: a non-finite x makes its copy's block
    NaN, so a finite copy means finite parameters."""
    bad, wire = [], []
    for b in s.buckets:
        copy = s.int8_wire.own_copy(b, plan)
        if torch.isfinite(copy).all():
            continue
        if not torch.isfinite(b.flat).all():
            bad.append(b.index)
        else:
            wire.append(_out_of_range(b, copy, s.int8_wire.block))
    return bad, wire


def _out_of_range(b, copy: torch.Tensor, block: int) -> str:
    """Where bucket b's copy went non-finite: its first such codec block, and the element of largest |x| there with
    the parameter holding it (the likely culprit: the x - copy that overflowed is gone from the NaN copy)."""
    first = int(torch.nonzero(~torch.isfinite(copy))[0])
    lo = first // block * block
    hi = min(b.numel, lo + block)
    magnitude = b.flat[lo:hi].double().abs()
    k = lo + int(magnitude.argmax())
    where = ""
    for slot in b.slots:
        if slot.offset <= k < slot.offset + slot.numel:
            where = f", element {_index(k - slot.offset, slot)} of a parameter of shape {tuple(slot.shape)}"
    return (f"bucket {b.index} (param group {b.group_index}), elements {lo}..{hi - 1} (largest |x| "
            f"{float(magnitude.max()):g}{where})")


def _index(m: int, slot) -> tuple:
    """The index of the element at offset m of a slot's memory (dense; channels_last too, by its strides)."""
    strides, step = [], 1
    for size in reversed(slot.shape):
        strides.insert(0, step)
        step *= size
    return tuple((m // st) % size for st, size in zip(slot.stride or strides, slot.shape))


def raise_sent(s, plan: MixPlan, bad: List[int], made_by: Optional[int], wire: Sequence[str] = ()):
    """Raises this rank's error for its non-finite buckets `bad`, and for the buckets `wire` whose 8-bit wire copies
    left float32's range (after_encoding), once the exchange just posted completed (reported first: a peer whose
    transfer fails meanwhile names it). `made_by`: the step whose update made them."""
    when = "before the first step" if made_by is None else f"after optimizer step {made_by}"
    when += s.warmup.culprits(made_by) if s.warmup else ""
    parts = [f"the parameters of bucket(s) {bad} are not finite {when}"] if bad else []
    if wire:
        parts.append(f"the change x - copy sent {when} exceeds the 8-bit wire's float32 range in " + "; ".join(wire) +
                     f": the parameters are finite, but x - copy or the new public copy is beyond +-FLT_MAX = "
                     f"{FLT_MAX:.8g}, so that codec block's public copies are NaN (or +-inf) on this rank and on "
                     "the ranks it sends to (a parameter beyond +-FLT_MAX, float64, cannot use comm_dtype=torch.int8)")
    error = _reported(s, "; ".join(parts) + " (check_finite=True; steps count from 0)")
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
    """Leaves `body` for the other ranks and returns this rank's error for it, kept as the schedule's `failed`."""
    if s.exchange is not None:  # and the whole-group all-reduces (its companion): where another rank may fail next
        s.exchange.report(body)
    error = RuntimeError(f"decent_comm: rank {s.rank}: {body}")
    s.failed = s.failed or str(error)
    return error


def check_usable(s, what: str) -> None:
    """RuntimeError quoting check_finite's first error once one was raised, before `what` touches anything. The
    error leaves the step part done (a neighbour's non-finite bucket k is found after buckets 0..k-1 were mixed and
    updated: checking every bucket first would wait for the last one's transfer before the first update, the overlap
    lost), this rank has told its peers it stopped, and a retry mixed and updated those buckets again before raising
    the same words: unusable, as after an exchange's error. First: RuntimeError in a fork of the process that built
    the optimizer (fork_guard), whose waits would never end."""
    fork_guard.check(s, what)
    if s.failed is not None:
        raise RuntimeError(f"decent_comm: {what}: unusable after an earlier check_finite error (build a new optimizer "
                           f"and load a checkpoint, or restart the process); the error was: {s.failed}")


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
