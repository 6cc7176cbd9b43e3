// Small-M W2A8 ternary linear on int8 tensor cores: 1 <= M <= 32 (64 with row scales; larger M as
// token slabs of 8, 16 or 32 along the grid's y, launch_ternary_mma_a8's `slab`), weights in
// the "a8" layout.
//
//   out[m, n] = s_x[m] * sum_b P[m, n, b] * scale[n, b] (+ bias[n]),
//   P[m, n, b] = sum_{k in block b} q[m, k] * v[n, k]   (int32, exact)
//
// q int8 [M, K] and s_x fp32 [M] come from the per-token quantization of x
// (ternop/activations.py is the spec); out is in x's dtype. For M <= kFusedMaxM the kernel can
// also take x itself (kFused): every CTA then quantizes the rows into shared memory first,
// with the spec's arithmetic, and the separate quantization launch (the larger part of a
// decode step's cost at M = 1) disappears. Each CTA re-reads x from L2 (M * K elements), which
// is why the fused form stops at small M. Like ternary_mma.cu, this file
// holds only CUDA code, and its structure is that kernel's: a CTA of R x W warps owns R sets
// of 16 rows (small_m_split, ternary_common.cuh), warp (r, w) takes a contiguous range of
// set r's scale blocks with D blocks of weight loads in flight (two unless asked), and warp 0
// of a set adds the other warps' fragments in a fixed order (deterministic, no atomics). The R
// sets share each read of x (and, fused, one quantization of it per CTA).
//
// Orientation. One mma.sync m16n8k32 s8 multiplies A = 16 weight rows x 32 k by
// B = 32 k x 8 tokens into int32 C [16 rows x 8 tokens]; M <= 8 uses one n8 tile, M <= 16
// two, M <= 32 four and M <= 64 eight, which share the A fragment (each weight word decodes once
// for all of them). Tokens past M and rows past N read token 0 / row 0. Eight tiles take row
// scales only: their int32 C fragments then run on over all of K (no per-block conversion, no
// float accumulators), and each tile's x words are loaded just before its mmas.
//
// k order. Lane (g = lane / 4, q = lane % 4) owns, for rows g and g + 8, the 32 weights
// [32q, 32q + 32) of each 128-wide block: two words h = 0, 1 of 16 codes. In the a8 layout
// (ternop/layouts.py) a word shifted right by s_r = 0, 2, 16, 18 holds the codes of weights
// 4r..4r+3 of the word in its nibbles 0..3; masked with 0x3333 they are the byte selectors of
// one PRMT into the table 0x00FF0100 = int8 (0, +1, -1, 0), the values of codes 0..3. So
// quad(h, r) is one register of four int8 weights, k = 32q + 16h + 4r + {0..3}, in the order
// of the int8 x in memory. mma step s = 0..3 of a block takes word h = s / 2 and r = 2(s % 2):
//   A slots 4q..4q+3      <- quad(h, r)      (a0: row g, a1: row g + 8)
//   A slots 16+4q..16+4q+3 <- quad(h, r + 1)  (a2: row g, a3: row g + 8)
//   B b0, b1              <- x words 4h + r and 4h + r + 1 of the lane's 32 bytes, as loaded.
// All 32 k of an mma lie in one block: four steps give the block's exact int32 partial, which
// is converted (|P| <= 127 * 128) and multiplied by the block's fp16 scale in fp32.
// tests/cuda/test_mma_mapping.py replays this mapping in NumPy.

#include "ternary_common.cuh"

