// Entry points of the fused kernels, one per device. Both take already-validated plain operands
// (see op_call.h for the validation shared by every device) and run the op chosen by `kind`.
#pragma once

#include "device_scalars.h"
#include "fused_math.h"

namespace decent_comm {

// Everything a kernel needs to run one op over one flat buffer, as plain pointers (no torch types),
// shared by the CPU and CUDA launchers.
struct FusedOperands {
  int64_t numel = 0;
  void* x = nullptr;
  DType x_dtype = DType::Float32;
  int num_neighbors = 0;
  const void* neighbors[kMaxNeighbors] = {};
  DType neighbor_dtype = DType::Float32;
  double self_weight = 1;
  double weights[kMaxNeighbors] = {};
  const void* grad = nullptr;          // same dtype as x
  float* state[kMaxState] = {};        // float32 optimizer state
  float* disagreement = nullptr;       // optional: receives sum((mixed - x_old)^2)
  DeviceScalars scalars;               // optional AMP scale / skip flag and device step count
};

// Runs on the calling thread's at::parallel_for pool (respects torch.set_num_threads).
void run_fused_cpu(UpdateKind kind, const FusedOperands& ops, const HyperParams& hyper);

// The hyper-parameters of an optimizer call with device scalars, resolved on the GPU by a one-thread kernel queued
// before the update kernel, which reads them from here: the update kernel then does no double-precision step math
// per thread, and the count is read and advanced by that one thread only.
struct ResolvedUpdate {
  Hyper<float> hyper;
  int skip;  // found_inf: only mix
};

// Enqueues on `stream` (a cudaStream_t) of `device`, which must be the current device (the caller's device
// guard makes it so). `resolved` is device memory for one ResolvedUpdate, needed when an optimizer op has device
// scalars (ops.scalars.any()), else null. Returns a cudaError_t as int (0 = ok) so this header stays free of CUDA
// and torch types; the caller turns it into an exception.
int run_fused_cuda(UpdateKind kind, const FusedOperands& ops, const HyperParams& hyper, int device, void* stream,
                   ResolvedUpdate* resolved);
const char* cuda_error_string(int code);

}  // namespace decent_comm
