"""Value types for the command line's flags, and the reader of ``--compute-sample``.

Each type turns bad text into ``argparse.ArgumentTypeError`` saying what would be valid; argparse
prefixes the flag ("argument --nodes: expected an integer in [1, 1048576], got '0'") and exits with
code 2.  Numbers must be finite: NaN and infinities are refused like any other bad value.
"""
from __future__ import annotations

import argparse
import math
import os

from ..runtime_model import units

#: Most values ``--compute-sample`` reads (a file of measured step times is thousands of lines), and the
#: largest file it opens.
MAX_SAMPLE = 1_000_000
MAX_SAMPLE_FILE_BYTES = 64 << 20


def _bounded(cast, kind: str, lo, hi):
    """A type accepting ``cast(text)`` in ``[lo, hi]`` (``None``: unbounded on that side)."""
    span = (f"in [{lo}, {hi}]" if lo is not None and hi is not None
            else f">= {lo}" if lo is not None else f"<= {hi}")

    def parse(text):
        try:
            value = cast(text)
        except (TypeError, ValueError):
            value = None
        if (value is None or not math.isfinite(value) or (lo is not None and value < lo)
                or (hi is not None and value > hi)):
            raise argparse.ArgumentTypeError(f"expected {kind} {span}, got {text!r}")
        return value
    parse.__name__ = kind
    return parse


def integer(lo: int, hi: int):
    """An integer in ``[lo, hi]``."""
    return _bounded(int, "an integer", lo, hi)


def number(lo: float | None = None, hi: float | None = None):
    """A finite number in ``[lo, hi]``."""
    return _bounded(float, "a finite number", lo, hi)


#: Physically sensible ranges of the unit flags, ``(lo, hi, in words)`` in base units (0 stays allowed where
#: the flag allows it): far beyond any real cluster, yet every product and quotient of the model stays finite.
DURATION_RANGE = (1e-9, 86400.0, "1ns .. 24h")
BANDWIDTH_RANGE = (125.0, 1.25e17, "1kbit/s .. 1000Pbit/s")
COUNT_RANGE = (1.0, 1e15, "1 .. 1e15")
SIZE_RANGE = (1.0, 1e15, "1B .. 1PB")


def in_range(value: float, span: tuple, text, what: str) -> float:
    """``value`` if 0 or within ``span`` (``DURATION_RANGE``, ...), else ``units.UnitError``."""
    lo, hi, words = span
    if value != 0 and not lo <= value <= hi:
        raise units.UnitError(f"{what}: {text!r} is outside {words}")
    return value


def unit(parser, span: tuple, example: str = "", **kw):
    """A ``runtime_model.units`` parser (``parse_bandwidth``, ...) as an argparse type, bounded by ``span``. With
    `example` a non-zero value needs a unit: the API reads a bare number in base units (seconds, bytes), which on
    the command line took ``--compute 300`` for 300 s and ``--bucket-size 25`` for 25 bytes, silently."""
    what = parser.__name__.replace("parse_", "")

    def parse(text):
        try:
            value = parser(text, **kw)
        except units.UnitError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        if example and value != 0 and _is_bare_number(text):
            raise argparse.ArgumentTypeError(f"{what} {text!r} needs a unit, e.g. {example}")
        try:
            return in_range(value, span, text, what)
        except units.UnitError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    parse.__name__ = what
    return parse


def _is_bare_number(text) -> bool:
    try:
        float(str(text).strip())
        return True
    except ValueError:
        return False


BANDWIDTH = unit(units.parse_bandwidth, BANDWIDTH_RANGE, example="25Gbit, 100Gbps, 3GB/s")
DURATION = unit(units.parse_duration, DURATION_RANGE, example="120ms, 0.12s, 5us")
COUNT = unit(units.parse_count, COUNT_RANGE)
SIZE = unit(units.parse_size, SIZE_RANGE, example="25MB, 25MiB")


def read_sample(text: str, flag: str = "--compute-sample") -> list:
    """Durations (seconds) from a file of one per line (``#`` comments) or a comma list; ``ValueError``
    naming ``flag`` for a directory, an unreadable file, a bad value or more than ``MAX_SAMPLE`` values."""
    if os.path.isdir(text):
        raise ValueError(f"{flag} {text!r} is a directory; give a file with one duration per line or a comma list")
    if os.path.exists(text):
        if not os.path.isfile(text):
            raise ValueError(f"{flag} {text!r} is not a regular file; give a file with one duration per line")
        if os.path.getsize(text) > MAX_SAMPLE_FILE_BYTES:
            raise ValueError(f"{flag} {text!r} is larger than {MAX_SAMPLE_FILE_BYTES >> 20} MiB")
        items = []
        try:
            with open(text, encoding="utf-8") as fh:
                for line in fh:
                    line = line.strip()
                    if line and not line.startswith("#"):
                        items.append(line)
                        if len(items) > MAX_SAMPLE:
                            raise ValueError(f"{flag} {text!r}: more than {MAX_SAMPLE} values")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"{flag} {text!r}: cannot read it ({type(e).__name__}: {e})") from None
        where = f"file {text!r}"
    else:
        items = [t for t in text.split(",") if t.strip()]
        where = "list"
    if not items:
        raise ValueError(f"{flag} {text!r}: no values")
    if len(items) > MAX_SAMPLE:
        raise ValueError(f"{flag}: more than {MAX_SAMPLE} values")
    bare = [t.strip() for t in items if _is_bare_number(t) and float(t) != 0] if where == "list" else []
    if bare:  # as --compute: typed on the command line, "100,120" meant milliseconds more often than seconds
        raise ValueError(f"{flag} {text!r}: {bare[0]!r} needs a unit, e.g. 120ms,0.12s (a file may hold bare "
                         "seconds, one per line)")
    try:
        return [in_range(units.parse_duration(t), DURATION_RANGE, t, "duration") for t in items]
    except units.UnitError as e:
        if where == "list" and "," not in text:
            raise ValueError(f"{flag} {text!r} is neither a file nor a duration ({e})") from None
        raise ValueError(f"{flag}: {e} in the {where}") from None
