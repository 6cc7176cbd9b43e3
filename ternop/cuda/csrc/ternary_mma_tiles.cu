// Mid-M ternary linear on tensor cores: out[m, n] = sum_k x[m, k] * W[n, k] (+ bias[n]) for
// M = 17..64 (the bucket in ternop/cuda/configs.py; any M runs), x fp16 or bf16,
// weights in the "a16" layout (ternop/layouts.py). No dense copy of W is ever written: each
// weight is decoded once per CTA, in registers, and feeds BM / 8 mma.sync m16n8k16.
//
// ternary_mma.cu (M <= 16) keeps x in registers, one lane per 32 k; past two n8 tiles that runs
// out of registers, and every warp would read x again. Here a CTA owns a tile of BN weight rows
// x BM tokens and stages, per 128-wide scale block, the block of x [BM x 128] and of the codes
// [BN x 32 bytes] in shared memory with cp.async, kStages blocks ahead, so that loads of later
// blocks overlap the MMAs of this one.
//
// Where it stops. Every CTA reads the x of its BM tokens in full, N / BN times in all, from L2,
// and one mma.sync needs a B fragment from shared memory. A warp that owns two m16 tiles
// (MT = 2) feeds each B fragment to two MMAs. Past M = 64 no tile of this design reached
// cuBLAS: on the H200 the best one ran at about 250 TFLOP/s wherever M * N * K was large, a
// third of cuBLAS's wgmma kernels, so larger M belongs to wgmma (or to dequantize-then-cuBLAS).
//
// Warps. WN x WM warps: warp (wn, wm) owns weight rows [16 MT wn, 16 MT (wn + 1)) of the tile
// (MT m16 tiles) and tokens [wm TM, (wm + 1) TM), TM = BM / WM, as NT = TM / 8 n8 tiles that
// share each decoded A fragment. The tiles are listed at Tile0 and Tile1; auto_tile picks one
// by M, N and K (the H200 sweep in benchmarks/results/h200 chose it), and the op can be asked
// for either.
//
// Orientation. One mma multiplies A = 16 weight rows x 16 k by B = 16 k x 8 tokens into fp32
// C [16 rows x 8 tokens]. k is in natural order (B comes from x in memory order through
// ldmatrix), which the a16 layout makes cheap on the A side: lane (g = lane / 4, q = lane % 4)
// needs, of word s (k in [16s, 16s + 16)) of rows g and g + 8, the pairs (2q, 2q + 1) and
// (2q + 8, 2q + 9), and a16 keeps neighbours 2p and 2p + 1 in fields p and p + 8, 16 bits apart.
// So (word >> 2q) & 0x00030003 is the first pair and (word >> (2q + 8)) & 0x00030003 the second,
// as u = v + 1 in the low bits of two halves; OR-ed into 2^10 (fp16) or 2^7 (bf16), where one
// ulp is 1, and minus (2^10 + 1) or (2^7 + 1) in one packed subtract, they are v, exactly.
//
// Scales. One packed multiply turns a decoded pair v into v * scale in x's dtype: exact, since
// v is 0 or +-1 and the fp16 scale is first rounded to x's dtype, which is what
// ternop.dequantize does to every weight of a bf16 model. The MMAs then accumulate all of K
// in fp32, with no per-block partials to keep in registers. The scales of the next block are
// loaded into registers one block ahead.
//
// x in shared memory. A token's 128 values are 16 chunks of 16 bytes; chunk c of token r is
// stored at chunk c ^ (r % 8), so the eight 16-byte rows one ldmatrix reads (eight tokens, one
// chunk) fall in different banks. Each ldmatrix.x4 yields the two B registers of two n8 tiles.
// The codes of a row are 32 bytes per block, stored 48 bytes apart, so that the eight rows
// a warp reads with one 16-byte load fall in different banks too.
//
// Split-K. Narrow layers (N = 1024) have too few tiles to fill the GPU; the launcher then gives
// each CTA a range of scale blocks (blockIdx.z) and the CTAs write fp32 partials to a workspace
// [S, M, N], which split_k_reduce_kernel adds in a fixed order (deterministic), adding the bias.
//
// Tokens past M and rows past N read the last token / row (loads stay unconditional); their
// outputs are never written.

#include <type_traits>

#include "ternary_a16.cuh"

