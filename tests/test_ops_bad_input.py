"""Misuse of the fused ops: every bad argument raises, naming it, before anything is written."""

import re

import pytest
import torch

from decent_comm import ops

from op_inputs import DTYPES, flat, gen


def _ok_args(n=16):
    return torch.zeros(n), [torch.zeros(n)], 0.5, [0.5]


@pytest.mark.parametrize(
    "mutate,pattern",
    [
        (lambda a: a.update(ys=[torch.zeros(15)]), r"neighbors\[0\] has 15 elements but x has 16"),
        (lambda a: a.update(ws=[0.5, 0.1]), r"1 neighbors but 2 weights"),
        (lambda a: a.update(ys=[torch.zeros(16), torch.zeros(16, dtype=torch.bfloat16)], ws=[0.2, 0.3]),
         r"neighbors\[1\] has dtype BFloat16 but neighbors\[0\] has Float"),
        (lambda a: a.update(x=torch.zeros(32)[::2]), r"x must be contiguous"),
        (lambda a: a.update(ys=[torch.zeros(32)[::2]]), r"neighbors\[0\] must be contiguous"),
        (lambda a: a.update(x=torch.zeros(4, 4)), r"x must be a 1-D flat buffer"),
        (lambda a: a.update(x=torch.zeros(16, dtype=torch.int32)), r"x has unsupported dtype Int"),
        (lambda a: a.update(ys=[torch.zeros(16, device="meta")]), r"neighbors\[0\] is on meta but x is on cpu"),
        (lambda a: a.update(ys=[torch.zeros(16)] * 33, ws=[0.01] * 33), r"at most 32 are supported"),
        (lambda a: a.update(ws=[float("nan")]), r"weights\[0\] must be finite"),
    ],
)
def test_gossip_mix_bad_input_raises_and_writes_nothing(mutate, pattern):
    x, ys, sw, ws = _ok_args()
    a = dict(x=x, ys=ys, sw=sw, ws=ws)
    mutate(a)
    before = a["x"].clone()
    with pytest.raises(RuntimeError, match=pattern):
        ops.gossip_mix_(a["x"], a["ys"], a["sw"], a["ws"])
    assert torch.equal(a["x"], before)


def test_optimizer_ops_bad_input():
    x, ys, sw, ws = _ok_args()
    g = torch.zeros(16)
    st = [torch.zeros(16) for _ in range(3)]
    with pytest.raises(RuntimeError, match="grad has 8 elements"):
        ops.mix_sgd_(x, ys, sw, ws, torch.zeros(8), None, lr=0.1)
    with pytest.raises(RuntimeError, match="grad has dtype BFloat16 but x has Float"):
        ops.mix_sgd_(x, ys, sw, ws, g.bfloat16(), None, lr=0.1)
    with pytest.raises(RuntimeError, match="momentum_buffer is required"):
        ops.mix_sgd_(x, ys, sw, ws, g, None, lr=0.1, momentum=0.9)
    with pytest.raises(RuntimeError, match="momentum_buffer must be float32"):
        ops.mix_sgd_(x, ys, sw, ws, g, st[0].double(), lr=0.1, momentum=0.9)
    with pytest.raises(RuntimeError, match="nesterov momentum requires"):
        ops.mix_sgd_(x, ys, sw, ws, g, st[0], lr=0.1, momentum=0.0, nesterov=True)
    with pytest.raises(RuntimeError, match="exp_avg_sq must be float32"):
        ops.mix_adam_(x, ys, sw, ws, g, st[0], st[1].half(), 1, lr=0.1)
    with pytest.raises(RuntimeError, match="step is the 1-based count"):
        ops.mix_adam_(x, ys, sw, ws, g, st[0], st[1], 0, lr=0.1)
    with pytest.raises(RuntimeError, match="beta2 must be in"):
        ops.mix_adam_(x, ys, sw, ws, g, st[0], st[1], 1, lr=0.1, beta2=1.0)
    with pytest.raises(RuntimeError, match="accum has 15 elements"):
        ops.mix_accum_adam_(x, ys, sw, ws, g, st[0], st[1], torch.zeros(15), 1, 2, lr=0.1)
    with pytest.raises(RuntimeError, match="accum_steps must be >= 1"):
        ops.mix_accum_adam_(x, ys, sw, ws, g, *st, 1, 0, lr=0.1)
    with pytest.raises(RuntimeError, match="disagreement must be a 1-element float32"):
        ops.gossip_mix_(x, ys, sw, ws, disagreement=torch.zeros(2))
    assert torch.all(x == 0) and all(torch.all(s == 0) for s in st)


