"""Every top-level name of `transformer_engine.pytorch` (TE 2.x's `__init__`, 85 names) either exists in
`fp8_parallel` or raises an AttributeError that names it as a TransformerEngine name and says what to use
instead; the migration page lists every one of them."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import fp8_parallel as te

TE_NAMES = """
constants CPLoadBalancingStrategy DType LayerNormLinear Linear LayerNormMLP LayerNorm RMSNorm GroupedLinear
Fp8Padding Fp8Unpadding initialize_ub destroy_ub UserBufferQuantizationMode DotProductAttention
GatedDeltaNetAttention FusedMLAQUpProjFunction FusedMLAQUpProjRopeQuant MultiheadAttention InferenceParams
RotaryPositionEmbedding TransformerLayer moe_permute moe_permute_with_probs moe_permute_and_pad_with_probs
moe_unpermute moe_sort_chunks_by_index moe_sort_chunks_by_index_with_probs fp8_autocast fp8_model_init autocast
apply_recipe quantized_model_init is_fp8_available is_mxfp8_available is_fp8_block_scaling_available
is_nvfp4_available get_default_recipe QuantizerRole QuantizerRequest DelayedScalingRequest quantizer_factory
get_cudnn_version get_device_compute_capability is_bf16_available deinterleave_glu_tensor interleave_glu_tensor
make_graphed_callables checkpoint CudaRNGStatesTracker get_cpu_offload_context mark_not_offload
ManualOffloadSynchronizer ops optimizers onnx_export parallel_cross_entropy CusolverMpCtx newton_schulz
newton_schulz_tp QuantizedTensorStorage QuantizedTensor Quantizer prepare_for_saving restore_from_saved
restore_from_func_ctx Float8Quantizer Float8CurrentScalingQuantizer MXFP8Quantizer Float8BlockQuantizer
NVFP4Quantizer Float8TensorStorage MXFP8TensorStorage Float8BlockwiseQTensorStorage NVFP4TensorStorage
Float8Tensor MXFP8Tensor Float8BlockwiseQTensor NVFP4Tensor HybridQuantizer HybridQuantizedTensorStorage
IdentityQuantizer IdentityTensorStorage HybridQuantizedTensor IdentityTensor
""".split()
MIGRATION = Path(__file__).resolve().parents[2] / "docs" / "migrating-from-te.md"


def test_the_list_is_te_s_whole_top_level():
    assert len(TE_NAMES) == len(set(TE_NAMES)) == 85


@pytest.mark.parametrize("name", TE_NAMES)
def test_each_te_name_exists_or_says_what_to_use(name):
    try:
        getattr(te, name)
    except AttributeError as err:
        message = str(err)
        assert f"fp8_parallel has no {name} (a TransformerEngine name): " in message
        assert len(message.split("): ", 1)[1]) > 20, message  # a reason or a replacement, not a bare miss
    else:
        assert name in te.__all__ or name in dir(te)


def test_migration_page_lists_every_te_name():
    text = MIGRATION.read_text()
    section = text[text.index("### Every TransformerEngine name"):]
    missing = [n for n in TE_NAMES if f"`{n}`" not in section]
    assert missing == [], missing


def test_device_helpers():
    if torch.cuda.is_available():
        major, minor = te.get_device_compute_capability()
        assert (major, minor) == torch.cuda.get_device_capability()
    else:
        with pytest.raises(RuntimeError, match="no CUDA device"):
            te.get_device_compute_capability()
    if torch.backends.cudnn.is_available() and torch.backends.cudnn.version():
        major, minor, patch = te.get_cudnn_version()
        assert major >= 8 and 0 <= minor < 100 and 0 <= patch < 100
    else:
        with pytest.raises(RuntimeError, match="no cuDNN"):
            te.get_cudnn_version()
