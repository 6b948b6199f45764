"""Checkpoint checks on megatron-core's training stack (see checkpoint_harness.py), 4 ranks.

Usage (under torchrun): checkpoint_checks.py SUITE DIR
  dense   TP2 x PP2, FP8: exact resume; reshard to TP1 x PP2 and TP2 x PP1; FP8 <-> no-FP8 / local spec
          interchange; bad checkpoints (corrupt, truncated, unsafe pickle, another model shape)
  moe     TP2 x PP2 x EP2 MoE (sequence parallel), FP8: exact resume; reshard EP2 -> EP1 and EP1 -> EP2
  save    (kill test, first launch; 2 ranks, TP2) save iteration 1, then start saving iteration 2 (the test kills it)
  verify  (kill test, second launch; 2 ranks, TP2) the kill left iteration 1 loadable; a new save of 2 completes
"""
from __future__ import annotations

import hashlib
import functools
import os
import pickle
import shutil
import sys
from pathlib import Path
from typing import Dict, List

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

N, K = 4, 2  # uninterrupted iterations; the save point of the interrupted run
KILL_TP = 2  # the kill test's layout (TP2 on 2 ranks: every rank writes shards of its own)
# FP8 tolerances for losses after a layout change: the first resumed forward runs the loaded weights (only
# reduction orders differ); later ones follow an Adam step on FP8 gradients summed in another order
FIRST_RTOL, LATER_RTOL = 2e-3, 2e-2


def _rank0() -> bool:
    return dist.get_rank() == 0


def _barrier_dir(path: Path) -> Path:
    dist.barrier()
    return path


def _equal_snapshots(ref: Dict[str, torch.Tensor], got: Dict[str, torch.Tensor], what: str) -> None:
    assert ref.keys() == got.keys(), f"{what}: keys differ: {sorted(ref.keys() ^ got.keys())[:5]}"
    bad = [k for k in ref if ref[k].dtype != got[k].dtype or not torch.equal(ref[k], got[k])]
    assert not bad, f"{what}: {len(bad)} of {len(ref)} tensors differ on rank {dist.get_rank()}, e.g. {bad[:5]}"


def _fp8_trained(snap: Dict[str, torch.Tensor]) -> None:
    hist = [v for k, v in snap.items() if k.endswith("fp8.fwd.amax_history")]
    assert hist and all(h.abs().sum() > 0 for h in hist), "FP8 histories missing or empty: the test proves nothing"


def _finite(losses: List[float]) -> None:
    from megatron.core import parallel_state as mpu

    if mpu.is_pipeline_last_stage():
        assert losses and all(torch.isfinite(torch.tensor(losses))), losses


def _layout(tp: int, pp: int, ep: int = 1, etp=None) -> None:
    import parallel_state as ps

    if ps.is_initialized():
        ps.destroy(destroy_process_group=False)
    ps.initialize(tp=tp, pp=pp, ep=ep, etp=etp)


def _hashes(root: Path) -> Dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _exact_resume(opts, root: Path, name: str) -> None:
    """Train N; separately train K, save, rebuild everything, load, train to N: bitwise equal."""
    from checkpoint_harness import Run
    from launch.checkpointing import TrainState, load_checkpoint, save_checkpoint

    ref = Run(opts)
    ref_losses = ref.train(0, N)
    ref_snap = ref.snapshot()
    _fp8_trained(ref_snap)
    del ref
    first = Run(opts)
    before = first.train(0, K)
    save_checkpoint(str(root / name), TrainState(K, K * opts.gbs, {"note": name}), first.model,
                    first.optimizer, first.scheduler, opts.run_args())
    del first
    resumed = Run(opts)
    state = load_checkpoint(str(root / name), resumed.model, resumed.optimizer, resumed.scheduler, opts.run_args())
    assert state is not None, "no checkpoint found"
    assert (state.iteration, state.consumed_samples, state.extra) == (K, K * opts.gbs, {"note": name}), state
    after = resumed.train(K, N)
    print(f"rank {dist.get_rank()} {name}: uninterrupted {ref_losses}, resumed {before} + {after}", flush=True)
    assert before + after == ref_losses, f"losses differ: {ref_losses} vs {before + after}"
    _equal_snapshots(ref_snap, resumed.snapshot(), name)


def _save_along(opts, root: Path, name: str) -> List[float]:
    """Train N, saving after K; returns the losses (reference for loads in other layouts)."""
    from checkpoint_harness import Run
    from launch.checkpointing import TrainState, save_checkpoint

    run = Run(opts)
    losses = run.train(0, K)
    save_checkpoint(str(root / name), TrainState(K, K * opts.gbs), run.model, run.optimizer, run.scheduler,
                    opts.run_args())
    losses += run.train(K, N)
    return _share(losses, N)


