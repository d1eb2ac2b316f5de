"""What a run shows of the gossip work without reading the code. torch.profiler ranges, so a trace shows the exchange
under the forward/backward: ``decent_comm::exchange_launch``, ``::exchange_wait``, ``::mix_update`` (AWC's fused
mix + update), ``::local_update``, ``::atc_mix``, ``::warmup_allreduce``, ``::check_values`` (the fused
optimizers' per-step hyper-parameter check, whose kernel call on a meta-device stand-in is no real kernel). Free when
no profiler runs (record_function itself costs tens of microseconds per call even then). And under logging.DEBUG, one
line per rank saying how the optimizer gossips (log_setup)."""

import functools
import logging

import torch
from torch.autograd.profiler import record_function

log = logging.getLogger(__name__)


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


def log_setup(schedule) -> None:
    """One DEBUG line per rank saying how this optimizer will gossip, so that `logging.DEBUG` shows which path a
    run took (point to point or group all-reduce, which wire) without reading the code."""
    if not log.isEnabledFor(logging.DEBUG):
        return
    topo, buckets = schedule.topology, schedule.buckets
    if schedule.world_size == 1:
        path = "a single rank: no gossip"
    elif schedule.group_steps is not None:
        groups = len(schedule.group_steps.all_groups)
        path = f"group all-reduce on the steps that average in groups of >= 3 ranks ({groups} group(s)), point " \
               f"to point otherwise"
    else:
        path = "point to point"
    wire = "int8 with error feedback" if schedule.int8_wire is not None else \
        str(schedule.comm_dtype or "the parameters' dtype").replace("torch.", "")
    log.debug("decent_comm: rank %d of %d: topology %s (period %d), mode %s, wire %s, %s; %d parameter element(s) in "
              "%d bucket(s) of %d elements", schedule.rank, schedule.world_size,
              getattr(topo, "current_name", topo.name), topo.period, schedule.mode, wire, path,
              sum(s.numel for b in buckets for s in b.slots), len(buckets), sum(b.numel for b in buckets))
