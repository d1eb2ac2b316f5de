// The decent_comm operator library: schemas, argument validation (shared by every device, including the
// Meta/fake kernels torch.compile traces with), and the CPU/CUDA implementations that hand validated
// plain pointers to the kernels in csrc/cpu and csrc/cuda.
#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <torch/library.h>

#include <cmath>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "kernels/fused_launch.h"

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
float* float_ptr(const at::Tensor& t) { return static_cast<float*>(raw_ptr(t)); }

bool supported_storage(const at::Tensor& t) {
  const auto s = t.scalar_type();
  if (s == at::kFloat || s == at::kBFloat16 || s == at::kHalf) return true;
  return s == at::kDouble && !t.is_cuda();  // the CUDA kernels are not built for float64
}

// Checks one flat operand against x: 1-D, contiguous, same length and device. `what` names it in errors.
void check_flat(const char* op, const std::string& what, const at::Tensor& t, const at::Tensor& x) {
  TORCH_CHECK(t.defined(), op, ": ", what, " is undefined");
  TORCH_CHECK(t.dim() == 1, op, ": ", what, " must be a 1-D flat buffer, got shape ", t.sym_sizes());
  TORCH_CHECK(t.is_contiguous(), op, ": ", what, " must be contiguous");
  TORCH_CHECK(t.device() == x.device(), op, ": ", what, " is on ", t.device(), " but x is on ", x.device());
  // sym_numel: under torch.compile's dynamic shapes the fake tensors carry symbolic sizes.
  TORCH_CHECK(t.sym_numel() == x.sym_numel(), op, ": ", what, " has ", t.sym_numel(), " elements but x has ",
              x.sym_numel());
}

void check_state(const char* op, const char* what, const at::Tensor& t, const at::Tensor& x) {
  check_flat(op, what, t, x);
  TORCH_CHECK(t.scalar_type() == at::kFloat, op, ": ", what, " must be float32 (optimizer state is kept in "
              "float32), got ", t.scalar_type());
}

// Validates x, the neighbours and their weights, and fills the mixing part of the operands. Runs before
// any write, so a bad argument never leaves a partially updated buffer.
FusedOperands check_mix(const char* op, const at::Tensor& x, const at::TensorList& neighbors,
                        double self_weight, const at::ArrayRef<double>& weights) {
  TORCH_CHECK(x.defined(), op, ": x is undefined");
  TORCH_CHECK(x.dim() == 1, op, ": x must be a 1-D flat buffer, got shape ", x.sym_sizes());
  TORCH_CHECK(x.is_contiguous(), op, ": x must be contiguous");
  TORCH_CHECK(supported_storage(x), op, ": x has unsupported dtype ", x.scalar_type(), " on ", x.device(),
              " (supported: float32, bfloat16, float16", x.is_cuda() ? "" : ", float64", ")");
  TORCH_CHECK(neighbors.size() == weights.size(), op, ": got ", neighbors.size(), " neighbors but ",
              weights.size(), " weights (len(weights) must equal len(neighbors))");
  TORCH_CHECK(int64_t(neighbors.size()) <= kMaxNeighbors, op, ": got ", neighbors.size(),
              " neighbors; at most ", kMaxNeighbors, " are supported per call (split the mix into two calls)");
  TORCH_CHECK(std::isfinite(self_weight), op, ": self_weight must be finite, got ", self_weight);
  FusedOperands o;
  o.numel = x.is_meta() ? 0 : x.numel();
  o.x = raw_ptr(x);
  o.x_dtype = to_dtype(x.scalar_type());
  o.self_weight = self_weight;
  o.num_neighbors = int(neighbors.size());
  for (size_t j = 0; j < neighbors.size(); ++j) {
    const std::string name = "neighbors[" + std::to_string(j) + "]";
    const at::Tensor& y = neighbors[j];
    check_flat(op, name, y, x);
    TORCH_CHECK(supported_storage(y), op, ": ", name, " has unsupported dtype ", y.scalar_type());
    TORCH_CHECK(y.scalar_type() == neighbors[0].scalar_type(), op, ": ", name, " has dtype ", y.scalar_type(),
                " but neighbors[0] has ", neighbors[0].scalar_type(), " (all neighbors must share one dtype)");
    TORCH_CHECK(std::isfinite(weights[j]), op, ": weights[", j, "] must be finite, got ", weights[j]);
    o.neighbors[j] = raw_ptr(y);
    o.weights[j] = weights[j];
  }
  if (!neighbors.empty()) o.neighbor_dtype = to_dtype(neighbors[0].scalar_type());
  return o;
}

