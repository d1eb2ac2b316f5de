// The CPU entry point of the fused gossip-mix ops: resolves the AMP/step device scalars and runs the loops of one
// update kind (fused_loops.h, instantiated once per kind in fused_<update>_cpu.cpp).
#include <stdexcept>

#include "fused_updates_cpu.h"

namespace decent_comm {

void run_fused_cpu(UpdateKind kind, const FusedOperands& o, const HyperParams& hp) {
  // The device scalars are CPU memory here: read once, before any write (op_call.cpp keeps them apart from the outputs).
  HyperParams call;
  const bool update = resolve_update(hp, o.scalars, call);
  if (o.numel == 0) {
    if (o.disagreement) *o.disagreement = 0.f;
  } else if (!update) {
    run_cpu_mix(o, call);  // found_inf: x <- mixed; the state is not touched
  } else {
    switch (kind) {
      case UpdateKind::Mix: run_cpu_mix(o, call); break;
      case UpdateKind::Sgd: run_cpu_sgd(o, call); break;
      case UpdateKind::SgdMomentum: run_cpu_sgd_momentum(o, call); break;
      case UpdateKind::Adam: run_cpu_adam(o, call); break;
      case UpdateKind::AccumAdam: run_cpu_accum_adam(o, call); break;
      default: throw std::invalid_argument("decent_comm: unknown update kind");
    }
  }
  advance_count(o.scalars);
}

}  // namespace decent_comm
