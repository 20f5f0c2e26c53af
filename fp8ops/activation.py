"""MLP activations: the differentiable high-precision op and the fused activation + FP8 cast wrappers.

``activation(h, act)`` is the activation of an MLP in high precision, differentiable (forward and
backward each one kernel launch on CUDA). ``act_quantize`` and ``dact_quantize`` are the internal
building blocks of the FP8 MLP (:func:`fp8ops.fused_ln_mlp`): the activation fused with the FP8 cast
of fc2's input in forward, and the activation gradient fused with the FP8 cast of fc1's output
gradient (and the bias gradient) in backward.

Activations (``ACTIVATIONS``): gelu, gelu_tanh, relu, squared_relu, silu, qgelu, and the gated
``GATED`` = swiglu, geglu, reglu, for which ``h = [a | b]`` (M, 2F) and the output is
``act(a) * b`` (TransformerEngine's convention). The math is in :mod:`fp8ops.reference.activation`
and ``docs/kernels/activation.md``.
"""

from __future__ import annotations

import inspect
import math
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ._glue import apply, refuse_compiled_transform
from ._checks import check_float_tensor
from .kernels import activation as _K
from .kernels._library import OPS, define as _define
from .quantize import QuantSpec, _loop_vmap
from .reference import activation as _ref

__all__ = [
    "ACTIVATIONS",
    "GATED",
    "ActQuantized",
    "DactQuantized",
    "act_quantize",
    "activation",
    "check_activation",
    "dact_quantize",
]

ACTIVATIONS: tuple[str, ...] = _ref.ACTIVATIONS
"""Names of the supported activations."""

GATED: tuple[str, ...] = _ref.GATED
"""The gated activations: ``h = [a | b]`` (..., 2F), output ``act(a) * b`` (..., F)."""

_ops = OPS


def check_activation(name: Any, where: str) -> str:
    """``name`` if it is one of :data:`ACTIVATIONS`, else a ValueError that lists the valid names.

    Example:
        >>> from fp8ops.activation import check_activation
        >>> check_activation("swiglu", "fused_ln_mlp")
        'swiglu'
    """
    if not isinstance(name, str) or name not in ACTIVATIONS:
        raise ValueError(f"{where}: activation must be one of {', '.join(map(repr, ACTIVATIONS))}; got {name!r}")
    return name


def _output_width(h: Tensor, act: str, where: str) -> int:
    C = h.shape[-1]
    if act in GATED:
        if C % 2:
            raise ValueError(
                f"{where}: the gated activation {act!r} splits h's last dim into [a | b] halves and needs it "
                f"even (2F), got shape {tuple(h.shape)}"
            )
        return C // 2
    return C


# ------------------------------------------------------------------------------------------------
# Fused activation + FP8 cast (internal building blocks of the FP8 MLP)


class ActQuantized(NamedTuple):
    """Outputs of :func:`act_quantize`.

    Attributes:
        data: (M, F) FP8 ``act(h)``, or None when ``store_q=False``.
        inv_scale: () float32, ``1 / scale``.
        data_t: (F, M) FP8 transposed copy, or None without ``transpose``.
        amax: () float32 ``max |act(h)|`` (to record in the state).
        y: (M, F) ``act(h)`` in h's dtype, or None without ``store_y``.
    """

    data: Tensor | None
    inv_scale: Tensor
    data_t: Tensor | None
    amax: Tensor
    y: Tensor | None


class DactQuantized(NamedTuple):
    """Outputs of :func:`dact_quantize`.

    Attributes:
        data: (M, C) FP8 ``dh = da * act'(h)``.
        inv_scale: () float32, ``1 / scale``.
        data_t: (C, M) FP8 transposed copy, or None without ``transpose``.
        amax: () float32 ``max |dh|``.
        dh: (M, C) ``dh`` in h's dtype, or None without ``store_dh``.
        dbias: (C,) float32 column sums of ``dh`` (the fc1 bias gradient), or None without ``dbias``.
    """

    data: Tensor
    inv_scale: Tensor
    data_t: Tensor | None
    amax: Tensor
    dh: Tensor | None
    dbias: Tensor | None


def _needs_amax_pass(spec: QuantSpec, where: str) -> bool:
    if spec.mode == "rowwise":
        raise ValueError(
            f"{where}: row-wise scaling is not supported by the fused activation kernels; compute the "
            "activation in high precision (fp8ops.activation) and quantize it with fp8ops.quantize"
        )
    return spec.mode != "delayed" or not spec.calibrated


def _check_2d(t: Tensor, name: str, where: str) -> None:
    check_float_tensor(t, name, where, min_dim=2)
    if t.dim() != 2:
        raise ValueError(f"{where}: {name} must be 2-D (M, C), got shape {tuple(t.shape)}; flatten leading dims first")


