// Large-M W2A8 ternary linear on Hopper's int8 warpgroup tensor cores, weights in the "a8" layout:
//
//   out[m, n] = s_x[m] * sum_b P[m, n, b] * scale[n, b] (+ bias[n]),
//   P[m, n, b] = sum_{k in block b} q[m, k] * v[n, k]   (int32, exact)
//
// as in ternary_mma_a8.cu (q int8 [M, K] and s_x fp32 [M] from the per-token quantization,
// ternop/activations.py). Needs sm_90a; elsewhere the kernel traps and the registry never
// launches it. The structure is that of ternary_wgmma.cu (read it first): out^T = W q^T with
// the decoded weights as the register A operand of wgmma m64nBTk32 s8, q staged by TMA in the
// 128-byte swizzle (one 128-byte row a token is one scale block), the codes by cp.async, two
// warpgroups of 64 rows, kStages - 2 blocks ahead.
//
// Decoding. Lane (g, q) needs, of rows g and g + 8, the weights 4q..4q+3 and 16+4q..16+4q+3 of
// each 32-wide k step s (words 2s and 2s + 1 of the row's block), in natural k order: the a8
// layout holds them in the nibbles of the word shifted right by (0, 2, 16, 18)[q], and one
// PRMT into the table 0x00FF0100 = int8 (0, +1, -1, 0) turns four masked nibbles into four int8
// weights (three instructions a register of four weights).
//
// Block partials. A block runs as two token halves, each four wgmmas m64n(BT/2)k32 s8 that
// accumulate P exactly in int32 (the first overwrites, scale-d 0) into the half's own registers.
// The halves ping-pong: while one runs on the tensor cores, the warpgroup adds the other's
// P * scale[n, b] into the fp32 accumulators, in block order (fmaf, as ternary_mma_a8.cu does).
// P becomes fp32 by the exponent trick (an integer add and a float add, exact for |P| < 2^22),
// not by a conversion instruction, whose throughput is a fraction of the adders'. The first version
// drained each block before scaling it and converted with I2F; it ran at 0.55-0.78x of cuBLAS
// bf16 (KERNELS.md).
// The epilogue multiplies by s_x[m] and then adds the bias, two fp32 roundings as in the spec.
// No split-K: narrow layers at small M leave SMs idle here.

#include "ternary_a16.cuh"  // smem_addr, cp.async
#include "ternary_wgmma.cuh"

namespace ternop {

namespace {

constexpr int kCodeRowBytesA8 = 48;  // shared-memory stride of one row's 32 code bytes
constexpr int kThreadsA8 = 256;      // two warpgroups
constexpr int kRowsA8 = 128;         // weight rows of a CTA
constexpr uint32_t kTableA8 = 0x00FF0100u;  // int8 value of code 0b00, 0b01, 0b10, 0b11

// d[64 rows x BT tokens] = A (s8 registers, 64 x 32) * B (s8 descriptor, 32 x BT) (+ d when
// scale_d != 0), int32 accumulate; d's layout is that of the fp32 Wgmma of ternary_wgmma.cu.
template <int BT>
struct WgmmaS8;

#if TERNOP_HAS_WGMMA
template <>
struct WgmmaS8<64> {
  __device__ __forceinline__ static void run(uint32_t scale_d, int32_t (&d)[32], const uint32_t (&a)[4], uint64_t desc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k32.s32.s8.s8 "
        "{"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
        "}, {%32, %33, %34, %35}, %36, p;\n}\n"
        : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3]), "+r"(d[4]), "+r"(d[5]), "+r"(d[6]), "+r"(d[7]),
          "+r"(d[8]), "+r"(d[9]), "+r"(d[10]), "+r"(d[11]), "+r"(d[12]), "+r"(d[13]), "+r"(d[14]), "+r"(d[15]),
          "+r"(d[16]), "+r"(d[17]), "+r"(d[18]), "+r"(d[19]), "+r"(d[20]), "+r"(d[21]), "+r"(d[22]), "+r"(d[23]),
          "+r"(d[24]), "+r"(d[25]), "+r"(d[26]), "+r"(d[27]), "+r"(d[28]), "+r"(d[29]), "+r"(d[30]), "+r"(d[31])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(scale_d));
  }
};

