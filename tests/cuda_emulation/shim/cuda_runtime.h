// The part of the CUDA runtime and device API that csrc/cuda uses, emulated on the CPU, so the tests can execute the
// kernels' own code (tests/cuda_emulation/run.py compiles csrc/cuda/*.cu with g++ against this header).
//
// A launch runs its blocks one after another on the calling thread; the threads of a block are fibers
// (emulated_runtime.cpp) that switch only at __syncthreads and at warp shuffles, which are real barriers: a thread
// waits there until every live thread of its block (warp) has arrived, and a barrier no live thread can reach is
// reported as a deadlock, like a divergent __syncthreads on a GPU. Between barriers the threads run in turn, upwards
// in even blocks and downwards in odd ones, so a missing barrier shows whichever thread reads. Shared memory is a
// static variable (one block runs at a time), atomics are plain read-modify-writes (one thread runs at a time),
// streams are synchronous.
// Shared memory is filled with 0x7f bytes (a huge float, a huge int) when a block first reaches its declaration
// (run.py adds the call), so a read of a slot no thread wrote shows as on a GPU's garbage.
// What this cannot show: timing, occupancy, races between blocks, the effects of FMA contraction (nvcc contracts
// a * b + c where the sources leave it; g++ here does not: -ffp-contract=off), host and device pointers confused (one
// memory here, and streams are synchronous), partial-mask shuffles (refused), and anything NCCL does.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <tuple>
#include <type_traits>
#include <utility>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __grid_constant__
#define __shared__ static

// The values of the real runtime's enum, so codes stay meaningful in messages and tests.
enum cudaError_t {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorLaunchOutOfResources = 7,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorInvalidDevice = 101,
  cudaErrorLaunchFailure = 719,
};
enum cudaDeviceAttr { cudaDevAttrMultiProcessorCount = 16 };
struct CUstream_st;
using cudaStream_t = CUstream_st*;

struct dc_emu_index {
  unsigned x = 0, y = 0, z = 0;
};
extern thread_local dc_emu_index threadIdx, blockIdx, blockDim, gridDim;

namespace dc_emu {

// The emulated device: what the occupancy and attribute queries answer. Small on purpose, so a buffer of a few
// thousand elements already needs the grid-stride loops' second and later rounds.
constexpr int kMultiprocessors = 3;
constexpr int kBlocksPerMultiprocessor = 2;

// Runs `thread_body` once per thread of a grid of `grid` x `block` threads (blocks in order, each block's threads as
// fibers). Returns cudaSuccess, cudaErrorInvalidConfiguration for an empty or oversized launch, or
// cudaErrorLaunchFailure after a deadlocked barrier or a shuffle over exited lanes (the reason: last_failure()).
cudaError_t run_grid(unsigned grid, unsigned block, const std::function<void()>& thread_body);
const char* last_failure();
void set_last_error(cudaError_t err);

void sync_threads();
// Lane `src` of the calling warp's values (all 32 lanes must take part, as with a full mask on a GPU; another mask is
// reported as a launch failure).
uint64_t exchange_in_warp(uint64_t bits, unsigned src_lane, unsigned mask);
// The first thread of a block to declare a __shared__ variable fills it with 0x7f bytes.
void poison_shared(void* p, size_t bytes);

// With DC_EMULATION_LAUNCH_LOG=<file>, appends the symbol of each kernel the first time this process launches it (the
// instantiations the tests ran; anonymous-namespace kernels have no dynamic symbol and show as "?").
void note_launch(const void* kernel);

template <typename... P, typename... A>
void launch(void (*kernel)(P...), unsigned grid, unsigned block, size_t /*shared_bytes*/, cudaStream_t /*stream*/,
            A&&... args) {
  note_launch(reinterpret_cast<const void*>(kernel));
  // Kernel parameters are copies of the arguments in the kernel's parameter types (direct initialization: it also
  // accepts explicit conversions, which a real launch would not compile).
  const std::tuple<std::decay_t<P>...> params(std::forward<A>(args)...);
  set_last_error(run_grid(grid, block, [&] { std::apply(kernel, params); }));
}

template <typename T>
T shuffle_from(T v, unsigned src_lane, unsigned mask) {
  static_assert(sizeof(T) <= sizeof(uint64_t) && std::is_trivially_copyable_v<T>);
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  bits = exchange_in_warp(bits, src_lane, mask);
  std::memcpy(&v, &bits, sizeof(T));
  return v;
}

}  // namespace dc_emu

inline void __syncthreads() { dc_emu::sync_threads(); }

// Width 32. A source lane past the warp gives the calling lane's own value, as CUDA defines.
template <typename T>
T __shfl_down_sync(unsigned mask, T v, unsigned delta) {
  const unsigned lane = threadIdx.x % 32;
  return dc_emu::shuffle_from(v, lane + delta < 32 ? lane + delta : lane, mask);
}
template <typename T>
T __shfl_xor_sync(unsigned mask, T v, unsigned lane_mask) {
  const unsigned lane = threadIdx.x % 32;
  return dc_emu::shuffle_from(v, (lane ^ lane_mask) < 32 ? lane ^ lane_mask : lane, mask);
}

inline float atomicAdd(float* p, float v) {
  const float old = *p;
  *p = old + v;
  return old;
}

inline int max(int a, int b) { return a > b ? a : b; }

inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline int __float_as_int(float v) {
  int i;
  std::memcpy(&i, &v, sizeof(i));
  return i;
}
inline float __int_as_float(int i) {
  float v;
  std::memcpy(&v, &i, sizeof(v));
  return v;
}
inline float __uint_as_float(unsigned i) {
  float v;
  std::memcpy(&v, &i, sizeof(v));
  return v;
}

cudaError_t cudaGetLastError();
const char* cudaGetErrorString(cudaError_t err);
cudaError_t cudaGetDevice(int* device);
cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device);
cudaError_t cudaMemsetAsync(void* p, int value, size_t bytes, cudaStream_t stream);

template <typename Kernel>
cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int* blocks, Kernel, int block_size, size_t) {
  if (block_size <= 0 || block_size > 1024) return cudaErrorInvalidValue;
  *blocks = dc_emu::kBlocksPerMultiprocessor;
  return cudaSuccess;
}
