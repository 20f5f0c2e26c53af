"""GPU tests of the quantize ops: bit-exact agreement with torch's own saturating FP8 cast on CUDA.

On CUDA, for E4M3 and E5M2 outputs and float32 / bfloat16 / float16 inputs, every quantize path
(delayed scaling with a calibrated state, delayed with an uncalibrated state, current scaling per
tensor, row-wise, with and without the transposed copy) must produce exactly the bytes of::

    (x.float() * scale).clamp(-fmax, fmax).to(fp8_dtype)

computed by torch on the same device with the same scale (NaN bytes compare equal to any NaN
byte). The scale the kernels compute just in time must be the correctly rounded
``fmax / amax / 2**margin`` that :func:`fp8ops.compute_scale` specifies; ``inv_scale`` must be the
correctly rounded ``1 / scale``; the amax must be ``x.abs().amax()`` (NaN when a NaN is present).
Inputs include the edge values of each format: ties between FP8 neighbours (round to nearest
even), values just above the largest finite value (saturate), FP8 subnormals, float subnormals,
zeros of both signs, +-inf and NaN.

The CPU interpreter runs compare with tolerances (it does not round like the GPU); bit-exactness
is checked here.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor
from torch.utils import _pytree as pytree

import fp8ops
from fp8ops import CurrentScaling, DelayedScaling, FakeQuantState, Format
from fp8ops.reference import fake_quantize as ref_fq
from fp8ops.reference import quantize as ref_q

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8_DTYPES = [E4M3, E5M2]
IN_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
FMAX = {E4M3: 448.0, E5M2: 57344.0}
FORMAT = {E4M3: Format.E4M3, E5M2: Format.E5M2}
FLT_MAX = torch.finfo(torch.float32).max
SHAPES = [(1, 1), (17, 33), (128, 4096), (1000, 1000), (3, 5, 67)]
MODES = ["delayed", "delayed_t", "delayed_uncal", "current", "current_t", "rowwise"]
DATA = ["normal", "edges", "edges_finite"]
EDGE_SCALE = 2.0  # power of two: x = target / 2 is exact and x * 2 lands on the target


def _id(v: Any) -> str:
    names = {E4M3: "e4m3", E5M2: "e5m2", torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
    if isinstance(v, torch.dtype):
        return names[v]
    if isinstance(v, tuple):
        return "x".join(map(str, v))
    return str(v)


# ------------------------------------------------------------------------------------------------
# Expected values, computed independently of fp8ops


def torch_cast(x: Tensor, scale: Tensor, fp8: torch.dtype) -> Tensor:
    """torch's saturating cast: ``(x.float() * scale).clamp(-fmax, fmax).to(fp8)``."""
    fmax = FMAX[fp8]
    return (x.float() * scale).clamp(-fmax, fmax).to(fp8)


def exact_scale(amax: Tensor, fallback: Tensor, fmax: float, margin: int = 0, power_2: bool = False) -> Tensor:
    """The correctly rounded ``fmax / amax / 2**margin`` (largest float32 on overflow, power-of-two
    floor if asked), ``fallback`` where amax is 0 or not finite.

    The quotient is taken in float64 and rounded once more to float32: for a quotient, that double
    rounding gives the correctly rounded float32 result (53 >= 2 * 24 + 2).
    """
    a = amax.double()
    q = (torch.full_like(a, fmax) / a).float()
    sf = torch.clamp(q * 2.0 ** -margin, max=FLT_MAX)
    if power_2:
        sf = (sf.contiguous().view(torch.int32) & 0x7F800000).view(torch.float32)
    valid = torch.isfinite(amax) & (amax > 0)
    return torch.where(valid, sf, fallback.float().expand_as(sf))


def exact_reciprocal(s: Tensor) -> Tensor:
    """The correctly rounded float32 ``1 / s`` (through float64; exact for the same reason)."""
    return (1.0 / s.double()).float()


def fp8_finite_values(fp8: torch.dtype) -> Tensor:
    """Every finite value of the format, ascending, float32 (one zero)."""
    v = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fp8).float()
    return torch.unique(v[torch.isfinite(v)])


