// Large-M W2A8 ternary linear on Hopper's int8 warpgroup tensor cores, weights in the "a8" layout:
//
//   out[m, n] = s_x[m] * sum_b P[m, n, b] * scale[n, b] (+ bias[n]),
//   P[m, n, b] = sum_{k in block b} q[m, k] * v[n, k]   (int32, exact)
//
// as in ternary_mma_a8.cu (q int8 [M, K] and s_x fp32 [M] from the per-token quantization,
// ternop/activations.py). Needs sm_90a; elsewhere the kernel traps and the registry never
// launches it. Like ternary_wgmma.cu (read it first), it runs out^T = W q^T with the decoded
// weights as the register A operand of wgmma m64nBTk32 s8 and q staged by TMA in the 128-byte
// swizzle (one 128-byte row a token is one scale block). A CTA has 128 weight rows and BT tokens.
//
// Warp roles. One producer warp issues, per 128-k block, two TMA loads into a stage: q's tile and
// the block's codes (32 bytes of each row; rows past N read as zero, which decodes to weight 0),
// both counted by the stage's "full" mbarrier. Two consumer warpgroups (64 rows each) wait for a
// stage, decode, run the block's four wgmmas, release the stage (its "empty" mbarrier, which the
// producer waits on before reusing it) and scale the partials.
//
// Ping-pong. The block's int32 partials have to be scaled into fp32 on the CUDA cores, about as
// long as the block's wgmmas take on the tensor cores. The two warpgroups take turns on the
// tensor cores (two named barriers order them; a warpgroup hands the turn over when its wgmmas
// have completed): while one warpgroup's wgmmas run, the other scales its partials and decodes
// its next block. The first version ran both warpgroups in lockstep, draining the tensor cores
// for each block's scaling, and reached 0.55-0.78x of cuBLAS bf16 (docs/KERNELS.md).
//
// Decoding. Lane (g, q) needs, of rows g and g + 8, the weights 4q..4q+3 and 16+4q..16+4q+3 of
// each 32-wide k step s (words 2s and 2s + 1 of the row's block), in natural k order: the a8
// layout holds them in the nibbles of the word shifted right by (0, 2, 16, 18)[q], and one
// PRMT into the table 0x00FF0100 = int8 (0, +1, -1, 0) turns four masked nibbles into four int8
// weights (three instructions a register of four weights).
//
// Block partials. A block's four wgmmas accumulate P exactly in int32 (the first overwrites,
// scale-d 0). The warpgroup adds P * scale[n, b] into the fp32 accumulators in block order (fmaf,
// as ternary_mma_a8.cu does). P (|P| <= 127 * 128) becomes fp32 by the exponent trick: the bits
// of 1.5 * 2^23 + P, minus 1.5 * 2^23; an integer add and a float add instead of a conversion
// instruction, whose throughput is a fraction of the adders'.
// The epilogue multiplies by s_x[m] and then adds the bias, two fp32 roundings as in the spec.
//
// Split-K (row scales only). Where a launch has fewer CTAs than SMs (narrow layers at small M),
// the row form splits K over a cluster of 2, 4 or 8 CTAs along z. Each CTA leaves its int32 sums
// in its shared memory; after a cluster barrier each adds, for its share of the tile's tokens, the
// cluster's sums through distributed shared memory and runs the epilogue. An int32 sum is exact in
// any order, so a split changes no bit of the output. The block-scale form does not split: its
// fp32 sums would round differently.

#include "ternary_a16.cuh"  // smem_addr
#include "ternary_wgmma.cuh"

namespace ternop {

template <typename T>
cudaError_t launch_ternary_wgmma_a8_ss(const int8_t* q, const float* qs, const uint8_t* wp, const __half* ws,
                                       const T* bias, T* out, int M, int N, int K, int tokens, cudaStream_t stream);

namespace {

constexpr int kConsumersA8 = 256;  // the turn-taking (block-scale) form: two consumer warpgroups
constexpr uint32_t kTableA8 = 0x00FF0100u;     // int8 value of code 0b00, 0b01, 0b10, 0b11

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
        : TERNOP_S32_OUT32(d, 0)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(scale_d));
  }
};

