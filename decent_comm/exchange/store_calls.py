"""Every call decent_comm makes on the default process group's store, each held to a deadline.

    store = default_store()                  # the default group's store, behind deadlines
    store.set(key, value); store.add(key, n); store.get(key); store.check(keys)   # each within REPLY_S
    store.wait(keys, timedelta)              # within its timeout + REPLY_S

Why: a TCPStore client whose server stops answering without closing the connection (the store's host cut off by a
partition, or its machine crashed, so no TCP reset arrives; or the store's process frozen) blocks in add, set, get
and check until TCP gives up (~15 min). Neither the store's own timeout nor set_timeout() bounds them, and not even
wait(keys, timeout) is bounded: past its timeout it cancels the wait and blocks for the server's answer to that
(torch 2.14, measured with the server's process stopped). decent_comm calls the store where
an optimizer has promised an error within its timeout + a few seconds: the construction's arrival barrier, the
failure paths' reports and blame (exchange.arrival, exchange.roster). So each call runs on a daemon thread of its
own, gone once the call returns, and the caller waits for it up to its deadline; past it the caller raises ``dist.DistStoreError`` naming
the store's address and the seconds, which the callers' ``except dist.DistError`` handlers put into their own words.
The call left behind still holds the client's connection (and its lock): until it returns, every later call raises
the same error at once instead of queueing behind it.

The calls happen at construction, on failures, and once per 0.5 s of a gloo all-reduce that lasts longer than that
(exchange.watched_wait), never per step otherwise; the thread costs a fraction of a millisecond a call.

Exit: a call's thread is a daemon; blocked when the process exits, it dies with it. But a call that returns
during the interpreter's finalization (the store answers late, or its host closes the connection) takes the GIL
there, and CPython ends the thread with pthread_exit, whose unwinding through a noexcept destructor is std::terminate
("terminate called without an active exception", see _closing.py; seen here: a frozen store killed as its client
exits). So an atexit hook shuts down this process's connections to the store when a call is still outstanding: the
call fails at once and its thread finishes while Python is alive.
"""
from __future__ import annotations

import atexit
import datetime
import os
import socket
import threading
from typing import List, Optional, Sequence, Tuple

import torch.distributed as dist

# The longest a request other than a wait may take: a store answers in milliseconds, and a loaded machine's in well
# under a second. Spent on top of `timeout` when the store stops answering on a failure path (the error then comes
# within timeout + REPLY_S, + roster.BLAME_GRACE_S at most when the store answered the first look-up).
REPLY_S = 3.0
_EXIT_JOIN_S = 2.0  # at exit: how long the outstanding call may take to fail once its connection is shut down


class _Job:
    __slots__ = ("fn", "method", "args", "address", "done", "result", "error")

    def __init__(self, fn, method, args, address):
        self.fn, self.method, self.args, self.address = fn, method, args, address
        self.done = threading.Event()
        self.result = self.error = None


class _State:
    def __init__(self):
        # Reentrant: any allocation inside it can start a cyclic garbage collection, whose finalizers (a dropped
        # GroupAllReduce's shutdown, an optimizer's) make store calls of their own on this thread; a plain Lock
        # deadlocked there, and every later store call of the process blocked behind it.
        self.lock = threading.RLock()
        self.outstanding: List[_Job] = []             # calls started and not returned, oldest first
        self.stuck: Optional[Tuple[_Job, str]] = None  # a call past its caller's deadline, and the error it raised
        self.closed: Optional[str] = None            # set at exit once the connections were shut down


_state = _State()
_exit_hook = []


def _reset_after_fork():
    global _state  # the child has no such thread, and the lock may have been held by another thread at the fork
    _state = _State()


os.register_at_fork(after_in_child=_reset_after_fork)


def _run(state: _State, job: _Job):
    try:
        job.result = job.fn(*job.args)
    except BaseException as e:  # noqa: BLE001 - handed to the caller
        job.error = e
    with state.lock:  # done is set under the lock: a caller whose deadline passes now sees it done, or not yet
        if job in state.outstanding:  # (_call took it back if its thread's start was interrupted)
            state.outstanding.remove(job)
        if state.stuck is not None and state.stuck[0] is job:
            state.stuck = None  # it answered after all: the connection is usable again
        job.done.set()


def _address(store) -> Optional[Tuple[str, int]]:
    """host and port of the TCPStore under `store` (PrefixStores unwrapped); None for another kind of store."""
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    host, port = getattr(store, "host", None), getattr(store, "port", None)
    return (host, port) if isinstance(port, int) else None


def _where(address) -> str:
    return f"at {address[0]}:{address[1]} " if address else ""


