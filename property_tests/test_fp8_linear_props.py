"""Properties of fp8ops.fp8_linear: against the FP32 reference, against the unquantized linear,
and the state, saturation, NaN, no-mutation, weight-cache and vmap semantics.

Over drawn recipes (DelayedScaling calibrated with drawn scales or uncalibrated, CurrentScaling per
tensor and per row; HYBRID / E4M3 / E5M2; margins 0..2; power-of-two scales), shapes (leading dims
0..2, K and N including 1, primes and non-multiples of 16), dtypes (float32, bfloat16) and input
magnitudes:

1. y, dx, dW, db and the probe gradient equal ``fp8ops.reference.fp8_linear`` up to the rounding of
   the output (the FP8 operands are the same); the new state holds max(pending, amax(x)) and
   max(pending, amax(W)), and nothing else of the state changes.
2. Against the unquantized float32 linear (``F.linear`` and its autograd gradients), with
   well-scaled inputs, every output element is within the error budget derived from the FP8
   half-ulp bounds, and the SQNR is above the floor that budget implies.
3. Inputs far beyond what the scale allows (and ±inf) saturate: every output is finite and equals
   the reference's saturated result (and, for a fixed scale, the result of the clamped inputs).
4. A NaN in x makes exactly the output rows (and dW columns) it touches NaN, makes the pending
   amax NaN, and an update then keeps the state finite.
5. No input is modified: x, weight, bias, dy, the probe and every tensor of the state.
6. The weight-cache path gives bit for bit the non-cached result.
7. vmap over a leading micro-batch dimension equals a Python loop, bit for bit.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from hypothesis import given, note, settings
from hypothesis import strategies as st
from torch import Tensor
from torch.utils import _pytree as pytree

import fp8ops
from fp8ops import LinearState
from fp8ops.reference import fp8_linear as R
from fp8ops.testing import assert_same_bits, half_ulp_rel, sqnr
from fp8ops.testing import strategies as fst

DTYPES = st.sampled_from((torch.float32, torch.bfloat16))
RECIPES = fst.recipes(max_margin=2, max_history_len=4)
SIDES = st.sampled_from(fst.INTERESTING_SIDES) | st.integers(1, 127)
LEADS = fst.shapes(0, 2, max_side=64, max_numel=64)  # leading dims of x; () gives a 1-D x

U32 = 2.0**-24  # float32 unit roundoff
# Unit roundoff of an output dtype: the relative error of one rounding to it.
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8}


def _gamma(n: int) -> float:
    """Higham's gamma_n = n u / (1 - n u): |fl(sum of n float32 terms) - sum| <= gamma_n * sum |terms|."""
    return n * U32 / (1 - n * U32)


class Case(NamedTuple):
    recipe: fp8ops.Recipe
    state: LinearState
    x: Tensor  # (..., K)
    w: Tensor  # (N, K)
    b: Tensor | None  # (N,)
    dy: Tensor  # (..., N)
    probe: bool
    grads: tuple[bool, bool, bool]  # requires_grad of x, w, b


class Run(NamedTuple):
    y: Tensor
    new_state: LinearState
    dx: Tensor | None
    dw: Tensor | None
    db: Tensor | None
    probe_grad: Tensor | None


# ------------------------------------------------------------------------------------------------
# drawing cases


def _draw_state(data: st.DataObject, recipe: fp8ops.Recipe, *, calibrated: bool | None = None,
                pending: bool | None = None) -> LinearState:
    """A LinearState with drawn histories, scales and pending amaxes (delayed: calibrated or not,
    per role unless ``calibrated`` is given)."""
    if pending is None:
        pending = data.draw(st.booleans(), label="pending observations")
    fields = {}
    for name, role in LinearState.ROLES.items():
        cal = calibrated if recipe.mode == "delayed" else True
        fields[name] = data.draw(fst.scaling_states(recipe, role=role, calibrated=cal, pending=pending),
                                 label=f"state.{name}")
    return LinearState(**fields)


def _draw_dims(data: st.DataObject) -> tuple[tuple[int, ...], int, int]:
    return data.draw(LEADS, label="lead"), data.draw(SIDES, label="K"), data.draw(SIDES, label="N")


