// The 8-bit wire's codec ops (decent_comm/ops.py documents the contract): int8_encode_ and int8_dequantize_add_,
// their argument checks, and one implementation per op for the CPU, CUDA and Meta (fake) kernels. They know nothing
// of topologies or exchanges: decent_comm/optim/int8_wire.py decides which copy and payload go where.
#include <ATen/MemoryOverlap.h>
#include <c10/core/GradMode.h>
#include <c10/core/InferenceMode.h>
#include <torch/library.h>

#include <string>
#include <utility>
#include <vector>

#include "kernels/int8_codec_launch.h"
#include "kernels/int8_codec_math.h"

namespace decent_comm {

#ifdef DECENT_COMM_WITH_CUDA
// cuda/int8_codec_cuda.cpp: device guard, current stream, launch, error check.
void run_int8_codec_cuda(bool encode, const Int8Codec& c, const at::Tensor& copy);
#else
void run_int8_codec_cuda(bool, const Int8Codec&, const at::Tensor&) {
  TORCH_CHECK(false, "decent_comm was built without CUDA kernels; rebuild with nvcc available (DECENT_COMM_CUDA=1)");
}
#endif

namespace {

using Named = std::pair<const char*, const at::Tensor*>;

void check_flat(const char* op, const char* name, const at::Tensor& t, const at::Tensor& copy) {
  TORCH_CHECK(t.defined(), op, ": ", name, " is undefined");
  TORCH_CHECK(t.dim() == 1, op, ": ", name, " must be a 1-D flat buffer, got shape ", t.sym_sizes());
  TORCH_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous");
  TORCH_CHECK(t.device() == copy.device(), op, ": ", name, " is on ", t.device(), " but copy is on ", copy.device());
}

// The checks both ops share; returns the operands with the payload's levels and scales located.
Int8Codec check_codec(const char* op, const at::Tensor& copy, const at::Tensor& payload, int64_t block) {
  TORCH_CHECK(block >= 4 && block <= kInt8MaxBlock && block % 4 == 0, op, ": block must be a multiple of 4 in [4, ",
              kInt8MaxBlock, "], got ", block);
  check_flat(op, "copy", copy, copy);
  TORCH_CHECK(copy.scalar_type() == at::kFloat, op, ": copy must be float32, got ", copy.scalar_type());
  TORCH_CHECK(copy.is_cpu() || copy.is_cuda() || copy.is_meta(), op, ": no kernel for device ", copy.device());
  check_flat(op, "payload", payload, copy);
  TORCH_CHECK(payload.scalar_type() == at::kByte, op, ": payload must be uint8 (raw bytes), got ",
              payload.scalar_type());
  const c10::SymInt blocks = (copy.sym_numel() + (block - 1)) / block;
  const c10::SymInt want = blocks * block + blocks * 4;
  TORCH_CHECK(payload.sym_numel() == want, op, ": payload has ", payload.sym_numel(), " bytes but ", copy.sym_numel(),
              " elements in blocks of ", block, " need ", want, " (", blocks, " * ", block, " levels and ", blocks,
              " float32 scales)");
  Int8Codec c;
  c.block = block;
  if (copy.is_meta()) return c;  // fake tensors have no memory: validation is all there is
  c.numel = copy.numel();
  c.copy = copy.data_ptr<float>();
  c.levels = reinterpret_cast<int8_t*>(payload.data_ptr<uint8_t>());
  TORCH_CHECK(reinterpret_cast<uintptr_t>(c.levels) % 4 == 0, op, ": payload must start 4-byte aligned (its "
              "float32 scales follow the levels); pass a fresh buffer, not an odd view");
  c.scales = reinterpret_cast<float*>(c.levels + c.blocks() * block);
  return c;
}

// Overlap, autograd and inference checks over the operands, then the version bump of the written ones (as torch's
// in-place ops do).
void check_and_mark(const char* op, const std::vector<Named>& written, const std::vector<Named>& read) {
  std::vector<Named> all = written;
  all.insert(all.end(), read.begin(), read.end());
  const bool recording = c10::GradMode::is_enabled();
  for (size_t a = 0; a < all.size(); ++a) {
    const auto& [name, t] = all[a];
    TORCH_CHECK(!(recording && t->requires_grad()), op, ": ", name, " requires grad while autograd is recording; "
                "the codec ops have no derivative: call them under torch.no_grad(), or pass ", name, ".detach()");
    if (t->is_meta()) continue;
    for (size_t b = a + 1; b < all.size(); ++b) {
      const auto status = at::get_overlap_status(*t, *all[b].second);
      TORCH_CHECK(status == at::MemOverlapStatus::No || status == at::MemOverlapStatus::TooHard, op, ": ", name,
                  " and ", all[b].first, " share memory (pass separate buffers)");
    }
  }
  for (const auto& [name, t] : written) {
    TORCH_CHECK(!(t->is_inference() && !c10::InferenceMode::is_enabled()), op, ": ", name,
                " is an inference tensor, which cannot be updated in place outside torch.inference_mode()");
  }
  for (const auto& [name, t] : written) t->unsafeGetTensorImpl()->bump_version();
}

DType x_dtype(const char* op, const at::Tensor& x) {
  switch (x.scalar_type()) {
    case at::kFloat: return DType::Float32;
    case at::kBFloat16: return DType::BFloat16;
    case at::kHalf: return DType::Float16;
    case at::kDouble:
      if (!x.is_cuda()) return DType::Float64;
      [[fallthrough]];
    default:
      TORCH_CHECK(false, op, ": x has unsupported dtype ", x.scalar_type(), " on ", x.device(),
                  " (supported: float32, bfloat16, float16", x.is_cuda() ? "" : ", float64", ")");
  }
}

void int8_encode_impl(const at::Tensor& x, const at::Tensor& copy, const at::Tensor& payload, int64_t block) {
  const char* op = "decent_comm.int8_encode_";
  Int8Codec c = check_codec(op, copy, payload, block);
  check_flat(op, "x", x, copy);
  TORCH_CHECK(x.sym_numel() == copy.sym_numel(), op, ": x has ", x.sym_numel(), " elements but copy has ",
              copy.sym_numel());
  c.x_dtype = x_dtype(op, x);
  check_and_mark(op, {{"copy", &copy}, {"payload", &payload}}, {{"x", &x}});
  if (copy.is_meta()) return;
  c.x = x.data_ptr();
  if (copy.is_cuda()) return run_int8_codec_cuda(true, c, copy);
  int8_encode_cpu(c);
}

void int8_dequantize_add_impl(const at::Tensor& copy, const at::Tensor& payload, int64_t block) {
  const char* op = "decent_comm.int8_dequantize_add_";
  const Int8Codec c = check_codec(op, copy, payload, block);
  check_and_mark(op, {{"copy", &copy}}, {{"payload", &payload}});
  if (copy.is_meta()) return;
  if (copy.is_cuda()) return run_int8_codec_cuda(false, c, copy);
  int8_dequantize_add_cpu(c);
}

}  // namespace
}  // namespace decent_comm

// New ops of the library defined in ops.cpp (the contract is in decent_comm/ops.py).
TORCH_LIBRARY_FRAGMENT(decent_comm, m) {
  m.def("int8_encode_(Tensor x, Tensor(a!) copy, Tensor(b!) payload, int block=512) -> ()");
  m.def("int8_dequantize_add_(Tensor(a!) copy, Tensor payload, int block=512) -> ()");
}

#define DECENT_COMM_REGISTER_CODEC(m)                                      \
  m.impl("int8_encode_", &decent_comm::int8_encode_impl);                  \
  m.impl("int8_dequantize_add_", &decent_comm::int8_dequantize_add_impl);

TORCH_LIBRARY_IMPL(decent_comm, CPU, m) { DECENT_COMM_REGISTER_CODEC(m) }
TORCH_LIBRARY_IMPL(decent_comm, Meta, m) { DECENT_COMM_REGISTER_CODEC(m) }
#ifdef DECENT_COMM_WITH_CUDA
TORCH_LIBRARY_IMPL(decent_comm, CUDA, m) { DECENT_COMM_REGISTER_CODEC(m) }
#endif
