"""The GPT training job (launch/pretrain_gpt.py): flags, bad input, data preprocessing, short multi-rank runs
on CPU/gloo (TP2, PP2 with virtual stages, MoE with FP8), determinism, the JSON log and its plot, a two-agent
rendezvous, and the embedded default run end to end."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

import pytest
import torch

from launcher import REPO, _free_port, child_env, job_argv, torchrun_command

HEAVY = pytest.mark.xdist_group("heavy")  # 4+ torchrun ranks: one at a time (--dist loadgroup)

ENTRY = REPO / "launch" / "pretrain_gpt.py"
TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "1e-2", "--min-lr", "1e-3",
        "--lr-warmup-iters", "1", "--log-interval", "2", "--no-progress-bar"]
FP8 = ["--fp8-format", "hybrid", "--fp8-amax-history-len", "4"]


def _env(tmp_path: Path) -> Dict[str, str]:
    return child_env(FP8P_DATA_CACHE=str(tmp_path.parent / "fp8p-data-cache"))


def _torchrun(tmp_path: Path, nproc: int, args: List[str], timeout: float = 900, expect_ok: bool = True,
              rdzv: List[str] = (), launcher: List[str] = (), forked: bool = True) -> str:
    """The job under torchrun on CPU ranks (forked ranks unless `forked=False` or a rendezvous of its own:
    `launcher.torchrun_command`); its output."""
    cmd = [*torchrun_command(forked=forked and not rdzv), f"--nproc_per_node={nproc}",
           *(rdzv or ["--nnodes=1", f"--master_port={_free_port()}"]), *launcher, str(ENTRY), *job_argv(args)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    if expect_ok:
        assert proc.returncode == 0, f"exit {proc.returncode}:\n{out[-15000:]}"
    return out


def _rows(path: Path) -> List[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _assert_falls(rows: List[dict], factor: float) -> None:
    losses = [r["loss"] for r in rows]
    assert all(isinstance(x, float) for x in losses), losses
    first, last = sum(losses[:2]) / 2, sum(losses[-2:]) / 2
    assert last < factor * first, f"loss did not fall: {losses}"


# -- flags and bad input (no ranks started) ----------------------------------------------------------------

def test_flags_parsed_with_megatron_names():
    from launch.train.arguments import embedded_default_argv, parse_args

    args = parse_args(["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                       "--virtual-pipeline-model-parallel-size", "2", "--num-layers", "8", "--micro-batch-size", "2",
                       "--global-batch-size", "16", "--fp8-format", "e4m3", "--fp8-recipe", "tensorwise",
                       "--fp8-amax-history-len", "8", "--fp8-amax-compute-algo", "most_recent", "--fp8-margin", "1",
                       "--recompute-granularity", "selective", "--lr-decay-style", "linear", "--clip-grad", "0.5",
                       "--data-path", "0.3", "a", "0.7", "b", "--split", "90,10,0", "--log-json", "x.jsonl"],
                      world_size=8)
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
            args.virtual_pipeline_model_parallel_size, args.data_parallel_size) == (2, 2, 2, 2)
    assert (args.fp8, args.fp8_recipe, args.fp8_amax_history_len, args.fp8_amax_compute_algo, args.fp8_margin) == \
        ("e4m3", "tensorwise", 8, "most_recent", 1)
    assert args.data_path == ["0.3", "a", "0.7", "b"] and args.clip_grad == 0.5
    assert parse_args(["--num-layers", "2"], world_size=1).fp8 is None  # absent --fp8-format: no FP8
    default = parse_args(embedded_default_argv(4, gpu=False), world_size=4)
    assert (default.tensor_model_parallel_size, default.pipeline_model_parallel_size,
            default.expert_model_parallel_size, default.expert_tensor_parallel_size, default.num_experts,
            default.fp8, default.cuda_graph) == (2, 2, 2, 1, 4, "hybrid", False)
    assert "--cuda-graph" in embedded_default_argv(4, gpu=True)


def test_flags_layer_over_the_preset():
    """A flag changes only its own setting of the preset: the job's default preset on 4 CPU ranks keeps its
    MoE, FP8, layout and save path under `--train-iters 200`; `--preset none` is megatron's defaults; a preset's
    sequence parallel goes with the TP it needed; boolean and FP8 settings of a preset can be turned off; an
    unknown preset is named with the closest one."""
    from launch.train.arguments import ArgumentError, describe, embedded_default_argv, parse_args

    base = parse_args([], world_size=4, preset="default")
    longer = parse_args(["--train-iters", "200"], world_size=4, preset="default")
    assert longer.as_dict() == {**base.as_dict(), "train_iters": 200}
    assert base.as_dict() == parse_args(["--preset", "none", *embedded_default_argv(4, gpu=False)],
                                        world_size=4).as_dict() | {"preset": "default"}
    assert (base.num_experts, base.fp8, base.tensor_model_parallel_size, base.sequence_parallel, base.save) == \
        (4, "hybrid", 2, True, "checkpoints/gpt_default")
    plain = parse_args(["--num-layers", "2"], world_size=1)  # parse_args alone: megatron's defaults
    assert (plain.fp8, plain.num_experts, plain.save, plain.preset) == (None, None, None, "none")
    tp1 = parse_args(["--tensor-model-parallel-size", "1"], world_size=4, preset="default")
    assert (tp1.tensor_model_parallel_size, tp1.sequence_parallel, tp1.data_parallel_size) == (1, False, 2)
    with pytest.raises(ArgumentError, match="--sequence-parallel needs"):  # asked for: not dropped
        parse_args(["--tensor-model-parallel-size", "1", "--sequence-parallel"], world_size=4, preset="default")
    gpu = parse_args([], world_size=1, gpu=True, preset="default")
    assert gpu.bf16 and gpu.cuda_graph and gpu.num_experts is None
    off = parse_args(["--no-bf16", "--no-cuda-graph", "--fp8-format", "none"], world_size=1, gpu=True,
                     preset="default")
    assert (off.bf16, off.cuda_graph, off.fp8) == (False, False, None)
    dense = parse_args(["--num-experts", "0"], world_size=4, preset="default")
    assert dense.num_experts is None and "MoE" not in describe(dense)
    gpu1 = parse_args(["--preset=gpu1", "--train-iters", "7"], world_size=2, preset="default")
    assert (gpu1.hidden_size, gpu1.data_parallel_size, gpu1.global_batch_size, gpu1.train_iters, gpu1.preset) == \
        (768, 2, 16, 7, "gpu1")
    line = describe(base)
    for part in ("preset default", "TP2 x PP2", "MoE 4 experts top-2 (EP2 ETP1)", "FP8 hybrid delayed",
                 "40 iterations", "saves to checkpoints/gpt_default"):
        assert part in line, (part, line)
    with pytest.raises(ArgumentError, match="--preset=gpu: unknown preset.*did you mean 'gpu1'"):
        parse_args(["--preset", "gpu"], world_size=1)


def test_fused_torch_adam_switch_matches_foreach_and_resets():
    """The job's switch of megatron's torch-Adam fallback to fused kernels: the groups of every inner
    optimizer of a chained one are switched, steps continue from the state foreach kernels left (step counts
    moved to the parameter's device), the updates match the foreach twin's, and `fused=False` puts torch's
    own choice back. (On the CPU: torch has fused CPU kernels; the GPU case runs in the GPU job tests.)"""
    import types

    import torch

    sys.path.insert(0, str(REPO))
    from launch.train.model import use_fused_torch_adam

    seed = 7
    print(f"seed {seed}")
    torch.manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(4))]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = torch.optim.AdamW([{"params": params[:1]}, {"params": params[1:], "weight_decay": 0.0}], lr=1e-2)
    ref = torch.optim.AdamW([{"params": twins[:1]}, {"params": twins[1:], "weight_decay": 0.0}], lr=1e-2)
    chained = types.SimpleNamespace(chained_optimizers=[types.SimpleNamespace(optimizer=opt),
                                                        types.SimpleNamespace(optimizer=None)])
    for step in range(4):
        if step == 2:  # after two foreach steps, as after loading a checkpoint saved without the switch
            assert use_fused_torch_adam(chained) == 2
            assert all(g["fused"] is True and g["foreach"] is False for g in opt.param_groups)
        grads = [torch.randn_like(p) for p in params]
        for o, ps in ((opt, params), (ref, twins)):
            for p, g in zip(ps, grads):
                p.grad = g.clone()
            o.step()
    for p, q in zip(params, twins):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    assert use_fused_torch_adam(chained, fused=False) == 0
    assert all(g["fused"] is None and g["foreach"] is None for g in opt.param_groups)


def test_foreach_multi_tensor_ops_match_megatrons_fallbacks(monkeypatch):
    """The foreach versions of megatron's multi-tensor fallbacks: the L2 norm of mixed-dtype tensors equals the
    norm of their norms (float32 rounding), with per-tensor norms on request and on the tensors' device; scale and
    copy equal megatron's `dst.copy_(src * scale)` bit for bit (in place too, and with scale 1); megatron's own
    gradient clipping with them bound gives the float64 norm and clips as without them. Binding is idempotent."""
    import torch
    from megatron.core import utils as mutils
    from megatron.core.optimizer import clip_grads, optimizer

    sys.path.insert(0, str(REPO))
    from launch.train.multi_tensor import foreach_l2_norm, foreach_scale, use_foreach_multi_tensor_ops

    seed = 23
    print(f"seed {seed}")
    torch.manual_seed(seed)
    flag = torch.zeros(1, dtype=torch.int)
    tensors = [torch.randn(17, 5), torch.randn(33).to(torch.bfloat16), torch.randn(4, 3, 9), torch.randn(1)]
    total, per = foreach_l2_norm(0, flag, [tensors], True)
    expect = torch.tensor([t.double().norm() for t in tensors])
    assert total.shape == (1,) and total.dtype == torch.float32 and per.shape == (4,)
    torch.testing.assert_close(per.double(), expect, rtol=1e-2, atol=0)  # the bfloat16 tensor's norm in bfloat16
    torch.testing.assert_close(total.double(), per.double().norm().reshape(1), rtol=1e-6, atol=0)
    assert foreach_l2_norm(0, flag, [tensors], False)[1] is None
    assert torch.equal(foreach_l2_norm(0, flag, [[]], False)[0], torch.zeros(1))
    fp32 = [t for t in tensors if t.dtype == torch.float32]
    torch.testing.assert_close(foreach_l2_norm(0, flag, [fp32], False)[0].double(),
                               torch.cat([t.double().flatten() for t in fp32]).norm().reshape(1), rtol=1e-6, atol=0)
    for scale in (0.37, 1.0):
        dsts = [torch.empty_like(t, dtype=torch.bfloat16) for t in fp32]
        refs = [d.clone() for d in dsts]
        foreach_scale(0, flag, [fp32, dsts], scale)
        mutils.local_multi_tensor_scale(0, flag, [fp32, refs], scale)
        assert all(torch.equal(d, r) for d, r in zip(dsts, refs)), scale
        same, twins = [t.clone() for t in fp32], [t.clone() for t in fp32]
        foreach_scale(0, flag, [same, same], scale)
        mutils.local_multi_tensor_scale(0, flag, [twins, twins], scale)
        assert all(torch.equal(a, b) for a, b in zip(same, twins)), scale
    for module, name in ((optimizer, "multi_tensor_scale_impl"), (clip_grads, "multi_tensor_scale_impl"),
                         (clip_grads, "l2_norm_impl")):
        monkeypatch.setattr(module, name, getattr(module, name))  # restored after the test
    local = clip_grads.l2_norm_impl is mutils.local_multi_tensor_l2_norm
    replaced = use_foreach_multi_tensor_ops()
    assert use_foreach_multi_tensor_ops() == []
    if not local:  # TransformerEngine or apex serve megatron here: nothing to replace
        assert replaced == []
        return
    assert sorted(replaced) == sorted(["megatron.core.optimizer.optimizer.multi_tensor_scale_impl",
                                       "megatron.core.optimizer.clip_grads.multi_tensor_scale_impl",
                                       "megatron.core.optimizer.clip_grads.l2_norm_impl"])
    import parallel_state as ps

    params = [torch.nn.Parameter(torch.randn(9, 4)), torch.nn.Parameter(torch.randn(6))]
    grads = [torch.randn_like(p) * 3 for p in params]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    norm64 = torch.cat([g.double().flatten() for g in grads]).norm().item()
    import torch.distributed as dist

    own = not dist.is_initialized()  # megatron's norm all-reduces over the default group
    if own:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with ps.cpu_compat():
            norm = clip_grads.get_grad_norm_fp32([p.grad for p in params])
            clip_grads.clip_grad_by_total_norm_fp32(params, max_norm=1.0, total_norm=norm)
    finally:
        if own:
            dist.destroy_process_group()
    assert abs(norm - norm64) <= 1e-6 * norm64, (norm, norm64)
    for p, g in zip(params, grads):
        torch.testing.assert_close(p.grad, g * (1.0 / (norm + 1e-6)), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("argv, world, needle", [
    (["--tensor-model-parallel-size", "3"], 4, "tensor x pipeline x context parallel = 3 x 1 x 1"),
    (["--pipeline-model-parallel-size", "2", "--num-layers", "3"], 2, "--num-layers=3"),
    (["--expert-model-parallel-size", "3", "--num-experts", "6"], 4, "--expert-model-parallel-size=3"),
    (["--global-batch-size", "6", "--micro-batch-size", "4"], 1, "--global-batch-size=6"),
    (["--tensor-model-parallel-size", "0"], 1, "--tensor-model-parallel-size=0"),
    (["--num-experts", "4", "--tensor-model-parallel-size", "2"], 2, "--sequence-parallel"),
    (["--num-experts", "4", "--moe-expert-capacity-factor", "0"], 1, "--moe-expert-capacity-factor=0.0"),
    (["--num-experts", "0", "--moe-expert-capacity-factor", "1"], 1, "without --num-experts"),
    (["--num-experts", "4", "--moe-pad-expert-input-to-capacity"], 1, "needs --moe-expert-capacity-factor"),
    (["--num-experts", "4", "--moe-expert-capacity-factor", "1", "--cuda-graph"], 1,
     "add --moe-expert-capacity-factor F --moe-pad-expert-input-to-capacity"),
])
def test_invalid_sizes_are_named(argv, world, needle):
    from launch.train.arguments import ArgumentError, parse_args

    with pytest.raises(ArgumentError) as err:
        parse_args(argv, world_size=world)
    assert needle in str(err.value), err.value


@HEAVY
@pytest.mark.parametrize("argv, needle", [
    (["--tensor-model-parallel-size", "3"], "world size 4 is not divisible"),
    (["--data-path", "/nonexistent/corpus_text_document"], "no megatron indexed dataset at /nonexistent/corpus"),
])
def test_bad_input_exits_nonzero_fast_on_every_rank(tmp_path, argv, needle):
    """Checked before any collective: rank 0 says why, once, and exits 2; no hang. The other ranks stay silent
    (polling every 10 s shows they do not print while torchrun has not stopped them)."""
    out = _torchrun(tmp_path, 4, argv, timeout=300, expect_ok=False, launcher=["--monitor-interval", "10"],
                    forked=False)  # torchrun's summary, as a user sees it
    printed = [line for line in out.splitlines() if line.startswith("pretrain_gpt.py: error:")]
    summary = [line for line in out.splitlines() if "traceback : pretrain_gpt.py: error:" in line]
    assert len(printed) == 1 and needle in printed[0], out[-5000:]
    # torchrun's failure summary names the same error, from rank 0's error file only
    assert len(summary) == 1 and needle in summary[0], out[-5000:]
    assert out.count(needle) == 2, out[-5000:]
    assert "exitcode  : 2" in out, out[-5000:]


# -- data ----------------------------------------------------------------------------------------------------

def test_preprocess_text_and_jsonl(tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    text = tmp_path / "in.txt"
    text.write_text("first doc line one\nline two\n\nsecond doc \u00e9\n\n\n")
    jsonl = tmp_path / "in.jsonl"
    jsonl.write_text(json.dumps({"text": "alpha"}) + "\n" + json.dumps({"text": "beta gamma"}) + "\n")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"body": "no text key"}\n')

    def start(src: Path, prefix: Path) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, str(REPO / "launch" / "preprocess_data.py"), "--input", str(src),
                                 "--output-prefix", str(prefix)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=_env(tmp_path))

    # the three conversions at once (each is mostly the interpreter's start-up)
    cases = [(text, ["first doc line one\nline two", "second doc \u00e9"]), (jsonl, ["alpha", "beta gamma"])]
    procs = [start(src, tmp_path / f"out_{src.suffix[1:]}") for src, _ in cases] + [start(bad, tmp_path / "bad")]
    results = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        results.append((proc.returncode, out, err))
    for (src, docs), (rc, out, err) in zip(cases, results):
        assert rc == 0, out + err
        ds = IndexedDataset(str(tmp_path / f"out_{src.suffix[1:]}"))
        assert len(ds) == len(docs)
        for i, doc in enumerate(docs):
            assert ds[i].tolist() == list(doc.encode("utf-8")) + [256], (i, ds[i])
    rc, _, err = results[2]
    assert rc == 2 and "bad.jsonl:2" in err, err
    assert not (tmp_path / "bad.idx").exists()


def test_data_resumes_at_consumed_samples():
    """Step batches depend only on the sample position: the step at sample k equals itself from any start."""
    import torch

    from launch.train.data import StepBatches

    data = [{"tokens": torch.tensor([i]), "labels": torch.tensor([i]), "loss_mask": torch.ones(1),
             "position_ids": torch.zeros(1)} for i in range(64)]
    ranks = [StepBatches(data, micro_batch_size=2, global_batch_size=8, dp_rank=r, dp_size=2) for r in range(2)]
    seen = sorted(int(t) for b in ranks for mb in b.step(8) for t in mb["tokens"].flatten())
    assert seen == list(range(8, 16))
    assert [mb["tokens"].flatten().tolist() for mb in ranks[1].step(8)] == [[10, 11], [14, 15]]
    with pytest.raises(IndexError, match="sample 60"):
        ranks[0].step(60)


# -- short runs ---------------------------------------------------------------------------------------------

def test_tp2_run_json_log_and_plot(tmp_path):
    log = tmp_path / "run.jsonl"
    # most_recent and margin 1: each logged scale follows from the logged newest amax alone (checked below)
    out = _torchrun(tmp_path, 2, TINY + FP8 + ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                               "--recompute-granularity", "full", "--train-iters", "8",
                                               "--fp8-amax-compute-algo", "most_recent", "--fp8-margin", "1",
                                               "--log-json", str(log), "--tensorboard-dir", str(tmp_path / "tb")])
    rows = _rows(log)
    assert [r["iteration"] for r in rows] == list(range(1, 9)), out[-3000:]
    for r in rows:
        for key in ("loss", "lr", "grad_norm", "tokens_per_s", "tflops_per_s", "memory_peak_mib", "step_ms",
                    "fp8_nonfinite_amax", "fp8_scale_min", "fp8_scale_max", "fp8_scopes_opened", "fp8_scopes_reduced"):
            assert r[key] is not None, (key, r)
        assert r["fp8_nonfinite_amax"] == 0 and r["fp8_scopes_reduced"] == r["fp8_scopes_opened"] == 2 * 4, r
    assert rows[0]["lr"] == 0.0 and rows[1]["lr"] == 1e-2 and rows[-1]["lr"] < rows[1]["lr"], "warm-up, then decay"
    layers = rows[-1]["fp8_layers"]
    assert any(k.startswith("layer01/") for k in layers) and any(k.startswith("layer02/") for k in layers), layers
    # the recipe's rule on the recorded amaxes, exactly: scale = fp8_max / amax / 2**margin in float32 (hybrid:
    # E4M3's 448 forward, E5M2's 57344 backward); a tensor with amax 0 never ran and keeps its scale
    checked = 0
    for name, state in layers.items():
        assert name.endswith((".fwd", ".bwd")), name
        fp8_max = 448.0 if name.endswith(".fwd") else 57344.0
        for amax, scale in zip(state["amax"], state["scale"]):
            if amax > 0:
                want = (torch.tensor(fp8_max) / torch.tensor(amax, dtype=torch.float32) / 2.0).item()
                assert scale == want, (name, amax, scale, want)
                checked += 1
    assert checked >= 3 * len(layers) // 2, (checked, layers)  # forward input and weight, backward grad
    scales = [s for state in layers.values() for s in state["scale"]]
    assert rows[-1]["fp8_scale_min"] <= min(scales) and rows[-1]["fp8_scale_max"] >= max(scales), rows[-1]
    # the per-role ranges are those of the role's tensors in `fp8_layers` (amaxes: the tensors that ran)
    for role, (direction, index) in {"input": (".fwd", 0), "weight": (".fwd", 1), "grad": (".bwd", 0)}.items():
        of_role = [state for name, state in layers.items() if name.endswith(direction)]
        role_scales = [state["scale"][index] for state in of_role]
        role_amaxes = [state["amax"][index] for state in of_role if state["amax"][index] > 0]
        got = [rows[-1][f"fp8_{role}_{k}"] for k in ("scale_min", "scale_max", "amax_min", "amax_max")]
        assert got == [min(role_scales), max(role_scales), min(role_amaxes), max(role_amaxes)], (role, got)
    _assert_falls(rows, 0.8)
    assert "iteration      2 | loss" in out and "scopes reduced" in out
    assert list((tmp_path / "tb").glob("events.out.tfevents.*")), "no TensorBoard event file"
    png = tmp_path / "run.png"
    proc = subprocess.run([sys.executable, str(REPO / "launch" / "plot_run.py"), str(log), str(png)],
                          capture_output=True, text=True, timeout=300, env=_env(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"loss and {3 * len(layers) // 2} FP8 tensors by role" in proc.stdout, proc.stdout
    assert png.stat().st_size > 10000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_training_flops_estimate_counts_the_gemms():
    """The model-FLOPs estimate is 3 x (forward GEMMs) per token: QKV, output projection, attention scores and
    values, the MLP's two GEMMs (per routed expert), the router, and the output layer."""
    from launch.train.metrics import training_flops_per_iteration

    L, h, f, s, V, B, E, k = 2, 8, 16, 4, 32, 3, 4, 2
    dense_layer = 2 * h * 3 * h + 2 * h * h + 2 * s * h + 2 * s * h + 2 * h * f + 2 * f * h
    want = 3 * B * s * (L * dense_layer + 2 * h * V)
    assert training_flops_per_iteration(L, h, f, s, V, B) == want
    moe_layer = dense_layer + k * (2 * h * f + 2 * f * h) - (2 * h * f + 2 * f * h) + 2 * h * E
    want = 3 * B * s * (L * moe_layer + 2 * h * V)
    assert training_flops_per_iteration(L, h, f, s, V, B, experts=E, topk=k) == want


def test_missing_tensorboard_is_one_note(monkeypatch, tmp_path, capsys):
    """Without tensorboard installed, the run log says so once and goes on without events."""
    from launch.train.metrics import RunLog

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # `import` raises ImportError
    log = RunLog(True, 2, 0, 1, str(tmp_path / "tb"), None, progress_bar=False)
    log.record({"iteration": 1, "loss": 1.0, "lr": 0.1, "grad_norm": 1.0, "tokens_per_s": 1.0,
                "tflops_per_s": 1.0, "step_ms": 1.0, "memory_peak_mib": 1.0})
    log.close()
    out = capsys.readouterr().out
    assert out.count("note: tensorboard is not installed") == 1 and "iteration      1 | loss" in out, out
    assert not (tmp_path / "tb").exists()


def test_plot_of_an_older_fp8_off_log_has_no_fp8_panels(tmp_path):
    """A log that recorded FP8 state without FP8 (every amax 0, every scale 1, as the job's logs did before
    FP8-off runs left it out) is plotted as an FP8-off run: the loss panel alone."""
    from launch.plot_run import figure, plot

    log = tmp_path / "old.jsonl"
    state = {"amax": [0.0, 0.0], "scale": [1.0, 1.0]}
    rows = [{"iteration": i, "loss": 5.0 - i, "fp8_scopes_opened": 0,
             "fp8_layers": {f"layer0{n}/mlp.linear_fc1.fp8.fwd": state for n in (1, 2)}} for i in (1, 2, 3)]
    log.write_text("".join(json.dumps(r) + "\n" for r in rows))
    fig = figure(str(log))
    assert [ax.get_title() for ax in fig.axes] == ["loss (FP8 off: no FP8 panels)"]
    assert plot(str(log), str(tmp_path / "old.png")) == 0


def test_pp2_interleaved_run_with_graphed_layers(tmp_path):
    """PP2 with 2 virtual stages; --cuda-graph takes graph_megatron_layers' eager path on CPU (one warning)."""
    log = tmp_path / "run.jsonl"
    out = _torchrun(tmp_path, 2, TINY + FP8 + ["--pipeline-model-parallel-size", "2",
                                               "--virtual-pipeline-model-parallel-size", "2", "--num-layers", "4",
                                               "--cuda-graph", "--train-iters", "8", "--log-json", str(log)])
    assert out.count("CUDA is not available; the callables run eagerly") == 1, out[-5000:]
    rows = _rows(log)
    assert len(rows) == 8
    # 8 iterations of a 4-layer model over the byte vocabulary padded to 512 (255 unused classes to push down):
    # measured 6.26 -> 5.06 (0.81)
    _assert_falls(rows, 0.85)
    # 4 micro batches x 2 virtual stages open one FP8 scope each on each of the 2 ranks
    assert all(r["fp8_scopes_reduced"] == r["fp8_scopes_opened"] == 16 for r in rows), rows[-1]


def test_moe_fp8_run_is_deterministic(tmp_path):
    """MoE (EP2) with FP8, megatron's TransformerConfig refuses fp8 + MoE without TransformerEngine; the job
    keeps FP8 out of the config and still runs the experts in FP8. Two runs give bitwise equal losses."""
    runs = []
    for name in ("a", "b"):
        log = tmp_path / f"{name}.jsonl"
        _torchrun(tmp_path, 2, TINY + FP8 + ["--num-experts", "4", "--moe-router-topk", "2",
                                             "--expert-model-parallel-size", "2", "--train-iters", "8",
                                             "--seed", "77", "--log-json", str(log)])
        runs.append(_rows(log))
    a, b = runs
    assert [r["loss"] for r in a] == [r["loss"] for r in b], ([r["loss"] for r in a], [r["loss"] for r in b])
    assert [r["grad_norm"] for r in a] == [r["grad_norm"] for r in b]
    _assert_falls(a, 0.85)
    experts = {k: v for k, v in a[-1]["fp8_layers"].items() if "/ep" in k}
    assert {k.split("/")[1] for k in experts} == {"ep0", "ep1"}, list(experts)
    assert any(s != 1.0 for v in experts.values() for s in v["scale"]), "expert FP8 scales never updated"
    assert all(r["fp8_nonfinite_amax"] == 0 for r in a)


def test_moe_drop_and_pad_run_with_graphed_layers(tmp_path):
    """MoE (EP2) with megatron's drop-and-pad (capacity 1, padded): --cuda-graph is accepted (the same shapes
    every step) and takes graph_megatron_layers' eager path on CPU; FP8 experts train and their scales move."""
    log = tmp_path / "run.jsonl"
    out = _torchrun(tmp_path, 2, TINY + FP8 + ["--num-experts", "4", "--moe-router-topk", "2",
                                               "--expert-model-parallel-size", "2", "--moe-expert-capacity-factor",
                                               "1", "--moe-pad-expert-input-to-capacity", "--cuda-graph",
                                               "--train-iters", "8", "--log-json", str(log)])
    assert "MoE 4 experts top-2 (EP2 ETP1, capacity 1 padded)" in out, out[-5000:]
    assert out.count("CUDA is not available; the callables run eagerly") == 1, out[-5000:]
    rows = _rows(log)
    assert len(rows) == 8
    _assert_falls(rows, 0.85)
    experts = {k: v for k, v in rows[-1]["fp8_layers"].items() if "/ep" in k}
    assert experts and any(s != 1.0 for v in experts.values() for s in v["scale"]), list(experts)


@HEAVY
def test_two_agents_join_through_c10d_rendezvous(tmp_path):
    """Two torchrun agents (2 ranks each) on 127.0.0.1 form one 4-rank job (TP2 x PP2)."""
    port = _free_port()
    log = tmp_path / "run.jsonl"
    args = TINY + ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                   "--train-iters", "3", "--log-json", str(log)]
    procs = []
    for node in range(2):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--nnodes=2",
               f"--node-rank={node}", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
               "--rdzv-id=fp8p-test", str(ENTRY), *job_argv(args)]
        procs.append(subprocess.Popen(cmd, cwd=tmp_path, env=_env(tmp_path), stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=900)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-10000:]
    text = "".join(outs)
    assert "job: 4 ranks, tp 2 pp 2" in text, text[-5000:]
    assert [r["iteration"] for r in _rows(log)] == [1, 2, 3]


