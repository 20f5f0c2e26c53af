"""Public quantize / dequantize ops and the FP8 value type.

``q, new_state = quantize(x, state, recipe=...)`` casts ``x`` to FP8 with the recipe's scaling and
returns a :class:`Float8Value` (FP8 data, inverse scale, optionally a transposed copy made in the
same pass) and the state with this call's amax recorded in ``pending_amax``.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import attrs
import torch
from torch import Tensor
from torch.utils import _pytree as pytree

from .kernels import quantize as _K
from .kernels._library import OPS, define as _define
from ._checks import FLOAT_DTYPES, check_float_tensor, check_recipe
from .formats import Role, check_role
from .recipes import Recipe
from .reference import quantize as _ref
from .state import ScalingState, validate_state

__all__ = ["Float8Value", "dequantize", "quantize"]

_ops = OPS


@attrs.frozen(init=False, eq=False, repr=False)
class Float8Value:
    """An FP8 tensor value: data, inverse scale and an optional transposed copy. Immutable pytree.

    Attributes:
        data: (..., K) FP8 (``torch.float8_e4m3fn`` or ``torch.float8_e5m2``).
        inv_scale: () float32 for one scale per tensor, or (..., 1) for one per row;
            ``dequantize`` multiplies by it (it is what ``torch._scaled_mm`` takes).
        data_t: (K, M) FP8, the transpose of ``data`` viewed as (M, K), or None. This K-major copy
            is the B operand layout that Hopper FP8 GEMMs want for the backward GEMMs.

    Example:
        >>> import torch, fp8ops
        >>> q, _ = fp8ops.quantize(torch.ones(2, 3), None, recipe=fp8ops.CurrentScaling(), transpose=True)
        >>> q.data.dtype, q.data_t.shape
        (torch.float8_e4m3fn, torch.Size([3, 2]))
    """

    data: Tensor
    inv_scale: Tensor
    data_t: Tensor | None

    def __init__(self, data: Tensor, inv_scale: Tensor, data_t: Tensor | None = None) -> None:
        object.__setattr__(self, "data", data)
        object.__setattr__(self, "inv_scale", inv_scale)
        object.__setattr__(self, "data_t", data_t)

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    def __repr__(self) -> str:
        t = "" if self.data_t is None else f", data_t={tuple(self.data_t.shape)}"
        return f"Float8Value(data={tuple(self.data.shape)} {self.data.dtype}, inv_scale={self.inv_scale!r}{t})"


pytree.register_pytree_node(
    Float8Value,
    lambda v: ([v.data, v.inv_scale, v.data_t], None),
    lambda c, _: Float8Value(c[0], c[1], c[2]),
    serialized_type_name="fp8ops.Float8Value",
    flatten_with_keys_fn=lambda v: (
        [(pytree.GetAttrKey(n), getattr(v, n)) for n in ("data", "inv_scale", "data_t")],
        None,
    ),
)


class QuantSpec(NamedTuple):
    """Static description of how one tensor role is quantized (plain constants: safe to pass
    through ``autograd.Function.apply`` and ``torch.compile``)."""

    mode: str
    dtype: torch.dtype
    margin: int
    power_2: bool
    calibrated: bool

    @staticmethod
    def of(recipe: Recipe, role: Role, calibrated: bool) -> QuantSpec:
        return QuantSpec(recipe.mode, recipe.dtype(role), recipe.margin, recipe.power_2_scale, calibrated)


def _resolve_role(state: ScalingState | None, role: Role | None, where: str) -> Role:
    if role is not None:
        check_role(role, where=where)
        if state is not None and state.role != role:
            raise ValueError(
                f"{where}: role={role!r} but the state was built for role {state.role!r}; "
                f"pass the matching state or omit role"
            )
        return role
    return state.role if state is not None else "forward"


def quantize_2d(
    x2: Tensor,
    scale: Tensor | None,
    spec: QuantSpec,
    *,
    transpose: bool = False,
) -> tuple[Tensor, Tensor, Tensor | None, Tensor]:
    """Dispatch an (M, K) tensor to the quantize ops: ``(data, inv_scale, data_t, amax)``.

    ``scale`` is the state's scale (None: no state, fallback scale 1). Internal to fp8ops ops.
    """
    if spec.mode == "rowwise":
        if transpose:
            raise ValueError(
                "quantize: transpose=True is not available with row-wise scaling: the transposed "
                "operand needs its own per-column scales; quantize x.t() separately instead"
            )
        data, inv, amax = _ops.cast_rowwise(x2, spec.margin, spec.power_2, spec.dtype)
        return data, inv, None, amax
    scale, amax_in = cast_scale(x2, scale, spec)
    if transpose:
        data, data_t, amax, inv = _ops.cast_transpose(x2, scale, amax_in, spec.margin, spec.power_2, spec.dtype)
        return data, inv, data_t, amax
    data, amax, inv = _ops.cast(x2, scale, amax_in, spec.margin, spec.power_2, spec.dtype)
    return data, inv, None, amax


def cast_scale(x2: Tensor | tuple[Tensor, ...], scale: Tensor | None, spec: QuantSpec
               ) -> tuple[Tensor, Tensor | None]:
    """A per-tensor cast's ``(scale, amax_in)``: the state's scale (None: fallback 1) and, for
    current scaling or an uncalibrated state, the amax the scale is computed from just in time (of
    ``x2``, or of all the parts of one tensor given as a tuple). Internal to fp8ops ops."""
    if scale is None:
        scale = torch.ones((), dtype=torch.float32, device=(x2 if isinstance(x2, Tensor) else x2[0]).device)
    amax_in = None
    if spec.mode != "delayed" or not spec.calibrated:
        if isinstance(x2, Tensor):
            amax_in = _ops.amax(x2)
        else:  # the parts may be strided views: each read as one contiguous run
            amax_in = functools.reduce(torch.maximum, [_ops.amax(p.contiguous()) for p in x2])
    return scale, amax_in


def quantize_2d_dbias(x2: Tensor, scale: Tensor | None, spec: QuantSpec
                      ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """:func:`quantize_2d` with ``transpose=True`` (per-tensor scaling) that also returns the
    float32 column sums of ``x2`` from the same pass: ``(data, inv_scale, data_t, amax, dbias)``.
    Internal to fp8ops ops (an output gradient's bias gradient)."""
    if spec.mode == "rowwise":
        raise ValueError("quantize_2d_dbias: row-wise scaling has no single pass with the transposed copy")
    scale, amax_in = cast_scale(x2, scale, spec)
    data, data_t, amax, inv, dbias = _ops.cast_transpose_dbias(x2, scale, amax_in, spec.margin, spec.power_2,
                                                              spec.dtype)
    return data, inv, data_t, amax, dbias


def quantize(
    x: Tensor,
    state: ScalingState | None,
    *,
    recipe: Recipe,
    role: Role | None = None,
    transpose: bool = False,
) -> tuple[Float8Value, ScalingState | None]:
    """Quantize ``x`` to FP8 with the recipe's scaling; record its amax in the state.

    Math::

        q = rne(clamp(x * s, -fp8_max, fp8_max))    # NaN stays NaN, never inf
        s = state.scale                             # delayed scaling (calibrated state)
        s = fp8_max / amax(x) / 2**margin           # current scaling, or an uncalibrated state
        new_state.pending_amax = max(state.pending_amax, amax(x))

    Delayed scaling is one kernel launch (the amax is computed in the same pass as the cast);
    current scaling is two (amax, then cast); row-wise scaling is one. ``quantize`` is not
    differentiable (its output is FP8); use :func:`fp8ops.fake_quantize` for a differentiable
    quantize-dequantize.

    Args:
        x: (..., K) float32, bfloat16 or float16; not modified.
        state: the :class:`ScalingState` of this tensor role, or None with a current-scaling recipe.
        recipe: a :class:`DelayedScaling` or :class:`CurrentScaling` recipe.
        role: "forward" or "backward" (selects the format under HYBRID); defaults to the state's.
        transpose: also return ``data_t`` (K, M), the transposed copy, written in the same pass.

    Returns:
        ``(q, new_state)``: a :class:`Float8Value` with ``data`` (..., K); ``new_state`` is None
        when ``state`` is None. The input state is not modified.

    Raises:
        TypeError, ValueError: bad input (the message names the argument and the fix).

    Example:
        >>> import torch, fp8ops
        >>> r = fp8ops.DelayedScaling()
        >>> x = torch.tensor([[0.5, -3.0, 200.0]])
        >>> q, s = fp8ops.quantize(x, r.init(role="forward"), recipe=r)
        >>> fp8ops.dequantize(q)  # first step: current scaling, s = 448 / 200
        tensor([[  0.5022,  -2.9018, 200.0000]])
        >>> s.pending_amax
        tensor(200.)

    References:
        Micikevicius et al., "FP8 Formats for Deep Learning" (2022).
    """
    where = "quantize"
    check_float_tensor(x, "x", where, min_dim=2 if transpose else 1)
    check_recipe(recipe, where)
    if state is not None:
        validate_state(state, where=where, device=x.device, recipe=recipe)
    elif recipe.mode == "delayed":
        raise ValueError("quantize: delayed scaling needs a state; pass recipe.init(role=...) or use CurrentScaling")
    role = _resolve_role(state, role, where)
    K = x.shape[-1]
    x2 = x.detach().reshape(math.prod(x.shape[:-1]), K)
    spec = QuantSpec.of(recipe, role, state.calibrated if state is not None else False)
    data, inv, data_t, amax = quantize_2d(
        x2, state.scale if state is not None else None, spec, transpose=transpose
    )
    data = data.reshape(x.shape)
    if inv.dim():
        inv = inv.reshape(*x.shape[:-1], 1)
    new_state = state._observe_amax(amax) if state is not None else None
    return Float8Value(data, inv, data_t), new_state


def dequantize(q: Float8Value, *, dtype: torch.dtype = torch.float32) -> Tensor:
    """Back to a floating tensor: ``q.data * q.inv_scale``, computed in float32, cast to ``dtype``.

    Args:
        q: a :class:`Float8Value` from :func:`quantize`.
        dtype: float32, bfloat16 or float16.

    Returns:
        A tensor of ``q.shape`` and ``dtype``.

    Example:
        >>> import torch, fp8ops
        >>> q, _ = fp8ops.quantize(torch.tensor([1.0, 3.0]), None, recipe=fp8ops.CurrentScaling())
        >>> fp8ops.dequantize(q, dtype=torch.bfloat16)  # 1 * 448/3 rounds to 144 in E4M3
        tensor([0.9648, 3.0000], dtype=torch.bfloat16)
    """
    if not isinstance(q, Float8Value):
        raise TypeError(f"dequantize: q must be a Float8Value (from fp8ops.quantize), got {type(q).__name__}")
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"dequantize: dtype must be float32, bfloat16 or float16, got {dtype}")
    return _ref.dequantize(q.data, q.inv_scale, dtype)


