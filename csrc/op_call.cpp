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

OpCall::OpCall(const char* op, const at::Tensor& x, at::TensorList neighbors, double self_weight,
               at::ArrayRef<double> weights)
    : op_(op), x_(x), float64_math_(x.defined() && x.scalar_type() == at::kDouble) {
  TORCH_CHECK(x.defined(), op, ": x is undefined");
  TORCH_CHECK(x.dim() == 1, op, ": x must be a 1-D flat buffer, got shape ", x.sym_sizes());
  TORCH_CHECK(x.is_contiguous(), op, ": x must be contiguous");
  TORCH_CHECK(supported_storage(x), op, ": x has unsupported dtype ", x.scalar_type(), " on ", x.device(),
              " (supported: float32, bfloat16, float16", x.is_cuda() ? "" : ", float64", ")");
  TORCH_CHECK(neighbors.size() == weights.size(), op, ": got ", neighbors.size(), " neighbors but ",
              weights.size(), " weights (len(weights) must equal len(neighbors))");
  TORCH_CHECK(int64_t(neighbors.size()) <= kMaxNeighbors, op, ": got ", neighbors.size(),
              " neighbors; at most ", kMaxNeighbors, " are supported per call (split the mix into two calls)");
  ops_.numel = x.is_meta() ? 0 : x.numel();
  ops_.x = raw_ptr(x);
  ops_.x_dtype = to_dtype(x.scalar_type());
  ops_.self_weight = finite("self_weight", self_weight);
  ops_.num_neighbors = int(neighbors.size());
  outputs_.emplace_back("x", &x);
  for (size_t j = 0; j < neighbors.size(); ++j) {
    const std::string name = "neighbors[" + std::to_string(j) + "]";
    const at::Tensor& y = neighbors[j];
    check_flat(name, y);
    TORCH_CHECK(supported_storage(y), op, ": ", name, " has unsupported dtype ", y.scalar_type());
    TORCH_CHECK(y.scalar_type() == neighbors[0].scalar_type(), op, ": ", name, " has dtype ", y.scalar_type(),
                " but neighbors[0] has ", neighbors[0].scalar_type(), " (all neighbors must share one dtype)");
    ops_.neighbors[j] = raw_ptr(y);
    ops_.weights[j] = finite(("weights[" + std::to_string(j) + "]").c_str(), weights[j]);
    inputs_.emplace_back(name, &y);
  }
  if (!neighbors.empty()) ops_.neighbor_dtype = to_dtype(neighbors[0].scalar_type());
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
                count_limit_log2(ops_.scalars.count_dtype), ") for ", dtype, " (beyond float32's 2^24 use int64)");
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