def _draw_case(data: st.DataObject, *, specials: bool | tuple[str, ...] = False, all_grads: bool = False,
               min_exp: int = -16, max_exp: int = 16) -> Case:
    recipe = data.draw(RECIPES, label="recipe")
    state = _draw_state(data, recipe)
    lead, K, N = _draw_dims(data)
    xdt = data.draw(DTYPES, label="x dtype")
    wdt = data.draw(DTYPES, label="weight dtype")  # bf16 activations with fp32 master weights too

    def tensor(shape: tuple[int, ...], dt: torch.dtype, label: str) -> Tensor:
        return data.draw(fst.float_tensors(shape, dt, specials=specials, min_exp=min_exp, max_exp=max_exp),
                         label=label)

    x = tensor((*lead, K), xdt, "x")
    w = tensor((N, K), wdt, "weight")
    b = tensor((N,), wdt, "bias") if data.draw(st.booleans(), label="with bias") else None
    dy = tensor((*lead, N), xdt, "dy")
    probe = data.draw(st.booleans(), label="probe")
    grads = (True, True, True) if all_grads else tuple(data.draw(st.booleans(), label=f"{n} requires grad")
                                                        for n in ("x", "weight", "bias"))
    return Case(recipe, state, x, w, b, dy, probe, grads)  # type: ignore[arg-type]


def _run(case: Case, *, state: LinearState | None = None, probe: Tensor | None = None, **kw: Any) -> Run:
    """Forward and (when anything needs a gradient) backward with ``dy`` under plain autograd.

    The tensors given to the op are detached views of the case's tensors: they share storage, so
    an in-place write by the op shows in the case.
    """
    gx, gw, gb = case.grads
    x = case.x.detach().requires_grad_(gx)
    w = case.w.detach().requires_grad_(gw)
    b = None if case.b is None else case.b.detach().requires_grad_(gb)
    if probe is None and case.probe:
        probe = torch.zeros((), requires_grad=True)
    y, new_state = fp8ops.fp8_linear(x, w, b, case.state if state is None else state,
                                     recipe=case.recipe, grad_probe=probe, **kw)
    if y.requires_grad:
        y.backward(case.dy)
    return Run(y.detach(), new_state, x.grad, w.grad, None if b is None else b.grad,
               None if probe is None else probe.grad)


# ------------------------------------------------------------------------------------------------
# comparisons


def _same_value(a: Tensor, b: Tensor) -> bool:
    """Scalars equal, or both NaN."""
    fa, fb = float(a), float(b)
    return (math.isnan(fa) and math.isnan(fb)) or fa == fb


def _clone(tree: Any) -> Any:
    """A copy of every tensor of a pytree (None stays None)."""
    return pytree.tree_map(lambda t: None if t is None else t.clone(), tree)


def _amax(t: Tensor) -> Tensor:
    return t.detach().float().abs().amax()  # NaN if t has a NaN


def _assert_same_state(a: fp8ops.ScalingState, b: fp8ops.ScalingState, name: str) -> None:
    assert (a.role, a.calibrated) == (b.role, b.calibrated), f"{name}: static fields differ"
    assert_same_bits(a.amax_history, b.amax_history, name=f"{name}.amax_history")
    assert_same_bits(a.scale, b.scale, name=f"{name}.scale")
    assert_same_bits(a.pending_amax, b.pending_amax, name=f"{name}.pending_amax")


def _assert_same_linear_state(a: LinearState, b: LinearState, name: str) -> None:
    for role in LinearState.ROLES:
        _assert_same_state(getattr(a, role), getattr(b, role), f"{name}.{role}")


def _assert_rounding_close(actual: Tensor, expected: Tensor, absprod: Tensor, n_terms: int, name: str) -> None:
    """Same FP8 operands, so only the float32 accumulation order and the output rounding may differ.

    Elementwise: ``|actual - expected| <= 2 gamma_(n+3) S + 1.01 u_out (|actual| + |expected|)``,
    where ``S`` is the sum of |products| of the dequantized operands (the scale of the float32
    rounding errors of a sum of n terms, whatever its order; +3 covers the dequantizing multiplies)
    and ``u_out`` the unit roundoff of the coarser output dtype (float32 2^-24: about 1e-6 of S
    for K <= 16; bfloat16 2^-8). Where the reference is not finite, ``actual`` must equal it.
    """
    a = actual.detach().to(torch.float64)
    e = expected.detach().to(torch.float64)
    assert a.shape == e.shape, f"{name}: shape {tuple(a.shape)}, reference {tuple(e.shape)}"
    fin = torch.isfinite(e)
    same_nonfinite = (a == e) | (torch.isnan(a) & torch.isnan(e))
    assert bool((fin | same_nonfinite).all()), f"{name}: differs from the reference where that is not finite"
    u_out = max(UNIT_ROUNDOFF[actual.dtype], UNIT_ROUNDOFF[expected.dtype])
    bound = 2 * _gamma(n_terms + 3) * absprod.to(torch.float64) + 1.01 * u_out * (a.abs() + e.abs())
    err = (a - e).abs()
    bad = fin & ~(err <= bound)  # a NaN / inf in actual where the reference is finite is bad
    if bool(bad.any()):
        i = int(bad.reshape(-1).nonzero()[0, 0])
        raise AssertionError(
            f"{name}: {int(bad.sum())} of {a.numel()} element(s) beyond the output-rounding tolerance; "
            f"first at flat index {i}: got {a.reshape(-1)[i].item()!r}, reference {e.reshape(-1)[i].item()!r}, "
            f"|diff| {err.reshape(-1)[i].item():.6g} > bound {bound.reshape(-1)[i].item():.6g}"
        )


