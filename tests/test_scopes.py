"""Nested FP8 autocast scopes and the amax reduction engine."""
import pytest
import torch

import fp8_parallel as fp
from fp8_parallel.modules import Linear
from launcher import launch

CHECKS = [
    "identical_state_from_global_max", "one_collective_per_scope_and_direction",
    "odd_iterations_module", "module_called_twice", "activation_checkpointing", "eval_no_grad_no_update",
    "updates_equal_reference", "nonfinite_counted", "mismatched_layouts_raise",
]
FOUR_RANK_CHECKS = ["nested_scopes_own_groups"]  # TP2 x EP2: needs 4 ranks


@pytest.mark.parametrize("nproc", [2, pytest.param(4, marks=pytest.mark.xdist_group("heavy"))])
def test_scopes_multirank(nproc):
    launch("scope_checks.py", nproc, expect_checks=CHECKS + (FOUR_RANK_CHECKS if nproc == 4 else []), timeout=600)


def test_disabled_scope_runs_high_precision_and_nested_same_key_shares_state():
    torch.manual_seed(0)
    lin = Linear(32, 32, device="cpu")
    x = torch.randn(8, 32)
    other = Linear(32, 32, device="cpu")
    recipe = fp.DelayedScaling()
    from fp8_parallel.scopes import current_scope
    from fp8_parallel.testing import active_scopes

    with fp.autocast(recipe=recipe):
        outer_state = current_scope().state
        with fp.autocast(enabled=False):
            y_hp = lin(x)
        with fp.autocast(recipe=fp.DelayedScaling()):  # an equal recipe, same group: the same key
            assert current_scope().state is outer_state
            other(x)
        with fp.autocast(recipe=fp.DelayedScaling(amax_compute_algo="most_recent")):  # another key
            assert current_scope().state is not outer_state
        lin(x)
        assert outer_state.forward.metas == [other.fp8.fwd, lin.fp8.fwd]  # one table for both
    torch.testing.assert_close(y_hp, torch.nn.functional.linear(x, lin.weight, lin.bias))
    assert not active_scopes()
    assert (other.fp8.fwd.amax_history[:, 0] > 0).all() and (lin.fp8.fwd.amax_history[:, 0] > 0).all()


def test_same_instance_cannot_be_entered_twice():
    ctx = fp.autocast()
    with ctx:
        with pytest.raises(RuntimeError, match="already active"):
            with ctx:
                pass


def test_current_scaling_modules_match_reference():
    torch.manual_seed(1)
    lin = Linear(32, 48, device="cpu")
    x = torch.randn(16, 32, requires_grad=True)
    with fp.autocast(recipe=fp.CurrentScaling()):
        y = lin(x)
    y.sum().backward()
    ref = x.detach().double() @ lin.weight.detach().double().t() + lin.bias.detach().double()
    rel = (y.detach().double() - ref).norm() / ref.norm()
    assert rel < 0.06, rel
    assert torch.equal(lin.fp8.fwd.amax_history, torch.zeros_like(lin.fp8.fwd.amax_history))


def test_amax_table_lives_where_its_modules_fp8_state_lives():
    """A scope opened on a machine with a GPU defaults its tables to the GPU; modules kept on the CPU register
    there anyway (their table moves to the CPU before any slot exists), and a second device in one table is
    refused by name (the fused update addresses every history through one device)."""
    from fp8_parallel.amax_table import AmaxTable
    from fp8_parallel.meta import FP8Meta
    from fp8_parallel.testing import allocate_table

    table = AmaxTable("forward", torch.device("meta"))  # stands for the GPU default of a CPU-only run here
    allocate_table(table)  # an empty table allocated for a reduction keeps no slots
    first = FP8Meta(2, "layer0/fwd", history_len=4, device=torch.device("cpu"))
    assert table.slots(first).device.type == "cpu" and table.device.type == "cpu"
    other = FP8Meta(1, "layer1/fwd", history_len=4, device=torch.device("meta"))
    with pytest.raises(RuntimeError, match=r"layer1/fwd is on meta.*layer0/fwd.*on cpu"):
        table.slots(other)


