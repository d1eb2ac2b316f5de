"""Property tests of the fused ops (hypothesis, a fixed derandomized profile): random sizes (0, 1, odd), views at odd
element offsets, 0..MAX_NEIGHBORS neighbours, every storage dtype for x and the neighbours, x aliased as a
neighbour, weights and hyper-parameters with edge values, AMP scalars and device step counts. Valid calls match the
float64 references of mix_reference.py within the dtypes' rounding; invalid ones raise and write nothing."""

import itertools
import math

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from decent_comm import ops

from mix_reference import accum_adam64, adam64, assert_close_to_ref, mix64, sgd64
from op_inputs import DTYPES

# Derandomized (the same examples on every run, so CI is deterministic), no example database, no deadline (the
# machine's load must not fail a test); sized to a few seconds on a 2-core machine, since the suite runs on every
# CI push (raise max_examples locally to search harder).
FUZZ = settings(derandomize=True, database=None, deadline=None, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
STORAGE = DTYPES["cpu"]
EDGE_WEIGHTS = st.sampled_from([0.0, 1.0, -1.0, 0.5, 1e-30, -2.0])
HYPER = {
    "sgd": dict(lr=[0.0, 1e-3, 0.1, 1.0], momentum=[0.0, 0.5, 0.9, 1.0], dampening=[0.0, 0.5, 1.0],
                weight_decay=[0.0, 1e-4, 0.5]),
    "adam": dict(lr=[0.0, 1e-4, 1e-2], beta1=[0.0, 0.5, 0.9, 1 - 2 ** -20], beta2=[0.0, 0.9, 0.999, 1 - 2 ** -20],
                 eps=[0.0, 1e-8, 1e-3, 1.0], weight_decay=[0.0, 0.01, 1.0]),
}
HYPER["accum"] = HYPER["adam"]
STEPS = [1, 2, 3, 10, 1000, 2 ** 31, 2 ** 62]


@st.composite
def calls(draw):
    """One call: the op, its operands' shapes and dtypes, its weights, hyper-parameters and AMP scalars."""
    op = draw(st.sampled_from(["mix", "sgd", "adam", "accum"]))
    k = draw(st.one_of(st.integers(0, 4), st.integers(0, ops.MAX_NEIGHBORS)))
    c = dict(op=op, k=k, seed=draw(st.integers(0, 2 ** 31)),
             n=draw(st.one_of(st.sampled_from([0, 1, 2, 3, 7, 8, 9, 16, 17, 33]), st.integers(0, 3000))),
             x_dtype=draw(st.sampled_from(STORAGE)), y_dtype=draw(st.sampled_from(STORAGE)),
             x_offset=draw(st.integers(0, 7)), y_offsets=draw(st.lists(st.integers(0, 7), min_size=k, max_size=k)),
             weights=draw(st.lists(st.one_of(EDGE_WEIGHTS, st.floats(-2, 2)), min_size=k + 1, max_size=k + 1)),
             alias=draw(st.integers(0, k - 1)) if k and draw(st.booleans()) else None,
             disagreement=draw(st.booleans()), hp={}, amp={})
    if c["alias"] is not None:
        c["y_dtype"] = c["x_dtype"]  # x among the neighbours: all of them share its dtype
    if op == "mix":
        return c
    c["hp"] = {name: draw(st.sampled_from(values)) for name, values in HYPER[op].items()}
    c["step"] = draw(st.sampled_from(STEPS))
    if op == "sgd":
        c["hp"]["nesterov"] = c["hp"]["momentum"] > 0 and draw(st.booleans())
        c["first_step"] = draw(st.booleans())  # the host flag; a device count decides by itself (step == 1)
    else:
        c["hp"]["decoupled"] = draw(st.booleans())
        c["accum_steps"] = draw(st.sampled_from([1, 2, 3, 7])) if op == "accum" else 1
    c["amp"] = dict(grad_scale=draw(st.sampled_from([None, 1.0, 2.0 ** 16, 3.0])),
                    found_inf=draw(st.sampled_from([None, 0.0, 1.0])),
                    count_dtype=draw(st.sampled_from([None, torch.float32, torch.float64, torch.int64])))
    return c


def _buffer(n, dtype, offset, g, scale=1.0):
    """n random elements at element `offset` of a larger buffer (an unaligned view when offset is odd)."""
    return (torch.randn(n + offset + 3, generator=g, dtype=torch.float64) * scale).to(dtype)[offset:offset + n]


def build(c):
    """The op's keyword arguments for case `c`, on fresh buffers."""
    g = torch.Generator().manual_seed(c["seed"])
    n, k = c["n"], c["k"]
    x = _buffer(n, c["x_dtype"], c["x_offset"], g)
    ys = [_buffer(n, c["y_dtype"], off, g) for off in c["y_offsets"]]
    if c["alias"] is not None:
        ys[c["alias"]] = x
    a = dict(x=x, neighbors=ys, self_weight=c["weights"][0], weights=c["weights"][1:],
             disagreement=torch.full((1,), 7.0) if c["disagreement"] else None)
    if c["op"] == "mix":
        return a
    # The gradient and the state at offsets 1 and 2 unless the case says otherwise: views a GPU cannot load by vectors.
    a.update(grad=_buffer(n, c["x_dtype"], c.get("grad_offset", 1), g), lr=c["hp"]["lr"],
             **{h: v for h, v in c["hp"].items() if h != "lr"})
    state = [_buffer(n, torch.float32, c.get("state_offset", 2), g, 0.1) for _ in range(3)]
    state[1] = state[1].abs() + 1e-6  # exp_avg_sq >= 0, and > 0 so that eps = 0 divides no zero by zero
    amp = c["amp"]
    for name in ["grad_scale", "found_inf"]:
        if amp[name] is not None:
            a[name] = torch.tensor(amp[name])
    step = c["step"]
    count_dtype = amp["count_dtype"]
    if count_dtype is torch.float32 and step - 1 >= 2 ** 24 or count_dtype is torch.float64 and step - 1 >= 2 ** 53:
        count_dtype = torch.int64  # where the dtype's count stops (test_ops_amp) or is refused (test_ops_bad_input)
    if count_dtype is not None:
        a["state_step"] = torch.tensor(step - 1, dtype=count_dtype)
    if c["op"] == "sgd":
        a.update(momentum_buffer=state[0], first_step=c["first_step"] and count_dtype is None)
    else:
        a.update(exp_avg=state[0], exp_avg_sq=state[1], step=None if count_dtype is not None else step)
        if c["op"] == "accum":
            a.update(accum=state[2], accum_steps=c["accum_steps"])
    return a


CALL = {"mix": ops.gossip_mix_, "sgd": ops.mix_sgd_, "adam": ops.mix_adam_, "accum": ops.mix_accum_adam_}
STATE = {"mix": [], "sgd": ["momentum_buffer"], "adam": ["exp_avg", "exp_avg_sq"],
         "accum": ["exp_avg", "exp_avg_sq", "accum"]}


def reference(c, a):
    """The call in float64 from the arguments before it: x, the state by name, the mixed point, and `scale`, the
    magnitude of the terms x's rounding errors scale with."""
    x_old = a["x"].double()
    mixed, scale = mix64(a["x"], a["neighbors"], a["self_weight"], a["weights"])
    r = dict(x=mixed, mixed=mixed, scale=scale, grad=torch.zeros(1, dtype=torch.float64),
             state={name: a[name].double() for name in STATE[c["op"]]})
    if c["op"] == "mix" or "found_inf" in a and float(a["found_inf"]) != 0:
        return r  # an overflow step only mixes
    inv = float(torch.tensor(1.0 / float(a["grad_scale"]), dtype=torch.float32)) if "grad_scale" in a else 1.0
    grad, hp, step, state = a["grad"].double() * inv, c["hp"], c["step"], r["state"]
    r["grad"] = grad
    if c["op"] == "sgd":
        first = step == 1 if "state_step" in a else c["first_step"]
        momentum, buf = hp["momentum"], a["momentum_buffer"].double()
        r["x"], b = sgd64(x_old, mixed, grad, buf, hp["lr"], momentum, hp["dampening"], hp["weight_decay"],
                          hp["nesterov"], first)
        if momentum:
            state["momentum_buffer"] = b
        terms = grad.abs() + hp["weight_decay"] * x_old.abs() + momentum * (buf.abs() + b.abs())
        r["scale"] = scale + 4 * hp["lr"] * terms
        return r
    common = dict(lr=hp["lr"], beta1=hp["beta1"], beta2=hp["beta2"], eps=hp["eps"], weight_decay=hp["weight_decay"],
                  decoupled=hp["decoupled"])
    if c["op"] == "adam":
        m_old = state["exp_avg"]
        r["x"], state["exp_avg"], state["exp_avg_sq"] = adam64(x_old, mixed, grad, m_old, state["exp_avg_sq"], step,
                                                               **common)
        # exp_avg moves as torch's lerp in its small-weight form, m_old + (1 - beta1) * (g - m_old): for beta1 <= 0.5
        # it is off by an ulp of m_old, which the step amplifies by lr_t / (sqrt(v_hat) + eps)
        denom = (state["exp_avg_sq"] / (1 - hp["beta2"] ** step)).sqrt() + hp["eps"]
        lerp = hp["lr"] / (1 - hp["beta1"] ** step) * (m_old.abs() + grad.abs()) / denom
    else:
        lerp = 0
        r["x"], *mva = accum_adam64(x_old, mixed, grad, state["exp_avg"], state["exp_avg_sq"], state["accum"], step,
                                    c["accum_steps"], **common)
        state.update(zip(STATE["accum"], mva))
    r["scale"] = scale + 10 * (r["x"] - mixed).abs() + x_old.abs() + lerp
    return r


def _bits(t):
    return t.detach().reshape(-1).view(torch.uint8).clone()


def check_call(c, precondition=assume):
    """Runs case `c` and checks x, the state, the disagreement and the count against the float64 reference.
    `precondition` gets whether the reference is finite and far enough from overflow in x's dtype."""
    a = build(c)
    r = reference(c, a)
    limit = torch.finfo(c["x_dtype"]).max / 2
    precondition(bool((r["x"].abs() < limit).all()))
    x_old = a["x"].to(torch.float64, copy=True)  # .double() of a float64 x would be x itself
    old_state = {name: a[name].double() for name in STATE[c["op"]]}
    count = int(a["state_step"]) if "state_step" in a else None
    CALL[c["op"]](**a)
    opmath = torch.float64 if c["x_dtype"] == torch.float64 else c["x_dtype"]
    assert_close_to_ref(a["x"], r["x"], r["scale"], opmath, c["k"] + 12)
    for name, want in r["state"].items():
        # the moment updates can cancel: their error scales with every input
        bound = want.abs() + old_state[name].abs() + 2 * r["grad"].abs() + x_old.abs()
        assert_close_to_ref(a[name], want, bound, torch.float32, 12, what=name)
    if a["disagreement"] is not None:
        want = float(((r["mixed"] - x_old) ** 2).sum())
        assert math.isclose(float(a["disagreement"]), want, rel_tol=1e-4, abs_tol=1e-30)
    if count is not None:
        skipped = "found_inf" in a and float(a["found_inf"]) != 0
        assert int(a["state_step"]) == count + (0 if skipped else 1)


@settings(FUZZ, max_examples=300)
@given(c=calls())
def test_valid_calls_match_the_float64_reference(c):
    check_call(c)


# One call per compiled variant of the kernels: update kind (SGD with and without momentum), x and neighbour dtype,
# the neighbour-count specializations, aligned (vector) and unaligned (one by one) operands, host or device scalars
# (GPU: the resolved kernels, and the mix-only kernel that runs when found_inf skips the update). The random draws
# above miss some; on a GPU, or against the emulated CUDA kernels (tests/cuda_emulation), each is a kernel of its own.
# 13,001 elements: more than one grid-stride round of the emulated device, and a tail after the vectors.
VARIANT_HYPER = {
    "mix": {},
    "sgd": dict(lr=0.1, momentum=0.0, dampening=0.0, weight_decay=0.01, nesterov=False),
    "sgd_momentum": dict(lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.01, nesterov=False),
    "adam": dict(lr=0.01, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.01, decoupled=True),
    "accum": dict(lr=0.01, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.01, decoupled=False),
}
VARIANT_SCALARS = {"host": dict(grad_scale=None, found_inf=None, count_dtype=None),
                   "device": dict(grad_scale=4.0, found_inf=0.0, count_dtype=torch.float32),
                   "skipped": dict(grad_scale=4.0, found_inf=1.0, count_dtype=torch.int64)}
# (neighbours, the offset of every operand: 0 is aligned, 1 is not)
VARIANT_OPERANDS = {"k1": (1, 0), "k2": (2, 0), "k3": (3, 0), "unaligned": (2, 1)}


def _variants():
    for update, scalars in itertools.product(VARIANT_HYPER, VARIANT_SCALARS):
        if update != "mix" or scalars == "host":
            for x_dtype, y_dtype in itertools.product(STORAGE, STORAGE):
                yield update, scalars, x_dtype, y_dtype


@pytest.mark.parametrize("update,scalars,x_dtype,y_dtype", list(_variants()))
def test_every_kernel_variant_matches_the_float64_reference(update, scalars, x_dtype, y_dtype):
    op = "sgd" if update == "sgd_momentum" else update
    for seed, (k, offset) in enumerate(VARIANT_OPERANDS.values()):
        c = dict(op=op, k=k, seed=seed, n=13_001, x_dtype=x_dtype, y_dtype=y_dtype, x_offset=offset,
                 y_offsets=[offset] * k, grad_offset=offset, state_offset=offset, weights=[0.4] + [0.6 / k] * k,
                 alias=None, disagreement=k != 1, hp=dict(VARIANT_HYPER[update]), amp=VARIANT_SCALARS[scalars],
                 step=3, first_step=False, accum_steps=3)
        check_call(c, precondition=_must_hold)


def _must_hold(ok):
    assert ok, "the reference of a variant case overflows x's dtype"


def _set_hyper(value, names=None):
    """A corruption that sets one of the op's hyper-parameters (chosen by `pick`) to `value`."""
    def mutate(a, c, pick):
        choice = names or sorted(HYPER[c["op"]])
        a[choice[pick % len(choice)]] = value
    return mutate


def _shifted_neighbor(a, c, pick):
    base, start = a["x"]._base, a["x"].storage_offset()
    a["neighbors"] = [base[start + 1:start + 1 + c["n"]]]  # one element off x: partial overlap (n >= 2)
    a["weights"] = [0.5]


def _bad_count(a, c, pick):
    """A count of updates that is none: a negative device count, or host step 0."""
    if "state_step" in a or c["op"] == "sgd":
        a.update(state_step=torch.tensor(-1.0), **({"first_step": False} if c["op"] == "sgd" else {"step": None}))
    else:
        a["step"] = 0


OPTIMIZER = lambda c: c["op"] != "mix"  # noqa: E731
# name: (applies to case c, mutate(args, c, pick)); each leaves a call that must be refused.
CORRUPT = {
    "neighbor_length": (lambda c: c["k"] > 0, lambda a, c, p: a["neighbors"].__setitem__(
        p % c["k"], torch.zeros(c["n"] + 1, dtype=c["y_dtype"]))),
    "weights_length": (lambda c: True, lambda a, c, p: a.update(weights=a["weights"] + [0.1])),
    "nan_self_weight": (lambda c: True, lambda a, c, p: a.update(self_weight=float("nan"))),
    "huge_weight": (lambda c: c["k"] > 0, lambda a, c, p: a["weights"].__setitem__(
        p % c["k"], float("inf") if c["x_dtype"] == torch.float64 else 1e39)),
    "too_many_neighbors": (lambda c: True, lambda a, c, p: a.update(neighbors=[a["x"]] * 33, weights=[0.01] * 33)),
    "nan_hyper": (OPTIMIZER, _set_hyper(float("nan"))),
    "negative_hyper": (OPTIMIZER, _set_hyper(-1.0, ["lr", "weight_decay"])),
    "beta_one": (lambda c: c["op"] in ("adam", "accum"), _set_hyper(1.0, ["beta1", "beta2"])),
    # n >= 2: one element off a one-element x is the next element, no overlap, a valid call (hypothesis drew
    # n = 1 with this corruption in one CI run: "DID NOT RAISE")
    "shifted_neighbor": (lambda c: c["n"] >= 2, _shifted_neighbor),
    "state_dtype": (lambda c: c["op"] in ("adam", "accum"),
                    lambda a, c, p: a.update(exp_avg_sq=a["exp_avg_sq"].half())),
    "grad_dtype": (OPTIMIZER, lambda a, c, p: a.update(
        grad=a["grad"].to(torch.float32 if c["x_dtype"] != torch.float32 else torch.float64))),
    "x_requires_grad": (lambda c: True, lambda a, c, p: a.update(x=a["x"].detach().requires_grad_())),
    "bad_count": (OPTIMIZER, _bad_count),
    "scalar_elsewhere": (OPTIMIZER, lambda a, c, p: a.update(found_inf=torch.zeros(1, device="meta"))),
    "zero_grad_scale": (OPTIMIZER, lambda a, c, p: a.update(grad_scale=torch.tensor(0.0))),
}


def _memory(t):
    """The whole buffer behind a tensor argument (a view's base), so writes outside the view count too."""
    return t._base if t._base is not None else t


@settings(FUZZ, max_examples=150)
@given(c=calls(), corruption=st.sampled_from(sorted(CORRUPT)), pick=st.integers(0, 99))
def test_invalid_calls_raise_and_write_nothing(c, corruption, pick):
    applies, mutate = CORRUPT[corruption]
    assume(applies(c))
    a = build(c)
    mutate(a, c, pick)
    tensors = [v for v in a.values() if isinstance(v, torch.Tensor)] + list(a["neighbors"])
    before = [(t, _bits(_memory(t))) for t in tensors if not t.is_meta]
    with pytest.raises((RuntimeError, ValueError)):
        CALL[c["op"]](**a)
    for t, bits in before:
        assert torch.equal(_bits(_memory(t)), bits), f"{corruption}: a refused call wrote an argument"
