// Small-M ternary linear on Hopper, fed by bulk copies: out[m, n] = sum_k x[m, k] * W[n, k]
// (+ bias[n]), 1 <= M <= 16, x fp16 or bf16, weights in the "a16" layout (ternop/layouts.py).
// sm_90a builds only (the bulk copies and mbarriers of ternary_wgmma.cuh); elsewhere it traps and
// the registry never launches it.
//
// Why. ternary_mma.cu loads each warp's codes into registers, two or four scale blocks ahead.
// Profiled at M = 1 on 4096 -> 14336 it reaches 28% of HBM bandwidth, issuing on 43% of cycles:
// its warps wait on their loads, and registers cap how many bytes a warp can have in flight
// (docs/KERNELS.md, "The small-M kernels profiled"). Here the tensor-memory-access unit copies a
// CTA's whole share of the codes into shared memory before any arithmetic, so shared memory, not
// registers, bounds the bytes in flight: 16 * K / 4 bytes a CTA (16 KiB at K = 4096), several
// CTAs an SM.
//
// Work. A CTA owns one set of 16 weight rows and all of K. Its W warps split the scale blocks
// (warp w a contiguous range, as in ternary_mma.cu); each warp cuts its range into at most
// kBulkMaxChunks chunks of an even number of blocks, each with its own mbarrier, and its lanes
// issue one bulk copy per (row, chunk). A row's codes are contiguous in [N, K/4], so a copy is
// 32 bytes a block. The warp then waits on its chunks in order and multiplies each as it lands.
// The scales of the set (16 x K/128 fp16) are read into shared memory by plain loads, issued
// after the copies so that they overlap them. Warps 1..W-1 leave their sums in shared memory and
// warp 0 adds them in a fixed order (sum_set_warps), adds the bias and writes out.
//
// Shared memory. Row r's codes sit at r * stride, stride = K / 4 rounded to an odd multiple of 32
// bytes: the eight rows g = 0..7 that one 8-byte load of a warp touches (32 bytes each) then fall
// in two 128-byte bank lines, the fewest a 256-byte load can take.
//
// Orientation and k order: those of ternary_mma.cu on the a16 layout. Lane (g = lane / 4,
// q = lane % 4) owns, for rows g and g + 8, the codes [32q, 32q + 32) of each block (two words h
// of 16 codes); mma step 4h + s takes the pairs (codes 4s, 4s + 1) and (4s + 2, 4s + 3) of word
// h, and B is the matching two registers of x as loaded.
//
// Decode, in two instructions a pair. The a16 layout holds u = v + 1 of codes (2j, 2j + 1) in the
// fields j and j + 8 of a word, 16 bits apart. A field at bit 2j of a half that lies inside the
// mantissa, ORed into the magic 2^10 (fp16) or 2^7 (bf16) whose ulp is 1, reads 2^10 + u * 4^j.
// One packed FMA, times 4^-j plus -(2^10 * 4^-j + 1), gives u - 1 = v: the product is exact (a
// power of two), and the sum is exact too, so its single rounding changes nothing. fp16's 10-bit
// mantissa takes j = 0..3 from the word and j = 4..7 from the word shifted right by 8; bf16's
// 7-bit one takes three fields per shift (by 0, 6 and 12). Bits that a shift moves from the high
// half into the low one land above the masked field. That is LOP3 + HFMA2 per pair and one or two
// shifts a word, against a shift, a LOP3 and an HSUB2 per pair in ternary_mma.cu.
//
// Scales and sums as in ternary_mma.cu: 8 mma steps give a block's fp32 partial per row, times
// its fp16 scale in fp32, added to the accumulator. Rows past N are not copied: their codes are
// whatever shared memory held (any 2-bit field decodes to a finite value), their scales are zero,
// and their outputs are never written. Tokens past M read token 0.

#include <type_traits>

#include "ternary_a16.cuh"
#include "ternary_wgmma.cuh"

