// The CPU loops of the fused gossip-mix ops, as templates over (x dtype, neighbour dtype, update, neighbour count).
//
// Every element's math is the shared per-element formula of fused_math.h; the loops around it are
// written so the compiler vectorizes them without -march flags, and every byte of every operand is read once and
// written at most once. Each loop is compiled for the SSE2 baseline, AVX2 and AVX-512, and the copy for this CPU
// runs (cpu_isa.h). Measured on an AVX2 EPYC, one thread, 16M-64M elements: the baseline loops of mix_adam_ reach
// 55-75% of the bandwidth of the torch kernel with the same streams, the AVX2 ones 98-105% (bench/mix_kernels.py).
// Each update kind is instantiated in a translation unit of its own (fused_<update>_cpu.cpp), so the build compiles
// them in parallel; fused_mix_cpu.cpp picks one per call.
// The extension is compiled with -fopenmp: at::parallel_for is header code, and without OpenMP in the translation
// unit it would run on one thread.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <functional>
#include <stdexcept>
#include <type_traits>

#include "../kernels/fused_launch.h"
#include "../kernels/int8_codec_math.h"
#include "cpu_isa.h"

namespace decent_comm {
namespace cpu {

constexpr int64_t kBlock = 512;
// Small buffers are not worth waking the thread pool for.
constexpr int64_t kGrain = 32768;

template <DType D> struct CpuStorage;
template <> struct CpuStorage<DType::Float32> { using type = float; using opmath = float; };
template <> struct CpuStorage<DType::Float64> { using type = double; using opmath = double; };
template <> struct CpuStorage<DType::BFloat16> { using type = c10::BFloat16; using opmath = float; };
template <> struct CpuStorage<DType::Float16> { using type = c10::Half; using opmath = float; };

// Typed view of the operands, converted once per call.
template <DType XD, DType ND>
struct Typed {
  using XT = typename CpuStorage<XD>::type;
  using NT = typename CpuStorage<ND>::type;
  using M = typename CpuStorage<XD>::opmath;
  XT* x;
  const XT* grad;
  const NT* neighbors[kMaxNeighbors];
  M weights[kMaxNeighbors];
  M self_weight;
  int k;
  float* const* state;

  explicit Typed(const FusedOperands& o)
      : x(static_cast<XT*>(o.x)), grad(static_cast<const XT*>(o.grad)), self_weight(M(o.self_weight)),
        k(o.num_neighbors), state(o.state) {
    for (int j = 0; j < k; ++j) {
      neighbors[j] = static_cast<const NT*>(o.neighbors[j]);
      weights[j] = M(o.weights[j]);
    }
  }

  // self_weight * x_old + sum_j w_j * neighbour_j[i] over a compile-time number of neighbours (the single-pass
  // loops; run_blocked accumulates neighbour by neighbour instead). Always inlined: a call left in the loop body
  // (GCC's inliner gives up on some of the large instantiations) would keep the loop scalar.
  template <int K>
  __attribute__((always_inline)) inline M mixed_at(int64_t i, M x_old) const {
    M mixed = self_weight * x_old;
    for (int j = 0; j < K; ++j) mixed += weights[j] * static_cast<M>(neighbors[j][i]);
    return mixed;
  }

