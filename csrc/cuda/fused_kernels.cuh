// The CUDA kernels of the fused gossip-mix ops and their launchers, as templates. Two translation units instantiate
// them, so nvcc compiles the two halves in parallel: fused_mix.cu the kernels that take their hyper-parameters as
// arguments, fused_mix_resolved.cu those that read them from device memory (the device-scalar path). Includes only
// the CUDA runtime and the shared math headers (never torch headers: nvcc spends minutes on those).
//
// Each thread handles VEC consecutive elements with 16-byte loads/stores of x (VEC = 16 / sizeof(x)),
// the neighbours, the gradient and the float32 state, in a grid-stride loop with int64 indices; the
// last numel % VEC elements are done one by one by the same kernel. When any pointer is not aligned to
// its vector width (e.g. a view at an odd storage offset) the launcher picks the VEC = 1 instantiation.
// Neighbour counts 1 and 2 (one-peer and ring topologies) are compile-time constants so the loop over
// neighbours unrolls; other counts use a runtime loop. The 8-bit wire's mixes (PayloadOperands: the first neighbours
// are public copies advanced by their payloads in the same pass) have kernels of their own (kWire). The grid is one
// wave of resident blocks, sized from the occupancy of each kernel variant on x's device.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

#include "../kernels/fused_launch.h"
#include "../kernels/int8_codec_math.h"

