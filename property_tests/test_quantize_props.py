"""Properties of fp8ops.quantize / fp8ops.dequantize against the FP32 reference.

On CPU the library ops run the reference math, so the public op must equal
``fp8ops.reference.quantize`` bit for bit; the numerical properties (round-trip bound, saturation,
sign, NaN, idempotence) and the state properties (no mutation, stable shapes, finite history,
positive scale) hold for every recipe, shape, dtype and input drawn.
"""

from __future__ import annotations

import math

import torch
from hypothesis import example, given, note
from hypothesis import strategies as st

import fp8ops
from fp8ops.reference import quantize as ref
from fp8ops.testing import assert_same_bits, half_ulp_rel, smallest_normal
from fp8ops.testing import strategies as fst

DTYPES = st.sampled_from((torch.float32, torch.bfloat16, torch.float16))
ROLES = st.sampled_from(("forward", "backward"))

# Slack on top of the half-ulp bound for the float32 roundings around the cast: x * scale,
# 1 / scale and q * inv_scale each add at most 2**-24 relative error.
FP32_SLACK = 2.0**-20


def _draw_state(data: st.DataObject, recipe: fp8ops.Recipe, role: str) -> fp8ops.ScalingState | None:
    """A state for ``recipe`` (None allowed for current scaling, which needs none)."""
    if recipe.mode != "delayed" and data.draw(st.booleans(), label="no state"):
        return None
    return data.draw(fst.scaling_states(recipe, role=role), label="state")  # type: ignore[arg-type]


def _clone_state(s: fp8ops.ScalingState | None) -> fp8ops.ScalingState | None:
    if s is None:
        return None
    return s.replace(amax_history=s.amax_history.clone(), scale=s.scale.clone(), pending_amax=s.pending_amax.clone())


def _assert_same_state(a: fp8ops.ScalingState | None, b: fp8ops.ScalingState | None, name: str) -> None:
    assert (a is None) == (b is None), f"{name}: one state is None"
    if a is None or b is None:
        return
    assert (a.role, a.calibrated) == (b.role, b.calibrated), f"{name}: static fields differ"
    assert_same_bits(a.amax_history, b.amax_history, name=f"{name}.amax_history")
    assert_same_bits(a.scale, b.scale, name=f"{name}.scale")
    assert_same_bits(a.pending_amax, b.pending_amax, name=f"{name}.pending_amax")


def _check_invariants(s: fp8ops.ScalingState, recipe: fp8ops.Recipe, role: str, name: str) -> None:
    """Shapes, dtypes and values every updated state must have."""
    L = recipe.history_len
    assert s.amax_history.shape == (L,) and s.amax_history.dtype == torch.float32, f"{name}: history {s.amax_history!r}"
    assert s.scale.shape == () and s.scale.dtype == torch.float32, f"{name}: scale {s.scale!r}"
    assert s.pending_amax.shape == () and s.pending_amax.dtype == torch.float32, f"{name}: pending {s.pending_amax!r}"
    assert bool(torch.isfinite(s.amax_history).all()), f"{name}: non-finite value in the history {s.amax_history}"
    assert bool((s.amax_history >= 0).all()), f"{name}: negative value in the history {s.amax_history}"
    assert bool(torch.isfinite(s.scale)) and float(s.scale) > 0, f"{name}: scale {float(s.scale)!r} not finite and > 0"
    assert float(s.pending_amax) == 0.0, f"{name}: pending_amax {float(s.pending_amax)!r} not cleared"
    # calibrated unless no update has observed anything yet (an all-zero or all-NaN tensor)
    assert s.role == role, f"{name}: role {s.role!r}"
    assert s.calibrated or not bool((s.amax_history > 0).any()), f"{name}: uncalibrated with history {s.amax_history}"


