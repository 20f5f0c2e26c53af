"""LayerNorm and RMSNorm with an optional fused residual add: ``layer_norm`` and ``rms_norm``.

Both run on the ``fp8ops::norm_fwd`` / ``fp8ops::norm_bwd`` library ops (Triton kernels on CUDA,
the FP32 reference math on CPU), with statistics in float32, and are differentiable in the input,
the weight, the bias and the residual. The FP8 output of the forward kernel (cast + transposed
copy + amax in the same pass) is used by the fused LayerNorm+Linear and LayerNorm+MLP ops.
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any

import torch
from torch import Tensor

from ._checks import (
    check_device,
    check_eps,
    check_float_tensor,
    check_residual_dropout,
    check_zero_centered_gamma,
)
from ._glue import apply, autocast_dtype, refuse_compiled_transform
from .attention.checks import _seed_tensor
from .kernels import norm as _K
from .kernels._library import OPS, define as _define
from .quantize import _loop_vmap
from .reference import norm as _ref

__all__ = ["layer_norm", "rms_norm"]

# The default of ``state``: a call that leaves it out gets the old return (``y`` or ``(y, s)``,
# no state) with a DeprecationWarning; ``state=None`` gets the calling convention's
# ``(outputs, None)``.
_OLD_RETURN: Any = type("_OldReturn", (), {"__repr__": lambda self: "<not given>"})()

_ops = OPS


class _Norm(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(  # type: ignore[override]
        x: Tensor,  # (M, K)
        residual: Tensor | None,  # (M, K)
        weight: Tensor,  # (K,)
        bias: Tensor | None,  # (K,)
        eps: float,
        rms: bool,
        zero_centered_gamma: bool,
        seed: Tensor | None,  # () int64: x dropped with probability drop_p before the residual add
        drop_p: float,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        y, s, _, _, _, _, mean, rstd = _ops.norm_fwd(
            x, residual, weight, bias, eps, rms, zero_centered_gamma, True, None, None, 0, False, None, False,
            seed, drop_p,
        )
        return y, s, mean, rstd

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        x, residual, weight, bias, _, rms, zero_centered_gamma, seed, drop_p = inputs
        _, s, mean, rstd = output
        ctx.mark_non_differentiable(mean, rstd)
        # The backward needs the normalised input: x, or the sum output s = x + residual.
        ctx.save_for_backward(s if residual is not None else x, weight, mean, rstd, seed)
        ctx.drop_p = drop_p
        ctx.rms = rms
        ctx.zero_centered_gamma = zero_centered_gamma
        ctx.has_residual = residual is not None
        ctx.bias_dtype = None if bias is None else bias.dtype

    @staticmethod
    def backward(ctx: Any, dy: Tensor, ds: Tensor, *_: Any) -> tuple[Any, ...]:  # type: ignore[override]
        s, weight, mean, rstd, seed = ctx.saved_tensors
        has_bias = ctx.bias_dtype is not None
        with torch.no_grad():
            # dx includes ds (the gradient of the sum output); x and residual share it, but for a
            # dropped x, whose gradient the same pass writes as dx * keep / (1 - p).
            args = (dy.contiguous(), s, weight, mean, rstd, ds.contiguous() if ctx.has_residual else None,
                    ctx.rms, ctx.zero_centered_gamma, has_bias)
            if seed is not None:
                dx, dxb, dw, db = _ops.norm_bwd_dropout(*args, seed, ctx.drop_p)
            else:
                dx, dw, db = _ops.norm_bwd(*args)
                dxb = dx
            db = db.to(ctx.bias_dtype) if has_bias else None
        need = ctx.needs_input_grad
        return (
            dxb if need[0] else None,
            dx if ctx.has_residual and need[1] else None,
            dw if need[2] else None,
            db if need[3] else None,
            None, None, None, None, None,
        )


# Under torch.compile and torch.func, autograd.Function.apply binds the arguments with
# inspect.signature(forward) on every call; a stored signature makes that lookup immediate (eager
# calls skip the binding: _glue.apply).
_Norm.forward.__signature__ = inspect.signature(_Norm.forward)  # type: ignore[attr-defined]


def _check(where: str, x: Any, weight: Any, bias: Any, residual: Any, eps: Any, zero_centered_gamma: Any,
           residual_dropout: Any = 0.0) -> int:
    """Validate the public arguments; return K."""
    check_residual_dropout(residual_dropout, residual, where)
    check_float_tensor(x, "x", where, min_dim=1)
    K = x.shape[-1]
    if K < 1:
        raise ValueError(f"{where}: x must have a non-empty last dimension (..., K), got shape {tuple(x.shape)}")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is None:
            continue
        check_float_tensor(t, name, where)
        if tuple(t.shape) != (K,):
            raise ValueError(f"{where}: {name} must have shape (K,) = ({K},) to match x's last dimension, "
                             f"got {tuple(t.shape)}")
        if t.dtype not in (torch.float32, x.dtype):
            raise ValueError(f"{where}: {name} must be float32 or x's dtype {x.dtype}, got {t.dtype}; "
                             f"cast it with .to(torch.float32)")
        check_device(t, name, x, where)
    if residual is not None:
        check_float_tensor(residual, "residual", where)
        if residual.shape != x.shape:
            raise ValueError(f"{where}: residual must have x's shape {tuple(x.shape)}, got {tuple(residual.shape)}")
        if residual.dtype != x.dtype:
            raise ValueError(f"{where}: residual must have x's dtype {x.dtype}, got {residual.dtype}; "
                             f"cast it with .to(x.dtype)")
        check_device(residual, "residual", x, where)
    check_eps(eps, where)
    check_zero_centered_gamma(zero_centered_gamma, where)
    return K


def _check_no_fp8(where: str, state: Any, recipe: Any) -> None:
    if state is not None and state is not _OLD_RETURN:
        raise TypeError(f"{where}: state must be None (a norm keeps no scaling state; its FP8 output is part of "
                        f"layernorm_linear and fused_ln_mlp), got {type(state).__name__}")
    if recipe is not None:
        raise TypeError(f"{where}: recipe must be None (the norm runs in its input's precision; fuse it with the "
                        f"next GEMM through layernorm_linear or fused_ln_mlp for FP8), got {recipe!r}")


def _convention(where: str, state: Any, out: Any) -> Any:
    """``(outputs, None)``; the old bare outputs when ``state`` was left out."""
    if state is _OLD_RETURN:
        if not torch.compiler.is_compiling():
            warnings.warn(f"{where}: pass state=None ({where}(x, weight, ..., None)) to get (outputs, None) like "
                          f"every fp8ops op; the bare return of a call without state is deprecated",
                          DeprecationWarning, stacklevel=3)
        return out
    return out, None


def _apply(x: Tensor, residual: Tensor | None, weight: Tensor, bias: Tensor | None, eps: float, rms: bool,
           zero_centered_gamma: bool, residual_dropout: float = 0.0, dropout_seed: Any = None
           ) -> Tensor | tuple[Tensor, Tensor]:
    if autocast_dtype(x.device.type) is not None:
        # torch.autocast: a norm is no GEMM; it runs in its inputs' dtype (statistics in float32),
        # with autocast off inside so that the reference math is not cast.
        with torch.autocast(x.device.type, enabled=False):
            return _apply(x, residual, weight, bias, eps, rms, zero_centered_gamma, residual_dropout, dropout_seed)
    where = "rms_norm" if rms else "layer_norm"
    K = x.shape[-1]
    x2 = x.reshape(-1, K)  # (M, K)
    r2 = None if residual is None else residual.reshape(-1, K)
    refuse_compiled_transform(where, x)
    seed = _seed_tensor(dropout_seed, x.device, where) if residual_dropout > 0 else None
    y, s, _, _ = apply(_Norm, x2, r2, weight, bias, float(eps), rms, zero_centered_gamma, seed,
                       float(residual_dropout))
    if residual is None:
        return y.reshape(x.shape)
    return y.reshape(x.shape), s.reshape(x.shape)


def layer_norm(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    state: None = _OLD_RETURN,
    *,
    recipe: None = None,
    eps: float = 1e-5,
    zero_centered_gamma: bool = False,
    residual: Tensor | None = None,
    residual_dropout: float = 0.0,
    dropout_seed: int | Tensor | None = None,
) -> Any:
    """LayerNorm over the last dimension, with an optional fused residual add.

    Math (per row of K elements, statistics in float32)::

        s    = x + residual                          # when given: added in fp32, rounded to x.dtype
        s    = x * keep / (1 - p) + residual         # with residual_dropout p
        mean = sum(s) / K,   var = sum((s - mean)^2) / K   (biased)
        y    = (s - mean) / sqrt(var + eps) * g + bias,   g = weight (+ 1 if zero_centered_gamma)

    One kernel reads x (and the residual) once and writes y (and s); the backward computes dx in
    one pass per row and reduces the weight and bias gradients deterministically.

    Args:
        x: (..., K) float32, bfloat16 or float16; y has the same shape and dtype, also inside
            ``torch.autocast`` (which does not cast a norm's inputs: float32 stays float32).
        weight: (K,) float32 or x's dtype.
        bias: (K,) float32 or x's dtype, or None.
        state: None (a norm keeps no scaling state). Leaving it out returns the bare outputs
            instead of ``(outputs, None)``: deprecated, with a DeprecationWarning.
        recipe: None (the norm runs in its input's precision; its FP8 output is part of
            :func:`fp8ops.layernorm_linear` and :func:`fp8ops.fused_ln_mlp`).
        eps: added to the variance; a finite number > 0.
        zero_centered_gamma: the weight is stored centred on 0 (g = weight + 1), as in
            Transformer Engine's ``zero_centered_gamma``.
        residual: (..., K) of x's shape and dtype, or None.
        residual_dropout: dropout probability in [0, 1) on x before the residual add (a block's
            ``s = residual + dropout(branch)``), in the norm's kernel: the keep mask is a hash of
            ``(dropout_seed, row, column)`` over x's (M, K) rows
            (``fp8ops.reference.norm.branch_keep``), nothing is stored, and the backward's kernel
            writes x's gradient next to the residual's. Needs a residual; 0: no dropout.
        dropout_seed: an int, a 1-element integer tensor, or None (drawn from torch's generator
            on x's device). Ignored without ``residual_dropout``.

    Returns:
        ``(y, None)`` with y (..., K); with a residual ``((y, s), None)`` where ``s = x + residual``
        (the next residual stream). Differentiable in x, weight, bias and residual.

    Raises:
        TypeError, ValueError: bad input (the message names the argument and the fix).

    Example:
        >>> import torch
        >>> from fp8ops.norm import layer_norm
        >>> x = torch.tensor([[1.0, 2.0, 3.0, 6.0]])
        >>> y, _ = layer_norm(x, torch.ones(4), torch.zeros(4), None)
        >>> y
        tensor([[-1.0690, -0.5345,  0.0000,  1.6036]])
        >>> (y, s), _ = layer_norm(x, torch.ones(4), None, None, residual=torch.ones(1, 4))
        >>> s
        tensor([[2., 3., 4., 7.]])

    References:
        Ba, Kiros & Hinton, "Layer Normalization" (2016); NVIDIA Transformer Engine LayerNorm.
    """
    where = "layer_norm"
    if weight is None:
        raise TypeError(f"{where}: weight must be a (K,) tensor (use torch.ones(K) for no scaling), got None")
    _check(where, x, weight, bias, residual, eps, zero_centered_gamma, residual_dropout)
    _check_no_fp8(where, state, recipe)
    return _convention(where, state, _apply(x, residual, weight, bias, eps, False, zero_centered_gamma,
                                            residual_dropout, dropout_seed))


def rms_norm(
    x: Tensor,
    weight: Tensor,
    state: None = _OLD_RETURN,
    *,
    recipe: None = None,
    eps: float = 1e-5,
    zero_centered_gamma: bool = False,
    residual: Tensor | None = None,
    residual_dropout: float = 0.0,
    dropout_seed: int | Tensor | None = None,
) -> Any:
    """RMSNorm over the last dimension, with an optional fused residual add.

    Math (per row of K elements, statistics in float32)::

        s = x + residual                             # when given: added in fp32, rounded to x.dtype
        s = x * keep / (1 - p) + residual            # with residual_dropout p
        y = s / sqrt(sum(s^2) / K + eps) * g,        g = weight (+ 1 if zero_centered_gamma)

    Args:
        x: (..., K) float32, bfloat16 or float16; y has the same shape and dtype, also inside
            ``torch.autocast`` (which does not cast a norm's inputs: float32 stays float32).
        weight: (K,) float32 or x's dtype.
        state: None, as in :func:`layer_norm`.
        recipe: None, as in :func:`layer_norm`.
        eps: added to the mean square; a finite number > 0.
        zero_centered_gamma: g = weight + 1.
        residual: (..., K) of x's shape and dtype, or None.
        residual_dropout, dropout_seed: dropout on x before the residual add, as in
            :func:`layer_norm`.

    Returns:
        ``(y, None)`` with y (..., K); with a residual ``((y, s), None)`` where
        ``s = x + residual``. Differentiable in x, weight and residual.

    Raises:
        TypeError, ValueError: bad input (the message names the argument and the fix).

    Example:
        >>> import torch
        >>> from fp8ops.norm import rms_norm
        >>> rms_norm(torch.tensor([[3.0, 4.0]]), torch.ones(2), None, eps=1e-6)
        (tensor([[0.8485, 1.1314]]), None)

    References:
        Zhang & Sennrich, "Root Mean Square Layer Normalization" (2019).
    """
    where = "rms_norm"
    if weight is None:
        raise TypeError(f"{where}: weight must be a (K,) tensor (use torch.ones(K) for no scaling), got None")
    _check(where, x, weight, None, residual, eps, zero_centered_gamma, residual_dropout)
    _check_no_fp8(where, state, recipe)
    return _convention(where, state, _apply(x, residual, weight, None, eps, True, zero_centered_gamma,
                                            residual_dropout, dropout_seed))


# ------------------------------------------------------------------------------------------------
# The library ops, every kernel side by side: CUDA and fake kernels from kernels/<stem>.py, the CPU
# kernel is the reference math; then their vmap rules.

_define(_K.norm_fwd, cpu=_ref.norm_fwd)
_define(_K.norm_amax, cpu=_ref.norm_amax)
_define(_K.norm_bwd, cpu=_ref.norm_bwd)
_define(_K.norm_bwd_dropout, cpu=_ref.norm_bwd_dropout)

for _name in ("norm_fwd", "norm_amax", "norm_bwd", "norm_bwd_dropout"):
    torch.library.register_vmap(f"fp8ops::{_name}", _loop_vmap(getattr(_ops, _name)))
