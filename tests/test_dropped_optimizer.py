"""An optimizer nobody shut down is shut down as shutdown() would when it is dropped (decent_comm/optim/teardown.py):
ATC's last step leaves its mix pending, and the parameters of a model whose optimizer was deleted, or died with the
function that trained, must still be x^{t+1} = W'(x^t - lr d^t) (checked against the float64 dense simulation); AWC
keeps its x^{t+1}. A dead peer makes that mix fail: logged, never raised, within the exchange timeout. At interpreter
exit (the optimizer a module global) the mix is applied before the exchangers close. Dropped after a failure it
caught, an optimizer is freed too."""

import gc
import logging
import os
import subprocess
import sys
import time
import traceback
import weakref

import pytest
import torch

import decent_comm
from decent_comm import topology as T
from decent_comm.exchange import ExchangeError

from dist_utils import exit_now, run_ranks
from optim_cases import OPTIMIZERS, batch, flat_params, make_model
from optim_reference import Reference
from test_exit import CPP_WARNING, ROOT


def _train(rank, n, opt_name, mode, give_model, ref, steps=3):
    """A train() function: `steps` steps beside the reference; returns the model, its optimizer dies here (with a
    weak reference to it, and whether the mix was pending when it died)."""
    ctor, _, _ = OPTIMIZERS[opt_name]
    model = make_model(rank)
    opt = ctor(model.parameters(), topology=T.make("ring", n), mode=mode, broadcast_init=False, timeout=30,
               model=model if give_model else None)
    for t in range(steps):
        x, y = batch(rank, t)
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
        ref.step([batch(r, t) for r in range(n)])
    return model, weakref.ref(opt), bool(opt._schedule.pending)


def _dropped_vs_reference(rank, n):
    out = {}
    for opt_name in ("dsgd", "dadamw"):
        _, kind, hp = OPTIMIZERS[opt_name]
        for mode in ("atc", "awc"):
            for how in ("del", "cycle", "function"):
                ref = Reference(make_model(0), [flat_params(make_model(r)) for r in range(n)], T.make("ring", n),
                                mode, kind, hp)
                gc.disable()  # del and function: reference counting alone drops the optimizer
                try:
                    if how == "function":
                        model, dead, pending = _train(rank, n, opt_name, mode, True, ref)
                    else:
                        ctor = OPTIMIZERS[opt_name][0]
                        model = make_model(rank)
                        opt = ctor(model.parameters(), topology=T.make("ring", n), mode=mode, broadcast_init=False,
                                   timeout=30, model=model if how == "cycle" else None)
                        for t in range(3):
                            x, y = batch(rank, t)
                            opt.zero_grad()
                            ((model(x) - y) ** 2).mean().backward()
                            opt.step()
                            ref.step([batch(r, t) for r in range(n)])
                        dead, pending = weakref.ref(opt), bool(opt._schedule.pending)
                        if how == "cycle":
                            holder = {"opt": opt}
                            holder["self"] = holder  # freed by the cyclic collector only
                            del holder
                        del opt
                finally:
                    gc.enable()
                gc.collect()
                got = torch.cat([v.reshape(-1) for v in model.state_dict().values()]) if how == "function" \
                    else flat_params(model)
                out[(opt_name, mode, how)] = ((got.double() - ref.X[rank]).abs().max().item(), pending,
                                              dead() is None)
    return out


def test_a_dropped_optimizer_leaves_the_parameters_of_its_last_step():
    """Dropped without shutdown(), an ATC optimizer left them at the unmixed half step: its exchangers only drained
    when collected, and the model's state_dict pre-hook that mixes went with it."""
    for rank, errs in enumerate(run_ranks(_dropped_vs_reference, 3, timeout=300)):
        # freed: the finalizer holds no reference to the optimizer; pending: in ATC there was a mix to apply
        bad = {case: (err, pending, freed) for case, (err, pending, freed) in errs.items()
               if not (err < 1e-5 and freed and pending == (case[1] == "atc"))}
        assert not bad, (rank, bad)


def _dropped_after_a_peer_died(rank, n):
    model = make_model(rank)
    opt = OPTIMIZERS["dsgd"][0](model.parameters(), topology="ring", mode="atc", timeout=3)
    x, y = batch(rank, 0)
    ((model(x) - y) ** 2).mean().backward()
    opt.step()
    opt.synchronize()  # rank 1's step-0 transfers have landed before it dies
    if rank == 1:
        exit_now("exited")
    opt.step()  # the mix of this step's exchange stays pending, and rank 1 sends nothing
    logged = []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())
    logging.getLogger("decent_comm").addHandler(handler)
    pending = bool(opt._schedule.pending)
    start = time.monotonic()
    del opt
    gc.collect()
    return pending, time.monotonic() - start, logged


