// Small-M ternary linear on tensor cores: out[m, n] = sum_k x[m, k] * W[n, k] (+ bias[n]),
// 1 <= M <= 16, x fp16 or bf16, weights in format v1 or in the "a16" layout (ternop/layouts.py).
//
// Like ternary_gemv.cu this file holds only CUDA code (no torch headers) so that nvcc can
// compile it alone in CI; linear_cuda.cpp calls launch_ternary_mma().
//
// Orientation. One mma.sync m16n8k16 multiplies A = 16 weight rows x 16 k by B = 16 k x 8
// tokens into C = fp32 [16 rows x 8 tokens]; M <= 8 uses one n8 tile, M <= 16 two that
// share the A fragment. Tokens past M are zero in B.
//
// k order. Inside one mma the order of the 16 k slots is free as long as A and B agree.
// Lane (g = lane / 4, q = lane % 4) owns, for rows g and g + 8, the 32 codes
// [32q, 32q + 32) of each 128-wide scale block: 8 bytes = two words (h = 0, 1) of 16 codes.
// The four lanes of a quad read one 32-byte sector per row. mma step i (0..7) of a block
// takes word h = i / 4 and e = 2 * (i % 4), and its A registers hold (low half, high half):
//   slots (2q, 2q+1)   <- codes (e, e + 8)     of word h
//   slots (2q+8, 2q+9) <- codes (e + 1, e + 9) of word h
// so all 16 k of an mma lie in one scale block: 8 steps give the block's fp32 partial,
// which is multiplied by its fp16 scale (as fp32) and added to the accumulator.
// tests/cuda/test_mma_mapping.py replays this mapping in NumPy.
//
// The a16 layout stores u = v + 1 and puts the neighbours (2p, 2p + 1) in fields (p, p + 8),
// so the same shift-and-mask yields pairs in x's memory order: step i = 4h + s takes
// pair(2s) = codes (4s, 4s + 1) into slots (2q, 2q + 1) and pair(2s + 1) = codes
// (4s + 2, 4s + 3) into slots (2q + 8, 2q + 9), and B is two x registers as loaded: no PRMT,
// and no plus2 (u is already an offset value). The subtract takes 2^e + 1 instead of 2^e + 2.
//
// Decode. Per 2-bit field lo - hi + 2 is in {1, 2, 3}, so
//   d = (w & 0x55555555) + 0xAAAAAAAA - ((w >> 1) & 0x55555555)
// holds v + 2 in every field with no carries (reserved 0b11 reads as 0). Codes j and j + 8
// of a word sit 16 bits apart, so ((d >> 2j) & 0x00030003) | magic puts both in the low
// mantissa bits of a half pair whose value is 2^10 + (v + 2) (fp16, magic 0x6400) or
// 2^7 + (v + 2) (bf16, magic 0x4300), exactly; one packed subtract of (2^10 + 2) or
// (2^7 + 2) leaves v. That is a shift, a LOP3 and an HSUB2 per two codes.
//
// Work split (small_m_split, ternary_common.cuh). A CTA of R x W warps owns R sets of 16
// rows; warp (r, w) takes set r and a contiguous range of its scale blocks, and keeps D
// blocks of weight loads in flight (kDepth unless asked). The R warps with the same w read the
// same x at about the same time, so x comes from L2 once per CTA and from L1 for the others. Warps
// w = 1..W-1 of a set leave their C fragments in shared memory; warp 0 of the set adds them
// in a fixed order (deterministic), adds the bias and writes out once. No atomics, no
// workspace.
//
// x in shared memory (kSmemX). Where R >= 2 sets share x and M <= 8, the a16 kernel first
// copies x into shared memory, while the first weight loads are in flight, and the warps read
// it from there. Reads of x from L1 are the largest wait of the M = 1 loop
// (docs/KERNELS.md, "The small-M kernel's arithmetic alone"); from shared memory they are
// shorter, and where R sets share x the copy is paid once for R. With R = 1 the copy has no
// one to share with and its wait before the loop is not hidden: on an H100 it made
// 4096->4096 and 14336->4096 3-5% slower at M = 1 (20% at M = 4), while the R >= 2 layers
// 4096->14336 and 4096->28672 got 6-8% faster (results/h100/sweep_mma_xsmem_*).
//
// x through a per-warp ring (kXRing). With two token tiles (M = 9..16) each warp instead copies
// the x of its next D blocks by cp.async into slots of its own in shared memory, and reads the
// current block from there: x's loads are issued D blocks ahead, as the weights' are, without
// holding registers. Taken where it measured faster (takes_x_ring, below).