template <>
struct WgmmaS8<128> {
  __device__ __forceinline__ static void run(uint32_t scale_d, int32_t (&d)[64], const uint32_t (&a)[4], uint64_t desc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k32.s32.s8.s8 "
        "{"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
        "}, {%64, %65, %66, %67}, %68, p;\n}\n"
        : TERNOP_S32_OUT64(d, 0)
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

// A CTA's tile: BT tokens, kGroups consumer warpgroups of 64 weight rows each, kStages stages.
template <int BT_, int kStages_, int kGroups_ = 2>
struct A8Tile {
  static constexpr int BT = BT_, kStages = kStages_, kGroups = kGroups_;
  static constexpr int kRows = 64 * kGroups;           // weight rows of a CTA
  static constexpr int kConsumers = 128 * kGroups;     // consumer threads
  static constexpr int kThreads = kConsumers + 32;     // and the producer warp
  static constexpr int kCodeBytes = kRows * 32;        // a block's codes in shared memory, 32 bytes a row
  static constexpr int kXBytes = BT * 128;  // one block of q: 128 int8 a token
  static constexpr int kStageBytes = (kXBytes + kCodeBytes + 1023) / 1024 * 1024;
  static constexpr int kSmemBytes = kStages * kStageBytes + 1024;
  static_assert(kSmemBytes <= 227 * 1024, "shared memory of one SM");
};

// Four int8 weights of a word of codes: the nibbles of (word >> shift) masked to codes, as byte
// selectors into the value table.
__device__ __forceinline__ uint32_t quad_a8(uint32_t word, uint32_t shift) {
  uint32_t r;
  asm("prmt.b32 %0, %1, 0, %2;" : "=r"(r) : "r"(kTableA8), "r"((word >> shift) & 0x3333u));
  return r;
}

// A block's 32 code bytes of this lane's rows (row, row + 8), decoded into the A fragments of its
// four 32-wide k steps.
__device__ __forceinline__ void decode_block_a8(const uint8_t* codes, uint32_t shift, uint32_t (&a)[4][4]) {
  const uint4 w0a = *reinterpret_cast<const uint4*>(codes);
  const uint4 w0b = *reinterpret_cast<const uint4*>(codes + 16);
  const uint4 w1a = *reinterpret_cast<const uint4*>(codes + 8 * 32);
  const uint4 w1b = *reinterpret_cast<const uint4*>(codes + 8 * 32 + 16);
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

// Named barriers 1 and 2 over the two consumer warpgroups: a warpgroup syncs on its own to wait for
// its turn on the tensor cores, and arrives on the other's to hand the turn over.
__device__ __forceinline__ void turn_wait(int id) { asm volatile("bar.sync %0, %1;" ::"r"(id), "n"(kConsumersA8) : "memory"); }
__device__ __forceinline__ void turn_pass(int id) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "n"(kConsumersA8) : "memory");
}

// An output from its fp32 sum before the token scale (value), the token's scale and the row's bias.
// Two roundings, as the spec has them (no contraction into one FMA): the token scale, then the bias.
template <typename T>
__device__ __forceinline__ T scaled_out(float value, float sx, float bv) {
  return Fp<T>::from_float(__fadd_rn(__fmul_rn(value, sx), bv));
}

// A lane's outputs: accumulator 4j + r is weight row n0 + row + 8 (r / 2), token m0 + 8j + 2q + r % 2;
// value(i) is accumulator i's fp32 sum before the token scale. The two rows' bias and the lane's
// token scales are read before any store (indices clamped into the tensors), so that their loads
// are in flight together: read beside each store, inside its bounds check, each waited for the
// one before.
template <typename T, int R, typename Value>
__device__ __forceinline__ void store_tile(T* __restrict__ out, const float* __restrict__ qs,
                                           const T* __restrict__ bias, int M, int N, int n0, int m0, int row, int q,
                                           Value&& value) {
  const int na = n0 + row, nb = na + 8;
  const float bva = bias != nullptr ? Fp<T>::to_float(bias[min(na, N - 1)]) : 0.f;
  const float bvb = bias != nullptr ? Fp<T>::to_float(bias[min(nb, N - 1)]) : 0.f;
  float sx[R / 2];  // token m0 + 8j + 2q + i at 2j + i
#pragma unroll
  for (int i = 0; i < R / 2; ++i) sx[i] = qs[min(m0 + 8 * (i / 2) + 2 * q + (i & 1), M - 1)];
#pragma unroll
  for (int j = 0; j < R / 4; ++j)
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int n = r < 2 ? na : nb;
      const int m = m0 + 8 * j + 2 * q + (r & 1);
      if (n < N && m < M)
        out[static_cast<int64_t>(m) * N + n] = scaled_out<T>(value(4 * j + r), sx[2 * j + (r & 1)], r < 2 ? bva : bvb);
    }
}

