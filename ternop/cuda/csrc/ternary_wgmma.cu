// Ternary linear on Hopper's warpgroup tensor cores: out[m, n] = sum_k x[m, k] * W[n, k] (+ bias[n])
// for the M that ternop/cuda/configs.py gives it (from 9 on wide layers, 17 or 33 on others; any M
// runs), x fp16 or bf16, weights in the "a16" layout (ternop/layouts.py). Needs sm_90a (wgmma);
// cuda_ext.py builds for it on a compute-capability 9.0 GPU, and elsewhere the kernel body is a
// trap that the registry never launches. No dense copy of W is written: each weight is decoded
// once per CTA, in registers.
//
// Orientation. The problem runs transposed, out^T = W x^T, so that the weights are the wgmma's A
// operand, which may come from registers: one wgmma m64nBTk16 multiplies A = 64 weight rows x 16 k
// (decoded by the warpgroup, each warp its 16 rows, in the m16n8k16 A-fragment layout that
// ternary_mma_tiles.cu documents) by B = 16 k x BT tokens, read by the tensor cores straight from
// shared memory through a matrix descriptor, into fp32 [64 rows x BT tokens] in registers.
// The decoding (a16 fields to v, times the block's scale in x's dtype, exact) is that of
// ternary_mma_tiles.cu, shared through ternary_a16.cuh.
//
// CTA. Two warpgroups, each MT m64 tiles of weight rows, x BT tokens; both read the same x tile.
// Per 128-wide scale block, the CTA stages x [BT x 128] (the tensor-memory-access unit, TMA, from
// a tensor map: one thread issues it, and an mbarrier a slot says when it has landed) and the
// codes [rows x 32 bytes] (cp.async) in shared memory, kStages - 2 blocks ahead: a slot is
// refilled two blocks after its last wgmma was issued, by which time every warpgroup has waited
// for it (wait_group after each wgmma, then the barrier at the top of the block), so no drain is
// needed between blocks. The other tiles run warp-specialised instead: a producer warp (64-token
// tiles 0 and 3) or warpgroup (tiles 1, 2 and 4) loads, and the kernel's comment says how.
//
// x in shared memory, as the descriptor reads it. Each half (k 0..63, 64..127) of a block is BT
// rows of 128 bytes, one per token (K-major B), in the 128-byte swizzle: 16-byte chunk c of
// token r sits at chunk c ^ (r % 8) of its row, rows of eight tokens form 1024-byte atoms
// (the descriptor's stride), and every half starts 1024-byte aligned. Stepping k by 16 inside a
// half adds 32 bytes to the descriptor's start address; the hardware applies the swizzle to the
// address it forms. TMA writes exactly this layout (SWIZZLE_128B, boxes of 64 k x BT tokens; a
// short last tile loads boxes of its own tokens only, x_tile_map). The first sweeps staged x with
// cp.async from every thread instead and ran at 0.45-0.7x of cuBLAS at large M whatever the rows
// per CTA or the wgmma depth.
//
// Pipelining inside a block. The A fragments cycle through kDepth register sets: the warpgroup
// decodes step s + 1 while the wgmmas of up to kDepth - 1 earlier steps run; wait_group
// kDepth - 1 after each commit frees the set that the next step overwrites.
//
// Split-K. When the output tiles cannot fill the GPU (narrow layers, small M), the S CTAs of an
// output tile take ranges of scale blocks (blockIdx.z). Where the device can run all of them at
// once as clusters of S CTAs, each cluster is one output tile: each CTA leaves its fp32 sums in
// its shared memory, and after a cluster barrier each adds 1/S of the tile's tokens over the S
// CTAs' shared memory (distributed shared memory), in rank order, and stores them
// (cluster_reduce_store): no fp32 partials in global memory, no second kernel. Elsewhere (S = 16,
// or GPCs too small for that many clusters) they write fp32 partials [S, M, N] and
// split_k_reduce_kernel adds them in the same order.
//
// Epilogue. The accumulators (plus the bias) go through the freed stages as a [tokens x rows]
// tile and leave in 16-byte stores along each token's row (store_tile).
//
// Tokens past M read as zero (TMA) and rows past N read the last row's codes; their outputs are
// never written.

#include <atomic>

#include "ternary_a16.cuh"
#include "ternary_wgmma.cuh"

