// float16 conversions of the emulated CUDA device (shim/cuda_runtime.h): GCC's _Float16, whose conversions are IEEE
// round to nearest even, like CUDA's and c10::Half's. (c10's header cannot be used here: with __CUDA_ARCH__ defined it
// calls the device intrinsics.)
#pragma once

#include <cstring>

#include "cuda_runtime.h"

struct __half {
  unsigned short bits;
};

inline float __half2float(__half h) {
  _Float16 v;
  std::memcpy(&v, &h.bits, sizeof(v));
  return static_cast<float>(v);
}
inline __half __float2half_rn(float f) {
  const _Float16 v = static_cast<_Float16>(f);
  __half h;
  std::memcpy(&h.bits, &v, sizeof(v));
  return h;
}
inline __half __ushort_as_half(unsigned short bits) { return {bits}; }
inline unsigned short __half_as_ushort(__half h) { return h.bits; }
