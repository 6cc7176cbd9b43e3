// CUDA implementations of the CUDA C++ small-M kernels' private ops. Their schemas and fake
// kernels are defined in Python (ternop/cuda/cpp_ops.py), beside every other ternop schema:
//
//   ternop::linear_cuda(Tensor x, Tensor weight_packed, Tensor weight_scale, Tensor? bias=None) -> Tensor
//   ternop::linear_cuda_mma(Tensor x, Tensor weight_packed, Tensor weight_scale, Tensor? bias=None,
//                           bool a16=False, int row_groups=-1, int depth=-1, int slab=0) -> Tensor
//   ternop::linear_cuda_mma_a8(Tensor q, Tensor qs, Tensor weight_packed, Tensor weight_scale,
//                              Tensor? bias, ScalarType dtype, int row_groups=-1, int depth=-1,
//                              int slab=0) -> Tensor
//   ternop::linear_cuda_mma_a8_fused(Tensor x, Tensor weight_packed, Tensor weight_scale,
//                                    Tensor? bias=None, int row_groups=-1, int depth=-1) -> Tensor
//   ternop::linear_cuda_dequant(Tensor x, Tensor weight_packed, Tensor weight_scale, Tensor? bias,
//                               int layout) -> Tensor
//   ternop::linear_cuda_mma_tiles(Tensor x, Tensor weight_packed, Tensor weight_scale, Tensor? bias=None,
//                                 int tile=-1) -> Tensor
//   ternop::linear_cuda_wgmma(Tensor x, Tensor weight_packed, Tensor weight_scale, Tensor? bias=None,
//                             int tile=-1) -> Tensor
//   ternop::linear_cuda_wgmma_a8(Tensor q, Tensor qs, Tensor weight_packed, Tensor weight_scale,
//                                Tensor? bias, ScalarType dtype, int tile=-1) -> Tensor
//   ternop::decode_int8_cuda(Tensor weight_packed, int layout) -> Tensor
//
// x [M, K] contiguous, fp16/bf16/fp32 with 1 <= M <= ternary_gemv_max_m() (CUDA cores,
// ternary_gemv.cu) or fp16/bf16 with 1 <= M <= ternary_mma_max_m(slab) (tensor cores,
// ternary_mma.cu, format v1 or the a16 layout); weight_packed uint8 [N, K/4]; weight_scale
// fp16 [N, K/128]; bias [N] in x's dtype or None -> new [M, N] in x's dtype. The W2A8 ops take
// x already quantized (q int8 [M, K], qs fp32 [M]), weights in the a8 layout, scales [N, K/128]
// or [N, 1] (a scale per row, ternop/activations.py), and return [M, N] in ``dtype``; the fused
// form takes x itself (fp16/bf16/fp32, M <= 2 and M * K <= 40 KiB)
// and quantizes it inside the kernel, with the same result; the three small-M ops' row_groups
// (sets of 16 weight rows per CTA, small_m_split in ternary_common.cuh) and depth (scale blocks
// of weight loads each warp keeps in flight: 2 or 4, 4 in linear_cuda_mma only for the a16
// layout) are -1 for the kernel's choice; slab (linear_cuda_mma, linear_cuda_mma_a8) is 0 for one
// CTA over all of M, or the tokens one CTA takes (8 or 16, and 32 in the W2A8 op) of a launch that
// runs ceil(M / slab) token slabs along the grid's y. linear_cuda_dequant (large M, any M
// and any row stride of x) writes the dense weight [N, K] in x's dtype (layout 0 = v1, 1 = a16,
// 2 = a8; ternary_dequant.cu) and returns at::linear(x, w, bias). linear_cuda_mma_tiles (mid M,
// any M and any row stride that keeps rows 16-byte aligned; fp16/bf16 x, weights in the a16
// layout; ternary_mma_tiles.cu) adds an fp32 workspace when it splits K; linear_cuda_wgmma takes the
// same arguments and runs Hopper's wgmma (ternary_wgmma.cu, sm_90a builds only; its splits of K add
// up inside thread-block clusters where the device runs them in one wave, else through the
// workspace), and
// linear_cuda_wgmma_a8 is the W2A8 op's Hopper form (any M; ternary_wgmma_a8.cu). decode_int8_cuda
// returns the weights' values as int8 [N, K] (-1, 0, +1, no scale; ternary_dequant.cu), the dense
// operand of the W2A8 int8 GEMM at large M. They allocate only through
// the caching allocator and launch on the current stream, so they are safe inside CUDA graph
// capture.

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_fp16.h>
#include <torch/library.h>

