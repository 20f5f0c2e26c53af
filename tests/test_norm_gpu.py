"""GPU tests of the norm kernels at real sizes: forward, FP8 epilogue, residual, backward.

- y, dx, dweight, dbias against a float64 computation of the same formulas, with the rule
  ``err <= k x err(plain PyTorch at the same precision) + atol`` (fp8ops.testing.assert_close_rule);
- FP8 bytes bit-exact against torch's saturating cast of the kernel's own fp32 output (float32
  inputs, where y is stored in fp32), and within one FP8 step of the cast of the FP32 reference
  otherwise; q_t bit-exact against q.t(); amax bit-exact against max |y| (float32 inputs);
- the just-in-time scale of current scaling equal to ``fp8ops.compute_scale`` of the amax pass;
- s = x + residual bit-exact against torch's fp32 add rounded to x's dtype;
- the chunked code paths (long rows, or a small BLOCK_K forced through ``config=``);
- the dweight / dbias reduction is deterministic (two runs give the same bits).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from fp8ops.kernels import norm as kn

import fp8ops
from fp8ops.norm import layer_norm, rms_norm
from fp8ops.reference import norm as R
from fp8ops.reference.quantize import saturating_cast
from fp8ops.testing import assert_close_rule, assert_same_bits

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FMAX = {E4M3: 448.0, E5M2: 57344.0}
EPS = 1e-5
SHAPES = [(4096, 4096), (8192, 1000), (1, 1), (3, 17), (257, 20000)]
NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def _data(shape, dtype, seed=0, wdtype=None):
    M, K = shape
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = (torch.randn(M, K, device="cuda", generator=g) * 2 + 0.5).to(dtype)
    r = torch.randn(M, K, device="cuda", generator=g).to(dtype)
    w = (1 + 0.2 * torch.randn(K, device="cuda", generator=g)).to(wdtype or dtype)
    b = (0.2 * torch.randn(K, device="cuda", generator=g)).to(wdtype or dtype)
    dy = torch.randn(M, K, device="cuda", generator=g).to(dtype)
    ds = torch.randn(M, K, device="cuda", generator=g).to(dtype)
    return x, r, w, b, dy, ds


def _f64_forward(s, w, b, rms, zc):
    """(y, mean, rstd, xh) in float64 from the normalised input s."""
    s = s.double()
    if rms:
        mean = None
        rstd = torch.rsqrt(s.square().mean(1) + EPS)
        xh = s * rstd[:, None]
    else:
        mean = s.mean(1)
        rstd = torch.rsqrt((s - mean[:, None]).square().mean(1) + EPS)
        xh = (s - mean[:, None]) * rstd[:, None]
    g = w.double() + (1.0 if zc else 0.0)
    y = xh * g + (0.0 if b is None else b.double())
    return y, mean, rstd, xh


def _torch_same_precision(s, w, b, rms, zc):
    K = s.shape[1]
    g = (w.float() + 1).to(w.dtype) if zc else w
    if rms:
        return F.rms_norm(s, (K,), g.to(s.dtype), EPS)
    return F.layer_norm(s, (K,), g.to(s.dtype), None if b is None else b.to(s.dtype), EPS)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=NAMES.get)
@pytest.mark.parametrize("rms", [False, True], ids=["ln", "rms"])
def test_forward_fp8_and_residual(shape, dtype, rms):
    x, r, w, b, _, _ = _data(shape, dtype)
    bias = None if rms else b
    scale = torch.tensor(24.0, device="cuda")
    y, s, q, q_t, amax, inv, mean, rstd = kn.norm_fwd_launch(
        x, r, w, bias, EPS, rms, False, True, scale, None, 0, False, E4M3, True
    )
    # s = x + residual: fp32 add, rounded once to x's dtype
    assert_same_bits(s, (x.float() + r.float()).to(dtype), name="s")
    y64, mean64, rstd64, _ = _f64_forward(s, w, bias, rms, False)
    assert_close_rule(y, y64, _torch_same_precision(s, w, bias, rms, False), k=2, atol=1e-5, name="y")
    assert_close_rule(rstd, rstd64, rstd64.float(), k=4, atol=1e-6 * float(rstd64.abs().max()), name="rstd")
    if not rms:
        assert_close_rule(mean, mean64, mean64.float(), k=4, atol=1e-6, name="mean")
    else:
        assert mean.numel() == 0
    assert_same_bits(q_t, q.t().contiguous(), name="q_t")
    assert_same_bits(inv, torch.tensor(24.0, device="cuda").reciprocal(), name="inv_scale")
    y_ref = R.norm_fwd(x, r, w, bias, EPS, rms, False, True, scale, None, 0, False, E4M3, False)[2]  # its q
    if dtype == torch.float32:
        # y is the kernel's fp32 output: q must be its saturating cast, bit for bit
        assert_same_bits(q, saturating_cast(y, scale, E4M3), name="q")
        assert_same_bits(amax, y.abs().amax(), name="amax")
    else:
        diff = (q.float() - y_ref.float()).abs()
        step = y_ref.float().abs().clamp_min(2.0**-6) * 2.0**-3  # one E4M3 step
        assert bool((diff <= step).all()), "q differs from the reference cast by more than one FP8 step"
        assert (q.view(torch.uint8) != y_ref.view(torch.uint8)).float().mean().item() < 1e-3
        torch.testing.assert_close(amax, y64.abs().amax().float(), rtol=1e-5, atol=0)


@pytest.mark.parametrize("out_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("margin,power_2", [(0, False), (1, True)])
def test_current_scaling(out_dtype, margin, power_2):
    x, _, w, b, _, _ = _data((4096, 4096), torch.float32, seed=1)
    a = kn.norm_amax_launch(x, None, w, b, EPS, False, True)
    fallback = torch.tensor(3.0, device="cuda")
    y, _, q, _, amax, inv, _, _ = kn.norm_fwd_launch(
        x, None, w, b, EPS, False, True, True, fallback, a, margin, power_2, out_dtype, False
    )
    assert_same_bits(a, amax, name="amax pass vs amax of the forward")
    sc = fp8ops.compute_scale(a, fallback, FMAX[out_dtype], margin=margin, power_2_scale=power_2)
    assert_same_bits(inv, torch.reciprocal(sc), name="inv_scale")
    assert_same_bits(q, saturating_cast(y, sc, out_dtype), name="q")


@pytest.mark.parametrize("config", [{"BLOCK_M": 2, "BLOCK_K": 256}, {"BLOCK_M": 16, "BLOCK_K": 64, "num_warps": 4},
                                    {"BLOCK_M": 4, "PROGRAMS_PER_SM": 1}])
def test_chunked_forward_matches_single_chunk(config):
    x, r, w, b, _, _ = _data((1000, 1000), torch.float32, seed=2)
    scale = torch.tensor(16.0, device="cuda")
    a = kn.norm_fwd_launch(x, r, w, b, EPS, False, True, True, scale, None, 0, False, E5M2, True)
    c = kn.norm_fwd_launch(x, r, w, b, EPS, False, True, True, scale, None, 0, False, E5M2, True, config=config)
    torch.testing.assert_close(c[0], a[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(c[7], a[7], rtol=1e-5, atol=0)
    assert_same_bits(c[1], a[1], name="s")
    assert (c[2].view(torch.uint8) != a[2].view(torch.uint8)).sum() <= 10
    assert_same_bits(c[3], c[2].t().contiguous(), name="q_t")


def test_nan_row():
    x, _, w, b, _, _ = _data((64, 300), torch.float32, seed=3)
    x[5, 7] = float("nan")
    y, _, q, _, amax, _, _, _ = kn.norm_fwd_launch(
        x, None, w, b, EPS, False, False, True, torch.tensor(1.0, device="cuda"), None, 0, False, E4M3, False
    )
    assert torch.isnan(amax) and torch.isnan(y[5]).all() and torch.isfinite(y[torch.arange(64) != 5]).all()
    assert torch.isnan(q[5].float()).all()


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=NAMES.get)
@pytest.mark.parametrize("rms,zc", [(False, False), (True, True)], ids=["ln", "rms_zc"])
def test_backward(shape, dtype, rms, zc):
    x, _, w, _, dy, ds = _data(shape, dtype, seed=4, wdtype=torch.float32)
    _, _, _, _, _, _, mean, rstd = kn.norm_fwd_launch(x, None, w, None, EPS, rms, zc, False, None, None, 0, False,
                                                      None, False)
    dx, dw, db = kn.norm_bwd_launch(dy, x, w, mean, rstd, ds, rms, zc, not rms)
    # float64 formulas from the float64 statistics
    _, _, rstd64, xh = _f64_forward(x, w, None, rms, zc)
    gdy = dy.double() * (w.double() + (1.0 if zc else 0.0))
    c2 = (gdy * xh).mean(1, keepdim=True)
    c1 = 0.0 if rms else gdy.mean(1, keepdim=True)
    dx64 = (gdy - c1 - xh * c2) * rstd64[:, None] + ds.double()
    dw64 = (dy.double() * xh).sum(0)
    # plain PyTorch at the same precision: autograd of F.layer_norm / F.rms_norm in x's dtype
    xx = x.clone().requires_grad_()
    ww = w.to(dtype).clone().requires_grad_()
    bb = torch.zeros_like(ww, requires_grad=True)
    g = (ww + 1) if zc else ww
    yy = F.rms_norm(xx, (shape[1],), g, EPS) if rms else F.layer_norm(xx, (shape[1],), g, bb, EPS)
    yy.backward(dy)
    scale = float(dx64.abs().max()) if dx64.numel() else 1.0
    # A contracted (fused multiply-add) dy * g - mean(dy * g) leaves one fp32 rounding of dy * g,
    # amplified by rstd: visible only in degenerate rows (K = 1, zero variance, rstd = 1/sqrt(eps)).
    fma = 2.0**-23 * float((rstd64[:, None] * gdy.abs()).max()) if dx64.numel() else 0.0
    assert_close_rule(dx, dx64, (xx.grad.double() + ds.double()).to(dtype), k=2, atol=1e-5 * scale + fma,
                      name="dx")
    assert_close_rule(dw, dw64, ww.grad, k=4, atol=1e-5 * float(dw64.abs().max()), name="dweight")
    if not rms:
        db64 = dy.double().sum(0)
        assert_close_rule(db, db64, bb.grad, k=4, atol=1e-5 * float(db64.abs().max()), name="dbias")
    # deterministic reduction
    dx2, dw2, _ = kn.norm_bwd_launch(dy, x, w, mean, rstd, ds, rms, zc, not rms)
    assert_same_bits(dw2, dw, name="dweight (second run)")
    assert_same_bits(dx2, dx, name="dx (second run)")


@pytest.mark.parametrize("config", [{"BLOCK_M": 4, "BLOCK_K": 128, "PROGRAMS_PER_SM": 1},
                                    {"BLOCK_M": 1, "BLOCK_K": 256, "num_warps": 4}])
def test_chunked_backward_matches_single_chunk(config):
    x, _, w, _, dy, _ = _data((3000, 1000), torch.float32, seed=5)
    _, _, _, _, _, _, mean, rstd = kn.norm_fwd_launch(x, None, w, None, EPS, False, False, False, None, None, 0,
                                                      False, None, False)
    a = kn.norm_bwd_launch(dy, x, w, mean, rstd, None, False, False, True)
    c = kn.norm_bwd_launch(dy, x, w, mean, rstd, None, False, False, True, config=config)
    for u, v in zip(a, c):
        torch.testing.assert_close(v, u, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("rms", [False, True], ids=["ln", "rms"])
def test_public_autograd_on_cuda(rms):
    g = torch.Generator(device="cuda").manual_seed(6)
    x = torch.randn(4, 512, 1536, device="cuda", generator=g).bfloat16().requires_grad_()
    res = torch.randn(4, 512, 1536, device="cuda", generator=g).bfloat16().requires_grad_()
    w = (1 + 0.1 * torch.randn(1536, device="cuda", generator=g)).requires_grad_()
    b = (0.1 * torch.randn(1536, device="cuda", generator=g)).requires_grad_()
    dy = torch.randn(4, 512, 1536, device="cuda", generator=g).bfloat16()
    dsum = torch.randn(4, 512, 1536, device="cuda", generator=g).bfloat16()
    if rms:
        (y, s), _ = rms_norm(x, w, None, residual=res)
    else:
        (y, s), _ = layer_norm(x, w, b, None, residual=res)
    torch.autograd.backward((y, s), (dy, dsum))
    # float64 autograd of the same math
    x64, r64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, res, w, b))
    # the normalised input is s as stored (rounded to bf16); its gradient flows to x and residual
    s64 = (x64 + r64).detach().to(torch.bfloat16).double() + (x64 + r64 - (x64 + r64).detach())
    y64 = F.rms_norm(s64, (1536,), w64, EPS) if rms else F.layer_norm(s64, (1536,), w64, b64, EPS)
    torch.autograd.backward((y64, s64), (dy.double(), dsum.double()))
    rel = lambda a, e: float((a.double() - e).norm() / e.norm())
    assert rel(y.detach(), y64.detach()) < 1e-2
    assert rel(x.grad, x64.grad) < 1e-2 and rel(res.grad, r64.grad) < 1e-2
    assert rel(w.grad, w64.grad) < 1e-4
    if not rms:
        assert rel(b.grad, b64.grad) < 1e-4


# ------------------------------------------------------------------------------------------------
# Dropout on x before the residual add


@pytest.mark.parametrize("shape", [(8192, 4096), (300, 1000), (64, 20000)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("fp8_t", [False, True], ids=["plain", "fp8_t"])
def test_dropout_forward_backward_against_the_reference(shape, fp8_t):
    """The keep mask is the reference's, element by element (s is the residual exactly where x is
    dropped, and nowhere else); s, y, dx, dx_branch within the rounding rule of the reference; the
    drop rate within sampling error of p; dx equals the plain backward's bit for bit."""
    M, K = shape
    p = 0.1
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(M, K, device="cuda", generator=g).bfloat16() * 2 + 1
    r = torch.randn(M, K, device="cuda", generator=g).bfloat16()
    w = (1 + 0.2 * torch.randn(K, device="cuda", generator=g)).bfloat16()
    b = (0.2 * torch.randn(K, device="cuda", generator=g)).bfloat16()
    dy = torch.randn(M, K, device="cuda", generator=g).bfloat16()
    ds = torch.randn(M, K, device="cuda", generator=g).bfloat16()
    seed = torch.tensor(2**40 + 12345, dtype=torch.int64, device="cuda")
    cast = (torch.ones((), device="cuda"), None, 0, False, E4M3, True) if fp8_t else (None, None, 0, False, None, False)
    y, s, q, q_t, amax, _, mean, rstd = kn.norm_fwd_launch(x, r, w, b, EPS, False, False, True, *cast, seed, p)
    keep = R.branch_keep(seed, M, K, p)
    assert torch.equal(s[~keep], r[~keep]) and bool(keep[s != r].all())
    assert abs(float((~keep).float().mean()) - p) < 6 * (p * (1 - p) / (M * K)) ** 0.5 + 2.0**-17
    s32 = x.double() * torch.where(keep, 1 / (1 - p), 0.0).double() + r.double()
    assert_close_rule(s, s32, s32.to(torch.bfloat16), k=1.0, atol=1e-6, name="s")
    y32 = R.norm_fwd(s.double(), None, w.double(), b.double(), EPS, False, False, True, None, None, 0, False, None,
                     False)[0]
    assert_close_rule(y, y32, F.layer_norm(s.float(), (K,), w.float(), b.float(), EPS).bfloat16(), k=2.0,
                      atol=1e-6, name="y")
    if fp8_t:
        assert torch.equal(q_t, q.t())
    dx, dxb, dw, db = kn.norm_bwd_dropout_launch(dy, s, w, mean, rstd, ds, False, False, True, seed, p)
    dx0, dw0, db0 = kn.norm_bwd_launch(dy, s, w, mean, rstd, ds, False, False, True)
    assert torch.equal(dx, dx0) and torch.equal(dw, dw0) and torch.equal(db, db0)
    assert bool((dxb[~keep] == 0).all())
    rdx = R._norm_bwd32(dy, s.float(), w.float(), mean, rstd, ds, False, False, True)[0]
    want = rdx * R.branch_scale(seed, M, K, p)
    assert_close_rule(dxb, want, want.bfloat16(), k=3.0, atol=1e-5 * float(want.abs().max()), name="dx_branch")