def _check_against_reference(case: Case, run: Run) -> None:
    """Property 1's assertions, shared with the saturation property."""
    recipe, state = case.recipe, case.state
    N, K = case.w.shape
    x2 = case.x.reshape(-1, K)
    M = x2.shape[0]
    y_ref, st_ref = R.fp8_linear(case.x, case.w, case.b, state, recipe=recipe)
    assert run.y.shape == (*case.x.shape[:-1], N) and run.y.dtype == case.x.dtype, (
        f"y is {tuple(run.y.shape)} {run.y.dtype}, expected {(*case.x.shape[:-1], N)} {case.x.dtype}"
    )

    def qdq(t: Tensor, role_state: fp8ops.ScalingState, role: str, dim: int = -1, probe_ok: bool = True) -> Tensor:
        cal = role_state.calibrated and probe_ok
        return R.qdq(t, role_state.scale if probe_ok else None, cal, recipe, role, dim=dim).abs().double()

    babs = torch.zeros(N, dtype=torch.float64) if case.b is None else case.b.double().abs()
    s_y = qdq(x2, state.input, "forward") @ qdq(case.w, state.weight, "forward").t() + babs
    _assert_rounding_close(run.y.reshape(M, N), y_ref.reshape(M, N), s_y, K + 1, "y")

    # The new state: this call's amaxes max-merged into pending; nothing else changes.
    _assert_same_linear_state(run.new_state, st_ref, "new_state")
    for role, t in (("input", case.x), ("weight", case.w)):
        got, old = getattr(run.new_state, role).pending_amax, getattr(state, role).pending_amax
        want = torch.maximum(old, _amax(t))
        assert _same_value(got, want), f"new_state.{role}.pending_amax {float(got)!r}, expected {float(want)!r}"
    _assert_same_state(run.new_state.grad_output, state.grad_output, "new_state.grad_output")

    if not (any(case.grads) or case.probe):
        return
    dx_ref, dw_ref, db_ref, amax_ref = R.fp8_linear_grads(case.x, case.w, case.dy, state, recipe=recipe,
                                                          has_probe=case.probe)
    dy2 = case.dy.reshape(M, N)
    gx, gw, gb = case.grads
    if gx:
        assert run.dx is not None and run.dx.dtype == case.x.dtype
        g_rows = qdq(dy2, state.grad_output, "backward", probe_ok=case.probe)
        s_dx = g_rows @ qdq(case.w, state.weight, "forward", dim=0)
        _assert_rounding_close(run.dx.reshape(M, K), dx_ref.reshape(M, K), s_dx, N, "dx")
    if gw:
        assert run.dw is not None and run.dw.dtype == case.w.dtype
        g_cols = qdq(dy2, state.grad_output, "backward", dim=0, probe_ok=case.probe)
        s_dw = g_cols.t() @ qdq(x2, state.input, "forward", dim=0)
        _assert_rounding_close(run.dw, dw_ref, s_dw, M, "dW")
    if case.b is not None and gb:
        assert run.db is not None and run.db.dtype == case.b.dtype
        _assert_rounding_close(run.db, db_ref, dy2.double().abs().sum(0), M, "db")
    if case.probe:
        assert run.probe_grad is not None
        assert_same_bits(run.probe_grad, amax_ref, name="probe grad (amax(dy))")


# ------------------------------------------------------------------------------------------------
# 1. equal to the reference


@given(data=st.data())
def test_forward_and_gradients_equal_reference(data: st.DataObject) -> None:
    """y, dx, dW, db and the probe gradient equal fp8ops.reference.fp8_linear up to the output rounding
    of the same FP8 operands; the new state's pending amaxes are max(pending, amax(x)) and
    max(pending, amax(W)) exactly, and its grad_output role is unchanged."""
    case = _draw_case(data, specials=("zero", "subnormal"), min_exp=-24, max_exp=24)
    _check_against_reference(case, _run(case))


# ------------------------------------------------------------------------------------------------
# 2. FP8 error budget against the unquantized linear


