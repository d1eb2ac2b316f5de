// Host-side glue of the CUDA kernels (compiled by the host compiler, so torch headers are fine here):
// pins x's device, launches on the caller's current stream, turns a launch error into an exception.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "../kernels/fused_launch.h"

namespace decent_comm {

void run_fused_cuda_checked(UpdateKind kind, const FusedOperands& o, const HyperParams& hp, const at::Tensor& x) {
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(x.device().index()).stream();
  const int err = run_fused_cuda(kind, o, hp, stream);
  TORCH_CHECK(err == 0, "decent_comm: CUDA kernel launch failed on ", x.device(), ": ", cuda_error_string(err));
}

}  // namespace decent_comm