@HEAVY
@pytest.mark.slow
def test_default_job_end_to_end(tmp_path):
    """The README's first command: no flags, 4 ranks, MoE GPT on TP2 x PP2 x EP2 with FP8; loss falls and a
    checkpoint is written. Slow (40 iterations, over a minute on 2 cores): run with `-m slow` (nightly)."""
    out = _torchrun(tmp_path, 4, [], timeout=1500, forked=False)  # as the README runs it
    assert "run (preset default): 4 ranks = TP2 x PP2" in out, out[-5000:]
    assert "tp 2 pp 2 vpp None cp 1 dp 1 ep 2 etp 1" in out and "experts 4; fp8 hybrid" in out, out[-5000:]
    losses = [float(line.split("| loss ")[1].split()[0]) for line in out.splitlines() if "| loss " in line]
    assert len(losses) == 8 and losses[-1] < 0.6 * losses[0], losses
    assert "saved checkpoint at iteration 40" in out, out[-5000:]
    assert any((tmp_path / "checkpoints" / "gpt_default").iterdir())
    assert out.count("TransformerEngine and Apex missing: megatron-core") == 1  # the message, said once
    assert not [line for line in out.splitlines() if "Warning: " in line], out[-5000:]  # MoE at ETP 1 included
    assert "are not installed" not in out and "is not installed" not in out


