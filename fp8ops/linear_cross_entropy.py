"""An output head and its cross-entropy loss in one op: ``linear_cross_entropy(x, weight, target)``.

A language model's step ends with the logits ``x W^T`` of every token over the vocabulary, the
largest activation of the step (8192 tokens by 50304 entries are 824 MB in bf16), and the mean
cross-entropy of the targets. ``F.cross_entropy(x @ W.t(), target)`` reads those logits in the
forward and again in the backward, where it writes their gradient. This op writes the gradient in
the forward, with the loss, in one kernel (``kernels/linear_cross_entropy.py``), keeps it in place
of the logits for the backward, and gives the backward's two GEMMs the mean's scale: the logits
are read once and no pass over them is left for the backward.

The math is in :mod:`fp8ops.reference.linear_cross_entropy`.
"""

from __future__ import annotations

import inspect
import math
from typing import Any

import torch
from torch import Tensor

from ._checks import check_float_tensor
from ._glue import apply, autocast_dtype, autocast_inputs, refuse_compiled_transform, values_readable
from .kernels import linear_cross_entropy as _K
from .kernels._library import OPS as _ops, define as _define
from .quantize import _loop_vmap
from .reference import linear_cross_entropy as _ref

__all__ = ["linear_cross_entropy"]

_TARGET_DTYPES = (torch.int64, torch.int32)


class _LinearCrossEntropy(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(x: Tensor, weight: Tensor, target: Tensor, ignore_index: int) -> tuple[Tensor, Tensor, Tensor]:  # type: ignore[override]
        logits = torch.mm(x, weight.t())  # (M, V)
        rows, d = _ops.linear_cross_entropy_fwd(logits, target, ignore_index)
        count = (target != ignore_index).sum(dtype=torch.float32)
        return rows.sum() / count, d, count

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        x, weight, _, _ = inputs
        _, d, count = output
        ctx.save_for_backward(x, weight, d, count)
        ctx.mark_non_differentiable(d, count)

    @staticmethod
    def backward(ctx: Any, g: Tensor, _d: Any, _count: Any) -> tuple[Tensor | None, Tensor | None, None, None]:  # type: ignore[override]
        x, weight, d, count = ctx.saved_tensors
        dx = dw = None
        with torch.no_grad():
            s = g.to(torch.float32) / count  # the mean's scale times the loss's gradient
            if ctx.needs_input_grad[0]:
                dx = (torch.mm(d, weight).to(torch.float32) * s).to(x.dtype)  # (M, K)
            if ctx.needs_input_grad[1]:
                dw = torch.mm(d.t(), (x.to(torch.float32) * s).to(x.dtype))  # (V, K)
        return dx, dw, None, None


# Under torch.compile and torch.func, autograd.Function.apply binds the arguments with
# inspect.signature(forward) on every call (eager calls skip the binding: _glue.apply).
_LinearCrossEntropy.forward.__signature__ = inspect.signature(_LinearCrossEntropy.forward)  # type: ignore[attr-defined]


def _check(x: Any, weight: Any, target: Any, ignore_index: Any, where: str, *, same_dtype: bool) -> None:
    check_float_tensor(x, "x", where, min_dim=1)
    check_float_tensor(weight, "weight", where)
    if weight.dim() != 2 or weight.shape[0] < 1 or weight.shape[1] != x.shape[-1]:
        raise ValueError(f"{where}: weight must be 2-D (V, K) with V >= 1 and K = x.shape[-1] = {x.shape[-1]}, "
                         f"got shape {tuple(weight.shape)}")
    if same_dtype and weight.dtype != x.dtype:
        raise ValueError(f"{where}: weight must have x's dtype {x.dtype}, got {weight.dtype}")
    if not isinstance(target, Tensor):
        raise TypeError(f"{where}: target must be a torch.Tensor of class indices, got {type(target).__name__}")
    if target.dtype not in _TARGET_DTYPES:
        raise ValueError(f"{where}: target must be int64 or int32 class indices, got {target.dtype}")
    if tuple(target.shape) != tuple(x.shape[:-1]):
        raise ValueError(f"{where}: target must have x's leading shape {tuple(x.shape[:-1])} (one class per row "
                         f"of x), got {tuple(target.shape)}")
    for name, t in (("weight", weight), ("target", target)):
        if t.device != x.device:
            raise ValueError(f"{where}: {name} is on {t.device} but x is on {x.device}; move it with .to(x.device)")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"{where}: ignore_index must be an int, got {type(ignore_index).__name__} {ignore_index!r}")


