// Dense weights from ternary codes, for large M: out [N, K] = value * scale, formed in fp32
// and rounded once to the output dtype, exactly as ternop.dequantize (ternop/format.py) does,
// from weights in any layout of ternop/layouts.py (v1, a16, a8). Also the values alone as int8
// (-1, 0, +1), the dense weight of the W2A8 path's int8 GEMM (launch_ternary_decode_int8).
//
// linear_cuda.cpp runs it and then cuBLAS in one C++ op (ternop::linear_cuda_dequant), so a
// large-M call outside a CUDA graph pays one op dispatch and one launch on the host instead
// of a Python kernel launch plus F.linear.
//
// One thread per 32-bit word (16 weights of one row; a row is K / 16 words, and the dense row
// is 16 elements per word in the same order). Each thread decodes its word field by field
// with compile-time shifts (field p holds weight k_of_field(p) of the word, as the layout
// says) into its warp's slice of shared memory; the warp then writes its 32 words' outputs
// with consecutive 16-byte stores, so every store instruction fills whole 32-byte sectors.
// (Each thread writing its own outputs straight to memory left half-written sectors in every
// store instruction, and ran at a fraction of the bandwidth.)

#include "ternary_common.cuh"

namespace ternop {

namespace {

// The layout codes linear_cuda.cpp passes (those of the Triton kernels' LAYOUT).
enum Layout : int { kV1 = 0, kA16 = 1, kA8 = 2 };

// Which of the word's 16 weights field p holds (ternop/layouts.py, _K_OF_FIELD).
template <int L>
__device__ __forceinline__ constexpr int k_of_field(int p) {
  if (L == kA16) return p < 8 ? 2 * p : 2 * (p - 8) + 1;
  if (L == kA8) return p < 8 ? 4 * (p % 2) + p / 2 : 8 + 4 * ((p - 8) % 2) + (p - 8) / 2;
  return p;
}

// The value of a 2-bit field: a16 holds u = v + 1; v1 and a8 hold the v1 code (0b11 reads as 0).
template <int L>
__device__ __forceinline__ int int_value_of(uint32_t c) {
  if (L == kA16) return static_cast<int>(c) - 1;
  return static_cast<int>(c & 1u) - static_cast<int>(c >> 1);
}

template <int L>
__device__ __forceinline__ float value_of(uint32_t c) {
  return static_cast<float>(int_value_of<L>(c));
}

constexpr int kWarps = 8;

template <typename T, int L>
__global__ void __launch_bounds__(kWarps * 32) ternary_dequant_kernel(const uint32_t* __restrict__ wp,
                                                                     const __half* __restrict__ ws,
                                                                     T* __restrict__ out, int64_t words,
                                                                     int words_per_row, int blocks_per_row) {
  constexpr int kWordBytes = 16 * sizeof(T);  // one word's outputs: 32 bytes (fp16/bf16) or 64 (fp32)
  __shared__ __align__(16) unsigned char stage[kWarps][32 * kWordBytes];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t w = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t first = w - lane;  // the warp's first word
  if (w < words) {
    const uint32_t word = __ldg(wp + w);
    const int64_t n = w / words_per_row;
    const int j = static_cast<int>(w - n * words_per_row);
    const float s = __half2float(ws[n * blocks_per_row + j / 8]);
    T vals[16];
#pragma unroll
    for (int p = 0; p < 16; ++p) vals[k_of_field<L>(p)] = Fp<T>::from_float(value_of<L>((word >> (2 * p)) & 3u) * s);
    uint4* dst = reinterpret_cast<uint4*>(stage[warp] + lane * kWordBytes);
#pragma unroll
    for (int q = 0; q < kWordBytes / 16; ++q) {
      uint4 chunk;
      memcpy(&chunk, reinterpret_cast<const char*>(vals) + 16 * q, 16);
      dst[q] = chunk;
    }
  }
  __syncwarp();
  const int64_t left = words - first;
  const int valid = static_cast<int>(left < 32 ? left : 32);
  const uint4* src = reinterpret_cast<const uint4*>(stage[warp]);
  uint4* o = reinterpret_cast<uint4*>(out + 16 * first);
#pragma unroll
  for (int c = lane; c < 32 * kWordBytes / 16; c += 32) {
    if (c * 16 / kWordBytes < valid) o[c] = src[c];
  }
}

// One thread per 32-bit word, as above; a word's 16 int8 values are one 16-byte store, so the
// 32 threads of a warp write 512 consecutive bytes with no staging.
template <int L>
__global__ void __launch_bounds__(kWarps * 32) ternary_decode_int8_kernel(const uint32_t* __restrict__ wp,
                                                                          int8_t* __restrict__ out, int64_t words) {
  const int64_t w = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (w >= words) return;
  const uint32_t word = __ldg(wp + w);
  int8_t vals[16];
#pragma unroll
  for (int p = 0; p < 16; ++p) vals[k_of_field<L>(p)] = static_cast<int8_t>(int_value_of<L>((word >> (2 * p)) & 3u));
  uint4 chunk;
  memcpy(&chunk, vals, 16);
  reinterpret_cast<uint4*>(out)[w] = chunk;
}

template <int L>
cudaError_t launch_int8_t(const uint8_t* wp, int8_t* out, int N, int K, cudaStream_t stream) {
  const int64_t words = static_cast<int64_t>(N) * (K / 16);
  const int64_t grid = (words + kWarps * 32 - 1) / (kWarps * 32);
  if (grid > INT32_MAX) return cudaErrorInvalidValue;
  ternary_decode_int8_kernel<L><<<static_cast<unsigned>(grid), kWarps * 32, 0, stream>>>(
      reinterpret_cast<const uint32_t*>(wp), out, words);
  return cudaGetLastError();
}

template <typename T, int L>
cudaError_t launch_t(const uint8_t* wp, const __half* ws, T* out, int N, int K, cudaStream_t stream) {
  const int64_t words = static_cast<int64_t>(N) * (K / 16);
  const int64_t grid = (words + kWarps * 32 - 1) / (kWarps * 32);
  if (grid > INT32_MAX) return cudaErrorInvalidValue;
  ternary_dequant_kernel<T, L><<<static_cast<unsigned>(grid), kWarps * 32, 0, stream>>>(
      reinterpret_cast<const uint32_t*>(wp), ws, out, words, K / 16, K / 128);
  return cudaGetLastError();
}

}  // namespace

// wp: uint8 [N, K/4] in `layout` (kV1, kA16 or kA8), contiguous and 16-byte aligned; ws: fp16
// [N, K/128] contiguous; out: [N, K] contiguous of dtype out_dtype (kFloat16, kBFloat16 or
// kFloat32). K a positive multiple of 128.
cudaError_t launch_ternary_dequant(const uint8_t* wp, const __half* ws, int layout, int out_dtype, void* out, int N,
                                   int K, cudaStream_t stream) {
  if (N < 1 || K < 128 || K % 128 != 0 || layout < kV1 || layout > kA8) return cudaErrorInvalidValue;
  return dispatch_dtype</*kWithFp32=*/true>(out_dtype, [&](auto tag) {
    using T = decltype(tag);
    T* o = static_cast<T*>(out);
    switch (layout) {
      case kA16: return launch_t<T, kA16>(wp, ws, o, N, K, stream);
      case kA8: return launch_t<T, kA8>(wp, ws, o, N, K, stream);
      default: return launch_t<T, kV1>(wp, ws, o, N, K, stream);
    }
  });
}

// wp as above; out: int8 [N, K] contiguous and 16-byte aligned, the values -1, 0, +1 (no scale).
cudaError_t launch_ternary_decode_int8(const uint8_t* wp, int layout, int8_t* out, int N, int K,
                                       cudaStream_t stream) {
  if (N < 1 || K < 128 || K % 128 != 0 || layout < kV1 || layout > kA8) return cudaErrorInvalidValue;
  switch (layout) {
    case kA16: return launch_int8_t<kA16>(wp, out, N, K, stream);
    case kA8: return launch_int8_t<kA8>(wp, out, N, K, stream);
    default: return launch_int8_t<kV1>(wp, out, N, K, stream);
  }
}

}  // namespace ternop
