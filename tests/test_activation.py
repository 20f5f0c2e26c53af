"""MLP activations on CPU (the reference path): math against independent float64 formulas, the fused
FP8 outputs against the quantization bounds, errors, opcheck, hypothesis shapes and the
torch.func / vmap / torch.compile canaries of ``fp8ops.activation.activation``.

The independent formulas are torch.nn.functional's (gelu, gelu(approximate="tanh"), relu, silu) in
float64, differentiated by autograd; the fp8ops results must be within the flash-attention rule
(``k`` times the error of plain PyTorch at the same precision, plus a small atol) of them.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as Fn
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from fp8ops.activation import (
    ACTIVATIONS,
    GATED,
    act_quantize,
    activation,
    check_activation,
    dact_quantize,
)
from fp8ops.formats import fp8_max_of
from fp8ops.quantize import QuantSpec
from fp8ops.reference import activation as R
from fp8ops.testing import assert_close_rule, half_ulp_rel, smallest_normal
from fp8ops.testing import strategies as fst

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
ops = torch.ops.fp8ops


# ------------------------------------------------------------------------------------------------
# Independent formulas (float64 or the precision of the input, through torch.nn.functional)


def _base_torch(x: Tensor, act: str) -> Tensor:
    if act in ("gelu",):
        return Fn.gelu(x)
    if act in ("gelu_tanh", "geglu"):
        return Fn.gelu(x, approximate="tanh")
    if act in ("relu", "reglu"):
        return Fn.relu(x)
    if act == "squared_relu":
        return Fn.relu(x) ** 2
    if act in ("silu", "swiglu"):
        return Fn.silu(x)
    if act == "qgelu":
        return x * torch.sigmoid(1.702 * x)
    raise AssertionError(act)


def torch_act(h: Tensor, act: str) -> Tensor:
    """act(h) by torch.nn.functional at h's precision."""
    if act in GATED:
        F = h.shape[-1] // 2
        return _base_torch(h[..., :F], act) * h[..., F:]
    return _base_torch(h, act)


def torch_act_grad(da: Tensor, h: Tensor, act: str) -> Tensor:
    """d/dh <act(h), da> by autograd at h's precision."""
    with torch.enable_grad():
        hh = h.detach().clone().requires_grad_(True)
        (g,) = torch.autograd.grad(torch_act(hh, act), hh, da.to(h.dtype))
    return g


def _width(C: int, act: str) -> int:
    return C // 2 if act in GATED else C


def _inputs(M: int, C: int, act: str, dtype: torch.dtype = torch.float32, seed: int = 0) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(M, C, generator=g) * 2.5).to(dtype)
    da = torch.randn(M, _width(C, act), generator=g).to(dtype)
    return h, da


def _atol(expected: Tensor, dtype: torch.dtype) -> float:
    # A few ulps of the output precision at the tensor's scale.
    eps = torch.finfo(dtype).eps
    return 4 * eps * max(1.0, float(expected.abs().max())) if expected.numel() else 0.0


# ------------------------------------------------------------------------------------------------
# The math: forward and gradient vs torch.nn.functional in float64


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("act", ACTIVATIONS)
def test_forward_and_grad_match_torch_float64(act: str, dtype: torch.dtype) -> None:
    h, dy = _inputs(37, 2 * 29 if act in GATED else 29, act, dtype)
    want = torch_act(h.double(), act)
    hl = h.clone().requires_grad_(True)
    y = activation(hl, act)
    assert y.dtype == dtype and y.shape == want.shape
    assert_close_rule(y, want, torch_act(h, act), k=2.0, atol=_atol(want, dtype), name=f"{act} forward {dtype}")
    y.backward(dy)
    want_g = torch_act_grad(dy.double(), h.double(), act)
    assert_close_rule(hl.grad, want_g, torch_act_grad(dy, h, act), k=2.0, atol=_atol(want_g, dtype),
                      name=f"{act} gradient {dtype}")