def linear_cross_entropy(x: Tensor, weight: Tensor, target: Tensor, *, ignore_index: int = -100) -> Tensor:
    """Mean cross-entropy of the logits ``x W^T`` against ``target``, the head and the loss in one op.

    Computes what ``F.cross_entropy(x @ weight.t(), target, ignore_index=ignore_index)`` computes
    (float32 softmax math, the mean over the rows whose target is not ``ignore_index``), but never
    keeps the logits: one kernel writes their gradient with the loss, and the backward multiplies
    it into ``weight`` and ``x`` with the mean's scale. On CUDA the logits GEMM and the backward's
    two GEMMs are torch's (cuBLAS) in x's dtype.

    Math::

        z = x W^T,   loss_r = log sum_j exp(z_rj) - z_{r, t_r}
        loss = sum_{r kept} loss_r / #kept
        dz_r = (softmax(z_r) - onehot(t_r)) g / #kept,   dx = dz W,   dW = dz^T x

    The gradient ``softmax(z_r) - onehot(t_r)`` is rounded to x's dtype before the scale
    ``g / #kept`` is applied (to the GEMMs' outputs for dx, to x for dW), where torch rounds it
    after; with a power-of-two count both round the same values.

    Works with autograd, ``torch.func`` (grad, vjp, vmap) and ``torch.compile(fullgraph=True)`` +
    ``.backward()``; inside ``torch.autocast`` x and weight are cast as ``F.linear`` casts them.

    Args:
        x: (..., K) float32, bfloat16 or float16, the head's input.
        weight: (V, K) in x's dtype, the head's weight (an embedding tied to the head, for instance).
        target: (...) int64 or int32 class indices in ``[0, V)``, x's leading shape.
        ignore_index: the target value of rows that count neither in the loss nor in the mean.

    Returns:
        () float32 loss. NaN when every target is ``ignore_index`` (as torch's), and NaN on CUDA
        when a target lies outside ``[0, V)`` (torch stops there with a device-side assertion); on
        CPU such a target raises.

    Raises:
        TypeError, ValueError: a tensor of the wrong kind, dtype, shape or device, or a
            non-integer ``ignore_index``; IndexError (CPU): a target outside ``[0, V)``.

    Example:
        >>> import math, torch
        >>> from fp8ops import linear_cross_entropy
        >>> x = torch.tensor([[1.0, 0.0], [0.0, 1.0]], requires_grad=True)
        >>> w = torch.tensor([[math.log(3.0), 0.0], [0.0, 0.0]])  # row 0's logits: ln 3, 0
        >>> loss = linear_cross_entropy(x, w, torch.tensor([0, -100]))
        >>> round(loss.item(), 6) == round(math.log(4 / 3), 6)  # -log(3 / (3 + 1)), row 1 ignored
        True
        >>> loss.backward()
        >>> x.grad[0]  # (softmax - onehot) @ w = (0.75 - 1, 0.25) @ w
        tensor([-0.2747,  0.0000])

    References:
        Milakov & Gimelshein, "Online normalizer calculation for softmax" (2018); Hsu et al.,
        "Liger Kernel: Efficient Triton Kernels for LLM Training" (2024).
    """
    where = "linear_cross_entropy"
    ac = autocast_dtype(x.device.type) if isinstance(x, Tensor) else None
    _check(x, weight, target, ignore_index, where, same_dtype=ac is None)  # autocast casts both
    if ac is not None:
        # torch.autocast: the head's GEMM as F.linear computes it there; the casts stay outside the
        # Function so that the gradients reach the originals in their dtype
        x, weight = autocast_inputs(ac, x, weight)
        with torch.autocast(x.device.type, enabled=False):
            return linear_cross_entropy(x, weight, target, ignore_index=ignore_index)
    lead = x.shape[:-1]
    x2 = x.reshape(math.prod(lead), x.shape[-1])
    t1 = target.reshape(-1)
    if x.device.type == "cpu" and values_readable(t1):  # a read of the values costs no sync on CPU
        outside = (t1 != ignore_index) & ((t1 < 0) | (t1 >= weight.shape[0]))
        if bool(outside.any()):
            bad = int(t1[outside][0])
            raise IndexError(f"{where}: target holds {bad}, outside [0, {weight.shape[0]}) and not ignore_index "
                             f"{ignore_index}")
    refuse_compiled_transform(where, x)
    loss, _, _ = apply(_LinearCrossEntropy, x2, weight, t1, ignore_index)
    return loss


# The library op, every kernel side by side: CUDA and fake kernels from kernels/<stem>.py, the CPU
# kernel is the reference math; then its vmap rule.
_define(_K.linear_cross_entropy_fwd, cpu=_ref.linear_cross_entropy_fwd)
torch.library.register_vmap("fp8ops::linear_cross_entropy_fwd", _loop_vmap(_ops.linear_cross_entropy_fwd))
