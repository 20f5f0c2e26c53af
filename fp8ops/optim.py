"""adamw_quantize_: an AdamW step that also writes the weight's FP8 copy for the next forward;
adamw_: the same AdamW step alone, over a list of parameters (those without an FP8 copy).

With delayed scaling a weight's FP8 copy for step t+1 depends only on the weight after the
optimizer step of step t and on the scale :func:`fp8ops.update` computed at the end of step t. So
the optimizer, which reads and writes the whole weight anyway, can write that copy in the same
pass: one kernel instead of the AdamW kernel plus a cast of the weight (its read of the weight and
its launch) at the next forward. The copy is a :class:`fp8ops.WeightCache`, passed to the ops'
``weight_cache``, whose buffers are overwritten in place at every step.

The parameters a model keeps in high precision (embeddings, norms, biases, an output head) take
:func:`adamw_`: the same math, one kernel per group of tensors, at about the copy bandwidth of
the GPU, where torch's fused AdamW ran at about three quarters of it (docs/linear.md).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from ._checks import FLOAT_DTYPES, check_float_tensor, check_recipe
from ._operands import quantize_pair
from .fp8_linear import LinearState, WeightCache
from .kernels import optim as _K
from .kernels._library import OPS, define as _define
from .quantize import Float8Value, QuantSpec
from .recipes import Recipe
from .reference import optim as _ref
from .state import ScalingState, validate_state

__all__ = ["adamw_", "adamw_quantize_"]

_define(_K.adamw_cast_transpose, cpu=_ref.adamw_cast_transpose)
_define(_K.adamw, cpu=_ref.adamw)


def _check_like(t: Any, name: str, weight: Tensor, where: str, of: str = "the weight") -> Tensor:
    if not isinstance(t, Tensor):
        raise TypeError(f"{where}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{where}: {name} must be float32, bfloat16 or float16, got {t.dtype}")
    if tuple(t.shape) != tuple(weight.shape):
        raise ValueError(f"{where}: {name} must have {of}'s shape {tuple(weight.shape)}, got {tuple(t.shape)}")
    if t.device != weight.device:
        raise ValueError(f"{where}: {name} is on {t.device}, {of} on {weight.device}")
    if not t.is_contiguous():
        raise ValueError(f"{where}: {name} must be contiguous, got strides {tuple(t.stride())}")
    return t


def _check_scalar_tensor(t: Any, name: str, weight: Tensor, where: str, whose: str = "the weight's") -> Tensor:
    if not isinstance(t, Tensor) or t.dim() != 0 or t.dtype != torch.float32 or t.device != weight.device:
        got = (f"{tuple(t.shape)} {t.dtype} on {t.device}" if isinstance(t, Tensor) else type(t).__name__)
        raise ValueError(f"{where}: {name} must be a 0-d float32 tensor on {whose} device ({weight.device}), "
                         f"got {got}")
    return t


def _check_hyper(value: Any, name: str, where: str, lo: float, hi: float, hi_open: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < lo \
            or value > hi or (hi_open and value == hi):
        bound = f"[{lo}, {hi})" if hi_open else f"[{lo}, {hi}]"
        raise ValueError(f"{where}: {name} must be a finite number in {bound}, got {value!r}")
    return float(value)


def _check_lr_and_coefficients(lr: Any, betas: Any, eps: Any, weight_decay: Any, like: Tensor, where: str,
                               whose: str) -> tuple[Tensor, float, float, float, float]:
    if isinstance(lr, Tensor):
        lr_t = _check_scalar_tensor(lr, "lr", like, where, whose)
    else:
        # a fill kernel with the value, not a copy from host memory (capturable in a CUDA graph)
        lr_t = torch.full((), _check_hyper(lr, "lr", where, 0.0, math.inf, False), device=like.device)
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"{where}: betas must be a pair (beta1, beta2), got {betas!r}")
    beta1 = _check_hyper(betas[0], "betas[0]", where, 0.0, 1.0, True)
    beta2 = _check_hyper(betas[1], "betas[1]", where, 0.0, 1.0, True)
    eps = _check_hyper(eps, "eps", where, 0.0, math.inf, False)
    weight_decay = _check_hyper(weight_decay, "weight_decay", where, 0.0, math.inf, False)
    return lr_t, beta1, beta2, eps, weight_decay


def adamw_(
    params: list[Tensor] | tuple[Tensor, ...],
    grads: list[Tensor] | tuple[Tensor, ...],
    exp_avgs: list[Tensor] | tuple[Tensor, ...],
    exp_avg_sqs: list[Tensor] | tuple[Tensor, ...],
    step: Tensor,
    *,
    lr: float | Tensor,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
) -> None:
    """One AdamW step on every parameter of a list, in place: the math of :func:`adamw_quantize_`
    (that is, of ``torch.optim.AdamW``) without an FP8 copy.

    For the parameters that :func:`adamw_quantize_` does not step: embeddings, norms, biases, an
    output head kept in high precision. On the GPU one kernel steps up to eight tensors
    (``fp8ops::adamw``), at about the copy bandwidth (docs/linear.md); the call is captured by CUDA
    graphs (:func:`fp8ops.graph_step`) and traced whole by ``torch.compile(fullgraph=True)``.

    Math per element (float32; ``t`` is ``step`` after this call adds one)::

        w = w - lr * weight_decay * w
        m = beta1 * m + (1 - beta1) * g;   v = beta2 * v + (1 - beta2) * g * g
        w = w - lr / (1 - beta1**t) * m / (sqrt(v) / sqrt(1 - beta2**t) + eps)

    Args:
        params: the parameters (any shape, float32, bfloat16 or float16, contiguous, all on one
            device); updated in place.
        grads: their gradients, one per parameter, same shape and device, contiguous.
        exp_avgs, exp_avg_sqs: the first and second moments, one per parameter, same shape and
            device, contiguous (any of the three float dtypes; start them at zeros); updated in
            place.
        step: 0-d float32 tensor on the parameters' device, the number of steps these parameters
            have taken; this call adds one (in place) and uses the new count for the bias
            corrections. Give each group of parameters stepped by its own call its own count.
        lr: learning rate, a float or a 0-d float32 tensor on the parameters' device.
        betas, eps, weight_decay: AdamW's coefficients.

    Raises:
        TypeError, ValueError: bad input; the message names the argument (with its index in the
            list) and what was expected. Nothing is changed by a refused call.

    Example:
        >>> import torch, fp8ops
        >>> ps = [torch.ones(3), torch.ones(2, 2)]
        >>> gs = [torch.full((3,), 0.5), torch.full((2, 2), -0.5)]
        >>> ms, vs = [torch.zeros_like(p) for p in ps], [torch.zeros_like(p) for p in ps]
        >>> t = torch.zeros(())
        >>> fp8ops.adamw_(ps, gs, ms, vs, t, lr=0.1, weight_decay=0.0)
        >>> t.item(), ps[0], ps[1][0]
        (1.0, tensor([0.9000, 0.9000, 0.9000]), tensor([1.1000, 1.1000]))
    """
    where = "adamw_"
    lists = {"params": params, "grads": grads, "exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs}
    for name, seq in lists.items():
        if not isinstance(seq, (list, tuple)):
            raise TypeError(f"{where}: {name} must be a list or tuple of tensors, got {type(seq).__name__}")
        if len(seq) != len(params):
            raise ValueError(f"{where}: {name} must have one tensor per parameter ({len(params)}), got {len(seq)}")
    if not params:
        raise ValueError(f"{where}: params is empty")
    first = params[0]
    for i, w in enumerate(params):
        check_float_tensor(w, f"params[{i}]", where)
        if w.device != first.device:
            raise ValueError(f"{where}: params[{i}] is on {w.device}, params[0] on {first.device}")
        if not w.is_contiguous():
            raise ValueError(f"{where}: params[{i}] must be contiguous, got strides {tuple(w.stride())}")
        for name in ("grads", "exp_avgs", "exp_avg_sqs"):
            _check_like(lists[name][i], f"{name}[{i}]", w, where, f"params[{i}]")
    _check_scalar_tensor(step, "step", first, where, "the parameters'")
    lr_t, beta1, beta2, eps, weight_decay = _check_lr_and_coefficients(lr, betas, eps, weight_decay, first, where,
                                                                       "the parameters'")
    with torch.no_grad():
        step.add_(1.0)
        OPS.adamw(list(params), list(grads), list(exp_avgs), list(exp_avg_sqs), step, lr_t, beta1, beta2, eps,
                  weight_decay)


def adamw_quantize_(
    weight: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    step: Tensor,
    state: ScalingState | LinearState,
    *,
    recipe: Recipe,
    lr: float | Tensor,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
    out: WeightCache,
) -> tuple[WeightCache, Any]:
    """One AdamW step on ``weight`` in place, and its FP8 copy for the next step's forward.

    Math (float32, as ``torch.optim.AdamW``; ``t`` is ``step`` after this call adds one)::

        w = w - lr * weight_decay * w
        m = beta1 * m + (1 - beta1) * g;   v = beta2 * v + (1 - beta2) * g * g
        w = w - lr / (1 - beta1**t) * m / (sqrt(v) / sqrt(1 - beta2**t) + eps)

    then ``out``'s buffers get the FP8 copy of the new ``w`` (as :func:`fp8ops.quantize_weight`
    writes it, with its transposed copy) under ``state``'s scale, and amax(w) is recorded. Call it
    after :func:`fp8ops.update` (the scale of the next step) and pass the returned cache as the
    ``weight_cache`` of the next step's forward.

    With delayed scaling and a calibrated state (one scale per tensor) the step and the copy are one
    kernel on the GPU (``fp8ops::adamw_cast_transpose``). Otherwise (current scaling, whose scale
    needs the new weight's amax first; a state not yet calibrated) the same kernel runs and the
    copy is then quantized again and written into ``out``: the same values, more passes. Row-wise
    scaling is not supported (its transposed copy has scales of its own). The call is captured by
    CUDA graphs (``fp8ops.graph_step``) and traced whole by ``torch.compile(fullgraph=True)``.

    Args:
        weight: (N, K) float32, bfloat16 or float16, contiguous; updated in place.
        grad: its gradient, same shape and device, contiguous.
        exp_avg, exp_avg_sq: the first and second moments, same shape and device, contiguous
            (any of the three float dtypes; start them at zeros); updated in place.
        step: 0-d float32 tensor on the weight's device, the number of steps taken so far; this
            call adds one (in place) and uses the new count for the bias corrections.
        state: the weight's :class:`ScalingState` (``linear_state.weight``) or the whole
            :class:`LinearState`, as returned by :func:`fp8ops.update` for the next step.
        recipe: the recipe the state was built with.
        lr: learning rate, a float or a 0-d float32 tensor on the weight's device (a tensor lets a
            CUDA graph replay the step with new values).
        betas, eps, weight_decay: AdamW's coefficients.
        out: a :class:`WeightCache` of this weight with one scale per tensor (from
            :func:`fp8ops.quantize_weight` before the first step): its FP8 bytes, transposed
            bytes and inverse scale are overwritten.

    Returns:
        ``(cache, new_state)``: a :class:`WeightCache` over ``out``'s buffers bound to ``state``
        (pass it as ``weight_cache`` with this state), and the state (same type as given) with the
        new weight's amax recorded.

    Raises:
        TypeError, ValueError: bad input; the message names the argument and what was expected.

    Example:
        >>> import torch, fp8ops
        >>> r = fp8ops.DelayedScaling()
        >>> w = torch.randn(32, 16)
        >>> w.grad = torch.randn(32, 16)
        >>> m, v, t = torch.zeros(32, 16), torch.zeros(32, 16), torch.zeros(())
        >>> cache, st = fp8ops.quantize_weight(w, fp8ops.LinearState.init(r), recipe=r)
        >>> cache, st = fp8ops.adamw_quantize_(w, w.grad, m, v, t, st, recipe=r, lr=1e-3, out=cache)
        >>> t, cache.value.data.shape, cache.value.data_t.shape
        (tensor(1.), torch.Size([32, 16]), torch.Size([16, 32]))
    """
    where = "adamw_quantize_"
    check_float_tensor(weight, "weight", where)
    if weight.dim() != 2:
        raise ValueError(f"{where}: weight must be 2-D (N, K), got shape {tuple(weight.shape)}")
    if not weight.is_contiguous():
        raise ValueError(f"{where}: weight must be contiguous, got strides {tuple(weight.stride())}")
    for t, name in ((grad, "grad"), (exp_avg, "exp_avg"), (exp_avg_sq, "exp_avg_sq")):
        _check_like(t, name, weight, where)
    _check_scalar_tensor(step, "step", weight, where)
    check_recipe(recipe, where)
    ws = state.weight if isinstance(state, LinearState) else state
    if not isinstance(ws, ScalingState):
        raise TypeError(f"{where}: state must be a ScalingState or a LinearState, got {type(state).__name__}")
    validate_state(ws, where=f"{where}: state", device=weight.device, recipe=recipe)
    lr_t, beta1, beta2, eps, weight_decay = _check_lr_and_coefficients(lr, betas, eps, weight_decay, weight, where,
                                                                       "the weight's")
    spec = QuantSpec.of(recipe, "forward", ws.calibrated)
    if spec.mode == "rowwise":
        raise ValueError(f"{where}: row-wise scaling is not supported (its transposed copy has scales of its own); "
                         f"run the optimizer, then fp8ops.quantize_weight")
    if not isinstance(out, WeightCache):
        raise TypeError(f"{where}: out must be a WeightCache from fp8ops.quantize_weight, got {type(out).__name__}")
    data, data_t, inv = out.value.data, out.value.data_t, out.value.inv_scale
    if (data.dtype != spec.dtype or tuple(data.shape) != tuple(weight.shape) or data_t is None
            or tuple(data_t.shape) != tuple(weight.shape[::-1]) or data_t.dtype != data.dtype
            or inv.dim() != 0 or not data.is_contiguous() or not data_t.is_contiguous()
            or data.device != weight.device):
        raise ValueError(f"{where}: out must hold this weight's FP8 copy with one scale per tensor: "
                         f"{spec.dtype} data {tuple(weight.shape)} and data_t {tuple(weight.shape[::-1])}, contiguous, "
                         f"on {weight.device} (as fp8ops.quantize_weight(weight, state, recipe=...) builds it); got "
                         f"data {data.dtype} {tuple(data.shape)}, data_t "
                         f"{None if data_t is None else tuple(data_t.shape)}, inv_scale {tuple(inv.shape)}")
    with torch.no_grad():
        step.add_(1.0)
        amax = OPS.adamw_cast_transpose(weight, grad, exp_avg, exp_avg_sq, step, lr_t, ws.scale, data, data_t,
                                        inv, beta1, beta2, eps, weight_decay)
        if not (spec.mode == "delayed" and spec.calibrated):
            # the scale comes from the new weight's amax: cast again, as quantize_weight would
            q, inv_new, q_t, _, amax = quantize_pair(weight, ws.scale, spec, True)
            data.copy_(q)
            data_t.copy_(q_t)
            inv.copy_(inv_new)
    cache = WeightCache(Float8Value(data, inv, data_t), None, ws.scale, recipe, weight)
    new_ws = ws._observe_amax(amax)
    return cache, (state.replace(weight=new_ws) if isinstance(state, LinearState) else new_ws)
