"""Ctrl-C during step() is raised once step() has taken the step (or refused it: below); likewise during ATC's
pending mix (a forward pre-hook's, synchronize()'s: GossipSchedule.mix_pending) and the global average
(optim/averaging.py), whose buckets were otherwise left part done: mixed twice, or averaged on some ranks only.

Raised where Python's default handler raises it, a KeyboardInterrupt could land between two buckets' launches: the
rest were never posted, so a handler that saves or averages on Ctrl-C (state_dict, global_average) timed out
waiting for them on every rank, and training on refused "bucket 0 is still in flight"; or between two buckets'
updates, leaving some mixed and updated twice at the next step. The wait this adds is at most the rest of one
step (a step waiting for a silent peer was not interruptible anyway: the exchange waits in C++ until its timeout).
The whole of step() is held, its checks too (holds_interrupt): held from the first launch on only, a Ctrl-C during
the checks before it came out with the step not taken (4 in 400 timed at random), and at 2 ranks one rank ended a
step behind the others, so the next synchronize() refused.
Holding costs two signal.signal calls (9 us on a loaded 2-core machine), paid once per step and once per pre-hook mix.

Only in the main thread (where signal handlers run) and while SIGINT has Python's default handler: a script's own
handler is left as it is.

A block that raised an error of its own while a SIGINT was held ends as KeyboardInterrupt all the same, raised from
that error (its __cause__): a Ctrl-C always ends as one. The error is often the Ctrl-C's own doing: a peer
interrupted outside step() shuts down, and this rank's step, waiting for it, raised ExchangeError; the error was
raised instead, so that rank printed a traceback where every other rank stopped as interrupted."""

import functools
import signal
import threading


class HeldInterrupt:
    """with HeldInterrupt(): ... -- a SIGINT received inside is raised as KeyboardInterrupt on leaving; if the block
    raised an Exception, from that exception (module docstring)."""

    def __enter__(self):
        self._previous, self._received = None, False
        if threading.current_thread() is threading.main_thread() and \
                signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            self._previous = signal.signal(signal.SIGINT, self._hold)
        return self

    def _hold(self, signum, frame):
        self._received = True

    def __exit__(self, kind, value, traceback):
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
        if self._received:
            if kind is None:
                raise KeyboardInterrupt
            if issubclass(kind, Exception):  # (a KeyboardInterrupt, SystemExit of the block's own goes on as it is)
                raise KeyboardInterrupt from value
        return False


def holds_interrupt(method):
    """The method's whole body runs in a HeldInterrupt (a fresh one per call: calls may nest or come from threads)."""
    @functools.wraps(method)
    def held(*args, **kwargs):
        with HeldInterrupt():
            return method(*args, **kwargs)
    return held