namespace ternop {

namespace {

constexpr int kBulkMaxWarps = 8;
constexpr int kBulkMaxDepth = 4;          // ring slots: sets of codes in flight a CTA
constexpr int kBulkHeader = 512;          // bytes before the slots: kBulkMaxWarps * kBulkMaxDepth mbarriers
constexpr int kBulkMaxSmem = 227 * 1024;  // dynamic shared memory an sm_90 CTA may take

__host__ __device__ inline int div_up(int a, int b) { return (a + b - 1) / b; }

// One ring slot holds one set: its 16 x blocks fp16 scales, then its 16 rows of codes, `stride`
// bytes apart.
struct BulkLayout {
  int blocks;      // K / 128
  int stride;      // bytes from one row's codes to the next
  int codes_off;   // offset of the codes in a slot (the scales are at 0)
  int slot;        // bytes a slot
};

__host__ __device__ inline BulkLayout bulk_layout(int K) {
  const int blocks = K / 128, row = K / 4;
  const int stride = row + ((row / 32) % 2 == 0 ? 32 : 0);
  const int codes_off = div_up(16 * blocks * 2, 128) * 128;
  return {blocks, stride, codes_off, codes_off + div_up(16 * stride, 128) * 128};
}

__host__ __device__ inline int bulk_smem(int K, int depth) { return kBulkHeader + depth * bulk_layout(K).slot; }

// mma step 4H + S of a block: rows g (word wg) and g + 8 (wg8), both token tiles.
template <typename T, int NT, int H, int S>
__device__ __forceinline__ void bulk_step(uint32_t wg, uint32_t wg8, const uint32_t (&xv)[NT][16], uint32_t magic,
                                          float (&c)[NT][4]) {
  const uint32_t a[4] = {decode_fma<T, 2 * S>(wg, magic), decode_fma<T, 2 * S>(wg8, magic),
                         decode_fma<T, 2 * S + 1>(wg, magic), decode_fma<T, 2 * S + 1>(wg8, magic)};
#pragma unroll
  for (int t = 0; t < NT; ++t) mma_16816<T>(c[t], a, xv[t][8 * H + 2 * S], xv[t][8 * H + 2 * S + 1]);
}

template <typename T, int NT, int H>
__device__ __forceinline__ void bulk_word(uint32_t wg, uint32_t wg8, const uint32_t (&xv)[NT][16], uint32_t magic,
                                          float (&c)[NT][4]) {
  bulk_step<T, NT, H, 0>(wg, wg8, xv, magic, c);
  bulk_step<T, NT, H, 1>(wg, wg8, xv, magic, c);
  bulk_step<T, NT, H, 2>(wg, wg8, xv, magic, c);
  bulk_step<T, NT, H, 3>(wg, wg8, xv, magic, c);
}

// Block b of this warp's range: codes and scales from shared memory, x in xv; acc += its sums.
template <typename T, int NT>
__device__ __forceinline__ void bulk_block(const uint8_t* cg, const uint8_t* cg8, const __half* sg, const __half* sg8,
                                           int b, const uint32_t (&xv)[NT][16], uint32_t magic, float (&acc)[NT][4]) {
  const uint2 wa = *reinterpret_cast<const uint2*>(cg + 32 * b);
  const uint2 wb = *reinterpret_cast<const uint2*>(cg8 + 32 * b);
  float c[NT][4];
#pragma unroll
  for (int t = 0; t < NT; ++t)
#pragma unroll
    for (int r = 0; r < 4; ++r) c[t][r] = 0.f;
  bulk_word<T, NT, 0>(wa.x, wb.x, xv, magic, c);
  bulk_word<T, NT, 1>(wa.y, wb.y, xv, magic, c);
  const float sa = __half2float(sg[b]), sb = __half2float(sg8[b]);
  // C fragment: c[t][0], c[t][1] are row g, c[t][2], c[t][3] row g + 8.
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    acc[t][0] = fmaf(c[t][0], sa, acc[t][0]);
    acc[t][1] = fmaf(c[t][1], sa, acc[t][1]);
    acc[t][2] = fmaf(c[t][2], sb, acc[t][2]);
    acc[t][3] = fmaf(c[t][3], sb, acc[t][3]);
  }
}

template <typename T, int NT>
__device__ __forceinline__ void load_x_tiles(const T* const (&px)[NT], int b, uint32_t (&xv)[NT][16]) {
#pragma unroll
  for (int t = 0; t < NT; ++t) load_x(px[t] + 128 * b, xv[t]);
}

template <typename T, int NT>
__global__ void __launch_bounds__(kBulkMaxWarps * 32, 1) ternary_mma_bulk_kernel(
    const T* __restrict__ x, const uint8_t* __restrict__ wp, const __half* __restrict__ ws,
    const T* __restrict__ bias, T* __restrict__ out, int M, int N, int K, int sets_per_cta, int depth) {
#if !TERNOP_HAS_WGMMA
  __trap();  // not an sm_90a build: the registry never launches it
#endif
  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ float red[2][kBulkMaxWarps - 1][NT * 4][32];

  const BulkLayout lay = bulk_layout(K);
  const int warps = blockDim.x / 32, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, q = lane % 4;
  const int n_sets = div_up(N, 16), first = blockIdx.x * sets_per_cta;
  const int sets = min(sets_per_cta, n_sets - first);  // this CTA's sets, one after the other

  // This warp's scale blocks, the same in every set.
  const int per = div_up(lay.blocks, warps);
  const int b_begin = min(warp * per, lay.blocks);
  const int count = min(per, lay.blocks - b_begin);

  // mbarrier (w, s): warp w's codes of slot s, and for w = 0 the slot's scales too.
  const uint32_t bars = smem_addr(smem);
  auto bar = [&](int w, int slot) { return bars + 8 * (w * kBulkMaxDepth + slot); };
  if (threadIdx.x == 0) {
    for (int i = 0; i < kBulkMaxWarps * kBulkMaxDepth; ++i) mbar_init(bars + 8 * i, 1);
    mbar_init_fence();
  }
  __syncthreads();

  const size_t row_bytes = static_cast<size_t>(K) / 4;
  auto slot_of = [&](int j) { return smem + kBulkHeader + (j % depth) * lay.slot; };
  // Copies of set j (of this CTA) into its slot: this warp's blocks of its rows, and warp 0 the scales
  // when the set has all 16 rows (else they are read from global memory).
  auto issue = [&](int j) {
    const int n0 = (first + j) * 16, rows = min(16, N - n0);
    const bool scales = warp == 0 && rows == 16;
    if (lane == 0) {
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // the slot's last reads came first
      mbar_expect(bar(warp, j % depth), rows * 32 * count + (scales ? 32 * lay.blocks : 0));
    }
    __syncwarp();
    uint8_t* slot = slot_of(j);
    if (lane < rows && count > 0)
      bulk_load(smem_addr(slot + lay.codes_off + lane * lay.stride + 32 * b_begin),
                wp + (n0 + lane) * row_bytes + 32 * b_begin, 32 * count, bar(warp, j % depth));
    if (scales && lane == 16)
      bulk_load(smem_addr(slot), ws + static_cast<size_t>(n0) * lay.blocks, 32 * lay.blocks, bar(0, j % depth));
  };
  for (int j = 0; j < min(depth, sets); ++j) issue(j);

  const T* px[NT];  // token t * 8 + g, this lane's B column
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    const int m = t * 8 + g;
    px[t] = x + static_cast<size_t>(m < M ? m : 0) * K + b_begin * 128 + 32 * q;
  }
  const uint32_t magic = FmaDecode<T>::kMagic;

