"""What a param group's options were when they were last checked and accepted: step() checks again only the groups
whose fingerprint differs (_FusedGroupOptions._check_group_options). A full check of every group cost about 38 us
per group and step (the meta-device kernel call of _check_values most of it): at 200 per-layer groups, 7.6 ms of a
16 ms DAdamW step. torch reads the options at every step, so the fingerprint must change with every edit that could
change whether the group is refused."""

from .checkpointing import SCHEDULE_KEY

# Immutable values, compared by type and value: True == 1 == 1.0, but a bool is refused where a number is taken.
# (A NaN lr is never accepted, so never compared.)
_PLAIN = (int, float, bool, str, complex, type(None))


def _value(v):
    kind = type(v)
    if kind in _PLAIN:
        return kind, v
    if kind in (tuple, list):
        return kind, tuple(_value(x) for x in v)
    # Anything else may change in place without a trace: a tensor (lr.data.fill_(-1.0), lr.numpy()[()] = -1 bump
    # neither its version counter nor its storage; skipped, the bad lr reached the kernel after other groups had
    # stepped), a numpy array, a dict. A new object() never equals it: such a group is checked at every step.
    return object()


def options_fingerprint(group, index, math_dtype):
    """Every option of param group `index` but its parameters (check_param_groups watches those) and, in group 0,
    the optimizer's own schedule entry (checkpointing.SCHEDULE_KEY, rewritten by state_dict() and repr()), with the
    group's math dtype, which the value checks depend on."""
    return math_dtype, tuple((key, _value(v)) for key, v in group.items()
                             if key != "params" and not (index == 0 and key == SCHEDULE_KEY))