namespace ternop {

namespace {

constexpr int kCodeRowBytes = 48;  // shared-memory stride of one row's 32 code bytes (no bank conflicts)
constexpr int kGroups = 2;         // warpgroups of a CTA
constexpr int kThreads = 128 * kGroups;

// d[64 rows x BT tokens] = A (registers, 64 x 16) * B (descriptor, 16 x BT) (+ d when scale_d != 0),
// fp32 accumulate.
// Per warp w, d[4j + r] is row 16w + g + 8 (r / 2), token 8j + 2q + r % 2 (g = lane / 4, q = lane % 4).
template <typename T, int BT>
struct Wgmma;

#if TERNOP_HAS_WGMMA
// The fp16 and bf16 forms of a size differ only in the operand type of the instruction, so each
// size is written once, as a macro, and instantiated for both.
#define TERNOP_WGMMA_8(T, AB) \
template <> \
struct Wgmma<T, 8> { \
  __device__ __forceinline__ static void run(uint32_t scale_d, float (&d)[4], const uint32_t (&a)[4], uint64_t desc) { \
    asm volatile( \
        "{\n.reg .pred p;\nsetp.ne.b32 p, %9, 0;\n" \
        "wgmma.mma_async.sync.aligned.m64n8k16.f32." AB "." AB " " \
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, %8, p, 1, 1, 0;\n}\n" \
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]) \
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(scale_d)); \
  } \
};
TERNOP_WGMMA_8(__half, "f16")
TERNOP_WGMMA_8(__nv_bfloat16, "bf16")
#undef TERNOP_WGMMA_8

#define TERNOP_WGMMA_16(T, AB) \
template <> \
struct Wgmma<T, 16> { \
  __device__ __forceinline__ static void run(uint32_t scale_d, float (&d)[8], const uint32_t (&a)[4], uint64_t desc) { \
    asm volatile( \
        "{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\n" \
        "wgmma.mma_async.sync.aligned.m64n16k16.f32." AB "." AB " " \
        "{%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9, %10, %11}, %12, p, 1, 1, 0;\n}\n" \
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]) \
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(scale_d)); \
  } \
};
TERNOP_WGMMA_16(__half, "f16")
TERNOP_WGMMA_16(__nv_bfloat16, "bf16")
#undef TERNOP_WGMMA_16

#define TERNOP_WGMMA_32(T, AB) \
template <> \
struct Wgmma<T, 32> { \
  __device__ __forceinline__ static void run(uint32_t scale_d, float (&d)[16], const uint32_t (&a)[4], uint64_t desc) { \
    asm volatile( \
        "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n" \
        "wgmma.mma_async.sync.aligned.m64n32k16.f32." AB "." AB " " \
        "{" \
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15" \
        "}, {%16, %17, %18, %19}, %20, p, 1, 1, 0;\n}\n" \
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]) \
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(scale_d)); \
  } \
};
TERNOP_WGMMA_32(__half, "f16")
TERNOP_WGMMA_32(__nv_bfloat16, "bf16")
#undef TERNOP_WGMMA_32

#define TERNOP_WGMMA_64(T, AB) \
template <> \
struct Wgmma<T, 64> { \
  __device__ __forceinline__ static void run(uint32_t scale_d, float (&d)[32], const uint32_t (&a)[4], uint64_t desc) { \
    asm volatile( \
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n" \
        "wgmma.mma_async.sync.aligned.m64n64k16.f32." AB "." AB " " \
        "{" \
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31" \
        "}, {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n" \
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]) \
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(scale_d)); \
  } \
};
TERNOP_WGMMA_64(__half, "f16")
TERNOP_WGMMA_64(__nv_bfloat16, "bf16")
#undef TERNOP_WGMMA_64

#define TERNOP_WGMMA_128(T, AB) \
template <> \
struct Wgmma<T, 128> { \
  __device__ __forceinline__ static void run(uint32_t scale_d, float (&d)[64], const uint32_t (&a)[4], uint64_t desc) { \
    asm volatile( \
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n" \
        "wgmma.mma_async.sync.aligned.m64n128k16.f32." AB "." AB " " \
        "{" \
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63" \
        "}, {%64, %65, %66, %67}, %68, p, 1, 1, 0;\n}\n" \
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]) \
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(scale_d)); \
  } \
};
TERNOP_WGMMA_128(__half, "f16")
TERNOP_WGMMA_128(__nv_bfloat16, "bf16")
#undef TERNOP_WGMMA_128

#define TERNOP_WGMMA_256(T, AB) \
template <> \
struct Wgmma<T, 256> { \
  __device__ __forceinline__ static void run(uint32_t scale_d, float (&d)[128], const uint32_t (&a)[4], uint64_t desc) { \
    asm volatile( \
        "{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n" \
        "wgmma.mma_async.sync.aligned.m64n256k16.f32." AB "." AB " " \
        "{" \
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, " \
        "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, " \
        "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, " \
        "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, " \
        "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127" \
        "}, {%128, %129, %130, %131}, %132, p, 1, 1, 0;\n}\n" \
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), \
          "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), \
          "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), \
          "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), \
          "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), \
          "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), \
          "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), \
          "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), \
          "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127]) \
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(scale_d)); \
  } \
};
TERNOP_WGMMA_256(__half, "f16")
TERNOP_WGMMA_256(__nv_bfloat16, "bf16")
#undef TERNOP_WGMMA_256
#else
template <typename T, int BT>
struct Wgmma {
  __device__ __forceinline__ static void run(uint32_t, float (&)[BT / 2], const uint32_t (&)[4], uint64_t) { __trap(); }
};
#endif

// kProducerWarps_: 0, every thread loads; 1, a producer warp loads and the warpgroups compute
// (warp-specialised); 4, a producer warpgroup loads and gives its registers to the two that compute.
// kCtasPerSm_: CTAs an SM must hold at once (registers are capped to fit them; the splits of K
// count that many per SM).
template <int BT_, int MT_, int kStages_, int kDepth_, int kProducerWarps_ = 0, int kCtasPerSm_ = 1>
struct WgTile {
  static constexpr int BT = BT_, MT = MT_, kStages = kStages_, kDepth = kDepth_;
  static constexpr int kProducerWarps = kProducerWarps_, kCtasPerSm = kCtasPerSm_;
  static constexpr bool kWS = kProducerWarps > 0;  // warp-specialised
  static constexpr bool kRegShift = kProducerWarps == 4;  // registers move to the computing warpgroups
  static constexpr int kBlockThreads = kThreads + 32 * kProducerWarps;
  // Threads that store the output tile: a producer warpgroup has left by then.
  static constexpr int kEpilogueThreads = kRegShift ? kThreads : kBlockThreads;
  static constexpr int kRows = 64 * MT * kGroups;  // weight rows of the CTA: MT m64 tiles a warpgroup
  static constexpr int kXHalfBytes = BT * 128;
  static constexpr int kXBytes = 2 * kXHalfBytes;
  // A row's 32 code bytes: padded for cp.async, dense as the tensor-memory-access unit writes them.
  static constexpr int kCodePitch = kWS ? 32 : kCodeRowBytes;
  static constexpr int kWBytes = kRows * kCodePitch;
  static constexpr int kStageBytes = (kXBytes + kWBytes + 1023) / 1024 * 1024;
  static constexpr int kSmemBytes = kStages * kStageBytes + 1024;  // + slack to align the base to 1024
  static_assert(kStages >= 3, "a slot is refilled two blocks after its use");
  static_assert(8 % kDepth == 0 && kDepth >= 2, "A register sets cycle within a block's eight k16 steps");
  static_assert(kRows * 2 % kThreads == 0, "whole 16-byte chunks of codes per thread");
  static_assert(kCtasPerSm * kSmemBytes <= 227 * 1024, "shared memory of one SM");
  static_assert(kProducerWarps == 0 || kProducerWarps == 1 || kProducerWarps == 4, "a warp or a warpgroup");
};