namespace ternop {

bool ternary_mma_a8_takes_depth(int depth);
int ternary_mma_a8_max_m(bool row, int slab);

namespace {

constexpr int kMaxWarpsA8 = 8;
// Scale blocks of weight loads in flight per warp, by default; every kernel also takes
// kDeepDepthA8 (launch_ternary_mma_a8's `depth`): the one-tile ones declared for three CTAs an SM
// instead of four, where their deeper buffers fit without spilling, the two-tile one in the 128
// registers of its two. The depth changes when the loads are issued, not what is summed or in
// which order.
constexpr int kDepthA8 = 2;
constexpr int kDeepDepthA8 = 4;
constexpr uint32_t kTable = 0x00FF0100u;  // int8 value of code 0b00, 0b01, 0b10, 0b11
// The one-tile kernels given quantized rows (M <= 8) take the fewest sets of 16 rows a CTA
// whose CTAs all run at once, kOneTileCtasPerSm an SM (its __launch_bounds__ at the default
// depth), instead of small_m_split's rule (the most sets that leave 1.5 CTAs an SM). On the
// H200 that is the set count measured fastest on every layer timed
// (sweep_mma_a8_split_2cb00c0.json, bench_decode_linears_*_fcb034d.json): 2 on 4096->14336
// (448 CTAs; 4 sets: 10% slower), 4 on 4096->28672 (448; 8 sets: 13%), 2 on 2560->13824 (432),
// 1 on every narrower layer; and 4 on 4096->24576 (384), where two sets (768 CTAs, two waves)
// had the int8 linears of vLLM's Qwen3-8B-shaped decode step at 1195 us a step at batch 1
// (bench_vllm_decode_a8row_921b5bc) against 1122 us with four (d926bca, another session's run).
// More, shorter CTAs also read the weights faster (benchmarks/probe_weight_reads.cu).
constexpr int kOneTileCtasPerSm = 4;
// The fused form keeps the two-tile rule's split, with at most four sets a CTA: in
// sweep_mma_a8_fused_split_2cb00c0.json four sets beat two by 4-10% on 4096->14336 (M = 2) and
// 2560->13824, and beat eight by 7% on 4096->28672; each of its CTAs quantizes all of x first.
constexpr int kFusedMaxSets = 4;
constexpr int kFusedMaxM = 2;             // rows the fused quantization takes
constexpr int kFusedMaxBytes = 40 * 1024;  // its shared int8 copy of x, M * K bytes (with the static
                                           // shared memory, under the 48 KiB a launch may take unasked)

// The 16-byte vectors of a contiguous row of T, as floats.
template <typename T>
struct Vec16 {
  static constexpr int kN = 16 / sizeof(T);
  __device__ __forceinline__ static void load(const T* p, float (&f)[kN]) {
    const uint4 raw = __ldg(reinterpret_cast<const uint4*>(p));
    T v[kN];
    memcpy(v, &raw, 16);
#pragma unroll
    for (int i = 0; i < kN; ++i) f[i] = Fp<T>::to_float(v[i]);
  }
};

// Per-token int8 quantization of x [M, K] (ternop/activations.py) by the whole CTA: xq [M, K]
// in shared memory, s_x[m] = amax / 127. `scratch` holds one float per (warp, row).
template <typename T>
__device__ __forceinline__ void quantize_rows_shared(const T* __restrict__ x, int M, int K, int8_t* xq, float* s_x,
                                                     float (&scratch)[kMaxWarpsA8][kFusedMaxM]) {
  constexpr int kN = Vec16<T>::kN;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  const int vecs = K / kN;  // K is a multiple of 128, so rows are whole vectors
  __shared__ float inv_s[kFusedMaxM];
  for (int m = 0; m < M; ++m) {
    const T* row = x + static_cast<size_t>(m) * K;
    float amax = 0.f;
    for (int v = threadIdx.x; v < vecs; v += blockDim.x) {
      float f[kN];
      Vec16<T>::load(row + v * kN, f);
#pragma unroll
      for (int i = 0; i < kN; ++i) amax = fmaxf(amax, fabsf(f[i]));
    }
#pragma unroll
    for (int o = 16; o > 0; o /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    if (lane == 0) scratch[warp][m] = amax;
  }
  __syncthreads();
  if (threadIdx.x < M) {
    const int m = threadIdx.x;
    float amax = scratch[0][m];
    for (int w = 1; w < warps; ++w) amax = fmaxf(amax, scratch[w][m]);
    // IEEE divisions, as the spec (no reciprocal approximation).
    inv_s[m] = amax > 0.f ? __fdiv_rn(127.f, amax) : 0.f;
    s_x[m] = __fdiv_rn(amax, 127.f);
  }
  __syncthreads();
  for (int m = 0; m < M; ++m) {
    const T* row = x + static_cast<size_t>(m) * K;
    const float inv = inv_s[m];
    for (int v = threadIdx.x; v < vecs; v += blockDim.x) {
      float f[kN];
      Vec16<T>::load(row + v * kN, f);
      uint32_t words[kN / 4] = {};
#pragma unroll
      for (int i = 0; i < kN; ++i) {
        // Round half to even of the fp32 product, then clamp: torch.round(x * inv).clamp(-127, 127).
        const int r = min(127, max(-127, __float2int_rn(__fmul_rn(f[i], inv))));
        words[i / 4] |= (static_cast<uint32_t>(r) & 0xFFu) << (8 * (i % 4));
      }
      uint32_t* dst = reinterpret_cast<uint32_t*>(xq + static_cast<size_t>(m) * K + v * kN);
#pragma unroll
      for (int w = 0; w < kN / 4; ++w) dst[w] = words[w];
    }
  }
  __syncthreads();
}

__device__ __forceinline__ uint2 load_stream8_a8(const void* p) {
  // The weights are read exactly once: keep them out of L1, where x lives.
  uint2 r;
  asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];" : "=r"(r.x), "=r"(r.y) : "l"(p));
  return r;
}

// Four int8 weights k = 4R..4R+3 of word w (a8 layout), as one register.
template <int R>
__device__ __forceinline__ uint32_t quad(uint32_t w, uint32_t table) {
  constexpr int kShift = (R / 2) * 16 + (R % 2) * 2;
  const uint32_t sel = (w >> kShift) & 0x3333u;
  uint32_t r;
  asm("prmt.b32 %0, %1, %1, %2;" : "=r"(r) : "r"(table), "r"(sel));
  return r;
}

// c += A (16 x 32 int8) * B (32 x 8 int8), int32 accumulate.
__device__ __forceinline__ void mma_16832(int (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                          uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  __trap();  // no m16n8k32 s8 before sm_80; the registry never launches it there
#else
  asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#endif
}

// Steps 2H and 2H + 1 of a block: word H of rows g (w_g) and g + 8 (w_g8). xwords(t) gives tile
// t's B words for them, the lane's x words 4H..4H+3: from registers loaded beforehand, or (eight
// tiles) loaded there, just before the tile's two mmas.
template <int NT, typename XWords>
__device__ __forceinline__ void mma_word_a8(uint32_t w_g, uint32_t w_g8, uint32_t table, XWords xwords,
                                            int (&c)[NT][4]) {
  const uint32_t g0 = quad<0>(w_g, table), g1 = quad<1>(w_g, table);
  const uint32_t g2 = quad<2>(w_g, table), g3 = quad<3>(w_g, table);
  const uint32_t h0 = quad<0>(w_g8, table), h1 = quad<1>(w_g8, table);
  const uint32_t h2 = quad<2>(w_g8, table), h3 = quad<3>(w_g8, table);
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    const uint4 xv = xwords(t);
    mma_16832(c[t], g0, h0, g1, h1, xv.x, xv.y);
    mma_16832(c[t], g2, h2, g3, h3, xv.z, xv.w);
  }
}

// CTAs per SM that ptxas must fit: 4 (64 registers) for one n8 tile, 2 for two and four (ptxas
// uses 60 and 90; at 3 CTAs the two-tile kernel spilled); 3 (85 registers) for one tile at
// kDeepDepthA8 (two and four tiles stay at 2). Eight tiles fit one CTA an SM: a block's x words
// (64 registers a lane, which ptxas loads together), the 32 int32 sums and the decoded weights
// take 158-166 registers, and in 128 they spilled. The dispatch gives them only the K = 1024
// layers (configs.mma_a8_declines), where they were the fastest int8 kernel of their run; on
// longer K the other int8 kernels were faster.
// kFused: x [M, K] (type T) instead of q and qs, quantized by the CTA into dynamic shared memory.
// D: scale blocks of weight loads in flight per warp.
template <typename T, int NT, bool kFused, int D>
__global__ void __launch_bounds__(kMaxWarpsA8 * 32, NT == 1 ? (D > kDepthA8 ? 3 : 4) : NT == 8 ? 1 : 2) ternary_mma_a8_kernel(
    const int8_t* __restrict__ q, const float* __restrict__ qs, const T* __restrict__ x,
    const uint8_t* __restrict__ wp, const __half* __restrict__ ws, bool row, const T* __restrict__ bias,
    T* __restrict__ out, int M, int N, int K, int warps_log2) {
  // Eight tiles (row scales only, never fused): C runs on over all of K in int32.
  constexpr bool kIntAcc = NT == 8;
  static_assert(!(kIntAcc && kFused), "the fused quantization takes M <= 2");
  __shared__ float red[kMaxWarpsA8 - 1][NT * 4][32];
  extern __shared__ __align__(16) int8_t xq_shared[];  // kFused: the quantized rows, [M, K]
  __shared__ float qs_shared[kFusedMaxM];
  __shared__ float scratch[kMaxWarpsA8][kFusedMaxM];

  // 2^warps_log2 warps (warps_k of the split) per set of 16 rows; blockDim.x / 32 / warps sets.
  const int warps = 1 << warps_log2;
  const int set = threadIdx.x >> (5 + warps_log2), warp = (threadIdx.x >> 5) & (warps - 1), lane = threadIdx.x % 32;
  const int g = lane / 4, qd = lane % 4;
  const int n0 = (blockIdx.x * (blockDim.x >> (5 + warps_log2)) + set) * 16;
  const int row0 = n0 + g, row1 = n0 + g + 8;

  const int blocks = K / 128;
  const int per_warp = (blocks + warps - 1) / warps;
  const int b_begin = min(warp * per_warp, blocks);
  const int count = min(per_warp, blocks - b_begin);

  const size_t row_bytes = static_cast<size_t>(K) / 4;
  const uint8_t* pw0 = wp + static_cast<size_t>(row0 < N ? row0 : 0) * row_bytes + b_begin * 32 + 8 * qd;
  const uint8_t* pw1 = wp + static_cast<size_t>(row1 < N ? row1 : 0) * row_bytes + b_begin * 32 + 8 * qd;
  // Row scales (ws [N, 1], `row`): every block is scaled by 1, exactly, so acc sums the int32
  // partials over all of K (exact while |S| < 2^24), and the row's scale multiplies at the end.
  const __half one = __float2half(1.f);
  const __half* ps0 = ws + (row ? 0 : static_cast<size_t>(row0 < N ? row0 : 0) * blocks + b_begin);
  const __half* ps1 = ws + (row ? 0 : static_cast<size_t>(row1 < N ? row1 : 0) * blocks + b_begin);
  const uint32_t table = kTable;

  float acc[NT][4];
#pragma unroll
  for (int t = 0; t < NT; ++t)
#pragma unroll
    for (int r = 0; r < 4; ++r) acc[t][r] = 0.f;

  int cacc[NT][4];  // kIntAcc: the running int32 sums
#pragma unroll
  for (int t = 0; t < NT; ++t)
#pragma unroll
    for (int r = 0; r < 4; ++r) cacc[t][r] = 0;

  uint2 wbuf[D][2];
  __half sbuf[D][2];
#pragma unroll
  for (int u = 0; u < D; ++u) {
    if (u < count) {
      wbuf[u][0] = load_stream8_a8(pw0 + 32 * u);
      wbuf[u][1] = load_stream8_a8(pw1 + 32 * u);
      sbuf[u][0] = row ? one : ps0[u];
      sbuf[u][1] = row ? one : ps1[u];
    }
  }

  // The first weight loads are in flight. Launched early (launch_a8_t), the kernel may get here
  // while the quantization that writes q and qs still runs: nothing an earlier kernel writes is
  // read before this wait. Fused, x is quantized here while the loads arrive.
  wait_for_prior_grids();
  if constexpr (kFused) quantize_rows_shared<T>(x, M, K, xq_shared, qs_shared, scratch);
  const int8_t* const qbase = kFused ? xq_shared : q;
  // A launch of token slabs (gridDim.y > 1, launch_ternary_mma_a8's `slab`) gives each CTA the
  // 8 * NT tokens from m_base; a launch of one slab has m_base = 0.
  const int m_base = static_cast<int>(blockIdx.y) * 8 * NT;
  const int8_t* px[NT];  // token m_base + t * 8 + g, this lane's B column: 32 bytes per block
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    const int m = m_base + t * 8 + g;
    px[t] = qbase + static_cast<size_t>(m < M ? m : 0) * K + b_begin * 128 + 32 * qd;
  }

