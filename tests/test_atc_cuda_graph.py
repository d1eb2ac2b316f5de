"""ATC's mix-before-use hooks (optim/mix_hooks.py) when a forward is captured into a CUDA graph. A replay runs no
Python hook, and the pending mix cannot be applied inside the capture (its wait for the exchange queries an event,
which invalidates a global-mode capture, then fails the exchange and aborts its communicator, so every neighbour
timed out). So a capture turns deferral off for good (step() applies every mix itself: replays read mixed
parameters), and a capture that would read a pending mix raises RuntimeError without touching the exchange.

No GPU here: the capture is simulated by patching torch.cuda.is_initialized / is_current_stream_capturing to True
during the one forward being "captured" (on CPU the hooks make no other CUDA call), on 2 gloo ranks that capture at
the same step, as a data-parallel script does: both raise, both apply the mix with synchronize(), so neither is
left waiting. The reference is the same run without any capture: ATC with the mix deferred to the hooks, whose
numbers the mix at the end of step() must reproduce bitwise (the same kernel on the same operands)."""

import contextlib
from unittest import mock

import pytest
import torch

import decent_comm

from dist_utils import run_ranks
from optim_cases import batch, make_model

STEPS, CAPTURE_AT = 6, 2


@contextlib.contextmanager
def _capturing():
    with mock.patch.object(torch.cuda, "is_initialized", lambda: True), \
            mock.patch.object(torch.cuda, "is_current_stream_capturing", lambda: True):
        yield


def _run(rank, n, case, give_model):
    """Trains STEPS steps; at step CAPTURE_AT the forward is "captured": `case` "none" (never: the reference),
    "clean" (after an eager warm-up forward, as a capture needs anyway: nothing pending) or "pending" (right
    after a step: the mix is pending). Returns the final parameters, the buckets pending after each step, and for
    "pending" what the refused capture did."""
    model = make_model(0)
    opt = decent_comm.DAdamW(model.parameters(), lr=0.05, topology="ring", mode="atc", timeout=60,
                             model=model if give_model else None)
    schedule, touched, refused = opt._schedule, [], None
    capture = [False]
    for name in ("wait", "synchronize"):  # the exchange must not be touched inside the capture
        real = getattr(schedule.exchange, name)
        setattr(schedule.exchange, name, lambda *a, _real=real, _name=name, **k: (
            touched.append(_name) if capture[0] else None, _real(*a, **k))[1])
    other = torch.nn.Linear(4, 2)  # a model the optimizer does not hold: its capture changes nothing
    pending = []
    for t in range(STEPS):
        x, y = batch(rank, t)
        opt.zero_grad()
        if t == CAPTURE_AT and case != "none":
            with _capturing():
                other(x)
            assert schedule._hooks.deferrable() == {0}, "a capture of another model turned the deferral off"
            if case == "clean":  # the warm-up forward and backward, eager: its hooks apply the pending mix
                ((model(x) - y) ** 2).mean().backward()
                opt.zero_grad()
            else:
                before = set(schedule.pending)
                capture[0] = True
                try:
                    with _capturing():
                        model(x)
                except RuntimeError as e:
                    refused = (str(e), before, set(schedule.pending), schedule.exchange.error)
                finally:
                    capture[0] = False
                opt.synchronize()  # the remedy the error names (every rank is here: a collective)
            capture[0] = True
            try:
                with _capturing():
                    out = model(x)
            finally:
                capture[0] = False
        else:
            out = model(x)
        ((out - y) ** 2).mean().backward()
        opt.step()
        pending.append(sorted(schedule.pending))
    opt.synchronize()
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    opt.shutdown()
    return params, pending, refused, touched


