"""The 8-bit wire's codec ops (decent_comm.ops.int8_encode_ / int8_dequantize_add_) against the independent numpy
float32 model of tests/int8_reference.py, bit for bit, on every device present; a GPU's copies equal the CPU's bit
for bit (a CPU rank and a GPU rank may share an edge); misuse refused by name."""

import numpy as np
import pytest
import torch

from decent_comm import ops

from int8_reference import roundtrip32
from op_inputs import DEVICES, DTYPES

CUDA = torch.cuda.is_available()


def _case(n, seed, x_dtype=torch.float32, device="cpu"):
    """x of blocks of very different scales (1e-6..1e2), some all-zero, and a non-zero copy."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g, dtype=torch.float64) * torch.logspace(-6, 2, n, dtype=torch.float64).roll(n // 3)
    if n > 1024:
        x[512:1024] = 0
    copy = torch.randn(n, generator=g) * (seed % 2)
    if n > 1024:
        copy[512:1024] = 0  # an all-zero delta block: scale 0, levels 0, the copy unchanged
    return x.to(x_dtype).to(device), copy.to(device)


def _levels_scales(payload, block):
    levels, scales = ops.int8_payload_views(payload, block)
    return levels.reshape(-1), scales


def _model(x, copy, block):
    """What encode must produce: the numpy quantization of x - copy (torch.sub into float32: a float64 x subtracted
    in float64, a 16-bit x converted exactly), the copy after the add."""
    d = torch.zeros(x.numel())
    torch.sub(x.cpu(), copy.cpu(), out=d)
    deq, q, scale = roundtrip32(d.numpy(), block)
    return copy.cpu().numpy() + deq, q, scale


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("n", [1, 7, 511, 512, 513, 3000, 100_003])
def test_encode_matches_the_numpy_model_bit_for_bit(device, x_dtype, n):
    if x_dtype not in DTYPES[device]:
        pytest.skip("float64 has no CUDA kernel")
    for seed in range(3):
        x, copy = _case(n, seed, x_dtype, device)
        want_copy, want_q, want_scale = _model(x, copy, 512)
        payload = torch.full((ops.int8_payload_nbytes(n),), 77, dtype=torch.uint8, device=device)
        ops.int8_encode_(x, copy, payload)
        q, scale = _levels_scales(payload.cpu(), 512)
        assert np.array_equal(q[:n].numpy(), want_q), (seed, np.nonzero(q[:n].numpy() != want_q)[0][:5])
        assert (q[n:] == 0).all(), "the padding of the last block must be 0"
        assert np.array_equal(scale.numpy(), want_scale)
        assert np.array_equal(copy.cpu().numpy(), want_copy)
        # the receiver's side: from the same starting copy, the same bits
        receiver = _case(n, seed, x_dtype, device)[1]
        ops.int8_dequantize_add_(receiver, payload)
        assert torch.equal(receiver, copy)


@pytest.mark.parametrize("device", DEVICES)
def test_rounding_ties_go_to_even(device):
    # absmax 127 makes the factor 1: every x.5 is a tie, 14.5 -> 14 and 15.5 -> 16 (not away from zero)
    x = torch.tensor([127.0, 14.5, 15.5, -14.5, -15.5, 0.5, 1.5, 2.5, -0.5, -1.5] * 3, device=device)
    copy = torch.zeros_like(x)
    payload = torch.empty(ops.int8_payload_nbytes(x.numel()), dtype=torch.uint8, device=device)
    ops.int8_encode_(x, copy, payload)
    q, scale = _levels_scales(payload.cpu(), 512)
    assert q[:10].tolist() == [127, 14, 16, -14, -16, 0, 2, 2, 0, -2]
    assert scale.tolist() == [1.0]


@pytest.mark.parametrize("device", DEVICES)
def test_a_level_rounds_the_product_with_the_float32_inverse(device):
    """The formula ops.int8_encode_ and docs/api_lowlevel.md state: round(fl(d * fl(127 / absmax))), not round(d * 127 /
    absmax). -30 of [-10, -30, -60, -43] is exactly -63.5, a tie to -64; -30 * fl(127 / 60) is -63.499996: -63."""
    x = torch.tensor([-10.0, -30.0, -60.0, -43.0], device=device)
    payload = torch.empty(ops.int8_payload_nbytes(4, 4), dtype=torch.uint8, device=device)
    ops.int8_encode_(x, torch.zeros_like(x), payload, 4)
    q, _ = _levels_scales(payload.cpu(), 4)
    inverse = np.float32(127) / np.float32(60)
    assert np.float32(-30) * inverse == np.float32(-63.499996) and -30 * 127 / 60 == -63.5
    assert q.tolist() == [-21, -63, -127, -91]
    assert q.tolist() == np.rint(np.float32([-10, -30, -60, -43]) * inverse).tolist()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block", [4, 64, 2048, 8192])
def test_other_block_sizes(device, block):
    n = 3 * block + 5
    x, copy = _case(n, 1, device=device)
    want_copy, want_q, want_scale = _model(x, copy, block)
    payload = torch.empty(ops.int8_payload_nbytes(n, block), dtype=torch.uint8, device=device)
    ops.int8_encode_(x, copy, payload, block)
    q, scale = _levels_scales(payload.cpu(), block)
    assert np.array_equal(q[:n].numpy(), want_q) and np.array_equal(scale.numpy(), want_scale)
    assert np.array_equal(copy.cpu().numpy(), want_copy)


@pytest.mark.parametrize("device", DEVICES)
def test_a_non_finite_value_poisons_its_block_only(device):
    n = 2048
    for bad in [float("nan"), float("inf"), -float("inf")]:
        x = torch.randn(n, generator=torch.Generator().manual_seed(0)).to(device)
        x[700] = bad
        copy = torch.zeros(n, device=device)
        payload = torch.empty(ops.int8_payload_nbytes(n), dtype=torch.uint8, device=device)
        ops.int8_encode_(x, copy, payload)
        _, scale = _levels_scales(payload.cpu(), 512)
        assert not torch.isfinite(scale[1]) and torch.isfinite(scale[[0, 2, 3]]).all()
        assert copy[512:1024].isnan().all(), "the block of the bad value must be NaN on both ends"
        clean = x.clone()
        clean[512:1024] = 0
        want_copy, _, _ = _model(clean, torch.zeros(n, device=device), 512)
        keep = torch.ones(n, dtype=torch.bool)
        keep[512:1024] = False
        assert np.array_equal(copy.cpu()[keep].numpy(), want_copy[keep.numpy()])


FLT_MAX = np.finfo(np.float32).max
#: the smallest float32 absmax whose 127 / absmax is finite (127 / FLT_MAX, rounded)
LOWEST = np.float32(3.7321948e-37)


def _encode_block(d, device):
    """The copy (float64) and levels of one block of d encoded from a zero copy."""
    x = torch.from_numpy(np.asarray(d, np.float32)).to(device)
    copy = torch.zeros_like(x)
    payload = torch.empty(ops.int8_payload_nbytes(x.numel()), dtype=torch.uint8, device=device)
    ops.int8_encode_(x, copy, payload)
    return copy.cpu().numpy().astype(np.float64), _levels_scales(payload.cpu(), 512)[0][:x.numel()].numpy()


@pytest.mark.parametrize("device", DEVICES)
def test_the_error_bound_holds_from_127_over_flt_max_to_below_flt_max(device):
    """The documented contract (ops.int8_encode_, docs/api_lowlevel.md): |copy - x| <= absmax / 254 (to the float32 roundings)
    for a block whose absmax is in [127 / FLT_MAX, FLT_MAX); below it every nonzero element goes to +-127 (error up
    to absmax, < 3.74e-37); at FLT_MAX the copies of its +-FLT_MAX elements are +-inf."""
    with np.errstate(over="ignore"):
        assert np.isfinite(np.float32(127) / LOWEST)
        assert not np.isfinite(np.float32(127) / np.nextafter(LOWEST, np.float32(0)))
    rng = np.random.default_rng(0)
    below_max = np.nextafter(FLT_MAX, np.float32(0))
    for absmax in [LOWEST, np.float32(1e-36), np.float32(1.0), below_max] + \
            list(np.float32(10.0 ** rng.uniform(-36.4, 38.5, 40))):
        a = np.float64(absmax)
        d = rng.uniform(-a, a, 512)
        d[:64] = (rng.integers(-126, 126, 64) + 0.5) * (a / 127)  # half-way between levels: the largest error
        d[64], d[65] = a, -a
        d = np.clip(d.astype(np.float32), -absmax, absmax)
        copy, _ = _encode_block(d, device)
        assert np.isfinite(copy).all(), absmax
        assert np.abs(copy - d).max() <= a / 254 * (1 + 1e-4), absmax
    for d in [rng.standard_normal(512) * 1e-40, [1e-37, 0.5e-37, 1e-39, -0.75e-37, 0.0],  # subnormal; normal, below
              [np.nextafter(LOWEST, np.float32(0)), -1e-38, 0.0]]:
        d = np.asarray(d, np.float32)
        copy, levels = _encode_block(d, device)
        assert np.array_equal(levels, np.sign(d) * 127)
        assert np.abs(copy - d).max() < np.abs(d).max() <= 3.74e-37
    copy, _ = _encode_block([FLT_MAX, -FLT_MAX, 1.0, 0.5], device)
    assert copy[:2].tolist() == [np.inf, -np.inf] and copy[2:].tolist() == [0.0, 0.0]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("threads", [1, 2])
def test_non_finite_blocks_anywhere_in_a_thread_range(device, x_dtype, threads):
    # Each block's scale and levels come from its own values only, wherever it lies in a thread's range of blocks
    # and whatever its neighbours hold: bad blocks first, in a row, alternating, the last whole block before a short
    # one, and the short last block itself, split over 1-2 threads (the CPU's fast path for finite blocks and its
    # clamping path for the others).
    if x_dtype not in DTYPES[device]:
        pytest.skip("float64 has no CUDA kernel")
    block, nblocks = 64, 41
    n = (nblocks - 1) * block + 9
    bad_blocks = [0, 5, 6, 7, 10, 12, 14, 39, 40]
    x, copy = _case(n, 5, x_dtype, device)
    for i, b in enumerate(bad_blocks):
        x[b * block + (i * 7) % 9] = [float("nan"), float("inf"), -float("inf")][i % 3]
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        got = copy.clone()
        payload = torch.empty(ops.int8_payload_nbytes(n, block), dtype=torch.uint8, device=device)
        ops.int8_encode_(x, got, payload, block)
    finally:
        torch.set_num_threads(before)
    bad = torch.zeros(n, dtype=torch.bool)
    for b in bad_blocks:
        bad[b * block:(b + 1) * block] = True
    clean = x.clone()
    clean[bad.to(device)] = 0
    want_copy, want_q, want_scale = _model(clean, copy, block)
    q, scale = _levels_scales(payload.cpu(), block)
    good_blocks = [b for b in range(nblocks) if b not in bad_blocks]
    assert np.array_equal(scale[good_blocks].numpy(), want_scale[good_blocks])
    assert not torch.isfinite(scale[bad_blocks]).any()
    assert np.array_equal(q[:n][~bad].numpy(), want_q[~bad.numpy()])
    assert np.array_equal(got.cpu()[~bad].numpy(), want_copy[~bad.numpy()])
    assert got.cpu()[bad].isnan().all(), "a bad value's block is NaN on both ends"
    assert (q[n:] == 0).all(), "the padding of the last block must be 0"


def test_threads_give_the_same_bits():
    n = 1_000_003
    x, copy = _case(n, 3)
    outs = []
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            c = copy.clone()
            payload = torch.empty(ops.int8_payload_nbytes(n), dtype=torch.uint8)
            ops.int8_encode_(x, c, payload)
            r = copy.clone()
            ops.int8_dequantize_add_(r, payload)
            outs.append((c, payload, r))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, b) for a, b in zip(*outs))


@pytest.mark.skipif(not CUDA, reason="needs a GPU")
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_cuda_copies_equal_the_cpu_copies(x_dtype):
    """A GPU sender and a CPU receiver (or the other way) keep identical copies over rounds of error feedback."""
    n = 1_000_003
    x, copy = _case(n, 5, x_dtype)
    cpu_copy, gpu_copy = copy.clone(), copy.cuda()
    gpu_x = x.cuda()
    for _ in range(3):
        p_cpu = torch.empty(ops.int8_payload_nbytes(n), dtype=torch.uint8)
        p_gpu = torch.empty(ops.int8_payload_nbytes(n), dtype=torch.uint8, device="cuda")
        ops.int8_encode_(x, cpu_copy, p_cpu)
        ops.int8_encode_(gpu_x, gpu_copy, p_gpu)
        assert torch.equal(p_gpu.cpu(), p_cpu)
        assert torch.equal(gpu_copy.cpu(), cpu_copy)
        x = x + torch.randn(n, generator=torch.Generator().manual_seed(_)).to(x_dtype) * 1e-3
        gpu_x = x.cuda()


def _operands(n=1000, device="cpu"):
    return (torch.randn(n, device=device), torch.zeros(n, device=device),
            torch.empty(ops.int8_payload_nbytes(n), dtype=torch.uint8, device=device))


@pytest.mark.parametrize("mutate, match", [
    (lambda x, c, p: (x, c, p[:-4]), "payload has 1028 bytes but 1000 elements in blocks of 512 need 1032"),
    (lambda x, c, p: (x, c.double(), p), "copy must be float32"),
    (lambda x, c, p: (x, c, p.view(torch.int8)), "payload must be uint8"),
    (lambda x, c, p: (x.int(), c, p), "x has unsupported dtype"),
    (lambda x, c, p: (x[:999], c, p), "x has 999 elements but copy has 1000"),
    (lambda x, c, p: (x.view(10, 100), c, p), "x must be a 1-D flat buffer"),
    (lambda x, c, p: (torch.randn(2000)[::2], c, p), "x must be contiguous"),
    (lambda x, c, p: (x, c, torch.empty(ops.int8_payload_nbytes(1000) + 1, dtype=torch.uint8)[1:]),
     "payload must start 4-byte aligned"),
    (lambda x, c, p: (c, c, p), "copy and x share memory"),
    (lambda x, c, p: (x, c, c.view(torch.uint8)[:ops.int8_payload_nbytes(1000)]), "copy and payload share memory"),
])
def test_misuse_is_refused_by_name_and_writes_nothing(mutate, match):
    x, c, p = mutate(*_operands())
    before = (c.clone(), p.clone())
    with pytest.raises(RuntimeError, match=match):
        ops.int8_encode_(x, c, p)
    assert torch.equal(c, before[0]) and torch.equal(p, before[1])


def test_bad_block_and_autograd_are_refused():
    x, c, p = _operands()
    for block in (0, 3, 6, 16384):
        with pytest.raises(RuntimeError, match="block must be a multiple of 4"):
            ops.int8_encode_(x, c, p, block)
    with pytest.raises(ValueError, match="block must be an integer"):
        ops.int8_dequantize_add_(c, p, 512.0)
    with pytest.raises(RuntimeError, match="x requires grad while autograd is recording"):
        ops.int8_encode_(x.requires_grad_(), c, p)
    with torch.no_grad():
        ops.int8_encode_(x, c, p)  # as an optimizer calls it
    version = c._version
    ops.int8_dequantize_add_(c, p)
    assert c._version > version, "a written tensor's version counter must move (autograd detects stale saves)"


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    x, c, p = _operands(1500, device)
    torch.library.opcheck(torch.ops.decent_comm.int8_encode_.default, (x, c, p, 512))
    torch.library.opcheck(torch.ops.decent_comm.int8_dequantize_add_.default, (c, p, 512))


def test_payload_views_know_the_layout():
    n, block = 1000, 64
    x, c, p = torch.randn(n), torch.zeros(n), torch.empty(ops.int8_payload_nbytes(n, block), dtype=torch.uint8)
    ops.int8_encode_(x, c, p, block)
    levels, scales = ops.int8_payload_views(p, block)
    assert levels.shape == (16, block) and scales.shape == (16,)
    assert levels.data_ptr() == p.data_ptr() and scales.data_ptr() == p.data_ptr() + 16 * block  # views, no copy
    assert torch.equal(levels.reshape(-1)[:n].float() * scales.repeat_interleave(block)[:n], c)  # the copy from 0
    for bad in (p[:-1], p.view(torch.int8)):
        with pytest.raises(ValueError, match="not an int8_encode_ payload"):
            ops.int8_payload_views(bad, block)
