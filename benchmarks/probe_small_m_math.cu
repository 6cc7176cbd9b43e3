// How fast the small-M kernel's arithmetic alone can go at M = 1: the decode and mma of
// ternary_mma.cu (a16 layout, one n8 tile, two mma chains a block), with no weight loads. Each
// warp makes its codes from its block index (two integer instructions a word, about what the
// loads cost in instructions) and reads x from L1 after the first touch. Variants (below) leave
// parts of the arithmetic out, or read x in other ways.
//
//   sets a warp 1: one set of 16 rows a warp, as the kernel (its 4096->14336 grid: 224 CTAs of
//                  eight warps, 16 blocks a warp; and the same work from twice the CTAs).
//   sets a warp 2: one warp multiplies two sets with each block of x it loads (two A fragments a
//                  B fragment): half the x loads a weight, and twice the independent mma chains.
//
// The work of every row is the 4096->14336 layer's at M = 1 (896 sets x 32 blocks), so each time
// compares with the kernel's (docs/KERNELS.md, "The small-M kernel's arithmetic alone").
//
//     nvcc -O3 -std=c++17 -arch=sm_90a -o probe_small_m_math benchmarks/probe_small_m_math.cu
//     ./probe_small_m_math [variants, e.g. full,x_own] [once]
//
// "once" launches each named variant once at the kernel's grid, untimed, for a profiler.
#include <cstdio>
#include <cstring>

#include "../ternop/cuda/csrc/ternary_mma.cu"  // the kernel's decode and mma steps
#include "probe_timing.cuh"


using T = __nv_bfloat16;

// The decode of one pair of A, by variant. Only kFull is the kernel's arithmetic; the others
// leave parts of it out (their values are wrong) to show what each part costs:
//   kFull      shift, LOP3 (mask | magic) and HSUB2 a pair, as ternop::pair
//   kNoSub     shift and LOP3: the pair stays biased by the magic
//   kNoShift   LOP3 with a per-pair mask (no shift) and HSUB2
//   kLopOnly   the LOP3 alone
//   kNoDecode  the raw words as A: the mma and the loads of x alone
//   kNoMma     no decode and no mma: the loop, the hash words and the loads of x
// Every lane of kFull loads x, as the kernel did before it skipped the B columns past M. Three
// variants change how x is read, with kFull's arithmetic (their values are right):
//   kXOwn      only the lanes whose token is below M (here 1) load x, the others get zeros: the
//              kernel's loads now
//   kXNext     x of the next block is loaded before this block's mma (16 more registers)
//   kXOwnNext  both
//   kXSmem     each CTA first copies x (8 KB) into shared memory, in the order the lanes read it
//              (block, 16-byte step i, lane group q), so that a warp's 16-byte reads of one step
//              fall in distinct banks; then every block's x is four LDS.128 a lane
// and kXSmem with the arithmetic of kNoDecode and of kNoMma (kXSmemNoDecode, kXSmemNoMma).
// Last, a shorter exact decode, LOP3 + HFMA2 a pair (kFma; with x in shared memory, kXSmemFma):
// the field at bit 2j of a half, ORed into the magic 2^7, reads 2^7 + u * 4^j, and one packed
// FMA by 4^-j plus -(2^7 * 4^-j + 1) gives v = u - 1 exactly; a word needs one shift for each
// three fields instead of one a field (results/h100/probe_small_m_math_fma_6adb57b.log).
enum Variant {
  kFull, kNoSub, kNoShift, kLopOnly, kNoDecode, kNoMma, kXOwn, kXNext, kXOwnNext, kXSmem, kXSmemNoDecode,
  kXSmemNoMma, kFma, kXSmemFma, kVariants
};
const char* const kVariantNames[kVariants] = {
    "full",       "no_sub", "no_shift",         "lop_only",      "no_decode", "no_mma",  "x_own", "x_next",
    "x_own_next", "x_smem", "x_smem_no_decode", "x_smem_no_mma", "fma",       "x_smem_fma"};
__host__ __device__ constexpr int decode_of(int v) {
  switch (v) {
    case kXOwn: case kXNext: case kXOwnNext: case kXSmem: return kFull;
    case kXSmemNoDecode: return kNoDecode;
    case kXSmemNoMma: return kNoMma;
    case kXSmemFma: return kFma;
    default: return v;
  }
}
__host__ __device__ constexpr bool smem_of(int v) {
  return v == kXSmem || v == kXSmemNoDecode || v == kXSmemNoMma || v == kXSmemFma;
}
constexpr int kProbeK = 4096;  // the layer's K (main's)

