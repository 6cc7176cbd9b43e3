// What the CUDA kernels of format v1 share: x's dtype codes, conversions to and from the fp32
// accumulator, the launchers' argument check and their dispatch on x's dtype.
//
// Like the kernels it holds no torch headers, so each .cu still compiles alone (CI runs nvcc
// on each). Everything is in an anonymous namespace: each kernel file gets its own copy.

#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

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
};

template <>
struct Fp<__nv_bfloat16> {
  __device__ __forceinline__ static __nv_bfloat16 from_float(float f) { return __float2bfloat16_rn(f); }
  __device__ __forceinline__ static float to_float(__nv_bfloat16 h) { return __bfloat162float(h); }
};

template <>
struct Fp<float> {
  __device__ __forceinline__ static float from_float(float f) { return f; }
  __device__ __forceinline__ static float to_float(float h) { return h; }
};

// 1 <= M <= max_m, N >= 1, K a positive multiple of 128 (one scale block).
inline bool valid_shape(int M, int max_m, int N, int K) {
  return M >= 1 && M <= max_m && N >= 1 && K >= 128 && K % 128 == 0;
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
