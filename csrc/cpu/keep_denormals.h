// The 8-bit wire's public copies must come out bit-identical on the sender and on every receiver
// (int8_codec_math.h), and subnormal float32 values are part of that math: a copy of 2e-38 moved by a level of -2
// times a scale of 1.2e-38 is -4e-39 with IEEE arithmetic and -0 with the result flushed. The flush-to-zero and
// denormals-are-zero modes are per thread state a caller may have set (torch.set_flush_denormal(True) sets both in
// the calling thread; a thread pool started meanwhile inherits them), so one rank flushing and its neighbour not
// would part their copies for good. Every CPU chunk that computes copies therefore runs with both modes off, and
// restores the caller's modes on leaving: a register read per chunk (at::parallel_for hands a chunk of at least
// 32K elements to a thread, and each pool thread has its own register), and two writes only when a mode was set.
// GPUs need nothing: nvcc keeps denormals unless built with -ftz=true or --use_fast_math, which build_tools/flags.py
// does not pass.
#pragma once

#include <cstdint>

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#endif

namespace decent_comm {
namespace cpu {

class KeepDenormals {
 public:
  // `active` false: nothing is read or changed (the fused ops' chunks without payloads: no copy to protect, and the
  // caller's modes apply to the mix as they do to torch's own kernels).
  explicit KeepDenormals(bool active = true) {
    if (!active) return;
#if defined(__x86_64__) || defined(__i386__)
    // MXCSR bit 15: flush to zero, bit 6: denormals are zero
    constexpr unsigned kFlush = 0x8040u;
    saved_ = _mm_getcsr();
    if (saved_ & kFlush) {
      _mm_setcsr(saved_ & ~kFlush);
      changed_ = true;
    }
#elif defined(__aarch64__)
    // FPCR bit 24 (FZ): flush float32 and float64 subnormal inputs and results to zero
    constexpr uint64_t kFlush = uint64_t(1) << 24;
    uint64_t fpcr;
    __asm__ __volatile__("mrs %0, fpcr" : "=r"(fpcr));
    saved_ = fpcr;
    if (fpcr & kFlush) {
      const uint64_t cleared = fpcr & ~kFlush;
      __asm__ __volatile__("msr fpcr, %0" : : "r"(cleared));
      changed_ = true;
    }
#endif
  }

  ~KeepDenormals() {
    if (!changed_) return;
#if defined(__x86_64__) || defined(__i386__)
    _mm_setcsr(static_cast<unsigned>(saved_));
#elif defined(__aarch64__)
    const uint64_t fpcr = saved_;
    __asm__ __volatile__("msr fpcr, %0" : : "r"(fpcr));
#endif
  }

  KeepDenormals(const KeepDenormals&) = delete;
  KeepDenormals& operator=(const KeepDenormals&) = delete;

 private:
  uint64_t saved_ = 0;
  bool changed_ = false;
};

}  // namespace cpu
}  // namespace decent_comm