#include <type_traits>

#include "ternary_common.cuh"

namespace ternop {

namespace {

constexpr int kMaxWarps = 8;
// Scale blocks of weight loads in flight per warp, by default. The a16 kernels also take
// kDeepDepth (launch_ternary_mma's `depth`), for layers whose CTAs leave the SMs' warp slots
// short of loads: ptxas fits it in the registers their CTAs an SM allow (80 of 85 for one tile,
// 108 of 128 for two). The v1 one-tile kernel would spill at four CTAs an SM, so v1 has no deep
// form. The depth changes when the loads are issued, not what is summed or in which order.
constexpr int kDepth = 2;
constexpr int kDeepDepth = 4;
// CTAs per SM that ptxas must fit: 64 registers for one n8 tile, 128 for two (ptxas uses 64
// and 106; tests/cuda/test_nvcc_compile.py checks that nothing spills). The a16 one-tile
// kernel keeps more pairs live and spilled at 64, so it gets 80 (three CTAs).
template <int NT, bool kA16>
constexpr int min_ctas() { return NT == 1 ? (kA16 ? 3 : 4) : 2; }

// The weights are read exactly once: keep them out of L1, where x lives.
__device__ __forceinline__ uint2 load_stream8(const void* p) {
  uint2 r;
  asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];" : "=r"(r.x), "=r"(r.y) : "l"(p));
  return r;
}

// Per x dtype: the packed pair type, the magic pair (2^10 or 2^7 in both halves, where one
// mantissa ulp is 1) and the magic plus 2 that the decode subtracts.
template <typename T>
struct Mma;

template <>
struct Mma<__half> {
  using Pair = __half2;
  static constexpr uint32_t kMagic = 0x64006400u;  // (1024, 1024) as fp16: ulp 1
  static constexpr uint32_t kBias = 0x64026402u;   // (1026, 1026): v1 fields hold v + 2
  static constexpr uint32_t kBiasA16 = 0x64016401u;  // (1025, 1025): a16 fields hold v + 1
};

template <>
struct Mma<__nv_bfloat16> {
  using Pair = __nv_bfloat162;
  static constexpr uint32_t kMagic = 0x43004300u;  // (128, 128) as bf16: ulp 1
  static constexpr uint32_t kBias = 0x43024302u;   // (130, 130)
  static constexpr uint32_t kBiasA16 = 0x43014301u;  // (129, 129)
};

// Packed a - b of two pairs of T.
template <typename T>
__device__ __forceinline__ uint32_t sub2(uint32_t a, uint32_t b) {
  using P = typename Mma<T>::Pair;
  P r = __hsub2(*reinterpret_cast<const P*>(&a), *reinterpret_cast<const P*>(&b));
  return *reinterpret_cast<uint32_t*>(&r);
}

// c += A (16 x 16, registers a0..a3) * B (16 x 8, b0, b1), fp32 accumulate, A and B in T.
template <typename T>
__device__ __forceinline__ void mma_16816(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                          uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  __trap();  // no m16n8k16 before sm_80; the registry never launches it there
#else
  if constexpr (std::is_same_v<T, __half>) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  } else {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
#endif
}

// v + 2 in every 2-bit field of w (see the file comment).
__device__ __forceinline__ uint32_t plus2(uint32_t w) {
  return (w & 0x55555555u) + 0xAAAAAAAAu - ((w >> 1) & 0x55555555u);
}

// Codes j (low half) and j + 8 (high half) of the word whose plus2() is d, as a pair of v.
// The mask and the OR are one LOP3 only when the magic sits in a register (a LOP3 takes one
// immediate), which ptxas does not arrange by itself.
template <typename T, int J, bool kA16>
__device__ __forceinline__ uint32_t pair(uint32_t d, uint32_t magic) {
  uint32_t r;
  // 0xEA = (a & b) | c
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(d >> (2 * J)), "n"(0x00030003), "r"(magic));
  return sub2<T>(r, kA16 ? Mma<T>::kBiasA16 : Mma<T>::kBias);
}

