// The CUDA entry point of the fused ops (run_fused_cuda) and the kernels that take their hyper-parameters as
// arguments; the device-scalar kernels are instantiated in fused_mix_resolved.cu. GradScaler's scale and found_inf
// and a device step count (device_scalars.h) are resolved by a one-thread kernel queued first, so no call needs
// the host.
#include "fused_kernels.cuh"

namespace decent_comm {
namespace cuda_kernels {

// fused_mix_resolved.cu: launch_update<true>, the kernels reading a ResolvedUpdate.
int launch_resolved_update(UpdateKind kind, const FusedOperands& o, const HyperParams& hp, Gate g, int device,
                           cudaStream_t stream);

namespace {

// Resolves an optimizer call's device scalars once, for the update kernel queued behind it, and advances the count:
// this thread is the only reader of the count, so the update can move it at once.
__global__ void resolve_kernel(const HyperParams hp, const DeviceScalars s, ResolvedUpdate* out) {
  HyperParams p;
  const bool update = resolve_update(hp, s, p);
  out->hyper = Hyper<float>(update ? p : hp);
  out->skip = update ? 0 : 1;
  advance_count(s);
}

}  // namespace
}  // namespace cuda_kernels

namespace {

int run_fused_cuda_unchecked(UpdateKind kind, const FusedOperands& o, const HyperParams& hp, int device,
                             void* stream_ptr, ResolvedUpdate* resolved) {
  using namespace cuda_kernels;
  const cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  int current = -1;
  cudaError_t err = cudaGetDevice(&current);
  if (err != cudaSuccess) return int(err);
  if (current != device) return int(cudaErrorInvalidDevice);  // the occupancy query would describe another GPU
  if (o.disagreement != nullptr) {
    // The kernel accumulates block partials atomically, so the output starts from zero.
    err = cudaMemsetAsync(o.disagreement, 0, sizeof(float), stream);
    if (err != cudaSuccess) return int(err);
  }
  if (kind == UpdateKind::Mix || !o.scalars.any()) {
    return o.numel == 0 ? int(cudaSuccess) : launch_update<false>(kind, o, hp, Gate{}, device, stream);
  }
  if (resolved == nullptr) return int(cudaErrorInvalidValue);
  resolve_kernel<<<1, 1, 0, stream>>>(hp, o.scalars, resolved);
  err = cudaGetLastError();
  if (err != cudaSuccess || o.numel == 0) return int(err);
  const int applied = launch_resolved_update(kind, o, hp, Gate{resolved, false}, device, stream);
  if (applied != 0) return applied;
  return launch_resolved_update(UpdateKind::Mix, o, hp, Gate{resolved, true}, device, stream);
}

}  // namespace

int run_fused_cuda(UpdateKind kind, const FusedOperands& o, const HyperParams& hp, int device, void* stream_ptr,
                   ResolvedUpdate* resolved) {
  const int err = run_fused_cuda_unchecked(kind, o, hp, device, stream_ptr, resolved);
  // A runtime call that failed (an occupancy query, the memset) also left this thread's last error set, which
  // torch's next launch check would raise again for a launch of its own: the caller reports it once.
  if (err != 0) (void)cudaGetLastError();
  return err;
}

const char* cuda_error_string(int code) { return cudaGetErrorString(static_cast<cudaError_t>(code)); }

}  // namespace decent_comm