def act_quantize(
    h: Tensor,
    act: str,
    scale: Tensor | None,
    spec: QuantSpec,
    *,
    transpose: bool,
    store_q: bool = True,
    store_y: bool = False,
) -> ActQuantized:
    """``act(h)`` cast to FP8 in the same pass (fc2's input in an FP8 MLP). Internal to fp8ops ops.

    Math::

        a = act(h)  (float32);  q = rne(sat(a * s));  amax = max |a|;  inv = 1 / s
        s = scale (delayed, calibrated) or fmax / amax(a) / 2**margin (current / uncalibrated)

    Current scaling (or an uncalibrated delayed state) is two launches: ``act_amax``, then the
    fused ``act_fwd``; calibrated delayed scaling is one.

    Args:
        h: (M, C) float32/bfloat16/float16; C = 2F for gated activations.
        act: one of :data:`ACTIVATIONS`.
        scale: the state's () float32 scale, or None (fallback scale 1).
        spec: the :class:`~fp8ops.quantize.QuantSpec` of the role (mode "delayed" or "current").
        transpose: also write the (F, M) transposed copy.
        store_q: write the (M, F) FP8 data (False when only the transposed copy is needed).
        store_y: also write ``act(h)`` in h's dtype.

    Returns:
        :class:`ActQuantized` ``(data, inv_scale, data_t, amax, y)``.

    Raises:
        ValueError: unknown activation, odd width for a gated activation, row-wise mode.

    Example:
        >>> import torch
        >>> from fp8ops.activation import act_quantize
        >>> from fp8ops.quantize import QuantSpec
        >>> spec = QuantSpec("current", torch.float8_e4m3fn, 0, False, False)
        >>> r = act_quantize(torch.randn(4, 6), "swiglu", None, spec, transpose=True)
        >>> r.data.shape, r.data_t.shape, r.y is None
        (torch.Size([4, 3]), torch.Size([3, 4]), True)

    References:
        NVIDIA Transformer Engine, fused activation + cast kernels.
    """
    where = "act_quantize"
    check_activation(act, where)
    _check_2d(h, "h", where)
    _output_width(h, act, where)
    amax_in = _ops.act_amax(h, act) if _needs_amax_pass(spec, where) else None
    y, q, q_t, amax, inv = _ops.act_fwd(h, act, store_y, scale, amax_in, spec.margin, spec.power_2, spec.dtype,
                                        store_q, transpose)
    return ActQuantized(q if store_q else None, inv, q_t if transpose else None, amax, y if store_y else None)


def dact_quantize(
    da: Tensor,
    h: Tensor,
    act: str,
    scale: Tensor | None,
    spec: QuantSpec,
    *,
    transpose: bool,
    dbias: bool,
    store_dh: bool = False,
) -> DactQuantized:
    """``dh = da * act'(h)`` cast to FP8 in the same pass (fc1's output gradient). Internal.

    Math::

        dh = da * act'(h)  (float32; gated: d a = (da b) act'(a), d b = da act(a))
        q = rne(sat(dh * s));  amax = max |dh|;  dbias = sum over rows of dh

    Args:
        da: (M, F) gradient of the activation output (fc2's input gradient).
        h: (M, C) the activation input saved from forward; C = 2F for gated activations.
        act: one of :data:`ACTIVATIONS`.
        scale: the state's () float32 scale, or None (fallback scale 1).
        spec: the :class:`~fp8ops.quantize.QuantSpec` of the gradient role.
        transpose: also write the (C, M) transposed copy (wgrad's operand).
        dbias: also return the (C,) float32 bias gradient.
        store_dh: also write ``dh`` in h's dtype.

    Returns:
        :class:`DactQuantized` ``(data, inv_scale, data_t, amax, dh, dbias)``.

    Raises:
        ValueError: unknown activation, bad shapes, row-wise mode.

    Example:
        >>> import torch
        >>> from fp8ops.activation import dact_quantize
        >>> from fp8ops.quantize import QuantSpec
        >>> spec = QuantSpec("delayed", torch.float8_e5m2, 0, False, True)
        >>> r = dact_quantize(torch.randn(4, 6), torch.randn(4, 6), "gelu", torch.tensor(8.0), spec,
        ...                   transpose=False, dbias=True)
        >>> r.data.dtype, r.dbias.shape, r.inv_scale
        (torch.float8_e5m2, torch.Size([6]), tensor(0.1250))

    References:
        NVIDIA Transformer Engine, fused dact + cast + dbias kernels.
    """
    where = "dact_quantize"
    check_activation(act, where)
    _check_2d(h, "h", where)
    _check_2d(da, "da", where)
    F = _output_width(h, act, where)
    if da.shape != (h.shape[0], F):
        raise ValueError(
            f"{where}: da must have shape (M, F) = {(h.shape[0], F)} for h of shape {tuple(h.shape)} and "
            f"act={act!r}, got {tuple(da.shape)}"
        )
    amax_in = _ops.act_bwd_amax(da, h, act) if _needs_amax_pass(spec, where) else None
    dh, q, q_t, amax, inv, db = _ops.act_bwd(da, h, act, store_dh, scale, amax_in, spec.margin, spec.power_2,
                                             spec.dtype, transpose, dbias)
    return DactQuantized(q, inv, q_t if transpose else None, amax, dh if store_dh else None, db if dbias else None)


