"""GEMM operands and GEMMs shared by the linear-family ops (``fp8_linear``, ``layernorm_linear``,
``fused_ln_mlp``): quantizing an operand together with its K-major transposed copy, quantizing
an output gradient, the three GEMMs of a linear layer in FP8 or high precision, a weight's
operands, and the normalisation that feeds a GEMM directly with its FP8 output.

Every operand is K-major (row-major with the contraction dimension last), the layout Hopper's FP8
tensor cores need::

    fprop  y  = x  . W^T     xq (M, K)  x  wq   (N, K)
    dgrad  dx = dy . W       dyq (M, N) x  wq^T (K, N)
    wgrad  dW = dy^T . x     dyq^T (N, M) x xq^T (K, M)
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from . import norm as _norm  # noqa: F401  (registers the fp8ops:: norm ops)
from ._glue import cast
from .gemm import scaled_mm
from .kernels._library import OPS
from .quantize import QuantSpec, cast_scale, quantize_2d, quantize_2d_dbias
from .recipes import GemmSpec

__all__ = [
    "HIGH",
    "NormCfg",
    "bias_grad",
    "cached_dgrad_operand",
    "dgrad_weight",
    "gemm_dgrad",
    "gemm_fprop",
    "gemm_wgrad",
    "head_views",
    "hp_linear",
    "norm_backward",
    "norm_operands",
    "or_empty",
    "quantize_grad",
    "quantize_grad_db",
    "quantize_grad_heads",
    "quantize_pair",
    "quantize_weight_operands",
]

_ops = OPS


def hp_linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``x . weight^T + bias`` in ``x``'s dtype with torch's own linear (no FP8, no kernel of ours);
    gradients flow back in each argument's dtype. Also the K = 0 result: the bias broadcast."""
    return torch.nn.functional.linear(x, cast(weight, x.dtype), None if bias is None else cast(bias, x.dtype))


