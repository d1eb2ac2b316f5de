"""``parse``: an ``Adaptive`` topology from a spec string (what ``make("adaptive:...")`` accepts).

    adaptive:consensus:<candidate>,<candidate>,...[:<key>=<value>,...]    ConsensusControl
    adaptive:phase:<candidate>@<first step>,<candidate>@<first step>,...  PhaseSchedule

Candidates are built-in names (``NAMES``; any case, ``_`` for ``-``).  The consensus options are the
``ConsensusControl`` keywords in ``OPTIONS``.  Every error is a ``ValueError`` that quotes the whole spec and the
offending token and says what would be valid.
"""
from __future__ import annotations

import math
from typing import Optional

from .adaptive import Adaptive
from .policies import ConsensusControl, PhaseSchedule
from .registry import NAMES, canonical_name

FORMS = ("'adaptive:consensus:<topology>,<topology>,...[:key=value,...]' (e.g. "
         "'adaptive:consensus:one-peer-exp,exp,complete:kappa=1') or 'adaptive:phase:<topology>@<first step>,...'"
         " (e.g. 'adaptive:phase:complete@0,one-peer-exp@100')")


def _int(text: str, minimum: int) -> int:
    value = int(text)  # ValueError for anything but an integer literal
    if value < minimum:
        raise ValueError
    return value


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError
    return value


def _bool(text: str) -> bool:
    key = text.lower()
    if key not in ("true", "false", "1", "0", "yes", "no"):
        raise ValueError
    return key in ("true", "1", "yes")


#: ConsensusControl keywords a consensus spec may set: key -> (converter, what the value must be).
OPTIONS = {
    "kappa": (_float, "a finite number > 0"),
    "low": (_float, "a finite number, 0 < low < high"),
    "high": (_float, "a finite number > low"),
    "interval": (lambda t: _int(t, 1), "an integer >= 1"),
    "min_dwell": (lambda t: _int(t, 0), "an integer >= 0"),
    "initial": (str, "'densest', 'sparsest' or one of the candidates"),
    "correlation": (_float, "a number in [0, 1)"),
    "hold_while_lr_rises": (_bool, "true or false"),
    "calibrate": (_bool, "true or false"),
}


class _Spec:
    """The spec being parsed, so that every error quotes it."""

    def __init__(self, spec):
        self.text = str(spec)

    def error(self, token: str, problem: str) -> ValueError:
        return ValueError(f"adaptive spec {self.text!r}: {token!r} {problem}")

    def candidate(self, name: str, token: str) -> str:
        """The canonical built-in name ``name``, read from ``token`` (the item that holds it)."""
        if not name.strip():
            raise self.error(token, f"has an empty topology name; expected one of {', '.join(NAMES)}")
        try:
            return canonical_name(name)
        except ValueError:
            raise self.error(token, f"is not a built-in topology; expected one of {', '.join(NAMES)}") from None

    def options(self, text: str, candidates: list) -> dict:
        options = {}
        for item in text.split(","):
            key, eq, value = item.partition("=")
            key = key.strip().replace("-", "_")
            if not eq or not key or not value.strip():
                raise self.error(item, "is not an option key=value; options are comma-separated key=value pairs"
                                       f" with key one of {', '.join(OPTIONS)}")
            if key not in OPTIONS:
                raise self.error(item, f"sets an unknown option {key!r}; valid options: {', '.join(OPTIONS)}")
            if key in options:
                raise self.error(item, f"sets option {key!r} a second time")
            convert, expected = OPTIONS[key]
            try:
                options[key] = convert(value.strip())
            except ValueError:
                raise self.error(item, f"has a bad value {value.strip()!r}: {key} must be {expected}") from None
        initial = options.get("initial")
        if initial is not None:  # any case, as the candidate names (canonical_name)
            options["initial"] = initial.strip().lower().replace("_", "-")
            if options["initial"] not in ("densest", "sparsest") and options["initial"] not in candidates:
                raise self.error(f"initial={initial}", f"names no candidate; initial must be {OPTIONS['initial'][1]}"
                                                       f" ({', '.join(candidates)})")
        return options

    def phases(self, body: str) -> list:
        phases = []
        for item in body.split(","):
            name, at, start = item.partition("@")
            if not at:
                raise self.error(item, "is not <topology>@<first step> (e.g. complete@0)")
            try:
                first = _int(start.strip(), 0)
            except ValueError:
                raise self.error(item, f"has first step {start.strip()!r}; expected an integer >= 0,"
                                       " as in <topology>@<first step> (e.g. one-peer-exp@100)") from None
            if not phases and first != 0:
                raise self.error(item, "starts the first phase after step 0; the first phase must start at step 0")
            if phases and first <= phases[-1][1]:
                raise self.error(item, f"starts at step {first}, not after the previous phase (step {phases[-1][1]});"
                                       " phases must be listed in increasing order of their first step")
            phases.append((self.candidate(name, item), first))
        return phases


def parse(spec: str, world_size: Optional[int] = None, local_world_size: Optional[int] = None) -> Adaptive:
    """``Adaptive`` from ``adaptive:consensus:<c1>,<c2>,...[:key=value,...]`` (``ConsensusControl``, keys in
    ``OPTIONS``) or ``adaptive:phase:<name>@<start>,<name>@<start>,...`` (``PhaseSchedule``).  Bound to
    ``world_size`` when given (``local_world_size``: ranks per node, ``None`` = one node)."""
    s = _Spec(spec)
    parts = s.text.strip().split(":")
    if parts[0].strip().lower() != "adaptive" or len(parts) < 3:
        raise ValueError(f"adaptive spec {s.text!r} is not of the form {FORMS}")
    kind, body = parts[1].strip().lower(), parts[2]
    options = ":".join(parts[3:]) if len(parts) > 3 else None
    if kind == "consensus":
        candidates = []
        for item in body.split(","):
            name = s.candidate(item, item)
            if name in candidates:
                raise s.error(item, f"repeats candidate {name!r}; candidates must be distinct")
            candidates.append(name)
        policy_options = s.options(options, candidates) if options is not None else {}
        try:
            policy = ConsensusControl(**policy_options)
        except ValueError as e:
            raise s.error(options, f"sets invalid options: {e}") from None
    elif kind == "phase":
        if options is not None:
            raise s.error(options, "is an option, but adaptive:phase takes none: adaptive:phase:<topology>@<step>,...")
        phases = s.phases(body)
        candidates = list(dict.fromkeys(name for name, _ in phases))
        policy = PhaseSchedule(phases)
    else:
        raise s.error(parts[1], f"is not an adaptive policy; expected 'consensus' or 'phase': {FORMS}")
    try:
        return Adaptive(candidates, policy, world_size=world_size, local_world_size=local_world_size)
    except ValueError as e:  # a candidate that cannot be built on this world size
        raise ValueError(f"adaptive spec {s.text!r}: {e}") from None