def edge_targets(fp8: torch.dtype, *, nonfinite: bool) -> Tensor:
    """float32 values meant to be hit after scaling: the edge cases of the format, both signs."""
    v = fp8_finite_values(fp8)
    pos = v[v > 0]
    fmax = FMAX[fp8]
    top_step = float(pos[-1] - pos[-2])
    min_sub = float(pos[0])
    ties = (pos[:-1] + pos[1:]) / 2  # halfway between neighbours, subnormal range included
    above = fmax + top_step * torch.tensor([1 / 32, 1 / 16, 1 / 8, 1 / 4, 3 / 8, 1 / 2, 3 / 4, 1.0, 2.0])
    tiny = min_sub * torch.tensor([0.25, 0.5, 0.75, 1.5, 2.5, 3.5])  # around the smallest subnormal
    parts = [ties, above, tiny, pos]
    if nonfinite:
        parts.append(torch.tensor([1e30, FLT_MAX]))
    vals = torch.cat(parts)
    vals = torch.cat([vals, -vals, torch.tensor([0.0, -0.0])])
    g = torch.Generator().manual_seed(5)
    vals = vals[torch.randperm(vals.numel(), generator=g)]
    if nonfinite:
        vals = torch.cat([torch.tensor([float("nan"), float("inf"), float("-inf")]), vals])
    return vals


def make_input(shape: tuple[int, ...], dtype: torch.dtype, fp8: torch.dtype, data: str, seed: int = 0) -> Tensor:
    """Random normal data on CUDA; with ``data != "normal"``, edge values (``target / EDGE_SCALE``)
    written at random positions."""
    g = torch.Generator().manual_seed(1000 + seed)
    x = torch.randn(shape, generator=g) * 2.0
    if data != "normal":
        edges = edge_targets(fp8, nonfinite=data == "edges") / EDGE_SCALE
        n = min(x.numel(), edges.numel())
        pos = torch.randperm(x.numel(), generator=g)[:n]
        flat = x.reshape(-1)
        flat[pos] = edges[:n]
    return x.to(dtype).cuda()


# ------------------------------------------------------------------------------------------------
# Comparisons


def poison(*nbytes: int) -> None:
    """Fill freed allocator blocks of these sizes with 0x5A, so an output element the kernel fails to
    write is likely to hold a wrong byte rather than a stale right one."""
    blocks = [torch.full((max(1, n),), 0x5A, dtype=torch.uint8, device="cuda") for n in nbytes]
    del blocks


def assert_fp8_equal(actual: Tensor, expected: Tensor, x: Tensor, what: str) -> None:
    """Same bytes, where a NaN byte equals any NaN byte; the message shows the first differences."""
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    a8 = actual.reshape(-1).view(torch.uint8)
    e8 = expected.reshape(-1).view(torch.uint8)
    both_nan = actual.reshape(-1).float().isnan() & expected.reshape(-1).float().isnan()
    bad = (a8 != e8) & ~both_nan
    if bool(bad.any()):
        idx = bad.nonzero().reshape(-1)[:8].tolist()
        xf = x.reshape(-1).float().cpu()
        af, ef = actual.reshape(-1).float(), expected.reshape(-1).float()
        lines = [
            f"  [{i}] x={float(xf[i]).hex()} ({float(xf[i])!r}): got 0x{int(a8[i]):02x} ({float(af[i])}), "
            f"want 0x{int(e8[i]):02x} ({float(ef[i])})"
            for i in idx
        ]
        pytest.fail(
            f"{what}: {int(bad.sum())} of {a8.numel()} FP8 bytes differ from torch's cast:\n" + "\n".join(lines)
        )


def assert_f32_bits_equal(actual: Tensor, expected: Tensor, what: str, *, context: Tensor | None = None) -> None:
    """Same float32 bit patterns (NaN equals NaN)."""
    assert actual.dtype == torch.float32, f"{what}: dtype {actual.dtype}"
    a = actual.reshape(-1).contiguous()
    e = expected.reshape(-1).to(a.device, torch.float32).contiguous()
    assert a.shape == e.shape, f"{what}: {a.numel()} values, expected {e.numel()}"
    bad = (a.view(torch.int32) != e.view(torch.int32)) & ~(a.isnan() & e.isnan())
    if bool(bad.any()):
        idx = bad.nonzero().reshape(-1)[:8].tolist()
        lines = []
        for i in idx:
            extra = f" for {float(context.reshape(-1)[i]).hex()}" if context is not None else ""
            lines.append(f"  [{i}]{extra}: got {float(a[i]).hex()}, want {float(e[i]).hex()}")
        pytest.fail(f"{what}: {int(bad.sum())} of {a.numel()} values differ:\n" + "\n".join(lines))


# ------------------------------------------------------------------------------------------------
# quantize vs torch's cast