namespace ternop {
int ternary_gemv_max_m();
cudaError_t launch_ternary_gemv(const void* x, int dtype, const uint8_t* wp, const __half* ws, const void* bias,
                                void* out, int M, int N, int K, cudaStream_t stream);
int ternary_mma_max_m(int slab);
bool ternary_mma_takes_depth(bool a16, int depth);
bool ternary_mma_takes_slab(bool a16, int depth, int slab);
cudaError_t launch_ternary_mma(const void* x, int dtype, const uint8_t* wp, const __half* ws, const void* bias,
                               void* out, int M, int N, int K, bool a16, int row_groups, int depth, int slab,
                               int sms, cudaStream_t stream);
int ternary_mma_a8_max_m(bool row, int slab);
bool ternary_mma_a8_takes_depth(int depth);
bool ternary_mma_a8_takes_slab(int slab);
cudaError_t launch_ternary_mma_a8(const int8_t* q, const float* qs, int out_dtype, const uint8_t* wp,
                                  const __half* ws, bool row, const void* bias, void* out, int M, int N, int K,
                                  int row_groups, int depth, int slab, int sms, cudaStream_t stream);
bool ternary_mma_a8_fused_takes(int M, int K);
cudaError_t launch_ternary_mma_a8_fused(const void* x, int x_dtype, const uint8_t* wp, const __half* ws, bool row,
                                        const void* bias, void* out, int M, int N, int K, int row_groups, int depth,
                                        int sms, cudaStream_t stream);
int ternary_mma_tiles_splits(int M, int N, int K, int sms, int tile);
cudaError_t launch_ternary_mma_tiles(const void* x, int64_t ldx, int dtype, const uint8_t* wp, const __half* ws,
                                     const void* bias, void* out, float* workspace, int M, int N, int K, int splits,
                                     int tile, cudaStream_t stream);
int ternary_wgmma_splits(int M, int N, int K, int sms, int tile);
bool ternary_wgmma_cluster_sums(int M, int N, int K, int sms, int tile, int splits);
cudaError_t launch_ternary_wgmma(const void* x, int64_t ldx, int dtype, const uint8_t* wp, const __half* ws,
                                 const void* bias, void* out, float* workspace, int M, int N, int K, int splits,
                                 int tile, int sms, cudaStream_t stream);
cudaError_t launch_ternary_wgmma_a8(const int8_t* q, const float* qs, int out_dtype, const uint8_t* wp,
                                    const __half* ws, bool row, const void* bias, void* out, int M, int N, int K,
                                    int tile, int sms, cudaStream_t stream);
cudaError_t launch_ternary_dequant(const uint8_t* wp, const __half* ws, int layout, int out_dtype, void* out, int N,
                                   int K, cudaStream_t stream);
cudaError_t launch_ternary_decode_int8(const uint8_t* wp, int layout, int8_t* out, int N, int K, cudaStream_t stream);
}  // namespace ternop