def test_a_dropped_optimizer_whose_peer_died_logs_the_failure():
    pending, seconds, logged = run_ranks(_dropped_after_a_peer_died, 2, timeout=120)[0]
    assert pending and seconds < 3 + 5, seconds
    assert any("closing an optimizer nobody shut down when it was garbage collected failed" in m for m in logged), \
        logged


EXIT_SCRIPT = os.path.join(ROOT, "tests", "atc_exit_script.py")


def test_an_atc_optimizer_alive_at_exit_applies_its_pending_mix():
    """The optimizer a module global: at exit the exchangers drained and closed, the mix stayed pending."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", EXIT_SCRIPT]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
           "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          stdin=subprocess.DEVNULL)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    # lr 0.25, gradient 1, ring of 2 (W = 1/2 1/2): x^1 = mean(0 - 0.25, 1 - 0.25) = 0.25 on both ranks
    for rank in (0, 1):
        assert f"rank {rank}: pending True, weight at exit 0.250000" in proc.stdout, out[-6000:]
    assert "failed" not in out and not CPP_WARNING.search(out), out[-6000:]


def _dropped_after_a_caught_timeout(rank, n, topology, mode, exchange):
    """Rank 2 sleeps past the 2 s timeout at step 2: ranks 0 and 1 time out waiting for it, rank 2's next transfers
    fail on the peers that gave up. Every rank catches its error and drops the optimizer without shutdown(). A bare
    parameter, used outside any module: ATC mixes it in step() (no forward pre-hook defers it), so the failure of that
    mix is raised in step() and kept as the failed mix's error."""
    w = torch.nn.Parameter(torch.randn(4, 2, generator=torch.Generator().manual_seed(rank)))
    opt = decent_comm.DAdamW([w], lr=0.01, topology=topology, mode=mode, exchange=exchange, timeout=2)
    caught = None
    try:
        for t in range(8):
            if rank == 2 and t == 2:
                time.sleep(4.5)
            x, y = batch(rank, t)
            opt.zero_grad()
            ((x @ w - y) ** 2).mean().backward()
            opt.step()
    except ExchangeError as e:
        # what the user caught keeps its whole traceback, down to the exchange that raised it; the copy kept for
        # shutdown() has the same type and words, and no traceback
        kept = opt._schedule.exchange.error
        caught = (type(e).__name__, traceback.extract_tb(e.__traceback__)[-1].filename,
                  type(kept) is type(e) and str(kept) == str(e) and kept.__traceback__ is None)
    dead = weakref.ref(opt)
    del opt
    gc.collect()
    return caught, dead() is None


@pytest.mark.parametrize("topology,mode,exchange", [("ring", "awc", "p2p"), ("one-peer-exp", "atc", "p2p"),
                                                    ("complete", "awc", "auto"), ("complete", "atc", "auto")])
def test_an_optimizer_dropped_after_a_caught_failure_is_freed(topology, mode, exchange):
    """The exchange kept its first error (and ATC the failed mix's) with the traceback, whose step() frames hold the
    optimizer; the finalizer holds the schedule that holds them, so the optimizer, its buffers and exchangers (and the
    peer watch's thread) lived until the process exited."""
    results = run_ranks(_dropped_after_a_caught_timeout, 3, topology, mode, exchange, timeout=120)
    assert [freed for _, freed in results] == [True] * 3, results
    for rank, (caught, _) in enumerate(results):
        assert caught is not None and caught[0] in ("ExchangeTimeout", "ExchangeError") and caught[2] and \
            caught[1].endswith("gossip_exchange.py" if exchange == "p2p" else "group_allreduce.py"), (rank, caught)


def test_a_kept_error_has_the_words_and_type_but_no_frames():
    """exchange.arrival.detached: what the exchange and ATC's failed mix keep. The original is left as it was."""
    from decent_comm.exchange import ExchangeTimeout, detached

    def fail():
        try:
            raise KeyError("the transport's own error")
        except KeyError as cause:
            raise ExchangeTimeout("decent_comm exchange: bucket 0 timed out") from cause

    try:
        fail()
    except ExchangeTimeout as e:
        e.add_note("a note")
        kept, words = detached(e), str(e)
        assert e.__traceback__ is not None and isinstance(e.__cause__, KeyError)
    assert type(kept) is ExchangeTimeout and isinstance(kept, TimeoutError) and str(kept) == words
    assert kept.__notes__ == ["a note"]
    assert kept.__traceback__ is None and kept.__cause__ is None and kept.__context__ is None


def test_an_error_that_cannot_be_built_from_its_args_is_kept_as_a_runtime_error():
    from decent_comm.exchange import detached
    from decent_comm.exchange.watched_wait import MembersFailed

    kept = detached(MembersFailed({2: "timeout"}))  # its constructor takes the ranks, its args hold the words
    assert type(kept) is RuntimeError and str(kept) == "MembersFailed: ranks [2] failed first"