namespace decent_comm {
namespace cuda_kernels {

constexpr int kThreads = 256;  // threads per block

template <DType D> struct GpuStorage;
template <> struct GpuStorage<DType::Float32> {
  using type = float;
  static __device__ __forceinline__ float load(float v) { return v; }
  static __device__ __forceinline__ float store(float v) { return v; }
};
// Half-precision storage is handled as raw 16-bit patterns so the vector structs stay trivial.
template <> struct GpuStorage<DType::BFloat16> {
  using type = unsigned short;
  static __device__ __forceinline__ float load(unsigned short v) { return __uint_as_float(unsigned(v) << 16); }
  static __device__ __forceinline__ unsigned short store(float v) {
    return __bfloat16_as_ushort(__float2bfloat16_rn(v));  // round to nearest even, as c10::BFloat16
  }
};
template <> struct GpuStorage<DType::Float16> {
  using type = unsigned short;
  static __device__ __forceinline__ float load(unsigned short v) { return __half2float(__ushort_as_half(v)); }
  static __device__ __forceinline__ unsigned short store(float v) { return __half_as_ushort(__float2half_rn(v)); }
};

template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

template <typename T, int N>
__device__ __forceinline__ Vec<T, N> load_vec(const T* p) {
  return *reinterpret_cast<const Vec<T, N>*>(p);
}
template <typename T, int N>
__device__ __forceinline__ void store_vec(T* p, const Vec<T, N>& v) {
  *reinterpret_cast<Vec<T, N>*>(p) = v;
}

struct KernelArgs {
  int64_t numel;
  void* x;
  const void* neighbors[kMaxNeighbors];
  float weights[kMaxNeighbors];
  float self_weight;
  int num_neighbors;
  const void* grad;
  float* state[kMaxState];
  float* disagreement;
  const ResolvedUpdate* resolved;  // optimizer ops with device scalars: the hyper-parameters to use, else null
  bool run_if_skipped;             // with `resolved`: run only when found_inf skips the update (else only when not)
  PayloadOperands payloads;        // the 8-bit wire: neighbours [0, payloads.count) are copies to advance first
};

// Which resolved call a launch serves, and on which outcome of found_inf it runs.
struct Gate {
  const ResolvedUpdate* resolved = nullptr;
  bool run_if_skipped = false;
};

// The 8-bit wire: advances W consecutive elements of public copy j (a float32 neighbour) by its payload, in place,
// with the codec's own operation (int8_dequantize_add: unfused, so the copy keeps the sender's bits). With W > 1 the
// launcher has checked that the W elements share one codec block and that the levels are W-byte aligned.
template <int W>
__device__ __forceinline__ void advance_copy(const KernelArgs& a, int j, int64_t base, Vec<float, W>& yv) {
  const PayloadOperands& p = a.payloads;
  const Vec<int8_t, W> lv = load_vec<int8_t, W>(p.levels[j] + base);
  // 32-bit division (OpCall keeps payload indices below 2^31): the 64-bit one is a called routine that made ptxas
  // spill in some variants.
  const float scale = p.scales[j][uint32_t(p.offset + base) / uint32_t(p.block)];
#pragma unroll
  for (int e = 0; e < W; ++e) yv.v[e] = int8_dequantize_add(yv.v[e], float(lv.v[e]), scale);
  // The copies travel as const neighbours; OpCall registered them as outputs of the op.
  store_vec<float, W>(const_cast<float*>(static_cast<const float*>(a.neighbors[j])) + base, yv);
}

// Processes W consecutive elements starting at `base`; returns sum((mixed - x_old)^2) over them.
template <DType XD, DType ND, int K, int W, typename Update, bool kWire>
__device__ __forceinline__ float process(const KernelArgs& a, const Hyper<float>& h, int64_t base) {
  using XS = GpuStorage<XD>;
  using NS = GpuStorage<ND>;
  using XT = typename XS::type;
  using NT = typename NS::type;
  XT* const x = static_cast<XT*>(a.x);
  const Vec<XT, W> xv = load_vec<XT, W>(x + base);
  // The mix rounds every product and every sum on its own (__fmul_rn / __fadd_rn, which nvcc never contracts into
  // an FMA), as the CPU loops do (-ffp-contract=off): left to nvcc, the kernels with 1 or 2 neighbours fixed at
  // compile time contracted x * self_weight + w * y one way and those with a run-time count (every 8-bit-wire
  // kernel) another, so the fused wire op and decode-then-mix gave different bits for the same mix. The loads
  // dominate this loop; the extra instruction per neighbour costs nothing measurable.
  float x_old[W], mixed[W];
#pragma unroll
  for (int e = 0; e < W; ++e) {
    x_old[e] = XS::load(xv.v[e]);
    mixed[e] = __fmul_rn(a.self_weight, x_old[e]);
  }
  const int k = K >= 0 ? K : a.num_neighbors;
#pragma unroll 4
  for (int j = 0; j < k; ++j) {
    Vec<NT, W> yv = load_vec<NT, W>(static_cast<const NT*>(a.neighbors[j]) + base);
    if constexpr (kWire) {
      if (j < a.payloads.count) advance_copy<W>(a, j, base, yv);  // the same branch for every thread
    }
    const float w = a.weights[j];
#pragma unroll
    for (int e = 0; e < W; ++e) mixed[e] = __fadd_rn(mixed[e], __fmul_rn(w, NS::load(yv.v[e])));
  }
  float sq = 0.f;
  if (a.disagreement != nullptr) {
#pragma unroll
    for (int e = 0; e < W; ++e) sq += (mixed[e] - x_old[e]) * (mixed[e] - x_old[e]);
  }
  Vec<XT, W> gv;
  if (Update::kHasGrad) gv = load_vec<XT, W>(static_cast<const XT*>(a.grad) + base);
  Vec<float, W> sv[Update::kNumState > 0 ? Update::kNumState : 1];
#pragma unroll
  for (int q = 0; q < Update::kNumState; ++q) sv[q] = load_vec<float, W>(a.state[q] + base);
  Vec<XT, W> out;
#pragma unroll
  for (int e = 0; e < W; ++e) {
    float s[kMaxState];
#pragma unroll
    for (int q = 0; q < Update::kNumState; ++q) s[q] = sv[q].v[e];
    const float g = Update::kHasGrad ? unscale_grad(h, XS::load(gv.v[e])) : 0.f;
    out.v[e] = XS::store(Update::apply(h, x_old[e], mixed[e], g, s));
#pragma unroll
    for (int q = 0; q < Update::kNumState; ++q) sv[q].v[e] = s[q];
  }
  store_vec<XT, W>(x + base, out);
#pragma unroll
  for (int q = 0; q < Update::kNumState; ++q) store_vec<float, W>(a.state[q] + base, sv[q]);
  return sq;
}

// The grid-stride loop over the whole buffer: VEC elements per item, then the tail one by one. Returns this thread's
// share of sum((mixed - x_old)^2).
template <DType XD, DType ND, int K, int VEC, typename Update, bool kWire>
__device__ __forceinline__ float grid_stride(const KernelArgs& a, const Hyper<float>& h) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t tid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t num_vec = a.numel / VEC;
  float sq = 0.f;
  for (int64_t v = tid; v < num_vec; v += stride) sq += process<XD, ND, K, VEC, Update, kWire>(a, h, v * VEC);
  if (VEC > 1) {
    for (int64_t i = num_vec * VEC + tid; i < a.numel; i += stride) sq += process<XD, ND, K, 1, Update, kWire>(a, h, i);
  }
  return sq;
}

// kResolved: the kernel takes its hyper-parameters from a ResolvedUpdate in device memory (written by
// resolve_kernel, queued before it) instead of its arguments. With device scalars an optimizer call is two such
// launches of which one does the work: the update kernel, gated to run when the update is applied, and the
// mix-only kernel, gated to run when found_inf skips it (its whole grid exits at once otherwise). Every variant
// keeps one loop and one hyper-parameter source: a second copy of the loop, or a run-time choice of source, made
// ptxas spill or raised the registers (and lowered the occupancy) of the plain kernels.
template <DType XD, DType ND, int K, int VEC, typename Update, bool kResolved, bool kWire>
__global__ void __launch_bounds__(kThreads)
    fused_mix_kernel(const __grid_constant__ KernelArgs a, const __grid_constant__ Hyper<float> host_hyper) {
  float sq;
  if constexpr (kResolved) {
    // The same for every thread, so whole blocks exit.
    if (bool(a.resolved->skip) != a.run_if_skipped) return;
    // Read in place (L1-resident): a register copy of the whole struct made ptxas spill in some variants.
    sq = grid_stride<XD, ND, K, VEC, Update, kWire>(a, a.resolved->hyper);
  } else {
    sq = grid_stride<XD, ND, K, VEC, Update, kWire>(a, host_hyper);
  }
  if (a.disagreement != nullptr) {
    // Block reduction: warp shuffles, then one partial per warp in shared memory, one atomic per block.
    __shared__ float warp_sums[kThreads / 32];
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) sq += __shfl_down_sync(0xffffffffu, sq, off);
    if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x >> 5] = sq;
    __syncthreads();
    if (threadIdx.x == 0) {
      float total = 0.f;
#pragma unroll
      for (int w = 0; w < kThreads / 32; ++w) total += warp_sums[w];
      atomicAdd(a.disagreement, total);
    }
  }
}