@st.composite
def _well_scaled(draw: Any, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    """sign x 2**uniform(lo, lo + span) with span <= 8 binades, and optionally some exact zeros.

    Every non-zero element then lies within 8 binades of its tensor's (row's, column's) amax. With
    a scale mapping the amax to at least fp8_max / 2**5 (margin <= 2, power-of-two rounding, up to
    2 binades of history headroom), |v * scale| >= 448 / 2**13 > 2**-6: the normal range of E4M3
    (and of E5M2), never saturated. There the FP8 round trip is within the half-ulp bound.
    """
    lo = draw(st.integers(-10, 10))
    span = draw(st.integers(0, 8))
    zeros = draw(st.sampled_from((0.0, 0.25)))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    n = math.prod(shape)
    mag = torch.exp2(lo + span * torch.rand(n, generator=g, dtype=torch.float64))
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).to(torch.float64)
    v = torch.where(torch.rand(n, generator=g) < zeros, torch.zeros_like(mag), sign * mag)
    return v.to(dtype).reshape(shape)


def _matched_state(data: st.DataObject, recipe: fp8ops.Recipe, x: Tensor, w: Tensor, dy: Tensor) -> LinearState:
    """Delayed scaling: calibrated scales that match the data (what an update after seeing an amax
    up to 4x this one gives), or uncalibrated (current scaling); current scaling: a fresh state."""
    state = LinearState.init(recipe)
    if recipe.mode != "delayed" or not data.draw(st.booleans(), label="calibrated"):
        return state
    fields = {}
    for (name, role), t in zip(LinearState.ROLES.items(), (x, w, dy)):
        headroom = 2.0 ** data.draw(st.integers(0, 2), label=f"{name} headroom (binades)")
        scale = fp8ops.compute_scale(_amax(t) * headroom, torch.ones(()), recipe.fp8_max(role),
                                     margin=recipe.margin, power_2_scale=recipe.power_2_scale)
        fields[name] = getattr(state, name).replace(scale=scale, calibrated=True)
    return LinearState(**fields)


# Error budget of a GEMM on FP8 operands. In the normal range and unsaturated, round-to-nearest-even
# gives |dq(q(v)) - v| <= u |v| with u the half-ulp (E4M3 2^-4, E5M2 2^-3), so one product of
# operands in formats a and b is off by at most c |a b| with c = u_a + u_b + u_a u_b, and a dot
# product by c S with S = sum |a_k b_k|. Add the float32 accumulation of both sides (gamma_(n+4) S,
# +4 for the dequantizing multiplies and the bias add) and the rounding to the output dtype.
#
# SQNR floor: the same budget in dB. Without cancellation (S = |y|) it is -20 log10(c):
# E4M3 x E4M3 (fprop) 17.8 dB, E5M2 x E4M3 (HYBRID dgrad / wgrad) 14.2 dB, E5M2 x E5M2 11.5 dB;
# cancellation in the dot products lowers it by 10 log10(sum S^2 / sum y^2), measured on the data.


def _budget_c(fa: torch.dtype, fb: torch.dtype) -> float:
    ua, ub = half_ulp_rel(fa), half_ulp_rel(fb)
    return ua + ub + ua * ub


def _assert_within_budget(actual: Tensor, exact: Tensor, s_prod: Tensor, c: float, n_terms: int, name: str,
                          s_extra: Tensor | float = 0.0) -> None:
    """Elementwise budget and SQNR floor of ``actual`` against the unquantized float32 ``exact``.

    ``s_prod``: sum |products| of the quantized operands; ``s_extra``: unquantized terms (|bias|).
    """
    a = actual.detach().to(torch.float64)
    e = exact.detach().to(torch.float64)
    assert bool(torch.isfinite(a).all()), f"{name}: non-finite output for well-scaled finite inputs"
    u_out = UNIT_ROUNDOFF[actual.dtype]
    acc = 2 * _gamma(n_terms + 4) * (1 + c)
    bound = c * s_prod + acc * (s_prod + s_extra) + 1.01 * u_out * a.abs()
    err = (a - e).abs()
    bad = ~(err <= bound)
    if bool(bad.any()):
        i = int(bad.reshape(-1).nonzero()[0, 0])
        raise AssertionError(
            f"{name}: {int(bad.sum())} of {a.numel()} element(s) beyond the FP8 error budget (c = {c:.4g}); "
            f"first at flat index {i}: got {a.reshape(-1)[i].item()!r}, unquantized {e.reshape(-1)[i].item()!r}, "
            f"|diff| {err.reshape(-1)[i].item():.6g} > budget {bound.reshape(-1)[i].item():.6g}"
        )
    signal = float((e * e).sum())
    if signal == 0.0:
        return
    # With s_all = s_prod + s_extra and |e| <= (1 + acc) s_all, |a| <= |e| + bound gives
    # bound <= c_eff s_all elementwise, hence sum (a - e)^2 <= c_eff^2 sum s_all^2.
    c_eff = (c + acc + 1.01 * u_out * (1 + acc)) / (1 - 1.01 * u_out)
    s_all = s_prod + s_extra  # (broadcast)
    cancel_db = 10 * math.log10(max(float((s_all * s_all).sum()) / signal, 1.0))
    floor = -20 * math.log10(c_eff) - cancel_db
    got = sqnr(actual.double(), exact.double())
    note(f"{name}: SQNR {got:.2f} dB, floor {floor:.2f} dB (cancellation {cancel_db:.2f} dB)")
    assert got >= floor, (
        f"{name}: SQNR {got:.3f} dB below the floor {floor:.3f} dB (c = {c:.4g}, cancellation {cancel_db:.2f} dB)"
    )


