// The compiled host path of fp8_parallel: the FP8 cast and one FP8 linear's forward and backward, each one
// call from Python. Computes exactly what the Python path computes (`quantize`, `fp8_gemm`,
// `modules/_core.py`): on CUDA with the kernels of cast_kernels.cu, elsewhere with the same torch formulas.
#include <torch/extension.h>

#include <optional>
#include <vector>

#ifdef FP8P_WITH_CUDA
#include "cuda_ops.h"
#endif

namespace fp8p {
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
    default: TORCH_CHECK(false, "fp8_parallel native: unknown dtype code ", code);
  }
}

Tensor rows_2d(const Tensor& x) {
  Tensor x2 = x.dim() == 2 ? x : x.reshape({-1, x.size(-1)});
  return x2.stride(-1) == 1 ? x2 : x2.contiguous();
}

void check_slot(const Tensor& buf, int64_t index, const char* what) {
  TORCH_CHECK(buf.scalar_type() == at::kFloat, "fp8_parallel native: ", what, " must be float32, got ",
              buf.scalar_type());
  TORCH_CHECK(buf.is_contiguous() && index >= 0 && index < buf.numel(), "fp8_parallel native: ", what,
              " index ", index, " outside a buffer of ", buf.numel(), " elements");
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

// one cast: `scale_buf[scale_index]` as the scale, `amax_buf[amax_index]` as the slot
void cast(const Tensor& x2, const Tensor& scale_buf, int64_t scale_index, const Tensor* data, const Tensor* t,
          const Tensor& scale_inv, const OptTensor& amax_buf, int64_t amax_index, const Tensor* noop, bool e5m2) {
  check_slot(scale_buf, scale_index, "scale");
  if (amax_buf) check_slot(*amax_buf, amax_index, "amax slot");
#ifdef FP8P_WITH_CUDA
  if (x2.is_cuda() && x2.numel() > 0) {
    cast_cuda(x2, scale_buf.data_ptr<float>() + scale_index,
              data != nullptr ? static_cast<unsigned char*>(data->data_ptr()) : nullptr,
              t != nullptr ? static_cast<unsigned char*>(t->data_ptr()) : nullptr, scale_inv.data_ptr<float>(),
              amax_buf ? amax_buf->data_ptr<float>() + amax_index : nullptr, noop, e5m2);
    return;
  }
#endif
  const Tensor slot = amax_buf ? amax_buf->narrow(0, amax_index, 1) : Tensor();
  cast_reference(x2, scale_buf.narrow(0, scale_index, 1), data, t, scale_inv, amax_buf ? &slot : nullptr, noop,
                 e5m2);
}

// cuBLAS's FP8 GEMM refuses operand and scale pointers that do not start at a 16-byte boundary
Tensor aligned(const Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0 ? t : t.clone(); }

Tensor scale_operand(const Tensor& scale_inv) {
  Tensor s = scale_inv.dim() == 0 ? scale_inv : scale_inv.reshape({});
  return aligned(s.scalar_type() == at::kFloat ? s : s.to(at::kFloat));
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
    r = at::_scaled_mm(a16, b16.t(), sa, sb, fused_bias, std::nullopt, result_type, fast_accum);
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
  acc.add_(at::_scaled_mm(a16, b16.t(), sa, sb, std::nullopt, std::nullopt, at::kFloat, false));
}

void check_fp8(const Tensor& t, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kFloat8_e4m3fn || t.scalar_type() == at::kFloat8_e5m2,
              "fp8_parallel native: ", what, " must be FP8, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 2 && t.is_contiguous(), "fp8_parallel native: ", what,
              " must be a contiguous 2-d tensor, got sizes ", t.sizes(), " strides ", t.strides());
}

}  // namespace