def quantize_and_check(
    x: Tensor, fp8: torch.dtype, mode: str, *, data: str, margin: int = 0, power_2: bool = False
) -> None:
    """Run fp8ops.quantize in ``mode`` and check data, inverse scale, transposed copy and amax."""
    dev = x.device
    fmt, fmax = FORMAT[fp8], FMAX[fp8]
    K = x.shape[-1]
    x2 = x.reshape(-1, K)
    amax = x.abs().amax().float()  # NaN if x holds a NaN
    fallback = torch.tensor(EDGE_SCALE, device=dev)
    if mode in ("delayed", "delayed_t"):
        recipe: fp8ops.Recipe = DelayedScaling(fp8_format=fmt, margin=margin, power_2_scale=power_2)
        if data == "normal":
            # A realistic delayed scale: from an amax 10% under this tensor's, so the top saturates.
            scale = exact_scale(0.9 * amax, torch.ones((), device=dev), fmax, margin, power_2)
        else:
            scale = torch.tensor(EDGE_SCALE, device=dev)
        state = recipe.init(role="forward", device=dev).replace(calibrated=True, scale=scale)
        want_scale = scale
    elif mode == "delayed_uncal":
        recipe = DelayedScaling(fp8_format=fmt, margin=margin, power_2_scale=power_2)
        state = recipe.init(role="forward", device=dev).replace(scale=fallback)
        assert not state.calibrated
        want_scale = exact_scale(amax, fallback, fmax, margin, power_2)
    elif mode in ("current", "current_t"):
        recipe = CurrentScaling(fp8_format=fmt, margin=margin, power_2_scale=power_2)
        state = recipe.init(role="forward", device=dev).replace(scale=fallback)
        want_scale = exact_scale(amax, fallback, fmax, margin, power_2)
    elif mode == "rowwise":
        recipe = CurrentScaling(fp8_format=fmt, margin=margin, power_2_scale=power_2, granularity="row")
        state = recipe.init(role="forward", device=dev)
        row_amax = x2.abs().amax(dim=1, keepdim=True).float()  # (M, 1)
        want_scale = exact_scale(row_amax, torch.ones_like(row_amax), fmax, margin, power_2)
    else:
        raise AssertionError(mode)
    transpose = mode.endswith("_t")
    pending_before = state.pending_amax.clone()
    scale_before = state.scale.clone()

    poison(x.numel(), x.numel(), 4 * x2.shape[0], 512, 512)
    q, new_state = fp8ops.quantize(x, state, recipe=recipe, transpose=transpose)
    torch.cuda.synchronize()
    tag = f"{mode} {x.dtype}->{fp8} {tuple(x.shape)} {data}"

    # Data: torch's saturating cast with the same scale.
    want = torch_cast(x2, want_scale, fp8).reshape(x.shape)
    assert_fp8_equal(q.data, want, x, f"{tag}: data")
    # Inverse scale: the correctly rounded 1 / scale (this also pins the scale the kernel used).
    if mode == "rowwise":
        assert q.inv_scale.shape == (*x.shape[:-1], 1)
    else:
        assert q.inv_scale.shape == ()
    assert_f32_bits_equal(q.inv_scale, exact_reciprocal(want_scale), f"{tag}: inv_scale")
    # Transposed copy: exactly data.t().
    if transpose:
        assert q.data_t is not None and q.data_t.shape == (K, x2.shape[0])
        assert torch.equal(q.data_t.view(torch.uint8), q.data.reshape(-1, K).t().contiguous().view(torch.uint8)), (
            f"{tag}: data_t != data.t()"
        )
    else:
        assert q.data_t is None
    # amax: recorded in the new state, NaN-propagating; the input state untouched.
    assert_f32_bits_equal(new_state.pending_amax, torch.maximum(pending_before, amax), f"{tag}: pending_amax")
    assert_f32_bits_equal(state.pending_amax, pending_before, f"{tag}: input state's pending_amax (must not change)")
    assert_f32_bits_equal(new_state.scale, scale_before, f"{tag}: scale (must not change in an op)")


@pytest.mark.parametrize("data", DATA)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", SHAPES, ids=_id)
@pytest.mark.parametrize("in_dtype", IN_DTYPES, ids=_id)
@pytest.mark.parametrize("fp8", FP8_DTYPES, ids=_id)
def test_quantize_bit_exact(
    fp8: torch.dtype, in_dtype: torch.dtype, shape: tuple[int, ...], mode: str, data: str
) -> None:
    x = make_input(shape, in_dtype, fp8, data, seed=10 * SHAPES.index(shape) + DATA.index(data))
    quantize_and_check(x, fp8, mode, data=data)


@pytest.mark.parametrize("margin,power_2", [(0, True), (2, False), (3, True)])
@pytest.mark.parametrize("mode", ["delayed_uncal", "current", "current_t", "rowwise"])
@pytest.mark.parametrize("in_dtype", IN_DTYPES, ids=_id)
@pytest.mark.parametrize("fp8", FP8_DTYPES, ids=_id)
def test_quantize_margin_power_2(
    fp8: torch.dtype, in_dtype: torch.dtype, mode: str, margin: int, power_2: bool
) -> None:
    for data in ("normal", "edges"):
        x = make_input((257, 96), in_dtype, fp8, data, seed=margin)
        quantize_and_check(x, fp8, mode, data=data, margin=margin, power_2=power_2)