// 16 bytes of read-only global memory at p into r where `load` holds, zeros where it does not
// (and then nothing is loaded). The zeros give r a definition on every path; without one, ptxas
// keeps r live through the whole kernel and spills.
__device__ __forceinline__ void load16_if(const void* p, bool load, uint32_t (&r)[4]) {
  asm("{\n .reg .pred p;\n setp.ne.b32 p, %5, 0;\n mov.b32 %0, 0;\n mov.b32 %1, 0;\n mov.b32 %2, 0;\n"
      " mov.b32 %3, 0;\n @p ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];\n}"
      : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
      : "l"(p), "r"(static_cast<int>(load)));
}

// The 32 x values [32q, 32q + 32) of one block for one token: 16 registers of two halves. The
// lanes of B columns past M (`mine` false) load nothing and hold zeros: their C columns are never
// written. Before, they loaded token 0 again, which at M = 1 was seven eighths of the bytes that
// x moves from L1 into registers; skipping them made M = 1 1-4.5% faster on an H100
// (results/h100/sweep_mma_x{all,own}_r{1,2}_*.json). M = 16 is unchanged: every lane loads.
template <typename T>
__device__ __forceinline__ void load_x(const T* p, bool mine, uint32_t (&xv)[16]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    uint32_t v[4];
    load16_if(p + 8 * i, mine, v);
    xv[4 * i] = v[0];
    xv[4 * i + 1] = v[1];
    xv[4 * i + 2] = v[2];
    xv[4 * i + 3] = v[3];
  }
}

// mma step 4H + S of a block (e = 2S): A from codes (e, e + 8) and (e + 1, e + 9) of word H
// (v1; a16: codes (4S, 4S + 1) and (4S + 2, 4S + 3)) of rows g (d_g: plus2 of that word for
// v1, the word itself for a16) and g + 8 (d_g8); B from the same k of x.
template <typename T, int NT, int H, int S, bool kA16>
__device__ __forceinline__ void mma_step(uint32_t d_g, uint32_t d_g8, const uint32_t (&xv)[NT][16], uint32_t magic,
                                         float (&c)[NT][4]) {
  const uint32_t a0 = pair<T, 2 * S, kA16>(d_g, magic);       // row g,     slots 2q, 2q+1
  const uint32_t a1 = pair<T, 2 * S, kA16>(d_g8, magic);      // row g + 8, slots 2q, 2q+1
  const uint32_t a2 = pair<T, 2 * S + 1, kA16>(d_g, magic);   // row g,     slots 2q+8, 2q+9
  const uint32_t a3 = pair<T, 2 * S + 1, kA16>(d_g8, magic);  // row g + 8, slots 2q+8, 2q+9
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    uint32_t b0, b1;
    if constexpr (kA16) {
      // x[16H + 4S .. 16H + 4S + 3] are xv[8H + 2S] and xv[8H + 2S + 1], as loaded.
      b0 = xv[t][8 * H + 2 * S];      // slots 2q, 2q+1
      b1 = xv[t][8 * H + 2 * S + 1];  // slots 2q+8, 2q+9
    } else {
      // x[16H + 2S] and x[16H + 2S + 8] are the low halves of xv[8H + S] and xv[8H + S + 4];
      // x[16H + 2S + 1] and x[16H + 2S + 9] their high halves.
      const uint32_t lo = xv[t][8 * H + S], hi = xv[t][8 * H + S + 4];
      b0 = __byte_perm(lo, hi, 0x5410);  // slots 2q, 2q+1
      b1 = __byte_perm(lo, hi, 0x7632);  // slots 2q+8, 2q+9
    }
    mma_16816<T>(c[t], a0, a1, a2, a3, b0, b1);
  }
}