// The epilogue of a CTA of a split of K (row scales; one of the cluster's S = gridDim.z CTAs, rank
// blockIdx.z). Once every consumer warp's wgmmas are done with the stages, its int32 sums go to
// shared memory as [BT tokens x kRows rows] (a pitch of kRows + 4 words: the lanes of a warp store
// to 32 different banks); after a cluster barrier it adds, for tokens [rank BT / S, (rank + 1) BT / S),
// the S CTAs' sums and stores them scaled. The second barrier keeps every CTA's shared memory alive
// until the last reader is done.
//
// A thread adds four rows of a token at a time: one 16-byte load from each CTA of the cluster, all
// of them issued before the first add (the loop over the ranks is unrolled to the largest split and
// predicated), so that a token waits for one round trip through distributed shared memory, not S.
// The form before read one int32 a rank and a token, each load waited for before the next, so every
// CTA waited for BT / 2 round trips in series whatever the split (32 for the 64-token tile).
template <typename T, typename Cfg, int R>
__device__ __forceinline__ void split_reduce_store(uint8_t* smem, const int32_t (&part)[R], int row, int q,
                                                   const float* __restrict__ qs, const __half* __restrict__ ws,
                                                   const T* __restrict__ bias, T* __restrict__ out, int M, int N,
                                                   int n0, int m0) {
#if TERNOP_HAS_WGMMA
  constexpr int kPitch = Cfg::kRows + 4;  // words; 16-byte aligned rows for the loads below
  static_assert(Cfg::BT * kPitch * 4 <= Cfg::kStages * Cfg::kStageBytes, "the sums fit in the stages");
  static_assert(kPitch % 4 == 0, "a token's sums start on 16 bytes");
  int32_t* sums = reinterpret_cast<int32_t*>(smem);
  asm volatile("bar.sync 3, %0;" ::"n"(Cfg::kConsumers) : "memory");
#pragma unroll
  for (int j = 0; j < R / 4; ++j)
#pragma unroll
    for (int r = 0; r < 4; ++r) sums[(8 * j + 2 * q + (r & 1)) * kPitch + row + 8 * (r / 2)] = part[4 * j + r];
  cluster_sync();
  cooperative_groups::cluster_group cluster = cooperative_groups::this_cluster();
  const int splits = static_cast<int>(cluster.num_blocks());
  const int rank = static_cast<int>(cluster.block_rank());
  const int per = Cfg::BT / splits;  // splits 2, 4 or 8; BT 64 or 128
  // A thread keeps four rows 4c..4c+3 of the tile (the consumers are a multiple of the quads), so
  // their scales and bias are read once, before the loop.
  constexpr int kQuads = Cfg::kRows / 4, kStep = Cfg::kConsumers / kQuads, kMaxSplits = 8;
  static_assert(Cfg::kConsumers % kQuads == 0, "a thread keeps one quad of rows of the tile");
  const int c = threadIdx.x % kQuads, n = n0 + 4 * c;
  if (n < N) {
    float sw[4], bv[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      sw[e] = __half2float(ws[min(n + e, N - 1)]);
      bv[e] = bias != nullptr ? Fp<T>::to_float(bias[min(n + e, N - 1)]) : 0.f;
    }
    for (int t = rank * per + threadIdx.x / kQuads; t < (rank + 1) * per; t += kStep) {
      const int m = m0 + t;
      if (m >= M) break;
      int4 v[kMaxSplits];
#pragma unroll
      for (int r = 0; r < kMaxSplits; ++r)
        if (r < splits) v[r] = *reinterpret_cast<const int4*>(cluster.map_shared_rank(sums + t * kPitch + 4 * c, r));
      const float sx = qs[m];
      int32_t sum[4] = {0, 0, 0, 0};
#pragma unroll
      for (int r = 0; r < kMaxSplits; ++r)
        if (r < splits) sum[0] += v[r].x, sum[1] += v[r].y, sum[2] += v[r].z, sum[3] += v[r].w;
      T* d = out + static_cast<int64_t>(m) * N + n;
      T o[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) o[e] = scaled_out<T>(__fmul_rn(static_cast<float>(sum[e]), sw[e]), sx, bv[e]);
      store_run<T, 4>(d, n, N, o);
    }
  }
  cluster_sync();
#endif
}

