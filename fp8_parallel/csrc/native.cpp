// The compiled host path of fp8_parallel: the FP8 cast and one FP8 linear's forward and backward, each one
// call from Python. Computes exactly what the Python path computes (`quantize`, `fp8_gemm`,
// `modules/_core.py`): on CUDA with the kernels of cast_kernels.cu, elsewhere with the same torch formulas.
// ATen and torch's pybind11 casters only: torch/extension.h (the whole C++ frontend) takes twice as long to
// compile, and nothing here uses the frontend.
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "messages.h"

#ifdef FP8P_WITH_CUDA
#include "cuda_ops.h"
#endif

// Rejecting a call throws nothing: every argument check returns the first failed check's message (a Problem,
// empty when the arguments are good), the entry points return it to Python, and `native.py` raises it there as
// a RuntimeError. The messages are built without iostreams (messages.h says why).
#define FP8P_CHECK(cond, ...)                                        \
  do {                                                               \
    if (!(cond)) return ::fp8p::message(__VA_ARGS__);                \
  } while (false)

// returns the problem a check found, if any
#define FP8P_TRY(check)                                \
  do {                                                 \
    ::fp8p::Problem problem_ = (check);                \
    if (!problem_.empty()) return problem_;            \
  } while (false)

namespace fp8p {

using Problem = std::string;  // a rejected call's message; empty: the arguments are good

namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

at::ScalarType fp8_type(bool e5m2) { return e5m2 ? at::kFloat8_e5m2 : at::kFloat8_e4m3fn; }
double fp8_limit(bool e5m2) { return e5m2 ? 57344.0 : 448.0; }

// the dtype codes the Python side passes (native.DTYPE_CODES)
at::ScalarType dtype_of(int64_t code) {
  switch (code) {
    case 0: return at::kBFloat16;
    case 1: return at::kHalf;
    case 2: return at::kFloat;
    default: return at::kFloat;  // not reached: the entry points check every code first (check_code)
  }
}

Tensor rows_2d(const Tensor& x) {
  Tensor x2 = x.dim() == 2 ? x : x.reshape({-1, x.size(-1)});
  return x2.stride(-1) == 1 ? x2 : x2.contiguous();
}

// Argument checks: every entry point validates all of its arguments with these before it reads or writes any
// tensor (the CUDA kernels and cuBLASLt take raw pointers, so a wrong size, device or layout would be an
// out-of-bounds access there). `what` names the argument in the error.

bool is_fp8(at::ScalarType t) { return t == at::kFloat8_e4m3fn || t == at::kFloat8_e5m2; }
bool is_float(at::ScalarType t) { return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf; }

Problem check_device(const Tensor& t, const at::Device& device, const char* what) {
  FP8P_CHECK(t.device() == device, "fp8_parallel native: ", what, " is on ", t.device(), ", the call's tensors on ",
              device);
  return {};
}

// a float32 / float16 / bfloat16 tensor with a feature (last) dimension, on `device`
Problem check_input(const Tensor& t, const at::Device& device, const char* what) {
  FP8P_CHECK(t.dim() >= 1, "fp8_parallel native: ", what, " must have a feature dimension, got sizes ", t.sizes());
  FP8P_CHECK(is_float(t.scalar_type()), "fp8_parallel native: ", what,
              " must be float32, float16 or bfloat16, got ", t.scalar_type());
  FP8P_TRY(check_device(t, device, what));
  return {};
}

// a contiguous float32 buffer on `device` with an element at `index`
Problem check_slot(const Tensor& buf, int64_t index, const at::Device& device, const char* what) {
  FP8P_CHECK(buf.scalar_type() == at::kFloat, "fp8_parallel native: ", what, " must be float32, got ",
              buf.scalar_type());
  FP8P_CHECK(buf.is_contiguous(), "fp8_parallel native: ", what, " must be contiguous, got sizes ", buf.sizes(),
              " strides ", buf.strides());
  FP8P_CHECK(index >= 0 && index < buf.numel(), "fp8_parallel native: ", what, " index ", index,
              " outside a buffer of ", buf.numel(), " elements");
  FP8P_TRY(check_device(buf, device, what));
  return {};
}

// one float32 value on `device` (a scale_inv)
Problem check_scalar(const Tensor& t, const at::Device& device, const char* what) {
  FP8P_CHECK(t.scalar_type() == at::kFloat && t.numel() == 1, "fp8_parallel native: ", what,
              " must be one float32, got ", t.scalar_type(), " ", t.sizes());
  FP8P_TRY(check_device(t, device, what));
  return {};
}

// a contiguous 2-d FP8 tensor (on `device`, when given)
Problem check_fp8(const Tensor& t, const char* what, const at::Device* device = nullptr) {
  FP8P_CHECK(is_fp8(t.scalar_type()), "fp8_parallel native: ", what, " must be FP8, got ", t.scalar_type());
  FP8P_CHECK(t.dim() == 2 && t.is_contiguous(), "fp8_parallel native: ", what,
              " must be a contiguous 2-d tensor, got sizes ", t.sizes(), " strides ", t.strides());
  if (device != nullptr) FP8P_TRY(check_device(t, *device, what));
  return {};
}

// a dtype code of native.DTYPE_CODES
Problem check_code(int64_t code, const char* what) {
  FP8P_CHECK(code >= 0 && code <= 2, "fp8_parallel native: ", what, " has unknown dtype code ", code);
  return {};
}

// a tensor megatron's fused accumulation adds a [rows, cols] weight gradient into
Problem check_main_grad(const Tensor& t, int64_t rows, int64_t cols, const at::Device& device, const char* what) {
  FP8P_CHECK(is_float(t.scalar_type()) && t.dim() == 2 && t.size(0) == rows && t.size(1) == cols,
              "fp8_parallel native: ", what, " must be a float32 / bfloat16 / float16 [", rows, ", ", cols,
              "] tensor, got ", t.scalar_type(), " ", t.sizes());
  FP8P_TRY(check_device(t, device, what));
  return {};
}

// `_quantize_torch`: the torch formulas, for CPU tensors and empty inputs
void cast_reference(const Tensor& x2, const Tensor& scale, const Tensor* data, const Tensor* t,
                    const Tensor& scale_inv, const Tensor* amax, const Tensor* noop, bool e5m2) {
  const double limit = fp8_limit(e5m2);
  const Tensor s = scale.reshape({}).to(at::kFloat);
  Tensor q = (x2.to(at::kFloat) * s).clamp(-limit, limit).to(fp8_type(e5m2));
  const std::optional<Tensor> flag =
      noop != nullptr ? std::optional<Tensor>(noop->reshape({}).to(at::kBool)) : std::nullopt;
  auto keep = [&](const Tensor& old, const Tensor& fresh) {
    if (!flag) return fresh;
    if (old.scalar_type() == at::kFloat8_e4m3fn || old.scalar_type() == at::kFloat8_e5m2)
      return at::where(*flag, old.view(at::kByte), fresh.view(at::kByte)).view(old.scalar_type());
    return at::where(*flag, old, fresh);
  };
  if (data != nullptr) {
    Tensor d = data->view({x2.size(0), x2.size(1)});
    q = keep(d, q);
    d.copy_(q);
  } else if (flag && t != nullptr) {
    q = keep(t->t(), q);
  }
  scale_inv.copy_(keep(scale_inv.reshape({}), s.reciprocal()).reshape(scale_inv.sizes()));
  if (t != nullptr) t->copy_(q.t());
  if (amax != nullptr) {
    Tensor a = x2.numel() ? x2.abs().amax().to(at::kFloat) : at::zeros({}, x2.options().dtype(at::kFloat));
    a = at::nan_to_num(a, INFINITY, INFINITY);
    const Tensor fresh = at::maximum(amax->reshape({}), a);
    amax->copy_(keep(amax->reshape({}), fresh).reshape(amax->sizes()));
  }
}

// one cast: `scale_buf[scale_index]` as the scale, `amax_buf[amax_index]` as the slot (flat indices of
// contiguous buffers); the entry points have checked every argument
void cast(const Tensor& x2, const Tensor& scale_buf, int64_t scale_index, const Tensor* data, const Tensor* t,
          const Tensor& scale_inv, const OptTensor& amax_buf, int64_t amax_index, const Tensor* noop, bool e5m2) {
#ifdef FP8P_WITH_CUDA
  if (x2.is_cuda() && x2.numel() > 0) {
    cast_cuda(x2, scale_buf.data_ptr<float>() + scale_index,
              data != nullptr ? static_cast<unsigned char*>(data->data_ptr()) : nullptr,
              t != nullptr ? static_cast<unsigned char*>(t->data_ptr()) : nullptr, scale_inv.data_ptr<float>(),
              amax_buf ? amax_buf->data_ptr<float>() + amax_index : nullptr, noop, e5m2);
    return;
  }
#endif
  const Tensor slot = amax_buf ? amax_buf->view(-1).narrow(0, amax_index, 1) : Tensor();
  cast_reference(x2, scale_buf.view(-1).narrow(0, scale_index, 1), data, t, scale_inv, amax_buf ? &slot : nullptr,
                 noop, e5m2);
}

// cuBLAS's FP8 GEMM refuses operand and scale pointers that do not start at a 16-byte boundary
Tensor aligned(const Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0 ? t : t.clone(); }

Tensor scale_operand(const Tensor& scale_inv) {
  Tensor s = scale_inv.dim() == 0 ? scale_inv : scale_inv.reshape({});
  return aligned(s.scalar_type() == at::kFloat ? s : s.to(at::kFloat));
}

// `gemm.scaled_mm`: torch._scaled_mm with per-tensor scales, a [M, K] row-major, b_kn [K, N] column-major. On the
// CPU the same operations as the Python side (a float32 matmul of the upcast operands, scaled once; torch's CPU
// FP8 kernel is a reference loop), so that both paths stay bitwise equal.
Tensor scaled_mm(const Tensor& a, const Tensor& b_kn, const Tensor& sa, const Tensor& sb, const OptTensor& bias,
                 at::ScalarType out, bool fast_accum) {
  if (!a.device().is_cpu()) return at::_scaled_mm(a, b_kn, sa, sb, bias, std::nullopt, out, fast_accum);
  Tensor r = at::mm(a.to(at::kFloat), b_kn.to(at::kFloat)).mul(sa.mul(sb));
  if (bias) r = r.add(bias->to(out).to(at::kFloat));
  return r.to(out);
}

// the same into `dx` (torch._scaled_mm's out variant off the CPU)
void scaled_mm_into(Tensor& dx, const Tensor& a, const Tensor& b_kn, const Tensor& sa, const Tensor& sb) {
  if (!dx.is_cpu()) {
    at::_scaled_mm_out(dx, a, b_kn, sa, sb, std::nullopt, std::nullopt, dx.scalar_type(), false);
    return;
  }
  dx.copy_(scaled_mm(a, b_kn, sa, sb, std::nullopt, dx.scalar_type(), false));
}

// `fp8_gemm(a, b)` = a @ b.T for row-major a [M, K], b [N, K]; a bias is fused for a bfloat16 result only
Tensor gemm(const Tensor& a, const Tensor& b, const Tensor& a_sinv, const Tensor& b_sinv, const OptTensor& bias,
            at::ScalarType out, bool fast_accum) {
  const Tensor sa = scale_operand(a_sinv), sb = scale_operand(b_sinv);
  const bool bias_after = bias && out != at::kBFloat16;
  const OptTensor fused_bias = bias_after ? std::nullopt : bias;
  const at::ScalarType result_type = bias_after ? at::kFloat : out;
  const Tensor a16 = aligned(a), b16 = aligned(b);
  Tensor r;
#ifdef FP8P_WITH_CUDA
  if (!lt_scaled_mm(a16, b16, sa, sb, fused_bias, result_type, fast_accum, r))
#endif
    r = scaled_mm(a16, b16.t(), sa, sb, fused_bias, result_type, fast_accum);
  if (!bias_after) return r;
  r = r + bias->to(at::kFloat);
  return out == at::kFloat ? r : r.to(out);
}

// `acc += a @ b.T` accumulated in float32 and rounded once into acc's dtype (megatron's fused weight-gradient
// accumulation): in the GEMM's epilogue where cuBLASLt takes `acc`, else the float32 product added
void gemm_accumulate(const Tensor& a, const Tensor& b, const Tensor& a_sinv, const Tensor& b_sinv, Tensor& acc) {
  const Tensor sa = scale_operand(a_sinv), sb = scale_operand(b_sinv);
  const Tensor a16 = aligned(a), b16 = aligned(b);
#ifdef FP8P_WITH_CUDA
  Tensor r;
  if (lt_scaled_mm(a16, b16, sa, sb, std::nullopt, acc.scalar_type(), false, r, &acc)) return;
#endif
  acc.add_(scaled_mm(a16, b16.t(), sa, sb, std::nullopt, at::kFloat, false));
}

}  // namespace

