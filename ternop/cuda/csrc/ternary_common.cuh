// What the CUDA kernels of format v1 share: x's dtype codes, conversions to and from the fp32
// accumulator, cp.async, the launchers' argument check and their dispatch on x's dtype.
//
// Like the kernels it holds no torch headers, so each .cu still compiles alone (CI runs nvcc
// on each). Everything is in an anonymous namespace: each kernel file gets its own copy.

#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <utility>

namespace ternop {

// x's dtype, as linear_cuda.cpp passes it.
enum XDtype : int { kFloat16 = 0, kBFloat16 = 1, kFloat32 = 2 };

namespace {

// x's dtype <-> the fp32 accumulator.
template <typename T>
struct Fp;

template <>
struct Fp<__half> {
  __device__ __forceinline__ static __half from_float(float f) { return __float2half_rn(f); }
  __device__ __forceinline__ static float to_float(__half h) { return __half2float(h); }
  // lo in the low 16 bits, each rounded to nearest as from_float rounds it
  __device__ __forceinline__ static uint32_t pack2(float lo, float hi) {
    const __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
};

template <>
struct Fp<__nv_bfloat16> {
  __device__ __forceinline__ static __nv_bfloat16 from_float(float f) { return __float2bfloat16_rn(f); }
  __device__ __forceinline__ static float to_float(__nv_bfloat16 h) { return __bfloat162float(h); }
  __device__ __forceinline__ static uint32_t pack2(float lo, float hi) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
};

template <>
struct Fp<float> {
  __device__ __forceinline__ static float from_float(float f) { return f; }
  __device__ __forceinline__ static float to_float(float h) { return h; }
};

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes from global to shared memory without the registers, cached in L2 only.
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src));
#endif
}

// The same, cached in L1 too: for data that other warps of the SM read again.
__device__ __forceinline__ void cp_async16_l1(uint32_t dst, const void* src) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.ca.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src));
#endif
}

__device__ __forceinline__ void cp_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;");
#endif
}

template <int N>
__device__ __forceinline__ void cp_async_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;" ::"n"(N));
#endif
}

// Programmatic dependent launch (sm_90 and later). A kernel started by launch_early may begin
// while the kernel before it on the stream still runs, once every block of that kernel has
// executed griddepcontrol.launch_dependents or finished (the per-token quantization kernel signals
// first thing, ternop/cuda/triton_fused.py). Before it reads anything an earlier kernel writes, it
// calls wait_for_prior_grids(), which returns once the prior grid has completed and its writes are
// visible; before that it may read only what no kernel writes (the weights, their scales). Without
// the launch attribute, or before sm_90, the wait returns at once.
__device__ __forceinline__ void wait_for_prior_grids() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Whether launches on the current device ask for an early start: sm_90 or later, unless the
// environment sets TERNOP_PDL=0 (read once a process: compare the two in two processes).
inline bool early_launch_allowed() {
  static const bool wanted = [] {
    const char* v = std::getenv("TERNOP_PDL");
    return v == nullptr || std::strcmp(v, "0") != 0;
  }();
  static std::atomic<signed char> hopper[64] = {};  // per device: 0 not asked yet, 1 yes, -1 no
  int dev = 0;
  if (!wanted || cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) return false;
  signed char known = hopper[dev].load(std::memory_order_relaxed);
  if (known == 0) {
    int major = 0;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess) return false;
    known = major >= 9 ? 1 : -1;
    hopper[dev].store(known, std::memory_order_relaxed);
  }
  return known > 0;
}

// The launch attribute of an early start: programmatic stream serialization.
inline void allow_early_start(cudaLaunchAttribute& attr) {
  attr = {};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
}

// kernel<<<grid, block, smem, stream>>>(args...), with programmatic stream serialization when
// `early` (see wait_for_prior_grids: the kernel must wait before it reads what earlier kernels write).
template <typename... Params, typename... Args>
cudaError_t launch_early(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                         bool early, Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attr;
  allow_early_start(attr);
  config.attrs = &attr;
  config.numAttrs = early ? 1 : 0;
  const cudaError_t err = cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
  return err != cudaSuccess ? err : cudaGetLastError();
}

// The most token slabs a small-M launch runs (launch_ternary_mma's and launch_ternary_mma_a8's `slab`):
// one per CTA along the grid's y, whose largest extent is 65535.
constexpr int kMaxSlabs = 65535;

