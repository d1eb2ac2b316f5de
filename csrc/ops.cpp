// The decent_comm operator library: schemas, the hyper-parameter checks of each op, and one implementation per op
// that serves the CPU, CUDA and Meta (fake) kernels alike (argument checks and the device hand-off: op_call.h).
#include <torch/library.h>

#include <optional>

#include "op_call.h"

namespace decent_comm {
namespace {

// Checks the Adam-family hyper-parameters and fills them in. The step-dependent ones are filled here from the
// host `step`, or in the kernel from the device count (state_step; `step` must then be 0). `accum_steps` is K for
// AccumAdam, 1 for Adam.
HyperParams adam_hyper(const OpCall& c, int64_t step, int64_t accum_steps, double lr, double beta1, double beta2,
                       double eps, double weight_decay, bool decoupled) {
  TORCH_CHECK(accum_steps >= 1, c.op(), ": accum_steps must be >= 1, got ", accum_steps);
  HyperParams hp;
  hp.lr = c.nonnegative("lr", lr);
  hp.beta1 = c.unit_interval("beta1", beta1);
  hp.beta2 = c.unit_interval("beta2", beta2);
  hp.eps = c.nonnegative("eps", eps);
  hp.weight_decay = c.nonnegative("weight_decay", weight_decay);
  hp.decoupled = decoupled;
  hp.accum_steps = accum_steps;
  // The coefficients the kernel derives must be representable too; the first update has the largest step size.
  c.finite("lr / (1 - beta1) (the step size of the first update)", lr / (1 - beta1));
  if (decoupled) c.finite("lr * weight_decay", lr * weight_decay);
  if (c.has_device_step()) {
    TORCH_CHECK(step == 0, c.op(), ": step must be 0 when state_step is given (the count is read from state_step "
                "on the device), got ", step);
  } else {
    TORCH_CHECK(step >= 1, c.op(), ": step is the 1-based count after this update and must be >= 1, got ", step);
    set_step_count(hp, step);
  }
  return hp;
}

// ---- op implementations (one function per op serves CPU, CUDA and Meta) ----

// The optional tensor lists of the schemas (copies, payloads): None is the empty list.
using OptionalTensors = std::optional<at::TensorList>;
at::TensorList list(const OptionalTensors& t) { return t.has_value() ? *t : at::TensorList(); }

void gossip_mix_impl(const at::Tensor& x, at::TensorList neighbors, double self_weight,
                     at::ArrayRef<double> weights, const std::optional<at::Tensor>& disagreement,
                     const OptionalTensors& copies, const OptionalTensors& payloads, int64_t payload_offset,
                     int64_t payload_block) {
  OpCall c("decent_comm.gossip_mix_", x, list(copies), neighbors, self_weight, weights);
  c.set_payloads(list(payloads), payload_offset, payload_block);
  c.set_disagreement(disagreement);
  c.run(UpdateKind::Mix, HyperParams{});
}

void mix_sgd_impl(const at::Tensor& x, at::TensorList neighbors, double self_weight,
                  at::ArrayRef<double> weights, const at::Tensor& grad,
                  const std::optional<at::Tensor>& momentum_buffer, double lr, double momentum,
                  double dampening, double weight_decay, bool nesterov, bool first_step,
                  const std::optional<at::Tensor>& disagreement, const std::optional<at::Tensor>& grad_scale,
                  const std::optional<at::Tensor>& found_inf, const std::optional<at::Tensor>& state_step,
                  const OptionalTensors& copies, const OptionalTensors& payloads, int64_t payload_offset,
                  int64_t payload_block) {
  OpCall c("decent_comm.mix_sgd_", x, list(copies), neighbors, self_weight, weights);
  c.set_payloads(list(payloads), payload_offset, payload_block);
  c.set_grad(grad);
  HyperParams hp;
  hp.lr = c.nonnegative("lr", lr);
  hp.momentum = c.nonnegative("momentum", momentum);
  hp.dampening = c.finite("dampening", dampening);
  hp.weight_decay = c.nonnegative("weight_decay", weight_decay);
  // As torch.optim.SGD's step: Nesterov needs a momentum buffer; a dampening set after construction (torch checks it
  // there only) damps the buffer as for plain momentum (fused_math.h's sgd update takes both).
  TORCH_CHECK(!nesterov || momentum > 0, c.op(), ": nesterov momentum requires momentum > 0");
  hp.nesterov = nesterov;
  hp.first_step = first_step;
  UpdateKind kind = UpdateKind::Sgd;
  if (momentum != 0) {
    TORCH_CHECK(momentum_buffer.has_value(), c.op(), ": momentum_buffer is required when momentum != 0");
    c.set_state({{"momentum_buffer", &*momentum_buffer}});
    kind = UpdateKind::SgdMomentum;
  }
  c.set_disagreement(disagreement);
  c.set_amp(grad_scale, found_inf, state_step);
  TORCH_CHECK(!(first_step && c.has_device_step()), c.op(), ": first_step must be False when state_step is given "
              "(the first step is then the one that finds state_step == 0)");
  c.run(kind, hp);
}

void mix_adam_impl(const at::Tensor& x, at::TensorList neighbors, double self_weight,
                   at::ArrayRef<double> weights, const at::Tensor& grad, const at::Tensor& exp_avg,
                   const at::Tensor& exp_avg_sq, int64_t step, double lr, double beta1, double beta2,
                   double eps, double weight_decay, bool decoupled,
                   const std::optional<at::Tensor>& disagreement, const std::optional<at::Tensor>& grad_scale,
                   const std::optional<at::Tensor>& found_inf, const std::optional<at::Tensor>& state_step,
                   const OptionalTensors& copies, const OptionalTensors& payloads, int64_t payload_offset,
                   int64_t payload_block) {
  OpCall c("decent_comm.mix_adam_", x, list(copies), neighbors, self_weight, weights);
  c.set_payloads(list(payloads), payload_offset, payload_block);
  c.set_grad(grad);
  c.set_state({{"exp_avg", &exp_avg}, {"exp_avg_sq", &exp_avg_sq}});
  c.set_disagreement(disagreement);
  c.set_amp(grad_scale, found_inf, state_step);
  c.run(UpdateKind::Adam, adam_hyper(c, step, 1, lr, beta1, beta2, eps, weight_decay, decoupled));
}

void mix_accum_adam_impl(const at::Tensor& x, at::TensorList neighbors, double self_weight,
                         at::ArrayRef<double> weights, const at::Tensor& grad, const at::Tensor& exp_avg,
                         const at::Tensor& exp_avg_sq, const at::Tensor& accum, int64_t step,
                         int64_t accum_steps, double lr, double beta1, double beta2, double eps,
                         double weight_decay, bool decoupled, const std::optional<at::Tensor>& disagreement,
                         const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf,
                         const std::optional<at::Tensor>& state_step,
                         const OptionalTensors& copies, const OptionalTensors& payloads, int64_t payload_offset,
                         int64_t payload_block) {
  OpCall c("decent_comm.mix_accum_adam_", x, list(copies), neighbors, self_weight, weights);
  c.set_payloads(list(payloads), payload_offset, payload_block);
  c.set_grad(grad);
  c.set_state({{"exp_avg", &exp_avg}, {"exp_avg_sq", &exp_avg_sq}, {"accum", &accum}});
  c.set_disagreement(disagreement);
  c.set_amp(grad_scale, found_inf, state_step);
  c.run(UpdateKind::AccumAdam, adam_hyper(c, step, accum_steps, lr, beta1, beta2, eps, weight_decay, decoupled));
}

}  // namespace

}  // namespace decent_comm

