// Kernels that test the emulated CUDA runtime itself (test_emulated_runtime.py, through selftest_ops.cpp): the
// semantics of its warp shuffles and indices, and its reports of a deadlocked barrier and of a shuffle over exited
// lanes. Compiled only into the emulated build, against shim/ like csrc/cuda.
#include <cstdint>

#include "cuda_runtime.h"

namespace dc_emu_selftest {
namespace {

// out[t] = the global index, then t's value after __shfl_down_sync(by 1) and after __shfl_xor_sync(with 16) of the
// global indices: three planes of grid * block ints.
__global__ void shuffles(int* out, int total) {
  const int t = int(blockIdx.x * blockDim.x + threadIdx.x);
  out[t] = t;
  out[total + t] = __shfl_down_sync(0xffffffffu, t, 1u);
  out[2 * total + t] = __shfl_xor_sync(0xffffffffu, t, 16u);
}

// Half of warp 0 waits at __syncthreads, the other half at a shuffle that needs the first half: neither completes.
__global__ void deadlock(int* out) {
  if (threadIdx.x % 32 < 16) {
    __syncthreads();
  } else {
    out[threadIdx.x] = __shfl_down_sync(0xffffffffu, int(threadIdx.x), 1u);
  }
}

// Lanes 16-31 have returned when lanes 0-15 shuffle: undefined on a GPU, reported by the emulation.
__global__ void shuffle_over_exited_lanes(int* out) {
  if (threadIdx.x % 32 >= 16) return;
  out[threadIdx.x] = __shfl_down_sync(0xffffffffu, int(threadIdx.x), 1u);
}

// Shared memory written by every thread before a barrier and read after it by the thread with the mirrored index.
__global__ void shared_after_barrier(int* out) {
  __shared__ int values[256];
  ::dc_emu::poison_shared(values, sizeof(values));  // run.py adds this after each declaration in csrc/cuda
  values[threadIdx.x] = int(blockIdx.x * 1000 + threadIdx.x);
  __syncthreads();
  out[blockIdx.x * blockDim.x + threadIdx.x] = values[blockDim.x - 1 - threadIdx.x];
}

// Slot 1 is never written: it reads the fill.
__global__ void unwritten_shared(int* out) {
  __shared__ int values[32];
  ::dc_emu::poison_shared(values, sizeof(values));
  if (threadIdx.x == 0) values[0] = 1;
  __syncthreads();
  out[blockIdx.x * blockDim.x + threadIdx.x] = values[1];
}

// A shuffle among half a warp: valid CUDA, not emulated, so reported.
__global__ void partial_mask_shuffle(int* out) {
  out[threadIdx.x] = __shfl_down_sync(0x0000ffffu, int(threadIdx.x), 1u);
}

}  // namespace

int run(int which, int* out, unsigned grid, unsigned block) {
  switch (which) {
    case 0: ::dc_emu::launch(shuffles, grid, block, 0, nullptr, out, int(grid * block)); break;
    case 1: ::dc_emu::launch(deadlock, grid, block, 0, nullptr, out); break;
    case 2: ::dc_emu::launch(shuffle_over_exited_lanes, grid, block, 0, nullptr, out); break;
    case 3: ::dc_emu::launch(shared_after_barrier, grid, block, 0, nullptr, out); break;
    case 4: ::dc_emu::launch(unwritten_shared, grid, block, 0, nullptr, out); break;
    case 5: ::dc_emu::launch(partial_mask_shuffle, grid, block, 0, nullptr, out); break;
    default: return int(cudaErrorInvalidValue);
  }
  return int(cudaGetLastError());
}

const char* error_string(int err) { return cudaGetErrorString(static_cast<cudaError_t>(err)); }

}  // namespace dc_emu_selftest