template <>
struct WgmmaS8<32> {
  __device__ __forceinline__ static void run(uint32_t scale_d, int32_t (&d)[16], const uint32_t (&a)[4], uint64_t desc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k32.s32.s8.s8 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "
        "{%16, %17, %18, %19}, %20, p;\n}\n"
        : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3]), "+r"(d[4]), "+r"(d[5]), "+r"(d[6]), "+r"(d[7]),
          "+r"(d[8]), "+r"(d[9]), "+r"(d[10]), "+r"(d[11]), "+r"(d[12]), "+r"(d[13]), "+r"(d[14]), "+r"(d[15])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(scale_d));
  }
};

#else
template <int BT>
struct WgmmaS8 {
  __device__ __forceinline__ static void run(uint32_t, int32_t (&)[BT / 2], const uint32_t (&)[4], uint64_t) {
    __trap();
  }
};
#endif

template <int BT_, int kStages_>
struct A8Tile {
  static constexpr int BT = BT_, kStages = kStages_;
  static constexpr int kXBytes = BT * 128;  // one block of q: 128 int8 a token
  static constexpr int kWBytes = kRowsA8 * kCodeRowBytesA8;
  static constexpr int kStageBytes = (kXBytes + kWBytes + 1023) / 1024 * 1024;
  static constexpr int kSmemBytes = kStages * kStageBytes + 1024;
  static_assert(kStages >= 3, "a slot is refilled two blocks after its use");
  static_assert(kSmemBytes <= 227 * 1024, "shared memory of one SM");
};

// Four int8 weights of a word of codes: the nibbles of (word >> shift) masked to codes, as byte
// selectors into the value table.
__device__ __forceinline__ uint32_t quad_a8(uint32_t word, uint32_t shift) {
  uint32_t r;
  asm("prmt.b32 %0, %1, 0, %2;" : "=r"(r) : "r"(kTableA8), "r"((word >> shift) & 0x3333u));
  return r;
}

template <typename Cfg>
__device__ __forceinline__ void load_stage_a8(uint32_t stage, uint32_t bar, const CUtensorMap* q_map, int m0,
                                              const uint8_t* __restrict__ wp, int64_t row_bytes, int n0, int N, int kb) {
  if (threadIdx.x == 0) {
    mbar_expect(bar, Cfg::kXBytes);
    tma_load(stage, q_map, kb * 128, m0, bar);
  }
  const int r = threadIdx.x / 2, half = threadIdx.x % 2;
  const int n = min(n0 + r, N - 1);
  cp_async16(stage + Cfg::kXBytes + r * kCodeRowBytesA8 + half * 16, wp + n * row_bytes + kb * 32 + half * 16);
}

// The ping-pong state of one warpgroup's thread: fp32 accumulators of the whole tile and the
// int32 partials of its two token halves (Cfg::BT / 2 tokens each).
template <typename Cfg>
struct A8Acc {
  static constexpr int R = Cfg::BT / 2, H = R / 2;  // registers: tile, one half
  float acc[R];
  int32_t part[2][H];
};

