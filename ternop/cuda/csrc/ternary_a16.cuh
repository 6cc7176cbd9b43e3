// What the tensor-core kernels of the "a16" layout (ternop/layouts.py) share: decoding a pair
// of weights into x's dtype and scaling it, and the split-K reduction (cp.async is in
// ternary_common.cuh).
// ternary_mma_tiles.cu (mma.sync) and ternary_wgmma.cu (wgmma, Hopper) include it; the
// decoding is explained at the top of ternary_mma_tiles.cu.

#pragma once

#include <type_traits>

#include "ternary_common.cuh"

namespace ternop {

namespace {

template <typename T>
struct Pair16;

template <>
struct Pair16<__half> {
  using Pair = __half2;
  static constexpr uint32_t kMagic = 0x64006400u;  // (1024, 1024): ulp 1
  static constexpr uint32_t kBias = 0x64016401u;   // (1025, 1025): fields hold v + 1
};

template <>
struct Pair16<__nv_bfloat16> {
  using Pair = __nv_bfloat162;
  static constexpr uint32_t kMagic = 0x43004300u;  // (128, 128): ulp 1
  static constexpr uint32_t kBias = 0x43014301u;   // (129, 129)
};

// v of the two fields (j, j + 8) of w >> 0 (pre-shifted by the caller), as a pair of T.
template <typename T>
__device__ __forceinline__ uint32_t decode_pair(uint32_t shifted, uint32_t magic) {
  uint32_t r;
  // 0xEA = (a & b) | c: one LOP3 with the magic in a register.
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(shifted), "n"(0x00030003), "r"(magic));
  using P = typename Pair16<T>::Pair;
  const uint32_t bias = Pair16<T>::kBias;
  P d = __hsub2(*reinterpret_cast<const P*>(&r), *reinterpret_cast<const P*>(&bias));
  return *reinterpret_cast<uint32_t*>(&d);
}

// The block's scale of one row as a pair of T (the same value twice), to multiply a decoded pair.
template <typename T>
__device__ __forceinline__ uint32_t scale_pair(__half s) {
  if constexpr (std::is_same_v<T, __half>) {
    const __half2 p = __halves2half2(s, s);
    return *reinterpret_cast<const uint32_t*>(&p);
  } else {
    const __nv_bfloat162 p = __float2bfloat162_rn(__half2float(s));
    return *reinterpret_cast<const uint32_t*>(&p);
  }
}

template <typename T>
__device__ __forceinline__ uint32_t mul2(uint32_t a, uint32_t b) {
  using P = typename Pair16<T>::Pair;
  P r = __hmul2(*reinterpret_cast<const P*>(&a), *reinterpret_cast<const P*>(&b));
  return *reinterpret_cast<uint32_t*>(&r);
}

// out[m, n] = sum_s partial[s, m, n] (+ bias[n]), the slices in order.
template <typename T>
__global__ void split_k_reduce_kernel(const float* __restrict__ partial, const T* __restrict__ bias,
                                      T* __restrict__ out, int64_t MN, int N, int splits) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < MN;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float v = partial[i];
    for (int s = 1; s < splits; ++s) v += partial[s * MN + i];
    if (bias != nullptr) v += Fp<T>::to_float(bias[i % N]);
    out[i] = Fp<T>::from_float(v);
  }
}

// Launches split_k_reduce_kernel over the [splits, M, N] workspace into out [M, N].
template <typename T>
cudaError_t launch_split_k_reduce(const float* workspace, const T* bias, T* out, int M, int N, int splits,
                                  cudaStream_t stream) {
  const int64_t mn = static_cast<int64_t>(M) * N;
  const int threads = 256;
  const int64_t want = (mn + threads - 1) / threads;
  const int grid = static_cast<int>(want < 4096 ? want : 4096);
  split_k_reduce_kernel<T><<<grid, threads, 0, stream>>>(workspace, bias, out, mn, N, splits);
  return cudaGetLastError();
}

}  // namespace

}  // namespace ternop
