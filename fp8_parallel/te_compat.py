"""TransformerEngine's entry points under their names: `fp8_autocast`, the availability checks,
`get_default_recipe`, and `quantized_model_init` / `fp8_model_init` (which refuse to make FP8 parameters).

`fp8_parallel.autocast` is TransformerEngine 2.x's `autocast(enabled, calibrating, recipe,
amax_reduction_group)`; `fp8_autocast` takes TransformerEngine's older keyword names and returns one. See
`docs/migrating-from-te.md` for the mapping of every TransformerEngine name.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist

from .recipe import DelayedScaling, Recipe
from .scopes import autocast

__all__ = [
    "FP8Availability",
    "fp8_autocast",
    "fp8_model_init",
    "get_cudnn_version",
    "get_default_recipe",
    "get_device_compute_capability",
    "is_bf16_available",
    "is_fp8_available",
    "is_fp8_block_scaling_available",
    "is_mxfp8_available",
    "is_nvfp4_available",
    "quantized_model_init",
]

_NO_FP8_PARAMETERS = ("FP8 parameters are not implemented: parameters stay in params_dtype, and their FP8 cast is "
                      "cached per step with forward(..., is_first_microbatch=True/False)")

_UB = "userbuffers communication overlap is not implemented (the ub_* options are refused)"
_PERMUTE = "token permutation for experts comes from megatron's MoE token dispatcher"
_OFFLOAD = "activation CPU offload is not implemented"
_QUANTIZER = ("only the per-tensor quantizers are provided (fp8_parallel.Quantizer, Float8Quantizer, "
              "Float8CurrentScalingQuantizer), and their results are Float8Tensors (QuantizedTensor): there are no "
              "storage-only, hybrid or identity variants, quantizer roles or requests")
_BLOCK = "only per-tensor FP8 scaling is implemented (MXFP8, block-scaled FP8 and NVFP4 are not)"
_NEWTON = "TransformerEngine's Newton-Schulz orthogonalization (for Muon) is not provided"
TE_NAMES_NOT_PROVIDED = {
    "InferenceParams": "there is no KV cache for inference: the modules refuse inference_params",
    "Fp8Padding": "GroupedLinear takes any m_splits: FP8 GEMM alignment is handled inside, no padding needed",
    "Fp8Unpadding": "GroupedLinear takes any m_splits: FP8 GEMM alignment is handled inside, no padding needed",
    "initialize_ub": _UB, "destroy_ub": _UB, "UserBufferQuantizationMode": _UB,
    "get_cpu_offload_context": _OFFLOAD, "mark_not_offload": _OFFLOAD, "ManualOffloadSynchronizer": _OFFLOAD,
    **{name: _PERMUTE for name in ("moe_permute", "moe_permute_with_probs", "moe_permute_and_pad_with_probs",
                                   "moe_unpermute", "moe_sort_chunks_by_index",
                                   "moe_sort_chunks_by_index_with_probs")},
    **{name: _QUANTIZER for name in ("QuantizedTensorStorage", "Float8TensorStorage", "HybridQuantizer",
                                     "HybridQuantizedTensor", "HybridQuantizedTensorStorage", "IdentityQuantizer",
                                     "IdentityTensor", "IdentityTensorStorage", "QuantizerRole", "QuantizerRequest",
                                     "DelayedScalingRequest", "quantizer_factory", "apply_recipe",
                                     "prepare_for_saving", "restore_from_saved", "restore_from_func_ctx")},
    **{name: _BLOCK for name in ("MXFP8Quantizer", "Float8BlockQuantizer", "NVFP4Quantizer", "MXFP8Tensor",
                                 "Float8BlockwiseQTensor", "NVFP4Tensor", "MXFP8TensorStorage",
                                 "Float8BlockwiseQTensorStorage", "NVFP4TensorStorage")},
    **{name: _NEWTON for name in ("newton_schulz", "newton_schulz_tp", "CusolverMpCtx")},
    "GatedDeltaNetAttention": "only softmax attention is provided (DotProductAttention, MultiheadAttention)",
    "FusedMLAQUpProjFunction": "multi-head latent attention's fused projections are not provided",
    "FusedMLAQUpProjRopeQuant": "multi-head latent attention's fused projections are not provided",
    "RotaryPositionEmbedding": ("pass rotary frequencies as rotary_pos_emb to MultiheadAttention / TransformerLayer "
                                "(megatron.core.models.common.embeddings.RotaryEmbedding makes them)"),
    "CPLoadBalancingStrategy": "context parallelism takes megatron's sequence split; no load-balancing choice",
    "constants": "TransformerEngine's constants module is not provided; its DType is fp8_parallel.DType",
    "optimizers": ("use torch.optim (e.g. torch.optim.AdamW(fused=True)) or megatron-core's optimizer "
                   "(megatron.core.optimizer)"),
    "onnx_export": "ONNX export is not provided",
    "parallel_cross_entropy": "use megatron.core.tensor_parallel.vocab_parallel_cross_entropy",
    "interleave_glu_tensor": "not provided: GLU weights are kept in one layout ([gate; up] halves)",
    "deinterleave_glu_tensor": "not provided: GLU weights are kept in one layout ([gate; up] halves)",
}
"""TransformerEngine names this package does not provide, with what to use instead (the AttributeError that
`fp8_parallel.<name>` raises says it)."""


def fp8_autocast(
    enabled: bool = True,
    calibrating: bool = False,
    fp8_recipe: Optional[Recipe] = None,
    fp8_group: Optional[dist.ProcessGroup] = None,
) -> autocast:
    """TransformerEngine's `fp8_autocast`: `autocast(enabled, calibrating, recipe=fp8_recipe, group=fp8_group)`.

    Unlike TransformerEngine, `enabled=True` also works without an FP8-capable GPU (see `is_fp8_available`).

    Args:
        enabled: run the FP8 modules inside in FP8 (False or None: high precision).
        calibrating: TransformerEngine's calibration mode (see `autocast`): amaxes recorded while computing
            in high precision (with `enabled=False`), the scales updated at exit.
        fp8_recipe: `recipe.DelayedScaling` (default) or `recipe.Float8CurrentScaling`, from
            `fp8_parallel.recipe`.
        fp8_group: the amax reduction group. None: the dense amax domain of `parallel_state` when it is
            initialized, else the world group when torch.distributed is initialized (TransformerEngine: the
            world group).

    Raises:
        TypeError: a recipe that is not one of ours (e.g. TransformerEngine's own), a recipe passed as the
            first or second positional argument (those are `enabled` and `calibrating`), or a group that is
            not a ProcessGroup.
    """
    if isinstance(enabled, Recipe):
        raise TypeError(
            f"fp8_autocast(enabled={enabled!r}): the first positional argument is `enabled`; pass the recipe "
            "as fp8_recipe=..."
        )
    if enabled is not None and not isinstance(enabled, (bool, int)):
        raise TypeError(f"fp8_autocast(enabled={enabled!r}): expected a bool")
    if isinstance(calibrating, Recipe):
        raise TypeError(
            f"fp8_autocast(enabled, calibrating={calibrating!r}): the second positional argument is "
            "`calibrating`; pass the recipe as fp8_recipe=..."
        )
    if fp8_recipe is not None and not isinstance(fp8_recipe, Recipe):
        raise TypeError(
            f"fp8_autocast(fp8_recipe={fp8_recipe!r}): expected a recipe from fp8_parallel.recipe "
            "(DelayedScaling or Float8CurrentScaling); TransformerEngine's recipe objects are not accepted"
        )
    if fp8_group is not None and not isinstance(fp8_group, dist.ProcessGroup):
        raise TypeError(f"fp8_autocast(fp8_group={fp8_group!r}): expected a torch.distributed ProcessGroup or None")
    return autocast(enabled=bool(enabled), calibrating=bool(calibrating), recipe=fp8_recipe,
                    amax_reduction_group=fp8_group)


@contextlib.contextmanager
def quantized_model_init(enabled: bool = True, recipe: Optional[Recipe] = None,
                         preserve_high_precision_init_val: bool = False) -> Iterator[None]:
    """TransformerEngine's `quantized_model_init`: with `enabled=False` a no-op context (modules built inside
    keep high-precision parameters, as they would in TransformerEngine).

    Raises:
        NotImplementedError: `enabled=True` (FP8 parameters are not implemented; the message says what to use).
        TypeError: a recipe that is not one of ours.
    """
    if recipe is not None and not isinstance(recipe, Recipe):
        raise TypeError(f"quantized_model_init(recipe={recipe!r}): expected a recipe from fp8_parallel.recipe")
    if enabled:
        raise NotImplementedError(f"quantized_model_init(enabled=True): {_NO_FP8_PARAMETERS}. Build the modules "
                                  f"outside it (or with enabled=False).")
    del preserve_high_precision_init_val  # only meaningful for FP8 parameters
    yield


@contextlib.contextmanager
def fp8_model_init(enabled: bool = True, recipe: Optional[Recipe] = None,
                   preserve_high_precision_init_val: bool = False) -> Iterator[None]:
    """TransformerEngine's older name of `quantized_model_init` (the same rules)."""
    if enabled:
        raise NotImplementedError(f"fp8_model_init(enabled=True): {_NO_FP8_PARAMETERS}. Build the modules outside "
                                  f"it (or with enabled=False).")
    with quantized_model_init(False, recipe, preserve_high_precision_init_val):
        yield


