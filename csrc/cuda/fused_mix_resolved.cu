// The kernels of the device-scalar path (GradScaler's scale and found_inf, a device step count): they read their
// hyper-parameters from the ResolvedUpdate that fused_mix.cu's resolve_kernel wrote. A translation unit of their
// own, so nvcc builds them in parallel with the plain kernels.
#include "fused_kernels.cuh"

namespace decent_comm {
namespace cuda_kernels {

int launch_resolved_update(UpdateKind kind, const FusedOperands& o, const HyperParams& hp, Gate g, int device,
                           cudaStream_t stream) {
  return launch_update<true>(kind, o, hp, g, device, stream);
}

}  // namespace cuda_kernels
}  // namespace decent_comm