def test_shifted_or_shared_outputs_are_refused_and_nothing_is_written():
    # The kernels read element i of every operand before writing element i, so an operand may be x
    # itself, but a view shifted against a written buffer, or two outputs in one buffer, is refused.
    buf = torch.randn(40)
    x, shifted = buf[0:16], buf[1:17]
    g = torch.randn(16)
    m, v = torch.zeros(16), torch.zeros(16)
    before = buf.clone()
    with pytest.raises(RuntimeError, match=r"neighbors\[0\] partially overlaps x"):
        ops.gossip_mix_(x, [shifted], 0.5, [0.5])
    with pytest.raises(RuntimeError, match=r"grad partially overlaps x"):
        ops.mix_sgd_(x, [], 1.0, [], shifted, None, lr=0.1)
    with pytest.raises(RuntimeError, match=r"grad partially overlaps exp_avg"):
        ops.mix_adam_(g, [], 1.0, [], buf[20:36], buf[19:35], v, 1, lr=0.1)
    with pytest.raises(RuntimeError, match=r"x and exp_avg share memory"):
        ops.mix_adam_(x, [], 1.0, [], g, x, v, 1, lr=0.1)
    with pytest.raises(RuntimeError, match=r"exp_avg and exp_avg_sq share memory"):
        ops.mix_adam_(g.clone(), [], 1.0, [], g, m, m, 1, lr=0.1)
    with pytest.raises(RuntimeError, match=r"x and disagreement share memory"):
        ops.gossip_mix_(x, [g], 0.5, [0.5], disagreement=buf[3:4])
    with pytest.raises(RuntimeError, match=r"exp_avg_sq and accum share memory"):
        ops.mix_accum_adam_(g.clone(), [], 1.0, [], g, m, v, v, 1, 2, lr=0.1)
    assert torch.equal(buf, before) and torch.all(m == 0) and torch.all(v == 0)


# float64 storage is CPU-only: the CPU cases of a run against the emulated CUDA kernels (tests/cuda_emulation) skip it.
cpu_float64 = pytest.mark.skipif(torch.float64 not in DTYPES["cpu"], reason="float64 has no CUDA kernel (emulated)")


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.float64, marks=cpu_float64)])
@pytest.mark.parametrize("n", [7, 4099])
def test_x_may_be_its_own_neighbor_or_gradient(n, dtype):
    x = torch.randn(n, dtype=dtype)
    y = torch.randn(n, dtype=dtype)
    expected = 0.5 * x + 0.5 * y  # 0.2 x + 0.3 x + 0.5 y
    ops.gossip_mix_(x, [x, y], 0.2, [0.3, 0.5])
    torch.testing.assert_close(x, expected)
    expected = x * (1 - 0.1)
    ops.mix_sgd_(x, [], 1.0, [], x, None, lr=0.1)
    torch.testing.assert_close(x, expected)


@cpu_float64
def test_float64_is_rejected_on_cuda_meta_check():
    # float64 storage exists only on CPU; the check runs before any CUDA work, so it is testable anywhere
    # a CUDA device exists. On CPU float64 is accepted.
    x = torch.zeros(4, dtype=torch.float64)
    ops.gossip_mix_(x, [torch.ones(4, dtype=torch.float64)], 0.5, [0.5])
    assert torch.all(x == 0.5)
    if torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="unsupported dtype Double"):
            ops.gossip_mix_(x.cuda(), [], 1.0, [])


# ------------------------------------------------------------------- hyper-parameters, steps, AMP scalars

