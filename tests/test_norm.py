"""layer_norm / rms_norm on CPU: forward and every gradient (x, weight, bias, residual) vs an
independent float64 formula with the tolerance rule, shapes from hypothesis, errors, opcheck of the
library ops, and the composition canaries (torch.func, vmap, torch.compile)."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import fp8ops
from fp8ops.norm import layer_norm, rms_norm
from fp8ops.reference import norm as R
from fp8ops.testing import assert_close_rule
from fp8ops.testing import dropout_hash as DH
from fp8ops.testing import strategies as fst

EPS = 1e-5
NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16"}


def _data(shape, dtype, seed=0, wdtype=None):
    g = torch.Generator().manual_seed(seed)
    K = shape[-1]
    x = (torch.randn(*shape, generator=g) * 2 + 0.5).to(dtype)
    r = torch.randn(*shape, generator=g).to(dtype)
    w = (1 + 0.2 * torch.randn(K, generator=g)).to(wdtype or dtype)
    b = (0.2 * torch.randn(K, generator=g)).to(wdtype or dtype)
    dy = torch.randn(*shape, generator=g).to(dtype)
    ds = torch.randn(*shape, generator=g).to(dtype)
    return x, r, w, b, dy, ds


def _formula(x, r, w, b, rms, zc, dtype):
    """The norm written with torch ops at a given precision (float64: the expected values; x's
    dtype: plain PyTorch at the same precision). Returns (y, s) with s = x + r rounded to x's dtype."""
    K = x.shape[-1]
    if r is not None:
        s_val = (x.detach().double() + r.detach().double()).to(x.dtype).to(dtype)
        s = s_val + ((x + r).to(dtype) - (x + r).to(dtype).detach())  # value of s, gradient of the sum
    else:
        s = x.to(dtype)
    g = w.to(dtype) + (1.0 if zc else 0.0)
    if rms:
        y = F.rms_norm(s, (K,), g, EPS)
    else:
        y = F.layer_norm(s, (K,), g, None if b is None else b.to(dtype), EPS)
    return y, s


def _grads(fn, x, r, w, b, dy, ds):
    leaves = [t.detach().clone().requires_grad_() if t is not None else None for t in (x, r, w, b)]
    y, s = fn(*leaves)
    outs, cots = [y], [dy.to(y.dtype)]
    if leaves[1] is not None:
        outs.append(s)
        cots.append(ds.to(s.dtype))
    torch.autograd.backward(outs, cots)
    return y.detach(), [t.grad if t is not None else None for t in leaves]


def _check_all(x, r, w, b, dy, ds, rms, zc, *, k=2.0):
    def ours(x, r, w, b):
        out, _ = rms_norm(x, w, None, eps=EPS, zero_centered_gamma=zc, residual=r) if rms else \
            layer_norm(x, w, b, None, eps=EPS, zero_centered_gamma=zc, residual=r)
        return out if r is not None else (out, x)

    y, g = _grads(ours, x, r, w, b, dy, ds)
    y64, g64 = _grads(lambda *a: _formula(*a, rms, zc, torch.float64), x, r, w, b, dy, ds)
    ypt, gpt = _grads(lambda *a: _formula(*a, rms, zc, x.dtype), x, r, w, b, dy, ds)
    assert y.dtype == x.dtype and y.shape == x.shape
    scale = max(1.0, float(y64.abs().max())) if y64.numel() else 1.0
    assert_close_rule(y, y64, ypt, k=k, atol=1e-6 * scale, name="y")
    for name, a, e, p in zip(("dx", "dresidual", "dweight", "dbias"), g, g64, gpt):
        if e is None:
            assert a is None, name
            continue
        assert a.dtype == e.dtype or a.dtype != torch.float64, name
        sc = max(1.0, float(e.abs().max())) if e.numel() else 1.0
        assert_close_rule(a, e, p, k=k, atol=1e-5 * sc, name=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=NAMES.get)
@pytest.mark.parametrize("rms", [False, True], ids=["ln", "rms"])
@pytest.mark.parametrize("zc", [False, True], ids=["gamma", "zero_centered"])
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_forward_and_gradients(dtype, rms, zc, residual):
    x, r, w, b, dy, ds = _data((3, 5, 40), dtype)
    _check_all(x, r if residual else None, w, None if rms else b, dy, ds, rms, zc)


