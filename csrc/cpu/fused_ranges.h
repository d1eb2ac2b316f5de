// The CPU loops of the fused gossip-mix ops over plain operands, as Range structs (cpu_isa.h) templated over (x dtype,
// neighbour dtype, update, neighbour count); fused_loops.h picks one per call.
//
// Every element's math is the shared per-element formula of fused_math.h; the loops around it are
// written so the compiler vectorizes them without -march flags, and every byte of every operand is read once and
// written at most once. Each loop is compiled for the SSE2 baseline, AVX2 and AVX-512, and the copy for this CPU
// runs (cpu_isa.h). Measured on an AVX2 EPYC, one thread, 16M-64M elements: the baseline loops of mix_adam_ reach
// 55-75% of the bandwidth of the torch kernel with the same streams, the AVX2 ones 98-105% (bench/mix_kernels.py).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "../kernels/fused_launch.h"
#include "cpu_isa.h"

namespace decent_comm {
namespace cpu {

constexpr int64_t kBlock = 512;

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

// partial += sum of sq[0, len) (a block's squared changes), in eight independent lanes (no serial add chain), then
// lane by lane in double: a fixed order, so every instruction set gives the same sum.
template <typename M>
DC_ALWAYS_INLINE void add_block_sum(double& partial, const M* sq, int64_t len) {
  M lanes[8] = {};
  for (int64_t i = 0; i < len; ++i) lanes[i & 7] += sq[i];
  for (M lane : lanes) partial += double(lane);
}

// One pass per element with a compile-time neighbour count: the common case (one-peer, ring, exp topologies), with no
// intermediate buffer. With kTracked it also returns the disagreement, sum((mixed - x_old)^2): per block of kBlock
// elements the main loop also stores d^2 into an L1-resident block, which a second, short loop sums in eight
// independent lanes; blocks add up in double, so precision does not depend on the buffer length. (An `omp simd
// reduction` in the main loop left mix_adam_ scalar, 3x slower.) The order of every addition is fixed by the source,
// so each instruction set gives the same sum.
template <DType XD, DType ND, typename Update, int K, bool kTracked>
struct SinglePass {
  using Result = std::conditional_t<kTracked, double, void>;
  // The plain mix over neighbours of x's dtype only streams memory: 256-bit AVX-512 vectors (cpu_isa.h).
  static constexpr bool kNarrowVectors = std::is_same_v<Update, MixUpdate> && XD == ND;
  static DC_ALWAYS_INLINE Result run(const void* ctx, int64_t begin, int64_t end) {
    using M = typename Typed<XD, ND>::M;
    const auto& c = *static_cast<const LoopContext<XD, ND>*>(ctx);
    // Local copies: the compiler can then prove the state stores do not alias the hyper-parameters
    // and pointers, hoist them out of the loop, and vectorize it.
    const Typed<XD, ND> t_local = c.t;
    const Hyper<M> h_local = c.h;
    [[maybe_unused]] double partial = 0.0;
    [[maybe_unused]] M sq[kBlock];
    for (int64_t b0 = begin; b0 < end; b0 += kBlock) {
      const int64_t b1 = std::min(end, b0 + kBlock);
      // Element i depends on element i of each operand only, and ops.cpp refuses shifted (partially
      // overlapping) operands, so there is no loop-carried dependence. Without this hint GCC vectorizes only
      // behind runtime alias checks, and gives up when the pointers are many (mix_adam_ with k = 2: 6 streams,
      // 3 of them written), running at a third of the memory bandwidth.
#pragma GCC ivdep
      for (int64_t i = b0; i < b1; ++i) {
        const M x_old = static_cast<M>(t_local.x[i]);
        const M mixed = t_local.template mixed_at<K>(i, x_old);
        if constexpr (kTracked) sq[i - b0] = (mixed - x_old) * (mixed - x_old);
        t_local.template update<Update>(h_local, i, x_old, mixed);
      }
      if constexpr (kTracked) add_block_sum(partial, sq, b1 - b0);
    }
    if constexpr (kTracked) return partial;
  }
};

// More than 4 neighbours, with or without the disagreement output: the buffer is cut into blocks of kBlock
// elements that stay in L1; the mix is accumulated neighbour by neighbour into an opmath block (simple loops that
// vectorize), then the update pass writes x and the state. Each operand is still read once from memory.
template <DType XD, DType ND, typename Update>
struct Blocked {
  using Result = double;
  // The plain mix over neighbours of x's dtype only streams memory: 256-bit AVX-512 vectors (cpu_isa.h).
  static constexpr bool kNarrowVectors = std::is_same_v<Update, MixUpdate> && XD == ND;
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

}  // namespace cpu
}  // namespace decent_comm
