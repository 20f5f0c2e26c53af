"""CPU checks of ``python -m fp8ops.bench attention``'s fp8ops rows: every implementation the suite
times (the public op, ``deterministic=True``, the portable forward through the kernels' launch config)
builds and computes the same attention and gradients (the kernels run in Triton's interpreter)."""

from __future__ import annotations

import importlib

import pytest
import torch

B = importlib.import_module("fp8ops.bench.attention")


@pytest.mark.parametrize("variant", ["none", "causal", "alibi"])
def test_every_fp8ops_row_computes_the_same_attention(variant):
    S, H, D = 64, 2, 16
    g = torch.Generator().manual_seed(0)
    base = [torch.randn(1, H, S, D, generator=g) for _ in range(3)]
    rows = {
        "fp8ops": B._fp8ops_fn(variant, S, H, None),
        "fp8ops (deterministic)": B._fp8ops_fn(variant, S, H, None, dq_mode="separate"),
        "fp8ops (portable fwd)": B._fp8ops_fn(variant, S, H, None, dq_mode="auto", fwd_config=B.PORTABLE_FWD_CONFIG),
    }
    results = {}
    for name, fn in rows.items():
        leaves = [t.clone().requires_grad_() for t in base]
        out = fn(*leaves)
        results[name] = (out, *torch.autograd.grad(out.sum(), leaves))
    ref = results["fp8ops"]
    for name, got in results.items():
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b, atol=2e-4, rtol=2e-4, msg=lambda m: f"{variant} {name}: {m}")
