// Per-token int8 quantization of x [M, K] (ternop/activations.py is the spec): the first of the
// two launches of the W2A8 C++ backends when they are handed x itself.
//
// The pass only moves bytes (2 or 4 in, 1 out per element), so what matters is how many bytes
// each SM keeps in flight. A group of 1, 2, 4 or 8 warps owns one row: every thread loads its
// share of the row as 16-byte vectors (up to kHeld of them, all issued before the first is
// used), the group reduces the absmax, and the same registers are rounded and stored. Rows
// longer than a group's registers hold read their remainder twice (the second time from L2).
// The group size is the host's choice (quantize_rows_group_log2): the fewest warps whose
// registers hold the row, and more while the grid has few warps (small M), where the pass's
// latency is on every layer's critical path.

#include <type_traits>

#include "ternary_common.cuh"

namespace ternop {

namespace {

constexpr int kQuantThreads = 256;  // 8 warps: 8 rows a CTA, or fewer rows of more warps each
constexpr int kQuantWarps = kQuantThreads / 32;
constexpr int kHeld = 12;           // 16-byte vectors a thread keeps between the absmax and the rounding
constexpr int kMinWarpsPerSm = 8;   // below this many warps an SM, give each row more warps

template <typename T>
struct QuantVec {
  static constexpr int kN = 16 / sizeof(T);  // elements in a 16-byte vector

  __device__ __forceinline__ static void unpack(const uint4& raw, float (&f)[kN]) {
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {  // a bf16 is the top half of its fp32
      const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        f[2 * i] = __uint_as_float(w[i] << 16);
        f[2 * i + 1] = __uint_as_float(w[i] & 0xFFFF0000u);
      }
    } else {
      T v[kN];
      memcpy(v, &raw, 16);
#pragma unroll
      for (int i = 0; i < kN; ++i) f[i] = Fp<T>::to_float(v[i]);
    }
  }

  // max(amax, |x|) over the vector, NaN-propagating like torch's amax (fmaxf would drop a NaN).
  __device__ __forceinline__ static float absmax(const uint4& raw, float amax) {
    float f[kN];
    unpack(raw, f);
#pragma unroll
    for (int i = 0; i < kN; ++i) {
      const float a = fabsf(f[i]);
      amax = (a > amax || a != a) ? a : amax;
    }
    return amax;
  }

