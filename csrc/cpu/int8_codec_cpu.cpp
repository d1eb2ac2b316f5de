// The CPU loops of the 8-bit wire's codec: one pass over memory per call, blocks spread over the at::parallel_for
// pool. Encode reads x and the copy once (the block's deltas wait in an L1-resident array between the absmax and
// the rounding), writes the levels, the scale and the copy once. The element math is int8_codec_math.h.
//
// The loops are Range structs compiled once per instruction set and picked at run time (cpu_isa.h); the math is
// the same IEEE operations in each, so all give the same bits.
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <stdexcept>

#include "../kernels/int8_codec_launch.h"
#include "../kernels/int8_codec_math.h"
#include "cpu_isa.h"
#include "keep_denormals.h"

namespace decent_comm {
namespace {

// About 32K elements per task, as the mix loops: smaller buffers are not worth waking the pool for.
int64_t grain_blocks(int64_t block) { return std::max<int64_t>(1, 32768 / block); }

DC_ALWAYS_INLINE float as_opmath(float v) { return v; }
DC_ALWAYS_INLINE double as_opmath(double v) { return v; }
DC_ALWAYS_INLINE float as_opmath(c10::BFloat16 v) { return float(v); }
DC_ALWAYS_INLINE float as_opmath(c10::Half v) { return float(v); }

template <typename XT>
DC_ALWAYS_INLINE void encode_blocks(const Int8Codec& c, int64_t first, int64_t last) {
  const XT* const x = static_cast<const XT*>(c.x);
  float delta[kInt8MaxBlock];
  for (int64_t b = first; b < last; ++b) {
    const int64_t start = b * c.block;
    const int64_t len = std::min(c.block, c.numel - start);
    const XT* const xb = x + start;
    float* const copy = c.copy + start;
    int8_t* const levels = c.levels + start;
    // Deltas, and their absmax as an integer maximum of bit patterns (int8_abs_bits), which vectorizes.
    int32_t absmax_bits = 0;
    for (int64_t i = 0; i < len; ++i) {
      delta[i] = int8_delta(as_opmath(xb[i]), copy[i]);
      const int32_t bits = int8_abs_bits(delta[i]);
      absmax_bits = bits > absmax_bits ? bits : absmax_bits;
    }
    const float absmax = int8_from_bits(absmax_bits);
    // The rounding pass below reads no memory beyond L1; ask for the next block now, so its loads overlap that
    // work (without this, one thread reaches half the memory bandwidth: the two passes take turns).
    if (b + 1 < last) {
      const int64_t next = std::min(c.block, c.numel - start - c.block);
      for (int64_t i = 0; i < next; i += 64 / int64_t(sizeof(XT))) __builtin_prefetch(xb + c.block + i);
      for (int64_t i = 0; i < next; i += 16) __builtin_prefetch(copy + c.block + i, 1);
    }
    const float scale = int8_scale(absmax);
    const float inverse = int8_inverse(absmax);
    // Each element depends on element i of each operand only, and the op refuses overlapping operands.
    if (int8_block_is_finite(absmax, inverse)) {
#pragma GCC ivdep
      for (int64_t i = 0; i < len; ++i) {
        const float biased = int8_biased_level_finite(delta[i], inverse);
        levels[i] = int8_level_byte(biased);
        copy[i] = int8_dequantize_add(copy[i], int8_level(biased), scale);
      }
    } else {
      for (int64_t i = 0; i < len; ++i) {
        const float biased = int8_biased_level(delta[i], inverse);
        levels[i] = int8_level_byte(biased);
        copy[i] = int8_dequantize_add(copy[i], int8_level(biased), scale);
      }
    }
    std::fill(levels + len, levels + c.block, int8_t(0));  // the padding of the last block
    c.scales[b] = scale;
  }
}

DC_ALWAYS_INLINE void dequantize_add_blocks(const Int8Codec& c, int64_t first, int64_t last) {
  for (int64_t b = first; b < last; ++b) {
    const int64_t start = b * c.block;
    const int64_t len = std::min(c.block, c.numel - start);
    const float scale = c.scales[b];
    float* const copy = c.copy + start;
    const int8_t* const levels = c.levels + start;
#pragma GCC ivdep
    for (int64_t i = 0; i < len; ++i) copy[i] = int8_dequantize_add(copy[i], float(levels[i]), scale);
  }
}

template <typename XT>
struct EncodeRange {
  using Result = void;
  // 256-bit AVX-512 vectors (cpu_isa.h): 92-97% of the roofline at 16M-64M, one thread, 76-85% with 512-bit ones
  static constexpr bool kNarrowVectors = true;
  static DC_ALWAYS_INLINE void run(const void* c, int64_t first, int64_t last) {
    encode_blocks<XT>(*static_cast<const Int8Codec*>(c), first, last);
  }
};

struct DequantizeAddRange {
  using Result = void;
  static DC_ALWAYS_INLINE void run(const void* c, int64_t first, int64_t last) {
    dequantize_add_blocks(*static_cast<const Int8Codec*>(c), first, last);
  }
};

// Each chunk runs with flush-to-zero and denormals-are-zero off, whatever the calling thread or the pool thread had
// set (keep_denormals.h: the copies must not depend on it). The loop is an indirect call, so the compiler cannot
// move its float operations across the mode switches.
template <typename Range>
void run_blocks(const Int8Codec& c) {
  const auto loop = pick_range<Range>();
  at::parallel_for(0, c.blocks(), grain_blocks(c.block), [&](int64_t first, int64_t last) {
    const cpu::KeepDenormals keep;
    loop(&c, first, last);
  });
}

template <typename XT>
void encode_typed(const Int8Codec& c) { run_blocks<EncodeRange<XT>>(c); }

}  // namespace

void int8_encode_cpu(const Int8Codec& c) {
  switch (c.x_dtype) {
    case DType::Float32: return encode_typed<float>(c);
    case DType::BFloat16: return encode_typed<c10::BFloat16>(c);
    case DType::Float16: return encode_typed<c10::Half>(c);
    case DType::Float64: return encode_typed<double>(c);
  }
  throw std::invalid_argument("decent_comm: unsupported x dtype for int8_encode_");
}

void int8_dequantize_add_cpu(const Int8Codec& c) { run_blocks<DequantizeAddRange>(c); }

}  // namespace decent_comm
