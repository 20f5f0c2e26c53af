"""``fp8ops.tied_embedding`` on the GPU (marker ``gpu``): the gradient of the table (eager, compiled
with ``fullgraph=True``, and inside ``fp8ops.graph_step``) against the FP32 reference under the
error rule with plain PyTorch at the same precision, tokens repeated many times (summed in float32
before the one add), the kernel's sums bit for bit (one rounding of an exact float32 sum), and the
compiled backward adding the rows in place in the head's GEMM output with the library's kernel.
"""

from __future__ import annotations

import pytest
import torch

import fp8ops
from fp8ops import tied_embedding
from fp8ops.reference import tied_embedding as R
from fp8ops.testing import assert_close_rule
from fp8ops.testing.tied_head import plain_tied as _plain, tied_grad as _grad, tied_inputs, tied_loss as _loss

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)


def _inputs(V: int, K: int, T: int, dtype: torch.dtype, seed: int = 0, few: int | None = None):
    return tied_inputs(V, K, (2, T // 2), dtype, seed=seed, device="cuda", few=few, w_scale=0.05)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("few", [None, 3])  # tokens drawn from the whole table, or from 3 entries
@pytest.mark.parametrize("mode", ["eager", "compile"])
def test_gradient_follows_the_reference(dtype: torch.dtype, few: int | None, mode: str) -> None:
    w, tokens, x, c = _inputs(1000, 64, 2048, dtype, seed=1, few=few)
    fn = tied_embedding if mode == "eager" else torch.compile(lambda t, a: tied_embedding(t, a), fullgraph=True)
    got = _grad(fn, w, tokens, x, c)
    want = _grad(R.tied_embedding, w.float(), tokens, x.float(), c.float())
    same = _grad(_plain, w, tokens, x, c)
    assert got.dtype == dtype
    assert_close_rule(got.float(), want, same.float(), name=f"dW ({mode})")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("few", [None, 3])  # tokens from 3000 entries, or runs of ~2700 of 3 tokens
def test_kernel_sums_first_then_rounds_once(dtype: torch.dtype, few: int | None) -> None:
    gen = torch.Generator(device="cuda").manual_seed(4)
    V, K, T = 3000, 4160, 8192  # K: four blocks of 1024 columns and a partial fifth
    g = torch.randn(V, K, device="cuda", generator=gen).to(dtype)
    tokens = torch.randint(0, few or V, (T,), device="cuda", generator=gen)
    rows = torch.randint(-8, 9, (T, K), device="cuda", generator=gen).to(dtype)  # sums exact in float32
    sums = torch.zeros(V, K, device="cuda", dtype=torch.float32).index_add_(0, tokens, rows.float())
    want = (g.float() + sums).to(dtype)  # the exact sum, one float32 add, one rounding (g where it is 0)
    got = g.clone()
    torch.ops.fp8ops.tied_embedding_bwd(got, tokens.int() if few else tokens, rows)
    assert torch.equal(got, want)


def test_compiled_adds_in_place_in_the_head_gradient() -> None:
    from torch._inductor.utils import run_and_get_code

    w, tokens, x, c = _inputs(4096, 128, 1024, torch.bfloat16, seed=2)
    wl = w.clone().requires_grad_()
    fn = torch.compile(lambda a: _loss(tied_embedding, a, tokens, x, c), fullgraph=True)
    _, codes = run_and_get_code(lambda: fn(wl).backward())
    backward = codes[-1]
    # the (V, K) gradient is the head's mm output itself: no second buffer of that size is filled,
    # and the rows are added by the library's kernel
    assert "fp8ops.tied_embedding_bwd" in backward, backward
    assert "empty_strided_cuda((4096, 128)" in backward
    assert backward.count("empty_strided_cuda((4096, 128)") == 1, backward
    torch.testing.assert_close(wl.grad, _grad(tied_embedding, w, tokens, x, c), rtol=0, atol=0)


def test_inside_graph_step_equals_eager() -> None:
    w, tokens, x, c = _inputs(500, 32, 512, torch.bfloat16, seed=3)
    want = _grad(tied_embedding, w, tokens, x, c)
    wl = w.clone().requires_grad_()

    def step(carry):
        wl.grad = None
        _loss(tied_embedding, wl, tokens, x, c).backward()
        return carry, wl.grad.clone()

    graphed = fp8ops.graph_step(step)
    for _ in range(3):
        _, g = graphed(None)
    torch.testing.assert_close(g, want, rtol=0, atol=0)
