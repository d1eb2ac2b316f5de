// The CPU loops of the AccumAdamUpdate kernels (fused_loops.h), in a translation unit of their own so they compile in parallel.
#include "fused_loops.h"
#include "fused_updates_cpu.h"

namespace decent_comm {

void run_cpu_accum_adam(const FusedOperands& o, const HyperParams& hp) { cpu::dispatch_x<AccumAdamUpdate>(o, hp); }

}  // namespace decent_comm
