// Entry points of the fused kernels, one per device. Both take already-validated plain operands
// (see ops.cpp for the validation shared by every device) and run the op chosen by `kind`.
#pragma once

#include "fused_math.h"

namespace decent_comm {

// Runs on the calling thread's at::parallel_for pool (respects torch.set_num_threads).
void run_fused_cpu(UpdateKind kind, const FusedOperands& ops, const HyperParams& hyper);

// Enqueues on `stream` (a cudaStream_t) of the current device. Returns a cudaError_t as int (0 = ok) so
// this header stays free of CUDA and torch types; the caller turns it into an exception.
int run_fused_cuda(UpdateKind kind, const FusedOperands& ops, const HyperParams& hyper, void* stream);
const char* cuda_error_string(int code);

}  // namespace decent_comm
