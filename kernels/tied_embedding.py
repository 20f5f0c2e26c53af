"""The backward of a token embedding tied to the output head: the lookup's rows added to the
head's gradient of the table, in place, each token's rows summed first.

Per token ``v`` that occurs in ``tokens`` (T positions), with ``g`` the (V, K) gradient of the
table from the head and ``rows`` the (T, K) gradient of the looked-up rows::

    g[v] = round(g[v] + sum over t with tokens[t] == v of rows[t])     (the sum in float32)

One rounding per touched row of ``g``, as adding a dense float32 gradient of the lookup would
give; rows of tokens that do not occur are not read or written.

Kernel:

- The launcher sorts the tokens (stable, so the positions of one token stay in order; as int32
  keys, half the radix passes of int64): a run of equal sorted tokens lists every position of one
  token.
- ``_add_rows_kernel``: one program per (sorted position, block of ``BLOCK_K`` columns). A program
  whose position does not start a run returns at once; the one that starts it walks the run
  ``BLOCK_R`` positions at a time (a (BLOCK_R, BLOCK_K) tile of rows gathered through the sort's
  order, the positions past the run masked), sums them in float32 and writes ``g[v]`` once, with a
  plain load and store: no other program touches that row, so there are no atomics, no (T, K)
  buffer and no fill, and the result does not depend on scheduling. A token that occurs n times
  costs its program n / BLOCK_R steps.

The op is registered as ``fp8ops::tied_embedding_bwd`` (``g`` mutable) with this launcher as its
CUDA kernel and a fake kernel; the CPU kernel, the reference math, is registered by
``fp8ops.tied_embedding``. Under ``torch.compile`` the call stays one node that Inductor runs in
place where ``g`` is not needed afterwards (the head's GEMM output).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from ._library import OpSpec, cdiv, fast_launch, merge_config, next_pow2

__all__ = ["tied_embedding_bwd", "tied_embedding_bwd_launch"]

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_TOKEN_DTYPES = (torch.int64, torch.int32)
_CFG = {"BLOCK_K": 1024, "BLOCK_R": 8, "num_warps": 4}
"""Columns per program, positions of a run summed per step, warps per program."""


@fast_launch
@triton.jit
def _add_rows_kernel(
    g_ptr,  # (V, K) gradient of the table, unit column stride; updated in place
    tok_ptr,  # (T,) tokens, sorted
    order_ptr,  # (T,) int64: the position in rows of each sorted token
    rows_ptr,  # (T, K) gradient of the looked-up rows, unit column stride
    T,
    K,
    stride_g,  # row stride of g
    stride_r,  # row stride of rows
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    col_ok = cols < K
    tok = tl.load(tok_ptr + i).to(tl.int64)
    prev = tl.load(tok_ptr + i - 1, mask=i > 0, other=-1).to(tl.int64)
    if prev != tok:  # this position starts the run of its token
        r = tl.arange(0, BLOCK_R)
        acc = tl.zeros([BLOCK_K], tl.float32)
        start = i
        more = i >= 0  # True, as a tensor (the loop's condition is one)
        while more:
            p = start + r
            same = tl.load(tok_ptr + p, mask=p < T, other=-1).to(tl.int64) == tok
            src = tl.load(order_ptr + p, mask=same, other=0)
            x = tl.load(rows_ptr + src[:, None] * stride_r + cols[None, :],
                        mask=same[:, None] & col_ok[None, :], other=0.0)
            acc += tl.sum(x.to(tl.float32), axis=0)
            start += BLOCK_R
            more = tl.sum(same.to(tl.int32), axis=0) == BLOCK_R  # the run may go on past this step
        g_row = g_ptr + tok * stride_g + cols
        old = tl.load(g_row, mask=col_ok, other=0.0).to(tl.float32)
        tl.store(g_row, (old + acc).to(g_ptr.dtype.element_ty), mask=col_ok)


def _check(g: torch.Tensor, tokens: torch.Tensor, rows: torch.Tensor) -> None:
    where = "tied_embedding_bwd_launch"
    if g.dim() != 2 or g.dtype not in _FLOAT_DTYPES or (g.shape[1] > 1 and g.stride(1) != 1):
        raise ValueError(f"{where}: g must be a 2-D (V, K) float32/bfloat16/float16 tensor with a unit column "
                         f"stride, got {g.dtype} of shape {tuple(g.shape)} and strides {g.stride()}")
    if tokens.dim() != 1 or tokens.dtype not in _TOKEN_DTYPES:
        raise ValueError(f"{where}: tokens must be a 1-D int64/int32 tensor, got {tokens.dtype} of shape "
                         f"{tuple(tokens.shape)}")
    T, K = tokens.shape[0], g.shape[1]
    if (rows.dim() != 2 or rows.dtype not in _FLOAT_DTYPES or tuple(rows.shape) != (T, K)
            or (K > 1 and rows.stride(1) != 1)):
        raise ValueError(f"{where}: rows must be a ({T}, {K}) float tensor with a unit column stride (one row "
                         f"per token, g's width), got {rows.dtype} of shape {tuple(rows.shape)} and strides "
                         f"{rows.stride()}")
    if not g.device == tokens.device == rows.device:
        raise ValueError(f"{where}: g, tokens and rows must be on one device, got {g.device}, {tokens.device}, "
                         f"{rows.device}")


def tied_embedding_bwd_launch(g: torch.Tensor, tokens: torch.Tensor, rows: torch.Tensor, *,
                              config: dict[str, Any] | None = None) -> None:
    """Add each token's rows of ``rows`` to its row of ``g``, in place, summed in float32 first.

    Args:
        g: (V, K) float32, bfloat16 or float16, unit column stride: the head's gradient of the table.
        tokens: (T,) int64 or int32 in ``[0, V)`` (not checked: a token outside reads and writes
            outside ``g``, as an index kernel would).
        rows: (T, K) float, unit column stride: the gradient of the looked-up rows.
        config: overrides of ``BLOCK_K``, ``BLOCK_R`` and ``num_warps``.
    """
    _check(g, tokens, rows)
    cfg = merge_config(_CFG, config, name="tied_embedding_bwd_launch")
    T, K = rows.shape
    if T == 0 or K == 0:
        return
    # int32 keys where the table allows: a radix sort of half the key bits (15 device operations
    # and 49 µs against 22 and 80 µs for 8192 int64 tokens on an H100, scripts/elementwise_ab.py)
    keys = tokens.to(torch.int32) if tokens.dtype == torch.int64 and g.shape[0] <= 2**31 - 1 else tokens
    sorted_tokens, order = torch.sort(keys, stable=True)
    block_k = min(cfg["BLOCK_K"], max(16, next_pow2(K)))
    _add_rows_kernel[(T, cdiv(K, block_k))](
        g, sorted_tokens, order, rows, T, K, g.stride(0), rows.stride(0),
        BLOCK_R=cfg["BLOCK_R"], BLOCK_K=block_k, num_warps=cfg["num_warps"],
    )


def _tied_embedding_bwd_fake(g, tokens, rows):  # type: ignore[no-untyped-def]
    return None


def _unit(t: torch.Tensor) -> torch.Tensor:
    # the kernel takes any row stride of the rows but needs a unit column stride (the tokens are
    # read only through their sorted copy)
    return t.contiguous() if t.dim() == 2 and t.shape[1] > 1 and t.stride(1) != 1 else t


tied_embedding_bwd = OpSpec(
    "tied_embedding_bwd(Tensor(a!) g, Tensor tokens, Tensor rows) -> ()",
    cuda=lambda g, tokens, rows: tied_embedding_bwd_launch(g, tokens, _unit(rows)),
    fake=_tied_embedding_bwd_fake,
)
"""``fp8ops::tied_embedding_bwd``: ``g`` with each token's rows added, in place; see
:func:`tied_embedding_bwd_launch`."""