// Word H (0 or 1) of a block: mma steps 4H..4H+3. w_g and w_g8 are that word of rows g
// and g + 8.
template <typename T, int NT, int H, bool kA16>
__device__ __forceinline__ void mma_word(uint32_t w_g, uint32_t w_g8, const uint32_t (&xv)[NT][16], uint32_t magic,
                                         float (&c)[NT][4]) {
  const uint32_t d_g = kA16 ? w_g : plus2(w_g), d_g8 = kA16 ? w_g8 : plus2(w_g8);
  mma_step<T, NT, H, 0, kA16>(d_g, d_g8, xv, magic, c);
  mma_step<T, NT, H, 1, kA16>(d_g, d_g8, xv, magic, c);
  mma_step<T, NT, H, 2, kA16>(d_g, d_g8, xv, magic, c);
  mma_step<T, NT, H, 3, kA16>(d_g, d_g8, xv, magic, c);
}

// kSmemX: token m of x at m * xs_stride(K) 16-byte chunks of the dynamic shared memory, and
// block b's chunk for mma steps (i, i + 4) of lane group q at b * 16 + i * 4 + q: the four
// distinct chunks a warp reads at once fall in 16 distinct banks (the lanes of one group get
// theirs by broadcast), and the token stride is 64 bytes past a multiple of 128, so two tokens
// take the other 16 banks.
__host__ __device__ constexpr int xs_stride(int K) { return K / 8 + 4; }
// Where chunk c of a token's x (elements 8c..8c+7: block c / 16, lane group (c / 4) % 4, step c % 4)
// goes in that token's stretch of xs.
__host__ __device__ constexpr int xs_chunk(int c) { return (c >> 4) * 16 + (c & 3) * 4 + ((c >> 2) & 3); }
constexpr size_t kMaxXSmemBytes = 40 * 1024;  // with `red`, under the 48 KB a launch gets unasked

// kXRing: each warp copies the x of its next D blocks by cp.async into D slots of its own in
// shared memory and reads the current block from there, so x's loads are in flight as long as
// the weights' and hold no registers ahead. A slot is M tokens of kRingTokenChunks 16-byte chunks:
// the 16 of the block in xs_chunk's order, then 64 bytes of padding, so that two tokens fall in
// different banks. Lane l copies chunk ring_chunk(l % 16) of tokens l / 16, l / 16 + 2, ...: the
// eight lanes of a quarter-warp then write eight chunks that fall in distinct banks.
constexpr int kRingTokenChunks = 20;
__host__ __device__ constexpr int ring_chunk(int l) { return ((l & 7) >> 1) * 4 + (l & 1) + ((l >> 3) & 1) * 2; }
__host__ __device__ constexpr size_t ring_bytes(int warps_per_cta, int D, int M) {
  return static_cast<size_t>(warps_per_cta) * D * M * kRingTokenChunks * 16;
}

// Where the kernel reads x from.
enum XSource : int { kXGlobal = 0, kXShared = 1, kXRing = 2 };

