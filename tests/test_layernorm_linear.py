"""layernorm_linear on CPU: forward and every gradient vs the FP32 reference, the returned norm
output, zero-centered gamma, precision escapes and errors."""

import pytest
import torch

import fp8ops
from fp8ops import (
    DelayedScaling,
    GemmSpec,
    LayerNormLinearState,
)
from fp8ops.reference import layernorm_linear as R
from fp8ops.reference import norm as RN
from fp8ops.testing import rel_error
from fp8ops.testing.states import calibrate
from fp8ops.testing.composition import RECIPES as RECIPE_NAMES, make_recipe

RECIPES = {name: make_recipe(name) for name in RECIPE_NAMES}  # none, delayed (history 4), current, rowwise
DELAYED = RECIPES["delayed"]


def _lnl_state(recipe, calibrated):
    if recipe is None:
        return None
    st = LayerNormLinearState.init(recipe)
    return calibrate(st, recipe, scales={"input": 64.0, "weight": 256.0, "grad_output": 2.0**12}) if calibrated else st


def _tol(dtype, recipe):
    if dtype == torch.float32:
        return 1e-5 if recipe is None else 2e-4
    return 2e-2


def _lnl_data(lead, K, N, dtype, rms, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(*lead, K, generator=g) * 3 + 1).to(dtype)
    ln_w = (1 + 0.1 * torch.randn(K, generator=g)).to(dtype)
    ln_b = None if rms else (0.1 * torch.randn(K, generator=g)).to(dtype)
    w = (torch.randn(N, K, generator=g) / K**0.5).to(dtype)
    b = torch.randn(N, generator=g).to(dtype)
    dy = (torch.randn(*lead, N, generator=g) * 1e-2).to(dtype)
    return x, ln_w, ln_b, w, b, dy


def _leaf(t):
    return None if t is None else t.clone().requires_grad_()


def _run_lnl(x, ln_w, ln_b, w, b, dy, st, recipe, *, probe=True, **kw):
    leaves = [_leaf(t) for t in (x, ln_w, ln_b, w, b)]
    p = torch.zeros((), requires_grad=True) if probe and recipe is not None else None
    y, st2 = fp8ops.layernorm_linear(*leaves, st, recipe=recipe, grad_probe=p, **kw)
    y.backward(dy)
    grads = [None if t is None else t.grad for t in leaves]
    return y.detach(), grads, (p.grad if p is not None else None), st2


