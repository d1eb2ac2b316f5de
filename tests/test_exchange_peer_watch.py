"""A point-to-point wait (gloo) stops once a peer it waits for marked that it failed, instead of waiting out its whole
timeout while that peer lives on (exchange.peer_watch): on real ranks (a dead neighbour's neighbours, also further
along a ring; a silent one's), and the watch's looks on fakes."""
import gc
import re
import time

import pytest
import torch

import decent_comm
from decent_comm.exchange import ExchangeError, GossipExchange
from decent_comm.exchange import peer_watch
from decent_comm.exchange.peer_watch import PeerWatch

from dist_utils import exit_now, run_ranks
from exchange_support import Ring

TIMEOUT_S = 20  # what a rank left waiting would wait for without the watch
LINGER_S = 12   # how long a failed rank lives on (saving a checkpoint): past the survivors' errors, short of TIMEOUT_S


def _first_error(steps, catch=ExchangeError):
    """Runs `steps` (callables) in order until one raises `catch`, then lives on for LINGER_S (a checkpoint saved in
    an except: clause). Returns (the error's class and words, or "no error"; seconds into the step that raised, or
    that the last step took)."""
    result = ("no error", 0.0)
    for step in steps:
        start = time.monotonic()
        try:
            step()
            result = ("no error", time.monotonic() - start)
        except catch as exc:
            result = (f"{type(exc).__name__}: {exc}", time.monotonic() - start)
            break
    time.sleep(LINGER_S)
    return result


def _ring(rank, n, quiet, timeouts, drop=None):
    """A point-to-point ring of `n`: rank 3 exits (`quiet`: stays alive and stops exchanging); its neighbours fail on
    it and live on for LINGER_S; every other rank's next wait is on a rank that stopped (`drop`: rank 1's is the
    drain of its "shutdown", or of the exchange it "drop"s or leaves in a "cycle"). Returns _first_error's."""
    step = Ring(rank, n, timeouts.get(rank, TIMEOUT_S))
    step()
    if rank == 3:
        if not quiet:
            exit_now(("exited", 0.0))
        time.sleep(TIMEOUT_S + LINGER_S)
        return "silent", 0.0
    if not (drop and rank == 1):
        return _first_error([step] * n)  # the first failures are in the first; each hop further fails a step later

    def drain():
        step.post()
        if drop == "shutdown":
            step.ex.shutdown()
            return
        if drop == "cycle":  # collected by the cyclic collector
            step.ex.cycle = step.ex
        step.ex = None  # its drain on collection (exchange._closing), as at exit
        gc.collect()

    return _first_error([step, drain])  # the step in which ranks 0 and 2 fail completes (their sends were posted)


def test_a_dead_neighbours_neighbour_stops_waiting_for_the_ranks_that_failed_on_it():
    """4 ranks: ranks 0 and 2 fail on rank 3's exit and live on; rank 1 stopped waiting for them within about a look
    (it waited its whole 20 s timeout before), named them and, through their reports, rank 3."""
    res = run_ranks(_ring, 4, False, {}, timeout=150)
    assert res[3][0] == "exited"
    for rank in (0, 2):
        assert res[rank][0].startswith("ExchangeError: ") and "receive from rank 3" in res[rank][0], res[rank]
    words, waited = res[1]
    assert words.startswith("ExchangeError: "), words  # the peers' transports failed: no timeout anywhere
    assert re.search(r"stopped waiting for (receive from|send to) rank [02]: (rank [02]|ranks \[0, 2\]) failed first "
                     r"and stopped exchanging, while this rank waited for it", words), words
    assert re.search(r"raised an error of (its|their) own before \(the likely cause\): rank [02]: decent_comm "
                     r"exchange: bucket 0: receive from rank 3", words), words
    assert waited < TIMEOUT_S / 2, waited


@pytest.mark.parametrize("drop", ["drop", "cycle"])
def test_the_drain_of_a_dropped_exchange_is_watched_too(drop):
    """Rank 1 drops an exchange with a bucket in flight (as at exit, or an optimizer collected unclosed; "cycle": in
    a reference cycle, whose weak references the collector clears before the drain runs): its drain
    (exchange._closing) waited for ranks 0 and 2 until they exited; it stops like a step's wait."""
    res = run_ranks(_ring, 4, False, {}, drop, timeout=150)
    assert res[1][0] == "no error" and res[1][1] < TIMEOUT_S / 2, res[1]
    for rank in (0, 2):
        assert "receive from rank 3" in res[rank][0], res[rank]


