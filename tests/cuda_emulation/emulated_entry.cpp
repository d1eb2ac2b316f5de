// The CPU entry points of the fused ops and the int8 codec, as the emulated build defines them: they run the CUDA
// kernels' code (csrc/cuda, compiled against shim/cuda_runtime.h) on the CPU tensors the tests pass, so the CPU tests
// check the CUDA kernels against their float64 references. Replaces csrc/cpu/fused_cpu.cpp and int8_codec_cpu.cpp.
#include <stdexcept>
#include <string>

#include <cuda_runtime.h>  // the emulation's (shim/)

#include "kernels/fused_launch.h"
#include "kernels/int8_codec_launch.h"

namespace decent_comm {
namespace {

void check(int err, const char* what) {
  if (err == 0) return;
  if (err == cudaErrorInvalidValue) {  // operands the CUDA kernels refuse (float64: CPU-only)
    throw std::invalid_argument(std::string("decent_comm CUDA emulation: ") + what + " refused the operands (" +
                                cuda_error_string(err) + "; float64, for one, has no CUDA kernel)");
  }
  throw std::runtime_error(std::string("decent_comm CUDA emulation: ") + what + " failed: " + cuda_error_string(err));
}

}  // namespace

void run_fused_cpu(UpdateKind kind, const FusedOperands& o, const HyperParams& hp) {
  ResolvedUpdate resolved{};  // "device memory" of the resolve kernel: this process's memory
  check(run_fused_cuda(kind, o, hp, /*device=*/0, /*stream=*/nullptr, &resolved), "the fused kernel");
}

void int8_encode_cpu(const Int8Codec& c) { check(int8_encode_cuda(c, nullptr), "the encode kernel"); }

void int8_dequantize_add_cpu(const Int8Codec& c) {
  check(int8_dequantize_add_cuda(c, nullptr), "the dequantize kernel");
}

}  // namespace decent_comm
