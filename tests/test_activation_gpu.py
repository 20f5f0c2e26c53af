"""GPU tests of the activation kernels at real sizes (bf16, 8192 x 4096 and 4096 x 2*4096 gated).

The expected values are the FP32 reference (fp8ops.reference.activation) run by torch on the same
CUDA tensors: ``q_ref = sat(a32 * s).to(fp8)`` with torch's cast. The kernels compute the same float32
formulas with Triton's exp/erf, which may differ from torch's in the last bit, so:

- FP8 data is bit-exact for the activations that need no transcendental (relu, squared_relu,
  reglu, forward and backward), and elsewhere at most one FP8 ulp apart on at most 1e-3 of the
  elements (a last-bit difference moves a value across a rounding tie);
- transposed copies are bit-exact against the kernel's own data;
- bf16 outputs (y, dh) are within one bf16 ulp; the amax within 2 float32 ulps; the bias gradient
  within the flash-attention rule against a float64 sum;
- ``inv_scale`` is the correctly rounded ``1 / scale``.
"""

from __future__ import annotations

import pytest
import torch
from fp8ops.kernels import activation as K
from torch import Tensor

from fp8ops.activation import (
    ACTIVATIONS,
    GATED,
    act_quantize,
    activation,
    dact_quantize,
)
from fp8ops.quantize import QuantSpec
from fp8ops.reference import activation as R
from fp8ops.testing import assert_close_rule

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
EXACT = ("relu", "squared_relu", "reglu")
ops = torch.ops.fp8ops


def _shape(act: str) -> tuple[int, int, int]:
    """(M, C, F): 8192 x 4096, or 4096 x 2*4096 for gated activations."""
    return (4096, 8192, 4096) if act in GATED else (8192, 4096, 4096)