# ------------------------------------------------------------------------------------------------
# The library ops, every kernel side by side: CUDA and fake kernels from kernels/<stem>.py, the CPU
# kernel is the reference math; then their vmap rules.

_define(_K.amax, cpu=_ref.amax)
_define(_K.cast, cpu=_ref.cast)
_define(_K.cast_transpose, cpu=_ref.cast_transpose)
_define(_K.cast_transpose_dbias, cpu=_ref.cast_transpose_dbias)
_define(_K.cast_transpose_heads, cpu=_ref.cast_transpose_heads)
_define(_K.cast_rowwise, cpu=_ref.cast_rowwise)
_define(_K.transpose_bytes, cpu=_ref.transpose_bytes)


def _loop_vmap(op: Any) -> Any:
    """A vmap rule that runs ``op`` once per batch entry: exact "vmap = loop" semantics.

    Per-sample amaxes and (with current scaling) per-sample scales follow; the batch sizes seen in
    practice (micro-batches) are small.
    """

    def rule(info: Any, in_dims: tuple[Any, ...], *args: Any) -> Any:
        outs = []
        for b in range(info.batch_size):
            sample = [
                a if d is None or not isinstance(a, Tensor) else a.select(d, b) for a, d in zip(args, in_dims)
            ]
            outs.append(op(*sample))
        if isinstance(outs[0], Tensor):
            return torch.stack(outs), 0
        stacked = tuple(torch.stack([o[i] for o in outs]) for i in range(len(outs[0])))
        return stacked, tuple(0 for _ in stacked)

    return rule


for _name in ("amax", "cast", "cast_transpose", "cast_transpose_dbias", "cast_transpose_heads", "cast_rowwise",
              "transpose_bytes"):
    torch.library.register_vmap(f"fp8ops::{_name}", _loop_vmap(getattr(_ops, _name)))