@given(data=st.data())
def test_error_budget_vs_unquantized_linear(data: st.DataObject) -> None:
    """With well-scaled inputs (calibrated scales matching the data, or current scaling), y, dx and
    dW stay within the FP8 error budget of the unquantized float32 linear (F.linear and its autograd
    gradients) elementwise and in SQNR; db is the unquantized bias gradient up to float32 / output
    rounding, and the probe gradient is amax(dy)."""
    recipe = data.draw(RECIPES, label="recipe")
    lead, K, N = _draw_dims(data)
    dt = data.draw(DTYPES, label="dtype")
    x = data.draw(_well_scaled((*lead, K), dt), label="x")
    w = data.draw(_well_scaled((N, K), dt), label="weight")
    b = data.draw(_well_scaled((N,), dt), label="bias")
    dy = data.draw(_well_scaled((*lead, N), dt), label="dy")
    state = _matched_state(data, recipe, x, w, dy)
    case = Case(recipe, state, x, w, b, dy, True, (True, True, True))
    run = _run(case)

    x32, w32, b32 = (t.detach().float().requires_grad_() for t in (x, w, b))
    y32 = F.linear(x32, w32, b32)
    y32.backward(dy.float())
    assert x32.grad is not None and w32.grad is not None and b32.grad is not None

    M = math.prod(lead)
    x2, dy2, wd = x.reshape(M, K).double().abs(), dy.reshape(M, N).double().abs(), w.double().abs()
    f, g = recipe.dtype("forward"), recipe.dtype("backward")
    _assert_within_budget(run.y.reshape(M, N), y32.detach().reshape(M, N), x2 @ wd.t(), _budget_c(f, f), K + 1, "y",
                          s_extra=b.double().abs())
    assert run.dx is not None and run.dw is not None and run.db is not None and run.probe_grad is not None
    _assert_within_budget(run.dx.reshape(M, K), x32.grad.reshape(M, K), dy2 @ wd, _budget_c(g, f), N, "dx")
    _assert_within_budget(run.dw, w32.grad, dy2.t() @ x2, _budget_c(g, f), M, "dW")
    # db is not quantized: no FP8 term, only float32 accumulation and the output rounding.
    _assert_within_budget(run.db, b32.grad, torch.zeros(N, dtype=torch.float64), 0.0, M, "db", s_extra=dy2.sum(0))
    assert_same_bits(run.probe_grad, _amax(dy), name="probe grad (amax(dy))")


# ------------------------------------------------------------------------------------------------
# 3. saturation


def _plant(data: st.DataObject, t: Tensor, kinds: tuple[str, ...], label: str) -> Tensor:
    """Set a few drawn positions of ``t`` to ±inf or ±(the dtype's largest finite value)."""
    spots = data.draw(st.lists(st.tuples(st.integers(0, t.numel() - 1), st.sampled_from(kinds), st.booleans()),
                               max_size=3), label=label)
    flat = t.clone().reshape(-1)
    big = torch.finfo(t.dtype).max
    for pos, kind, neg in spots:
        flat[pos] = (-1.0 if neg else 1.0) * (math.inf if kind == "inf" else big)
    return flat.reshape(t.shape)


def _blow_up(data: st.DataObject, t: Tensor, scale: Tensor, fmax: float, label: str) -> Tensor:
    """Rescale ``t`` so that amax(t) * scale = fmax * 2**j, j in 1..24: far beyond the FP8 range."""
    j = data.draw(st.integers(1, 24), label=f"{label}: binades above fp8_max")
    t = t.float()
    a = float(t.abs().amax())
    if a == 0.0:
        t, a = torch.ones_like(t), 1.0
    return t * (fmax * 2.0**j / (float(scale) * a))


