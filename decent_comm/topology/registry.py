"""``make(name, world_size, ...)``: the built-in topologies by name."""
from __future__ import annotations

import functools

from .aer import AlternatingExponentialRing
from .base import Topology
from .base_k import BaseGraph
from .builtins import (Complete, Exponential, Local, OnePeerExponential, OnePeerHypercube, OnePeerRing,
                       Ring, Torus)
from .validation import check_world_size, resolve_local_world_size

# name -> (class, accepted options)
_BUILTINS = {
    "complete": (Complete, ()),
    "ring": (Ring, ()),
    "one-peer-ring": (OnePeerRing, ()),
    "exp": (Exponential, ()),
    "one-peer-exp": (OnePeerExponential, ()),
    "one-peer-hypercube": (OnePeerHypercube, ()),
    "aer": (AlternatingExponentialRing, ("inter",)),
    # aer whose inter-node step averages whole node pairs: every step runs as group all-reduces.
    "aer-pair": (functools.partial(AlternatingExponentialRing, inter="pair"), ()),
    "torus": (Torus, ()),
    "base-k": (BaseGraph, ("k", "simple")),
    "local": (Local, ()),
}

#: Canonical names of the built-in topologies (``make`` also accepts ``_`` for ``-``).
NAMES = tuple(_BUILTINS)

#: ``make`` runs ``validate()`` on a built-in when ``world_size <= 256`` and
#: ``world_size * degree <= 16384``, degree being rank 0's at step 0 (an estimate: aer-pair's
#: largest is up to twice it) (cost O(period * n * degree); larger
#: schedules are left lazy so construction stays O(1)).
VALIDATE_MAX_WORLD_SIZE = 256
VALIDATE_MAX_WORK = 16384


def canonical_name(name: str) -> str:
    """``'One_Peer_Exp'`` -> ``'one-peer-exp'``; ``ValueError`` listing ``NAMES`` if unknown."""
    key = str(name).strip().lower().replace("_", "-")
    if key not in _BUILTINS:
        raise ValueError(f"unknown topology {name!r}; valid names: {', '.join(NAMES)}"
                         " (or use from_matrix / from_networkx / a Topology subclass)")
    return key


def make(name: str, world_size: int, local_world_size: int | None = None, **options) -> Topology:
    """Built-in topology ``name`` on ``world_size`` ranks (1 .. ``MAX_WORLD_SIZE`` = 2**24).

    ``local_world_size``: ranks per node; ``None`` means one node
    (``world_size``).  It must divide ``world_size``.  Only the argument counts:
    the topology layer never reads the environment (the optimizers pass
    torchrun's ``LOCAL_WORLD_SIZE`` themselves).  ``options`` are topology
    specific (``base-k``: ``k``, ``simple``; ``aer``: ``inter``).  ``name`` may
    also be an adaptive spec, ``adaptive:consensus:one-peer-exp,exp,complete[:kappa=1]``
    or ``adaptive:phase:complete@0,one-peer-exp@100`` (see ``spec.parse``).
    Small schedules are validated here, averaging included (see
    ``VALIDATE_MAX_WORK``); large ones are built lazily, so construction costs
    at most O(sqrt(n)) (torus' factorization: ~10 ms at ``MAX_WORLD_SIZE``,
    the others well under a millisecond; tests validate the built-ins
    exhaustively for small n).
    """
    if str(name).strip().lower().startswith("adaptive:"):
        if options:
            raise ValueError(f"adaptive specs take their options in the string, got {sorted(options)}")
        from .spec import parse
        return parse(name, check_world_size(world_size), local_world_size)
    key = canonical_name(name)
    n = check_world_size(world_size)
    L = resolve_local_world_size(n, local_world_size)
    cls, accepted = _BUILTINS[key]
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ValueError(f"topology {key!r} does not take option(s) {unknown};"
                         f" accepted options: {list(accepted) or 'none'}")
    topo = cls(n, L, **options)
    if n <= VALIDATE_MAX_WORLD_SIZE and n * max(1, topo.peers(0, 0).degree) <= VALIDATE_MAX_WORK:
        topo.validate()
    return topo
