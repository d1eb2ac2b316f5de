"""What a step may skip because a cheap test proves it unchanged since the last step (per bucket).

A step checks every parameter's storage (buckets.adopt_storage) and .grad (grads.gather_grads), splits each bucket
into runs by gradient presence and step count (step_counts.segments) and counts the steps: Python work per parameter,
which on models of many small tensors cost more than the update itself (2000 tensors of 16 elements: DAdamW's step
took twice torch.optim.AdamW(fused)'s, gather_grads 80% of it). Between two steps of a training loop none of it
changes, so each bucket keeps what the last full check found, keyed by values read with C loops (map over the
parameters, ~0.1 us each):

- the parameters' data_ptr, stride, size, dtype and device, recorded when each was its view of the bucket (every
  p.data = t, set_, .to(), .half(), t_() or resize_() changes one of them);
- each .grad object as gather_grads left it (a view of the slot, or None) and those views' data_ptr, stride and size
  (a .grad replaced or dropped is another object; one written through .data =, set_, t_() or resize_() has another
  layout);
- the step count k all the counts had at the last step's end, checked against their values (one comparison on
  the tensor: a write through `.data` or NumPy bumps no version counter, so the counter cannot tell).

Anything else, or any key that differs, runs the full code, which then records the keys again.
"""

import itertools
import operator
from typing import List, Optional

import torch

_data_ptr, _stride, _size = torch.Tensor.data_ptr, torch.Tensor.stride, torch.Tensor.size
_grad, _dtype, _device = operator.attrgetter("grad"), operator.attrgetter("dtype"), operator.attrgetter("device")


def _layout(tensors) -> object:
    """The tensors' addresses, strides and sizes; when one has no storage to read (a parameter turned sparse, p.data =
    ...), a new object, equal to no key: the full check says what is wrong."""
    try:
        return list(map(_data_ptr, tensors)), list(map(_stride, tensors)), list(map(_size, tensors))
    except RuntimeError:
        return object()


class StepCache:
    """One bucket's keys (module docstring). `params`: the bucket's parameters in slot order."""

    def __init__(self, params: List[torch.nn.Parameter]):
        self.params = params
        self.param_key: object = None  # the parameters' layout, dtype and device when adopt_storage passed
        self.views: Optional[List[torch.Tensor]] = None  # per slot, a view of the bucket's gradient buffer
        self.view_key: object = None   # their layout when made
        self.expect: Optional[list] = None      # per slot, .grad as last left (a view of its slot, or None)
        self.others: list = []                  # the tensors among them that are not in `views`,
        self.others_key: object = None  # and their layout then
        # Per slot: .grad is not None, as gather_grads left it. What the rest of that step reads (segments, the step
        # counts, opt.state's publication) instead of walking the parameters again; nothing between changes a .grad
        # but the warm-up's average, which notes it (warmup.WarmupAverage.average).
        self.has: Optional[List[bool]] = None
        self.all_have = False
        self.count: Optional[int] = None  # the count every slot had at the last step's end (None: not all equal)

    # ------------------------------------------------------------------------------------------------ parameters

    def params_unchanged(self) -> bool:
        """Every parameter is still what it was when adopt_storage last passed (its view of the bucket)."""
        return self.param_key is not None and self._param_key() == self.param_key

    def params_in_place(self) -> bool:
        """Every parameter still starts where adopt_storage last left it: the data pointers of params_unchanged's key
        only (1/7 of its cost: 145 against 980 us over 2000 parameters), what ATC's pending mix needs before it
        writes the bucket, each step paying the full check once already; a change of layout, dtype or device at the
        same address is the next step's to refuse."""
        key = self.param_key
        if not isinstance(key, tuple):
            return False
        try:
            return list(map(_data_ptr, self.params)) == key[0]
        except RuntimeError:  # (no storage to read: the full check says what is wrong)
            return False

    def note_params(self) -> None:
        """adopt_storage passed: every parameter is its view of the bucket."""
        self.param_key = self._param_key()

    def _param_key(self) -> object:
        layout = _layout(self.params)
        if not isinstance(layout, tuple):
            return layout
        return (*layout, list(map(_dtype, self.params)), list(map(_device, self.params)))

    # ------------------------------------------------------------------------------------------------- gradients

    def grad_views(self, b) -> List[torch.Tensor]:
        """Per slot, a view of b.grad (made once, and again when user code re-laid one out through a .grad)."""
        if self.views is None or _layout(self.views) != self.view_key:
            self.views = [b.view(b.grad, s) for s in b.slots]
            self.view_key = _layout(self.views)
            self.expect = None
        return self.views

    def grads_unchanged(self) -> bool:
        """Every .grad is the object it was when note_grads ran, and each tensor among them has the layout it had."""
        return self.expect is not None and all(map(operator.is_, map(_grad, self.params), self.expect)) and \
            _layout(self.views) == self.view_key and _layout(self.others) == self.others_key

    def note_grads(self) -> None:
        """Every .grad is None or a view of its slot in the gradient buffer (gather_grads has run, zero_grad, the
        warm-up's average): remember them, and which parameters have one."""
        self.expect = list(map(_grad, self.params))
        # the views among them that are not grad_views' (kept from user code: p.grad = p.grad.view(p.shape))
        self.others = [g for g, v in zip(self.expect, self.views) if g is not None and g is not v] \
            if self.views is not None else [g for g in self.expect if g is not None]
        self.others_key = _layout(self.others)
        self.has = list(map(operator.is_not, self.expect, itertools.repeat(None)))
        self.all_have = all(self.has)

    # ---------------------------------------------------------------------------------------------- step counts

    def uniform_count(self, step_count: torch.Tensor) -> Optional[int]:
        """k when every count of `step_count` is the k the last step left, else None (then segments reads them)."""
        k = self.count
        return k if k is not None and bool(step_count.eq(k).all()) else None

    def note_counts(self, k: Optional[int]) -> None:
        """Every count is k now (None: not all equal, or not known)."""
        self.count = k
