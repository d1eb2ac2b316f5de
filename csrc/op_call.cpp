// The argument checks every fused op shares (see op_call.h), and the hand-off of validated operands to the
// device kernels.
#include "op_call.h"

#include <ATen/MemoryOverlap.h>
#include <ATen/core/Formatting.h>  // operator<< for the Scalar hyper-parameters in error messages
#include <c10/core/GradMode.h>
#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>

#include "kernels/int8_codec_math.h"  // kInt8MaxBlock

namespace decent_comm {

#ifdef DECENT_COMM_WITH_CUDA
// Defined in cuda/fused_mix_cuda.cpp: device guard, current stream, launch, error check.
void run_fused_cuda_checked(UpdateKind kind, const FusedOperands& o, const HyperParams& hp, const at::Tensor& x);
#else
void run_fused_cuda_checked(UpdateKind, const FusedOperands&, const HyperParams&, const at::Tensor&) {
  TORCH_CHECK(false, "decent_comm was built without CUDA kernels; rebuild with nvcc available (DECENT_COMM_CUDA=1)");
}
#endif

namespace {

DType to_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return DType::Float32;
    case at::kBFloat16: return DType::BFloat16;
    case at::kHalf: return DType::Float16;
    case at::kDouble: return DType::Float64;
    default: TORCH_CHECK(false, "unreachable: unsupported dtype ", t);
  }
}

// Meta (fake) tensors carry no data; validation still runs on them, so pointers are taken only for real ones.
void* raw_ptr(const at::Tensor& t) { return t.is_meta() ? nullptr : t.data_ptr(); }

bool supported_storage(const at::Tensor& t) {
  const auto s = t.scalar_type();
  if (s == at::kFloat || s == at::kBFloat16 || s == at::kHalf) return true;
  return s == at::kDouble && !t.is_cuda();  // the CUDA kernels are not built for float64
}

// A hyper-parameter as errors show it: 12 significant digits, so 1 - 1e-9 does not print as 1.
std::string show(double v) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.12g", v);
  return text;
}

// A value the CPU can read now (on a GPU that would be a host synchronization, so only CPU values are checked).
bool readable_now(const at::Tensor& t) { return t.is_cpu(); }

}  // namespace

OpCall::OpCall(const char* op, const at::Tensor& x, at::TensorList copies, at::TensorList neighbors,
               double self_weight, at::ArrayRef<double> weights)
    : op_(op), x_(x), num_copies_(copies.size()), float64_math_(x.defined() && x.scalar_type() == at::kDouble) {
  TORCH_CHECK(x.defined(), op, ": x is undefined");
  TORCH_CHECK(x.dim() == 1, op, ": x must be a 1-D flat buffer, got shape ", x.sym_sizes());
  TORCH_CHECK(x.is_contiguous(), op, ": x must be contiguous");
  TORCH_CHECK(supported_storage(x), op, ": x has unsupported dtype ", x.scalar_type(), " on ", x.device(),
              " (supported: float32, bfloat16, float16", x.is_cuda() ? "" : ", float64", ")");
  const size_t total = copies.size() + neighbors.size();
  TORCH_CHECK(total == weights.size(), op, ": got ", copies.size(), " copies and ", neighbors.size(),
              " neighbors but ", weights.size(), " weights (len(weights) must equal len(copies) + len(neighbors))");
  TORCH_CHECK(int64_t(total) <= kMaxNeighbors, op, ": got ", total, " neighbors and copies; at most ", kMaxNeighbors,
              " are supported per call (split the mix into two calls)");
  ops_.numel = x.is_meta() ? 0 : x.numel();
  ops_.x = raw_ptr(x);
  ops_.x_dtype = to_dtype(x.scalar_type());
  ops_.self_weight = finite("self_weight", self_weight);
  ops_.num_neighbors = int(total);
  outputs_.emplace_back("x", &x);
  // The kernels see one list: the copies, then the neighbours, all of one dtype.
  for (size_t j = 0; j < total; ++j) {
    const bool is_copy = j < copies.size();
    const at::Tensor& y = is_copy ? copies[j] : neighbors[j - copies.size()];
    const std::string name = is_copy ? "copies[" + std::to_string(j) + "]"
                                     : "neighbors[" + std::to_string(j - copies.size()) + "]";
    check_flat(name, y);
    TORCH_CHECK(supported_storage(y), op, ": ", name, " has unsupported dtype ", y.scalar_type());
    if (!copies.empty()) {
      TORCH_CHECK(y.scalar_type() == at::kFloat, op, ": ", name, " has dtype ", y.scalar_type(), "; with copies "
                  "(the 8-bit wire's float32 public copies) every neighbor must be float32 too");
    }
    const at::Tensor& first = is_copy ? copies[0] : neighbors[0];
    TORCH_CHECK(y.scalar_type() == first.scalar_type(), op, ": ", name, " has dtype ", y.scalar_type(),
                " but neighbors[0] has ", first.scalar_type(), " (all neighbors must share one dtype)");
    ops_.neighbors[j] = raw_ptr(y);
    ops_.weights[j] = finite(("weights[" + std::to_string(j) + "]").c_str(), weights[j]);
    // A copy is written (after its dequantization), a neighbour only read.
    if (is_copy) {
      outputs_.emplace_back(name, &y);
    } else {
      inputs_.emplace_back(name, &y);
    }
  }
  if (total > 0) ops_.neighbor_dtype = to_dtype((copies.empty() ? neighbors[0] : copies[0]).scalar_type());
}

