"""The training job resumes a checkpoint under another tensor / pipeline layout (CPU, gloo): saved under TP2 +
sequence parallel with FP8, resumed under PP2; the run continues where the uninterrupted one goes. The
vocabulary is padded to one size for every TP that divides 8, so the embedding keeps its shape across TP. Virtual
pipeline stages reshard too (saved PP2 x VPP2, resumed PP2)."""
from __future__ import annotations

import shutil

import pytest

from launch import checkpoint_files as cf
from test_pretrain_gpt import FP8, TINY, _rows, _torchrun

TP2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
PP2 = ["--pipeline-model-parallel-size", "2"]


def test_padded_vocab_is_the_same_for_every_tp_dividing_8():
    from launch.train.model import padded_vocab_size

    for vocab in (257, 32000, 50257):
        sizes = {padded_vocab_size(vocab, tp) for tp in (1, 2, 4, 8)}
        assert len(sizes) == 1 and sizes.pop() % (64 * 8) == 0, (vocab, sizes)
    assert padded_vocab_size(257, 3) % (64 * 3) == 0


VPP2 = PP2 + ["--virtual-pipeline-model-parallel-size", "2"]


def _save_then_resume_elsewhere(tmp_path, saved_layout, resumed_layout) -> None:
    """Train 8 iterations whole under `saved_layout`, saving iteration 4 on the way, and resume that save under
    `resumed_layout`: the resumed run continues where the whole one goes. Another layout computes the same model
    with other reduction orders and amax domains: FP8 tolerance. (A save does not change the run that makes it,
    and a run stopped by --exit-interval leaves the same checkpoint: test_checkpointing_job checks both bitwise;
    so the whole run's save at 4 stands for a separate run to 4, one launch fewer.)"""
    common = TINY + FP8 + ["--num-layers", "4", "--train-iters", "8"]
    saved, ckpt = tmp_path / "saved", tmp_path / "ckpt"
    _torchrun(tmp_path, 2, common + saved_layout + ["--save", str(saved), "--save-interval", "4",
                                                    "--log-json", str(tmp_path / "whole.jsonl")])
    assert cf.read_latest(saved) == "iter_0000008" and (saved / "iter_0000004").is_dir(), sorted(saved.iterdir())
    ckpt.mkdir()
    shutil.copytree(saved / "iter_0000004", ckpt / "iter_0000004")  # the checkpoint a run stopped at 4 leaves
    cf.write_atomic(ckpt / cf.LATEST, "iter_0000004\n")
    cf.verify(cf.find_current(ckpt)[0])
    _torchrun(tmp_path, 2, common + resumed_layout + ["--load", str(ckpt), "--log-json", str(tmp_path / "resumed.jsonl")])
    whole, resumed = _rows(tmp_path / "whole.jsonl"), _rows(tmp_path / "resumed.jsonl")
    assert [r["iteration"] for r in resumed] == [5, 6, 7, 8], resumed
    for a, b in zip(whole[4:], resumed):
        assert b["loss"] == pytest.approx(a["loss"], rel=2e-2), (a["iteration"], a["loss"], b["loss"])


def test_job_saved_tp2_resumes_under_pp2(tmp_path):
    _save_then_resume_elsewhere(tmp_path, TP2, PP2)


def test_job_saved_pp2_vpp2_resumes_without_virtual_stages(tmp_path):
    """Saved PP2 with two virtual stages per rank, resumed PP2 with one chunk per rank: dist_checkpointing keys
    name global layer numbers, so the layers find their new chunk."""
    _save_then_resume_elsewhere(tmp_path, VPP2, PP2)


def test_job_refuses_another_amax_history_length_naming_it(tmp_path):
    """The amax history's shape is [2, history]: resuming with another --fp8-amax-history-len is refused with
    an error that names both lengths (it once blamed the parallel layouts, which were the same)."""
    common = TINY + ["--fp8-format", "hybrid", "--num-layers", "2", "--train-iters", "2"]
    ckpt = tmp_path / "ckpt"
    _torchrun(tmp_path, 2, common + ["--fp8-amax-history-len", "4", "--save", str(ckpt), "--save-interval", "2"])
    out = _torchrun(tmp_path, 2, common + ["--fp8-amax-history-len", "8", "--load", str(ckpt),
                                           "--train-iters", "3"], expect_ok=False)
    assert "--fp8-amax-history-len: checkpoint 4, this run 8" in out, out[-5000:]
