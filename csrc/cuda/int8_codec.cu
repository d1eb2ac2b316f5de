// The CUDA kernels of the 8-bit wire's codec. Encode: one thread block per codec block (its absmax is a block
// reduction); the deltas are recomputed for the rounding pass from x and the copy, which the first pass left in L1/L2
// (a codec block is 4 KiB of them), so global memory sees each operand once. Decode: a grid-stride loop over
// elements. The element math is int8_codec_math.h, shared with the CPU loops, with unfused float operations so the
// copies on a GPU rank and a CPU rank stay bit-identical.
#include <algorithm>

#include "fused_kernels.cuh"  // GpuStorage
#include "../kernels/int8_codec_launch.h"
#include "../kernels/int8_codec_math.h"

namespace decent_comm {
namespace cuda_kernels {
namespace {

constexpr int kCodecThreads = 256;

__device__ __forceinline__ int32_t warp_max(int32_t m) {
  for (int offset = 16; offset > 0; offset >>= 1) m = max(m, __shfl_xor_sync(0xffffffffu, m, offset));
  return m;
}

template <DType XD>
__global__ void __launch_bounds__(kCodecThreads) encode_kernel(Int8Codec c) {
  using XS = GpuStorage<XD>;
  const auto* const x = static_cast<const typename XS::type*>(c.x);
  const int64_t b = blockIdx.x;
  const int64_t start = b * c.block;
  const int len = int(c.numel - start < c.block ? c.numel - start : c.block);
  // The absmax as the integer maximum of the deltas' bit patterns (int8_abs_bits): the CPU loop's result, exactly.
  int32_t m = 0;
  for (int i = threadIdx.x; i < len; i += blockDim.x) {
    m = max(m, int8_abs_bits(int8_delta(XS::load(x[start + i]), c.copy[start + i])));
  }
  __shared__ int32_t warp_maxima[kCodecThreads / 32];
  m = warp_max(m);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) warp_maxima[warp] = m;
  __syncthreads();
  if (warp == 0) {
    m = lane < int(blockDim.x / 32) ? warp_maxima[lane] : 0;
    m = warp_max(m);
    if (lane == 0) warp_maxima[0] = m;
  }
  __syncthreads();
  const float absmax = int8_from_bits(warp_maxima[0]);
  const float scale = int8_scale(absmax);
  const float inverse = int8_inverse(absmax);
  for (int i = threadIdx.x; i < len; i += blockDim.x) {
    const float copy = c.copy[start + i];
    const float biased = int8_biased_level(int8_delta(XS::load(x[start + i]), copy), inverse);
    c.levels[start + i] = int8_level_byte(biased);
    c.copy[start + i] = int8_dequantize_add(copy, int8_level(biased), scale);
  }
  for (int i = len + threadIdx.x; i < c.block; i += blockDim.x) c.levels[start + i] = 0;
  if (threadIdx.x == 0) c.scales[b] = scale;
}

__global__ void __launch_bounds__(kCodecThreads) dequantize_add_kernel(Int8Codec c) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < c.numel; i += stride) {
    c.copy[i] = int8_dequantize_add(c.copy[i], float(c.levels[i]), c.scales[i / c.block]);
  }
}

}  // namespace
}  // namespace cuda_kernels

int int8_encode_cuda(const Int8Codec& c, void* stream_ptr) {
  using namespace cuda_kernels;
  if (c.numel == 0) return int(cudaSuccess);
  const cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  const int64_t blocks = c.blocks();
  if (blocks > 0x7fffffff) return int(cudaErrorInvalidConfiguration);
  switch (c.x_dtype) {
    case DType::Float32: encode_kernel<DType::Float32><<<unsigned(blocks), kCodecThreads, 0, stream>>>(c); break;
    case DType::BFloat16: encode_kernel<DType::BFloat16><<<unsigned(blocks), kCodecThreads, 0, stream>>>(c); break;
    case DType::Float16: encode_kernel<DType::Float16><<<unsigned(blocks), kCodecThreads, 0, stream>>>(c); break;
    default: return int(cudaErrorInvalidValue);  // float64 is CPU-only (the op refuses it first)
  }
  return int(cudaGetLastError());
}

int int8_dequantize_add_cuda(const Int8Codec& c, void* stream_ptr) {
  using namespace cuda_kernels;
  if (c.numel == 0) return int(cudaSuccess);
  const cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  // A few waves of blocks; the grid-stride loop covers the rest.
  const int64_t wanted = (c.numel + kCodecThreads - 1) / kCodecThreads;
  const unsigned grid = unsigned(std::min<int64_t>(wanted, 65536));
  dequantize_add_kernel<<<grid, kCodecThreads, 0, stream>>>(c);
  return int(cudaGetLastError());
}

}  // namespace decent_comm
