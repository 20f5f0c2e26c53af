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