// Devices whose attributes are cached; a process with more still works, it just asks every time.
constexpr int kCachedDevices = 64;

// A per-device value computed once by `query` (a cudaError_t-returning callable filling an int > 0).
template <typename Query>
inline cudaError_t cached(std::atomic<int>* cache, int device, int* out, Query query) {
  const bool cacheable = device >= 0 && device < kCachedDevices;
  if (cacheable && (*out = cache[device].load(std::memory_order_relaxed)) > 0) return cudaSuccess;
  const cudaError_t err = query(out);
  if (err != cudaSuccess) return err;
  if (*out <= 0) return cudaErrorLaunchOutOfResources;  // a kernel no SM can hold would not launch either
  if (cacheable) cache[device].store(*out, std::memory_order_relaxed);
  return cudaSuccess;
}

inline cudaError_t sm_count(int device, int* out) {
  static std::atomic<int> cache[kCachedDevices];
  return cached(cache, device, out, [device](int* n) {
    return cudaDeviceGetAttribute(n, cudaDevAttrMultiProcessorCount, device);
  });
}

inline bool aligned(const void* p, size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

// One wave of resident blocks: as many as the SMs of x's device hold of this kernel variant at kThreads threads
// (its registers and shared memory decide; cached per variant and device), fewer when the buffer is small. The
// grid-stride loop covers the rest.
template <DType XD, DType ND, int K, int VEC, typename Update, bool kResolved, bool kWire = false>
int launch(const KernelArgs& a, const Hyper<float>& h, int device, cudaStream_t stream) {
  static std::atomic<int> per_sm_cache[kCachedDevices];
  const auto kernel = fused_mix_kernel<XD, ND, K, VEC, Update, kResolved, kWire>;
  int per_sm = 0, sms = 0;
  // The occupancy query is about the current device, which the caller's guard set to `device`.
  cudaError_t err = cached(per_sm_cache, device, &per_sm, [kernel](int* n) {
    return cudaOccupancyMaxActiveBlocksPerMultiprocessor(n, kernel, kThreads, 0);
  });
  if (err == cudaSuccess) err = sm_count(device, &sms);
  if (err != cudaSuccess) return int(err);
  const int64_t items = (a.numel + VEC - 1) / VEC;
  const int64_t wanted = (items + kThreads - 1) / kThreads;
  const int64_t wave = int64_t(per_sm) * sms;
  const unsigned blocks = unsigned(wanted < wave ? (wanted > 0 ? wanted : 1) : wave);
  kernel<<<blocks, kThreads, 0, stream>>>(a, h);
  return int(cudaGetLastError());
}

template <DType XD, DType ND, typename Update, bool kResolved>
int launch_typed(const FusedOperands& o, const HyperParams& hp, Gate gate, int device, cudaStream_t stream) {
  KernelArgs a{};
  a.numel = o.numel;
  a.x = o.x;
  a.num_neighbors = o.num_neighbors;
  for (int j = 0; j < o.num_neighbors; ++j) {
    a.neighbors[j] = o.neighbors[j];
    a.weights[j] = float(o.weights[j]);
  }
  a.self_weight = float(o.self_weight);
  a.grad = o.grad;
  for (int q = 0; q < kMaxState; ++q) a.state[q] = o.state[q];
  a.disagreement = o.disagreement;
  a.resolved = gate.resolved;
  a.run_if_skipped = gate.run_if_skipped;
  a.payloads = o.payloads;
  const Hyper<float> h(hp);

  constexpr int VEC = 16 / sizeof(typename GpuStorage<XD>::type);
  bool vec_ok = aligned(o.x, 16) && (!Update::kHasGrad || aligned(o.grad, 16));
  for (int j = 0; j < o.num_neighbors; ++j)
    vec_ok = vec_ok && aligned(o.neighbors[j], VEC * sizeof(typename GpuStorage<ND>::type));
  for (int q = 0; q < Update::kNumState; ++q) vec_ok = vec_ok && aligned(o.state[q], VEC * sizeof(float));
  if (o.payloads.count > 0) {
    // The 8-bit wire's kernels are separate instantiations with a run-time neighbour count, so the others keep their
    // registers (the dequantization compiled into every kernel raised some past the 64 registers that hold 4 blocks
    // of 256 threads per SM).
    if constexpr (ND != DType::Float32) {
      return int(cudaErrorInvalidValue);  // the copies are float32, and so every neighbour (OpCall checks it)
    } else {
      // A vector of VEC elements must lie in one codec block (one scale), and its levels be one aligned load.
      bool wire_vec = vec_ok && o.payloads.offset % VEC == 0 && o.payloads.block % VEC == 0;
      for (int j = 0; j < o.payloads.count; ++j) wire_vec = wire_vec && aligned(o.payloads.levels[j], VEC);
      if (!wire_vec) return launch<XD, ND, -1, 1, Update, kResolved, true>(a, h, device, stream);
      return launch<XD, ND, -1, VEC, Update, kResolved, true>(a, h, device, stream);
    }
  }
  if (!vec_ok) return launch<XD, ND, -1, 1, Update, kResolved>(a, h, device, stream);
  switch (o.num_neighbors) {
    case 1: return launch<XD, ND, 1, VEC, Update, kResolved>(a, h, device, stream);
    case 2: return launch<XD, ND, 2, VEC, Update, kResolved>(a, h, device, stream);
    default: return launch<XD, ND, -1, VEC, Update, kResolved>(a, h, device, stream);
  }
}

template <DType XD, typename Update, bool kResolved>
int dispatch_neighbor(const FusedOperands& o, const HyperParams& hp, Gate g, int device, cudaStream_t s) {
  switch (o.neighbor_dtype) {
    case DType::Float32: return launch_typed<XD, DType::Float32, Update, kResolved>(o, hp, g, device, s);
    case DType::BFloat16: return launch_typed<XD, DType::BFloat16, Update, kResolved>(o, hp, g, device, s);
    case DType::Float16: return launch_typed<XD, DType::Float16, Update, kResolved>(o, hp, g, device, s);
    default: return int(cudaErrorInvalidValue);
  }
}

template <typename Update, bool kResolved>
int dispatch_x(const FusedOperands& o, const HyperParams& hp, Gate g, int device, cudaStream_t s) {
  switch (o.x_dtype) {
    case DType::Float32: return dispatch_neighbor<DType::Float32, Update, kResolved>(o, hp, g, device, s);
    case DType::BFloat16: return dispatch_neighbor<DType::BFloat16, Update, kResolved>(o, hp, g, device, s);
    case DType::Float16: return dispatch_neighbor<DType::Float16, Update, kResolved>(o, hp, g, device, s);
    default: return int(cudaErrorInvalidValue);
  }
}

// Launches the kernel of `kind` for the operands' dtypes, neighbour count and alignment.
template <bool kResolved>
int launch_update(UpdateKind kind, const FusedOperands& o, const HyperParams& hp, Gate g, int device,
                  cudaStream_t stream) {
  switch (kind) {
    case UpdateKind::Mix: return dispatch_x<MixUpdate, kResolved>(o, hp, g, device, stream);
    case UpdateKind::Sgd: return dispatch_x<SgdUpdate, kResolved>(o, hp, g, device, stream);
    case UpdateKind::SgdMomentum: return dispatch_x<SgdMomentumUpdate, kResolved>(o, hp, g, device, stream);
    case UpdateKind::Adam: return dispatch_x<AdamUpdate, kResolved>(o, hp, g, device, stream);
    case UpdateKind::AccumAdam: return dispatch_x<AccumAdamUpdate, kResolved>(o, hp, g, device, stream);
  }
  return int(cudaErrorInvalidValue);
}

}  // namespace cuda_kernels
}  // namespace decent_comm