void OpCall::set_payloads(at::TensorList payloads, int64_t offset, int64_t block) {
  TORCH_CHECK(payloads.size() == num_copies_, op_, ": got ", num_copies_, " copies but ", payloads.size(),
              " payloads (one payload per copy)");
  if (payloads.empty()) return;
  TORCH_CHECK(block >= 4 && block <= kInt8MaxBlock && block % 4 == 0, op_, ": payload_block must be a multiple of 4 "
              "in [4, ", kInt8MaxBlock, "] (int8_encode_'s block), got ", block);
  TORCH_CHECK(offset >= 0, op_, ": payload_offset must be >= 0, got ", offset);
  // The CUDA kernels index payloads in 32 bits (2^31 elements: an 8 GiB float32 bucket).
  // Compared without adding: offset + len(x) wrapped for an offset near 2^63 and passed both checks (a wild read).
  TORCH_CHECK(offset < (int64_t(1) << 31) - x_.sym_numel(), op_, ": payload_offset + len(x) = ", offset, " + ",
              x_.sym_numel(), " is 2^31 or more; split the bucket (payloads address fewer elements)");
  ops_.payloads.count = int(payloads.size());
  ops_.payloads.offset = offset;
  ops_.payloads.block = block;
  for (size_t j = 0; j < payloads.size(); ++j) {
    const std::string name = "payloads[" + std::to_string(j) + "]";
    const at::Tensor& p = payloads[j];
    TORCH_CHECK(p.defined(), op_, ": ", name, " is undefined");
    TORCH_CHECK(p.dim() == 1 && p.is_contiguous(), op_, ": ", name, " must be a contiguous 1-D buffer, got shape ",
                p.sym_sizes());
    TORCH_CHECK(p.scalar_type() == at::kByte, op_, ": ", name, " must be uint8 (int8_encode_'s raw bytes), got ",
                p.scalar_type());
    TORCH_CHECK(p.device() == x_.device(), op_, ": ", name, " is on ", p.device(), " but x is on ", x_.device());
    // int8_encode_'s layout: blocks * block levels, then blocks float32 scales.
    const c10::SymInt bytes = p.sym_numel();
    TORCH_CHECK(bytes % (block + 4) == 0, op_, ": ", name, " has ", bytes, " bytes, which is no whole number of "
                "blocks of ", block, " levels and a float32 scale (int8_payload_nbytes)");
    const c10::SymInt blocks = bytes / (block + 4);
    TORCH_CHECK(offset + x_.sym_numel() <= blocks * block, op_, ": ", name, " holds ", blocks * block,
                " elements, fewer than payload_offset + len(x) = ", offset + x_.sym_numel());
    scalars_.emplace_back(name, &p);
    if (x_.is_meta()) continue;
    const auto* bytes_ptr = static_cast<const uint8_t*>(p.data_ptr());
    TORCH_CHECK(reinterpret_cast<uintptr_t>(bytes_ptr) % 4 == 0, op_, ": ", name, " must start 4-byte aligned (its "
                "float32 scales follow the levels); pass the whole payload, not an odd view");
    ops_.payloads.levels[j] = reinterpret_cast<const int8_t*>(bytes_ptr) + offset;
    ops_.payloads.scales[j] = reinterpret_cast<const float*>(bytes_ptr + p.numel() / (block + 4) * block);
  }
}

