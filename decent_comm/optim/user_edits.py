"""What users change behind an optimizer's back the torch.optim way, and what a step makes of it.

torch.optim reads its param groups and ``opt.state`` afresh at every step, so code written for it may edit them
between steps: reset the moments (``opt.state.clear()``, ``del opt.state[p]``, ``opt.state[p]["exp_avg"] =
torch.zeros_like(p)``, ``opt.state[p]["exp_avg"].data = ...``, ``opt.state[p]["step"].fill_(0)``), or append a
parameter to a group. The decentralized optimizers keep parameters and state in
flat buckets laid out at construction (the same on every rank), with ``opt.state[p]`` holding views of them. So a
step first checks that nothing was edited: state edits are taken into the flat buffers as torch would take them, and
edits of the groups' parameters, which the buckets cannot follow, are refused rather than silently ignored.

It also tells torch.distributed.checkpoint's state initialization (a step at lr 0 on zero gradients, which must
neither communicate nor count) apart from a user's step that merely looks like it.
"""

import itertools
import operator
import sys
from typing import Callable, List, Sequence

import torch

from .buckets import Bucket
from .step_counts import count_classes
from .state_views import StateLayout, load_state


def group_layout(groups: Sequence[dict]) -> List[tuple]:
    """Per param group, the ids of its parameters in order: what the buckets were built from."""
    return [tuple(id(p) for p in g["params"]) for g in groups]


def check_param_groups(groups: Sequence[dict], built: List[tuple]) -> None:
    """RuntimeError when `groups` no longer hold the parameters the buckets were built from (`built`, from
    group_layout): a group added, a parameter appended to or removed from a group. The buckets (and every other
    rank's) cannot follow, so the change would be ignored: the new parameter never updated, the removed one still
    updated and averaged."""
    if len(groups) == len(built) and all(tuple(map(id, g["params"])) == ids for g, ids in zip(groups, built)):
        return  # (every step: a C loop per group; the diagnostics below sort the ids)
    if len(groups) != len(built):
        raise RuntimeError(f"decent_comm: the optimizer was built with {len(built)} param group(s) and now has "
                           f"{len(groups)}: groups added later (e.g. to the wrapped optimizer) would be neither updated "
                           "nor averaged; pass every group at construction")
    for k, (g, ids) in enumerate(zip(groups, built)):
        params = g["params"]
        if len(params) == len(ids) and sorted(map(id, params)) == sorted(ids) and any(
                id(p) != i for p, i in zip(params, ids)):
            raise RuntimeError(
                f"decent_comm: param group {k} holds its parameters in another order than at construction: the flat "
                "buckets and the state_dict's parameter numbers follow the construction order, the same on every "
                "rank; put the list back in that order")
        if len(params) != len(ids) or any(id(p) != i for p, i in zip(params, ids)):
            raise RuntimeError(
                f"decent_comm: param group {k} holds other parameters than at construction ({len(ids)} then, "
                f"{len(params)} now): the parameters are laid out in flat buckets at construction, the same on every "
                "rank, so one added to a group later would never be updated and one removed would still be; pass "
                "every parameter at construction (one that should not train yet can have requires_grad=False) or "
                "build a new optimizer")