template <typename T, int NT, bool kA16, int D, int kX = kXGlobal>
__global__ void __launch_bounds__(kMaxWarps * 32, min_ctas<NT, kA16>()) ternary_mma_kernel(
    const T* __restrict__ x, const uint8_t* __restrict__ wp, const __half* __restrict__ ws,
    const T* __restrict__ bias, T* __restrict__ out, int M, int N, int K, int warps_log2) {
  __shared__ float red[kMaxWarps - 1][NT * 4][32];
  extern __shared__ uint4 xs[];  // kXShared: the whole x; kXRing: the warps' slots
  constexpr bool kSmemX = kX == kXShared, kRing = kX == kXRing;
  static_assert(!kSmemX || (kA16 && NT == 1), "x in shared memory: the one-tile a16 kernel only");
  static_assert(!kRing || (kA16 && NT == 2), "the x ring: the two-tile a16 kernel only");
  if (gridDim.y > 1) {  // experiment (TERNOP_A16_SLAB): slab y of 8 * NT tokens, as a launch of its own
    const int mb = static_cast<int>(blockIdx.y) * 8 * NT;
    x += static_cast<size_t>(mb) * K;
    out += static_cast<size_t>(mb) * N;
    M = min(8 * NT, M - mb);
  }

  // 2^warps_log2 warps (warps_k of the split) per set of 16 rows; blockDim.x / 32 / warps sets.
  const int warps = 1 << warps_log2;
  const int set = threadIdx.x >> (5 + warps_log2), warp = (threadIdx.x >> 5) & (warps - 1), lane = threadIdx.x % 32;
  const int g = lane / 4, q = lane % 4;
  const int n0 = (blockIdx.x * (blockDim.x >> (5 + warps_log2)) + set) * 16;
  const int row0 = n0 + g, row1 = n0 + g + 8;

  const int blocks = K / 128;
  const int per_warp = (blocks + warps - 1) / warps;
  const int b_begin = min(warp * per_warp, blocks);
  const int count = min(per_warp, blocks - b_begin);  // this warp's scale blocks

  // Rows past N read row 0 instead of branching, and tokens past M load nothing (zeros, load_x):
  // an mma keeps C's rows and columns apart, and those outputs are never written.
  const size_t row_bytes = static_cast<size_t>(K) / 4;
  const uint8_t* pw0 = wp + static_cast<size_t>(row0 < N ? row0 : 0) * row_bytes + b_begin * 32 + 8 * q;
  const uint8_t* pw1 = wp + static_cast<size_t>(row1 < N ? row1 : 0) * row_bytes + b_begin * 32 + 8 * q;
  const __half* ps0 = ws + static_cast<size_t>(row0 < N ? row0 : 0) * blocks + b_begin;
  const __half* ps1 = ws + static_cast<size_t>(row1 < N ? row1 : 0) * blocks + b_begin;
  const T* px[NT];  // token t * 8 + g, this lane's B column
  bool x_mine[NT];  // whether that token exists (the lanes of the others load nothing)
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    const int m = t * 8 + g;
    px[t] = x + static_cast<size_t>(m < M ? m : 0) * K + b_begin * 128 + 32 * q;
    x_mine[t] = m < M;
  }
  const uint32_t magic = Mma<T>::kMagic;

  float acc[NT][4];
#pragma unroll
  for (int t = 0; t < NT; ++t)
#pragma unroll
    for (int r = 0; r < 4; ++r) acc[t][r] = 0.f;

  // D blocks of weights and scales in flight; the pointers advance by D blocks
  // per outer step, so every offset below is an immediate.
  uint2 wbuf[D][2];
  __half sbuf[D][2];