def test_fp32_weight_with_bf16_input_and_no_bias():
    x, r, w, _, dy, ds = _data((7, 33), torch.bfloat16, seed=1, wdtype=torch.float32)
    _check_all(x, r, w, None, dy, ds, False, False)
    (y, s), _ = layer_norm(x, w, None, None, residual=r)
    assert y.dtype == s.dtype == torch.bfloat16


@settings(deadline=None)
@given(shape=fst.shapes(1, 3, max_side=67, max_numel=1500), rms=st.booleans(), residual=st.booleans(),
       seed=st.integers(0, 2**16))
def test_hypothesis_shapes(shape, rms, residual, seed):
    x, r, w, b, dy, ds = _data(shape, torch.float32, seed=seed)
    _check_all(x, r if residual else None, w, None if rms else b, dy, ds, rms, False)


def test_reference_matches_public_forward():
    x, r, w, b, _, _ = _data((4, 6, 24), torch.bfloat16, seed=2)
    (y, s), _ = layer_norm(x, w, b, None, residual=r)
    y_ref, s_ref = R.layer_norm(x, w, b, residual=r)
    assert torch.equal(y, y_ref) and torch.equal(s, s_ref)
    assert torch.equal(rms_norm(x, w, None)[0], R.rms_norm(x, w))


def test_empty_and_single_row():
    w = torch.ones(5)
    assert layer_norm(torch.zeros(0, 5), w, None, None)[0].shape == (0, 5)
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0, 10.0]], requires_grad=True)
    y, _ = layer_norm(x, w, torch.zeros(5), None)
    y.sum().backward()
    torch.testing.assert_close(x.grad, torch.zeros_like(x), atol=1e-6, rtol=0)  # sum of a LayerNorm output


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        ({"x": torch.ones(2, 3, dtype=torch.float64)}, ValueError, "x must be float32, bfloat16 or float16"),
        ({"x": torch.ones(2, 0)}, ValueError, "non-empty last dimension"),
        ({"weight": torch.ones(4)}, ValueError, r"weight must have shape \(K,\) = \(3,\)"),
        ({"weight": torch.ones(3, dtype=torch.float16)}, ValueError, "weight must be float32 or x's dtype"),
        ({"bias": torch.ones(2)}, ValueError, r"bias must have shape \(K,\) = \(3,\)"),
        ({"residual": torch.ones(3, 3)}, ValueError, r"residual must have x's shape \(2, 3\)"),
        ({"residual": torch.ones(2, 3, dtype=torch.bfloat16)}, ValueError, "residual must have x's dtype"),
        ({"eps": 0.0}, ValueError, "eps must be a finite number > 0"),
        ({"eps": float("nan")}, ValueError, "eps must be a finite number > 0"),
        ({"zero_centered_gamma": 1}, TypeError, "zero_centered_gamma must be a bool"),
        ({"weight": None}, TypeError, "weight must be a"),
        ({"x": [1.0]}, TypeError, "x must be a torch.Tensor"),
    ],
)
def test_errors(kwargs, exc, match):
    args = {"x": torch.ones(2, 3), "weight": torch.ones(3), "bias": None}
    args.update(kwargs)
    with pytest.raises(exc, match=match):
        layer_norm(args.pop("x"), args.pop("weight"), args.pop("bias"), None, **args)
    if "bias" not in kwargs:
        args = {"x": torch.ones(2, 3), "weight": torch.ones(3)}
        args.update(kwargs)
        with pytest.raises(exc, match=match):
            rms_norm(args.pop("x"), args.pop("weight"), None, **args)


def test_opcheck_every_op():
    ops = torch.ops.fp8ops
    x, r, w, b, dy, ds = _data((5, 12), torch.float32, seed=3)
    one, amax = torch.tensor(2.0), torch.tensor(3.0)
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        torch.library.opcheck(ops.norm_fwd.default, (x, r, w, b, EPS, False, False, True, one, None, 0, False, dtype,
                                                     True))
        torch.library.opcheck(ops.norm_fwd.default, (x.bfloat16(), None, w, None, EPS, True, True, False, one, amax,
                                                     1, True, dtype, False))
    torch.library.opcheck(ops.norm_fwd.default, (x, None, w, b, EPS, False, False, True, None, None, 0, False, None,
                                                 False))
    torch.library.opcheck(ops.norm_amax.default, (x, r, w, b, EPS, False, True))
    torch.library.opcheck(ops.norm_amax.default, (x, None, w, None, EPS, True, False))
    _, _, _, _, _, _, mean, rstd = ops.norm_fwd(x, None, w, b, EPS, False, False, False, None, None, 0, False, None,
                                                False)
    torch.library.opcheck(ops.norm_bwd.default, (dy, x, w, mean, rstd, ds, False, False, True))
    torch.library.opcheck(ops.norm_bwd.default, (dy.bfloat16(), x, w, rstd, rstd, None, True, True, False))
    seed = torch.tensor(17, dtype=torch.int64)
    torch.library.opcheck(ops.norm_fwd.default, (x, r, w, b, EPS, False, False, True, one, None, 0, False,
                                                 torch.float8_e4m3fn, True, seed, 0.2))
    torch.library.opcheck(ops.norm_amax.default, (x, r, w, b, EPS, False, False, seed, 0.2))
    torch.library.opcheck(ops.norm_bwd_dropout.default, (dy, x, w, mean, rstd, ds, False, False, True, seed, 0.2))


