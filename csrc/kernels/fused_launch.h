// Entry points of the fused kernels, one per device. Both take already-validated plain operands
// (see op_call.h for the validation shared by every device) and run the op chosen by `kind`.
#pragma once

#include "device_scalars.h"
#include "fused_math.h"

namespace decent_comm {

// The 8-bit wire (decent_comm/optim/int8_wire.py) dequantized inside the mix: neighbours [0, count) are float32
// public copies that the op writes. Element i of copy j first becomes int8_dequantize_add(copy, level, scale) with
// the level and the scale of element offset + i of payload j (the codec's own operation, so the copy stays
// bit-identical to the sender's), and that new value is what the mix reads. One pass over memory instead of a decode
// pass that writes the copies and a mix pass that reads them again.
struct PayloadOperands {
  int count = 0;
  const int8_t* levels[kMaxNeighbors] = {};  // the level of x's element 0: payload j's bytes + offset
  const float* scales[kMaxNeighbors] = {};   // payload j's scales: element i uses scales[(offset + i) / block]
  int64_t offset = 0;                         // the payload element x's element 0 corresponds to
  int64_t block = 1;                          // elements per scale
};

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
  PayloadOperands payloads;            // optional: the 8-bit wire's payloads of the first neighbours
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
