"""Recipe math against hand-computed cases, formats, and recipe validation."""

import math

import attrs
import pytest
import torch

import fp8ops
from fp8ops import CurrentScaling, DelayedScaling, Format


def _obs(state, value):
    return state.observe(torch.tensor(float(value)))


def _hist(state):
    return state.amax_history.tolist()


# ------------------------------------------------------------------------------------------------
# formats


def test_formats():
    assert Format.E4M3.dtype("forward") == Format.E4M3.dtype("backward") == torch.float8_e4m3fn
    assert Format.E5M2.dtype("forward") == torch.float8_e5m2
    assert Format.HYBRID.dtype("forward") == torch.float8_e4m3fn
    assert Format.HYBRID.dtype("backward") == torch.float8_e5m2
    assert Format.HYBRID.max("forward") == fp8ops.E4M3_MAX == 448.0
    assert Format.HYBRID.max("backward") == fp8ops.E5M2_MAX == 57344.0
    assert torch.finfo(torch.float8_e4m3fn).max == fp8ops.E4M3_MAX
    assert torch.finfo(torch.float8_e5m2).max == fp8ops.E5M2_MAX
    with pytest.raises(ValueError, match="role must be 'forward' or 'backward'"):
        Format.E4M3.dtype("grad")


# ------------------------------------------------------------------------------------------------
# history rolling, amax algorithms, margin, power of two


def test_history_rolls_newest_first():
    r = DelayedScaling(fp8_format=Format.E4M3, amax_history_len=3)
    s = r.init(role="forward")
    assert _hist(s) == [0.0, 0.0, 0.0] and s.scale.item() == 1.0 and not s.calibrated
    for v in (1.0, 2.0, 4.0, 8.0):
        s = r.update(_obs(s, v))
    assert _hist(s) == [8.0, 4.0, 2.0]
    assert s.pending_amax.item() == 0.0 and s.calibrated


def test_max_vs_most_recent():
    for algo, expect in (("max", 448.0 / 16.0), ("most_recent", 448.0 / 2.0)):
        r = DelayedScaling(fp8_format=Format.E4M3, amax_history_len=4, amax_compute_algo=algo)
        s = r.init(role="forward")
        for v in (16.0, 4.0, 2.0):
            s = r.update(_obs(s, v))
        assert s.scale.item() == expect, algo


def test_callable_amax_algo_and_scaling_factor():
    r = DelayedScaling(
        fp8_format=Format.E4M3,
        amax_history_len=3,
        amax_compute_algo=lambda h: h.mean(-1),
        scaling_factor_compute_algo=lambda amax, scale, fmax, recipe: fmax / amax / 4,
    )
    s = r.init(role="forward")
    s = r.update(_obs(s, 6.0))  # history [6, 0, 0]: mean 2 -> 448 / 2 / 4
    assert s.scale.item() == 56.0


def test_margin_and_role_format():
    r = DelayedScaling(fp8_format=Format.HYBRID, margin=2, amax_history_len=1)
    f = r.update(_obs(r.init(role="forward"), 7.0))
    b = r.update(_obs(r.init(role="backward"), 7.0))
    assert f.scale.item() == 448.0 / 7.0 / 4.0
    assert b.scale.item() == pytest.approx(57344.0 / 7.0 / 4.0, rel=1e-7)


def test_power_2_scale_rounds_down():
    r = DelayedScaling(fp8_format=Format.E4M3, amax_history_len=1, power_2_scale=True)
    s = r.update(_obs(r.init(role="forward"), 3.0))  # 448 / 3 = 149.33 -> 128
    assert s.scale.item() == 128.0
    s = r.update(_obs(s, 3.5))  # 448 / 3.5 = 128 exactly -> 128
    assert s.scale.item() == 128.0
    s = r.update(_obs(s, 3.5001))  # just below 128 -> 64
    assert s.scale.item() == 64.0


@pytest.mark.parametrize("bad", [0.0, float("nan"), float("inf"), float("-inf")])
def test_zero_or_nonfinite_keeps_old_scale_and_never_enters_history(bad):
    r = DelayedScaling(fp8_format=Format.E4M3, amax_history_len=3, amax_compute_algo="most_recent")
    s = r.update(_obs(r.init(role="forward"), 7.0))
    assert s.scale.item() == 64.0
    s2 = r.update(_obs(s, bad))
    assert s2.scale.item() == 64.0
    assert _hist(s2) == [0.0, 7.0, 0.0]
    assert torch.isfinite(s2.amax_history).all()


