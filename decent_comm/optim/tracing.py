"""torch.profiler ranges for the gossip work, so a trace shows the exchange under the forward/backward:
``decent_comm::exchange_launch``, ``::exchange_wait``, ``::mix_update`` (AWC's fused mix + update),
``::local_update``, ``::atc_mix``, ``::warmup_allreduce``. Free when no profiler runs (record_function itself
costs tens of microseconds per call even then)."""

import functools

import torch
from torch.autograd.profiler import record_function


def traced(name: str):
    label = f"decent_comm::{name}"

    def decorate(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if not torch.autograd._profiler_enabled():
                return fn(*args, **kwargs)
            with record_function(label):
                return fn(*args, **kwargs)
        return wrapper
    return decorate
