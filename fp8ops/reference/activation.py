"""FP32 reference for the MLP activations and their fused FP8 casts: the executable specification
of ``kernels/activation.py``.

Math (all in float32; ``h`` (M, C), ``a32`` (M, F), C = 2F for gated activations)::

    gelu(x)         = 0.5 x (1 + erf(x / sqrt 2))
    gelu_tanh(x)    = x * sigmoid(2 sqrt(2/pi) (x + 0.044715 x^3))      # = 0.5 x (1 + tanh(u))
    relu(x)         = 0 where x < 0 else x                              # NaN stays NaN
    squared_relu(x) = relu(x)^2
    silu(x)         = x * sigmoid(x)
    qgelu(x)        = x * sigmoid(1.702 x)
    gated, h = [a | b]:  swiglu = silu(a) b,  geglu = gelu_tanh(a) b,  reglu = relu(a) b

    forward:  a32 = act(h);  y = a32.to(h.dtype);  q = rne(sat(a32 * s));  amax = max |a32|
    backward: dh32 = da * act'(h)  (gated: d a = (da b) act'(a), d b = da act(a));
              dh = dh32.to(h.dtype);  q = rne(sat(dh32 * s));  amax = max |dh32|;  dbias = sum_rows dh32

With ``h_inv``, h holds FP8 codes and every function reads ``h = code.float() * h_inv`` (the
kernels' FP8 input). FP8 is emulated by saturate-then-cast to torch's float8 dtypes
(:mod:`fp8ops.reference.quantize`).
``act_fwd``, ``act_amax``, ``act_bwd`` and ``act_bwd_amax`` have the signatures of the library ops
``fp8ops::act_*`` and are their CPU kernels.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..formats import fp8_max_of
from ..kernels import activation as _kernel_activation
from ..recipes import compute_scale
from .quantize import amax as _amax
from .quantize import saturating_cast

__all__ = [
    "ACTIVATIONS",
    "GATED",
    "act_amax",
    "act_bwd",
    "act_bwd_amax",
    "act_fwd",
    "activation",
    "activation_grad",
]

# One definition of the activation names, with the kernels (which import only torch and triton).
ACTIVATIONS: tuple[str, ...] = _kernel_activation.ACTIVATIONS
GATED: tuple[str, ...] = _kernel_activation.GATED
_BASE = {"swiglu": "silu", "geglu": "gelu_tanh", "reglu": "relu"}

_INV_SQRT_2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_TWO_SQRT_2_OVER_PI = 2.0 * math.sqrt(2.0 / math.pi)


def _check(act: str, h: Tensor, where: str) -> tuple[str, bool, int]:
    if act not in ACTIVATIONS:
        raise ValueError(f"{where}: act must be one of {', '.join(ACTIVATIONS)}; got {act!r}")
    gated = act in GATED
    if h.dim() < 1:
        raise ValueError(f"{where}: h must have at least 1 dimension (..., C), got shape {tuple(h.shape)}")
    C = h.shape[-1]
    if gated and C % 2:
        raise ValueError(
            f"{where}: a gated activation ({act}) needs h of even width (..., 2F) = [a | b], got shape {tuple(h.shape)}"
        )
    return _BASE.get(act, act), gated, C // 2 if gated else C


def _relu(x: Tensor) -> Tensor:
    return torch.where(x < 0, torch.zeros_like(x), x)


def _base_act(x: Tensor, act: str) -> Tensor:
    if act == "gelu":
        return 0.5 * x * (1.0 + torch.erf(x * _INV_SQRT_2))
    if act == "gelu_tanh":
        return x * torch.sigmoid(_TWO_SQRT_2_OVER_PI * (x + 0.044715 * x * x * x))
    if act == "relu":
        return _relu(x)
    if act == "squared_relu":
        r = _relu(x)
        return r * r
    if act == "silu":
        return x * torch.sigmoid(x)
    return x * torch.sigmoid(1.702 * x)  # qgelu


def _base_dact(x: Tensor, act: str) -> Tensor:
    if act == "gelu":
        cdf = 0.5 * (1.0 + torch.erf(x * _INV_SQRT_2))
        return cdf + x * (torch.exp(-0.5 * x * x) * _INV_SQRT_2PI)
    if act == "gelu_tanh":
        s = torch.sigmoid(_TWO_SQRT_2_OVER_PI * (x + 0.044715 * x * x * x))
        du = _TWO_SQRT_2_OVER_PI * (1.0 + 0.134145 * x * x)
        return s + x * (s * (1.0 - s)) * du
    if act == "relu":
        return (x > 0).to(x.dtype)
    if act == "squared_relu":
        return torch.where(x > 0, 2.0 * x, torch.zeros_like(x))
    if act == "silu":
        s = torch.sigmoid(x)
        return s * (1.0 + x * (1.0 - s))
    s = torch.sigmoid(1.702 * x)  # qgelu
    return s + 1.702 * x * (s * (1.0 - s))


def activation(h: Tensor, act: str) -> Tensor:
    """``act(h)`` in float32: h (..., C) -> (..., F), F = C / 2 for gated activations."""
    base, gated, F = _check(act, h, "activation")
    x = h.to(torch.float32)
    if gated:
        return _base_act(x[..., :F], base) * x[..., F:]
    return _base_act(x, base)


def activation_grad(da: Tensor, h: Tensor, act: str) -> Tensor:
    """``dh32 = da * act'(h)`` in float32: da (..., F), h (..., C) -> (..., C)."""
    base, gated, F = _check(act, h, "activation_grad")
    if da.shape != (*h.shape[:-1], F):
        raise ValueError(
            f"activation_grad: da must have shape {(*h.shape[:-1], F)} for h of shape {tuple(h.shape)} and "
            f"act={act!r}, got {tuple(da.shape)}"
        )
    x = h.to(torch.float32)
    d = da.to(torch.float32)
    if gated:
        a, b = x[..., :F], x[..., F:]
        return torch.cat([(d * b) * _base_dact(a, base), d * _base_act(a, base)], dim=-1)
    return d * _base_dact(x, base)