// A block's 32 code bytes of this lane's rows (row, row + 8), decoded into the A fragments of its
// four 32-wide k steps.
__device__ __forceinline__ void decode_block_a8(const uint8_t* codes, uint32_t shift, uint32_t (&a)[4][4]) {
  const uint4 w0a = *reinterpret_cast<const uint4*>(codes);
  const uint4 w0b = *reinterpret_cast<const uint4*>(codes + 16);
  const uint4 w1a = *reinterpret_cast<const uint4*>(codes + 8 * kCodeRowBytesA8);
  const uint4 w1b = *reinterpret_cast<const uint4*>(codes + 8 * kCodeRowBytesA8 + 16);
  const uint32_t w0[8] = {w0a.x, w0a.y, w0a.z, w0a.w, w0b.x, w0b.y, w0b.z, w0b.w};
  const uint32_t w1[8] = {w1a.x, w1a.y, w1a.z, w1a.w, w1b.x, w1b.y, w1b.z, w1b.w};
#pragma unroll
  for (int s = 0; s < 4; ++s) {
    a[s][0] = quad_a8(w0[2 * s], shift);      // row g,     k 32s + 4q..4q+3
    a[s][1] = quad_a8(w1[2 * s], shift);      // row g + 8
    a[s][2] = quad_a8(w0[2 * s + 1], shift);  // row g,     k 32s + 16 + 4q..
    a[s][3] = quad_a8(w1[2 * s + 1], shift);  // row g + 8
  }
}

// Token half `h` of a block: four wgmmas into its int32 partials (the first overwrites them),
// committed as one group. The half's tokens start 64 h rows into the swizzled tile of q.
template <typename Cfg, int h>
__device__ __forceinline__ void issue_half_a8(A8Acc<Cfg>& st, const uint32_t (&a)[4][4], uint32_t stage) {
  constexpr int HT = Cfg::BT / 2;
  wgmma_fence();
#pragma unroll
  for (int s = 0; s < 4; ++s) WgmmaS8<HT>::run(s > 0, st.part[h], a[s], b_desc(stage + h * HT * 128 + s * 32));
  wgmma_commit();
}

// acc += P * scale in block order for half h, once its group has completed. P (|P| <= 127 * 128)
// becomes fp32 exactly through the exponent trick (bits of 1.5 * 2^23 + P, minus 1.5 * 2^23):
// an integer add and a float add instead of a low-throughput conversion.
template <typename Cfg, int h>
__device__ __forceinline__ void scale_half_a8(A8Acc<Cfg>& st, float s0, float s1) {
  constexpr int H = A8Acc<Cfg>::H;
  fence_acc(st.part[h]);
  // part[h][4j + r] is row g + 8 (r / 2), token (BT / 2) h + 8j + 2q + r % 2: scale s0 for r < 2, s1 otherwise.
#pragma unroll
  for (int i = 0; i < H; ++i) {
    const float p = __int_as_float(st.part[h][i] + 0x4B400000) - 12582912.0f;
    st.acc[h * H + i] = fmaf(p, (i & 2) ? s1 : s0, st.acc[h * H + i]);
  }
}

