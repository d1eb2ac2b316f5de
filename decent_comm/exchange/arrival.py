"""A bounded arrival barrier: every rank of a group reaches the same point within `timeout`, or every rank
raises ``ExchangeTimeout`` naming the ranks that did not arrive in time.

    wait_for_ranks(group, timeout, what)   # collective over `group`; timeout in seconds, None: the group's own

Why it exists: the start-up collectives of the optimizers and exchangers (all_gather_object, broadcast,
dist.new_group) wait for the process group's own timeout - 30 minutes for gloo's default - so a rank that builds
its optimizer late, or never, stalled the others for half an hour and then failed without naming anyone. The
first collective of every construction is this barrier instead, bounded by the caller's `timeout`; the
collectives after it start when every rank is known to be there.

It runs on the store the default process group was created with, not on a collective, so that a rank that gives
up leaves nothing posted in a backend (a gloo collective abandoned by a timed-out wait keeps the group's worker
thread busy until the group's own timeout, 30 min), works the same for gloo and NCCL groups and touches no
device, and can name who is missing. Per call: one set, one add and one wait per rank; the names are only
looked up on a timeout.

Protocol (keys under decent_comm/arrival/<group>/<n>, n counting this group's barriers, the same on every rank):
a rank sets rank<r>, then adds 1 to `count`; the rank whose add makes it world_size sets `done`; the others wait
for `done`. A rank whose wait times out adds POISON to `count`. The store orders every add, so the first
poisoner sees exactly how many had arrived before anyone gave up: all of them (then the barrier succeeded and it
returns) or not (it writes the `verdict` naming the missing ranks, and raises). Later poisoners follow that
verdict, and a rank arriving after the first poison sees POISON in its own add and raises at once, saying the
others gave up on it. So every rank ends the same way, except in one race that still ends in an error: a rank
that sees `done` before a slower rank's poison lands keeps going, and its next collective then finds that rank
gone (the optimizer's next step raises within its own timeout).
"""
from __future__ import annotations

import datetime
import weakref
from typing import List, Optional

import torch
import torch.distributed as dist

from .._native import _C
from .store_calls import default_store

# The exchange layer's error family (exchanger.py re-exports them; imported from _C here, as exchanger.py imports
# this module).
ExchangeError, ExchangeTimeout = _C.ExchangeError, _C.ExchangeTimeout

POISON = 1 << 32   # added by a rank that gives up; world sizes stay far below it (the topology layer: <= 2**24)
_VERDICT_WAIT = datetime.timedelta(seconds=60)  # for the first poisoner's verdict: it writes it right after its add
# Calls so far per process group object: a group destroyed and created again (a retry after a failure, in one
# process) starts from 0 on every rank, although torch gives it the same name. Counted by name, a rank whose
# earlier call had timed out alone stayed one call ahead of the others for good: no construction could meet again.
_calls: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def group_timeout_s(group) -> float:
    """The timeout `group` was created with, in seconds (what a collective on it waits for)."""
    device = torch.device("cuda" if "nccl" in str(dist.get_backend(group)) else "cpu")
    return _C._process_group_timeout_ms(group, device) / 1000.0


def timeout_s(group, timeout: Optional[float]) -> float:
    """`timeout` in seconds, or when it is None the timeout `group` (None: the default group) was created with."""
    group = group if group is not None else dist.distributed_c10d._get_default_group()
    return group_timeout_s(group) if timeout is None else float(timeout)


def check_process_group(group, who: str = "") -> None:
    """A ValueError, its message starting with `who` ("Exchanger: "), unless `group` is None (the default group) or a
    torch.distributed ProcessGroup; checked before any torch call takes it: torch's own errors for a string ("Group x
    is not registered") or another object (AttributeError) named neither the argument nor what it must be. A rank
    refused here has no group to tell its peers on: they wait for it and time out naming it (wait_for_ranks)."""
    if group is None or (dist.is_available() and isinstance(group, dist.ProcessGroup)):
        return
    if dist.is_available() and type(group) is int and group == dist.GroupMember.NON_GROUP_MEMBER:
        # what dist.new_group() returns on the ranks it leaves out
        rank = f" (global rank {dist.get_rank()})" if dist.is_initialized() else ""
        raise ValueError(f"{who}this process{rank} is not a member of the process_group given "
                         "(dist.new_group() returned GroupMember.NON_GROUP_MEMBER here): use it on the ranks of that "
                         "group only")
    raise ValueError(f"{who}process_group must be a torch.distributed ProcessGroup (or None for the default group), "
                     f"got {type(group).__name__}")


def members_of(group) -> Optional[List[int]]:
    """The global ranks of `group`'s members (None for the default group, or torch.distributed not initialized):
    what an object keeps to name ranks in its errors instead of the group itself, which it must not hold past its
    shutdown (dist.destroy_process_group() then leaves the group, and gloo's threads, alive)."""
    if group is None or not (dist.is_available() and dist.is_initialized()):
        return None
    return list(dist.get_process_group_ranks(group))