namespace {

int dtype_code(at::ScalarType t) {
  switch (t) {
    case at::kHalf: return 0;
    case at::kBFloat16: return 1;
    case at::kFloat: return 2;
    default: return -1;
  }
}

bool aligned16(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

// Checks weight_packed uint8 [N, K/4] and weight_scale fp16 [N, K/128] (or [N, 1] when
// `row_scales`; contiguous, weights 16-byte aligned) against K and returns N.
int64_t check_weights(const char* op, const at::Tensor& weight_packed, const at::Tensor& weight_scale, int64_t K,
                      bool row_scales = false) {
  TORCH_CHECK(weight_packed.is_cuda() && weight_scale.is_cuda(), op,
              ": weight_packed and weight_scale must be CUDA tensors");
  TORCH_CHECK(K % 128 == 0, op, ": K=", K, " must be a multiple of 128");
  TORCH_CHECK(weight_packed.scalar_type() == at::kByte && weight_packed.dim() == 2 &&
                  weight_packed.size(1) * 4 == K && weight_packed.is_contiguous(),
              op, ": weight_packed must be contiguous uint8 [N, K/4] = [N, ", K / 4, "], got ",
              weight_packed.scalar_type(), " ", weight_packed.sizes());
  const int64_t N = weight_packed.size(0);
  TORCH_CHECK(weight_scale.scalar_type() == at::kHalf && weight_scale.dim() == 2 && weight_scale.size(0) == N &&
                  (weight_scale.size(1) == K / 128 || (row_scales && weight_scale.size(1) == 1)) &&
                  weight_scale.is_contiguous(),
              op, ": weight_scale must be contiguous float16 [N, K/128] = [", N, ", ", K / 128, "]",
              row_scales ? " or [N, 1]" : "", ", got ", weight_scale.scalar_type(), " ", weight_scale.sizes());
  TORCH_CHECK(aligned16(weight_packed), op, ": weight_packed must be 16-byte aligned");
  TORCH_CHECK(N <= INT32_MAX && K <= INT32_MAX, op, ": N and K must fit in int32");
  return N;
}

// Whether weight_scale holds a scale per row ([N, 1]; with one block, K = 128, both forms are the
// same arithmetic).
bool row_scaled(const at::Tensor& weight_scale, int64_t K) {
  return weight_scale.dim() == 2 && weight_scale.size(1) == 1;
}

// The bias as a contiguous [N] tensor of `dtype` (kept alive by the caller), or nullptr.
const void* bias_pointer(const char* op, const std::optional<at::Tensor>& bias, at::ScalarType dtype, int64_t N,
                         at::Tensor& keep) {
  if (!bias.has_value()) return nullptr;
  keep = bias->contiguous();
  TORCH_CHECK(keep.scalar_type() == dtype && keep.dim() == 1 && keep.size(0) == N && keep.is_cuda(), op,
              ": bias must be a CUDA [N] = [", N, "] tensor of dtype ", dtype, ", got ", keep.scalar_type(), " ",
              keep.sizes());
  return keep.data_ptr();
}

// x [M, K] contiguous and 16-byte aligned, 1 <= M <= max_m, fp16/bf16 (and fp32 when `fp32`).
void check_x(const char* op, const at::Tensor& x, int max_m, bool fp32) {
  TORCH_CHECK(x.is_cuda(), op, ": x must be a CUDA tensor");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), op, ": x must be a contiguous [M, K] tensor, got ", x.sizes());
  const int code = dtype_code(x.scalar_type());
  TORCH_CHECK(code >= 0 && (fp32 || code != 2), op, ": x must be float16",
              fp32 ? ", bfloat16 or float32" : " or bfloat16", ", got ", x.scalar_type());
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= max_m, op, ": x has M=", x.size(0), " rows; this kernel takes 1..",
              max_m);
  TORCH_CHECK(aligned16(x), op, ": x must be 16-byte aligned");
}

cudaStream_t stream_of(const at::Tensor& t) { return c10::cuda::getCurrentCUDAStream(t.device().index()).stream(); }

// The multiprocessor count of t's device (ATen caches the properties).
int sms_of(const at::Tensor& t) { return at::cuda::getDeviceProperties(t.device().index())->multiProcessorCount; }

