"""The FP8 GEMM kernel (kernels/gemm.py) on CUDA, against torch._scaled_mm and the FP32 reference.

The rule (DESIGN section 5): the kernel's error against the FP32 reference is at most k times the
error of ``torch._scaled_mm`` in the same accumulation mode, plus a small atol, and its SQNR is at
most a few dB below ``_scaled_mm``'s. Where ``_scaled_mm`` cannot run a combination natively (a
per-row scale with E5M2, a float32 output with a bias, ...), the peer is ``_scaled_mm`` with unit
scales and a float32 output, scaled afterwards in float32: the same cuBLAS accumulation.
"""

import pytest
import torch

from fp8ops.kernels import gemm as G
from fp8ops.reference import gemm as R
from fp8ops.testing import assert_close_rule, sqnr

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
BF16, F32 = torch.bfloat16, torch.float32
FMAX = {E4M3: 448.0, E5M2: 57344.0}
SHAPES = [(128, 256, 512), (1000, 1024, 2048), (4096, 4096, 4096)]
# (rowwise scales, dtype of a, out dtype, fast_accum, bias dtype); b is always E4M3 (the weight).
CASES = [
    (False, E4M3, BF16, False, None),
    (False, E4M3, BF16, True, BF16),
    (False, E5M2, BF16, False, BF16),
    (False, E4M3, F32, False, F32),
    (False, E5M2, F32, True, None),
    (True, E4M3, BF16, False, BF16),
    (True, E4M3, BF16, True, None),
    (True, E5M2, F32, True, F32),
]


def _case_id(c):
    rowwise, adt, out, fast, bias = c
    return (f"{'row' if rowwise else 'tensor'}-{'e5m2' if adt == E5M2 else 'e4m3'}xe4m3-"
            f"{'bf16' if out == BF16 else 'f32'}-{'fast' if fast else 'precise'}-{'bias' if bias else 'nobias'}")


@pytest.fixture(autouse=True)
def _ieee_fp32_matmul():
    """The FP32 reference must not run its matmul in TF32."""
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


@pytest.fixture(autouse=True, scope="module")
def _needs_fp8_gpu():
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 tensor cores need compute capability 8.9 or newer")


def _operands(M, N, K, a_dtype, rowwise, bias_dtype, seed=0):
    """Random FP8 operands that use the format's range (never zeros), and matching inverse scales."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    dev = "cuda"
    xa = torch.randn(M, K, device=dev, generator=g) * torch.logspace(-1, 1, M, device=dev)[:, None]
    xb = torch.randn(N, K, device=dev, generator=g) * torch.logspace(-1, 1, N, device=dev)[:, None]
    if rowwise:
        amax_a, amax_b = xa.abs().amax(1, keepdim=True), xb.abs().amax(1, keepdim=True)
    else:
        amax_a, amax_b = xa.abs().amax(), xb.abs().amax()
    qa = (xa * (FMAX[a_dtype] / amax_a)).clamp(-FMAX[a_dtype], FMAX[a_dtype]).to(a_dtype)
    qb = (xb * (FMAX[E4M3] / amax_b)).clamp(-FMAX[E4M3], FMAX[E4M3]).to(E4M3)
    sa = (amax_a / FMAX[a_dtype]).float()  # () or (M, 1)
    sb = (amax_b / FMAX[E4M3]).float()
    sb = sb.reshape(1, N) if rowwise else sb  # () or (1, N)
    bias = None if bias_dtype is None else torch.randn(N, device=dev, generator=g).to(bias_dtype)
    return qa, qb, sa, sb, bias


def _pad16(t, dim):
    """Zero-pad an FP8 tensor along ``dim`` to a multiple of 16 (torch._scaled_mm's requirement)."""
    extra = -t.shape[dim] % 16
    if not extra:
        return t
    shape = list(t.shape)
    shape[dim] = extra
    zeros = torch.zeros(shape, dtype=torch.uint8, device=t.device)
    return torch.cat([t.view(torch.uint8), zeros], dim=dim).view(t.dtype)


def _scaled_mm_peer(a, b, sa, sb, bias, out_dtype, fast):
    """torch._scaled_mm in the same accumulation mode: native where it can, else unit scales + FP32.

    The fallback pads the operands with zeros to multiples of 16 (zero products add nothing),
    multiplies with unit scales into float32, and applies the scales and the bias afterwards.
    """
    M, N = a.shape[0], b.shape[0]
    if M % 16 == 0 and N % 16 == 0 and a.shape[1] % 16 == 0:
        try:
            return torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, bias=bias, out_dtype=out_dtype,
                                    use_fast_accum=fast)
        except (RuntimeError, ValueError):
            pass
    ap, bp = _pad16(_pad16(a, 1), 0), _pad16(_pad16(b, 1), 0)
    one = torch.ones((), device=a.device)
    acc = torch._scaled_mm(ap, bp.t(), scale_a=one, scale_b=one, out_dtype=torch.float32, use_fast_accum=fast)
    out = acc[:M, :N] * sa * sb
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