// The register split of a CTA of 384 threads (65536 registers, 168 a thread at launch): the
// producer warpgroup keeps 40, the two computing warpgroups take 232 (128 x 40 + 256 x 232 = 64512).
constexpr int kProducerRegs = 40;
constexpr int kConsumerRegs = 232;

// The tensor map a token tile loads x through, and the bytes a block of it brings: a short last
// tile (M % BT tokens) has its own map, whose boxes hold exactly its tokens. Through the full map
// the tensor-memory-access unit would zero-fill the rest of each box; the sweep at b3b2dec
// (results/h100/sweep_a16_b3b2dec.json) had such tiles slower than full ones on the same grid
// (4096->14336: 52.2 us at M = 160, 44.1 us at 192); with this map such tiles took 0.72-0.91 of
// their time (results/h200/ab_x_tail_summary_dbf36d5.log). The stage rows past M keep stale data;
// they feed only the accumulators of tokens past M, which no store writes.
template <typename Cfg>
__device__ __forceinline__ const CUtensorMap* x_tile_map(const CUtensorMap* x_map, const CUtensorMap* x_tail_map,
                                                         int m0, int M, int& x_bytes) {
  const int tokens = min(Cfg::BT, M - m0);
  x_bytes = 2 * 128 * tokens;
  return tokens < Cfg::BT ? x_tail_map : x_map;
}

// Issues the loads of scale block kb into a stage: x [BT x 128] as two boxes of the tensor map
// (thread 0; the tensor-memory-access unit swizzles them), and the codes [kRows x 32 bytes] with
// cp.async (every thread). x_map is the tile's map (x_tile_map), x_bytes the bytes its two boxes hold.
template <typename Cfg>
__device__ __forceinline__ void load_stage(uint32_t stage, uint32_t bar, const CUtensorMap* x_map, int x_bytes,
                                           int m0, const uint8_t* __restrict__ wp, int64_t row_bytes, int n0, int N,
                                           int kb) {
  if (threadIdx.x == 0) {
    mbar_expect(bar, x_bytes);
    tma_load(stage, x_map, kb * 256, m0, bar);  // bytes: 128 k of 2 bytes a block
    tma_load(stage + Cfg::kXHalfBytes, x_map, kb * 256 + 128, m0, bar);
  }
#pragma unroll
  for (int j = 0; j < Cfg::kRows * 2 / kThreads; ++j) {
    const int c = threadIdx.x + j * kThreads;
    const int r = c / 2, half = c % 2;
    const int n = min(n0 + r, N - 1);
    cp_async16(stage + Cfg::kXBytes + r * Cfg::kCodePitch + half * 16, wp + n * row_bytes + kb * 32 + half * 16);
  }
}

// The epilogue: the CTA's accumulators (plus the bias, for a final output) go through shared
// memory as a [BT tokens x kRows rows] tile of E (x's dtype, or fp32 for a split of K), so that
// they leave in 16-byte stores along each token's row of dst [M, N] instead of scattered 2-byte
// ones. Rows are padded by 16 bytes: the fragment writes fall in distinct banks.
template <typename E, typename Cfg>
constexpr int kTilePitch = Cfg::kRows * static_cast<int>(sizeof(E)) + 16;

template <typename E, typename Cfg, typename T, int R>
__device__ __forceinline__ void stage_tile(uint8_t* tile, const float (&acc)[Cfg::MT][R], const int (&row)[Cfg::MT],
                                           int q, const T* __restrict__ bias, int n0, int N) {
  constexpr int kPitch = kTilePitch<E, Cfg>;
  static_assert(Cfg::BT * kPitch <= Cfg::kStages * Cfg::kStageBytes, "the output tile fits in the stages");
#pragma unroll
  for (int mt = 0; mt < Cfg::MT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int c = row[mt] + 8 * h;
      float bv = 0.f;
      if constexpr (!std::is_same_v<E, float>) {
        if (bias != nullptr) bv = Fp<T>::to_float(bias[min(n0 + c, N - 1)]);
      }
#pragma unroll
      for (int j = 0; j < R / 4; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float v = acc[mt][4 * j + 2 * h + e] + bv;
          E* slot = reinterpret_cast<E*>(tile + (8 * j + 2 * q + e) * kPitch) + c;
          if constexpr (std::is_same_v<E, float>) {
            *slot = v;
          } else {
            *slot = Fp<T>::from_float(v);
          }
        }
    }
}

// A CTA's tile of E (x's dtype with the bias for a whole-K CTA; fp32 for a split's partial
// [M, N] slice), staged, leaves in 16-byte stores.
template <typename E, typename Cfg, typename T, int R>
__device__ __forceinline__ void store_tile(uint8_t* tile, const float (&acc)[Cfg::MT][R], const int (&row)[Cfg::MT],
                                           int q, const T* __restrict__ bias, E* __restrict__ dst, int m0, int M,
                                           int n0, int N) {
  if (threadIdx.x < kThreads) stage_tile<E, Cfg, T>(tile, acc, row, q, bias, n0, N);  // not the producer warp
  __syncthreads();
  copy_tile_out<E, Cfg::BT, Cfg::kRows, kTilePitch<E, Cfg>>(tile, dst, m0, M, n0, N, threadIdx.x,
                                                            Cfg::kEpilogueThreads);
}