def test_nan_gradient_amax_skipped_even_with_finite_pending():
    r = DelayedScaling(fp8_format=Format.E4M3, amax_history_len=2)
    s = _obs(r.init(role="forward"), 7.0)
    s2 = r.update(s, grad_amax=torch.tensor(float("nan")))
    assert _hist(s2) == [0.0, 0.0] and s2.scale.item() == 1.0


def test_update_merges_pending_and_grad_amax_by_max():
    r = DelayedScaling(fp8_format=Format.E4M3, amax_history_len=2)
    s = _obs(r.init(role="backward"), 3.0)
    assert r.update(s, grad_amax=torch.tensor(14.0)).scale.item() == 32.0
    assert r.update(s, grad_amax=torch.tensor(1.0)).scale.item() == pytest.approx(448.0 / 3.0)


def test_tiny_amax_clamps_scale_to_float32_max():
    r = DelayedScaling(fp8_format=Format.E4M3, amax_history_len=1)
    s = r.update(_obs(r.init(role="forward"), 1e-42))
    assert s.scale.item() == torch.finfo(torch.float32).max


def test_update_does_not_modify_input_state():
    r = DelayedScaling(amax_history_len=2)
    s = _obs(r.init(role="forward"), 5.0)
    before = [t.clone() for t in (s.amax_history, s.scale, s.pending_amax)]
    r.update(s)
    for a, b in zip(before, (s.amax_history, s.scale, s.pending_amax)):
        assert torch.equal(a, b)
    assert not s.calibrated


def test_history_length_mismatch_is_a_clear_error():
    s = DelayedScaling(amax_history_len=4).init()
    with pytest.raises(ValueError, match="length 4 but this recipe keeps 16"):
        DelayedScaling().update(s)


def test_compute_scale_matches_formula():
    amax = torch.tensor([7.0, 0.0, float("nan"), float("inf"), 1.0])
    old = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
    out = fp8ops.compute_scale(amax, old, 448.0, margin=1)
    assert out.tolist() == [32.0, 2.0, 3.0, 4.0, 224.0]


# ------------------------------------------------------------------------------------------------
# current scaling


def test_current_scaling_state_and_update():
    r = CurrentScaling(fp8_format=Format.E5M2)
    s = r.init(role="backward")
    assert s.amax_history.shape == (1,) and s.calibrated
    s = r.update(_obs(s, 7.0))
    assert _hist(s) == [7.0] and s.scale.item() == 57344.0 / 7.0
    assert r.mode == "current" and CurrentScaling(granularity="row").mode == "rowwise"


# ------------------------------------------------------------------------------------------------
# validation and hashing


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"fp8_format": "E4M3"}, "fp8_format must be a fp8ops.Format"),
        ({"margin": -1}, "margin must be an int in"),
        ({"margin": 1.5}, "margin must be an int in"),
        ({"margin": 65}, "margin must be an int in"),
        ({"amax_history_len": 0}, "amax_history_len must be an int >= 1"),
        ({"amax_compute_algo": "mean"}, "amax_compute_algo must be"),
        ({"scaling_factor_compute_algo": 3}, "scaling_factor_compute_algo must be None or a callable"),
        ({"power_2_scale": 1}, "power_2_scale must be a bool"),
    ],
)
def test_delayed_scaling_validation(kwargs, match):
    with pytest.raises((TypeError, ValueError), match=match):
        DelayedScaling(**kwargs)


def test_current_scaling_validation_and_keyword_only():
    with pytest.raises(ValueError, match="granularity must be 'tensor' or 'row'"):
        CurrentScaling(granularity="block")
    with pytest.raises(TypeError):
        DelayedScaling(Format.E4M3)  # keyword-only


def test_recipes_are_frozen_and_hashable():
    a, b = DelayedScaling(margin=1), DelayedScaling(margin=1)
    assert a == b and hash(a) == hash(b) and {a: 1}[b] == 1
    assert DelayedScaling(margin=2) != a
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        a.margin = 3  # type: ignore[misc]


def test_init_role_validation_and_device():
    with pytest.raises(ValueError, match="role"):
        DelayedScaling().init(role="input")  # type: ignore[arg-type]
    s = DelayedScaling().init(role="backward", device="cpu")
    assert s.role == "backward" and s.scale.dtype == torch.float32 and s.scale.dim() == 0
    assert math.isclose(s.scale.item(), 1.0)


