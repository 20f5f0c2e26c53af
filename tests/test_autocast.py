"""torch.autocast on CPU: every op computes as torch's equivalent does inside autocast.

Linear-like ops (fp8_linear, layernorm_linear, fused_ln_mlp, attention) cast their floating inputs
and parameters to the autocast dtype outside their autograd Function and return that dtype, FP8 or
not: the result equals the op called outside autocast on inputs cast to bfloat16 by hand (bitwise),
and the gradients reach the float32 parameters in float32, equal to the hand-cast gradients.
Norms and fake_quantize are not cast (as torch's layer_norm / rms_norm / fake_quantize on CPU):
float32 in, float32 out, the same as outside autocast.
"""

import pytest
import torch

import fp8ops
from fp8ops import DelayedScaling, LayerNormLinearState, LayerNormMLPState, LinearState

BF16 = torch.bfloat16
DELAYED = DelayedScaling(amax_history_len=4)


def _randn(*shape, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * scale


def _leaves(ts, dtype=None):
    return [None if t is None else (t if dtype is None else t.to(dtype)).clone().requires_grad_() for t in ts]


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def _grads_of(out, leaves, dy):
    torch.autograd.backward(_first(out).float(), dy)
    return [None if t is None else t.grad for t in leaves]


def _check_linear_like(fn, tensors, *, compiled=False, grad_tol=0.0):
    """``fn(*tensors) -> (y, new_state)`` under autocast(bf16) on float32 leaves vs outside on
    hand-cast bfloat16 leaves: same dtype, values, states and gradients (gradients in float32;
    bitwise unless ``grad_tol``, a bf16-sized rtol/atol)."""
    a = _leaves(tensors)
    f = torch.compile(fn, fullgraph=True, backend="aot_eager") if compiled else fn
    with torch.autocast("cpu", dtype=BF16):
        y, st = f(*a)
    b = _leaves(tensors, BF16)
    y_ref, st_ref = fn(*b)
    assert _first(y).dtype == BF16
    torch.testing.assert_close(y, y_ref, rtol=0, atol=0)
    if st_ref is not None:
        for sa, sb in zip(torch.utils._pytree.tree_leaves(st), torch.utils._pytree.tree_leaves(st_ref)):
            torch.testing.assert_close(sa, sb, rtol=0, atol=0)
    dy = _randn(*_first(y).shape, seed=99)
    ga, gb = _grads_of(y, a, dy), _grads_of(y_ref, b, dy)
    for i, (t, g, r) in enumerate(zip(a, ga, gb)):
        if t is None:
            continue
        assert g is not None and g.dtype == torch.float32, (i, None if g is None else g.dtype)
        torch.testing.assert_close(g, r.float(), rtol=grad_tol, atol=grad_tol, msg=lambda m: f"gradient {i}: {m}")
    return y


# ------------------------------------------------------------------------------------------------
# fp8_linear


def _linear_tensors(bias=True):
    return [_randn(3, 5, 32, seed=0, scale=2.0), _randn(24, 32, seed=1, scale=32**-0.5),
            _randn(24, seed=2) if bias else None]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("recipe", [None, DELAYED], ids=["hp", "delayed"])
def test_fp8_linear(recipe, compiled):
    st = None if recipe is None else LinearState.init(recipe)

    def fn(x, w, b):
        return fp8ops.fp8_linear(x, w, b, st, recipe=recipe)

    _check_linear_like(fn, _linear_tensors(), compiled=compiled)


def test_fp8_linear_probe_and_wgrad_dtype():
    """The probe gets amax(dy) of the bf16 output; wgrad_dtype=float32 (the weight's own) is accepted."""
    x, w, b = _linear_tensors(bias=False)
    st = LinearState.init(DELAYED)
    w = w.requires_grad_()
    p = torch.zeros((), requires_grad=True)
    with torch.autocast("cpu", dtype=BF16):
        y, _ = fp8ops.fp8_linear(x, w, None, st, recipe=DELAYED, grad_probe=p, wgrad_dtype=torch.float32)
    assert y.dtype == BF16
    dy = _randn(*y.shape, seed=5)
    y.backward(dy.to(BF16))
    assert w.grad.dtype == torch.float32
    w2 = w.detach().to(BF16).requires_grad_()
    p2 = torch.zeros((), requires_grad=True)
    y2, _ = fp8ops.fp8_linear(x.to(BF16), w2, None, st, recipe=DELAYED, grad_probe=p2)
    y2.backward(dy.to(BF16))
    assert torch.equal(y, y2) and torch.equal(p.grad, p2.grad) and torch.equal(w.grad, w2.grad.float())


def test_fp8_linear_weight_cache():
    """A weight cache is used as built (its fp32 weight is not cast); x is cast, y is bf16."""
    x, w, b = _linear_tensors()
    st = LinearState.init(DELAYED)
    w = w.requires_grad_()
    qw, st = fp8ops.quantize_weight(w, st, recipe=DELAYED)
    with torch.autocast("cpu", dtype=BF16):
        y, _ = fp8ops.fp8_linear(x, w, b, st, recipe=DELAYED, weight_cache=qw)
    y_ref, _ = fp8ops.fp8_linear(x.to(BF16), w, b.to(BF16), st, recipe=DELAYED, weight_cache=qw)
    assert y.dtype == BF16 and torch.equal(y, y_ref)
    y.float().sum().backward()
    assert w.grad.dtype == torch.float32


def test_fp8_linear_torch_func():
    """torch.func.grad through the cast: float32 gradients equal to the hand-cast ones."""
    x, w, b = _linear_tensors()

    def loss(w, b):
        with torch.autocast("cpu", dtype=BF16):
            y, _ = fp8ops.fp8_linear(x, w, b, None, recipe=None)
        return y.float().square().sum()

    def loss_ref(w, b):
        y, _ = fp8ops.fp8_linear(x.to(BF16), w, b, None, recipe=None)
        return y.float().square().sum()

    gw, gb = torch.func.grad(loss, argnums=(0, 1))(w, b)
    rw, rb = torch.func.grad(loss_ref, argnums=(0, 1))(w.to(BF16), b.to(BF16))
    assert gw.dtype == gb.dtype == torch.float32
    assert torch.equal(gw, rw.float()) and torch.equal(gb, rb.float())


def test_matches_torch_linear_dtype_and_close():
    """The high-precision path agrees with F.linear under autocast (dtype, values to bf16 accuracy)."""
    x, w, b = _linear_tensors()
    with torch.autocast("cpu", dtype=BF16):
        y, _ = fp8ops.fp8_linear(x, w, b, None, recipe=None)
        y_t = torch.nn.functional.linear(x, w, b)
    assert y.dtype == y_t.dtype == BF16
    torch.testing.assert_close(y, y_t, rtol=2e-2, atol=2e-2)


# ------------------------------------------------------------------------------------------------
# layernorm_linear and fused_ln_mlp


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("recipe", [None, DELAYED], ids=["hp", "delayed"])
def test_layernorm_linear(recipe, compiled):
    st = None if recipe is None else LayerNormLinearState.init(recipe)
    K, N = 32, 24
    tensors = [_randn(4, 6, K, seed=0, scale=2.0), 1 + 0.1 * _randn(K, seed=1), 0.1 * _randn(K, seed=2),
               _randn(N, K, seed=3, scale=K**-0.5), _randn(N, seed=4)]

    def fn(x, g, beta, w, b):
        (y, ln), st2 = fp8ops.layernorm_linear(x, g, beta, w, b, st, recipe=recipe, return_layernorm_output=True)
        return (y, ln), st2

    y, ln = _check_linear_like(fn, tensors, compiled=compiled)
    assert ln.dtype == BF16


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("recipe", [None, DELAYED], ids=["hp", "delayed"])
def test_fused_ln_mlp(recipe, compiled):
    st = None if recipe is None else LayerNormMLPState.init(recipe)
    K, F = 32, 48
    tensors = [_randn(4, 6, K, seed=0, scale=2.0), 1 + 0.1 * _randn(K, seed=1), None,
               _randn(2 * F, K, seed=3, scale=K**-0.5), _randn(2 * F, seed=4),
               _randn(K, F, seed=5, scale=F**-0.5), None]

    def fn(x, g, beta, w1, b1, w2, b2):
        return fp8ops.fused_ln_mlp(x, g, beta, w1, b1, w2, b2, st, recipe=recipe, normalization="RMSNorm",
                                   activation="swiglu")

    _check_linear_like(fn, tensors, compiled=compiled)


# ------------------------------------------------------------------------------------------------
# attention


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("kw", [dict(causal=True), dict(window=(3, 0), return_lse=True)], ids=["sdpa", "reference"])
def test_attention(kw, compiled):
    tensors = [_randn(2, 4, 8, 16, seed=0), _randn(2, 2, 8, 16, seed=1), _randn(2, 2, 8, 16, seed=2)]

    def fn(q, k, v):
        out, st = fp8ops.attention(q, k, v, **kw)
        return out, st

    # Compiled, AOT autograd traces attention's backward under the caller's autocast state, which
    # rounds its gradients differently from the eager backward (by a bf16 ulp or so): compared
    # with a bf16 tolerance there; the forward stays bitwise.
    _check_linear_like(fn, tensors, compiled=compiled, grad_tol=2e-2 if compiled else 0.0)


def test_attention_matches_sdpa_dtype():
    q, k, v = (_randn(1, 2, 8, 16, seed=i) for i in range(3))
    with torch.autocast("cpu", dtype=BF16):
        out, _ = fp8ops.attention(q, k, v, causal=True)
        ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert out.dtype == ref.dtype == BF16
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)