def quantize_pair(t: Tensor, scale: Tensor | None, spec: QuantSpec, need_t: bool
                   ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(q, inv, q_t, inv_t, amax) of an (R, C) tensor; q_t (C, R) is K-major for the other GEMM.

    Per-tensor scaling writes both in one pass; row-wise scaling quantizes the transpose with its
    own row scales (per column of ``t``), the layout a row-wise scaled GEMM needs.
    """
    if spec.mode == "rowwise":
        q, inv, _, amax = quantize_2d(t, scale, spec)
        if not need_t:
            return q, inv, t.new_empty(0, dtype=q.dtype), inv.new_empty(0), amax
        q_t, inv_t, _, _ = quantize_2d(t.t().contiguous(), scale, spec)
        return q, inv, q_t, inv_t, amax
    q, inv, q_t, amax = quantize_2d(t, scale, spec, transpose=need_t)
    if q_t is None:
        q_t = t.new_empty(0, dtype=q.dtype)
    return q, inv, q_t, inv, amax


def quantize_grad(dy: Tensor, g_scale: Tensor, spec: QuantSpec, has_probe: bool, need_q: bool, need_t: bool
                   ) -> tuple[Tensor | None, Tensor | None, Tensor | None, Tensor | None, Tensor]:
    """(q, inv, q_t, inv_t, amax) of an output gradient; without a probe, current scaling.

    ``q`` feeds the dgrad GEMM and ``q_t`` the wgrad GEMM; with neither needed only the amax (the
    observation) is computed.
    """
    return quantize_grad_db(dy, g_scale, spec, has_probe, need_q, need_t, False)[:5]


FUSE_DBIAS = False
"""Whether :func:`quantize_grad_db` takes the bias gradient from the quantizing pass
(``fp8ops::cast_transpose_dbias``: per-tile column sums and one fixed-order finishing kernel) or
from ``dy.sum(0)`` (False, the default), in every execution mode alike, so that eager and compiled
steps compute the same bias gradients. Under ``torch.compile`` ``dy.sum(0)`` is Inductor's: a
reduction of its own, or fused into the kernel that assembles dy where that kernel is Inductor's
(the QKV projection's dy, the concatenation of dq, dk, dv). ``scripts/gpt_ab_check.py`` times
compiled, graphed GPT steps with the flag off and on."""


def bias_grad(dy: Tensor, dtype: torch.dtype) -> Tensor:
    """``dy.sum(0)`` in ``dtype``, summed in float32 and rounded once: one reduction kernel that
    writes ``dtype`` where that is dy's dtype or float32 (a reduction takes its input in the output
    dtype, so any other would round each element first), else a float32 sum and a conversion."""
    if dtype == dy.dtype or dtype == torch.float32:
        return dy.sum(0, dtype=dtype)
    return dy.sum(0, dtype=torch.float32).to(dtype)


def quantize_grad_db(dy: Tensor, g_scale: Tensor, spec: QuantSpec, has_probe: bool, need_q: bool, need_t: bool,
                     need_db: bool, db_dtype: torch.dtype = torch.float32
                     ) -> tuple[Tensor | None, Tensor | None, Tensor | None, Tensor | None, Tensor, Tensor | None]:
    """:func:`quantize_grad` plus, with ``need_db``, the column sums of dy (the bias gradient) in
    ``db_dtype``, summed in float32: ``(q, inv, q_t, inv_t, amax, db)``. The sums are
    :func:`bias_grad`'s (rounded once to ``db_dtype``), or, with
    :data:`FUSE_DBIAS` on where the cast writes the transposed copy with a per-tensor scale, come
    out of that same pass over dy."""
    if not (need_q or need_t):
        return None, None, None, None, _ops.amax(dy), (bias_grad(dy, db_dtype) if need_db else None)
    if not has_probe:  # nothing is recorded: the scale comes from this gradient's own amax
        spec = spec._replace(calibrated=False)
    scale = g_scale if has_probe else None
    if need_db and need_t and spec.mode != "rowwise" and FUSE_DBIAS:
        q, inv, q_t, amax, db = quantize_2d_dbias(dy, scale, spec)
        return q, inv, q_t, inv, amax, db.to(db_dtype)
    q, inv, q_t, inv_t, amax = quantize_pair(dy, scale, spec, need_t)
    return q, inv, q_t, inv_t, amax, (bias_grad(dy, db_dtype) if need_db else None)


def quantize_grad_heads(dq: Tensor, dk: Tensor, dv: Tensor, g_scale: Tensor, spec: QuantSpec, has_probe: bool,
                        db_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """:func:`quantize_grad_db` (both operands, the bias sums) of a QKV projection's output gradient
    given as attention's dq, dk, dv (B, H, S, D): one pass over them where they lie
    (``fp8ops::cast_transpose_heads``), without their concatenation. Per-tensor scaling only."""
    if not has_probe:
        spec = spec._replace(calibrated=False)
    scale, amax_in = cast_scale((dq, dk, dv), g_scale if has_probe else None, spec)
    q, q_t, amax, inv, db = _ops.cast_transpose_heads(dq, dk, dv, scale, amax_in, spec.margin, spec.power_2,
                                                      spec.dtype)
    return q, inv, q_t, inv, amax, db.to(db_dtype)


def head_views(y: Tensor, batch: int, hq: int, hkv: int, d: int) -> tuple[Tensor, Tensor, Tensor]:
    """Attention's q, k, v (B, h, S, d) views of a QKV projection output y: (S B, (hq + 2 hkv) d)
    rows in (s, b) order, or (S, B, (hq + 2 hkv) d)."""
    y3 = y.reshape(-1, batch, y.shape[-1])
    q, k, v = y3.split([hq * d, hkv * d, hkv * d], dim=-1)
    return tuple(t.unflatten(-1, (t.shape[-1] // d, d)).permute(1, 2, 0, 3) for t in (q, k, v))  # type: ignore[return-value]


def gemm_fprop(xq: Tensor | None, x_inv: Tensor | None, x: Tensor | None, wq: Tensor | None,
               w_inv: Tensor | None, w: Tensor | None, bias: Tensor | None, spec: GemmSpec,
               out_dtype: torch.dtype) -> Tensor:
    """``y = x . W^T + b`` (M, N): FP8 operands (M, K) x (N, K) when ``spec`` says fp8, else high precision."""
    if spec.precision == "fp8":
        return scaled_mm(xq, wq, x_inv, w_inv, bias=bias, out_dtype=out_dtype, fast_accum=spec.fast_accum, backend=spec.backend)
    assert x is not None and w is not None
    b = None if bias is None else cast(bias, x.dtype)
    return cast(torch.nn.functional.linear(x, cast(w, x.dtype), b), out_dtype)


def gemm_dgrad(dyq: Tensor | None, dy_inv: Tensor | None, dy: Tensor, wq_t: Tensor | None,
               w_inv_t: Tensor | None, w: Tensor | None, spec: GemmSpec, out_dtype: torch.dtype) -> Tensor:
    """``dx = dy . W`` (M, K): FP8 operands (M, N) x (K, N) when ``spec`` says fp8, else high precision."""
    if spec.precision == "fp8":
        return scaled_mm(dyq, wq_t, dy_inv, w_inv_t, out_dtype=out_dtype, fast_accum=spec.fast_accum, backend=spec.backend)
    assert w is not None
    return cast(dy @ cast(w, dy.dtype), out_dtype)


def gemm_wgrad(dyq_t: Tensor | None, dy_inv_t: Tensor | None, dy: Tensor, xq_t: Tensor | None,
               x_inv_t: Tensor | None, x: Tensor | None, spec: GemmSpec, out_dtype: torch.dtype) -> Tensor:
    """``dW = dy^T . x`` (N, K): FP8 operands (N, M) x (K, M) when ``spec`` says fp8, else high precision."""
    if spec.precision == "fp8":
        return scaled_mm(dyq_t, xq_t, dy_inv_t, x_inv_t, out_dtype=out_dtype, fast_accum=spec.fast_accum, backend=spec.backend)
    assert x is not None
    return cast(dy.t() @ cast(x, dy.dtype), out_dtype)


def quantize_weight_operands(w: Tensor, w_scale: Tensor | None, spec: QuantSpec | None, fp8_fprop: bool,
                             need_t: bool) -> tuple[Tensor | None, Tensor | None, Tensor | None, Tensor | None, Tensor]:
    """(wq, inv, wq_t, inv_t, amax) of a weight for the fprop GEMM and (transposed) the dgrad GEMM.

    ``spec=None`` (no FP8): nothing is quantized and the amax is an empty placeholder.
    """
    if spec is None:
        return None, None, None, None, w.new_empty(0, dtype=torch.float32)
    if fp8_fprop or need_t:
        return quantize_pair(w, w_scale, spec, need_t)
    return None, None, None, None, _ops.amax(w)


def cached_dgrad_operand(c_data: Tensor | None, c_data_t: Tensor | None, c_inv: Tensor | None,
                         c_inv_t: Tensor | None) -> tuple[Tensor | None, Tensor | None, bool]:
    """``(operand, inverse scale, transpose later)`` of a cached weight for the dgrad GEMM, saved for
    the backward pass: the cache's transposed copy (K, N), or, when the cache holds none (an FSDP2
    weight all-gathered in FP8), its (N, K) bytes themselves, to be transposed by
    :func:`dgrad_weight` in the backward pass (one scale per tensor: its inverse serves both)."""
    if c_data_t is not None:
        return c_data_t, (c_inv_t if c_inv_t is not None else c_inv), False
    return c_data, c_inv, True


def dgrad_weight(wq_t: Tensor | None, later: bool) -> Tensor | None:
    """The dgrad GEMM's K-major weight operand from what :func:`cached_dgrad_operand` saved."""
    return _ops.transpose_bytes(wq_t) if later and wq_t is not None else wq_t