template <typename T, typename Cfg>
__global__ void __launch_bounds__(kThreadsA8, 1)
    ternary_wgmma_a8_kernel(const __grid_constant__ CUtensorMap q_map, const float* __restrict__ qs,
                            const uint8_t* __restrict__ wp, const __half* __restrict__ ws, const T* __restrict__ bias,
                            T* __restrict__ out, int M, int N, int K) {
#if !TERNOP_HAS_WGMMA
  __trap();  // not an sm_90a build: the registry never launches it
#endif
  constexpr int BT = Cfg::BT, kStages = Cfg::kStages;
  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw = smem_addr(smem_raw);
  const uint32_t base = (raw + 1023) & ~1023u;
  const uint8_t* smem = smem_raw + (base - raw);
  __shared__ __align__(8) uint64_t bars[kStages];
  const uint32_t bar0 = smem_addr(bars);
  if (threadIdx.x == 0) {
#pragma unroll
    for (int s = 0; s < kStages; ++s) mbar_init(bar0 + 8 * s);
    mbar_init_fence();
  }
  __syncthreads();

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, q = lane % 4;
  const int row = 16 * warp + g;  // this lane's rows of the CTA: row and row + 8
  const int n0 = blockIdx.x * kRowsA8, m0 = blockIdx.y * BT;
  const int blocks = K / 128;
  const int64_t row_bytes = K / 4;
  const uint32_t shift = (q & 1) * 2 + (q >> 1) * 16;  // 0, 2, 16, 18
  const __half* sc0p = ws + static_cast<int64_t>(min(n0 + row, N - 1)) * blocks;
  const __half* sc1p = ws + static_cast<int64_t>(min(n0 + row + 8, N - 1)) * blocks;

  A8Acc<Cfg> st;
#pragma unroll
  for (int i = 0; i < A8Acc<Cfg>::R; ++i) st.acc[i] = 0.f;

#pragma unroll
  for (int s = 0; s < kStages - 2; ++s) {
    if (s < blocks) load_stage_a8<Cfg>(base + s * Cfg::kStageBytes, bar0 + 8 * s, &q_map, m0, wp, row_bytes, n0, N, s);
    cp_async_commit();
  }
  auto stage_of = [&](int i) { return base + (i % kStages) * Cfg::kStageBytes; };
  // Block i has landed for every thread; the slot of block i - 2 is free everywhere, and takes
  // block i + kStages - 2.
  auto arrive = [&](int i) {
    cp_async_wait<kStages - 3>();
    mbar_wait(bar0 + 8 * (i % kStages), (i / kStages) & 1);
    __syncthreads();
    const int next = i + kStages - 2;
    if (next < blocks)
      load_stage_a8<Cfg>(stage_of(next), bar0 + 8 * (next % kStages), &q_map, m0, wp, row_bytes, n0, N, next);
    cp_async_commit();
  };
  auto codes_of = [&](int i) { return smem + (stage_of(i) - base) + Cfg::kXBytes + row * kCodeRowBytesA8; };

  // Ping-pong: while half 0 of block i is scaled, half 1 runs on the tensor cores; while half 1
  // is scaled, half 0 of block i + 1 does. The A fragments alternate between two register sets
  // (a block's stay untouched until both its halves complete), so the loop goes two blocks a turn.
  // Ping-pong over the two token halves: while one half's group runs on the tensor cores, the
  // other half's partials are scaled. A step (block i, its A fragments decoded):
  //   issue half 0 of block i;  scale half 1 of block i - 1 (zero partials before block 0);
  //   issue half 1 of block i;  wait for half 0, scale it;
  //   block i + 1 arrives and is decoded into the other register set;  wait for half 1.
  // Nothing is in flight from one step to the next: ptxas keeps the wgmmas asynchronous only when
  // every read of partials follows a wait on a group issued in the same loop turn.
  uint32_t a[2][4][4];
#pragma unroll
  for (int i = 0; i < A8Acc<Cfg>::H; ++i) st.part[1][i] = 0;
  float p0 = 0.f, p1 = 0.f;  // the scales of the block whose half 1 waits to be scaled
  auto step = [&](int i, const uint32_t(&a_cur)[4][4], uint32_t(&a_next)[4][4]) {
    wgmma_wait<0>();  // nothing is in flight here; the wait tells ptxas so
    issue_half_a8<Cfg, 0>(st, a_cur, stage_of(i));
    scale_half_a8<Cfg, 1>(st, p0, p1);
    issue_half_a8<Cfg, 1>(st, a_cur, stage_of(i));
    p0 = __half2float(sc0p[i]);
    p1 = __half2float(sc1p[i]);
    wgmma_wait<1>();
    scale_half_a8<Cfg, 0>(st, p0, p1);
    if (i + 1 < blocks) {
      arrive(i + 1);
      decode_block_a8(codes_of(i + 1), shift, a_next);
    }
    wgmma_wait<0>();
  };
  arrive(0);
  decode_block_a8(codes_of(0), shift, a[0]);
  for (int i = 0; i < blocks; i += 2) {
    step(i, a[0], a[1]);
    if (i + 1 < blocks) step(i + 1, a[1], a[0]);
  }
  scale_half_a8<Cfg, 1>(st, p0, p1);
  cp_async_wait<0>();

  // acc[4j + r] is row n0 + row + 8 (r / 2), token m0 + 8j + 2q + r % 2 (half j / (BT / 16)).
#pragma unroll
  for (int j = 0; j < A8Acc<Cfg>::R / 4; ++j)
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int n = n0 + row + 8 * (r / 2);
      const int m = m0 + 8 * j + 2 * q + (r & 1);
      if (n < N && m < M) {
        const float bv = bias != nullptr ? Fp<T>::to_float(bias[n]) : 0.f;
        // Two roundings, as the spec has them (no contraction into one FMA).
        out[static_cast<int64_t>(m) * N + n] = Fp<T>::from_float(__fadd_rn(__fmul_rn(st.acc[4 * j + r], qs[m]), bv));
      }
    }
}