// A CTA of a split of K summed in a cluster (one of its S = gridDim.z CTAs, rank blockIdx.z): its fp32
// tile is staged; after a cluster barrier it adds, for tokens [rank BT / S, (rank + 1) BT / S) of
// the tile, the S CTAs' tiles in rank order through distributed shared memory (the order, and so
// the rounding, of one fixed-order sum), then the bias, and stores. The second barrier keeps
// every CTA's shared memory alive until the last reader is done.
template <typename Cfg, typename T, int R>
__device__ __forceinline__ void cluster_reduce_store(uint8_t* tile, const float (&acc)[Cfg::MT][R],
                                                     const int (&row)[Cfg::MT], int q, const T* __restrict__ bias,
                                                     T* __restrict__ out, int m0, int M, int n0, int N) {
#if TERNOP_HAS_WGMMA
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  if (threadIdx.x < kThreads) stage_tile<float, Cfg, T>(tile, acc, row, q, nullptr, n0, N);
  cluster_sync();
  constexpr int kPitch = kTilePitch<float, Cfg>, kChunks = Cfg::kRows / 8;
  const int splits = static_cast<int>(cluster.num_blocks());
  const int rank = static_cast<int>(cluster.block_rank());
  const int per = Cfg::BT / splits;  // splits is a power of two up to 8, BT one of 8 and more
  for (int i = threadIdx.x; i < per * kChunks; i += Cfg::kEpilogueThreads) {
    const int t = rank * per + i / kChunks, c = i % kChunks;
    const int m = m0 + t, n = n0 + c * 8;
    if (m >= M || n >= N) continue;
    float v[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) v[e] = 0.f;
    for (int r = 0; r < splits; ++r) {
      const float4* src = reinterpret_cast<const float4*>(cluster.map_shared_rank(tile + t * kPitch + c * 32, r));
      const float4 a = src[0], b = src[1];
      v[0] += a.x, v[1] += a.y, v[2] += a.z, v[3] += a.w, v[4] += b.x, v[5] += b.y, v[6] += b.z, v[7] += b.w;
    }
    if (bias != nullptr)
#pragma unroll
      for (int e = 0; e < 8; ++e) v[e] += Fp<T>::to_float(bias[min(n + e, N - 1)]);
    T o[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) o[e] = Fp<T>::from_float(v[e]);
    store_run<T, 8>(out + static_cast<int64_t>(m) * N + n, n, N, o);
  }
  cluster_sync();
#endif
}

