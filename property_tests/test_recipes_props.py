"""Properties of the recipe math: compute_scale, power-of-two scales, margins, amax algorithms,
and the update rule against a pure-Python model of Transformer Engine's delayed scaling."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

import fp8ops
from fp8ops import E4M3_MAX, E5M2_MAX
from fp8ops.testing import assert_same_bits
from fp8ops.testing import strategies as fst

FLT_MAX = float(np.finfo(np.float32).max)
FP8_MAXES = st.sampled_from((E4M3_MAX, E5M2_MAX))
MARGINS = st.integers(0, 3)

# Amaxes over the whole float32 range (tiny ones overflow fp8_max / amax), plus float32 subnormals.
WIDE_AMAXES = fst.amaxes(min_exp=-126, max_exp=127) | st.floats(2.0**-149, 2.0**-127, width=32)
VALID_AMAXES = fst.amaxes(allow_zero=False, allow_nonfinite=False, min_exp=-100, max_exp=100)


def f32(v: float) -> float:
    """Round a Python float to the nearest float32 (inf beyond the range)."""
    with np.errstate(over="ignore"):
        return float(np.float32(v))


def model_scale(amax: float, old: float, fp8_max: float, margin: int, power_2: bool) -> float:
    """``fp8_max / amax / 2**margin`` in float32; the old scale for amax 0 / NaN / inf; a quotient
    ``fp8_max / amax`` that overflows float32 becomes the largest float32; optionally rounded down
    to a power of two. Computed in float64 and rounded once (exact for one division)."""
    if not (math.isfinite(amax) and amax > 0):
        return old
    if math.isinf(f32(fp8_max / amax)):
        sf = FLT_MAX
    else:
        sf = f32(fp8_max / amax / 2.0**margin)
    if power_2:
        sf = 2.0 ** math.floor(math.log2(sf))
    return sf


def max_nan(a: float, b: float) -> float:
    """torch.maximum on floats: NaN if either is NaN."""
    return math.nan if math.isnan(a) or math.isnan(b) else max(a, b)


def same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b


@pytest.mark.parametrize("fp8_max_type", ["tensor", "float"])
@example(amax=[117.0], old=[torch.ones(())], fp8_max=E4M3_MAX, margin=0, power_2=False)
@given(
    amax=st.lists(WIDE_AMAXES, min_size=1, max_size=16),
    old=st.lists(fst.scales(), min_size=1, max_size=16),
    fp8_max=FP8_MAXES,
    margin=MARGINS,
    power_2=st.booleans(),
)
def test_compute_scale_matches_formula(
    fp8_max_type: str, amax: list[float], old: list[torch.Tensor], fp8_max: float, margin: int, power_2: bool
) -> None:
    """compute_scale == fp8_max / amax / 2**margin elementwise (correctly rounded float32, as the
    Triton kernels compute it with div_rn); the old scale is kept for 0 / NaN / inf.

    ``fp8_max`` is passed both as a tensor and as a Python float: ``float / Tensor`` in torch is
    reciprocal-then-multiply (two roundings, up to 1 ulp off), so the float case pins that the
    quotient is still one correctly rounded division (the @example is such a case: 448 / 117).
    """
    n = len(amax)
    old_t = torch.stack([old[i % len(old)] for i in range(n)])
    fmax: float | torch.Tensor = fp8_max if fp8_max_type == "float" else torch.full((n,), fp8_max)
    got = fp8ops.compute_scale(torch.tensor(amax, dtype=torch.float32), old_t, fmax, margin=margin,
                               power_2_scale=power_2)
    assert got.shape == (n,) and got.dtype == torch.float32
    for i, a in enumerate(amax):
        want = model_scale(a, float(old_t[i]), fp8_max, margin, power_2)
        assert float(got[i]) == want, f"amax {a!r}, margin {margin}, power_2 {power_2}: got {float(got[i])!r}, want {want!r}"
        if not (math.isfinite(a) and a > 0):
            assert_same_bits(got[i], old_t[i], name=f"scale kept for amax {a!r}")
        assert math.isfinite(float(got[i])) and float(got[i]) > 0


@given(amax=st.lists(WIDE_AMAXES, min_size=1, max_size=16), fp8_max=FP8_MAXES, margin=MARGINS)
def test_power_2_scale_is_exact_power_of_two_below_unrounded(amax: list[float], fp8_max: float, margin: int) -> None:
    """With power_2_scale, a recomputed scale is an exact power of two in (unrounded / 2, unrounded]."""
    a = torch.tensor(amax, dtype=torch.float32)
    old = torch.full_like(a, 3.0)  # not a power of two: a kept scale is recognisable
    p2 = fp8ops.compute_scale(a, old, fp8_max, margin=margin, power_2_scale=True)
    raw = fp8ops.compute_scale(a, old, fp8_max, margin=margin, power_2_scale=False)
    for i, v in enumerate(amax):
        if not (math.isfinite(v) and v > 0):
            assert float(p2[i]) == 3.0
            continue
        s, r = float(p2[i]), float(raw[i])
        mant, _ = math.frexp(s)
        assert mant == 0.5, f"amax {v!r}: scale {s!r} is not a power of two"
        assert r / 2 < s <= r, f"amax {v!r}: power-of-two scale {s!r} not in ({r / 2!r}, {r!r}]"


@given(amax=st.lists(VALID_AMAXES, min_size=1, max_size=16), fp8_max=FP8_MAXES, margin=MARGINS,
       power_2=st.booleans())
def test_margin_divides_by_power_of_two(amax: list[float], fp8_max: float, margin: int, power_2: bool) -> None:
    """compute_scale(margin=m) == compute_scale(margin=0) / 2**m exactly (no overflow involved)."""
    a = torch.tensor(amax, dtype=torch.float32)
    old = torch.ones_like(a)
    with_m = fp8ops.compute_scale(a, old, fp8_max, margin=margin, power_2_scale=power_2)
    without = fp8ops.compute_scale(a, old, fp8_max, margin=0, power_2_scale=power_2)
    assert torch.equal(with_m, without / 2.0**margin), f"margin {margin}: {with_m.tolist()} vs {(without / 2.0**margin).tolist()}"


@given(
    hist=st.integers(1, 8).flatmap(
        lambda L: st.lists(st.lists(fst.amaxes(allow_nonfinite=False), min_size=L, max_size=L), min_size=1, max_size=4)
    ),
)
def test_amax_compute_algo_max_vs_most_recent(hist: list[list[float]]) -> None:
    """"max" reduces the whole history; "most_recent" takes index 0 (the newest step)."""
    L = len(hist[0])
    h = torch.tensor(hist, dtype=torch.float32)  # (S, L)
    mx = fp8ops.DelayedScaling(amax_history_len=L, amax_compute_algo="max").amax_from_history(h)
    mr = fp8ops.DelayedScaling(amax_history_len=L, amax_compute_algo="most_recent").amax_from_history(h)
    assert mx.tolist() == [max(r) for r in hist]
    assert mr.tolist() == [r[0] for r in hist]


@given(
    L=st.integers(1, 8),
    steps=st.lists(fst.amaxes(), min_size=1, max_size=12),
    fp8_format=st.sampled_from(tuple(fp8ops.Format)),
    margin=MARGINS,
    role=st.sampled_from(("forward", "backward")),
)
def test_max_and_most_recent_share_history(
    L: int, steps: list[float], fp8_format: fp8ops.Format, margin: int, role: str
) -> None:
    """Fed the same observations, "max" and "most_recent" share a history; the "max" scale is the
    formula on max(history) and the "most_recent" scale the formula on history[0]."""
    r_max = fp8ops.DelayedScaling(fp8_format=fp8_format, margin=margin, amax_history_len=L, amax_compute_algo="max")
    r_new = fp8ops.DelayedScaling(fp8_format=fp8_format, margin=margin, amax_history_len=L,
                                  amax_compute_algo="most_recent")
    s_max, s_new = r_max.init(role=role), r_new.init(role=role)  # type: ignore[arg-type]
    fmax = r_max.fp8_max(role)  # type: ignore[arg-type]
    for obs in steps:
        old_max, old_new = float(s_max.scale), float(s_new.scale)
        s_max = r_max.update(s_max, grad_amax=torch.tensor(obs))
        s_new = r_new.update(s_new, grad_amax=torch.tensor(obs))
        assert_same_bits(s_max.amax_history, s_new.amax_history, name="history")
        h = s_max.amax_history.tolist()
        assert float(s_max.scale) == model_scale(max(h), old_max, fmax, margin, False)
        assert float(s_new.scale) == model_scale(h[0], old_new, fmax, margin, False)


@given(
    recipe=fst.recipes(granularities=("tensor", "row")),
    role=st.sampled_from(("forward", "backward")),
    steps=st.lists(
        st.tuples(st.lists(fst.amaxes(), max_size=3), st.none() | fst.amaxes(), st.booleans()),
        min_size=1,
        max_size=12,
    ),
)
def test_update_matches_python_model(
    recipe: fp8ops.Recipe, role: str, steps: list[tuple[list[float], float | None, bool]]
) -> None:
    """recipe.update and fp8ops.update equal a pure-Python model of the rule, step by step:

    obs = max(pending, grad_amax) (NaN propagates); a non-finite obs is recorded as 0; the history
    (newest first) rolls; amax = max(history) or history[0]; the scale is the formula on amax (the
    old scale for amax 0); pending is cleared; the state becomes calibrated. Except that an
    uncalibrated state (delayed scaling, before its first observation) whose obs is 0 or
    non-finite keeps its history and scale and stays uncalibrated: observing nothing never
    calibrates.
    """
    L = recipe.history_len
    algo = getattr(recipe, "amax_compute_algo", "max")
    fmax = recipe.fp8_max(role)  # type: ignore[arg-type]
    state = recipe.init(role=role)  # type: ignore[arg-type]
    hist, scale, calibrated = [0.0] * L, 1.0, recipe.mode != "delayed"
    assert state.calibrated == calibrated
    for i, (observations, grad, through_tree) in enumerate(steps):
        pending = 0.0
        for a in observations:
            state = state.observe(torch.tensor(a))
            pending = max_nan(pending, a)
        assert same(float(state.pending_amax), pending), f"step {i}: pending {float(state.pending_amax)} vs {pending}"
        g = None if grad is None else torch.tensor(grad)
        if through_tree and g is None:
            state = fp8ops.update({"s": state}, recipe=recipe)["s"]
        elif through_tree:
            # The tree-level update takes gradient amaxes through an op state's probe slot.
            op = fp8ops.FakeQuantState(input=recipe.init(role="forward"), grad_output=state)
            state = fp8ops.update(op, recipe=recipe, grad_amax=g).grad_output
        else:
            state = recipe.update(state, grad_amax=g)
        obs = pending if grad is None else max_nan(pending, grad)
        obs = obs if math.isfinite(obs) else 0.0
        if calibrated or obs > 0:
            hist = [obs, *hist[:-1]]
            amax = max(hist) if algo == "max" else hist[0]
            scale = model_scale(amax, scale, fmax, recipe.margin, recipe.power_2_scale)
            calibrated = True
        assert state.amax_history.tolist() == hist, f"step {i}: history {state.amax_history.tolist()} vs model {hist}"
        assert float(state.scale) == scale, f"step {i}: scale {float(state.scale)!r} vs model {scale!r}"
        assert float(state.pending_amax) == 0.0 and state.role == role
        assert state.calibrated == calibrated, f"step {i}: calibrated {state.calibrated} vs model {calibrated}"


@example(margin=128, amax=1.0, power_2=False, kind="delayed")
@given(
    margin=st.integers(0, 300),
    amax=fst.amaxes(min_exp=-126, max_exp=127),
    power_2=st.booleans(),
    kind=st.sampled_from(("delayed", "current")),
)
def test_scale_finite_and_positive_for_every_accepted_margin(margin: int, amax: float, power_2: bool, kind: str) -> None:
    """Whatever margin a recipe accepts, an update leaves a finite scale > 0 (a recipe may instead
    reject a margin at construction with ValueError): margins are bounded, and a quotient that
    under- or overflows is clamped to the normal float32 range."""
    try:
        if kind == "delayed":
            recipe: fp8ops.Recipe = fp8ops.DelayedScaling(margin=margin, amax_history_len=1, power_2_scale=power_2)
        else:
            recipe = fp8ops.CurrentScaling(margin=margin, power_2_scale=power_2)
    except ValueError:
        return
    state = recipe.update(recipe.init(role="forward"), grad_amax=torch.tensor(amax))
    s = float(state.scale)
    assert math.isfinite(s) and s > 0, f"margin {margin}, amax {amax!r}: scale {s!r}"
