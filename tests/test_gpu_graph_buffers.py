"""TransformerEngine's two buffer-ownership cases with captured graphs: outputs kept from every microbatch of an
interleaved pipeline order equal eager ones (per-microbatch buffers by default; with sharing turned on, the
debug check refuses the overwrite), and parameter gradients a hook keeps from two replays are two tensors
(unless `clone_param_grads_on_return=False`). CPU counterparts: tests/test_graph_buffers.py."""
from __future__ import annotations

import copy

import pytest
import torch

import fp8_parallel as fp
from fp8_parallel.pipeline import capture_order

pytestmark = pytest.mark.gpu

SEED = 7301
D = 256


class _Chunk(torch.nn.Module):
    def __init__(self, dtype):
        super().__init__()
        self.fc1 = fp.Linear(D, 2 * D, params_dtype=dtype, device="cuda")
        self.fc2 = fp.Linear(2 * D, D, params_dtype=dtype, device="cuda")

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))


def _drive(order, microbatches, data, grads, call):
    """Run the order; keep every output to the end (TE's test does); backward with the given grads."""
    outputs, fwd, bwd = {}, [0, 0], [0, 0]
    for step in order:
        c = abs(step) - 1
        if step > 0:
            mb = fwd[c]
            fwd[c] += 1
            outputs[(c, mb)] = call(c, mb, data[c][mb])
        else:
            mb = bwd[c]
            bwd[c] += 1
            outputs[(c, mb)].backward(grads[c][mb])
    return outputs


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_interleaved_outputs_kept_by_the_caller_equal_eager(dtype):
    print(f"seed {SEED}")
    torch.manual_seed(SEED)
    microbatches = 4
    order = capture_order(microbatches, 2, 0, vpp_size=2)  # Megatron-LM's interleaved order, rank 0
    plain = [_Chunk(dtype), _Chunk(dtype)]
    graphed = copy.deepcopy(plain)
    gen = torch.Generator(device="cuda").manual_seed(SEED + 1)
    data = [[torch.randn(64, D, device="cuda", dtype=dtype, generator=gen).requires_grad_()
             for _ in range(microbatches)] for _ in range(2)]
    grads = [[torch.randn(64, D, device="cuda", dtype=dtype, generator=gen) for _ in range(microbatches)]
             for _ in range(2)]
    samples = [(torch.randn(64, D, device="cuda", dtype=dtype, requires_grad=True),) for _ in range(2 * microbatches)]
    calls = fp.make_graphed_callables(tuple(graphed), samples, _order=order)
    expected = _drive(order, microbatches, data, grads, lambda c, mb, x: plain[c](x))
    got = _drive(order, microbatches, data, grads, lambda c, mb, x: calls[c * microbatches + mb](x))
    for key in expected:
        assert torch.equal(got[key], expected[key]), f"{dtype} output of (chunk, microbatch) {key} differs"
    for a, b in zip([p for m in plain for p in m.parameters()], [p for m in graphed for p in m.parameters()]):
        assert torch.equal(a.grad, b.grad)

    shared = copy.deepcopy(plain)
    calls = fp.make_graphed_callables(tuple(shared), samples, _order=order, _reuse_graph_input_output_buffers=True,
                                      check_held_outputs=True)
    with pytest.raises(RuntimeError, match="would overwrite output 0"):
        _drive(order, microbatches, data, grads, lambda c, mb, x: calls[c * microbatches + mb](x))


@pytest.mark.parametrize("clone", [True, False])
def test_parameter_grads_a_hook_keeps_are_owned_unless_asked_otherwise(clone):
    print(f"seed {SEED}")
    torch.manual_seed(SEED)
    model = fp.Linear(64, 64, device="cuda")
    sample = torch.randn(16, 64, device="cuda", requires_grad=True)
    graphed = fp.make_graphed_callables(model, (sample,), clone_param_grads_on_return=clone)
    seen = []
    hook = model.weight.register_hook(lambda g: seen.append(g))
    try:
        xs = [torch.randn(16, 64, device="cuda", requires_grad=True) for _ in range(2)]
        for x in xs:
            graphed(x).sum().backward()
            model.zero_grad(set_to_none=True)
        assert len(seen) == 2
        assert (seen[0].data_ptr() != seen[1].data_ptr()) == clone
        if clone:  # each kept gradient is its own replay's: the weight gradient of sum(x W^T) is 1^T x
            for g, x in zip(seen, xs):
                expected = torch.ones(16, 64, device="cuda").t() @ x.detach()
                torch.testing.assert_close(g.float(), expected.float(), rtol=0.05, atol=0.5)
    finally:
        hook.remove()
        graphed.reset()
