// Hopper primitives the wgmma kernels share (ternary_wgmma.cu, 16-bit x; ternary_wgmma_a8.cu,
// int8 x): the shared-memory matrix descriptor of a 128-byte-swizzled K-major operand, the
// wgmma fences, mbarriers, TMA box loads, the cluster barrier and the host-side tensor map of x. Device code is
// compiled only for sm_90a (TERNOP_HAS_WGMMA); elsewhere these are empty and the kernels trap.

#pragma once

#include <cooperative_groups.h>
#include <cuda.h>
#include <cudaTypedefs.h>
#include <type_traits>

#include "ternary_common.cuh"

// The int32 accumulators d[0..n) of an s8 wgmma as in-out operands of its inline PTX, eight at a time.
#define TERNOP_S32_OUT8(d, i)                                                                              \
  "+r"(d[i]), "+r"(d[i + 1]), "+r"(d[i + 2]), "+r"(d[i + 3]), "+r"(d[i + 4]), "+r"(d[i + 5]), "+r"(d[i + 6]), \
      "+r"(d[i + 7])
#define TERNOP_S32_OUT32(d, i) \
  TERNOP_S32_OUT8(d, i), TERNOP_S32_OUT8(d, i + 8), TERNOP_S32_OUT8(d, i + 16), TERNOP_S32_OUT8(d, i + 24)
#define TERNOP_S32_OUT64(d, i) TERNOP_S32_OUT32(d, i), TERNOP_S32_OUT32(d, i + 32)
#define TERNOP_S32_OUT128(d) TERNOP_S32_OUT64(d, 0), TERNOP_S32_OUT64(d, 64)

namespace ternop {

namespace {

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define TERNOP_HAS_WGMMA 1
#else
#define TERNOP_HAS_WGMMA 0
#endif

// The shared-memory matrix descriptor of a K-major, 128-byte-swizzled B operand at `addr`:
// start address >> 4 (bits 0-13), leading byte offset 16 (bits 16-29; unused by swizzled K-major
// layouts), stride byte offset 1024 between groups of eight tokens (bits 32-45), base offset 0
// (atoms are 1024-byte aligned), swizzle mode 1 = 128 bytes (bits 62-63).
__device__ __forceinline__ uint64_t b_desc(uint32_t addr) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (uint64_t{16 >> 4} << 16) | (uint64_t{1024 >> 4} << 32) |
         (uint64_t{1} << 62);
}

__device__ __forceinline__ void wgmma_fence() {
#if TERNOP_HAS_WGMMA
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#endif
}

__device__ __forceinline__ void wgmma_commit() {
#if TERNOP_HAS_WGMMA
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
#endif
}

template <int N>
__device__ __forceinline__ void wgmma_wait() {
#if TERNOP_HAS_WGMMA
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
#endif
}

// mbarriers: the tensor-memory-access unit signals one when a stage's tiles have landed; in the
// warp-specialised kernel, consumers signal another when they are done with a stage.
__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count = 1) {
#if TERNOP_HAS_WGMMA
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
#endif
}

__device__ __forceinline__ void mbar_init_fence() {
#if TERNOP_HAS_WGMMA
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#endif
}

__device__ __forceinline__ void mbar_expect(uint32_t bar, uint32_t bytes) {
#if TERNOP_HAS_WGMMA
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
#endif
}

// One arrival on `bar` (a consumer releasing a stage to the producer).
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
#if TERNOP_HAS_WGMMA
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
#endif
}

__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
#if TERNOP_HAS_WGMMA
  asm volatile(
      "{\n.reg .pred done;\nWAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
#endif
}

// One box of a 2-D tensor map (x_tensor_map: 128 bytes of a row x `tokens` rows, 128-byte
// swizzled) at (byte k_byte of the row, row m) into shared memory; `bar` counts its bytes.
__device__ __forceinline__ void tma_load(uint32_t dst, const CUtensorMap* map, int k_byte, int m, uint32_t bar) {
#if TERNOP_HAS_WGMMA
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];" ::"r"(
          dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(k_byte), "r"(m), "r"(bar)
      : "memory");
#endif
}

// Warp-specialised kernels move registers between warpgroups: a producer warpgroup that only issues
// TMA gives registers back to the CTA's pool (dec), the warpgroups holding accumulators take them
// (inc, which waits until the pool has them). Every warp of a warpgroup runs the same one.
template <int N>
__device__ __forceinline__ void setmaxnreg_dec() {
#if TERNOP_HAS_WGMMA
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(N));
#endif
}

template <int N>
__device__ __forceinline__ void setmaxnreg_inc() {
#if TERNOP_HAS_WGMMA
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(N));
#endif
}