void check_grad(const char* op, FusedOperands& o, const at::Tensor& grad, const at::Tensor& x) {
  check_flat(op, "grad", grad, x);
  TORCH_CHECK(grad.scalar_type() == x.scalar_type(), op, ": grad has dtype ", grad.scalar_type(),
              " but x has ", x.scalar_type(), " (they must match)");
  o.grad = raw_ptr(grad);
}

void set_disagreement(const char* op, FusedOperands& o, const std::optional<at::Tensor>& out,
                      const at::Tensor& x) {
  if (!out.has_value()) return;
  const at::Tensor& d = *out;
  TORCH_CHECK(d.defined() && d.sym_numel() == 1 && d.scalar_type() == at::kFloat && d.is_contiguous(), op,
              ": disagreement must be a 1-element float32 tensor");
  TORCH_CHECK(d.device() == x.device(), op, ": disagreement is on ", d.device(), " but x is on ", x.device());
  o.disagreement = float_ptr(d);
}

// The kernels compute element i from element i of every operand only, and read all of them before writing
// any (the CPU loops are compiled with "no loop-carried dependence" hints on that basis). So an operand may
// be the very same buffer as x (same start, same length), but buffers that are shifted against each other
// would be silently wrong, and two outputs in one buffer are meaningless: both are refused, by name.
// `outputs` are the buffers the op writes; `inputs` the ones it only reads.
using Named = std::pair<std::string, const at::Tensor*>;
void check_no_overlap(const char* op, const std::vector<Named>& outputs, const std::vector<Named>& inputs) {
  if (outputs.front().second->is_meta()) return;  // fake tensors have no memory
  for (size_t a = 0; a < outputs.size(); ++a) {
    const at::Tensor& out = *outputs[a].second;
    for (size_t b = a + 1; b < outputs.size(); ++b) {
      const auto status = at::get_overlap_status(out, *outputs[b].second);
      TORCH_CHECK(status == at::MemOverlapStatus::No || status == at::MemOverlapStatus::TooHard, op, ": ",
                  outputs[a].first, " and ", outputs[b].first, " share memory (both are written; pass separate "
                  "buffers)");
    }
    for (const auto& [name, in] : inputs) {
      TORCH_CHECK(at::get_overlap_status(out, *in) != at::MemOverlapStatus::Partial, op, ": ", name,
                  " partially overlaps ", outputs[a].first, ", which the op writes (an operand may be the same "
                  "buffer as x, never a shifted view of it)");
    }
  }
}

// The read-only operands of one call (the neighbours, then `grad` when given), named for check_no_overlap.
std::vector<Named> named_inputs(const at::TensorList& neighbors, const at::Tensor* grad = nullptr) {
  std::vector<Named> named;
  for (size_t j = 0; j < neighbors.size(); ++j) named.emplace_back("neighbors[" + std::to_string(j) + "]", &neighbors[j]);
  if (grad != nullptr) named.emplace_back("grad", grad);
  return named;
}

// x, the state buffers and the optional disagreement output: what the op writes.
std::vector<Named> named_outputs(const at::Tensor& x, std::vector<Named> state,
                                 const std::optional<at::Tensor>& disagreement) {
  state.insert(state.begin(), Named("x", &x));
  if (disagreement.has_value()) state.emplace_back("disagreement", &*disagreement);
  return state;
}

// Checks the op's float32 state buffers against x and hands them to the kernel in order (o.state[0], [1], ...);
// returns them named, for named_outputs. One list per op drives both, so they cannot disagree.
std::vector<Named> set_state(const char* op, FusedOperands& o, const at::Tensor& x, std::vector<Named> state) {
  TORCH_INTERNAL_ASSERT(state.size() <= size_t(kMaxState), op, ": too many state buffers");
  for (size_t q = 0; q < state.size(); ++q) {
    check_state(op, state[q].first.c_str(), *state[q].second, x);
    o.state[q] = float_ptr(*state[q].second);
  }
  return state;
}

