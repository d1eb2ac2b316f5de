"""The step-agreement check before the optimizer's whole-group all-reduces: every rank confirms that every rank is
about to run the same ones after the same number of optimizer steps (``announce``), and raises an error naming the
ranks that are not (uneven step() calls, closure evaluations, collective utilities called alone); and the same
check at the first step after building the optimizer or loading a state_dict (``agree_on_step``), where the ranks'
schedules may stand at different steps with no whole-group all-reduce to come."""

from typing import Dict, List, Optional

from ..exchange import CollectiveMismatch, in_global_ranks, ranks_text


def announce(all_reduce, what: str, step: int, sizes: List[int], evaluation: Optional[int] = None) -> None:
    """Before the optimizer's whole-group all-reduces of `sizes` elements (a step's or a utility's): every rank
    checks that every rank is about to run the same ones, after the same number of optimizer steps
    (BoundedAllReduce.agree), and raises RuntimeError naming the ranks otherwise, before any of them is posted.

    Gossip cannot see it: a rank that calls step() once more than the others (an uneven last batch) pairs each later
    round with its neighbours' previous one, same sizes and tags, so nothing fails and the replicas mix rounds of
    different steps; and whole-group all-reduces out of step would pair tensors of different calls (gloo aborts the
    process on unequal sizes).

    `evaluation`: the wrapped optimizer's closure evaluation of this step (1 for the first) whose gradients the
    warm-up averages (Decentralized): ranks that evaluate it a different number of times are named as such."""
    if all_reduce is None:
        return
    try:
        all_reduce.agree(what, step, sizes, sub=evaluation)
    except CollectiveMismatch as e:
        sides = e.sides
        uneven = _uneven_evaluations(sides)
        if uneven:
            raise RuntimeError(f"decent_comm: {what}: {uneven}") from e
        known = [v for v in sides.values() if v is not None]
        if len(known) == len(sides) and len({(v[0], v[2], v[3]) for v in known}) == 1:
            by_count: Dict[int, List[int]] = {}
            for r, v in sides.items():
                by_count.setdefault(v[1], []).append(r)
            seen = "; ".join(f"{ranks_text(rs)}: {c} steps" for c, rs in sorted(by_count.items(), reverse=True))
            problem = f"the ranks have taken different numbers of optimizer steps ({seen})"
        else:
            problem = _other_calls(sides)
        raise RuntimeError(f"decent_comm: {what}: {problem}. Every rank must call step() equally often (e.g. drop an "
                           "uneven last batch on every rank), use a GradScaler on every rank or on none, and call the "
                           "collective utilities together; gossip between ranks at different steps mixes neighbours' "
                           "parameters of other steps") from e


def _other_calls(sides) -> str:
    """The error's words when the ranks of a mismatch (CollectiveMismatch.sides) were about to make other calls."""
    known = [v for v in sides.values() if v is not None]
    same_call = len(known) == len(sides) and len({(v[0], v[1]) for v in known}) == 1
    seen = "; ".join(f"rank {r}: " + (f"{v[0]} after {v[1]} steps" if v is not None else "(unknown)")
                     + (f" ({v[2]} tensors, {v[3]} elements)" if same_call else "") for r, v in sides.items())
    return f"the ranks are not running the same whole-group all-reduce ({seen})"


