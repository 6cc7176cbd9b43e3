// How fast the small-M kernels' weight reads can go, apart from their arithmetic: only the loads
// of cuda_mma_a8 at M = 1 (ternop/cuda/csrc/ternary_mma_a8.cu), with its grid, warps and loads in
// flight, against the same bytes laid out so that each warp reads them contiguously.
//
//   rows:   the v1 / a8 layout. Lane (g, q) of a warp reads 8 bytes of row g and 8 of row g + 8
//           per 128-wide block (bytes 32b + 8q of the row): each load instruction touches eight
//           rows, 32 bytes each, and a row's next 32 bytes are read one block later.
//   tiles:  the same 512 bytes per (16 rows, block), stored contiguously, one 16-byte load a lane.
//   persist: the v1 / a8 loads from a few CTAs an SM, each walking row groups a grid apart.
//   stream: every thread of a plain grid reads 16-byte vectors in order (what a copy reaches).
//   rows-kS: rows with one set a CTA, S CTAs sharing each set's K (split-K: the kernel would
//           then add S int32 partials, exact in any order with row scales).
//   bulk:   one set a CTA of four or eight warps; each warp has the tensor-memory-access unit copy its range
//           of blocks of the 16 rows into shared memory (cp.async.bulk, `depth` chunks a warp, one
//           mbarrier each), then reads them as the small-M kernels' lanes do (8 bytes of rows g and
//           g + 8 a block): the feed of the bulk-copy kernel of aaef170, without its arithmetic.
//
// Each kernel XORs what it read into one word per warp, so nothing is optimised away. Weights
// rotate over copies that together pass 200 MB (four times the L2).
//
//     nvcc -O3 -arch=sm_90a -o probe_weight_reads benchmarks/probe_weight_reads.cu && ./probe_weight_reads [rows,bulk,...]
#include <cstdio>
#include <cstdint>
#include <algorithm>

#include <cuda_runtime.h>

#include "../ternop/cuda/csrc/ternary_a16.cuh"    // smem_addr
#include "../ternop/cuda/csrc/ternary_wgmma.cuh"  // mbarriers and bulk copies (sm_90a)
#include "probe_timing.cuh"


constexpr int kWarps = 8;

__device__ __forceinline__ uint2 ld8(const uint8_t* p) {
  uint2 r;
  asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];" : "=r"(r.x), "=r"(r.y) : "l"(p));
  return r;
}

__device__ __forceinline__ uint4 ld16(const uint8_t* p) {
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(p));
  return r;
}

// The warp of set `set`, split `warp` of warps_k: its 16 rows and its range of scale blocks.
struct WarpWork {
  int n0, b_begin, count;
};

__device__ __forceinline__ WarpWork warp_work(int N, int K, int warps_log2) {
  const int warps = 1 << warps_log2;
  const int set = threadIdx.x >> (5 + warps_log2), warp = (threadIdx.x >> 5) & (warps - 1);
  const int n0 = (blockIdx.x * (blockDim.x >> (5 + warps_log2)) + set) * 16;
  // Split-K over CTAs: CTA (x, y) of a grid gridDim.y high takes slice y of the scale blocks.
  const int blocks = K / 128, slices = gridDim.y;
  const int per_slice = (blocks + slices - 1) / slices;
  const int s_begin = min(static_cast<int>(blockIdx.y) * per_slice, blocks);
  const int s_end = min(s_begin + per_slice, blocks);
  const int per_warp = (s_end - s_begin + warps - 1) / warps;
  const int b_begin = min(s_begin + warp * per_warp, s_end);
  return {n0, b_begin, min(per_warp, s_end - b_begin)};
}

// The order in which a warp walks its blocks. kInOrder: its range front to back (the kernel's
// order). kRotated: the same range, started at (row group mod count) and wrapped, so that the row
// groups in flight at one time read different K offsets instead of all the same one. kInterleaved:
// the set's warps take turns block by block (warp w reads w, w + warps, ...), so that at one time
// they read neighbouring 32 bytes of each row.
enum Order { kInOrder, kRotated, kInterleaved };

