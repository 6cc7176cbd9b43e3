// Large-M W2A8 ternary linear with a scale per weight row on Hopper, both wgmma operands in shared
// memory:
//
//   out[m, n] = fp32(fp32(S[m, n]) * scale[n]) * s_x[m] (+ bias[n]),   S[m, n] = sum_k q[m, k] * v[n, k]
//
// exactly as ternop/activations.py has it (q int8 [M, K] and s_x fp32 [M] from the per-token
// quantization, S in int32). ternary_wgmma_a8.cu (read it first) decodes the weights into the
// register A operand of wgmma inside the warpgroups that issue the wgmmas, and each of them waits
// on its own wgmmas every block: its tensor pipe runs at about half of its peak at large M
// (docs/KERNELS.md). Here the decoding moves out of those warpgroups: producer warps decode each
// block's codes into a dense int8 weight tile in shared memory, in the 128-byte swizzle that TMA
// gives q's tile, and the two consumer warpgroups only issue wgmma m64nBTk32 s8 with both operands
// read by descriptor, one block's group left in flight while they wait for the next stage. That is
// the loop of a dense int8 GEMM, with the weights still read from memory as 2-bit codes and never
// written out dense.
//
// A CTA has 128 weight rows and BT tokens (128 or 256) and 384 threads:
// - the producer warpgroup (the decoders, 128 threads): waits for a stage's "loaded" barrier, turns
//   its 1024 code words (a word is 16 weights of a row) into 16 int8 values each, one PRMT per four
//   (the a8 layout's nibble trick, ternary_wgmma_a8.cu), stores them as 16-byte chunk `word` of the
//   row at chunk position word ^ (row % 8) (the 128-byte swizzle), makes the stores visible to the
//   tensor cores' proxy and arrives on "decoded". A decoder loads its eight words of a block before
//   it stores any (the compiler may not move a load past a store that could alias it).
// - warpgroups 1 and 2 (the consumers, 64 weight rows each): wait for "loaded" and "decoded", issue
//   the block's four wgmmas into int32 accumulators that run over all of K, commit, and once the
//   previous block's group has completed, release its stage ("empty"). The first wgmma of a tile
//   overwrites its accumulators (scale-d 0).
// - the loads: lane 0 of the first consumer warp loads q's tile [BT tokens x 128 bytes] and the
//   block's codes [128 rows x 32 bytes] by TMA onto the stage's "loaded" mbarrier, the first
//   kStages blocks before its loop and each later one once both warpgroups have released the stage
//   it goes to. Tokens past M and rows past N read as zero (a zero code is weight 0). A dedicated
//   loader warp would leave the decoding to three warps; Nsight Compute had the consumers waiting
//   on "decoded" for most of the loop with three (docs/KERNELS.md).
// The decoders keep 40 registers and give the rest to the consumers (232 each: 128 int32
// accumulators at 256 tokens).
//
// The epilogue scales each int32 sum once, in the spec's order, stages the tile in shared memory
// as [BT tokens x 128 rows] of the output dtype (16-bit outputs as packed pairs by stmatrix, which
// transposes the accumulators' fragments into that layout) and stores it in 16-byte pieces along
// each token's row. No split of K: the tile is meant for launches that fill the GPU.

#include "ternary_a16.cuh"  // smem_addr
#include "ternary_wgmma.cuh"

