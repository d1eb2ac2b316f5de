"""Human units for the planner: bandwidths, counts, durations and sizes.

All parsers take a string (or a number, taken as already in base units) and
return a ``float`` in base units; bad input raises ``UnitError`` (a
``ValueError``) whose message names the input and the accepted forms.

* ``parse_bandwidth("25Gbit") == 25e9 / 8`` bytes per second.  A lower-case
  ``b`` / ``bit`` is bits, an upper-case ``B`` / ``byte`` is bytes; decimal
  prefixes ``k M G T`` (1e3 ...) and binary ``Ki Mi Gi Ti`` (1024 ...); the
  suffixes ``/s``, ``ps`` and ``it/s`` are optional: ``100Gbps``,
  ``100 Gbit/s``, ``12.5GB/s``, ``12.5GBps``.  A bare number is bytes/s.
* ``parse_count("65M") == 65e6``: ``k/K`` 1e3, ``M`` 1e6, ``B/G`` 1e9,
  ``T`` 1e12; also plain or scientific numbers (``"6.5e7"``).
* ``parse_duration("120ms") == 0.12`` seconds: ``ns us µs ms s min h``; a
  bare number is seconds.
* ``parse_size("260MB") == 260e6`` bytes (``b`` suffixes are bits).

Zero is accepted, negative values are not; ``allow_zero=False`` rejects 0.
"""
from __future__ import annotations

import math
import re

_NUM = r"([+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?)"
_DECIMAL = {"": 1.0, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15}
_BINARY = {"Ki": 2.0 ** 10, "Mi": 2.0 ** 20, "Gi": 2.0 ** 30, "Ti": 2.0 ** 40}
_DURATION = {"": 1.0, "s": 1.0, "sec": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "μs": 1e-6,
             "ns": 1e-9, "min": 60.0, "h": 3600.0}
_COUNT = {"": 1.0, "k": 1e3, "K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}


class UnitError(ValueError):
    """A value that cannot be parsed (unknown unit, not a number, negative)."""


def _split(text, what: str) -> tuple[float, str]:
    if isinstance(text, bool):
        raise UnitError(f"{what}: expected a number with a unit, got {text!r}")
    if isinstance(text, (int, float)):
        return float(text), ""
    s = str(text).strip()
    m = re.fullmatch(_NUM + r"\s*(.*)", s)
    if not m:
        raise UnitError(f"{what}: {text!r} is not a number followed by a unit")
    return float(m.group(1)), m.group(2).strip()


def _check(value: float, text, what: str, allow_zero: bool) -> float:
    if not math.isfinite(value):
        raise UnitError(f"{what}: {text!r} is not finite")
    if value < 0 or (value == 0 and not allow_zero):
        raise UnitError(f"{what}: {text!r} must be {'>= 0' if allow_zero else '> 0'}")
    return value


def _prefix_and_base(unit: str) -> tuple[float, str] | None:
    """Split ``'GiB'`` into ``(2**30, 'B')``; ``None`` for an unknown prefix."""
    for table in (_BINARY, _DECIMAL):
        for p in sorted(table, key=len, reverse=True):
            if p and unit.startswith(p) and len(unit) > len(p):
                return table[p], unit[len(p):]
    return 1.0, unit


def _bits_or_bytes(base: str) -> float | None:
    """Bytes per unit of ``base`` ('bit', 'b' -> 1/8; 'B', 'byte' -> 1); None if unknown."""
    if base in ("b", "bit", "bits", "Bit", "Bits"):
        return 1.0 / 8.0
    if base in ("B", "byte", "bytes", "Byte", "Bytes"):
        return 1.0
    return None


def parse_bandwidth(text, allow_zero: bool = False) -> float:
    """Bandwidth in bytes per second (see the module docstring for the forms)."""
    what = "bandwidth"
    value, unit = _split(text, what)
    if unit:
        u = unit.replace(" ", "")
        for suffix in ("/s", "/sec", "ps"):
            if u.endswith(suffix) and len(u) > len(suffix):
                u = u[: -len(suffix)]
                break
        factor, base = _prefix_and_base(u)
        per = _bits_or_bytes(base)
        if per is None:
            raise UnitError(f"{what}: unknown unit {unit!r} in {text!r}; use e.g. 25Gbit, 100Gbps,"
                            " 600Gbit/s (bits) or 12.5GB/s, 12.5GBps (bytes)")
        value *= factor * per
    return _check(value, text, what, allow_zero)


def parse_count(text, allow_zero: bool = False) -> float:
    """A count such as a parameter number: ``65M``, ``1.3B``, ``125k``, ``6.5e7``."""
    what = "count"
    value, unit = _split(text, what)
    if unit not in _COUNT:
        raise UnitError(f"{what}: unknown suffix {unit!r} in {text!r}; use k, M, B (or G), T, e.g. 65M, 1.3B")
    return _check(value * _COUNT[unit], text, what, allow_zero)


def parse_duration(text, allow_zero: bool = True) -> float:
    """A duration in seconds: ``120ms``, ``0.12s``, ``5us``, ``100ns``; bare numbers are seconds."""
    what = "duration"
    value, unit = _split(text, what)
    if unit not in _DURATION:
        raise UnitError(f"{what}: unknown unit {unit!r} in {text!r}; use ns, us, ms, s, min or h,"
                        " e.g. 120ms, 0.12s, 5us")
    return _check(value * _DURATION[unit], text, what, allow_zero)


def parse_size(text, allow_zero: bool = False) -> float:
    """A size in bytes: ``260MB``, ``1.5GiB``, ``800Mbit``; bare numbers are bytes."""
    what = "size"
    value, unit = _split(text, what)
    if unit:
        factor, base = _prefix_and_base(unit.replace(" ", ""))
        per = _bits_or_bytes(base)
        if per is None:
            raise UnitError(f"{what}: unknown unit {unit!r} in {text!r}; use e.g. 260MB, 1.5GiB, 800Mbit")
        value *= factor * per
    return _check(value, text, what, allow_zero)


# -- formatting ------------------------------------------------------------------
def format_seconds(s: float) -> str:
    """``0.1234 -> '123.4 ms'``; picks s, ms or us."""
    if s is None or not math.isfinite(s):
        return "-"
    if s == 0:
        return "0"
    a = abs(s)
    if a >= 1:
        return f"{s:.3g} s"
    if a >= 1e-3:
        return f"{s * 1e3:.4g} ms"
    return f"{s * 1e6:.4g} us"


def format_bandwidth(bps: float) -> str:
    """Bytes per second as ``'25 Gbit/s (3.125 GB/s)'``."""
    return f"{bps * 8 / 1e9:.4g} Gbit/s ({bps / 1e9:.4g} GB/s)"


def format_bytes(b: float) -> str:
    """``260e6 -> '260 MB'`` (decimal prefixes)."""
    for p, f in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(b) >= f:
            return f"{b / f:.4g} {p}"
    return f"{b:.4g} B"