// `quantize`'s fused cast into given outputs: `data` (x's shape), `t` ([N, M]) or both; see cuda_ops.h
Problem cast_into(const Tensor& x, const Tensor& scale_buf, int64_t scale_index, const OptTensor& data,
               const OptTensor& t, const Tensor& scale_inv, const OptTensor& amax_buf, int64_t amax_index,
               const OptTensor& noop) {
  const at::Device device = x.device();
  FP8P_TRY(check_input(x, device, "input"));
  const Tensor x2 = rows_2d(x.detach());
  FP8P_CHECK(data || t, "fp8_parallel native cast: neither data nor transpose given");
  if (data) {
    FP8P_CHECK(is_fp8(data->scalar_type()), "fp8_parallel native: data must be FP8, got ", data->scalar_type());
    FP8P_CHECK(data->numel() == x2.numel(), "fp8_parallel native cast: data has ", data->numel(),
                " elements, the input ", x2.numel());
    FP8P_CHECK(data->is_contiguous(), "fp8_parallel native cast: data must be contiguous, got sizes ",
                data->sizes(), " strides ", data->strides());
    FP8P_TRY(check_device(*data, device, "data"));
  }
  if (t) {
    FP8P_TRY(check_fp8(*t, "transpose", &device));
    FP8P_CHECK(t->size(0) == x2.size(1) && t->size(1) == x2.size(0), "fp8_parallel native cast: transpose has sizes ",
                t->sizes(), ", the input ", x2.sizes());
    FP8P_CHECK(!data || data->scalar_type() == t->scalar_type(), "fp8_parallel native cast: data is ",
                data->scalar_type(), ", transpose ", t->scalar_type());
  }
  const bool e5m2 = (data ? *data : *t).scalar_type() == at::kFloat8_e5m2;
  FP8P_TRY(check_scalar(scale_inv, device, "scale_inv"));
  FP8P_TRY(check_slot(scale_buf, scale_index, device, "scale"));
  if (amax_buf) FP8P_TRY(check_slot(*amax_buf, amax_index, device, "amax slot"));
  if (noop) {
    FP8P_CHECK(noop->numel() == 1, "fp8_parallel native cast: noop flag must be one element, got sizes ",
                noop->sizes());
    FP8P_TRY(check_device(*noop, device, "noop flag"));
  }
  cast(x2, scale_buf, scale_index, data ? &*data : nullptr, t ? &*t : nullptr, scale_inv, amax_buf, amax_index,
       noop ? &*noop : nullptr, e5m2);
  return {};
}