__device__ __forceinline__ WarpWork ordered_work(int N, int K, int warps_log2, Order order) {
  WarpWork ww = warp_work(N, K, warps_log2);
  if (order == kInterleaved) {  // (without split-K)
    const int warps = 1 << warps_log2, warp = (threadIdx.x >> 5) & (warps - 1), blocks = K / 128;
    ww.b_begin = warp;
    ww.count = warp < blocks ? (blocks - warp + warps - 1) / warps : 0;
  }
  return ww;
}

// Block of step i (0 <= i < ww.count) in the given order.
__device__ __forceinline__ int block_of(const WarpWork& ww, int i, Order order, int warps_log2) {
  if (order == kRotated) return ww.b_begin + (i + ww.n0 / 16) % ww.count;
  if (order == kInterleaved) return ww.b_begin + (i << warps_log2);
  return ww.b_begin + i;
}

template <int D>
__global__ void __launch_bounds__(kWarps * 32, 4) rows_kernel(const uint8_t* __restrict__ w, int N, int K,
                                                              int warps_log2, Order order, uint32_t* sink) {
  const WarpWork ww = ordered_work(N, K, warps_log2, order);
  const int lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
  const size_t row_bytes = static_cast<size_t>(K) / 4;
  const int r0 = ww.n0 + g < N ? ww.n0 + g : 0, r1 = ww.n0 + g + 8 < N ? ww.n0 + g + 8 : 0;
  const uint8_t* p0 = w + r0 * row_bytes + 8 * q;
  const uint8_t* p1 = w + r1 * row_bytes + 8 * q;
  auto at = [&](int i) { return 32 * block_of(ww, i, order, warps_log2); };
  uint2 buf[D][2];
#pragma unroll
  for (int d = 0; d < D; ++d)
    if (d < ww.count) buf[d][0] = ld8(p0 + at(d)), buf[d][1] = ld8(p1 + at(d));
  uint32_t acc = 0;
  for (int b = 0; b < ww.count; b += D) {
#pragma unroll
    for (int d = 0; d < D; ++d) {
      if (b + d < ww.count) {
        acc ^= buf[d][0].x ^ buf[d][0].y ^ buf[d][1].x ^ buf[d][1].y;
        if (b + d + D < ww.count) buf[d][0] = ld8(p0 + at(b + d + D)), buf[d][1] = ld8(p1 + at(b + d + D));
      }
    }
  }
  if (acc == 0x9e3779b9u) sink[0] = acc;
}

// Tile (n0 / 16) holds its blocks one after the other, 512 bytes each.
template <int D>
__global__ void __launch_bounds__(kWarps * 32, 4) tiles_kernel(const uint8_t* __restrict__ w, int N, int K,
                                                               int warps_log2, Order order, uint32_t* sink) {
  const WarpWork ww = ordered_work(N, K, warps_log2, order);
  const int lane = threadIdx.x % 32;
  const int tile = ww.n0 < N ? ww.n0 / 16 : 0;
  const uint8_t* p = w + static_cast<size_t>(tile) * 16 * (K / 4) + 16 * lane;
  auto at = [&](int i) { return 512 * block_of(ww, i, order, warps_log2); };
  uint4 buf[D];
#pragma unroll
  for (int d = 0; d < D; ++d)
    if (d < ww.count) buf[d] = ld16(p + at(d));
  uint32_t acc = 0;
  for (int b = 0; b < ww.count; b += D) {
#pragma unroll
    for (int d = 0; d < D; ++d) {
      if (b + d < ww.count) {
        acc ^= buf[d].x ^ buf[d].y ^ buf[d].z ^ buf[d].w;
        if (b + d + D < ww.count) buf[d] = ld16(p + at(b + d + D));
      }
    }
  }
  if (acc == 0x9e3779b9u) sink[0] = acc;
}

