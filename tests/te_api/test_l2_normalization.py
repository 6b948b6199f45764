"""`fp8_parallel.ops.L2Normalization` as TransformerEngine's: `x / sqrt(sum(x**2) + eps)` over the last
dimension, forward and backward against float64, every dtype, an odd width; the attention's qk norm uses it."""
from __future__ import annotations

import pytest
import torch

import fp8_parallel as te
from seeds import session_seed

TOL = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_l2_normalization_forward_and_backward_against_float64(dtype):
    seed = session_seed()
    print("seed", seed)
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(3, 5, 37, generator=gen) * 4).to(dtype).requires_grad_()
    dy = torch.randn(3, 5, 37, generator=gen).to(dtype)
    norm = te.ops.L2Normalization(eps=1e-6, seq_length=5, micro_batch_size=3)
    y = norm(x)
    y.backward(dy)
    x64 = x.detach().double().requires_grad_()
    y64 = x64 / torch.sqrt(x64.square().sum(-1, keepdim=True) + 1e-6)
    y64.backward(dy.double())
    assert y.dtype == dtype and x.grad.dtype == dtype
    torch.testing.assert_close(y.double(), y64, rtol=TOL[dtype], atol=TOL[dtype])
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=4 * TOL[dtype], atol=4 * TOL[dtype])
    assert list(norm.parameters()) == []


def test_other_ops_names_say_what_to_use():
    with pytest.raises(AttributeError, match="fp8_parallel.ops has no Sequential .*only L2Normalization"):
        te.ops.Sequential  # noqa: B018
    with pytest.raises(ValueError, match="eps=-1"):
        te.ops.L2Normalization(eps=-1)


def test_multihead_attention_qk_norm_is_the_public_class():
    mha = te.MultiheadAttention(32, 4, qk_norm_type="L2Normalization", params_dtype=torch.float32, device="cpu")
    assert isinstance(mha.q_norm, te.ops.L2Normalization) and isinstance(mha.k_norm, te.ops.L2Normalization)