// The small-M kernels' row_groups argument: -1 (the kernel's choice) or 1, 2, 4, 8 sets of 16
// rows per CTA.
void check_row_groups(const char* op, int64_t row_groups) {
  TORCH_CHECK(row_groups == -1 || row_groups == 1 || row_groups == 2 || row_groups == 4 || row_groups == 8, op,
              ": row_groups must be -1 (the kernel's choice), 1, 2, 4 or 8; got ", row_groups);
}

// The small-M kernels' depth argument: -1 (the kernel's choice), or a depth that `takes` (the
// kernel's own rule) accepts; `rule` says that rule in the error.
void check_depth(const char* op, int64_t depth, bool takes, const char* rule) {
  TORCH_CHECK(depth == -1 || (depth > 0 && takes), op, ": depth must be -1 (the kernel's choice) or ", rule,
              "; got ", depth);
}

// The shared body of the fp16/bf16/fp32-x ops: checks, output allocation, launch(dtype code,
// bias pointer, out, M, N, K) on the current stream, error check. `row_scales`: the kernel also
// takes weight_scale [N, 1].
template <typename Launch>
at::Tensor run_on_x(const char* op, const at::Tensor& x, const at::Tensor& weight_packed,
                    const at::Tensor& weight_scale, const std::optional<at::Tensor>& bias, int max_m, bool fp32,
                    Launch&& launch, bool row_scales = false) {
  check_x(op, x, max_m, fp32);
  const int64_t M = x.size(0), K = x.size(1);
  const int64_t N = check_weights(op, weight_packed, weight_scale, K, row_scales);
  at::Tensor keep;
  const void* b = bias_pointer(op, bias, x.scalar_type(), N, keep);
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor out = at::empty({M, N}, x.options());
  const cudaError_t err = launch(dtype_code(x.scalar_type()), b, out.data_ptr(), static_cast<int>(M),
                                 static_cast<int>(N), static_cast<int>(K));
  TORCH_CHECK(err == cudaSuccess, op, ": kernel launch failed: ", cudaGetErrorString(err));
  return out;
}

at::Tensor linear_cuda(const at::Tensor& x, const at::Tensor& weight_packed, const at::Tensor& weight_scale,
                       const std::optional<at::Tensor>& bias) {
  return run_on_x("ternop.linear_cuda", x, weight_packed, weight_scale, bias, ternop::ternary_gemv_max_m(), true,
                  [&](int code, const void* b, void* out, int M, int N, int K) {
                    return ternop::launch_ternary_gemv(x.data_ptr(), code, weight_packed.data_ptr<uint8_t>(),
                                                       reinterpret_cast<const __half*>(weight_scale.data_ptr()), b,
                                                       out, M, N, K, stream_of(x));
                  });
}

at::Tensor linear_cuda_mma(const at::Tensor& x, const at::Tensor& weight_packed, const at::Tensor& weight_scale,
                           const std::optional<at::Tensor>& bias, bool a16, int64_t row_groups, int64_t depth,
                           int64_t slab) {
  const char* op = "ternop.linear_cuda_mma";
  check_row_groups(op, row_groups);
  check_depth(op, depth, depth <= INT32_MAX && ternop::ternary_mma_takes_depth(a16, static_cast<int>(depth)),
              "2, or 4 with a16 weights");
  TORCH_CHECK(slab >= 0 && slab <= 16 &&
                  ternop::ternary_mma_takes_slab(a16, static_cast<int>(depth), static_cast<int>(slab)),
              op, ": slab must be 0 (one CTA takes all of M), or 8 or 16 with a16 weights at the default depth; got ",
              slab, a16 ? "" : " with v1 weights", depth == -1 || depth == 2 ? "" : " at depth 4");
  return run_on_x(op, x, weight_packed, weight_scale, bias, ternop::ternary_mma_max_m(static_cast<int>(slab)), false,
                  [&](int code, const void* b, void* out, int M, int N, int K) {
                    return ternop::launch_ternary_mma(x.data_ptr(), code, weight_packed.data_ptr<uint8_t>(),
                                                      reinterpret_cast<const __half*>(weight_scale.data_ptr()), b,
                                                      out, M, N, K, a16, static_cast<int>(row_groups),
                                                      static_cast<int>(depth), static_cast<int>(slab), sms_of(x),
                                                      stream_of(x));
                  });
}

