"""What a param group's options were when they were last checked and accepted: step() checks again only the groups
whose fingerprint differs (_FusedGroupOptions._check_group_options). A full check of every group cost about 38 us
per group and step (the meta-device kernel call of _check_values most of it): at 200 per-layer groups, 7.6 ms of a
16 ms DAdamW step. torch reads the options at every step, so the fingerprint must change with every edit that could
change whether the group is refused."""

import torch

from .checkpointing import SCHEDULE_KEY

# Immutable values, compared by type and value: True == 1 == 1.0, but a bool is refused where a number is taken.
# (A NaN never equals another NaN object: its group is simply checked again.)
_PLAIN = (int, float, bool, str, complex, type(None))


class _Same:
    """A tensor option (a tensor lr, betas of tensors) is equal only as the same object, holding it so that its id is
    not reused by a new tensor; the caller adds its version counter (an in-place lr.fill_(-1.0) bumps it), storage
    address (lr.data = ..., which does not), dtype and shape."""
    __slots__ = ("obj",)
    __hash__ = None

    def __init__(self, obj):
        self.obj = obj

    def __eq__(self, other):
        return isinstance(other, _Same) and other.obj is self.obj


def _value(v):
    kind = type(v)
    if kind in _PLAIN:
        return kind, v
    if kind in (tuple, list):
        return kind, tuple(_value(x) for x in v)
    if isinstance(v, torch.Tensor):
        try:
            return _Same(v), v._version, v.data_ptr(), v.dtype, v.device, v.shape
        except RuntimeError:  # a tensor without plain storage (sparse, ...): checked every time
            return object()
    return object()  # anything else may change in place (a numpy array, a dict): a new object() never equals it


def options_fingerprint(group, index, math_dtype):
    """Every option of param group `index` but its parameters (check_param_groups watches those) and, in group 0,
    the optimizer's own schedule entry (checkpointing.SCHEDULE_KEY, rewritten by state_dict() and repr()), with the
    group's math dtype, which the value checks depend on."""
    return math_dtype, tuple((key, _value(v)) for key, v in group.items()
                             if key != "params" and not (index == 0 and key == SCHEDULE_KEY))