  for (int left = count; left > 0; left -= D) {
#pragma unroll
    for (int u = 0; u < D; ++u) {
      if (u >= left) break;  // warp-uniform
      const uint2 wa = wbuf[u][0], wb = wbuf[u][1];
      if constexpr (kIntAcc) {
        if (u + D < left) {
          wbuf[u][0] = load_stream8_a8(pw0 + 32 * (u + D));
          wbuf[u][1] = load_stream8_a8(pw1 + 32 * (u + D));
        }
        // Bytes 16H..16H+15 of the lane's 32 of this block.
        mma_word_a8<NT>(wa.x, wb.x, table, [&](int t) { return __ldg(reinterpret_cast<const uint4*>(px[t] + 128 * u)); },
                        cacc);
        mma_word_a8<NT>(wa.y, wb.y, table,
                        [&](int t) { return __ldg(reinterpret_cast<const uint4*>(px[t] + 128 * u) + 1); }, cacc);
        continue;
      }
      const float sa = __half2float(sbuf[u][0]), sb = __half2float(sbuf[u][1]);
      if (u + D < left) {
        wbuf[u][0] = load_stream8_a8(pw0 + 32 * (u + D));
        wbuf[u][1] = load_stream8_a8(pw1 + 32 * (u + D));
        sbuf[u][0] = row ? one : ps0[u + D];
        sbuf[u][1] = row ? one : ps1[u + D];
      }

      uint32_t xw[NT][8];
#pragma unroll
      for (int t = 0; t < NT; ++t) {
        const uint4* p = reinterpret_cast<const uint4*>(px[t] + 128 * u);
        uint4 lo, hi;
        if constexpr (kFused) {
          lo = p[0];  // shared memory
          hi = p[1];
        } else {
          lo = __ldg(p);
          hi = __ldg(p + 1);
        }
        xw[t][0] = lo.x; xw[t][1] = lo.y; xw[t][2] = lo.z; xw[t][3] = lo.w;
        xw[t][4] = hi.x; xw[t][5] = hi.y; xw[t][6] = hi.z; xw[t][7] = hi.w;
      }

      int c[NT][4];
#pragma unroll
      for (int t = 0; t < NT; ++t)
#pragma unroll
        for (int r = 0; r < 4; ++r) c[t][r] = 0;
      mma_word_a8<NT>(wa.x, wb.x, table, [&](int t) { return make_uint4(xw[t][0], xw[t][1], xw[t][2], xw[t][3]); }, c);
      mma_word_a8<NT>(wa.y, wb.y, table, [&](int t) { return make_uint4(xw[t][4], xw[t][5], xw[t][6], xw[t][7]); }, c);
      // C fragment: c[t][0], c[t][1] are row g, c[t][2], c[t][3] row g + 8. The int32 -> fp32
      // conversion is exact (|P| <= 127 * 128).
#pragma unroll
      for (int t = 0; t < NT; ++t) {
        acc[t][0] = fmaf(static_cast<float>(c[t][0]), sa, acc[t][0]);
        acc[t][1] = fmaf(static_cast<float>(c[t][1]), sa, acc[t][1]);
        acc[t][2] = fmaf(static_cast<float>(c[t][2]), sb, acc[t][2]);
        acc[t][3] = fmaf(static_cast<float>(c[t][3]), sb, acc[t][3]);
      }
    }
    pw0 += 32 * D;
    pw1 += 32 * D;
    ps0 += D;
    ps1 += D;
#pragma unroll
    for (int t = 0; t < NT; ++t) px[t] += 128 * D;
  }
  if constexpr (kIntAcc) {
    // Exact, as the float sums of the other kernels, while |S| < 2^24 (127 * K).
#pragma unroll
    for (int t = 0; t < NT; ++t)
#pragma unroll
      for (int r = 0; r < 4; ++r) acc[t][r] = static_cast<float>(cacc[t][r]);
  }