namespace ternop {

namespace {

constexpr uint32_t kTableSS = 0x00FF0100u;  // int8 value of code 0b00, 0b01, 0b10, 0b11
constexpr int kSSConsumers = 256;            // two consumer warpgroups, warps 4-11
constexpr int kSSDecoders = 128;             // the producer warpgroup, warps 0-3
constexpr int kSSThreads = kSSDecoders + kSSConsumers;
constexpr int kSSRows = 128;                 // weight rows of a CTA
constexpr int kDecodeWords = kSSRows * 8 / kSSDecoders;  // a decoder's code words a block (8 a row)
constexpr int kRowStep = kSSDecoders / 8;    // rows between them
static_assert(kRowStep % 8 == 0, "a decoder's words all take the same chunk position of the swizzle");
constexpr int kSSProducerRegs = 40;
constexpr int kSSConsumerRegs = 232;

// d[64 rows x BT tokens] (+)= A (s8 descriptor, 64 x 32) * B (s8 descriptor, 32 x BT), int32
// accumulate; d's layout is that of WgmmaS8 in ternary_wgmma_a8.cu.
template <int BT>
struct WgmmaS8SS;

#if TERNOP_HAS_WGMMA
template <>
struct WgmmaS8SS<128> {
  __device__ __forceinline__ static void run(uint32_t scale_d, int32_t (&d)[64], uint64_t a_desc, uint64_t b_desc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k32.s32.s8.s8 "
        "{"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,  "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31,  "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47,  "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
        "}, %64, %65, p;\n}\n"
        : TERNOP_S32_OUT64(d, 0)
        : "l"(a_desc), "l"(b_desc), "r"(scale_d));
  }
};

template <>
struct WgmmaS8SS<256> {
  __device__ __forceinline__ static void run(uint32_t scale_d, int32_t (&d)[128], uint64_t a_desc, uint64_t b_desc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k32.s32.s8.s8 "
        "{"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,  "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31,  "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47,  "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63,  "
        "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79,  "
        "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95,  "
        "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111,  "
        "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
        "}, %128, %129, p;\n}\n"
        : TERNOP_S32_OUT128(d)
        : "l"(a_desc), "l"(b_desc), "r"(scale_d));
  }
};
#else
template <int BT>
struct WgmmaS8SS {
  __device__ __forceinline__ static void run(uint32_t, int32_t (&)[BT / 2], uint64_t, uint64_t) { __trap(); }
};
#endif

template <int BT_, int kStages_>
struct SSTile {
  static constexpr int BT = BT_, kStages = kStages_;
  static constexpr int kQBytes = BT * 128;          // q's block: 128 int8 a token
  static constexpr int kWBytes = kSSRows * 128;     // the decoded weights: 128 int8 a row
  static constexpr int kCodeBytes = kSSRows * 32;   // the block's codes: 32 bytes a row
  static constexpr int kStageBytes = (kQBytes + kWBytes + kCodeBytes + 1023) / 1024 * 1024;
  static constexpr int kSmemBytes = kStages * kStageBytes + 1024;  // + slack to align the base to 1024
  static_assert(kSmemBytes <= 227 * 1024, "shared memory of one SM");
  static_assert(kQBytes % 1024 == 0 && kWBytes % 1024 == 0, "swizzle atoms start 1024-byte aligned");
};

using SSTile128 = SSTile<128, 6>;
using SSTile256 = SSTile<256, 4>;

__device__ __forceinline__ uint32_t quad_ss(uint32_t word, uint32_t shift) {
  uint32_t r;
  asm("prmt.b32 %0, %1, 0, %2;" : "=r"(r) : "r"(kTableSS), "r"((word >> shift) & 0x3333u));
  return r;
}

// Four 8 x 8 matrices of 16-bit values from their mma fragments (r[i]: matrix i), stored transposed:
// lane l gives the address of the 16 bytes that hold column l % 8 of matrix l / 8.
__device__ __forceinline__ void stmatrix_x4_trans(uint32_t addr, const uint32_t (&r)[4]) {
#if TERNOP_HAS_WGMMA
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(r[0]),
               "r"(r[1]), "r"(r[2]), "r"(r[3])
               : "memory");
#endif
}

// Generic-proxy stores to shared memory, made visible to the tensor cores' (async) proxy.
__device__ __forceinline__ void fence_proxy_async_smem() {
#if TERNOP_HAS_WGMMA
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
}