@pytest.mark.parametrize("act", ACTIVATIONS)
def test_reference_helpers_float32(act: str) -> None:
    h, da = _inputs(16, 2 * 24 if act in GATED else 24, act, seed=3)
    h[0, :4] = torch.tensor([0.0, -0.0, 30.0, -30.0])  # zeros and saturated tails
    a = R.activation(h, act)
    g = R.activation_grad(da, h, act)
    assert a.dtype == g.dtype == torch.float32
    want = torch_act(h.double(), act)
    want_g = torch_act_grad(da.double(), h.double(), act)
    assert_close_rule(a, want, torch_act(h, act), k=2.0, atol=_atol(want, torch.float32), name=f"{act} reference")
    assert_close_rule(g, want_g, torch_act_grad(da, h, act), k=2.0, atol=_atol(want_g, torch.float32),
                      name=f"{act} reference gradient")


def test_special_values() -> None:
    x = torch.tensor([[float("nan"), float("inf"), -float("inf"), 0.0, -2.0, 3.0]])
    assert torch.isnan(activation(x, "relu")[0, 0]) and activation(x, "relu")[0, 1] == math.inf
    assert activation(x, "relu")[0, 2] == 0.0
    for act in ("gelu", "gelu_tanh", "silu", "qgelu"):
        y = activation(x, act)
        assert torch.isnan(y[0, 0]) and y[0, 1] == math.inf and y[0, 3] == 0.0, act
    # relu' is 0 at 0 (TransformerEngine's convention), squared_relu' = 2 relu
    h = torch.tensor([[0.0, -1.0, 2.0]], requires_grad=True)
    activation(h, "relu").sum().backward()
    assert h.grad.tolist() == [[0.0, 0.0, 1.0]]
    h.grad = None
    activation(h, "squared_relu").sum().backward()
    assert h.grad.tolist() == [[0.0, 0.0, 4.0]]


def test_leading_dims_and_empty() -> None:
    h = torch.randn(2, 3, 10)
    assert activation(h, "swiglu").shape == (2, 3, 5)
    assert torch.equal(activation(h, "gelu"), activation(h.reshape(6, 10), "gelu").reshape(2, 3, 10))
    e = torch.empty(0, 8, requires_grad=True)
    y = activation(e, "geglu")
    assert y.shape == (0, 4)
    y.sum().backward()
    assert e.grad.shape == (0, 8)


# ------------------------------------------------------------------------------------------------
# Fused FP8 outputs against the quantization bound


def check_fp8(q: Tensor, inv: Tensor, v64: Tensor, scale: float, dtype: torch.dtype, what: str) -> None:
    """``q * inv`` within half an FP8 ulp of ``sat(v64 * scale) / scale``, plus the float32 error of
    the activation itself (a few ulps of the tensor's largest value: erf-GELU's ``1 + erf(x)``
    cancels for large negative x)."""
    assert q.dtype == dtype and q.shape == v64.shape, f"{what}: {q.dtype} {tuple(q.shape)}"
    fmax = fp8_max_of(dtype)
    target = (v64 * scale).clamp(-fmax, fmax) / scale
    deq = q.double() * inv.double()
    # Half the subnormal spacing: 2**-10 (E4M3), 2**-17 (E5M2), in the scaled domain.
    half_sub = smallest_normal(dtype) * (2.0**-4 if dtype == E4M3 else 2.0**-3)
    f32_slack = 4 * torch.finfo(torch.float32).eps * float(v64.abs().max()) if v64.numel() else 0.0
    bound = (half_ulp_rel(dtype) + 1e-5) * target.abs() + half_sub / scale + f32_slack
    bad = (deq - target).abs() > bound
    assert not bool(bad.any()), (
        f"{what}: {int(bad.sum())} of {bad.numel()} FP8 values off the rounding bound; first: "
        f"{deq[bad][:4].tolist()} vs {target[bad][:4].tolist()}"
    )


def _spec(mode: str, dtype: torch.dtype, margin: int = 0, power_2: bool = False) -> tuple[QuantSpec, Tensor | None]:
    if mode == "delayed":
        return QuantSpec("delayed", dtype, margin, power_2, True), torch.tensor(3.0 if dtype == E4M3 else 300.0)
    if mode == "uncalibrated":
        return QuantSpec("delayed", dtype, margin, power_2, False), torch.tensor(5.0)
    return QuantSpec("current", dtype, margin, power_2, False), None


