// The Python module decent_comm._C. Loading it registers the torch.ops.decent_comm operators (ops.cpp);
// it also exposes how the extension was built, and (later) the stateful C++ objects through pybind11.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>

namespace py = pybind11;

#ifdef DECENT_COMM_WITH_NCCL
#include <nccl.h>
#endif

namespace {

bool built_with_cuda() {
#ifdef DECENT_COMM_WITH_CUDA
  return true;
#else
  return false;
#endif
}

// NCCL version the extension was compiled against as (major, minor, patch), or None without NCCL.
py::object nccl_version() {
#ifdef DECENT_COMM_WITH_NCCL
  return py::make_tuple(NCCL_MAJOR, NCCL_MINOR, NCCL_PATCH);
#else
  return py::none();
#endif
}

}  // namespace

#include "cpu/cpu_isa.h"

namespace {
std::string cpu_isa() { return decent_comm::cpu_isa_name(decent_comm::cpu_isa()); }
}  // namespace

// csrc/comm/bindings.cpp: the exchange scheduler and its transports.
void register_comm_bindings(py::module& m);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "decent_comm native extension: fused gossip-mix kernels and the exchange scheduler";
  m.def("built_with_cuda", &built_with_cuda, "True when the CUDA kernels were compiled in");
  m.def("nccl_version", &nccl_version, "NCCL version compiled against, or None");
  m.def("cpu_isa", &cpu_isa,
        "The instruction set the CPU loops run with (baseline, avx2, avx512): the best this CPU has, or a lower one "
        "named by DECENT_COMM_CPU_ISA");
  register_comm_bindings(m);
}