#pragma unroll
  for (int u = 0; u < D; ++u) {
    if (u < count) {
      wbuf[u][0] = load_stream8(pw0 + 32 * u);
      wbuf[u][1] = load_stream8(pw1 + 32 * u);
      sbuf[u][0] = ps0[u];
      sbuf[u][1] = ps1[u];
    }
  }

  // The first weight loads are in flight; copy x meanwhile.
  int xo = 0;  // kSmemX: index in xs of this lane's token at b_begin, lane group q
  if constexpr (kSmemX) {
    const int chunks = K / 8;
    for (int m = 0; m < M; ++m) {
      const uint4* row = reinterpret_cast<const uint4*>(x + static_cast<size_t>(m) * K);
      for (int c = threadIdx.x; c < chunks; c += blockDim.x)
        xs[m * xs_stride(K) + xs_chunk(c)] = __ldg(row + c);
    }
    __syncthreads();
    // Token g; past M, a token of g's parity (tokens 0 and 1 fill the other half of the banks each),
    // so that the pair g = 2p, 2p + 1 that one quarter-warp serves stays conflict-free at odd M.
    xo = (g < M ? g : (M > 1 ? g & 1 : 0)) * xs_stride(K) + b_begin * 16 + q;
  }
  // kRing: this warp's slots, and where this lane's copies of block b_begin start.
  uint4* const ring = xs + static_cast<size_t>(threadIdx.x >> 5) * D * M * kRingTokenChunks;
  const int rk = ring_chunk(lane & 15), rm = lane >> 4;
  const T* const ring_src = x + static_cast<size_t>(rm) * K + b_begin * 128 + rk * 8;
  uint4* const ring_dst = ring + rm * kRingTokenChunks + (rk & 3) * 4 + (rk >> 2);
  auto ring_copy = [&](int j, int slot) {  // block b_begin + j into `slot`
    const T* src = ring_src + j * 128;
    uint4* dst = ring_dst + slot * M * kRingTokenChunks;
    for (int m = rm; m < M; m += 2, src += 2 * static_cast<size_t>(K), dst += 2 * kRingTokenChunks)
      cp_async16_l1(smem_addr(dst), src);
  };
  if constexpr (kRing) {
#pragma unroll
    for (int u = 0; u < D; ++u) {
      if (u < count) ring_copy(u, u);
      cp_async_commit();  // one group a slot, empty or not, so that wait_group counts slots
    }
  }

  for (int left = count; left > 0; left -= D) {
#pragma unroll
    for (int u = 0; u < D; ++u) {
      if (u >= left) break;  // warp-uniform
      const uint2 wa = wbuf[u][0], wb = wbuf[u][1];
      const float sa = __half2float(sbuf[u][0]), sb = __half2float(sbuf[u][1]);
      if (u + D < left) {
        wbuf[u][0] = load_stream8(pw0 + 32 * (u + D));
        wbuf[u][1] = load_stream8(pw1 + 32 * (u + D));
        sbuf[u][0] = ps0[u + D];
        sbuf[u][1] = ps1[u + D];
      }

      uint32_t xv[NT][16];
      if constexpr (kRing) {
        cp_async_wait<D - 1>();  // slot u holds block count - left + u (this lane's copies)
        __syncwarp();            // and every other lane's
#pragma unroll
        for (int t = 0; t < NT; ++t) {
          const uint4* src = ring + (u * M + t * 8 + g) * kRingTokenChunks + q;
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            uint4 v = make_uint4(0, 0, 0, 0);
            if (x_mine[t]) v = src[4 * i];
            xv[t][4 * i] = v.x, xv[t][4 * i + 1] = v.y, xv[t][4 * i + 2] = v.z, xv[t][4 * i + 3] = v.w;
          }
        }
        __syncwarp();  // every lane has read slot u before it is refilled
        if (u + D < left) ring_copy(count - left + u + D, u);
        cp_async_commit();
      } else if constexpr (kSmemX) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const uint4 v = xs[xo + 16 * u + 4 * i];
          xv[0][4 * i] = v.x, xv[0][4 * i + 1] = v.y, xv[0][4 * i + 2] = v.z, xv[0][4 * i + 3] = v.w;
        }
      } else {
#pragma unroll
        for (int t = 0; t < NT; ++t) load_x(px[t] + 128 * u, x_mine[t], xv[t]);
      }

      // The block's eight mma steps in two chains, one a word, added at the end: the one-tile a16
      // kernel then waits on four dependent mma at a time instead of eight, which made it 1-4%
      // faster at M = 1 on every layer of an H100 (results/h100/sweep_mma_{base,split}_*); with two
      // tiles it moved M = 16 by -4% to +3%, so those keep one chain.
      constexpr bool kTwoChains = kA16 && NT == 1;
      float c[NT][4], c2[NT][4];
#pragma unroll
      for (int t = 0; t < NT; ++t)
#pragma unroll
        for (int r = 0; r < 4; ++r) c[t][r] = 0.f, c2[t][r] = 0.f;
      mma_word<T, NT, 0, kA16>(wa.x, wb.x, xv, magic, c);
      mma_word<T, NT, 1, kA16>(wa.y, wb.y, xv, magic, kTwoChains ? c2 : c);
      if constexpr (kTwoChains) {
#pragma unroll
        for (int t = 0; t < NT; ++t)
#pragma unroll
          for (int r = 0; r < 4; ++r) c[t][r] += c2[t][r];
      }
      // C fragment: c[t][0], c[t][1] are row g, c[t][2], c[t][3] row g + 8.