def operands(op, device="cpu", dtype=torch.float32, n=16):
    """Valid keyword arguments of one call of `op` ("mix", "sgd", "adam", "accum") on fresh random buffers."""
    g = gen(5)
    a = dict(x=flat(n, dtype, "cpu", gen=g), neighbors=[flat(n, dtype, "cpu", gen=g)], self_weight=0.5,
             weights=[0.5])
    state = [flat(n, torch.float32, "cpu", gen=g, scale=0.1) for _ in range(3)]
    state[1] = state[1].abs()
    if op != "mix":
        a.update(grad=flat(n, dtype, "cpu", gen=g), lr=0.01)
    if op == "sgd":
        a.update(momentum_buffer=state[0], momentum=0.9)
    elif op == "adam":
        a.update(exp_avg=state[0], exp_avg_sq=state[1], step=3)
    elif op == "accum":
        a.update(exp_avg=state[0], exp_avg_sq=state[1], accum=state[2], step=3, accum_steps=2)
    return {k: _to(v, device) for k, v in a.items()}


def _to(v, device):
    if isinstance(v, torch.Tensor):
        return v.to(device)
    return [_to(t, device) for t in v] if isinstance(v, list) else v


CALL = {"mix": ops.gossip_mix_, "sgd": ops.mix_sgd_, "adam": ops.mix_adam_, "accum": ops.mix_accum_adam_}


def _tensors(a):
    for v in a.values():
        yield from (v if isinstance(v, list) else [v])


def assert_refused(op, args, pattern, error=RuntimeError):
    """The call raises `error` matching `pattern`, and every tensor argument keeps its bits."""
    tensors = [t for t in _tensors(args) if isinstance(t, torch.Tensor) and t.layout == torch.strided]
    before = [t.detach().reshape(-1).clone() for t in tensors]
    with pytest.raises(error, match=pattern):
        CALL[op](**args)
    for t, b in zip(tensors, before):
        if not t.is_meta:
            assert torch.equal(t.detach().reshape(-1).view(torch.uint8), b.view(torch.uint8)), "a refused call wrote"


NAN, INF = float("nan"), float("inf")
OPTIMIZERS = ["sgd", "adam", "accum"]
HYPER = {"sgd": ["lr", "momentum", "dampening", "weight_decay"],
         "adam": ["lr", "beta1", "beta2", "eps", "weight_decay"],
         "accum": ["lr", "beta1", "beta2", "eps", "weight_decay"]}
# (op, overrides, pattern) refused alike by the CPU and the Meta (fake) kernel.
BAD_VALUES = (
    [(op, {name: v}, rf"{name} must be finite") for op in OPTIMIZERS for name in HYPER[op] for v in [NAN, INF, -INF]]
    + [(op, {"self_weight": NAN}, r"self_weight must be finite") for op in CALL]
    + [(op, {"weights": [INF]}, r"weights\[0\] must be finite") for op in CALL]
    + [(op, {"weights": [1e300]}, r"weights\[0\] = 1e\+300 overflows float32") for op in CALL]
    + [(op, {"self_weight": 3.5e38}, r"self_weight = 3.5e\+38 overflows float32") for op in CALL]
    + [(op, {"lr": -0.1}, r"lr must be >= 0") for op in OPTIMIZERS]
    + [(op, {"weight_decay": -0.1}, r"weight_decay must be >= 0") for op in OPTIMIZERS]
    + [("sgd", {"momentum": -0.5}, r"momentum must be >= 0")]
    + [(op, {"eps": -1e-8}, r"eps must be >= 0") for op in ["adam", "accum"]]
    + [(op, {b: v}, rf"{b} must be in \[0, 1\)") for op in ["adam", "accum"] for b in ["beta1", "beta2"]
       for v in [-0.1, 1.0, 1.5]]
    + [(op, {b: 1 - 1e-9}, rf"{b} = 0.999999999 rounds to 1 in float32") for op in ["adam", "accum"]
       for b in ["beta1", "beta2"]]
    + [(op, {"lr": 1e38, "beta1": 0.9}, r"lr / \(1 - beta1\) .* overflows float32") for op in ["adam", "accum"]]
    + [("adam", {"lr": 1e20, "weight_decay": 1e20, "decoupled": True}, r"lr \* weight_decay = .* overflows")]
    + [(op, {"step": s}, r"step is the 1-based count .* must be >= 1") for op in ["adam", "accum"] for s in [0, -5]]
    + [("accum", {"accum_steps": k}, r"accum_steps must be >= 1") for k in [0, -3]]
    + [(op, {"state_step": torch.zeros(2), "step": None}, r"state_step must be a 1-element float32, float64 or int64")
       for op in ["adam", "accum"]]
    + [("adam", {"state_step": torch.zeros(1, dtype=torch.int32), "step": None}, r"state_step must be a 1-element")]
    + [(op, {"grad_scale": torch.ones(2)}, r"grad_scale must be a 1-element float32") for op in OPTIMIZERS]
    + [(op, {"found_inf": torch.zeros((), dtype=torch.float64)}, r"found_inf must be a 1-element float32")
       for op in OPTIMIZERS]
    + [("sgd", {"state_step": torch.zeros(()), "first_step": True}, r"first_step must be False when state_step")]
)


