"""FP32 reference for LayerNorm / RMSNorm: the executable specification of the norm kernels.

Math (rows of length K; every statistic in float32)::

    s    = (x + residual) rounded to x.dtype          # when a residual is given, else s = x
    s    = (x * keep / (1 - p) + residual) rounded    # with dropout p on x (dropout_seed): one rounding
    LayerNorm: mean = mean(s), rstd = 1 / sqrt(var(s) + eps) (biased var), xh = (s - mean) * rstd
    RMSNorm:   rstd = 1 / sqrt(mean(s^2) + eps),                               xh = s * rstd
    g    = weight (+ 1 with zero-centred gamma);  y32 = xh * g (+ bias)
    q    = sat(y32 * scale) cast to FP8;  amax = max |y32|;  inv_scale = 1 / scale

Backward (``gdy = dy * g``)::

    LayerNorm: dx = rstd * (gdy - mean(gdy) - xh * mean(gdy * xh))  (+ ds)
    RMSNorm:   dx = rstd * (gdy - xh * mean(gdy * xh))              (+ ds)
    dweight = sum_rows(dy * xh), dbias = sum_rows(dy)
    with dropout on x: dx_branch = dx * keep / (1 - p) (from dx in float32), dx the residual's

``keep`` (:func:`branch_keep`) is the attention dropout hash of ``(seed, 0, 0, row, column)`` over
the (M, K) rows, so the backward regenerates the mask and nothing is stored.

``norm_fwd``, ``norm_amax``, ``norm_bwd`` and ``norm_bwd_dropout`` have the signatures of the
``fp8ops::`` library ops and are their CPU kernels; ``layer_norm`` and ``rms_norm`` specify the public functions' forward.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..formats import fp8_max_of
from ..recipes import compute_scale
from .quantize import amax as _amax
from .quantize import saturating_cast

__all__ = ["branch_keep", "branch_scale", "layer_norm", "norm32", "norm32_leaves", "norm_amax", "norm_bwd",
           "norm_bwd_dropout", "norm_fwd", "rms_norm"]


def branch_keep(seed: Tensor, M: int, K: int, p: float, device: Any = None) -> Tensor:
    """The keep mask (M, K) of the dropout on a norm's input ``x`` before its residual add: True
    where element ``(row, column)`` of the (M, K) rows is kept.

    It is the attention dropout hash (:func:`fp8ops.reference.attention.dropout_keep`) with
    ``b = h = 0``, the column as the query and the row as the key. Columns ``2j`` and ``2j + 1``
    are the two queries of one pair (query indices ``i`` and ``i + 8`` of an aligned 16), so they
    share one per-element hash and take its two 16-bit halves::

        q(c) = (c >> 4) * 16 + (c & 1) * 8 + ((c >> 1) & 7)      # pair index q(c) -> c >> 1
        keep(row, c) = dropout_keep(seed, 0, 0, q(c), row, p)

    A kernel thread holds both columns of a pair side by side, so it computes that hash once for
    two elements.
    """
    from .attention import dropout_keep

    dev = seed.device if device is None else device
    rows = torch.arange(M, dtype=torch.int64, device=dev)[:, None]
    cols = torch.arange(K, dtype=torch.int64, device=dev)[None, :]
    q = ((cols >> 4) << 4) | ((cols & 1) << 3) | ((cols >> 1) & 7)
    zero = torch.zeros((), dtype=torch.int64, device=dev)
    return dropout_keep(seed.reshape(()).to(device=dev, dtype=torch.int64), zero, zero, q, rows, p)


def branch_scale(seed: Tensor, M: int, K: int, p: float, device: Any = None) -> Tensor:
    """``where(keep, 1 / (1 - p), 0)`` in float32, (M, K): the factor of each element of the
    dropped input (:func:`branch_keep`); ``1 / (1 - p)`` is rounded to float32 once, as the kernels do."""
    keep = branch_keep(seed, M, K, p, device)
    inv = torch.tensor(1.0 / (1.0 - float(p)), dtype=torch.float32, device=keep.device)
    return torch.where(keep, inv, torch.zeros((), dtype=torch.float32, device=keep.device))


def _sum_input(x: Tensor, residual: Tensor | None, dropout_seed: Tensor | None = None,
               dropout_p: float = 0.0) -> Tensor:
    """s = x + residual, added in float32 and rounded to x's dtype; with ``dropout_seed`` (and a
    residual) x is dropped first: s = x * branch_scale + residual, one rounding."""
    if residual is None:
        return x
    x32 = x.to(torch.float32)
    if dropout_seed is not None:
        x32 = x32 * branch_scale(dropout_seed, x.shape[0], x.shape[1], dropout_p, x.device)
    return (x32 + residual.to(torch.float32)).to(x.dtype)


def _gamma(weight: Tensor, zero_centered_gamma: bool) -> Tensor:
    g = weight.to(torch.float32)
    return g + 1.0 if zero_centered_gamma else g


def _stats(s32: Tensor, eps: float, rms: bool) -> tuple[Tensor | None, Tensor]:
    """(mean or None, rstd) of each row of an (M, K) float32 tensor."""
    if rms:
        return None, torch.rsqrt((s32 * s32).mean(dim=1) + eps)
    mean = s32.mean(dim=1)
    var = ((s32 - mean[:, None]) ** 2).mean(dim=1)
    return mean, torch.rsqrt(var + eps)


def _normalize(s32: Tensor, mean: Tensor | None, rstd: Tensor) -> Tensor:
    return (s32 if mean is None else s32 - mean[:, None]) * rstd[:, None]


def _y32(x: Tensor, residual: Tensor | None, weight: Tensor, bias: Tensor | None, eps: float, rms: bool,
         zero_centered_gamma: bool, dropout_seed: Tensor | None = None, dropout_p: float = 0.0
         ) -> tuple[Tensor, Tensor, Tensor | None, Tensor]:
    """(s, y32, mean, rstd)."""
    s = _sum_input(x, residual, dropout_seed, dropout_p)
    s32 = s.to(torch.float32)
    mean, rstd = _stats(s32, eps, rms)
    y = _normalize(s32, mean, rstd) * _gamma(weight, zero_centered_gamma)
    if bias is not None:
        y = y + bias.to(torch.float32)
    return s, y, mean, rstd


def norm_fwd(
    x: Tensor,
    residual: Tensor | None,
    weight: Tensor,
    bias: Tensor | None,
    eps: float,
    rms: bool,
    zero_centered_gamma: bool,
    store_y: bool,
    scale: Tensor | None,
    amax_in: Tensor | None,
    margin: int,
    power_2: bool,
    out_dtype: torch.dtype | None,
    transpose: bool,
    dropout_seed: Tensor | None = None,
    dropout_p: float = 0.0,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Reference of ``fp8ops::norm_fwd``: ``(y, s, q, q_t, amax, inv_scale, mean, rstd)``.

    x: (M, K); unused outputs are distinct empty tensors. ``scale`` None means 1; with ``amax_in``
    the scale is computed just in time (``compute_scale``, ``scale`` the fallback). With
    ``dropout_seed`` (a residual required) x is dropped with probability ``dropout_p`` before the add.
    """
    f32 = torch.float32
    s, y32, mean, rstd = _y32(x, residual, weight, bias, eps, rms, zero_centered_gamma, dropout_seed, dropout_p)
    y = y32.to(x.dtype) if store_y else x.new_empty(0)
    s_out = s.clone() if residual is not None else x.new_empty(0)
    if out_dtype is not None:
        fallback = scale if scale is not None else torch.ones((), dtype=f32, device=x.device)
        sc = fallback
        if amax_in is not None:
            sc = compute_scale(amax_in, fallback, fp8_max_of(out_dtype), margin=margin, power_2_scale=power_2)
        q = saturating_cast(y32, sc, out_dtype)
        q_t = q.t().contiguous() if transpose else x.new_empty(0, dtype=out_dtype)
        inv = torch.reciprocal(sc.to(f32))
    else:
        q, q_t, inv = x.new_empty(0), x.new_empty(0), x.new_empty(0, dtype=f32)
    mean_out = x.new_empty(0, dtype=f32) if mean is None else mean
    return y, s_out, q, q_t, _amax(y32), inv, mean_out, rstd