def test_dropout_in_a_compiled_graph_gives_the_eager_bits():
    """Inside torch.compile Inductor launches the norm kernels itself: the same mask and bits."""
    M, K = 1024, 768
    g = torch.Generator(device="cuda").manual_seed(2)
    args = [torch.randn(M, K, device="cuda", generator=g).bfloat16() for _ in range(2)]
    ln_w = torch.ones(K, device="cuda", dtype=torch.bfloat16)
    ln_b = torch.zeros(K, device="cuda", dtype=torch.bfloat16)
    w1 = (torch.randn(4 * K, K, device="cuda", generator=g) / K**0.5).bfloat16()
    w2 = (torch.randn(K, 4 * K, device="cuda", generator=g) / (4 * K) ** 0.5).bfloat16()
    seed = torch.tensor(9, dtype=torch.int64, device="cuda")

    def f(x, r):
        (y, s), _ = fp8ops.fused_ln_mlp(x, ln_w, ln_b, w1, None, w2, None, None, recipe=None, residual=r,
                                        residual_dropout=0.1, dropout_seed=seed)
        return y, s

    outs = []
    for fn in (f, torch.compile(f, fullgraph=True)):
        x, r = (t.clone().requires_grad_() for t in args)
        y, s = fn(x, r)
        torch.autograd.backward([y, s], [torch.ones_like(y), torch.ones_like(s)])
        outs.append((y.detach(), s.detach(), x.grad, r.grad))
    for a, c, name in zip(*outs, ("y", "s", "dx", "dr")):
        assert torch.equal(a, c), name