// Row scales (ws fp16 [N, 1]; kRow): the int32 sums run over all of K in the wgmma accumulators and
// are scaled once in the epilogue, fp32(fp32(S) * s_w[n]) * s_x[m] as ternop/activations.py says.
// Nothing is left for the CUDA cores per block but decoding, so the warpgroups need no turns: each
// decodes its next block into a second set of A registers while its own wgmmas run.
template <int BT>
__device__ __forceinline__ void row_step(int kb, int blocks, uint32_t stage, uint32_t full_next, uint32_t parity_next,
                                         uint32_t empty, const uint8_t* next_codes, uint32_t shift, int lane,
                                         int32_t (&part)[BT / 2],
                                         const uint32_t (&a)[4][4], uint32_t (&a_next)[4][4]) {
  wgmma_fence();
#pragma unroll
  for (int s = 0; s < 4; ++s) WgmmaS8<BT>::run(kb > 0 || s > 0, part, a[s], b_desc(stage + s * 32));
  wgmma_commit();
  if (kb + 1 < blocks) {
    mbar_wait(full_next, parity_next);
    decode_block_a8(next_codes, shift, a_next);
  }
  wgmma_wait<0>();
  fence_acc(part);
  if (lane == 0) mbar_arrive(empty);  // this warp is done with the stage
}