  // The rows' scales and bias are read before the sums are reduced, and a tile's token scales
  // before its stores: each load's latency then overlaps the others' and the reduction, where
  // loads issued beside each store (as the compiler scheduled the row-scaled epilogue since
  // the slab offset came in) wait one after another.
  const int n0c = row0 < N ? row0 : 0, n1c = row1 < N ? row1 : 0;
  const float rs0 = row ? __half2float(ws[n0c]) : 1.f, rs1 = row ? __half2float(ws[n1c]) : 1.f;
  const float bv0 = bias != nullptr ? Fp<T>::to_float(bias[n0c]) : 0.f;
  const float bv1 = bias != nullptr ? Fp<T>::to_float(bias[n1c]) : 0.f;

  // The set is recomputed here rather than kept live through the loop.
  if (!sum_set_warps<NT>(red, acc, threadIdx.x >> (5 + warps_log2), warp, warps, lane)) return;

  // C fragment: acc[t][r] is row g + 8 * (r / 2), token t * 8 + 2q + r % 2.
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    const int m0 = m_base + t * 8 + 2 * qd;
    float sx[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int m = m0 + i < M ? m0 + i : 0;
      if constexpr (kFused) {
        sx[i] = qs_shared[m];
      } else {
        sx[i] = qs[m];
      }
    }
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int n = r < 2 ? row0 : row1;
      const int m = m0 + (r & 1);
      if (n < N && m < M) {
        const float a = row ? __fmul_rn(acc[t][r], r < 2 ? rs0 : rs1) : acc[t][r];
        // Two roundings, as the spec has them (no contraction into one FMA).
        out[static_cast<size_t>(m) * N + n] = Fp<T>::from_float(__fadd_rn(__fmul_rn(a, sx[r & 1]), r < 2 ? bv0 : bv1));
      }
    }
  }
}