// One FP8 linear's forward: cast x (viewed as x2 [M, K]) with scale_buf[0] (E4M3) into amax_buf[amax_index],
// then y = x @ W.T (+ bias) with fast accumulation. W is the cached FP8 weight `w_data` ([N, K]) with `w_sinv`,
// or, given `w_hp` instead, that high-precision weight cast here with scale_buf[1] into amax_buf[amax_index + 1].
// Returns [y (x's shape with N features), the FP8 transpose of x2 (keep_t) or undefined, x2's scale_inv, a copy
// of scale_buf[0:2] (keep_scales: the scales backward re-casts x and a `w_hp` with) or undefined, the scale_inv
// of a weight cast here or undefined].
Problem linear_fwd(std::vector<Tensor>& out, const Tensor& x, const Tensor& scale_buf, const OptTensor& amax_buf,
                               int64_t amax_index, bool keep_t, bool keep_scales, const OptTensor& w_data,
                               const OptTensor& w_sinv, const OptTensor& w_hp, const OptTensor& bias) {
  const at::Device device = x.device();
  FP8P_TRY(check_input(x, device, "input"));
  FP8P_CHECK(w_hp ? !w_data && !w_sinv : w_data && w_sinv,
              "fp8_parallel native linear: give the FP8 weight and its scale_inv, or the weight to cast");
  const Tensor x2 = rows_2d(x);
  const int64_t K = x2.size(1);
  // the checks, before anything is read or written
  FP8P_TRY(check_slot(scale_buf, 0, device, "scale"));
  if (w_hp || keep_scales) FP8P_TRY(check_slot(scale_buf, 1, device, "scale"));
  if (amax_buf) {
    FP8P_TRY(check_slot(*amax_buf, amax_index, device, "amax slot"));
    if (w_hp) FP8P_TRY(check_slot(*amax_buf, amax_index + 1, device, "weight amax slot"));
  }
  Tensor w2;
  int64_t N;
  if (w_hp) {
    FP8P_TRY(check_input(*w_hp, device, "weight"));
    w2 = rows_2d(w_hp->detach());
    N = w2.size(0);
    FP8P_CHECK(w2.size(1) == K, "fp8_parallel native linear: input has ", K, " features, the weight ", w_hp->sizes());
  } else {
    FP8P_TRY(check_fp8(*w_data, "weight", &device));
    FP8P_TRY(check_scalar(*w_sinv, device, "weight scale_inv"));
    N = w_data->size(0);
    FP8P_CHECK(w_data->size(1) == K, "fp8_parallel native linear: input has ", K, " features, the weight ",
                w_data->sizes());
  }
  if (bias) {
    FP8P_TRY(check_input(*bias, device, "bias"));
    FP8P_CHECK(bias->dim() == 1 && bias->size(0) == N, "fp8_parallel native linear: bias has sizes ", bias->sizes(),
                ", the weight ", N, " outputs");
  }
  const auto opts = x2.options();
  const Tensor saved_scales = keep_scales ? scale_buf.view(-1).narrow(0, 0, 2).clone() : Tensor();
  Tensor qw, qw_sinv, cast_sinv;
  if (w_hp) {
    qw = at::empty({w2.size(0), w2.size(1)}, opts.dtype(at::kFloat8_e4m3fn));
    cast_sinv = qw_sinv = at::empty({}, opts.dtype(at::kFloat));
    cast(w2, scale_buf, 1, &qw, nullptr, qw_sinv, amax_buf, amax_index + 1, nullptr, false);
  } else {
    qw = *w_data;
    qw_sinv = *w_sinv;
  }
  const Tensor qx = at::empty({x2.size(0), x2.size(1)}, opts.dtype(at::kFloat8_e4m3fn));
  const Tensor qx_t = keep_t ? at::empty({x2.size(1), x2.size(0)}, opts.dtype(at::kFloat8_e4m3fn)) : Tensor();
  const Tensor sinv = at::empty({}, opts.dtype(at::kFloat));
  cast(x2, scale_buf, 0, &qx, keep_t ? &qx_t : nullptr, sinv, amax_buf, amax_index, nullptr, false);
  const OptTensor b = bias ? OptTensor(bias->to(x2.scalar_type())) : std::nullopt;
  Tensor y = gemm(qx, qw, sinv, qw_sinv, b, x2.scalar_type(), true);
  if (x.dim() != 2) {
    std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
    shape.back() = qw.size(0);
    y = y.view(shape);
  }
  out = {y, qx_t, sinv, saved_scales, cast_sinv};
  return {};
}