// The contract other modules rely on (documented in decent_comm/ops.py). All ops mutate their (a!)... arguments in
// place and return nothing. New arguments go last, with defaults, so existing callers keep working.
TORCH_LIBRARY(decent_comm, m) {
  m.def(
      "gossip_mix_(Tensor(a!) x, Tensor[] neighbors, float self_weight, float[] weights, "
      "Tensor(b!)? disagreement=None, "
      "Tensor(c!)[]? copies=None, Tensor[]? payloads=None, int payload_offset=0, int payload_block=512) -> ()");
  m.def(
      "mix_sgd_(Tensor(a!) x, Tensor[] neighbors, float self_weight, float[] weights, Tensor grad, "
      "Tensor(b!)? momentum_buffer, float lr, float momentum, float dampening, float weight_decay, "
      "bool nesterov, bool first_step, Tensor(c!)? disagreement=None, Tensor? grad_scale=None, "
      "Tensor? found_inf=None, Tensor(d!)? state_step=None, "
      "Tensor(e!)[]? copies=None, Tensor[]? payloads=None, int payload_offset=0, int payload_block=512) -> ()");
  m.def(
      "mix_adam_(Tensor(a!) x, Tensor[] neighbors, float self_weight, float[] weights, Tensor grad, "
      "Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq, int step, float lr, float beta1, float beta2, float eps, "
      "float weight_decay, bool decoupled, Tensor(d!)? disagreement=None, Tensor? grad_scale=None, "
      "Tensor? found_inf=None, Tensor(e!)? state_step=None, "
      "Tensor(f!)[]? copies=None, Tensor[]? payloads=None, int payload_offset=0, int payload_block=512) -> ()");
  m.def(
      "mix_accum_adam_(Tensor(a!) x, Tensor[] neighbors, float self_weight, float[] weights, Tensor grad, "
      "Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq, Tensor(d!) accum, int step, int accum_steps, float lr, "
      "float beta1, float beta2, float eps, float weight_decay, bool decoupled, "
      "Tensor(e!)? disagreement=None, Tensor? grad_scale=None, Tensor? found_inf=None, "
      "Tensor(f!)? state_step=None, "
      "Tensor(g!)[]? copies=None, Tensor[]? payloads=None, int payload_offset=0, int payload_block=512) -> ()");
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