def get_default_recipe() -> Recipe:
    """The recipe `autocast(recipe=None)` uses: `DelayedScaling()` (TransformerEngine picks by GPU; its choice
    on Hopper and Ada is this one)."""
    return DelayedScaling()


class FP8Availability(NamedTuple):
    """`(available, reason)`. Its truth value is `available`, so both `ok, reason = is_fp8_available()` and
    `if is_fp8_available():` read as TransformerEngine's do."""

    available: bool
    reason: str

    def __bool__(self) -> bool:
        return self.available


_CPU_PATH = (
    "without one, fp8_parallel runs its FP8 path on the CPU as an emulation (the same FP8 casts, scales, amax "
    "histories and reductions; FP8 GEMMs as float32 matmuls of the upcast operands): correct for testing, not fast"
)


def is_fp8_available(return_reason: bool = True) -> FP8Availability:
    """Whether this machine's GPU runs FP8 GEMMs, and if not, why (TransformerEngine's rule).

    FP8 needs an NVIDIA GPU of compute capability 8.9 or higher (Ada, Hopper and newer) and, on Ada (8.9),
    CUDA 12.1 or newer. Checks the current CUDA device.

    Args:
        return_reason: accepted for TransformerEngine compatibility; the result is always the pair, whose
            truth value is the availability.

    Returns:
        `FP8Availability(available, reason)`; `reason` is "" when available.
    """
    del return_reason
    if torch.version.hip is not None:
        return FP8Availability(False, f"ROCm build of torch {torch.__version__}: FP8 here targets NVIDIA GPUs "
                                      f"(float8_e4m3fn / float8_e5m2); {_CPU_PATH}")
    if torch.version.cuda is None:
        return FP8Availability(False, f"torch {torch.__version__} is a CPU build (no CUDA): FP8 GEMMs need an "
                                      f"NVIDIA GPU of compute capability 8.9 or higher; {_CPU_PATH}")
    if not torch.cuda.is_available():
        return FP8Availability(False, f"no CUDA device is visible: FP8 GEMMs need an NVIDIA GPU of compute "
                                      f"capability 8.9 or higher; {_CPU_PATH}")
    device = torch.cuda.current_device()
    capability = torch.cuda.get_device_capability(device)
    name = torch.cuda.get_device_name(device)
    if capability < (8, 9):
        return FP8Availability(False, f"device compute capability 8.9 or higher required for FP8 execution "
                                      f"({name} has {capability[0]}.{capability[1]}); {_CPU_PATH}")
    if capability < (9, 0) and tuple(int(v) for v in torch.version.cuda.split(".")[:2]) < (12, 1):
        return FP8Availability(False, f"CUDA 12.1 or newer required for FP8 execution on Ada ({name}; torch "
                                      f"built with CUDA {torch.version.cuda})")
    return FP8Availability(True, "")


