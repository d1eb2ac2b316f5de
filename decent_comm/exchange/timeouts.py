"""The `timeout` argument of every bounded wait - the optimizers' option, ``Exchanger``, ``GroupAllReduce``,
``BoundedAllReduce`` - read and checked in one place: None (the process group's own timeout), a positive finite
number of seconds, or a ``datetime.timedelta``."""

import datetime
import math
import numbers
from typing import Optional


#: the longest timeout taken: the C++ transports' deadline is the steady clock's nanoseconds plus the timeout
MAX_TIMEOUT_S = 1e8


def timeout_seconds(timeout, who: str = "") -> Optional[float]:
    """`timeout` in seconds, None staying None; a ValueError, its message starting with `who` (e.g. "Exchanger: "),
    for anything else than a positive finite real number (numpy's too) or timedelta: a bool or a string from a config
    file would pass float(), and an infinite or huge one overflows the transports' deadline."""
    if timeout is None:
        return None
    seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else timeout
    if isinstance(seconds, bool) or not isinstance(seconds, numbers.Real) or not math.isfinite(seconds) \
            or seconds <= 0:
        raise ValueError(f"{who}timeout must be a positive number of seconds (or a timedelta), got {timeout!r}")
    if seconds > MAX_TIMEOUT_S:
        raise ValueError(f"{who}timeout must be at most {MAX_TIMEOUT_S:.0e} s (about 3 years), got {timeout!r}: the "
                         "transports' deadline (now + timeout, in nanoseconds) overflows beyond 9.2e9 s, and every "
                         "wait then timed out at once")
    return float(seconds)


def timeout_ms(seconds: Optional[float]) -> int:
    """`seconds` (timeout_seconds' result) in whole milliseconds, at least 1, the transports' unit; -1 (the
    transport's default, the process group's own timeout) for None."""
    return -1 if seconds is None else max(1, round(seconds * 1000))