template <typename T, typename Cfg>
__global__ void __launch_bounds__(kSSThreads, 1)
    ternary_wgmma_a8_ss_kernel(const __grid_constant__ CUtensorMap q_map, const __grid_constant__ CUtensorMap c_map,
                               const float* __restrict__ qs, const __half* __restrict__ ws,
                               const T* __restrict__ bias, T* __restrict__ out, int M, int N, int K) {
#if !TERNOP_HAS_WGMMA
  __trap();  // not an sm_90a build: the registry never launches it
#endif
  constexpr int BT = Cfg::BT, kStages = Cfg::kStages, R = BT / 2;
  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw = smem_addr(smem_raw);
  const uint32_t base = (raw + 1023) & ~1023u;
  uint8_t* smem = smem_raw + (base - raw);
  __shared__ __align__(8) uint64_t bars[3 * kStages];  // loaded[s], decoded[s], empty[s]
  __shared__ __align__(8) float x_scales[BT];
  const uint32_t loaded0 = smem_addr(bars), decoded0 = loaded0 + 8 * kStages, empty0 = decoded0 + 8 * kStages;
  if (threadIdx.x == 0) {
#pragma unroll
    for (int s = 0; s < kStages; ++s) {
      mbar_init(loaded0 + 8 * s, 1);                    // the loader's expect_tx arrival
      mbar_init(decoded0 + 8 * s, kSSDecoders);         // one arrival a decoder thread
      mbar_init(empty0 + 8 * s, kSSConsumers / 32);     // one arrival a consumer warp
    }
    mbar_init_fence();
  }
  __syncthreads();

  const int n0 = blockIdx.x * kSSRows, m0 = blockIdx.y * BT;
  const int blocks = K / 128;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  if (warp < 4) {  // the decoders
    setmaxnreg_dec<kSSProducerRegs>();
    // Decoder thread t owns word t % 8 of rows t / 8 + 16 j: the swizzle puts all of them at the same
    // chunk position of their rows, so every address is a constant offset from one base. All of a
    // block's words are loaded before the first store, so the loads' latency overlaps (stores may
    // alias the loads for all the compiler knows).
    const int t = threadIdx.x;
    const int word = t & 7, row0 = t >> 3;
    uint8_t* const w0 = smem + Cfg::kQBytes + row0 * 128 + ((word ^ (row0 & 7)) << 4);
    const uint32_t* const c0 = reinterpret_cast<const uint32_t*>(smem + Cfg::kQBytes + Cfg::kWBytes) + t;
    for (int i = 0; i < blocks; ++i) {
      const int slot = i % kStages;
      mbar_wait(loaded0 + 8 * slot, (i / kStages) & 1);
      const int off = slot * Cfg::kStageBytes;
      uint32_t c[kDecodeWords];
#pragma unroll
      for (int j = 0; j < kDecodeWords; ++j) c[j] = c0[off / 4 + kSSDecoders * j];
#pragma unroll
      for (int j = 0; j < kDecodeWords; ++j) {
        uint4 v;
        v.x = quad_ss(c[j], 0);   // k 16 word + 0..3
        v.y = quad_ss(c[j], 2);   // 4..7
        v.z = quad_ss(c[j], 16);  // 8..11
        v.w = quad_ss(c[j], 18);  // 12..15
        *reinterpret_cast<uint4*>(w0 + off + kRowStep * 128 * j) = v;
      }
      fence_proxy_async_smem();
      mbar_arrive(decoded0 + 8 * slot);
    }
    return;
  }

  setmaxnreg_inc<kSSConsumerRegs>();
  const int cw = warp - 4;                 // consumer warp 0..7
  const int wg = cw / 4;                   // consumer warpgroup 0 or 1: weight rows 64 wg ..
  const int g = lane / 4, q = lane % 4;
  const int row = 16 * cw + g;             // this lane's rows of the CTA: row and row + 8
  // The epilogue's scales and bias, read before the main loop: the tile's token scales go to shared
  // memory (the named barrier after the loop orders them), each lane's two rows' to registers.
  const int ct = static_cast<int>(threadIdx.x) - 128;
  if (ct < BT) x_scales[ct] = qs[min(m0 + ct, M - 1)];
  float sw[2], bv[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int n = min(n0 + row + 8 * h, N - 1);
    sw[h] = __half2float(ws[n]);
    bv[h] = bias != nullptr ? Fp<T>::to_float(bias[n]) : 0.f;
  }
  // Block i's loads into its stage, once the stage's last block has been released.
  auto load_block = [&](int i) {
    const int slot = i % kStages;
    if (i >= kStages) mbar_wait(empty0 + 8 * slot, (i / kStages - 1) & 1);
    const uint32_t stage = base + slot * Cfg::kStageBytes, bar = loaded0 + 8 * slot;
    mbar_expect(bar, Cfg::kQBytes + Cfg::kCodeBytes);
    tma_load(stage, &q_map, i * 128, m0, bar);
    tma_load(stage + Cfg::kQBytes + Cfg::kWBytes, &c_map, i * 32, n0, bar);
  };
  const bool loader = cw == 0 && lane == 0;  // issues the loads: the first stages' now, the rest as they free
  if (loader)
    for (int i = 0; i < min(kStages, blocks); ++i) load_block(i);
  int32_t acc[R];
  for (int i = 0; i < blocks; ++i) {
    const int slot = i % kStages;
    const uint32_t parity = (i / kStages) & 1;
    mbar_wait(loaded0 + 8 * slot, parity);
    mbar_wait(decoded0 + 8 * slot, parity);
    const uint32_t stage = base + slot * Cfg::kStageBytes;
    const uint32_t a = stage + Cfg::kQBytes + wg * 64 * 128;
    wgmma_fence();
#pragma unroll
    for (int s = 0; s < 4; ++s) WgmmaS8SS<BT>::run(i > 0 || s > 0, acc, b_desc(a + s * 32), b_desc(stage + s * 32));
    wgmma_commit();
    wgmma_wait<1>();  // the previous block's wgmmas are done: its stage is free
    if (i > 0 && lane == 0) mbar_arrive(empty0 + 8 * ((i - 1) % kStages));
    if (loader && i > 0 && i - 1 + kStages < blocks) load_block(i - 1 + kStages);
  }
  wgmma_wait<0>();
  fence_acc(acc);

  // Every consumer is past its last wgmma: the stages become the output tile.
  asm volatile("bar.sync 1, %0;" ::"n"(kSSConsumers) : "memory");
  constexpr int kPitch = kSSRows * static_cast<int>(sizeof(T)) + 16;
  static_assert(BT * kPitch <= kStages * Cfg::kStageBytes, "the output tile fits in the stages");
  // Two roundings, as the spec has them (no contraction into one FMA).
  auto scaled = [&](int i, int h, float sx) {
    return __fadd_rn(__fmul_rn(__fmul_rn(static_cast<float>(acc[i]), sw[h]), sx), bv[h]);
  };
  if constexpr (sizeof(T) == 2) {
    // The accumulators of token group j (tokens 8 j ..) and row half h are the fragment of one 8 x 8
    // matrix [rows x tokens] as stmatrix takes it (lane g, q: row g, tokens 2q and 2q + 1 as one
    // packed pair). stmatrix .trans stores it as 8 tokens of 16 bytes (8 rows each), lanes 8 i ..
    // 8 i + 7 naming the tokens of matrix i: four matrices an instruction, groups j and j + 1 x
    // both halves. 272-byte pitch: the 8 tokens of a matrix start 4 banks apart.
    const int mi = lane / 8;
    const uint32_t st0 = base + (8 * (mi / 2) + lane % 8) * kPitch + (16 * cw + 8 * (mi % 2)) * 2;
#pragma unroll
    for (int j = 0; j < R / 4; j += 2) {
      uint32_t p[4];
#pragma unroll
      for (int jj = 0; jj < 2; ++jj) {
        const float2 sx2 = *reinterpret_cast<const float2*>(x_scales + 8 * (j + jj) + 2 * q);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int i = 4 * (j + jj) + 2 * h;
          p[2 * jj + h] = Fp<T>::pack2(scaled(i, h, sx2.x), scaled(i + 1, h, sx2.y));
        }
      }
      stmatrix_x4_trans(st0 + 8 * j * kPitch, p);
    }
  } else {
#pragma unroll
    for (int j = 0; j < R / 4; ++j) {
      const float2 sx2 = *reinterpret_cast<const float2*>(x_scales + 8 * j + 2 * q);
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int t = 8 * j + 2 * q + e;
#pragma unroll
        for (int h = 0; h < 2; ++h)
          reinterpret_cast<T*>(smem + t * kPitch)[row + 8 * h] = Fp<T>::from_float(scaled(4 * j + 2 * h + e, h, e ? sx2.y : sx2.x));
      }
    }
  }
  asm volatile("bar.sync 1, %0;" ::"n"(kSSConsumers) : "memory");
  copy_tile_out<T, BT, kSSRows, kPitch>(smem, out, m0, M, n0, N, ct, kSSConsumers);
}

