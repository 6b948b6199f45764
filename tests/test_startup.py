"""`fp8_parallel.startup`: megatron-core imported without torch's compiler, its compiled functions unchanged."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from fp8_parallel.startup import deferred_compile

REPO = Path(__file__).resolve().parent.parent


def test_deferred_compile_compiles_at_the_first_call_with_the_given_options(monkeypatch):
    calls = []

    def fake_compile(model=None, **options):  # records what the real torch.compile would be asked
        calls.append((model, options))
        return lambda *a, **k: ("compiled", model(*a, **k))

    monkeypatch.setattr(torch, "compile", fake_compile)
    with deferred_compile():
        def double(x):
            """doubles"""
            return 2 * x

        plain = torch.compile(double)
        decorated = torch.compile(fullgraph=True, dynamic=False)(double)
        module = torch.nn.Linear(2, 2)
        compiled_module = torch.compile(module, mode="max-autotune")
    assert torch.compile is fake_compile  # restored
    assert calls == [(module, {"mode": "max-autotune"})]  # a module is compiled at once
    assert callable(compiled_module)
    assert plain.__name__ == "double" and plain.__doc__ == "doubles"
    assert plain(3) == ("compiled", 6) and plain(4) == ("compiled", 8)
    assert decorated(5) == ("compiled", 10)
    assert calls[1:] == [(double, {}), (double, {"fullgraph": True, "dynamic": False})]  # once each


def test_megatron_core_imports_without_the_compiler_and_its_fused_function_still_compiles():
    script = textwrap.dedent("""
        import sys, torch
        from fp8_parallel.startup import import_megatron_core
        import_megatron_core("megatron.core.fusions.fused_bias_dropout")
        assert "torch._dynamo" not in sys.modules and "torch._inductor" not in sys.modules
        from megatron.core.fusions.fused_bias_dropout import bias_dropout_add_fused_train as fused
        torch.manual_seed(0)
        x, bias, residual = torch.randn(4, 2, 8), torch.randn(8), torch.randn(4, 2, 8)
        out = fused((x, bias), residual, 0.0)
        assert "torch._dynamo" in sys.modules  # compiled at the first call
        torch.testing.assert_close(out, residual + (x + bias), rtol=1e-6, atol=1e-6)
        print("ok")
    """)
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=os.pathsep.join(
        p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout + proc.stderr[-4000:]