@given(data=st.data())
def test_saturation_gives_finite_reference_result(data: st.DataObject) -> None:
    """x, W (and dy) far above what the state's scales allow, with ±inf and ±dtype-max values
    planted in x and W, give finite y, dx, dW, db and probe gradient, equal to the reference's
    saturated result; with a fixed (delayed) scale, y and dW equal the result of inputs clamped to
    ±fp8_max / scale beforehand."""
    recipe = data.draw(RECIPES, label="recipe")
    state = _draw_state(data, recipe, calibrated=True)
    lead, K, N = _draw_dims(data)
    xdt, wdt = data.draw(DTYPES, label="x dtype"), data.draw(DTYPES, label="weight dtype")
    fwd, bwd = recipe.fp8_max("forward"), recipe.fp8_max("backward")

    def base(shape: tuple[int, ...], dt: torch.dtype, label: str) -> Tensor:
        return data.draw(fst.float_tensors(shape, dt, min_exp=-4, max_exp=4), label=label)

    x = _blow_up(data, base((*lead, K), xdt, "x"), state.input.scale, fwd, "x").to(xdt)
    w = _blow_up(data, base((N, K), wdt, "weight"), state.weight.scale, fwd, "weight").to(wdt)
    dy = _blow_up(data, base((*lead, N), xdt, "dy"), state.grad_output.scale, bwd, "dy").to(xdt)
    # ±dtype-max only under a fixed scale: current scaling would take it as the amax and keep it
    # (a huge but correct product); ±inf has no amax to scale by and falls back to the state's scale.
    kinds = ("inf", "max") if recipe.mode == "delayed" else ("inf",)
    x = _plant(data, x, kinds, "specials in x")
    w = _plant(data, w, kinds, "specials in weight")
    b = base((N,), wdt, "bias") if data.draw(st.booleans(), label="with bias") else None
    case = Case(recipe, state, x, w, b, dy, data.draw(st.booleans(), label="probe"), (True, True, True))
    if recipe.mode == "delayed":  # the premise: the state's scales cannot hold these inputs
        for t, s in ((x, state.input.scale), (w, state.weight.scale)):
            assert float(_amax(t)) * float(s) > fwd, "premise: input within the FP8 range"
    run = _run(case)
    for name, t in (("y", run.y), ("dx", run.dx), ("dW", run.dw), ("db", run.db), ("probe grad", run.probe_grad)):
        if t is not None:
            assert bool(torch.isfinite(t).all()), f"{name}: non-finite value from saturating inputs: {t}"
    _check_against_reference(case, run)
    if recipe.mode == "delayed":
        # Saturation means: anything beyond fp8_max / scale acts as ±fp8_max / scale exactly.
        def clamp(t: Tensor, s: Tensor) -> Tensor:
            lim = fwd / float(s)
            return t.float().clamp(-lim, lim).to(t.dtype)

        clamped = case._replace(x=clamp(x, state.input.scale), w=clamp(w, state.weight.scale))
        run_c = _run(clamped)
        assert_same_bits(run.y, run_c.y, name="y vs y of the clamped inputs")
        assert run.dw is not None and run_c.dw is not None
        assert_same_bits(run.dw, run_c.dw, name="dW vs dW of the clamped inputs")


# ------------------------------------------------------------------------------------------------
# 4. NaN