// One flat operand against x: 1-D, contiguous, same length and device. `what` names it in errors.
void OpCall::check_flat(const std::string& what, const at::Tensor& t) const {
  TORCH_CHECK(t.defined(), op_, ": ", what, " is undefined");
  TORCH_CHECK(t.dim() == 1, op_, ": ", what, " must be a 1-D flat buffer, got shape ", t.sym_sizes());
  TORCH_CHECK(t.is_contiguous(), op_, ": ", what, " must be contiguous");
  TORCH_CHECK(t.device() == x_.device(), op_, ": ", what, " is on ", t.device(), " but x is on ", x_.device());
  // sym_numel: under torch.compile's dynamic shapes the fake tensors carry symbolic sizes.
  TORCH_CHECK(t.sym_numel() == x_.sym_numel(), op_, ": ", what, " has ", t.sym_numel(), " elements but x has ",
              x_.sym_numel());
}

// A one-element operand (disagreement, grad_scale, found_inf, state_step) on x's device, of one of `dtypes`.
void OpCall::check_scalar(const char* what, const at::Tensor& t, std::initializer_list<at::ScalarType> dtypes,
                          const char* dtypes_text) const {
  TORCH_CHECK(t.defined(), op_, ": ", what, " is undefined");
  TORCH_CHECK(t.sym_numel() == 1 && std::find(dtypes.begin(), dtypes.end(), t.scalar_type()) != dtypes.end(), op_,
              ": ", what, " must be a 1-element ", dtypes_text, " tensor, got ", t.scalar_type(), " of shape ",
              t.sym_sizes());
  TORCH_CHECK(t.device() == x_.device(), op_, ": ", what, " is on ", t.device(), " but x is on ", x_.device(),
              " (move it there with .to(x.device, non_blocking=True))");
}

void OpCall::set_grad(const at::Tensor& grad) {
  check_flat("grad", grad);
  TORCH_CHECK(grad.scalar_type() == x_.scalar_type(), op_, ": grad has dtype ", grad.scalar_type(),
              " but x has ", x_.scalar_type(), " (they must match)");
  ops_.grad = raw_ptr(grad);
  inputs_.emplace_back("grad", &grad);
}

void OpCall::set_state(const std::vector<Named>& state) {
  TORCH_INTERNAL_ASSERT(state.size() <= size_t(kMaxState), op_, ": too many state buffers");
  for (size_t q = 0; q < state.size(); ++q) {
    const auto& [name, t] = state[q];
    check_flat(name, *t);
    TORCH_CHECK(t->scalar_type() == at::kFloat, op_, ": ", name, " must be float32 (optimizer state is kept in "
                "float32), got ", t->scalar_type());
    ops_.state[q] = static_cast<float*>(raw_ptr(*t));
    outputs_.push_back(state[q]);
  }
}

void OpCall::set_disagreement(const std::optional<at::Tensor>& out) {
  if (!out.has_value()) return;
  check_scalar("disagreement", *out, {at::kFloat}, "float32");
  ops_.disagreement = static_cast<float*>(raw_ptr(*out));
  outputs_.emplace_back("disagreement", &*out);
}

void OpCall::set_amp(const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf,
                     const std::optional<at::Tensor>& state_step) {
  for (const auto& [name, t] : {std::pair("grad_scale", &grad_scale), std::pair("found_inf", &found_inf)}) {
    if (!t->has_value()) continue;
    check_scalar(name, **t, {at::kFloat}, "float32");  // as GradScaler makes them
    scalars_.emplace_back(name, &**t);
  }
  if (grad_scale.has_value()) {
    ops_.scalars.grad_scale = static_cast<const float*>(raw_ptr(*grad_scale));
    if (readable_now(*grad_scale)) {
      const float s = *ops_.scalars.grad_scale;
      TORCH_CHECK(std::isfinite(s) && s > 0, op_, ": grad_scale must be finite and > 0, got ", s);
    }
  }
  if (found_inf.has_value()) ops_.scalars.found_inf = static_cast<const float*>(raw_ptr(*found_inf));
  if (!state_step.has_value()) return;
  const at::Tensor& c = *state_step;
  // float32 is torch.optim's own step dtype
  check_scalar("state_step", c, {at::kFloat, at::kDouble, at::kLong}, "float32, float64 or int64");
  const auto dtype = c.scalar_type();
  ops_.scalars.count_dtype = dtype == at::kFloat ? CountDType::Float32
                             : dtype == at::kDouble ? CountDType::Float64 : CountDType::Int64;
  ops_.scalars.step_count = raw_ptr(c);
  has_device_step_ = true;
  if (readable_now(c)) {
    TORCH_CHECK(load_count(ops_.scalars.step_count, ops_.scalars.count_dtype) >= 0, op_, ": state_step holds ",
                c.item(), ", which is not a count of applied updates: an integer in [0, 2^",
                count_limit_log2(ops_.scalars.count_dtype), "] for ", dtype);
  }
  outputs_.emplace_back("state_step", &c);
}

