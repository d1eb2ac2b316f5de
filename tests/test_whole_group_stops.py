"""The optimizer's whole-group collectives outside the gossip - the start-up broadcast of rank 0's parameters, the
all-reduces of the warm-up, the adaptive statistics and the collective utilities (exchange.bounded) - end within the
timeout like the gossip does: a rank stalled before the broadcast is named, and a failure on either side (the gossip
or these all-reduces) stops a rank waiting for the failed one on the other side instead of letting it wait until
that process exits (GossipExchange.add_companion)."""
import re
import time

import torch

import decent_comm
from decent_comm.exchange import BoundedAllReduce

from dist_utils import exit_now, run_ranks
from exchange_support import Ring
from optim_cases import make_model

TIMEOUT_S = 20  # what a rank left waiting would wait for
LINGER_S = 12   # how long a failed rank lives on (saving a checkpoint): past the survivors' errors, short of TIMEOUT_S


def _outcome(call):
    """(the error's class and words, or "no error"; seconds the call took)."""
    start = time.monotonic()
    try:
        call()
        return "no error", time.monotonic() - start
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}", time.monotonic() - start


def _stalled_before_the_broadcast(rank, n):
    import decent_comm.optim.base as base
    real = base.broadcast_from_rank0
    if rank == 1:  # silent between the construction's check of the replicas and the copy of rank 0's parameters
        base.broadcast_from_rank0 = lambda *args: (time.sleep(10), real(*args))
    return _outcome(lambda: decent_comm.DAdamW(make_model(rank).parameters(), topology="ring", timeout=3))


def test_a_rank_stalled_before_the_start_up_broadcast_is_named_within_the_timeout():
    """dist.broadcast waited for the stalled rank for the process group's own timeout (the 10 s stall here, 30 min
    for gloo's default): the ranks now meet first, within `timeout`."""
    res = run_ranks(_stalled_before_the_broadcast, 3, timeout=120)
    for rank in (0, 2):
        words, took = res[rank]
        assert words.startswith("ExchangeTimeout: ") and "copying rank 0's parameters" in words, words
        assert "rank 1 did not arrive within 3 s" in words, words
        assert took < 8, took
    assert res[1][0].startswith("ExchangeTimeout: ") and "arrived after the other ranks had stopped waiting" in \
        res[1][0], res[1]


def _died_after_the_meeting(rank, n):
    import decent_comm.exchange.bounded as bounded
    meet = bounded.wait_for_ranks

    def meet_then_die(*args):
        base = meet(*args)
        if rank == 1:
            exit_now(("exited", 0.0))
        return base

    bounded.wait_for_ranks = meet_then_die
    return _outcome(lambda: decent_comm.DAdamW(make_model(rank).parameters(), topology="ring", timeout=3))


def test_a_rank_that_dies_in_the_start_up_broadcast_is_named_by_its_source():
    """Rank 1 dies after the broadcast's meeting: rank 0's error named no rank (the transport's words only)."""
    res = run_ranks(_died_after_the_meeting, 3, timeout=120)
    words, took = res[0]
    assert words.startswith("ExchangeError: ") and "the broadcast of tensor 0 from rank 0 failed" in words, words
    assert re.search(r"(rank 1|ranks \[1, 2\]) did not report this failure", words), words
    assert took < 8, took


def _utility_after_the_gossip_failed(rank, n):
    """4-rank ring: rank 3 exits; ranks 0 and 2 fail on it in a step and live on; rank 1's step completes (their
    sends had gone out), and it then calls a collective utility, whose all-reduce waits for ranks 0 and 2."""
    model = make_model(rank)
    opt = decent_comm.DAdamW(model.parameters(), topology="ring", timeout=TIMEOUT_S)

    def step():
        model(torch.randn(6, 4)).sum().backward()
        opt.step()
        opt.zero_grad()

    for _ in range(3):
        step()
    if rank == 3:
        exit_now(("exited", 0.0))
    calls = [step, lambda: opt.global_average().__enter__()] if rank == 1 else [step] * 3
    for call in calls:  # until one raises (AWC: the first step waits for the exchange rank 3 had posted)
        result = _outcome(call)
        if result[0] != "no error":
            break
    time.sleep(LINGER_S)
    return result


