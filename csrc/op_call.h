// One call of a fused op while its arguments are checked. Every operand passes through an OpCall, so each gets
// the same checks (shape, dtype, device, memory overlap, autograd, and for hyper-parameters finiteness and
// representability in the math dtype), and nothing is written before all of them passed. The same code runs for
// the CPU, CUDA and Meta (fake) kernels, so torch.compile traces exactly the checks eager mode makes.
#pragma once

#include <ATen/core/Tensor.h>

#include <initializer_list>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "kernels/fused_launch.h"

namespace decent_comm {

// An operand and the name errors call it by.
using Named = std::pair<std::string, const at::Tensor*>;

class OpCall {
 public:
  // Checks x, the neighbours and the mixing weights. `copies` (the 8-bit wire's public copies, float32, written by
  // set_payloads' dequantization) are mixed first, with weights[0, len(copies)), then the neighbours.
  OpCall(const char* op, const at::Tensor& x, at::TensorList copies, at::TensorList neighbors, double self_weight,
         at::ArrayRef<double> weights);

  // One payload per copy (uint8, int8_encode_'s layout, `block` elements per scale); x's element i is the payload's
  // element offset + i. Dequantized into the copies inside the op (PayloadOperands).
  void set_payloads(at::TensorList payloads, int64_t offset, int64_t block);

  void set_grad(const at::Tensor& grad);
  // The op's float32 state buffers, in the order the update reads them (o.state[0], [1], ...).
  void set_state(const std::vector<Named>& state);
  void set_disagreement(const std::optional<at::Tensor>& out);
  // GradScaler's scale and found_inf (read) and the device step count (read and advanced); all optional.
  void set_amp(const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf,
               const std::optional<at::Tensor>& state_step);
  bool has_device_step() const { return has_device_step_; }

  // Hyper-parameters: finite and representable in the op's math dtype (float32, or float64 for float64 x), and
  // in range. Each returns the value, or raises naming it.
  double finite(const char* name, double v) const;
  double nonnegative(const char* name, double v) const;
  double unit_interval(const char* name, double v) const;  // [0, 1), also after rounding to the math dtype
  const char* op() const { return op_; }

  // Checks what concerns the operands together (memory overlap, autograd, inference tensors), marks the
  // outputs as modified in place (version counters, as torch's in-place ops do), and runs the op on x's device.
  void run(UpdateKind kind, const HyperParams& hp);

 private:
  void check_flat(const std::string& what, const at::Tensor& t) const;
  void check_scalar(const char* what, const at::Tensor& t, std::initializer_list<at::ScalarType> dtypes,
                    const char* dtypes_text) const;
  void check_no_overlap() const;
  void check_autograd() const;

  const char* op_;
  const at::Tensor& x_;
  size_t num_copies_ = 0;
  bool float64_math_;
  bool has_device_step_ = false;  // state_step given (the pointer alone is null for fake tensors)
  FusedOperands ops_;
  std::vector<Named> outputs_;  // written: x first, then state, disagreement, state_step
  std::vector<Named> inputs_;   // only read, element by element: neighbours, grad
  std::vector<Named> scalars_;  // only read, by every element: grad_scale, found_inf
};

}  // namespace decent_comm
