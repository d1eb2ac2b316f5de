// The element-wise math of every fused gossip-mix op, written once.
//
// This header is compiled by g++ for the CPU kernels and by nvcc for the CUDA kernels, so the CPU tests
// check exactly the formulas the GPU runs. It includes nothing from torch: the CUDA translation units
// that include it must stay light (nvcc spends minutes on torch/extension.h).
//
// Every op has the shape
//     mixed  = self_weight * x_old + sum_j weights[j] * neighbor_j          (the gossip average)
//     x_new  = Update::apply(hyper, x_old, mixed, grad, state...)           (the local optimizer step)
// computed in "opmath" M (float, or double for float64 storage) whatever the storage dtype.
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define DC_HD __host__ __device__ __forceinline__
#else
#define DC_HD inline
#endif

namespace decent_comm {

// Largest number of neighbour buffers one op call accepts. Pointers and weights travel by value in the
// CUDA kernel arguments (32 * 12 bytes), far below the 4 KiB kernel-parameter limit.
constexpr int kMaxNeighbors = 32;
// Largest number of float32 state buffers an update carries (AccumAdam: M, V, A).
constexpr int kMaxState = 3;

// Storage dtypes the kernels understand. Float64 is CPU-only.
enum class DType : int { Float32 = 0, BFloat16 = 1, Float16 = 2, Float64 = 3 };

enum class UpdateKind : int { Mix = 0, Sgd = 1, SgdMomentum = 2, Adam = 3, AccumAdam = 4 };

// Hyper-parameters of every update, filled on the host in double precision. The step-dependent ones (bias
// corrections, the AccumAdam flush, SGD's first step) come from set_step_count: on the host once per call, as
// torch.optim does, or in the kernel when the count lives in device memory (device_scalars.h).
struct HyperParams {
  double lr = 0, weight_decay = 0;
  // SGD
  double momentum = 0, dampening = 0;
  bool nesterov = false, first_step = false;
  // Adam / AccumAdam
  double beta1 = 0, beta2 = 0, eps = 0;
  double step_size = 0;  // lr / (1 - beta1^k)   (k = the step t, or the window count for AccumAdam)
  double bc2_sqrt = 1;   // sqrt(1 - beta2^k)
  bool decoupled = false;
  // AccumAdam (1 for every other update, which makes the window count k equal to t)
  int64_t accum_steps = 1;  // K
  bool flush = false;       // t % K == 0: fold the accumulated gradient into M and V
  // AMP: gradients are multiplied by this (1 / GradScaler's scale, rounded to float32 as GradScaler.unscale_ does)
  double inv_grad_scale = 1;
};

// Fills the step-dependent hyper-parameters of update number t >= 1. Adam's bias corrections count the updates;
// AccumAdam's count the windows k = ceil(t / K), since M and V move once per window (K = 1 gives k = t). Integer
// arithmetic throughout, so any t up to 2^63 - 1 is exact (t + K - 1 would overflow there).
DC_HD void set_step_count(HyperParams& p, int64_t t) {
  const int64_t k = t / p.accum_steps + (t % p.accum_steps != 0 ? 1 : 0);
  p.step_size = p.lr / (1 - ::pow(p.beta1, double(k)));
  p.bc2_sqrt = ::sqrt(1 - ::pow(p.beta2, double(k)));
  p.flush = t % p.accum_steps == 0;
  p.first_step = t == 1;
}

// The same hyper-parameters, cast once to the opmath type the kernel computes in.
// The flags are folded into coefficients here (l2_decay, decoupled_decay) so the per-element formulas
// have no branches the CPU vectorizer would have to give up on.
template <typename M>
struct Hyper {
  M lr, weight_decay, momentum, dampening, beta1, beta2, eps, step_size, bc2_sqrt, accum_steps, inv_grad_scale;
  // 1 - beta1, 1 - beta2, 1 - dampening, taken in double before the cast as torch.optim takes them: in float,
  // 1 - float(0.9999) is 1e-4 off by 6e-5 of itself, a bias of every Adam update that torch does not have.
  M one_minus_beta1, one_minus_beta2, one_minus_dampening;
  M l2_decay;         // weight_decay folded into the gradient (Adam, AccumAdam), else 0
  M decoupled_decay;  // lr * weight_decay applied to x_old (AdamW, AccumAdamW), else 0
  bool nesterov, first_step, flush;