def test_a_utility_stops_waiting_for_ranks_that_failed_in_the_gossip():
    """Rank 1's all-reduce waited until ranks 0 and 2 exited (12 s), then said they "did not report this failure":
    their gossip failure is marked for the whole-group all-reduces too."""
    res = run_ranks(_utility_after_the_gossip_failed, 4, timeout=150)
    for rank in (0, 2):
        assert "receive from rank 3" in res[rank][0], res[rank]
    words, took = res[1]
    assert words.startswith("ExchangeError: ") and "global_average()" in words, words
    assert "failed on ranks [0, 2] first, while this rank waited for it" in words, words
    assert "ranks [0, 2] raised an error of their own before" in words and "receive from rank 3" in words, words
    assert took < TIMEOUT_S / 2, took


def _gossip_after_an_all_reduce_failed(rank, n):
    """4 ranks: a point-to-point ring and a whole-group all-reduce, companions as in the optimizer. Rank 3 exits;
    ranks 0 and 2 fail in the all-reduce and live on; rank 1's ring step waits for them."""
    ring = Ring(rank, n, TIMEOUT_S)
    all_reduce = BoundedAllReduce(None, timeout=TIMEOUT_S)
    ring.ex.add_companion(all_reduce)
    all_reduce.add_companion(ring.ex)
    ring()
    all_reduce(torch.ones(10), "a healthy all-reduce")
    if rank == 3:
        exit_now(("exited", 0.0))
    if rank == 1:
        time.sleep(1)  # ranks 0 and 2 are in the all-reduce first
        result = _outcome(ring)
    else:
        result = _outcome(lambda: all_reduce(torch.ones(10), "the all-reduce after rank 3 exited"))
    time.sleep(LINGER_S)
    return result


def test_a_gossip_wait_stops_for_ranks_that_failed_in_a_whole_group_all_reduce():
    """Rank 1's point-to-point wait on ranks 0 and 2 (exchange.peer_watch) waited until they exited: their
    all-reduce failure is marked for the gossip too."""
    res = run_ranks(_gossip_after_an_all_reduce_failed, 4, timeout=150)
    for rank in (0, 2):
        words = res[rank][0]
        assert words.startswith("Exchange") and "the all-reduce after rank 3 exited" in words, res[rank]
        # rank 1, told before the blame's grace, stopped and marked itself within it: not named as missing
        assert "rank 3 did not report" in words and "[1, 3]" not in words, words
    words, took = res[1]
    assert words.startswith("ExchangeError: ") and "failed first and stopped exchanging" in words, words
    assert "raised an error of" in words and "the all-reduce after rank 3 exited" in words, words
    assert took < TIMEOUT_S / 2, took


def _utility_after_check_finite_raised(rank, n):
    """Every rank raises check_finite's error for rank 0's NaN gradient in the warm-up, and lives on; then they all
    call a collective utility, rank 2 late by more than a look (watched_wait.POLL_S)."""
    model = make_model(rank)
    opt = decent_comm.DAdamW(model.parameters(), topology="ring", timeout=TIMEOUT_S, check_finite=True,
                             warmup_steps=5)
    for t in range(3):
        model(torch.randn(6, 4)).sum().backward()
        if t == 1 and rank == 0:
            model[0].weight.grad[0, 0] = float("nan")
        first = _outcome(opt.step)
        opt.zero_grad()
        if first[0] != "no error":
            break
    if rank == 2:
        time.sleep(1.5)
    return first[0], _outcome(lambda: opt.global_average().__enter__())


def test_after_an_error_of_check_finite_a_whole_group_utility_refuses_at_once_quoting_it():
    """Its mark reached the whole-group all-reduces too: it stopped every later one that took longer than a look,
    saying ranks [1, 2] failed first (review BQ). Now the mark stays on the gossip, and a rank that raised
    check_finite's error is unusable (review CZ 2): each refuses the utility at once, before its all-reduce, quoting
    its own error, and none is stopped by another's mark or waits for one."""
    res = run_ranks(_utility_after_check_finite_raised, 3, timeout=150)
    for rank, (raised, (words, took)) in enumerate(res):
        assert raised.startswith("RuntimeError: ") and "not finite" in raised, (rank, raised)
        assert words.startswith("RuntimeError: decent_comm: global_average(): unusable after an earlier check_finite "
                                "error") and words.endswith(raised[len("RuntimeError: "):]), (rank, words)
        assert took < 1.0, (rank, took)