// `quantize`'s fused cast into given outputs: `data` (x's shape), `t` ([N, M]) or both; see cuda_ops.h
void cast_into(const Tensor& x, const Tensor& scale_buf, int64_t scale_index, const OptTensor& data,
               const OptTensor& t, const Tensor& scale_inv, const OptTensor& amax_buf, int64_t amax_index,
               const OptTensor& noop) {
  const Tensor x2 = rows_2d(x.detach());
  TORCH_CHECK(data || t, "fp8_parallel native cast: neither data nor transpose given");
  const bool e5m2 = (data ? *data : *t).scalar_type() == at::kFloat8_e5m2;
  if (data) {
    check_fp8(data->dim() == 2 ? *data : data->view({x2.size(0), x2.size(1)}), "data");
    TORCH_CHECK(data->numel() == x2.numel(), "fp8_parallel native cast: data has ", data->numel(),
                " elements, the input ", x2.numel());
  }
  if (t) {
    check_fp8(*t, "transpose");
    TORCH_CHECK(t->size(0) == x2.size(1) && t->size(1) == x2.size(0), "fp8_parallel native cast: transpose has sizes ",
                t->sizes(), ", the input ", x2.sizes());
    TORCH_CHECK(!data || data->scalar_type() == t->scalar_type(), "fp8_parallel native cast: data is ",
                data->scalar_type(), ", transpose ", t->scalar_type());
  }
  TORCH_CHECK(scale_inv.scalar_type() == at::kFloat && scale_inv.numel() == 1,
              "fp8_parallel native cast: scale_inv must be one float32, got ", scale_inv.scalar_type(), " ",
              scale_inv.sizes());
  cast(x2, scale_buf, scale_index, data ? &*data : nullptr, t ? &*t : nullptr, scale_inv, amax_buf, amax_index,
       noop ? &*noop : nullptr, e5m2);
}

// One FP8 linear's forward: cast x (viewed as x2 [M, K]) with scale_buf[0] (E4M3) into amax_buf[amax_index],
// then y = x @ W.T (+ bias) with fast accumulation. W is the cached FP8 weight `w_data` ([N, K]) with `w_sinv`,
// or, given `w_hp` instead, that high-precision weight cast here with scale_buf[1] into amax_buf[amax_index + 1].
// Returns [y (x's shape with N features), the FP8 transpose of x2 (keep_t) or undefined, x2's scale_inv, a copy
// of scale_buf[0:2] (keep_scales: the scales backward re-casts x and a `w_hp` with) or undefined, the scale_inv
// of a weight cast here or undefined].
std::vector<Tensor> linear_fwd(const Tensor& x, const Tensor& scale_buf, const OptTensor& amax_buf,
                               int64_t amax_index, bool keep_t, bool keep_scales, const OptTensor& w_data,
                               const OptTensor& w_sinv, const OptTensor& w_hp, const OptTensor& bias) {
  TORCH_CHECK(x.dim() >= 1, "fp8_parallel native linear: input must have a feature dimension");
  TORCH_CHECK((w_data && w_sinv) != bool(w_hp), "fp8_parallel native linear: give the FP8 weight or the weight to cast");
  const Tensor x2 = rows_2d(x);
  const auto opts = x2.options();
  const Tensor saved_scales = keep_scales ? scale_buf.narrow(0, 0, 2).clone() : Tensor();
  Tensor qw, qw_sinv, cast_sinv;
  if (w_hp) {
    const Tensor w2 = rows_2d(w_hp->detach());
    qw = at::empty({w2.size(0), w2.size(1)}, opts.dtype(at::kFloat8_e4m3fn));
    cast_sinv = qw_sinv = at::empty({}, opts.dtype(at::kFloat));
    cast(w2, scale_buf, 1, &qw, nullptr, qw_sinv, amax_buf, amax_index + 1, nullptr, false);
  } else {
    qw = *w_data;
    qw_sinv = *w_sinv;
  }
  check_fp8(qw, "weight");
  TORCH_CHECK(qw.size(1) == x2.size(1), "fp8_parallel native linear: input has ", x2.size(1),
              " features, the weight ", qw.sizes());
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
  return {y, qx_t, sinv, saved_scales, cast_sinv};
}

