"""FP32 reference for :func:`fp8ops.fake_quantize`: forward value and input gradient."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ..recipes import Recipe, compute_scale
from .quantize import amax, saturating_cast

if TYPE_CHECKING:
    from ..fake_quantize import FakeQuantState

__all__ = ["fake_quantize", "fake_quantize_grad"]


def _qdq(x: Tensor, scale: Tensor, calibrated: bool, recipe: Recipe, role: str) -> Tensor:
    dtype = recipe.dtype(role)  # type: ignore[arg-type]
    if recipe.mode != "delayed" or not calibrated:
        scale = compute_scale(amax(x), scale, recipe.fp8_max(role), margin=recipe.margin,  # type: ignore[arg-type]
                              power_2_scale=recipe.power_2_scale)
    return (saturating_cast(x, scale, dtype).to(torch.float32) * torch.reciprocal(scale)).to(x.dtype)


def fake_quantize(x: Tensor, state: FakeQuantState, *, recipe: Recipe, grad_probe: Tensor | None = None
                  ) -> tuple[Tensor, FakeQuantState]:
    """Reference forward: ``(y, new_state)`` as :func:`fp8ops.fake_quantize` returns them."""
    y = _qdq(x.detach(), state.input.scale, state.input.calibrated, recipe, "forward")
    return y, state.replace(input=state.input.observe(amax(x)))


def fake_quantize_grad(dy: Tensor, state: FakeQuantState, *, recipe: Recipe, has_probe: bool = True
                       ) -> tuple[Tensor, Tensor]:
    """Reference backward: ``(dx, amax(dy))`` for an output gradient ``dy``."""
    if has_probe:
        dx = _qdq(dy, state.grad_output.scale, state.grad_output.calibrated, recipe, "backward")
    else:
        dx = _qdq(dy, torch.ones((), device=dy.device), False, recipe, "backward")
    return dx, amax(dy)