using A8Tile0 = A8Tile<64, 8>;
using A8Tile1 = A8Tile<128, 6>;
constexpr int kA8Tiles = 2;
constexpr int kA8Tokens[kA8Tiles] = {A8Tile0::BT, A8Tile1::BT};

template <typename T, typename Cfg>
cudaError_t launch_wgmma_a8(const int8_t* q, const float* qs, const uint8_t* wp, const __half* ws, const T* bias,
                            T* out, int M, int N, int K, cudaStream_t stream) {
  auto kernel = ternary_wgmma_a8_kernel<T, Cfg>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes);
  if (err != cudaSuccess) return err;
  CUtensorMap q_map;
  err = x_tensor_map(&q_map, q, K, M, K, Cfg::BT);
  if (err != cudaSuccess) return err;
  const dim3 grid((N + kRowsA8 - 1) / kRowsA8, (M + Cfg::BT - 1) / Cfg::BT);
  kernel<<<grid, kThreadsA8, Cfg::kSmemBytes, stream>>>(q_map, qs, wp, ws, bias, out, M, N, K);
  return cudaGetLastError();
}

}  // namespace

// The tile a call runs: `tile` when it names one (0: 64 tokens, 1: 128), else 128 tokens where
// its CTAs fill the GPU, 64 where they do not.
int ternary_wgmma_a8_tile(int M, int N, int sms, int tile) {
  if (tile >= 0 && tile < kA8Tiles) return tile;
  const int64_t ctas = static_cast<int64_t>((N + kRowsA8 - 1) / kRowsA8) * ((M + kA8Tokens[1] - 1) / kA8Tokens[1]);
  return ctas >= sms ? 1 : 0;
}

// q int8 [M, K] contiguous, 16-byte aligned; qs fp32 [M]; wp uint8 [N, K/4] in the a8 layout;
// ws fp16 [N, K/128]; bias [N] in the output dtype or nullptr; out [M, N] in `out_dtype`.
cudaError_t launch_ternary_wgmma_a8(const int8_t* q, const float* qs, int out_dtype, const uint8_t* wp,
                                    const __half* ws, const void* bias, void* out, int M, int N, int K, int tile,
                                    int sms, cudaStream_t stream) {
  if (M < 1 || N < 1 || K < 128 || K % 128) return cudaErrorInvalidValue;
  if (reinterpret_cast<uintptr_t>(q) % 16) return cudaErrorInvalidValue;  // the tensor map's base
  return dispatch_dtype</*kWithFp32=*/true>(out_dtype, [&](auto tag) {
    using T = decltype(tag);
    const T* bt = static_cast<const T*>(bias);
    T* ot = static_cast<T*>(out);
    if (ternary_wgmma_a8_tile(M, N, sms, tile) == 0)
      return launch_wgmma_a8<T, A8Tile0>(q, qs, wp, ws, bt, ot, M, N, K, stream);
    return launch_wgmma_a8<T, A8Tile1>(q, qs, wp, ws, bt, ot, M, N, K, stream);
  });
}

}  // namespace ternop