@pytest.mark.parametrize("rname", list(RECIPES))
@pytest.mark.parametrize("calibrated", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("shape", [((3, 5), 40, 24), ((7,), 17, 13)])
def test_layernorm_linear_matches_reference(rname, calibrated, dtype, norm, shape):
    recipe = RECIPES[rname]
    if recipe is None and not calibrated:
        pytest.skip("no state without FP8")
    lead, K, N = shape
    rms = norm == "RMSNorm"
    x, ln_w, ln_b, w, b, dy = _lnl_data(lead, K, N, dtype, rms)
    st = _lnl_state(recipe, calibrated)
    y, (dx, dlnw, dlnb, dw, db), pg, st2 = _run_lnl(x, ln_w, ln_b, w, b, dy, st, recipe, normalization=norm)
    ref = R.layernorm_linear(x, ln_w, ln_b, w, b, st, dy, recipe=recipe, normalization=norm)
    tol = _tol(dtype, recipe)
    for name, got, want in [("y", y.reshape(ref["y"].shape), ref["y"]), ("dx", dx, ref["dx"]),
                            ("dln_w", dlnw, ref["dln_w"]), ("dw", dw, ref["dw"]), ("db", db, ref["db"])]:
        assert got.dtype == (dtype if name != "dln_w" else ln_w.dtype)
        assert rel_error(got, want) <= tol, f"{name}: rel err {rel_error(got, want):.2e} > {tol:.0e}"
    if not rms:
        assert rel_error(dlnb, ref["dln_b"]) <= tol
    if recipe is None:
        assert st2 is None and pg is None
        return
    assert torch.allclose(pg, ref["amax_dy"], rtol=1e-2 if dtype != torch.float32 else 1e-6)
    # row-wise scaling observes the normalised output after its rounding to x.dtype
    rtol = 1e-2 if recipe.mode == "rowwise" and dtype != torch.float32 else 1e-5
    assert not st2.input.pending_amax.requires_grad
    assert torch.allclose(st2.input.pending_amax, ref["amax_ln"], rtol=rtol)
    assert torch.equal(st2.weight.pending_amax, ref["amax_w"])
    assert torch.equal(st2.grad_output.pending_amax, st.grad_output.pending_amax)  # arrives through the probe


def test_layernorm_linear_returns_differentiable_layernorm_output():
    x, ln_w, ln_b, w, b, dy = _lnl_data((6,), 24, 16, torch.float32, False)
    st = _lnl_state(DELAYED, True)
    leaves = [_leaf(t) for t in (x, ln_w, ln_b, w, b)]
    (y, ln), _ = fp8ops.layernorm_linear(*leaves, st, recipe=DELAYED, return_layernorm_output=True)
    ref = R.layernorm_linear(x, ln_w, ln_b, w, b, st, dy, recipe=DELAYED, has_probe=False)
    assert rel_error(ln, ref["ln"]) < 1e-5
    dln_extra = torch.randn_like(ln)
    torch.autograd.backward([y, ln], [dy, dln_extra])
    # the extra gradient flows through the norm's backward, added to the dgrad output
    x32 = x.clone().requires_grad_()
    lnr = RN.norm32(x32, ln_w, ln_b, rms=False, eps=1e-5, zero_centered_gamma=False)
    (dx_extra,) = torch.autograd.grad(lnr, x32, dln_extra)
    assert rel_error(leaves[0].grad, ref["dx"] + dx_extra) < 1e-4


def test_layernorm_output_alone_carries_the_gradient():
    # Only the returned norm output feeds the loss: the GEMM's output gets no gradient at all.
    x, ln_w, ln_b, w, b, _dy = _lnl_data((6,), 24, 16, torch.float32, False)
    st = _lnl_state(DELAYED, True)
    leaves = [_leaf(t) for t in (x, ln_w, ln_b, w, b)]
    (_y, ln), _ = fp8ops.layernorm_linear(*leaves, st, recipe=DELAYED, return_layernorm_output=True)
    dln = torch.randn_like(ln)
    ln.backward(dln)
    x32 = x.clone().requires_grad_()
    lnr = RN.norm32(x32, ln_w, ln_b, rms=False, eps=1e-5, zero_centered_gamma=False)
    (dx,) = torch.autograd.grad(lnr, x32, dln)
    assert rel_error(leaves[0].grad, dx) < 1e-5
    assert float(leaves[3].grad.abs().max()) == 0.0 and float(leaves[4].grad.abs().max()) == 0.0


def test_zero_centered_gamma_multiplies_by_one_plus_weight():
    x, ln_w, ln_b, w, b, _dy = _lnl_data((5,), 32, 8, torch.float32, False)
    y0, _ = fp8ops.layernorm_linear(x, ln_w, ln_b, w, b, None, recipe=None)
    y1, _ = fp8ops.layernorm_linear(x, ln_w - 1, ln_b, w, b, None, recipe=None, zero_centered_gamma=True)
    torch.testing.assert_close(y0, y1, rtol=1e-5, atol=1e-5)


def test_precision_escapes_match_reference():
    recipe = DelayedScaling(amax_history_len=4, dgrad=GemmSpec(precision="high"), wgrad=GemmSpec(precision="high"))
    x, ln_w, ln_b, w, b, dy = _lnl_data((4, 3), 40, 24, torch.float32, False)
    st = _lnl_state(recipe, True)
    y, (dx, dlnw, _dlnb, dw, _db), _, _ = _run_lnl(x, ln_w, ln_b, w, b, dy, st, recipe)
    ref = R.layernorm_linear(x, ln_w, ln_b, w, b, st, dy, recipe=recipe)
    for got, want in [(y.reshape(ref["y"].shape), ref["y"]), (dx, ref["dx"]), (dw, ref["dw"]), (dlnw, ref["dln_w"])]:
        assert rel_error(got, want) < 2e-4


def test_layernorm_linear_errors():
    x, ln_w, ln_b, w, b, _ = _lnl_data((4,), 8, 6, torch.float32, False)
    st = _lnl_state(DELAYED, True)
    with pytest.raises(ValueError, match="ln_weight must have shape"):
        fp8ops.layernorm_linear(x, ln_w[:3], ln_b, w, b, st, recipe=DELAYED)
    with pytest.raises(ValueError, match="RMSNorm has no bias"):
        fp8ops.layernorm_linear(x, ln_w, ln_b, w, b, st, recipe=DELAYED, normalization="RMSNorm")
    with pytest.raises(ValueError, match="weight is"):
        fp8ops.layernorm_linear(x, ln_w, ln_b, w[:, :5], b, st, recipe=DELAYED)
    with pytest.raises(ValueError, match="grad_probe is only meaningful"):
        fp8ops.layernorm_linear(x, ln_w, ln_b, w, b, None, recipe=None, grad_probe=torch.zeros(()))


# ------------------------------------------------------------------------------------------------
# weight_cache: the weight quantized once per optimizer step (fp8ops.quantize_weight)

CACHE_CASES = {  # name: (recipe, calibrated state)
    "delayed": (DELAYED, True),
    "delayed-first-step": (DELAYED, False),
    "current": (RECIPES["current"], False),
    "rowwise": (RECIPES["rowwise"], False),
    "dgrad-high": (DelayedScaling(amax_history_len=4, dgrad=GemmSpec(precision="high")), True),
    "fprop-high": (DelayedScaling(amax_history_len=4, fprop=GemmSpec(precision="high")), True),
}


def _without_transpose(c):
    """The cache ``c`` without its transposed copy: the op transposes the bytes in its backward."""
    return fp8ops.WeightCache(fp8ops.Float8Value(c.value.data, c.value.inv_scale), None, c.scale, c.recipe, c.weight)


def _lnl_micro_batches(recipe, calibrated, *, cache, micro=1, grads="all", dtype=torch.float32, **kw):
    """``micro`` micro-batches through layernorm_linear with the same parameter leaves (their
    gradients accumulate) and the state threaded through; with ``cache`` the weight is quantized
    once, first. ``grads``: "all", "no_x" (x and the norm's parameters need no gradient: no dgrad)
    or "no_w" (the weight needs none: no wgrad). Returns the per-micro-batch outputs, x gradients
    and probe gradients, the parameters' gradients, and the final state as a flat dict."""
    x, ln_w, ln_b, w, b, dy = _lnl_data((3, 5), 40, 24, dtype, False)
    batches = [(x, dy)]
    for i in range(1, micro):
        xi, *_, dyi = _lnl_data((3, 5), 40, 24, dtype, False, seed=i)
        batches.append((xi, dyi))
    params = [t.clone().requires_grad_(not (grads == "no_x" and i < 2) and not (grads == "no_w" and i == 2))
              for i, t in enumerate((ln_w, ln_b, w, b))]
    st = _lnl_state(recipe, calibrated)
    extra = {}
    if cache:
        extra["weight_cache"], st = fp8ops.quantize_weight(params[2], st, recipe=recipe)
        if cache == "no_t":
            extra["weight_cache"] = _without_transpose(extra["weight_cache"])
    out = []
    for xb, dyb in batches:
        xl = xb.clone().requires_grad_(grads != "no_x")
        p = torch.zeros((), requires_grad=True)
        y, st = fp8ops.layernorm_linear(xl, *params, st, recipe=recipe, grad_probe=p, **extra, **kw)
        y.backward(dyb)
        out += [y.detach(), xl.grad, p.grad]
    return out + [t.grad for t in params], fp8ops.state_dict(st)


def _assert_same(got, ref):
    (g, g_st), (r, r_st) = got, ref
    assert len(g) == len(r)
    for i, (a, b) in enumerate(zip(g, r)):
        assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), f"output/gradient {i} differs"
    assert g_st.keys() == r_st.keys()
    for k in r_st:
        assert torch.equal(g_st[k], r_st[k]), f"state {k}: {g_st[k]} != {r_st[k]}"