  Hyper() = default;
  DC_HD explicit Hyper(const HyperParams& p)
      : lr(M(p.lr)), weight_decay(M(p.weight_decay)), momentum(M(p.momentum)),
        dampening(M(p.dampening)), beta1(M(p.beta1)), beta2(M(p.beta2)), eps(M(p.eps)),
        step_size(M(p.step_size)), bc2_sqrt(M(p.bc2_sqrt)), accum_steps(M(p.accum_steps)),
        inv_grad_scale(M(p.inv_grad_scale)), one_minus_beta1(M(1.0 - p.beta1)), one_minus_beta2(M(1.0 - p.beta2)),
        one_minus_dampening(M(1.0 - p.dampening)), l2_decay(p.decoupled ? M(0) : M(p.weight_decay)),
        decoupled_decay(p.decoupled ? M(p.lr * p.weight_decay) : M(0)),
        nesterov(p.nesterov), first_step(p.first_step), flush(p.flush) {}
};

// The gradient an update sees: the stored one, unscaled (a multiplication by 1 when there is no GradScaler, which
// leaves every value, NaN and infinities included, as it was).
template <typename M>
DC_HD M unscale_grad(const Hyper<M>& h, M g) { return g * h.inv_grad_scale; }

DC_HD float dc_sqrt(float v) { return ::sqrtf(v); }
DC_HD double dc_sqrt(double v) { return ::sqrt(v); }

// g + decay * x and y - decay * x, or g and y unchanged when decay is 0, as torch.optim skips a weight decay of 0:
// 0 * x is NaN for an infinite x, which would reach the optimizer state (torch leaves an infinite parameter
// infinite and its state finite). A select on a coefficient that is the same for every element, so loops stay
// vectorized; finite values give the same bits either way (up to the sign of a zero).
template <typename M>
DC_HD M with_decay(M g, M decay, M x) { return decay != M(0) ? g + decay * x : g; }
template <typename M>
DC_HD M without_decay(M y, M decay, M x) { return decay != M(0) ? y - decay * x : y; }

// ---- Updates. Each: kHasGrad, kNumState, and apply(h, x_old, mixed, g, s) -> x_new, updating s[]. ----

// Pure gossip averaging: x_new = mixed.
struct MixUpdate {
  static constexpr bool kHasGrad = false;
  static constexpr int kNumState = 0;
  template <typename M>
  static DC_HD M apply(const Hyper<M>&, M, M mixed, M, M*) { return mixed; }
};

// torch.optim.SGD direction without momentum: d = g + wd * x_old.
struct SgdUpdate {
  static constexpr bool kHasGrad = true;
  static constexpr int kNumState = 0;
  template <typename M>
  static DC_HD M apply(const Hyper<M>& h, M x_old, M mixed, M g, M*) {
    return mixed - h.lr * with_decay(g, h.weight_decay, x_old);
  }
};

// torch.optim.SGD with momentum buffer b (s[0]):
//   g' = g + wd*x_old;  b = g' on the first step, else momentum*b + (1-dampening)*g';
//   d = g' + momentum*b (nesterov) or b.
struct SgdMomentumUpdate {
  static constexpr bool kHasGrad = true;
  static constexpr int kNumState = 1;
  template <typename M>
  static DC_HD M apply(const Hyper<M>& h, M x_old, M mixed, M g, M* s) {
    g = with_decay(g, h.weight_decay, x_old);
    const M b = h.first_step ? g : h.momentum * s[0] + h.one_minus_dampening * g;
    s[0] = b;
    const M d = h.nesterov ? g + h.momentum * b : b;
    return mixed - h.lr * d;
  }
};

// torch.optim.Adam (decoupled=false: L2 decay folded into g) / AdamW (decoupled=true: decay of x_old).
// s[0] = exp_avg m, s[1] = exp_avg_sq v.
struct AdamUpdate {
  static constexpr bool kHasGrad = true;
  static constexpr int kNumState = 2;
  template <typename M>
  static DC_HD M apply(const Hyper<M>& h, M x_old, M mixed, M g, M* s) {
    g = with_decay(g, h.l2_decay, x_old);
    // torch: exp_avg.lerp_(g, 1 - beta1), in lerp's form for weights < 0.5. (torch switches to the form exact at
    // weight 1 from 0.5 on; here that costs 3-8 registers in the half-precision kernels, so for beta1 <= 0.5 and
    // |g| << |exp_avg| m carries an absolute error of an ulp of exp_avg.)
    const M m = s[0] + h.one_minus_beta1 * (g - s[0]);
    const M v = h.beta2 * s[1] + h.one_minus_beta2 * g * g;
    s[0] = m;
    s[1] = v;
    return without_decay(mixed - h.step_size * m / (dc_sqrt(v) / h.bc2_sqrt + h.eps), h.decoupled_decay, x_old);
  }
};

// AccumAdam / AccumAdamW (Wang et al., ICLR 2025). s[0] = M, s[1] = V, s[2] = A (gradient accumulator).
// The direction uses one-step look-ahead moments m, v built from the slow moments M, V; M and V only move
// every K steps, with the mean gradient of the window, which damps the drift decentralization adds.
struct AccumAdamUpdate {
  static constexpr bool kHasGrad = true;
  static constexpr int kNumState = 3;
  template <typename M>
  static DC_HD M apply(const Hyper<M>& h, M x_old, M mixed, M g, M* s) {
    g = with_decay(g, h.l2_decay, x_old);
    const M m = h.beta1 * s[0] + h.one_minus_beta1 * g;
    const M v = h.beta2 * s[1] + h.one_minus_beta2 * g * g;
    const M x = without_decay(mixed - h.step_size * m / (dc_sqrt(v) / h.bc2_sqrt + h.eps), h.decoupled_decay, x_old);
    const M a = s[2] + g / h.accum_steps;
    // Selects rather than an if-block, so the loop around this stays branch-free (vectorizable).
    const M slow_m = h.beta1 * s[0] + h.one_minus_beta1 * a;
    const M slow_v = h.beta2 * s[1] + h.one_minus_beta2 * a * a;
    s[0] = h.flush ? slow_m : s[0];
    s[1] = h.flush ? slow_v : s[1];
    s[2] = h.flush ? M(0) : a;
    return x;
  }
};

}  // namespace decent_comm