  // The vector's kN int8 codes, written to dst (kN bytes, kN-byte aligned).
  __device__ __forceinline__ static void round_store(const uint4& raw, float inv, int8_t* dst) {
    float f[kN];
    unpack(raw, f);
    uint32_t words[kN / 4] = {};
#pragma unroll
    for (int i = 0; i < kN; ++i) {
      // fp32 product, then round half to even, then clamp: torch.round(x * inv).clamp(-127, 127).
      const int r = min(127, max(-127, __float2int_rn(__fmul_rn(f[i], inv))));
      words[i / 4] |= (static_cast<uint32_t>(r) & 0xFFu) << (8 * (i % 4));
    }
    if constexpr (kN == 8) {
      *reinterpret_cast<uint2*>(dst) = make_uint2(words[0], words[1]);
    } else {
      *reinterpret_cast<uint32_t*>(dst) = words[0];
    }
  }
};

template <typename T>
__global__ void __launch_bounds__(kQuantThreads, 2) quantize_rows_kernel(const T* __restrict__ x, int64_t ldx,
                                                                      int8_t* __restrict__ q, float* __restrict__ qs,
                                                                      int M, int K, int group_log2) {
  using V = QuantVec<T>;
  __shared__ float partial[kQuantWarps];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int group = 1 << group_log2;  // warps a row
  const int first_warp = warp & ~(group - 1);
  const int64_t m = static_cast<int64_t>(blockIdx.x) * (kQuantWarps >> group_log2) + (warp >> group_log2);
  const bool live = m < M;
  const int t = (warp - first_warp) * 32 + lane, stride = group * 32;
  const int vecs = K / V::kN;
  const T* row = x + (live ? m : 0) * ldx;

  uint4 held[kHeld];
  float amax = 0.f;
#pragma unroll
  for (int i = 0; i < kHeld; ++i) {
    const int v = i * stride + t;
    if (live && v < vecs) held[i] = __ldg(reinterpret_cast<const uint4*>(row + static_cast<int64_t>(v) * V::kN));
  }
#pragma unroll
  for (int i = 0; i < kHeld; ++i) {
    if (live && i * stride + t < vecs) amax = V::absmax(held[i], amax);
  }
  for (int v = kHeld * stride + t; live && v < vecs; v += stride)
    amax = V::absmax(__ldg(reinterpret_cast<const uint4*>(row + static_cast<int64_t>(v) * V::kN)), amax);
#pragma unroll
  for (int o = 16; o > 0; o /= 2) {
    const float other = __shfl_xor_sync(0xffffffffu, amax, o);
    amax = (other > amax || other != other) ? other : amax;
  }
  if (group > 1) {  // uniform over the CTA: every thread reaches the barrier
    if (lane == 0) partial[warp] = amax;
    __syncthreads();
    amax = partial[first_warp];
    for (int w = 1; w < group; ++w) {
      const float other = partial[first_warp + w];
      amax = (other > amax || other != other) ? other : amax;
    }
  }
  if (!live) return;
  // IEEE divisions, as the spec (no reciprocal approximation); a NaN amax gives inv = 0 and a
  // NaN scale, as the reference.
  const float inv = amax > 0.f ? __fdiv_rn(127.f, amax) : 0.f;
  if (t == 0) qs[m] = __fdiv_rn(amax, 127.f);
  int8_t* qrow = q + m * K;
#pragma unroll
  for (int i = 0; i < kHeld; ++i) {
    const int v = i * stride + t;
    if (v < vecs) V::round_store(held[i], inv, qrow + static_cast<int64_t>(v) * V::kN);
  }
  for (int v = kHeld * stride + t; v < vecs; v += stride)
    V::round_store(__ldg(reinterpret_cast<const uint4*>(row + static_cast<int64_t>(v) * V::kN)), inv,
                   qrow + static_cast<int64_t>(v) * V::kN);
}

}  // namespace

// log2 of the warps that own one row of x [M, K] of `elem_size`-byte elements: the fewest whose
// registers hold the row, then twice as many while the grid has fewer than kMinWarpsPerSm warps an
// SM and each thread still loads a vector (at most a CTA's 8 warps).
int quantize_rows_group_log2(int64_t M, int K, int elem_size, int sms) {
  const int64_t vecs = static_cast<int64_t>(K) * elem_size / 16;
  int g = 0;
  while (g < 3 && vecs > (static_cast<int64_t>(32) << g) * kHeld) ++g;
  while (g < 3 && (static_cast<int64_t>(32) << (g + 1)) <= vecs && (M << g) < static_cast<int64_t>(kMinWarpsPerSm) * sms)
    ++g;
  return g;
}

// x [M, K] fp16/bf16/fp32 with unit-stride rows ldx elements apart, rows and base 16-byte
// aligned; K a positive multiple of 128; q int8 [M, K] contiguous, qs fp32 [M]. `dtype` as XDtype.
cudaError_t launch_quantize_rows(const void* x, int64_t ldx, int dtype, int8_t* q, float* qs, int M, int K, int sms,
                                 cudaStream_t stream) {
  if (M < 1 || K < 128 || K % 128) return cudaErrorInvalidValue;
  return dispatch_dtype</*kWithFp32=*/true>(dtype, [&](auto tag) {
    using T = decltype(tag);
    if (reinterpret_cast<uintptr_t>(x) % 16 || (ldx * static_cast<int64_t>(sizeof(T))) % 16 || ldx < K)
      return cudaErrorInvalidValue;
    const int g = quantize_rows_group_log2(M, K, sizeof(T), sms);
    const int rows_per_cta = kQuantWarps >> g;
    const int64_t ctas = (static_cast<int64_t>(M) + rows_per_cta - 1) / rows_per_cta;
    quantize_rows_kernel<T><<<static_cast<unsigned>(ctas), kQuantThreads, 0, stream>>>(static_cast<const T*>(x), ldx,
                                                                                       q, qs, M, K, g);
    return cudaGetLastError();
  });
}

}  // namespace ternop