def _check_rule(out, peer, expected, out_dtype, name):
    big = expected.abs().max().item()
    k = 2.0 if out_dtype == BF16 else 4.0
    errs = assert_close_rule(out, expected, peer, k=k, atol=2.0**-16 * big, name=name)
    # SQNR within 6 dB of torch._scaled_mm's, which is capped at 80 dB: beyond that both are float32
    # accumulation noise, whose size depends only on the summation order.
    s_out, s_peer = sqnr(out.float(), expected), sqnr(peer.float(), expected)
    assert s_out >= min(s_peer, 80.0) - 6.0, f"{name}: SQNR {s_out:.1f} dB vs torch._scaled_mm {s_peer:.1f} dB"
    return errs


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_matches_scaled_mm_and_reference(shape, case):
    rowwise, a_dtype, out_dtype, fast, bias_dtype = case
    M, N, K = shape
    a, b, sa, sb, bias = _operands(M, N, K, a_dtype, rowwise, bias_dtype)
    out = G.scaled_mm_launch(a, b, sa, sb, bias, out_dtype, fast)
    assert out.shape == (M, N) and out.dtype == out_dtype
    if torch.cuda.get_device_capability() >= (9, 0):
        assert G.uses_tma(a, b, out_dtype, fast)  # every shape here is TMA-aligned
    expected = R.scaled_mm(a, b, sa, sb, bias, torch.float32, fast)
    peer = _scaled_mm_peer(a, b, sa, sb, bias, out_dtype, fast)
    _check_rule(out, peer, expected, out_dtype, f"scaled_mm {shape} {_case_id(case)}")


