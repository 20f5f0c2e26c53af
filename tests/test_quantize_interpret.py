"""The Triton launchers of kernels/quantize.py under TRITON_INTERPRET=1, at small sizes, on CPU.

The interpreter's FP8 downcast rounds incorrectly near binade boundaries and turns NaN into a
finite value, and its ``div_rn`` can be one ulp off. So: data is compared bit-exactly only for
inputs that are exactly representable after scaling (indexing, masking, transposition,
saturation); just-in-time scales are compared to a few ulp; dequantized values to the format's
rounding bound. Bit-exact rounding and NaN propagation are checked on the GPU (test_quantize_gpu).
"""

import os

import pytest
import torch

from fp8ops.kernels import quantize as K
from fp8ops.reference import quantize as R

pytestmark = [
    pytest.mark.interpret,
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs only under TRITON_INTERPRET=1"),
]

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
IN = [torch.float32, torch.bfloat16, torch.float16]
SHAPES = [(1, 1), (3, 17), (37, 53), (64, 130)]


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _grid(shape, dtype, seed):
    """Random finite normal FP8 values of ``dtype`` (as float32): exactly representable."""
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
    v = bits.view(dtype).float()
    v = torch.where(torch.isfinite(v), v, torch.ones_like(v))
    tiny = 2.0**-6 if dtype == torch.float8_e4m3fn else 2.0**-14
    return torch.where(v.abs() < tiny, torch.full_like(v, 0.5), v)


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("xdt", IN)
@pytest.mark.parametrize("shape", SHAPES)
def test_cast_delayed_exact(dtype, xdt, shape):
    scale = torch.tensor(4.0)
    x = (_grid(shape, dtype, 1) / scale).to(xdt)
    q, amax, inv = K.cast_launch(x, scale, None, 0, False, dtype, config={"BLOCK": 256})
    qr, amax_r, inv_r = R.cast(x, scale, None, 0, False, dtype)
    assert torch.equal(_u8(q), _u8(qr))
    assert amax.item() == amax_r.item()
    assert inv.item() == inv_r.item() == 0.25


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("block", [(16, 32, 2), (32, 16, 1)])
def test_cast_transpose_exact(dtype, shape, block):
    scale = torch.tensor(0.5)
    x = (_grid(shape, dtype, 2) / scale).to(torch.bfloat16)
    bm, bk, gm = block
    q, qt, amax, inv = K.cast_transpose_launch(
        x, scale, None, 0, False, dtype, config={"BLOCK_M": bm, "BLOCK_K": bk, "GROUP_M": gm}
    )
    qr, qtr, amax_r, _ = R.cast_transpose(x, scale, None, 0, False, dtype)
    assert q.shape == shape and qt.shape == shape[::-1]
    assert torch.equal(_u8(q), _u8(qr))
    assert torch.equal(_u8(qt), _u8(qtr))
    assert amax.item() == amax_r.item()
    assert inv.item() == 2.0


