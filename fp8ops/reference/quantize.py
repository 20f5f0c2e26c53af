"""FP32 reference for quantize / dequantize: the executable specification of the quantize kernels.

FP8 is emulated with torch's float8 dtypes: scale in float32, clamp to the finite range (a NaN
stays NaN), then cast (round-to-nearest-even). The primitive functions below are also the CPU
kernels of the ``fp8ops::amax``, ``fp8ops::cast``, ``fp8ops::cast_transpose``,
``fp8ops::cast_transpose_dbias`` and ``fp8ops::cast_rowwise`` library ops.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..formats import Role, fp8_max_of
from ..recipes import Recipe, compute_scale
from ..state import ScalingState

__all__ = [
    "amax",
    "cast",
    "cast_rowwise",
    "cast_transpose",
    "cast_transpose_dbias",
    "cast_transpose_heads",
    "heads_2d",
    "dequantize",
    "quantize",
    "saturating_cast",
    "transpose_bytes",
]


def saturating_cast(x: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """``clamp(x * scale, -fp8_max, fp8_max).to(dtype)`` in float32; NaN stays NaN."""
    fmax = fp8_max_of(dtype)
    return torch.clamp(x.to(torch.float32) * scale, -fmax, fmax).to(dtype)


def amax(x: Tensor) -> Tensor:
    """max |x| in float32 (0 for an empty tensor); NaN if any element is NaN."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    return x.detach().abs().amax().to(torch.float32)


def transpose_bytes(x: Tensor) -> Tensor:
    """The (K, M) contiguous transpose of a 2-D (M, K) tensor of one-byte elements (uint8, FP8)."""
    if x.dim() != 2 or x.element_size() != 1:
        raise ValueError(f"transpose_bytes: x must be a 2-D tensor of one-byte elements, got {x.dtype} "
                         f"of shape {tuple(x.shape)}")
    return x.view(torch.uint8).t().contiguous().view(x.dtype)


def _scale(scale: Tensor, amax_in: Tensor | None, margin: int, power_2: bool, dtype: torch.dtype) -> Tensor:
    if amax_in is None:
        return scale
    return compute_scale(amax_in, scale, fp8_max_of(dtype), margin=margin, power_2_scale=power_2)


def cast(
    x: Tensor, scale: Tensor, amax_in: Tensor | None, margin: int, power_2: bool, out_dtype: torch.dtype
) -> tuple[Tensor, Tensor, Tensor]:
    """Reference of ``fp8ops::cast``: ``(q, amax, inv_scale)``."""
    s = _scale(scale, amax_in, margin, power_2, out_dtype)
    return saturating_cast(x, s, out_dtype), amax(x), torch.reciprocal(s)


def cast_transpose(
    x: Tensor, scale: Tensor, amax_in: Tensor | None, margin: int, power_2: bool, out_dtype: torch.dtype
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Reference of ``fp8ops::cast_transpose``: ``(q (M, K), q_t (K, M), amax, inv_scale)``."""
    q, a, inv = cast(x, scale, amax_in, margin, power_2, out_dtype)
    return q, q.t().clone(memory_format=torch.contiguous_format), a, inv


def cast_transpose_dbias(
    x: Tensor, scale: Tensor, amax_in: Tensor | None, margin: int, power_2: bool, out_dtype: torch.dtype
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Reference of ``fp8ops::cast_transpose_dbias``: :func:`cast_transpose` and the float32
    column sums of x, ``(q, q_t, amax, inv_scale, dbias (K,))``."""
    return (*cast_transpose(x, scale, amax_in, margin, power_2, out_dtype), x.to(torch.float32).sum(0))


def heads_2d(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """The (S B, (Hq + 2 Hkv) D) matrix whose row (s, b) is ``[q[b, :, s] | k[b, :, s] | v[b, :, s]]``
    flattened, from (B, H, S, D) tensors: a QKV projection's gradient from attention's dq, dk, dv."""
    return torch.cat([t.permute(2, 0, 1, 3).reshape(t.shape[2] * t.shape[0], t.shape[1] * t.shape[3])
                      for t in (q, k, v)], dim=1)


def cast_transpose_heads(
    q: Tensor, k: Tensor, v: Tensor, scale: Tensor, amax_in: Tensor | None, margin: int, power_2: bool,
    out_dtype: torch.dtype,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Reference of ``fp8ops::cast_transpose_heads``: :func:`cast_transpose_dbias` of
    :func:`heads_2d` ``(q, k, v)``."""
    return cast_transpose_dbias(heads_2d(q, k, v), scale, amax_in, margin, power_2, out_dtype)


def cast_rowwise(x: Tensor, margin: int, power_2: bool, out_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """Reference of ``fp8ops::cast_rowwise``: ``(q (M, K), inv_scale (M, 1), amax)``."""
    xf = x.to(torch.float32)
    row_amax = xf.abs().amax(dim=1, keepdim=True) if x.shape[1] else torch.zeros(x.shape[0], 1, device=x.device)
    s = compute_scale(row_amax, torch.ones_like(row_amax), fp8_max_of(out_dtype), margin=margin, power_2_scale=power_2)
    return saturating_cast(xf, s, out_dtype), torch.reciprocal(s), amax(x)


def quantize(
    x: Tensor,
    state: ScalingState | None,
    *,
    recipe: Recipe,
    role: Role | None = None,
    transpose: bool = False,
) -> tuple[tuple[Tensor, Tensor, Tensor | None], ScalingState | None]:
    """Reference of :func:`fp8ops.quantize`: ``((data, inv_scale, data_t), new_state)``.

    Same semantics as the public op, written directly from the equations.
    """
    role = role if role is not None else (state.role if state is not None else "forward")
    dtype = recipe.dtype(role)
    K = x.shape[-1]
    x2 = x.reshape(-1, K).to(torch.float32)
    a = amax(x2)
    if recipe.mode == "rowwise":
        q, inv, _ = cast_rowwise(x2, recipe.margin, recipe.power_2_scale, dtype)
        inv = inv.reshape(*x.shape[:-1], 1)
        data_t = None
    else:
        fallback = state.scale if state is not None else torch.ones((), device=x.device)
        if recipe.mode == "delayed" and state is not None and state.calibrated:
            s = state.scale
        else:
            s = compute_scale(a, fallback, recipe.fp8_max(role), margin=recipe.margin, power_2_scale=recipe.power_2_scale)
        q = saturating_cast(x2, s, dtype)
        inv = torch.reciprocal(s)
        data_t = q.t().contiguous() if transpose else None
    new_state = None if state is None else state.observe(a)
    return (q.reshape(x.shape), inv, data_t), new_state


def dequantize(data: Tensor, inv_scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """``data * inv_scale`` in float32, then cast to ``dtype``."""
    return (data.to(torch.float32) * inv_scale).to(dtype)
