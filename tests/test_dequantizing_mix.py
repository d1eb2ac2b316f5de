"""The 8-bit wire dequantized inside the fused ops (``copies=``/``payloads=`` of decent_comm.ops): every op, dtype,
neighbour count, payload offset and block size gives, bit for bit, what the two-pass path gives (int8_dequantize_add_
on each copy, then the op with the copies as its first neighbours), and the mixed values match a float64 reference
built on the numpy model of the codec; a slice of a bucket (payload_offset) is the same as the whole; found_inf still
advances the copies; misuse is refused by name with nothing written."""

import numpy as np
import pytest
import torch

from decent_comm import ops

from int8_reference import roundtrip32
from op_inputs import DEVICES, DTYPES

CUDA = torch.cuda.is_available()


def _payload(total, seed, block=512, device="cpu"):
    """A payload of `total` elements whose blocks have very different scales (one all-zero)."""
    g = torch.Generator().manual_seed(seed)
    d = torch.randn(total, generator=g) * torch.logspace(-4, 1, total).roll(seed * 97)
    if total > 3 * block:
        d[block:2 * block] = 0
    p = torch.empty(ops.int8_payload_nbytes(total, block), dtype=torch.uint8)
    ops.int8_encode_(d, torch.zeros(total), p, block)
    return p.to(device), d


def _operands(n, copies, neighbors, x_dtype=torch.float32, offset=0, block=512, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    total = offset + n + 5  # the payloads cover more than this slice
    pays = [_payload(total, seed + 10 * j, block, device)[0] for j in range(copies)]
    return dict(
        x=torch.randn(n, generator=g).to(x_dtype).to(device),
        grad=torch.randn(n, generator=g).to(x_dtype).to(device),
        state=[torch.rand(n, generator=g).to(device) for _ in range(3)],
        copies=[torch.randn(n, generator=g).to(device) for _ in range(copies)],
        neighbors=[torch.randn(n, generator=g).to(device) for _ in range(neighbors)],
        weights=[float(w) for w in torch.rand(copies + neighbors, generator=g) - 0.3],
        payloads=pays, offset=offset, block=block)


def _clone(o):
    return {k: ([t.clone() for t in v] if isinstance(v, list) and v and isinstance(v[0], torch.Tensor)
                else v.clone() if isinstance(v, torch.Tensor) else v) for k, v in o.items()}


def _call(kind, o, fused, disagreement=None, **amp):
    """One op call: fused (copies= / payloads=) or the two-pass path (decode each copy, then mix)."""
    x, st, nbs = o["x"], o["state"], o["neighbors"]
    if fused:
        kw = dict(copies=o["copies"], payloads=o["payloads"], payload_offset=o["offset"], payload_block=o["block"])
    else:
        for c, p in zip(o["copies"], o["payloads"]):
            full = torch.zeros(ops.int8_payload_views(p, o["block"])[0].numel(), device=c.device)  # its elements
            full[o["offset"]:o["offset"] + c.numel()] = c
            ops.int8_dequantize_add_(full, p, o["block"])
            c.copy_(full[o["offset"]:o["offset"] + c.numel()])
        nbs, kw = o["copies"] + nbs, {}
    common = (x, nbs, 0.6, o["weights"])
    if kind == "mix":
        ops.gossip_mix_(*common, disagreement=disagreement, **kw)
    elif kind == "sgd":
        ops.mix_sgd_(*common, o["grad"], st[0], 0.01, 0.9, 0.1, 0.01, disagreement=disagreement, **amp, **kw)
    elif kind == "sgd_plain":  # no momentum: an update kind of its own in the kernels
        ops.mix_sgd_(*common, o["grad"], None, 0.01, 0.0, 0.0, 0.01, disagreement=disagreement, **amp, **kw)
    elif kind == "adamw":
        ops.mix_adam_(*common, o["grad"], st[0], st[1], None if amp else 3, 1e-3, weight_decay=0.1, decoupled=True,
                      disagreement=disagreement, **amp, **kw)
    else:
        ops.mix_accum_adam_(*common, o["grad"], st[0], st[1], st[2], None if amp else 4, 2, 1e-3,
                            disagreement=disagreement, **amp, **kw)


def _assert_same(a, b):
    assert torch.equal(a["x"], b["x"])
    for name in ("state", "copies"):
        for i, (u, v) in enumerate(zip(a[name], b[name])):
            assert torch.equal(u, v), (name, i, (u - v).abs().max().item())


def _scalars(scalars, device):
    """The AMP scalars and device step count of a call: none (the host's hyper-parameters), or all of them (on a GPU
    the update then reads what a one-thread kernel resolved)."""
    if scalars == "host":
        return {}
    return dict(grad_scale=torch.full((1,), 8.0, device=device), found_inf=torch.zeros(1, device=device),
                state_step=torch.full((1,), 2.0, device=device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind,scalars", [("mix", "host")] + [(kind, scalars) for kind in ["sgd", "sgd_plain", "adamw",
                                                                  "accum"] for scalars in ["host", "device"]])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("copies,neighbors", [(1, 0), (1, 1), (2, 1), (3, 1), (5, 1)])