// Keeps the compiler from moving reads or writes of the accumulators across a wgmma wait.
template <int R>
__device__ __forceinline__ void fence_acc(float (&d)[R]) {
#pragma unroll
  for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

template <int R>
__device__ __forceinline__ void fence_acc(int32_t (&d)[R]) {
#pragma unroll
  for (int i = 0; i < R; ++i) asm volatile("" : "+r"(d[i])::"memory");
}

// The tensor map of a byte matrix [rows of row_bytes bytes, ld_bytes apart] whose box is
// box_bytes x box_rows, with the given shared-memory swizzle; rows past `rows` read as zero.
// The encoder is a driver function, looked up once through the runtime (no link against the
// driver library).
inline cudaError_t byte_tensor_map(CUtensorMap* map, const void* base, int64_t ld_bytes, int rows, int64_t row_bytes,
                                   int box_bytes, int box_rows, CUtensorMapSwizzle swizzle) {
  static PFN_cuTensorMapEncodeTiled_v12000 encode = nullptr;
  if (encode == nullptr) {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found;
    const cudaError_t err = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault,
                                                             &found);
    if (err != cudaSuccess || found != cudaDriverEntryPointSuccess || fn == nullptr) return cudaErrorNotSupported;
    encode = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(row_bytes), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(ld_bytes)};
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(box_bytes), static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t steps[2] = {1, 1};
  const CUresult r = encode(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, const_cast<void*>(base), dims, strides, box, steps,
                            CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

// The tensor map of x [M rows of row_bytes bytes, rows ld_bytes apart] read as bytes, whose box is
// 128 bytes x `tokens` rows, 128-byte swizzled as the wgmma descriptor reads a K-major operand;
// rows past M read as zero.
inline cudaError_t x_tensor_map(CUtensorMap* map, const void* x, int64_t ld_bytes, int M, int64_t row_bytes,
                                int tokens) {
  return byte_tensor_map(map, x, ld_bytes, M, row_bytes, 128, tokens, CU_TENSOR_MAP_SWIZZLE_128B);
}

// The tensor map of the codes [N rows of K / 4 bytes] in a ternary layout, whose box is one scale
// block (32 bytes) x `rows` rows, unswizzled; rows past N read as zero.
inline cudaError_t codes_tensor_map(CUtensorMap* map, const uint8_t* wp, int N, int K, int rows) {
  return byte_tensor_map(map, wp, K / 4, N, K / 4, 32, rows, CU_TENSOR_MAP_SWIZZLE_NONE);
}

// The launch configuration of `grid` CTAs of `threads` threads and `smem` bytes of dynamic shared
// memory: as clusters of grid.z CTAs along z when `clustered`, through `cluster`, which must
// outlive the config.
inline cudaLaunchConfig_t z_cluster_config(dim3 grid, int threads, int smem, cudaStream_t stream, bool clustered,
                                           cudaLaunchAttribute& cluster) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = dim3(threads);
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cluster = {};
  cluster.id = cudaLaunchAttributeClusterDimension;
  cluster.val.clusterDim.x = 1;
  cluster.val.clusterDim.y = 1;
  cluster.val.clusterDim.z = grid.z;
  config.attrs = &cluster;
  config.numAttrs = clustered ? 1 : 0;
  return config;
}

// Every thread of the cluster's CTAs arrives, then waits for all of them.
__device__ __forceinline__ void cluster_sync() {
#if TERNOP_HAS_WGMMA
  cooperative_groups::this_cluster().sync();
#endif
}

// A CTA's output tile, staged in shared memory as [kTokens tokens x kRows weight rows] of E (token
// rows kPitch bytes apart), to dst [M, N] at token m0 and row n0: 16-byte stores along each token's
// row, element by element where N is not a multiple of 16 bytes; rows past N and tokens past M are
// left out. Thread `tid` of `threads` that share the copy.
template <typename E, int kTokens, int kRows, int kPitch>
__device__ __forceinline__ void copy_tile_out(const uint8_t* tile, E* __restrict__ dst, int m0, int M, int n0, int N,
                                              int tid, int threads) {
  constexpr int V = 16 / static_cast<int>(sizeof(E)), kChunks = kRows / V;
  const bool vector = N % V == 0;
  for (int i = tid; i < kTokens * kChunks; i += threads) {
    const int t = i / kChunks, c = i % kChunks;
    const int m = m0 + t, n = n0 + c * V;
    if (m >= M || n >= N) continue;
    const uint8_t* src = tile + t * kPitch + c * 16;
    E* d = dst + static_cast<int64_t>(m) * N + n;
    if (vector) {
      *reinterpret_cast<uint4*>(d) = *reinterpret_cast<const uint4*>(src);
    } else {
      for (int e = 0; e < V && n + e < N; ++e) d[e] = reinterpret_cast<const E*>(src)[e];
    }
  }
}

// E outputs of one token from column n of a row of N (d points at the first): one 8- or 16-byte
// store where N is a multiple of E (so is n, so the run is in bounds and aligned), element by
// element up to N otherwise. The epilogues that add the CTAs of a split of K store through it.
template <typename T, int E>
__device__ __forceinline__ void store_run(T* __restrict__ d, int n, int N, const T (&o)[E]) {
  constexpr int kBytes = static_cast<int>(sizeof(T)) * E;
  static_assert(kBytes == 8 || kBytes == 16, "one 8- or 16-byte store");
  using V = std::conditional_t<kBytes == 16, uint4, uint2>;
  if (N % E == 0) {
    V packed;
    T* p = reinterpret_cast<T*>(&packed);
#pragma unroll
    for (int e = 0; e < E; ++e) p[e] = o[e];
    *reinterpret_cast<V*>(d) = packed;
  } else {
    for (int e = 0; e < E && n + e < N; ++e) d[e] = o[e];
  }
}

}  // namespace

}  // namespace ternop