def or_empty(t: Tensor | None, x: Tensor) -> Tensor:
    """``t``, or a fresh empty placeholder (one tensor must never be two outputs of a Function)."""
    return x.new_empty(0) if t is None else t


HIGH = GemmSpec(precision="high")
"""The GEMMs of the no-FP8 path: the operands in their own dtype."""


class NormCfg(NamedTuple):
    """Static description of the normalisation in front of a GEMM."""

    rms: bool
    eps: float
    zero_centered: bool
    has_bias: bool


def norm_operands(
    x: Tensor, w: Tensor, b: Tensor | None, ncfg: NormCfg, scale: Tensor | None, spec: QuantSpec | None,
    *, need_q: bool, need_t: bool, need_hp: bool, residual: Tensor | None = None,
    dropout: tuple[Tensor, float] | None = None,
) -> tuple[Tensor | None, Tensor | None, Tensor | None, Tensor | None, Tensor | None, Tensor, Tensor, Tensor,
           Tensor | None]:
    """Normalise ``x`` (M, K) into the forms the following GEMMs need, in one kernel where it can.

    Returns ``(hp, q, inv, q_t, inv_t, amax, mean, rstd, s)``: ``hp`` the normalised output in
    ``x.dtype`` (when ``need_hp``), ``q`` / ``q_t`` its FP8 copy (M, K) / (K, M) with inverse
    scales, ``amax`` of the normalised output, ``mean`` / ``rstd`` the saved statistics, and ``s``:
    with a ``residual`` (M, K) the kernel normalises ``s = x + residual`` (added in fp32, rounded to
    x's dtype) and returns it, else None; with ``dropout`` ``(seed, p)`` x is dropped first
    (``s = x * keep / (1 - p) + residual``, the kernels' hash mask). Row-wise scaling writes the
    high-precision output and quantizes it separately (per-row scales need the whole row's amax
    before the cast).
    """
    fp8 = need_q or need_t
    r = residual
    dseed, dp = dropout if dropout is not None else (None, 0.0)
    if not fp8 or spec is None or spec.mode == "rowwise":
        y, s, _, _, amax, _, mean, rstd = _ops.norm_fwd(
            x, r, w, b, ncfg.eps, ncfg.rms, ncfg.zero_centered, True, None, None, 0, False, None, False, dseed, dp
        )
        s = s if r is not None else None
        if not fp8 or spec is None:
            return y, None, None, None, None, amax, mean, rstd, s
        q, inv, q_t, inv_t, amax = quantize_pair(y, None, spec, need_t)
        return ((y if need_hp else None), q, inv, (q_t if need_t else None), (inv_t if need_t else None), amax, mean,
                rstd, s)
    if scale is None:
        scale = torch.ones((), dtype=torch.float32, device=x.device)
    amax_in = None
    if spec.mode != "delayed" or not spec.calibrated:
        amax_in = _ops.norm_amax(x, r, w, b, ncfg.eps, ncfg.rms, ncfg.zero_centered, dseed, dp)
    y, s, q, q_t, amax, inv, mean, rstd = _ops.norm_fwd(
        x, r, w, b, ncfg.eps, ncfg.rms, ncfg.zero_centered, need_hp, scale, amax_in,
        spec.margin, spec.power_2, spec.dtype, need_t, dseed, dp,
    )
    return ((y if need_hp else None), q, inv, (q_t if need_t else None), (inv if need_t else None), amax, mean, rstd,
            (s if r is not None else None))