def test_scale_views_follow_the_scale_buffer():
    """`FP8Meta.scale_of` keeps its views only while they see the scale buffer: in-place writes show through;
    a replaced buffer, a replaced storage (`.data`), a deep copy and `.to()` give views of the new one."""
    import copy

    from fp8_parallel.meta import FP8Meta

    meta = FP8Meta(2, "views")
    assert meta.scale_of(1).data_ptr() == meta.scale.data_ptr() + 4
    meta.scale.copy_(torch.tensor([2.0, 3.0]))
    assert meta.scale_of(0).item() == 2.0 and meta.scale_of(1).item() == 3.0
    meta.scale.data = torch.tensor([5.0, 7.0])
    assert meta.scale_of(1).item() == 7.0
    meta.scale = torch.tensor([11.0, 13.0])
    assert meta.scale_of(0).item() == 11.0
    twin = copy.deepcopy(meta)
    twin.scale.fill_(17.0)
    assert twin.scale_of(1).item() == 17.0 and meta.scale_of(1).item() == 13.0
    meta.to(torch.float64)  # FP8 state keeps float32 (see FP8Meta._apply), in a new buffer
    meta.scale.fill_(19.0)
    assert meta.scale_of(0).item() == 19.0 and meta.scale_of(0).dtype == torch.float32


def test_inference_before_any_scale_warns_once_and_trained_or_loaded_scales_do_not():
    """Delayed scaling under no_grad updates no scale (as in TransformerEngine): on a state that never had
    one, the casts use scale 1, so its first such call warns, once; a state that ran a training forward, or
    was loaded from a state dict, or current scaling, does not warn."""
    import warnings

    seed = 21
    print(f"seed {seed}")
    torch.manual_seed(seed)
    x = torch.randn(16, 64) * 1e3  # far from scale 1's range: the unscaled result is badly off

    def fp8_warnings(fn):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
        return [str(w.message) for w in caught if str(w.message).startswith("fp8_parallel:")]

    def infer(lin, recipe, calls=1):
        def run():
            for _ in range(calls):
                with torch.no_grad(), fp.autocast(recipe=recipe):
                    lin(x)
        return run

    fresh = Linear(64, 32, device="cpu")
    said = fp8_warnings(infer(fresh, fp.DelayedScaling(), calls=3))
    assert len(said) == 1 and "Linear(64,32)" in said[0] and "scale 1" in said[0], said
    assert torch.equal(fresh.fp8.fwd.scale, torch.ones(2)), "an inference call updated the scale"

    trained = Linear(64, 32, device="cpu")
    with fp.autocast(recipe=fp.DelayedScaling()):
        trained(x).sum().backward()
    assert not fp8_warnings(infer(trained, fp.DelayedScaling()))
    loaded = Linear(64, 32, device="cpu")
    loaded.load_state_dict(trained.state_dict())
    assert not fp8_warnings(infer(loaded, fp.DelayedScaling()))
    assert not fp8_warnings(infer(Linear(64, 32, device="cpu"), fp.CurrentScaling()))


def test_callable_amax_compute_algo_gets_transformer_engines_layout():
    """A callable `amax_compute_algo` sees `[history_len, num_tensors]` (newest in row 0), as in
    TransformerEngine: its max over dim 0 equals "max"; one returning another shape is refused by name."""
    seed = 5
    print(f"seed {seed}")
    torch.manual_seed(seed)
    xs = [torch.randn(8, 32) * (1 + i) for i in range(3)]
    lins = [Linear(32, 16, device="cpu") for _ in range(2)]
    lins[1].load_state_dict(lins[0].state_dict())
    for lin, algo in zip(lins, ("max", lambda h: h.max(dim=0).values)):
        for x in xs:
            with fp.autocast(recipe=fp.DelayedScaling(amax_history_len=4, amax_compute_algo=algo)):
                lin(x).sum().backward()
    assert (lins[0].fp8.fwd.scale != 1).all()
    for a, b in zip(lins[0].fp8.state_dict().values(), lins[1].fp8.state_dict().values()):
        if a.is_floating_point():
            assert torch.equal(a, b)
    bad = Linear(32, 16, device="cpu")
    with pytest.raises(ValueError, match=r"history_len, num_tensors\] = \[4, 2\].*shape \[2\]; got \(4,\)"):
        with fp.autocast(recipe=fp.DelayedScaling(amax_history_len=4, amax_compute_algo=lambda h: h.max(dim=1).values)):
            bad(xs[0])
