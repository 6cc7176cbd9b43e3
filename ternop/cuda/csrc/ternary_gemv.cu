// Small-M ternary GEMV for format v1: out[m, n] = sum_k x[m, k] * W[n, k] (+ bias[n]).
//
// This file holds only CUDA code (no torch headers) so that nvcc can compile it on its
// own: CI builds it for sm_90 to catch syntax errors on machines without a GPU. The torch
// binding (linear_cuda.cpp) calls launch_ternary_gemv().
//
// Layout. weight_packed is uint8 [N, K/4], 4 codes per byte, little-endian; a 32-bit
// word therefore holds 16 consecutive codes of one row, code j in bits (2j, 2j+1).
// weight_scale is fp16 [N, K/128].
//
// Work split. A group of TPR lanes (2..32, chosen from K) owns ROWS rows (4, or 2 when
// M > 4 to bound registers); each lane streams 16-byte chunks (64 codes, half a scale
// block) of those rows, loading the next chunk before it decodes the current one so that
// two chunks per row are in flight. The x values of a chunk are read once and reused for
// ROWS rows, which keeps L1 traffic for x below the weight traffic. Partial sums are fp32; each chunk's partial is multiplied by its block
// scale before it joins the accumulator; lanes of a group reduce with warp shuffles.

#include "ternary_common.cuh"

namespace ternop {

namespace {

constexpr int kThreads = 128;      // threads per block
constexpr uint32_t kMagic = 0x4B000000u;  // 2^23 as fp32: OR-ing an integer < 2^23 into the mantissa gives 2^23 + i exactly

// The weights are read exactly once: bypass L1 so the x vectors, which every row reuses,
// stay resident there.
__device__ __forceinline__ uint4 load_stream(const void* p) {
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(p));
  return r;
}

template <typename T>
struct XLoad;

// Loads 16 consecutive x values as fp32.
template <>
struct XLoad<__half> {
  __device__ __forceinline__ static void load16(const __half* p, float* out) {
    const uint4* q = reinterpret_cast<const uint4*>(p);
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      uint4 v = __ldg(q + i);
      const __half2* h = reinterpret_cast<const __half2*>(&v);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        float2 f = __half22float2(h[j]);
        out[8 * i + 2 * j] = f.x;
        out[8 * i + 2 * j + 1] = f.y;
      }
    }
  }
};

template <>
struct XLoad<__nv_bfloat16> {
  __device__ __forceinline__ static void load16(const __nv_bfloat16* p, float* out) {
    const uint4* q = reinterpret_cast<const uint4*>(p);
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      uint4 v = __ldg(q + i);
      const uint32_t* w = reinterpret_cast<const uint32_t*>(&v);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        // bf16 -> fp32 is a shift into the high half; no conversion instruction needed.
        out[8 * i + 2 * j] = __uint_as_float(w[j] << 16);
        out[8 * i + 2 * j + 1] = __uint_as_float(w[j] & 0xFFFF0000u);
      }
    }
  }
};

template <>
struct XLoad<float> {
  __device__ __forceinline__ static void load16(const float* p, float* out) {
    const float4* q = reinterpret_cast<const float4*>(p);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      float4 v = __ldg(q + i);
      out[4 * i] = v.x;
      out[4 * i + 1] = v.y;
      out[4 * i + 2] = v.z;
      out[4 * i + 3] = v.w;
    }
  }
};

// Position of code j (0..15) of a word inside the field register it is read from:
// codes 0..10 are read in place, codes 11..15 from the word shifted right by 22, so that
// every field lies below bit 22 and fits the fp32 mantissa next to the 2^23 magic.
__host__ __device__ constexpr int field_pos(int j) { return j <= 10 ? j : j - 11; }

// x'[j] = x[j] * 4^-field_pos(j): the decode below yields v * 4^field_pos(j), and the
// power-of-two scaling cancels exactly in the product.
__device__ __forceinline__ void prescale16(float* x) {
#pragma unroll
  for (int j = 0; j < 16; ++j) x[j] *= __uint_as_float((127u - 2u * field_pos(j)) << 23);
}

