"""Locks of the exchange layer taken together with another lock, in an order that deadlocked (review CA):

* the C++ Exchanger's lock and the GIL: a blocking call (wait, ...) holds the exchanger's lock for its whole wait with
  the GIL released, and inside it lets go of tensors, which can take the GIL (a tensor whose Python object C++ kept
  alive decrefs it); the properties bytes_sent, handshakes, in_flight and closed took that lock with the GIL held.
  A thread reading opt.bytes_sent (documented as local) during a step deadlocked the rank.
* store_calls' lock and a finalizer: a cyclic garbage collection started by an allocation under the lock ran a
  finalizer (a dropped GroupAllReduce's shutdown, an optimizer's) whose store call took the lock again on the same
  thread: a self-deadlock, and every later store call of the process blocked behind it."""
import gc
import threading
import time

import torch
import torch.distributed as dist

from decent_comm.exchange import Exchanger, store_calls

from dist_utils import run_ranks


def _reads_properties_during_wait(rank, world_size):
    ex = Exchanger(timeout=30)
    send, recv = torch.full((4,), float(rank)), torch.empty(4)
    ex.exchange(0, send, [recv], [1 - rank], [1 - rank])  # the handshake: later exchanges go straight to the data
    ex.wait(0)
    dist.barrier()
    if rank == 1:
        time.sleep(2)  # rank 0 waits for this one meanwhile
        ex.exchange(0, send, [recv], [0], [0])
        ex.wait(0)
        ex.shutdown()
        return None
    ex.exchange(0, torch.zeros(4), [torch.empty(4)], [1], [1])  # only the exchanger holds these tensors now: the
    # wait lets go of them under its lock, where the last Python reference to each is dropped (the GIL taken)
    reads, stop = [], threading.Event()

    def reader():
        while not stop.is_set():
            reads.append((ex.bytes_sent, ex.handshakes, ex.in_flight, ex.closed))
            time.sleep(0.001)

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    time.sleep(0.2)
    start = time.monotonic()
    ex.wait(0)
    waited = time.monotonic() - start
    stop.set()
    thread.join(10)
    ex.shutdown()
    return dict(waited=waited, reads=len(reads), reader_done=not thread.is_alive(), last=reads[-1])


def test_exchanger_properties_read_during_a_wait_do_not_deadlock():
    result = run_ranks(_reads_properties_during_wait, 2, timeout=90)[0]
    assert result["reader_done"] and 1.0 < result["waited"] < 10, result
    assert result["reads"] > 50, result  # the reader was not stalled for the wait's length either
    assert result["last"][2] in ([], [0]) and result["last"][3] is False, result


class _Cycle:
    """Freed only by the cyclic collector; its finalizer makes a store call, as a dropped GroupAllReduce's does."""
    calls = 0

    def __init__(self):
        self.me = self

    def __del__(self):
        store_calls.default_store().add("test_lock_order/finalizer", 1)
        _Cycle.calls += 1


def _store_calls_with_finalizers(rank, world_size):
    gc.set_threshold(5, 1, 1)  # a collection at nearly every allocation: inside the lock too
    try:
        for _ in range(300):
            _Cycle()
            store_calls.default_store().add("test_lock_order/caller", 1)
        gc.collect()
    finally:
        gc.set_threshold(700, 10, 10)
    store = store_calls.default_store()
    return int(store.get("test_lock_order/caller")), int(store.get("test_lock_order/finalizer")), _Cycle.calls


def test_a_finalizer_making_a_store_call_inside_a_store_call_does_not_deadlock():
    callers, finalizers, calls = run_ranks(_store_calls_with_finalizers, 1, timeout=90)[0]
    assert callers == 300 and finalizers == calls == 300, (callers, finalizers, calls)