def norm_backward(dln: Tensor, x: Tensor, w: Tensor, mean: Tensor, rstd: Tensor, ncfg: NormCfg,
                  ds: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor | None]:
    """``(dx, dweight, dbias)`` of the normalisation for the gradient ``dln`` of its output; ``x``
    is the normalised input (s with a residual), ``ds`` the gradient that reached s directly (the
    residual stream), added into dx in the same pass."""
    dx, dw, db = _ops.norm_bwd(dln.contiguous(), x, w, mean, rstd, None if ds is None else ds.contiguous(),
                               ncfg.rms, ncfg.zero_centered, ncfg.has_bias)
    return dx, dw, (db if ncfg.has_bias else None)


def norm_backward_dropout(dln: Tensor, s: Tensor, w: Tensor, mean: Tensor, rstd: Tensor, ncfg: NormCfg,
                          ds: Tensor | None, dropout: tuple[Tensor, float]
                          ) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """``(ds_total, dx, dweight, dbias)`` of a norm whose input x was dropped before its residual
    add (:func:`norm_operands` with ``dropout``): ``ds_total`` the gradient of s (the residual's),
    ``dx = ds_total * keep / (1 - p)`` the gradient of x, in one pass."""
    dsum, dx, dw, db = _ops.norm_bwd_dropout(dln.contiguous(), s, w, mean, rstd,
                                             None if ds is None else ds.contiguous(), ncfg.rms, ncfg.zero_centered,
                                             ncfg.has_bias, dropout[0], float(dropout[1]))
    return dsum, dx, dw, (db if ncfg.has_bias else None)


