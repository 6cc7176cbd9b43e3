// What the tensor-core kernels of the "a16" layout (ternop/layouts.py) share: decoding a pair
// of weights into x's dtype and scaling it, cp.async staging, and the split-K reduction.
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

// The decode's constants per x dtype: fields per shift, the magic pair, and for field position j
// the pair 4^-j and -(magic * 4^-j + 1) (bit patterns).
template <typename T>
struct FmaDecode;

template <>
struct FmaDecode<__half> {
  static constexpr int kSpan = 4;
  static constexpr uint32_t kMagic = 0x64006400u;  // (1024, 1024)
  __device__ static constexpr uint32_t mul(int j) {
    return j == 0 ? 0x3C003C00u : j == 1 ? 0x34003400u : j == 2 ? 0x2C002C00u : 0x24002400u;  // 1, 1/4, 1/16, 1/64
  }
  __device__ static constexpr uint32_t add(int j) {
    return j == 0 ? 0xE401E401u : j == 1 ? 0xDC04DC04u : j == 2 ? 0xD410D410u : 0xCC40CC40u;  // -1025, -257, -65, -17
  }
};

template <>
struct FmaDecode<__nv_bfloat16> {
  static constexpr int kSpan = 3;
  static constexpr uint32_t kMagic = 0x43004300u;  // (128, 128)
  __device__ static constexpr uint32_t mul(int j) {
    return j == 0 ? 0x3F803F80u : j == 1 ? 0x3E803E80u : 0x3D803D80u;  // 1, 1/4, 1/16
  }
  __device__ static constexpr uint32_t add(int j) {
    return j == 0 ? 0xC301C301u : j == 1 ? 0xC204C204u : 0xC110C110u;  // -129, -33, -9
  }
};

// v of codes (2J, 2J + 1) of the a16 word w, as a pair of T (see the file comment).
template <typename T, int J>
__device__ __forceinline__ uint32_t decode_fma(uint32_t w, uint32_t magic) {
  using D = FmaDecode<T>;
  constexpr int j = J % D::kSpan, shift = 2 * D::kSpan * (J / D::kSpan);
  uint32_t r;
  // 0xEA = (a & b) | c: one LOP3 with the magic in a register.
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(w >> shift), "n"(0x00030003u << (2 * j)), "r"(magic));
  using P = typename Pair16<T>::Pair;
  const uint32_t m = D::mul(j), a = D::add(j);
  P d = __hfma2(*reinterpret_cast<const P*>(&r), *reinterpret_cast<const P*>(&m), *reinterpret_cast<const P*>(&a));
  return *reinterpret_cast<uint32_t*>(&d);
}

// c += A (16 x 16: a[0..3]) * B (16 x 8: b0, b1), fp32 accumulate, A and B in T.
template <typename T>
__device__ __forceinline__ void mma_16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  __trap();  // no m16n8k16 before sm_80; the registry never launches it there
#else
  if constexpr (std::is_same_v<T, __half>) {
    asm(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
#endif
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src));
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