@pytest.mark.parametrize("fp8", FP8_DTYPES, ids=_id)
def test_edge_values_all_present(fp8: torch.dtype) -> None:
    """The edge inputs hold what the tests claim: ties round to even, values above max saturate."""
    t = edge_targets(fp8, nonfinite=True).cuda()
    q = torch_cast(t, torch.ones((), device="cuda"), fp8)
    v = fp8_finite_values(fp8).cuda()
    ties = ((v[v > 0][:-1] + v[v > 0][1:]) / 2)
    assert torch.isin(ties, t).all()
    assert (q.float()[t > FMAX[fp8]] == FMAX[fp8]).all()
    assert t.isnan().any() and t.isinf().any() and (t == 0).any()


# ------------------------------------------------------------------------------------------------
# The just-in-time scale is compute_scale's


def _wide_amaxes(n: int, seed: int) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    mant = 1.0 + torch.rand(n, generator=g)
    expo = torch.randint(-30, 30, (n,), generator=g).float()
    return (mant * torch.exp2(expo)).float()


@pytest.mark.parametrize("margin,power_2", [(0, False), (1, False), (0, True), (3, True)])
@pytest.mark.parametrize("fp8", FP8_DTYPES, ids=_id)
def test_just_in_time_scale_equals_compute_scale(fp8: torch.dtype, margin: int, power_2: bool) -> None:
    """Row-wise (one scale per row, many amaxes in one launch) and per-tensor current scaling use
    exactly ``fp8ops.compute_scale(amax, fallback, fmax, margin=, power_2_scale=)``."""
    fmax = FMAX[fp8]
    fmt = FORMAT[fp8]
    n = 4096
    amaxes = _wide_amaxes(n, seed=3 + margin)
    g = torch.Generator().manual_seed(9)
    x = (torch.rand(n, 64, generator=g) * 2 - 1) * amaxes[:, None]
    x[:, 5] = amaxes * torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)  # the row amax, either sign
    x = x.cuda()
    row_amax = x.abs().amax(dim=1, keepdim=True)
    want = fp8ops.compute_scale(row_amax, torch.ones_like(row_amax), fmax, margin=margin, power_2_scale=power_2)
    exact = exact_scale(row_amax, torch.ones_like(row_amax), fmax, margin, power_2)
    # compute_scale itself must be the correctly rounded quotient the kernels compute.
    assert_f32_bits_equal(want, exact, "compute_scale vs the correctly rounded fmax / amax / 2**margin",
                          context=row_amax)
    rec = CurrentScaling(fp8_format=fmt, margin=margin, power_2_scale=power_2, granularity="row")
    q, _ = fp8ops.quantize(x, None, recipe=rec)
    assert_f32_bits_equal(q.inv_scale, exact_reciprocal(want), "row-wise inv_scale vs 1 / compute_scale",
                          context=row_amax)
    assert_fp8_equal(q.data, torch_cast(x, want, fp8), x, "row-wise data with compute_scale's scale")
    # Per tensor: a few of the same amaxes, one launch each.
    rec_t = CurrentScaling(fp8_format=fmt, margin=margin, power_2_scale=power_2)
    for i in range(0, n, n // 32):
        xi = x[i : i + 1]
        ai = xi.abs().amax()
        s = fp8ops.compute_scale(ai, torch.ones((), device="cuda"), fmax, margin=margin, power_2_scale=power_2)
        qi, _ = fp8ops.quantize(xi, None, recipe=rec_t)
        assert_f32_bits_equal(qi.inv_scale, exact_reciprocal(s), f"per-tensor inv_scale vs 1 / compute_scale (row {i})",
                              context=ai)
        assert_fp8_equal(qi.data, torch_cast(xi, s, fp8), xi, f"per-tensor data with compute_scale's scale (row {i})")


# ------------------------------------------------------------------------------------------------
# Float subnormal inputs (a flush-to-zero anywhere on the path shows here)


def _subnormal_input(dtype: torch.dtype) -> Tensor:
    # k * 2**-140, k in [16, 2**13): float32 (and bfloat16) subnormals; some negative, some zero.
    g = torch.Generator().manual_seed(17)
    k = torch.randint(16, 2**13, (64, 48), generator=g).double()
    sign = torch.where(torch.rand(64, 48, generator=g) < 0.5, -1.0, 1.0).double()
    x = (k * sign * 2.0**-140).float()
    x[0, :4] = 0.0
    return x.to(dtype).cuda()


@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16], ids=_id)
@pytest.mark.parametrize("fp8", FP8_DTYPES, ids=_id)
def test_subnormal_inputs_delayed(fp8: torch.dtype, in_dtype: torch.dtype) -> None:
    """A float subnormal times a large scale is an ordinary FP8 value, not zero."""
    x = _subnormal_input(in_dtype)
    assert (x.float().abs() < torch.finfo(torch.float32).tiny).all()
    recipe = DelayedScaling(fp8_format=FORMAT[fp8])
    scale = torch.tensor(2.0**127, device="cuda")
    state = recipe.init(role="forward", device="cuda").replace(calibrated=True, scale=scale)
    for transpose in (False, True):
        q, st = fp8ops.quantize(x, state, recipe=recipe, transpose=transpose)
        assert_fp8_equal(q.data, torch_cast(x, scale, fp8), x, f"subnormal inputs, transpose={transpose}")
        assert_f32_bits_equal(st.pending_amax, x.abs().amax().float(), "amax of subnormal inputs")