def act_operands(
    h: Tensor, act: str, scale: Tensor | None, spec: QuantSpec | None, *, need_q: bool, need_t: bool,
    need_hp: bool, amax_in: Tensor | None = None, h_inv: Tensor | None = None, hp_dtype: torch.dtype | None = None,
) -> tuple[Tensor | None, Tensor | None, Tensor | None, Tensor | None, Tensor | None, Tensor, Tensor | None]:
    """``act(h)`` in the forms fc2 needs: ``(hp, q, inv, q_t, inv_t, amax, amax_in)``.

    ``amax_in`` (current scaling, or a first uncalibrated step) is the amax the scale was computed
    from; passing it back in reproduces the same scale, so a recomputation writes the same bits.
    With ``h_inv``, h holds FP8 codes (read as ``code * h_inv``) and ``hp`` is of ``hp_dtype``.
    """
    fp8 = need_q or need_t
    if not fp8 or spec is None or spec.mode == "rowwise":
        y, _, _, amax, _ = _ops.act_fwd(h, act, True, None, None, 0, False, None, False, False, h_inv, hp_dtype)
        if not fp8 or spec is None:
            return y, None, None, None, None, amax, None
        q, inv, q_t, inv_t, amax = quantize_pair(y, None, spec, need_t)
        return (y if need_hp else None), q, inv, (q_t if need_t else None), (inv_t if need_t else None), amax, None
    if scale is None:
        scale = torch.ones((), dtype=torch.float32, device=h.device)
    if amax_in is None and (spec.mode != "delayed" or not spec.calibrated):
        amax_in = _ops.act_amax(h, act, h_inv)
    y, q, q_t, amax, inv = _ops.act_fwd(
        h, act, need_hp, scale, amax_in, spec.margin, spec.power_2, spec.dtype, need_q, need_t, h_inv, hp_dtype
    )
    return ((y if need_hp else None), (q if need_q else None), inv, (q_t if need_t else None),
            (inv if need_t else None), amax, amax_in)


def dact_operands(
    da: Tensor, h: Tensor, act: str, g_scale: Tensor | None, spec: QuantSpec | None, has_probe: bool, *,
    need_q: bool, need_t: bool, need_hp: bool, dbias: bool, h_inv: Tensor | None = None,
    hp_dtype: torch.dtype | None = None,
) -> tuple[Tensor | None, Tensor | None, Tensor | None, Tensor | None, Tensor | None, Tensor, Tensor | None]:
    """``dh = da * act'(h)`` in the forms fc1's backward GEMMs need:
    ``(hp, q, inv, q_t, inv_t, amax, dbias)``; without a probe, current scaling. ``h_inv``,
    ``hp_dtype``: as :func:`act_operands`."""
    fp8 = need_q or need_t
    if not fp8 or spec is None or spec.mode == "rowwise":
        dh, _, _, amax, _, db = _ops.act_bwd(da, h, act, True, None, None, 0, False, None, False, dbias, h_inv,
                                             hp_dtype)
        db = db if dbias else None
        if not fp8 or spec is None:
            return dh, None, None, None, None, amax, db
        q, inv, q_t, inv_t, amax = quantize_grad(dh, g_scale, spec, has_probe, need_q, need_t)
        return (dh if need_hp else None), q, inv, q_t, inv_t, amax, db
    scale = g_scale
    if not has_probe or scale is None:  # nothing is recorded: the scale comes from this gradient
        spec = spec._replace(calibrated=False)
        scale = torch.ones((), dtype=torch.float32, device=h.device)
    amax_in = None
    if spec.mode != "delayed" or not spec.calibrated:
        amax_in = _ops.act_bwd_amax(da, h, act, h_inv)
    dh, q, q_t, amax, inv, db = _ops.act_bwd(
        da, h, act, need_hp, scale, amax_in, spec.margin, spec.power_2, spec.dtype, need_t, dbias, h_inv, hp_dtype
    )
    return ((dh if need_hp else None), q, inv, (q_t if need_t else None), (inv if need_t else None), amax,
            (db if dbias else None))