template <typename T, typename Cfg, bool kRow>
__global__ void __launch_bounds__(Cfg::kThreads, 1)
    ternary_wgmma_a8_kernel(const __grid_constant__ CUtensorMap q_map, const __grid_constant__ CUtensorMap c_map,
                            const float* __restrict__ qs, const __half* __restrict__ ws, const T* __restrict__ bias,
                            T* __restrict__ out, int M, int N, int K) {
#if !TERNOP_HAS_WGMMA
  __trap();  // not an sm_90a build: the registry never launches it
#endif
  constexpr int BT = Cfg::BT, kStages = Cfg::kStages, R = BT / 2;
  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw = smem_addr(smem_raw);
  const uint32_t base = (raw + 1023) & ~1023u;
  uint8_t* smem = smem_raw + (base - raw);
  __shared__ __align__(8) uint64_t bars[2 * kStages];  // full[s], then empty[s]
  const uint32_t full0 = smem_addr(bars), empty0 = full0 + 8 * kStages;
  if (threadIdx.x == 0) {
#pragma unroll
    for (int s = 0; s < kStages; ++s) {
      mbar_init(full0 + 8 * s, 1);               // the producer's expect_tx arrival
      mbar_init(empty0 + 8 * s, Cfg::kConsumers / 32);  // one arrival a consumer warp
    }
    mbar_init_fence();
  }
  __syncthreads();

  static_assert(kRow || Cfg::kGroups == 2, "the block-scale form takes turns between two warpgroups");
  const int n0 = blockIdx.x * Cfg::kRows, m0 = blockIdx.y * BT;
  // This CTA's blocks of K: all of them, or its split's share (the host splits only row-scaled
  // launches, and only into a divisor of the block count).
  const int blocks = K / 128 / static_cast<int>(gridDim.z), kb_begin = static_cast<int>(blockIdx.z) * blocks;
  if (threadIdx.x >= Cfg::kConsumers) {  // the producer warp; one lane issues the loads
    if (threadIdx.x == Cfg::kConsumers) {
      // Launched early (launch_wgmma_a8), the kernel may get here while the quantization that
      // writes q still runs: the codes of the first stages are asked for before the wait, the
      // rows of q after it. Each stage's barrier expects both from the start.
      const int first = blocks < kStages ? blocks : kStages;
      for (int i = 0; i < first; ++i) {
        const uint32_t stage = base + i * Cfg::kStageBytes, full = full0 + 8 * i;
        mbar_expect(full, Cfg::kXBytes + Cfg::kCodeBytes);
        tma_load(stage + Cfg::kXBytes, &c_map, (kb_begin + i) * 32, n0, full);
      }
      wait_for_prior_grids();
      for (int i = 0; i < blocks; ++i) {
        const int slot = i % kStages, round = i / kStages, kb = kb_begin + i;
        const uint32_t stage = base + slot * Cfg::kStageBytes, full = full0 + 8 * slot;
        if (round > 0) {
          mbar_wait(empty0 + 8 * slot, (round - 1) & 1);
          mbar_expect(full, Cfg::kXBytes + Cfg::kCodeBytes);
          tma_load(stage + Cfg::kXBytes, &c_map, kb * 32, n0, full);
        }
        tma_load(stage, &q_map, kb * 128, m0, full);
      }
    }
    if (gridDim.z > 1) {  // the cluster barriers of split_reduce_store count every thread
      __syncwarp();
      cluster_sync();
      cluster_sync();
    }
    return;
  }

  wait_for_prior_grids();  // the consumers read qs (global memory) in the epilogue
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, wg = warp / 4;
  const int g = lane / 4, q = lane % 4;
  const int row = 16 * warp + g;  // this lane's rows of the CTA: row and row + 8
  const uint32_t shift = (q & 1) * 2 + (q >> 1) * 16;  // 0, 2, 16, 18

  if constexpr (kRow) {
    int32_t part[R];
    uint32_t a0[4][4];
    mbar_wait(full0, 0);
    decode_block_a8(smem + Cfg::kXBytes + row * 32, shift, a0);
    if constexpr (Cfg::kGroups > 2) {
      // Three or four warpgroups: registers for one set of A fragments only; while one
      // warpgroup decodes after its wait, the others' wgmmas keep the tensor cores busy.
      for (int b = 0; b < blocks; ++b) {
        const int slot = b % kStages, next = (b + 1) % kStages;
        wgmma_fence();
#pragma unroll
        for (int s = 0; s < 4; ++s)
          WgmmaS8<BT>::run(b > 0 || s > 0, part, a0[s], b_desc(base + slot * Cfg::kStageBytes + s * 32));
        wgmma_commit();
        wgmma_wait<0>();
        fence_acc(part);
        if (lane == 0) mbar_arrive(empty0 + 8 * slot);
        if (b + 1 < blocks) {
          mbar_wait(full0 + 8 * next, ((b + 1) / kStages) & 1);
          decode_block_a8(smem + next * Cfg::kStageBytes + Cfg::kXBytes + row * 32, shift, a0);
        }
      }
    } else {
      uint32_t a1[4][4];
      // Two blocks an iteration, so that the A registers alternate without being indexed.
      for (int kb = 0; kb < blocks; kb += 2) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int b = kb + h;
          if (b >= blocks) break;
          const int slot = b % kStages, next = (b + 1) % kStages;
          const uint32_t stage = base + slot * Cfg::kStageBytes;
          const uint8_t* next_codes = smem + next * Cfg::kStageBytes + Cfg::kXBytes + row * 32;
          const uint32_t parity = ((b + 1) / kStages) & 1;
          if (h == 0)
            row_step<BT>(b, blocks, stage, full0 + 8 * next, parity, empty0 + 8 * slot, next_codes, shift, lane,
                         part, a0, a1);
          else
            row_step<BT>(b, blocks, stage, full0 + 8 * next, parity, empty0 + 8 * slot, next_codes, shift, lane,
                         part, a1, a0);
        }
      }
    }
    if (gridDim.z > 1) {
      split_reduce_store<T, Cfg, R>(smem, part, row, q, qs, ws, bias, out, M, N, n0, m0);
      return;
    }
    // The row's scale first: fp32(fp32(S) * s_w[n]), then the token's. Accumulator i is row
    // row + 8 ((i / 2) % 2) of the CTA.
    const float wsa = __half2float(ws[min(n0 + row, N - 1)]), wsb = __half2float(ws[min(n0 + row + 8, N - 1)]);
    store_tile<T, R>(out, qs, bias, M, N, n0, m0, row, q,
                     [&](int i) { return __fmul_rn(static_cast<float>(part[i]), (i & 2) ? wsb : wsa); });
    return;
  }

  const __half* sc0p = ws + static_cast<int64_t>(min(n0 + row, N - 1)) * blocks;
  const __half* sc1p = ws + static_cast<int64_t>(min(n0 + row + 8, N - 1)) * blocks;
  const int my_turn = 1 + wg, other_turn = 2 - wg;

  float acc[R];
