"""Public quantize / dequantize on CPU: semantics, errors, opcheck, vmap, compile."""

import pytest
import torch

import fp8ops
from fp8ops import CurrentScaling, DelayedScaling, Format
from fp8ops.reference import quantize as R

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _u8(t):
    return t.view(torch.uint8)


def test_delayed_calibrated_uses_state_scale_and_records_amax():
    r = DelayedScaling()
    s = r.init(role="forward").replace(scale=torch.tensor(2.0), calibrated=True)
    x = torch.tensor([[1.0, -3.0], [300.0, 0.25]], dtype=torch.bfloat16)
    q, s2 = fp8ops.quantize(x, s, recipe=r)
    assert q.data.dtype == E4M3 and q.inv_scale.item() == 0.5
    assert q.data.float().tolist() == [[2.0, -6.0], [448.0, 0.5]]  # 600 saturates
    assert s2.pending_amax.item() == 300.0 and s.pending_amax.item() == 0.0
    assert fp8ops.dequantize(q).tolist() == [[1.0, -3.0], [224.0, 0.25]]


def test_uncalibrated_delayed_state_uses_current_scaling():
    r = DelayedScaling()
    x = torch.tensor([3.5, 1.0, -0.5])
    q, _ = fp8ops.quantize(x, r.init(role="forward"), recipe=r)
    assert q.inv_scale.item() == pytest.approx(3.5 / 448.0)
    assert q.data.float().abs().max().item() == 448.0


def test_backward_role_uses_e5m2_under_hybrid():
    r = DelayedScaling(fp8_format=Format.HYBRID)
    q, _ = fp8ops.quantize(torch.ones(2, 2), r.init(role="backward"), recipe=r)
    assert q.data.dtype == E5M2
    q, _ = fp8ops.quantize(torch.ones(2, 2), None, recipe=CurrentScaling(), role="backward")
    assert q.data.dtype == E5M2


@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 3, 17), (1, 1, 1, 13)])
@pytest.mark.parametrize("recipe", [DelayedScaling(), CurrentScaling(), CurrentScaling(granularity="row", margin=1)])
def test_matches_reference_any_leading_dims(shape, recipe):
    torch.manual_seed(0)
    x = torch.randn(shape) * 10
    state = recipe.init(role="forward")
    if recipe.mode == "delayed":
        state = state.replace(scale=torch.tensor(12.0), calibrated=True)
    q, s2 = fp8ops.quantize(x, state, recipe=recipe)
    (d, inv, _), s_ref = R.quantize(x, state, recipe=recipe)
    assert q.data.shape == shape and torch.equal(_u8(q.data), _u8(d))
    assert torch.equal(q.inv_scale, inv)
    assert torch.equal(s2.pending_amax, s_ref.pending_amax)
    if recipe.mode == "rowwise":
        assert q.inv_scale.shape == (*shape[:-1], 1)


def test_transpose_copy():
    x = torch.randn(3, 4, 5)
    q, _ = fp8ops.quantize(x, None, recipe=CurrentScaling(), transpose=True)
    assert q.data_t.shape == (5, 12)
    assert torch.equal(_u8(q.data_t), _u8(q.data.reshape(12, 5).t().contiguous()))


def test_transpose_bytes_ops_hand_values():
    """fp8ops::transpose_bytes on the CPU: hand-written bytes, uint8 and FP8."""
    x = torch.tensor([[1, 2, 3], [4, 5, 0xFF]], dtype=torch.uint8)
    want = torch.tensor([[1, 4], [2, 5], [3, 0xFF]], dtype=torch.uint8)
    assert torch.equal(torch.ops.fp8ops.transpose_bytes(x), want)
    y = torch.ops.fp8ops.transpose_bytes(x.view(torch.float8_e4m3fn))
    assert y.dtype == torch.float8_e4m3fn and torch.equal(y.view(torch.uint8), want)


def test_inputs_not_modified():
    r = DelayedScaling()
    x = torch.randn(4, 6)
    s = r.init()
    xc, sc = x.clone(), [t.clone() for t in (s.amax_history, s.scale, s.pending_amax)]
    fp8ops.quantize(x, s, recipe=r, transpose=True)
    assert torch.equal(x, xc)
    for a, b in zip(sc, (s.amax_history, s.scale, s.pending_amax)):
        assert torch.equal(a, b)


