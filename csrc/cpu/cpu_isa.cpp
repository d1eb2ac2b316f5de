// cpu_isa(): what this CPU supports, lowered by DECENT_COMM_CPU_ISA when set (see cpu_isa.h).
#include "cpu_isa.h"

#include <cstdlib>
#include <stdexcept>
#include <string>

namespace decent_comm {
namespace {

CpuIsa detect() {
#if DC_X86_DISPATCH
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512dq")) {
    return CpuIsa::Avx512;
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return CpuIsa::Avx2;
#endif
  return CpuIsa::Baseline;
}

CpuIsa choose() {
  const CpuIsa best = detect();
  const char* env = std::getenv("DECENT_COMM_CPU_ISA");
  if (env == nullptr || *env == '\0') return best;
  const std::string want(env);
  CpuIsa isa;
  if (want == "baseline") {
    isa = CpuIsa::Baseline;
  } else if (want == "avx2") {
    isa = CpuIsa::Avx2;
  } else if (want == "avx512") {
    isa = CpuIsa::Avx512;
  } else {
    throw std::invalid_argument("decent_comm: DECENT_COMM_CPU_ISA=" + want +
                                " is not one of baseline, avx2, avx512 (unset it to use the best this CPU has)");
  }
  if (int(isa) > int(best)) {
    throw std::invalid_argument("decent_comm: DECENT_COMM_CPU_ISA=" + want + " but this CPU supports at most " +
                                cpu_isa_name(best));
  }
  return isa;
}

}  // namespace

CpuIsa cpu_isa() {
  static const CpuIsa isa = choose();  // a throw leaves it unset, so every call reports the bad setting
  return isa;
}

const char* cpu_isa_name(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::Avx512: return "avx512";
    case CpuIsa::Avx2: return "avx2";
    default: return "baseline";
  }
}

}  // namespace decent_comm