def test_fp8_reference_output():
    x, r, w, b, _, _ = _data((6, 10), torch.float32, seed=4)
    y, _, q, q_t, amax, _, _, _ = torch.ops.fp8ops.norm_fwd(x, r, w, b, EPS, False, False, True, torch.tensor(1.0),
                                                            None, 0, False, torch.float8_e4m3fn, True)
    assert amax.item() == y.abs().max().item()
    assert torch.equal(q_t.float(), q.float().t())
    a = torch.ops.fp8ops.norm_amax(x, r, w, b, EPS, False, False)
    out = torch.ops.fp8ops.norm_fwd(x, r, w, b, EPS, False, False, False, torch.tensor(1.0), a, 0, False,
                                    torch.float8_e4m3fn, False)
    assert out[5].item() == pytest.approx(a.item() / 448.0) and out[0].numel() == 0


# ------------------------------------------------------------------------------------------------
# composition canaries


def _loss(x, w, b, r):
    (y, s), _ = layer_norm(x, w, b, None, residual=r)
    return (y.float() ** 2).sum() + (s.float() * 0.5).sum()


@pytest.fixture
def case():
    x, r, w, b, _, _ = _data((4, 6, 32), torch.float32, seed=5)
    return x, w, b, r


def _eager(x, w, b, r):
    xx, ww, bb, rr = (t.clone().requires_grad_() for t in (x, w, b, r))
    loss = _loss(xx, ww, bb, rr)
    loss.backward()
    return loss.detach(), xx.grad, ww.grad, bb.grad, rr.grad


def test_torch_func_grad_and_vjp(case):
    x, w, b, r = case
    _, gx, gw, gb, gr = _eager(x, w, b, r)
    fx, fw, fb, fr = torch.func.grad(_loss, argnums=(0, 1, 2, 3))(x, w, b, r)
    for a, e in ((fx, gx), (fw, gw), (fb, gb), (fr, gr)):
        assert torch.equal(a, e)
    _, vjp_fn = torch.func.vjp(lambda w: _loss(x, w, b, r), w)
    assert torch.equal(vjp_fn(torch.ones(()))[0], gw)


def test_vmap_equals_loop(case):
    _, w, b, _ = case
    xs = torch.randn(3, 5, 32) * torch.tensor([1.0, 4.0, 0.25])[:, None, None]
    rs = torch.randn(3, 5, 32)
    f = torch.func.grad(_loss, argnums=(0, 1))
    vx, vw = torch.func.vmap(f, in_dims=(0, None, None, 0))(xs, w, b, rs)
    for i in range(3):
        lx, lw = f(xs[i], w, b, rs[i])
        torch.testing.assert_close(vx[i], lx, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(vw[i], lw, rtol=1e-6, atol=1e-6)
    y = torch.func.vmap(lambda x: rms_norm(x, w, None)[0])(xs)
    torch.testing.assert_close(y, torch.stack([rms_norm(x, w, None)[0] for x in xs]), rtol=0, atol=0)


def test_compile_fullgraph_backward_equals_eager(case):
    x, w, b, r = case
    loss, gx, gw, gb, gr = _eager(x, w, b, r)
    torch._dynamo.reset()
    compiled = torch.compile(_loss, fullgraph=True)
    xx, ww, bb, rr = (t.clone().requires_grad_() for t in (x, w, b, r))
    closs = compiled(xx, ww, bb, rr)
    closs.backward()
    torch.testing.assert_close(closs.detach(), loss, rtol=1e-6, atol=0)
    for a, e in ((xx.grad, gx), (ww.grad, gw), (bb.grad, gb), (rr.grad, gr)):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-6)