@pytest.mark.parametrize("give_model", [True, False], ids=["model", "global-hook"])
def test_a_captured_forward_turns_the_deferral_off_and_trains_as_atc(give_model):
    reference = run_ranks(_run, 2, "none", give_model, timeout=300)
    for case in ("clean", "pending"):
        for rank, (ref, got) in enumerate(zip(reference, run_ranks(_run, 2, case, give_model, timeout=300))):
            assert ref[1] == [[0]] * STEPS  # without a capture, every step leaves its mix to the next forward
            # from the capture on, step() applies every mix itself (a replay would read the parameters unmixed)
            assert got[1] == [[0]] * CAPTURE_AT + [[]] * (STEPS - CAPTURE_AT), (case, rank, got[1])
            assert torch.equal(got[0], ref[0]), (case, rank, (got[0] - ref[0]).abs().max())
            assert got[3] == [], (case, rank, got[3])  # nothing waited for the exchange inside the capture
            if case == "clean":
                assert got[2] is None
                continue
            assert got[2] is not None, f"rank {rank}: a capture reading the pending mix was not refused"
            message, before, after, exchange_error = got[2]
            assert before == after == {0} and exchange_error is None, got[2]  # the mix is left to synchronize()
            for words in ("mode='atc'", "captured into a CUDA graph", "opt.synchronize()", "once eagerly first"):
                assert words in message, (words, message)
            # it sent model= users to make_graphed_callables, which refuses a module with the hooks model= registers
            assert "make_graphed_callables" not in message, message


def test_an_evaluation_capture_refuses_any_pending_mix():
    """An evaluation may read parameters without running their modules (nn.TransformerEncoder's fast path), so its
    capture is refused while any mix is pending, even where the module captured holds none of the pending buckets."""
    first, second = torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)
    opt = decent_comm.DSGD([{"params": first.parameters()}, {"params": second.parameters()}], lr=0.1, mode="atc")
    hooks, schedule = opt._schedule._hooks, opt._schedule
    schedule.pending = {1}  # (one rank: nothing is exchanged; what a step leaves pending with neighbours)
    first.train()
    with _capturing():
        first(torch.ones(2, 4))  # a training forward of `first` reads bucket 0 only: captured
    assert hooks.deferrable() == set() and schedule.pending == {1}
    first.eval()
    with torch.no_grad(), _capturing(), pytest.raises(RuntimeError, match=r"buckets \[1\]"):
        first(torch.ones(2, 4))
    schedule.pending = set()
    opt.shutdown()


class _PastTheChecks(Exception):
    """Raised where make_graphed_callables, having accepted its arguments, makes its first CUDA graph."""


def _graphable(module, sample) -> bool:
    """Whether torch.cuda.make_graphed_callables accepts `module` (its own argument checks, which run before any CUDA
    call; stopped right after them, so this runs on any machine)."""
    with mock.patch.object(torch.cuda, "CUDAGraph", side_effect=_PastTheChecks):
        try:
            torch.cuda.make_graphed_callables(module, (sample,))
        except _PastTheChecks:
            return True
        except AssertionError as e:
            assert "must not have hooks" in str(e), e
            return False
    raise AssertionError("make_graphed_callables made no CUDA graph")


@pytest.mark.parametrize("mode", ["awc", "atc"])
def test_what_make_graphed_callables_accepts_with_and_without_model(mode):
    """docs/api.md's advice, against torch's own check: make_graphed_callables refuses a module passed with hooks of
    its own (not its submodules'). model= puts the DDP-wrap check's pre-hook on the model (either mode) and, with
    ATC, a pre-hook on every module holding parameters directly; model=None registers global hooks only."""
    x = torch.ones(2, 4)
    for give_model in (True, False):
        model = torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)))
        opt = decent_comm.DAdamW(model.parameters(), lr=0.1, mode=mode, model=model if give_model else None)
        accepted = {"model": _graphable(model, x), "container": _graphable(model[0], x),
                    "layer": _graphable(model[0][0], x)}
        if give_model:
            assert accepted == {"model": False, "container": True, "layer": mode == "awc"}, (mode, accepted)
        else:
            assert accepted == {"model": True, "container": True, "layer": True}, (mode, accepted)
        opt.shutdown()