// Validates the Adam-family hyper-parameters and fills them in, with the bias corrections for
// `bias_steps` moment updates (the step for Adam; the window count for AccumAdam).
HyperParams adam_hyper(const char* op, int64_t step, double bias_steps, double lr, double beta1, double beta2,
                       double eps, double weight_decay, bool decoupled) {
  TORCH_CHECK(step >= 1, op, ": step is the 1-based count after this update and must be >= 1, got ", step);
  TORCH_CHECK(beta1 >= 0 && beta1 < 1, op, ": beta1 must be in [0, 1), got ", beta1);
  TORCH_CHECK(beta2 >= 0 && beta2 < 1, op, ": beta2 must be in [0, 1), got ", beta2);
  HyperParams hp;
  hp.lr = lr;
  hp.weight_decay = weight_decay;
  hp.beta1 = beta1;
  hp.beta2 = beta2;
  hp.eps = eps;
  hp.step_size = lr / (1 - std::pow(beta1, bias_steps));
  hp.bc2_sqrt = std::sqrt(1 - std::pow(beta2, bias_steps));
  hp.decoupled = decoupled;
  return hp;
}

// Runs validated operands on x's device; on Meta (fake tensors) validation was all there is to do.
void run(UpdateKind kind, const FusedOperands& o, const HyperParams& hp, const at::Tensor& x) {
  if (x.is_meta()) return;
  if (x.is_cpu()) return run_fused_cpu(kind, o, hp);
  if (x.is_cuda()) return run_fused_cuda_checked(kind, o, hp, x);
  TORCH_CHECK(false, "decent_comm: no kernel for device ", x.device());
}

// ---- op implementations (one function per op serves CPU, CUDA and Meta) ----

void gossip_mix_impl(const at::Tensor& x, at::TensorList neighbors, double self_weight,
                     at::ArrayRef<double> weights, const std::optional<at::Tensor>& disagreement) {
  const char* op = "decent_comm.gossip_mix_";
  FusedOperands o = check_mix(op, x, neighbors, self_weight, weights);
  set_disagreement(op, o, disagreement, x);
  check_no_overlap(op, named_outputs(x, {}, disagreement), named_inputs(neighbors));
  run(UpdateKind::Mix, o, HyperParams{}, x);
}

void mix_sgd_impl(const at::Tensor& x, at::TensorList neighbors, double self_weight,
                  at::ArrayRef<double> weights, const at::Tensor& grad,
                  const std::optional<at::Tensor>& momentum_buffer, double lr, double momentum,
                  double dampening, double weight_decay, bool nesterov, bool first_step,
                  const std::optional<at::Tensor>& disagreement) {
  const char* op = "decent_comm.mix_sgd_";
  FusedOperands o = check_mix(op, x, neighbors, self_weight, weights);
  check_grad(op, o, grad, x);
  set_disagreement(op, o, disagreement, x);
  TORCH_CHECK(momentum >= 0, op, ": momentum must be >= 0, got ", momentum);
  TORCH_CHECK(!nesterov || (momentum > 0 && dampening == 0), op,
              ": nesterov momentum requires momentum > 0 and dampening = 0");
  HyperParams hp;
  hp.lr = lr;
  hp.weight_decay = weight_decay;
  hp.momentum = momentum;
  hp.dampening = dampening;
  hp.nesterov = nesterov;
  hp.first_step = first_step;
  UpdateKind kind = UpdateKind::Sgd;
  std::vector<Named> state;
  if (momentum != 0) {
    TORCH_CHECK(momentum_buffer.has_value(), op, ": momentum_buffer is required when momentum != 0");
    state = set_state(op, o, x, {{"momentum_buffer", &*momentum_buffer}});
    kind = UpdateKind::SgdMomentum;
  }
  check_no_overlap(op, named_outputs(x, state, disagreement), named_inputs(neighbors, &grad));
  run(kind, o, hp, x);
}

void mix_adam_impl(const at::Tensor& x, at::TensorList neighbors, double self_weight,
                   at::ArrayRef<double> weights, const at::Tensor& grad, const at::Tensor& exp_avg,
                   const at::Tensor& exp_avg_sq, int64_t step, double lr, double beta1, double beta2,
                   double eps, double weight_decay, bool decoupled,
                   const std::optional<at::Tensor>& disagreement) {
  const char* op = "decent_comm.mix_adam_";
  FusedOperands o = check_mix(op, x, neighbors, self_weight, weights);
  check_grad(op, o, grad, x);
  const auto state = set_state(op, o, x, {{"exp_avg", &exp_avg}, {"exp_avg_sq", &exp_avg_sq}});
  set_disagreement(op, o, disagreement, x);
  const HyperParams hp = adam_hyper(op, step, double(step), lr, beta1, beta2, eps, weight_decay, decoupled);
  check_no_overlap(op, named_outputs(x, state, disagreement), named_inputs(neighbors, &grad));
  run(UpdateKind::Adam, o, hp, x);
}