class StateWatch:
    """What opt.state held when the optimizer last handed it back (after construction, step, state_dict and
    load_state_dict), to tell at the next step whether the user edited it: a parameter's entry added, removed or
    replaced, a tensor or "step" assigned under an optimizer state name (identity tests, run by C loops: map over
    operator.is_); a state tensor given other memory (t.data = u, t.set_(u)), which torch's next step would read
    (its data_ptr, another C loop; a re-layout of the same memory, t.data = t.data.t(), is not looked for); a step
    count written in place (the counts' version counter, per bucket). The 8-bit wire's copies, a delayed round's
    correction and foreign entries are not looked at. A step pays ~0.25 us per parameter and state name for it
    (200 parameters of DAdamW: 0.15 ms, of which 0.1 ms for the data_ptr test, on a loaded 2-core machine)."""

    def __init__(self):
        self._state = None
        self._keys: list = []      # opt.state's parameter keys (tensors), in order,
        self._entries: list = []   # and their entries
        self._published: list = []  # each bucket's Bucket.published when the lists below were built
        self._dicts: list = []     # per (published parameter, name): its entry in opt.state,
        self._names: list = []     # the name,
        self._views: list = []     # and what the entry held under it
        self._held: list = []      # the indices of the views held (not None) in _views,
        self._held_views: list = []  # those views,
        self._addresses: list = []  # their data_ptr(),
        self._twins: list = []     # and another view of the same memory each
        self._count_versions: list = []  # per bucket: its step counts' version counter

    def note(self, buckets: List[Bucket], state, names_of: Callable[[Bucket], List[str]]) -> None:
        """Remembers opt.state as the optimizer leaves it."""
        published = [b.published for b in buckets]
        if self._state is not state or len(published) != len(self._published) or \
                not all(map(operator.is_, published, self._published)):
            self._dicts, self._names, self._views = [], [], []
            for b, pub in zip(buckets, published):
                names = [*names_of(b), "step"]
                for s, views in zip(b.slots, pub):
                    if views:
                        entry = state[s.param]
                        for n in names:
                            self._dicts.append(entry)
                            self._names.append(n)
                            self._views.append(views.get(n))
            self._held = [k for k, v in enumerate(self._views) if v is not None]
            self._held_views = [self._views[k] for k in self._held]
            self._addresses = list(map(torch.Tensor.data_ptr, self._held_views))
            self._twins = [t.detach() for t in self._held_views]
            self._published = published
        self._state = state
        self._keys = list(itertools.compress(state, _tensor_keys(state)))
        self._entries = list(map(state.__getitem__, self._keys))
        self._count_versions = [_version(b.step_count) for b in buckets]

    def edited(self, state) -> bool:
        """Whether a parameter's entry of opt.state was added, removed or replaced since note(). Other keys are not
        looked at (the reload reads the parameters' entries only): a step hook that counts under opt.state["n"], as
        torch's tests do, replaced an entry at every step and made every step a full reload (22x slower with 2,000
        parameters)."""
        if state is not self._state or sum(_tensor_keys(state)) != len(self._keys):
            return True
        # as many parameter keys as noted, each still holding its entry: the same keys, the same entries
        if not all(map(operator.is_, map(state.get, self._keys), self._entries)):
            return True
        return not all(map(operator.is_, map(dict.get, self._dicts, self._names), self._views))

    @torch.no_grad()
    def adopt_moved(self) -> bool:
        """State tensors given other storage since note() that opt.state still holds: their values are copied into
        their views' memory, and the tensor made that view again (as buckets.adopt_storage does for parameters), so
        the user's reference stays opt.state's and live. False, with nothing done, when one now has another shape
        (a reload refuses it, naming it)."""
        if list(map(torch.Tensor.data_ptr, self._held_views)) == self._addresses:
            return True
        moved = [(t, twin) for k, t, twin in zip(self._held, self._held_views, self._twins)
                 if not t.is_set_to(twin) and self._dicts[k].get(self._names[k]) is t]
        if any(t.shape != twin.shape for t, twin in moved):
            return False
        # Read every source before any view is written: one given another state tensor's memory (ea.data, eb.data
        # = eb.data, ea.data; a rotation) was overwritten by an earlier copy (two parameters got one's moments).
        ours = {twin.untyped_storage().data_ptr() for twin in self._twins}
        sources = [t.detach().clone() if t.untyped_storage().data_ptr() in ours else t.detach() for t, _ in moved]
        for (t, twin), source in zip(moved, sources):
            twin.copy_(source)
            t.data = twin
        return True

    def counts_written(self, buckets: List[Bucket]) -> List[Bucket]:
        """The buckets whose step counts were written since note(), in place (opt.state[p]["step"].fill_(1))."""
        return [b for b, v in zip(buckets, self._count_versions) if _version(b.step_count) != v]

    def needs_reload(self, state, buckets: List[Bucket]) -> bool:
        """Takes in the edits that need no reload (storage given to a state tensor; counts written in place, which
        the kernels that count on the device read from each run's first slot: the runs are regrouped by the counts,
        one read of them) and says whether the others ask for one (adopt_state_edits)."""
        if self.edited(state) or not self.adopt_moved():  # (the reload takes a moved tensor in as a replacement)
            return True
        for b in self.counts_written(buckets):
            if b.classes is not None:
                b.classes = count_classes(b.step_count.tolist())
        return False


def _tensor_keys(state):
    """Per key of opt.state, whether it is a tensor (a parameter's entry, as param_states tells them), by a C loop."""
    return map(isinstance, state, itertools.repeat(torch.Tensor))


def _version(t: torch.Tensor) -> int:
    """t's version counter (bumped by every in-place write through it or a view of it); an inference tensor has
    none, and cannot be written outside inference mode anyway."""
    return -1 if t.is_inference() else t._version


def adopt_state_edits(buckets: List[Bucket], params: Sequence, state, layout: StateLayout) -> None:
    """Loads opt.state as it now stands into the flat buffers, as load_state_dict would load it: a parameter without
    state starts afresh (zero moments, count 0, as in torch.optim), an assigned tensor is copied in (its shape
    checked), an assigned "step" sets the count, foreign entries stay as they are; then opt.state holds the buckets'
    views again."""
    # keyed by the parameters' indices (the optimizer's param groups in order), as in a state_dict and its errors
    saved = {k: dict(state[p]) for k, p in enumerate(params) if p in state}
    load_state(buckets, saved, dict(enumerate(params)), state, layout)


def called_by_checkpoint_init(depth: int = 12) -> bool:
    """Whether torch.distributed.checkpoint's _init_optim_state is the caller of this step (within `depth` frames:
    torch's step hooks and no_grad wrap the call). It steps an optimizer without state once, at lr 0 on zero
    gradients, to create the state it then loads into; a user's first step can look the same (a warm-up from lr 0,
    a batch whose gradients are all zero), so the look alone does not tell them apart."""
    frame = sys._getframe(1)
    for _ in range(depth):
        if frame is None:
            return False
        if frame.f_code.co_name == "_init_optim_state" and \
                str(frame.f_globals.get("__name__", "")).startswith("torch.distributed.checkpoint"):
            return True
        frame = frame.f_back
    return False