@given(data=st.data())
def test_nan_in_x_poisons_only_its_rows_and_never_the_state(data: st.DataObject) -> None:
    """A NaN in x gives NaN in exactly the output rows holding it (and in exactly the dW columns
    holding it); dx, db and the probe gradient stay finite; the pending input amax is NaN; after
    fp8ops.update every state is finite, the NaN observation counts as none (history[0] == 0) and
    the input scale is what an update without observation gives: the old scale where the rest of
    the history is empty or the recipe uses the most recent amax."""
    recipe = data.draw(RECIPES, label="recipe")
    state = _draw_state(data, recipe)
    if data.draw(st.booleans(), label="empty input history"):
        state = state.replace(input=state.input.replace(amax_history=torch.zeros_like(state.input.amax_history)))
    lead, K, N = _draw_dims(data)
    xdt, wdt = data.draw(DTYPES, label="x dtype"), data.draw(DTYPES, label="weight dtype")
    x = data.draw(fst.float_tensors((*lead, K), xdt), label="x")
    spots = data.draw(st.lists(st.integers(0, x.numel() - 1), min_size=1, max_size=4), label="NaN positions")
    flat = x.clone().reshape(-1)
    flat[spots] = math.nan
    x = flat.reshape(x.shape)
    w = data.draw(fst.float_tensors((N, K), wdt), label="weight")
    b = data.draw(fst.float_tensors((N,), wdt), label="bias")
    dy = data.draw(fst.float_tensors((*lead, N), xdt), label="dy")
    case = Case(recipe, state, x, w, b, dy, True, (True, True, True))
    run = _run(case)

    M = math.prod(lead)
    nan_x = torch.isnan(x.reshape(M, K))
    rows, cols = nan_x.any(1), nan_x.any(0)  # (M,), (K,)
    y = run.y.reshape(M, N)
    assert bool(torch.isnan(y[rows]).all()), "an output row fed by a NaN is not all NaN"
    assert bool(torch.isfinite(y[~rows]).all()), "NaN or inf leaked into output rows without a NaN in x"
    assert run.dw is not None and run.dx is not None and run.db is not None and run.probe_grad is not None
    assert bool(torch.isnan(run.dw[:, cols]).all()), "a dW column fed by a NaN in x is not all NaN"
    assert bool(torch.isfinite(run.dw[:, ~cols]).all()), "NaN or inf leaked into dW columns without a NaN in x"
    for name, t in (("dx", run.dx), ("db", run.db), ("probe grad", run.probe_grad)):
        assert bool(torch.isfinite(t).all()), f"{name}: a NaN in x leaked into it"
    assert torch.isnan(run.new_state.input.pending_amax), "pending input amax is not NaN"
    assert _same_value(run.new_state.weight.pending_amax, torch.maximum(state.weight.pending_amax, _amax(w)))

    updated = fp8ops.update(run.new_state, recipe=recipe, grad_amax=run.probe_grad)
    for role in LinearState.ROLES:
        s = getattr(updated, role)
        assert bool(torch.isfinite(s.amax_history).all()), f"{role}: non-finite history {s.amax_history}"
        assert bool(torch.isfinite(s.scale)) and float(s.scale) > 0, f"{role}: scale {float(s.scale)!r}"
        assert float(s.pending_amax) == 0.0, f"{role}: not cleared"
        # the weight and the gradient observed finite amaxes: calibrated now (0 only for zero data)
        assert s.calibrated or role == "input" or not bool((s.amax_history > 0).any()), f"{role}: not calibrated"
    if not state.input.calibrated:  # observed nothing (NaN): left as it is, still uncalibrated
        assert not updated.input.calibrated, "an update that observed nothing calibrated the input state"
        _assert_same_state(updated.input, state.input.replace(pending_amax=torch.zeros(())), "input (nothing observed)")
        return
    assert float(updated.input.amax_history[0]) == 0.0, "the NaN observation entered the history"
    no_obs = recipe.update(state.input.replace(pending_amax=torch.zeros(())))
    _assert_same_state(updated.input, no_obs, "updated input state vs an update without observation")
    hist = state.input.amax_history
    if bool((hist[:-1] == 0).all()) or getattr(recipe, "amax_compute_algo", "most_recent") == "most_recent":
        assert_same_bits(updated.input.scale, state.input.scale, name="input scale after a NaN step (kept)")


# ------------------------------------------------------------------------------------------------
# 5. no mutation


@given(data=st.data())
def test_inputs_not_mutated(data: st.DataObject) -> None:
    """Forward, backward, quantize_weight and the cached path leave x, weight, bias, dy, the probe
    and every tensor of the state untouched (specials included), and the new state shares no
    pending-amax tensor with the old one."""
    case = _draw_case(data, specials=True, all_grads=data.draw(st.booleans(), label="all grads"))
    originals = _clone((case.x, case.w, case.b, case.dy, case.state))
    probe = torch.zeros((), requires_grad=True)
    run = _run(case, probe=probe if case.probe else None)
    if data.draw(st.booleans(), label="also the cached path"):
        qw, st_c = fp8ops.quantize_weight(case.w, case.state, recipe=case.recipe)
        _run(case, state=st_c, probe=probe if case.probe else None, weight_cache=qw)
    x0, w0, b0, dy0, state0 = originals
    assert_same_bits(case.x, x0, name="x")
    assert_same_bits(case.w, w0, name="weight")
    if case.b is not None:
        assert_same_bits(case.b, b0, name="bias")
    assert_same_bits(case.dy, dy0, name="dy")
    assert_same_bits(probe.detach(), torch.zeros(()), name="probe")
    _assert_same_linear_state(case.state, state0, "state")
    for role in ("input", "weight"):
        assert getattr(run.new_state, role).pending_amax is not getattr(case.state, role).pending_amax, (
            f"new_state.{role}.pending_amax aliases the old state's tensor"
        )


# ------------------------------------------------------------------------------------------------
# 6. weight cache