def _quantize_case(data: st.DataObject, *, specials: bool | tuple[str, ...], transpose_ok: bool = True,
                   granularities: tuple[str, ...] = ("tensor", "row"), min_exp: int = -16, max_exp: int = 16
                   ) -> tuple[fp8ops.Recipe, str, str | None, fp8ops.ScalingState | None, torch.Tensor, bool]:
    """Draw (recipe, role, role_arg, state, x, transpose) for one quantize call."""
    recipe = data.draw(fst.recipes(granularities=granularities), label="recipe")
    role = data.draw(ROLES, label="role")
    state = _draw_state(data, recipe, role)
    role_arg = role if state is None or data.draw(st.booleans(), label="pass role") else None
    transpose = transpose_ok and recipe.mode != "rowwise" and data.draw(st.booleans(), label="transpose")
    shape = data.draw(fst.shapes(2 if transpose else 1, 3), label="shape")
    x = data.draw(fst.float_tensors(shape, DTYPES, specials=specials, min_exp=min_exp, max_exp=max_exp), label="x")
    return recipe, role, role_arg, state, x, transpose


@given(data=st.data())
def test_quantize_equals_reference_exactly(data: st.DataObject) -> None:
    """data bytes, inv_scale, data_t, amax and the new state equal the FP32 reference bit for bit."""
    recipe, role, role_arg, state, x, transpose = _quantize_case(data, specials=True)
    q, new_state = fp8ops.quantize(x, state, recipe=recipe, role=role_arg, transpose=transpose)
    (rdata, rinv, rdata_t), rstate = ref.quantize(x, state, recipe=recipe, role=role_arg, transpose=transpose)
    assert q.data.dtype == recipe.dtype(role)  # type: ignore[arg-type]
    assert_same_bits(q.data, rdata, name="data")
    assert_same_bits(q.inv_scale, rinv, name="inv_scale")
    if transpose:
        assert q.data_t is not None and rdata_t is not None
        assert_same_bits(q.data_t, rdata_t, name="data_t")
    else:
        assert q.data_t is None
    _assert_same_state(new_state, rstate, "new_state")


@given(data=st.data())
def test_roundtrip_within_half_ulp_in_normal_range(data: st.DataObject) -> None:
    """|dequantize(quantize(x)) - x| <= half-ulp x |x| where smallest_normal <= |x * scale| <= fp8_max."""
    recipe, role, role_arg, state, x, _ = _quantize_case(data, specials=False, transpose_ok=False)
    q, _ = fp8ops.quantize(x, state, recipe=recipe, role=role_arg)
    y = fp8ops.dequantize(q).double()
    x64 = x.double()
    dt = recipe.dtype(role)  # type: ignore[arg-type]
    scaled = (x64 / q.inv_scale.double()).abs()
    normal = (scaled >= smallest_normal(dt)) & (scaled <= recipe.fp8_max(role))  # type: ignore[arg-type]
    if recipe.mode != "delayed" and bool((x != 0).any()):
        # Current scaling maps the amax into the normal range: the property is never vacuous here.
        assert bool(normal.any()), "current scaling left no element in the normal range"
    bound = (half_ulp_rel(dt) + FP32_SLACK) * x64.abs()
    err = (y - x64).abs()
    bad = normal & (err > bound)
    note(f"{int(normal.sum())} of {x.numel()} elements in the normal range")
    assert not bool(bad.any()), (
        f"{int(bad.sum())} element(s) above the {dt} half-ulp bound; first: x={x64[bad][0].item()!r}, "
        f"dequantized={y[bad][0].item()!r}, rel err={(err[bad][0] / x64.abs()[bad][0]).item():.4g} "
        f"> {half_ulp_rel(dt)}"
    )