class BoundedStore:
    """The calls of decent_comm on `store`, each within a deadline (see the module docstring)."""

    def __init__(self, store):
        self._store, self._address = store, _address(store)

    def set(self, key: str, value):
        return self._call("set", (key, value), REPLY_S)

    def add(self, key: str, amount: int) -> int:
        return self._call("add", (key, amount), REPLY_S)

    def get(self, key: str) -> bytes:
        return self._call("get", (key,), REPLY_S)

    def check(self, keys: Sequence[str]) -> bool:
        return self._call("check", (list(keys),), REPLY_S)

    def wait(self, keys: Sequence[str], timeout: datetime.timedelta):
        """Raises dist.DistStoreError when a key is not there within `timeout` (the store's own error)."""
        return self._call("wait", (list(keys), timeout), timeout.total_seconds() + REPLY_S)

    def _call(self, method: str, args: tuple, seconds: float):
        state = _state
        # Made before the lock is taken: fewer allocations under it, where a collection runs finalizers (_State.lock)
        job = _Job(getattr(self._store, method), method, args, self._address)
        # A thread of its own per call, gone once the call returns: none outlives shutdown() and
        # destroy_process_group() (tests/test_exit.py counts them).
        thread = threading.Thread(target=_run, args=(state, job), daemon=True, name=f"decent_comm-store-{method}")
        with state.lock:
            refused = state.closed or (state.stuck[1] if state.stuck is not None else None)
            if refused is None:
                if not _exit_hook:
                    _exit_hook.append(atexit.register(_close_at_exit))
                blocker = state.outstanding[0] if state.outstanding else None  # e.g. a wait whose caller was interrupted
                state.outstanding.append(job)
        if refused is not None:
            raise dist.DistStoreError(refused)
        try:
            thread.start()
        except RuntimeError:  # at interpreter shutdown (Python >= 3.12 refuses new threads): made here, unbounded
            _run(state, job)
        except BaseException:  # Ctrl-C before the thread ran: a job nobody runs would stand as a later call's blocker
            with state.lock:
                if not thread.is_alive() and not job.done.is_set() and job in state.outstanding:
                    state.outstanding.remove(job)
            raise
        if not job.done.wait(seconds):
            with state.lock:
                if not job.done.is_set():
                    message = (f"no answer from the default process group's store {_where(self._address)}within "
                               f"{seconds:g} s ({method}: its host unreachable, or the store stuck)")
                    if blocker is not None and not blocker.done.is_set():  # the store may be fine
                        message += (f"; this process's earlier store call ({blocker.method}) has not returned yet, "
                                    "and this one waits behind it for the store's connection")
                    if state.stuck is None:  # the call holds (or waits for) the client's connection
                        state.stuck = (job, message)
                    raise dist.DistStoreError(message)
        if job.error is not None:
            raise job.error
        return job.result


def default_store() -> BoundedStore:
    """The default process group's store, each call held to a deadline."""
    return BoundedStore(dist.distributed_c10d._get_default_store())


def _close_at_exit():
    """With a call outstanding, shuts down this process's connections to its store so that it fails now, while the
    interpreter is alive, rather than return during finalization (see the module docstring)."""
    state = _state
    with state.lock:
        if not state.outstanding:
            return
        jobs = list(state.outstanding)
        state.closed = (f"the default process group's store {_where(jobs[0].address)}was disconnected at exit with a "
                        "call outstanding")
    if jobs[0].address is not None:
        _shut_down_connections(*jobs[0].address)
    for job in jobs:
        job.done.wait(_EXIT_JOIN_S)


def _ip(address: str) -> str:
    return address[7:] if address.startswith("::ffff:") else address  # an IPv4 peer of a dual-stack socket


def _shut_down_connections(host: str, port: int):
    """shutdown() of every socket of this process connected to the store at `host`:`port` (its clients; not a
    server's own accepted connections, whose local port it is; not a connection to another host's service on the
    same port number). Linux (/proc); elsewhere nothing happens."""
    try:
        ips = {_ip(info[4][0]) for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)}
        fds = [int(fd) for fd in os.listdir("/proc/self/fd")]
    except OSError:  # socket.gaierror is an OSError: without the store's addresses no socket can be told apart
        return
    for fd in fds:
        try:
            sock = socket.socket(fileno=fd)
        except (OSError, ValueError):  # not a socket (or closed meanwhile), or of a family Python does not know
            continue
        try:
            peer, own = sock.getpeername(), sock.getsockname()
            if isinstance(peer, tuple) and peer[1] == port and own[1] != port and _ip(peer[0]) in ips:
                sock.shutdown(socket.SHUT_RDWR)
        except OSError:  # not connected, or not an inet socket
            pass
        finally:
            sock.detach()  # the fd stays its owner's