@pytest.mark.parametrize("mode", ["current", "rowwise"])
@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16], ids=_id)
@pytest.mark.parametrize("fp8", FP8_DTYPES, ids=_id)
def test_subnormal_inputs_current(fp8: torch.dtype, in_dtype: torch.dtype, mode: str) -> None:
    """A subnormal amax gives the largest float32 scale (fmax / amax overflows) and its correctly
    rounded (subnormal) reciprocal."""
    x = _subnormal_input(in_dtype)
    quantize_and_check(x, fp8, mode, data="subnormal")


# ------------------------------------------------------------------------------------------------
# Other entry points and layouts


@pytest.mark.parametrize("fp8", FP8_DTYPES, ids=_id)
def test_hybrid_backward_role_is_e5m2(fp8: torch.dtype) -> None:
    recipe = DelayedScaling()  # HYBRID
    role = "forward" if fp8 == E4M3 else "backward"
    x = make_input((33, 130), torch.bfloat16, fp8, "edges")
    scale = torch.tensor(0.5, device="cuda")
    state = recipe.init(role=role, device="cuda").replace(calibrated=True, scale=scale)
    q, _ = fp8ops.quantize(x, state, recipe=recipe, transpose=True)
    assert q.data.dtype == fp8
    assert_fp8_equal(q.data, torch_cast(x, scale, fp8), x, f"HYBRID role={role}")


@pytest.mark.parametrize("in_dtype", IN_DTYPES, ids=_id)
def test_current_without_state_uses_scale_1_fallback(in_dtype: torch.dtype) -> None:
    x = make_input((40, 24), in_dtype, E4M3, "edges")  # holds a NaN: the amax is not finite
    q, st = fp8ops.quantize(x, None, recipe=CurrentScaling(fp8_format=Format.E4M3))
    assert st is None
    one = torch.ones((), device="cuda")
    assert_fp8_equal(q.data, torch_cast(x, one, E4M3), x, "current scaling, no state, NaN present")
    assert_f32_bits_equal(q.inv_scale, one, "inv_scale of the fallback scale 1")


@pytest.mark.parametrize("mode", ["delayed", "delayed_t", "current", "rowwise"])
def test_non_contiguous_input(mode: str) -> None:
    base = make_input((96, 160), torch.bfloat16, E4M3, "normal")
    x = base.t()  # (160, 96), column-major
    assert not x.is_contiguous()
    if mode.startswith("delayed"):
        recipe: fp8ops.Recipe = DelayedScaling(fp8_format=Format.E4M3)
        state = recipe.init(role="forward", device="cuda").replace(
            calibrated=True, scale=torch.tensor(37.25, device="cuda"))
    else:
        recipe = CurrentScaling(fp8_format=Format.E4M3, granularity="row" if mode == "rowwise" else "tensor")
        state = None
    t = mode == "delayed_t"
    q1, _ = fp8ops.quantize(x, state, recipe=recipe, transpose=t)
    q2, _ = fp8ops.quantize(x.contiguous(), state, recipe=recipe, transpose=t)
    assert torch.equal(q1.data.view(torch.uint8), q2.data.view(torch.uint8))
    assert torch.equal(q1.inv_scale, q2.inv_scale)
    if t:
        assert torch.equal(q1.data_t.view(torch.uint8), q2.data_t.view(torch.uint8))


