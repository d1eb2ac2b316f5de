"""What each rank of a faulty job does. Rank FAULTY (1) carries the fault; the others train normally and must end
in a clear error. Every scenario records, per attempt, the exception (its class names and message) and the
time.time() it started and ended, on a clock shared by every rank of the machine, so that the seconds from the
fault (``t_fault``, written by the faulty rank) to each live rank's error can be read off the records.

    path   "p2p"   topology "ring" with exchange="p2p": each rank exchanges point to point with both others
           "group" topology "complete" on 3 ranks: each step is one all-reduce of the 3 (exchange="auto")
    mode   "awc" | "atc"

Scenarios: dead, silent, silent-warmup, late, options, size, exit, nan, nan-unchecked (see SCENARIOS and
docs/reliability.md).
"""

import os
import time

import torch

import decent_comm
from decent_comm.exchange import GossipExchange

FAULTY = 1
WARM_STEPS = 3          # healthy steps before a mid-training fault: the schedule is running, every edge agreed
TRAIN_STEPS = 40        # steps the live ranks try after a fault; any error ends them


class Ctx:
    """One rank's view of its job, and its record (what decent_train.faults.worker writes as JSON)."""

    def __init__(self, rank, world_size, path, mode, timeout, write):
        self.rank, self.world_size, self.path, self.mode, self.timeout = rank, world_size, path, mode, timeout
        self.faulty = rank == FAULTY
        self.record = dict(rank=rank, faulty=self.faulty, t_fault=None, attempts=[])
        self._write = write

    def optimizer_options(self, **overrides):
        topo = dict(topology="ring", exchange="p2p") if self.path == "p2p" else dict(topology="complete")
        return {**topo, "mode": self.mode, "timeout": self.timeout, **overrides}

    def mark_fault(self):
        self.record["t_fault"] = time.time()

    def attempt(self, what, fn):
        """Runs fn(), recording its exception (or none); returns fn()'s value, or None if it raised."""
        entry = dict(what=what, t_start=time.time())
        self.record["attempts"].append(entry)
        try:
            value = fn()
            entry.update(error=None, t_end=time.time())
            return value
        except Exception as exc:  # noqa: BLE001 - what the matrix judges
            entry.update(error=[c.__name__ for c in type(exc).__mro__], message=str(exc), t_end=time.time())
            return None

    def die(self):
        """Like a crash: the record reaches disk, then the process vanishes without any teardown."""
        self.mark_fault()
        self._write(self.record)
        os._exit(0)


def make_model(hidden=8):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 2))


def build(ctx, model, ctor=decent_comm.DAdamW, **overrides):
    return ctor(model.parameters(), lr=0.01, model=model, **ctx.optimizer_options(**overrides))


def train(ctx, model, opt, steps, start=0, nan_at=None, sync=True):
    for t in range(start, start + steps):
        g = torch.Generator().manual_seed(1000 * ctx.rank + t)
        x, y = torch.randn(6, 4, generator=g), torch.randn(6, 2, generator=g)
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        if nan_at == t:
            ctx.mark_fault()
            loss = loss * float("nan")
        loss.backward()
        opt.step()
    if sync:
        opt.synchronize()


def _mid_training(ctx, fault, **overrides):
    model = make_model()
    opt = build(ctx, model, **overrides)
    train(ctx, model, opt, WARM_STEPS)
    if ctx.faulty:
        fault()
    ctx.attempt("train after the fault", lambda: train(ctx, model, opt, TRAIN_STEPS, start=WARM_STEPS))
    return opt


def dead(ctx):
    """Rank 1 exits (os._exit, no teardown) after 3 healthy steps; the others keep stepping."""
    _mid_training(ctx, ctx.die)


def silent(ctx):
    """Rank 1 stays alive but stops stepping for timeout + 8 s after 3 healthy steps, then tries one step."""
    def stall():
        ctx.mark_fault()
        time.sleep(ctx.timeout + 8)
    _mid_training(ctx, stall)


def silent_warmup(ctx):
    """As silent, during the warm-up (warmup_steps: each step all-reduces the gradients over every rank, a
    blocking whole-group all-reduce instead of the gossip)."""
    def stall():
        ctx.mark_fault()
        time.sleep(ctx.timeout + 8)
    _mid_training(ctx, stall, warmup_steps=WARM_STEPS + TRAIN_STEPS)