def test_shutdown_stops_waiting_and_names_the_failure_like_a_step():
    """shutdown() drains what is in flight: stopped like a step's wait, and its error named in the same words."""
    res = run_ranks(_ring, 4, False, {}, "shutdown", timeout=150)
    words, waited = res[1]
    assert words.startswith("ExchangeError: ") and "failed first and stopped exchanging" in words, words
    assert "raised an error of" in words and "receive from rank 3" in words, words
    assert waited < TIMEOUT_S / 2, waited


def _mixed(rank, n, order):
    """4 ranks: groups [0, 1] and [2, 3] beside point-to-point pairs (0, 2) and (1, 3), one healthy round of each;
    then every rank runs the two in `order`. "group" first: rank 1 exits, rank 0's all-reduce fails ("shutdown": in
    the drain of its shutdown()), and rank 2's transfer waits for rank 0; "p2p" first: rank 2 exits, rank 0's
    transfer fails, and rank 1's all-reduce waits for rank 0. Rank 0 lives on. Returns (the error's class and words,
    seconds into the step that raised)."""
    ex = GossipExchange(None, torch.device("cpu"), timeout=TIMEOUT_S, groups=[[0, 1], [2, 3]])
    x, pair = torch.ones(10), [(rank + 2) % n]

    def group(drain=False):
        ex.exchange(1, x, [torch.empty(10)], group=[0, 1] if rank < 2 else [2, 3])
        if drain:
            ex.shutdown()
        else:
            ex.wait(1)

    def p2p():
        ex.exchange(3, x, [torch.empty(10)], send_to=pair, recv_from=pair)
        ex.wait(3)

    group(), p2p()
    if rank == (1 if order[0] == "group" else 2):
        exit_now(("exited", 0.0))
    if rank == 0 and "shutdown" in order:
        return _first_error((lambda: group(drain=True), p2p))
    return _first_error((group, p2p) if order[0] == "group" else (p2p, group))


@pytest.mark.parametrize("order", [("group", "p2p"), ("group", "p2p", "shutdown"), ("p2p", "group")])
def test_a_failure_on_one_path_stops_a_wait_on_the_other(order):
    """Rank 0 failed on one path (its own store namespace; "shutdown": in its drain) and lives on; the rank waiting
    for it on the other path waited until it exited: each path's failure is marked on both
    (GossipExchange.stopped)."""
    res = run_ranks(_mixed, 4, order, timeout=150)
    waiting = 2 if order[0] == "group" else 1
    words, waited = res[waiting]
    assert words.startswith("ExchangeError: ") and "rank 0" in words, words
    if order[0] == "group":
        assert "stopped waiting for receive from rank 0: rank 0 failed first" in words, words
        assert "rank 0 raised an error of its own before" in words and "all-reduce among ranks [0, 1]" in words, words
    else:
        assert "the all-reduce among ranks [0, 1] failed on rank 0 first, while this rank waited for it" in words, words
    assert waited < TIMEOUT_S / 2, waited


def test_a_stop_spreads_along_the_ring():
    """6 ranks: rank 0 is three hops from rank 3, its neighbours 1 and 5 stop waiting because 2 and 4 stopped, and
    rank 0 because they did: every survivor's error comes well inside the timeout, although all live on."""
    res = run_ranks(_ring, 6, False, {}, timeout=150)
    for rank in (0, 1, 5):
        words, waited = res[rank]
        assert words.startswith("ExchangeError: ") and "failed first and stopped exchanging" in words, res[rank]
        assert waited < TIMEOUT_S / 2, (rank, waited)
    assert "receive from rank 3" in res[2][0] and "receive from rank 3" in res[4][0], res


def test_a_silent_neighbours_neighbour_does_not_wait_out_its_own_timeout():
    """Rank 3 stays alive and stops exchanging; ranks 0 and 2 time out on it after 3 s and live on. Rank 1, with a
    20 s timeout, raises soon after theirs. (gloo itself tells it here: a gloo transfer that times out fails every
    connection of its process group, so rank 1's receive from rank 0 fails at once; the watch's timeout verdict is for
    the backends that do not, and is checked on a fake below.)"""
    res = run_ranks(_ring, 4, True, {0: 3, 2: 3}, timeout=150)
    for rank in (0, 2):
        assert res[rank][0].startswith("ExchangeTimeout: ") and "rank 3" in res[rank][0], res[rank]
    words, waited = res[1]
    assert words.startswith(("ExchangeError: ", "ExchangeTimeout: ")) and re.search(r"rank [02]", words), words
    assert waited < TIMEOUT_S / 2, waited


