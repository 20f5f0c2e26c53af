"""The Triton launcher of kernels/gemm.py under TRITON_INTERPRET=1, at small sizes, on CPU.

The interpreter upcasts FP8 dot operands to float16 (exact) and multiplies in float32 (IEEE), so
float32 outputs are compared with the FP32 reference to float32 rounding. Its fp32 -> bfloat16
cast truncates instead of rounding to nearest even, so 16-bit outputs are allowed one unit in the
last place. Small block sizes (16 x 16 x 32) and the interpreter's 4 "SMs" make the persistent loop
run several tiles per program, with partial tiles along M, N and K. The accumulation modes are
identical here (the interpreter has no reduced-precision accumulator); they, bit-exact rounding
and speed are checked on the GPU (test_gemm_gpu).
"""

import os

import pytest
import torch

from fp8ops.kernels import gemm as G
from fp8ops.reference import gemm as R
from fp8ops.testing import assert_close_rule

pytestmark = [
    pytest.mark.interpret,
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs only under TRITON_INTERPRET=1"),
]

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
SMALL = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 32}
# Relative size of one unit in the last place (the interpreter truncates 16-bit casts).
ULP = {torch.float32: 2.0**-22, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}


def _fp8(shape, dtype, seed):
    """Random FP8 values spread over a few binades, zeros included (as a real operand has)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 4.0).to(dtype)


def _randn(shape, seed, dtype=torch.float32):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _scales(M, N, rowwise, seed):
    g = torch.Generator().manual_seed(seed)
    if rowwise:
        return torch.rand(M, 1, generator=g) + 0.25, torch.rand(1, N, generator=g) * 0.01 + 0.001
    return torch.tensor(0.75), torch.tensor(0.0123)


def _check(out, a, b, sa, sb, bias, out_dtype):
    """``out`` vs the FP32 reference, by the project's rule and element by element."""
    expected = R.scaled_mm(a, b, sa, sb, bias, torch.float32, False)
    # Plain PyTorch at the same precision: float32 matmul, scales after it, one cast.
    peer = (a.float() @ b.float().t()) * sa * sb  # sb: () or (1, N)
    if bias is not None:
        peer = peer + bias.float()
    peer = peer.to(out_dtype)
    assert out.dtype == out_dtype and out.shape == expected.shape
    big = expected.abs().max().item() if expected.numel() else 0.0
    # Float32 sums in another order, plus the truncating 16-bit cast of the interpreter.
    slack = 2.0**-18 * big
    assert_close_rule(out, expected, peer, k=2.0, atol=ULP[out_dtype] * big + slack, name=f"scaled_mm {out_dtype}")
    err = (out.float() - expected).abs()
    bound = ULP[out_dtype] * expected.abs() + slack
    assert (err <= bound).all(), f"{int((err > bound).sum())} elements off; worst {err.max().item()}"


SHAPES = [(1, 16, 32), (17, 48, 64), (64, 32, 96), (33, 80, 160), (3, 5, 7), (13, 29, 50)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("rowwise", [False, True])
@pytest.mark.parametrize("dtypes", [(E4M3, E4M3), (E5M2, E4M3)], ids=["e4m3xe4m3", "e5m2xe4m3"])
def test_matches_reference(shape, rowwise, dtypes):
    M, N, K = shape
    a, b = _fp8((M, K), dtypes[0], 1), _fp8((N, K), dtypes[1], 2)
    sa, sb = _scales(M, N, rowwise, 3)
    out = G.scaled_mm_launch(a, b, sa, sb, None, torch.float32, False, config=SMALL)
    _check(out, a, b, sa, sb, None, torch.float32)
    assert not G.uses_tma(a, b, torch.float32, config=SMALL)  # CPU tensors: pointer kernel


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias_dtype", [None, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fast_accum", [False, True])
def test_epilogue_bias_and_out_dtype(out_dtype, bias_dtype, fast_accum):
    M, N, K = 33, 80, 160
    a, b = _fp8((M, K), E5M2, 4), _fp8((N, K), E4M3, 5)
    sa, sb = _scales(M, N, True, 6)
    bias = None if bias_dtype is None else (_randn(N, 30) * 3).to(bias_dtype)
    out = G.scaled_mm_launch(a, b, sa, sb, bias, out_dtype, fast_accum, config=SMALL)
    _check(out, a, b, sa, sb, bias, out_dtype)