// The checks of the W2A8 ops that take q already quantized: q int8 [M, K] (1 <= M <= max_m),
// qs fp32 [M], the weights, the bias in `dtype`; then launch(code, bias, out, M, N, K) on the
// current stream.
template <typename Launch>
at::Tensor run_on_q(const char* op, const at::Tensor& q, const at::Tensor& qs, const at::Tensor& weight_packed,
                    const at::Tensor& weight_scale, const std::optional<at::Tensor>& bias, at::ScalarType dtype,
                    int64_t max_m, Launch&& launch) {
  TORCH_CHECK(q.is_cuda() && qs.is_cuda(), op, ": q and qs must be CUDA tensors");
  TORCH_CHECK(q.scalar_type() == at::kChar && q.dim() == 2 && q.is_contiguous() && aligned16(q), op,
              ": q must be a contiguous, 16-byte aligned int8 [M, K] tensor, got ", q.scalar_type(), " ", q.sizes());
  const int64_t M = q.size(0), K = q.size(1);
  TORCH_CHECK(M >= 1 && M <= max_m, op, ": q has M=", M, " rows; this kernel takes 1..", max_m);
  TORCH_CHECK(qs.scalar_type() == at::kFloat && qs.dim() == 1 && qs.size(0) == M && qs.is_contiguous(), op,
              ": qs must be a contiguous float32 [M] = [", M, "] tensor, got ", qs.scalar_type(), " ", qs.sizes());
  const int code = dtype_code(dtype);
  TORCH_CHECK(code >= 0, op, ": dtype must be float16, bfloat16 or float32, got ", dtype);
  const int64_t N = check_weights(op, weight_packed, weight_scale, K, /*row_scales=*/true);
  at::Tensor keep;
  const void* b = bias_pointer(op, bias, dtype, N, keep);
  const c10::cuda::CUDAGuard guard(q.device());
  at::Tensor out = at::empty({M, N}, q.options().dtype(dtype));
  const cudaError_t err = launch(code, b, out.data_ptr(), static_cast<int>(M), static_cast<int>(N),
                                 static_cast<int>(K));
  TORCH_CHECK(err == cudaSuccess, op, ": kernel launch failed: ", cudaGetErrorString(err));
  return out;
}

at::Tensor linear_cuda_mma_a8(const at::Tensor& q, const at::Tensor& qs, const at::Tensor& weight_packed,
                              const at::Tensor& weight_scale, const std::optional<at::Tensor>& bias,
                              at::ScalarType dtype, int64_t row_groups, int64_t depth, int64_t slab) {
  const char* op = "ternop.linear_cuda_mma_a8";
  check_row_groups(op, row_groups);
  check_depth(op, depth, depth <= INT32_MAX && ternop::ternary_mma_a8_takes_depth(static_cast<int>(depth)),
              "2 or 4");
  TORCH_CHECK(slab >= 0 && slab <= 32 && ternop::ternary_mma_a8_takes_slab(static_cast<int>(slab)), op,
              ": slab must be 0 (one CTA takes all of M), 8, 16 or 32; got ", slab);
  const bool row = row_scaled(weight_scale, q.dim() == 2 ? q.size(1) : 0);  // run_on_q checks q's shape
  return run_on_q(op, q, qs, weight_packed, weight_scale, bias, dtype,
                  ternop::ternary_mma_a8_max_m(row, static_cast<int>(slab)),
                  [&](int code, const void* b, void* out, int M, int N, int K) {
                    return ternop::launch_ternary_mma_a8(q.data_ptr<int8_t>(), qs.data_ptr<float>(), code,
                                                         weight_packed.data_ptr<uint8_t>(),
                                                         reinterpret_cast<const __half*>(weight_scale.data_ptr()),
                                                         row, b, out, M, N, K,
                                                         static_cast<int>(row_groups), static_cast<int>(depth),
                                                         static_cast<int>(slab), sms_of(q), stream_of(q));
                  });
}

