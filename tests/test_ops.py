"""The fused gossip-mix ops against float64 references and torch.optim, on every device present."""

import itertools
import zlib

import pytest
import torch

import decent_comm
from decent_comm import ops

from mix_reference import accum_adam64, adam64, assert_close_to_ref, mix64, sgd64
from op_inputs import DEVICES, DTYPES, flat, gen, random_weights

SIZES = [0, 1, 7, 4097, 100_003]


# ---------------------------------------------------------------------------------------------- gossip_mix_

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("k", list(range(10)) + [16, 32])
def test_gossip_mix_sizes_and_neighbor_counts(device, n, k):
    g = gen(1000 * k + n)
    x = flat(n, torch.float32, device, gen=g)
    ys = [flat(n, torch.float32, device, gen=g) for _ in range(k)]
    sw, ws = random_weights(k, g)
    ref, scale = mix64(x, ys, sw, ws)
    ops.gossip_mix_(x, ys, sw, ws)
    assert_close_to_ref(x.cpu(), ref.cpu(), scale.cpu(), torch.float32, k)


@pytest.mark.parametrize("device", DEVICES)
def test_gossip_mix_every_dtype_combination(device):
    for x_dtype, y_dtype in itertools.product(DTYPES[device], DTYPES[device]):
        for n, offset, k in [(4097, 0, 1), (4097, 1, 2), (333, 3, 3), (8, 0, 5)]:
            g = gen(zlib.crc32(f"{x_dtype}/{y_dtype}/{n}/{k}".encode()))  # hash() of str is salted per process
            x = flat(n, x_dtype, device, offset, g)
            ys = [flat(n, y_dtype, device, offset + j % 2, g) for j in range(k)]
            sw, ws = random_weights(k, g)
            ref, scale = mix64(x, ys, sw, ws)
            ops.gossip_mix_(x, ys, sw, ws)
            opmath = torch.float64 if x_dtype == torch.float64 else torch.float32
            # the result is rounded to x's dtype; accumulation happens in opmath
            assert_close_to_ref(x.cpu(), ref.cpu(), scale.cpu(), x_dtype if x_dtype != torch.float64 else opmath, k,
                                what=f"x {x_dtype} / neighbors {y_dtype}")