// Persistent: gridDim.x CTAs (a few an SM) of the rule's warps; set r of CTA c takes the row
// groups c * R + r, then that plus gridDim.x * R, and so on, so the groups in flight across the GPU
// form one contiguous window of the weights that moves through memory in order. Each warp keeps D
// blocks of loads in flight across the groups it walks.
template <int D>
__global__ void __launch_bounds__(kWarps * 32, 4) persistent_kernel(const uint8_t* __restrict__ w, int N, int K,
                                                                    int warps_log2, uint32_t* sink) {
  const WarpWork ww = warp_work(N, K, warps_log2);  // its n0 / 16 is this warp's first group
  const int b_begin = ww.b_begin, count = ww.count;
  const int lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
  const int n_groups = (N + 15) / 16, first = ww.n0 / 16, stride = gridDim.x * (blockDim.x >> (5 + warps_log2));
  if (count <= 0 || first >= n_groups) return;
  const int mine = (n_groups - first + stride - 1) / stride;
  const int steps = mine * count;
  const size_t row_bytes = static_cast<size_t>(K) / 4;
  auto addr = [&](int s, int r8) {  // step s: group first + (s / count) * stride, block s % count
    const int grp = first + (s / count) * stride;
    int row = grp * 16 + g + r8;
    row = row < N ? row : 0;
    return w + row * row_bytes + (b_begin + s % count) * 32 + 8 * q;
  };
  uint2 buf[D][2];
#pragma unroll
  for (int d = 0; d < D; ++d)
    if (d < steps) buf[d][0] = ld8(addr(d, 0)), buf[d][1] = ld8(addr(d, 8));
  uint32_t acc = 0;
  for (int s = 0; s < steps; s += D) {
#pragma unroll
    for (int d = 0; d < D; ++d) {
      if (s + d < steps) {
        acc ^= buf[d][0].x ^ buf[d][0].y ^ buf[d][1].x ^ buf[d][1].y;
        if (s + d + D < steps) buf[d][0] = ld8(addr(s + d + D, 0)), buf[d][1] = ld8(addr(s + d + D, 8));
      }
    }
  }
  if (acc == 0x9e3779b9u) sink[0] = acc;
}

// See "bulk" above. Shared memory: the mbarriers, then 16 rows `stride` bytes apart (an odd multiple
// of 32, as the kernel had them).
constexpr int kBulkHeader = 512;

// `bytes` (a multiple of 16) from global `src` to shared `dst`, counted by `bar`.
__device__ __forceinline__ void bulk_load(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}

__host__ __device__ inline int bulk_stride(int K) { return K / 4 + ((K / 128) % 2 == 0 ? 32 : 0); }

__global__ void __launch_bounds__(kWarps * 32) bulk_kernel(const uint8_t* __restrict__ w, int N, int K, int chunks,
                                                           uint32_t* sink) {
  extern __shared__ __align__(128) uint8_t smem[];
  const int warps = blockDim.x / 32, warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
  const int blocks = K / 128, n0 = blockIdx.x * 16, rows = min(16, N - n0), stride = bulk_stride(K);
  const int per = (blocks + warps - 1) / warps, b0 = min(warp * per, blocks), count = min(per, blocks - b0);
  const int chunk = (count + chunks - 1) / chunks, nch = chunk > 0 ? (count + chunk - 1) / chunk : 0;
  const uint32_t bars = ternop::smem_addr(smem), mine = bars + 8 * chunks * warp;
  if (threadIdx.x == 0) {
    for (int i = 0; i < warps * chunks; ++i) ternop::mbar_init(bars + 8 * i, 1);
    ternop::mbar_init_fence();
  }
  __syncthreads();
  uint8_t* codes = smem + kBulkHeader;
  const size_t row_bytes = static_cast<size_t>(K) / 4;
  if (lane == 0)
    for (int c = 0; c < nch; ++c) ternop::mbar_expect(mine + 8 * c, rows * 32 * min(chunk, count - c * chunk));
  __syncwarp();
  for (int i = lane; i < 16 * nch; i += 32) {
    const int r = i % 16, c = i / 16, b = b0 + c * chunk;
    if (r < rows)
      bulk_load(ternop::smem_addr(codes + r * stride + 32 * b), w + (n0 + r) * row_bytes + 32 * b,
                32 * min(chunk, count - c * chunk), mine + 8 * c);
  }
  uint32_t acc = 0;
  for (int c = 0; c < nch; ++c) {
    ternop::mbar_wait(mine + 8 * c, 0);
    for (int b = b0 + c * chunk; b < b0 + min(count, (c + 1) * chunk); ++b) {
      const uint2 a = *reinterpret_cast<const uint2*>(codes + g * stride + 32 * b + 8 * q);
      const uint2 e = *reinterpret_cast<const uint2*>(codes + (g + 8) * stride + 32 * b + 8 * q);
      acc ^= a.x ^ a.y ^ e.x ^ e.y;
    }
  }
  if (acc == 0x9e3779b9u) sink[0] = acc;
}