def _expected_scale(mode: str, scale: Tensor | None, amax64: float, dtype: torch.dtype, margin: int,
                    power_2: bool) -> float:
    if mode == "delayed":
        return float(scale)
    s = fp8_max_of(dtype) / amax64 / 2.0**margin
    return 2.0 ** math.floor(math.log2(s)) if power_2 else s


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("mode,margin,power_2", [("delayed", 0, False), ("uncalibrated", 0, False),
                                                  ("current", 0, False), ("current", 1, True)])
@pytest.mark.parametrize("act", ACTIVATIONS)
def test_act_quantize(act: str, mode: str, margin: int, power_2: bool, dtype: torch.dtype) -> None:
    h, _ = _inputs(33, 2 * 21 if act in GATED else 21, act, torch.bfloat16, seed=5)
    spec, scale = _spec(mode, dtype, margin, power_2)
    r = act_quantize(h, act, scale, spec, transpose=True, store_y=True)
    a64 = torch_act(h.double(), act)
    amax64 = float(a64.abs().max())
    torch.testing.assert_close(r.amax.double(), torch.tensor(amax64, dtype=torch.float64), rtol=1e-5, atol=0)
    s = _expected_scale(mode, scale, amax64, dtype, margin, power_2)
    torch.testing.assert_close(r.inv_scale.double(), torch.tensor(1 / s, dtype=torch.float64), rtol=1e-5, atol=0)
    check_fp8(r.data, r.inv_scale, a64, s, dtype, f"{act} {mode} q")
    assert torch.equal(r.data_t.view(torch.uint8), r.data.t().contiguous().view(torch.uint8))
    assert r.y is not None and r.y.dtype == torch.bfloat16
    assert_close_rule(r.y, a64, torch_act(h, act), k=2.0, atol=_atol(a64, torch.bfloat16), name=f"{act} y")
    # The switches: no q, no transposed copy, no y.
    r2 = act_quantize(h, act, scale, spec, transpose=False, store_q=False)
    assert r2.data is None and r2.data_t is None and r2.y is None
    assert torch.equal(r2.amax, r.amax) and torch.equal(r2.inv_scale, r.inv_scale)


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("mode", ["delayed", "uncalibrated", "current"])
@pytest.mark.parametrize("act", ACTIVATIONS)
def test_dact_quantize(act: str, mode: str, dtype: torch.dtype) -> None:
    h, da = _inputs(40, 2 * 19 if act in GATED else 19, act, torch.bfloat16, seed=6)
    spec, scale = _spec(mode, dtype)
    r = dact_quantize(da, h, act, scale, spec, transpose=True, dbias=True, store_dh=True)
    g64 = torch_act_grad(da.double(), h.double(), act)
    amax64 = float(g64.abs().max())
    torch.testing.assert_close(r.amax.double(), torch.tensor(amax64, dtype=torch.float64), rtol=1e-5, atol=0)
    s = _expected_scale(mode, scale, amax64, dtype, 0, False)
    torch.testing.assert_close(r.inv_scale.double(), torch.tensor(1 / s, dtype=torch.float64), rtol=1e-5, atol=0)
    check_fp8(r.data, r.inv_scale, g64, s, dtype, f"{act} {mode} dh q")
    assert torch.equal(r.data_t.view(torch.uint8), r.data.t().contiguous().view(torch.uint8))
    assert r.dh is not None and r.dh.dtype == torch.bfloat16 and r.dh.shape == h.shape
    assert_close_rule(r.dh, g64, torch_act_grad(da, h, act), k=2.0, atol=_atol(g64, torch.bfloat16), name=f"{act} dh")
    db64 = g64.sum(0)
    pt32 = torch_act_grad(da.float(), h.float(), act).sum(0)
    assert r.dbias is not None and r.dbias.dtype == torch.float32 and r.dbias.shape == (h.shape[1],)
    assert_close_rule(r.dbias, db64, pt32, k=4.0, atol=_atol(g64.abs().sum(0), torch.float32), name=f"{act} dbias")
    r2 = dact_quantize(da, h, act, scale, spec, transpose=False, dbias=False)
    assert r2.data_t is None and r2.dh is None and r2.dbias is None
    assert torch.equal(r2.data.view(torch.uint8), r.data.view(torch.uint8))