@given(data=st.data())
def test_saturates_never_inf(data: st.DataObject) -> None:
    """Values beyond fp8_max after scaling (and ±inf) become ±fp8_max; no inf is ever produced."""
    recipe, role, role_arg, state, x, _ = _quantize_case(data, specials=("inf", "huge", "zero"), transpose_ok=False)
    q, _ = fp8ops.quantize(x, state, recipe=recipe, role=role_arg)
    fmax = recipe.fp8_max(role)  # type: ignore[arg-type]
    d = q.data.float()
    y = fp8ops.dequantize(q)
    assert not bool(torch.isinf(d).any()), "inf in the FP8 data"
    assert not bool(torch.isinf(y).any()), "inf in the dequantized output"
    assert bool((d.abs() <= fmax).all()), f"FP8 data above fp8_max {fmax}: {d.abs().max().item()}"
    x64 = x.double()
    over = (x64 / q.inv_scale.double()).abs() > fmax * (1 + FP32_SLACK)
    expected = torch.sign(x64[over]) * fmax
    assert torch.equal(d[over].double(), expected), (
        f"{int(over.sum())} value(s) beyond fp8_max after scaling; got {d[over][:8].tolist()}, "
        f"expected {expected[:8].tolist()}"
    )


@given(data=st.data())
def test_sign_preserved(data: st.DataObject) -> None:
    """A non-zero quantized value has the sign of its input."""
    recipe, role, role_arg, state, x, _ = _quantize_case(
        data, specials=("zero", "inf", "huge", "subnormal", "nan"), transpose_ok=False
    )
    q, _ = fp8ops.quantize(x, state, recipe=recipe, role=role_arg)
    d = q.data.float()
    y = fp8ops.dequantize(q)
    nz = (d != 0) & ~torch.isnan(d)
    assert torch.equal(d[nz] > 0, x[nz] > 0), "FP8 data has the wrong sign"
    assert torch.equal(y[nz] > 0, x[nz] > 0), "dequantized value has the wrong sign"


@given(data=st.data())
def test_nan_stays_nan(data: st.DataObject) -> None:
    """NaN inputs give NaN FP8 data and NaN dequantized values, and nothing else becomes NaN."""
    recipe, role, role_arg, state, x, transpose = _quantize_case(data, specials=("nan", "inf", "zero"))
    q, _ = fp8ops.quantize(x, state, recipe=recipe, role=role_arg, transpose=transpose)
    nan_x = torch.isnan(x)
    assert torch.equal(torch.isnan(q.data.float()), nan_x), "NaN pattern of the FP8 data differs from x's"
    assert torch.equal(torch.isnan(fp8ops.dequantize(q)), nan_x), "NaN pattern of the dequantized value differs"


@given(data=st.data())
def test_requantize_with_same_scale_is_idempotent(data: st.DataObject) -> None:
    """quantize(dequantize(quantize(x))) with the scale of the first call gives the same bytes."""
    recipe, role, role_arg, state, x, _ = _quantize_case(data, specials=True, transpose_ok=False,
                                                         granularities=("tensor",))
    q1, _ = fp8ops.quantize(x, state, recipe=recipe, role=role_arg)
    # The scale of the first call: the state's (delayed, calibrated) or just in time from amax(x).
    fallback = state.scale if state is not None else torch.ones(())
    if recipe.mode == "delayed" and state is not None and state.calibrated:
        s = state.scale
    else:
        s = fp8ops.compute_scale(x.float().abs().amax(), fallback, recipe.fp8_max(role),  # type: ignore[arg-type]
                                 margin=recipe.margin, power_2_scale=recipe.power_2_scale)
    assert_same_bits(q1.inv_scale, torch.reciprocal(s), name="inv_scale (scale recovered for the test)")
    fixed = fp8ops.DelayedScaling(fp8_format=recipe.fp8_format, amax_history_len=1)
    s_state = fp8ops.ScalingState(torch.zeros(1), s.clone(), torch.zeros(()), role=role, calibrated=True)  # type: ignore[arg-type]
    q2, _ = fp8ops.quantize(fp8ops.dequantize(q1), s_state, recipe=fixed)
    assert_same_bits(q2.data, q1.data, name="requantized data")