// U 16-byte loads in flight a thread.
template <int U>
__global__ void stream_kernel(const uint4* __restrict__ w, size_t vecs, uint32_t* sink) {
  uint32_t acc = 0;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < vecs; i += U * stride) {
    uint4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u)
      v[u] = i + u * stride < vecs ? ld16(reinterpret_cast<const uint8_t*>(w + i + u * stride)) : uint4{};
#pragma unroll
    for (int u = 0; u < U; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  if (acc == 0x9e3779b9u) sink[0] = acc;
}

// small_m_split of ternary_common.cuh (M = 1 grid).
// `force` > 0 takes that many sets instead of the rule's.
static void split(int N, int K, int sms, int force, int* groups, int* warps_log2) {
  const int blocks = K / 128;
  int w = 1;
  while (w < kWarps && blocks / (2 * w) >= 2) w *= 2;
  int r = 1;
  while (2 * r <= kWarps && 2 * ((N + 32 * r - 1) / (32 * r)) >= 3 * sms) r *= 2;
  if (force > 0) r = force;
  const int warps_k = r >= w ? 1 : w / r;
  int l = 0;
  while ((1 << l) < warps_k) ++l;
  *groups = r;
  *warps_log2 = l;
}

enum Kind { kRows, kTiles, kStream, kPersistent, kBulk };
const char* const kNames[] = {"rows", "tiles", "stream", "persist", "bulk"};
// depth: blocks in flight a warp (rows, tiles), 16-byte loads in flight a thread (stream) or
// bulk copies a warp a row (bulk, whose CTAs are one set of `threads`);
// sets: sets of 16 rows a CTA, 0 for small_m_split's rule; stream: CTAs an SM and threads a CTA.
// ksplit: CTAs that share a set's K (rows only), each reading 1 / ksplit of it.
struct Config {
  Kind kind;
  int depth, sets, ctas_per_sm, threads;
  Order order = kInOrder;
  int ksplit = 1;
};
const Config configs[] = {
    {kRows, 2, 0, 0, 0},   {kRows, 4, 0, 0, 0},   {kRows, 8, 0, 0, 0},    {kRows, 4, 1, 0, 0},
    {kRows, 4, 2, 0, 0},   {kRows, 4, 4, 0, 0},   {kRows, 8, 2, 0, 0},    {kTiles, 4, 0, 0, 0},
    {kStream, 1, 0, 4, 512}, {kStream, 4, 0, 4, 512}, {kStream, 4, 0, 2, 256}, {kStream, 4, 0, 1, 256},
    {kStream, 1, 0, 2, 256},
    {kPersistent, 4, 1, 2, 0}, {kPersistent, 4, 1, 4, 0}, {kPersistent, 8, 1, 2, 0}, {kPersistent, 8, 1, 4, 0},
    {kPersistent, 4, 2, 4, 0}, {kPersistent, 8, 0, 4, 0},
    {kRows, 2, 0, 0, 0, kRotated},  {kRows, 4, 0, 0, 0, kRotated},  {kRows, 4, 1, 0, 0, kRotated},
    {kRows, 2, 0, 0, 0, kInterleaved}, {kRows, 4, 0, 0, 0, kInterleaved}, {kRows, 4, 1, 0, 0, kInterleaved},
    {kTiles, 4, 0, 0, 0, kRotated}, {kTiles, 4, 0, 0, 0, kInterleaved},
    {kRows, 4, 1, 0, 0, kInOrder, 2}, {kRows, 4, 1, 0, 0, kInOrder, 4}, {kRows, 2, 1, 0, 0, kInOrder, 4},
    {kRows, 8, 1, 0, 0, kInOrder, 2},
    {kBulk, 1, 1, 0, 128}, {kBulk, 2, 1, 0, 128}, {kBulk, 4, 1, 0, 128}, {kBulk, 1, 1, 0, 256},
};
const char* const kOrderNames[] = {"", "-rot", "-il"};

