// Host-side glue of the CUDA kernels (compiled by the host compiler, so torch headers are fine here):
// pins x's device (the kernels size their grid from its SMs), launches on the caller's current stream, turns a
// CUDA error into an exception.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "../kernels/fused_launch.h"

namespace decent_comm {

void run_fused_cuda_checked(UpdateKind kind, const FusedOperands& o, const HyperParams& hp, const at::Tensor& x) {
  const c10::cuda::CUDAGuard guard(x.device());
  const int device = x.device().index();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device).stream();
  at::Tensor scratch;  // freed on return: the caching allocator reuses it only behind this stream's kernels
  ResolvedUpdate* resolved = nullptr;
  if (kind != UpdateKind::Mix && o.scalars.any()) {
    scratch = at::empty({int64_t(sizeof(ResolvedUpdate))}, at::TensorOptions().dtype(at::kByte).device(x.device()));
    resolved = static_cast<ResolvedUpdate*>(scratch.data_ptr());
  }
  const int err = run_fused_cuda(kind, o, hp, device, stream, resolved);
  TORCH_CHECK(err == 0, "decent_comm: CUDA kernel launch failed on ", x.device(), ": ", cuda_error_string(err));
}

}  // namespace decent_comm