// The kernel, in three forms (Cfg::kProducerWarps). In the first every thread takes part in
// loading: thread 0 issues the TMA of x, every thread cp.asyncs its share of the codes, and the CTA
// meets at a barrier once a block. In the warp-specialised forms a producer issues all of a stage's
// loads as three TMA boxes (x twice, the codes once) on the stage's "full" mbarrier, and the two
// warpgroups never meet in the loop: each waits for a stage's "full" barrier and, once the wgmmas
// that read a stage are done, arrives on its "empty" one, which the producer waits for before
// refilling it. Every stage is in flight, not kStages - 2. The producer is a ninth warp, which
// caps every thread at 168 registers (288 threads), or a third warpgroup, which gives all but 40
// of its registers to the two that compute (232 each: room for 256 tokens of accumulators) and
// leaves before the epilogue.
template <typename T, typename Cfg>
__global__ void __launch_bounds__(Cfg::kBlockThreads, Cfg::kCtasPerSm)
    ternary_wgmma_kernel(const __grid_constant__ CUtensorMap x_map, const __grid_constant__ CUtensorMap x_tail_map,
                         const __grid_constant__ CUtensorMap w_map, const uint8_t* __restrict__ wp,
                         const __half* __restrict__ ws, const T* __restrict__ bias, T* __restrict__ out,
                         float* __restrict__ partial, int M, int N, int K, int blocks_per_split) {
#if !TERNOP_HAS_WGMMA
  __trap();  // not an sm_90a build: the registry never launches it
#endif
  constexpr int BT = Cfg::BT, MT = Cfg::MT, kStages = Cfg::kStages, R = BT / 2;
  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw = smem_addr(smem_raw);
  const uint32_t base = (raw + 1023) & ~1023u;
  const uint8_t* smem = smem_raw + (base - raw);
  // full[slot]: the slot's block has landed (x only, in the first form); empty[slot] (second form):
  // both warpgroups are done with it.
  __shared__ __align__(8) uint64_t bars[2 * kStages];
  const uint32_t bar0 = smem_addr(bars), empty0 = bar0 + 8 * kStages;
  if (threadIdx.x == 0) {
#pragma unroll
    for (int s = 0; s < kStages; ++s) {
      mbar_init(bar0 + 8 * s);
      if constexpr (Cfg::kWS) mbar_init(empty0 + 8 * s, kGroups);
    }
    mbar_init_fence();
  }
  __syncthreads();

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, q = lane % 4;
  // This lane's rows of the CTA: tile mt of warpgroup warp / 4 starts at 64 (MT (warp / 4) + mt);
  // warp % 4 owns 16 of its rows, the lane g and g + 8 of those.
  int row[MT];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) row[mt] = 64 * (MT * (warp / 4) + mt) + 16 * (warp % 4) + g;
  const int n0 = blockIdx.x * Cfg::kRows, m0 = blockIdx.y * BT;
  const int blocks = K / 128;
  const int kb_begin = blockIdx.z * blocks_per_split;
  const int count = max(0, min(blocks_per_split, blocks - kb_begin));
  const int64_t row_bytes = K / 4;
  int x_bytes;
  const CUtensorMap* xm = x_tile_map<Cfg>(&x_map, &x_tail_map, m0, M, x_bytes);
  // The epilogue sums the splits of K in a cluster (else it stores fp32 partials, or the tile).
  const bool cluster_sum = partial == nullptr && gridDim.z > 1;

  // The first wgmma of each tile overwrites its accumulators (scale-d 0): zeroing them with
  // ordinary instructions would make ptxas serialize every wgmma of the loop.
  float acc[MT][R];

  if (Cfg::kWS && warp >= 4 * kGroups) {  // the producer
    if constexpr (Cfg::kRegShift) setmaxnreg_dec<kProducerRegs>();
    if (warp == 4 * kGroups && lane == 0) {
      for (int i = 0; i < count; ++i) {
        const int slot = i % kStages;
        if (i >= kStages) mbar_wait(empty0 + 8 * slot, (i / kStages - 1) & 1);
        const uint32_t stage = base + slot * Cfg::kStageBytes, bar = bar0 + 8 * slot;
        const int kb = kb_begin + i;
        mbar_expect(bar, x_bytes + Cfg::kWBytes);
        tma_load(stage, xm, kb * 256, m0, bar);  // bytes: 128 k of 2 bytes a block
        tma_load(stage + Cfg::kXHalfBytes, xm, kb * 256 + 128, m0, bar);
        tma_load(stage + Cfg::kXBytes, &w_map, kb * 32, n0, bar);  // rows past N read as zero
      }
    }
    if constexpr (Cfg::kRegShift) {
      // Left with 40 registers, the producer warpgroup takes no part in the epilogue: it meets the
      // other warps at the epilogue's barriers (bar.sync and barrier.cluster count arrivals, not
      // places in the code) and leaves.
      __syncthreads();
      if (cluster_sum) {
        cluster_sync();
        cluster_sync();
      } else {
        __syncthreads();
      }
      return;
    }
  } else {
    if constexpr (Cfg::kRegShift) setmaxnreg_inc<kConsumerRegs>();
    const __half* ps0 = ws + kb_begin;
    int srow[MT][2];
    __half sc[MT][2];  // this block's scales, loaded a block ahead
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        srow[mt][h] = min(n0 + row[mt] + 8 * h, N - 1);
        sc[mt][h] = count > 0 ? ps0[static_cast<int64_t>(srow[mt][h]) * blocks] : __float2half(0.f);
      }
    const uint32_t magic = Pair16<T>::kMagic;

    if constexpr (!Cfg::kWS) {
#pragma unroll
      for (int s = 0; s < kStages - 2; ++s) {
        if (s < count)
          load_stage<Cfg>(base + s * Cfg::kStageBytes, bar0 + 8 * s, xm, x_bytes, m0, wp, row_bytes, n0, N,
                          kb_begin + s);
        cp_async_commit();
      }
    }

    uint32_t a[Cfg::kDepth][MT][4];
    for (int i = 0; i < count; ++i) {
      if constexpr (Cfg::kWS) {
        mbar_wait(bar0 + 8 * (i % kStages), (i / kStages) & 1);  // x and codes of block i
      } else {
        cp_async_wait<kStages - 3>();                            // this thread's codes of block i
        mbar_wait(bar0 + 8 * (i % kStages), (i / kStages) & 1);  // x of block i
        __syncthreads();  // block i has landed for every thread; block i - 2's slot is free everywhere
        const int next = i + kStages - 2;
        if (next < count)
          load_stage<Cfg>(base + (next % kStages) * Cfg::kStageBytes, bar0 + 8 * (next % kStages), xm, x_bytes, m0,
                          wp, row_bytes, n0, N, kb_begin + next);
        cp_async_commit();
      }
      uint32_t sp[MT][2];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          sp[mt][h] = scale_pair<T>(sc[mt][h]);
          if (i + 1 < count) sc[mt][h] = ps0[static_cast<int64_t>(srow[mt][h]) * blocks + i + 1];
        }
      const uint32_t stage = base + (i % kStages) * Cfg::kStageBytes;
      const uint8_t* codes = smem + (stage - base) + Cfg::kXBytes;

#pragma unroll
      for (int half = 0; half < 2; ++half) {
        // This lane's code words of the half block (k16 steps 4 half .. 4 half + 3), rows row and row + 8.
        uint4 w[MT][2];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int h = 0; h < 2; ++h)
            w[mt][h] = *reinterpret_cast<const uint4*>(codes + (row[mt] + 8 * h) * Cfg::kCodePitch + 16 * half);
#pragma unroll
        for (int t = 0; t < 4; ++t) {
          const int s = 4 * half + t;
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            uint32_t(&as)[4] = a[s % Cfg::kDepth][mt];
            const uint32_t* w0 = reinterpret_cast<const uint32_t*>(&w[mt][0]);
            const uint32_t* w1 = reinterpret_cast<const uint32_t*>(&w[mt][1]);
            const uint32_t u0 = w0[t] >> (2 * q), u1 = w1[t] >> (2 * q);
            as[0] = mul2<T>(decode_pair<T>(u0, magic), sp[mt][0]);
            as[1] = mul2<T>(decode_pair<T>(u1, magic), sp[mt][1]);
            as[2] = mul2<T>(decode_pair<T>(u0 >> 8, magic), sp[mt][0]);
            as[3] = mul2<T>(decode_pair<T>(u1 >> 8, magic), sp[mt][1]);
          }
          wgmma_fence();
          const uint64_t desc = b_desc(stage + half * Cfg::kXHalfBytes + t * 32);
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) Wgmma<T, BT>::run(i > 0 || s > 0, acc[mt], a[s % Cfg::kDepth][mt], desc);
          wgmma_commit();
          wgmma_wait<Cfg::kDepth - 1>();
          // Past this wait only steps of block i are in flight: block i - 1's stage is free. The
          // wait is warpgroup-wide, so one thread of each warpgroup says so for all four warps.
          if constexpr (Cfg::kWS)
            if (s == Cfg::kDepth - 1 && i > 0 && threadIdx.x % 128 == 0) mbar_arrive(empty0 + 8 * ((i - 1) % kStages));
        }
      }
    }
    wgmma_wait<0>();
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) fence_acc(acc[mt]);
  }
  if constexpr (!Cfg::kWS) cp_async_wait<0>();
  if (count == 0) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int i = 0; i < R; ++i) acc[mt][i] = 0.f;
  }
  __syncthreads();  // every warp is done with the stages: they now hold the output tile
  uint8_t* tile = smem_raw + (base - raw);
  if (partial != nullptr) {
    store_tile<float, Cfg, T>(tile, acc, row, q, nullptr, partial + static_cast<int64_t>(blockIdx.z) * M * N, m0, M,
                              n0, N);
  } else if (cluster_sum) {
    cluster_reduce_store<Cfg, T>(tile, acc, row, q, bias, out, m0, M, n0, N);
  } else {
    store_tile<T, Cfg, T>(tile, acc, row, q, bias, out, m0, M, n0, N);
  }
}

