// torch.ops.dc_emulation.selftest(which, grid, block) -> int32 output of the self-test kernel `which` (0 shuffles,
// 1 deadlock, 2 shuffle over exited lanes, 3 shared memory after a barrier, 4 unwritten shared memory, 5 a
// partial-mask shuffle), or a RuntimeError quoting the emulated runtime's report. Only in the emulated build (run.py).
#include <torch/library.h>

#include <ATen/ATen.h>

namespace dc_emu_selftest {
int run(int which, int* out, unsigned grid, unsigned block);
const char* error_string(int err);
}  // namespace dc_emu_selftest

namespace {

at::Tensor selftest(int64_t which, int64_t grid, int64_t block) {
  at::Tensor out = at::zeros({3 * grid * block}, at::TensorOptions().dtype(at::kInt));
  const int err = dc_emu_selftest::run(int(which), out.data_ptr<int>(), unsigned(grid), unsigned(block));
  TORCH_CHECK(err == 0, "emulated launch failed: ", dc_emu_selftest::error_string(err));
  return out;
}

}  // namespace

TORCH_LIBRARY(dc_emulation, m) { m.def("selftest(int which, int grid, int block) -> Tensor", &selftest); }