def test_cast_transpose_dbias_hand_computed():
    """Column sums of a 3 x 3 tensor, by hand; the cast outputs are those of cast_transpose."""
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [-7.0, 0.5, 0.0]], dtype=torch.bfloat16)
    scale = torch.tensor(2.0)
    q, qt, amax, inv, db = K.cast_transpose_dbias_launch(x, scale, None, 0, False, torch.float8_e4m3fn)
    assert db.dtype == torch.float32 and db.tolist() == [-2.0, 7.5, 9.0]
    q2, qt2, amax2, inv2 = K.cast_transpose_launch(x, scale, None, 0, False, torch.float8_e4m3fn)
    assert torch.equal(_u8(q), _u8(q2)) and torch.equal(_u8(qt), _u8(qt2))
    assert amax.item() == amax2.item() == 7.0 and inv.item() == inv2.item() == 0.5


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("block", [(16, 32, 2), (32, 16, 1)])
def test_cast_transpose_dbias_sums_every_tile_row(shape, block):
    """Several tile rows and columns, edges included: the partial sums of every tile row are added
    (integers, so every summation order gives the same float32 sums)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randint(-8, 9, shape, generator=g).to(torch.bfloat16)
    bm, bk, gm = block
    cfg = {"BLOCK_M": bm, "BLOCK_K": bk, "GROUP_M": gm}
    q, qt, amax, inv, db = K.cast_transpose_dbias_launch(x, torch.tensor(4.0), None, 0, False,
                                                         torch.float8_e5m2, config=cfg)
    assert db.shape == (shape[1],)
    assert torch.equal(db, x.float().sum(0))
    q2, qt2, _, _ = K.cast_transpose_launch(x, torch.tensor(4.0), None, 0, False, torch.float8_e5m2, config=cfg)
    assert torch.equal(_u8(q), _u8(q2)) and torch.equal(_u8(qt), _u8(qt2))


@pytest.mark.parametrize("shape", [(0, 16), (5, 0)])
def test_cast_transpose_dbias_empty(shape):
    x = torch.empty(shape, dtype=torch.bfloat16)
    *_, inv, db = K.cast_transpose_dbias_launch(x, torch.tensor(4.0), None, 0, False, torch.float8_e4m3fn)
    assert db.shape == (shape[1],) and (db == 0).all() and inv.item() == 0.25


@pytest.mark.parametrize("dtype", FP8)
def test_cast_saturates(dtype):
    fmax = 448.0 if dtype == torch.float8_e4m3fn else 57344.0
    x = torch.tensor([[fmax * 2, -fmax * 10, float("inf"), float("-inf"), fmax, 1.0, 0.0, -0.0]])
    q, amax, _ = K.cast_launch(x, torch.tensor(1.0), None, 0, False, dtype)
    assert q.float().tolist()[0] == [fmax, -fmax, fmax, -fmax, fmax, 1.0, 0.0, 0.0]
    assert amax.item() == float("inf")


def test_amax_nan_and_empty():
    x = torch.randn(9, 31)
    assert K.amax_launch(x, config={"BLOCK": 64}).item() == x.abs().max().item()
    x[4, 7] = float("nan")
    assert torch.isnan(K.amax_launch(x, config={"BLOCK": 64}))
    x[4, 7] = float("-inf")
    assert K.amax_launch(x).item() == float("inf")
    assert K.amax_launch(torch.empty(0, 5)).item() == 0.0
    # A NaN wins the in-pass amax of the cast kernels too.
    x[4, 7] = float("nan")
    assert torch.isnan(K.cast_launch(x, torch.tensor(1.0), None, 0, False, torch.float8_e4m3fn)[1])
    assert torch.isnan(K.cast_transpose_launch(x, torch.tensor(1.0), None, 0, False, torch.float8_e5m2)[2])


def _check_dequantized(x, q, inv, qr, inv_r, dtype):
    """Dequantized values within one ulp of the reference, except where the reference rounds up
    into the next binade (the interpreter drops that carry: 126.2 -> 64 instead of 128)."""
    bound = 2.0**-3 if dtype == torch.float8_e4m3fn else 2.0**-2
    deq, ref = q.float() * inv, qr.float() * inv_r
    m, _ = torch.frexp(qr.float())
    carry = (m.abs() == 0.5) & (x.float().abs() < ref.abs())
    ok = ((deq - ref).abs() <= bound * ref.abs() + 2.0**-9 * inv_r) | carry
    assert ok.all(), f"{(~ok).sum().item()} values off: {deq[~ok][:5].tolist()} vs {ref[~ok][:5].tolist()}"
    assert carry.float().mean() < 0.2  # most values are still checked


def _close_scale(a, b):
    torch.testing.assert_close(a, b, rtol=2.0**-21, atol=0.0)


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("margin,pow2", [(0, False), (2, False), (1, True)])
@pytest.mark.parametrize("transpose", [False, True])
def test_cast_current(dtype, margin, pow2, transpose):
    torch.manual_seed(3)
    x = torch.randn(37, 53) * 3.0
    amax = K.amax_launch(x, config={"BLOCK": 128})
    assert amax.item() == x.abs().max().item()
    fallback = torch.tensor(1.0)
    if transpose:
        q, qt, _, inv = K.cast_transpose_launch(x, fallback, amax, margin, pow2, dtype,
                                                config={"BLOCK_M": 16, "BLOCK_K": 32, "GROUP_M": 4})
        assert torch.equal(_u8(qt), _u8(q.t().contiguous()))
    else:
        q, _, inv = K.cast_launch(x, fallback, amax, margin, pow2, dtype, config={"BLOCK": 512})
    qr, _, inv_r = R.cast(x, fallback, amax, margin, pow2, dtype)
    _close_scale(inv, inv_r)
    if pow2:
        assert inv.item() == inv_r.item()
        m, _ = torch.frexp(inv)
        assert m.item() == 0.5  # an exact power of two
    _check_dequantized(x, q, inv, qr, inv_r, dtype)


@pytest.mark.filterwarnings("error:divide by zero encountered in f:RuntimeWarning")  # fmod, floor_divide
@pytest.mark.parametrize("shape", [(0, 16), (0, 1), (5, 0)])
@pytest.mark.parametrize("current", [False, True], ids=["delayed", "current"])
def test_cast_transpose_empty(shape, current):
    """An empty matrix launches one program that only writes the inverse scale (no tile row: the
    grouped tile order must not divide by the zero tile count)."""
    x = torch.empty(shape, dtype=torch.bfloat16)
    scale = torch.tensor(4.0)
    amax_in = K.amax_launch(x) if current else None
    q, qt, amax, inv = K.cast_transpose_launch(x, scale, amax_in, 0, False, torch.float8_e4m3fn)
    assert q.shape == shape and qt.shape == shape[::-1]
    assert amax.item() == 0.0 and inv.item() == 0.25


@pytest.mark.parametrize("dtype", FP8)
def test_cast_current_zero_and_nonfinite_amax_use_fallback(dtype):
    x = torch.zeros(4, 8)
    fallback = torch.tensor(8.0)
    q, _, inv = K.cast_launch(x, fallback, K.amax_launch(x), 0, False, dtype)
    assert inv.item() == 0.125 and (q.float() == 0).all()
    x[1, 1] = float("inf")
    _, _, inv = K.cast_launch(x, fallback, K.amax_launch(x), 0, False, dtype)
    assert inv.item() == 0.125


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("shape", [(1, 1), (5, 7), (13, 100)])
@pytest.mark.parametrize("margin,pow2", [(0, False), (1, True)])
def test_cast_rowwise(dtype, shape, margin, pow2):
    torch.manual_seed(4)
    x = torch.randn(shape) * torch.logspace(-3, 3, shape[0])[:, None]
    x[0, 0] = 0.0
    q, inv, amax = K.cast_rowwise_launch(x, margin, pow2, dtype, config={"BLOCK_M": 4, "BLOCK_K": 16})
    qr, inv_r, amax_r = R.cast_rowwise(x, margin, pow2, dtype)
    assert inv.shape == (shape[0], 1)
    _close_scale(inv, inv_r)
    assert amax.item() == amax_r.item()
    fmax = 448.0 if dtype == torch.float8_e4m3fn else 57344.0
    assert (q.float().abs().amax(1) <= fmax).all()
    _check_dequantized(x, q, inv, qr, inv_r, dtype)


def test_rowwise_zero_row_keeps_scale_one():
    x = torch.zeros(3, 5)
    x[1] = 2.0
    q, inv, _ = K.cast_rowwise_launch(x, 0, False, torch.float8_e4m3fn)
    assert inv[0].item() == 1.0 and inv[2].item() == 1.0
    _close_scale(inv[1], torch.tensor([2.0 / 448.0]))


def test_launchers_validate():
    x = torch.randn(4, 6)
    with pytest.raises(ValueError, match="contiguous"):
        K.cast_launch(x.t(), torch.tensor(1.0), None, 0, False, torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="out_dtype"):
        K.cast_launch(x, torch.tensor(1.0), None, 0, False, torch.bfloat16)
    with pytest.raises(ValueError, match="2-D"):
        K.cast_transpose_launch(x.reshape(2, 2, 6), torch.tensor(1.0), None, 0, False, torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="0-d float32"):
        K.cast_launch(x, torch.ones(1), None, 0, False, torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        K.amax_launch(x.double())
    with pytest.raises(ValueError, match="unknown launch config"):
        K.cast_launch(x, torch.tensor(1.0), None, 0, False, torch.float8_e4m3fn, config={"BLOK": 4})


@pytest.mark.parametrize("shape", [(1, 1), (3, 17), (130, 37), (64, 256)])
@pytest.mark.parametrize("dtype", [torch.uint8, *FP8])
def test_transpose_bytes_launcher(shape, dtype):
    """Every byte lands at its transposed place (tiles smaller than the tensor: edges masked)."""
    g = torch.Generator().manual_seed(shape[0] * 1000 + shape[1])
    x = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g).view(dtype)
    y = K.transpose_bytes_launch(x, config={"BLOCK_M": 32, "BLOCK_K": 16})
    assert y.dtype == dtype and y.shape == (shape[1], shape[0]) and y.is_contiguous()
    assert torch.equal(_u8(y), _u8(x).t())
    assert torch.equal(_u8(R.transpose_bytes(x)), _u8(y))


def test_transpose_bytes_rejects_wider_elements():
    with pytest.raises(ValueError, match="transpose_bytes: x must be a 2-D tensor of one-byte elements"):
        K.transpose_bytes_launch(torch.zeros(2, 3))
    with pytest.raises(ValueError, match="one-byte elements"):
        R.transpose_bytes(torch.zeros(2, 3, dtype=torch.uint8)[None])


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("dims", [(2, 2, 1, 5, 32), (3, 1, 1, 4, 64), (1, 4, 2, 7, 32)])
@pytest.mark.parametrize("layout", ["bhsd", "sbhd"])
def test_cast_transpose_heads_exact(dtype, dims, layout):
    # three (B, H, S, D) parts, contiguous or permuted views of (S, B, H, D) storage; delayed scale
    B, Hq, Hkv, S, D = dims
    scale = torch.tensor(0.5)

    def part(h, seed):
        x = (_grid((B, h, S, D), dtype, seed) / scale).to(torch.bfloat16)
        return x if layout == "bhsd" else x.permute(2, 0, 1, 3).contiguous().permute(1, 2, 0, 3)

    q, k, v = part(Hq, 3), part(Hkv, 4), part(Hkv, 5)
    got = K.cast_transpose_heads_launch(q, k, v, scale, None, 0, False, dtype, config={"BLOCK_M": 16})
    want = R.cast_transpose_heads(q, k, v, scale, None, 0, False, dtype)
    assert torch.equal(_u8(got[0]), _u8(want[0])) and torch.equal(_u8(got[1]), _u8(want[1]))
    assert got[2].item() == want[2].item() and got[3].item() == want[3].item() == 2.0
    torch.testing.assert_close(got[4], want[4], rtol=1e-6, atol=1e-5)


def test_cast_transpose_heads_current_scaling():
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(2, h, 3, 32, generator=g) for h in (2, 1, 1))
    amax_in = R.amax(R.heads_2d(q, k, v))
    got = K.cast_transpose_heads_launch(q, k, v, torch.tensor(1.0), amax_in, 0, False, torch.float8_e4m3fn)
    want = R.cast_transpose_heads(q, k, v, torch.tensor(1.0), amax_in, 0, False, torch.float8_e4m3fn)
    _close_scale(got[3], want[3])
    assert torch.equal(_u8(got[1]), _u8(got[0].t().contiguous()))
    _check_dequantized(R.heads_2d(q, k, v), got[0], got[3], want[0], want[3], torch.float8_e4m3fn)


def test_cast_transpose_heads_rejects_bad_parts():
    q = torch.zeros(2, 2, 3, 32)
    with pytest.raises(ValueError, match="cast_transpose_heads: k and v must be"):
        K.cast_transpose_heads_launch(q, torch.zeros(2, 1, 4, 32), torch.zeros(2, 1, 4, 32), torch.tensor(1.0),
                                      None, 0, False, torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="multiples of 32"):
        K.cast_transpose_heads_launch(torch.zeros(2, 1, 3, 8), torch.zeros(2, 1, 3, 8), torch.zeros(2, 1, 3, 8),
                                      torch.tensor(1.0), None, 0, False, torch.float8_e4m3fn)