def test_a_never_observed_state_keeps_its_history_and_scale_next_to_observed_ones():
    r = DelayedScaling(amax_history_len=2)
    st = {k: r.init(role="forward") for k in "abc"}
    st["c"] = st["c"].replace(amax_history=torch.tensor([3.0, 1.0]), scale=torch.tensor(2.0))
    for vals in ([1.0, 2.0], [4.0, 8.0], [0.5, 16.0]):
        obs = {k: s.observe(torch.tensor(v)) for (k, s), v in zip(list(st.items())[:2], vals)}
        st = fp8ops.update({**obs, "c": st["c"]}, recipe=r)  # "c": no op observed it
    assert not st["c"].calibrated and st["c"].amax_history.tolist() == [3.0, 1.0] and st["c"].scale.item() == 2.0
    assert st["a"].amax_history.tolist() == [0.5, 4.0] and st["b"].amax_history.tolist() == [16.0, 8.0]


def test_update_many_takes_two_observations_per_state():
    """update_many with (2, S) observations equals the one with their maximum; another shape raises."""
    r = fp8ops.DelayedScaling(amax_history_len=3)
    states = [r.init(role="forward").replace(observed=True), r.init(role="backward").replace(observed=True)]
    pair = torch.tensor([[3.5, float("nan")], [1.0, 2.0]])
    a = r.update_many(states, pair)
    b = r.update_many(states, pair.amax(0))
    assert [s.scale.item() for s in a] == [128.0, 1.0] and [s.calibrated for s in a] == [True, False]
    assert all(torch.equal(x.amax_history, y.amax_history) and torch.equal(x.scale, y.scale) for x, y in zip(a, b))
    with pytest.raises(ValueError, match=r"obs must have shape \(2,\) or \(2, 2\)"):
        r.update_many(states, torch.ones(3, 2))


def test_rows_reads_an_update_s_rows_in_place():
    """recipes._rows: the rows an update returned (consecutive rows of one buffer) are viewed, not
    stacked; rows in another order, or of different buffers, are stacked."""
    from fp8ops.recipes import _rows

    buf = torch.arange(12.0).reshape(4, 3)
    rows = buf.unbind(0)
    v = _rows(rows)
    assert v.data_ptr() == buf.data_ptr() and torch.equal(v, buf)
    scalars = torch.arange(4.0).unbind(0)
    assert _rows(scalars).data_ptr() == scalars[0].data_ptr()
    shuffled = [rows[1], rows[0], rows[2], rows[3]]
    s = _rows(shuffled)
    assert s.data_ptr() != buf.data_ptr() and torch.equal(s, torch.stack(shuffled))
    mixed = [rows[0], rows[1].clone()]
    assert torch.equal(_rows(mixed), torch.stack(mixed)) and _rows(mixed).data_ptr() != buf.data_ptr()


def test_when_the_fused_update_kernel_may_run():
    """recipes._eager_kernels_ok / Recipe._fused_algo: the fused kernel (GPU, eager) only for plain
    float32 states of the recipe's default hooks, histories of at most 4096 steps, outside
    torch.func transforms; the torch operations otherwise."""
    from fp8ops.recipes import _eager_kernels_ok

    r = fp8ops.DelayedScaling(amax_history_len=4)
    states = [r.init(), r.init(role="backward")]
    obs = torch.zeros(2, 2)
    assert _eager_kernels_ok(obs, states)
    assert not _eager_kernels_ok(obs, [s.replace(amax_history=torch.zeros(4097)) for s in states])
    assert not _eager_kernels_ok(obs, [states[0].replace(scale=torch.ones((), dtype=torch.float64)), states[1]])
    seen = []
    torch.func.vmap(lambda t: seen.append(_eager_kernels_ok(obs, states)) or t)(torch.zeros(2))
    assert seen == [False]
    assert r._fused_algo() == "max"
    assert fp8ops.DelayedScaling(amax_compute_algo="most_recent")._fused_algo() == "most_recent"
    assert fp8ops.DelayedScaling(amax_compute_algo=lambda h: h.amax(-1))._fused_algo() is None
    assert fp8ops.DelayedScaling(scaling_factor_compute_algo=lambda a, s, m, r: m / a)._fused_algo() is None

    class Mine(fp8ops.DelayedScaling):
        def scale_from_amax(self, amax, old_scale, fp8_max):
            return old_scale

    assert Mine()._fused_algo() is None
