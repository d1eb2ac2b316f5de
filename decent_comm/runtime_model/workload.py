"""What one training step costs: ``ComputeTime`` and ``Workload``.

``ComputeTime``: the forward + backward (+ optimizer update) time of one
step on one rank, a random variable ``C`` described by ``mean`` and ``std``
(normal, truncated at 0 in the simulator) or by a measured ``sample``
(resampled; ``mean``/``std`` are then the sample's).  ``forward_fraction``
(default 1/3) and ``backward_fraction`` (default 2/3) split it: ATC overlaps
communication with the forward only, all-reduce with the backward only.

``Workload``: ``params`` (count) times ``bytes_per_param`` (wire dtype: 4 for
fp32, 2 for bf16/fp16, 1 + 4/512 for the int8 wire with its scales) is the buffer ``B`` every rank exchanges per step
(gradients for all-reduce, parameters for gossip); ``mode`` is ``"awc"``
(communication overlaps forward + backward) or ``"atc"`` (forward only);
``bucket_bytes`` is the all-reduce bucket size (PyTorch DDP's default
``bucket_cap_mb = 25``, i.e. 25 MiB).  ``exchange`` says how a gossip step
moves bytes: ``"auto"`` (default; what decent_comm's optimizers do: a step
whose mixing matrix is uniform averaging over groups, one of them of at least
three ranks, runs one all-reduce per group, any other step point to point),
``"p2p"`` (every rank sends its buffer to each out-neighbour) or
``"group-allreduce"`` (every step that is uniform averaging over groups runs
one all-reduce per group, as the seed library Decent-DP does). Under "auto" the 8-bit wire is always point
to point and a bf16/fp16 wire's group steps sum in the parameters' dtype, ``param_bytes`` per element (4:
float32, the default; 2: a bf16/fp16 model) (``group_bytes_per_rank``), as the optimizers do; an fp16 model's
sums run in float32 (an fp16 sum overflows at 65504), which ``group_sum_bytes=4`` says.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from .._args import real
from ..topology.analysis import MIN_ALLREDUCE_GROUP
from .stragglers import expected_max_normal, expected_max_sample

MODES = ("awc", "atc")
EXCHANGES = ("auto", "p2p", "group-allreduce")
#: With exchange="auto", a step runs as group all-reduces when one of its groups has this many ranks
#: (the same threshold the optimizers use).
AUTO_MIN_GROUP = MIN_ALLREDUCE_GROUP
#: Bytes per parameter of each wire the optimizers' comm_dtype offers (and only those: the planner must not price a
#: wire nothing can run). int8 carries one float32 scale per 512-element block.
WIRE_DTYPES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "half": 2,
               "int8": 1 + 4 / 512, "fp64": 8, "float64": 8}
DDP_BUCKET_BYTES = 25 * 2 ** 20


@dataclasses.dataclass(frozen=True)
class ComputeTime:
    """Per-step compute time of one rank (seconds); see the module docstring."""

    mean: float
    std: float = 0.0
    sample: tuple | None = None
    forward_fraction: float = 1.0 / 3.0
    backward_fraction: float = 2.0 / 3.0

    def __post_init__(self):
        if self.sample is not None:
            s = np.asarray(self.sample, dtype=np.float64).ravel()
            if s.size == 0 or not np.all(np.isfinite(s)) or s.min() < 0:
                raise ValueError("compute sample must be a non-empty list of finite times >= 0")
            object.__setattr__(self, "sample", tuple(s.tolist()))
            object.__setattr__(self, "mean", float(s.mean()))
            object.__setattr__(self, "std", float(s.std()))
        # the shared rule (_args.real): True was a mean of 1 s, and a string failed inside math.isfinite
        real(self.mean, "compute mean (seconds)", low=0)
        real(self.std, "compute std (seconds)", low=0)
        for name in ("forward_fraction", "backward_fraction"):
            real(getattr(self, name), name, 0, 1)

    @classmethod
    def from_sample(cls, sample, **kw) -> "ComputeTime":
        """A ``ComputeTime`` resampled from measured per-step times."""
        return cls(mean=0.0, sample=tuple(sample), **kw)

    @property
    def cv2(self) -> float:
        """``sigma^2 = Var[C] / E[C]^2`` (squared coefficient of variation; 0 when mean is 0)."""
        return (self.std / self.mean) ** 2 if self.mean > 0 else 0.0

    def expected_max(self, k: float) -> float:
        """``E[max of k independent draws of C]`` (``k`` may be fractional for normal C).

        Normal: ``mean + std * e(k)`` with ``e(k) = E[max of k standard
        normals]`` (``expected_max_normal``); sample: the exact expectation
        under resampling with replacement (``expected_max_sample``).
        """
        if self.sample is not None:
            return expected_max_sample(self.sample, k)
        return self.mean + self.std * expected_max_normal(k)

    def draw(self, rng: np.random.Generator, size) -> np.ndarray:
        """Random compute times: resampled, or normal clipped at 0."""
        if self.sample is not None:
            return rng.choice(np.asarray(self.sample), size=size)
        if self.std == 0:
            return np.full(size, self.mean)
        return np.maximum(rng.normal(self.mean, self.std, size=size), 0.0)


@dataclasses.dataclass(frozen=True)
class Workload:
    """``params`` x ``bytes_per_param`` bytes per rank per step, ``compute`` time, overlap ``mode``."""

    params: float
    compute: ComputeTime
    bytes_per_param: int = 4
    mode: str = "awc"
    bucket_bytes: float = DDP_BUCKET_BYTES
    exchange: str = "auto"
    param_bytes: float = 4
    group_sum_bytes: float = 0  # under "auto", the least bytes per element a group step sums (4: fp16 parameters)

    def __post_init__(self):
        real(self.params, "params", low=0, tensor=True)  # validated, kept as given (a bool or a string is no count)
        if not isinstance(self.compute, ComputeTime):  # a bare number failed later, inside predict()
            raise TypeError(f"compute must be a ComputeTime (e.g. ComputeTime({self.compute!r}) for a fixed "
                            f"{self.compute!r} s per step), got {type(self.compute).__name__}")
        real(self.bytes_per_param, "bytes_per_param", low=0, low_open=True)  # inf, NaN failed in predict()
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.exchange not in EXCHANGES:
            raise ValueError(f"exchange must be one of {EXCHANGES}, got {self.exchange!r}")
        real(self.bucket_bytes, "bucket_bytes", low=0, low_open=True, finite=False)  # inf: one bucket
        if self.param_bytes not in (2, 4, 8):
            raise ValueError(f"param_bytes must be 2 (bf16/fp16), 4 (fp32) or 8 (fp64), got {self.param_bytes!r}")
        if self.group_sum_bytes not in (0, 4) or isinstance(self.group_sum_bytes, bool):
            raise ValueError(f"group_sum_bytes must be 0 (the parameters' own) or 4 (fp16 parameters, summed in "
                             f"float32), got {self.group_sum_bytes!r}")

    @property
    def bytes_per_rank(self) -> float:
        """``B = params * bytes_per_param``: what each rank sends per message / all-reduces per step."""
        return float(self.params) * self.bytes_per_param

    @property
    def group_bytes_per_rank(self) -> float:
        """What a group all-reduce step sums per rank: ``B``, except that decent_comm's optimizers (``"auto"``)
        sum a bf16/fp16 wire's groups in the parameters' dtype, ``param_bytes`` (a sum in the wire dtype rounds
        every partial sum: decent_comm/optim/wire_buffers.py), and fp16 parameters' in float32, ``group_sum_bytes``
        (an fp16 sum overflows at 65504)."""
        if self.exchange == "auto":
            return float(self.params) * max(self.bytes_per_param, self.param_bytes, self.group_sum_bytes)
        return self.bytes_per_rank

    @property
    def group_buckets(self) -> int:
        """All-reduce buckets of a group step: ``ceil(group_bytes_per_rank / bucket_bytes)`` (at least 1)."""
        return max(1, math.ceil(self.group_bytes_per_rank / self.bucket_bytes))

    @property
    def wire_is_8bit(self) -> bool:
        """The 8-bit wire (or any under 2 bytes): its per-edge deltas cannot be summed, so "auto" never groups."""
        return self.bytes_per_param < 2

    @property
    def buckets(self) -> int:
        """All-reduce buckets: ``ceil(B / bucket_bytes)`` (at least 1)."""
        return max(1, math.ceil(self.bytes_per_rank / self.bucket_bytes))

    @property
    def overlap_fraction(self) -> float:
        """Fraction of compute a gossip exchange overlaps: 1 (AWC) or ``forward_fraction`` (ATC)."""
        return 1.0 if self.mode == "awc" else self.compute.forward_fraction

    def with_(self, **changes) -> "Workload":
        """A copy with ``changes`` applied."""
        return dataclasses.replace(self, **changes)
