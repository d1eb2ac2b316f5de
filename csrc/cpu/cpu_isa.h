// Runtime CPU dispatch of the CPU loops, as ATen dispatches its kernels: the extension is compiled for the x86-64
// baseline (SSE2, so one build runs on every x86 CPU), and the hot loop functions are compiled again with
// target("avx2") and target("avx512...") attributes; cpu_isa() picks the best the CPU has, once.
//
// Only functions of our own carry a target attribute (the range loops, with everything they call inlined), never
// code from a header of torch or the standard library, so no AVX2 instance of an inline function can reach a CPU
// without AVX2 through the linker. The math is the same IEEE operations in every variant (no FMA contraction:
// -ffp-contract=off; sums in a fixed order), so every variant gives the same bits, which tests check.
//
// AVX-512 comes in two vector widths, chosen per loop by its Range's `kNarrowVectors` (false when absent): 512-bit
// vectors, or AVX-512's instructions on 256-bit ones (prefer-vector-width=256, GCC's own choice for -march=
// skylake-avx512 and later Intel parts). Measured on an AVX-512 AMD EPYC, one thread, 16M-64M elements, the two
// builds alternated in one session (bench/mix_kernels.py, bench/int8_codec.py, % of the roofline): the plain mix
// streams memory and ran at 88-94% of torch's same-shape kernels with 512-bit vectors, 99-102% with 256-bit ones
// (issue #19 saw the same kind of gap, 1.2-1.35x, on a Xeon), and the encoder at 76-85% against 92-97%; mix_adam_
// ran at 93-117% with 512-bit vectors against 68-95%, and the mixes that dequantize payloads and the decoder gained
// 5-15% from them too. Those runs allocated every operand separately, all at one page offset, which costs the
// narrower loops more (decent_comm/optim/flat_memory.py; the optimizers' buffers now lie apart).
#pragma once

#include <cstdint>

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#define DC_X86_DISPATCH 1
#define DC_TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))
#define DC_TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")))
#define DC_TARGET_AVX512_256 \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,prefer-vector-width=256")))
#else
#define DC_X86_DISPATCH 0
#define DC_TARGET_AVX2
#define DC_TARGET_AVX512
#define DC_TARGET_AVX512_256
#endif
#define DC_ALWAYS_INLINE __attribute__((always_inline)) inline

namespace decent_comm {

enum class CpuIsa : int { Baseline = 0, Avx2 = 1, Avx512 = 2 };

// The instruction set the loops run with: the best this CPU has, or a lower one named by the environment variable
// DECENT_COMM_CPU_ISA (baseline, avx2, avx512; for comparisons and tests). Read once; an unknown name, or one this CPU
// lacks, raises std::invalid_argument naming it.
CpuIsa cpu_isa();
const char* cpu_isa_name(CpuIsa isa);

// A loop over [begin, end) of some operands, compiled once per instruction set: `Range::run(ctx, begin, end)` is an
// always-inline static function, and these are its three compiled copies.
template <typename Range>
typename Range::Result range_baseline(const void* ctx, int64_t begin, int64_t end) {
  return Range::run(ctx, begin, end);
}
template <typename Range>
DC_TARGET_AVX2 typename Range::Result range_avx2(const void* ctx, int64_t begin, int64_t end) {
  return Range::run(ctx, begin, end);
}
template <typename Range>
DC_TARGET_AVX512 typename Range::Result range_avx512(const void* ctx, int64_t begin, int64_t end) {
  return Range::run(ctx, begin, end);
}
template <typename Range>
DC_TARGET_AVX512_256 typename Range::Result range_avx512_256(const void* ctx, int64_t begin, int64_t end) {
  return Range::run(ctx, begin, end);
}

template <typename Range>
constexpr bool narrow_vectors() {
  if constexpr (requires { Range::kNarrowVectors; }) {
    return Range::kNarrowVectors;
  } else {
    return false;
  }
}

// The copy of Range's loop for this CPU.
template <typename Range>
auto pick_range() -> typename Range::Result (*)(const void*, int64_t, int64_t) {
  switch (cpu_isa()) {
#if DC_X86_DISPATCH
    case CpuIsa::Avx512:
      if constexpr (narrow_vectors<Range>()) {
        return &range_avx512_256<Range>;
      } else {
        return &range_avx512<Range>;
      }
    case CpuIsa::Avx2: return &range_avx2<Range>;
#endif
    default: return &range_baseline<Range>;
  }
}

}  // namespace decent_comm
