"""GPU: SDPA core attention per dtype and SDPA backend against megatron-core's DotProductAttention (run in
float32 on the same inputs), GQA, dropout under megatron's RNG tracker, and the CP worker on two GPUs."""

import pytest
import torch

from launcher import launch
from seeds import session_seed

pytestmark = pytest.mark.gpu

TOL = {torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 1e-2}  # max |error| / max |reference|


@pytest.fixture(scope="module")
def megatron_groups():
    """megatron's groups on one GPU (its DotProductAttention reads the TP group and a memory buffer)."""
    import parallel_state as ps

    ps.initialize()
    yield
    ps.destroy()


def _config(heads, groups, dim, dtype, **kw):
    from megatron.core.transformer.transformer_config import TransformerConfig

    kw.setdefault("attention_dropout", 0.0)
    return TransformerConfig(num_layers=2, hidden_size=heads * dim, num_attention_heads=heads,
                             num_query_groups=groups, kv_channels=dim, params_dtype=dtype,
                             bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
                             masked_softmax_fusion=False, **kw)


def _backend(name):
    from torch.nn.attention import SDPBackend

    return {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}[name]


def _rel_err(got, want):
    return ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-6)).item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("backend", ["flash", "efficient", "cudnn", "math"])
@pytest.mark.parametrize("case", ["causal", "causal_gqa", "padding", "padding_gqa"])
def test_backends_match_megatron(megatron_groups, dtype, backend, case):
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from torch.nn.attention import sdpa_kernel

    from fp8_parallel.modules.attention import SDPADotProductAttention

    if dtype == torch.float32 and backend in ("flash", "cudnn"):
        pytest.skip(f"{backend} attention has no float32 kernel")
    seed = session_seed()
    print(f"seed={seed}")
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed % 1000)
    sq, b, heads, dim = 512, 2, 8, 64
    groups = 2 if case.endswith("gqa") else heads
    q = torch.randn(sq, b, heads, dim, device="cuda")
    k, v = (torch.randn(sq, b, groups, dim, device="cuda") for _ in range(2))
    grad = torch.randn(sq, b, heads * dim, device="cuda")
    mask_type, mask = AttnMaskType.causal, None
    if case.startswith("padding"):
        mask = torch.rand(b, 1, 1, sq, device="cuda") < 0.2
        mask[..., 0] = False
        mask_type = AttnMaskType.padding

    ref = DotProductAttention(_config(heads, groups, dim, torch.float32), 1, mask_type, "self")
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    want = ref(*leaves, mask)
    want.backward(grad)
    want_grads = [t.grad for t in leaves]

    ours = SDPADotProductAttention(_config(heads, groups, dim, dtype), 1, mask_type, "self")
    leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    try:
        with sdpa_kernel(_backend(backend)):
            got = ours(*leaves, mask)
            got.backward(grad.to(dtype))
    except RuntimeError as e:
        if "No available kernel" in str(e):
            pytest.skip(f"torch has no {backend} kernel for {case} in {dtype}: {str(e)[:200]}")
        raise
    assert got.dtype == dtype and got.shape == want.shape
    errs = [_rel_err(got, want)] + [_rel_err(t.grad, w) for t, w in zip(leaves, want_grads)]
    print(f"{backend} {case} {dtype}: relative error out/dq/dk/dv {errs}")
    assert max(errs) < TOL[dtype], errs


def test_causal_path_takes_a_fused_kernel(megatron_groups):
    """Causal attention without a mask must not need the math backend (no S x S tensor): it runs with only
    flash / cuDNN / efficient kernels allowed, and with GQA."""
    from megatron.core.transformer.enums import AttnMaskType
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from fp8_parallel.modules.attention import SDPADotProductAttention

    for groups in (16, 4):
        ours = SDPADotProductAttention(_config(16, groups, 128, torch.bfloat16), 1, AttnMaskType.causal, "self")
        q = torch.randn(2048, 2, 16, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(2048, 2, groups, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn_like(k, requires_grad=True)
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
            out = ours(q, k, v, None)
            out.sum().backward()
        assert torch.isfinite(out).all() and torch.isfinite(q.grad).all()


@pytest.mark.parametrize("graph_safe", [False, True])
def test_dropout_deterministic_under_rng_tracker(megatron_groups, graph_safe):
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.enums import AttnMaskType

    from fp8_parallel.modules.attention import SDPADotProductAttention

    seed = session_seed() % 10000
    print(f"seed={seed}")
    ours = SDPADotProductAttention(_config(8, 2, 64, torch.bfloat16, attention_dropout=0.2), 1,
                                   AttnMaskType.causal, "self")
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(256, 2, 8, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(256, 2, 2, 64, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    outs = []
    for default_seed in (1, 2):  # the mask follows the tracker, not the default generator
        model_parallel_cuda_manual_seed(seed, use_cudagraphable_rng=graph_safe, force_reset_rng=True)
        torch.cuda.manual_seed(default_seed)
        outs.append(ours(q, k, v, None))
    third = ours(q, k, v, None)
    ours.eval()
    plain = ours(q, k, v, None)
    assert torch.equal(outs[0], outs[1])
    assert not torch.equal(outs[0], third)
    assert not torch.equal(outs[0], plain)


def test_context_parallel_on_two_gpus():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    launch("attention_checks.py", 2, timeout=600, gpus=True, expect_checks=[
        "matches_megatron_dot_product_attention", "errors", "dropout_under_rng_tracker", "gpt_cp1_reference",
        "cp2_attention_matches_full_sequence", "gpt_mha_learned_cp2_matches_cp1", "gpt_gqa_rope_cp2_matches_cp1",
        "gpt_fp8_cp2_matches_cp1"])