template <int V, int J>
__device__ __forceinline__ uint32_t decode(uint32_t d, uint32_t magic) {
  uint32_t r;
  if constexpr (V == kFull) {
    return ternop::pair<T, J, true>(d, magic);
  } else if constexpr (V == kNoSub) {
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(d >> (2 * J)), "n"(0x00030003), "r"(magic));
    return r;
  } else if constexpr (V == kFma) {
    // bf16: three fields a shift (bits 0-5 of each half stay in the mantissa).
    constexpr int j = J % 3, shift = 6 * (J / 3);
    constexpr uint32_t mul = j == 0 ? 0x3F803F80u : j == 1 ? 0x3E803E80u : 0x3D803D80u;  // 1, 1/4, 1/16
    constexpr uint32_t add = j == 0 ? 0xC301C301u : j == 1 ? 0xC204C204u : 0xC110C110u;  // -129, -33, -9
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(d >> shift), "n"(0x00030003u << (2 * j)), "r"(magic));
    const __nv_bfloat162 m = *reinterpret_cast<const __nv_bfloat162*>(&mul);
    const __nv_bfloat162 a = *reinterpret_cast<const __nv_bfloat162*>(&add);
    __nv_bfloat162 v = __hfma2(*reinterpret_cast<const __nv_bfloat162*>(&r), m, a);
    return *reinterpret_cast<uint32_t*>(&v);
  } else if constexpr (V == kNoShift || V == kLopOnly) {
    // A different mask for every J, so that the compiler cannot merge the eight.
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(d), "n"(0x00030003u << J), "r"(magic));
    return V == kNoShift ? ternop::sub2<T>(r, ternop::Mma<T>::kBiasA16) : r;
  } else {
    return d;
  }
}

// mma step 4H + S of a block, as ternop::mma_step (a16, one n8 tile), with the variant's decode.
template <int V, int H, int S>
__device__ __forceinline__ void step(uint32_t d_g, uint32_t d_g8, const uint32_t (&xv)[16], uint32_t magic,
                                     float (&c)[4]) {
  const uint32_t b0 = xv[8 * H + 2 * S], b1 = xv[8 * H + 2 * S + 1];
  constexpr int D = decode_of(V);
  if constexpr (D == kNoMma) {
    c[0] += __uint_as_float(b0 ^ d_g) + __uint_as_float(b1 ^ d_g8);
  } else {
    ternop::mma_16816<T>(c, decode<D, 2 * S>(d_g, magic), decode<D, 2 * S>(d_g8, magic),
                         decode<D, 2 * S + 1>(d_g, magic), decode<D, 2 * S + 1>(d_g8, magic), b0, b1);
  }
}

template <int V, int H>
__device__ __forceinline__ void word(uint32_t d_g, uint32_t d_g8, const uint32_t (&xv)[16], uint32_t magic,
                                     float (&c)[4]) {
  step<V, H, 0>(d_g, d_g8, xv, magic, c);
  step<V, H, 1>(d_g, d_g8, xv, magic, c);
  step<V, H, 2>(d_g, d_g8, xv, magic, c);
  step<V, H, 3>(d_g, d_g8, xv, magic, c);
}

// Each warp: S sets (one A fragment each) times `blocks` consecutive blocks of x.
template <int V, int S>
__global__ void __launch_bounds__(256) math_kernel(const T* __restrict__ x, int k_blocks, int blocks, float* sink) {
  const int lane = threadIdx.x % 32, q = lane % 4;
  const int warp = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  const T* px = x + 32 * q;  // token 0 for every lane (M = 1: the kernel reads token 0 for g >= M)
  const uint32_t magic = ternop::Mma<T>::kMagic;
  float acc[S][4] = {};
  const uint32_t seed = 0x9E3779B9u * (warp + 1) + lane;
  const int b0 = (warp * blocks) % k_blocks;
  constexpr bool kOwn = V == kXOwn || V == kXOwnNext, kNext = V == kXNext || V == kXOwnNext;
  const bool loads = !kOwn || lane / 4 < 1;  // M = 1: token g = lane / 4 exists only for g = 0
  auto block_of = [&](int i) { return b0 + i < k_blocks ? b0 + i : b0 + i - k_blocks; };
  constexpr bool kSmem = smem_of(V);
  __shared__ uint4 xs[kSmem ? kProbeK / 8 : 1];
  if constexpr (kSmem) {
    // The kernel's layout of x in shared memory (ternop::xs_chunk), for the one token.
    for (int c = threadIdx.x; c < kProbeK / 8; c += blockDim.x)
      xs[ternop::xs_chunk(c)] = __ldg(reinterpret_cast<const uint4*>(x) + c);
    __syncthreads();
  }
  uint32_t xv[16] = {}, xn[16] = {};
  if (kNext && blocks > 0) ternop::load_x(px + 128 * block_of(0), loads, xn);
  for (int i = 0; i < blocks; ++i) {
    if constexpr (kSmem) {
      const int b = block_of(i);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const uint4 v = xs[b * 16 + j * 4 + q];
        xv[4 * j] = v.x, xv[4 * j + 1] = v.y, xv[4 * j + 2] = v.z, xv[4 * j + 3] = v.w;
      }
    } else if constexpr (kNext) {
#pragma unroll
      for (int r = 0; r < 16; ++r) xv[r] = xn[r];
      if (i + 1 < blocks) ternop::load_x(px + 128 * block_of(i + 1), loads, xn);
    } else {
      ternop::load_x(px + 128 * block_of(i), loads, xv);
    }
#pragma unroll
    for (int s = 0; s < S; ++s) {
      const uint32_t h = seed * (2 * i + s + 1);
      const uint32_t wa0 = h ^ 0x5a5a5a5au, wa1 = h + 0x3c3c3c3cu, wb0 = h ^ 0x0f0f0f0fu, wb1 = h + 0x12345678u;
      float c[4] = {}, c2[4] = {};
      word<V, 0>(wa0, wb0, xv, magic, c);
      word<V, 1>(wa1, wb1, xv, magic, c2);
#pragma unroll
      for (int r = 0; r < 4; ++r) acc[s][r] = fmaf(c[r] + c2[r], 0.5f, acc[s][r]);
    }
  }
  float total = 0.f;
