// How fast the small-M kernel's arithmetic alone can go at M = 1: the decode and mma of
// ternary_mma.cu (a16 layout, one n8 tile, two mma chains a block), with no weight loads. Each
// warp makes its codes from its block index (two integer instructions a word, about what the
// loads cost in instructions) and reads x as the kernel does (from L1 after the first touch).
//
//   sets a warp 1: one set of 16 rows a warp, as the kernel (its 4096->14336 grid: 224 CTAs of
//                  eight warps, 16 blocks a warp; and the same work from twice the CTAs).
//   sets a warp 2: one warp multiplies two sets with each block of x it loads (two A fragments a
//                  B fragment): half the x loads a weight, and twice the independent mma chains.
//
// The work of every row is the 4096->14336 layer's at M = 1 (896 sets x 32 blocks), so each time
// compares with the kernel's (docs/KERNELS.md, "The feed alone": loads alone 7-9 us, kernel 13 us
// on an H100).
//
//     nvcc -O3 -std=c++17 -arch=sm_90a -o probe_small_m_math benchmarks/probe_small_m_math.cu && ./probe_small_m_math
#include <cstdio>

#include "../ternop/cuda/csrc/ternary_mma.cu"  // the kernel's decode and mma steps
#include "probe_timing.cuh"


using T = __nv_bfloat16;

// Each warp: S sets (one A fragment each) times `blocks` consecutive blocks of x.
template <int S>
__global__ void __launch_bounds__(256) math_kernel(const T* __restrict__ x, int k_blocks, int blocks, float* sink) {
  const int lane = threadIdx.x % 32, q = lane % 4;
  const int warp = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  const T* px = x + 32 * q;  // token 0 for every lane (M = 1: the kernel reads token 0 for g >= M)
  const uint32_t magic = ternop::Mma<T>::kMagic;
  float acc[S][4] = {};
  const uint32_t seed = 0x9E3779B9u * (warp + 1) + lane;
  const int b0 = (warp * blocks) % k_blocks;
  for (int i = 0; i < blocks; ++i) {
    const int b = b0 + i < k_blocks ? b0 + i : b0 + i - k_blocks;
    uint32_t xv[1][16];
    ternop::load_x(px + 128 * b, xv[0]);
#pragma unroll
    for (int s = 0; s < S; ++s) {
      const uint32_t h = seed * (2 * i + s + 1);
      const uint32_t wa0 = h ^ 0x5a5a5a5au, wa1 = h + 0x3c3c3c3cu, wb0 = h ^ 0x0f0f0f0fu, wb1 = h + 0x12345678u;
      float c[1][4] = {}, c2[1][4] = {};
      ternop::mma_word<T, 1, 0, true>(wa0, wb0, xv, magic, c);
      ternop::mma_word<T, 1, 1, true>(wa1, wb1, xv, magic, c2);
#pragma unroll
      for (int r = 0; r < 4; ++r) acc[s][r] = fmaf(c[0][r] + c2[0][r], 0.5f, acc[s][r]);
    }
  }
  float total = 0.f;
#pragma unroll
  for (int s = 0; s < S; ++s)
#pragma unroll
    for (int r = 0; r < 4; ++r) total += acc[s][r];
  if (total == 1234.5f) sink[0] = total;
}

struct Config {
  int sets_a_warp, warps_a_cta, blocks_a_warp;
};

int main() {
  const int K = 4096, N = 14336, k_blocks = K / 128, set_blocks = (N / 16) * k_blocks;
  const Config configs[] = {{1, 8, 16}, {1, 8, 8}, {1, 4, 16}, {2, 8, 16}, {2, 8, 8}, {2, 4, 16}, {2, 4, 8}};
  T* x = nullptr;
  float* sink = nullptr;
  CHECK(cudaMalloc(&x, K * sizeof(T)));
  CHECK(cudaMemset(x, 0x3c, K * sizeof(T)));
  CHECK(cudaMalloc(&sink, 4));
  cudaStream_t stream;
  CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  std::printf("%-10s %-10s %-11s %6s %9s\n", "sets/warp", "warps/cta", "blocks/warp", "ctas", "us/call");
  for (const Config& c : configs) {
    const int warps = set_blocks / (c.sets_a_warp * c.blocks_a_warp);
    const int ctas = warps / c.warps_a_cta, threads = 32 * c.warps_a_cta, reps = 200;
    auto launch = [&](int) {
      if (c.sets_a_warp == 1) math_kernel<1><<<ctas, threads, 0, stream>>>(x, k_blocks, c.blocks_a_warp, sink);
      else math_kernel<2><<<ctas, threads, 0, stream>>>(x, k_blocks, c.blocks_a_warp, sink);
    };
    double us = 0.0;
    CHECK(time_graph_us(stream, reps, launch, &us));
    std::printf("%-10d %-10d %-11d %6d %9.2f\n", c.sets_a_warp, c.warps_a_cta, c.blocks_a_warp, ctas, us);
  }
  return 0;
}