def test_nan_amax_and_saturation() -> None:
    h = torch.tensor([[1.0, float("nan"), 1000.0, -1000.0]])
    spec = QuantSpec("delayed", E4M3, 0, False, True)
    r = act_quantize(h, "relu", torch.tensor(1.0), spec, transpose=False)
    assert torch.isnan(r.amax)
    assert r.data.float()[0, 0] == 1.0 and torch.isnan(r.data.float()[0, 1])
    assert r.data.float()[0, 2] == 448.0 and r.data.float()[0, 3] == 0.0
    # Current scaling with a NaN amax falls back to the state's scale.
    r = act_quantize(h, "relu", torch.tensor(2.0), QuantSpec("current", E4M3, 0, False, False), transpose=False)
    assert r.inv_scale == 0.5


def test_empty_rows() -> None:
    spec = QuantSpec("current", E4M3, 0, False, False)
    h = torch.empty(0, 8)
    r = act_quantize(h, "swiglu", torch.tensor(4.0), spec, transpose=True)
    assert r.data.shape == (0, 4) and r.data_t.shape == (4, 0) and r.amax == 0 and r.inv_scale == 0.25
    d = dact_quantize(torch.empty(0, 4), h, "swiglu", None, spec, transpose=True, dbias=True)
    assert d.data.shape == (0, 8) and d.data_t.shape == (8, 0) and torch.equal(d.dbias, torch.zeros(8))


# ------------------------------------------------------------------------------------------------
# Errors


@pytest.mark.parametrize(
    "call, exc, match",
    [
        (lambda: activation(torch.ones(2, 4), "gelu2"), ValueError, "one of 'gelu', 'gelu_tanh'"),
        (lambda: activation(torch.ones(2, 5), "swiglu"), ValueError, "even"),
        (lambda: activation(torch.ones(2, 4, dtype=torch.float64), "gelu"), ValueError, "float32, bfloat16"),
        (lambda: activation([1.0], "gelu"), TypeError, "h must be a torch.Tensor"),
        (lambda: check_activation(3, "fused_ln_mlp"), ValueError, "fused_ln_mlp: activation must be one of"),
        (lambda: act_quantize(torch.ones(2, 4), "relu", None, QuantSpec("rowwise", E4M3, 0, False, False),
                              transpose=False), ValueError, "row-wise"),
        (lambda: act_quantize(torch.ones(2, 3), "reglu", None, QuantSpec("current", E4M3, 0, False, False),
                              transpose=False), ValueError, "even"),
        (lambda: act_quantize(torch.ones(2, 2, 4), "relu", None, QuantSpec("current", E4M3, 0, False, False),
                              transpose=False), ValueError, "2-D"),
        (lambda: dact_quantize(torch.ones(2, 4), torch.ones(2, 4), "geglu", None,
                               QuantSpec("current", E5M2, 0, False, False), transpose=False, dbias=False),
         ValueError, r"da must have shape \(M, F\) = \(2, 2\)"),
        (lambda: dact_quantize(torch.ones(2, 4), torch.ones(2, 4), "gelu", None,
                               QuantSpec("rowwise", E5M2, 0, False, False), transpose=False, dbias=False),
         ValueError, "row-wise"),
        (lambda: ops.act_fwd(torch.ones(2, 4), "tanh", False, None, None, 0, False, None, False, False),
         ValueError, "act must be one of"),
        (lambda: ops.act_bwd(torch.ones(2, 2), torch.ones(2, 3), "swiglu", False, None, None, 0, False, None,
                             False, False), ValueError, "even width"),
        (lambda: ops.act_fwd(torch.ones(2, 4).to(E4M3), "gelu", False, None, None, 0, False, None, False, False),
         ValueError, "pass its inverse scale h_inv"),
        (lambda: ops.act_bwd(torch.ones(2, 4), torch.ones(2, 4).to(E4M3), "gelu", True, None, None, 0, False, None,
                             False, False, torch.tensor(1.0)), ValueError, "pass hp_dtype"),
        (lambda: ops.act_amax(torch.ones(2, 4), "gelu", torch.tensor(1.0)), ValueError, "h_inv is only for FP8 h"),
    ],
)
def test_errors_name_argument_and_fix(call, exc, match) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(exc, match=match):
        call()


