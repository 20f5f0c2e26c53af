"""``fp8ops.linear_cross_entropy`` on CPU: hand-computed values, the loss and both gradients against
the FP32 reference and against ``F.cross_entropy`` under the error rule, ignored and bad targets,
argument errors, opcheck of the library op, and its composition with torch.func, vmap, autocast and
torch.compile.

On CPU the op's kernel is the reference's ``linear_cross_entropy_fwd`` (by hand: softmax minus
one-hot), and its backward is the op's own (the mean's scale applied to the GEMMs), so comparing
with :func:`fp8ops.reference.linear_cross_entropy.linear_cross_entropy`, differentiated by autograd,
checks both.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as Fn

from fp8ops import linear_cross_entropy
from fp8ops._glue import GUARD_MESSAGE
from fp8ops.reference import linear_cross_entropy as R
from fp8ops.testing import assert_close_rule

ops = torch.ops.fp8ops


def _inputs(M: int, K: int, V: int, dtype: torch.dtype = torch.float32, seed: int = 0, lead: tuple[int, ...] = ()):
    g = torch.Generator().manual_seed(seed)
    shape = lead if lead else (M,)
    x = (torch.randn(*shape, K, generator=g) * 2.0).to(dtype)
    w = (torch.randn(V, K, generator=g) / math.sqrt(K)).to(dtype)
    t = torch.randint(0, V, shape, generator=g)
    return x, w, t


def _grads(fn, x, w, t, **kw):
    xl, wl = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    loss = fn(xl, wl, t, **kw)
    loss.backward()
    return loss.detach(), xl.grad, wl.grad


def _torch_ce(x, w, t, ignore_index=-100):
    """Plain PyTorch at x's precision: the logits in x's dtype, the loss in float32 (as the GPT's)."""
    z = x.reshape(-1, x.shape[-1]) @ w.t()
    return Fn.cross_entropy(z.float(), t.reshape(-1), ignore_index=ignore_index)


# ------------------------------------------------------------------------------------------------
# Hand-computed values


def test_hand_computed_loss_and_gradients() -> None:
    # x = I, so the logits are W's rows: row 0 (0, ln 3, ln 4) has softmax (1, 3, 4) / 8 and
    # target 2; row 1 (ln 2, ln 2, 0) has softmax (2, 2, 1) / 5 and target 0; row 2 is ignored.
    w = torch.tensor([[0.0, math.log(2.0), 5.0], [math.log(3.0), math.log(2.0), -1.0], [math.log(4.0), 0.0, 2.0]])
    x = torch.eye(3)
    t = torch.tensor([2, 0, -100])
    loss, dx, dw = _grads(linear_cross_entropy, x, w, t)
    want = (-math.log(4 / 8) - math.log(2 / 5)) / 2
    assert abs(loss.item() - want) < 1e-6
    dz = torch.tensor([[1 / 8, 3 / 8, 4 / 8 - 1], [2 / 5 - 1, 2 / 5, 1 / 5], [0.0, 0.0, 0.0]]) / 2
    torch.testing.assert_close(dx, dz @ w, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(dw, dz.t() @ x, rtol=1e-6, atol=1e-7)


def test_cpu_kernel_by_hand() -> None:
    z = torch.tensor([[0.0, math.log(3.0)], [1.0, 1.0], [2.0, -3.0], [0.0, 0.0]])
    t = torch.tensor([1, -7, 0, 5])  # row 1 ignored (ignore_index -7), row 3's target outside [0, 2)
    loss, d = ops.linear_cross_entropy_fwd(z, t, -7)
    assert loss[0].item() == pytest.approx(math.log(4 / 3), abs=1e-7)
    assert loss[1].item() == 0.0 and loss[3].isnan()
    assert loss[2].item() == pytest.approx(math.log(1 + math.exp(-5.0)), abs=1e-7)
    torch.testing.assert_close(d[0], torch.tensor([0.25, -0.25]))
    assert d[1].abs().sum() == 0
    torch.testing.assert_close(d[3], torch.tensor([0.5, 0.5]))  # the softmax alone; the loss says NaN


def test_mean_is_over_kept_rows_only() -> None:
    x, w, t = _inputs(12, 8, 11)
    t[::3] = -100
    loss = linear_cross_entropy(x, w, t)
    kept = t != -100
    alone = linear_cross_entropy(x[kept], w, t[kept])
    torch.testing.assert_close(loss, alone, rtol=1e-6, atol=0)


# ------------------------------------------------------------------------------------------------
# Against the FP32 reference and F.cross_entropy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M,K,V", [(1, 4, 3), (17, 24, 131), (64, 16, 1000)])
def test_loss_and_gradients_follow_the_reference(dtype: torch.dtype, M: int, K: int, V: int) -> None:
    x, w, t = _inputs(M, K, V, dtype, seed=M + V)
    if M > 4:
        t[1] = -100
    loss, dx, dw = _grads(linear_cross_entropy, x, w, t)
    x32, w32 = x.float(), w.float()
    want, wdx, wdw = _grads(R.linear_cross_entropy, x32, w32, t)
    same, sdx, sdw = _grads(_torch_ce, x, w, t)
    # the loss is float32 whatever x's dtype; gradients in x's dtype
    assert loss.dtype == torch.float32 and dx.dtype == dtype and dw.dtype == dtype
    tiny = 1e-6 if dtype == torch.float32 else 1e-3
    assert_close_rule(loss, want, same, k=2.0, atol=tiny * max(1.0, abs(want.item())), name=f"loss {dtype}")
    assert_close_rule(dx, wdx, sdx, k=2.0, atol=tiny * float(wdx.abs().max()), name=f"dx {dtype}")
    assert_close_rule(dw, wdw, sdw, k=2.0, atol=tiny * float(wdw.abs().max()), name=f"dw {dtype}")


def test_reference_equals_torch_cross_entropy() -> None:
    x, w, t = _inputs(40, 12, 77, seed=3)
    t[5] = 9
    t[7] = -1
    want = Fn.cross_entropy(x @ w.t(), t, ignore_index=-1)
    torch.testing.assert_close(R.linear_cross_entropy(x, w, t, ignore_index=-1), want, rtol=1e-6, atol=0)


def test_leading_dims_int32_targets_and_ignore_index() -> None:
    x, w, t = _inputs(0, 8, 19, lead=(3, 5), seed=4)
    t[0, 0] = 7
    loss, dx, dw = _grads(linear_cross_entropy, x, w, t.int(), ignore_index=7)
    want, wdx, wdw = _grads(R.linear_cross_entropy, x, w, t, ignore_index=7)
    assert dx.shape == x.shape
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=0)
    torch.testing.assert_close(dx, wdx, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(dw, wdw, rtol=1e-5, atol=1e-7)
    assert dx[0, 0].abs().sum() == 0  # the ignored row gets no gradient


def test_the_loss_gradient_scales_both_gradients() -> None:
    x, w, t = _inputs(9, 6, 13, seed=5)
    xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
    (linear_cross_entropy(xl, wl, t) * -2.5).backward()
    _, dx, dw = _grads(linear_cross_entropy, x, w, t)
    torch.testing.assert_close(xl.grad, -2.5 * dx, rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(wl.grad, -2.5 * dw, rtol=1e-6, atol=1e-8)


def test_every_target_ignored_gives_nan_as_torch() -> None:
    x, w, t = _inputs(4, 6, 5, seed=6)
    t[:] = -100
    assert linear_cross_entropy(x, w, t).isnan() and Fn.cross_entropy(x @ w.t(), t).isnan()


def test_nan_and_inf_logits() -> None:
    x, w, t = _inputs(3, 4, 6, seed=7)
    x[1, 0] = float("nan")
    assert linear_cross_entropy(x, w, t).isnan()
    z = torch.tensor([[float("-inf"), 0.0, 1.0]])
    loss, d = ops.linear_cross_entropy_fwd(z, torch.tensor([2]), -100)
    assert torch.isfinite(loss).all() and d[0, 0] == 0.0  # a masked-out vocabulary entry


def test_target_outside_vocabulary_raises_on_cpu() -> None:
    x, w, t = _inputs(4, 6, 5, seed=8)
    t[2] = 5
    with pytest.raises(IndexError, match=r"linear_cross_entropy: target holds 5, outside \[0, 5\)"):
        linear_cross_entropy(x, w, t)


# ------------------------------------------------------------------------------------------------
# Argument errors


@pytest.mark.parametrize("bad,err,match", [
    (dict(x=[1.0]), TypeError, "x must be a torch.Tensor"),
    (dict(x=torch.ones(2, 4, dtype=torch.int32)), ValueError, "x must be float32"),
    (dict(w=torch.ones(5, 3)), ValueError, r"weight must be 2-D \(V, K\) with V >= 1 and K = x.shape\[-1\] = 4"),
    (dict(w=torch.ones(0, 4)), ValueError, "V >= 1"),
    (dict(w=torch.ones(5, 4, dtype=torch.bfloat16)), ValueError, "weight must have x's dtype torch.float32"),
    (dict(t=[0, 1]), TypeError, "target must be a torch.Tensor"),
    (dict(t=torch.zeros(2)), ValueError, "target must be int64 or int32"),
    (dict(t=torch.zeros(3, dtype=torch.long)), ValueError, r"target must have x's leading shape \(2,\)"),
    (dict(ignore_index=1.0), TypeError, "ignore_index must be an int"),
    (dict(ignore_index=True), TypeError, "ignore_index must be an int"),
])
def test_bad_arguments_are_named(bad, err, match) -> None:
    args = {"x": torch.ones(2, 4), "w": torch.ones(5, 4), "t": torch.zeros(2, dtype=torch.long), "ignore_index": -100}
    args.update(bad)
    with pytest.raises(err, match=match):
        linear_cross_entropy(args["x"], args["w"], args["t"], ignore_index=args["ignore_index"])


def test_launcher_checks_its_arguments() -> None:
    from fp8ops.kernels.linear_cross_entropy import linear_cross_entropy_fwd_launch

    with pytest.raises(ValueError, match="target must be a 1-D int64/int32 tensor of the logits' 3 rows"):
        linear_cross_entropy_fwd_launch(torch.ones(3, 4), torch.zeros(2, dtype=torch.long), -100)
    with pytest.raises(ValueError, match="unit column stride"):
        linear_cross_entropy_fwd_launch(torch.ones(4, 3).t(), torch.zeros(3, dtype=torch.long), -100)


def test_opcheck() -> None:
    z = torch.randn(6, 9)
    t = torch.tensor([0, 8, -100, 3, 3, 1])
    torch.library.opcheck(ops.linear_cross_entropy_fwd, (z, t, -100))
    torch.library.opcheck(ops.linear_cross_entropy_fwd, (z.bfloat16(), t.int(), -100))


# ------------------------------------------------------------------------------------------------
# torch.func, vmap, autocast, torch.compile


def test_torch_func_grad_matches_autograd() -> None:
    x, w, t = _inputs(10, 8, 21, seed=9)
    _, dx, dw = _grads(linear_cross_entropy, x, w, t)
    gx, gw = torch.func.grad(lambda a, b: linear_cross_entropy(a, b, t), argnums=(0, 1))(x, w)
    torch.testing.assert_close(gx, dx, rtol=0, atol=0)
    torch.testing.assert_close(gw, dw, rtol=0, atol=0)


def test_vmap_over_batches_is_a_loop() -> None:
    x, w, t = _inputs(0, 8, 21, lead=(3, 7), seed=10)
    got = torch.func.vmap(lambda a, b: linear_cross_entropy(a, w, b))(x, t)
    want = torch.stack([linear_cross_entropy(x[i], w, t[i]) for i in range(3)])
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)


def test_autocast_computes_as_f_linear_does() -> None:
    x, w, t = _inputs(12, 16, 40, seed=11)
    xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = linear_cross_entropy(xl, wl, t)
    loss.backward()
    assert xl.grad.dtype == torch.float32 and wl.grad.dtype == torch.float32
    want, wdx, wdw = _grads(linear_cross_entropy, x.bfloat16(), w.bfloat16(), t)
    torch.testing.assert_close(loss, want, rtol=0, atol=0)
    torch.testing.assert_close(xl.grad, wdx.float(), rtol=0, atol=0)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # mixed dtypes, as F.linear takes them there
        mixed = linear_cross_entropy(x, w.bfloat16(), t)
    torch.testing.assert_close(mixed, want, rtol=0, atol=0)


def test_compiled_fullgraph_matches_eager() -> None:
    x, w, t = _inputs(0, 8, 33, lead=(2, 5), seed=12)
    want = _grads(linear_cross_entropy, x, w, t)
    got = _grads(torch.compile(linear_cross_entropy, fullgraph=True, backend="aot_eager"), x, w, t)
    for a, b, what in zip(got, want, ("loss", "dx", "dw")):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-8, msg=what)


@pytest.mark.parametrize("argnums", [0, 1, (0, 1)])
def test_compiled_func_grad_raises(argnums) -> None:
    x, w, t = _inputs(4, 8, 9, seed=13)
    fn = torch.compile(torch.func.grad(lambda a, b: linear_cross_entropy(a, b, t), argnums=argnums),
                       backend="aot_eager", fullgraph=True)
    with pytest.raises(Exception, match="pytorch#193279"):
        fn(x, w)
    assert "pytorch#193279" in GUARD_MESSAGE
