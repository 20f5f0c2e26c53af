"""Properties of fp8ops.fake_quantize: forward and gradients against the FP32 reference, the probe
protocol (its gradient is amax(dy); without one the gradient uses current scaling), and NaN
handling (NaN flows through the values but never into the state)."""

from __future__ import annotations

import math

import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.utils import _pytree as pytree

import fp8ops
from fp8ops.reference import fake_quantize as ref
from fp8ops.testing import assert_same_bits
from fp8ops.testing import strategies as fst

DTYPES = st.sampled_from((torch.float32, torch.bfloat16, torch.float16))
TENSOR_RECIPES = fst.recipes(granularities=("tensor",))


def _draw_op_state(data: st.DataObject, recipe: fp8ops.Recipe) -> fp8ops.FakeQuantState:
    return fp8ops.FakeQuantState(
        input=data.draw(fst.scaling_states(recipe, role="forward"), label="state.input"),
        grad_output=data.draw(fst.scaling_states(recipe, role="backward"), label="state.grad_output"),
    )


def _run(x: torch.Tensor, dy: torch.Tensor, state: fp8ops.FakeQuantState, recipe: fp8ops.Recipe, *,
         probe: bool) -> tuple[torch.Tensor, fp8ops.FakeQuantState, torch.Tensor, torch.Tensor | None]:
    """Forward and backward under plain autograd: ``(y, new_state, dx, probe grad)``."""
    xg = x.detach().requires_grad_(True)  # shares x's storage: an in-place write would show in x
    p = torch.zeros((), requires_grad=True) if probe else None
    y, new_state = fp8ops.fake_quantize(xg, state, recipe=recipe, grad_probe=p)
    y.backward(dy)
    assert xg.grad is not None
    return y.detach(), new_state, xg.grad, (None if p is None else p.grad)


def _assert_same_state(a: fp8ops.ScalingState, b: fp8ops.ScalingState, name: str) -> None:
    assert (a.role, a.calibrated) == (b.role, b.calibrated), f"{name}: static fields differ"
    assert_same_bits(a.amax_history, b.amax_history, name=f"{name}.amax_history")
    assert_same_bits(a.scale, b.scale, name=f"{name}.scale")
    assert_same_bits(a.pending_amax, b.pending_amax, name=f"{name}.pending_amax")


def _max_abs(t: torch.Tensor) -> float:
    vals = [abs(v) for v in t.float().reshape(-1).tolist()]
    return math.nan if any(math.isnan(v) for v in vals) else max(vals, default=0.0)


@given(data=st.data())
def test_forward_and_gradients_equal_reference(data: st.DataObject) -> None:
    """y, new_state, dx and the probe gradient equal fp8ops.reference.fake_quantize(_grad) bit for
    bit, and x, dy and the state are left untouched."""
    recipe = data.draw(TENSOR_RECIPES, label="recipe")
    shape = data.draw(fst.shapes(1, 3), label="shape")
    dtype = data.draw(DTYPES, label="dtype")
    x = data.draw(fst.float_tensors(shape, dtype, specials=True), label="x")
    dy = data.draw(fst.float_tensors(shape, dtype, specials=True), label="dy")
    state = _draw_op_state(data, recipe)
    probe = data.draw(st.booleans(), label="probe")
    x0, dy0 = x.clone(), dy.clone()
    state0 = pytree.tree_map(torch.clone, state)
    y, new_state, dx, pgrad = _run(x, dy, state, recipe, probe=probe)
    # Nothing given to the op is modified: x, dy and every tensor of the state.
    assert_same_bits(x, x0, name="x after forward and backward")
    assert_same_bits(dy, dy0, name="dy after backward")
    _assert_same_state(state.input, state0.input, "state.input after the call")
    _assert_same_state(state.grad_output, state0.grad_output, "state.grad_output after the call")
    y_ref, state_ref = ref.fake_quantize(x, state, recipe=recipe)
    dx_ref, amax_ref = ref.fake_quantize_grad(dy, state, recipe=recipe, has_probe=probe)
    assert_same_bits(y, y_ref, name="y")
    _assert_same_state(new_state.input, state_ref.input, "new_state.input")
    _assert_same_state(new_state.grad_output, state_ref.grad_output, "new_state.grad_output")
    assert_same_bits(dx, dx_ref, name="dx")
    if probe:
        assert pgrad is not None
        assert_same_bits(pgrad, amax_ref, name="probe grad")


@given(data=st.data())
def test_probe_gradient_is_amax_of_dy(data: st.DataObject) -> None:
    """The probe's gradient is max |dy| as a 0-d float32 (NaN if dy has a NaN); the op state's
    input role records max |x| and the grad_output role records nothing."""
    recipe = data.draw(TENSOR_RECIPES, label="recipe")
    shape = data.draw(fst.shapes(1, 3), label="shape")
    dtype = data.draw(DTYPES, label="dtype")
    x = data.draw(fst.float_tensors(shape, dtype, specials=True), label="x")
    dy = data.draw(fst.float_tensors(shape, dtype, specials=True), label="dy")
    state = fp8ops.FakeQuantState.init(recipe)
    _, new_state, _, pgrad = _run(x, dy, state, recipe, probe=True)
    assert pgrad is not None and pgrad.shape == () and pgrad.dtype == torch.float32
    want, got = _max_abs(dy), float(pgrad)
    assert (math.isnan(want) and math.isnan(got)) or got == want, f"probe grad {got!r}, amax(dy) {want!r}"
    want_x, got_x = _max_abs(x), float(new_state.input.pending_amax)
    assert (math.isnan(want_x) and math.isnan(got_x)) or got_x == want_x, f"pending {got_x!r}, amax(x) {want_x!r}"
    assert float(new_state.grad_output.pending_amax) == 0.0