#pragma unroll
  for (int i = 0; i < R; ++i) acc[i] = 0.f;
  int32_t part[R];
  uint32_t a[4][4];

  mbar_wait(full0, 0);
  decode_block_a8(smem + Cfg::kXBytes + row * 32, shift, a);
  for (int kb = 0; kb < blocks; ++kb) {
    const int slot = kb % kStages;
    const uint32_t stage = base + slot * Cfg::kStageBytes;
    // Warpgroup 0 goes first on each block, warpgroup 1 after it.
    if (wg == 1 || kb > 0) turn_wait(my_turn);
    wgmma_fence();
#pragma unroll
    for (int s = 0; s < 4; ++s) WgmmaS8<BT>::run(s > 0, part, a[s], b_desc(stage + s * 32));
    wgmma_commit();
    const float s0 = __half2float(sc0p[kb]), s1 = __half2float(sc1p[kb]);
    wgmma_wait<0>();
    if (lane == 0) mbar_arrive(empty0 + 8 * slot);  // this warp is done with the stage
    // The turn passes once the wgmmas have completed, which keeps the two warpgroups in opposite
    // phases. Passed as soon as they were issued (d40a32e), both warpgroups issued back to back,
    // then scaled at the same time while the tensor cores idled: 0.72-0.83x of cuBLAS bf16 at
    // M >= 2048 on the 8B shapes against 0.76-0.90x this way (8bbb40a).
    if (wg == 0 || kb + 1 < blocks) turn_pass(other_turn);
    if (kb + 1 < blocks) {
      const int next = (kb + 1) % kStages;
      mbar_wait(full0 + 8 * next, ((kb + 1) / kStages) & 1);
      decode_block_a8(smem + next * Cfg::kStageBytes + Cfg::kXBytes + row * 32, shift, a);
    }
    fence_acc(part);
    // part[4j + r] is row g + 8 (r / 2), token 8j + 2q + r % 2: scale s0 for r < 2, s1 otherwise.
#pragma unroll
    for (int i = 0; i < R; ++i) {
      const float p = __int_as_float(part[i] + 0x4B400000) - 12582912.0f;
      acc[i] = fmaf(p, (i & 2) ? s1 : s0, acc[i]);
    }
  }

  store_tile<T, R>(out, qs, bias, M, N, n0, m0, row, q, [&](int i) { return acc[i]; });
}

using A8Tile0 = A8Tile<64, 8>;
using A8Tile1 = A8Tile<128, 8>;
// Row scales only (no turns): more weight rows a CTA, so that each token block is read from L2
// fewer times: 192 rows at 128 tokens (three consumer warpgroups: 416 threads leave 128 registers
// a thread; four at 128 tokens would leave 96 and spill) and 256 rows at 64 tokens.
// A persistent form of the row kernel (356497c: a CTA an SM walking tiles, its stage count running
// across them so that the next tile's loads overlap the last one's epilogue) measured slower on
// the H200 (sweep_wgmma_a8_row_356497c.log: 1.12x against 1.17x on 4096->14336 at M = 8192, 1.06x
// against 1.22x on 14336->4096), so each CTA takes one tile.
using A8Tile2 = A8Tile<128, 8, 3>;
using A8Tile3 = A8Tile<64, 8, 4>;
// Tiles 4 and 5 (row scales only): 128 weight rows and 128 or 256 tokens, the weights decoded by
// producer warps into shared memory and both wgmma operands read from there
// (ternary_wgmma_a8_ss.cu). A persistent grid of tile 5 (a CTA an SM walking the tiles, the output
// stored from the accumulators while the next tile's blocks load) ran slower at every point
// (9893d9d, results/h100/sweep_a8_row_ss_a9e8bb5.json, "tile:6") and was taken out again. Tried
// again after the decoders changed (results/h100/sweep_a8_row_persistent_10dee87.json): the kernel
// rewritten to walk tiles lost more than the persistent grid gained (docs/KERNELS.md).
constexpr int kA8Tiles = 6;
constexpr int kSSMinM = 512;  // the smallest M the tile rule gives tile 5 (measured from there)
constexpr int kSSShortK = 4096;  // below it the tile rule may give tile 4 (measured on K = 1024..3072)

int64_t ctas_of(int M, int N, int rows, int tokens) {
  return static_cast<int64_t>((N + rows - 1) / rows) * ((M + tokens - 1) / tokens);
}