@pytest.mark.parametrize("shape", [(0, 16), (0, 1)], ids=_id)
@pytest.mark.parametrize("mode", ["delayed", "delayed_t", "current", "rowwise"])
def test_empty_input_matches_cpu(shape: tuple[int, int], mode: str) -> None:
    """Empty tensors: no crash, the CPU path's shapes and values (amax 0, fallback scale)."""
    if mode.startswith("delayed"):
        recipe: fp8ops.Recipe = DelayedScaling()
        make_state = lambda d: recipe.init(role="forward", device=d).replace(  # noqa: E731
            calibrated=True, scale=torch.tensor(3.0, device=d))
    else:
        recipe = CurrentScaling(granularity="row" if mode == "rowwise" else "tensor")
        make_state = lambda d: recipe.init(role="forward", device=d)  # noqa: E731
    t = mode == "delayed_t"
    x = torch.empty(shape, dtype=torch.bfloat16)
    qc, sc = fp8ops.quantize(x, make_state("cpu"), recipe=recipe, transpose=t)
    qg, sg = fp8ops.quantize(x.cuda(), make_state("cuda"), recipe=recipe, transpose=t)
    assert qg.data.shape == qc.data.shape and qg.data.dtype == qc.data.dtype
    assert qg.inv_scale.shape == qc.inv_scale.shape
    assert torch.equal(qg.inv_scale.cpu(), qc.inv_scale)
    assert torch.equal(sg.pending_amax.cpu(), sc.pending_amax)
    if t:
        assert qg.data_t.shape == qc.data_t.shape


@pytest.mark.parametrize("in_dtype", IN_DTYPES, ids=_id)
@pytest.mark.parametrize("shape", SHAPES, ids=_id)
def test_amax_op(shape: tuple[int, ...], in_dtype: torch.dtype) -> None:
    for data in DATA:
        x = make_input(shape, in_dtype, E4M3, data, seed=7)
        got = torch.ops.fp8ops.amax(x)
        assert_f32_bits_equal(got, x.abs().amax().float(), f"amax {data}")
    assert float(torch.ops.fp8ops.amax(torch.empty(0, 8, device="cuda"))) == 0.0


# ------------------------------------------------------------------------------------------------
# fake_quantize: CUDA forward and backward against the reference run on CUDA tensors


def _fq_setup(kind: str) -> tuple[fp8ops.Recipe, FakeQuantState]:
    dev = "cuda"
    if kind in ("delayed", "delayed_pow2"):
        recipe: fp8ops.Recipe = DelayedScaling()
        st = FakeQuantState.init(recipe, device=dev)
        s_in, s_grad = (448.0 / 5.3, 57344.0 / 0.031) if kind == "delayed" else (2.0**6, 2.0**20)
        return recipe, st.replace(
            input=st.input.replace(calibrated=True, scale=torch.tensor(s_in, device=dev)),
            grad_output=st.grad_output.replace(calibrated=True, scale=torch.tensor(s_grad, device=dev)),
        )
    if kind == "uncalibrated_pow2":
        recipe = DelayedScaling(power_2_scale=True)
        return recipe, FakeQuantState.init(recipe, device=dev)
    if kind == "current_pow2":
        recipe = CurrentScaling(power_2_scale=True)
        return recipe, FakeQuantState.init(recipe, device=dev)
    raise AssertionError(kind)


def _fq_run(x: Tensor, dy: Tensor, st: FakeQuantState, recipe: fp8ops.Recipe, with_probe: bool) -> dict[str, Any]:
    xl = x.detach().clone().requires_grad_(True)
    probe = torch.zeros((), device=x.device, requires_grad=True) if with_probe else None
    y, ns = fp8ops.fake_quantize(xl, st, recipe=recipe, grad_probe=probe)
    y.backward(dy)
    return {"y": y.detach(), "dx": xl.grad, "probe": None if probe is None else probe.grad, "state": ns}


def _assert_same(a: Tensor, b: Tensor, what: str) -> None:
    a, b = a.detach(), b.detach().to(a.device)
    assert a.dtype == b.dtype and a.shape == b.shape, f"{what}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
    if a.dtype == torch.float32:
        assert_f32_bits_equal(a, b, what)
    else:
        ok = torch.equal(a, b) or bool(((a == b) | (a.isnan() & b.isnan())).all())
        if not ok:
            d = (a.float() - b.float()).abs()
            pytest.fail(f"{what}: {int((a != b).sum())} of {a.numel()} values differ, max |diff| {float(d.max())}")


