"""Sums of squares and of scalars kept on the parameters' device: the step measurements and disagreement
meters add them up without a host sync."""

from typing import List, Optional

import torch


def sq_dist(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """||a - b||^2 as a float64 device scalar (accumulated in float32 for lower-precision storage)."""
    acc = torch.float64 if a.dtype == torch.float64 else torch.float32
    return torch.linalg.vector_norm(a - b, dtype=acc).double() ** 2


def sum_scalars(vals: List[torch.Tensor]) -> Optional[torch.Tensor]:
    """The sum of device scalars (moved to the first one's device: buckets may live on several), None for none."""
    if not vals:
        return None
    total = vals[0]
    for v in vals[1:]:
        total = total + v.to(total.device)
    return total
