"""FP32 reference for :func:`fp8ops.layernorm_linear`.

Written from the equations, forward and backward by hand: the norm is the float32 reference of
the norm ops (its derivative through ``torch.autograd.grad``), every GEMM operand is
quantized-dequantized with the op's rule (:func:`fp8ops.reference.fp8_linear.qdq`) and multiplied in
float32. The dgrad output the op stores in the input precision is rounded to it here too, so that
the comparison isolates the kernels.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..recipes import Recipe
from .fp8_linear import qdq_operand, state_scales
from .norm import norm32_leaves
from .quantize import amax

__all__ = ["layernorm_linear"]


def layernorm_linear(
    x: Tensor, ln_w: Tensor, ln_b: Tensor | None, w: Tensor, b: Tensor | None, state: Any, dy: Tensor, *,
    recipe: Recipe | None, normalization: str = "LayerNorm", eps: float = 1e-5, zero_centered_gamma: bool = False,
    has_probe: bool = True,
) -> dict[str, Any]:
    """Reference outputs: ``y``, ``ln``, gradients ``dx, dln_w, dln_b, dw, db`` for output gradient
    ``dy``, and the observations ``amax_ln, amax_w, amax_dy``."""
    N = w.shape[0]
    leaves, ln = norm32_leaves(x, ln_w, ln_b, normalization=normalization, eps=eps,
                               zero_centered_gamma=zero_centered_gamma)
    lnv = ln.detach()
    fp8 = recipe is not None
    sx, sw, sg = state_scales(state, ("input", "weight", "grad_output")) if fp8 else [(None, False)] * 3
    if not has_probe:
        sg = (None, False)
    f, d, wg = ((recipe.fprop.precision == "fp8", recipe.dgrad.precision == "fp8", recipe.wgrad.precision == "fp8")
                if fp8 else (False, False, False))
    w32 = w.detach().to(torch.float32)
    y = qdq_operand(lnv, sx, recipe, "forward", f, dtype=x.dtype) @ qdq_operand(w32, sw, recipe, "forward", f).t()
    if b is not None:
        y = y + b.detach().to(torch.float32)
    dy2 = dy.reshape(-1, N).to(torch.float32)
    dln = (qdq_operand(dy2, sg, recipe, "backward", d) @ qdq_operand(w32, sw, recipe, "forward", d, dim=0)).to(x.dtype).float()
    dw = qdq_operand(dy2, sg, recipe, "backward", wg, dim=0).t() @ qdq_operand(lnv, sx, recipe, "forward", wg, dim=0, dtype=x.dtype)
    grads = torch.autograd.grad(ln, leaves, dln)
    return {
        "y": y, "ln": lnv, "dx": grads[0].reshape(x.shape), "dln_w": grads[1],
        "dln_b": grads[2] if ln_b is not None else None, "dw": dw, "db": dy2.sum(0),
        "amax_ln": amax(lnv), "amax_w": amax(w32), "amax_dy": amax(dy2),
    }