template <typename T, typename Cfg>
cudaError_t launch_ss(const int8_t* q, const float* qs, const uint8_t* wp, const __half* ws, const T* bias, T* out,
                      int M, int N, int K, cudaStream_t stream) {
  auto kernel = ternary_wgmma_a8_ss_kernel<T, Cfg>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes);
  if (err != cudaSuccess) return err;
  CUtensorMap q_map, c_map;
  err = x_tensor_map(&q_map, q, K, M, K, Cfg::BT);
  if (err != cudaSuccess) return err;
  err = codes_tensor_map(&c_map, wp, N, K, kSSRows);
  if (err != cudaSuccess) return err;
  const dim3 grid((N + kSSRows - 1) / kSSRows, (M + Cfg::BT - 1) / Cfg::BT);
  kernel<<<grid, kSSThreads, Cfg::kSmemBytes, stream>>>(q_map, c_map, qs, ws, bias, out, M, N, K);
  return cudaGetLastError();
}

}  // namespace

// q int8 [M, K] contiguous, 16-byte aligned; qs fp32 [M]; wp uint8 [N, K/4] in the a8 layout,
// 16-byte aligned; ws fp16 [N, 1] (a scale per row); bias [N] in T or nullptr; out [M, N] in T.
// `tokens` 128 or 256: the CTA's token tile.
template <typename T>
cudaError_t launch_ternary_wgmma_a8_ss(const int8_t* q, const float* qs, const uint8_t* wp, const __half* ws,
                                       const T* bias, T* out, int M, int N, int K, int tokens, cudaStream_t stream) {
  return tokens == 256 ? launch_ss<T, SSTile256>(q, qs, wp, ws, bias, out, M, N, K, stream)
                       : launch_ss<T, SSTile128>(q, qs, wp, ws, bias, out, M, N, K, stream);
}

template cudaError_t launch_ternary_wgmma_a8_ss<__half>(const int8_t*, const float*, const uint8_t*, const __half*,
                                                        const __half*, __half*, int, int, int, int, cudaStream_t);
template cudaError_t launch_ternary_wgmma_a8_ss<__nv_bfloat16>(const int8_t*, const float*, const uint8_t*,
                                                               const __half*, const __nv_bfloat16*, __nv_bfloat16*,
                                                               int, int, int, int, cudaStream_t);
template cudaError_t launch_ternary_wgmma_a8_ss<float>(const int8_t*, const float*, const uint8_t*, const __half*,
                                                       const float*, float*, int, int, int, int, cudaStream_t);

}  // namespace ternop
