"""A token embedding whose table is also the output head: ``rows, head = tied_embedding(tokens, weight)``.

A language model with a tied head (GPT-2's) reads one table twice: ``weight[tokens]`` at the
input, ``x @ weight.T`` at the output. Autograd then builds two dense (V, K) gradients of the table
and adds them: the lookup's, a table of zeros with a few rows filled (in float32 when compiled,
then converted), and the head's GEMM output, summed in another pass. At a vocabulary of 50304 by
4096 each of those passes moves about 0.4 to 1.2 GB, for at most one row per token of information.

This op hands the table on to the head as its second output, so that one backward sees both
gradients: it adds the lookup's rows, summed per token in float32, into the head's gradient. Under
``torch.compile`` the add happens in place in the head's GEMM output; eagerly it writes a copy (an
incoming gradient may be shared, so it is never changed in place). On CUDA one kernel does the add
(``kernels/tied_embedding.py``: the tokens sorted, each token's rows summed by one program and its
row of the gradient written once); on CPU and under ``torch.func`` transforms the same math runs
out of place with torch ops.

The math is in :mod:`fp8ops.reference.tied_embedding`.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ._checks import check_float_tensor
from ._glue import apply, refuse_compiled_transform, values_readable
from .kernels import tied_embedding as _K
from .kernels._library import OPS, define as _define
from .reference import tied_embedding as _ref

__all__ = ["tied_embedding"]

_TOKEN_DTYPES = (torch.int64, torch.int32)


def _kernel_applies(*ts: Tensor) -> bool:
    # the CUDA kernel writes g in place: plain CUDA tensors, or a compiled graph's (torch.func
    # transforms, which would batch or differentiate the in-place op, take the out-of-place math)
    if not ts[0].is_cuda or torch._C._are_functorch_transforms_active():
        return False
    return torch.compiler.is_compiling() or not any(_is_functorch_wrapped(t) for t in ts)


_is_functorch_wrapped = torch._C._functorch.is_functorch_wrapped_tensor


class _TiedEmbedding(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(tokens: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:  # type: ignore[override]
        return F.embedding(tokens, weight), weight.view_as(weight)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        tokens, weight = inputs
        ctx.save_for_backward(tokens)
        ctx.table = (weight.shape, weight.dtype)

    @staticmethod
    def backward(ctx: Any, g_rows: Tensor | None, g_head: Tensor | None) -> tuple[None, Tensor | None]:  # type: ignore[override]
        if not ctx.needs_input_grad[1]:
            return None, None
        (tokens,) = ctx.saved_tensors
        shape, dtype = ctx.table
        with torch.no_grad():
            g = torch.zeros(shape, device=tokens.device, dtype=dtype) if g_head is None else g_head
            if g_rows is None:
                return None, g
            tok, rows = tokens.reshape(-1), g_rows.reshape(-1, shape[1])
            if not _kernel_applies(tok, rows, g):
                return None, _ref.add_rows(g, tok.long(), rows)
            if g_head is not None:
                # changed in place: in a compiled graph nothing else reads it; eagerly the incoming
                # gradient may be shared, so a copy
                g = g.contiguous() if torch.compiler.is_compiling() else g.clone(memory_format=torch.contiguous_format)
            OPS.tied_embedding_bwd(g, tok, rows)
        return None, g


# Under torch.compile and torch.func, autograd.Function.apply binds the arguments with
# inspect.signature(forward) on every call (eager calls skip the binding: _glue.apply).
_TiedEmbedding.forward.__signature__ = inspect.signature(_TiedEmbedding.forward)  # type: ignore[attr-defined]


def _check(tokens: Any, weight: Any, where: str) -> None:
    if not isinstance(tokens, Tensor):
        raise TypeError(f"{where}: tokens must be a torch.Tensor of token indices, got {type(tokens).__name__}")
    if tokens.dtype not in _TOKEN_DTYPES:
        raise ValueError(f"{where}: tokens must be int64 or int32 token indices, got {tokens.dtype}")
    check_float_tensor(weight, "weight", where)
    if weight.dim() != 2 or weight.shape[0] < 1:
        raise ValueError(f"{where}: weight must be a 2-D (V, K) table with V >= 1, got shape {tuple(weight.shape)}")
    if tokens.device != weight.device:
        raise ValueError(f"{where}: tokens is on {tokens.device} but weight is on {weight.device}; move it with "
                         f".to(weight.device)")


def tied_embedding(tokens: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
    """The embedding rows of ``tokens`` and the table itself, for an output head tied to it.

    ``rows`` is ``F.embedding(tokens, weight)``; ``head`` is ``weight`` (a view of it, the same
    values and storage) to hand to the model's output head: ``x @ head.T``,
    :func:`fp8ops.linear_cross_entropy` or :func:`fp8ops.fp8_linear` on it. The gradient that
    reaches ``weight`` is the sum of both uses', as with ``weight`` used twice, but it is built
    from the head's gradient by adding the lookup's rows to it (float32 sums per token), not as a
    second dense (V, K) gradient added to the first. Use ``head`` read-only (no in-place changes).

    Math::

        rows[t] = W[tokens[t]],   head = W
        dW = d(head) + sum over t of onehot(tokens[t]) d(rows)[t]^T

    Works with autograd, ``torch.func`` (grad, vjp, vmap) and ``torch.compile(fullgraph=True)`` +
    ``.backward()``; under ``torch.compile`` the rows are added in place in the head's gradient.

    Args:
        tokens: (...) int64 or int32 token indices in ``[0, V)``, any shape.
        weight: (V, K) float32, bfloat16 or float16, the table.

    Returns:
        ``(rows, head)``: (..., K) in weight's dtype, and the (V, K) table.

    Raises:
        TypeError, ValueError: a tensor of the wrong kind, dtype, shape or device; IndexError
            (CPU): a token outside ``[0, V)`` (on CUDA the lookup stops with a device-side
            assertion, as ``F.embedding``).

    Example:
        >>> import torch
        >>> from fp8ops import tied_embedding
        >>> w = torch.tensor([[1.0, 0.0], [0.0, 2.0], [3.0, 3.0]], requires_grad=True)
        >>> rows, head = tied_embedding(torch.tensor([2, 0, 2]), w)
        >>> rows
        tensor([[3., 3.],
                [1., 0.],
                [3., 3.]], grad_fn=<_TiedEmbeddingBackward>)
        >>> (rows.sum() + 10 * head[1].sum()).backward()
        >>> w.grad  # the lookup's ones (token 2 twice, token 0 once) and the head's tens in row 1
        tensor([[ 1.,  1.],
                [10., 10.],
                [ 2.,  2.]])
    """
    where = "tied_embedding"
    _check(tokens, weight, where)
    if tokens.device.type == "cpu" and values_readable(tokens):  # a read of the values costs no sync on CPU
        outside = (tokens < 0) | (tokens >= weight.shape[0])
        if bool(outside.any()):
            raise IndexError(f"{where}: tokens holds {int(tokens[outside][0])}, outside [0, {weight.shape[0]})")
    refuse_compiled_transform(where, weight)
    rows, head = apply(_TiedEmbedding, tokens, weight)
    return rows, head


# The library op: CUDA and fake kernels from kernels/tied_embedding.py, the CPU kernel is the
# reference math. It writes its first argument, so it has no vmap rule: torch.func transforms take
# the out-of-place math (_kernel_applies).
_define(_K.tied_embedding_bwd, cpu=_ref.tied_embedding_bwd)
