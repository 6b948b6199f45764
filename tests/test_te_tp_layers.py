"""Tensor parallelism of `fp8_parallel.MultiheadAttention` and `fp8_parallel.TransformerLayer`
(`set_parallel_mode=True`: column-parallel QKV split per part, row-parallel `proj`, LayerNormMLP's fc1 / fc2),
with and without `sequence_parallel`, on 2 gloo ranks (workers/te_tp_checks.py, its `layers` checks).

Each TP2 module holds the shards of a TP1 module's float32 parameters: split parameters (`query_weight`, ...) and
an interleaved fused QKV weight (grouped per key/value head) split along their rows, a fused `[q; k; v]` weight
(`qkv_weight_interleaved=False`) split per part, a gated fc1 per half, `proj` / fc2 along their columns;
norms and row-parallel biases replicated. FP8 off: output, input gradient and every parameter gradient equal to
the TP1 module's (this rank's slice) within 1e-5 relative; a replicated parameter under sequence parallelism
carries `sequence_parallel` and its per-rank gradient is partial, summed over the TP group by the caller
(megatron's DDP / finalize_model_grads), which the check does before comparing. FP8 on (delayed scaling, amax
group = the TP group): against the TP1 module in high precision within tests/test_te_surface.py's tolerances
for two FP8 GEMMs in a row (forward 0.16, backward 0.24 relative Frobenius error) and against the TP1 module in
FP8 (the same scales) within 1e-4. The seed is printed by the worker; FP8P_TEST_SEED reproduces a run.
"""
from __future__ import annotations

from launcher import launch
from te_testing import seed_for

LAYER_KINDS = ["MHA-fused", "MHA-split", "MHA-gqa2-fused", "MHA-gqa2-split", "MHA-gqa2-fused-concat",
               "TransformerLayer", "TransformerLayer-rmsnorm-swiglu"]


def test_multihead_attention_and_transformer_layer_tp2():
    """MultiheadAttention (self-attention, input_layernorm, fused interleaved / split / fused [q; k; v] QKV,
    GQA with 2 groups of 4 heads) and TransformerLayer (default encoder; RMSNorm + swiglu) at TP2 and
    TP2 + sequence parallelism, FP8 off and on, against the TP1 module with the same full weights."""
    seed = seed_for("te_tp_checks.py layers")
    launch("te_tp_checks.py", 2, args=["layers"], timeout=600, env={"FP8P_TEST_SEED": str(seed)},
           expect_checks=[f"layers_tp2:{kind}" for kind in LAYER_KINDS])