def _share(losses: List[float], n: int) -> List[float]:
    """The last stage's `n` losses on every rank (other stages hold none), so every rank can assert."""
    t = torch.full((n,), float("-inf"), dtype=torch.float64)
    if losses:
        t[:] = torch.tensor(losses, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _resume_close(opts, root: Path, name: str, ref: List[float]) -> None:
    """Load `name` into `opts`' layout and continue: losses within FP8 tolerance of the reference."""
    from checkpoint_harness import Run
    from launch.checkpointing import load_checkpoint

    run = Run(opts)
    fresh = run.snapshot()
    state = load_checkpoint(str(root / name), run.model, run.optimizer, run.scheduler, opts.run_args())
    assert state is not None and state.iteration == K, state
    loaded = run.snapshot()
    weights = [k for k in fresh if k.startswith("model") and k.endswith(".weight")]
    _together(bool(weights) and all(not torch.equal(fresh[k], loaded[k]) for k in weights), "weights did not load")
    _together(all(v.abs().sum() > 0 for k, v in loaded.items() if k.endswith("fp8.fwd.amax_history")),
              "FP8 state did not load")
    losses = _share(run.train(K, N), N - K)
    if dist.get_rank() == dist.get_world_size() - 1:
        print(f"rank {dist.get_rank()} resharded to tp={opts.tp} pp={opts.pp} ep={opts.ep}: {losses} vs {ref[K:]}",
              flush=True)
    for i, (got, want) in enumerate(zip(losses, ref[K:])):
        rtol = FIRST_RTOL if i == 0 else LATER_RTOL
        assert abs(got - want) <= rtol * abs(want), f"loss {got} vs {want} at iteration {K + i + 1} after reshard"


def _together(ok: bool, message: str) -> None:
    """Assert on every rank at once (a rank failing alone would leave the others in a collective)."""
    flag = torch.tensor([0 if ok else 1])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    assert not flag.item(), message if not ok else f"{message} (on another rank)"


def _expect_error(fn, *needles: str) -> str:
    from launch.checkpointing import CheckpointError

    try:
        fn()
    except CheckpointError as e:
        text = str(e)
        for needle in needles:
            assert needle in text, f"error does not name {needle!r}: {text}"
        return text
    raise AssertionError(f"no CheckpointError (expected one naming {needles})")


def _run_selected(checks) -> None:
    """All checks, or those named in argv[3] (comma-separated; for re-running one while debugging)."""
    from rank_checks import run_checks

    wanted = sys.argv[3].split(",") if len(sys.argv) > 3 else None
    run_checks([c for c in checks if wanted is None or c[0] in wanted])


def dense(root: Path) -> None:
    import dataclasses

    from checkpoint_harness import Opts, Run
    from launch.checkpointing import TrainState, load_checkpoint, save_checkpoint
    from rank_checks import test_seed

    seed = test_seed() % 100_000
    print(f"checkpoint dense suite seed {seed}", flush=True)
    base = Opts(tp=2, pp=2, seed=seed, train_iters=N)
    calm = dataclasses.replace(base, dropout=0.0)
    refs: Dict[str, List[float]] = {}

    def exact():
        _exact_resume(base, root, "exact_dense")

    def reshard():
        refs["calm"] = _save_along(calm, root, "calm")  # every rank: the losses live on the last stage
        try:
            _layout(1, 2)
            _resume_close(dataclasses.replace(calm, tp=1), root, "calm", refs["calm"])
            _layout(2, 1)
            _resume_close(dataclasses.replace(calm, pp=1), root, "calm", refs["calm"])
        finally:
            _layout(2, 2)

    def interchange():
        # saved without FP8 -> FP8 run: weights load, FP8 state starts fresh
        plain = dataclasses.replace(calm, fp8=None, seed=seed + 1)
        src = Run(plain)
        save_checkpoint(str(root / "plain"), TrainState(0, 0), src.model, src.optimizer, src.scheduler,
                        plain.run_args())
        dst = Run(calm)
        load_checkpoint(str(root / "plain"), dst.model, dst.optimizer, dst.scheduler, calm.run_args())
        a, b = src.snapshot(), dst.snapshot()
        weights = [k for k in a if k.startswith("model") and ".fp8." not in k and not k.endswith("_extra_state")]
        assert weights and all(torch.equal(a[k], b[k]) for k in weights), "weights of a no-FP8 checkpoint did not load"
        assert all(float(v.abs().sum()) == 0 for k, v in b.items() if k.endswith("amax_history")), "FP8 state not fresh"
        _finite(dst.train(0, 1))
        # FP8 checkpoint -> run without FP8: loads, FP8 keys ignored
        bf = dataclasses.replace(calm, fp8=None)
        run = Run(bf)
        state = load_checkpoint(str(root / "calm"), run.model, run.optimizer, run.scheduler, bf.run_args())
        assert state.iteration == K
        _finite(run.train(K, K + 1))
        # megatron's local spec (no FP8 modules) -> FP8 run
        local = dataclasses.replace(calm, fp8=None, local_spec=True)
        src = Run(local)
        save_checkpoint(str(root / "local"), TrainState(0, 0), src.model, src.optimizer, src.scheduler,
                        local.run_args())
        dst = Run(calm)
        load_checkpoint(str(root / "local"), dst.model, dst.optimizer, dst.scheduler, calm.run_args())
        got = dict(dst.model[0].module.named_parameters())
        want = dict(src.model[0].module.named_parameters())
        for k in ("embedding.word_embeddings.weight", "decoder.layers.0.self_attention.linear_qkv.weight"):
            if k in want:
                assert torch.equal(got[k], want[k]), f"{k} did not load from the local-spec checkpoint"
        _finite(dst.train(0, 1))

    def bad_inputs():
        good = root / "calm" / "iter_0000002"
        before = _hashes(root / "calm")
        run = Run(calm)
        def load(d: Path) -> None:
            load_checkpoint(str(d), run.model, run.optimizer, run.scheduler, calm.run_args())

        # another model shape
        wide = dataclasses.replace(calm, hidden=64)
        wide_run = Run(wide)
        _expect_error(lambda: load_checkpoint(str(root / "calm"), wide_run.model, wide_run.optimizer,
                                              wide_run.scheduler, wide.run_args()), "hidden_size", "32", "64")
        # hidden_size unknown to the run arguments: the tensor check still names the tensor and both shapes
        _expect_error(lambda: load_checkpoint(str(root / "calm"), wide_run.model, None, None, {}), "shape")
        assert _hashes(root / "calm") == before, "a failed load changed the checkpoint"

        def damaged(name: str, damage) -> Path:
            d = root / name
            if _rank0():
                shutil.copytree(root / "calm", d)
                damage(d / "iter_0000002")
            return _barrier_dir(d)

        def flip(ck: Path):
            f = sorted(ck.glob("*.distcp"))[0]
            data = bytearray(f.read_bytes())
            data[len(data) // 2] ^= 0xFF
            f.write_bytes(bytes(data))

        def truncate(ck: Path):
            f = sorted(ck.glob("*.distcp"))[-1]
            f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])

        def unsafe(ck: Path):
            from launch.checkpoint_files import write_manifest

            class Evil:
                def __reduce__(self):
                    return (os.system, ("echo this should never run",))

            (ck / ".metadata").write_bytes(pickle.dumps(Evil()))
            write_manifest(ck)  # even a consistent manifest must not make it loadable

        _expect_error(lambda: load(damaged("flipped", flip)), "corrupt", ".distcp")
        _expect_error(lambda: load(damaged("truncated", truncate)), "truncated", ".distcp")
        _expect_error(lambda: load(damaged("unsafe", unsafe)), "refusing", "system")
        assert good.is_dir() and _hashes(root / "calm") == before

    _run_selected([
        ("ckpt_exact_resume_tp2_pp2_fp8", exact),
        ("ckpt_reshard_tp2pp2_to_tp1pp2_and_tp2pp1", reshard),
        ("ckpt_interchange_fp8_nofp8_localspec", interchange),
        ("ckpt_bad_inputs_named", bad_inputs),
    ])