at::Tensor linear_cuda_wgmma_a8(const at::Tensor& q, const at::Tensor& qs, const at::Tensor& weight_packed,
                                const at::Tensor& weight_scale, const std::optional<at::Tensor>& bias,
                                at::ScalarType dtype, int64_t tile) {
  const char* op = "ternop.linear_cuda_wgmma_a8";
  TORCH_CHECK(tile >= -1 && tile <= 5 && (tile < 2 || row_scaled(weight_scale, q.size(1))), op,
              ": tile must be -1 (the kernel's choice), 0 or 1, or with row scales 2 to 5; got ", tile);
  int sms = 0;
  TORCH_CHECK(q.is_cuda() && cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, q.device().index()) ==
                                 cudaSuccess,
              op, ": q must be a CUDA tensor on a device whose multiprocessor count can be read");
  return run_on_q(op, q, qs, weight_packed, weight_scale, bias, dtype, INT32_MAX,
                  [&](int code, const void* b, void* out, int M, int N, int K) {
                    return ternop::launch_ternary_wgmma_a8(
                        q.data_ptr<int8_t>(), qs.data_ptr<float>(), code, weight_packed.data_ptr<uint8_t>(),
                        reinterpret_cast<const __half*>(weight_scale.data_ptr()), row_scaled(weight_scale, K), b,
                        out, M, N, K, static_cast<int>(tile), sms, stream_of(q));
                  });
}

at::Tensor linear_cuda_mma_a8_fused(const at::Tensor& x, const at::Tensor& weight_packed,
                                    const at::Tensor& weight_scale, const std::optional<at::Tensor>& bias,
                                    int64_t row_groups, int64_t depth) {
  const char* op = "ternop.linear_cuda_mma_a8_fused";
  check_row_groups(op, row_groups);
  check_depth(op, depth, depth <= INT32_MAX && ternop::ternary_mma_a8_takes_depth(static_cast<int>(depth)),
              "2 or 4");
  const bool takes = x.dim() == 2 && x.size(1) <= INT32_MAX &&
                     ternop::ternary_mma_a8_fused_takes(static_cast<int>(x.size(0)), static_cast<int>(x.size(1)));
  TORCH_CHECK(takes, op, ": x ", x.sizes(), " is past the fused quantization's M <= 2 and M * K <= 40960");
  return run_on_x(op, x, weight_packed, weight_scale, bias, 2, true,
                  [&](int code, const void* b, void* out, int M, int N, int K) {
                    return ternop::launch_ternary_mma_a8_fused(x.data_ptr(), code, weight_packed.data_ptr<uint8_t>(),
                                                               reinterpret_cast<const __half*>(weight_scale.data_ptr()),
                                                               row_scaled(weight_scale, K), b, out, M, N, K,
                                                               static_cast<int>(row_groups), static_cast<int>(depth),
                                                               sms_of(x), stream_of(x));
                  },
                  /*row_scales=*/true);
}

