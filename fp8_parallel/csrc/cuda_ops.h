// The CUDA entry points (cast_kernels.cu, lt_gemm.cpp), for the host code in native.cpp.
#pragma once
#include <ATen/ATen.h>

#include <optional>

namespace fp8p {

// Casts `x` ([M, N], last dimension contiguous, float32 / float16 / bfloat16, M and N > 0) with `*scale` into
// `data` ([M, N]) and / or `t` ([N, M]), either may be null; writes 1 / scale to `scale_inv` and maxes the
// amax of |x| into `amax` (may be null). A non-zero `noop` flag (may be null) makes it a no-op on the device.
void cast_cuda(const at::Tensor& x, const float* scale, unsigned char* data, unsigned char* t, float* scale_inv,
               float* amax, const at::Tensor* noop, bool e5m2);

// out = a @ b.T (+ bias) for row-major FP8 a [M, K], b [N, K] with per-tensor scales, through cuBLASLt with a
// plan kept per shape (the kernel torch._scaled_mm runs); false where it does not apply (then call torch).
// `accumulate_into` (may be null; a contiguous [M, N] tensor of `out_dtype`, no bias): the product is added
// into it in the GEMM's epilogue (beta 1), and `out` is that tensor.
bool lt_scaled_mm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& a_sinv, const at::Tensor& b_sinv,
                  const std::optional<at::Tensor>& bias, at::ScalarType out_dtype, bool fast_accum, at::Tensor& out,
                  const at::Tensor* accumulate_into = nullptr);

}  // namespace fp8p