def test_compile_of_func_grad_raises(case):
    x, w, b, r = case
    torch._dynamo.reset()
    f = torch.compile(torch.func.grad(_loss, argnums=(1,)))
    with pytest.raises(Exception, match="fp8ops"):
        f(x, w, b, r)


def test_calling_convention_and_the_deprecated_bare_return():
    """``state=None`` gives ``(outputs, None)`` like every op; leaving state out still returns the
    bare outputs, with a DeprecationWarning; a state or a recipe is refused (no FP8 norm alone)."""
    x, r, w, b, _, _ = _data((3, 8), torch.float32, seed=5)
    (y, s), st = layer_norm(x, w, b, None, residual=r)
    assert st is None
    y1, st1 = rms_norm(x, w, None)
    assert st1 is None and torch.equal(y1, R.rms_norm(x, w))
    with pytest.warns(DeprecationWarning, match="pass state=None"):
        y_old, s_old = layer_norm(x, w, b, residual=r)
    assert torch.equal(y_old, y) and torch.equal(s_old, s)
    with pytest.warns(DeprecationWarning, match="rms_norm: pass state=None"):
        assert torch.equal(rms_norm(x, w), y1)
    recipe = fp8ops.DelayedScaling()
    with pytest.raises(TypeError, match="layer_norm: state must be None"):
        layer_norm(x, w, b, fp8ops.LinearState.init(recipe))
    with pytest.raises(TypeError, match="rms_norm: recipe must be None"):
        rms_norm(x, w, None, recipe=recipe)


# ------------------------------------------------------------------------------------------------
# residual_dropout=: x dropped before the residual add, in the norm kernel


@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_residual_dropout_forward_and_every_gradient_against_the_reference(rms, dtype):
    """s = x * keep / (1 - p) + residual with the reference mask, y its norm; x's gradient is the
    residual's times the mask's factor, the weight's and bias's those of the norm of s."""
    x, r, w, b, dy, ds = _data((9, 20), dtype, seed=11)
    p, seed = 0.35, 123
    leaves = [t.clone().requires_grad_() for t in (x, r, w, b)]
    xl, rl, wl, bl = leaves
    kw = {"residual": rl, "residual_dropout": p, "dropout_seed": seed}
    if rms:
        (y, s), _ = rms_norm(xl, wl, None, **kw)
    else:
        (y, s), _ = layer_norm(xl, wl, bl, None, **kw)
    torch.autograd.backward([y, s], [dy, ds])
    scale = R.branch_scale(torch.tensor(seed), 9, 20, p)
    assert 0.2 < float((scale == 0).float().mean()) < 0.5
    ref = [t.detach().float().requires_grad_() for t in (x, r, w, b)]
    xr, rr, wr, br = ref
    sr = xr * scale + rr
    yr = (sr * torch.rsqrt(sr.square().mean(-1, keepdim=True) + EPS) * wr if rms
          else F.layer_norm(sr, (20,), wr, br, EPS))
    torch.autograd.backward([yr, sr], [dy.float(), ds.float()])
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(s.float(), sr, **tol)
    torch.testing.assert_close(y.float(), yr, **tol)
    for a, c in zip(leaves[:3] if rms else leaves, ref[:3] if rms else ref):
        torch.testing.assert_close(a.grad.float(), c.grad, **tol)
    assert bool((xl.grad[scale == 0] == 0).all())
    if dtype == torch.float32:
        torch.testing.assert_close(xl.grad, rl.grad * scale, rtol=0, atol=0)


def _norm_draw(seed, row, col):
    # the 16-bit draw of element (row, col) in Python integers: the column pair col >> 1 hashed
    # under the key of (seed, b = 0, h = 0), then the row; the odd column takes the top half, the
    # even one the xor of the halves
    return DH.draw(DH.key(seed, 0, 0), col >> 1, row, bool(col & 1))