@pytest.mark.parametrize("with_probe", [True, False])
@pytest.mark.parametrize("kind", ["delayed", "delayed_pow2", "uncalibrated_pow2", "current_pow2"])
@pytest.mark.parametrize("shape", [(257, 96), (5, 7, 33)], ids=_id)
@pytest.mark.parametrize("in_dtype", IN_DTYPES, ids=_id)
def test_fake_quantize_cuda_matches_reference(in_dtype: torch.dtype, shape: tuple[int, ...], kind: str,
                                              with_probe: bool) -> None:
    """Forward, input gradient, probe gradient and new state on CUDA, bit for bit, against
    ``fp8ops.reference.fake_quantize`` on the same CUDA tensors, and against the op on CPU.

    The power-of-two kinds make the just-in-time scales insensitive to the last bit of
    ``fmax / amax`` (the data is far from a power-of-two boundary), so they compare exactly even
    where the kernel and the reference compute that quotient differently."""
    if kind == "delayed" and not with_probe:
        pytest.skip("without a probe the gradient is quantized with a just-in-time scale; that path is "
                    "covered exactly by the power-of-two kinds and by test_just_in_time_scale_equals_compute_scale")
    recipe, st = _fq_setup(kind)
    g = torch.Generator().manual_seed(11)
    x = (torch.randn(shape, generator=g) * 1.5).to(in_dtype)
    dy = (torch.randn(shape, generator=g) * 0.01).to(in_dtype)
    xg, dyg = x.cuda(), dy.cuda()
    got = _fq_run(xg, dyg, st, recipe, with_probe)

    # Against the reference math on the same CUDA tensors.
    y_ref, ns_ref = ref_fq.fake_quantize(xg, st, recipe=recipe)
    dx_ref, gamax_ref = ref_fq.fake_quantize_grad(dyg, st, recipe=recipe, has_probe=with_probe)
    # Same FP8 bytes and the same dequantization (multiply by the correctly rounded 1 / scale).
    _assert_same(got["y"], y_ref, f"{kind}: forward vs reference")
    _assert_same(got["dx"], dx_ref, f"{kind}: input gradient vs reference")
    _assert_same(got["state"].input.pending_amax, ns_ref.input.pending_amax, "forward amax in the new state")
    _assert_same(got["state"].grad_output.pending_amax, st.grad_output.pending_amax, "grad_output state untouched")
    if with_probe:
        _assert_same(got["probe"], gamax_ref, "probe gradient = amax(dy)")
        _assert_same(got["probe"], dyg.abs().amax().float(), "probe gradient = dy.abs().amax()")

    # Against the same op on CPU (the CPU kernels are the reference math, same multiply by 1/s).
    st_cpu = pytree.tree_map(lambda t: t.cpu(), st)
    cpu = _fq_run(x, dy, st_cpu, recipe, with_probe)
    _assert_same(got["y"].cpu(), cpu["y"], f"{kind}: forward, CUDA vs CPU")
    _assert_same(got["dx"].cpu(), cpu["dx"], f"{kind}: input gradient, CUDA vs CPU")
    if with_probe:
        _assert_same(got["probe"].cpu(), cpu["probe"], "probe gradient, CUDA vs CPU")


# ------------------------------------------------------------------------------------------------
# opcheck of the CUDA ops


@pytest.mark.parametrize("shape", [(17, 33), (64, 256)], ids=_id)
@pytest.mark.parametrize("out_dtype", FP8_DTYPES, ids=_id)
@pytest.mark.parametrize("in_dtype", IN_DTYPES, ids=_id)
def test_opcheck_cuda(in_dtype: torch.dtype, out_dtype: torch.dtype, shape: tuple[int, int]) -> None:
    ops = torch.ops.fp8ops
    x = make_input(shape, in_dtype, out_dtype, "normal")
    scale = torch.tensor(3.25, device="cuda")
    amax_in = x.abs().amax().float()
    torch.library.opcheck(ops.amax.default, (x,))
    torch.library.opcheck(ops.cast.default, (x, scale, None, 0, False, out_dtype))
    torch.library.opcheck(ops.cast.default, (x, scale, amax_in, 1, True, out_dtype))
    torch.library.opcheck(ops.cast_transpose.default, (x, scale, None, 0, False, out_dtype))
    torch.library.opcheck(ops.cast_transpose.default, (x, scale, amax_in, 2, False, out_dtype))
    torch.library.opcheck(ops.cast_transpose_dbias.default, (x, scale, None, 0, False, out_dtype))
    torch.library.opcheck(ops.cast_transpose_dbias.default, (x, scale, amax_in, 2, False, out_dtype))
    torch.library.opcheck(ops.cast_rowwise.default, (x, 0, False, out_dtype))
    torch.library.opcheck(ops.cast_rowwise.default, (x, 1, True, out_dtype))