namespace ternop {

namespace {

constexpr int kRowBytes = 48;       // shared-memory stride of one row's 32 code bytes
constexpr int kXRowBytes = 256;     // one token's 128 x values (fp16/bf16)

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

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
#endif
}

template <int BM_, int WN_, int WM_, int MT_, int kStages_>
struct Tile {
  static constexpr int BM = BM_, WN = WN_, WM = WM_, MT = MT_, kStages = kStages_;
  static constexpr int kWarps = WN * WM;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int BN = 16 * MT * WN;  // weight rows: each warp owns MT m16 tiles
  static constexpr int TM = BM / WM;
  static constexpr int NT = TM / 8;
  static constexpr int kXBytes = BM * kXRowBytes;
  static constexpr int kWBytes = BN * kRowBytes;
  static constexpr int kStageBytes = kXBytes + kWBytes;
  static constexpr int kSmemBytes = kStages * kStageBytes;
  // CTAs per SM that ptxas must fit: as many as the shared memory allows, up to 512 threads an
  // SM (128 registers a thread); a tile that shared memory holds to fewer CTAs may use more.
  static constexpr int kSmemCtas = (227 * 1024) / kSmemBytes;
  static constexpr int kMinCtas = kThreads >= 512 || kSmemCtas <= 1 ? 1 : (512 / kThreads < kSmemCtas ? 512 / kThreads : kSmemCtas);
  static_assert(NT % 2 == 0, "ldmatrix.x4 loads two n8 tiles");
};

// Issues the cp.async of scale block kb into stage buffer `stage`: x [BM x 128] swizzled and
// the codes [BN x 32 bytes].
template <typename Cfg, typename T>
__device__ __forceinline__ void load_stage(uint8_t* stage, const T* __restrict__ x, int64_t ldx, int m0, int M,
                                           const uint8_t* __restrict__ wp, int64_t row_bytes, int n0, int N, int kb) {
  const uint32_t xs = smem_addr(stage);
  const uint32_t ws = xs + Cfg::kXBytes;
  static_assert(Cfg::BM * 16 % Cfg::kThreads == 0, "whole x chunks per thread");
#pragma unroll
  for (int j = 0; j < Cfg::BM * 16 / Cfg::kThreads; ++j) {
    const int c = threadIdx.x + j * Cfg::kThreads;
    const int r = c / 16, chunk = c % 16;
    const int m = min(m0 + r, M - 1);
    const T* src = x + m * ldx + kb * 128 + chunk * 8;
    cp_async16(xs + r * kXRowBytes + ((chunk ^ (r & 7)) * 16), src);
  }
  // BN * 2 chunks of codes: one per thread (or two: BN * 2 = 2 * threads when WM = 1 and MT = 2).
#pragma unroll
  for (int j = 0; j < (Cfg::BN * 2 + Cfg::kThreads - 1) / Cfg::kThreads; ++j) {
    const int c = threadIdx.x + j * Cfg::kThreads;
    if (c < Cfg::BN * 2) {
      const int r = c / 2, half = c % 2;
      const int n = min(n0 + r, N - 1);
      cp_async16(ws + r * kRowBytes + half * 16, wp + n * row_bytes + kb * 32 + half * 16);
    }
  }
}

template <typename T, typename Cfg>
__global__ void __launch_bounds__(Cfg::kThreads, Cfg::kMinCtas)
    ternary_mma_tiles_kernel(const T* __restrict__ x, int64_t ldx, const uint8_t* __restrict__ wp,
                             const __half* __restrict__ ws, const T* __restrict__ bias, T* __restrict__ out,
                             float* __restrict__ partial, int M, int N, int K, int blocks_per_split) {
  constexpr int NT = Cfg::NT, MT = Cfg::MT, kStages = Cfg::kStages;
  extern __shared__ __align__(128) uint8_t smem[];

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int wn = warp % Cfg::WN, wm = warp / Cfg::WN;
  const int g = lane / 4, q = lane % 4;
  const int n0 = blockIdx.x * Cfg::BN, m0 = blockIdx.y * Cfg::BM;
  const int blocks = K / 128;
  const int kb_begin = blockIdx.z * blocks_per_split;
  const int count = max(0, min(blocks_per_split, blocks - kb_begin));
  const int64_t row_bytes = K / 4;

  // Row (tile mt, half h) of this lane: 16 (MT wn + mt) + g + 8 h of the CTA's rows.
  // Its scales: ps0[srow[mt][h] * blocks + kb] (32-bit offsets keep registers for the tiles).
  const __half* ps0 = ws + kb_begin;
  int srow[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) srow[mt][h] = min(n0 + 16 * (MT * wn + mt) + g + 8 * h, N - 1);
  // ldmatrix.x4, lanes 8j..8j+7 give the rows of matrix j: tile 2i + j / 2, chunk 2s + j % 2.
  const int lm_tok = wm * Cfg::TM + 8 * (lane / 16) + (lane % 8);  // + 16 i
  const int lm_chunk = (lane / 8) % 2;                             // + 2 s
  const uint32_t magic = Pair16<T>::kMagic;

  float acc[MT][NT][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int t = 0; t < NT; ++t)
#pragma unroll
      for (int r = 0; r < 4; ++r) acc[mt][t][r] = 0.f;

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < count)
      load_stage<Cfg>(smem + s * Cfg::kStageBytes, x, ldx, m0, M, wp, row_bytes, n0, N, kb_begin + s);
    cp_async_commit();
  }
  __half sc[MT][2];  // this block's scales, loaded a block ahead
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) sc[mt][h] = count > 0 ? ps0[static_cast<int64_t>(srow[mt][h]) * blocks] : __float2half(0.f);

  for (int i = 0; i < count; ++i) {
    cp_async_wait<kStages - 2>();
    __syncthreads();  // block i has landed for every thread; everyone is done with block i - 1
    {
      const int next = i + kStages - 1;
      if (next < count)
        load_stage<Cfg>(smem + (next % kStages) * Cfg::kStageBytes, x, ldx, m0, M, wp, row_bytes, n0, N,
                        kb_begin + next);
      cp_async_commit();
    }
    uint32_t sp[MT][2];
    __half sn[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        sp[mt][h] = scale_pair<T>(sc[mt][h]);
        sn[mt][h] = i + 1 < count ? ps0[static_cast<int64_t>(srow[mt][h]) * blocks + i + 1] : __float2half(0.f);
      }

    const uint8_t* stage = smem + (i % kStages) * Cfg::kStageBytes;
    const uint32_t xs = smem_addr(stage);
    const uint8_t* wrow = stage + Cfg::kXBytes + (16 * MT * wn + g) * kRowBytes;

#pragma unroll
    for (int s = 0; s < 8; ++s) {
      uint32_t a[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        const uint32_t w0 = *reinterpret_cast<const uint32_t*>(wrow + 16 * mt * kRowBytes + 4 * s) >> (2 * q);
        const uint32_t w1 = *reinterpret_cast<const uint32_t*>(wrow + (16 * mt + 8) * kRowBytes + 4 * s) >> (2 * q);
        // v * scale, exact: v is 0 or +-1, and the scale is already in x's dtype (for bf16 the
        // rounding that ternop.dequantize applies to every weight).
        a[mt][0] = mul2<T>(decode_pair<T>(w0, magic), sp[mt][0]);
        a[mt][1] = mul2<T>(decode_pair<T>(w1, magic), sp[mt][1]);
        a[mt][2] = mul2<T>(decode_pair<T>(w0 >> 8, magic), sp[mt][0]);
        a[mt][3] = mul2<T>(decode_pair<T>(w1 >> 8, magic), sp[mt][1]);
      }
#pragma unroll
      for (int t2 = 0; t2 < NT / 2; ++t2) {
        const int tok = lm_tok + 16 * t2;
        const int chunk = 2 * s + lm_chunk;
        uint32_t b[4];
        ldmatrix_x4(b, xs + tok * kXRowBytes + ((chunk ^ (tok & 7)) * 16));
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma_16816<T>(acc[mt][2 * t2], a[mt], b[0], b[1]);
          mma_16816<T>(acc[mt][2 * t2 + 1], a[mt], b[2], b[3]);
        }
      }
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) sc[mt][h] = sn[mt][h];
  }
  cp_async_wait<0>();

  // acc[mt][t][r] is row n0 + 16 (MT wn + mt) + g + 8 (r / 2), token m0 + wm TM + 8 t + 2q + r % 2.
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int t = 0; t < NT; ++t)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int n = n0 + 16 * (MT * wn + mt) + g + 8 * (r / 2);
        const int m = m0 + wm * Cfg::TM + 8 * t + 2 * q + (r & 1);
        if (n < N && m < M) {
          if (partial != nullptr) {
            partial[(static_cast<int64_t>(blockIdx.z) * M + m) * N + n] = acc[mt][t][r];
          } else {
            const float bv = bias != nullptr ? Fp<T>::to_float(bias[n]) : 0.f;
            out[static_cast<int64_t>(m) * N + n] = Fp<T>::from_float(acc[mt][t][r] + bv);
          }
        }
      }
}