// One FP8 linear's backward from `linear_fwd`'s outputs: cast g2 ([M, N]) with g_scale_buf[0] (E5M2 when
// g_e5m2) into g_amax_buf[g_amax_index]; dgrad = g2 @ W from the weight's FP8 transpose, given (`w_t`, [K, N])
// or re-cast here from `w_ref` with saved_scales[1]; wgrad = g2.T @ x2 from x2's FP8 transpose, given (`x_t`,
// [K, M]) or re-cast here from `x_ref` with saved_scales[0]; the bias gradient g2.sum(0). Given `main_grad` (a
// float32 / bfloat16 / float16 [N, K] tensor), wgrad is added into it (accumulated in float32, one rounding)
// instead of returned. Returns [grad_x (g's shape
// with K features), grad_w, grad_b], undefined where not asked for (grad_w also with `main_grad`).
Problem linear_bwd(std::vector<Tensor>& out, const Tensor& g, const Tensor& g_scale_buf, const OptTensor& g_amax_buf,
                               int64_t g_amax_index, bool g_e5m2, const OptTensor& w_t, const OptTensor& w_ref,
                               const OptTensor& w_sinv, const OptTensor& x_t, const OptTensor& x_ref,
                               const OptTensor& saved_scales, const OptTensor& x_sinv, bool need_dgrad,
                               bool need_wgrad, bool need_bgrad, int64_t x_dtype, int64_t w_dtype,
                               const OptTensor& main_grad) {
  const at::Device device = g.device();
  FP8P_TRY(check_input(g, device, "grad_output"));
  const Tensor g2 = g.dim() == 2 ? g : g.reshape({-1, g.size(-1)});
  const int64_t M = g2.size(0), N = g2.size(1);
  // the checks, before anything is read or written
  FP8P_TRY(check_slot(g_scale_buf, 0, device, "grad_output scale"));
  if (g_amax_buf) FP8P_TRY(check_slot(*g_amax_buf, g_amax_index, device, "grad_output amax slot"));
  FP8P_TRY(check_code(x_dtype, "the input's dtype"));
  FP8P_TRY(check_code(w_dtype, "the weight's dtype"));
  int64_t K = -1;  // the input's features, from the dgrad's or the wgrad's operand
  if (need_dgrad) {
    FP8P_CHECK((w_t || w_ref) && w_sinv, "fp8_parallel native linear: dgrad needs the weight's FP8 transpose");
    FP8P_TRY(check_scalar(*w_sinv, device, "weight scale_inv"));
    if (w_t) {
      FP8P_TRY(check_fp8(*w_t, "weight transpose", &device));
      FP8P_CHECK(w_t->size(1) == N, "fp8_parallel native linear: weight transpose has sizes ", w_t->sizes(),
                  ", the gradient ", N, " features");
      K = w_t->size(0);
    } else {
      FP8P_TRY(check_input(*w_ref, device, "weight"));
      FP8P_CHECK(saved_scales, "fp8_parallel native linear: a re-cast needs the forward's scales");
      FP8P_TRY(check_slot(*saved_scales, 1, device, "saved scales"));
      const Tensor w2 = rows_2d(w_ref->detach());
      FP8P_CHECK(w2.size(0) == N, "fp8_parallel native linear: weight has sizes ", w_ref->sizes(), ", the gradient ",
                  N, " features");
      K = w2.size(1);
    }
  }
  if (need_wgrad) {
    FP8P_CHECK(x_sinv && (x_t || x_ref), "fp8_parallel native linear: wgrad needs the input's FP8 transpose");
    FP8P_TRY(check_scalar(*x_sinv, device, "input scale_inv"));
    int64_t k = -1;
    if (x_t) {
      FP8P_TRY(check_fp8(*x_t, "input transpose", &device));
      FP8P_CHECK(x_t->size(1) == M, "fp8_parallel native linear: input transpose has sizes ", x_t->sizes(),
                  ", the gradient ", M, " rows");
      k = x_t->size(0);
    } else {
      FP8P_TRY(check_input(*x_ref, device, "input"));
      FP8P_CHECK(saved_scales, "fp8_parallel native linear: a re-cast needs the forward's scales");
      FP8P_TRY(check_slot(*saved_scales, 0, device, "saved scales"));
      const Tensor r2 = rows_2d(x_ref->detach());
      FP8P_CHECK(r2.size(0) == M, "fp8_parallel native linear: input has sizes ", x_ref->sizes(), ", the gradient ",
                  M, " rows");
      k = r2.size(1);
    }
    FP8P_CHECK(K < 0 || k == K, "fp8_parallel native linear: the weight has ", K, " input features, the input ", k);
    if (main_grad) {
      FP8P_TRY(check_main_grad(*main_grad, N, k, device, "main_grad"));
    }
  }
  const Tensor g2c = g2.stride(1) == 1 ? g2 : g2.contiguous();
  const auto opts = g2.options();
  const at::ScalarType gtype = fp8_type(g_e5m2);
  Tensor qg = at::empty({M, N}, opts.dtype(gtype));
  const Tensor qg_t = need_wgrad ? at::empty({N, M}, opts.dtype(gtype)) : Tensor();
  const Tensor g_sinv = at::empty({}, opts.dtype(at::kFloat));
  cast(g2c, g_scale_buf, 0, &qg, need_wgrad ? &qg_t : nullptr, g_sinv, g_amax_buf, g_amax_index, nullptr, g_e5m2);
  // a transpose-only re-cast of `ref` ([R, C] -> [C, R], E4M3) with saved_scales[index]
  auto recast_t = [&](const Tensor& ref, int64_t index) {
    const Tensor r2 = rows_2d(ref.detach());
    Tensor t = at::empty({r2.size(1), r2.size(0)}, opts.dtype(at::kFloat8_e4m3fn));
    const Tensor unused_sinv = at::empty({}, opts.dtype(at::kFloat));
    cast(r2, *saved_scales, index, nullptr, &t, unused_sinv, std::nullopt, 0, nullptr, false);
    return t;
  };
  Tensor grad_x, grad_w, grad_b;
  // dgrad first; its operands are released before the wgrad GEMM allocates the weight gradient
  if (need_dgrad) {
    const Tensor wt = w_t ? *w_t : recast_t(*w_ref, 1);
    grad_x = gemm(qg, wt, g_sinv, *w_sinv, std::nullopt, dtype_of(x_dtype), false);
  }
  qg.reset();
  if (need_wgrad) {
    const Tensor xt = x_t ? *x_t : recast_t(*x_ref, 0);
    if (main_grad) {
      Tensor acc = *main_grad;
      gemm_accumulate(qg_t, xt, g_sinv, *x_sinv, acc);
    } else {
      grad_w = gemm(qg_t, xt, g_sinv, *x_sinv, std::nullopt, dtype_of(w_dtype), false);
    }
  }
  if (need_bgrad) grad_b = g2.sum(0).to(dtype_of(w_dtype));
  if (grad_x.defined() && g.dim() != 2) {  // in the input's shape: g's with the input's features
    std::vector<int64_t> shape(g.sizes().begin(), g.sizes().end());
    shape.back() = grad_x.size(1);
    grad_x = grad_x.view(shape);
  }
  out = {grad_x, grad_w, grad_b};
  return {};
}

