// Torch bindings of the CUDA C++ small-M kernels: the private ops
//
//   ternop::linear_cuda(Tensor x, Tensor weight_packed, Tensor weight_scale, Tensor? bias=None) -> Tensor
//   ternop::linear_cuda_mma(Tensor x, Tensor weight_packed, Tensor weight_scale, Tensor? bias=None) -> Tensor
//
// x [M, K] contiguous, fp16/bf16/fp32 with 1 <= M <= ternary_gemv_max_m() (CUDA cores,
// ternary_gemv.cu) or fp16/bf16 with 1 <= M <= ternary_mma_max_m() (tensor cores,
// ternary_mma.cu); weight_packed uint8 [N, K/4]; weight_scale fp16 [N, K/128]; bias [N] in
// x's dtype or None -> new [M, N] in x's dtype. They allocate only through the caching
// allocator and launch on the current stream, so they are safe inside CUDA graph capture.

#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_fp16.h>
#include <torch/library.h>

namespace ternop {
int ternary_gemv_max_m();
cudaError_t launch_ternary_gemv(const void* x, int dtype, const uint8_t* wp, const __half* ws, const void* bias,
                                void* out, int M, int N, int K, cudaStream_t stream);
int ternary_mma_max_m();
cudaError_t launch_ternary_mma(const void* x, int dtype, const uint8_t* wp, const __half* ws, const void* bias,
                               void* out, int M, int N, int K, cudaStream_t stream);
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

using Launch = cudaError_t (*)(const void*, int, const uint8_t*, const __half*, const void*, void*, int, int, int,
                               cudaStream_t);

// Shared checks and launch; `op` names the op in errors, `max_m` and `fp32` are the kernel's limits.
at::Tensor run_linear(const char* op, Launch launch, int max_m, bool fp32, const at::Tensor& x,
                      const at::Tensor& weight_packed, const at::Tensor& weight_scale,
                      const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.is_cuda() && weight_packed.is_cuda() && weight_scale.is_cuda(), op,
              ": x, weight_packed and weight_scale must be CUDA tensors");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), op, ": x must be a contiguous [M, K] tensor, got ", x.sizes());
  const int code = dtype_code(x.scalar_type());
  TORCH_CHECK(code >= 0 && (fp32 || code != 2), op, ": x must be float16",
              fp32 ? ", bfloat16 or float32" : " or bfloat16", ", got ", x.scalar_type());
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(M >= 1 && M <= max_m, op, ": x has M=", M, " rows; this kernel takes 1..", max_m);
  TORCH_CHECK(K % 128 == 0, op, ": K=", K, " must be a multiple of 128");
  TORCH_CHECK(weight_packed.scalar_type() == at::kByte && weight_packed.dim() == 2 &&
                  weight_packed.size(1) * 4 == K && weight_packed.is_contiguous(),
              op, ": weight_packed must be contiguous uint8 [N, K/4] = [N, ", K / 4, "], got ",
              weight_packed.scalar_type(), " ", weight_packed.sizes());
  const int64_t N = weight_packed.size(0);
  TORCH_CHECK(weight_scale.scalar_type() == at::kHalf && weight_scale.dim() == 2 && weight_scale.size(0) == N &&
                  weight_scale.size(1) == K / 128 && weight_scale.is_contiguous(),
              op, ": weight_scale must be contiguous float16 [N, K/128] = [", N, ", ", K / 128, "], got ",
              weight_scale.scalar_type(), " ", weight_scale.sizes());
  TORCH_CHECK(aligned16(x) && aligned16(weight_packed), op, ": x and weight_packed must be 16-byte aligned");
  TORCH_CHECK(N <= INT32_MAX && K <= INT32_MAX, op, ": N and K must fit in int32");
  const void* bias_ptr = nullptr;
  at::Tensor b;
  if (bias.has_value()) {
    b = bias->contiguous();
    TORCH_CHECK(b.scalar_type() == x.scalar_type() && b.dim() == 1 && b.size(0) == N && b.is_cuda(), op,
                ": bias must be a CUDA [N] = [", N, "] tensor of x's dtype ", x.scalar_type(), ", got ",
                b.scalar_type(), " ", b.sizes());
    bias_ptr = b.data_ptr();
  }
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor out = at::empty({M, N}, x.options());
  const cudaError_t err =
      launch(x.data_ptr(), code, weight_packed.data_ptr<uint8_t>(),
             reinterpret_cast<const __half*>(weight_scale.data_ptr()), bias_ptr, out.data_ptr(), static_cast<int>(M),
             static_cast<int>(N), static_cast<int>(K), c10::cuda::getCurrentCUDAStream(x.device().index()).stream());
  TORCH_CHECK(err == cudaSuccess, op, ": kernel launch failed: ", cudaGetErrorString(err));
  return out;
}

at::Tensor linear_cuda(const at::Tensor& x, const at::Tensor& weight_packed, const at::Tensor& weight_scale,
                       const std::optional<at::Tensor>& bias) {
  return run_linear("ternop.linear_cuda", &ternop::launch_ternary_gemv, ternop::ternary_gemv_max_m(), true, x,
                    weight_packed, weight_scale, bias);
}

at::Tensor linear_cuda_mma(const at::Tensor& x, const at::Tensor& weight_packed, const at::Tensor& weight_scale,
                           const std::optional<at::Tensor>& bias) {
  return run_linear("ternop.linear_cuda_mma", &ternop::launch_ternary_mma, ternop::ternary_mma_max_m(), false, x,
                    weight_packed, weight_scale, bias);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ternop, m) {
  m.def("linear_cuda(Tensor x, Tensor weight_packed, Tensor weight_scale, Tensor? bias=None) -> Tensor");
  m.def("linear_cuda_mma(Tensor x, Tensor weight_packed, Tensor weight_scale, Tensor? bias=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(ternop, CUDA, m) {
  m.impl("linear_cuda", &linear_cuda);
  m.impl("linear_cuda_mma", &linear_cuda_mma);
}