// Adds sum_j x'[m][j] * v_j to part[m] for the 16 codes of word w.
//
// Decode: per 2-bit field, lo - hi + 2 is in {1, 2, 3}, so one add/sub over the whole
// word has no carries between fields: d holds v + 2 in every field (0b11 reads as 0).
// Masking one field into the mantissa of 2^23 and subtracting (2^23 + 2 * 4^p) gives
// v * 4^p exactly: one LOP3 and one FADD per code, then one FFMA per code and row of x.
template <int M>
__device__ __forceinline__ void dot_word(uint32_t w, const float (&x)[M][16], float (&part)[M]) {
  const uint32_t d = (w & 0x55555555u) + 0xAAAAAAAAu - ((w >> 1) & 0x55555555u);
  const uint32_t d_hi = d >> 22;
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    const int p = field_pos(j);
    const uint32_t src = j <= 10 ? d : d_hi;
    const float f = __uint_as_float(kMagic | (src & (3u << (2 * p))));
    const float v = f - (8388608.0f + 2.0f * static_cast<float>(1u << (2 * p)));
#pragma unroll
    for (int m = 0; m < M; ++m) part[m] = fmaf(x[m][j], v, part[m]);
  }
}

template <typename T, int M, int TPR, int kRows>
__global__ void __launch_bounds__(kThreads) ternary_gemv_kernel(
    const T* __restrict__ x, const uint8_t* __restrict__ wp, const __half* __restrict__ ws,
    const T* __restrict__ bias, T* __restrict__ out, int N, int K) {
  const int groups_per_block = kThreads / TPR;
  const int group = blockIdx.x * groups_per_block + threadIdx.x / TPR;
  const int lane = threadIdx.x % TPR;
  const int n0 = group * kRows;
  // An idle group (past the last row) must still reach the shuffles below: its lanes share
  // a warp with working groups, and the shuffles name the whole warp.
  const bool active = n0 < N;

  const int chunks = K / 64;         // 16-byte chunks per row
  const size_t row_bytes = K / 4;
  const int blocks = K / 128;

  float acc[kRows][M];
#pragma unroll
  for (int r = 0; r < kRows; ++r)
#pragma unroll
    for (int m = 0; m < M; ++m) acc[r][m] = 0.f;

  auto load_chunk = [&](int c, uint4 (&wv)[kRows]) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int n = n0 + r;
      wv[r] = (n < N && c < chunks) ? load_stream(wp + n * row_bytes + c * 16) : make_uint4(0, 0, 0, 0);
    }
  };
  uint4 next[kRows];
  int c = active ? lane : chunks;
  load_chunk(c, next);
  for (; c < chunks; c += TPR) {
    uint4 wv[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) wv[r] = next[r];
    load_chunk(c + TPR, next);  // in flight while this chunk is decoded
    float part[kRows][M];
#pragma unroll
    for (int r = 0; r < kRows; ++r)
#pragma unroll
      for (int m = 0; m < M; ++m) part[r][m] = 0.f;
#pragma unroll
    for (int q = 0; q < 4; ++q) {  // 4 words of 16 codes per chunk
      float xs[M][16];
#pragma unroll
      for (int m = 0; m < M; ++m) {
        XLoad<T>::load16(x + static_cast<size_t>(m) * K + c * 64 + q * 16, xs[m]);
        prescale16(xs[m]);
      }
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const uint32_t w = q == 0 ? wv[r].x : q == 1 ? wv[r].y : q == 2 ? wv[r].z : wv[r].w;
        dot_word<M>(w, xs, part[r]);
      }
    }
    const int b = c / 2;  // a chunk is half of one 128-wide scale block
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int n = n0 + r;
      const float s = n < N ? __half2float(ws[static_cast<size_t>(n) * blocks + b]) : 0.f;
#pragma unroll
      for (int m = 0; m < M; ++m) acc[r][m] = fmaf(part[r][m], s, acc[r][m]);
    }
  }