@pytest.mark.parametrize("device", ["cpu", "meta"])
@pytest.mark.parametrize("op,overrides,pattern", BAD_VALUES)
def test_bad_values_are_refused_by_name_and_nothing_is_written(device, op, overrides, pattern):
    args = operands(op, device)
    args.update({k: _to(v, device) for k, v in overrides.items()})
    assert_refused(op, args, pattern)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_values_beyond_float32_are_refused_for_half_storage_too(dtype):
    # bf16 / fp16 storage computes in float32: the weight must be representable there.
    assert_refused("adam", {**operands("adam", dtype=dtype), "weights": [1e39]}, r"overflows float32, the math dtype")


@cpu_float64
def test_float64_storage_computes_in_float64_so_its_range_applies():
    x = torch.ones(4, dtype=torch.float64)
    ops.gossip_mix_(x, [torch.ones(4, dtype=torch.float64)], 0.0, [1e300])
    assert torch.all(x == 1e300)
    a = operands("adam", dtype=torch.float64)
    a.update(beta1=1 - 1e-9)  # rounds to 1 in float32, not in float64
    ops.mix_adam_(**a)
    assert torch.isfinite(a["x"]).all()


def test_the_largest_step_is_exact():
    """step = 2^63 - 1: the bias corrections are 1, and AccumAdam's window count and flush do not overflow."""
    for op in ["adam", "accum"]:
        a, expected = operands(op), operands(op)
        a["step"] = 2 ** 63 - 1
        # beta2^k is below double rounding from k ~ 40000 on: the same update as at any larger step
        expected["step"] = 7 * 200_000
        if op == "accum":
            a["accum_steps"] = expected["accum_steps"] = 7  # 2^63 - 1 = 7 * 1317624576693539401: both flush
        CALL[op](**a)
        CALL[op](**expected)
        for name in ["x", "exp_avg", "exp_avg_sq"] + (["accum"] if op == "accum" else []):
            assert torch.equal(a[name], expected[name]), name
        assert torch.isfinite(a["x"]).all()


@pytest.mark.parametrize("op", ["adam", "accum"])
@pytest.mark.parametrize("step,pattern", [(2 ** 63, r"step must fit in int64"), (1.5, r"step must be an integer"),
                                          (None, r"step is None but no state_step")])
def test_steps_that_are_no_int64_are_refused_in_python(op, step, pattern):
    assert_refused(op, {**operands(op), "step": step}, pattern, ValueError)


@pytest.mark.parametrize("name,value,pattern", [("payload_offset", "x", r"payload_offset must be an integer"),
                                                ("payload_block", 1.5, r"payload_block must be an integer")])
def test_wire_arguments_that_are_no_int64_are_refused_without_a_wire_too(name, value, pattern):
    assert_refused("mix", {**operands("mix"), name: value}, pattern, ValueError)


def test_accum_steps_beyond_int64_is_refused():
    assert_refused("accum", {**operands("accum"), "accum_steps": 2 ** 64}, r"accum_steps must fit in int64", ValueError)


@pytest.mark.parametrize("op", OPTIMIZERS)
@pytest.mark.parametrize("value", [0.0, -1.0, INF, NAN])
def test_a_grad_scale_that_is_not_positive_and_finite_is_refused_on_cpu(op, value):
    assert_refused(op, {**operands(op), "grad_scale": torch.tensor(value)}, r"grad_scale must be finite and > 0")