#pragma unroll
      for (int t = 0; t < NT; ++t) {
        acc[t][0] = fmaf(c[t][0], sa, acc[t][0]);
        acc[t][1] = fmaf(c[t][1], sa, acc[t][1]);
        acc[t][2] = fmaf(c[t][2], sb, acc[t][2]);
        acc[t][3] = fmaf(c[t][3], sb, acc[t][3]);
      }
    }
    pw0 += 32 * D;
    pw1 += 32 * D;
    ps0 += D;
    ps1 += D;
#pragma unroll
    for (int t = 0; t < NT; ++t) px[t] += 128 * D;
    if constexpr (kSmemX) xo += 16 * D;
  }

  // The set is recomputed here rather than kept live through the loop.
  if (!sum_set_warps<NT>(red, acc, threadIdx.x >> (5 + warps_log2), warp, warps, lane)) return;

  // C fragment: acc[t][r] is row g + 8 * (r / 2), token t * 8 + 2q + r % 2.
#pragma unroll
  for (int t = 0; t < NT; ++t)
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int n = r < 2 ? row0 : row1;
      const int m = t * 8 + 2 * q + (r & 1);
      if (n < N && m < M) {
        const float bv = bias != nullptr ? Fp<T>::to_float(bias[n]) : 0.f;
        out[static_cast<size_t>(m) * N + n] = Fp<T>::from_float(acc[t][r] + bv);
      }
    }
}

// Whether the two-tile a16 kernel reads x through the ring (kXRing). On an H100 it took 0.89-0.97x
// of the time without it at M = 12 and 16 on the layers with N > K or under 2^24 weights
// (1024->4096, 1024->6144, 2048->1024, 3072->1024, 4096->14336, 4096->28672) and 1.00-1.03x on
// 4096->4096 and 14336->4096 (results/h100/sweep_mma_ring{off,on}_*_97cf270.json, where every a16
// kernel took it; with one tile it cost up to 12% at M <= 5, so M <= 8 never takes it). As landed,
// 0.88-0.99x at M = 9..16 on those six (results/h100/sweep_mma_rule{on,off}_*_52c3c5a.json).
inline bool takes_x_ring(int M, int N, int K) {
  return M > 8 && !(N <= K && static_cast<int64_t>(N) * K >= (int64_t{1} << 24));
}

// Experiment: TERNOP_A16_SLAB=8 or 16 runs M above it (up to 64) as slabs of that many tokens along
// the grid's y, each CTA the one- or two-tile kernel on its own slab. 0 where it is unset.
int a16_slab() {
  const char* v = std::getenv("TERNOP_A16_SLAB");
  const int slab = v != nullptr ? std::atoi(v) : 0;
  return slab == 8 || slab == 16 ? slab : 0;
}

