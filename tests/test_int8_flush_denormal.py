"""The 8-bit wire's copies do not depend on the flush-to-zero / denormals-are-zero modes of the thread that runs the
codec (torch.set_flush_denormal(True) sets both): one rank flushing and its neighbour not parted their copies for good
(a copy of 2e-38 moved by level -2 times scale 1.2e-38 is -4e-39 in IEEE arithmetic, -0 flushed). Encode, decode and
the fused mix that decodes give the same bits with the modes on as off, and as the numpy model of the codec (run with
them off); the caller's modes are back on afterwards."""

import numpy as np
import pytest
import torch

from decent_comm import ops

from int8_reference import roundtrip32

BLOCK = 64


def _flushing(fn):
    """fn() with torch.set_flush_denormal(True) in this thread, the modes off again afterwards."""
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU has no flush-to-zero mode")
    try:
        return fn()
    finally:
        torch.set_flush_denormal(False)


def _tiny(n, seed):
    """x and a copy whose changes and copies are subnormal or just above (blocks of absmax 1e-45..1e-35: the
    +-127 path below 3.73e-37 and the regular one above, both with subnormal level * scale products)."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.logspace(-45, -35, n, dtype=torch.float64).roll(seed * 31)
    x = (torch.randn(n, generator=g, dtype=torch.float64) * scale).float()
    copy = (torch.randn(n, generator=g, dtype=torch.float64) * scale).float()
    x[:4], copy[:4] = torch.tensor([0.8e-38, 1.524e-36, 0.0, 0.0]), torch.tensor([2e-38, 0.0, 0.0, 0.0])
    return x, copy


def _encode(x, copy):
    c = copy.clone()
    payload = torch.zeros(ops.int8_payload_nbytes(x.numel(), BLOCK), dtype=torch.uint8)
    ops.int8_encode_(x, c, payload, BLOCK)
    return c, payload


def _bits(t):
    return t.view(torch.int32)


@pytest.mark.parametrize("n,threads", [(8, 1), (3000, 1), (200_003, 2)])
def test_encode_and_decode_ignore_flush_to_zero(n, threads):
    x, copy = _tiny(n, n)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        plain_copy, plain_payload = _encode(x, copy)
        flushed_copy, flushed_payload = _flushing(lambda: _encode(x, copy))
        receiver = _flushing(lambda: (lambda r: (ops.int8_dequantize_add_(r, plain_payload, BLOCK), r)[1])(
            copy.clone()))
    finally:
        torch.set_num_threads(before)
    deq, q, scale = roundtrip32((x - copy).numpy(), BLOCK)
    want = copy.numpy() + deq
    assert np.count_nonzero(want != 0) and np.count_nonzero((np.abs(want) < 1.1754944e-38) & (want != 0)), \
        "the case must hold subnormal copies"
    assert torch.equal(_bits(plain_copy), _bits(torch.from_numpy(want)))
    assert torch.equal(flushed_payload, plain_payload)
    assert torch.equal(_bits(flushed_copy), _bits(plain_copy)), "the sender's copy under flush-to-zero"
    assert torch.equal(_bits(receiver), _bits(plain_copy)), "a receiver's copy under flush-to-zero"


@pytest.mark.parametrize("neighbors", [1, 2])  # the single-pass loop (copies + own copy), the span loop
@pytest.mark.parametrize("tracked", [False, True])  # without and with a disagreement output (two pool loops)
def test_the_fused_mix_advances_the_copies_as_without_flush_to_zero(neighbors, tracked):
    n = 5000
    x, copy = _tiny(n, 3)
    _, payload = _encode(x, copy)

    def mix():
        c, y = copy.clone(), torch.ones(n)
        ops.gossip_mix_(y, [torch.zeros(n)] * neighbors, 0.5, [0.5 / (neighbors + 1)] * (neighbors + 1),
                        torch.zeros(1) if tracked else None, copies=[c], payloads=[payload], payload_block=BLOCK)
        return c

    sender, _ = _encode(x, copy)
    assert torch.equal(_bits(mix()), _bits(sender))
    assert torch.equal(_bits(_flushing(mix)), _bits(sender))


def test_the_callers_modes_are_back_afterwards():
    x, copy = _tiny(100, 1)
    sub = torch.full((16,), 1e-39)

    def encode_then_multiply():
        _encode(x, copy)
        return (sub * 1.0).tolist()

    assert _flushing(encode_then_multiply) == [0.0] * 16, "flush-to-zero must still be on after the op"
    assert (sub * 1.0).tolist() == sub.tolist()
