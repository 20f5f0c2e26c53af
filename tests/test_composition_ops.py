"""Each op alone in every execution mode: eager autograd, ``torch.compile`` (default and
``fullgraph=True``, backend ``aot_eager``: eager's kernels in a compiled graph), ``torch.func.grad``
and ``torch.func.vjp`` — output and every gradient (inputs, parameters, probe) bitwise equal to
eager, for ``recipe=None`` and each recipe the op takes, in float32 and bfloat16, on the CPU and
(marker ``gpu``) on CUDA. The model-level matrix with Inductor and CUDA graphs is
``tests/test_composition.py`` / ``tests/test_composition_gpu.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import fp8ops
from fp8ops.testing import composition as C

DEVICES = [pytest.param("cpu", id="cpu")]
if torch.cuda.is_available():
    DEVICES.append(pytest.param("cuda", id="cuda", marks=pytest.mark.gpu))
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
MODES = ["compile", "fullgraph", "func.grad", "func.vjp"]


def _case(op: str, recipe_name: str, dtype: torch.dtype, device: str
          ) -> tuple[Callable[..., Any], list[torch.Tensor], torch.Tensor | None]:
    """(loss(*inputs, probe), inputs, a fresh probe or None) of one op on small random data."""
    g = torch.Generator().manual_seed(0)

    def rnd(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)

    recipe = C.make_recipe(recipe_name)
    M, K, N = 24, 32, 48
    c = rnd(M, N)  # the loss weights: dy = c, with a non-trivial amax
    if op == "fp8_linear":
        st = None if recipe is None else fp8ops.LinearState.init(recipe, device=device)

        def loss(x, w, b, p=None):
            y, _ = fp8ops.fp8_linear(x, w, b, st, recipe=recipe, grad_probe=p)
            return (y.float() * c.float()).sum()

        return loss, [rnd(M, K), rnd(N, K, scale=K**-0.5), rnd(N)], None if st is None else fp8ops.make_probes(st, requires_grad=False)
    if op == "layernorm_linear":
        st = None if recipe is None else fp8ops.LayerNormLinearState.init(recipe, device=device)

        def loss(x, lw, lb, w, b, p=None):
            y, _ = fp8ops.layernorm_linear(x, lw, lb, w, b, st, recipe=recipe, grad_probe=p)
            return (y.float() * c.float()).sum()

        return loss, [rnd(M, K), 1 + rnd(K, scale=0.1), rnd(K, scale=0.1), rnd(N, K, scale=K**-0.5), rnd(N)], \
            None if st is None else fp8ops.make_probes(st, requires_grad=False)
    if op == "fused_ln_mlp":
        st = None if recipe is None else fp8ops.LayerNormMLPState.init(recipe, device=device)
        ck = rnd(M, K)

        def loss(x, lw, lb, w1, b1, w2, b2, p=None):
            y, _ = fp8ops.fused_ln_mlp(x, lw, lb, w1, b1, w2, b2, st, recipe=recipe, grad_probe=p)
            return (y.float() * ck.float()).sum()

        F = 2 * K
        return loss, [rnd(M, K), 1 + rnd(K, scale=0.1), rnd(K, scale=0.1), rnd(F, K, scale=K**-0.5), rnd(F),
                      rnd(K, F, scale=F**-0.5), rnd(K)], None if st is None else fp8ops.make_probes(st, requires_grad=False)
    if op == "fake_quantize":
        st = fp8ops.FakeQuantState.init(recipe, device=device)
        cx = rnd(M, K)

        def loss(x, p=None):
            y, _ = fp8ops.fake_quantize(x, st, recipe=recipe, grad_probe=p)
            return (y.float() * cx.float()).sum()

        return loss, [rnd(M, K)], fp8ops.make_probes(st, requires_grad=False)
    if op == "layer_norm":
        ck = rnd(M, K)

        def loss(x, r, w, b):
            (y, s), _ = fp8ops.layer_norm(x, w, b, None, residual=r)
            return (y.float() * ck.float()).sum() + s.float().square().sum()

        return loss, [rnd(M, K), rnd(M, K), 1 + rnd(K, scale=0.1), rnd(K, scale=0.1)], None
    if op == "rms_norm":
        ck = rnd(M, K)

        def loss(x, w):
            return (fp8ops.rms_norm(x, w, None)[0].float() * ck.float()).sum()

        return loss, [rnd(M, K), 1 + rnd(K, scale=0.1)], None
    if op == "attention":
        co = rnd(2, 2, 16, 16)

        def loss(q, k, v):
            out, _ = fp8ops.attention(q, k, v, causal=True)
            return (out.float() * co.float()).sum()

        return loss, [rnd(2, 2, 16, 16), rnd(2, 2, 16, 16), rnd(2, 2, 16, 16)], None
    raise AssertionError(op)


OPS = {  # op -> the recipes it takes
    "fp8_linear": C.RECIPES,
    "layernorm_linear": C.RECIPES,
    "fused_ln_mlp": C.RECIPES,
    "fake_quantize": ("delayed", "current"),
    "layer_norm": ("none",),
    "rms_norm": ("none",),
    "attention": ("none",),
}
CASES = [(op, r) for op, recipes in OPS.items() for r in recipes]


def _run(mode: str, loss: Callable[..., Any], inputs: list[torch.Tensor], probe: torch.Tensor | None
         ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    args = [t.detach().clone() for t in inputs]
    if probe is not None:
        args.append(probe.detach().clone())
    if mode.startswith("func."):
        argnums = tuple(range(len(args)))
        if mode == "func.grad":
            grads, value = torch.func.grad_and_value(loss, argnums=argnums)(*args)
        else:
            value, vjp_fn = torch.func.vjp(loss, *args)
            grads = vjp_fn(torch.ones_like(value))
        return value.detach(), [g.detach() for g in grads]
    args = [a.requires_grad_() for a in args]
    fn = loss
    if mode != "eager":
        torch._dynamo.reset()
        fn = torch.compile(loss, backend="aot_eager", fullgraph=mode == "fullgraph")
    value = fn(*args)
    value.backward()
    return value.detach(), [a.grad for a in args]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("op,recipe", CASES, ids=[f"{o}-{r}" for o, r in CASES])
def test_op_modes_are_bitwise_eager(op: str, recipe: str, dtype: str, device: str) -> None:
    loss, inputs, probe = _case(op, recipe, DTYPES[dtype], device)
    want_v, want_g = _run("eager", loss, inputs, probe)
    assert all(g is not None for g in want_g)
    for mode in MODES:
        got_v, got_g = _run(mode, loss, inputs, probe)
        assert torch.equal(got_v, want_v), f"{op} {recipe} {dtype} {device} {mode}: loss {got_v} vs eager {want_v}"
        for i, (a, b) in enumerate(zip(want_g, got_g)):
            assert b is not None and torch.equal(a, b), (
                f"{op} {recipe} {dtype} {device} {mode}: gradient of input {i} differs from eager "
                f"(max |diff| {(a.float() - b.float()).abs().max().item() if b is not None else 'None'})")