// With an argument, only the patterns it names (comma-separated, e.g. "rows,bulk,stream").
int main(int argc, char** argv) {
  const char* only = argc > 1 ? argv[1] : nullptr;
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const int shapes[][2] = {{4096, 4096}, {4096, 6144}, {4096, 14336}, {4096, 28672}, {14336, 4096},
                           {2560, 3840}, {2560, 2560}, {2560, 13824}, {6912, 2560}, {1024, 4096}};
  uint32_t* sink = nullptr;
  CHECK(cudaMalloc(&sink, 4));
  cudaStream_t stream;
  CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  std::printf("%-13s %-11s %5s %5s %6s %7s %9s %7s\n", "K x N", "pattern", "depth", "sets", "ctas", "threads",
              "us/call", "TB/s");
  for (const auto& s : shapes) {
    const int K = s[0], N = s[1];
    const size_t bytes = static_cast<size_t>(N) * K / 4;
    const int copies = static_cast<int>((200u << 20) / bytes) + 2;
    uint8_t* w = nullptr;
    CHECK(cudaMalloc(&w, bytes * copies));
    CHECK(cudaMemset(w, 0x5a, bytes * copies));
    const int reps = 20 * copies;
    for (const Config& c : configs) {
      int groups = 0, warps_log2 = 0;
      split(N, K, sms, c.sets, &groups, &warps_log2);
      if (!named_in(only, kNames[c.kind])) continue;
      const bool own_threads = c.kind == kStream || c.kind == kBulk;
      const int threads = own_threads ? c.threads : groups * (1 << warps_log2) * 32;
      int ctas = c.kind == kStream ? c.ctas_per_sm * sms : (N + 16 * groups - 1) / (16 * groups);
      if (c.kind == kPersistent) ctas = std::min(ctas, c.ctas_per_sm * sms);
      if (!own_threads && threads != kWarps * 32) continue;  // the kernels' 8 warps only
      const int bulk_smem = kBulkHeader + 16 * bulk_stride(K);
      if (c.kind == kBulk) {
        if (bulk_smem > 227 * 1024) continue;
        CHECK(cudaFuncSetAttribute(bulk_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bulk_smem));
      }
      auto launch = [&](int i) {
        const uint8_t* wi = w + bytes * (i % copies);
        const uint4* wv = reinterpret_cast<const uint4*>(wi);
        if (c.kind == kRows && c.depth == 2) rows_kernel<2><<<dim3(ctas, c.ksplit), threads, 0, stream>>>(wi, N, K, warps_log2, c.order, sink);
        if (c.kind == kRows && c.depth == 4) rows_kernel<4><<<dim3(ctas, c.ksplit), threads, 0, stream>>>(wi, N, K, warps_log2, c.order, sink);
        if (c.kind == kRows && c.depth == 8) rows_kernel<8><<<dim3(ctas, c.ksplit), threads, 0, stream>>>(wi, N, K, warps_log2, c.order, sink);
        if (c.kind == kTiles && c.depth == 4) tiles_kernel<4><<<ctas, threads, 0, stream>>>(wi, N, K, warps_log2, c.order, sink);
        if (c.kind == kPersistent && c.depth == 4) persistent_kernel<4><<<ctas, threads, 0, stream>>>(wi, N, K, warps_log2, sink);
        if (c.kind == kPersistent && c.depth == 8) persistent_kernel<8><<<ctas, threads, 0, stream>>>(wi, N, K, warps_log2, sink);
        if (c.kind == kStream && c.depth == 1) stream_kernel<1><<<ctas, threads, 0, stream>>>(wv, bytes / 16, sink);
        if (c.kind == kStream && c.depth == 4) stream_kernel<4><<<ctas, threads, 0, stream>>>(wv, bytes / 16, sink);
        if (c.kind == kBulk) bulk_kernel<<<ctas, threads, bulk_smem, stream>>>(wi, N, K, c.depth, sink);
      };
      double us = 0.0;
      CHECK(time_graph_us(stream, reps, launch, &us));
      char name[16];
      std::snprintf(name, sizeof name, "%s%s", kNames[c.kind], kOrderNames[c.order]);
      if (c.ksplit > 1) std::snprintf(name, sizeof name, "%s-k%d", kNames[c.kind], c.ksplit);
      std::printf("%5dx%-7d %-11s %5d %5d %6d %7d %9.2f %7.2f\n", K, N, name, c.depth,
                  c.kind == kStream ? 0 : groups, ctas * c.ksplit, threads, us, bytes / us * 1e-6);
    }
    CHECK(cudaFree(w));
  }
  return 0;
}