# ------------------------------------------------------------------------------------------------
# norms and fake_quantize: not cast (float32 in, float32 out, as torch's layer_norm on CPU)


def _norm_cases():
    K = 32
    x, r = _randn(4, 6, K, seed=0, scale=2.0), _randn(4, 6, K, seed=5)
    g, beta = 1 + 0.1 * _randn(K, seed=1), 0.1 * _randn(K, seed=2)
    return [
        ("layer_norm", lambda x, g, beta, r: fp8ops.layer_norm(x, g, beta, None)[0],
         lambda x, g, beta, r: torch.nn.functional.layer_norm(x, (K,), g, beta), (x, g, beta, r)),
        ("rms_norm_residual", lambda x, g, beta, r: fp8ops.rms_norm(x, g, None, residual=r)[0],
         lambda x, g, beta, r: torch.nn.functional.rms_norm(x, (K,), g), (x, g, beta, r)),
    ]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("case", _norm_cases(), ids=lambda c: c[0])
def test_norms_stay_float32(case, compiled):
    _, op, torch_op, tensors = case
    a = _leaves(tensors)
    f = torch.compile(op, fullgraph=True, backend="aot_eager") if compiled else op
    with torch.autocast("cpu", dtype=BF16):
        out = f(*a)
        ref_dtype = torch_op(*tensors).dtype
    b = _leaves(tensors)
    out_ref = op(*b)
    assert _first(out).dtype == ref_dtype == torch.float32
    torch.testing.assert_close(out, out_ref, rtol=0, atol=0)
    dy = _randn(*_first(out).shape, seed=9)
    for g, r in zip(_grads_of(out, a, dy), _grads_of(out_ref, b, dy)):
        if r is not None:
            assert g.dtype == torch.float32
            torch.testing.assert_close(g, r, rtol=0, atol=0)


