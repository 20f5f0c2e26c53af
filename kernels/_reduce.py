"""Column sums of float32 partial buffers: the deterministic finalize of kernels that reduce over
rows without atomics.

A kernel that needs a sum over the rows of its input (a bias or norm-weight gradient) writes one
row of float32 partial sums per program or tile row, a ``(G, K)`` buffer; :func:`column_sums` adds
the G rows of one or two such buffers in one launch and writes them in the requested dtype::

    out[k] = sum_g part[g, k]      (float32, fixed order: BLOCK_G-row slabs in turn, then the slab's rows)

The order does not depend on the data or on timing, so the result is the same bits on every run.
One launch replaces a ``sum(0)`` per buffer and a dtype conversion per output.

Program (i, j) sums column block i of buffer j: ``cdiv(K, BLOCK_K)`` x (1 or 2) programs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._library import cdiv, fast_launch, graph_kernel

__all__ = ["column_sums"]

_BLOCK_G, _BLOCK_K, _NUM_WARPS = 64, 32, 4  # a program's (rows, columns) tile


@fast_launch
@triton.jit
def _column_sums_kernel(
    a_ptr,  # (G, K) float32 partial sums, contiguous
    b_ptr,  # (G, K) float32 partial sums, contiguous (TWO)
    out_a_ptr,  # (K,) output
    out_b_ptr,  # (K,) output (TWO)
    G,
    K,
    TWO: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rk = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    col_ok = rk < K
    part = a_ptr
    out = out_a_ptr
    if TWO:
        if tl.program_id(1) == 1:
            part = b_ptr
            out = out_b_ptr
    acc = tl.zeros((BLOCK_G, BLOCK_K), dtype=tl.float32)
    for g0 in range(0, G, BLOCK_G):
        rg = (g0 + tl.arange(0, BLOCK_G)).to(tl.int64)
        m = (rg < G)[:, None] & col_ok[None, :]
        acc += tl.load(part + rg[:, None] * K + rk[None, :], mask=m, other=0.0)
    tl.store(out + rk, tl.sum(acc, axis=0).to(out.dtype.element_ty), mask=col_ok)


def column_sums(a: torch.Tensor, b: torch.Tensor | None = None, *, dtype: torch.dtype = torch.float32,
                traced: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(a.sum(0), b.sum(0))`` of contiguous (G, K) float32 buffers, summed in float32 and written in
    ``dtype``, in one launch (``b`` None: ``(a.sum(0), None)``). G may be 0 (zeros). ``traced``:
    launched from a compiled graph, as the traced CUDA kernel that calls it (``_library.traced_kernel``)."""
    if a.dim() != 2 or a.dtype != torch.float32 or not a.is_contiguous():
        raise ValueError(f"column_sums: a must be a contiguous 2-D float32 tensor, got {a.dtype} of shape "
                         f"{tuple(a.shape)} and strides {tuple(a.stride())}")
    if b is not None and (b.shape != a.shape or b.dtype != torch.float32 or not b.is_contiguous()
                          or b.device != a.device):
        raise ValueError(f"column_sums: b must be a contiguous float32 tensor of a's shape {tuple(a.shape)} on "
                         f"{a.device}, got {b.dtype} of shape {tuple(b.shape)} on {b.device}")
    G, K = a.shape
    out_a = torch.empty((K,), dtype=dtype, device=a.device)
    out_b = torch.empty((K,), dtype=dtype, device=a.device) if b is not None else None
    if K:
        kernel = graph_kernel(_column_sums_kernel, traced)
        kernel[(cdiv(K, _BLOCK_K), 2 if b is not None else 1)](
            a, b if b is not None else a, out_a, out_b if out_b is not None else out_a, G, K,
            TWO=b is not None, BLOCK_G=_BLOCK_G, BLOCK_K=_BLOCK_K, num_warps=_NUM_WARPS,
        )
    return out_a, out_b