#pragma unroll
  for (int s = 0; s < S; ++s)
#pragma unroll
    for (int r = 0; r < 4; ++r) total += acc[s][r];
  if (total == 1234.5f) sink[0] = total;
}

template <int V>
void launch_variant(int sets_a_warp, int ctas, int threads, cudaStream_t stream, const T* x, int k_blocks,
                    int blocks, float* sink) {
  if (sets_a_warp == 1) math_kernel<V, 1><<<ctas, threads, 0, stream>>>(x, k_blocks, blocks, sink);
  else math_kernel<V, 2><<<ctas, threads, 0, stream>>>(x, k_blocks, blocks, sink);
}

using LaunchFn = void (*)(int, int, int, cudaStream_t, const T*, int, int, float*);
const LaunchFn kLaunch[kVariants] = {launch_variant<kFull>,    launch_variant<kNoSub>,    launch_variant<kNoShift>,
                                     launch_variant<kLopOnly>, launch_variant<kNoDecode>, launch_variant<kNoMma>,
                                     launch_variant<kXOwn>,    launch_variant<kXNext>,    launch_variant<kXOwnNext>,
                                     launch_variant<kXSmem>,   launch_variant<kXSmemNoDecode>,
                                     launch_variant<kXSmemNoMma>, launch_variant<kFma>,
                                     launch_variant<kXSmemFma>};

struct Config {
  int sets_a_warp, warps_a_cta, blocks_a_warp;
};

int main(int argc, char** argv) {
  const char* only = argc > 1 ? argv[1] : nullptr;  // e.g. "full,no_sub": only these variants
  // "once": one plain launch of each variant at the kernel's grid, untimed, for a profiler.
  const bool once = argc > 2 && std::strcmp(argv[2], "once") == 0;
  const int K = kProbeK, N = 14336, k_blocks = K / 128, set_blocks = (N / 16) * k_blocks;
  const Config configs[] = {{1, 8, 16}, {1, 8, 8}, {1, 4, 16}, {2, 8, 16}, {2, 8, 8}, {2, 4, 16}, {2, 4, 8}};
  T* x = nullptr;
  float* sink = nullptr;
  CHECK(cudaMalloc(&x, K * sizeof(T)));
  CHECK(cudaMemset(x, 0x3c, K * sizeof(T)));
  CHECK(cudaMalloc(&sink, 4));
  cudaStream_t stream;
  CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const int reps = 200;
  double us = 0.0;
  if (once) {
    for (int v = 0; v < kVariants; ++v) {
      if (!named_in(only, kVariantNames[v])) continue;
      const Config& c = configs[0];
      const int ctas = set_blocks / (c.sets_a_warp * c.blocks_a_warp) / c.warps_a_cta;
      kLaunch[v](c.sets_a_warp, ctas, 32 * c.warps_a_cta, stream, x, k_blocks, c.blocks_a_warp, sink);
    }
    CHECK(cudaStreamSynchronize(stream));
    return 0;
  }
  // The floor: the kernel's grid at 4096->14336 with no blocks to do.
  CHECK(time_graph_us(stream, reps, [&](int) { kLaunch[kFull](1, 224, 256, stream, x, k_blocks, 0, sink); }, &us));
  std::printf("empty launch, 224 CTAs of 8 warps: %.2f us/call\n", us);
  std::printf("%-10s %-10s %-10s %-11s %6s %9s\n", "variant", "sets/warp", "warps/cta", "blocks/warp", "ctas",
              "us/call");
  for (int v = 0; v < kVariants; ++v) {
    if (!named_in(only, kVariantNames[v])) continue;
    for (const Config& c : configs) {
      const int warps = set_blocks / (c.sets_a_warp * c.blocks_a_warp);
      const int ctas = warps / c.warps_a_cta, threads = 32 * c.warps_a_cta;
      auto launch = [&](int) { kLaunch[v](c.sets_a_warp, ctas, threads, stream, x, k_blocks, c.blocks_a_warp, sink); };
      CHECK(time_graph_us(stream, reps, launch, &us));
      std::printf("%-10s %-10d %-10d %-11d %6d %9.2f\n", kVariantNames[v], c.sets_a_warp, c.warps_a_cta,
                  c.blocks_a_warp, ctas, us);
    }
  }
  return 0;
}