def _check_2d(h: Tensor, what: str, where: str) -> None:
    if h.dim() != 2:
        raise ValueError(f"{where}: {what} must be 2-D, got shape {tuple(h.shape)}")


def _fp8(
    v: Tensor,
    scale: Tensor | None,
    amax_in: Tensor | None,
    margin: int,
    power_2: bool,
    out_dtype: torch.dtype | None,
) -> tuple[Tensor | None, Tensor]:
    """``(q or None, inv_scale)``: the saturating cast of ``v`` with the given or just-in-time scale."""
    if out_dtype is None:
        return None, v.new_empty(0, dtype=torch.float32)
    s = scale if scale is not None else torch.ones((), dtype=torch.float32, device=v.device)
    if amax_in is not None:
        s = compute_scale(amax_in, s, fp8_max_of(out_dtype), margin=margin, power_2_scale=power_2)
    return saturating_cast(v, s, out_dtype), torch.reciprocal(s)


def _input(h: Tensor, h_inv: Tensor | None, hp_dtype: torch.dtype | None, store_hp: bool,
           where: str) -> tuple[Tensor, torch.dtype]:
    """``(h32, dtype of the high-precision output)``: h in float32, dequantized (``code * h_inv``)
    when it holds FP8 codes."""
    _check_2d(h, "h", where)
    if h.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        if h_inv is None:
            raise ValueError(f"{where}: h is {h.dtype} (FP8 codes); pass its inverse scale h_inv (a 0-d float32 tensor)")
        if hp_dtype is None and store_hp:
            raise ValueError(f"{where}: h is FP8, so the high-precision output needs a dtype: pass hp_dtype")
        return h.to(torch.float32) * h_inv, (hp_dtype if hp_dtype is not None else torch.bfloat16)
    if h_inv is not None:
        raise ValueError(f"{where}: h_inv is only for FP8 h, but h is {h.dtype}; pass h_inv=None")
    return h.to(torch.float32), (hp_dtype if hp_dtype is not None else h.dtype)