# ------------------------------------------------------------------------------------------------
# opcheck of the four ops


@pytest.mark.parametrize("act", ["gelu", "swiglu"])
def test_opcheck_every_op(act: str) -> None:
    h, da = _inputs(5, 14, act, seed=9)
    s, a_in = torch.tensor(2.0), torch.tensor(3.0)
    torch.library.opcheck(ops.act_amax.default, (h, act))
    torch.library.opcheck(ops.act_bwd_amax.default, (da, h, act))
    for dt in (E4M3, E5M2):
        torch.library.opcheck(ops.act_fwd.default, (h, act, True, s, None, 0, False, dt, True, True))
        torch.library.opcheck(ops.act_fwd.default, (h.bfloat16(), act, False, s, a_in, 1, True, dt, False, True))
        torch.library.opcheck(ops.act_bwd.default, (da, h, act, True, s, None, 0, False, dt, True, True))
        torch.library.opcheck(ops.act_bwd.default, (da.bfloat16(), h.bfloat16(), act, False, None, a_in, 2,
                                                    False, dt, False, False))
    torch.library.opcheck(ops.act_fwd.default, (h, act, True, None, None, 0, False, None, False, False))
    torch.library.opcheck(ops.act_bwd.default, (da, h, act, True, None, None, 0, False, None, True, True))
    # h as FP8 codes with its inverse scale (fused_ln_mlp's recompute="activation"); the schema
    # check's mutation test compares inputs with allclose, which FP8 tensors lack on CPU.
    hq, inv = (h * 8.0).to(E4M3), torch.tensor(0.125)
    utils = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")
    torch.library.opcheck(ops.act_amax.default, (hq, act, inv), test_utils=utils)
    torch.library.opcheck(ops.act_bwd_amax.default, (da, hq, act, inv), test_utils=utils)
    torch.library.opcheck(ops.act_fwd.default, (hq, act, True, s, None, 0, False, E4M3, True, True, inv,
                                                torch.bfloat16), test_utils=utils)
    torch.library.opcheck(ops.act_bwd.default, (da, hq, act, True, s, a_in, 0, False, E5M2, True, True, inv,
                                                torch.float32), test_utils=utils)
    y = ops.act_fwd(hq, act, True, None, None, 0, False, None, False, False, inv, torch.float32)[0]
    torch.testing.assert_close(y, R.activation(hq.float() * 0.125, act), rtol=0, atol=0)


def test_outputs_are_distinct_tensors() -> None:
    h, da = _inputs(3, 8, "relu")
    outs = ops.act_fwd(h, "relu", False, None, None, 0, False, None, False, False)
    assert len({o.data_ptr() for o in outs if o.numel()} | {id(o) for o in outs}) >= len(outs)
    assert all(o.shape == (0,) for o in (outs[0], outs[1], outs[2], outs[4]))
    outs = ops.act_bwd(da, h, "relu", False, None, None, 0, False, None, False, False)
    assert all(o.shape == (0,) for i, o in enumerate(outs) if i != 3)
    assert len({id(o) for o in outs}) == len(outs)


# ------------------------------------------------------------------------------------------------
# Hypothesis: shapes with 1, primes and non-multiples of 16


@settings(deadline=None)
@given(
    shape=fst.shapes(2, 2, max_side=67, max_numel=1500),
    act=st.sampled_from(ACTIVATIONS),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    fp8=st.sampled_from([E4M3, E5M2]),
    seed=st.integers(0, 2**16),
)
def test_hypothesis_shapes(shape: tuple[int, int], act: str, dtype: torch.dtype, fp8: torch.dtype, seed: int) -> None:
    M, F = shape
    C = 2 * F if act in GATED else F
    h, da = _inputs(M, C, act, dtype, seed)
    # forward + gradient of the high-precision op
    hl = h.clone().requires_grad_(True)
    y = activation(hl, act)
    want = torch_act(h.double(), act)
    assert_close_rule(y, want, torch_act(h, act), k=2.0, atol=_atol(want, dtype), name=f"{act} forward {shape}")
    y.backward(da)
    want_g = torch_act_grad(da.double(), h.double(), act)
    assert_close_rule(hl.grad, want_g, torch_act_grad(da, h, act), k=2.0, atol=_atol(want_g, dtype),
                      name=f"{act} gradient {shape}")
    # fused FP8 paths, current scaling
    spec = QuantSpec("current", fp8, 0, False, False)
    r = act_quantize(h, act, None, spec, transpose=True)
    amax64 = float(want.abs().max())
    if amax64 > 0:
        check_fp8(r.data, r.inv_scale, want, fp8_max_of(fp8) / amax64, fp8, f"{act} q {shape}")
    assert r.data_t.shape == (F, M)
    d = dact_quantize(da, h, act, None, spec, transpose=True, dbias=True)
    g_amax = float(want_g.abs().max())
    if g_amax > 0:
        check_fp8(d.data, d.inv_scale, want_g, fp8_max_of(fp8) / g_amax, fp8, f"{act} dh q {shape}")
    assert d.data_t.shape == (C, M) and d.dbias.shape == (C,)


