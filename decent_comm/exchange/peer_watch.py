"""Stopping a blocked point-to-point wait once a peer it waits for said, through the store, that it stopped.

The point-to-point transfers of the ProcessGroup transport (gloo) wait in C++ for the whole time left to their
deadline, and gloo cannot wait in slices the way exchange.watched_wait does for its collectives: a gloo send/recv
wait that times out fails every pair of the process group. A rank learns that a peer stopped exchanging only from its
own connection to that peer: when that process exits, or at the deadline. A peer that failed on a third rank (a dead
neighbour's neighbour) and lives on (a script that catches the error to save a checkpoint, a notebook) left this
rank waiting until that process exited or its full timeout passed, 30 min by default (measured: a 4-rank ring, rank 3
exits, ranks 0 and 2 fail on it and live on for 12 s; rank 1 waited those 12 s).

So a rank whose transfer failed leaves a mark (exchange.roster: ``mark_failed``), and one thread per process looks,
every POLL_S, at the transports whose host-blocking wait has been blocked by the same operation since its previous
look (``_wait_generation`` changes with each operation a wait moves to): one store call (``Roster.failed``) asks
whether that operation's peer left a mark, and if it did, ``_interrupt`` makes that wait raise, as an
``ExchangeTimeout`` when that peer itself had timed out (it waits for a silent rank, as this rank would). Only the
blocking operation's peer counts: a peer may stop right after its transfers with this rank went through (check_finite
stops so), and this rank's wait for another, slow peer must go on. Every wait of the exchanger is seen (a step's, a
handshake's, shutdown()'s, the drain at exit or on collection: exchange._closing), and nothing is added to the calls
themselves; the thread wakes every POLL_S while a watched exchanger is open.

    watch = PeerWatch(transport, failed)   # an Exchanger's transport (_C._Transport), Roster.failed
    watch.close()                          # when the exchanger is shut down
"""
from __future__ import annotations

import atexit
import logging
import os
import threading
from typing import Callable, Dict, List, Optional

from .arrival import ranks_text
from .watched_wait import POLL_S

log = logging.getLogger(__name__)

_lock = threading.Condition()  # guards the two below; notified to stop the thread
# Held strongly until closed: an exchanger collected in a cycle drains in its finalizer (exchange._closing), and the
# collector clears weak references to the cycle before it runs finalizers, which took that drain off the watch.
_watches: "set[PeerWatch]" = set()
_thread: Optional[threading.Thread] = None  # the watcher; a thread that is not this one any more ends at once


class PeerWatch:
    """One transport's waits, seen by the watcher thread. `failed(peers)`: the peers that left a mark, each with
    "timeout" or "error" ({} none, None the store cannot tell: not asked again in that wait)."""

    def __init__(self, transport, failed: Callable[[List[int]], Optional[Dict[int, str]]]):
        self._transport, self._failed = transport, failed
        self._seen = -1     # the wait generation at the previous look
        self._mute = -1     # the generation in which the store could not tell
        _watch(self)

    def close(self):
        """Unregisters this exchanger; the last one closed ends the thread before returning (as shutdown() lets
        destroy_process_group() leave no thread behind)."""
        with _lock:
            _watches.discard(self)
        _stop_thread(only_if_idle=True)

    def look(self):
        """The watcher thread's look: asks the store when the same operation has blocked a wait since the previous
        look (the generation changes with each operation a wait moves to, and when it ends)."""
        g = self._transport._wait_generation
        if g == self._seen and g != self._mute:
            self._ask(g)
        self._seen = g

    def _ask(self, g: int):
        peers = sorted(self._transport._waiting_peers())
        if not peers:  # no wait runs
            return
        failed = self._failed(peers)
        if failed is None:
            self._mute = g
        elif failed:
            timed_out = "timeout" in failed.values()
            self._transport._interrupt(g, f"{ranks_text(sorted(failed))} {'timed out' if timed_out else 'failed'} "
                                          "first and stopped exchanging, while this rank waited for it", timed_out)


def _watch(w: PeerWatch):
    global _thread
    with _lock:
        _watches.add(w)
        if _thread is None:
            _thread = threading.Thread(target=_run, name="decent_comm-peer-watch", daemon=True)
            _thread.start()


def _run():
    global _thread
    me = threading.current_thread()
    while True:
        with _lock:
            if _thread is me and _watches:
                _lock.wait(POLL_S)
            if _thread is not me or not _watches:  # stopped, or every exchanger was closed
                if _thread is me:
                    _thread = None
                return
            watches = list(_watches)
        _look_at(watches)


def _look_at(watches):
    for w in watches:
        try:
            w.look()
        except Exception:  # noqa: BLE001 - a failed look stops nothing early; the wait keeps its own deadline
            log.debug("decent_comm: the peer watch's look failed", exc_info=True)


def _stop_thread(only_if_idle: bool = False):
    """Ends the thread (`only_if_idle`: if no exchange is registered) and waits for it (it may be in one store call,
    bounded by store_calls). Also at exit, before the interpreter finalizes: a daemon thread in a store call then
    would be killed inside it."""
    global _thread
    with _lock:
        if only_if_idle and _watches:
            return
        thread, _thread = _thread, None
        _lock.notify_all()
    if thread is not None and thread is not threading.current_thread():  # (a look may drop the last exchange)
        thread.join()


def _after_fork_in_child():
    global _thread, _lock
    _lock = threading.Condition()  # the parent's thread may have held it at the fork
    _thread = None  # the parent's thread does not exist here; the next PeerWatch starts one
    _watches.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


# Registered at import, before any exchanger exists, so it runs after exchange._closing's hook (atexit is LIFO), which
# registers at the first exchanger: the drain at exit is watched too, and the thread is gone before finalization.
atexit.register(_stop_thread)