  for (int j = 0; j < sets; ++j) {
    const int n0 = (first + j) * 16, rows = min(16, N - n0);
    const uint32_t parity = (j / depth) & 1;
    mbar_wait(bar(warp, j % depth), parity);
    if (rows == 16 && warp != 0) mbar_wait(bar(0, j % depth), parity);  // the scales
    const uint8_t* slot = slot_of(j);
    const uint8_t* cg = slot + lay.codes_off + g * lay.stride + 32 * b_begin + 8 * q;
    const uint8_t* cg8 = cg + 8 * lay.stride;
    const __half* sc = rows == 16 ? reinterpret_cast<const __half*>(slot) : ws + static_cast<size_t>(n0) * lay.blocks;
    // Rows past N read row 0 of the set's scales (their outputs are never written).
    const __half* sg = sc + (g < rows ? g : 0) * lay.blocks + b_begin;
    const __half* sg8 = sc + (g + 8 < rows ? g + 8 : 0) * lay.blocks + b_begin;

    float acc[NT][4];
#pragma unroll
    for (int t = 0; t < NT; ++t)
#pragma unroll
      for (int r = 0; r < 4; ++r) acc[t][r] = 0.f;
    // x of the next block is loaded while this one is multiplied (two buffers, so no copies).
    uint32_t xa[NT][16], xb[NT][16];
    if (count > 0) load_x_tiles<T, NT>(px, 0, xa);
    for (int b = 0; b < count; b += 2) {
      if (b + 1 < count) load_x_tiles<T, NT>(px, b + 1, xb);
      bulk_block<T, NT>(cg, cg8, sg, sg8, b, xa, magic, acc);
      if (b + 1 >= count) break;
      if (b + 2 < count) load_x_tiles<T, NT>(px, b + 2, xa);
      bulk_block<T, NT>(cg, cg8, sg, sg8, b + 1, xb, magic, acc);
    }

    // Warps 1..W-1 park their sums (two buffers: set j + 1's cannot overwrite set j's before
    // warp 0 has read them, since that needs set j + 1's barrier); warp 0 adds them in order.
    if (warp > 0) {
#pragma unroll
      for (int t = 0; t < NT; ++t)
#pragma unroll
        for (int r = 0; r < 4; ++r) red[j & 1][warp - 1][t * 4 + r][lane] = acc[t][r];
    }
    __syncthreads();  // every warp is done with slot j % depth
    if (j + depth < sets) issue(j + depth);
    if (warp == 0) {
      for (int w = 0; w < warps - 1; ++w)
#pragma unroll
        for (int t = 0; t < NT; ++t)
#pragma unroll
          for (int r = 0; r < 4; ++r) acc[t][r] += red[j & 1][w][t * 4 + r][lane];
      // C fragment: acc[t][r] is row g + 8 * (r / 2), token t * 8 + 2q + r % 2.
#pragma unroll
      for (int t = 0; t < NT; ++t)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const int n = n0 + g + 8 * (r / 2);
          const int m = t * 8 + 2 * q + (r & 1);
          if (n < N && m < M) {
            const float bv = bias != nullptr ? Fp<T>::to_float(bias[n]) : 0.f;
            out[static_cast<size_t>(m) * N + n] = Fp<T>::from_float(acc[t][r] + bv);
          }
        }
    }
  }
}