template <typename T>
cudaError_t launch_a8_t(const int8_t* q, const float* qs, const T* x, const uint8_t* wp, const __half* ws,
                        bool row, const void* bias, void* out, int M, int N, int K, int row_groups, int depth,
                        int slab, int sms, cudaStream_t stream) {
  // M and slab are checked by both entry points below (ternary_mma_a8_max_m(row, slab), or the fused
  // form's M <= 2 without slabs).
  if (row_groups > kMaxWarpsA8 || !ternary_mma_a8_takes_depth(depth)) return cudaErrorInvalidValue;
  const bool deep = depth == kDeepDepthA8;
  // Token slabs: ceil(M / slab) CTAs along the grid's y, each the launch of its slab's Mk tokens.
  const int Mk = slab > 0 && M > slab ? slab : M;
  const int slabs = (M + Mk - 1) / Mk;
  int sets = row_groups;
  if (sets <= 0 && x != nullptr) {
    sets = min(small_m_split(N, K, sms, -1, kMaxWarpsA8).groups, kFusedMaxSets);
  } else if (sets <= 0 && Mk <= 8) {
    sets = 1;
    while (2 * sets <= kMaxWarpsA8 && (N + 16 * sets - 1) / (16 * sets) > kOneTileCtasPerSm * sms) sets *= 2;
  }
  const SmallMSplit split = small_m_split(N, K, sms, sets, kMaxWarpsA8);
  const T* bt = static_cast<const T*>(bias);
  T* ot = static_cast<T*>(out);
  const dim3 grid((N + 16 * split.groups - 1) / (16 * split.groups), slabs);
  const dim3 block(32 * split.groups * split.warps_k);
  const int wk = split.warps_log2;
  const size_t xq_bytes = static_cast<size_t>(M) * K;
  if (x != nullptr) {  // fused quantization; the caller checked M <= kFusedMaxM and M * K <= kFusedMaxBytes
    if (deep) {
      ternary_mma_a8_kernel<T, 1, true, kDeepDepthA8><<<grid, block, xq_bytes, stream>>>(
          nullptr, nullptr, x, wp, ws, row, bt, ot, M, N, K, wk);
    } else {
      ternary_mma_a8_kernel<T, 1, true, kDepthA8><<<grid, block, xq_bytes, stream>>>(
          nullptr, nullptr, x, wp, ws, row, bt, ot, M, N, K, wk);
    }
    return cudaGetLastError();
  }
  // From q and qs the kernel may start before the quantization that writes them has finished
  // (programmatic dependent launch, ternary_common.cuh): its first weight loads then overlap the
  // end of that kernel instead of following it.
  auto kernel = deep ? (Mk <= 8    ? ternary_mma_a8_kernel<T, 1, false, kDeepDepthA8>
                        : Mk <= 16 ? ternary_mma_a8_kernel<T, 2, false, kDeepDepthA8>
                        : Mk <= 32 ? ternary_mma_a8_kernel<T, 4, false, kDeepDepthA8>
                                   : ternary_mma_a8_kernel<T, 8, false, kDeepDepthA8>)
                     : (Mk <= 8    ? ternary_mma_a8_kernel<T, 1, false, kDepthA8>
                        : Mk <= 16 ? ternary_mma_a8_kernel<T, 2, false, kDepthA8>
                        : Mk <= 32 ? ternary_mma_a8_kernel<T, 4, false, kDepthA8>
                                   : ternary_mma_a8_kernel<T, 8, false, kDepthA8>);
  const T* no_x = nullptr;
  return launch_early(kernel, grid, block, 0, stream, early_launch_allowed(), q, qs, no_x, wp, ws, row, bt, ot, M,
                      N, K, wk);
}

}  // namespace

