// The CUDA cast entry point (cast_kernels.cu), for the host code in native.cpp.
#pragma once
#include <ATen/ATen.h>

namespace fp8p {

// Casts `x` ([M, N], last dimension contiguous, float32 / float16 / bfloat16, M and N > 0) with `*scale` into
// `data` ([M, N]) and / or `t` ([N, M]), either may be null; writes 1 / scale to `scale_inv` and maxes the
// amax of |x| into `amax` (may be null). A non-zero `noop` flag (may be null) makes it a no-op on the device.
void cast_cuda(const at::Tensor& x, const float* scale, unsigned char* data, unsigned char* t, float* scale_inv,
               float* amax, const at::Tensor* noop, bool e5m2);

}  // namespace fp8p