def act_fwd(
    h: Tensor,
    act: str,
    store_y: bool,
    scale: Tensor | None,
    amax_in: Tensor | None,
    margin: int,
    power_2: bool,
    out_dtype: torch.dtype | None,
    store_q: bool,
    transpose: bool,
    h_inv: Tensor | None = None,
    hp_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Reference of ``fp8ops::act_fwd``: ``(y (M, F), q (M, F), q_t (F, M), amax (), inv_scale ())``.

    Outputs that are not asked for are empty (0,) tensors (q, q_t of ``out_dtype``, or of h's dtype
    without one). ``scale`` None means 1. With ``h_inv``, h holds FP8 codes and the activation reads
    ``h = code * h_inv``; ``y`` is then of ``hp_dtype``.
    """
    h32, ydt = _input(h, h_inv, hp_dtype, store_y, "act_fwd")
    a32 = activation(h32, act)
    qdt = out_dtype if out_dtype is not None else h.dtype
    y = a32.to(ydt) if store_y else h.new_empty(0, dtype=ydt)
    if store_y and y is a32:
        y = a32.clone()
    q, inv = _fp8(a32, scale, amax_in, margin, power_2, out_dtype)
    empty = lambda: h.new_empty(0, dtype=qdt)
    q_out = q if (q is not None and store_q) else empty()
    q_t = q.t().contiguous() if (q is not None and transpose) else empty()
    return y, q_out, q_t, _amax(a32), inv


def act_amax(h: Tensor, act: str, h_inv: Tensor | None = None) -> Tensor:
    """Reference of ``fp8ops::act_amax``: max |act(h)| in float32 (NaN-propagating)."""
    h32, _ = _input(h, h_inv, None, False, "act_amax")
    return _amax(activation(h32, act))


def act_bwd(
    da: Tensor,
    h: Tensor,
    act: str,
    store_dh: bool,
    scale: Tensor | None,
    amax_in: Tensor | None,
    margin: int,
    power_2: bool,
    out_dtype: torch.dtype | None,
    transpose: bool,
    dbias: bool,
    h_inv: Tensor | None = None,
    hp_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Reference of ``fp8ops::act_bwd``:
    ``(dh (M, C), q (M, C), q_t (C, M), amax (), inv_scale (), dbias (C,))``; outputs that are not
    asked for are empty (0,) tensors. ``h_inv``, ``hp_dtype``: as :func:`act_fwd`."""
    h32, dhdt = _input(h, h_inv, hp_dtype, store_dh, "act_bwd")
    _check_2d(da, "da", "act_bwd")
    d32 = activation_grad(da, h32, act)
    qdt = out_dtype if out_dtype is not None else h.dtype
    dh = d32.to(dhdt) if store_dh else h.new_empty(0, dtype=dhdt)
    if store_dh and dh is d32:
        dh = d32.clone()
    q, inv = _fp8(d32, scale, amax_in, margin, power_2, out_dtype)
    empty = lambda: h.new_empty(0, dtype=qdt)
    q_out = q if q is not None else empty()
    q_t = q.t().contiguous() if (q is not None and transpose) else empty()
    db = d32.sum(dim=0) if dbias else h.new_empty(0, dtype=torch.float32)
    return dh, q_out, q_t, _amax(d32), inv, db


def act_bwd_amax(da: Tensor, h: Tensor, act: str, h_inv: Tensor | None = None) -> Tensor:
    """Reference of ``fp8ops::act_bwd_amax``: max |da * act'(h)| in float32 (NaN-propagating)."""
    h32, _ = _input(h, h_inv, None, False, "act_bwd_amax")
    _check_2d(da, "da", "act_bwd_amax")
    return _amax(activation_grad(da, h32, act))
