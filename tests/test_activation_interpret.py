"""The Triton launchers of kernels/activation.py under TRITON_INTERPRET=1, at tiny sizes, on CPU.

Every activation, forward and backward, against the FP32 reference (fp8ops.reference.activation):
high-precision outputs and the bias gradient to a few float32 ulps (the interpreter's exp/erf are
numpy's, not torch's), the amax and the just-in-time scale to float32 rounding, FP8 data to one FP8
ulp of the reference (the interpreter truncates the FP8 downcast instead of rounding to nearest
even), and the transposed copies bit-exactly against the kernel's own data. Bit-exact rounding is
checked on the GPU (test_activation_gpu).
"""

import os

import pytest
import torch
from fp8ops.kernels import activation as K

from fp8ops.reference import activation as R

pytestmark = [
    pytest.mark.interpret,
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs only under TRITON_INTERPRET=1"),
]

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
CFG = {"BLOCK_M": 16, "BLOCK_N": 16, "GROUP_M": 2, "num_warps": 1}


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _inputs(act, M, F, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    C = 2 * F if act in R.GATED else F
    h = (torch.randn(M, C, generator=g) * 2.5).to(dtype)
    da = torch.randn(M, F, generator=g).to(dtype)
    return h, da


def _close32(a, b, what):
    """Within a few float32 ulps of the tensor's scale."""
    scale = float(b.abs().max()) if b.numel() else 0.0
    torch.testing.assert_close(a.float(), b.float(), rtol=1e-5, atol=1e-6 * max(1.0, scale), msg=what)


def _check_fp8(q, qr, inv, what):
    """FP8 values within one FP8 ulp of the reference's (the interpreter truncates), where the
    reference does not round up into the next binade (the interpreter drops that carry)."""
    assert q.dtype == qr.dtype and q.shape == qr.shape, what
    bound = 2.0**-3 if q.dtype == E4M3 else 2.0**-2
    a, r = q.float(), qr.float()
    m, _ = torch.frexp(r)
    carry = m.abs() == 0.5
    sub = 2.0**-9 if q.dtype == E4M3 else 2.0**-16
    ok = ((a - r).abs() <= bound * r.abs() + sub) | carry | (a.isnan() & r.isnan())
    assert ok.all(), f"{what}: {(~ok).sum().item()} values off: {a[~ok][:5].tolist()} vs {r[~ok][:5].tolist()}"


@pytest.mark.parametrize("act", R.ACTIVATIONS)
def test_forward_delayed(act):
    h, _ = _inputs(act, 37, 21, torch.bfloat16, seed=1)
    dt = E4M3
    s = torch.tensor(6.0)
    y, q, qt, amax, inv = K.act_fwd_launch(h, act, True, s, None, 0, False, dt, True, True, config=CFG)
    yr, qr, _, amax_r, inv_r = R.act_fwd(h, act, True, s, None, 0, False, dt, True, True)
    assert y.dtype == torch.bfloat16 and y.shape == yr.shape
    # y is rounded to bf16 by truncation here: one bf16 ulp.
    torch.testing.assert_close(y.float(), yr.float(), rtol=2.0**-7, atol=1e-6)
    _check_fp8(q, qr, inv, f"{act} q")
    assert torch.equal(_u8(qt), _u8(q.t().contiguous()))
    _close32(amax, amax_r, f"{act} amax")
    torch.testing.assert_close(inv, inv_r, rtol=2.0**-21, atol=0.0)


@pytest.mark.parametrize("act", R.ACTIVATIONS)
def test_backward_delayed_dbias(act):
    h, da = _inputs(act, 35, 19, seed=2)
    s = torch.tensor(40.0)
    dh, q, qt, amax, inv, db = K.act_bwd_launch(da, h, act, True, s, None, 0, False, E5M2, True, True, config=CFG)
    dhr, qr, _, amax_r, _, dbr = R.act_bwd(da, h, act, True, s, None, 0, False, E5M2, True, True)
    _close32(dh, dhr, f"{act} dh")
    _check_fp8(q, qr, inv, f"{act} dh q")
    assert qt.shape == (h.shape[1], h.shape[0]) and torch.equal(_u8(qt), _u8(q.t().contiguous()))
    _close32(amax, amax_r, f"{act} dh amax")
    assert db.shape == (h.shape[1],) and db.dtype == torch.float32
    torch.testing.assert_close(db, dbr, rtol=1e-5, atol=1e-5 * float(dhr.abs().sum(0).max()))


@pytest.mark.parametrize("act", ["gelu", "squared_relu", "swiglu", "geglu"])
@pytest.mark.parametrize("margin,pow2", [(0, False), (1, True)])
def test_current_scaling_two_passes(act, margin, pow2):
    h, da = _inputs(act, 20, 33, seed=3)
    fb = torch.tensor(1.0)
    a_in = K.act_amax_launch(h, act, config=CFG)
    _close32(a_in, R.act_amax(h, act), f"{act} act_amax")
    y, q, qt, _, inv = K.act_fwd_launch(h, act, False, fb, a_in, margin, pow2, E4M3, True, True, config=CFG)
    _, qr, _, _, inv_r = R.act_fwd(h, act, False, fb, a_in, margin, pow2, E4M3, True, True)
    assert y.shape == (0,)
    torch.testing.assert_close(inv, inv_r, rtol=2.0**-21, atol=0.0)
    _check_fp8(q, qr, inv, f"{act} current q")
    assert torch.equal(_u8(qt), _u8(q.t().contiguous()))
    g_in = K.act_bwd_amax_launch(da, h, act, config=CFG)
    _close32(g_in, R.act_bwd_amax(da, h, act), f"{act} act_bwd_amax")
    dh, q, qt, _, inv, db = K.act_bwd_launch(da, h, act, False, fb, g_in, margin, pow2, E5M2, True, False,
                                                config=CFG)
    _, qr, _, _, inv_r, _ = R.act_bwd(da, h, act, False, fb, g_in, margin, pow2, E5M2, True, False)
    assert dh.shape == (0,) and db.shape == (0,)
    torch.testing.assert_close(inv, inv_r, rtol=2.0**-21, atol=0.0)
    _check_fp8(q, qr, inv, f"{act} current dh q")


@pytest.mark.parametrize("act", ["relu", "swiglu"])
def test_switches_and_high_precision_only(act):
    """Writes switched off give empty outputs; the high-precision path (no out_dtype) matches."""
    h, da = _inputs(act, 9, 17, torch.float16, seed=4)
    y, q, qt, amax, inv = K.act_fwd_launch(h, act, True, None, None, 0, False, None, True, True, config=CFG)
    assert q.shape == qt.shape == inv.shape == (0,)
    _close32(y, R.activation(h, act).half(), f"{act} y fp16")
    _close32(amax, R.act_amax(h, act), f"{act} amax")
    _, q, qt, _, _ = K.act_fwd_launch(h, act, False, torch.tensor(2.0), None, 0, False, E4M3, False, True, config=CFG)
    assert q.shape == (0,) and qt.shape == (17, 9)
    dh, q, qt, amax, inv, db = K.act_bwd_launch(da, h, act, True, None, None, 0, False, None, True, True, config=CFG)
    assert q.shape == qt.shape == inv.shape == (0,)
    _close32(dh.float(), R.activation_grad(da, h, act).half().float(), f"{act} dh fp16")
    torch.testing.assert_close(db, R.activation_grad(da, h, act).sum(0), rtol=1e-5, atol=1e-4)


def _fp8_h(act, M, F, seed):
    """FP8 codes of an h (E4M3, scale 16) and their inverse scale; the dequantized h in float32."""
    h, da = _inputs(act, M, F, seed=seed)
    s = torch.tensor(16.0)
    hq = (h * s).clamp(-448.0, 448.0).to(E4M3)
    inv = torch.reciprocal(s)
    return hq, inv, hq.float() * inv, da


@pytest.mark.parametrize("act", ["gelu", "relu", "swiglu", "geglu"])
def test_fp8_input_forward(act):
    """h given as FP8 codes with h_inv: the kernels read code * h_inv; same as the high-precision
    kernels on the dequantized h, and the reference."""
    hq, inv, hd, _ = _fp8_h(act, 21, 18, seed=6)
    s = torch.tensor(5.0)
    y, q, qt, amax, _ = K.act_fwd_launch(hq, act, True, s, None, 0, False, E4M3, True, True, inv, torch.float32,
                                         config=CFG)
    yd, qd, _, amax_d, _ = K.act_fwd_launch(hd, act, True, s, None, 0, False, E4M3, True, False, config=CFG)
    yr, qr, _, amax_r, _ = R.act_fwd(hq, act, True, s, None, 0, False, E4M3, True, False, inv, torch.float32)
    assert y.dtype == torch.float32
    _close32(y, R.activation(hd, act), f"{act} y from FP8 h")
    _close32(y, yd, f"{act} y from FP8 h vs dequantized")
    _close32(yr, R.activation(hd, act), f"{act} reference y from FP8 h")
    assert torch.equal(_u8(q), _u8(qd))
    _check_fp8(q, qr, None, f"{act} q from FP8 h")
    assert torch.equal(_u8(qt), _u8(q.t().contiguous()))
    _close32(amax, amax_r, f"{act} amax from FP8 h")
    _close32(K.act_amax_launch(hq, act, inv, config=CFG), amax_d, f"{act} act_amax from FP8 h")
    y16 = K.act_fwd_launch(hq, act, True, None, None, 0, False, None, False, False, inv, torch.bfloat16,
                           config=CFG)[0]
    assert y16.dtype == torch.bfloat16 and y16.shape == y.shape


@pytest.mark.parametrize("act", ["gelu_tanh", "squared_relu", "swiglu", "reglu"])
def test_fp8_input_backward(act):
    hq, inv, hd, da = _fp8_h(act, 19, 20, seed=7)
    s = torch.tensor(64.0)
    dh, q, qt, amax, _, db = K.act_bwd_launch(da, hq, act, True, s, None, 0, False, E5M2, True, True, inv,
                                              torch.float32, config=CFG)
    d32 = R.activation_grad(da, hd, act)
    _close32(dh, d32, f"{act} dh from FP8 h")
    _, qr, _, amax_r, _, dbr = R.act_bwd(da, hq, act, False, s, None, 0, False, E5M2, False, True, inv)
    _check_fp8(q, qr, None, f"{act} dh q from FP8 h")
    assert torch.equal(_u8(qt), _u8(q.t().contiguous()))
    _close32(amax, amax_r, f"{act} dh amax from FP8 h")
    torch.testing.assert_close(db, dbr, rtol=1e-5, atol=1e-5 * float(d32.abs().sum(0).max()))
    _close32(K.act_bwd_amax_launch(da, hq, act, inv, config=CFG), amax_r, f"{act} act_bwd_amax from FP8 h")


def test_fp8_input_validation():
    hq, inv, _, da = _fp8_h("gelu", 4, 6, seed=8)
    with pytest.raises(ValueError, match="pass its inverse scale h_inv"):
        K.act_fwd_launch(hq, "gelu", False, None, None, 0, False, E4M3, True, False)
    with pytest.raises(ValueError, match="pass hp_dtype"):
        K.act_bwd_launch(da, hq, "gelu", True, None, None, 0, False, None, False, False, inv)
    with pytest.raises(ValueError, match="h_inv is only for FP8 h"):
        K.act_fwd_launch(hq.float(), "gelu", False, None, None, 0, False, E4M3, True, False, inv)
    with pytest.raises(ValueError, match="h_inv must be a 0-d float32"):
        K.act_amax_launch(hq, "gelu", inv.reshape(1))


def test_strided_rows_empty_and_nan():
    base = torch.randn(12, 40)
    h = base[:, :30]  # row stride 40, unit column stride
    y = K.act_fwd_launch(h, "geglu", True, None, None, 0, False, None, False, False, config=CFG)[0]
    _close32(y, R.activation(h, "geglu"), "strided geglu")
    y, q, qt, amax, inv = K.act_fwd_launch(torch.empty(0, 6), "gelu", True, torch.tensor(4.0), None, 0, False,
                                           E4M3, True, True)
    assert y.shape == q.shape == (0, 6) and qt.shape == (6, 0) and amax.item() == 0.0 and inv.item() == 0.25
    out = K.act_bwd_launch(torch.empty(0, 3), torch.empty(0, 6), "reglu", True, None, None, 0, False, E5M2, True, True)
    assert out[0].shape == (0, 6) and torch.equal(out[5], torch.zeros(6))
    h = torch.randn(5, 7)
    h[2, 3] = float("nan")
    assert torch.isnan(K.act_amax_launch(h, "silu"))
    assert torch.isnan(K.act_bwd_amax_launch(torch.ones(5, 7), h, "silu"))


def test_launchers_validate():
    h = torch.randn(4, 6)
    with pytest.raises(ValueError, match="act must be one of"):
        K.act_fwd_launch(h, "tanh", True, None, None, 0, False, None, False, False)
    with pytest.raises(ValueError, match="even width"):
        K.act_fwd_launch(torch.randn(4, 5), "swiglu", True, None, None, 0, False, None, False, False)
    with pytest.raises(ValueError, match="out_dtype"):
        K.act_fwd_launch(h, "gelu", True, None, None, 0, False, torch.bfloat16, True, False)
    with pytest.raises(ValueError, match="0-d float32"):
        K.act_fwd_launch(h, "gelu", True, torch.ones(1), None, 0, False, E4M3, True, False)
    with pytest.raises(ValueError, match="unit stride"):
        K.act_fwd_launch(h.t(), "gelu", True, None, None, 0, False, None, False, False)
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        K.act_amax_launch(h.double(), "gelu")
    with pytest.raises(ValueError, match=r"da must have shape \(M, F\)"):
        K.act_bwd_launch(torch.randn(4, 6), h, "swiglu", True, None, None, 0, False, None, False, False)
    with pytest.raises(ValueError, match="unknown launch config"):
        K.act_fwd_launch(h, "gelu", True, None, None, 0, False, None, False, False, config={"BLOCK_K": 4})