// The tiles (BM tokens, WN x WM warps, MT m16 tiles a warp, stages); BN = 16 MT WN rows. The H200
// sweep (benchmarks/sweep_tiles.py; results/h200/sweep_tiles.json) also tried 256-row tiles and
// 128-token tiles of 8 and 16 warps: none won a shape from M = 17 to 512, so they are gone.
using Tile0 = Tile<32, 4, 1, 1, 4>;  // BN  64, 4 warps of 16 rows x 32 tokens
using Tile1 = Tile<64, 4, 1, 2, 4>;  // BN 128, 4 warps of 32 rows x 64 tokens
constexpr int kTiles = 2;

struct TileShape {
  int bm, bn, smem;
};

template <typename Cfg>
constexpr TileShape shape_of() {
  return {Cfg::BM, Cfg::BN, Cfg::kSmemBytes};
}

constexpr TileShape kShapes[kTiles] = {shape_of<Tile0>(), shape_of<Tile1>()};

template <typename T, typename Cfg>
cudaError_t launch_tiles(const T* x, int64_t ldx, const uint8_t* wp, const __half* ws, const T* bias, T* out,
                         float* workspace, int M, int N, int K, int splits, cudaStream_t stream) {
  auto kernel = ternary_mma_tiles_kernel<T, Cfg>;
  // Past the 48 KiB a launch may take unasked; set on every launch (cheap, and per device).
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes);
  if (err != cudaSuccess) return err;
  const int blocks = K / 128;
  const int per_split = (blocks + splits - 1) / splits;
  const dim3 grid((N + Cfg::BN - 1) / Cfg::BN, (M + Cfg::BM - 1) / Cfg::BM, splits);
  kernel<<<grid, Cfg::kThreads, Cfg::kSmemBytes, stream>>>(x, ldx, wp, ws, bias, out,
                                                          splits > 1 ? workspace : nullptr, M, N, K, per_split);
  err = cudaGetLastError();
  if (err != cudaSuccess || splits == 1) return err;
  return launch_split_k_reduce(workspace, bias, out, M, N, splits, stream);
}