def moe(root: Path) -> None:
    import dataclasses

    from checkpoint_harness import Opts
    from rank_checks import test_seed

    seed = test_seed() % 100_000
    print(f"checkpoint moe suite seed {seed}", flush=True)
    base = Opts(tp=2, pp=2, ep=2, etp=1, experts=4, seed=seed, train_iters=N)

    def exact():
        _exact_resume(base, root, "exact_moe")

    calm = dataclasses.replace(base, dropout=0.0)
    refs: Dict[str, List[float]] = {}

    def reshard_ep():
        # EP1 and EP2 runs both keep experts in megatron's separate expert optimizer (the job marks them so)
        refs["ep2"] = _save_along(calm, root, "moe_calm")
        try:
            _layout(2, 2, ep=1, etp=1)
            ep1 = dataclasses.replace(calm, ep=1)
            _resume_close(ep1, root, "moe_calm", refs["ep2"])
            ref_ep1 = _save_along(ep1, root, "moe_calm_ep1")
        finally:
            _layout(2, 2, ep=2, etp=1)
        _resume_close(calm, root, "moe_calm_ep1", ref_ep1)

    def into_one_optimizer():
        """EP2's chained dense + expert optimizers into one optimizer (EP1 with experts marked as megatron
        marks them: dense): param groups matched by identity, moments and step loaded."""
        from checkpoint_harness import Run
        from launch.checkpointing import load_checkpoint

        try:
            _layout(2, 2, ep=1, etp=1)
            single = dataclasses.replace(calm, ep=1, megatron_expert_marking=True)
            run = Run(single)
            opts = getattr(run.optimizer, "chained_optimizers", [run.optimizer])
            assert len(opts) == 1, f"expected one optimizer with megatron's EP1 marking, got {len(opts)}"
            state = load_checkpoint(str(root / "moe_calm"), run.model, run.optimizer, run.scheduler,
                                    single.run_args())
            assert state is not None and state.iteration == K, state
            inner = opts[0].optimizer
            steps = {float(s["step"]) for s in inner.state.values()}
            assert steps == {float(K)}, f"optimizer steps after load: {steps}"
            moments = [s["exp_avg"] for s in inner.state.values()]
            assert moments and all(bool(m.abs().sum() > 0) for m in moments), "Adam moments did not load"
            first = _share(run.train(K, K + 1), 1)[0]
        finally:
            _layout(2, 2, ep=2, etp=1)
        want = refs["ep2"][K]
        assert abs(first - want) <= FIRST_RTOL * abs(want), f"loss {first} vs {want} after loading into one optimizer"

    _run_selected([("ckpt_exact_resume_moe_tp2_pp2_ep2", exact), ("ckpt_reshard_moe_ep2_to_ep1_and_back", reshard_ep),
                   ("ckpt_moe_chained_optimizers_into_one", into_one_optimizer)])