def _not_implemented(what: str) -> FP8Availability:
    return FP8Availability(False, f"{what} is not implemented in fp8_parallel (only per-tensor FP8 scaling: "
                                  f"recipe.DelayedScaling, recipe.Float8CurrentScaling; see is_fp8_available)")


def is_mxfp8_available(return_reason: bool = True) -> FP8Availability:
    """TransformerEngine's check for MXFP8: always `(False, reason)` here (MXFP8 is not implemented)."""
    del return_reason
    return _not_implemented("MXFP8 block scaling (recipe.MXFP8BlockScaling)")


def is_fp8_block_scaling_available(return_reason: bool = True) -> FP8Availability:
    """TransformerEngine's check for block-scaled FP8: always `(False, reason)` here (not implemented)."""
    del return_reason
    return _not_implemented("FP8 block scaling (recipe.Float8BlockScaling)")


def is_nvfp4_available(return_reason: bool = True) -> FP8Availability:
    """TransformerEngine's check for NVFP4: always `(False, reason)` here (not implemented)."""
    del return_reason
    return _not_implemented("NVFP4 (recipe.NVFP4BlockScaling)")


def is_bf16_available(return_reason: bool = True) -> FP8Availability:
    """Whether bfloat16 computation is supported here: a CUDA device of compute capability 8.0 or higher
    (TransformerEngine's rule), or the CPU (torch computes bfloat16 there). `(available, reason)`, truthy as
    `available`."""
    del return_reason
    if not torch.cuda.is_available():
        return FP8Availability(True, "")
    major, minor = torch.cuda.get_device_capability()
    if major < 8:
        return FP8Availability(False, f"device compute capability 8.0 or higher required for BF16 execution "
                                      f"({torch.cuda.get_device_name()} has {major}.{minor})")
    return FP8Availability(True, "")


def get_device_compute_capability() -> Tuple[int, int]:
    """TransformerEngine's `get_device_compute_capability`: `(major, minor)` of the current CUDA device.

    Raises:
        RuntimeError: no CUDA device is visible.
    """
    if not torch.cuda.is_available():
        raise RuntimeError("get_device_compute_capability: no CUDA device is visible")
    return tuple(torch.cuda.get_device_capability(torch.cuda.current_device()))  # type: ignore[return-value]


def get_cudnn_version() -> Tuple[int, int, int]:
    """TransformerEngine's `get_cudnn_version`: `(major, minor, patch)` of the cuDNN torch loaded.

    Raises:
        RuntimeError: this torch has no cuDNN.
    """
    version = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    if not version:
        raise RuntimeError("get_cudnn_version: this torch build has no cuDNN")
    major, rest = divmod(version, 10000) if version >= 10000 else divmod(version, 1000)
    minor, patch = divmod(rest, 100)
    return major, minor, patch
