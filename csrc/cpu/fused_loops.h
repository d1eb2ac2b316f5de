// Which CPU loop runs a fused gossip-mix op (fused_ranges.h, dequantizing_ranges.h): by x dtype, neighbour dtype,
// neighbour count, disagreement output and payloads, on the at::parallel_for pool.
// Each update kind is instantiated in a translation unit of its own (fused_<update>_cpu.cpp), so the build compiles
// them in parallel; fused_mix_cpu.cpp picks one per call.
// The extension is compiled with -fopenmp: at::parallel_for is header code, and without OpenMP in the translation
// unit it would run on one thread.
#pragma once

#include <ATen/Parallel.h>

#include <functional>
#include <stdexcept>

#include "dequantizing_ranges.h"
#include "fused_ranges.h"
#include "keep_denormals.h"

namespace decent_comm {
namespace cpu {

// Small buffers are not worth waking the thread pool for.
constexpr int64_t kGrain = 32768;

// The copy of `Range` for this CPU, dequantizing payloads first when the call has any (float32 neighbours only: the
// copies are float32, and all neighbours share one dtype).
template <typename Range, DType XD, DType ND>
auto pick_loop(const FusedOperands& o) {
  if constexpr (ND == DType::Float32) {
    if (o.payloads.count > 0) return pick_range<Dequantizing<Range, XD>>();
  }
  if (o.payloads.count > 0) throw std::invalid_argument("decent_comm: payloads need float32 neighbours");
  return pick_range<Range>();
}

// A loop without a disagreement output, over the pool's chunks. A chunk that advances the 8-bit wire's copies (any
// payloads) runs with flush-to-zero and denormals-are-zero off, as the codec's (keep_denormals.h): the copies must
// come out as the sender's, whatever modes this thread has; the mix in the same pass then keeps denormals too. The
// loop is an indirect call, so no float operation moves across the mode switches.
template <typename Loop, DType XD, DType ND>
void run_plain_loop(const FusedOperands& o, const LoopContext<XD, ND>& ctx, Loop loop) {
  at::parallel_for(0, o.numel, kGrain, [&](int64_t begin, int64_t end) {
    const KeepDenormals keep(o.payloads.count > 0);
    loop(&ctx, begin, end);
  });
}

// The loops with a disagreement output (or none, for Blocked), summed over the pool's chunks in double.
template <typename Loop, DType XD, DType ND>
void run_reduced_loop(const FusedOperands& o, const LoopContext<XD, ND>& ctx, Loop loop) {
  const double disagreement = at::parallel_reduce(
      0, o.numel, kGrain, 0.0,
      [&](int64_t begin, int64_t end, double partial) {
        const KeepDenormals keep(o.payloads.count > 0);  // as run_plain_loop
        return partial + loop(&ctx, begin, end);
      },
      std::plus<double>());
  if (o.disagreement != nullptr) *o.disagreement = float(disagreement);
}

template <typename Range, DType XD, DType ND>
void run_plain(const FusedOperands& o, const HyperParams& hp) {
  const LoopContext<XD, ND> ctx(o, hp);
  run_plain_loop(o, ctx, pick_loop<Range, XD, ND>(o));
}

template <typename Range, DType XD, DType ND>
void run_reduced(const FusedOperands& o, const HyperParams& hp) {
  const LoopContext<XD, ND> ctx(o, hp);
  run_reduced_loop(o, ctx, pick_loop<Range, XD, ND>(o));
}

// P copies with payloads and the own copy (DequantizingSinglePass).
template <DType XD, typename Update, int P>
void run_dequantizing(const FusedOperands& o, const HyperParams& hp) {
  const LoopContext<XD, DType::Float32> ctx(o, hp);
  if (o.disagreement != nullptr) {
    return run_reduced_loop(o, ctx, pick_range<DequantizingSinglePass<XD, Update, P, true>>());
  }
  run_plain_loop(o, ctx, pick_range<DequantizingSinglePass<XD, Update, P, false>>());
}

template <DType XD, DType ND, typename Update>
void run_blocked(const FusedOperands& o, const HyperParams& hp) {
  run_reduced<Blocked<XD, ND, Update>, XD, ND>(o, hp);
}

template <DType XD, DType ND, typename Update, int K>
void run_fixed_k(const FusedOperands& o, const HyperParams& hp) {
  if constexpr (ND == DType::Float32 && K >= 2) {
    if (o.payloads.count == K - 1) return run_dequantizing<XD, Update, K - 1>(o, hp);
  }
  if (o.disagreement == nullptr) return run_plain<SinglePass<XD, ND, Update, K, false>, XD, ND>(o, hp);
  run_reduced<SinglePass<XD, ND, Update, K, true>, XD, ND>(o, hp);
}

template <DType XD, DType ND, typename Update>
void run_typed(const FusedOperands& o, const HyperParams& hp) {
  switch (o.num_neighbors) {
    case 0: return run_fixed_k<XD, ND, Update, 0>(o, hp);
    case 1: return run_fixed_k<XD, ND, Update, 1>(o, hp);
    case 2: return run_fixed_k<XD, ND, Update, 2>(o, hp);
    case 3: return run_fixed_k<XD, ND, Update, 3>(o, hp);
    case 4: return run_fixed_k<XD, ND, Update, 4>(o, hp);
    default: return run_blocked<XD, ND, Update>(o, hp);
  }
}

// The (x, neighbour) dtype pairs the optimizers use get the single-pass loops specialized per neighbour count:
// equal dtypes, and a float32 model over a 16-bit wire. Every other pair is valid but rare (a float64 model over a
// float32 wire, say) and runs the blocked loop, which takes any count: the same math in the same order, and 11 fewer
// instantiations per pair, which is most of the build time of these kernels.
template <DType XD, DType ND>
constexpr bool kSpecialized = XD == ND || (XD == DType::Float32 && (ND == DType::BFloat16 || ND == DType::Float16));

template <DType XD, DType ND, typename Update>
void run_pair(const FusedOperands& o, const HyperParams& hp) {
  if constexpr (kSpecialized<XD, ND>) {
    run_typed<XD, ND, Update>(o, hp);
  } else {
    run_blocked<XD, ND, Update>(o, hp);
  }
}

template <DType XD, typename Update>
void dispatch_neighbor(const FusedOperands& o, const HyperParams& hp) {
  switch (o.neighbor_dtype) {
    case DType::Float32: return run_pair<XD, DType::Float32, Update>(o, hp);
    case DType::BFloat16: return run_pair<XD, DType::BFloat16, Update>(o, hp);
    case DType::Float16: return run_pair<XD, DType::Float16, Update>(o, hp);
    case DType::Float64: return run_pair<XD, DType::Float64, Update>(o, hp);
  }
  throw std::invalid_argument("decent_comm: unsupported neighbor dtype");
}

template <typename Update>
void dispatch_x(const FusedOperands& o, const HyperParams& hp) {
  switch (o.x_dtype) {
    case DType::Float32: return dispatch_neighbor<DType::Float32, Update>(o, hp);
    case DType::BFloat16: return dispatch_neighbor<DType::BFloat16, Update>(o, hp);
    case DType::Float16: return dispatch_neighbor<DType::Float16, Update>(o, hp);
    case DType::Float64: return dispatch_neighbor<DType::Float64, Update>(o, hp);
  }
  throw std::invalid_argument("decent_comm: unsupported x dtype");
}

}  // namespace cpu
}  // namespace decent_comm
