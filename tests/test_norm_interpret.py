"""The Triton launchers of kernels/norm.py under TRITON_INTERPRET=1, at tiny sizes, on CPU.

Compared with the FP32 reference (fp8ops.reference.norm). The interpreter truncates fp32 -> bf16 /
fp16 / fp8 conversions instead of rounding to nearest even, so rounded outputs are compared with
the rule ``err <= 3 x err(reference rounded to the same dtype) + atol`` (truncation errs by up to one
ulp, rounding by half an ulp), FP8 values within one FP8 step; indexing, masking and transposition
are checked exactly (q_t against q.t()). Bit-exact rounding is checked on the GPU (test_norm_gpu).
"""

import os

import pytest
import torch
from fp8ops.kernels import norm as K

from fp8ops.reference import norm as R
from fp8ops.testing import assert_close_rule, assert_same_bits

pytestmark = [
    pytest.mark.interpret,
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs only under TRITON_INTERPRET=1"),
]

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
EPS = 1e-5
CHUNKED = {"BLOCK_M": 4, "BLOCK_K": 16}  # rows longer than 16 take the two-sweep path
NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def _data(M, Kd, dtype, seed=0, wdtype=None):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(M, Kd, generator=g) * 3 + 1).to(dtype)
    r = torch.randn(M, Kd, generator=g).to(dtype)
    w = (1 + 0.3 * torch.randn(Kd, generator=g)).to(wdtype or dtype)
    b = (0.3 * torch.randn(Kd, generator=g)).to(wdtype or dtype)
    dy = torch.randn(M, Kd, generator=g).to(dtype)
    ds = torch.randn(M, Kd, generator=g).to(dtype)
    return x, r, w, b, dy, ds


def _rule(actual, ref32, name, k=3.0):
    """actual (rounded to its dtype by the kernel) vs the fp32 reference."""
    scale = float(ref32.abs().max()) if ref32.numel() else 1.0
    assert_close_rule(actual, ref32, ref32.to(actual.dtype), k=k, atol=2e-6 * max(scale, 1.0), name=name)


def _fp8_close(q, y32, scale, dtype, name):
    """Dequantized q within one FP8 step of y32 (normal range), or of the subnormal spacing.

    Values in the top step of a binade are skipped: the interpreter's FP8 downcast can carry the
    rounding into the exponent wrongly there (the GPU tests check those bit-exactly).
    """
    fmax = 448.0 if dtype == E4M3 else 57344.0
    rel = 2.0**-3 if dtype == E4M3 else 2.0**-2
    v = (y32 * scale).clamp(-fmax, fmax)
    step = v.abs().clamp_min(2.0**-6 if dtype == E4M3 else 2.0**-14) * rel
    mant = v.abs() / torch.exp2(torch.floor(torch.log2(v.abs().clamp_min(2.0**-30))))
    near_boundary = (mant > 2.0 - rel) & (v.abs() < fmax)
    bad = ((q.float() - v).abs() > step) & ~near_boundary
    assert not bool(bad.any()), f"{name}: {int(bad.sum())} FP8 values off by more than one step"
    assert int(near_boundary.sum()) < v.numel() // 4