def test_fused_equals_decode_then_mix(device, kind, scalars, x_dtype, copies, neighbors):
    if x_dtype not in DTYPES[device]:
        pytest.skip("float64 has no CUDA kernel")
    for n, offset in [(1, 0), (513, 0), (3000, 700), (100_003, 4096 + 3)]:
        o = _operands(n, copies, neighbors, x_dtype, offset, seed=n, device=device)
        fused, two_pass = _clone(o), _clone(o)
        d_fused = torch.zeros(1, device=device)
        d_two = torch.zeros(1, device=device)
        _call(kind, fused, True, d_fused, **_scalars(scalars, device))
        _call(kind, two_pass, False, d_two, **_scalars(scalars, device))
        _assert_same(fused, two_pass)
        # the disagreement is summed span by span inside the fused loop: same terms, another association
        assert torch.allclose(d_fused, d_two, rtol=1e-5, atol=0), (d_fused, d_two)


@pytest.mark.parametrize("block", [4, 64, 2048, 8192])
@pytest.mark.parametrize("threads", [1, 2])
def test_blocks_offsets_and_threads(block, threads):
    """Codec blocks that straddle the loops' spans and the thread pool's chunks (numel > the 32K grain)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for offset in (0, 1, block - 1, 3 * block + 5):
            o = _operands(70_001, 2, 1, offset=offset, block=block, seed=offset)
            fused, two_pass = _clone(o), _clone(o)
            _call("adamw", fused, True)
            _call("adamw", two_pass, False)
            _assert_same(fused, two_pass)
    finally:
        torch.set_num_threads(before)


def test_mix_matches_a_float64_reference():
    """Independent of the decode op: the copies advance by the numpy codec model, and the mix is float64 math."""
    n, block, offset = 20_000, 512, 300
    o = _operands(n, 2, 1, offset=offset, block=block, seed=7)
    want_copies = []
    for j, c in enumerate(o["copies"]):
        d = _payload(offset + n + 5, 7 + 10 * j, block)[1]  # the deltas the payload was encoded from (_operands)
        deq = roundtrip32(d.numpy(), block)[0][offset:offset + n]
        want_copies.append((c.numpy() + deq).astype(np.float32))  # one float32 add
    x64 = o["x"].double().numpy()
    mixed = 0.6 * x64 + sum(w * y.astype(np.float64) for w, y in zip(o["weights"],
                                                                     want_copies + [o["neighbors"][0].numpy()]))
    _call("mix", o, True)
    for got, want in zip(o["copies"], want_copies):
        assert np.array_equal(got.numpy(), want)
    assert np.allclose(o["x"].double().numpy(), mixed, rtol=1e-6, atol=1e-6)


def test_slices_of_a_bucket_equal_the_whole():
    """The optimizers call the op per segment of a bucket, each with its payload_offset."""
    o = _operands(50_000, 2, 1, seed=3)
    whole, parts = _clone(o), _clone(o)
    _call("adamw", whole, True)
    for sl in (slice(0, 12_345), slice(12_345, 40_000), slice(40_000, 50_000)):
        ops.mix_adam_(parts["x"][sl], [y[sl] for y in parts["neighbors"]], 0.6, parts["weights"], parts["grad"][sl],
                      parts["state"][0][sl], parts["state"][1][sl], 3, 1e-3, weight_decay=0.1, decoupled=True,
                      copies=[c[sl] for c in parts["copies"]], payloads=parts["payloads"], payload_offset=sl.start)
    _assert_same(whole, parts)


@pytest.mark.parametrize("device", DEVICES)
def test_a_skipped_update_still_advances_the_copies(device):
    """found_inf skips the update, never the gossip: the copies must move as the sender's did."""
    o = _operands(5000, 2, 1, device=device)
    fused, two_pass = _clone(o), _clone(o)
    amp = lambda: dict(found_inf=torch.ones(1, device=device), state_step=torch.zeros(1, device=device))  # noqa: E731
    _call("adamw", fused, True, **amp())
    _call("adamw", two_pass, False, **amp())
    _assert_same(fused, two_pass)
    assert torch.equal(fused["state"][0], o["state"][0]), "a skipped update leaves the state alone"
    assert not torch.equal(fused["copies"][0], o["copies"][0])