// The tiles: <tokens BT, m64 tiles a warpgroup MT, stages, wgmma groups in flight, producer warps>;
// a CTA owns 128 MT weight rows. Tile 5 (32 tokens) doubles the CTAs of tile 0 on a layer with
// fewer 128-row tiles than SMs, where tile 0 would split K (auto_wgmma_tile: short-K layers at
// M = 33..64).
// The forms. A same-run sweep of every tile in the first two forms (results/h200/
// sweep_wgmma_ws_b86fccd.json, the eight shapes at M = 32..2048) had the 64-token tiles faster with
// a producer warp at 47 and 46 of 48 points (tile 0: median 1.095x, range 0.98-1.21x; tile 3: median
// 1.064x); the 128-token tile ran the same in both forms, the 32-token one too (0.83x and 0.85x of
// cuBLAS where auto_wgmma_tile takes it, against 0.83x and 0.87x), and the 256-token and 256-row x
// 128-token tiles lost: 288 threads cap a thread at 168 registers and ptxas serialised their
// wgmmas. A producer warpgroup that gives its registers to the computing ones removes that cap:
// the sweep at e697c98 (results/h200/sweep_wgmma_wg_e697c98.json, M = 128..2048, where tiles 6-8
// were tiles 1, 2 and 4 in that form) had them faster at 36, 35 and 37 of 40 points (medians 1.04x,
// 1.02x and 1.16x; at most 1.09x, 1.12x and 1.26x faster, 2%, 4% and 3% slower).
using WgTile0 = WgTile<64, 1, 6, 4, 1>;
using WgTile1 = WgTile<128, 1, 6, 4, 4>;
using WgTile2 = WgTile<256, 1, 3, 4, 4>;
using WgTile3 = WgTile<64, 2, 6, 4, 1>;
using WgTile4 = WgTile<128, 2, 5, 4, 4>;
using WgTile5 = WgTile<32, 1, 8, 4>;
// Tiles 6 and 7 (16 and 8 tokens) are for M <= 16, where the 64-token tiles issue four to eight
// times the MMAs that the tokens need and their 16 KiB of x a stage leave room for one CTA an SM:
// these hold two, the first step against a latency-bound kernel (one CTA of two computing
// warpgroups an SM kept 0.5 warps eligible a scheduler, ncu_wgmma_m128_4096x14336_38af09e.txt).
using WgTile6 = WgTile<16, 1, 8, 4, 1, 2>;
using WgTile7 = WgTile<8, 1, 8, 4, 1, 2>;
constexpr int kWgTiles = 8;

struct WgShape {
  int rows, tokens, ctas_per_sm;
};
template <typename Cfg>
constexpr WgShape wg_shape() {
  return {Cfg::kRows, Cfg::BT, Cfg::kCtasPerSm};
}
constexpr WgShape kWgShapes[kWgTiles] = {wg_shape<WgTile0>(), wg_shape<WgTile1>(), wg_shape<WgTile2>(),
                                         wg_shape<WgTile3>(), wg_shape<WgTile4>(), wg_shape<WgTile5>(),
                                         wg_shape<WgTile6>(), wg_shape<WgTile7>()};

// The launch configuration of tile Cfg over `grid`: as clusters of grid.z CTAs along z when
// `clustered`, through `cluster`, which must outlive the config. The launch and the occupancy
// query below use it both, so the clusters counted are the clusters launched.
template <typename Cfg>
cudaLaunchConfig_t wgmma_config(dim3 grid, cudaStream_t stream, bool clustered, cudaLaunchAttribute& cluster) {
  return z_cluster_config(grid, Cfg::kBlockThreads, Cfg::kSmemBytes, stream, clustered, cluster);
}