template <typename T, bool kA16>
cudaError_t launch_t(const void* x, const uint8_t* wp, const __half* ws, const void* bias, void* out, int M, int N,
                     int K, SmallMSplit split, bool deep, cudaStream_t stream) {
  const T* xt = static_cast<const T*>(x);
  const T* bt = static_cast<const T*>(bias);
  T* ot = static_cast<T*>(out);
  const int slab = a16_slab();
  const int slabs = slab > 0 && M > slab ? (M + slab - 1) / slab : 1;
  const int Mk = slabs > 1 ? slab : M;  // the tokens one CTA takes: what picks the kernel and sizes its x
  const dim3 grid((N + 16 * split.groups - 1) / (16 * split.groups), slabs);
  const dim3 block(32 * split.groups * split.warps_k);
  const int wl = split.warps_log2;
  if constexpr (kA16) {
    const size_t xs_bytes = static_cast<size_t>(Mk) * xs_stride(K) * sizeof(uint4);
    if (Mk <= 8 && split.groups >= 2 && xs_bytes <= kMaxXSmemBytes) {  // x in shared memory
      if (deep)
        ternary_mma_kernel<T, 1, true, kDeepDepth, kXShared><<<grid, block, xs_bytes, stream>>>(xt, wp, ws, bt, ot, M, N, K, wl);
      else
        ternary_mma_kernel<T, 1, true, kDepth, kXShared><<<grid, block, xs_bytes, stream>>>(xt, wp, ws, bt, ot, M, N, K, wl);
      return cudaGetLastError();
    }
    if (!deep && takes_x_ring(Mk, N, K)) {
      auto kernel = ternary_mma_kernel<T, 2, true, kDepth, kXRing>;
      const size_t bytes = ring_bytes(static_cast<int>(block.x / 32), kDepth, Mk);
      // Past the 48 KB a launch may take unasked; set on every launch (cheap, and per device).
      cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
      if (err != cudaSuccess) return err;
      kernel<<<grid, block, bytes, stream>>>(xt, wp, ws, bt, ot, M, N, K, wl);
      return cudaGetLastError();
    }
  }
  if (deep) {
    if constexpr (!kA16) {
      return cudaErrorInvalidValue;  // no v1 kernel at kDeepDepth; ternary_mma_takes_depth refuses it first
    } else if (Mk <= 8) {
      ternary_mma_kernel<T, 1, true, kDeepDepth><<<grid, block, 0, stream>>>(xt, wp, ws, bt, ot, M, N, K, wl);
    } else {
      ternary_mma_kernel<T, 2, true, kDeepDepth><<<grid, block, 0, stream>>>(xt, wp, ws, bt, ot, M, N, K, wl);
    }
  } else if (Mk <= 8) {
    ternary_mma_kernel<T, 1, kA16, kDepth><<<grid, block, 0, stream>>>(xt, wp, ws, bt, ot, M, N, K, wl);
  } else {
    ternary_mma_kernel<T, 2, kA16, kDepth><<<grid, block, 0, stream>>>(xt, wp, ws, bt, ot, M, N, K, wl);
  }
  return cudaGetLastError();
}

}  // namespace

// Largest M the kernel takes (two n8 tiles).
int ternary_mma_max_m() { return a16_slab() > 0 ? 64 : 16; }

// Whether launch_ternary_mma takes `depth` in the given layout.
bool ternary_mma_takes_depth(bool a16, int depth) {
  return depth <= 0 || depth == kDepth || (depth == kDeepDepth && a16);
}

// x: [M, K] row-major, dtype kFloat16 or kBFloat16; wp: uint8 [N, K/4] in format v1
// (a16 = false) or the a16 layout (a16 = true); ws: fp16 [N, K/128]; bias: [N] in x's dtype or
// nullptr; out: [M, N]. x and wp must be 16-byte aligned, K a multiple of 128, 1 <= M <= 16,
// N < 2^31 / 16. row_groups: sets of 16 rows per CTA (1, 2, 4 or 8), or <= 0 for the
// kernel's choice from the layer and `sms`, the device's multiprocessor count. depth: scale
// blocks of weight loads in flight per warp, kDepth (or <= 0, the kernel's choice: kDepth) or
// kDeepDepth, which takes only a16 weights (ternary_mma_takes_depth).
cudaError_t launch_ternary_mma(const void* x, int dtype, const uint8_t* wp, const __half* ws, const void* bias,
                               void* out, int M, int N, int K, bool a16, int row_groups, int depth, int sms,
                               cudaStream_t stream) {
  if (!valid_shape(M, ternary_mma_max_m(), N, K) || row_groups > kMaxWarps || !ternary_mma_takes_depth(a16, depth))
    return cudaErrorInvalidValue;
  const SmallMSplit split = small_m_split(N, K, sms, row_groups, kMaxWarps);
  const bool deep = depth == kDeepDepth;
  return dispatch_dtype</*kWithFp32=*/false>(dtype, [&](auto tag) {
    return a16 ? launch_t<decltype(tag), true>(x, wp, ws, bias, out, M, N, K, split, deep, stream)
               : launch_t<decltype(tag), false>(x, wp, ws, bias, out, M, N, K, split, deep, stream);
  });
}

}  // namespace ternop
