"""FP32 reference for :func:`fp8ops.fused_ln_mlp`.

Written from the equations, forward and backward by hand: the norm and the activation are the
float32 references of those ops (their derivatives through ``torch.autograd.grad``), every GEMM
operand is quantized-dequantized with the op's rule (:func:`fp8ops.reference.fp8_linear.qdq`) and
multiplied in float32. Intermediates the op stores in the input precision (fc1's output h, the
dgrad outputs) are rounded to it here too, so that the comparison isolates the kernels.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..recipes import Recipe
from .activation import activation
from .fp8_linear import qdq, qdq_operand, state_scales
from .norm import norm32_leaves
from .quantize import amax

__all__ = ["fused_ln_mlp"]


def fused_ln_mlp(
    x: Tensor, ln_w: Tensor, ln_b: Tensor | None, w1: Tensor, b1: Tensor | None, w2: Tensor, b2: Tensor | None,
    state: Any, dy: Tensor, *, recipe: Recipe | None, normalization: str = "LayerNorm",
    activation_name: str = "gelu_tanh", eps: float = 1e-5, zero_centered_gamma: bool = False,
    has_probe: bool = True, recompute: bool = False, h_amax: Tensor | None = None,
) -> dict[str, Any]:
    """Reference outputs: ``y``, gradients ``dx, dln_w, dln_b, dw1, db1, dw2, db2`` and the
    observations ``amax_ln, amax_w1, amax_a, amax_w2, amax_dh, amax_dy`` (and ``amax_h``).

    ``recompute=True`` (with a recipe) quantizes-dequantizes fc1's output h per tensor with the
    ``fc1_output`` role before the activation, as ``recompute="activation"`` stores it: the
    activation and its derivative read the dequantized h, whose gradient passes to fc1 unchanged.
    ``h_amax`` replaces the amax its just-in-time scale is computed from (the op's own observation:
    a current scale follows one element of h, so a last-bit difference there moves the whole grid).
    """
    K2 = w2.shape[0]
    leaves, ln = norm32_leaves(x, ln_w, ln_b, normalization=normalization, eps=eps,
                               zero_centered_gamma=zero_centered_gamma)
    lnv = ln.detach()
    fp8 = recipe is not None
    names = ("fc1_input", "fc1_weight", "fc1_grad_output", "fc2_input", "fc2_weight", "fc2_grad_output")
    sx1, sw1, sg1, sx2, sw2, sg2 = state_scales(state, names) if fp8 else [(None, False)] * 6
    if not has_probe:
        sg1 = sg2 = (None, False)
    f, d, wg = ((recipe.fprop.precision == "fp8", recipe.dgrad.precision == "fp8", recipe.wgrad.precision == "fp8")
                if fp8 else (False, False, False))
    w1_32, w2_32 = w1.detach().float(), w2.detach().float()
    h = qdq_operand(lnv, sx1, recipe, "forward", f, dtype=x.dtype) @ qdq_operand(w1_32, sw1, recipe, "forward", f).t()
    if b1 is not None:
        h = h + b1.detach().float()
    h = h.to(x.dtype).float()  # the op keeps h in the input precision
    amax_h = amax(h)
    if fp8 and recompute:  # the op stores q(h) per tensor and the activation reads dq(q(h))
        sh, cal = state_scales(state, ("fc1_output",))[0]
        h = qdq(h, sh, cal, recipe, "forward", per_tensor=True, amax_in=h_amax)  # type: ignore[arg-type]
    h = h.requires_grad_()
    a = activation(h, activation_name)
    av = a.detach()
    y = qdq_operand(av, sx2, recipe, "forward", f, dtype=x.dtype) @ qdq_operand(w2_32, sw2, recipe, "forward", f).t()
    if b2 is not None:
        y = y + b2.detach().float()
    dy2 = dy.reshape(-1, K2).float()
    da = (qdq_operand(dy2, sg2, recipe, "backward", d) @ qdq_operand(w2_32, sw2, recipe, "forward", d, dim=0)).to(x.dtype).float()
    dw2 = qdq_operand(dy2, sg2, recipe, "backward", wg, dim=0).t() @ qdq_operand(av, sx2, recipe, "forward", wg, dim=0, dtype=x.dtype)
    (dh,) = torch.autograd.grad(a, h, da)
    dln = (qdq_operand(dh, sg1, recipe, "backward", d, dtype=x.dtype) @ qdq_operand(w1_32, sw1, recipe, "forward", d, dim=0)).to(x.dtype).float()
    dw1 = (qdq_operand(dh, sg1, recipe, "backward", wg, dim=0, dtype=x.dtype).t()
           @ qdq_operand(lnv, sx1, recipe, "forward", wg, dim=0, dtype=x.dtype))
    grads = torch.autograd.grad(ln, leaves, dln)
    return {
        "y": y, "h": h.detach(), "a": av, "dx": grads[0].reshape(x.shape), "dln_w": grads[1],
        "dln_b": grads[2] if ln_b is not None else None, "dw1": dw1, "db1": dh.sum(0), "dw2": dw2,
        "db2": dy2.sum(0), "amax_ln": amax(lnv), "amax_w1": amax(w1_32), "amax_a": amax(av),
        "amax_w2": amax(w2_32), "amax_dh": amax(dh), "amax_dy": amax(dy2), "amax_h": amax_h,
    }