def norm_amax(x: Tensor, residual: Tensor | None, weight: Tensor, bias: Tensor | None, eps: float, rms: bool,
              zero_centered_gamma: bool, dropout_seed: Tensor | None = None, dropout_p: float = 0.0) -> Tensor:
    """Reference of ``fp8ops::norm_amax``: max |y32| as a () float32 tensor (0 when M == 0)."""
    return _amax(_y32(x, residual, weight, bias, eps, rms, zero_centered_gamma, dropout_seed, dropout_p)[1])


def norm_bwd(
    dy: Tensor,
    s: Tensor,
    weight: Tensor,
    mean: Tensor,
    rstd: Tensor,
    ds: Tensor | None,
    rms: bool,
    zero_centered_gamma: bool,
    has_bias: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """Reference of ``fp8ops::norm_bwd``: ``(dx, dweight, dbias)``.

    dx (M, K) in s's dtype; dweight, dbias (K,) in weight's dtype (dbias empty without a bias).
    """
    dx, dweight, dbias = _norm_bwd32(dy, s, weight, mean, rstd, ds, rms, zero_centered_gamma, has_bias)
    return dx.to(s.dtype), dweight, dbias


def norm_bwd_dropout(
    dy: Tensor,
    s: Tensor,
    weight: Tensor,
    mean: Tensor,
    rstd: Tensor,
    ds: Tensor | None,
    rms: bool,
    zero_centered_gamma: bool,
    has_bias: bool,
    dropout_seed: Tensor,
    dropout_p: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Reference of ``fp8ops::norm_bwd_dropout``: ``(dx, dx_branch, dweight, dbias)``, the backward
    of a forward whose input x was dropped before its residual add: dx is the gradient of s (the
    residual's), ``dx_branch = dx * branch_scale`` (from dx in float32) the gradient of x."""
    dx, dweight, dbias = _norm_bwd32(dy, s, weight, mean, rstd, ds, rms, zero_centered_gamma, has_bias)
    dxb = dx * branch_scale(dropout_seed, s.shape[0], s.shape[1], dropout_p, s.device)
    return dx.to(s.dtype), dxb.to(s.dtype), dweight, dbias


def _norm_bwd32(dy: Tensor, s: Tensor, weight: Tensor, mean: Tensor, rstd: Tensor, ds: Tensor | None, rms: bool,
                zero_centered_gamma: bool, has_bias: bool) -> tuple[Tensor, Tensor, Tensor]:
    # (dx in float32, dweight, dbias)
    f32 = torch.float32
    dy32 = dy.to(f32)
    xh = _normalize(s.to(f32), None if rms else mean, rstd)
    gdy = dy32 * _gamma(weight, zero_centered_gamma)
    c2 = (gdy * xh).mean(dim=1, keepdim=True)
    if rms:
        dx = (gdy - xh * c2) * rstd[:, None]
    else:
        dx = (gdy - gdy.mean(dim=1, keepdim=True) - xh * c2) * rstd[:, None]
    if ds is not None:
        dx = dx + ds.to(f32)
    dweight = (dy32 * xh).sum(dim=0).to(weight.dtype)
    dbias = dy32.sum(dim=0).to(weight.dtype) if has_bias else weight.new_empty(0)
    return dx, dweight, dbias


def norm32(x: Tensor, weight: Tensor, bias: Tensor | None, *, eps: float, rms: bool,
           zero_centered_gamma: bool) -> Tensor:
    """The normalised output of the rows of ``x`` (M, K) in float32, differentiable with autograd."""
    return _y32(x, None, weight, bias, eps, rms, zero_centered_gamma)[1]


def norm32_leaves(x: Tensor, weight: Tensor, bias: Tensor | None, *, normalization: str, eps: float,
                  zero_centered_gamma: bool) -> tuple[list[Tensor], Tensor]:
    """The norm in front of a GEMM, for the references of the fused ops: float32 leaves
    ``[x (M, K), weight, bias (if any)]`` that require grad, and their normalised output (M, K)."""
    K = weight.shape[-1]
    leaves = [t.detach().to(torch.float32).requires_grad_() for t in (x.reshape(-1, K), weight, bias) if t is not None]
    beta = leaves[2] if bias is not None else None
    ln = norm32(leaves[0], leaves[1], beta, rms=normalization == "RMSNorm", eps=eps,
                zero_centered_gamma=zero_centered_gamma)
    return leaves, ln


def layer_norm(x: Tensor, weight: Tensor, bias: Tensor | None, *, eps: float = 1e-5,
               zero_centered_gamma: bool = False, residual: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """Reference of :func:`fp8ops.layer_norm` (forward): y (..., K) in x's dtype, or (y, s)."""
    return _public(x, residual, weight, bias, eps, False, zero_centered_gamma)


def rms_norm(x: Tensor, weight: Tensor, *, eps: float = 1e-5, zero_centered_gamma: bool = False,
             residual: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """Reference of :func:`fp8ops.rms_norm` (forward): y (..., K) in x's dtype, or (y, s)."""
    return _public(x, residual, weight, None, eps, True, zero_centered_gamma)


def _public(x: Tensor, residual: Tensor | None, weight: Tensor, bias: Tensor | None, eps: float, rms: bool,
            zero_centered_gamma: bool) -> Tensor | tuple[Tensor, Tensor]:
    K = x.shape[-1]
    r2 = None if residual is None else residual.reshape(-1, K)
    s, y32, _, _ = _y32(x.reshape(-1, K), r2, weight, bias, eps, rms, zero_centered_gamma)
    y = y32.to(x.dtype).reshape(x.shape)
    return y if residual is None else (y, s.reshape(x.shape))
