"""torch.optim.Optimizer's state_dict hooks around the whole of a decentralized optimizer's state_dict() and
load_state_dict(): torch's own methods are only a part of those (the schedule entry is added after them; the flat
buckets are loaded after them, from the state torch's load is not given), so hooks run by torch's methods would see a
state dict without the schedule, a load without its state, and a post-load optimizer whose state is not loaded yet."""

import contextlib
from collections import OrderedDict

_TABLES = ("_optimizer_state_dict_pre_hooks", "_optimizer_state_dict_post_hooks",
           "_optimizer_load_state_dict_pre_hooks", "_optimizer_load_state_dict_post_hooks")


@contextlib.contextmanager
def suspended(opt):
    """torch's state_dict / load_state_dict on `opt` without its hooks, which the caller runs around them."""
    saved = {name: getattr(opt, name) for name in _TABLES}
    try:
        for name in _TABLES:
            setattr(opt, name, OrderedDict())
        yield
    finally:
        for name, table in saved.items():
            setattr(opt, name, table)


def state_dict_with_hooks(opt, compute):
    """As torch.optim.Optimizer.state_dict: pre-hooks, `compute()`, post-hooks (which may replace the dict)."""
    for hook in opt._optimizer_state_dict_pre_hooks.values():
        hook(opt)
    sd = compute()
    for hook in opt._optimizer_state_dict_post_hooks.values():
        result = hook(opt, sd)
        if result is not None:
            sd = result
    return sd


def load_with_hooks(opt, state_dict, load):
    """As torch.optim.Optimizer.load_state_dict: pre-hooks (which may replace the dict), `load`, post-hooks."""
    state_dict = state_dict.copy()
    for hook in opt._optimizer_load_state_dict_pre_hooks.values():
        result = hook(opt, state_dict)
        if result is not None:
            state_dict = result
    load(dict(state_dict))  # the loader edits its dict: not the one a hook returned
    for hook in opt._optimizer_load_state_dict_post_hooks.values():
        hook(opt)
