"""--profile DIR: a torch.profiler trace of a few training steps per rank (DIR/trace_rank<r>.json, chrome trace
format; open it in Perfetto or chrome://tracing, or draw it with bench/trace_picture.py).

The steps are cut into ranges (``train::forward``, ``train::backward``, ``train::optimizer_step``) beside the
optimizer's own (``decent_comm::exchange_launch``, ``::exchange_wait``, ``::mix_update``, ...: decent_comm's
optim/tracing.py), so a trace shows where the host issues the exchange, computes while it is in flight, and
waits for it. Ranges are recorded only while the profiler runs: a run without --profile pays nothing."""

import contextlib
import os

import torch
from torch.autograd.profiler import record_function
from torch.profiler import ProfilerActivity, profile, schedule

# Skipped first (start-up, allocator warm-up), then one warm-up step the profiler discards, then recorded.
SKIP_STEPS, WARMUP_STEPS, ACTIVE_STEPS = 4, 1, 4


def step_range(name: str):
    """A ``train::<name>`` range while a profiler records, else nothing."""
    return record_function(f"train::{name}") if torch.autograd._profiler_enabled() else contextlib.nullcontext()


@contextlib.contextmanager
def step_profiler(out_dir, rank: int, device: torch.device):
    """Yields a callable to call after every step (the profiler's clock), or a no-op without `out_dir`."""
    if not out_dir:
        yield lambda: None
        return
    os.makedirs(out_dir, exist_ok=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    path = os.path.join(out_dir, f"trace_rank{rank}.json")
    steps = schedule(wait=SKIP_STEPS, warmup=WARMUP_STEPS, active=ACTIVE_STEPS, repeat=1)
    with profile(activities=activities, schedule=steps, on_trace_ready=lambda prof: prof.export_chrome_trace(path)) as prof:
        yield prof.step
