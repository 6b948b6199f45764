// The FP8 GEMM through cuBLASLt with its plan (descriptors, layouts, algorithm) made once per shape and kept.
//
// torch._scaled_mm builds its descriptors and asks cuBLASLt's heuristic for an algorithm on every call, which is
// most of its host time. This asks the same question once per shape (the same descriptors, the same workspace
// limit, the first heuristic answer) and then only issues cublasLtMatmul, so it runs the kernel torch would run
// and writes the same bytes.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cublasLt.h>

#include <stdexcept>

#include "messages.h"

#include <cstdlib>
#include <cstring>
#include <unordered_map>

#include "cuda_ops.h"

namespace fp8p {
namespace {

cudaDataType_t cuda_type(at::ScalarType t) {
  switch (t) {
    case at::kFloat8_e4m3fn: return CUDA_R_8F_E4M3;
    case at::kFloat8_e5m2: return CUDA_R_8F_E5M2;
    case at::kBFloat16: return CUDA_R_16BF;
    case at::kHalf: return CUDA_R_16F;
    case at::kFloat: return CUDA_R_32F;
    default: throw std::runtime_error(message("fp8_parallel cuBLASLt GEMM: unsupported dtype ", t));
  }
}

struct Key {
  int64_t m, n, k;
  int a, b, out, bias;  // dtypes (bias: -1 without one)
  bool fast_accum;
  bool accumulate;  // D = a @ b.T + C with C = D (beta 1)
  int cd_align;     // bytes C and D start at a multiple of (the output alone: 256)
  int device;
  size_t workspace;
  bool operator==(const Key& o) const { return std::memcmp(this, &o, sizeof(Key)) == 0; }
};

struct KeyHash {
  size_t operator()(const Key& k) const {
    size_t h = 1469598103934665603ull;
    const unsigned char* p = reinterpret_cast<const unsigned char*>(&k);
    for (size_t i = 0; i < sizeof(Key); ++i) h = (h ^ p[i]) * 1099511628211ull;
    return h;
  }
};

struct Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t A = nullptr, B = nullptr, C = nullptr, D = nullptr;
  cublasLtMatmulAlgo_t algo;
  bool ok = false;
};

#define FP8P_LT_CHECK(call)                                                                            \
  do {                                                                                                 \
    const cublasStatus_t status_ = (call);                                                             \
    if (status_ != CUBLAS_STATUS_SUCCESS)                                                              \
      throw std::runtime_error(message("fp8_parallel cuBLASLt GEMM: ", #call, " failed (status ",     \
                                       static_cast<int>(status_), ")"));                               \
  } while (0)

// cuBLAS is column-major: the row-major result [M, N] = a [M, K] @ b [N, K].T is the column-major [N, M] =
// b^T (A, transposed) @ a (B), as torch arranges it; A's scale is b's, B's is a's
Plan make_plan(const Key& key, cublasLtHandle_t handle, const void* a_scale, const void* b_scale,
               const void* bias_ptr) {
  Plan p;
  const int64_t m = key.n, n = key.m, k = key.k;  // cuBLAS's m, n, k
  FP8P_LT_CHECK(cublasLtMatmulDescCreate(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
  FP8P_LT_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
  FP8P_LT_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
  const int8_t fast = key.fast_accum ? 1 : 0;
  FP8P_LT_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof(fast)));
  const int32_t scalar_mode = CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F;
  FP8P_LT_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &scalar_mode,
                                               sizeof(scalar_mode)));
  FP8P_LT_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &scalar_mode,
                                               sizeof(scalar_mode)));
  // the first call's pointers (later calls set their own): the heuristic sees what torch's sees
  FP8P_LT_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &a_scale,
                                               sizeof(a_scale)));
  FP8P_LT_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &b_scale,
                                               sizeof(b_scale)));
  const at::ScalarType out = static_cast<at::ScalarType>(key.out);
  const at::ScalarType c_type = key.bias >= 0 ? static_cast<at::ScalarType>(key.bias) : out;
  if (key.bias >= 0) {
    const cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_BIAS;
    const cudaDataType_t bias_type = cuda_type(c_type);
    FP8P_LT_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias_ptr,
                                                 sizeof(bias_ptr)));
    FP8P_LT_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof(epilogue)));
    FP8P_LT_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_type,
                                                 sizeof(bias_type)));
  }
  FP8P_LT_CHECK(cublasLtMatrixLayoutCreate(&p.A, cuda_type(static_cast<at::ScalarType>(key.b)), k, m, k));
  FP8P_LT_CHECK(cublasLtMatrixLayoutCreate(&p.B, cuda_type(static_cast<at::ScalarType>(key.a)), k, n, k));
  FP8P_LT_CHECK(cublasLtMatrixLayoutCreate(&p.C, cuda_type(c_type), m, n, m));
  FP8P_LT_CHECK(cublasLtMatrixLayoutCreate(&p.D, cuda_type(out), m, n, m));
  cublasLtMatmulPreference_t pref = nullptr;
  FP8P_LT_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  const size_t workspace = key.workspace;
  FP8P_LT_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace,
                                                     sizeof(workspace)));
  if (key.cd_align < 256) {  // an accumulation target inside a larger buffer (megatron's grad buffer)
    const uint32_t align = static_cast<uint32_t>(key.cd_align);
    FP8P_LT_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align,
                                                       sizeof(align)));
    FP8P_LT_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align,
                                                       sizeof(align)));
  }
  cublasLtMatmulHeuristicResult_t result = {};
  int returned = 0;
  const cublasStatus_t status =
      cublasLtMatmulAlgoGetHeuristic(handle, p.desc, p.A, p.B, p.C, p.D, pref, 1, &result, &returned);
  cublasLtMatmulPreferenceDestroy(pref);
  if (status == CUBLAS_STATUS_SUCCESS && returned > 0) {
    p.algo = result.algo;
    p.ok = true;
  }
  return p;
}