@pytest.mark.parametrize("op", OPTIMIZERS)
@pytest.mark.parametrize("count", [torch.tensor(-1.0), torch.tensor(1.5), torch.tensor(NAN),
                                   torch.tensor(2.0 ** 24 + 2), torch.tensor(2 ** 62 + 1), torch.tensor(-3)],
                         ids=["negative", "fractional", "nan", "float32-past-2^24", "int64-past-2^62", "int64-negative"])
def test_a_state_step_that_is_no_count_is_refused_on_cpu(op, count):
    args = {**operands(op), "state_step": count}
    if op != "sgd":
        args["step"] = None
    assert_refused(op, args, r"state_step holds .* which is not a count of applied updates")


def test_state_step_replaces_the_host_step():
    a = {**operands("adam"), "state_step": torch.zeros(())}
    assert_refused("adam", a, r"pass step=None with state_step", ValueError)
    with pytest.raises(RuntimeError, match=r"step must be 0 when state_step is given"):
        torch.ops.decent_comm.mix_adam_(a["x"], a["neighbors"], 0.5, [0.5], a["grad"], a["exp_avg"], a["exp_avg_sq"],
                                        3, 0.01, 0.9, 0.999, 1e-8, 0.0, False, None, None, None, a["state_step"])
    assert float(a["state_step"]) == 0


def test_scalars_sharing_memory_with_outputs_are_refused():
    a = operands("adam")
    assert_refused("adam", {**a, "found_inf": a["x"][3:4]}, r"found_inf shares memory with x")
    d = torch.full((1,), 2.0)
    assert_refused("adam", {**a, "disagreement": d, "grad_scale": d}, r"grad_scale shares memory with disagreement")
    a["exp_avg"][0] = 3.0  # a valid count, so that the overlap is what is refused
    assert_refused("adam", {**a, "step": None, "state_step": a["exp_avg"][0:1]},
                   r"exp_avg and state_step share memory")


# ------------------------------------------------------------------------------------- autograd

def _param(t):
    return torch.nn.Parameter(t.clone())


AUTOGRAD_CASES = [
    ("mix", "x", lambda a: _param(a["x"])),
    ("sgd", "x", lambda a: a["x"].clone().requires_grad_() * 1),  # not a leaf: autograd tracks it
    ("adam", "exp_avg", lambda a: _param(a["exp_avg"])),
    ("sgd", "momentum_buffer", lambda a: _param(a["momentum_buffer"])),
    ("accum", r"neighbors\[0\]", lambda a: [_param(a["neighbors"][0])]),
    ("adam", "grad", lambda a: _param(a["grad"])),
    ("mix", "disagreement", lambda a: torch.zeros(1, requires_grad=True)),
    ("adam", "grad_scale", lambda a: torch.ones((), requires_grad=True)),
]


@pytest.mark.parametrize("device", ["cpu", "meta"])
@pytest.mark.parametrize("op,name,make", AUTOGRAD_CASES, ids=[f"{o}-{n}" for o, n, _ in AUTOGRAD_CASES])
def test_tensors_that_require_grad_are_refused_while_autograd_records(device, op, name, make):
    args = operands(op, device)
    key = name.replace("\\", "").split("[")[0]
    args[key] = _to(make(args), device)
    assert_refused(op, args, rf"{name} requires grad while autograd is recording")


def test_under_no_grad_a_parameter_is_updated_like_torch_in_place_ops_do():
    a = operands("adam")
    plain = operands("adam")
    a["x"] = _param(a["x"])
    version = a["x"]._version
    with torch.no_grad():
        ops.mix_adam_(**a)
    ops.mix_adam_(**plain)
    assert torch.equal(a["x"].detach(), plain["x"]) and a["x"]._version > version
    assert a["exp_avg"]._version > 0 and a["exp_avg_sq"]._version > 0


def test_a_tensor_saved_for_backward_and_then_mixed_makes_backward_raise():
    """The op bumps version counters, so autograd notices, as after torch's own in-place ops."""
    leaf = torch.randn(8, requires_grad=True)
    y = leaf * 2
    loss = (y * y).sum()  # saves y
    with torch.no_grad():
        ops.gossip_mix_(y, [torch.zeros(8)], 0.5, [0.5])
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_inference_tensors_are_written_only_in_inference_mode():
    with torch.inference_mode():
        x = torch.ones(16)
        ops.gossip_mix_(x, [torch.zeros(16)], 0.5, [0.5])
        assert torch.all(x == 0.5)
    assert_refused("mix", {**operands("mix"), "x": x}, r"x is an inference tensor")