  // The local update of element i, given its old value and its mixed value.
  template <typename Update>
  DC_ALWAYS_INLINE void update(const Hyper<M>& h, int64_t i, M x_old, M mixed) const {
    M s[kMaxState];
    for (int q = 0; q < Update::kNumState; ++q) s[q] = M(state[q][i]);
    const M g = Update::kHasGrad ? unscale_grad(h, static_cast<M>(grad[i])) : M(0);
    x[i] = static_cast<XT>(Update::apply(h, x_old, mixed, g, s));
    for (int q = 0; q < Update::kNumState; ++q) state[q][i] = float(s[q]);
  }
};

// The loops below are Range structs (cpu_isa.h): an always-inline run(ctx, begin, end) over the operands in ctx,
// compiled once per instruction set, and the copy for this CPU runs on the at::parallel_for pool.
template <DType XD, DType ND>
struct LoopContext {
  using M = typename Typed<XD, ND>::M;
  Typed<XD, ND> t;
  Hyper<M> h;
  bool want_disagreement;
  PayloadOperands payloads;
  LoopContext(const FusedOperands& o, const HyperParams& hp)
      : t(o), h(hp), want_disagreement(o.disagreement != nullptr), payloads(o.payloads) {}
};

// One pass per element with a compile-time neighbour count: the common case (one-peer, ring, exp
// topologies), with no intermediate buffer.
template <DType XD, DType ND, typename Update, int K>
struct SinglePass {
  using Result = void;
  static DC_ALWAYS_INLINE void run(const void* ctx, int64_t begin, int64_t end) {
    using M = typename Typed<XD, ND>::M;
    const auto& c = *static_cast<const LoopContext<XD, ND>*>(ctx);
    // Local copies: the compiler can then prove the state stores do not alias the hyper-parameters
    // and pointers, hoist them out of the loop, and vectorize it.
    const Typed<XD, ND> t_local = c.t;
    const Hyper<M> h_local = c.h;
    // Element i depends on element i of each operand only, and ops.cpp refuses shifted (partially
    // overlapping) operands, so there is no loop-carried dependence. Without this hint GCC vectorizes only
    // behind runtime alias checks, and gives up when the pointers are many (mix_adam_ with k = 2: 6 streams,
    // 3 of them written), running at a third of the memory bandwidth.
#pragma GCC ivdep
    for (int64_t i = begin; i < end; ++i) {
      const M x_old = static_cast<M>(t_local.x[i]);
      t_local.template update<Update>(h_local, i, x_old, t_local.template mixed_at<K>(i, x_old));
    }
  }
};

// The single pass with the disagreement output, sum((mixed - x_old)^2): per block of kBlock elements the main
// loop (the same as SinglePass) also stores d^2 into an L1-resident block, which a second, short loop sums
// in eight independent lanes; blocks add up in double, so precision does not depend on the buffer length. (An
// `omp simd reduction` in the main loop left mix_adam_ scalar, 3x slower.) The order of every addition is fixed by
// the source, so each instruction set gives the same sum.
template <DType XD, DType ND, typename Update, int K>
struct SinglePassTracked {
  using Result = double;
  static DC_ALWAYS_INLINE double run(const void* ctx, int64_t begin, int64_t end) {
    using M = typename Typed<XD, ND>::M;
    const auto& c = *static_cast<const LoopContext<XD, ND>*>(ctx);
    const Typed<XD, ND> t_local = c.t;
    const Hyper<M> h_local = c.h;
    double partial = 0.0;
    M sq[kBlock];
    for (int64_t b0 = begin; b0 < end; b0 += kBlock) {
      const int64_t len = std::min(kBlock, end - b0);
      // No loop-carried dependence: see SinglePass.
#pragma GCC ivdep
      for (int64_t i = 0; i < len; ++i) {
        const M x_old = static_cast<M>(t_local.x[b0 + i]);
        const M mixed = t_local.template mixed_at<K>(b0 + i, x_old);
        sq[i] = (mixed - x_old) * (mixed - x_old);
        t_local.template update<Update>(h_local, b0 + i, x_old, mixed);
      }
      M lanes[8] = {};
      for (int64_t i = 0; i < len; ++i) lanes[i & 7] += sq[i];
      for (M lane : lanes) partial += double(lane);
    }
    return partial;
  }
};

// More than 4 neighbours, with or without the disagreement output: the buffer is cut into blocks of kBlock
// elements that stay in L1; the mix is accumulated neighbour by neighbour into an opmath block (simple loops that
// vectorize), then the update pass writes x and the state. Each operand is still read once from memory.
template <DType XD, DType ND, typename Update>
struct Blocked {
  using Result = double;
  static DC_ALWAYS_INLINE double run(const void* ctx, int64_t begin, int64_t end) {
    using M = typename Typed<XD, ND>::M;
    const auto& c = *static_cast<const LoopContext<XD, ND>*>(ctx);
    const Typed<XD, ND>& t = c.t;
    double partial = 0.0;
    M x_old[kBlock];
    M mixed[kBlock];
    for (int64_t b0 = begin; b0 < end; b0 += kBlock) {
      const int64_t len = std::min(kBlock, end - b0);
      for (int64_t i = 0; i < len; ++i) {
        x_old[i] = static_cast<M>(t.x[b0 + i]);
        mixed[i] = t.self_weight * x_old[i];
      }
      for (int j = 0; j < t.k; ++j) {
        const auto* const yb = t.neighbors[j] + b0;
        const M w = t.weights[j];
        for (int64_t i = 0; i < len; ++i) mixed[i] += w * static_cast<M>(yb[i]);
      }
      if (c.want_disagreement) {
        // Eight independent partial sums keep the reduction off one serial add chain.
        M lanes[8] = {};
        for (int64_t i = 0; i < len; ++i) {
          const M d = mixed[i] - x_old[i];
          lanes[i & 7] += d * d;
        }
        for (M lane : lanes) partial += double(lane);
      }
#pragma GCC ivdep
      for (int64_t i = 0; i < len; ++i) t.template update<Update>(c.h, b0 + i, x_old[i], mixed[i]);
    }
    return partial;
  }
};

// The 8-bit wire's payloads dequantized inside the mix (PayloadOperands): any loop above, run span by span, each span
// preceded by the advance of the public copies over it. A span is 64 KiB of each copy, so the loop reads the new
// values back from L2, and memory sees every copy once (read and written) and every level once, as the separate
// decode pass alone would. The element math is the codec's (int8_dequantize_add): the copies get the bits
// int8_dequantize_add_ gives them, and the mix reads the same values as after that op. Span length, measured on
// the AVX2 EPYC (bench/mix_kernels.py, 16M elements, one thread, % of the roofline of the op's bytes): 512-8192
// elements 80-93% (every switch between the two loops restarts the hardware prefetchers of the other's streams;
// software prefetching the next span did worse), 16384-131072 91-101%.
constexpr int64_t kDequantizeSpan = 16384;

template <typename Inner, DType XD>
struct Dequantizing {
  using Result = typename Inner::Result;
  static DC_ALWAYS_INLINE Result run(const void* ctx, int64_t begin, int64_t end) {
    const auto& c = *static_cast<const LoopContext<XD, DType::Float32>*>(ctx);
    [[maybe_unused]] double sum = 0.0;
    for (int64_t s0 = begin; s0 < end; s0 += kDequantizeSpan) {
      const int64_t s1 = std::min(end, s0 + kDequantizeSpan);
      for (int j = 0; j < c.payloads.count; ++j) advance_copy(c, j, s0, s1);
      if constexpr (std::is_void_v<Result>) {
        Inner::run(ctx, s0, s1);
      } else {
        sum += Inner::run(ctx, s0, s1);
      }
    }
    if constexpr (!std::is_void_v<Result>) return sum;
  }