// Whether the kernel takes `slab` (tokens a CTA, launch_ternary_mma_a8): 0 (one CTA takes all of M),
// or one, two or four n8 tiles.
bool ternary_mma_a8_takes_slab(int slab) { return slab == 0 || slab == 8 || slab == 16 || slab == 32; }

// Largest M the kernel takes: four n8 tiles, or eight with row scales (`row`); over slabs, as many
// slabs as a grid's y holds.
int ternary_mma_a8_max_m(bool row, int slab) { return slab > 0 ? kMaxSlabs * slab : row ? 64 : 32; }

// Whether the kernels take `depth` (scale blocks of weight loads in flight per warp): kDepthA8
// (or <= 0, the kernel's choice: kDepthA8) or kDeepDepthA8.
bool ternary_mma_a8_takes_depth(int depth) {
  return depth <= 0 || depth == kDepthA8 || depth == kDeepDepthA8;
}

// q: int8 [M, K] row-major, 16-byte aligned; qs: fp32 [M]; wp: uint8 [N, K/4] in the a8
// layout, 16-byte aligned; ws: fp16 [N, K/128], or [N, 1] when `row` (a scale per row,
// ternop/activations.py); bias: [N] in the output dtype or nullptr;
// out: [M, N] of dtype out_dtype (kFloat16, kBFloat16 or kFloat32). K a multiple of 128,
// 1 <= M <= ternary_mma_a8_max_m(row, slab). row_groups: sets of 16 rows per CTA (1, 2, 4 or 8), or <= 0 for the
// kernel's choice from the layer and `sms`, the device's multiprocessor count; depth as
// ternary_mma_a8_takes_depth says. slab: 0, or 8, 16 or 32 tokens a CTA, the grid's y running
// ceil(M / slab) slabs (where M > slab), each CTA what a launch of its slab's rows alone would run:
// the same bits.
cudaError_t launch_ternary_mma_a8(const int8_t* q, const float* qs, int out_dtype, const uint8_t* wp,
                                  const __half* ws, bool row, const void* bias, void* out, int M, int N, int K,
                                  int row_groups, int depth, int slab, int sms, cudaStream_t stream) {
  if (!ternary_mma_a8_takes_slab(slab) || !valid_shape(M, ternary_mma_a8_max_m(row, slab), N, K))
    return cudaErrorInvalidValue;
  return dispatch_dtype</*kWithFp32=*/true>(out_dtype, [&](auto tag) {
    using T = decltype(tag);
    return launch_a8_t<T>(q, qs, nullptr, wp, ws, row, bias, out, M, N, K, row_groups, depth, slab, sms, stream);
  });
}

