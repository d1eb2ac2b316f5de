// Entry points of the 8-bit wire's codec kernels (int8_codec_math.h), one per device, over plain pointers of
// operands that csrc/int8_ops.cpp has validated.
#pragma once

#include <cstdint>

#include "fused_math.h"  // DType

namespace decent_comm {

// A payload is `blocks * block` int8 levels (the tail of the last block zero), then `blocks` float32 scales.
struct Int8Codec {
  int64_t numel = 0;
  int64_t block = 0;
  const void* x = nullptr;     // encode only: the values to send, of x_dtype
  DType x_dtype = DType::Float32;
  float* copy = nullptr;       // the public copy, float32: advanced by the decoded payload
  int8_t* levels = nullptr;    // the payload's levels (written by encode, read by decode)
  float* scales = nullptr;     // the payload's scales

  int64_t blocks() const { return (numel + block - 1) / block; }
};

// payload <- Q(x - copy); copy += deq(payload).
void int8_encode_cpu(const Int8Codec& c);
// copy += deq(payload).
void int8_dequantize_add_cpu(const Int8Codec& c);

// The same on `stream` (a cudaStream_t) of the current device; return a cudaError_t as int (0 = ok).
int int8_encode_cuda(const Int8Codec& c, void* stream);
int int8_dequantize_add_cuda(const Int8Codec& c, void* stream);

}  // namespace decent_comm