def late(ctx):
    """Rank 1 builds its optimizer timeout + 3 s after the others."""
    if ctx.faulty:
        time.sleep(ctx.timeout + 3)
    model = make_model()
    opt = ctx.attempt("construct", lambda: build(ctx, model))
    if opt is not None:  # not refused: the ranks that did not wait for it would then train alone
        ctx.attempt("train", lambda: train(ctx, model, opt, WARM_STEPS))


# Options a rank may set differently from the others (rank 1 takes the second value).
OPTION_CASES = {
    "comm_dtype": (decent_comm.DAdamW, [dict(comm_dtype=None), dict(comm_dtype=torch.bfloat16)]),
    "accum_steps": (decent_comm.AccumAdamW, [dict(accum_steps=4), dict(accum_steps=2)]),
    "broadcast_init": (decent_comm.DAdamW, [dict(broadcast_init=True), dict(broadcast_init=False)]),
    "check_finite": (decent_comm.DAdamW, [dict(check_finite=False), dict(check_finite=True)]),
}


def options(ctx):
    """Each option of OPTION_CASES set differently on rank 1: the construction must be refused on every rank."""
    for name, (ctor, values) in OPTION_CASES.items():
        model = make_model()
        opt = ctx.attempt(name, lambda: build(ctx, model, ctor, **values[int(ctx.faulty)]))
        if opt is not None:
            opt.shutdown()


SIZE_BUCKET = 3


def size(ctx):
    """Rank 1's buffers differ in size: (1) its model has another hidden width (the optimizer's start-up check),
    (2) one bucket of 1500 elements against the others' 1000 through the exchange layer (GossipExchange, the
    object the optimizers exchange through, on the scenario's path)."""
    model = make_model(hidden=12 if ctx.faulty else 8)
    opt = ctx.attempt("parameter shapes", lambda: build(ctx, model))
    if opt is not None:
        opt.shutdown()
    numel = 1500 if ctx.faulty else 1000
    others = [r for r in range(ctx.world_size) if r != ctx.rank]
    groups = [tuple(range(ctx.world_size))] if ctx.path == "group" else ()
    ex = GossipExchange(None, torch.device("cpu"), timeout=ctx.timeout, groups=groups)
    send = torch.ones(numel)

    def exchange():
        if ctx.path == "group":
            ex.exchange(SIZE_BUCKET, send, [torch.empty(numel)], group=groups[0])
        else:
            ex.exchange(SIZE_BUCKET, send, [torch.empty(numel) for _ in others], send_to=others, recv_from=others)
        ex.wait(SIZE_BUCKET)
    ctx.attempt("bucket size", exchange)
    ctx.attempt("shutdown", ex.shutdown)


_script_globals = []  # what a training script's module scope holds until the interpreter exits


def exit_without_shutdown(ctx):
    """A healthy job whose script ends after its last step, without opt.shutdown() nor destroy_process_group:
    every rank must exit 0 with nothing on stderr. In AWC the last step launched an exchange nobody waits for."""
    model = make_model()
    opt = build(ctx, model)
    ctx.attempt("train", lambda: train(ctx, model, opt, WARM_STEPS, sync=False))
    _script_globals.append(opt)


def nan(ctx):
    """check_finite=True; rank 1's loss is NaN at step 3: it raises naming itself and the step, its neighbours
    raise naming it."""
    model = make_model()
    opt = build(ctx, model, check_finite=True)
    ctx.attempt("train", lambda: train(ctx, model, opt, 6, nan_at=3 if ctx.faulty else None))


def nan_unchecked(ctx):
    """As nan, without check_finite: no error is expected; records the first step after which each rank's
    parameters are non-finite (how far a NaN spreads, and how fast)."""
    model = make_model()
    opt = build(ctx, model)
    first_bad = None

    def run():
        nonlocal first_bad
        for t in range(6):
            train(ctx, model, opt, 1, start=t, nan_at=3 if ctx.faulty and t == 3 else None)
            if first_bad is None and not all(torch.isfinite(p).all() for p in model.parameters()):
                first_bad = t
    ctx.attempt("train", run)
    ctx.record["first_nonfinite_step"] = first_bad


SCENARIOS = {"dead": dead, "silent": silent, "silent-warmup": silent_warmup, "late": late, "options": options,
             "size": size, "exit": exit_without_shutdown, "nan": nan, "nan-unchecked": nan_unchecked}