def _uneven_evaluations(sides) -> str:
    """The error's words when the sides of a mismatch (CollectiveMismatch.sides) are ranks whose wrapped optimizer
    evaluated a warm-up step's closure a different number of times, else "". Every earlier announcement agreed, so
    the ranks at a k-th evaluation (k > 1) of step t are all at that one, and every other rank stopped after k - 1
    (it went on to the next step, or to another call)."""
    if any(v is None for v in sides.values()):
        return ""
    further = [(v[1], v[4]) for v in sides.values() if len(v) > 4 and v[4] > 1]
    if not further:
        return ""
    step, k = further[0]
    at = [r for r, v in sides.items() if len(v) > 4 and (v[1], v[4]) == (step, k)]
    stopped = [r for r in sides if r not in at]
    if not stopped:  # all at the same evaluation: they differ in something else (sizes)
        return ""
    return (f"the wrapped optimizer evaluated the closure a different number of times on the ranks in warm-up step "
            f"{step} ({ranks_text(at)}: {k} times or more; {ranks_text(stopped)}: {k - 1} "
            f"time{'s' if k > 2 else ''}). In a warm-up step every evaluation's gradients are averaged over the ranks, "
            "as DDP's backward does, so every rank must evaluate the closure equally often; an optimizer that decides "
            "from this rank's own loss when to stop (LBFGS's tolerance_change, its strong_wolfe line search) may stop "
            "earlier on one rank. Make the number of evaluations the same on every rank (LBFGS: line_search_fn=None "
            "and tolerance_change=0, so that max_iter, max_eval and the averaged gradient decide it), or use "
            "warmup_steps=0 with such an optimizer (warming up first, if wanted, with another optimizer wrapped)")


#: What agree_on_step announces (the same words on every rank: the step is the label that must agree)
AGREE_STEP = "step(): agreeing with the other ranks on where the gossip schedule stands"


#: What a rank last did to its schedule, as agree_on_step names it (the index is what it announces)
_SINCE = ("no state_dict loaded", "after load_state_dict", "after a refused load_state_dict")


def agree_on_step(all_reduce, step: int, since: str) -> None:
    """At a rank's first step after it built the optimizer or loaded a state_dict: returns when every rank of the group
    is at schedule step `step` too, else raises RuntimeError on every rank naming each rank's step and `since`: "built",
    "loaded" or "refused" (a load_state_dict that raised, caught). One all-reduce (BoundedAllReduce.agree); nothing of
    the step has run. A refused load beside loads that went through is refused too, at the same step: a load
    restarts the exchange in flight (schedule_state.load_state_dict) and a refused one keeps it, so their rounds
    would no longer pair up."""
    try:  # the refusal is announced as a batch size, so that it is compared (`sub` only names a side)
        all_reduce.agree(AGREE_STEP, step, [1] if since == "refused" else [],
                         sub=("built", "loaded", "refused").index(since))
    except CollectiveMismatch as e:
        sides = e.sides
        if not all(v is None or v[0] == AGREE_STEP for v in sides.values()):  # another call on some rank
            raise in_global_ranks(RuntimeError(f"decent_comm: {AGREE_STEP}: {_other_calls(sides)}. Every rank must "
                                               "call step() equally often and the collective utilities together, and "
                                               "step its optimizers in the same order"), all_reduce.group) from e
        seen = "; ".join(f"rank {r}: " + ("(unknown)" if v is None else f"step {v[1]}, " + (
            _SINCE[v[4] if len(v) > 4 and 0 <= v[4] < len(_SINCE) else 0])) for r, v in sides.items())
        if len({v[1] for v in sides.values() if v is not None}) == 1 and None not in sides.values():
            raise in_global_ranks(RuntimeError(
                f"decent_comm: {AGREE_STEP}: a load_state_dict was refused on some ranks and went through on the "
                f"others ({seen}): a load restarts the exchange in flight and a refused one keeps it, so their rounds "
                "would not pair up. Nothing was stepped; load on every rank again (state_dicts every rank accepts), "
                "or restart every rank from its checkpoint"), all_reduce.group) from e
        raise in_global_ranks(RuntimeError(
            f"decent_comm: {AGREE_STEP}: the ranks' gossip schedules stand at different steps ({seen}), so each would "
            "mix its neighbours' parameters of other steps. Every rank must resume from its own checkpoint of the same "
            "step (a save that did not finish on every rank, or a wrong path, leaves them apart; so do a refused "
            "load that one rank caught and went on from, and DCP's get_state_dict with full_state_dict=True and "
            "cpu_offload=True, which keeps rank 0's state only). Nothing was stepped; load matching checkpoints on "
            "every rank (or build every optimizer afresh) and step again"), all_reduce.group) from e
