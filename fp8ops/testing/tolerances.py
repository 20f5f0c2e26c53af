"""Tolerances and comparison rules for testing fp8ops against its FP32 reference.

Quantization bounds (round-to-nearest-even into a format with ``p`` explicit mantissa bits)::

    |dq(q(x)) - x| <= 2**-(p+1) * |x|        when smallest_normal <= |x * scale| <= fp8_max

that is a relative half-ulp of ``2**-4`` for E4M3 (3 mantissa bits) and ``2**-3`` for E5M2 (2 bits).
Below the smallest normal (E4M3 ``2**-6``, E5M2 ``2**-14``) the error is bounded in absolute terms
by half the subnormal spacing instead.

The comparison rule for ops (flash-attention's)::

    err(actual, ref) <= k * err(same computation in plain PyTorch at the same precision, ref) + atol

where ``err`` is the largest absolute difference over the elements where the reference is finite
and ``ref`` is the FP32 reference (:mod:`fp8ops.reference`). The failure message carries the three
numbers: the error of ``actual``, the error of plain PyTorch, and the bound.

References:
    Micikevicius et al., "FP8 Formats for Deep Learning" (2022); Dao et al., FlashAttention tests.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from types import MappingProxyType
from typing import NamedTuple

import torch
from torch import Tensor

__all__ = [
    "E4M3_HALF_ULP",
    "E4M3_SMALLEST_NORMAL",
    "E5M2_HALF_ULP",
    "E5M2_SMALLEST_NORMAL",
    "HALF_ULP_REL",
    "SMALLEST_NORMAL",
    "RuleErrors",
    "assert_close_rule",
    "assert_same_bits",
    "half_ulp_rel",
    "rel_error",
    "smallest_normal",
    "sqnr",
]

E4M3_HALF_ULP: float = 2.0**-4
"""Relative half-ulp of E4M3 in its normal range (3 mantissa bits): the round-trip bound."""

E5M2_HALF_ULP: float = 2.0**-3
"""Relative half-ulp of E5M2 in its normal range (2 mantissa bits): the round-trip bound."""

E4M3_SMALLEST_NORMAL: float = 2.0**-6
"""Smallest positive normal value of ``torch.float8_e4m3fn``."""

E5M2_SMALLEST_NORMAL: float = 2.0**-14
"""Smallest positive normal value of ``torch.float8_e5m2``."""

HALF_ULP_REL: Mapping[torch.dtype, float] = MappingProxyType(
    {torch.float8_e4m3fn: E4M3_HALF_ULP, torch.float8_e5m2: E5M2_HALF_ULP}
)
"""FP8 dtype -> relative round-trip bound in the normal range."""

SMALLEST_NORMAL: Mapping[torch.dtype, float] = MappingProxyType(
    {torch.float8_e4m3fn: E4M3_SMALLEST_NORMAL, torch.float8_e5m2: E5M2_SMALLEST_NORMAL}
)
"""FP8 dtype -> smallest positive normal value."""


def _fp8_key(dtype: torch.dtype, where: str, table: Mapping[torch.dtype, float]) -> float:
    if dtype not in table:
        raise ValueError(f"{where}: expected torch.float8_e4m3fn or torch.float8_e5m2, got {dtype}")
    return table[dtype]


def half_ulp_rel(dtype: torch.dtype) -> float:
    """The relative round-trip bound of an FP8 dtype in its normal range (E4M3 2^-4, E5M2 2^-3).

    Raises:
        ValueError: ``dtype`` is not an FP8 dtype.

    Example:
        >>> import torch
        >>> from fp8ops.testing import half_ulp_rel
        >>> half_ulp_rel(torch.float8_e4m3fn)
        0.0625
    """
    return _fp8_key(dtype, "half_ulp_rel", HALF_ULP_REL)


def smallest_normal(dtype: torch.dtype) -> float:
    """The smallest positive normal value of an FP8 dtype (E4M3 2^-6, E5M2 2^-14).

    Raises:
        ValueError: ``dtype`` is not an FP8 dtype.

    Example:
        >>> import torch
        >>> from fp8ops.testing import smallest_normal
        >>> smallest_normal(torch.float8_e5m2) == 2.0**-14
        True
    """
    return _fp8_key(dtype, "smallest_normal", SMALLEST_NORMAL)


class RuleErrors(NamedTuple):
    """The three numbers of :func:`assert_close_rule`.

    Attributes:
        error: max |actual - reference| over the elements where the reference is finite.
        ref_error: max |plain PyTorch at the same precision - reference| over the same elements.
        bound: ``k * ref_error + atol``.
    """

    error: float
    ref_error: float
    bound: float


def _as_f64(t: Tensor, what: str, name: str) -> Tensor:
    if not isinstance(t, Tensor):
        raise TypeError(f"assert_close_rule: {what} must be a torch.Tensor, got {type(t).__name__} ({name})")
    return t.detach().to(device="cpu", dtype=torch.float64)


def _max_abs_err(a: Tensor, ref: Tensor, finite: Tensor) -> tuple[float, int]:
    """Largest |a - ref| where ``finite``; NaN/inf in ``a`` there count as an infinite error."""
    if not bool(finite.any()):
        return 0.0, -1
    diff = (a - ref).abs()
    diff = torch.where(torch.isfinite(diff), diff, torch.full_like(diff, math.inf))
    diff = torch.where(finite, diff, torch.zeros_like(diff)).reshape(-1)
    idx = int(diff.argmax())
    return float(diff[idx]), idx


def assert_close_rule(
    actual: Tensor,
    expected: Tensor,
    ref_same_precision: Tensor,
    *,
    k: float = 2.0,
    atol: float = 1e-5,
    name: str = "output",
) -> RuleErrors:
    """Assert ``err(actual) <= k * err(ref_same_precision) + atol``, both measured against ``expected``.

    Math::

        err(t)  = max |t - expected|   over the elements where ``expected`` is finite
        bound   = k * err(ref_same_precision) + atol

    ``expected`` is the FP32 reference; ``ref_same_precision`` is the same computation done in plain
    PyTorch at the precision of ``actual`` (e.g. bf16 inputs, fp32 accumulation), so the rule only
    asks ``actual`` to be about as accurate as PyTorch itself. Where ``expected`` is NaN or ±inf,
    ``actual`` must be NaN or the same infinity (a non-finite ``actual`` where ``expected`` is finite
    is an infinite error).

    Args:
        actual: the tensor under test (any float dtype; compared in float64 on CPU).
        expected: the FP32 reference, same shape.
        ref_same_precision: plain PyTorch at the precision of ``actual``, same shape.
        k: allowed factor over PyTorch's own error.
        atol: absolute slack (covers the case where PyTorch at the same precision is exact).
        name: what is compared, for the failure message.

    Returns:
        :class:`RuleErrors` ``(error, ref_error, bound)``.

    Raises:
        AssertionError: the rule fails, or the shapes or the non-finite patterns differ; the
            message names ``name`` and gives the error, PyTorch's error and the bound.
        TypeError, ValueError: an argument is not a tensor, or ``k`` / ``atol`` is negative.

    Example:
        >>> import torch
        >>> from fp8ops.testing import assert_close_rule
        >>> ref = torch.linspace(-1, 1, 8, dtype=torch.float64)
        >>> pt = ref.to(torch.bfloat16)
        >>> assert_close_rule(ref.to(torch.bfloat16), ref, pt, name="x").error <= 2**-9
        True

    References:
        Dao et al., FlashAttention test suite (the "2 x PyTorch's error" rule).
    """
    if k < 0 or atol < 0:
        raise ValueError(f"assert_close_rule: k and atol must be >= 0, got k={k}, atol={atol}")
    a = _as_f64(actual, "actual", name)
    e = _as_f64(expected, "expected", name)
    r = _as_f64(ref_same_precision, "ref_same_precision", name)
    if a.shape != e.shape or r.shape != e.shape:
        raise AssertionError(
            f"{name}: shapes differ: actual {tuple(a.shape)}, expected {tuple(e.shape)}, "
            f"ref_same_precision {tuple(r.shape)}"
        )
    finite = torch.isfinite(e)
    nan_e = torch.isnan(e)
    inf_e = torch.isinf(e)
    bad_nan = nan_e & ~torch.isnan(a)
    bad_inf = inf_e & (a != e)
    if bool(bad_nan.any()) or bool(bad_inf.any()):
        raise AssertionError(
            f"{name}: {int(bad_nan.sum())} element(s) where the reference is NaN and actual is not, "
            f"{int(bad_inf.sum())} where the reference is ±inf and actual differs"
        )
    err, idx = _max_abs_err(a, e, finite)
    ref_err, _ = _max_abs_err(r, e, finite)
    bound = k * ref_err + atol
    if not err <= bound:
        where = ""
        if idx >= 0:
            pos = tuple(int(i) for i in torch.unravel_index(torch.tensor(idx), e.shape)) if e.dim() else ()
            where = f" (worst at index {pos}: actual {float(a.reshape(-1)[idx])!r}, reference {float(e.reshape(-1)[idx])!r})"
        raise AssertionError(
            f"{name}: error vs reference {err:.6g} > bound {bound:.6g} = {k} x {ref_err:.6g} "
            f"(error of plain PyTorch at the same precision) + atol {atol:.6g}{where}"
        )
    return RuleErrors(err, ref_err, bound)


def assert_same_bits(actual: Tensor, expected: Tensor, *, name: str = "tensor") -> None:
    """Assert two tensors have the same dtype, shape and bytes (NaN == NaN, +0 != -0).

    The exactness check for FP8 data (compare ``data.view(torch.uint8)``), scales and states.

    Raises:
        AssertionError: dtype, shape or some element differs; the message gives the count of
            differing elements and the first one.

    Example:
        >>> import torch
        >>> from fp8ops.testing import assert_same_bits
        >>> x = torch.tensor([float("nan"), 1.0])
        >>> assert_same_bits(x, x.clone(), name="x")
    """
    if not isinstance(actual, Tensor) or not isinstance(expected, Tensor):
        raise AssertionError(
            f"{name}: expected two tensors, got {type(actual).__name__} and {type(expected).__name__}"
        )
    if actual.dtype != expected.dtype or actual.shape != expected.shape:
        raise AssertionError(
            f"{name}: got {tuple(actual.shape)} {actual.dtype}, expected {tuple(expected.shape)} {expected.dtype}"
        )
    a = actual.detach().cpu().contiguous().reshape(-1)
    b = expected.detach().cpu().contiguous().reshape(-1)
    if a.numel() == 0:
        return
    ab = a.view(torch.uint8).reshape(a.numel(), -1)
    bb = b.view(torch.uint8).reshape(b.numel(), -1)
    diff = (ab != bb).any(dim=1)
    if bool(diff.any()):
        i = int(diff.nonzero()[0, 0])
        av, bv = a[i], b[i]
        if a.dtype.is_floating_point and a.element_size() == 1:
            av, bv = av.to(torch.float32), bv.to(torch.float32)
        raise AssertionError(
            f"{name}: {int(diff.sum())} of {a.numel()} element(s) differ; first at flat index {i}: "
            f"got {av.item()!r} (bytes {ab[i].tolist()}), expected {bv.item()!r} (bytes {bb[i].tolist()})"
        )


def sqnr(actual: Tensor, reference: Tensor) -> float:
    """Signal-to-quantization-noise ratio of ``actual`` against ``reference``, in dB.

    Math::

        sqnr = 10 * log10( sum(reference**2) / sum((reference - actual)**2) )

    computed in float64; ``inf`` when the two are equal, ``-inf`` when the reference is all zeros
    and ``actual`` is not.

    Raises:
        ValueError: the shapes differ, or an input has a NaN or an infinity.

    Example:
        >>> import torch
        >>> from fp8ops.testing import sqnr
        >>> round(sqnr(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.5])), 2)
        14.62
    """
    a = actual.detach().to(device="cpu", dtype=torch.float64)
    r = reference.detach().to(device="cpu", dtype=torch.float64)
    if a.shape != r.shape:
        raise ValueError(f"sqnr: shapes differ: actual {tuple(a.shape)}, reference {tuple(r.shape)}")
    if not (bool(torch.isfinite(a).all()) and bool(torch.isfinite(r).all())):
        raise ValueError("sqnr: inputs must be finite (SQNR of a NaN or an infinity is meaningless)")
    signal = float((r * r).sum())
    noise = float(((r - a) ** 2).sum())
    if noise == 0.0:
        return math.inf
    if signal == 0.0:
        return -math.inf
    return 10.0 * math.log10(signal / noise)


def rel_error(actual: Tensor, expected: Tensor) -> float:
    """Relative error in the Frobenius norm, ``||actual - expected|| / ||expected||``, in float32
    (the denominator held at 1e-30 or more, so an all-zero ``expected`` gives ``||actual|| * 1e30``).

    Example:
        >>> import torch
        >>> from fp8ops.testing import rel_error
        >>> round(rel_error(torch.tensor([3.0, 4.0]), torch.tensor([3.0, 5.0])), 6)  # 1 / sqrt(34)
        0.171499
    """
    a, b = actual.float(), expected.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()