// The launch: a split of K (splits > 1) runs as clusters of `splits` CTAs along z, or, given a
// workspace, writes fp32 partials there and adds them in a second kernel.
template <typename T, typename Cfg>
cudaError_t launch_wgmma(const T* x, int64_t ldx, const uint8_t* wp, const __half* ws, const T* bias, T* out,
                         float* workspace, int M, int N, int K, int splits, cudaStream_t stream) {
  auto kernel = ternary_wgmma_kernel<T, Cfg>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes);
  if (err != cudaSuccess) return err;
  CUtensorMap x_map, x_tail_map, w_map = {};
  err = x_tensor_map(&x_map, x, ldx * 2, M, int64_t{K} * 2, Cfg::BT);
  if (err != cudaSuccess) return err;
  const int tail = M % Cfg::BT;  // tokens of a short last tile; with none the kernel never reads its map
  if (tail > 0) {
    err = x_tensor_map(&x_tail_map, x, ldx * 2, M, int64_t{K} * 2, tail);
    if (err != cudaSuccess) return err;
  } else {
    x_tail_map = x_map;  // no second encoding on the host
  }
  if constexpr (Cfg::kWS) {  // the producer warp loads the codes by TMA too
    err = codes_tensor_map(&w_map, wp, N, K, Cfg::kRows);
    if (err != cudaSuccess) return err;
  }
  const int blocks = K / 128;
  const int per_split = (blocks + splits - 1) / splits;
  const dim3 grid((N + Cfg::kRows - 1) / Cfg::kRows, (M + Cfg::BT - 1) / Cfg::BT, splits);
  cudaLaunchAttribute cluster;
  const cudaLaunchConfig_t config = wgmma_config<Cfg>(grid, stream, splits > 1 && workspace == nullptr, cluster);
  float* partial = splits > 1 ? workspace : nullptr;
  err = cudaLaunchKernelEx(&config, kernel, x_map, x_tail_map, w_map, wp, ws, bias, out, partial, M, N, K, per_split);
  if (err != cudaSuccess || partial == nullptr) return err;
  return launch_split_k_reduce(workspace, bias, out, M, N, splits, stream);
}

// How many clusters of `splits` CTAs of tile Cfg the current device runs at once (its GPCs bound
// that below SMs / splits); 0 where it cannot run them.
template <typename Cfg>
int max_active_clusters(int splits) {
  auto kernel = ternary_wgmma_kernel<__half, Cfg>;
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  cudaLaunchAttribute cluster;
  const cudaLaunchConfig_t config = wgmma_config<Cfg>(dim3(1, 1, splits), nullptr, true, cluster);
  int clusters = 0;
  if (cudaOccupancyMaxActiveClusters(&clusters, kernel, &config) != cudaSuccess) {
    cudaGetLastError();  // not a Hopper-class device, or not an sm_90a build
    return 0;
  }
  return clusters;
}

// f(Cfg{}) for tile index t (0..kWgTiles - 1; past the end, the last tile).
template <typename F>
decltype(auto) with_tile(int t, F&& f) {
  switch (t) {
    case 0: return f(WgTile0{});
    case 1: return f(WgTile1{});
    case 2: return f(WgTile2{});
    case 3: return f(WgTile3{});
    case 4: return f(WgTile4{});
    case 5: return f(WgTile5{});
    case 6: return f(WgTile6{});
    default: return f(WgTile7{});
  }
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

int64_t ctas_of(int t, int M, int N) { return ceil_div(N, kWgShapes[t].rows) * ceil_div(M, kWgShapes[t].tokens); }

// Splits of K for tile t: the most (a power of two up to 16) whose CTAs still fit in one wave, one
// CTA an SM (tiles * splits <= sms; the tiles that hold more CTAs an SM count that many), each
// split keeping at least two scale blocks. Splitting past one wave gains nothing: twice the splits
// over two waves is the same time per SM, plus a prologue and an epilogue per CTA and the
// reduction (the rule before doubled while tiles * splits < sms, so 112 tiles on 132 SMs ran as
// 224 half-K CTAs in two waves). The splits add up inside clusters where the device runs all
// `tiles` clusters of that size at once (ternary_wgmma_cluster_sums), else through an fp32
// workspace [splits, M, N] that linear_cuda.cpp allocates. Capping the splits
// at what the clusters allow instead ran 4096 -> 4096 at M = 33..128 at 0.74-0.91x of cuBLAS bf16
// where the workspace ran 0.93-1.28x (results/h200/bench_linear_mid_m_7cdd483.json).
int splits_of(int t, int M, int N, int K, int sms) {
  const int64_t tiles = ctas_of(t, M, N), slots = int64_t{sms} * kWgShapes[t].ctas_per_sm;
  const int blocks = K / 128;
  int splits = 1;
  while (splits < 16 && tiles * splits * 2 <= slots && blocks / (2 * splits) >= 2) splits *= 2;
  return splits;
}

// The time of tile t on a call, in units of one scale block of tile 1 (128 tokens x 128 rows):
// the waves of CTAs, each walking its share of the scale blocks at its block_cost plus one unit of
// prologue and epilogue, and one unit per split for adding the splits up. block_cost is what a
// scale block costs each tile against tile 1 (the 64-token tile decodes its rows for half the
// tokens; the 256-token and 256-row tiles do twice tile 1's MMAs a block, a little faster than
// two of its blocks); tiles 3 and 5 are not ranked (the rules for M <= 64 below take them).
// Fitted to the sweep at e697c98 (results/h200/sweep_wgmma_wg_e697c98.json: the eight shapes at
// M = 128, 256, 512, 1024 and 2048, each tile in both forms): the model's tile is within 2.3% of
// the fastest at every one of those 40 points (5% summed over them), where the rule before it (the
// 256-token tile only from M = 257 and where its CTAs fill the GPU; the 64-token tile on K = 1024
// layers up to M = 512 while its CTAs fit one wave) lost up to 24% (14336 -> 4096 at M = 1024: 0.81x
// of cuBLAS bf16 against 1.00x) and 268% summed; with the new forms the model's choice is 1.07x
// as fast as the old rule's on average. Where it was not fitted (M = 96, 192, 384, 768 and 1536,
// sweep_wgmma_rule_4dba057.json) it was within 3% of the fastest tile at 37 of 40 points, at
// worst 6% (14336 -> 4096 at M = 384).
struct RankedTile {
  int tile;
  double block_cost;
};
constexpr RankedTile kRanked[] = {{0, 0.65}, {1, 1.0}, {2, 1.9}, {4, 2.0}};

double tile_cost(RankedTile r, int M, int N, int K, int sms) {
  const int splits = splits_of(r.tile, M, N, K, sms);
  const int64_t waves = ceil_div(ctas_of(r.tile, M, N) * splits, sms);
  return static_cast<double>(waves) * (r.block_cost * (K / 128) / splits + 1.0) + (splits > 1 ? splits : 0);
}

// The tile for a call when none is forced. Above M = 64, the cheapest by tile_cost. Up to M = 64
// one 64-token tile holds every token, and the 128-token tile only adds MMAs on zero rows: 128
// weight rows a CTA, or 256 (tile 3) where 128-row CTAs would need a second wave
// (results/h200/sweep_wgmma_small_m_8997d70.json: on 4096 -> 28672 tile 3 ran 1.51-1.63x of cuBLAS
// bf16 at M = 8..64 against 1.29-1.38x for tile 0 and 0.79-1.01x for the 128-token tile). Short-K
// layers (K below kLongK, the bound configs.py's WGMMA_SMALL_M_MIN_K also draws) at M = 33..64 take
// the 32-token tile (5) where its CTAs fit one wave: on 1024 -> 4096 at M = 64 it makes 64 CTAs
// whose splits in two add up in clusters, where tile 0's 32 CTAs split four ways, more clusters
// than the GPCs hold at once, and go through the workspace: 0.78x against 0.68x
// (sweep_wgmma_06b_f5091fa.json; on 1024 -> 6144 0.86x against 0.85x). Up to M = 16 the 16-token
// tile (6), two CTAs an SM, ran ahead of the 64-token ones on every layer the dispatcher gives this
// kernel there (results/h200/sweep_wgmma_small_3c8c22a.json, M = 16: 4096 -> 14336 1.62x of cuBLAS
// bf16 against 1.37x, 4096 -> 28672 1.78x against 1.51x) and on the 0.6B layers (0.93-1.32x against
// 0.82-1.17x); the 8-token tile (7) was ahead only to M = 8, where cuda_mma runs.
constexpr int kLongK = 2048;
constexpr int kSmallM = 16;

int auto_wgmma_tile(int M, int N, int K, int sms) {
  if (M <= kSmallM) return 6;
  if (K < kLongK && M > 32 && M <= 64 && ctas_of(5, M, N) <= sms) return 5;
  if (M <= 64) return ctas_of(0, M, N) > sms ? 3 : 0;
  int best = -1;
  double best_cost = 0.0;
  for (const RankedTile& r : kRanked) {
    const double c = tile_cost(r, M, N, K, sms);
    if (best < 0 || c < best_cost) best = r.tile, best_cost = c;
  }
  return best;
}

}  // namespace