@pytest.mark.parametrize("rowwise_a,rowwise_b", [(True, False), (False, True)])
def test_mixed_scale_granularity(rowwise_a, rowwise_b):
    M, N, K = 17, 48, 64
    a, b = _fp8((M, K), E4M3, 7), _fp8((N, K), E5M2, 8)
    ra, rb = _scales(M, N, True, 9)
    ta, tb = _scales(M, N, False, 9)
    sa, sb = (ra if rowwise_a else ta), (rb if rowwise_b else tb)
    bias = _randn(N, 31)
    out = G.scaled_mm_launch(a, b, sa, sb, bias, torch.float32, True, config=SMALL)
    _check(out, a, b, sa, sb, bias, torch.float32)


@pytest.mark.parametrize(
    "cfg",
    [
        {"GROUP_M": 1},
        {"GROUP_M": 2, "PROGRAMS_PER_SM": 2},
        {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 64, "FLATTEN": False},
        {"BLOCK_K": 128, "PROMOTE_K": 64},
    ],
)
def test_configs(cfg):
    M, N, K = 45, 70, 130
    a, b = _fp8((M, K), E4M3, 10), _fp8((N, K), E4M3, 11)
    sa, sb = _scales(M, N, True, 12)
    bias = _randn(N, 32, torch.bfloat16)
    out = G.scaled_mm_launch(a, b, sa, sb, bias, torch.float32, False, config={**SMALL, **cfg})
    _check(out, a, b, sa, sb, bias, torch.float32)


def test_strided_operands_and_scales():
    """Row strides larger than K (slices of a wider buffer) and expanded (stride-0) row scales."""
    M, N, K = 19, 33, 64
    wide_a, wide_b = _fp8((M, K + 32), E4M3, 13), _fp8((N, K + 16), E4M3, 14)
    a, b = wide_a[:, 8 : 8 + K], wide_b[:, :K]
    sa = torch.tensor([[0.5]]).expand(M, 1)
    sb = _randn((2, N), 33).abs()[:1]
    out = G.scaled_mm_launch(a, b, sa, sb, None, torch.float32, False, config=SMALL)
    _check(out, a, b, sa, sb, None, torch.float32)


@pytest.mark.parametrize("subtile", [False, True])
@pytest.mark.parametrize("rowwise", [False, True])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_tma_kernel_matches_pointer_kernel(subtile, rowwise, out_dtype):
    """The TMA kernel (forced onto CPU tensors) computes exactly what the pointer kernel does."""
    M, N, K = 48, 96, 160  # partial tiles along M and K with 32 x 64 x 64 blocks
    a, b = _fp8((M, K), E5M2, 15), _fp8((N, K), E4M3, 16)
    sa, sb = _scales(M, N, rowwise, 17)
    bias = _randn(N, 34)
    cfg = {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 64, "EPILOGUE_SUBTILE": subtile}
    assert G.uses_tma(a, b, out_dtype, config={**cfg, "TMA": True})
    tma = G.scaled_mm_launch(a, b, sa, sb, bias, out_dtype, True, config={**cfg, "TMA": True})
    ptr = G.scaled_mm_launch(a, b, sa, sb, bias, out_dtype, True, config={**cfg, "TMA": False})
    _check(tma, a, b, sa, sb, bias, out_dtype)
    assert torch.equal(tma, ptr)


def test_empty_dimensions():
    a, b = _fp8((0, 32), E4M3, 18), _fp8((16, 32), E4M3, 19)
    assert G.scaled_mm_launch(a, b, torch.tensor(1.0), torch.tensor(1.0), None, torch.bfloat16, True).shape == (0, 16)
    a, b = _fp8((4, 32), E4M3, 18), _fp8((0, 32), E4M3, 19)
    assert G.scaled_mm_launch(a, b, torch.tensor(1.0), torch.tensor(1.0), None, torch.float32, True).shape == (4, 0)
    # K == 0: the empty sum is 0, so the result is the bias.
    a, b = _fp8((3, 0), E4M3, 18), _fp8((5, 0), E4M3, 19)
    bias = torch.arange(5, dtype=torch.float32)
    out = G.scaled_mm_launch(a, b, torch.tensor(2.0), torch.tensor(3.0), bias, torch.bfloat16, False)
    assert out.dtype == torch.bfloat16 and torch.equal(out.float(), bias.expand(3, 5))
    out = G.scaled_mm_launch(a, b, torch.tensor(2.0), torch.tensor(3.0), None, torch.float32, False)
    assert torch.equal(out, torch.zeros(3, 5))
    assert torch.equal(R.scaled_mm(a, b, torch.tensor(2.0), torch.tensor(3.0), None, torch.float32, False), out)


