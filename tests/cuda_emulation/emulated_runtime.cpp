// The emulated CUDA runtime of shim/cuda_runtime.h: a grid's blocks run in order on the calling thread, and a block's
// threads are fibers that a scheduler switches at barriers only.
#include <dlfcn.h>
#include <sys/mman.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "cuda_runtime.h"

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
// A fiber abandoned mid-kernel (a deadlocked block) leaves its frames' redzones poisoned on a stack the next block
// reuses: every fiber starts from a clean stack.
#define DC_EMU_CLEAN_STACK(p, n) __asan_unpoison_memory_region((p), (n))
#else
#define DC_EMU_CLEAN_STACK(p, n) ((void)(p), (void)(n))
#endif

thread_local dc_emu_index threadIdx, blockIdx, blockDim, gridDim;

namespace dc_emu {
namespace {

constexpr size_t kStackBytes = 256 * 1024;
constexpr size_t kGuardBytes = 4096;  // below each stack, unmapped: an overflow faults instead of corrupting
constexpr unsigned kMaxThreads = 1024;
constexpr unsigned kWarp = 32;

enum class Wait { None, Block, Warp };

// A fiber switch saves the callee-saved registers on the old stack and restores them from the new one (the System V
// x86-64 ABI: nothing else survives a call). ucontext's swapcontext also saves the signal mask with a system call,
// 50x slower: an encode of 25,000 codec blocks of 4 elements took minutes.
#if !defined(__x86_64__)
#error "the CUDA emulation's fiber switch is written for x86-64"
#endif
extern "C" void dc_emu_switch(void** save_sp, void* load_sp);
asm(R"(
  .text
  .globl dc_emu_switch
  .type dc_emu_switch, @function
dc_emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size dc_emu_switch, .-dc_emu_switch
)");

struct Fiber {
  void* sp = nullptr;  // saved stack pointer while switched out
  unsigned tid = 0;
  bool done = false;
  Wait wait = Wait::None;
  unsigned shuffles = 0;  // shuffles this thread has done: picks the slot buffer (two alternate)
};

// One block's run. Barriers count arrivals against the live (not yet returned) threads, as a GPU counts an exited
// thread as arrived.
struct BlockRun {
  void* scheduler_sp = nullptr;
  std::vector<Fiber> fibers;
  Fiber* current = nullptr;
  const std::function<void()>* body = nullptr;
  unsigned live = 0, block_arrived = 0;
  unsigned warp_live[kMaxThreads / kWarp] = {}, warp_arrived[kMaxThreads / kWarp] = {};
  uint64_t slots[kMaxThreads / kWarp][2][kWarp] = {};
  std::set<void*> shared_filled;  // the block's __shared__ variables already filled (poison_shared)
  std::string failure;
};

thread_local BlockRun* g_run = nullptr;
thread_local cudaError_t g_last_error = cudaSuccess;
thread_local std::string g_last_failure;
// Shared memory is a static variable of the kernel: one launch at a time in the process.
std::mutex g_launch_mutex;

// Stacks are mapped once per OS thread and reused by every block.
std::vector<char*>& stacks() {
  thread_local std::vector<char*> s;
  return s;
}

char* stack(unsigned i) {
  auto& s = stacks();
  while (s.size() <= i) {
    void* p = mmap(nullptr, kStackBytes + kGuardBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::runtime_error("cuda emulation: cannot map a fiber stack");
    mprotect(p, kGuardBytes, PROT_NONE);
    s.push_back(static_cast<char*>(p) + kGuardBytes);
  }
  return s[i];
}

// The first code of every fiber; it never returns (a finished fiber is not resumed again).
[[noreturn]] void fiber_entry() {
  BlockRun& r = *g_run;
  (*r.body)();
  Fiber& f = *r.current;
  f.done = true;
  --r.live;
  --r.warp_live[f.tid / kWarp];
  dc_emu_switch(&f.sp, r.scheduler_sp);
  __builtin_unreachable();
}

// A fresh stack whose first switch "returns" into fiber_entry, with the stack aligned as at a function's entry.
void* initial_sp(char* stack_base) {
  auto* top = reinterpret_cast<uintptr_t*>((reinterpret_cast<uintptr_t>(stack_base) + kStackBytes) & ~uintptr_t(15));
  *--top = 0;                                              // fiber_entry's return address: none
  *--top = reinterpret_cast<uintptr_t>(&fiber_entry);      // where dc_emu_switch's ret goes
  for (int i = 0; i < 6; ++i) *--top = 0;                  // rbp, rbx, r12-r15
  return top;
}

void yield() {
  BlockRun& r = *g_run;
  dc_emu_switch(&r.current->sp, r.scheduler_sp);
}

// Releases the waiters of a barrier whose live threads have all arrived (also after a thread returned).
void release_complete_barriers(BlockRun& r) {
  if (r.block_arrived > 0 && r.block_arrived == r.live) {
    r.block_arrived = 0;
    for (Fiber& f : r.fibers) {
      if (f.wait == Wait::Block) f.wait = Wait::None;
    }
  }
  for (unsigned w = 0; w < (r.fibers.size() + kWarp - 1) / kWarp; ++w) {
    if (r.warp_arrived[w] > 0 && r.warp_arrived[w] == r.warp_live[w]) {
      // A full-mask shuffle needs all 32 lanes: with some returned, a GPU leaves the result undefined.
      if (r.warp_live[w] != kWarp && r.failure.empty()) {
        r.failure = "warp shuffle in block " + std::to_string(blockIdx.x) + ", warp " + std::to_string(w) + " with " +
                    std::to_string(r.warp_live[w]) + " of 32 lanes live";
      }
      r.warp_arrived[w] = 0;
      for (unsigned t = w * kWarp; t < std::min<size_t>(r.fibers.size(), (w + 1) * kWarp); ++t) {
        if (r.fibers[t].wait == Wait::Warp) r.fibers[t].wait = Wait::None;
      }
    }
  }
}

void run_block(BlockRun& r, unsigned block) {
  for (unsigned t = 0; t < block; ++t) {
    Fiber& f = r.fibers[t];
    f = Fiber{};
    f.tid = t;
    DC_EMU_CLEAN_STACK(stack(t), kStackBytes);
    f.sp = initial_sp(stack(t));
  }
  r.live = block;
  r.block_arrived = 0;
  r.shared_filled.clear();
  for (unsigned w = 0; w < (block + kWarp - 1) / kWarp; ++w) {
    r.warp_live[w] = std::min(kWarp, block - w * kWarp);
    r.warp_arrived[w] = 0;
  }
  // Between barriers, threads run one after another: even blocks from thread 0 up, odd blocks from the last thread
  // down. A read of shared memory that a missing __syncthreads leaves unordered with its write then sees the stale
  // value in one of the two orders, whichever thread reads.
  const bool descending = blockIdx.x % 2 == 1;
  while (r.live > 0) {
    bool ran = false;
    for (unsigned i = 0; i < block; ++i) {
      Fiber& f = r.fibers[descending ? block - 1 - i : i];
      if (f.done || f.wait != Wait::None) continue;
      r.current = &f;
      threadIdx.x = f.tid;
      dc_emu_switch(&r.scheduler_sp, f.sp);
      ran = true;
      release_complete_barriers(r);
    }
    if (!ran) {
      r.failure = "deadlock in block " + std::to_string(blockIdx.x) + ": " + std::to_string(r.live) +
                  " live threads wait at a barrier that the others never reach";
      return;
    }
  }
}

}  // namespace

cudaError_t run_grid(unsigned grid, unsigned block, const std::function<void()>& thread_body) {
  if (grid == 0 || block == 0 || block > kMaxThreads) return cudaErrorInvalidConfiguration;
  const std::lock_guard<std::mutex> lock(g_launch_mutex);
  BlockRun r;
  r.fibers.resize(block);
  r.body = &thread_body;
  g_run = &r;
  gridDim = {grid, 1, 1};
  blockDim = {block, 1, 1};
  for (unsigned b = 0; b < grid && r.failure.empty(); ++b) {
    blockIdx.x = b;
    run_block(r, block);
  }
  g_run = nullptr;
  threadIdx = blockIdx = blockDim = gridDim = dc_emu_index{};
  if (r.failure.empty()) return cudaSuccess;
  g_last_failure = r.failure;
  return cudaErrorLaunchFailure;
}

void note_launch(const void* kernel) {
  static const char* const log = std::getenv("DC_EMULATION_LAUNCH_LOG");
  if (log == nullptr) return;
  static std::mutex mutex;
  static std::set<const void*> seen;
  const std::lock_guard<std::mutex> lock(mutex);
  if (!seen.insert(kernel).second) return;
  Dl_info info{};
  const char* name = dladdr(kernel, &info) != 0 && info.dli_sname != nullptr ? info.dli_sname : "?";
  if (FILE* f = std::fopen(log, "a")) {
    std::fprintf(f, "%s\n", name);
    std::fclose(f);
  }
}

const char* last_failure() { return g_last_failure.c_str(); }

void set_last_error(cudaError_t err) {
  if (err != cudaSuccess) g_last_error = err;  // the last error, until read, like the runtime's
}

void poison_shared(void* p, size_t bytes) {
  if (g_run->shared_filled.insert(p).second) std::memset(p, 0x7f, bytes);
}

void sync_threads() {
  BlockRun& r = *g_run;
  r.current->wait = Wait::Block;
  ++r.block_arrived;
  yield();
}

uint64_t exchange_in_warp(uint64_t bits, unsigned src_lane, unsigned mask) {
  BlockRun& r = *g_run;
  Fiber& f = *r.current;
  const unsigned warp = f.tid / kWarp;
  if (mask != 0xffffffffu && r.failure.empty()) {
    r.failure = "a warp shuffle with mask " + std::to_string(mask) + ": only full-warp shuffles are emulated";
  }
  const unsigned buffer = f.shuffles++ & 1;
  r.slots[warp][buffer][f.tid % kWarp] = bits;
  f.wait = Wait::Warp;
  ++r.warp_arrived[warp];
  yield();
  // Every lane has written this shuffle's buffer; none can write it again before all have read it: the next shuffle
  // writes the other buffer, and the one after needs every lane past the next barrier.
  return r.slots[warp][buffer][src_lane % kWarp];
}

}  // namespace dc_emu

cudaError_t cudaGetLastError() {
  const cudaError_t err = dc_emu::g_last_error;
  dc_emu::g_last_error = cudaSuccess;
  return err;
}

const char* cudaGetErrorString(cudaError_t err) {
  switch (err) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorLaunchOutOfResources: return "too many resources requested for launch";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorLaunchFailure: return dc_emu::last_failure();
  }
  return "unknown error";
}

cudaError_t cudaGetDevice(int* device) {
  *device = 0;
  return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device) {
  if (device != 0 || attr != cudaDevAttrMultiProcessorCount) return cudaErrorInvalidValue;
  *value = dc_emu::kMultiprocessors;
  return cudaSuccess;
}

cudaError_t cudaMemsetAsync(void* p, int value, size_t bytes, cudaStream_t) {
  std::memset(p, value, bytes);
  return cudaSuccess;
}