at::Tensor linear_cuda_dequant(const at::Tensor& x, const at::Tensor& weight_packed, const at::Tensor& weight_scale,
                               const std::optional<at::Tensor>& bias, int64_t layout) {
  const char* op = "ternop.linear_cuda_dequant";
  TORCH_CHECK(x.is_cuda() && x.dim() == 2, op, ": x must be a 2-D CUDA tensor, got ", x.sizes());
  const int code = dtype_code(x.scalar_type());
  TORCH_CHECK(code >= 0, op, ": x must be float16, bfloat16 or float32, got ", x.scalar_type());
  TORCH_CHECK(layout >= 0 && layout <= 2, op, ": layout must be 0 (v1), 1 (a16) or 2 (a8), got ", layout);
  const int64_t K = x.size(1);
  const int64_t N = check_weights(op, weight_packed, weight_scale, K);
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor w = at::empty({N, K}, x.options());
  const cudaError_t err = ternop::launch_ternary_dequant(
      weight_packed.data_ptr<uint8_t>(), reinterpret_cast<const __half*>(weight_scale.data_ptr()),
      static_cast<int>(layout), code, w.data_ptr(), static_cast<int>(N), static_cast<int>(K), stream_of(x));
  TORCH_CHECK(err == cudaSuccess, op, ": kernel launch failed: ", cudaGetErrorString(err));
  return at::linear(x, w, bias);
}

at::Tensor decode_int8_cuda(const at::Tensor& weight_packed, int64_t layout) {
  const char* op = "ternop.decode_int8_cuda";
  TORCH_CHECK(weight_packed.is_cuda() && weight_packed.scalar_type() == at::kByte && weight_packed.dim() == 2 &&
                  weight_packed.is_contiguous() && aligned16(weight_packed),
              op, ": weight_packed must be a contiguous, 16-byte aligned uint8 [N, K/4] CUDA tensor, got ",
              weight_packed.scalar_type(), " ", weight_packed.sizes());
  TORCH_CHECK(layout >= 0 && layout <= 2, op, ": layout must be 0 (v1), 1 (a16) or 2 (a8), got ", layout);
  const int64_t N = weight_packed.size(0), K = weight_packed.size(1) * 4;
  TORCH_CHECK(N >= 1 && K >= 128 && K % 128 == 0 && N <= INT32_MAX && K <= INT32_MAX, op,
              ": N >= 1 and K a positive multiple of 128 that fit in int32, got N=", N, ", K=", K);
  const c10::cuda::CUDAGuard guard(weight_packed.device());
  at::Tensor out = at::empty({N, K}, weight_packed.options().dtype(at::kChar));
  const cudaError_t err = ternop::launch_ternary_decode_int8(weight_packed.data_ptr<uint8_t>(), static_cast<int>(layout),
                                                             out.data_ptr<int8_t>(), static_cast<int>(N),
                                                             static_cast<int>(K), stream_of(weight_packed));
  TORCH_CHECK(err == cudaSuccess, op, ": kernel launch failed: ", cudaGetErrorString(err));
  return out;
}

// The shared body of the split-K a16 ops (mid and large M): x [M, K] fp16/bf16 with any row
// stride that keeps rows 16-byte aligned, checks, the split count splits_of(M, N, K, sms), the fp32
// workspace [splits, M, N] unless in_cluster(M, N, K, sms, splits) says the kernel adds its splits
// on chip, launch(code, bias, out, workspace, M, N, K, splits, sms) on the current stream.
template <typename Splits, typename InCluster, typename Launch>
at::Tensor run_split_k(const char* op, const at::Tensor& x, const at::Tensor& weight_packed,
                       const at::Tensor& weight_scale, const std::optional<at::Tensor>& bias, Splits&& splits_of,
                       InCluster&& in_cluster, Launch&& launch) {
  TORCH_CHECK(x.is_cuda() && x.dim() == 2 && x.size(0) >= 1, op, ": x must be a 2-D CUDA tensor with M >= 1, got ",
              x.sizes());
  const int code = dtype_code(x.scalar_type());
  TORCH_CHECK(code == 0 || code == 1, op, ": x must be float16 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(x.stride(1) == 1 && x.stride(0) >= x.size(1) && x.stride(0) % 8 == 0 && aligned16(x), op,
              ": x's rows must be unit-stride, 16-byte aligned, and a multiple of 8 elements apart");
  const int64_t M = x.size(0), K = x.size(1);
  const int64_t N = check_weights(op, weight_packed, weight_scale, K);
  TORCH_CHECK(M <= INT32_MAX, op, ": M must fit in int32");
  at::Tensor keep;
  const void* b = bias_pointer(op, bias, x.scalar_type(), N, keep);
  const c10::cuda::CUDAGuard guard(x.device());
  int sms = 0;
  TORCH_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, x.device().index()) == cudaSuccess, op,
              ": could not read the device's multiprocessor count");
  const int m = static_cast<int>(M), n = static_cast<int>(N), k = static_cast<int>(K);
  const int splits = splits_of(m, n, k, sms);
  at::Tensor out = at::empty({M, N}, x.options());
  at::Tensor workspace;
  if (splits > 1 && !in_cluster(m, n, k, sms, splits)) workspace = at::empty({splits, M, N}, x.options().dtype(at::kFloat));
  const cudaError_t err =
      launch(code, b, out.data_ptr(), workspace.defined() ? workspace.data_ptr<float>() : nullptr, m, n, k, splits, sms);
  TORCH_CHECK(err == cudaSuccess, op, ": kernel launch failed: ", cudaGetErrorString(err));
  return out;
}

