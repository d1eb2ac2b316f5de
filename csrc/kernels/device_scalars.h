// The per-call scalars that live in memory on x's device: GradScaler's scale and found_inf, and the count of
// updates applied so far. They are read once per call where the kernels run (on the GPU by a one-thread kernel queued
// before the update), so mixed precision training needs no host synchronization per step and a captured CUDA graph
// replays correct steps.
//
// Shared by the CPU and CUDA kernels, like fused_math.h, and free of torch headers for the same reason.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

#include "fused_math.h"

namespace decent_comm {

// Dtypes a step count may be stored in: torch.optim keeps `step` as a float32 (float64) tensor; int64 counts
// beyond float32's 2^24 exact integers.
enum class CountDType : int { Float32 = 0, Float64 = 1, Int64 = 2 };

struct DeviceScalars {
  const float* grad_scale = nullptr;  // gradients are divided by *grad_scale (GradScaler's current scale)
  const float* found_inf = nullptr;   // *found_inf != 0 (NaN too): skip the update: x <- mixed, state untouched
  void* step_count = nullptr;         // updates applied before this call; this one is number count + 1
  CountDType count_dtype = CountDType::Float32;

  DC_HD bool any() const { return grad_scale != nullptr || found_inf != nullptr || step_count != nullptr; }
};

// The largest count, as a power of two: float32 2^24, where torch.optim's float32 state["step"] stops (2^24 + 1
// rounds back to 2^24, so torch goes on stepping with t = 2^24; so does this), float64 2^53, int64 2^62.
DC_HD int count_limit_log2(CountDType d) { return d == CountDType::Float32 ? 24 : d == CountDType::Float64 ? 53 : 62; }

// The stored count, or -1 when it is not an integer in [0, 2^count_limit_log2] (a NaN included).
DC_HD int64_t load_count(const void* p, CountDType d) {
  const int64_t limit = int64_t(1) << count_limit_log2(d);
  if (d == CountDType::Int64) {
    const int64_t v = *static_cast<const int64_t*>(p);
    return v >= 0 && v <= limit ? v : -1;
  }
  const double v = d == CountDType::Float32 ? double(*static_cast<const float*>(p)) : *static_cast<const double*>(p);
  const bool valid = v >= 0 && v <= double(limit) && v == ::floor(v);  // false for NaN
  return valid ? int64_t(v) : -1;
}

// The number of this update: count + 1, which stays at the limit once the count reached it.
DC_HD int64_t next_count(int64_t applied, CountDType d) {
  const int64_t limit = int64_t(1) << count_limit_log2(d);
  return applied < limit ? applied + 1 : limit;
}

DC_HD void store_count(void* p, CountDType d, int64_t v) {
  if (d == CountDType::Int64) *static_cast<int64_t*>(p) = v;
  else if (d == CountDType::Float64) *static_cast<double*>(p) = double(v);
  else *static_cast<float*>(p) = float(v);
}

DC_HD bool update_skipped(const DeviceScalars& s) { return s.found_inf != nullptr && !(*s.found_inf == 0.f); }

// Resolves the hyper-parameters of this call from those the host validated and filled (`host`) and the device
// scalars. Returns false when found_inf says to skip the update (only the mix then runs). A stored count that is not
// valid (checked on the host for CPU tensors; on a GPU that would take a synchronization) makes the step NaN, so a
// corrupted count shows in x instead of passing for a plausible update.
DC_HD bool resolve_update(const HyperParams& host, const DeviceScalars& s, HyperParams& out) {
  if (update_skipped(s)) return false;
  out = host;
  // GradScaler.unscale_ multiplies by the reciprocal computed in double and rounded to float32; so does this.
  if (s.grad_scale != nullptr) out.inv_grad_scale = double(float(1.0 / double(*s.grad_scale)));
  if (s.step_count != nullptr) {
    const int64_t applied = load_count(s.step_count, s.count_dtype);
    if (applied >= 0) {
      set_step_count(out, next_count(applied, s.count_dtype));
    } else {
      out.lr = out.step_size = NAN;  // NAN, not numeric_limits: callable on the device without --expt-relaxed-constexpr
    }
  }
  return true;
}

// After the update: count += 1 (up to the limit), unless the update was skipped (or the count is not valid; it then
// stays as it is). Runs once per call, after every read of the count: on the CPU after the update, on the GPU in the
// one-thread kernel that resolved the call (the update kernels read the resolved copy, never the count itself).
DC_HD void advance_count(const DeviceScalars& s) {
  if (s.step_count == nullptr || update_skipped(s)) return;
  const int64_t applied = load_count(s.step_count, s.count_dtype);
  if (applied >= 0) store_count(s.step_count, s.count_dtype, next_count(applied, s.count_dtype));
}

}  // namespace decent_comm
