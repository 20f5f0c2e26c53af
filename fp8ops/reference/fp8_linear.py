"""FP32 reference for :func:`fp8ops.fp8_linear`: forward and the three gradients.

Each operand is quantized with the same rule as the op (emulated FP8: saturate, then cast to
torch's float8 dtypes), dequantized to float32, and multiplied in float32.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from ..recipes import Recipe, compute_scale
from .quantize import amax, saturating_cast

if TYPE_CHECKING:
    from ..fp8_linear import LinearState

__all__ = ["fp8_linear", "fp8_linear_grads", "qdq", "qdq_operand", "state_scales"]


def qdq(t: Tensor, scale: Tensor | None, calibrated: bool, recipe: Recipe, role: str, *, dim: int = -1,
        per_tensor: bool = False, amax_in: Tensor | None = None) -> Tensor:
    """Quantize-dequantize ``t`` (2-D) as the op does, in float32.

    Per-tensor modes use ``scale`` (delayed, calibrated) or a just-in-time scale from ``amax(t)``
    (or from ``amax_in`` when given); row-wise mode scales each slice along ``dim`` (``dim=-1``: one
    scale per row; ``dim=0``: per column) unless ``per_tensor`` (then it scales as current scaling).
    """
    t = t.to(torch.float32)
    dtype = recipe.dtype(role)  # type: ignore[arg-type]
    fmax = recipe.fp8_max(role)  # type: ignore[arg-type]
    if recipe.mode == "rowwise" and not per_tensor:
        a = t.abs().amax(dim=dim, keepdim=True)
        s = compute_scale(a, torch.ones_like(a), fmax, margin=recipe.margin, power_2_scale=recipe.power_2_scale)
    else:
        fallback = scale if scale is not None else torch.ones((), device=t.device)
        if recipe.mode == "delayed" and calibrated and scale is not None:
            s = scale
        else:
            a = amax(t) if amax_in is None else amax_in.to(torch.float32)
            s = compute_scale(a, fallback, fmax, margin=recipe.margin, power_2_scale=recipe.power_2_scale)
    return saturating_cast(t, s, dtype).to(torch.float32) * torch.reciprocal(s)


def fp8_linear(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    state: LinearState,
    *,
    recipe: Recipe,
    grad_probe: Tensor | None = None,
    weight_cache: object = None,
    wgrad_dtype: torch.dtype | None = None,
) -> tuple[Tensor, LinearState]:
    """Reference forward: ``(y, new_state)`` as :func:`fp8ops.fp8_linear` returns them."""
    K = weight.shape[1]
    x2 = x.detach().reshape(-1, K)
    w = weight.detach()
    if recipe.fprop.precision == "fp8":
        xd = qdq(x2, state.input.scale, state.input.calibrated, recipe, "forward")
        wd = qdq(w, state.weight.scale, state.weight.calibrated, recipe, "forward")
    else:
        xd, wd = x2.to(torch.float32), w.to(torch.float32)
    y = xd @ wd.t()
    if bias is not None:
        y = y + bias.detach().to(torch.float32)
    new_state = state.replace(input=state.input.observe(amax(x2)), weight=state.weight.observe(amax(w)))
    return y.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0]), new_state


def fp8_linear_grads(
    x: Tensor,
    weight: Tensor,
    dy: Tensor,
    state: LinearState,
    *,
    recipe: Recipe,
    has_probe: bool = True,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Reference backward: ``(dx, dW, db, amax(dy))`` for an output gradient ``dy`` (..., N)."""
    N, K = weight.shape
    x2 = x.detach().reshape(-1, K).to(torch.float32)
    dy2 = dy.reshape(-1, N).to(torch.float32)
    w = weight.detach().to(torch.float32)
    g = state.grad_output
    g_scale = g.scale if has_probe else None
    g_cal = g.calibrated and has_probe
    if recipe.dgrad.precision == "fp8":
        dx = qdq(dy2, g_scale, g_cal, recipe, "backward") @ qdq(w, state.weight.scale, state.weight.calibrated, recipe, "forward", dim=0)
    else:
        dx = dy2 @ w
    if recipe.wgrad.precision == "fp8":
        dw = qdq(dy2, g_scale, g_cal, recipe, "backward", dim=0).t() @ qdq(
            x2, state.input.scale, state.input.calibrated, recipe, "forward", dim=0
        )
    else:
        dw = dy2.t() @ x2
    db = dy2.sum(0)
    return dx.to(x.dtype).reshape(x.shape), dw.to(weight.dtype), db, amax(dy2)


def state_scales(state: Any, names: tuple[str, ...]) -> list[tuple[Tensor | None, bool]]:
    """``(scale, calibrated)`` of each named role of an op's state."""
    return [(getattr(state, n).scale, getattr(state, n).calibrated) for n in names]


def qdq_operand(t: Tensor, sc: tuple[Tensor | None, bool], recipe: Recipe | None, role: str, on: bool,
                dim: int = -1, dtype: torch.dtype = torch.float32) -> Tensor:
    """A GEMM operand as the op feeds it: float32, quantized-dequantized with ``qdq`` when ``on`` (the
    GEMM runs in FP8) and a recipe is given; row-wise recipes first round it to the producer's
    ``dtype``."""
    t = t.to(torch.float32)
    if recipe is None or not on:
        return t
    if recipe.mode == "rowwise":  # row-wise scaling quantizes the producer's output stored in ``dtype``
        t = t.to(dtype).to(torch.float32)
    return qdq(t, sc[0], sc[1], recipe, role, dim=dim)