// How many CTAs split K for a row-scaled launch of `ctas` CTAs: the largest of 2, 4 and 8 that
// keeps the launch within one wave, divides the block count and leaves each CTA two blocks or more;
// else 1.
int a8_row_splits(int64_t ctas, int K, int sms) {
  const int blocks = K / 128;
  int splits = 1;
  for (int s = 2; s <= 8; s *= 2)
    if (ctas * s <= sms && blocks % s == 0 && blocks / s >= 2) splits = s;
  return splits;
}

template <typename T, typename Cfg, bool kRow>
cudaError_t launch_wgmma_a8(const int8_t* q, const float* qs, const uint8_t* wp, const __half* ws, const T* bias,
                            T* out, int M, int N, int K, int sms, cudaStream_t stream) {
  auto kernel = ternary_wgmma_a8_kernel<T, Cfg, kRow>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes);
  if (err != cudaSuccess) return err;
  CUtensorMap q_map, c_map;
  err = x_tensor_map(&q_map, q, K, M, K, Cfg::BT);
  if (err != cudaSuccess) return err;
  err = codes_tensor_map(&c_map, wp, N, K, Cfg::kRows);
  if (err != cudaSuccess) return err;
  const int64_t ctas = ctas_of(M, N, Cfg::kRows, Cfg::BT);
  const int splits = kRow ? a8_row_splits(ctas, K, sms) : 1;
  const dim3 grid((N + Cfg::kRows - 1) / Cfg::kRows, (M + Cfg::BT - 1) / Cfg::BT, splits);
  cudaLaunchAttribute attr;
  cudaLaunchConfig_t config = z_cluster_config(grid, Cfg::kThreads, Cfg::kSmemBytes, stream, splits > 1, attr);
  // An early start (ternary_common.cuh) only where the launch does not split K (not tried with
  // clusters) and where two CTAs cannot share an SM. Early-started, tile 0 (97 KiB, 93 registers:
  // two fit) made its one-wave launches at M = 256 37-56% slower on an H100 (4096->4096, 14336->4096
  // in results/h100/bench_linear_pdl_c04e0f4.json): CTAs placed while the quantization still runs
  // can land two to an SM, where a plain launch spreads them one to an SM. Tiles 1-3 started early,
  // forced, ran 5% faster to 2% slower than plain (results/h100/bench_linear_early_{off,on}_4d94a8d.json).
  constexpr bool kOneAnSM = 2 * Cfg::kSmemBytes > 227 * 1024;
  if (kOneAnSM && splits == 1 && early_launch_allowed()) {
    allow_early_start(attr);
    config.numAttrs = 1;
  }
  return cudaLaunchKernelEx(&config, kernel, q_map, c_map, qs, ws, bias, out, M, N, K);
}

}  // namespace