// The experts' backward GEMMs of a grouped call with per-expert GEMMs (`_grouped_gemm._direct_expert_backward`),
// issued from here, the last expert first: the GEMMs, operands, scales and order of its Python loop, for
// experts of N outputs and K inputs. Input
// gradient (given `g_rows`, the grad_outputs' FP8 cast [rows, N]): expert e's rows of a new [rows, K] tensor of
// dtype `x_dtype` = its rows of g_rows times its weight's FP8 transpose `w_t[e]` ([K, N], scale_inv `w_sinv[e]`).
// Weight gradients (given `g_t` and `x_t`, the row blocks' transposes: expert e's [N, padded_rows[e]] and
// [K, padded_rows[e]] matrices from elements N * padded_starts[e] and K * padded_starts[e]): for each e with
// need_w[e], g_t_e @ x_t_e.T in `w_dtypes[e]`, zeros for an expert without rows, or, given `main_grads[e]`,
// added into it (float32 accumulation, one rounding) and not returned. `g_sinv`, `x_sinv`: one scale_inv per
// expert (views, 16 bytes apart). Returns [grad_x or undefined, then per expert its grad_w or undefined].
Problem experts_bwd(std::vector<Tensor>& out, int64_t n, int64_t k, const OptTensor& g_rows, const Tensor& g_sinv,
                                const std::vector<int64_t>& splits,
                                const std::vector<Tensor>& w_t, const std::vector<Tensor>& w_sinv, int64_t x_dtype,
                                const OptTensor& g_t, const OptTensor& x_t, const OptTensor& x_sinv,
                                const std::vector<int64_t>& padded_starts, const std::vector<int64_t>& padded_rows,
                                const std::vector<bool>& need_w, const std::vector<int64_t>& w_dtypes,
                                const std::vector<OptTensor>& main_grads) {
  const int64_t experts = static_cast<int64_t>(splits.size());
  const at::Device device = g_sinv.device();
  // the checks, before anything is read or written
  FP8P_CHECK(n > 0 && k > 0, "fp8_parallel native experts: ", n, " outputs and ", k, " inputs per expert");
  FP8P_CHECK(g_sinv.scalar_type() == at::kFloat && g_sinv.dim() == 1 && g_sinv.size(0) == experts,
              "fp8_parallel native experts: ", experts, " experts, ", g_sinv.sizes(), " grad_output scale_invs (",
              g_sinv.scalar_type(), ")");
  const bool dgrad = g_rows.has_value(), wgrad = g_t && x_t;
  std::vector<int64_t> starts(experts);
  if (dgrad) {
    FP8P_TRY(check_fp8(*g_rows, "grad_output cast", &device));
    FP8P_CHECK(g_rows->size(1) == n, "fp8_parallel native experts: the grad_output cast has sizes ", g_rows->sizes(),
                ", the experts ", n, " outputs");
    FP8P_CHECK(static_cast<int64_t>(w_t.size()) == experts && static_cast<int64_t>(w_sinv.size()) == experts,
                "fp8_parallel native experts: ", w_t.size(), " weight transposes and ", w_sinv.size(),
                " scale_invs for ", experts, " experts");
    FP8P_TRY(check_code(x_dtype, "the input's dtype"));
    const int64_t total = g_rows->size(0);
    int64_t rows = 0;
    for (int64_t e = 0; e < experts; ++e) {
      // (each one at most the rows of the cast: no overflow in the sum)
      FP8P_CHECK(splits[e] >= 0 && splits[e] <= total, "fp8_parallel native experts: split ", e, " is ", splits[e],
                  ", the cast has ", total, " rows");
      starts[e] = rows;
      rows += splits[e];
    }
    FP8P_CHECK(rows == total, "fp8_parallel native experts: splits sum to ", rows, ", the cast has ", total, " rows");
    for (int64_t e = 0; e < experts; ++e) {
      FP8P_CHECK(is_fp8(w_t[e].scalar_type()) && w_t[e].dim() == 2 && w_t[e].is_contiguous(),
                  "fp8_parallel native experts: weight transpose ", e, " must be a contiguous 2-d FP8 tensor, got ",
                  w_t[e].scalar_type(), " sizes ", w_t[e].sizes(), " strides ", w_t[e].strides());
      FP8P_CHECK(w_t[e].size(0) == k && w_t[e].size(1) == n, "fp8_parallel native experts: weight transpose ", e,
                  " has sizes ", w_t[e].sizes(), ", expected [", k, ", ", n, "]");
      FP8P_TRY(check_device(w_t[e], device, "a weight transpose"));
      FP8P_TRY(check_scalar(w_sinv[e], device, "a weight scale_inv"));
    }
  }
  if (wgrad) {
    FP8P_CHECK(x_sinv && x_sinv->scalar_type() == at::kFloat && x_sinv->dim() == 1 && x_sinv->size(0) == experts,
                "fp8_parallel native experts: the inputs' scale_invs must be one float32 per expert, got ",
                x_sinv ? x_sinv->sizes() : at::IntArrayRef{}, " for ", experts, " experts");
    FP8P_TRY(check_device(*x_sinv, device, "the inputs' scale_invs"));
    FP8P_CHECK(static_cast<int64_t>(padded_starts.size()) == experts &&
                    static_cast<int64_t>(padded_rows.size()) == experts &&
                    static_cast<int64_t>(need_w.size()) == experts &&
                    static_cast<int64_t>(w_dtypes.size()) == experts &&
                    static_cast<int64_t>(main_grads.size()) == experts,
                "fp8_parallel native experts: one padded start, padded row count, need flag, dtype and main_grad ",
                "per expert, got ", padded_starts.size(), ", ", padded_rows.size(), ", ", need_w.size(), ", ",
                w_dtypes.size(), ", ", main_grads.size(), " for ", experts, " experts");
    for (const auto* buf : {&*g_t, &*x_t}) {
      const char* what = buf == &*g_t ? "grad_output transposes" : "input transposes";
      FP8P_CHECK(is_fp8(buf->scalar_type()) && buf->is_contiguous(), "fp8_parallel native experts: the ", what,
                  " must be a contiguous FP8 buffer, got ", buf->scalar_type(), " sizes ", buf->sizes(), " strides ",
                  buf->strides());
      FP8P_TRY(check_device(*buf, device, what));
    }
    for (int64_t e = 0; e < experts; ++e) {
      if (!need_w[e]) continue;
      FP8P_TRY(check_code(w_dtypes[e], "a weight gradient's dtype"));
      const int64_t ps = padded_starts[e], pm = padded_rows[e];
      // [ps, ps + pm) of the padded rows, in both buffers (compared by division: no overflow)
      const int64_t g_rows_have = g_t->numel() / n, x_rows_have = x_t->numel() / k;
      FP8P_CHECK(ps >= 0 && pm >= 0 && pm <= g_rows_have && ps <= g_rows_have - pm && pm <= x_rows_have &&
                      ps <= x_rows_have - pm,
                  "fp8_parallel native experts: expert ", e, "'s padded rows [", ps, ", ", ps, " + ", pm,
                  ") outside the transposes' ", g_rows_have, " (grad_output) and ", x_rows_have, " (input) rows");
      if (main_grads[e]) {
        const Tensor& acc = *main_grads[e];
        FP8P_CHECK(is_float(acc.scalar_type()) && acc.dim() == 2 && acc.size(0) == n && acc.size(1) == k &&
                        acc.device() == device,
                    "fp8_parallel native experts: main_grad ", e, " has sizes ", acc.sizes(), " (", acc.scalar_type(),
                    ") on ", acc.device(), ", expected float32 / bfloat16 / float16 [", n, ", ", k, "] on ", device);
      }
    }
  }
  out.assign(experts + 1, Tensor());
  if (dgrad) {
    Tensor grad_x = at::empty({g_rows->size(0), k}, g_rows->options().dtype(dtype_of(x_dtype)));
    for (int64_t e = experts - 1; e >= 0; --e) {
      if (splits[e] == 0) continue;
      Tensor dx = grad_x.narrow(0, starts[e], splits[e]);
      scaled_mm_into(dx, g_rows->narrow(0, starts[e], splits[e]), w_t[e].t(), g_sinv.select(0, e),
                     scale_operand(w_sinv[e]));
    }
    out[0] = grad_x;
  }
  if (wgrad) {
    const Tensor g_flat = g_t->view(-1), x_flat = x_t->view(-1);
    for (int64_t e = experts - 1; e >= 0; --e) {
      if (!need_w[e]) continue;
      const int64_t ps = padded_starts[e], pm = padded_rows[e];
      const OptTensor& into = main_grads[e];
      if (pm == 0) {
        if (!into) out[e + 1] = at::zeros({n, k}, g_t->options().dtype(dtype_of(w_dtypes[e])));
        continue;
      }
      const Tensor a = g_flat.narrow(0, n * ps, n * pm).view({n, pm});  // [N, padded] row-major
      const Tensor b = x_flat.narrow(0, k * ps, k * pm).view({k, pm});  // [K, padded] row-major
      const Tensor sa = g_sinv.select(0, e), sb = x_sinv->select(0, e);
      if (into) {
        Tensor acc = *into;
        gemm_accumulate(a, b, sa, sb, acc);
      } else {
        out[e + 1] = scaled_mm(a, b.t(), sa, sb, std::nullopt, dtype_of(w_dtypes[e]), false);
      }
    }
  }
  return {};
}

}  // namespace fp8p