# Which side refuses decides the exception type (the module doc of decent_comm.ops): the kernels' checks raise
# RuntimeError, the Python-side checks before the call ValueError; both start "decent_comm.<op>: " and name the
# argument (step=0 was a RuntimeError saying so, step=1.5 a ValueError without the op).
OP_NAMES = {"mix": "gossip_mix_", "sgd": "mix_sgd_", "adam": "mix_adam_", "accum": "mix_accum_adam_"}
WHO_REFUSES = [
    ("adam", {"step": 0}, RuntimeError, "step is the 1-based count after this update and must be >= 1, got 0"),
    ("adam", {"step": 1.5}, ValueError, "step must be an integer, got 1.5"),
    ("accum", {"step": None}, ValueError, "step is None but no state_step was given"),
    ("accum", {"accum_steps": 0}, RuntimeError, "accum_steps must be >= 1"),
    ("accum", {"accum_steps": 2 ** 64}, ValueError, "accum_steps must fit in int64"),
    ("sgd", {"lr": -1.0}, RuntimeError, "lr must be"),
    ("sgd", {"payload_block": 1.5}, ValueError, "payload_block must be an integer"),
    ("mix", {"payload_offset": "x"}, ValueError, "payload_offset must be an integer"),
    ("mix", {"copies": [torch.zeros(16)]}, ValueError, "pass copies and payloads together"),
    # sparse: the dispatcher's NotImplementedError (backend 'SparseCPU') named neither decent_comm.<op> nor the argument
    ("sgd", {"grad": torch.zeros(16).to_sparse()}, RuntimeError, "grad has layout torch.sparse_coo; the ops take"),
    ("mix", {"neighbors": [torch.ones(16).to_sparse()]}, RuntimeError, "neighbors[0] has layout torch.sparse_coo"),
    ("adam", {"exp_avg": torch.zeros(16).to_sparse()}, RuntimeError, "exp_avg has layout torch.sparse_coo"),
    ("accum", {"found_inf": torch.zeros(1).to_sparse()}, RuntimeError, "found_inf has layout torch.sparse_coo"),
]


@pytest.mark.parametrize("op,bad,error,says", WHO_REFUSES, ids=[f"{op}-{next(iter(b))}-{e.__name__}"
                                                              for op, b, e, _ in WHO_REFUSES])
def test_kernel_checks_raise_runtime_error_python_checks_value_error_both_naming_the_op(op, bad, error, says):
    assert_refused(op, {**operands(op), **bad}, "^" + re.escape(f"decent_comm.{OP_NAMES[op]}: {says}"), error)


def test_codec_checks_name_the_op_too():
    x, copy = torch.randn(16), torch.zeros(16)
    payload = torch.empty(ops.int8_payload_nbytes(16, 512), dtype=torch.uint8)
    for call, op in ((lambda b: ops.int8_encode_(x, copy, payload, b), "int8_encode_"),
                     (lambda b: ops.int8_dequantize_add_(copy, payload, b), "int8_dequantize_add_")):
        with pytest.raises(RuntimeError, match=rf"^decent_comm\.{op}: block must be a multiple of 4"):
            call(6)
        with pytest.raises(ValueError, match=rf"^decent_comm\.{op}: block must be an integer, got 512\.0"):
            call(512.0)
    with pytest.raises(RuntimeError, match=r"^decent_comm\.int8_encode_: copy has layout torch\.sparse_coo; "):
        ops.int8_encode_(x, copy.to_sparse(), payload)
    with pytest.raises(RuntimeError, match=r"^decent_comm\.int8_dequantize_add_: copy has layout torch\.sparse_coo"):
        ops.int8_dequantize_add_(copy.to_sparse(), payload)
    with pytest.raises(ValueError, match=r"^decent_comm\.int8_payload_views: not an int8_encode_ payload"):
        ops.int8_payload_views(payload[:-1], 512)