  // copy j += deq(payload j) over [s0, s1), codec block by codec block (one scale each).
  static DC_ALWAYS_INLINE void advance_copy(const LoopContext<XD, DType::Float32>& c, int j, int64_t s0, int64_t s1) {
    const PayloadOperands& p = c.payloads;
    // The copies are neighbours, held const by the loops; OpCall registered them as outputs of the op.
    float* const copy = const_cast<float*>(c.t.neighbors[j]);
    const int8_t* const levels = p.levels[j];
    for (int64_t b0 = s0; b0 < s1;) {
      const int64_t blk = (p.offset + b0) / p.block;
      const int64_t b1 = std::min(s1, (blk + 1) * p.block - p.offset);
      const float scale = p.scales[j][blk];
#pragma GCC ivdep
      for (int64_t i = b0; i < b1; ++i) copy[i] = int8_dequantize_add(copy[i], float(levels[i]), scale);
      b0 = b1;
    }
  }
};

// The copy of `Range` for this CPU, dequantizing payloads first when the call has any (float32 neighbours only: the
// copies are float32, and all neighbours share one dtype).
template <typename Range, DType XD, DType ND>
auto pick_loop(const FusedOperands& o) {
  if constexpr (ND == DType::Float32) {
    if (o.payloads.count > 0) return pick_range<Dequantizing<Range, XD>>();
  }
  if (o.payloads.count > 0) throw std::invalid_argument("decent_comm: payloads need float32 neighbours");
  return pick_range<Range>();
}

template <DType XD, DType ND, typename Update, int K>
void run_single_pass(const FusedOperands& o, const HyperParams& hp) {
  const LoopContext<XD, ND> ctx(o, hp);
  const auto loop = pick_loop<SinglePass<XD, ND, Update, K>, XD, ND>(o);
  at::parallel_for(0, o.numel, kGrain, [&](int64_t begin, int64_t end) { loop(&ctx, begin, end); });
}

// The loops with a disagreement output (or none, for Blocked), summed over the pool's chunks in double.
template <typename Range, DType XD, DType ND>
void run_reduced(const FusedOperands& o, const HyperParams& hp) {
  const LoopContext<XD, ND> ctx(o, hp);
  const auto loop = pick_loop<Range, XD, ND>(o);
  const double disagreement = at::parallel_reduce(
      0, o.numel, kGrain, 0.0,
      [&](int64_t begin, int64_t end, double partial) { return partial + loop(&ctx, begin, end); },
      std::plus<double>());
  if (o.disagreement != nullptr) *o.disagreement = float(disagreement);
}

template <DType XD, DType ND, typename Update>
void run_blocked(const FusedOperands& o, const HyperParams& hp) {
  run_reduced<Blocked<XD, ND, Update>, XD, ND>(o, hp);
}

template <DType XD, DType ND, typename Update, int K>
void run_fixed_k(const FusedOperands& o, const HyperParams& hp) {
  if (o.disagreement == nullptr) return run_single_pass<XD, ND, Update, K>(o, hp);
  run_reduced<SinglePassTracked<XD, ND, Update, K>, XD, ND>(o, hp);
}

template <DType XD, DType ND, typename Update>
void run_typed(const FusedOperands& o, const HyperParams& hp) {
  switch (o.num_neighbors) {
    case 0: return run_fixed_k<XD, ND, Update, 0>(o, hp);
    case 1: return run_fixed_k<XD, ND, Update, 1>(o, hp);
    case 2: return run_fixed_k<XD, ND, Update, 2>(o, hp);
    case 3: return run_fixed_k<XD, ND, Update, 3>(o, hp);
    case 4: return run_fixed_k<XD, ND, Update, 4>(o, hp);
    default: return run_blocked<XD, ND, Update>(o, hp);
  }
}

// The (x, neighbour) dtype pairs the optimizers use get the single-pass loops specialized per neighbour count:
// equal dtypes, and a float32 model over a 16-bit wire. Every other pair is valid but rare (a float64 model over a
// float32 wire, say) and runs the blocked loop, which takes any count: the same math in the same order, and 11 fewer
// instantiations per pair, which is most of the build time of these kernels.
template <DType XD, DType ND>
constexpr bool kSpecialized = XD == ND || (XD == DType::Float32 && (ND == DType::BFloat16 || ND == DType::Float16));

template <DType XD, DType ND, typename Update>
void run_pair(const FusedOperands& o, const HyperParams& hp) {
  if constexpr (kSpecialized<XD, ND>) {
    run_typed<XD, ND, Update>(o, hp);
  } else {
    run_blocked<XD, ND, Update>(o, hp);
  }
}

template <DType XD, typename Update>
void dispatch_neighbor(const FusedOperands& o, const HyperParams& hp) {
  switch (o.neighbor_dtype) {
    case DType::Float32: return run_pair<XD, DType::Float32, Update>(o, hp);
    case DType::BFloat16: return run_pair<XD, DType::BFloat16, Update>(o, hp);
    case DType::Float16: return run_pair<XD, DType::Float16, Update>(o, hp);
    case DType::Float64: return run_pair<XD, DType::Float64, Update>(o, hp);
  }
  throw std::invalid_argument("decent_comm: unsupported neighbor dtype");
}

template <typename Update>
void dispatch_x(const FusedOperands& o, const HyperParams& hp) {
  switch (o.x_dtype) {
    case DType::Float32: return dispatch_neighbor<DType::Float32, Update>(o, hp);
    case DType::BFloat16: return dispatch_neighbor<DType::BFloat16, Update>(o, hp);
    case DType::Float16: return dispatch_neighbor<DType::Float16, Update>(o, hp);
    case DType::Float64: return dispatch_neighbor<DType::Float64, Update>(o, hp);
  }
  throw std::invalid_argument("decent_comm: unsupported x dtype");
}

}  // namespace cpu
}  // namespace decent_comm