@pytest.mark.parametrize("shape", [(1000, 1024, 2048), (4096, 4096, 4096)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("fast", [False, True], ids=["precise", "fast"])
@pytest.mark.parametrize("out_dtype", [BF16, F32], ids=["bf16", "f32"])
def test_tma_and_pointer_kernels_agree(shape, fast, out_dtype):
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("TMA needs compute capability 9.0")
    M, N, K = shape
    a, b, sa, sb, bias = _operands(M, N, K, E5M2, True, BF16, seed=1)
    cfg = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128, "num_stages": 3, "EPILOGUE_SUBTILE": False}
    assert G.uses_tma(a, b, out_dtype, fast, config={**cfg, "TMA": True})
    tma = G.scaled_mm_launch(a, b, sa, sb, bias, out_dtype, fast, config={**cfg, "TMA": True})
    ptr = G.scaled_mm_launch(a, b, sa, sb, bias, out_dtype, fast, config={**cfg, "TMA": False})
    expected = R.scaled_mm(a, b, sa, sb, bias, torch.float32, fast)
    peer = _scaled_mm_peer(a, b, sa, sb, bias, out_dtype, fast)
    _check_rule(tma, peer, expected, out_dtype, "TMA kernel")
    _check_rule(ptr, peer, expected, out_dtype, "pointer kernel")
    # Within rounding of each other: one unit in the last place of the output, plus accumulator noise.
    ulp = 2.0**-7 if out_dtype == BF16 else 2.0**-20
    big = expected.abs().max().item()
    diff = (tma.float() - ptr.float()).abs()
    bound = ulp * torch.maximum(tma.float().abs(), ptr.float().abs()) + 2.0**-16 * big
    assert (diff <= bound).all(), (
        f"TMA and pointer kernels differ by up to {diff.max().item():.4g} "
        f"({int((diff > bound).sum())} elements over the bound); bit-equal fraction "
        f"{(tma == ptr).float().mean().item():.4f}"
    )


@pytest.mark.parametrize("shape", [(333, 1000, 1000), (7, 24, 40), (1, 4096, 4096)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("fast", [False, True], ids=["precise", "fast"])
def test_fallback_shapes(shape, fast):
    """Shapes TMA cannot take (K % 16 != 0, or smaller than a block) run the pointer kernel."""
    M, N, K = shape
    a, b, sa, sb, bias = _operands(M, N, K, E4M3, False, BF16, seed=2)
    assert not G.uses_tma(a, b, BF16, fast)
    out = G.scaled_mm_launch(a, b, sa, sb, bias, BF16, fast)
    expected = R.scaled_mm(a, b, sa, sb, bias, torch.float32, fast)
    _check_rule(out, _scaled_mm_peer(a, b, sa, sb, bias, BF16, fast), expected, BF16, f"fallback {shape}")


def test_strided_operand_views():
    """Operands that are column slices of wider buffers (row stride > K), still TMA-aligned."""
    M, N, K = 512, 384, 256
    a, b, sa, sb, bias = _operands(M, N, K + 64, E4M3, True, None, seed=3)
    a, b = a[:, 32 : 32 + K], b[:, 64 : 64 + K]
    assert G.uses_tma(a, b, BF16, False) == (torch.cuda.get_device_capability() >= (9, 0))
    out = G.scaled_mm_launch(a, b, sa, sb, None, BF16, False)
    expected = R.scaled_mm(a, b, sa, sb, None, torch.float32, False)
    peer = _scaled_mm_peer(a.contiguous(), b.contiguous(), sa, sb, None, BF16, False)
    _check_rule(out, peer, expected, BF16, "strided views")


# opcheck's test_schema compares the inputs before and after the call with torch.allclose, which
# has no FP8 kernel; the other checks (fake kernel, AOT dispatch with dynamic shapes, autograd
# registration) apply.
_OPCHECK_UTILS = ("test_faketensor", "test_aot_dispatch_dynamic", "test_autograd_registration")


@pytest.mark.parametrize("rowwise", [False, True], ids=["tensor", "row"])
def test_opcheck(rowwise):
    a, b, sa, sb, bias = _operands(256, 384, 512, E4M3, rowwise, BF16, seed=4)
    op = torch.ops.fp8ops.scaled_mm.default
    torch.library.opcheck(op, (a, b, sa, sb, bias, BF16, False), test_utils=_OPCHECK_UTILS)
    torch.library.opcheck(op, (a, b, sa, sb, None, F32, True), test_utils=_OPCHECK_UTILS)


def test_compiled_call_matches_eager():
    """Under torch.compile(fullgraph=True) the op is one opaque node: same result, no graph break."""
    a, b, sa, sb, bias = _operands(512, 256, 384, E5M2, True, BF16, seed=5)

    def f(a, b, sa, sb, bias):
        return torch.ops.fp8ops.scaled_mm(a, b, sa, sb, bias, BF16, False).float() * 2.0

    torch.testing.assert_close(torch.compile(f, fullgraph=True)(a, b, sa, sb, bias), f(a, b, sa, sb, bias),
                               rtol=0, atol=0)