def in_global_ranks(exc: BaseException, group) -> BaseException:
    """`exc`, its message extended (in place) to say which global ranks the ranks it names are, when `group` is a
    subgroup: every message of this layer names ranks of the group it runs on, and on a subgroup a user reading
    "rank 2" would take it for global rank 2. `group`: a process group, None (the default group), or the global
    ranks of its members as members_of() gave them."""
    if group is None or len(exc.args) != 1 or not isinstance(exc.args[0], str):
        return exc
    try:
        members = group if isinstance(group, list) else members_of(group)
    except Exception:  # noqa: BLE001 - a group destroyed meanwhile: the error as it is
        return exc
    if members is None or members == list(range(len(members))):  # its ranks are the global ones
        return exc
    note = f" [ranks of the process group: its ranks 0..{len(members) - 1} are global ranks {members}]"
    if not exc.args[0].endswith(note):
        exc.args = (exc.args[0] + note,)
    return exc


def detached(exc: BaseException) -> BaseException:
    """A copy of `exc` to keep for later (a failure checked or quoted after the call that raised it is over): its type,
    words and attributes, without its traceback, cause and context. Those hold the frames the error passed through, and
    the frames the objects they ran on: an optimizer's step() frames hold the optimizer, so an error kept on its
    schedule (which its finalizer holds: decent_comm.optim.teardown) kept a failed optimizer, its buffers and its
    exchangers alive until the process exited. `exc` itself keeps its traceback, for whoever catches it. A type
    that cannot be built again from its args alone is kept as a RuntimeError with its name and words."""
    try:
        copy = type(exc)(*exc.args)
        copy.__dict__.update(exc.__dict__)  # its attributes (MembersFailed.ranks, __notes__), none of them frames
    except Exception:  # noqa: BLE001 - a constructor taking other arguments than its args
        copy = RuntimeError(f"{type(exc).__name__}: {exc}")
    return copy


def ranks_text(ranks) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {list(ranks)}"


def wait_for_ranks(group, timeout: Optional[float], what: str) -> str:
    """Returns once every rank of `group` (None: the default group) has called it, or raises ExchangeTimeout on
    every rank, naming the ranks that did not arrive within `timeout` seconds (None: the group's own timeout).
    `what` names the point in the messages ("building the optimizer"). Returns a store key prefix that is the
    same on every rank and unique to this call (for what the caller keeps in the store afterwards)."""
    group = group if group is not None else dist.distributed_c10d._get_default_group()
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    name = group.group_name
    seq = _calls[group] = _calls.get(group, 0) + 1
    base = f"decent_comm/arrival/{name}/{seq}"
    if world_size == 1:
        return base
    seconds = timeout_s(group, timeout)
    store = default_store()  # each call bounded: a store that stops answering fails it (store_calls)
    try:
        store.set(f"{base}/rank{rank}", "1")
        count = store.add(f"{base}/count", 1)
        if count >= POISON:
            verdict = _verdict(store, base)
            raise in_global_ranks(ExchangeTimeout(f"decent_comm: {what}: this rank (rank {rank}) arrived after the "
                                                  f"other ranks had stopped waiting for it ({verdict})"), group)
        if count == world_size:
            store.set(f"{base}/done", "1")
            return base
        try:
            store.wait([f"{base}/done"], datetime.timedelta(seconds=seconds))
            return base
        except dist.DistStoreError:  # timed out (the store's own failures raise again below)
            pass
        count = store.add(f"{base}/count", POISON)
        if count // POISON > 1:  # another rank gave up first: its verdict is everyone's
            verdict = _verdict(store, base)
            if not verdict:
                return base
        elif count % POISON == world_size:  # everyone had arrived before anyone gave up
            store.set(f"{base}/verdict", "")
            return base
        else:
            missing = [r for r in range(world_size) if not store.check([f"{base}/rank{r}"])]
            verdict = (f"{ranks_text(missing)} did not arrive within {seconds:g} s" if missing else
                       f"{world_size - count % POISON} rank(s) did not arrive within {seconds:g} s")
            store.set(f"{base}/verdict", verdict)
    except dist.DistError as exc:  # the store itself failed (its server is gone): no rank can be named
        raise ExchangeError(f"decent_comm: {what}: the store of the default process group failed while the ranks "
                            f"met: {exc}") from exc
    raise in_global_ranks(ExchangeTimeout(f"decent_comm: {what}: {verdict} of the {world_size} (this rank: rank "
                                          f"{rank}); every rank that arrived raises this error"), group)


def _verdict(store, base: str) -> str:
    store.wait([f"{base}/verdict"], _VERDICT_WAIT)
    return store.get(f"{base}/verdict").decode()