@pytest.mark.parametrize("shape", [(1, 1), (5, 33), (19, 70)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=NAMES.get)
@pytest.mark.parametrize("rms,zc,res", [(False, False, True), (True, True, False), (False, True, False)],
                         ids=["ln_res", "rms_zc", "ln_zc"])
@pytest.mark.parametrize("config", [None, CHUNKED, {"BLOCK_M": 2, "PROGRAMS_PER_SM": 1}],
                         ids=["row", "chunked", "persistent"])
def test_forward(shape, dtype, rms, zc, res, config):
    x, r, w, b, _, _ = _data(*shape, dtype, wdtype=torch.float32 if dtype == torch.bfloat16 else None)
    r = r if res else None
    bias = None if rms else b
    y, s, q, q_t, amax, inv, mean, rstd = K.norm_fwd_launch(
        x, r, w, bias, EPS, rms, zc, True, None, None, 0, False, None, False, config=config
    )
    if res:
        _rule(s, x.float() + r.float(), "s")
    else:
        assert s.numel() == 0
    # The rest from the kernel's own s (the interpreter rounds the sum by truncation).
    s_in = s if res else x
    _, _, _, _, ramax, _, rmean, rrstd = R.norm_fwd(s_in, None, w, bias, EPS, rms, zc, False, None, None, 0,
                                                    False, None, False)
    _, y32, _, _ = R._y32(s_in, None, w, bias, EPS, rms, zc)
    _rule(y, y32, "y")
    torch.testing.assert_close(rstd, rrstd, rtol=1e-5, atol=0)
    if rms:
        assert mean.numel() == 0
    else:
        torch.testing.assert_close(mean, rmean, rtol=1e-5, atol=1e-5)
    assert q.numel() == q_t.numel() == inv.numel() == 0
    torch.testing.assert_close(amax, ramax, rtol=1e-5, atol=0)
    amax_only = K.norm_amax_launch(x, r, w, bias, EPS, rms, zc, config=config)
    assert_same_bits(amax_only, amax, name="norm_amax vs norm_fwd amax")


@pytest.mark.parametrize("out_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("mode", ["delayed", "current"])
@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("config", [None, {"BLOCK_M": 8, "BLOCK_K": 16}], ids=["default", "tiles"])
def test_fp8_output(out_dtype, mode, transpose, config):
    x, r, w, b, _, _ = _data(37, 45, torch.bfloat16, seed=1)
    scale = torch.tensor(4.0)
    amax_in = K.norm_amax_launch(x, r, w, b, EPS, False, False) if mode == "current" else None
    y, s, q, q_t, amax, inv, _, _ = K.norm_fwd_launch(
        x, r, w, b, EPS, False, False, False, scale, amax_in, 1, True, out_dtype, transpose, config=config
    )
    # The reference from the kernel's own s (the interpreter rounds the sum by truncation).
    _, _, rq, rq_t, ramax, rinv, _, _ = R.norm_fwd(s, None, w, b, EPS, False, False, False, scale, amax_in, 1, True,
                                                   out_dtype, transpose)
    assert y.numel() == 0 and s.shape == x.shape
    assert q.shape == (37, 45) and q.dtype == out_dtype
    torch.testing.assert_close(amax, ramax, rtol=1e-5, atol=0)
    assert inv.item() == rinv.item()  # power-of-two scales: exact reciprocals
    if mode == "delayed":
        assert inv.item() == 0.25
    _, y32, _, _ = R._y32(s, None, w, b, EPS, False, False)
    _fp8_close(q, y32, 1 / rinv, out_dtype, "q")
    if transpose:
        assert q_t.shape == (45, 37)
        assert_same_bits(q_t, q.t().contiguous(), name="q_t")
    else:
        assert q_t.numel() == 0 and rq_t.numel() == 0
    del rq


def test_fp8_saturates_and_empty_rows():
    x, _, w, b, _, _ = _data(6, 20, torch.float32, seed=2)
    y, _, q, _, _, _, _, _ = K.norm_fwd_launch(
        x, None, w, b, EPS, False, False, True, torch.tensor(1e4), None, 0, False, E4M3, True
    )
    big = (y * 1e4).abs() > 448
    assert bool(big.any()) and bool((q.float()[big].abs() == 448).all())
    # M == 0: empty outputs, amax 0, inv_scale still written
    out = K.norm_fwd_launch(x[:0], None, w, b, EPS, True, False, True, torch.tensor(4.0), None, 0, False, E5M2, True)
    assert out[0].shape == (0, 20) and out[2].shape == (0, 20) and out[3].shape == (20, 0)
    assert out[4].item() == 0.0 and out[5].item() == 0.25 and out[7].shape == (0,)


@pytest.mark.parametrize("shape", [(1, 1), (13, 40), (37, 9)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=NAMES.get)
@pytest.mark.parametrize("rms,zc,has_ds", [(False, False, True), (True, True, False), (False, True, False)],
                         ids=["ln_ds", "rms_zc", "ln_zc"])
@pytest.mark.parametrize("config", [None, {"BLOCK_M": 2, "BLOCK_K": 16, "PROGRAMS_PER_SM": 1}],
                         ids=["row", "chunked"])
def test_backward(shape, dtype, rms, zc, has_ds, config):
    x, _, w, _, dy, ds = _data(*shape, dtype, seed=3, wdtype=torch.float32)
    ds = ds if has_ds else None
    _, _, _, _, _, _, mean, rstd = R.norm_fwd(x, None, w, None, EPS, rms, zc, False, None, None, 0, False, None, False)
    dx, dw, db = K.norm_bwd_launch(dy, x, w, mean, rstd, ds, rms, zc, not rms, config=config)
    x32 = x.float()
    rdx, rdw, rdb = R.norm_bwd(dy, x32, w, mean, rstd, ds, rms, zc, not rms)  # fp32 dx
    assert dx.dtype == dtype and dw.dtype == torch.float32
    _rule(dx, rdx, "dx")
    torch.testing.assert_close(dw, rdw, rtol=1e-5, atol=1e-5)
    if rms:
        assert db.numel() == 0
    else:
        torch.testing.assert_close(db, rdb, rtol=1e-5, atol=1e-5)


def test_backward_finalize_sums_every_partial_row():
    # 100 one-row programs (G = 100 > the finalize's 32-row slab) over K = 100 columns (two column
    # blocks of the finalize, the second partial): every row's contribution must arrive once.
    M, Kc = 100, 100
    x, _, w, _, dy, _ = _data(M, Kc, torch.float32, seed=5, wdtype=torch.float32)
    _, _, _, _, _, _, mean, rstd = R.norm_fwd(x, None, w, None, EPS, False, False, False, None, None, 0, False,
                                              None, False)
    cfg = {"BLOCK_M": 1, "BLOCK_K": 128, "num_warps": 4, "PROGRAMS_PER_SM": 25}
    _, dw, db = K.norm_bwd_launch(dy, x, w, mean, rstd, None, False, False, True, config=cfg)
    _, rdw, rdb = R.norm_bwd(dy, x, w, mean, rstd, None, False, False, True)
    torch.testing.assert_close(dw, rdw, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(db, rdb, rtol=1e-5, atol=1e-5)
    # by hand: dy of ones, so dbias is the row count in every column, exactly
    _, _, db1 = K.norm_bwd_launch(torch.ones_like(dy), x, w, mean, rstd, None, False, False, True, config=cfg)
    assert db1.tolist() == [float(M)] * Kc


def test_backward_weight_dtype_and_empty():
    x, _, w, _, dy, _ = _data(9, 24, torch.bfloat16, seed=4)
    _, _, _, _, _, _, mean, rstd = R.norm_fwd(x, None, w, None, EPS, False, False, False, None, None, 0, False,
                                              None, False)
    dx, dw, db = K.norm_bwd_launch(dy, x, w, mean, rstd, None, False, False, True)
    assert dw.dtype == db.dtype == torch.bfloat16
    _, rdw, _ = R.norm_bwd(dy, x, w.float(), mean, rstd, None, False, False, True)
    torch.testing.assert_close(dw.float(), rdw, rtol=1e-2, atol=1e-2)
    dx, dw, db = K.norm_bwd_launch(dy[:0], x[:0], w, mean[:0], rstd[:0], None, False, False, True)
    assert dx.shape == (0, 24) and bool((dw == 0).all()) and bool((db == 0).all())


def test_launcher_errors():
    x, r, w, b, _, _ = _data(4, 8, torch.float32)
    with pytest.raises(ValueError, match="x must be a contiguous 2-D"):
        K.norm_fwd_launch(x.t(), None, w, b, EPS, False, False, True, None, None, 0, False, None, False)
    with pytest.raises(ValueError, match=r"weight must be a contiguous \(8,\)"):
        K.norm_fwd_launch(x, None, w[:4], b, EPS, False, False, True, None, None, 0, False, None, False)
    with pytest.raises(ValueError, match="residual must have x's dtype"):
        K.norm_fwd_launch(x, r.bfloat16(), w, b, EPS, False, False, True, None, None, 0, False, None, False)
    with pytest.raises(ValueError, match="transpose=True needs an FP8 out_dtype"):
        K.norm_fwd_launch(x, None, w, b, EPS, False, False, True, None, None, 0, False, None, True)
    with pytest.raises(ValueError, match="unknown launch config keys"):
        K.norm_fwd_launch(x, None, w, b, EPS, False, False, True, None, None, 0, False, None, False,
                          config={"BLOCK": 4})
    with pytest.raises(ValueError, match="BLOCK_K must be a power of two"):
        K.norm_bwd_launch(x, x, w, x[:, 0].contiguous(), x[:, 0].contiguous(), None, False, False, False,
                          config={"BLOCK_K": 12})


# ------------------------------------------------------------------------------------------------
# Dropout on x before the residual add


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=NAMES.get)
@pytest.mark.parametrize("config", [None, CHUNKED, {"BLOCK_M": 2, "PROGRAMS_PER_SM": 1}],
                         ids=["row", "chunked", "persistent"])
@pytest.mark.parametrize("transpose", [False, True], ids=["plain", "fp8_t"])
def test_forward_dropout_is_the_reference_mask(dtype, config, transpose):
    """s = x * keep / (1 - p) + residual with the reference's mask of (seed, row, column), in the
    whole-row, chunked and persistent paths and the transposed FP8 path; y normalises that s."""
    M, Kd, p = 37, 40, 0.3
    x, r, w, b, _, _ = _data(M, Kd, dtype, seed=6, wdtype=torch.float32)
    seed = torch.tensor(-987654321987, dtype=torch.int64)
    cast = (torch.ones(()), None, 0, False, E4M3, True) if transpose else (None, None, 0, False, None, False)
    y, s, q, q_t, amax, _, mean, rstd = K.norm_fwd_launch(x, r, w, b, EPS, False, False, True, *cast, seed, p,
                                                          config=config)
    keep = R.branch_keep(seed, M, Kd, p)
    assert 0.2 < 1 - float(keep.float().mean()) < 0.4
    s32 = x.float() * torch.where(keep, 1 / (1 - p), 0.0) + r.float()
    _rule(s, s32, "s")
    # where x is dropped s is the residual exactly (x * 0 + r in fp32, then rounded)
    assert torch.equal(s[~keep], r[~keep])
    ry, rs, *_ = R.norm_fwd(x, r, w, b, EPS, False, False, True, *cast, seed, p)
    assert torch.equal(rs == r, s == r)  # the same mask, element by element
    y32 = R.norm_fwd(s.float(), None, w, b, EPS, False, False, True, None, None, 0, False, None, False)[0]
    _rule(y, y32, "y")
    if transpose:
        assert torch.equal(q_t, q.t())
    a = K.norm_amax_launch(x, r, w, b, EPS, False, False, seed, p, config=config)
    torch.testing.assert_close(a, amax, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=NAMES.get)
@pytest.mark.parametrize("config", [None, {"BLOCK_M": 2, "BLOCK_K": 16, "PROGRAMS_PER_SM": 1}],
                         ids=["row", "chunked"])
def test_backward_dropout_writes_the_branch_gradient(dtype, config):
    M, Kd, p = 21, 40, 0.25
    x, r, w, _, dy, ds = _data(M, Kd, dtype, seed=8, wdtype=torch.float32)
    seed = torch.tensor(4242, dtype=torch.int64)
    _, s, _, _, _, _, mean, rstd = R.norm_fwd(x, r, w, None, EPS, False, False, False, None, None, 0, False, None,
                                              False, seed, p)
    dx, dxb, dw, db = K.norm_bwd_dropout_launch(dy, s, w, mean, rstd, ds, False, False, True, seed, p,
                                                config=config)
    rdx, rdxb, rdw, rdb = R.norm_bwd_dropout(dy, s.float(), w, mean, rstd, ds, False, False, True, seed, p)
    dx0, _, _ = K.norm_bwd_launch(dy, s, w, mean, rstd, ds, False, False, True, config=config)
    assert torch.equal(dx, dx0)  # the residual's gradient is the plain backward's dx
    _rule(dx, R._norm_bwd32(dy, s.float(), w, mean, rstd, ds, False, False, True)[0], "dx")
    keep = R.branch_keep(seed, M, Kd, p)
    assert bool((dxb[~keep] == 0).all()) and bool((dxb[keep] != 0).all())
    _rule(dxb, R._norm_bwd32(dy, s.float(), w, mean, rstd, ds, False, False, True)[0]
          * R.branch_scale(seed, M, Kd, p), "dx_branch")
    torch.testing.assert_close(dw, rdw, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(db, rdb, rtol=1e-5, atol=1e-5)


def test_dropout_launcher_errors():
    x, r, w, b, dy, _ = _data(4, 8, torch.float32)
    seed = torch.tensor(1, dtype=torch.int64)
    base = (EPS, False, False, True, None, None, 0, False, None, False)
    with pytest.raises(ValueError, match="norm_fwd: the dropout applies to x before its residual add"):
        K.norm_fwd_launch(x, None, w, b, *base, seed, 0.1)
    with pytest.raises(ValueError, match=r"norm_fwd: dropout_p must be in \(0, 1\)"):
        K.norm_fwd_launch(x, r, w, b, *base, seed, 1.0)
    with pytest.raises(ValueError, match="norm_fwd: dropout_p=0.2 needs a dropout_seed"):
        K.norm_fwd_launch(x, r, w, b, *base, None, 0.2)
    with pytest.raises(ValueError, match="dropout_seed must be a 1-element int64 tensor"):
        K.norm_fwd_launch(x, r, w, b, *base, seed.int(), 0.2)
    with pytest.raises(ValueError, match="norm_bwd_dropout: dropout_seed must be"):
        K.norm_bwd_dropout_launch(dy, x, w, x[:, 0].contiguous(), x[:, 0].contiguous(), None, False, False, False,
                                  None, 0.2)
