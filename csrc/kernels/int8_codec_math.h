// The element math of the 8-bit wire's codec (decent_comm/optim/int8_wire.py), written once for the CPU loops and
// the CUDA kernels.
//
// A block of `block` values d (the change of a public copy, rounded to float32) travels as int8 levels and one
// float32 scale fl(absmax / 127); both ends of an edge then add fl(level * scale) to their copy of the sender. A
// level is fl(d * inverse), inverse = fl(127 / absmax), clamped to -127..127 and rounded to an integer half to
// even; not round(d * 127 / absmax), from which it differs where the rounded inverse moves a product across a half
// (ops.int8_encode_ states every operation). Those copies must stay bit-identical on every device the two ends may
// run on (a CPU rank and a GPU rank, an AVX2 and an SSE2 build), so every operation here is one IEEE float32
// operation with its own rounding: a multiply and an add are never contracted into an FMA (CUDA: the __f*_rn
// intrinsics, which nvcc never fuses; host: the build passes -ffp-contract=off, so g++ does not fuse them even
// under -march=native), the rounding to an integer uses the 1.5 * 2^23 trick in the default rounding mode (exact for
// |v| <= 2^22), a division is IEEE division on both (nvcc's default -prec-div=true), and subnormals are kept: nvcc
// flushes none without -ftz=true, and the CPU loops switch the caller's flush-to-zero and denormals-are-zero modes
// off while they run (cpu/keep_denormals.h).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "fused_math.h"  // DC_HD

namespace decent_comm {

constexpr float kInt8Levels = 127.f;  // symmetric: the zero of a delta is exact
// Largest block one call accepts: the CPU loop keeps one block of deltas on the stack.
constexpr int64_t kInt8MaxBlock = 8192;

DC_HD float int8_mul(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

DC_HD float int8_add(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

DC_HD float int8_sub(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}

// The delta a rank encodes: x - copy, rounded once to float32 (as torch.sub into a float32 output: a float64 x is
// subtracted in float64; bfloat16 and float16 convert to float32 exactly). Beyond float32's range it is +-inf (a
// float64 x of 1e39; 3e38 - (-3e38)): the block's absmax and scale are then inf and its copies NaN, as for an inf x.
DC_HD float int8_delta(float x, float copy) { return int8_sub(x, copy); }
DC_HD float int8_delta(double x, float copy) { return float(x - double(copy)); }

// |v| as the int32 of its bit pattern. For non-negative floats the integer order is the float order, and every NaN
// sorts above inf, so the plain integer maximum of these is a block's absmax with a NaN sticky (the block's scale is
// then NaN, and so is every copy it reaches, which check_finite names), the same whatever order a device reduces in,
// and a reduction compilers vectorize (a float maximum that keeps NaNs is not).
DC_HD int32_t int8_abs_bits(float v) {
#if defined(__CUDA_ARCH__)
  return __float_as_int(v) & 0x7fffffff;
#else
  int32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  return bits & 0x7fffffff;
#endif
}

DC_HD float int8_from_bits(int32_t bits) {
#if defined(__CUDA_ARCH__)
  return __int_as_float(bits);
#else
  float v;
  std::memcpy(&v, &bits, sizeof(v));
  return v;
#endif
}

DC_HD float int8_scale(float absmax) { return absmax / kInt8Levels; }
// 127 / absmax; 0 for an all-zero block (its levels are then all 0) and for a non-finite absmax.
DC_HD float int8_inverse(float absmax) {
  return absmax > 0.f && absmax <= 3.4028234663852886e38f ? kInt8Levels / absmax : 0.f;
}

constexpr float kInt8Round = 12582912.f;  // 1.5 * 2^23: adding and removing it rounds half to even

// The level of one value plus kInt8Round: a float whose low 8 bits of the pattern are the int8 level (two's
// complement; int8_level_byte), and from which int8_level recovers the level as a float.
DC_HD float int8_biased_level(float d, float inverse) {
  float v = int8_mul(d, inverse);
  v = v == v ? v : 0.f;  // d = +-inf in a block whose absmax is inf: the scale makes the block NaN anyway
  v = v > kInt8Levels ? kInt8Levels : v;
  v = v < -kInt8Levels ? -kInt8Levels : v;
  return int8_add(v, kInt8Round);
}

// The same when the block's absmax and inverse are finite: then |d * inverse| <= 127 * (1 + 2^-22), so the clamps
// and the NaN guard above are no-ops and this gives the same bits with fewer instructions (the CPU's fast path).
DC_HD float int8_biased_level_finite(float d, float inverse) { return int8_add(int8_mul(d, inverse), kInt8Round); }
DC_HD bool int8_block_is_finite(float absmax, float inverse) {
  return absmax <= 3.4028234663852886e38f && inverse <= 3.4028234663852886e38f;
}

DC_HD float int8_level(float biased) { return int8_sub(biased, kInt8Round); }

// The int8 of a biased level: for |n| < 2^22, n + 1.5 * 2^23 has the bit pattern 0x4B400000 + n.
DC_HD int8_t int8_level_byte(float biased) { return static_cast<int8_t>(int8_abs_bits(biased) & 0xff); }

// copy + level * scale: the one update both ends of an edge apply.
DC_HD float int8_dequantize_add(float copy, float level, float scale) {
  return int8_add(copy, int8_mul(level, scale));
}

}  // namespace decent_comm