// The tile a call runs: `tile` when it names one (0: 64 tokens, 1: 128, on 128 weight rows; with
// row scales also 2: 128 tokens on 192 rows, and 3: 64 on 256), else by M:
// - up to 64 tokens, tile 0: the 128-token tiles would leave half their tokens empty;
// - from 512 with row scales, tile 5 (the weights decoded into shared memory, 256 tokens) where its
//   CTAs fill the GPU: in sweep_a8_row_ss_9c48815.json (an H100, M = 512, 2048 and 8192; four decoder
//   warps) it was the fastest tile at every point where this rule takes it, 10 of the 12 points of
//   the 8B layers (at M = 2048 and 8192 1.43-1.65x of cuBLAS bf16 with the quantization of x, against
//   0.99-1.34x for the other tiles' best) and six of the 0.6B layers; it lost where its CTAs do not
//   fill the GPU (4096->4096 and 14336->4096 at 512, the N = 1024 layers below 8192);
// - from 512 with row scales and K < kSSShortK, where tile 5 does not fill the GPU, tile 4 (the same
//   kernel on 128 tokens) where its CTAs make one wave that fills 90% of the SMs or more: in the same
//   sweep those were the three points of the short-K layers where tile 4 was the fastest tile, 7-35%
//   ahead of the tile the rule took before (2048->1024 and 3072->1024 at M = 2048: 0.76x of cuBLAS
//   bf16 against 0.66x and 0.71x; 1024->4096 at 512: 0.78x against 0.59x). 1024->6144 at M = 512
//   (96 CTAs of tile 5) ran 1.8x faster on tile 5 than on the rule's tile: no rule takes it yet;
// - from 2048 with row scales, tile 2 where its CTAs fill the GPU (its extra weight rows read each
//   token block from L2 fewer times);
// - otherwise tile 1 where its CTAs fill three quarters of the GPU, else tile 0.
// sweep_wgmma_a8_row_0da2207.json at M = 17..512 on the 8B layers: tile 0 best up to 64 tokens
// (1.89-2.27x of cuBLAS bf16 on the wide layers), tile 1 at M = 128..512 where it makes 112 or more
// CTAs (1.45x against tile 0's 1.30x on 4096->14336 at M = 128), tile 0 where it makes more CTAs
// than tile 1's 32-64 (4096->4096 at M = 128..256); tile 2 lost below M = 2048 (1.13-1.20x at
// M = 128 on the wide layers).
int ternary_wgmma_a8_tile(int M, int N, int K, int sms, int tile, bool row) {
  if (tile >= 0 && tile < (row ? kA8Tiles : 2)) return tile;
  if (M <= A8Tile0::BT) return 0;
  if (row && M >= kSSMinM) {
    const int64_t ctas = ctas_of(M, N, 128, 256), waves = (ctas + sms - 1) / sms;
    if (ctas >= sms && 5 * ctas >= 4 * waves * sms) return 5;
    const int64_t ctas4 = ctas_of(M, N, 128, 128);
    if (K < kSSShortK && ctas4 <= sms && 10 * ctas4 >= 9 * sms) return 4;
  }
  if (row && M >= 2048 && ctas_of(M, N, A8Tile2::kRows, A8Tile2::BT) >= sms) return 2;
  return 4 * ctas_of(M, N, A8Tile1::kRows, A8Tile1::BT) >= 3 * sms ? 1 : 0;
}

// q int8 [M, K] contiguous, 16-byte aligned; qs fp32 [M]; wp uint8 [N, K/4] in the a8 layout;
// ws fp16 [N, K/128], or [N, 1] when `row` (a scale per row); bias [N] in the output dtype or
// nullptr; out [M, N] in `out_dtype`. `tile` as ternary_wgmma_a8_tile takes it.
cudaError_t launch_ternary_wgmma_a8(const int8_t* q, const float* qs, int out_dtype, const uint8_t* wp,
                                    const __half* ws, bool row, const void* bias, void* out, int M, int N, int K,
                                    int tile, int sms, cudaStream_t stream) {
  if (M < 1 || N < 1 || K < 128 || K % 128) return cudaErrorInvalidValue;
  // The tensor maps' bases.
  if (reinterpret_cast<uintptr_t>(q) % 16 || reinterpret_cast<uintptr_t>(wp) % 16) return cudaErrorInvalidValue;
  return dispatch_dtype</*kWithFp32=*/true>(out_dtype, [&](auto tag) {
    using T = decltype(tag);
    const T* bt = static_cast<const T*>(bias);
    T* ot = static_cast<T*>(out);
    const int picked = ternary_wgmma_a8_tile(M, N, K, sms, tile, row);
    switch (picked) {
      case 0:
        return row ? launch_wgmma_a8<T, A8Tile0, true>(q, qs, wp, ws, bt, ot, M, N, K, sms, stream)
                   : launch_wgmma_a8<T, A8Tile0, false>(q, qs, wp, ws, bt, ot, M, N, K, sms, stream);
      case 1:
        return row ? launch_wgmma_a8<T, A8Tile1, true>(q, qs, wp, ws, bt, ot, M, N, K, sms, stream)
                   : launch_wgmma_a8<T, A8Tile1, false>(q, qs, wp, ws, bt, ot, M, N, K, sms, stream);
      case 2:
        return launch_wgmma_a8<T, A8Tile2, true>(q, qs, wp, ws, bt, ot, M, N, K, sms, stream);
      case 3:
        return launch_wgmma_a8<T, A8Tile3, true>(q, qs, wp, ws, bt, ot, M, N, K, sms, stream);
      default:  // 4 and 5: the weights decoded into shared memory (ternary_wgmma_a8_ss.cu)
        return launch_ternary_wgmma_a8_ss<T>(q, qs, wp, ws, bt, ot, M, N, K, picked == 5 ? 256 : 128, stream);
    }
  });
}

}  // namespace ternop