// The tile for a call when none is forced. From the sweep: the 64-row, 32-token tile is the
// fastest at M <= 32 on all eight shapes (0.93-1.45x of cuBLAS bf16) and at M <= 64 on the
// 0.6B shapes and 4096 x 4096; the 128-row, 64-token tile wins M = 33..64 where N * K > 2^25
// (0.87-1.08x against 0.82-0.94x).
int auto_tile(int M, int N, int K) {
  return M > 32 && static_cast<int64_t>(N) * K > (int64_t{1} << 25) ? 1 : 0;
}

}  // namespace

// The tile a call runs: `tile` when it names one (0 or 1, for benchmarks), else auto_tile.
int ternary_mma_tiles_tile(int M, int N, int K, int tile) {
  return tile >= 0 && tile < kTiles ? tile : auto_tile(M, N, K);
}

// Splits of K for this launch: doubled while the CTAs do not fill every SM's slots (as many
// CTAs as the tile's shared memory lets an SM hold) and each split keeps at least two scale
// blocks. linear_cuda.cpp sizes the fp32 workspace [splits, M, N] from it.
int ternary_mma_tiles_splits(int M, int N, int K, int sms, int tile) {
  const TileShape t = kShapes[ternary_mma_tiles_tile(M, N, K, tile)];
  const int per_sm = max(1, (227 * 1024) / t.smem);
  const int tiles = ((N + t.bn - 1) / t.bn) * ((M + t.bm - 1) / t.bm);
  const int blocks = K / 128;
  int splits = 1;
  while (splits < 16 && tiles * splits < per_sm * sms && blocks / (2 * splits) >= 2) splits *= 2;
  return splits;
}

// x: [M, K] with row stride ldx (elements, a multiple of 8), fp16 or bf16; wp: uint8 [N, K/4]
// in the a16 layout; ws: fp16 [N, K/128]; bias [N] in x's dtype or nullptr; out [M, N];
// workspace: fp32 [splits, M, N] when splits > 1. x, wp 16-byte aligned, K a multiple of 128.
cudaError_t launch_ternary_mma_tiles(const void* x, int64_t ldx, int dtype, const uint8_t* wp, const __half* ws,
                                     const void* bias, void* out, float* workspace, int M, int N, int K, int splits,
                                     int tile, cudaStream_t stream) {
  if (M < 1 || N < 1 || K < 128 || K % 128 || ldx % 8 || splits < 1) return cudaErrorInvalidValue;
  return dispatch_dtype</*kWithFp32=*/false>(dtype, [&](auto tag) {
    using T = decltype(tag);
    const T* xt = static_cast<const T*>(x);
    const T* bt = static_cast<const T*>(bias);
    T* ot = static_cast<T*>(out);
    if (ternary_mma_tiles_tile(M, N, K, tile) == 0)
      return launch_tiles<T, Tile0>(xt, ldx, wp, ws, bt, ot, workspace, M, N, K, splits, stream);
    return launch_tiles<T, Tile1>(xt, ldx, wp, ws, bt, ot, workspace, M, N, K, splits, stream);
  });
}

}  // namespace ternop
