"""The 8-bit wire's bucket limit: the fused mix addresses a payload in 32 bits (csrc/op_call.cpp refuses
payload_offset + len(x) beyond ops.MAX_PAYLOAD_ELEMENTS = 2^31 - 1 on every device), so comm_dtype=torch.int8 is
refused at construction, on every rank and before any buffer is allocated, for a bucket of more elements. It was
refused at the first step, after the copies were allocated, with advice ("split the bucket") that a bucket of one
parameter cannot follow. Parameters on the meta device lay out buckets of 2^31 elements without the 8 GiB."""

import math

import pytest
import torch

import decent_comm
from decent_comm import ops

from dist_utils import run_ranks

LIMIT = 2 ** 31 - 1


def test_the_limit_is_the_kernels():
    """The constant is the mix's: a payload end of 2^31 - 1 passes the limit (and fails on the small payload's size
    instead), one more is refused as beyond it."""
    assert ops.MAX_PAYLOAD_ELEMENTS == LIMIT
    x, copy = torch.zeros(16), torch.zeros(16)
    payload = torch.zeros(ops.int8_payload_nbytes(16, 512), dtype=torch.uint8)
    with pytest.raises(RuntimeError, match=f"holds 512 elements, fewer than payload_offset \\+ len\\(x\\) = {LIMIT}"):
        ops.gossip_mix_(x, [], 0.5, [0.5], copies=[copy], payloads=[payload], payload_offset=LIMIT - 16)
    with pytest.raises(RuntimeError, match=f"payload_offset \\+ len\\(x\\) = {LIMIT - 15} \\+ 16 is 2\\^31 or more"):
        ops.gossip_mix_(x, [], 0.5, [0.5], copies=[copy], payloads=[payload], payload_offset=LIMIT - 15)


@pytest.mark.parametrize("op", ["gossip_mix_", "mix_sgd_"])
@pytest.mark.parametrize("offset", [2 ** 63 - 1, 2 ** 63 - 16, 2 ** 62])
def test_an_offset_near_int64s_end_is_refused_not_wrapped(op, offset):
    """payload_offset + len(x) wrapped to a negative number for an offset near 2^63, so both checks passed and the
    kernel read through a pointer far outside the payload (a segfault: review ED's AddressSanitizer run)."""
    x, copy = torch.zeros(16), torch.zeros(16)
    payload = torch.zeros(ops.int8_payload_nbytes(16, 512), dtype=torch.uint8)
    kwargs = dict(copies=[copy], payloads=[payload], payload_offset=offset)
    with pytest.raises(RuntimeError, match=f"payload_offset \\+ len\\(x\\) = {offset} \\+ 16 is 2\\^31 or more"):
        if op == "gossip_mix_":
            ops.gossip_mix_(x, [], 0.5, [0.5], **kwargs)
        else:
            ops.mix_sgd_(x, [], 0.5, [0.5], torch.zeros(16), torch.zeros(16), 0.1, **kwargs)
    assert torch.equal(x, torch.zeros(16)) and torch.equal(copy, torch.zeros(16))


def _meta(*numels, dtype=torch.float32):
    return [torch.nn.Parameter(torch.empty(n, dtype=dtype, device="meta")) for n in numels]


def _in_bucket(numel: int, dtype) -> int:
    """A parameter's extent in its bucket, from the layout's rule (each starts on a 16-byte boundary)."""
    size = torch.empty((), dtype=dtype).element_size()
    return math.ceil(numel * size / 16) * 16 // size


@pytest.mark.parametrize("numel, dtype", [(2 ** 31, torch.float32), (2 ** 31 - 3, torch.float32),
                                          (2 ** 31 - 4, torch.float32), (2 ** 31 - 7, torch.bfloat16),
                                          (2 ** 31 - 8, torch.bfloat16), (2 ** 32, torch.bfloat16)])
def test_a_parameter_beyond_the_limit_is_refused_naming_it(numel, dtype):
    refused = _in_bucket(numel, dtype) > LIMIT
    try:
        decent_comm.DAdamW(_meta(numel, dtype=dtype), comm_dtype=torch.int8)
        assert not refused, numel
    except ValueError as e:
        assert refused, (numel, str(e))
        msg = str(e)
        assert f"a parameter of shape ({numel},) ({dtype}) in param group 0 has {numel} elements" in msg
        assert f"takes buckets of at most {LIMIT} elements" in msg
        assert "cannot use the 8-bit wire; use another comm_dtype" in msg
    decent_comm.DAdamW(_meta(numel, dtype=dtype), comm_dtype=torch.bfloat16)  # the 8-bit wire's limit alone


def test_a_bucket_beyond_the_limit_is_refused_with_a_bucket_cap_that_fits():
    params = _meta(2 ** 30, 2 ** 30, 2 ** 20)
    with pytest.raises(ValueError, match=f"bucket 0 \\(param group 0, 2 parameters of torch.float32\\) holds "
                                         f"{2 ** 31} elements, but the 8-bit wire .* at most {LIMIT} elements .*: "
                                         "use a bucket_cap_mb below 8192, or another comm_dtype"):
        decent_comm.DAdamW(params, comm_dtype=torch.int8, bucket_cap_mb=8192)
    opt = decent_comm.DAdamW(params, comm_dtype=torch.int8, bucket_cap_mb=8191.99)  # as advised
    assert [b.numel for b in opt._buckets] == [2 ** 30, 2 ** 30 + 2 ** 20]


def test_refused_before_anything_is_allocated(monkeypatch):
    """With the limit lowered: a parameter keeps its own storage (the layout would have moved it into a bucket)."""
    monkeypatch.setattr(ops, "MAX_PAYLOAD_ELEMENTS", 1000)
    small, large = torch.nn.Parameter(torch.randn(1000)), torch.nn.Parameter(torch.randn(1001))
    before = large.data_ptr()
    with pytest.raises(ValueError, match=r"shape \(1001,\) \(torch.float32\) in param group 1 has 1001 elements "
                                         r"\(1004 aligned in its bucket\), but .* at most 1000 elements"):
        decent_comm.DSGD([{"params": [small]}, {"params": [large]}], lr=0.1, comm_dtype=torch.int8)
    assert large.data_ptr() == before
    opt = decent_comm.DSGD([small], lr=0.1, comm_dtype=torch.int8)  # exactly the limit
    small.grad = torch.ones(1000)
    opt.step()


def _build(rank, world_size, numel):
    try:
        decent_comm.DAdamW(_meta(numel), topology="ring", comm_dtype=torch.int8, timeout=30)
        return "built"
    except ValueError as e:
        return str(e)


def test_every_rank_refuses_at_construction():
    for r, msg in enumerate(run_ranks(_build, 3, 2 ** 31, timeout=120)):
        assert f"has {2 ** 31} elements, but the 8-bit wire" in msg, (r, msg)