def _inputs(M: int, C: int, F: int, seed: int = 0) -> tuple[Tensor, Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    h = (torch.randn(M, C, generator=g, device="cuda") * 2.0).bfloat16()
    da = (torch.randn(M, F, generator=g, device="cuda") * 0.5).bfloat16()
    return h, da


def exact_reciprocal(s: Tensor) -> Tensor:
    return (1.0 / s.double()).float()


def assert_fp8_close(got: Tensor, want: Tensor, *, exact: bool, what: str, frac: float = 1e-3) -> None:
    """Bit-exact, or at most one FP8 ulp apart (adjacent codes) on at most ``frac`` of the elements."""
    assert got.dtype == want.dtype and got.shape == want.shape, f"{what}: {got.dtype}{tuple(got.shape)}"
    a = got.reshape(-1).view(torch.uint8).int()
    b = want.reshape(-1).view(torch.uint8).int()
    nan = got.reshape(-1).float().isnan() & want.reshape(-1).float().isnan()
    diff = (a != b) & ~nan
    n = int(diff.sum())
    if exact:
        assert n == 0, f"{what}: {n} of {a.numel()} FP8 bytes differ from the reference cast"
        return
    # Same sign and adjacent magnitudes (codes are sign-magnitude); +0/-0 count as adjacent.
    mag_a, mag_b = a & 0x7F, b & 0x7F
    adjacent = ((mag_a - mag_b).abs() <= 1) & (((a ^ b) & 0x80) == 0) | ((mag_a <= 1) & (mag_b <= 1))
    far = int((diff & ~adjacent).sum())
    assert far == 0, f"{what}: {far} FP8 values more than one ulp from the reference"
    assert n <= frac * a.numel(), f"{what}: {n} of {a.numel()} FP8 values one ulp off (more than {frac:.0e})"


def assert_bf16_close(got: Tensor, want: Tensor, what: str) -> None:
    """Within one bf16 ulp of the reference rounding (same formula, last-bit transcendental
    differences), plus the float32 error of the formula itself: a few float32 ulps of the tensor's
    largest value (erf-GELU's ``1 + erf(x)`` cancels for x << 0, where the result is tiny)."""
    assert got.dtype == want.dtype and got.shape == want.shape, what
    w = want.float()
    f32_slack = 4 * torch.finfo(torch.float32).eps * float(w.abs().max()) if w.numel() else 0.0
    bound = w.abs() * 2.0**-7 + f32_slack
    bad = (got.float() - w).abs() > bound
    bad &= ~(got.isnan() & want.isnan())
    assert not bool(bad.any()), f"{what}: {int(bad.sum())} values more than one bf16 ulp off"


@pytest.mark.parametrize("act", ACTIVATIONS)
def test_forward_delayed_transpose(act: str) -> None:
    M, C, F = _shape(act)
    h, _ = _inputs(M, C, F)
    a32 = R.activation(h, act)
    s = torch.tensor(448.0 / float(a32.abs().amax()) * 1.5, device="cuda")  # the top saturates
    y, q, qt, amax, inv = ops.act_fwd(h, act, True, s, None, 0, False, E4M3, True, True)
    yr, qr, _, amax_r, _ = R.act_fwd(h, act, True, s, None, 0, False, E4M3, True, False)
    assert_fp8_close(q, qr, exact=act in EXACT, what=f"{act} q")
    assert qt.shape == (F, M) and torch.equal(qt.view(torch.uint8), q.t().contiguous().view(torch.uint8))
    assert_bf16_close(y, yr, f"{act} y")
    torch.testing.assert_close(amax, amax_r, rtol=2.0**-22, atol=0.0)
    assert torch.equal(inv, exact_reciprocal(s))


@pytest.mark.parametrize("act", ACTIVATIONS)
def test_backward_delayed_transpose_dbias(act: str) -> None:
    M, C, F = _shape(act)
    h, da = _inputs(M, C, F, seed=1)
    d32 = R.activation_grad(da, h, act)
    s = torch.tensor(57344.0 / float(d32.abs().amax()), device="cuda")
    dh, q, qt, amax, inv, db = ops.act_bwd(da, h, act, True, s, None, 0, False, E5M2, True, True)
    dhr, qr, _, amax_r, _, _ = R.act_bwd(da, h, act, True, s, None, 0, False, E5M2, False, False)
    assert_fp8_close(q, qr, exact=act in EXACT, what=f"{act} dh q")
    assert qt.shape == (C, M) and torch.equal(qt.view(torch.uint8), q.t().contiguous().view(torch.uint8))
    assert_bf16_close(dh, dhr, f"{act} dh")
    torch.testing.assert_close(amax, amax_r, rtol=2.0**-22, atol=0.0)
    assert torch.equal(inv, exact_reciprocal(s))
    db64 = d32.double().sum(0)
    assert_close_rule(db, db64, d32.sum(0), k=4.0, atol=1e-6 * float(d32.abs().sum(0).max()),
                      name=f"{act} dbias")


@pytest.mark.parametrize("act", ["gelu", "swiglu", "squared_relu"])
def test_current_scaling(act: str) -> None:
    M, C, F = _shape(act)
    h, da = _inputs(M, C, F, seed=2)
    fb = torch.tensor(1.0, device="cuda")
    spec = QuantSpec("current", E4M3, 0, False, False)
    r = act_quantize(h, act, fb, spec, transpose=True)
    a_in = R.act_amax(h, act)
    torch.testing.assert_close(r.amax, a_in, rtol=2.0**-22, atol=0.0)
    # The kernel's just-in-time scale from its own amax: the correctly rounded fmax / amax.
    s = (448.0 / r.amax.double()).float()
    assert torch.equal(r.inv_scale, exact_reciprocal(s))
    _, qr, _, _, _ = R.act_fwd(h, act, False, s, None, 0, False, E4M3, True, False)
    assert_fp8_close(r.data, qr, exact=act in EXACT, what=f"{act} current q")
    assert torch.equal(r.data_t.view(torch.uint8), r.data.t().contiguous().view(torch.uint8))
    spec = QuantSpec("current", E5M2, 0, False, False)
    d = dact_quantize(da, h, act, fb, spec, transpose=False, dbias=False)
    s = (57344.0 / d.amax.double()).float()
    assert torch.equal(d.inv_scale, exact_reciprocal(s))
    _, qr, _, _, _, _ = R.act_bwd(da, h, act, False, s, None, 0, False, E5M2, False, False)
    assert_fp8_close(d.data, qr, exact=act in EXACT, what=f"{act} current dh q")


@pytest.mark.parametrize("act", ["gelu_tanh", "swiglu", "reglu"])
def test_fp8_input_matches_dequantized_and_recomputes_the_same_bits(act: str) -> None:
    """h as FP8 codes with h_inv (what fused_ln_mlp's recompute stores): every output equals the
    high-precision kernels' on the dequantized h (the same float32 values), the reference within
    its rule, and a second pass that writes only the transposed copy (the recompute in backward)
    writes the same bits as the first pass's data, for delayed and current scaling."""
    M, C, F = _shape(act)
    h, da = _inputs(M, C, F, seed=5)
    s_h = torch.tensor(32.0, device="cuda")
    hq = (h.float() * s_h).clamp(-448.0, 448.0).to(E4M3)
    h_inv = exact_reciprocal(s_h)
    hd = hq.float() * h_inv  # exact: a power-of-two scale
    s = torch.tensor(20.0, device="cuda")
    y, q, qt, amax, _ = ops.act_fwd(hq, act, True, s, None, 0, False, E4M3, True, True, h_inv, torch.bfloat16)
    yd, qd, qtd, amax_d, _ = ops.act_fwd(hd, act, True, s, None, 0, False, E4M3, True, True)
    yr, qr, _, amax_r, _ = R.act_fwd(hq, act, True, s, None, 0, False, E4M3, True, False, h_inv, torch.bfloat16)
    assert torch.equal(q.view(torch.uint8), qd.view(torch.uint8)) and torch.equal(qt.view(torch.uint8),
                                                                                  qtd.view(torch.uint8))
    assert torch.equal(amax, amax_d)
    assert y.dtype == torch.bfloat16 and torch.equal(y, yd.bfloat16())
    assert_fp8_close(q, qr, exact=act in EXACT, what=f"{act} q from FP8 h")
    assert_bf16_close(y, yr, f"{act} y from FP8 h")
    torch.testing.assert_close(amax, amax_r, rtol=2.0**-22, atol=0.0)
    # the recompute: only the transposed copy, same scale (delayed) or same amax_in (current)
    _, _, qt2, _, _ = ops.act_fwd(hq, act, False, s, None, 0, False, E4M3, False, True, h_inv, torch.bfloat16)
    assert torch.equal(qt2.view(torch.uint8), q.t().contiguous().view(torch.uint8))
    a_in = ops.act_amax(hq, act, h_inv)
    assert torch.equal(a_in, amax)
    fb = torch.tensor(1.0, device="cuda")
    _, qc, _, _, _ = ops.act_fwd(hq, act, False, fb, a_in, 0, False, E4M3, True, False, h_inv)
    _, _, qct, _, _ = ops.act_fwd(hq, act, False, fb, a_in, 0, False, E4M3, False, True, h_inv)
    assert torch.equal(qct.view(torch.uint8), qc.t().contiguous().view(torch.uint8))
    # backward from FP8 h: as from the dequantized h
    sd = torch.tensor(4096.0, device="cuda")
    dh, dq, dqt, damax, _, db = ops.act_bwd(da, hq, act, True, sd, None, 0, False, E5M2, True, True, h_inv,
                                            torch.bfloat16)
    dhd, dqd, _, damax_d, _, dbd = ops.act_bwd(da, hd, act, True, sd, None, 0, False, E5M2, True, True)
    assert torch.equal(dq.view(torch.uint8), dqd.view(torch.uint8)) and torch.equal(damax, damax_d)
    assert torch.equal(dh, dhd.bfloat16()) and torch.equal(db, dbd)
    assert torch.equal(dqt.view(torch.uint8), dq.t().contiguous().view(torch.uint8))
    dhr, dqr, _, damax_r, _, _ = R.act_bwd(da, hq, act, True, sd, None, 0, False, E5M2, False, False, h_inv,
                                           torch.bfloat16)
    assert_fp8_close(dq, dqr, exact=act in EXACT, what=f"{act} dh q from FP8 h")
    assert_bf16_close(dh, dhr, f"{act} dh from FP8 h")
    torch.testing.assert_close(damax, damax_r, rtol=2.0**-22, atol=0.0)


def test_relu_edge_values_bit_exact() -> None:
    """relu is exact in float32, so its cast must be torch's, bit for bit, on the FP8 edge values:
    ties between neighbours, values above the maximum, subnormals, zeros, inf and NaN."""
    v = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(E4M3).float()
    pos = torch.unique(v[torch.isfinite(v) & (v > 0)])
    ties = (pos[:-1] + pos[1:]) / 2
    vals = torch.cat([pos, ties, torch.tensor([460.0, 500.0, 1e30, float("inf"), float("nan"), 0.0, -0.0]), -pos])
    h = vals.repeat(64)[: 64 * 97].reshape(64, 97).cuda()
    s = torch.tensor(1.0, device="cuda")
    _, q, _, amax, _ = ops.act_fwd(h, "relu", False, s, None, 0, False, E4M3, True, True)
    want = torch.where(h < 0, torch.zeros_like(h), h).clamp(-448, 448).to(E4M3)
    assert_fp8_close(q, want, exact=True, what="relu edge values")
    assert torch.isnan(amax)


@pytest.mark.parametrize("shape", [(1, 1), (17, 33), (1000, 1000), (0, 64), (3, 2 * 50)])
def test_odd_shapes(shape: tuple[int, int]) -> None:
    act = "swiglu" if shape == (3, 100) else "silu"
    M, C = shape
    F = C // 2 if act in GATED else C
    h, da = _inputs(M, C, F, seed=3) if M else (torch.empty(0, C, device="cuda").bfloat16(),
                                                  torch.empty(0, F, device="cuda").bfloat16())
    s = torch.tensor(3.0, device="cuda")
    got = ops.act_fwd(h, act, True, s, None, 0, False, E4M3, True, True)
    want = R.act_fwd(h, act, True, s, None, 0, False, E4M3, True, True)
    assert_fp8_close(got[1], want[1], exact=False, what=f"{shape} q", frac=0.01)
    assert got[2].shape == (F, M)
    gb = ops.act_bwd(da, h, act, True, s, None, 0, False, E5M2, True, True)
    wb = R.act_bwd(da, h, act, True, s, None, 0, False, E5M2, True, True)
    assert_fp8_close(gb[1], wb[1], exact=False, what=f"{shape} dh q", frac=0.01)
    torch.testing.assert_close(gb[5], wb[5], rtol=1e-5, atol=1e-4)


def test_activation_autograd_matches_cpu() -> None:
    h = torch.randn(300, 2 * 130).bfloat16()
    dy = torch.randn(300, 130).bfloat16()
    out = {}
    for dev in ("cpu", "cuda"):
        x = h.detach().to(dev).requires_grad_(True)
        y = activation(x, "geglu")
        y.backward(dy.to(dev))
        out[dev] = (y.detach().cpu(), x.grad.cpu())
    assert_bf16_close(out["cuda"][0], out["cpu"][0], "geglu y CUDA vs CPU")
    assert_bf16_close(out["cuda"][1], out["cpu"][1], "geglu dh CUDA vs CPU")


def test_opcheck_cuda() -> None:
    h, da = _inputs(33, 2 * 40, 40, seed=4)
    s, a_in = torch.tensor(2.0, device="cuda"), torch.tensor(3.0, device="cuda")
    torch.library.opcheck(ops.act_fwd.default, (h, "swiglu", True, s, None, 0, False, E4M3, True, True))
    torch.library.opcheck(ops.act_fwd.default, (h, "swiglu", False, s, a_in, 1, True, E4M3, False, True))
    torch.library.opcheck(ops.act_amax.default, (h, "swiglu"))
    torch.library.opcheck(ops.act_bwd.default, (da, h, "swiglu", True, s, None, 0, False, E5M2, True, True))
    torch.library.opcheck(ops.act_bwd_amax.default, (da, h, "swiglu"))
    assert K.ACTIVATIONS == ACTIVATIONS


@pytest.mark.parametrize("act", ["gelu_tanh", "swiglu"])
@pytest.mark.parametrize("shape", [(8192, 2048), (4112, 200), (100, 48), (64, 16)])
@pytest.mark.parametrize("current", [False, True])
def test_transposed_copy_through_tma_is_the_pointer_stores_bytes(act, shape, current):
    """The forward's transposed FP8 copy stored through a TMA tensor map (64 x 64 tiles, clipped
    at the edges: 4112 x 200 ends in partial tiles both ways) writes the same bytes as the pointer
    stores of the 32 x 128 tiles, with the same amax and q; 100 rows (a row of q^T of 100 bytes,
    not a multiple of 16) cannot use a tensor map and takes the pointer stores."""
    from fp8ops.kernels._library import tma_store_ok

    M, F = shape
    g = torch.Generator(device="cuda").manual_seed(M + F)
    h = (2 * torch.randn(M, 2 * F if act in GATED else F, device="cuda", generator=g)).bfloat16()
    scale = torch.tensor(32.0, device="cuda")
    amax_in = K.act_amax_launch(h, act) if current else None
    outs = [K.act_fwd_launch(h, act, False, scale, amax_in, 0, False, E4M3, True, True, config=cfg)
            for cfg in ({"TMA": True}, {"TMA": False})]
    (_, q1, qt1, a1, i1), (_, q0, qt0, a0, i0) = outs
    assert tma_store_ok(qt1) == (M % 16 == 0)
    assert torch.equal(qt1.view(torch.uint8), qt0.view(torch.uint8))
    assert torch.equal(qt1.view(torch.uint8), q1.view(torch.uint8).t())
    assert torch.equal(q1.view(torch.uint8), q0.view(torch.uint8))
    assert torch.equal(a1, a0) and torch.equal(i1, i0)


@pytest.mark.parametrize("act, shape", [("gelu_tanh", (8192, 2048)), ("gelu_tanh", (4112, 200)),
                                        ("swiglu", (4096, 256)), ("swiglu", (4096, 200)), ("gelu_tanh", (100, 48))])
def test_backward_transposed_copy_through_tma_is_the_pointer_stores_bytes(act, shape):
    """The backward's transposed FP8 gradient through a TMA tensor map writes the pointer stores'
    bytes, with the same dh, q, amax and (up to float32 rounding) bias gradient. Gated with F = 200 (not a multiple of the 64
    columns of a tile, which would cross from one half into the other) and 100 rows (a 100-byte row
    of q^T) take the pointer stores."""
    M, F = shape
    C = 2 * F if act in GATED else F
    g = torch.Generator(device="cuda").manual_seed(M + 3 * F)
    h = (2 * torch.randn(M, C, device="cuda", generator=g)).bfloat16()
    da = (0.1 * torch.randn(M, F, device="cuda", generator=g)).bfloat16()
    scale = torch.tensor(256.0, device="cuda")
    outs = [K.act_bwd_launch(da, h, act, True, scale, None, 0, False, E5M2, True, True, config=cfg)
            for cfg in ({"TMA": True}, {"TMA": False})]
    for a, b in zip(outs[0][:5], outs[1][:5]):  # dh, q, q^T, amax, inv
        a, b = (t.view(torch.uint8) if t.dtype == E5M2 else t for t in (a, b))
        assert torch.equal(a, b)
    # the bias gradient: the same float32 column sums; the order of a tile's sum follows the layout the
    # compiler picks, which differs between the two kernels when F is not a multiple of 16
    torch.testing.assert_close(outs[0][5], outs[1][5], rtol=1e-5, atol=1e-5)
    if F % 16 == 0:
        assert torch.equal(outs[0][5], outs[1][5])
    assert torch.equal(outs[0][2].view(torch.uint8), outs[0][1].view(torch.uint8).t())