@pytest.mark.parametrize("case", list(CACHE_CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_cache_gives_the_same_bits(case, dtype):
    """With a cache: the same output, every gradient and probe gradient, and the same state (amax(W)
    recorded by quantize_weight instead of the op) as without one."""
    recipe, calibrated = CACHE_CASES[case]
    _assert_same(_lnl_micro_batches(recipe, calibrated, cache=True, dtype=dtype),
                 _lnl_micro_batches(recipe, calibrated, cache=False, dtype=dtype))


@pytest.mark.parametrize("case", ["delayed", "current"])
@pytest.mark.parametrize("grads", ["all", "no_x", "no_w"])
def test_weight_cache_reused_over_two_micro_batches(case, grads):
    recipe, calibrated = CACHE_CASES[case]
    _assert_same(_lnl_micro_batches(recipe, calibrated, cache=True, micro=2, grads=grads),
                 _lnl_micro_batches(recipe, calibrated, cache=False, micro=2, grads=grads))


@pytest.mark.parametrize("case", ["delayed", "current", "dgrad-high"])
@pytest.mark.parametrize("grads", ["all", "no_w"])
def test_weight_cache_without_transposed_copy_gives_the_same_bits(case, grads):
    """A cache without ``data_t`` (one scale per tensor): the backward transposes the cached bytes."""
    recipe, calibrated = CACHE_CASES[case]
    _assert_same(_lnl_micro_batches(recipe, calibrated, cache="no_t", micro=2, grads=grads),
                 _lnl_micro_batches(recipe, calibrated, cache=False, micro=2, grads=grads))


def test_weight_cache_without_transposed_copy_refuses_rowwise_scales():
    recipe, calibrated = CACHE_CASES["rowwise"]
    with pytest.raises(ValueError, match=r"layernorm_linear: weight_cache has no transposed copy .* row-wise"):
        _lnl_micro_batches(recipe, calibrated, cache="no_t")


def test_weight_cache_with_the_layernorm_output():
    x, ln_w, ln_b, w, b, _ = _lnl_data((4,), 24, 16, torch.float32, False)
    st = _lnl_state(DELAYED, True)
    qw, st_c = fp8ops.quantize_weight(w, st, recipe=DELAYED)
    (y, ln), _ = fp8ops.layernorm_linear(x, ln_w, ln_b, w, b, st_c, recipe=DELAYED, weight_cache=qw,
                                         return_layernorm_output=True)
    (y_ref, ln_ref), _ = fp8ops.layernorm_linear(x, ln_w, ln_b, w, b, st, recipe=DELAYED, return_layernorm_output=True)
    assert torch.equal(y, y_ref) and torch.equal(ln, ln_ref)


@pytest.mark.parametrize("case", ["delayed", "current", "rowwise"])
def test_weight_cache_operands_are_what_the_gemms_read(case):
    """The forward and dgrad GEMMs read the cached FP8 operands only, never the weight's values:
    a cache of W next to an all-zero stand-in weight (as FSDP's FP8 all-gather passes) gives the
    results of W, and W's gradient reaches the stand-in."""
    recipe, calibrated = CACHE_CASES[case]
    x, ln_w, ln_b, w, b, dy = _lnl_data((3, 5), 40, 24, torch.float32, False)
    st = _lnl_state(recipe, calibrated)
    qw, st_c = fp8ops.quantize_weight(w, st, recipe=recipe)
    stand_in = torch.zeros_like(w, requires_grad=True)
    cache = fp8ops.WeightCache(qw.value, qw.inv_scale_t, qw.scale, recipe, stand_in)
    got, ref = [], []
    for weight, kw, out in ((stand_in, {"weight_cache": cache}, got), (w.clone().requires_grad_(), {}, ref)):
        xl = x.clone().requires_grad_()
        y, _ = fp8ops.layernorm_linear(xl, ln_w, ln_b, weight, b, st_c, recipe=recipe, **kw)
        y.backward(dy)
        out += [y, xl.grad, weight.grad]
    for name, a, r in zip(["y", "dx", "dw"], got, ref):
        assert torch.equal(a, r), name


def test_weight_cache_amax_is_recorded_by_quantize_weight_not_the_op():
    x, ln_w, ln_b, w, b, _ = _lnl_data((4,), 24, 16, torch.float32, False)
    st = _lnl_state(DELAYED, True)
    qw, st_c = fp8ops.quantize_weight(w, st, recipe=DELAYED)
    assert st_c.weight.pending_amax.item() == w.abs().max().item()
    _, st2 = fp8ops.layernorm_linear(x, ln_w, ln_b, w, b, st_c, recipe=DELAYED, weight_cache=qw)
    assert st2.weight.pending_amax.item() == w.abs().max().item()
    # given the state from before quantize_weight (same scale: accepted), the op records no amax(W)
    _, st3 = fp8ops.layernorm_linear(x, ln_w, ln_b, w, b, st, recipe=DELAYED, weight_cache=qw)
    assert st3.weight.pending_amax.item() == 0.0 and st3.input.pending_amax.item() > 0


def test_weight_cache_under_autocast_uses_the_weight_as_built():
    """Inside torch.autocast the cached weight is not cast (the cache was built from the FP32
    weight): the same bits as the op on the cast inputs with the FP32 weight's cache."""
    x, ln_w, ln_b, w, b, dy = _lnl_data((4,), 24, 16, torch.float32, False)
    w = w.requires_grad_()
    qw, st = fp8ops.quantize_weight(w, _lnl_state(DELAYED, True), recipe=DELAYED)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, _ = fp8ops.layernorm_linear(x, ln_w, ln_b, w, b, st, recipe=DELAYED, weight_cache=qw)
    bf = [t.to(torch.bfloat16) for t in (x, ln_w, ln_b, b)]
    y_ref, _ = fp8ops.layernorm_linear(*bf[:3], w, bf[3], st, recipe=DELAYED, weight_cache=qw)
    assert y.dtype == torch.bfloat16 and torch.equal(y, y_ref)
    y.backward(dy.to(y.dtype))
    assert w.grad.dtype == torch.float32


def test_weight_cache_errors():
    x, ln_w, ln_b, w, b, _ = _lnl_data((4,), 8, 6, torch.float32, False)
    st = _lnl_state(DELAYED, True)
    qw, st = fp8ops.quantize_weight(w, st, recipe=DELAYED)

    def call(weight=w, bias=b, state=st, recipe=DELAYED, cache=qw):
        return fp8ops.layernorm_linear(x, ln_w, ln_b, weight, bias, state, recipe=recipe, weight_cache=cache)

    fixes = r"rebuild it with quantize_weight\(weight, state\.weight, recipe=\.\.\.\)"
    cases = [
        (dict(state=None, recipe=None), ValueError, "weight_cache is only meaningful with FP8 .* pass weight_cache=None"),
        (dict(cache=object()), TypeError, "weight_cache must be a WeightCache from quantize_weight, got object"),
        (dict(cache=(qw,)), TypeError, "weight_cache must be a WeightCache from quantize_weight, got tuple"),
        (dict(recipe=DelayedScaling(amax_history_len=4, margin=1)), ValueError,
         "weight_cache was built with another recipe .*; " + fixes),
        (dict(state=fp8ops.update(st, recipe=DELAYED)), ValueError,
         r"weight_cache was built with another weight state \(stale after fp8ops\.update\?\); " + fixes),
        (dict(weight=w[:4], bias=b[:4]), ValueError, r"weight_cache holds a \(6, 8\) weight, expected \(4, 8\)"),
        (dict(weight=w.clone()), ValueError, "weight_cache was built from another weight tensor than weight; " + fixes),
    ]
    for kw, exc, match in cases:
        with pytest.raises(exc, match="^layernorm_linear: " + match):
            call(**kw)
    # a detached alias of the weight is the same weight
    y, _ = call(weight=w.detach())
    assert torch.equal(y, call()[0])


def test_weight_cache_under_func_grad_and_compile():
    """The cache passes through torch.func.grad (the weight wrapped by the transform is still its
    weight) and torch.compile(fullgraph=True), forward and backward, with the eager results."""
    x, ln_w, ln_b, w, b, dy = _lnl_data((6,), 24, 16, torch.float32, False)
    w = w.requires_grad_()
    qw, st = fp8ops.quantize_weight(w, _lnl_state(DELAYED, True), recipe=DELAYED)

    def loss(x, w, st, qw, p):
        y, _ = fp8ops.layernorm_linear(x, ln_w, ln_b, w, b, st, recipe=DELAYED, grad_probe=p, weight_cache=qw)
        return (y * dy).sum()

    compiled = torch.compile(loss, backend="aot_eager", fullgraph=True)
    grads = []
    for fn in (loss, compiled):
        xl, p = x.clone().requires_grad_(), torch.zeros((), requires_grad=True)
        fn(xl, w, st, qw, p).backward()
        grads.append((xl.grad, w.grad, p.grad))
        w.grad = None
    grads.append(torch.func.grad(lambda x, w, p: loss(x, w, st, qw, p), argnums=(0, 1, 2))(x, w, torch.zeros(())))
    for name, a, c, f in zip(["dx", "dw", "probe"], *grads):
        assert torch.equal(a, c) and torch.equal(a, f), name


# ------------------------------------------------------------------------------------------------
# residual=: the norm kernel adds the residual stream and returns s = x + residual


@pytest.mark.parametrize("rname", list(RECIPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("return_ln", [False, True])
def test_residual_equals_the_add_in_front_with_every_gradient(rname, dtype, return_ln):
    """layernorm_linear(x, ..., residual=r) returns s = x + r as torch adds it and y (and ln) of s
    bit for bit; x and r share the gradient of s: the norm's dx plus ds (in fp32, rounded once)."""
    recipe = RECIPES[rname]
    x, ln_w, ln_b, w, b, dy = _lnl_data((3, 4), 16, 24, dtype, False, seed=7)
    g = torch.Generator().manual_seed(8)
    r = (torch.randn(3, 4, 16, generator=g) * 2).to(dtype)
    ds = (torch.randn(3, 4, 16, generator=g) * 1e-2).to(dtype)
    dln = (torch.randn(3, 4, 16, generator=g) * 1e-2).to(dtype)
    st = _lnl_state(recipe, True)
    outs = []
    for fused in (True, False):
        leaves = [_leaf(t) for t in (x, ln_w, ln_b, w, b)]
        rl = r.clone().requires_grad_()
        p = torch.zeros((), requires_grad=True) if recipe is not None else None
        kw = {"recipe": recipe, "grad_probe": p, "return_layernorm_output": return_ln}
        if fused:
            out, _ = fp8ops.layernorm_linear(*leaves, st, residual=rl, **kw)
            s = out[-1]
        else:
            s = leaves[0] + rl
            out, _ = fp8ops.layernorm_linear(s, *leaves[1:], st, **kw)
            out = (*out, s) if return_ln else (out, s)
        cot = [dy, dln, ds] if return_ln else [dy, ds]
        torch.autograd.backward(list(out), cot)
        outs.append(([t.detach() for t in out], [t.grad for t in leaves], rl.grad, None if p is None else p.grad))
    (o1, g1, r1, p1), (o0, g0, r0, p0) = outs
    for a, c in zip(o1, o0):
        assert torch.equal(a, c)
    assert torch.equal(g1[0], r1)
    assert rel_error(g1[0], g0[0]) <= (1e-6 if dtype == torch.float32 else 1e-2)
    for a, c in zip(g1[1:], g0[1:]):
        assert torch.equal(a, c)
    if p1 is not None:
        assert torch.equal(p1, p0)


def test_residual_errors_and_unfused_paths():
    x, ln_w, ln_b, w, b, _ = _lnl_data((5,), 16, 8, torch.float32, False)
    with pytest.raises(ValueError, match=r"layernorm_linear: residual must have x's shape \(5, 16\), got \(5, 15\)"):
        fp8ops.layernorm_linear(x, ln_w, ln_b, w, b, None, recipe=None, residual=x[:, :-1])
    with pytest.raises(ValueError, match="layernorm_linear: residual must have x's dtype torch.float32"):
        fp8ops.layernorm_linear(x, ln_w, ln_b, w, b, None, recipe=None, residual=x.half())
    # K = 0: the add in front, then the op's empty-input path
    x0 = torch.zeros(5, 0)
    (y, s), _ = fp8ops.layernorm_linear(x0, torch.ones(0), None, torch.zeros(8, 0), b, None, recipe=None,
                                        residual=x0 + 1)
    assert s.shape == (5, 0) and torch.equal(y, b.expand(5, 8))


@pytest.mark.parametrize("recipe_name", ["delayed", "current", "rowwise", "none"])
def test_qkv_heads_views_and_gradients_match_the_plain_projection(recipe_name, monkeypatch):
    """``qkv_heads``: y as attention's (B, h, S, d) views; under a per-tensor recipe the backward
    quantizes the three gradients in one op call (counted), giving the gradients of the plain
    projection whose views autograd concatenates."""
    from fp8ops._operands import head_views
    from fp8ops.testing.composition import make_recipe

    recipe = make_recipe(recipe_name)
    g = torch.Generator().manual_seed(0)
    S, B, K, hq, hkv, d = 5, 3, 32, 2, 1, 32
    N = (hq + 2 * hkv) * d
    x, r = torch.randn(S, B, K, generator=g), torch.randn(S, B, K, generator=g)
    lw, lb = torch.randn(K, generator=g), torch.randn(K, generator=g)
    w, b = torch.randn(N, K, generator=g) * 0.2, torch.randn(N, generator=g)
    leaves = [t.requires_grad_() for t in (x, r, lw, lb, w, b)]
    calls = []
    real = fp8ops._operands._ops.cast_transpose_heads
    monkeypatch.setattr(fp8ops._operands._ops, "cast_transpose_heads", lambda *a: calls.append(1) or real(*a))
    results = []
    for heads in (None, (hq, hkv, d)):
        st = fp8ops.LayerNormLinearState.init(recipe) if recipe is not None else None
        probe = torch.zeros((), requires_grad=True) if recipe is not None else None
        (y, s), _ = fp8ops.layernorm_linear(x, lw, lb, w, b, st, recipe=recipe, grad_probe=probe, residual=r,
                                           qkv_heads=heads)
        views = y if heads is not None else head_views(y, B, hq, hkv, d)
        assert [tuple(t.shape) for t in views] == [(B, hq, S, d), (B, hkv, S, d), (B, hkv, S, d)]
        o = torch.nn.functional.scaled_dot_product_attention(*views, is_causal=True)
        loss = o.square().sum() + s.sum()
        results.append((views, torch.autograd.grad(loss, leaves + ([probe] if probe is not None else []))))
    (v0, g0), (v1, g1) = results
    assert all(torch.equal(a, c) for a, c in zip(v0, v1))
    assert all(torch.equal(a, c) for a, c in zip(g0, g1))
    assert len(calls) == (1 if recipe_name in ("delayed", "current") else 0)


def test_qkv_heads_rejects_bad_arguments():
    x, lw, w = torch.randn(4, 2, 8), torch.ones(8), torch.randn(3 * 8, 8)
    with pytest.raises(TypeError, match=r"layernorm_linear: qkv_heads must be a tuple \(hq, hkv, d\)"):
        fp8ops.layernorm_linear(x, lw, None, w, None, None, recipe=None, qkv_heads=(1, 1))
    with pytest.raises(ValueError, match="layernorm_linear: qkv_heads=.* needs a weight of"):
        fp8ops.layernorm_linear(x, lw, None, w, None, None, recipe=None, qkv_heads=(2, 1, 8))
    with pytest.raises(ValueError, match=r"layernorm_linear: qkv_heads needs x as \(S, B, K\)"):
        fp8ops.layernorm_linear(x[0], lw, None, w, None, None, recipe=None, qkv_heads=(1, 1, 8))
