"""``fp8ops.linear_cross_entropy`` on the GPU (marker ``gpu``): the CUDA kernel against the CPU
kernel on the same logits (the gradient's rounding to bf16 to the bit where the two exponentials
agree), the op's loss and gradients against the FP32 reference under the error rule with plain
PyTorch at the same precision, special values, and the op compiled with ``fullgraph=True`` (its
kernel then launched from Inductor's graph) and inside ``fp8ops.graph_step`` against eager.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as Fn

import fp8ops
from fp8ops import linear_cross_entropy
from fp8ops.reference import linear_cross_entropy as R
from fp8ops.testing import assert_close_rule

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

ops = torch.ops.fp8ops


def _inputs(M: int, K: int, V: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = (torch.randn(M, K, device="cuda", generator=g) * 2.0).to(dtype)
    w = (torch.randn(V, K, device="cuda", generator=g) / math.sqrt(K)).to(dtype)
    t = torch.randint(0, V, (M,), device="cuda", generator=g)
    t[::7] = -100
    return x, w, t


def _grads(fn, x, w, t):
    xl, wl = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    loss = fn(xl, wl, t)
    loss.backward()
    return loss.detach(), xl.grad, wl.grad


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("V", [50304, 1000, 7])
def test_kernel_matches_the_cpu_kernel(dtype: torch.dtype, V: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(V)
    z = (torch.randn(300, V, device="cuda", generator=g) * 3.0).to(dtype)
    t = torch.randint(0, V, (300,), device="cuda", generator=g)
    t[3] = -100
    loss, d = ops.linear_cross_entropy_fwd(z, t, -100)
    rl, rd = R.linear_cross_entropy_fwd(z.cpu(), t.cpu(), -100)
    torch.testing.assert_close(loss.cpu(), rl, rtol=2e-6, atol=2e-6)
    assert d.dtype == dtype and loss[3].item() == 0.0 and d[3].abs().sum().item() == 0
    if dtype == torch.bfloat16:
        # the same float32 value rounds to the same bits; CUDA's and the CPU's exp and log differ by
        # float32 ulps, which move a bf16 rounding in rare cases, by one ulp (2**-7 relative at most)
        same = (d.cpu().float() == rd.float()).float().mean().item()
        assert same > 0.999, f"only {same:.5f} of the gradient's values round as the CPU kernel's"
    rtol = 2.0**-7 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(d.cpu().float(), rd.float(), rtol=rtol, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_loss_and_gradients_follow_the_reference(dtype: torch.dtype) -> None:
    x, w, t = _inputs(1000, 256, 50304, dtype, seed=1)
    loss, dx, dw = _grads(linear_cross_entropy, x, w, t)
    want, wdx, wdw = _grads(R.linear_cross_entropy, x.float().cpu(), w.float().cpu(), t.cpu())

    def torch_ce(a, b, c):
        return Fn.cross_entropy((a @ b.t()).float(), c)

    same, sdx, sdw = _grads(torch_ce, x, w, t)
    tiny = 1e-6 if dtype == torch.float32 else 1e-4
    assert_close_rule(loss.cpu(), want, same.cpu(), k=2.0, atol=tiny * abs(want.item()), name=f"loss {dtype}")
    assert_close_rule(dx.cpu(), wdx, sdx.cpu(), k=2.0, atol=tiny * float(wdx.abs().max()), name=f"dx {dtype}")
    assert_close_rule(dw.cpu(), wdw, sdw.cpu(), k=2.0, atol=tiny * float(wdw.abs().max()), name=f"dw {dtype}")


def test_special_values_on_cuda() -> None:
    z = torch.randn(4, 5000, device="cuda")
    z[0, :4000] = float("-inf")
    z[1, 17] = float("nan")
    t = torch.tensor([4500, 3, 4999, 5000], device="cuda")  # row 3: outside [0, 5000)
    loss, d = ops.linear_cross_entropy_fwd(z, t, -100)
    assert torch.isfinite(loss[[0, 2]]).all() and loss[1].isnan() and loss[3].isnan()
    assert d[0, :4000].abs().sum().item() == 0 and torch.isfinite(d[0]).all()
    x, w, tt = _inputs(64, 32, 100, torch.bfloat16, seed=2)
    tt[5] = 100
    assert linear_cross_entropy(x, w, tt).isnan()  # no device assertion, a NaN loss


@pytest.mark.parametrize("inline", [True, False])
def test_compiled_fullgraph_matches_eager(inline: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    from fp8ops.kernels import _library

    monkeypatch.setattr(_library, "INLINE_IN_GRAPHS", inline)
    torch._dynamo.reset()
    x, w, t = _inputs(2048, 128, 50304, torch.bfloat16, seed=3)
    want = _grads(linear_cross_entropy, x, w, t)
    got = _grads(torch.compile(linear_cross_entropy, fullgraph=True), x, w, t)
    for a, b, what in zip(got, want, ("loss", "dx", "dw")):
        torch.testing.assert_close(a.float(), b.float(), rtol=1e-5, atol=1e-6, msg=f"{what}, inline={inline}")
    torch._dynamo.reset()


def test_graph_step_replays_the_eager_step() -> None:
    x, w, t = _inputs(1024, 64, 8192, torch.bfloat16, seed=4)
    w = w.clone().requires_grad_()

    def step(carry, xx, tt):
        w.grad = None
        loss = linear_cross_entropy(xx, w, tt)
        loss.backward()
        return carry, (loss.detach(), w.grad.clone())

    _, want = step(None, x, t)
    graphed = fp8ops.graph_step(step)
    for _ in range(5):
        _, got = graphed(None, x, t)
    assert graphed.stats["replays"] > 0, graphed.stats
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)