def test_fake_quantize_keeps_dtype():
    st = fp8ops.FakeQuantState.init(DELAYED)
    x = _randn(4, 32, seed=0)
    with torch.autocast("cpu", dtype=BF16):
        y, st1 = fp8ops.fake_quantize(x, st, recipe=DELAYED)
    y_ref, st_ref = fp8ops.fake_quantize(x, st, recipe=DELAYED)
    assert y.dtype == torch.float32 and torch.equal(y, y_ref)
    assert torch.equal(st1.input.pending_amax, st_ref.input.pending_amax)


# ------------------------------------------------------------------------------------------------
# no autocast: nothing changes


def test_without_autocast_float32():
    x, w, b = _linear_tensors()
    y, _ = fp8ops.fp8_linear(x, w, b, None, recipe=None)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, torch.nn.functional.linear(x, w, b))
    with torch.autocast("cpu", dtype=BF16, enabled=False):
        y2, _ = fp8ops.fp8_linear(x, w, b, None, recipe=None)
    assert torch.equal(y, y2)
    y3, _ = fp8ops.fp8_linear(x, w, b, LinearState.init(DELAYED), recipe=DELAYED)
    assert y3.dtype == torch.float32
    q = _randn(1, 2, 8, 16, seed=0)
    assert fp8ops.attention(q, q, q)[0].dtype == torch.float32
    K = 32
    x = _randn(4, K, seed=1)
    y4, _ = fp8ops.layernorm_linear(x, torch.ones(K), None, w, None, None, recipe=None)
    assert y4.dtype == torch.float32


def test_autocast_dtype_helper():
    from fp8ops._glue import autocast_dtype

    assert autocast_dtype("cpu") is None
    with torch.autocast("cpu", dtype=torch.float16):
        assert autocast_dtype("cpu") is torch.float16
        assert autocast_dtype("meta") is None
        with torch.autocast("cpu", enabled=False):
            assert autocast_dtype("cpu") is None


def test_float16_autocast():
    x, w, b = _linear_tensors()
    with torch.autocast("cpu", dtype=torch.float16):
        y, _ = fp8ops.fp8_linear(x, w, b, None, recipe=None)
    assert y.dtype == torch.float16
    assert torch.equal(y, fp8ops.fp8_linear(x.half(), w.half(), b.half(), None, recipe=None)[0])
