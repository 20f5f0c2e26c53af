"""FP32 reference of ``fp8ops::adamw_cast_transpose`` and ``fp8ops::adamw`` (the CPU kernels of the
library ops).

The math of :mod:`fp8ops.kernels.optim`, in float32 with torch operations: one AdamW step on the
weight and its moments (written back in place in their dtypes), then the saturating FP8 cast of
the weight as stored, with its transpose, inverse scale and amax (:func:`quantize.cast_transpose`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import quantize as _q

__all__ = ["adamw", "adamw_cast_transpose", "adamw_quantize_", "adamw_step"]


def adamw_step(w: Tensor, g: Tensor, m: Tensor, v: Tensor, step: Tensor, lr: Tensor, beta1: float, beta2: float,
               eps: float, weight_decay: float) -> None:
    """One AdamW step in float32, written into ``w``, ``m``, ``v`` (``step`` already counts it)::

        w = w - lr * weight_decay * w
        m = beta1 * m + (1 - beta1) * g;   v = beta2 * v + (1 - beta2) * g * g
        w = w - lr / (1 - beta1**t) * m / (sqrt(v) / sqrt(1 - beta2**t) + eps)
    """
    f32 = torch.float32
    t, lr_ = step.to(f32), lr.to(f32)
    b1, b2 = torch.tensor(beta1, dtype=f32), torch.tensor(beta2, dtype=f32)
    bias1 = 1.0 - torch.exp2(t * torch.log2(b1))
    bias2_sqrt = torch.sqrt(1.0 - torch.exp2(t * torch.log2(b2)))
    wf, gf, mf, vf = (x.to(f32) for x in (w, g, m, v))
    wf = wf - lr_ * weight_decay * wf
    mf = b1 * mf + (1.0 - b1) * gf
    vf = b2 * vf + (1.0 - b2) * gf * gf
    wf = wf - (lr_ / bias1) * (mf / (torch.sqrt(vf) / bias2_sqrt + eps))
    w.copy_(wf)
    m.copy_(mf)
    v.copy_(vf)


def adamw(ws: list[Tensor], gs: list[Tensor], ms: list[Tensor], vs: list[Tensor], step: Tensor, lr: Tensor,
          beta1: float, beta2: float, eps: float, weight_decay: float) -> None:
    """Reference of ``fp8ops::adamw``: :func:`adamw_step` on each ``(ws[i], gs[i], ms[i], vs[i])``."""
    for w, g, m, v in zip(ws, gs, ms, vs, strict=True):
        adamw_step(w, g, m, v, step, lr, beta1, beta2, eps, weight_decay)


def adamw_cast_transpose(w: Tensor, g: Tensor, m: Tensor, v: Tensor, step: Tensor, lr: Tensor, scale: Tensor,
                         q: Tensor, q_t: Tensor, inv: Tensor, beta1: float, beta2: float, eps: float,
                         weight_decay: float) -> Tensor:
    """Reference of ``fp8ops::adamw_cast_transpose``: :func:`adamw_step`, then ``q``, ``q_t`` and
    ``inv`` overwritten with the cast of the new ``w``; returns its amax."""
    adamw_step(w, g, m, v, step, lr, beta1, beta2, eps, weight_decay)
    data, data_t, amax, inv_scale = _q.cast_transpose(w, scale, None, 0, False, q.dtype)
    q.copy_(data)
    q_t.copy_(data_t)
    inv.copy_(inv_scale)
    return amax


def adamw_quantize_(weight: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, step: Tensor, scale: Tensor, *,
                    lr: Tensor, betas: tuple[float, float], eps: float, weight_decay: float,
                    fp8_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Reference of :func:`fp8ops.adamw_quantize_` with a per-tensor ``scale``: ``step`` += 1, one
    :func:`adamw_step` in place, then ``(q, q_t, inv_scale, amax)`` of the new weight (the FP8 copy,
    its transpose, ``1 / scale`` and max |w|), as :func:`quantize.cast_transpose` computes them."""
    step.add_(1.0)
    q = torch.empty(weight.shape, dtype=fp8_dtype, device=weight.device)
    q_t = torch.empty(weight.shape[::-1], dtype=fp8_dtype, device=weight.device)
    inv = torch.empty((), device=weight.device)
    amax = adamw_cast_transpose(weight, grad, exp_avg, exp_avg_sq, step, lr, scale, q, q_t, inv, betas[0], betas[1],
                                eps, weight_decay)
    return q, q_t, inv, amax