def test_fake_kernel_gives_shape_and_dtype():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        a = torch.empty(7, 64, dtype=E4M3)
        b = torch.empty(24, 64, dtype=E5M2)
        out = torch.ops.fp8ops.scaled_mm(a, b, torch.empty(7, 1), torch.empty(1, 24), None, torch.bfloat16, True)
        assert out.shape == (7, 24) and out.dtype == torch.bfloat16
        with pytest.raises(ValueError, match="share K"):
            torch.ops.fp8ops.scaled_mm(a, b[:, :32], torch.empty(()), torch.empty(()), None, torch.float32, True)


def test_reference_matches_dequantized_matmul():
    a, b = _fp8((5, 32), E4M3, 20), _fp8((6, 32), E5M2, 21)
    sa, sb = _scales(5, 6, True, 22)
    a64, b64 = a.double() * sa.double(), b.double() * sb.double().t()
    want = a64 @ b64.t()
    got = R.scaled_mm(a, b, sa, sb, None, torch.float32, True)
    # Float32 rounding of the dequantized operands and of the sums, relative to sum |a_k b_k|.
    assert ((got.double() - want).abs() <= 2.0**-20 * (a64.abs() @ b64.abs().t())).all()
    with pytest.raises(ValueError, match="scale_b"):
        R.scaled_mm(a, b, sa, sb.t(), None, torch.float32, True)


def test_launcher_validates():
    a, b = _fp8((8, 32), E4M3, 22), _fp8((16, 32), E4M3, 23)
    one = torch.tensor(1.0)

    def call(a=a, b=b, sa=one, sb=one, bias=None, out_dtype=torch.bfloat16, config=None):
        return G.scaled_mm_launch(a, b, sa, sb, bias, out_dtype, True, config=config)

    with pytest.raises(ValueError, match=r"a must be torch.float8_e4m3fn or torch.float8_e5m2.*quantize"):
        call(a=a.float())
    with pytest.raises(ValueError, match="2-D"):
        call(b=b.reshape(2, 8, 32))
    with pytest.raises(ValueError, match="share K.*pass w, not w.t"):
        call(b=b.t().contiguous())
    with pytest.raises(ValueError, match=r"b must be row-major.*contiguous"):
        call(b=_fp8((32, 16), E4M3, 24).t())
    with pytest.raises(ValueError, match=r"a must be row-major.*a.contiguous"):
        call(a=_fp8((32, 8), E4M3, 25).t())
    with pytest.raises(ValueError, match="scale_a must be a float32 tensor"):
        call(sa=torch.tensor(1.0, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"scale_a must be \(\).*\(8, 1\)"):
        call(sa=torch.ones(8))
    with pytest.raises(ValueError, match=r"scale_b must be \(\).*\(1, 16\)"):
        call(sb=torch.ones(16, 1))
    with pytest.raises(ValueError, match=r"bias must have shape \(N,\) = \(16,\)"):
        call(bias=torch.ones(8))
    with pytest.raises(ValueError, match="bias must be a bfloat16, float16 or float32"):
        call(bias=torch.ones(16, dtype=torch.float64))
    with pytest.raises(ValueError, match="out_dtype"):
        call(out_dtype=E4M3)
    with pytest.raises(ValueError, match="unknown launch config"):
        call(config={"BLOCK": 64})
    with pytest.raises(ValueError, match="BLOCK_K must be a power of two >= 32"):
        call(config={"BLOCK_K": 16})
    with pytest.raises(ValueError, match="PROMOTE_K"):
        call(config={"PROMOTE_K": 16})
    # TMA required but impossible: K = 40 is not a multiple of 16 bytes.
    a40, b40 = _fp8((64, 40), E4M3, 26), _fp8((64, 40), E4M3, 27)
    with pytest.raises(ValueError, match="TMA=True.*multiples of 16 bytes.*TMA=None"):
        call(a=a40, b=b40, config={**SMALL, "TMA": True})
    # ... while the automatic choice falls back to the pointer kernel and works.
    assert not G.uses_tma(a40, b40, torch.bfloat16, config=SMALL)
    assert call(a=a40, b=b40, config=SMALL).shape == (64, 64)