# ------------------------------------------------------------------------------------------------
# High-precision differentiable activation


class _Activation(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(h: Tensor, act: str) -> Tensor:  # type: ignore[override]
        return _ops.act_fwd(h, act, True, None, None, 0, False, None, False, False)[0]

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        h, act = inputs
        ctx.save_for_backward(h)
        ctx.act = act

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        (h,) = ctx.saved_tensors
        with torch.no_grad():
            dh = _ops.act_bwd(dy, h, ctx.act, True, None, None, 0, False, None, False, False)[0]
        return dh, None


# Under torch.compile and torch.func, autograd.Function.apply binds the arguments with
# inspect.signature(forward) on every call (eager calls skip the binding: _glue.apply).
_Activation.forward.__signature__ = inspect.signature(_Activation.forward)  # type: ignore[attr-defined]


def activation(h: Tensor, act: str) -> Tensor:
    """A differentiable MLP activation in high precision (fp32 math, output in h's dtype).

    Math::

        gelu(x) = x Phi(x);  gelu_tanh(x) = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
        relu(x) = max(x, 0);  squared_relu(x) = relu(x)^2
        silu(x) = x sigmoid(x);  qgelu(x) = x sigmoid(1.702 x)
        swiglu(h) = silu(a) b,  geglu(h) = gelu_tanh(a) b,  reglu(h) = relu(a) b,  h = [a | b]

    Forward and backward are one kernel launch each on CUDA (the backward recomputes act'(h)
    from the saved input). Works with autograd, ``torch.func`` (grad, vjp, vmap) and
    ``torch.compile(fullgraph=True)`` + ``.backward()``.

    Args:
        h: (..., C) float32, bfloat16 or float16; C = 2F for gated activations.
        act: one of :data:`ACTIVATIONS`.

    Returns:
        (..., F) in h's dtype (F = C, or C / 2 when gated).

    Raises:
        TypeError, ValueError: h is not a float tensor, the activation is unknown, or a gated
            activation gets an odd last dim.

    Example:
        >>> import torch
        >>> from fp8ops.activation import activation
        >>> h = torch.tensor([[-1.0, 0.0, 2.0, 1.0, 3.0, 0.5]], requires_grad=True)
        >>> y = activation(h, "reglu")  # relu([-1, 0, 2]) * [1, 3, 0.5]
        >>> y.tolist()
        [[0.0, 0.0, 1.0]]
        >>> y.sum().backward()
        >>> h.grad
        tensor([[0.0000, 0.0000, 0.5000, 0.0000, 0.0000, 2.0000]])

    References:
        Hendrycks & Gimpel, "Gaussian Error Linear Units" (2016); Shazeer, "GLU Variants Improve
        Transformer" (2020); So et al., "Primer" (2021).
    """
    where = "activation"
    check_float_tensor(h, "h", where, min_dim=1)
    check_activation(act, where)
    F = _output_width(h, act, where)
    lead = h.shape[:-1]
    h2 = h.reshape(math.prod(lead), h.shape[-1])
    refuse_compiled_transform(where, h)
    y = apply(_Activation, h2, act)
    return y.reshape(*lead, F)


# ------------------------------------------------------------------------------------------------
# The library ops, every kernel side by side: CUDA and fake kernels from kernels/<stem>.py, the CPU
# kernel is the reference math; then their vmap rules.

_define(_K.act_fwd, cpu=_ref.act_fwd)
_define(_K.act_amax, cpu=_ref.act_amax)
_define(_K.act_bwd, cpu=_ref.act_bwd)
_define(_K.act_bwd_amax, cpu=_ref.act_bwd_amax)

for _name in ("act_fwd", "act_amax", "act_bwd", "act_bwd_amax"):
    torch.library.register_vmap(f"fp8ops::{_name}", _loop_vmap(getattr(_ops, _name)))
