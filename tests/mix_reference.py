"""Independent float64 references of the fused ops, written from the formulas in the op contract.

They use plain torch float64 arithmetic and share no code with the kernels.
"""

import math

import torch

# Relative size of one rounding step of each storage dtype (half an ulp, with margin).
STORE_RTOL = {torch.float64: 1e-15, torch.float32: 1.2e-7, torch.bfloat16: 2 ** -8, torch.float16: 2 ** -11}
# Below the smallest normal number the spacing stops shrinking: rounding there is absolute, at most half
# the smallest subnormal (float16: 2**-25; a relative bound alone fails for results like 2.7e-5 in fp16).
STORE_ATOL = {d: torch.finfo(d).smallest_normal * torch.finfo(d).eps for d in STORE_RTOL}


def mix64(x, neighbors, self_weight, weights):
    """self_weight * x + sum_j w_j y_j in float64, and the sum of the magnitudes of its terms."""
    out = self_weight * x.double()
    scale = (self_weight * x.double()).abs()
    for y, w in zip(neighbors, weights):
        out = out + w * y.double()
        scale = scale + (w * y.double()).abs()
    return out, scale


def sgd64(x_old, mixed, g, buf, lr, momentum, dampening, weight_decay, nesterov, first_step):
    """Returns (x_new, new_buf) for the AWC-fused torch.optim.SGD step."""
    g = g.double() + weight_decay * x_old
    if momentum == 0:
        return mixed - lr * g, buf
    b = g.clone() if first_step else momentum * buf.double() + (1 - dampening) * g
    d = g + momentum * b if nesterov else b
    return mixed - lr * d, b


def adam64(x_old, mixed, g, m, v, step, lr, beta1, beta2, eps, weight_decay, decoupled):
    g = g.double()
    if not decoupled:
        g = g + weight_decay * x_old
    m = beta1 * m.double() + (1 - beta1) * g
    v = beta2 * v.double() + (1 - beta2) * g * g
    m_hat = m / (1 - beta1 ** step)
    v_hat = v / (1 - beta2 ** step)
    x = mixed - lr * (m_hat / (v_hat.sqrt() + eps))
    if decoupled:
        x = x - lr * weight_decay * x_old
    return x, m, v


def accum_adam64(x_old, mixed, g, M, V, A, step, accum_steps, lr, beta1, beta2, eps, weight_decay, decoupled):
    g = g.double()
    if not decoupled:
        g = g + weight_decay * x_old
    M, V, A = M.double(), V.double(), A.double()
    k = math.ceil(step / accum_steps)
    m = beta1 * M + (1 - beta1) * g
    v = beta2 * V + (1 - beta2) * g * g
    x = mixed - lr * ((m / (1 - beta1 ** k)) / ((v / (1 - beta2 ** k)).sqrt() + eps))
    if decoupled:
        x = x - lr * weight_decay * x_old
    A = A + g / accum_steps
    if step % accum_steps == 0:
        M = beta1 * M + (1 - beta1) * A
        V = beta2 * V + (1 - beta2) * A * A
        A = torch.zeros_like(A)
    return x, M, V, A


def assert_close_to_ref(actual, ref, scale, dtype, terms, what="x"):
    """|actual - ref| <= rounding of the stored result + accumulation error of `terms` opmath operations."""
    opmath_eps = 2.3e-16 if dtype == torch.float64 else 1.2e-7
    tol = STORE_RTOL[dtype] * ref.abs() + STORE_ATOL[dtype] + (terms + 2) * opmath_eps * scale + 1e-30
    err = (actual.double() - ref).abs()
    bad = err > tol
    if bad.any():
        i = int(bad.nonzero()[0])
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {ref.numel()} elements off; first at {i}: got {float(actual[i])}, "
            f"want {float(ref[i])} (tol {float(tol[i])})"
        )