// 1 <= M <= max_m, N >= 1, K a positive multiple of 128 (one scale block).
inline bool valid_shape(int M, int max_m, int N, int K) {
  return M >= 1 && M <= max_m && N >= 1 && K >= 128 && K % 128 == 0;
}

// The work split of the small-M tensor-core kernels (ternary_mma.cu, ternary_mma_a8.cu): a
// CTA of groups x warps_k warps (at most max_warps) owns `groups` sets of 16 weight rows, and the
// warps_k warps of a set split its scale blocks. Warps of different sets read the same x at
// the same time, so a CTA reads x from L2 once for 16 * groups rows instead of once per 16
// (at M = 16 that traffic is eight times the weights' bytes). Measured, it pays only on the
// widest layers, by 0-14%: x traffic is not what mainly limits these kernels.
struct SmallMSplit {
  int groups;   // sets of 16 rows per CTA: 1, 2, 4 or 8
  int warps_k;  // warps per set, each with a contiguous range of at least two scale blocks
  int warps_log2;  // log2(warps_k), what the kernels take
};

// `row_groups` <= 0 picks by the layer: the most sets (up to max_warps) that still leave at
// least 1.5 CTAs per SM; fewer leave SMs idle at the end of the grid. On the H200
// (benchmarks/sweep_tiles.py --kernel mma / mma_a8, results/h200/sweep_mma*_row_sets.json) that
// takes 4 sets on 4096->14336 and 8 on 4096->28672 and keeps 1 on every narrower layer, where
// more sets measured slower.
constexpr int kSmallMMinCtasPer2Sms = 3;  // at least 3 CTAs per 2 SMs
inline SmallMSplit small_m_split(int N, int K, int sms, int row_groups, int max_warps) {
  const int blocks = K / 128;
  int w = 1;  // warps for one set: at least two blocks each (K = 4096 -> 8 warps of 4 blocks)
  while (w < max_warps && blocks / (2 * w) >= 2) w *= 2;
  int r = row_groups;
  if (r <= 0) {
    r = 1;
    while (2 * r <= max_warps && 2 * ((N + 32 * r - 1) / (32 * r)) >= kSmallMMinCtasPer2Sms * sms) r *= 2;
  }
  const int warps_k = r >= w ? 1 : w / r;
  int log2 = 0;
  while ((1 << log2) < warps_k) ++log2;
  return {r, warps_k, log2};
}

// The cross-warp sum of the small-M kernels: the warps 1..warps-1 of each set of 16 rows park
// their C fragments in `red` (warps - 1 slots per set), and warp 0 adds them in slot order, so
// the sum is deterministic (no atomics). Every thread of the CTA calls it (it holds a
// __syncthreads when warps > 1); it returns true in the one warp of the set that then holds
// the set's sum and writes the outputs.
template <int NT>
__device__ __forceinline__ bool sum_set_warps(float (*red)[NT * 4][32], float (&acc)[NT][4], int set, int warp,
                                              int warps, int lane) {
  if (warps == 1) return true;
  float(*const mine)[NT * 4][32] = red + set * (warps - 1);
  if (warp > 0) {
#pragma unroll
    for (int t = 0; t < NT; ++t)
#pragma unroll
      for (int r = 0; r < 4; ++r) mine[warp - 1][t * 4 + r][lane] = acc[t][r];
  }
  __syncthreads();
  if (warp > 0) return false;
  for (int w = 0; w < warps - 1; ++w)
#pragma unroll
    for (int t = 0; t < NT; ++t)
#pragma unroll
      for (int r = 0; r < 4; ++r) acc[t][r] += mine[w][t * 4 + r][lane];
  return true;
}

// launch(T{}) with T the element type of `dtype`: fp16, bf16, and fp32 when kWithFp32 (a
// kernel without an fp32 instance is never instantiated for it).
template <bool kWithFp32, typename Launch>
cudaError_t dispatch_dtype(int dtype, Launch&& launch) {
  switch (dtype) {
    case kFloat16: return launch(__half{});
    case kBFloat16: return launch(__nv_bfloat16{});
    case kFloat32:
      if constexpr (kWithFp32) return launch(float{});
      return cudaErrorInvalidValue;
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

}  // namespace ternop