# -- GPUs (skipped without CUDA) ------------------------------------------------------------------------------

def _gpu_torchrun(tmp_path: Path, nproc: int, args: List[str], timeout: float = 900) -> str:
    env = child_env(gpus=True, FP8P_DATA_CACHE=str(tmp_path.parent / "fp8p-data-cache"))
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--nnodes=1",
           f"--master_port={_free_port()}", str(ENTRY), *job_argv(args)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{out[-15000:]}"
    return out


@pytest.mark.gpu
def test_gpu_default_job_one_gpu(tmp_path):
    """The no-flag run on one GPU: NCCL, bf16 with fp32 master weights, FP8, graphed layers; loss falls."""
    import torch

    if torch.cuda.device_count() < 1:
        pytest.skip("needs a GPU")
    out = _gpu_torchrun(tmp_path, 1, [])
    (run,) = [line for line in out.splitlines() if line.startswith("run (preset default): 1 ranks")]
    assert "bf16, FP8 hybrid delayed (amax history 16), CUDA graphs" in run, run
    assert "fp8 hybrid (delayed)" in out, out[-5000:]
    losses = [float(line.split("| loss ")[1].split()[0]) for line in out.splitlines() if "| loss " in line]
    assert len(losses) == 8 and losses[-1] < 0.6 * losses[0], losses
    assert "runs eagerly" not in out, out[-5000:]


@pytest.mark.gpu
@pytest.mark.parametrize("layout", [["--tensor-model-parallel-size", "2", "--sequence-parallel"],
                                    ["--pipeline-model-parallel-size", "2", "--virtual-pipeline-model-parallel-size",
                                     "2", "--num-layers", "4"]])
def test_gpu_two_gpus_fp8_graphed(tmp_path, layout):
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    log = tmp_path / "run.jsonl"
    _gpu_torchrun(tmp_path, 2, TINY + FP8 + layout + ["--bf16", "--cuda-graph", "--train-iters", "8",
                                                      "--log-json", str(log)])
    rows = _rows(log)
    assert len(rows) == 8 and all(r["fp8_nonfinite_amax"] == 0 for r in rows), rows[-1]
    _assert_falls(rows, 0.85)