@given(data=st.data())
def test_inputs_not_mutated(data: st.DataObject) -> None:
    """quantize and dequantize leave x, every tensor of the state and the FP8 value untouched."""
    recipe, role, role_arg, state, x, transpose = _quantize_case(data, specials=True)
    x0, state0 = x.clone(), _clone_state(state)
    q, new_state = fp8ops.quantize(x, state, recipe=recipe, role=role_arg, transpose=transpose)
    assert_same_bits(x, x0, name="x")
    _assert_same_state(state, state0, "state")
    data0, inv0 = q.data.clone(), q.inv_scale.clone()
    fp8ops.dequantize(q, dtype=data.draw(DTYPES, label="dequantize dtype"))
    assert_same_bits(q.data, data0, name="q.data")
    assert_same_bits(q.inv_scale, inv0, name="q.inv_scale")
    if new_state is not None and state is not None:
        assert new_state.pending_amax is not state.pending_amax, "the new state aliases the old pending_amax"


@given(data=st.data())
def test_amax_is_max_abs(data: st.DataObject) -> None:
    """new_state.pending_amax == max(state.pending_amax, max |x|); NaN if x has a NaN."""
    recipe = data.draw(fst.recipes(), label="recipe")
    role = data.draw(ROLES, label="role")
    state = data.draw(fst.scaling_states(recipe, role=role), label="state")
    shape = data.draw(fst.shapes(1, 3), label="shape")
    x = data.draw(fst.float_tensors(shape, DTYPES, specials=True), label="x")
    _, new_state = fp8ops.quantize(x, state, recipe=recipe)
    assert new_state is not None
    vals = [abs(v) for v in x.float().reshape(-1).tolist()]
    expected = math.nan if any(math.isnan(v) for v in vals) else max([float(state.pending_amax), *vals])
    got = float(new_state.pending_amax)
    assert (math.isnan(got) and math.isnan(expected)) or got == expected, f"pending_amax {got!r}, expected {expected!r}"
    assert new_state.pending_amax.dtype == torch.float32 and new_state.pending_amax.shape == ()


@given(data=st.data())
def test_state_stable_over_many_updates(data: st.DataObject) -> None:
    """Over many observe/update rounds (observations 0, NaN, inf included) every state keeps its
    shapes and dtypes, a finite history, a finite positive scale, and the inputs are not mutated."""
    recipe = data.draw(fst.recipes(granularities=("tensor",)), label="recipe")
    role = data.draw(ROLES, label="role")
    bare = recipe.init(role=role)  # type: ignore[arg-type]
    op = fp8ops.FakeQuantState.init(recipe)
    obs = fst.amaxes()
    for step in range(data.draw(st.integers(1, 12), label="rounds")):
        for _ in range(data.draw(st.integers(0, 3), label="observations")):
            if data.draw(st.booleans(), label="observe through quantize"):
                x = data.draw(fst.float_tensors(fst.shapes(1, 2, max_numel=12), specials=True), label="x")
                _, bare = fp8ops.quantize(x, bare, recipe=recipe)
                _, op_in = fp8ops.quantize(x, op.input, recipe=recipe)
                op = op.replace(input=op_in)
            else:
                bare = bare.observe(torch.tensor(data.draw(obs, label="amax")))
        g = data.draw(st.none() | obs, label="grad amax")
        grad = None if g is None else torch.tensor(g)
        bare0, op0 = _clone_state(bare), fp8ops.FakeQuantState(input=_clone_state(op.input), grad_output=_clone_state(op.grad_output))
        if data.draw(st.booleans(), label="recipe.update"):
            new_bare = recipe.update(bare, grad_amax=grad)
        else:
            new_bare = fp8ops.update({"s": bare}, recipe=recipe)["s"]
        new_op = fp8ops.update(op, recipe=recipe, grad_amax=grad)
        _assert_same_state(bare, bare0, f"round {step}: state before update")
        _assert_same_state(op.input, op0.input, f"round {step}: op.input before update")
        _assert_same_state(op.grad_output, op0.grad_output, f"round {step}: op.grad_output before update")
        _check_invariants(new_bare, recipe, role, f"round {step}: state")
        _check_invariants(new_op.input, recipe, "forward", f"round {step}: op.input")
        _check_invariants(new_op.grad_output, recipe, "backward", f"round {step}: op.grad_output")
        bare, op = new_bare, new_op