int ternary_wgmma_tile(int M, int N, int K, int sms, int tile) {
  return tile >= 0 && tile < kWgTiles ? tile : auto_wgmma_tile(M, N, K, sms);
}

namespace {

// max_active_clusters per device, tile and split count (2, 4, 8), plus one; 0 until asked.
constexpr int kMaxDevices = 64;
std::atomic<int> cluster_cache[kMaxDevices][kWgTiles][3];

int clusters_of(int tile, int splits) {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= kMaxDevices) return 0;
  const int s = splits == 2 ? 0 : splits == 4 ? 1 : 2;
  std::atomic<int>& slot = cluster_cache[device][tile][s];
  int known = slot.load(std::memory_order_relaxed);
  if (known > 0) return known - 1;
  const int n = with_tile(tile, [&](auto cfg) { return max_active_clusters<decltype(cfg)>(splits); });
  slot.store(n + 1, std::memory_order_relaxed);
  return n;
}

}  // namespace

// Splits of K for the call's tile (splits_of above).
int ternary_wgmma_splits(int M, int N, int K, int sms, int tile) {
  return splits_of(ternary_wgmma_tile(M, N, K, sms, tile), M, N, K, sms);
}

bool ternary_wgmma_cluster_sums(int M, int N, int K, int sms, int tile, int splits) {
  const int t = ternary_wgmma_tile(M, N, K, sms, tile);
  return splits > 1 && splits <= 8 && clusters_of(t, splits) >= ctas_of(t, M, N);
}

// x: [M, K] with row stride ldx (elements, a multiple of 8), fp16 or bf16; wp: uint8 [N, K/4]
// in the a16 layout; ws: fp16 [N, K/128]; bias [N] in x's dtype or nullptr; out [M, N];
// splits from ternary_wgmma_splits; workspace: fp32 [splits, M, N] when splits > 1 and
// ternary_wgmma_cluster_sums is false, else nullptr. x, wp 16-byte aligned, K a multiple of 128.
cudaError_t launch_ternary_wgmma(const void* x, int64_t ldx, int dtype, const uint8_t* wp, const __half* ws,
                                 const void* bias, void* out, float* workspace, int M, int N, int K, int splits,
                                 int tile, int sms, cudaStream_t stream) {
  if (M < 1 || N < 1 || K < 128 || K % 128 || ldx % 8 || splits < 1) return cudaErrorInvalidValue;
  if (splits > 1 && workspace == nullptr && (splits > 8 || (splits & (splits - 1)))) return cudaErrorInvalidValue;
  if (reinterpret_cast<uintptr_t>(x) % 16) return cudaErrorInvalidValue;  // the tensor map's base
  return dispatch_dtype</*kWithFp32=*/false>(dtype, [&](auto tag) {
    using T = decltype(tag);
    const T* xt = static_cast<const T*>(x);
    const T* bt = static_cast<const T*>(bias);
    T* ot = static_cast<T*>(out);
    return with_tile(ternary_wgmma_tile(M, N, K, sms, tile), [&](auto cfg) {
      return launch_wgmma<T, decltype(cfg)>(xt, ldx, wp, ws, bt, ot, workspace, M, N, K, splits, stream);
    });
  });
}

}  // namespace ternop