namespace {

using fp8p::Problem;

// An ATen error inside a call whose arguments passed the checks (out of memory, a failed GEMM), as a problem:
// its message without the C++ backtrace (symbolizing that crashed on some machines).
template <typename Run>
Problem problem_of(Run&& run) {
  try {
    return run();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  } catch (const std::exception& e) {
    return e.what();
  }
}

// An entry point with outputs as Python sees it: returns (problem, outputs), the problem "" when it ran.
template <typename... Args>
auto with_outputs(Problem (*fn)(std::vector<at::Tensor>&, Args...)) {
  return [fn](Args... args) {
    std::vector<at::Tensor> out;
    Problem problem = problem_of([&] { return fn(out, std::forward<Args>(args)...); });
    return std::make_pair(std::move(problem), std::move(out));
  };
}

// An entry point that writes into given tensors: returns its problem, "" when it ran.
template <typename... Args>
auto writing(Problem (*fn)(Args...)) {
  return [fn](Args... args) { return problem_of([&] { return fn(std::forward<Args>(args)...); }); };
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() =
      "fp8_parallel's compiled host path: FP8 cast and FP8 linear forward / backward. Call it through "
      "fp8_parallel.native, which raises the problems these functions return.";
  m.def("cast_into", writing(&fp8p::cast_into), "fused FP8 cast into given outputs");
  m.def("linear_fwd", with_outputs(&fp8p::linear_fwd), "one FP8 linear's forward");
  m.def("linear_bwd", with_outputs(&fp8p::linear_bwd), "one FP8 linear's backward");
  m.def("experts_bwd", with_outputs(&fp8p::experts_bwd), "the per-expert backward GEMMs of a grouped call");
#ifdef FP8P_WITH_CUDA
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif
}