@given(data=st.data())
def test_weight_cache_equals_uncached(data: st.DataObject) -> None:
    """quantize_weight then weight_cache= gives bit for bit the y, dx, dW, db, probe gradient and
    new state of the non-cached call; quantize_weight records max(pending, amax(W)); the cache
    is left untouched by the calls that use it."""
    case = _draw_case(data, specials=True)
    plain = _run(case)
    bare = data.draw(st.booleans(), label="quantize_weight on the bare weight state")
    if bare:
        qw, ws = fp8ops.quantize_weight(case.w, case.state.weight, recipe=case.recipe)
        st_c = case.state.replace(weight=ws)
    else:
        qw, st_c = fp8ops.quantize_weight(case.w, case.state, recipe=case.recipe)
    want = torch.maximum(case.state.weight.pending_amax, _amax(case.w))
    assert _same_value(st_c.weight.pending_amax, want), (
        f"quantize_weight recorded {float(st_c.weight.pending_amax)!r}, expected {float(want)!r}"
    )
    cache0 = _clone(pytree.tree_leaves(qw))
    cached = _run(case, state=st_c, weight_cache=qw)
    for name in ("y", "dx", "dw", "db", "probe_grad"):
        a, e = getattr(cached, name), getattr(plain, name)
        assert (a is None) == (e is None), f"{name}: cached {a is None}, uncached {e is None} (None)"
        if a is not None:
            assert_same_bits(a, e, name=f"{name} (cached vs uncached)")
    _assert_same_linear_state(cached.new_state, plain.new_state, "new_state (cached vs uncached)")
    for i, (a, e) in enumerate(zip(pytree.tree_leaves(qw), cache0)):
        if a is not None or e is not None:
            assert_same_bits(a, e, name=f"weight cache leaf {i} after use")


# ------------------------------------------------------------------------------------------------
# 7. vmap over micro-batches


def _loss(x: Tensor, w: Tensor, b: Tensor, st: LinearState, probe: Tensor, dy: Tensor,
          recipe: fp8ops.Recipe) -> tuple[Tensor, tuple[Tensor, LinearState]]:
    y, new_state = fp8ops.fp8_linear(x, w, b, st, recipe=recipe, grad_probe=probe)
    return (y.float() * dy.float()).sum(), (y, new_state)  # d loss / d y = dy


@settings(max_examples=5)
@given(data=st.data())
def test_vmap_over_micro_batches_equals_loop(data: st.DataObject) -> None:
    """torch.func.vmap of torch.func.grad over a leading micro-batch dimension of x and dy (each
    micro-batch at its own magnitude) equals a Python loop bit for bit: y, dx, dW, db, the probe
    gradient and the new state's pending amaxes."""
    recipe = data.draw(RECIPES, label="recipe")
    state = _draw_state(data, recipe)
    lead = data.draw(fst.shapes(0, 2, max_side=16, max_numel=16), label="lead")
    K, N = data.draw(SIDES, label="K"), data.draw(SIDES, label="N")
    B = data.draw(st.integers(2, 3), label="micro-batches")
    dt = data.draw(DTYPES, label="dtype")
    # Distinct power-of-two magnitudes per micro-batch: per-sample amaxes and scales must differ.
    unique_exps = st.lists(st.integers(-8, 8), min_size=B, max_size=B, unique=True)
    ex, ey = data.draw(unique_exps, label="x magnitudes"), data.draw(unique_exps, label="dy magnitudes")
    xs = torch.stack([data.draw(fst.float_tensors((*lead, K), dt), label=f"x[{i}]") * 2.0 ** ex[i] for i in range(B)])
    dys = torch.stack([data.draw(fst.float_tensors((*lead, N), dt), label=f"dy[{i}]") * 2.0 ** ey[i] for i in range(B)])
    w = data.draw(fst.float_tensors((N, K), dt), label="weight")
    b = data.draw(fst.float_tensors((N,), dt), label="bias")

    def loss(x: Tensor, w: Tensor, b: Tensor, st: LinearState, probe: Tensor, dy: Tensor) -> Any:
        return _loss(x, w, b, st, probe, dy, recipe)

    f = torch.func.grad(loss, argnums=(0, 1, 2, 4), has_aux=True)
    (vx, vw, vb, vp), (vy, vst) = torch.func.vmap(f, in_dims=(0, None, None, None, None, 0))(
        xs, w, b, state, torch.zeros(()), dys
    )
    for i in range(B):
        (lx, lw, lb, lp), (ly, lst) = f(xs[i], w, b, state, torch.zeros(()), dys[i])
        for name, v, loop in (("y", vy, ly), ("dx", vx, lx), ("dW", vw, lw), ("db", vb, lb), ("probe grad", vp, lp)):
            assert_same_bits(v[i], loop, name=f"{name}[{i}] (vmap vs loop)")
        for role in ("input", "weight"):
            v_pend = getattr(vst, role).pending_amax
            v_pend = v_pend[i] if v_pend.dim() else v_pend
            assert_same_bits(v_pend, getattr(lst, role).pending_amax, name=f"new_state.{role}.pending_amax[{i}]")