@pytest.mark.parametrize("device", DEVICES)
def test_gossip_mix_misaligned_views(device):
    for offset in range(1, 8):
        g = gen(offset)
        n = 1001
        x = flat(n, torch.bfloat16, device, offset, g)
        ys = [flat(n, torch.float32, device, (offset * 3 + j) % 5, g) for j in range(2)]
        sw, ws = random_weights(2, g)
        ref, scale = mix64(x, ys, sw, ws)
        ops.gossip_mix_(x, ys, sw, ws)
        assert_close_to_ref(x.cpu(), ref.cpu(), scale.cpu(), torch.bfloat16, 2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("k", [1, 3, 6])  # the CPU kernels reduce in the single pass up to k = 4, blocked beyond
def test_gossip_mix_reports_disagreement(device, k):
    g = gen(7 + k)
    for n in [0, 5, 4097, 70_001]:
        x = flat(n, torch.float32, device, gen=g)
        ys = [flat(n, torch.bfloat16, device, gen=g) for _ in range(k)]
        sw, ws = random_weights(k, g)
        ref, _ = mix64(x, ys, sw, ws)
        want = float(((ref - x.double()) ** 2).sum())
        out = torch.full((1,), 123.0, device=device)
        ops.gossip_mix_(x, ys, sw, ws, disagreement=out)
        assert float(out) == pytest.approx(want, rel=1e-5, abs=1e-30)


# ------------------------------------------------------------------------------------------- optimizer ops

SGD_FLAGS = [dict(momentum=m, dampening=d, nesterov=nv, weight_decay=wd)
             for m, d, nv, wd in itertools.product([0.0, 0.9], [0.0, 0.3], [False, True], [0.0, 0.05])
             if not (nv and m == 0)]  # damped Nesterov too: torch.optim.SGD steps it when set after construction


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("flags", SGD_FLAGS, ids=lambda f: "-".join(f"{k}{v}" for k, v in f.items()))
@pytest.mark.parametrize("k", [0, 1, 2, 5])
def test_mix_sgd_matches_reference(device, flags, k):
    for x_dtype in DTYPES[device]:
        g = gen(k)
        n = 4099
        x = flat(n, x_dtype, device, gen=g)
        ys = [flat(n, torch.bfloat16 if j % 2 else x_dtype, device, gen=g) for j in range(k)]
        ys = [y.to(ys[0].dtype) for y in ys]  # one neighbour dtype per call
        grad = flat(n, x_dtype, device, gen=g)
        buf = flat(n, torch.float32, device, gen=g)
        sw, ws = random_weights(k, g)
        for first_step in [True, False]:
            x1, buf1 = x.clone(), buf.clone()
            mixed, scale = mix64(x1, ys, sw, ws)
            ref, ref_buf = sgd64(x1.double(), mixed, grad, buf1, lr=0.1, first_step=first_step, **flags)
            ops.mix_sgd_(x1, ys, sw, ws, grad, buf1 if flags["momentum"] else None, lr=0.1,
                         first_step=first_step, **flags)
            update = (ref - mixed).abs()
            opmath = torch.float64 if x_dtype == torch.float64 else x_dtype
            assert_close_to_ref(x1.cpu(), ref.cpu(), (scale + update + x1.double().abs()).cpu(), opmath, k + 8)
            if flags["momentum"]:
                assert_close_to_ref(buf1.cpu(), ref_buf.cpu(), ref_buf.abs().cpu() + grad.double().abs().cpu(),
                                    torch.float32, 8, what="momentum_buffer")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("decoupled", [False, True])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("k", [0, 1, 2, 3, 16])
def test_mix_adam_matches_reference(device, decoupled, weight_decay, k):
    for x_dtype in DTYPES[device]:
        g = gen(31 * k + int(decoupled))
        n = 4101
        x = flat(n, x_dtype, device, gen=g)
        ys = [flat(n, torch.float32, device, gen=g) for _ in range(k)]
        grad = flat(n, x_dtype, device, gen=g)
        m = flat(n, torch.float32, device, gen=g, scale=0.1)
        v = flat(n, torch.float32, device, gen=g).abs() * 0.01
        sw, ws = random_weights(k, g)
        for step in [1, 2, 10]:
            x1, m1, v1 = x.clone(), m.clone(), v.clone()
            mixed, scale = mix64(x1, ys, sw, ws)
            hp = dict(lr=0.01, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=weight_decay, decoupled=decoupled)
            ref, ref_m, ref_v = adam64(x1.double(), mixed, grad, m1, v1, step, **hp)
            ops.mix_adam_(x1, ys, sw, ws, grad, m1, v1, step, **hp)
            update = (ref - mixed).abs()
            opmath = torch.float64 if x_dtype == torch.float64 else x_dtype
            assert_close_to_ref(x1.cpu(), ref.cpu(), (scale + 10 * update + x1.double().abs()).cpu(), opmath, k + 10)
            assert_close_to_ref(m1.cpu(), ref_m.cpu(), ref_m.abs().cpu() + grad.double().abs().cpu(), torch.float32, 8,
                                what="exp_avg")
            assert_close_to_ref(v1.cpu(), ref_v.cpu(), ref_v.abs().cpu(), torch.float32, 8, what="exp_avg_sq")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("decoupled", [False, True])
@pytest.mark.parametrize("accum_steps", [1, 3])
@pytest.mark.parametrize("k", [0, 1, 4])
def test_mix_accum_adam_matches_reference_over_steps(device, decoupled, accum_steps, k):
    """Eight consecutive steps (two flushes of the accumulator for K = 3) against the float64 loop."""
    for x_dtype in DTYPES[device]:
        g = gen(17 * k + accum_steps)
        n = 2053
        x = flat(n, x_dtype, device, gen=g)
        state = [torch.zeros(n, device=device) for _ in range(3)]
        ref_x, ref_state = x.double(), [s.double() for s in state]
        hp = dict(lr=0.01, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.05, decoupled=decoupled)
        for step in range(1, 9):
            ys = [flat(n, torch.bfloat16, device, gen=g) for _ in range(k)]
            grad = flat(n, x_dtype, device, gen=g)
            sw, ws = random_weights(k, g)
            mixed, scale = mix64(ref_x, ys, sw, ws)
            old_state = [s.double() for s in state]
            ref_x_new, *ref_state = accum_adam64(ref_x, mixed, grad, *ref_state, step, accum_steps, **hp)
            ops.mix_accum_adam_(x, ys, sw, ws, grad, *state, step, accum_steps, **hp)
            # compare the one-step result from the same inputs, then continue from what the kernel produced
            opmath = torch.float64 if x_dtype == torch.float64 else x_dtype
            update = (ref_x_new - mixed).abs()
            assert_close_to_ref(x.cpu(), ref_x_new.cpu(), (scale + 10 * update + ref_x.abs()).cpu(), opmath, k + 12,
                                what=f"x at step {step}")
            # the state update can cancel (M = b1*M + (1-b1)*A), so the error scales with its inputs
            magnitude = sum(s.abs() for s in old_state) + grad.double().abs() + ref_x.abs()
            for name, s, r in zip(["M", "V", "A"], state, ref_state):
                assert_close_to_ref(s.cpu(), r.cpu(), (r.abs() + magnitude).cpu(), torch.float32, 10,
                                    what=f"{name} at step {step}")
            ref_x, ref_state = x.double(), [s.double() for s in state]


def test_accum_adam_state_is_flushed_every_k_steps():
    n, K = 64, 3
    x = torch.zeros(n)
    M, V, A = (torch.zeros(n) for _ in range(3))
    grads = [torch.full((n,), float(i + 1)) for i in range(K)]
    for t, g in enumerate(grads, start=1):
        ops.mix_accum_adam_(x, [], 1.0, [], g, M, V, A, t, K, lr=0.0)
        if t < K:
            assert torch.all(M == 0) and torch.all(A > 0)
    mean_g = sum(g for g in grads) / K
    torch.testing.assert_close(M, 0.1 * mean_g)
    torch.testing.assert_close(V, 0.001 * mean_g ** 2)
    assert torch.all(A == 0)


# ------------------------------------------------------------------------- no neighbours == torch.optim

TORCH_OPT_CASES = (
    [("sgd", dict(lr=0.05, **f)) for f in SGD_FLAGS]
    + [("adam", dict(lr=0.01, weight_decay=wd)) for wd in [0.0, 0.1]]
    + [("adamw", dict(lr=0.01, weight_decay=wd)) for wd in [0.0, 0.1]]
)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind,hp", TORCH_OPT_CASES, ids=[f"{k}-{i}" for i, (k, _) in enumerate(TORCH_OPT_CASES)])
def test_no_neighbors_equals_torch_optimizer(device, kind, hp):
    """k = 0 and self_weight = 1 is exactly one torch.optim step (how ATC mode runs its local update)."""
    g = gen(3)
    n = 3001
    p_ref = torch.nn.Parameter(flat(n, torch.float32, device, gen=g))
    x = p_ref.detach().clone()
    if kind == "sgd":  # a damped Nesterov is set after construction, where torch.optim.SGD takes it
        opt = torch.optim.SGD([p_ref], foreach=False, **{**hp, "dampening": 0.0})
        opt.param_groups[0]["dampening"] = hp["dampening"]
    elif kind == "adam":
        opt = torch.optim.Adam([p_ref], foreach=False, **hp)
    else:
        opt = torch.optim.AdamW([p_ref], foreach=False, **hp)
    state = [torch.zeros(n, device=device) for _ in range(2)]
    for step in range(1, 6):
        grad = flat(n, torch.float32, device, gen=g)
        p_ref.grad = grad.clone()
        opt.step()
        if kind == "sgd":
            ops.mix_sgd_(x, [], 1.0, [], grad, state[0], first_step=step == 1, **hp)
        else:
            ops.mix_adam_(x, [], 1.0, [], grad, state[0], state[1], step, decoupled=kind == "adamw", **hp)
        torch.testing.assert_close(x, p_ref.detach(), rtol=2e-6, atol=2e-6)


# ---------------------------------------------------------------------------- registration and compile

def _amp(d):
    """GradScaler's scale and found_inf and a step count, as the optimizer ops take them (the schema's last three)."""
    return torch.full((), 1024.0, device=d), torch.zeros((), device=d), torch.full((), 4.0, device=d)


def _rand(d, n=37):
    return torch.randn(n, device=d)


OPCHECK_CASES = {
    "gossip_mix_": ("gossip_mix_", lambda d: (_rand(d), [_rand(d), _rand(d)], 0.4, [0.3, 0.3])),
    "mix_sgd_": ("mix_sgd_", lambda d: (_rand(d), [_rand(d)], 0.5, [0.5], _rand(d), _rand(d), 0.1, 0.9, 0.0, 0.01,
                                        True, False)),
    "mix_sgd_-amp": ("mix_sgd_", lambda d: (_rand(d), [_rand(d)], 0.5, [0.5], _rand(d), _rand(d), 0.1, 0.9, 0.0,
                                            0.01, True, False, None, *_amp(d))),
    "mix_adam_": ("mix_adam_", lambda d: (_rand(d), [_rand(d)], 0.5, [0.5], _rand(d), torch.zeros(37, device=d),
                                          torch.zeros(37, device=d), 1, 0.01, 0.9, 0.999, 1e-8, 0.01, True)),
    "mix_adam_-amp": ("mix_adam_", lambda d: (_rand(d), [_rand(d)], 0.5, [0.5], _rand(d), torch.zeros(37, device=d),
                                              torch.zeros(37, device=d), 0, 0.01, 0.9, 0.999, 1e-8, 0.01, True, None,
                                              *_amp(d))),
    "mix_accum_adam_": ("mix_accum_adam_", lambda d: (_rand(d), [_rand(d)], 0.5, [0.5], _rand(d),
                                                      torch.zeros(37, device=d), torch.zeros(37, device=d),
                                                      torch.zeros(37, device=d), 2, 2, 0.01, 0.9, 0.999, 1e-8, 0.01,
                                                      False)),
    "mix_accum_adam_-amp": ("mix_accum_adam_", lambda d: (_rand(d), [_rand(d)], 0.5, [0.5], _rand(d),
                                                          torch.zeros(37, device=d), torch.zeros(37, device=d),
                                                          torch.zeros(37, device=d), 0, 2, 0.01, 0.9, 0.999, 1e-8,
                                                          0.01, False, torch.zeros(1, device=d), *_amp(d))),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", sorted(OPCHECK_CASES))
def test_opcheck(device, case):
    name, make_args = OPCHECK_CASES[case]
    torch.library.opcheck(getattr(torch.ops.decent_comm, name).default, make_args(device))


@pytest.mark.parametrize("device", DEVICES)
def test_torch_compile_fullgraph(device):
    def step(x, y, grad, m, v):
        torch.ops.decent_comm.mix_adam_(x, [y], 0.5, [0.5], grad, m, v, 1, 0.01, 0.9, 0.999, 1e-8, 0.0, True)
        return x * 2

    n = 257
    args = [torch.randn(n, device=device) for _ in range(3)] + [torch.zeros(n, device=device) for _ in range(2)]
    eager_args = [a.clone() for a in args]
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    out = compiled(*args)
    ref = step(*eager_args)
    torch.testing.assert_close(out, ref)
    for a, b in zip(args, eager_args):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("device", DEVICES)
def test_torch_compile_fullgraph_with_amp_scalars(device):
    """GradScaler's tensors and the device step count trace into one graph (no data-dependent Python)."""
    def step(x, grad, m, v, grad_scale, found_inf, count):
        ops.mix_adam_(x, [], 1.0, [], grad, m, v, None, 0.01, grad_scale=grad_scale, found_inf=found_inf,
                      state_step=count)
        return x + 1

    n = 129
    args = [torch.randn(n, device=device) for _ in range(2)] + [torch.zeros(n, device=device) for _ in range(2)]
    args += [torch.full((), 2.0 ** 10, device=device), torch.zeros((), device=device), torch.zeros((), device=device)]
    eager_args = [a.clone() for a in args]
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    for found in [0.0, 1.0, 0.0]:  # an overflow step in the middle
        for a in (args, eager_args):
            a[5].fill_(found)
        torch.testing.assert_close(compiled(*args), step(*eager_args))
    for a, b in zip(args, eager_args):
        torch.testing.assert_close(a, b)
    assert float(args[-1]) == 2.0


def test_misuse_is_refused_while_tracing_too():
    """The fake (Meta) kernel runs the same checks, so a compiled call refuses what an eager one does."""
    def step(x, grad, m, v):
        ops.mix_adam_(x, [], 1.0, [], grad, m, v, 1, 0.01, eps=-1e-8)

    with pytest.raises(Exception, match=r"eps must be >= 0"):
        torch.compile(step, fullgraph=True, backend="aot_eager")(*[torch.zeros(8) for _ in range(4)])


def test_cuda_kernels_registered_in_cuda_build():
    names = ["gossip_mix_", "mix_sgd_", "mix_adam_", "mix_accum_adam_"]
    for name in names:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"decent_comm::{name}", "CPU")
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"decent_comm::{name}", "Meta")
    if not ops.has_cuda_kernels():
        pytest.skip("this build has no CUDA kernels (no nvcc or a CPU-only torch)")
    for name in names:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"decent_comm::{name}", "CUDA"), name


def test_cuda_build_expected_when_toolchain_present():
    """With nvcc, a CUDA torch and a reason to build CUDA (a visible GPU, TORCH_CUDA_ARCH_LIST as in CI, or
    DECENT_COMM_CUDA=1), the build must include the CUDA kernels and the NCCL transport."""
    import os
    import shutil
    asked = os.environ.get("DECENT_COMM_CUDA") == "1" or bool(os.environ.get("TORCH_CUDA_ARCH_LIST")) \
        or torch.cuda.is_available()
    if os.environ.get("DECENT_COMM_CUDA") == "0" or shutil.which("nvcc") is None or not torch.version.cuda \
            or not asked:
        pytest.skip("no CUDA toolchain, CUDA disabled, or no GPU and no TORCH_CUDA_ARCH_LIST (CPU-only build)")
    assert ops.has_cuda_kernels()
    assert decent_comm._native.nccl_version() is not None