void mix_accum_adam_impl(const at::Tensor& x, at::TensorList neighbors, double self_weight,
                         at::ArrayRef<double> weights, const at::Tensor& grad, const at::Tensor& exp_avg,
                         const at::Tensor& exp_avg_sq, const at::Tensor& accum, int64_t step,
                         int64_t accum_steps, double lr, double beta1, double beta2, double eps,
                         double weight_decay, bool decoupled, const std::optional<at::Tensor>& disagreement) {
  const char* op = "decent_comm.mix_accum_adam_";
  FusedOperands o = check_mix(op, x, neighbors, self_weight, weights);
  check_grad(op, o, grad, x);
  const auto state = set_state(op, o, x, {{"exp_avg", &exp_avg}, {"exp_avg_sq", &exp_avg_sq}, {"accum", &accum}});
  set_disagreement(op, o, disagreement, x);
  TORCH_CHECK(accum_steps >= 1, op, ": accum_steps must be >= 1, got ", accum_steps);
  // Bias correction counts windows, k = ceil(t / K): M and V have been updated k - 1 times, and the
  // look-ahead m, v once more.
  const double windows = double((step + accum_steps - 1) / accum_steps);
  HyperParams hp = adam_hyper(op, step, windows, lr, beta1, beta2, eps, weight_decay, decoupled);
  hp.accum_steps = double(accum_steps);
  hp.flush = step % accum_steps == 0;
  check_no_overlap(op, named_outputs(x, state, disagreement), named_inputs(neighbors, &grad));
  run(UpdateKind::AccumAdam, o, hp, x);
}

}  // namespace

}  // namespace decent_comm

// The contract other modules rely on. All ops mutate their (a!)... arguments in place and return nothing.
TORCH_LIBRARY(decent_comm, m) {
  m.def(
      "gossip_mix_(Tensor(a!) x, Tensor[] neighbors, float self_weight, float[] weights, "
      "Tensor(b!)? disagreement=None) -> ()");
  m.def(
      "mix_sgd_(Tensor(a!) x, Tensor[] neighbors, float self_weight, float[] weights, Tensor grad, "
      "Tensor(b!)? momentum_buffer, float lr, float momentum, float dampening, float weight_decay, "
      "bool nesterov, bool first_step, Tensor(c!)? disagreement=None) -> ()");
  m.def(
      "mix_adam_(Tensor(a!) x, Tensor[] neighbors, float self_weight, float[] weights, Tensor grad, "
      "Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq, int step, float lr, float beta1, float beta2, float eps, "
      "float weight_decay, bool decoupled, Tensor(d!)? disagreement=None) -> ()");
  m.def(
      "mix_accum_adam_(Tensor(a!) x, Tensor[] neighbors, float self_weight, float[] weights, Tensor grad, "
      "Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq, Tensor(d!) accum, int step, int accum_steps, float lr, "
      "float beta1, float beta2, float eps, float weight_decay, bool decoupled, "
      "Tensor(e!)? disagreement=None) -> ()");
}

#define DECENT_COMM_REGISTER_IMPLS(m)                  \
  m.impl("gossip_mix_", &decent_comm::gossip_mix_impl);             \
  m.impl("mix_sgd_", &decent_comm::mix_sgd_impl);                   \
  m.impl("mix_adam_", &decent_comm::mix_adam_impl);                 \
  m.impl("mix_accum_adam_", &decent_comm::mix_accum_adam_impl);

TORCH_LIBRARY_IMPL(decent_comm, CPU, m) { DECENT_COMM_REGISTER_IMPLS(m) }
// Meta: validation only; this is the fake kernel torch.compile and opcheck trace with.
TORCH_LIBRARY_IMPL(decent_comm, Meta, m) { DECENT_COMM_REGISTER_IMPLS(m) }
#ifdef DECENT_COMM_WITH_CUDA
TORCH_LIBRARY_IMPL(decent_comm, CUDA, m) { DECENT_COMM_REGISTER_IMPLS(m) }
#endif

