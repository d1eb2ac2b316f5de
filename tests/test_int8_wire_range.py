"""The 8-bit wire's float32 range: a change x - copy beyond it (a float64 parameter of 1e39, a float32 one of
2.5e38 against a copy near -1e38) makes the whole codec block's copies NaN, on the sender and its receivers; with
check_finite=True the sender's error names the wire's range, the bucket, the block and the step, instead of saying
its parameters became non-finite at the next optimizer step (the NaN the mix then made of them), and its receivers
name it as the sender of non-finite values."""

import numpy as np
import pytest
import torch

import decent_comm
from decent_comm import ops

from dist_utils import run_ranks

FLT_MAX = float(np.finfo(np.float32).max)


@pytest.mark.parametrize("x_dtype,x,copy", [
    (torch.float64, 1e39, 0.0),        # a float64 parameter beyond FLT_MAX, from a zero copy
    (torch.float64, 1e39, FLT_MAX),    # whatever the copy
    (torch.float32, 3e38, -3e38),      # a float32 change of 6e38
    (torch.bfloat16, 3e38, -3e38),
])
def test_a_change_beyond_float32_makes_its_whole_block_nan(x_dtype, x, copy):
    n, block = 1500, 512
    xs = torch.randn(n, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    copies = torch.zeros(n)
    xs[700], copies[700] = x, copy
    xs = xs.to(x_dtype)
    payload = torch.empty(ops.int8_payload_nbytes(n, block), dtype=torch.uint8)
    ops.int8_encode_(xs, copies, payload, block)
    levels, scales = ops.int8_payload_views(payload, block)
    assert scales[1].item() == float("inf") and torch.isfinite(scales[[0, 2]]).all()
    assert (levels[1] == 0).all()
    assert copies[512:1024].isnan().all(), "the whole block, not only the element, is NaN"
    assert torch.isfinite(copies[:512]).all() and torch.isfinite(copies[1024:]).all()


def _beyond_float32(rank, n, case):
    """3 ranks on a ring, check_finite, the 8-bit wire, no gradient (x moves by the mix only): rank 1 takes one weight
    out of the wire's float32 range, finite all along. float64: 1e39 after step 2, so the round launched after step
    3 encodes it. float32: -3e38 after step 1 (the mixes take the three ranks and their copies to -1e38 after step
    3), then 2.5e38 (which the mix of step 4 keeps finite), so the round after step 4 sends 2.5e38 - (-1e38)."""
    dtype = torch.float64 if case == "float64" else torch.float32
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4).to(dtype)
    opt = decent_comm.DSGD(model.parameters(), lr=0.1, topology="ring", check_finite=True, comm_dtype=torch.int8,
                           timeout=20, exchange="p2p")
    try:
        for t in range(6):
            for p in model.parameters():
                p.grad = torch.zeros_like(p)
            opt.step()
            with torch.no_grad():
                if rank == 1 and case == "float64" and t == 2:
                    model.weight[1, 2] = 1e39  # finite in float64; x - copy overflows float32 whatever the copy
                if rank == 1 and case == "float32" and t == 1:
                    model.weight[1, 2] = -3e38
                if rank == 1 and case == "float32" and t == 3:
                    model.weight[1, 2] = 2.5e38
        opt.synchronize()
    except RuntimeError as exc:
        return str(exc)
    finally:
        opt.shutdown()
    return "no error"


@pytest.mark.parametrize("case", ["float64", "float32"])
def test_check_finite_names_the_wires_float32_range_on_the_sender(case):
    res = run_ranks(_beyond_float32, 3, case, timeout=120)
    culprit, step = res[1], 3 if case == "float64" else 4
    assert f"rank 1: the change x - copy sent after optimizer step {step} exceeds the 8-bit wire's float32 range in " \
           "bucket 0 (param group 0), elements 0..35 (largest |x| " in culprit, culprit
    assert f"(largest |x| {1e39 if case == 'float64' else 2.5e38:g}, " in culprit, culprit
    assert ", element (1, 2) of a parameter of shape (4, 8))" in culprit, culprit
    assert "are not finite after optimizer step" not in culprit, culprit
    for r in (0, 2):
        assert "received non-finite values from rank 1 (check_finite=True)" in res[r], (r, res[r])