def save_then_hang(root: Path) -> None:
    """Save iteration 1 (complete); then save iteration 2 slowly (PAUSE env set by the test, which kills us)."""
    from checkpoint_harness import Opts, Run
    from launch.checkpointing import PAUSE_ENV, TrainState, save_checkpoint

    opts = Opts(tp=KILL_TP, dropout=0.0)
    run = Run(opts)
    run.train(0, 1)
    pause = os.environ.pop(PAUSE_ENV)
    save_checkpoint(str(root), TrainState(1, opts.gbs), run.model, run.optimizer, run.scheduler, opts.run_args())
    torch.save(run.snapshot(), root / f"snap_rank{dist.get_rank()}.pt")
    dist.barrier()
    run.train(1, 2)
    print("SAVING-ITERATION-2", flush=True)
    os.environ[PAUSE_ENV] = pause
    save_checkpoint(str(root), TrainState(2, 2 * opts.gbs), run.model, run.optimizer, run.scheduler, opts.run_args())
    print("SAVE-2-NOT-KILLED", flush=True)


def verify_after_kill(roots: str) -> None:
    """For each directory of `roots` (comma-separated; a save was killed in each): the previous checkpoint
    loads exactly, and a new save over the leftovers completes. Check names end with the directory's name."""
    from checkpoint_harness import Opts, Run
    from launch.checkpointing import TrainState, load_checkpoint, save_checkpoint
    from rank_checks import run_checks

    opts = Opts(tp=KILL_TP, dropout=0.0)

    def previous_loads(root: Path):
        run = Run(opts)
        state = load_checkpoint(str(root), run.model, run.optimizer, run.scheduler, opts.run_args())
        assert state is not None and state.iteration == 1, f"expected the iteration-1 checkpoint, got {state}"
        ref = torch.load(root / f"snap_rank{dist.get_rank()}.pt", weights_only=True)
        _equal_snapshots(ref, run.snapshot(), "after a killed save")
        run.train(1, 2)
        save_checkpoint(str(root), TrainState(2, 2 * opts.gbs), run.model, run.optimizer, run.scheduler,
                        opts.run_args())
        again = Run(opts)
        state = load_checkpoint(str(root), again.model, again.optimizer, again.scheduler, opts.run_args())
        assert state.iteration == 2 and not (root / "iter_0000002.tmp").exists()

    run_checks([(f"ckpt_killed_save_leaves_previous_{Path(r).name}", functools.partial(previous_loads, Path(r)))
                for r in roots.split(",")])


def main() -> None:
    import parallel_state as ps

    suite, root = sys.argv[1], sys.argv[2]
    if suite == "moe":
        ps.initialize(tp=2, pp=2, ep=2, etp=1)
    elif suite in ("save", "verify"):
        ps.initialize(tp=KILL_TP)
    else:
        ps.initialize(tp=2, pp=2)
    if suite == "verify":
        verify_after_kill(root)
    else:
        {"dense": dense, "moe": moe, "save": save_then_hang}[suite](Path(root))
    ps.destroy()


if __name__ == "__main__":  # megatron's checkpoint writer spawns a helper process that imports this module
    main()
