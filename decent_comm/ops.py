"""The fused gossip-mix operators (torch.ops.decent_comm.*), with Python signatures and docs.

All ops mutate their first argument (and the optimizer state) in place and return None. Math runs in
float32 (float64 for float64 storage) whatever the storage dtype; neighbour buffers may have another
dtype than x (e.g. fp32 params mixed with bf16 received buffers). Inputs are contiguous 1-D flat buffers
of equal length on one device; optimizer state is float32.

``disagreement``, when given, is a 1-element float32 tensor that receives sum((mixed - x_old)^2), the
squared distance to the neighbourhood average, computed in the same pass over memory.
"""

from typing import Optional, Sequence

import torch

from . import _native  # noqa: F401  (registers the ops)

_ops = torch.ops.decent_comm

#: Most neighbours one call accepts.
MAX_NEIGHBORS = 32


def gossip_mix_(x: torch.Tensor, neighbors: Sequence[torch.Tensor], self_weight: float,
                weights: Sequence[float], disagreement: Optional[torch.Tensor] = None) -> None:
    """x <- self_weight * x + sum_j weights[j] * neighbors[j]."""
    _ops.gossip_mix_(x, list(neighbors), float(self_weight), [float(w) for w in weights], disagreement)


def mix_sgd_(x, neighbors, self_weight, weights, grad, momentum_buffer, lr, momentum=0.0, dampening=0.0,
             weight_decay=0.0, nesterov=False, first_step=False, disagreement=None) -> None:
    """Gossip mix fused with a torch.optim.SGD step whose direction is computed at x_old (AWC):

    g' = g + weight_decay * x_old; b = momentum * b + (1 - dampening) * g' (b = g' on the first step);
    d = g' + momentum * b if nesterov else b (d = g' when momentum = 0);
    x <- self_weight * x_old + sum_j w_j y_j - lr * d.
    """
    _ops.mix_sgd_(x, list(neighbors), float(self_weight), [float(w) for w in weights], grad, momentum_buffer,
                  float(lr), float(momentum), float(dampening), float(weight_decay), bool(nesterov),
                  bool(first_step), disagreement)


def mix_adam_(x, neighbors, self_weight, weights, grad, exp_avg, exp_avg_sq, step, lr, beta1=0.9,
              beta2=0.999, eps=1e-8, weight_decay=0.0, decoupled=False, disagreement=None) -> None:
    """Gossip mix fused with a torch.optim.Adam (decoupled=False) / AdamW (decoupled=True) step.

    ``step`` is the 1-based count after this update. x <- mix(x_old) - lr * (m_hat / (sqrt(v_hat) + eps)
    [+ weight_decay * x_old if decoupled]); with no neighbours and self_weight = 1 it is one torch step.
    """
    _ops.mix_adam_(x, list(neighbors), float(self_weight), [float(w) for w in weights], grad, exp_avg,
                   exp_avg_sq, int(step), float(lr), float(beta1), float(beta2), float(eps),
                   float(weight_decay), bool(decoupled), disagreement)


def mix_accum_adam_(x, neighbors, self_weight, weights, grad, exp_avg, exp_avg_sq, accum, step, accum_steps,
                    lr, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, decoupled=False,
                    disagreement=None) -> None:
    """Gossip mix fused with an AccumAdam(W) step (Wang et al., ICLR 2025).

    With K = accum_steps and k = ceil(step / K): m = b1*M + (1-b1)*g; v = b2*V + (1-b2)*g^2;
    x <- mix(x_old) - lr * ((m / (1-b1^k)) / (sqrt(v / (1-b2^k)) + eps) [+ decoupled decay]);
    A += g / K; every K steps M, V absorb A (M = b1*M + (1-b1)*A, V = b2*V + (1-b2)*A^2) and A = 0.
    """
    _ops.mix_accum_adam_(x, list(neighbors), float(self_weight), [float(w) for w in weights], grad, exp_avg,
                         exp_avg_sq, accum, int(step), int(accum_steps), float(lr), float(beta1),
                         float(beta2), float(eps), float(weight_decay), bool(decoupled), disagreement)


def has_cuda_kernels() -> bool:
    """True when this build registered CUDA kernels for every op."""
    return _native.built_with_cuda()