// Whether the fused form takes M rows of K: M <= 2 and M * K <= 40 KiB (its shared copy).
bool ternary_mma_a8_fused_takes(int M, int K) {
  return M >= 1 && M <= kFusedMaxM && static_cast<int64_t>(M) * K <= kFusedMaxBytes;
}

// The same product from x itself: x [M, K] of dtype x_dtype, contiguous and 16-byte aligned,
// quantized per token inside the kernel exactly as ternop/activations.py says; out in x's dtype.
cudaError_t launch_ternary_mma_a8_fused(const void* x, int x_dtype, const uint8_t* wp, const __half* ws, bool row,
                                        const void* bias, void* out, int M, int N, int K, int row_groups, int depth,
                                        int sms, cudaStream_t stream) {
  if (!valid_shape(M, kFusedMaxM, N, K) || !ternary_mma_a8_fused_takes(M, K)) return cudaErrorInvalidValue;
  return dispatch_dtype</*kWithFp32=*/true>(x_dtype, [&](auto tag) {
    using T = decltype(tag);
    return launch_a8_t<T>(nullptr, nullptr, static_cast<const T*>(x), wp, ws, row, bias, out, M, N, K, row_groups,
                          depth, /*slab=*/0, sms, stream);
  });
}

}  // namespace ternop