template <typename T, int NT>
cudaError_t launch_bulk(const void* x, const uint8_t* wp, const __half* ws, const void* bias, void* out, int M, int N,
                        int K, int warps, int sets, int depth, cudaStream_t stream) {
  auto kernel = ternary_mma_bulk_kernel<T, NT>;
  const int bytes = bulk_smem(K, depth);
  // Past the 48 KiB a launch may take unasked; set on every launch (cheap, and per device).
  const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (err != cudaSuccess) return err;
  kernel<<<div_up(div_up(N, 16), sets), 32 * warps, bytes, stream>>>(static_cast<const T*>(x), wp, ws,
                                                                      static_cast<const T*>(bias),
                                                                      static_cast<T*>(out), M, N, K, sets, depth);
  return cudaGetLastError();
}

}  // namespace

// Whether the kernel takes K at `depth` slots (<= 0: one): the slots fit a CTA's shared memory.
bool ternary_mma_bulk_takes(int K, int depth) {
  return K >= 128 && K % 128 == 0 && bulk_smem(K, depth > 0 ? depth : 1) <= kBulkMaxSmem;
}

// The kernel's choices where asked for none: four warps, or eight from 64 scale blocks (K = 8192);
// two slots where they fit, else one; sets a CTA so that two CTAs an SM take the layer.
int ternary_mma_bulk_warps(int K) { return K / 128 >= 64 ? 8 : 4; }
int ternary_mma_bulk_depth(int K) { return ternary_mma_bulk_takes(K, 2) ? 2 : 1; }
int ternary_mma_bulk_sets(int N, int sms) { return div_up(div_up(N, 16), 2 * sms); }

// x: [M, K] row-major, fp16 or bf16, 16-byte aligned; wp: uint8 [N, K/4] in the a16 layout,
// 16-byte aligned; ws: fp16 [N, K/128]; bias: [N] in x's dtype or nullptr; out: [M, N].
// 1 <= M <= 16; warps 1..8, sets (a CTA) >= 1, depth 1..4, each <= 0 for the kernel's choice;
// ternary_mma_bulk_takes(K, depth).
cudaError_t launch_ternary_mma_bulk(const void* x, int dtype, const uint8_t* wp, const __half* ws, const void* bias,
                                    void* out, int M, int N, int K, int warps, int sets, int depth, int sms,
                                    cudaStream_t stream) {
  const int d = depth > 0 ? depth : ternary_mma_bulk_depth(K);
  if (!valid_shape(M, 16, N, K) || !ternary_mma_bulk_takes(K, d) || warps > kBulkMaxWarps || d > kBulkMaxDepth)
    return cudaErrorInvalidValue;
  const int w = warps > 0 ? warps : ternary_mma_bulk_warps(K);
  const int s = sets > 0 ? sets : ternary_mma_bulk_sets(N, sms);
  return dispatch_dtype</*kWithFp32=*/false>(dtype, [&](auto tag) {
    return M <= 8 ? launch_bulk<decltype(tag), 1>(x, wp, ws, bias, out, M, N, K, w, s, d, stream)
                  : launch_bulk<decltype(tag), 2>(x, wp, ws, bias, out, M, N, K, w, s, d, stream);
  });
}

}  // namespace ternop
