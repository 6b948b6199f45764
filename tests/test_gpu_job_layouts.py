"""The training job on one GPU: a checkpoint saved mid-run (FP8, graphed layers, torch's fused Adam) resumes
into the same run. On two GPUs: a checkpoint saved under TP2 + sequence parallel (FP8, graphed layers) resumes
under PP2 (FP8, graphed layers) through dist_checkpointing, and continues the run. (Virtual pipeline stages
change the number of model chunks per rank, which the job's checkpoints refuse to reshard, naming both
layouts.)"""
from __future__ import annotations

import pytest

from test_pretrain_gpt import FP8, TINY, _gpu_torchrun, _rows

pytestmark = pytest.mark.gpu

TP2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
PP2 = ["--pipeline-model-parallel-size", "2"]


def test_gpu_save_tp2_resume_pp2(tmp_path):
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    common = TINY + FP8 + ["--num-layers", "4", "--bf16", "--cuda-graph", "--train-iters", "8"]
    ckpt = tmp_path / "ckpt"
    whole, first, resumed = (tmp_path / n for n in ("whole.jsonl", "first.jsonl", "resumed.jsonl"))
    _gpu_torchrun(tmp_path, 2, common + TP2 + ["--log-json", str(whole)])
    _gpu_torchrun(tmp_path, 2, common + TP2 + ["--save", str(ckpt), "--save-interval", "4", "--exit-interval", "4",
                                               "--log-json", str(first)])
    out = _gpu_torchrun(tmp_path, 2, common + PP2 + ["--load", str(ckpt), "--log-json", str(resumed)])
    rows_whole, rows_first, rows_resumed = _rows(whole), _rows(first), _rows(resumed)
    assert [r["iteration"] for r in rows_first] == [1, 2, 3, 4], rows_first
    assert [r["iteration"] for r in rows_resumed] == [5, 6, 7, 8], (rows_resumed, out[-3000:])
    # the first four iterations are the same run; after the resume another layout computes the same model:
    # losses agree within FP8 tolerance (different reduction orders and amax domains), none is non-finite
    for a, b in zip(rows_whole[:4], rows_first):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-3), (a, b)
    for a, b in zip(rows_whole[4:], rows_resumed):
        assert b["fp8_nonfinite_amax"] == 0
        assert a["loss"] == pytest.approx(b["loss"], rel=0.05), (a["iteration"], a["loss"], b["loss"])


def test_gpu_save_and_resume_one_gpu(tmp_path):
    """FP8 with graphed layers and megatron's optimizer on torch's fused Adam: 4 iterations, a checkpoint, 4
    more from it, against 8 in one go."""
    import torch

    if torch.cuda.device_count() < 1:
        pytest.skip("needs a GPU")
    common = TINY + FP8 + ["--num-layers", "4", "--bf16", "--cuda-graph", "--train-iters", "8"]
    ckpt = tmp_path / "ckpt"
    whole, first, resumed = (tmp_path / n for n in ("whole.jsonl", "first.jsonl", "resumed.jsonl"))
    out = _gpu_torchrun(tmp_path, 1, common + ["--log-json", str(whole)])
    assert "torch's fused Adam kernels" in out, out[-3000:]
    _gpu_torchrun(tmp_path, 1, common + ["--save", str(ckpt), "--save-interval", "4", "--exit-interval", "4",
                                         "--log-json", str(first)])
    out = _gpu_torchrun(tmp_path, 1, common + ["--load", str(ckpt), "--log-json", str(resumed)])
    assert "torch's fused Adam kernels" in out, out[-3000:]
    rows_whole, rows_first, rows_resumed = _rows(whole), _rows(first), _rows(resumed)
    assert [r["iteration"] for r in rows_resumed] == [5, 6, 7, 8], (rows_resumed, out[-3000:])
    for a, b in zip(rows_whole, rows_first + rows_resumed):
        assert b["fp8_nonfinite_amax"] == 0
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-3), (a["iteration"], a["loss"], b["loss"])