@given(data=st.data())
def test_rowwise_one_scale_per_row(data: st.DataObject) -> None:
    """Row-wise scaling: inv_scale is (..., 1), and each row's amax maps to fp8_max / 2**margin
    (to (fp8_max / 2**(margin+1), fp8_max / 2**margin] with power-of-two scales)."""
    recipe = data.draw(fst.recipes(kinds=("current",), granularities=("row",)), label="recipe")
    role = data.draw(ROLES, label="role")
    shape = data.draw(fst.shapes(1, 3), label="shape")
    x = data.draw(fst.float_tensors(shape, DTYPES, specials=("zero", "nan", "inf", "huge")), label="x")
    q, _ = fp8ops.quantize(x, None, recipe=recipe, role=role)  # type: ignore[arg-type]
    assert q.inv_scale.shape == (*x.shape[:-1], 1), f"inv_scale shape {tuple(q.inv_scale.shape)} for x {tuple(x.shape)}"
    fmax = recipe.fp8_max(role)  # type: ignore[arg-type]
    top = fmax / 2**recipe.margin
    K = x.shape[-1]
    d = q.data.float().reshape(-1, K)
    row_amax = x.float().abs().reshape(-1, K).amax(dim=1)
    for r in range(d.shape[0]):
        row = d[r][~torch.isnan(d[r])]
        m = float(row.abs().max()) if row.numel() else 0.0
        assert m <= fmax, f"row {r}: max |data| {m} > fp8_max {fmax}"
        a = float(row_amax[r])
        if math.isfinite(a) and a > 0:
            if recipe.power_2_scale:
                assert top / 2 <= m <= top, f"row {r} (amax {a}): max |data| {m} not in [{top / 2}, {top}]"
            else:
                assert m == top, f"row {r} (amax {a}): max |data| {m} != fp8_max / 2**margin = {top}"


@example(  # a unit side: the transposed copy must still be a separate tensor
    recipe=fp8ops.CurrentScaling(), role="forward", x=torch.ones(1, 4), with_state=False,
    scale=torch.ones(()), calibrated=False,
)
@given(
    recipe=fst.recipes(granularities=("tensor",)),
    role=ROLES,
    x=fst.float_tensors(fst.shapes(2, 3), DTYPES, specials=True),
    with_state=st.booleans(),
    scale=fst.scales(),
    calibrated=st.booleans(),
)
def test_transpose_copy(
    recipe: fp8ops.Recipe, role: str, x: torch.Tensor, with_state: bool, scale: torch.Tensor, calibrated: bool
) -> None:
    """transpose=True: data_t == data.reshape(-1, K).t(), and data is what transpose=False gives.

    Shapes with a unit side matter: there ``q.t()`` is already contiguous, and a kernel that
    returns ``q.t().contiguous()`` hands back an alias of ``q``, which a custom op may not do.
    """
    state = None
    if with_state or recipe.mode == "delayed":
        state = recipe.init(role=role).replace(scale=scale, calibrated=calibrated)  # type: ignore[arg-type]
    q, _ = fp8ops.quantize(x, state, recipe=recipe, role=role, transpose=True)
    plain, _ = fp8ops.quantize(x, state, recipe=recipe, role=role)
    K = x.shape[-1]
    assert q.data_t is not None
    assert q.data_t.shape == (K, x.numel() // K)
    assert_same_bits(q.data_t, q.data.reshape(-1, K).t().contiguous(), name="data_t")
    assert_same_bits(q.data, plain.data, name="data")
    assert_same_bits(q.inv_scale, plain.inv_scale, name="inv_scale")
