// Host glue of the codec's CUDA kernels (host compiler, so torch headers are fine): pins the operands' device,
// launches on its current stream, turns a CUDA error into an exception.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "../kernels/fused_launch.h"  // cuda_error_string
#include "../kernels/int8_codec_launch.h"

namespace decent_comm {

void run_int8_codec_cuda(bool encode, const Int8Codec& c, const at::Tensor& copy) {
  const c10::cuda::CUDAGuard guard(copy.device());
  void* stream = c10::cuda::getCurrentCUDAStream(copy.device().index()).stream();
  const int err = encode ? int8_encode_cuda(c, stream) : int8_dequantize_add_cuda(c, stream);
  TORCH_CHECK(err == 0, "decent_comm: CUDA codec kernel launch failed on ", copy.device(), ": ",
              cuda_error_string(err));
}

}  // namespace decent_comm