@given(data=st.data())
def test_no_probe_gradient_uses_current_scaling(data: st.DataObject) -> None:
    """Without a probe, dx ignores state.grad_output and equals the gradient quantized with the
    scale just-in-time from amax(dy) (what a calibrated delayed state with that scale gives)."""
    recipe = data.draw(TENSOR_RECIPES, label="recipe")
    shape = data.draw(fst.shapes(1, 3), label="shape")
    dtype = data.draw(DTYPES, label="dtype")
    x = data.draw(fst.float_tensors(shape, dtype), label="x")
    dy = data.draw(fst.float_tensors(shape, dtype, specials=True), label="dy")
    s1, s2 = _draw_op_state(data, recipe), _draw_op_state(data, recipe)
    _, _, dx1, _ = _run(x, dy, s1, recipe, probe=False)
    _, _, dx2, _ = _run(x, dy, s2, recipe, probe=False)
    assert_same_bits(dx1, dx2, name="dx with two different grad_output states")
    # The same gradient through the probe path of a delayed recipe whose calibrated state holds the
    # current scale (the fallback for an amax of 0 / NaN / inf is 1).
    s_cur = fp8ops.compute_scale(dy.float().abs().amax(), torch.ones(()), recipe.fp8_max("backward"),
                                 margin=recipe.margin, power_2_scale=recipe.power_2_scale)
    delayed = fp8ops.DelayedScaling(fp8_format=recipe.fp8_format, amax_history_len=1)
    st_cur = fp8ops.FakeQuantState(
        input=s1.input.replace(amax_history=torch.zeros(1)),
        grad_output=fp8ops.ScalingState(torch.zeros(1), s_cur, torch.zeros(()), role="backward", calibrated=True),
    )
    _, _, dx_cur, _ = _run(x, dy, st_cur, delayed, probe=True)
    assert_same_bits(dx1, dx_cur, name="dx vs current scaling")


@given(data=st.data())
def test_nan_flows_through_values_not_into_state(data: st.DataObject) -> None:
    """A NaN in x gives NaN in y at the same places; after fp8ops.update the history stays finite,
    the NaN observation counts as "no information" (0), and a fresh history keeps its scale."""
    recipe = data.draw(TENSOR_RECIPES, label="recipe")
    shape = data.draw(fst.shapes(1, 3), label="shape")
    dtype = data.draw(DTYPES, label="dtype")
    x = data.draw(fst.float_tensors(shape, dtype, specials=True), label="x")
    nan_at = data.draw(st.lists(st.integers(0, x.numel() - 1), min_size=1, max_size=4), label="NaN positions")
    x = x.reshape(-1).clone()
    x[nan_at] = math.nan
    x = x.reshape(shape)
    dy = data.draw(fst.float_tensors(shape, dtype, specials=data.draw(st.booleans(), label="dy specials")), label="dy")
    fresh = data.draw(st.booleans(), label="fresh history")
    if fresh:
        state = fp8ops.FakeQuantState(
            input=recipe.init(role="forward").replace(scale=data.draw(fst.scales(), label="input scale")),
            grad_output=recipe.init(role="backward").replace(scale=data.draw(fst.scales(), label="grad scale")),
        )
    else:
        state = _draw_op_state(data, recipe)
    y, new_state, dx, pgrad = _run(x, dy, state, recipe, probe=True)
    assert torch.equal(torch.isnan(y), torch.isnan(x)), "NaN pattern of y differs from x's"
    assert torch.equal(torch.isnan(dx), torch.isnan(dy)), "NaN pattern of dx differs from dy's"
    assert math.isnan(float(new_state.input.pending_amax)), "the NaN was not observed"
    updated = fp8ops.update(new_state, recipe=recipe, grad_amax=pgrad)
    for role_name in ("input", "grad_output"):
        new = getattr(updated, role_name)
        assert bool(torch.isfinite(new.amax_history).all()), f"{role_name}: history {new.amax_history} not finite"
        assert bool(torch.isfinite(new.scale)) and float(new.scale) > 0, f"{role_name}: scale {new.scale}"
        assert float(new.pending_amax) == 0.0
    # The input's observation was NaN. An uncalibrated state observed nothing: left as it is and
    # still uncalibrated. A calibrated one rolls in 0 and the scale follows the rule on that
    # history, which for a fresh history (all zeros) keeps the scale.
    old_in, new_in = state.input, updated.input
    if not old_in.calibrated:
        assert not new_in.calibrated, "an update that observed nothing calibrated the input state"
        assert_same_bits(new_in.amax_history, old_in.amax_history, name="input history (nothing observed)")
        assert_same_bits(new_in.scale, old_in.scale, name="input scale (nothing observed)")
        return
    expected_hist = torch.cat([torch.zeros(1), old_in.amax_history[:-1]])
    assert_same_bits(new_in.amax_history, expected_hist, name="input history")
    expected_scale = recipe.scale_from_amax(recipe.amax_from_history(expected_hist), old_in.scale,
                                            torch.tensor(recipe.fp8_max("forward")))
    assert_same_bits(new_in.scale, expected_scale, name="input scale")
    if fresh:
        assert_same_bits(new_in.scale, old_in.scale, name="input scale after a NaN step on a fresh history")
        if math.isnan(float(pgrad)) or math.isinf(float(pgrad)) or float(pgrad) == 0.0:
            assert_same_bits(updated.grad_output.scale, state.grad_output.scale, name="grad scale")