#pragma unroll
  for (int r = 0; r < kRows; ++r)
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
      for (int off = TPR / 2; off > 0; off /= 2)
        acc[r][m] += __shfl_xor_sync(0xFFFFFFFFu, acc[r][m], off, TPR);

  if (active && lane == 0) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int n = n0 + r;
      if (n >= N) break;
      const float b = bias != nullptr ? Fp<T>::to_float(bias[n]) : 0.f;
#pragma unroll
      for (int m = 0; m < M; ++m) out[static_cast<size_t>(m) * N + n] = Fp<T>::from_float(acc[r][m] + b);
    }
  }
}

template <typename T, int M>
cudaError_t launch_m(const T* x, const uint8_t* wp, const __half* ws, const T* bias, T* out, int N, int K,
                     cudaStream_t stream) {
  constexpr int kRows = M <= 4 ? 4 : 2;
  const int chunks = K / 64;
  const int groups = (N + kRows - 1) / kRows;
  // Fewer lanes per row group when a row has few chunks, so that no lane idles.
  if (chunks >= 32) {
    const int grid = (groups + kThreads / 32 - 1) / (kThreads / 32);
    ternary_gemv_kernel<T, M, 32, kRows><<<grid, kThreads, 0, stream>>>(x, wp, ws, bias, out, N, K);
  } else if (chunks >= 16) {
    const int grid = (groups + kThreads / 16 - 1) / (kThreads / 16);
    ternary_gemv_kernel<T, M, 16, kRows><<<grid, kThreads, 0, stream>>>(x, wp, ws, bias, out, N, K);
  } else if (chunks >= 8) {
    const int grid = (groups + kThreads / 8 - 1) / (kThreads / 8);
    ternary_gemv_kernel<T, M, 8, kRows><<<grid, kThreads, 0, stream>>>(x, wp, ws, bias, out, N, K);
  } else {
    const int grid = (groups + kThreads / 2 - 1) / (kThreads / 2);
    ternary_gemv_kernel<T, M, 2, kRows><<<grid, kThreads, 0, stream>>>(x, wp, ws, bias, out, N, K);
  }
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_t(const void* x, const uint8_t* wp, const __half* ws, const void* bias, void* out, int M, int N,
                     int K, cudaStream_t stream) {
  const T* xt = static_cast<const T*>(x);
  const T* bt = static_cast<const T*>(bias);
  T* ot = static_cast<T*>(out);
  switch (M) {
    case 1: return launch_m<T, 1>(xt, wp, ws, bt, ot, N, K, stream);
    case 2: return launch_m<T, 2>(xt, wp, ws, bt, ot, N, K, stream);
    case 3: return launch_m<T, 3>(xt, wp, ws, bt, ot, N, K, stream);
    case 4: return launch_m<T, 4>(xt, wp, ws, bt, ot, N, K, stream);
    case 5: return launch_m<T, 5>(xt, wp, ws, bt, ot, N, K, stream);
    case 6: return launch_m<T, 6>(xt, wp, ws, bt, ot, N, K, stream);
    case 7: return launch_m<T, 7>(xt, wp, ws, bt, ot, N, K, stream);
    case 8: return launch_m<T, 8>(xt, wp, ws, bt, ot, N, K, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

// Largest M the kernel is instantiated for; larger batches belong to the tensor-core GEMM.
int ternary_gemv_max_m() { return 8; }

// x: [M, K] row-major in `dtype`; wp: uint8 [N, K/4]; ws: fp16 [N, K/128]; bias: [N] or
// nullptr; out: [M, N]. x and wp must be 16-byte aligned, K a multiple of 128, 1 <= M <= 8.
cudaError_t launch_ternary_gemv(const void* x, int dtype, const uint8_t* wp, const __half* ws, const void* bias,
                                void* out, int M, int N, int K, cudaStream_t stream) {
  if (!valid_shape(M, ternary_gemv_max_m(), N, K)) return cudaErrorInvalidValue;
  return dispatch_dtype</*kWithFp32=*/true>(dtype, [&](auto tag) {
    return launch_t<decltype(tag)>(x, wp, ws, bias, out, M, N, K, stream);
  });
}

}  // namespace ternop
