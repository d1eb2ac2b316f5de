// One CPU entry point per update kind, each defined in its own translation unit (fused_<update>_cpu.cpp).
#pragma once

#include "../kernels/fused_launch.h"

namespace decent_comm {

void run_cpu_mix(const FusedOperands& o, const HyperParams& hp);
void run_cpu_sgd(const FusedOperands& o, const HyperParams& hp);
void run_cpu_sgd_momentum(const FusedOperands& o, const HyperParams& hp);
void run_cpu_adam(const FusedOperands& o, const HyperParams& hp);
void run_cpu_accum_adam(const FusedOperands& o, const HyperParams& hp);

}  // namespace decent_comm