// One FP8 linear's backward from `linear_fwd`'s outputs: cast g2 ([M, N]) with g_scale_buf[0] (E5M2 when
// g_e5m2) into g_amax_buf[g_amax_index]; dgrad = g2 @ W from the weight's FP8 transpose, given (`w_t`, [K, N])
// or re-cast here from `w_ref` with saved_scales[1]; wgrad = g2.T @ x2 from x2's FP8 transpose, given (`x_t`,
// [K, M]) or re-cast here from `x_ref` with saved_scales[0]; the bias gradient g2.sum(0). Given `main_grad` (a
// float32 / bfloat16 / float16 [N, K] tensor), wgrad is added into it (accumulated in float32, one rounding)
// instead of returned. Returns [grad_x (g's shape
// with K features), grad_w, grad_b], undefined where not asked for (grad_w also with `main_grad`).
std::vector<Tensor> linear_bwd(const Tensor& g, const Tensor& g_scale_buf, const OptTensor& g_amax_buf,
                               int64_t g_amax_index, bool g_e5m2, const OptTensor& w_t, const OptTensor& w_ref,
                               const OptTensor& w_sinv, const OptTensor& x_t, const OptTensor& x_ref,
                               const OptTensor& saved_scales, const OptTensor& x_sinv, bool need_dgrad,
                               bool need_wgrad, bool need_bgrad, int64_t x_dtype, int64_t w_dtype,
                               const OptTensor& main_grad) {
  const Tensor g2 = g.dim() == 2 ? g : g.reshape({-1, g.size(-1)});
  const Tensor g2c = g2.stride(1) == 1 ? g2 : g2.contiguous();
  const int64_t M = g2.size(0), N = g2.size(1);
  const auto opts = g2.options();
  const at::ScalarType gtype = fp8_type(g_e5m2);
  Tensor qg = at::empty({M, N}, opts.dtype(gtype));
  const Tensor qg_t = need_wgrad ? at::empty({N, M}, opts.dtype(gtype)) : Tensor();
  const Tensor g_sinv = at::empty({}, opts.dtype(at::kFloat));
  cast(g2c, g_scale_buf, 0, &qg, need_wgrad ? &qg_t : nullptr, g_sinv, g_amax_buf, g_amax_index, nullptr, g_e5m2);
  // a transpose-only re-cast of `ref` ([R, C] -> [C, R], E4M3) with saved_scales[index]
  auto recast_t = [&](const Tensor& ref, int64_t index) {
    TORCH_CHECK(saved_scales, "fp8_parallel native linear: a re-cast needs the forward's scales");
    const Tensor r2 = rows_2d(ref.detach());
    Tensor t = at::empty({r2.size(1), r2.size(0)}, opts.dtype(at::kFloat8_e4m3fn));
    const Tensor unused_sinv = at::empty({}, opts.dtype(at::kFloat));
    cast(r2, *saved_scales, index, nullptr, &t, unused_sinv, std::nullopt, 0, nullptr, false);
    return t;
  };
  Tensor grad_x, grad_w, grad_b;
  // dgrad first; its operands are released before the wgrad GEMM allocates the weight gradient
  if (need_dgrad) {
    TORCH_CHECK((w_t || w_ref) && w_sinv, "fp8_parallel native linear: dgrad needs the weight's FP8 transpose");
    const Tensor wt = w_t ? *w_t : recast_t(*w_ref, 1);
    check_fp8(wt, "weight transpose");
    grad_x = gemm(qg, wt, g_sinv, *w_sinv, std::nullopt, dtype_of(x_dtype), false);
  }
  qg.reset();
  if (need_wgrad) {
    TORCH_CHECK(x_sinv && (x_t || x_ref), "fp8_parallel native linear: wgrad needs the input's FP8 transpose");
    const Tensor xt = x_t ? *x_t : recast_t(*x_ref, 0);
    check_fp8(xt, "input transpose");
    if (main_grad) {
      const at::ScalarType mt = main_grad->scalar_type();
      TORCH_CHECK(main_grad->device() == g2.device(), "fp8_parallel native linear: main_grad is on ",
                  main_grad->device(), ", the gradient on ", g2.device());
      TORCH_CHECK((mt == at::kFloat || mt == at::kBFloat16 || mt == at::kHalf) && main_grad->dim() == 2 &&
                      main_grad->size(0) == N && main_grad->size(1) == xt.size(0),
                  "fp8_parallel native linear: main_grad must be a float32 / bfloat16 / float16 [", N, ", ",
                  xt.size(0), "] tensor, got ", mt, " ", main_grad->sizes());
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
  return {grad_x, grad_w, grad_b};
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
std::vector<Tensor> experts_bwd(int64_t n, int64_t k, const OptTensor& g_rows, const Tensor& g_sinv,
                                const std::vector<int64_t>& splits,
                                const std::vector<Tensor>& w_t, const std::vector<Tensor>& w_sinv, int64_t x_dtype,
                                const OptTensor& g_t, const OptTensor& x_t, const OptTensor& x_sinv,
                                const std::vector<int64_t>& padded_starts, const std::vector<int64_t>& padded_rows,
                                const std::vector<bool>& need_w, const std::vector<int64_t>& w_dtypes,
                                const std::vector<OptTensor>& main_grads) {
  const int64_t experts = static_cast<int64_t>(splits.size());
  TORCH_CHECK(g_sinv.dim() == 1 && g_sinv.size(0) == experts, "fp8_parallel native experts: ", experts,
              " experts, ", g_sinv.sizes(), " grad_output scale_invs");
  std::vector<Tensor> out(experts + 1);
  if (g_rows) {
    check_fp8(*g_rows, "grad_output cast");
    TORCH_CHECK(static_cast<int64_t>(w_t.size()) == experts && static_cast<int64_t>(w_sinv.size()) == experts,
                "fp8_parallel native experts: ", w_t.size(), " weight transposes for ", experts, " experts");
    Tensor grad_x = at::empty({g_rows->size(0), k}, g_rows->options().dtype(dtype_of(x_dtype)));
    std::vector<int64_t> starts(experts);
    int64_t rows = 0;
    for (int64_t e = 0; e < experts; ++e) { starts[e] = rows; rows += splits[e]; }
    TORCH_CHECK(rows == g_rows->size(0), "fp8_parallel native experts: splits sum to ", rows, ", the cast has ",
                g_rows->size(0), " rows");
    for (int64_t e = experts - 1; e >= 0; --e) {
      if (splits[e] == 0) continue;
      check_fp8(w_t[e], "weight transpose");
      TORCH_CHECK(w_t[e].size(0) == k && w_t[e].size(1) == g_rows->size(1), "fp8_parallel native experts: weight ",
                  "transpose ", e, " has sizes ", w_t[e].sizes(), ", expected [", k, ", ", g_rows->size(1), "]");
      Tensor dx = grad_x.narrow(0, starts[e], splits[e]);
      at::_scaled_mm_out(dx, g_rows->narrow(0, starts[e], splits[e]), w_t[e].t(), g_sinv.select(0, e),
                         scale_operand(w_sinv[e]), std::nullopt, std::nullopt, dtype_of(x_dtype), false);
    }
    out[0] = grad_x;
  }
  if (g_t && x_t) {
    TORCH_CHECK(x_sinv && x_sinv->dim() == 1 && x_sinv->size(0) == experts, "fp8_parallel native experts: the ",
                "inputs' scale_invs must be one per expert");
    TORCH_CHECK(static_cast<int64_t>(padded_starts.size()) == experts &&
                    static_cast<int64_t>(padded_rows.size()) == experts &&
                    static_cast<int64_t>(need_w.size()) == experts &&
                    static_cast<int64_t>(w_dtypes.size()) == experts &&
                    static_cast<int64_t>(main_grads.size()) == experts,
                "fp8_parallel native experts: one padded start, padded row count, need flag, dtype and main_grad ",
                "per expert");
    for (int64_t e = experts - 1; e >= 0; --e) {
      if (!need_w[e]) continue;
      const int64_t ps = padded_starts[e], pm = padded_rows[e];
      const OptTensor& into = main_grads[e];
      if (pm == 0) {
        if (!into) out[e + 1] = at::zeros({n, k}, g_t->options().dtype(dtype_of(w_dtypes[e])));
        continue;
      }
      const Tensor a = g_t->as_strided({n, pm}, {pm, 1}, n * ps);  // [N, padded] row-major
      const Tensor b = x_t->as_strided({k, pm}, {pm, 1}, k * ps);  // [K, padded] row-major
      const Tensor sa = g_sinv.select(0, e), sb = x_sinv->select(0, e);
      if (into) {
        Tensor acc = *into;
        TORCH_CHECK(acc.dim() == 2 && acc.size(0) == n && acc.size(1) == k && acc.device() == g_t->device(),
                    "fp8_parallel native experts: main_grad ", e, " has sizes ", acc.sizes(), " on ", acc.device(),
                    ", expected [", n, ", ", k, "] on ", g_t->device());
        gemm_accumulate(a, b, sa, sb, acc);
      } else {
        out[e + 1] = at::_scaled_mm(a, b.t(), sa, sb, std::nullopt, std::nullopt, dtype_of(w_dtypes[e]), false);
      }
    }
  }
  return out;
}

}  // namespace fp8p

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "fp8_parallel's compiled host path: FP8 cast and FP8 linear forward / backward";
  m.def("cast_into", &fp8p::cast_into, "fused FP8 cast into given outputs");
  m.def("linear_fwd", &fp8p::linear_fwd, "one FP8 linear's forward");
  m.def("linear_bwd", &fp8p::linear_bwd, "one FP8 linear's backward");
  m.def("experts_bwd", &fp8p::experts_bwd, "the per-expert backward GEMMs of a grouped call");
#ifdef FP8P_WITH_CUDA
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif
}
