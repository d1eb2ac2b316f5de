"""The type and range checks of numeric arguments, shared by the public entry points (the optimizers' options,
the topologies, the runtime model, the ops), so that one rule holds everywhere and a value one of them takes
another does not refuse:

* a bool is not a number (True is not 1): a flag passed in a number's place, or a number in a flag's, is a bug;
* numpy scalars are numbers, and numpy integers integers (np.int64 from a config or an array is common); so is a
  0-d numpy array (np.array(0.1), what numpy reductions and some schedulers give; torch.optim trains with it);
* an integer option takes what ``operator.index`` takes (int, numpy integers, an integer tensor) and a finite
  Python or numpy float whose value is whole (4.0: argparse's type=float and arithmetic such as n / 2 give them),
  as the int it equals; never a fractional float (int(0.5) = 0 gave a start step of 0), NaN or inf (int(inf)
  overflowed), a float tensor or a string;
* a real option takes ``numbers.Real`` (not a string: float("0.1") would let a typo'd config value train), never
  NaN, and inf only where asked.

A refusal is a ValueError naming the argument (and `where`, the callee, when given). Nothing here imports torch
(the topology and runtime-model layers do not); a tensor is recognized when torch is loaded.
"""

import math
import numbers
import operator
import sys

import numpy as np


def _tensor_type():
    torch = sys.modules.get("torch")  # a tensor exists only once torch is imported
    return torch.Tensor if torch is not None else ()


def _unwrap(value):
    """A 0-d numpy array as the numpy scalar it holds (np.array(0.1)[()] is np.float64(0.1)); anything else as is."""
    return value[()] if isinstance(value, np.ndarray) and value.ndim == 0 else value


def is_bool(value) -> bool:
    """Python, numpy and torch booleans (a bool tensor and a 0-d bool array too)."""
    if isinstance(_unwrap(value), (bool, np.bool_)):
        return True
    tensor = _tensor_type()
    return bool(tensor) and isinstance(value, tensor) and value.dtype is sys.modules["torch"].bool


def _bound(value) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _range(low, high, low_open, high_open) -> str:
    if low is not None and high is not None:
        return f" in {'(' if low_open else '['}{_bound(low)}, {_bound(high)}{')' if high_open else ']'}"
    if low is not None:
        return f" {'>' if low_open else '>='} {_bound(low)}"
    if high is not None:
        return f" {'<' if high_open else '<='} {_bound(high)}"
    return ""


def _outside(v, low, high, low_open, high_open) -> bool:
    return ((low is not None and (v <= low if low_open else v < low))
            or (high is not None and (v >= high if high_open else v > high)))


def integer(value, name: str, low=None, high=None, where: str = "") -> int:
    """`value` as a Python int, if it is an integer (not a bool; a whole finite float too) in [low, high] (None:
    unbounded), else ValueError."""
    v = value if type(value) is int else _as_int(value, name, low, high, where)  # a plain int first: the usual
    if _outside(v, low, high, False, False):
        raise ValueError(f"{_want_int(name, low, high, where)}, got {v}")
    return v


def _as_int(value, name, low, high, where) -> int:
    value = _unwrap(value)
    try:
        if is_bool(value):
            raise TypeError
        if isinstance(value, (float, np.floating)):  # np.float64 is a float; np.float32 is not
            if not (math.isfinite(value) and float(value).is_integer()):
                raise TypeError
            return int(value)
        return int(operator.index(value))  # int(): an int subclass or a tensor's __index__ as a plain int
    except Exception:  # TypeError, and whatever a tensor on the meta device raises
        raise ValueError(f"{_want_int(name, low, high, where)}, got {describe(value)}") from None


def _want_int(name, low, high, where) -> str:
    # built only when raising: integer() runs on every Topology.peers() call (+15% when built on every call)
    return f"{where + ': ' if where else ''}{name} must be an integer{_range(low, high, False, False)}"


def is_real(value, tensor: bool = False) -> bool:
    """A real number, not a bool (numpy's too); with `tensor`, also a real tensor of one element holding data
    (not on the meta device)."""
    value = _unwrap(value)
    if is_bool(value):
        return False
    t = _tensor_type()
    if t and isinstance(value, t):
        return tensor and value.numel() == 1 and not value.is_complex() and not value.is_meta
    return isinstance(value, numbers.Real)


def describe(value) -> str:
    """`value` for a refusal's message, with why it is no number where that is not plain from its repr."""
    if is_bool(value):
        return f"{value!r} (a bool is not a number here)"
    t = _tensor_type()
    if t and isinstance(value, t):
        return f"a tensor of {value.numel()} element(s), dtype {value.dtype}, on {value.device}"
    return f"{value!r} ({type(value).__name__})"


def real(value, name: str, low=None, high=None, *, low_open: bool = False, high_open: bool = False,
         finite: bool = True, tensor: bool = False, where: str = "") -> float:
    """`value` as a float, if it is_real (with `tensor`, a one-element tensor too) and in the range given
    (low/high, each closed unless *_open), never NaN, inf only without `finite`; else ValueError."""
    value = _unwrap(value)
    if not is_real(value, tensor):
        raise ValueError(f"{_want_real(name, low, high, low_open, high_open, finite, where)}, got {describe(value)}")
    try:
        v = float(value)
    except OverflowError:  # an int past float's range
        v = math.inf if value > 0 else -math.inf
    if math.isnan(v) or (finite and math.isinf(v)) or _outside(v, low, high, low_open, high_open):
        raise ValueError(f"{_want_real(name, low, high, low_open, high_open, finite, where)}, got {value!r}")
    return v


def _want_real(name, low, high, low_open, high_open, finite, where) -> str:
    bounded = low is not None and high is not None  # then finite goes without saying
    return (f"{where + ': ' if where else ''}{name} must be a {'finite ' if finite and not bounded else ''}number"
            f"{_range(low, high, low_open, high_open)}")