def _misuse_cases():
    def with_(**changes):
        def make():
            o = _operands(1000, 2, 1)
            o.update({k: (v(o) if callable(v) else v) for k, v in changes.items()})
            return o
        return make
    short = torch.empty(ops.int8_payload_nbytes(500), dtype=torch.uint8)
    return {
        "one payload": (with_(payloads=lambda o: o["payloads"][:1]), "got 2 copies but 1 payloads"),
        "int8 payload": (with_(payloads=lambda o: [p.view(torch.int8) for p in o["payloads"]]), "must be uint8"),
        "ragged": (with_(payloads=lambda o: [o["payloads"][0][:-1], o["payloads"][1]]), "no whole number of blocks"),
        "short": (with_(payloads=lambda o: [short, o["payloads"][1]]), "fewer than payload_offset \\+ len\\(x\\)"),
        "offset past": (with_(offset=25), "fewer than payload_offset"),  # 1025 > the 1024 of 1005
        "negative offset": (with_(offset=-1), "payload_offset must be >= 0"),
        "2^31": (with_(offset=2 ** 31 - 50), "is 2\\^31 or more"),  # the CUDA kernels index payloads in 32 bits
        "block": (with_(block=502), "payload_block must be a multiple of 4"),
        "misaligned": (with_(payloads=lambda o: [torch.empty(o["payloads"][0].numel() + 1, dtype=torch.uint8)[1:],
                                                 o["payloads"][1]]), "must start 4-byte aligned"),
        "double copy": (with_(copies=lambda o: [o["copies"][0].double(), o["copies"][1]]), "copies\\[0\\] has dtype"),
        "bf16 neighbor": (with_(neighbors=lambda o: [o["neighbors"][0].bfloat16()]),
                          "every neighbor must be float32 too"),
        "copy is x": (with_(copies=lambda o: [o["x"], o["copies"][1]]), "share memory"),
        "payload in a copy": (with_(payloads=lambda o: [o["copies"][1].view(torch.uint8)[:1032], o["payloads"][1]]),
                              "payloads\\[0\\] shares memory with copies\\[1\\]"),
        "weights": (with_(weights=[0.1, 0.2]), "2 copies and 1 neighbors but 2 weights"),
        "short copy": (with_(copies=lambda o: [o["copies"][0][:999], o["copies"][1]]),
                       "copies\\[0\\] has 999 elements"),
    }


@pytest.mark.parametrize("case", sorted(_misuse_cases()))
def test_misuse_is_refused_by_name_and_writes_nothing(case):
    make, match = _misuse_cases()[case]
    o = make()
    before = _clone(o)
    with pytest.raises(RuntimeError, match=match):
        _call("adamw", o, True)
    _assert_same(o, before)


def test_copies_and_payloads_go_together():
    o = _operands(100, 1, 1)
    with pytest.raises(ValueError, match="copies and payloads together"):
        ops.gossip_mix_(o["x"], o["neighbors"], 1.0, o["weights"], copies=o["copies"])
    with pytest.raises(ValueError, match="payload_offset must be an integer"):
        ops.gossip_mix_(o["x"], o["neighbors"], 1.0, o["weights"], copies=o["copies"], payloads=o["payloads"],
                        payload_offset=0.5)
    with pytest.raises(RuntimeError, match="copies\\[0\\] requires grad while autograd is recording"):
        ops.gossip_mix_(o["x"], o["neighbors"], 1.0, o["weights"], copies=[o["copies"][0].requires_grad_()],
                        payloads=o["payloads"])


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    o = _operands(1500, 2, 1, offset=100, device=device)
    torch.library.opcheck(torch.ops.decent_comm.gossip_mix_.default,
                          (o["x"], o["neighbors"], 0.5, o["weights"], None, o["copies"], o["payloads"], 100, 512))
    torch.library.opcheck(torch.ops.decent_comm.mix_adam_.default,
                          (o["x"], o["neighbors"], 0.5, o["weights"], o["grad"], o["state"][0], o["state"][1], 2, 1e-3,
                           0.9, 0.999, 1e-8, 0.0, True, None, None, None, None, o["copies"], o["payloads"], 100, 512))


@pytest.mark.skipif(not CUDA, reason="needs a GPU")
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("offset", [0, 3])  # 3: the kernel's one-element path
def test_cuda_copies_equal_the_cpu_copies(x_dtype, offset):
    """A GPU rank's copies after a fused mix equal a CPU rank's bit for bit (they may share an edge)."""
    o = _operands(1_000_003, 2, 1, x_dtype, offset=offset, seed=11)
    gpu = {k: ([t.cuda() for t in v] if isinstance(v, list) and v and isinstance(v[0], torch.Tensor)
               else v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in o.items()}
    _call("adamw", o, True)
    _call("adamw", gpu, True)
    for c_cpu, c_gpu in zip(o["copies"], gpu["copies"]):
        assert torch.equal(c_gpu.cpu(), c_cpu)
    # x: the CUDA kernels contract the mix into FMAs, so the last bits may differ from the CPU's
    assert torch.allclose(gpu["x"].cpu().float(), o["x"].float(), rtol=1e-5, atol=1e-6)