def test_nan_input_nan_output_and_nan_amax():
    r = DelayedScaling()
    s = r.init().replace(calibrated=True)
    x = torch.tensor([[1.0, float("nan"), float("inf"), -float("inf")]])
    q, s2 = fp8ops.quantize(x, s, recipe=r)
    v = q.data.float()[0]
    assert v[0].item() == 1.0 and torch.isnan(v[1]) and v[2].item() == 448.0 and v[3].item() == -448.0
    assert torch.isnan(s2.pending_amax)
    s3 = r.update(s2)  # the NaN never enters the history; the scale is kept
    assert torch.isfinite(s3.amax_history).all() and s3.scale.item() == 1.0


def test_empty_tensor():
    q, s = fp8ops.quantize(torch.empty(0, 8), DelayedScaling().init(), recipe=DelayedScaling())
    assert q.data.shape == (0, 8) and s.pending_amax.item() == 0.0


@pytest.mark.parametrize(
    "call,exc,match",
    [
        (lambda: fp8ops.quantize([1.0], None, recipe=CurrentScaling()), TypeError, "x must be a torch.Tensor"),
        (lambda: fp8ops.quantize(torch.ones(2, dtype=torch.float64), None, recipe=CurrentScaling()), ValueError, "float32, bfloat16 or float16"),
        (lambda: fp8ops.quantize(torch.ones(()), None, recipe=CurrentScaling()), ValueError, "at least 1 dimension"),
        (lambda: fp8ops.quantize(torch.ones(3), None, recipe=CurrentScaling(), transpose=True), ValueError, "at least 2 dimension"),
        (lambda: fp8ops.quantize(torch.ones(2), None, recipe="delayed"), TypeError, "recipe must be a fp8ops recipe"),
        (lambda: fp8ops.quantize(torch.ones(2), None, recipe=DelayedScaling()), ValueError, "delayed scaling needs a state"),
        (lambda: fp8ops.quantize(torch.ones(2), DelayedScaling().init(role="forward"), recipe=DelayedScaling(), role="backward"), ValueError, "built for role 'forward'"),
        (lambda: fp8ops.quantize(torch.ones(2), torch.ones(()), recipe=DelayedScaling()), TypeError, "state must be a ScalingState"),
        (lambda: fp8ops.quantize(torch.ones(2), DelayedScaling().init().replace(scale=torch.ones(1)), recipe=DelayedScaling()), ValueError, "state.scale must be a 0-d float32"),
        (lambda: fp8ops.quantize(torch.ones(2, 2), None, recipe=CurrentScaling(granularity="row"), transpose=True), ValueError, "row-wise scaling"),
        (lambda: fp8ops.dequantize(torch.ones(2)), TypeError, "q must be a Float8Value"),
    ],
)
def test_errors_name_argument_and_fix(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_opcheck_every_op():
    x = torch.randn(5, 7)
    one, amax = torch.tensor(2.0), torch.tensor(3.0)
    ops = torch.ops.fp8ops
    for dtype in (E4M3, E5M2):
        torch.library.opcheck(ops.amax.default, (x,))
        torch.library.opcheck(ops.cast.default, (x, one, None, 0, False, dtype))
        torch.library.opcheck(ops.cast.default, (x.bfloat16(), one, amax, 2, True, dtype))
        torch.library.opcheck(ops.cast_transpose.default, (x, one, None, 0, False, dtype))
        torch.library.opcheck(ops.cast_transpose.default, (x, one, amax, 1, False, dtype))
        torch.library.opcheck(ops.cast_transpose_dbias.default, (x, one, None, 0, False, dtype))
        torch.library.opcheck(ops.cast_transpose_dbias.default, (x.bfloat16(), one, amax, 1, True, dtype))
        torch.library.opcheck(ops.cast_rowwise.default, (x, 0, True, dtype))


def test_cast_transpose_dbias_reference_by_hand():
    x = torch.tensor([[1.5, -2.0], [0.25, 3.0], [-4.0, 1.0]], dtype=torch.bfloat16)
    q, qt, amax, inv, db = torch.ops.fp8ops.cast_transpose_dbias(x, torch.tensor(1.0), None, 0, False, E4M3)
    assert db.dtype == torch.float32 and db.tolist() == [-2.25, 2.0]
    assert q.float().tolist() == [[1.5, -2.0], [0.25, 3.0], [-4.0, 1.0]] and torch.equal(qt.float(), q.float().t())
    assert amax.item() == 4.0 and inv.item() == 1.0


def test_vmap_equals_loop():
    r = DelayedScaling()
    s = r.init().replace(scale=torch.tensor(4.0), calibrated=True)
    xs = torch.randn(3, 4, 6) * torch.tensor([1.0, 10.0, 100.0])[:, None, None]

    def f(x):
        q, s2 = fp8ops.quantize(x, s, recipe=r, transpose=True)
        return q.data.float(), q.data_t.float(), s2.pending_amax

    vd, vt, va = torch.func.vmap(f)(xs)
    for i in range(3):
        d, t, a = f(xs[i])
        assert torch.equal(vd[i], d) and torch.equal(vt[i], t) and torch.equal(va[i], a)

    def g(x):  # current scaling: per-sample scales under vmap, like a loop
        return fp8ops.quantize(x, None, recipe=CurrentScaling())[0].inv_scale

    inv = torch.func.vmap(g)(xs)
    assert torch.equal(inv, torch.stack([g(xs[i]) for i in range(3)]))


def test_quantize_under_compile_fullgraph():
    r = DelayedScaling()
    s = r.init().replace(scale=torch.tensor(4.0), calibrated=True)

    def f(x, s):
        q, s2 = fp8ops.quantize(x, s, recipe=r, transpose=True)
        return fp8ops.dequantize(q), q.data_t, s2

    x = torch.randn(6, 10)
    eager = f(x, s)
    comp = torch.compile(f, fullgraph=True)(x, s)
    assert torch.equal(eager[0], comp[0]) and torch.equal(_u8(eager[1]), _u8(comp[1]))
    assert torch.equal(eager[2].pending_amax, comp[2].pending_amax)


def test_cast_transpose_heads_reference_by_hand():
    # q (B=2, H=1, S=2, D=2), k and v (B=2, H=1, S=2, D=2): row (s, b) = [q[b,0,s] | k[b,0,s] | v[b,0,s]]
    q = torch.tensor([[[[1.0, 2.0], [3.0, 4.0]]], [[[5.0, 6.0], [7.0, 8.0]]]])
    k, v = -q, q / 4
    x = R.heads_2d(q, k, v)
    assert x.tolist() == [[1.0, 2.0, -1.0, -2.0, 0.25, 0.5],  # (s=0, b=0)
                          [5.0, 6.0, -5.0, -6.0, 1.25, 1.5],  # (s=0, b=1)
                          [3.0, 4.0, -3.0, -4.0, 0.75, 1.0],  # (s=1, b=0)
                          [7.0, 8.0, -7.0, -8.0, 1.75, 2.0]]  # (s=1, b=1)
    xq, xqt, amax, inv, db = torch.ops.fp8ops.cast_transpose_heads(q, k, v, torch.tensor(2.0), None, 0, False, E4M3)
    assert db.tolist() == [16.0, 20.0, -16.0, -20.0, 4.0, 5.0]
    assert xq.float().tolist() == (2 * x).tolist() and torch.equal(xqt.float(), xq.float().t())
    assert amax.item() == 8.0 and inv.item() == 0.5
    # 8 * 64 = 512 saturates to 448 (E4M3's largest value)
    xq, _, _, _, _ = torch.ops.fp8ops.cast_transpose_heads(q, k, v, torch.tensor(64.0), None, 0, False, E4M3)
    assert xq[3].float().tolist() == [448.0, 448.0, -448.0, -448.0, 112.0, 128.0]


def test_cast_transpose_heads_opcheck():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 3, 8, generator=g)
    k, v = torch.randn(2, 2, 3, 8, generator=g), torch.randn(2, 2, 3, 8, generator=g)
    ops = torch.ops.fp8ops
    torch.library.opcheck(ops.cast_transpose_heads.default, (q, k, v, torch.tensor(2.0), None, 0, False, E4M3))
    torch.library.opcheck(ops.cast_transpose_heads.default,
                          (q.bfloat16(), k.bfloat16(), v.bfloat16(), torch.tensor(1.0), torch.tensor(3.0), 1, True,
                           E5M2))