@pytest.mark.parametrize("out_dtype", FP8_DTYPES, ids=_id)
def test_ops_cuda_match_cpu_reference_ops(out_dtype: torch.dtype) -> None:
    """The library ops on CUDA and their CPU kernels (the reference) give the same bytes for a given
    scale (no just-in-time division involved)."""
    x = make_input((67, 129), torch.bfloat16, out_dtype, "edges")
    scale = torch.tensor(0.5, device="cuda")
    got = torch.ops.fp8ops.cast_transpose(x, scale, None, 0, False, out_dtype)
    want = ref_q.cast_transpose(x.cpu(), scale.cpu(), None, 0, False, out_dtype)
    assert_fp8_equal(got[0].cpu(), want[0], x, "cast_transpose data vs CPU reference")
    assert_fp8_equal(got[1].cpu(), want[1], x.t(), "cast_transpose data_t vs CPU reference")
    assert_f32_bits_equal(got[2].cpu(), want[2], "cast_transpose amax vs CPU reference")
    assert_f32_bits_equal(got[3].cpu(), want[3], "cast_transpose inv_scale vs CPU reference")
    got_db = torch.ops.fp8ops.cast_transpose_dbias(x, scale, None, 0, False, out_dtype)
    for i in range(4):  # the same bytes as cast_transpose (NaNs included)
        assert torch.equal(got_db[i].reshape(-1).view(torch.uint8), got[i].reshape(-1).view(torch.uint8)), \
            f"cast_transpose_dbias output {i} differs from cast_transpose's"
    assert got_db[4].dtype == torch.float32 and got_db[4].shape == (129,)
    torch.testing.assert_close(got_db[4], x.float().sum(0), rtol=1e-6, atol=1e-4, equal_nan=True)


@pytest.mark.parametrize("shape", [(8192, 4096), (8191, 1027)], ids=_id)
def test_cast_transpose_dbias_at_training_sizes(shape: tuple[int, int]) -> None:
    """The bias gradient from the quantizing pass: integers, so exact whatever the summation order;
    then random values against a float64 sum."""
    g = torch.Generator(device="cuda").manual_seed(shape[1])
    x = torch.randint(-8, 9, shape, device="cuda", generator=g).to(torch.bfloat16)
    db = torch.ops.fp8ops.cast_transpose_dbias(x, torch.tensor(1.0, device="cuda"), None, 0, False,
                                               torch.float8_e4m3fn)[4]
    assert torch.equal(db, x.float().sum(0))
    x = torch.randn(shape, device="cuda", generator=g).to(torch.bfloat16)
    db = torch.ops.fp8ops.cast_transpose_dbias(x, torch.tensor(1.0, device="cuda"), None, 0, False,
                                               torch.float8_e5m2)[4]
    torch.testing.assert_close(db.double(), x.double().sum(0), rtol=0, atol=1e-3)


@pytest.mark.parametrize("shape", [(1, 1), (100, 333), (8192, 4096), (4096, 24576)], ids=_id)
@pytest.mark.parametrize("dtype", [torch.uint8, torch.float8_e4m3fn, torch.float8_e5m2], ids=["u8", "e4m3", "e5m2"])
def test_transpose_bytes_equals_torch(shape: tuple[int, int], dtype: torch.dtype) -> None:
    """fp8ops::transpose_bytes on the GPU gives the bytes of torch's transposed copy."""
    g = torch.Generator(device="cuda").manual_seed(shape[0] + shape[1])
    x = torch.randint(0, 256, shape, dtype=torch.uint8, device="cuda", generator=g).view(dtype)
    y = torch.ops.fp8ops.transpose_bytes(x)
    assert y.dtype == dtype and y.shape == (shape[1], shape[0]) and y.is_contiguous()
    assert torch.equal(y.view(torch.uint8), x.view(torch.uint8).t().contiguous())


@pytest.mark.parametrize("shape", [(8192, 1536), (4112, 200), (100, 48), (2048, 512)])
@pytest.mark.parametrize("dbias", [False, True])
def test_cast_transpose_through_tma_is_the_pointer_stores_bytes(shape, dbias):
    """cast_transpose's transposed copy stored through a TMA tensor map (64 x 64 tiles, clipped at
    the edges) writes the same bytes as the pointer stores of the 64 x 128 tiles, with the same q
    and amax and (dbias) the same column sums up to float32 rounding; 100 rows cannot use a tensor
    map (a 100-byte row of q^T)."""
    from fp8ops.kernels import quantize as kq
    from fp8ops.kernels._library import tma_store_ok

    M, K = shape
    g = torch.Generator(device="cuda").manual_seed(M * 7 + K)
    x = (3 * torch.randn(M, K, device="cuda", generator=g)).bfloat16()
    scale = torch.tensor(16.0, device="cuda")
    launch = kq.cast_transpose_dbias_launch if dbias else kq.cast_transpose_launch
    outs = [launch(x, scale, None, 0, False, torch.float8_e4m3fn, config=cfg) for cfg in ({"TMA": True}, {"TMA": False})]
    assert tma_store_ok(outs[0][1]) == (M % 16 == 0)
    for a, b in zip(outs[0][:4], outs[1][:4]):  # q, q^T, amax, inv: the same bytes
        assert torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                           b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b)
    if dbias:  # float32 column sums of tiles 64 (TMA) or 128 (pointer) columns wide: summed in another order
        torch.testing.assert_close(outs[0][4], outs[1][4], rtol=1e-5, atol=1e-4)
    assert torch.equal(outs[0][1].view(torch.uint8), outs[0][0].view(torch.uint8).t())
