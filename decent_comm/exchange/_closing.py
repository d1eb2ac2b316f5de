"""Closing exchangers their owner never shut down: when the owner drops them, and at interpreter exit.

An exchanger left open still has the last step's transfers in flight (an optimizer launches the next
exchange at the end of every step). Destroyed like that, the native Exchanger can only keep their buffers
alive forever and warn. And whatever still runs on gloo's threads once Python finalizes is dangerous: a gloo
worker that releases a finished collective's tensors needs the GIL (their Python objects), and CPython ends a
thread that asks for the GIL during finalization with pthread_exit, whose unwinding through a noexcept
destructor is std::terminate ("terminate called without an active exception", issue #14.1).

So every Exchanger and GroupAllReduce registers here when it is created (and every BoundedAllReduce, whose
``shutdown()`` lets go of the tensors of its last all-reduces once gloo's workers surely have: bounded.HOLD_S), and
is drained and closed (``shutdown()``, which also lets go of the process group) either when it is garbage collected
(``__del__``: an optimizer local to ``main()`` dies when ``main`` returns, or later in a cyclic collection; a
BoundedAllReduce, with nothing in flight, is only released then) or, if still alive then, by an atexit hook.
Draining is safe at both points: every rank launched the same exchange, so each transfer in flight has its matching
one posted on the peer.

An optimizer registers too (``track_owner``, with the label its failure is logged under), as its own shutdown uses
its exchange (ATC applies the last step's pending mix: decent_comm.optim.teardown): at exit the owners are shut down
first, then the exchangers (an owner registers after the exchangers it creates, so creation order alone would close
its exchange under it).

The atexit hook is registered when the first exchanger is created, i.e. after torch and the process group
are set up, so it runs before every atexit hook registered earlier (atexit is LIFO; torch registers none
that tears process groups down) and while the process group and the interpreter are fully alive. It drains
nothing when the interpreter is exiting because of an uncaught exception (peers may never post their side;
the native destructor then keeps the buffers alive and says so).

A forked child (os.fork() while they live) closes none of its parent's: their transfers run on the parent's gloo
threads, which the child does not have (a drain waited forever), and its sockets and epoll instance are shared with
the parent (a child's drain took gloo's loop down in the parent: SIGABRT, "epoll_ctl: No such file or directory").
So at the fork the child takes them off both lists and leaks them on purpose: an extra reference the interpreter never
drops, so that neither ``__del__`` nor the native destructor (which lets go of the transport and the process group)
runs in the child, not even at finalization; their owners' finalizers find them foreign and do nothing.
"""
import atexit
import ctypes
import logging
import os
import sys
import threading
import weakref

import torch.distributed as dist

if dist.is_available():
    # Imported now, while (as a rule) no process group exists yet. Its functions' defaults ``group=group.WORLD``
    # are evaluated at import; imported after init_process_group (via torch._dynamo, which torch imports lazily:
    # in the first torch.optim.Optimizer's add_param_group, in DDP's constructor) they pin the default group for
    # good, so destroy_process_group() could never destroy it: gloo's threads would live into finalization.
    import torch.distributed.nn.functional  # noqa: F401

log = logging.getLogger(__name__)

_lock = threading.Lock()
_open = []           # (weak reference, "") of the exchangers created so far, in creation order
_owners = []         # (weak reference, label) of the owners (optimizers' schedules) of exchangers, in creation order
_registered = False
_foreign = set()     # id() of a parent's exchangers and owners, in a forked child: leaked, so their ids stay theirs


def _add(refs: list, obj, label: str) -> None:
    global _registered
    with _lock:
        refs[:] = [(r, name) for r, name in refs if r() is not None]
        refs.append((weakref.ref(obj), label))
        if not _registered:
            atexit.register(_close_all_at_exit)
            _registered = True


def track(exchanger) -> None:
    """Registers `exchanger` (an object with ``shutdown()``) to be closed at exit if it is still open."""
    _add(_open, exchanger, "")


def track_owner(owner, label: str) -> None:
    """Registers `owner` (an object with ``shutdown()`` that uses exchangers) to be shut down at exit, if still
    alive, before any exchanger is closed; `label` names it in the warning logged if that fails."""
    _add(_owners, owner, label)


def close_quietly(closeable, when: str, name: str = "") -> None:
    """``closeable.shutdown()`` (an exchanger's or an owner's); a failure (a peer died) is logged, never raised
    (``__del__``, atexit)."""
    try:
        closeable.shutdown()
    except Exception as e:  # noqa: BLE001 - at exit or in __del__ there is nobody to raise to
        log.warning("decent_comm: closing %s %s failed: %s", name or type(closeable).__name__, when, e)


def close_on_collect(closeable, name: str = "") -> None:
    """For ``__del__`` (or a weakref.finalize) of an exchanger or an owner: drain and close unless the interpreter
    is already finalizing (then the atexit hook has run: it was left open because the process is dying of an
    exception)."""
    if sys.is_finalizing() or id(closeable) in _foreign:
        return
    close_quietly(closeable, "when it was garbage collected", name)


def _dying_of_an_exception() -> bool:
    """sys.last_value (last_exc): the uncaught exception a script dies of; in an interactive session (python -i, the
    REPL, IPython, Jupyter) any error shown earlier, after which the session went on and now ends normally (it
    skipped the drain, and every rank warned of an exchanger destroyed with a bucket in flight)."""
    if getattr(sys, "last_value", None) is None and getattr(sys, "last_exc", None) is None:
        return False
    return not (hasattr(sys, "ps1") or sys.flags.interactive or _ipython_session())


def _ipython_session() -> bool:
    """A Jupyter kernel, or IPython's terminal REPL: not `ipython script.py`, nor a shell a script embedded (ipdb,
    IPython.embed), which create a shell object too."""
    ipython = sys.modules.get("IPython")
    shell = getattr(ipython, "get_ipython", lambda: None)() if ipython is not None else None
    if shell is None:
        return False
    if getattr(shell, "kernel", None) is not None:
        return True
    try:
        from IPython.terminal.ipapp import TerminalIPythonApp
        return bool(TerminalIPythonApp.initialized() and TerminalIPythonApp.instance().interact)
    except Exception:  # noqa: BLE001 - another IPython layout: not taken for a session
        return False


def _close_all_at_exit() -> None:
    if _dying_of_an_exception():
        return  # do not wait for peers that may never answer
    with _lock:
        owners, alive = [(r(), label) for r, label in _owners], [r() for r, _ in _open]
        _owners.clear()
        _open.clear()
    for owner, label in owners:  # first: their shutdown uses their exchangers (ATC's pending mix)
        if owner is not None:
            close_quietly(owner, "at exit", label)
    for exchanger in alive:  # creation order, the same on every rank
        if exchanger is not None:
            close_quietly(exchanger, "at exit")


def _after_fork_in_child() -> None:
    """The parent's exchangers and owners are leaked here (module docstring): never drained, closed or destroyed."""
    global _lock
    _lock = threading.Lock()  # another thread of the parent may have held it at the fork
    for ref, _ in _owners + _open:
        obj = ref()
        if obj is not None:
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))
            _foreign.add(id(obj))
    _owners.clear()
    _open.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