double OpCall::finite(const char* name, double v) const {
  TORCH_CHECK(std::isfinite(v), op_, ": ", name, " must be finite, got ", show(v));
  TORCH_CHECK(float64_math_ || std::isfinite(static_cast<float>(v)), op_, ": ", name, " = ", show(v),
              " overflows float32, the math dtype of ", x_.scalar_type(), " x (|value| <= ",
              std::numeric_limits<float>::max(), ")");
  return v;
}

double OpCall::nonnegative(const char* name, double v) const {
  TORCH_CHECK(finite(name, v) >= 0, op_, ": ", name, " must be >= 0, got ", show(v));
  return v;
}

double OpCall::unit_interval(const char* name, double v) const {
  TORCH_CHECK(finite(name, v) >= 0 && v < 1, op_, ": ", name, " must be in [0, 1), got ", show(v));
  TORCH_CHECK(float64_math_ || static_cast<float>(v) < 1.f, op_, ": ", name, " = ", show(v),
              " rounds to 1 in float32, the math dtype of ", x_.scalar_type(), " x (it must stay below 1 there)");
  return v;
}

// The kernels compute element i from element i of every operand only, and read all of them before writing
// any (the CPU loops are compiled with "no loop-carried dependence" hints on that basis). So an operand may
// be the very same buffer as x (same start, same length), but buffers that are shifted against each other
// would be silently wrong, and two outputs in one buffer are meaningless: both are refused, by name. The
// one-element scalars are read by every element, so they may share no memory with any output.
void OpCall::check_no_overlap() const {
  if (x_.is_meta()) return;  // fake tensors have no memory
  for (size_t a = 0; a < outputs_.size(); ++a) {
    const auto& [out_name, out] = outputs_[a];
    for (size_t b = a + 1; b < outputs_.size(); ++b) {
      const auto status = at::get_overlap_status(*out, *outputs_[b].second);
      TORCH_CHECK(status == at::MemOverlapStatus::No || status == at::MemOverlapStatus::TooHard, op_, ": ",
                  out_name, " and ", outputs_[b].first, " share memory (both are written; pass separate buffers)");
    }
    for (const auto& [name, in] : inputs_) {
      TORCH_CHECK(at::get_overlap_status(*out, *in) != at::MemOverlapStatus::Partial, op_, ": ", name,
                  " partially overlaps ", out_name, ", which the op writes (an operand may be the same buffer as x, "
                  "never a shifted view of it)");
    }
    for (const auto& [name, in] : scalars_) {
      const auto status = at::get_overlap_status(*out, *in);
      TORCH_CHECK(status == at::MemOverlapStatus::No || status == at::MemOverlapStatus::TooHard, op_, ": ", name,
                  " shares memory with ", out_name, ", which the op writes (pass a separate tensor)");
    }
  }
}

// The ops have no derivative. While autograd records, a tensor that requires grad is refused wherever it appears:
// written in place it would carry a wrong history (torch refuses "a leaf Variable that requires grad is being used
// in an in-place operation" likewise), and read, its gradient would silently not flow into x. Under torch.no_grad()
// (how optimizers call them) the caller says the update is not part of the graph, and it is allowed, as torch allows
// in-place updates of Parameters there; the version counters bumped in run() still let autograd detect a
// modified tensor it had saved for backward.
void OpCall::check_autograd() const {
  const bool recording = c10::GradMode::is_enabled();
  for (const auto* group : {&outputs_, &inputs_, &scalars_}) {
    const bool written = group == &outputs_;
    for (const auto& [name, t] : *group) {
      TORCH_CHECK(!(recording && t->requires_grad()), op_, ": ", name, " requires grad while autograd is recording; "
                  "the fused ops have no derivative", written ? " and write it in place" : "",
                  ": call the op under torch.no_grad(), or pass ", name, ".detach()");
      TORCH_CHECK(!(written && t->is_inference() && !c10::InferenceMode::is_enabled()), op_, ": ", name,
                  " is an inference tensor, which cannot be updated in place outside torch.inference_mode() "
                  "(pass a clone)");
    }
  }
}

void OpCall::run(UpdateKind kind, const HyperParams& hp) {
  check_no_overlap();
  check_autograd();
  for (const auto& [name, t] : outputs_) t->unsafeGetTensorImpl()->bump_version();
  if (x_.is_meta()) return;  // fake tensors: validation was all there is to do
  if (x_.is_cpu()) return run_fused_cpu(kind, ops_, hp);
  if (x_.is_cuda()) return run_fused_cuda_checked(kind, ops_, hp, x_);
  TORCH_CHECK(false, op_, ": no kernel for device ", x_.device());
}

}  // namespace decent_comm