def test_residual_dropout_mask_by_hand():
    """The mask of element (row, column): columns 2j and 2j + 1 share one hash and take its two
    halves; the draws written out in integers, a few pinned by value, and the mapping of columns
    onto the attention hash's queries (the reference's definition) checked on its own."""
    seed, M, Kd = -98765432123, 5, 40
    for p in (0.1, 0.5, 0.9):
        keep = R.branch_keep(torch.tensor(seed), M, Kd, p)
        want = torch.tensor([[_norm_draw(seed, i, c) >= round(p * 2**16) for c in range(Kd)] for i in range(M)])
        assert torch.equal(keep, want), p
    # columns 6 and 7 of row 3: one hash, 0x65a7c1cb; column 7 takes its top half 0x65a7 = 26023
    # (0.397 * 2**16), column 6 the xor of the halves 0x65a7 ^ 0xc1cb = 42092 (0.642)
    assert (_norm_draw(seed, 3, 7), _norm_draw(seed, 3, 6)) == (26023, 42092)
    keep = [R.branch_keep(torch.tensor(seed), 4, 8, p)[3, 6:8].tolist() for p in (0.39, 0.40, 0.64, 0.65)]
    assert keep == [[True, True], [True, False], [True, False], [False, False]]
    # column c is the attention query q(c): 0 -> 0, 1 -> 8, 2 -> 1, 3 -> 9, ..., 15 -> 15, 16 -> 16, 17 -> 24
    q = torch.tensor([0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15, 16, 24])
    rows = torch.arange(3)[:, None]
    z = torch.zeros((), dtype=torch.int64)
    from fp8ops.reference.attention import dropout_keep

    assert torch.equal(R.branch_keep(torch.tensor(seed), 3, 18, 0.5),
                       dropout_keep(torch.tensor(seed), z, z, q[None, :], rows, 0.5))


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_residual_dropout_mask_neighbours_are_uncorrelated(p):
    # keep decisions 1..8 columns apart (the two columns of a pair at lag 1 where aligned), and of
    # neighbouring rows: correlations within 4.5 standard errors of zero over 1024 x 2048
    # elements; the keep rate within 4.5 standard errors of 1 - p
    k = R.branch_keep(torch.tensor(77), 1024, 2048, p).double() - (1 - p)
    var = p * (1 - p)
    assert abs(k.mean().item() / (var / k.numel()) ** 0.5) < 4.5
    for lag in range(1, 9):
        a, b = k[:, :-lag], k[:, lag:]
        assert abs((a * b).mean().item() / var * a.numel() ** 0.5) < 4.5, lag
    a, b = k[:, 0::2], k[:, 1::2]
    assert abs((a * b).mean().item() / var * a.numel() ** 0.5) < 4.5, "pairs"
    for lag in (1, 2, 8):
        a, b = k[:-lag], k[lag:]
        assert abs((a * b).mean().item() / var * a.numel() ** 0.5) < 4.5, ("rows", lag)


def test_residual_dropout_errors_and_seeds():
    x, r, w, b, _, _ = _data((4, 8), torch.float32, seed=2)
    with pytest.raises(ValueError, match="layer_norm: residual_dropout=0.1 drops x before its residual add"):
        layer_norm(x, w, b, None, residual_dropout=0.1)
    with pytest.raises(ValueError, match=r"rms_norm: residual_dropout must be a number in \[0, 1\), got 1"):
        rms_norm(x, w, None, residual=r, residual_dropout=1)
    with pytest.raises(TypeError, match="layer_norm: dropout_seed must be an int"):
        layer_norm(x, w, b, None, residual=r, residual_dropout=0.5, dropout_seed="7")
    (y1, s1), _ = layer_norm(x, w, b, None, residual=r, residual_dropout=0.5, dropout_seed=7)
    (y2, s2), _ = layer_norm(x, w, b, None, residual=r, residual_dropout=0.5, dropout_seed=torch.tensor(7))
    (y3, s3), _ = layer_norm(x, w, b, None, residual=r, residual_dropout=0.5, dropout_seed=8)
    assert torch.equal(s1, s2) and torch.equal(y1, y2) and not torch.equal(s1, s3)
    (_, s0), _ = layer_norm(x, w, b, None, residual=r)
    assert torch.equal(s0, x + r)


def test_residual_dropout_under_func_grad_and_compile_matches_eager():
    x, r, w, b, dy, ds = _data((6, 16), torch.float32, seed=5)
    seed = torch.tensor(99)

    def loss(xx, rr, ww):
        (y, s), _ = layer_norm(xx, ww, b, None, residual=rr, residual_dropout=0.25, dropout_seed=seed)
        return (y * dy).sum() + (s * ds).sum()

    leaves = [t.clone().requires_grad_() for t in (x, r, w)]
    loss(*leaves).backward()
    grads = torch.func.grad(loss, argnums=(0, 1, 2))(x, r, w)
    for g, t in zip(grads, leaves):
        assert torch.equal(g, t.grad)
    torch._dynamo.reset()
    leaves2 = [t.clone().requires_grad_() for t in (x, r, w)]
    torch.compile(loss, fullgraph=True, backend="aot_eager")(*leaves2).backward()
    for a, c in zip(leaves2, leaves):
        assert torch.equal(a.grad, c.grad)
