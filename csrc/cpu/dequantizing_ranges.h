// The CPU loops of the fused ops with the 8-bit wire's payloads dequantized inside the mix (PayloadOperands): the
// public copies advance by their payloads in the same call that mixes them, so no separate decode pass re-reads them.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "../kernels/int8_codec_math.h"
#include "fused_ranges.h"

namespace decent_comm {
namespace cpu {

// Any loop of fused_ranges.h with payloads (more than 4 neighbours, payloads that are not all neighbours but the own
// copy, a model that is not float32), run span by span, each span preceded by the advance of the public copies over
// it. A span is 64 KiB of each copy, so the loop reads the new
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

// The 8-bit wire's usual call in one pass: P copies with payloads, then this rank's own copy (K = P + 1, the
// neighbours of MixPlan.as_correction), a float32 model. Each element's copies advance and are mixed in the same
// iteration, so every stream is read sequentially once, with no second loop to switch to. On an AVX-512 EPYC, one
// thread, 16M-64M elements, bench/mix_kernels.py --only int8: 91-101% of the roofline of the op's bytes, where the
// span loop above reached 70-90%. The element math and its order are SinglePass's over the advanced copies, and the
// disagreement is summed in SinglePass's blocks: the same bits as the span loop and the two-pass way.
template <DType XD, typename Update, int P, bool kTracked>
struct DequantizingSinglePass {
  using Result = std::conditional_t<kTracked, double, void>;
  static DC_ALWAYS_INLINE Result run(const void* ctx, int64_t begin, int64_t end) {
    using M = typename Typed<XD, DType::Float32>::M;
    const auto& c = *static_cast<const LoopContext<XD, DType::Float32>*>(ctx);
    const Typed<XD, DType::Float32> t_local = c.t;
    const Hyper<M> h_local = c.h;
    const PayloadOperands& p = c.payloads;
    // The copies are neighbours, held const by Typed; OpCall registered them as outputs of the op.
    float* copies[P];
    const int8_t* levels[P];
    for (int j = 0; j < P; ++j) {
      copies[j] = const_cast<float*>(t_local.neighbors[j]);
      levels[j] = p.levels[j];
    }
    const float* const own = t_local.neighbors[P];
    [[maybe_unused]] double partial = 0.0;
    [[maybe_unused]] M sq[kBlock];
    for (int64_t c0 = begin; c0 < end; c0 += kBlock) {
      const int64_t c1 = std::min(end, c0 + kBlock);
      for (int64_t s0 = c0; s0 < c1;) {  // codec block by codec block: one scale per copy
        const int64_t blk = (p.offset + s0) / p.block;
        const int64_t s1 = std::min(c1, (blk + 1) * p.block - p.offset);
        float scales[P];
        for (int j = 0; j < P; ++j) scales[j] = p.scales[j][blk];
        // No loop-carried dependence: see SinglePass.
#pragma GCC ivdep
        for (int64_t i = s0; i < s1; ++i) {
          const M x_old = static_cast<M>(t_local.x[i]);
          M mixed = t_local.self_weight * x_old;
          for (int j = 0; j < P; ++j) {
            const float copy = int8_dequantize_add(copies[j][i], float(levels[j][i]), scales[j]);
            copies[j][i] = copy;
            mixed += t_local.weights[j] * static_cast<M>(copy);
          }
          mixed += t_local.weights[P] * static_cast<M>(own[i]);
          if constexpr (kTracked) sq[i - c0] = (mixed - x_old) * (mixed - x_old);
          t_local.template update<Update>(h_local, i, x_old, mixed);
        }
        s0 = s1;
      }
      if constexpr (kTracked) add_block_sum(partial, sq, c1 - c0);
    }
    if constexpr (kTracked) return partial;
  }
};

}  // namespace cpu
}  // namespace decent_comm