bool enabled() {
  static const bool on = [] {
    const char* v = std::getenv("FP8_PARALLEL_NATIVE_GEMM");
    return v == nullptr || std::strcmp(v, "0") != 0;
  }();
  return on;
}

bool aligned(const void* p, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

// the largest power of two up to 256 that `p` is a multiple of
int alignment_of(const void* p) {
  int align = 256;
  while (align > 1 && !aligned(p, align)) align /= 2;
  return align;
}

}  // namespace

bool lt_scaled_mm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& a_sinv, const at::Tensor& b_sinv,
                  const std::optional<at::Tensor>& bias, at::ScalarType out_dtype, bool fast_accum, at::Tensor& out,
                  const at::Tensor* accumulate_into) {
  if (!enabled() || !a.is_cuda()) return false;
  if (accumulate_into != nullptr && (bias || !accumulate_into->is_contiguous() ||
                                    accumulate_into->scalar_type() != out_dtype ||
                                    !aligned(accumulate_into->data_ptr(), 16)))
    return false;
  const int64_t M = a.size(0), K = a.size(1), N = b.size(0);
  if (accumulate_into != nullptr && (accumulate_into->dim() != 2 || accumulate_into->size(0) != M ||
                                    accumulate_into->size(1) != N))
    return false;
  // cuBLASLt's heuristic assumes 256-byte aligned matrices unless told otherwise; anything else goes to torch
  if (M == 0 || K == 0 || N == 0 || !a.is_contiguous() || !b.is_contiguous() || !aligned(a.data_ptr(), 256) ||
      !aligned(b.data_ptr(), 256) || !aligned(a_sinv.data_ptr(), 16) || !aligned(b_sinv.data_ptr(), 16))
    return false;
  if (bias && (!bias->is_contiguous() || !aligned(bias->data_ptr(), 256))) return false;
  const c10::cuda::CUDAGuard guard(a.device());
  const size_t workspace = at::cuda::getCUDABlasLtWorkspaceSize();
  Key key;
  std::memset(&key, 0, sizeof(key));  // compared and hashed as bytes: no stray padding
  key.m = M, key.n = N, key.k = K;
  key.a = (int)a.scalar_type(), key.b = (int)b.scalar_type(), key.out = (int)out_dtype;
  key.bias = bias ? (int)bias->scalar_type() : -1;
  key.fast_accum = fast_accum, key.device = (int)a.get_device(), key.workspace = workspace;
  key.accumulate = accumulate_into != nullptr;
  key.cd_align = accumulate_into != nullptr ? alignment_of(accumulate_into->data_ptr()) : 256;
  const void* a_scale = b_sinv.data_ptr();  // cuBLAS's A is b
  const void* b_scale = a_sinv.data_ptr();
  cublasLtHandle_t handle = at::cuda::getCurrentCUDABlasLtHandle();
  // per thread (forward and autograd's device thread): a plan's pointer attributes are set per call
  thread_local std::unordered_map<Key, Plan, KeyHash> plans;
  auto it = plans.find(key);
  if (it == plans.end())
    it = plans.emplace(key, make_plan(key, handle, a_scale, b_scale, bias ? bias->data_ptr() : nullptr)).first;
  Plan& p = it->second;
  if (!p.ok) return false;
  FP8P_LT_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &a_scale, sizeof(a_scale)));
  FP8P_LT_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &b_scale, sizeof(b_scale)));
  if (bias) {
    const void* bias_ptr = bias->data_ptr();
    FP8P_LT_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias_ptr,
                                                 sizeof(bias_ptr)));
  }
  out = accumulate_into != nullptr ? *accumulate_into : at::empty({M, N}, a.options().dtype(out_dtype));
  const float alpha = 1.0f, beta = accumulate_into != nullptr ? 1.0f : 0.0f;
  FP8P_LT_CHECK(cublasLtMatmul(handle, p.desc, &alpha, b.data_ptr(), p.A, a.data_ptr(), p.B, &beta, out.data_ptr(),
                               p.C, out.data_ptr(), p.D, &p.algo, at::cuda::getCUDABlasLtWorkspace(), workspace,
                               c10::cuda::getCurrentCUDAStream()));
  return true;
}

}  // namespace fp8p