at::Tensor linear_cuda_mma_tiles(const at::Tensor& x, const at::Tensor& weight_packed, const at::Tensor& weight_scale,
                                 const std::optional<at::Tensor>& bias, int64_t tile) {
  const int t = static_cast<int>(tile);
  return run_split_k(
      "ternop.linear_cuda_mma_tiles", x, weight_packed, weight_scale, bias,
      [&](int M, int N, int K, int sms) { return ternop::ternary_mma_tiles_splits(M, N, K, sms, t); },
      [](int, int, int, int, int) { return false; },
      [&](int code, const void* b, void* out, float* workspace, int M, int N, int K, int splits, int) {
        return ternop::launch_ternary_mma_tiles(x.data_ptr(), x.stride(0), code, weight_packed.data_ptr<uint8_t>(),
                                                reinterpret_cast<const __half*>(weight_scale.data_ptr()), b, out,
                                                workspace, M, N, K, splits, t, stream_of(x));
      });
}

at::Tensor linear_cuda_wgmma(const at::Tensor& x, const at::Tensor& weight_packed, const at::Tensor& weight_scale,
                             const std::optional<at::Tensor>& bias, int64_t tile) {
  const int t = static_cast<int>(tile);
  return run_split_k(
      "ternop.linear_cuda_wgmma", x, weight_packed, weight_scale, bias,
      [&](int M, int N, int K, int sms) { return ternop::ternary_wgmma_splits(M, N, K, sms, t); },
      [&](int M, int N, int K, int sms, int splits) {
        return ternop::ternary_wgmma_cluster_sums(M, N, K, sms, t, splits);
      },
      [&](int code, const void* b, void* out, float* workspace, int M, int N, int K, int splits, int sms) {
        return ternop::launch_ternary_wgmma(x.data_ptr(), x.stride(0), code, weight_packed.data_ptr<uint8_t>(),
                                            reinterpret_cast<const __half*>(weight_scale.data_ptr()), b, out,
                                            workspace, M, N, K, splits, t, sms, stream_of(x));
      });
}

}  // namespace

TORCH_LIBRARY_IMPL(ternop, CUDA, m) {
  m.impl("linear_cuda", &linear_cuda);
  m.impl("linear_cuda_mma", &linear_cuda_mma);
  m.impl("linear_cuda_mma_a8", &linear_cuda_mma_a8);
  m.impl("linear_cuda_mma_a8_fused", &linear_cuda_mma_a8_fused);
  m.impl("linear_cuda_dequant", &linear_cuda_dequant);
  m.impl("linear_cuda_mma_tiles", &linear_cuda_mma_tiles);
  m.impl("linear_cuda_wgmma", &linear_cuda_wgmma);
  m.impl("linear_cuda_wgmma_a8", &linear_cuda_wgmma_a8);
  m.impl("decode_int8_cuda", &decode_int8_cuda);
}