# ------------------------------------------------------------------------------------------------
# torch.func / vmap / torch.compile canaries of the differentiable op


def _loss(h: Tensor, act: str) -> Tensor:
    return (activation(h, act) * torch.linspace(-1, 1, _width(h.shape[-1], act))).sum()


@pytest.mark.parametrize("act", ["gelu_tanh", "swiglu"])
def test_func_grad_and_vjp(act: str) -> None:
    h, _ = _inputs(6, 10, act, seed=2)
    w = torch.linspace(-1, 1, _width(10, act)).expand(6, -1)
    g = torch.func.grad(_loss)(h, act)
    assert torch.allclose(g, R.activation_grad(w, h, act), rtol=1e-6, atol=1e-6)
    _, vjp = torch.func.vjp(lambda x: activation(x, act), h)
    assert torch.allclose(vjp(w)[0], g, rtol=1e-6, atol=1e-7)


def test_vmap_equals_loop() -> None:
    hs = torch.randn(3, 4, 10)
    got = torch.func.vmap(lambda x: activation(x, "swiglu"))(hs)
    assert torch.equal(got, torch.stack([activation(hs[i], "swiglu") for i in range(3)]))
    gg = torch.func.vmap(torch.func.grad(lambda x: _loss(x, "gelu")))(hs)
    assert torch.allclose(gg, torch.stack([torch.func.grad(_loss)(hs[i], "gelu") for i in range(3)]))
    # vmap over the fused FP8 wrapper: one scale per sample (current scaling), like a loop
    spec = QuantSpec("current", E4M3, 0, False, False)
    inv = torch.func.vmap(lambda x: act_quantize(x, "silu", None, spec, transpose=True).inv_scale)(hs)
    assert torch.equal(inv, torch.stack([act_quantize(hs[i], "silu", None, spec, transpose=True).inv_scale
                                         for i in range(3)]))


def test_compile_fullgraph_then_backward_equals_eager() -> None:
    h = torch.randn(5, 12)

    def f(x: Tensor) -> Tensor:
        return (activation(x, "geglu") ** 2).sum()

    he = h.clone().requires_grad_(True)
    f(he).backward()
    torch._dynamo.reset()
    hc = h.clone().requires_grad_(True)
    loss = torch.compile(f, fullgraph=True)(hc)
    loss.backward()
    assert torch.allclose(loss, f(h), rtol=1e-6)
    assert torch.allclose(hc.grad, he.grad, rtol=1e-6, atol=1e-7)


def test_compile_of_func_grad_raises_or_is_exact() -> None:
    """pytorch#193279 can drop custom backwards under compile(func.grad): the op must either raise
    (its guard) or return the right gradient, never a wrong one."""
    x = torch.randn(3, 8)
    want = torch.func.grad(_loss)(x, "swiglu")
    torch._dynamo.reset()
    try:
        got = torch.compile(torch.func.grad(_loss), fullgraph=True)(x, "swiglu")
    except Exception as e:  # noqa: BLE001  (raising is the other acceptable outcome)
        assert "fp8ops" in str(e)
    else:
        assert torch.allclose(got, want, rtol=1e-6, atol=1e-7)
        assert torch.allclose(got, R.activation_grad(torch.linspace(-1, 1, 4).expand(3, 4), x, "swiglu"),
                              rtol=1e-6, atol=1e-7)