def _nan_on_a_ring(rank, n):
    """DSGD on a point-to-point ring of 4 with check_finite: rank 2's loss is NaN at step 3; ranks 1 and 3 receive
    its values and raise; rank 0, a neighbour of neither rank 2 nor its exit, waits for them next. Every rank lives on
    for LINGER_S after its error."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = decent_comm.DSGD(model.parameters(), lr=0.1, topology="ring", exchange="p2p", check_finite=True,
                           timeout=TIMEOUT_S)

    def step(t):
        opt.zero_grad()
        loss = model(torch.ones(2, 4)).pow(2).mean()
        (loss * float("nan") if rank == 2 and t == 3 else loss).backward()
        opt.step()

    return _first_error([lambda t=t: step(t) for t in range(6)] + [opt.synchronize], catch=RuntimeError)


def test_a_rank_that_raised_for_non_finite_values_is_not_waited_for():
    """Ranks 1 and 3 raise for the non-finite values they received and live on; rank 0 waited for them until they
    exited (LINGER_S) and now stops within about a look, quoting their errors (check_finite's mark: finite_check)."""
    res = run_ranks(_nan_on_a_ring, 4, timeout=150)
    assert "rank 2: the parameters of bucket(s) [0] are not finite" in res[2][0], res[2]
    for rank in (1, 3):
        assert "received non-finite values from rank 2" in res[rank][0], res[rank]
    words, waited = res[0]
    assert words.startswith("ExchangeError: ") and "failed first and stopped exchanging" in words, words
    assert "received non-finite values from rank 2" in words, words
    assert waited < TIMEOUT_S / 2, waited


class _Transport:
    """What a PeerWatch reads and calls (a transport's _wait_generation, _waiting_peers, _interrupt), with the
    store's answers (`failed`) given in advance; records what it was asked. `block(peer)` moves the running wait to
    an operation with `peer` (None: the wait ends)."""

    def __init__(self, failed):
        self.answers, self.peers = list(failed), []
        self._wait_generation = 0
        self.asked, self.interrupts = [], []

    def block(self, peer):
        self.peers = [] if peer is None else [peer]
        self._wait_generation += 1

    def _waiting_peers(self):
        return self.peers

    def _interrupt(self, generation, reason, timed_out):
        self.interrupts.append((generation, reason, timed_out))
        return generation == self._wait_generation

    def failed(self, peers):
        self.asked.append(list(peers))
        return self.answers.pop(0)


def _watch(transport):
    w = PeerWatch(transport, transport.failed)
    w.close()  # looked at by hand here, not by the thread
    return w


def test_the_store_is_asked_only_about_an_operation_that_blocked_since_the_previous_look():
    t = _Transport([{}, {2: "timeout"}])
    w = _watch(t)
    w.look(), w.look()  # no wait runs
    t.block(0)
    w.look()  # blocked since less than a look
    assert t.asked == []
    w.look()
    assert t.asked == [[0]] and t.interrupts == []
    t.block(2)  # that operation completed, the wait moved on
    w.look()
    assert t.asked == [[0]]
    w.look()
    assert t.interrupts == [(2, "rank 2 timed out first and stopped exchanging, while this rank waited for it", True)]
    t.block(None)
    w.look(), w.look()
    assert t.asked == [[0], [2]]


def test_a_store_that_cannot_tell_is_not_asked_again_about_that_operation():
    t = _Transport([None, {1: "error"}])
    w = _watch(t)
    t.block(1)
    w.look(), w.look(), w.look()
    assert t.asked == [[1]]
    t.block(1)
    w.look(), w.look()
    assert t.interrupts == [(2, "rank 1 failed first and stopped exchanging, while this rank waited for it", False)]


def test_the_interrupt_names_the_operation_it_was_asked_about():
    """The operation may complete while the store is asked: the interrupt carries its generation, and the transport
    interrupts only while that operation blocks (checked on real ranks by the tests above; here: what is passed)."""
    t = _Transport([])
    w = _watch(t)
    t.block(1)
    w.look()

    def failed_as_the_operation_completes(peers):
        t.block(3)
        return {1: "error"}

    w._failed = failed_as_the_operation_completes
    w.look()
    assert [g for g, _, _ in t.interrupts] == [1]


def test_the_thread_ends_when_the_last_open_exchanger_closes():
    """shutdown() of the last exchanger ends the thread before it returns (tests/test_exit.py counts the threads left
    after destroy_process_group()); one exchanger still open keeps it."""
    a, b = PeerWatch(_Transport([]), dict), PeerWatch(_Transport([]), dict)
    thread = peer_watch._thread
    assert thread is not None and thread.is_alive()
    a.close()
    assert thread.is_alive() and peer_watch._thread is thread
    b.close()
    assert not thread.is_alive() and peer_watch._thread is None
