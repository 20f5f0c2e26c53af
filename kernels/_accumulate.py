"""A float32 accumulator copied into its 16-bit destination, where that is a strided view.

The attention backwards sum dQ in a contiguous float32 buffer and then write it into ``dq``. Where
``dq`` is contiguous, torch's copy runs at the copy bandwidth. Where it is a view (the layer's
q, k and v are per-head views of one projection, and their gradients views of one gradient),
torch's copy takes its generic strided kernel: 99 µs for the seed layer's (4, 32, 2048, 128) dQ
on an H200, about half the bandwidth. Both sides are rows of ``D`` contiguous elements, so a
kernel over rows reads and writes whole lines: :func:`store_accumulated`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._library import cdiv, fast_launch, next_pow2

ROWS_PER_PROGRAM = 32


@fast_launch
@triton.jit
def _rows_cast_kernel(
    src_ptr,  # (N0, N1, N2, D) float32, contiguous
    dst_ptr,  # (N0, N1, N2, D) view: last stride 1
    n_rows,  # N0 * N1 * N2
    N1,
    N2,
    stride0,
    stride1,
    stride2,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    d = tl.arange(0, BLOCK_D)
    mask = (r < n_rows)[:, None] & (d < D)[None, :]
    x = tl.load(src_ptr + r[:, None] * D + d[None, :], mask=mask, other=0.0)
    i2 = r % N2
    i1 = (r // N2) % N1
    i0 = r // (N2 * N1)
    row = i0 * stride0 + i1 * stride1 + i2 * stride2
    tl.store(dst_ptr + row[:, None] + d[None, :], x.to(dst_ptr.dtype.element_ty), mask=mask)


def store_accumulated(dst: torch.Tensor, acc: torch.Tensor) -> None:
    """``dst.copy_(acc)`` for a contiguous float32 ``acc`` of ``dst``'s shape: by the row kernel
    where ``dst`` is a 3- or 4-dim 16-bit CUDA view with a contiguous last dim that is not
    contiguous as a whole, by torch's copy otherwise. Rounds to nearest even, as torch's copy."""
    if (not dst.is_cuda or dst.is_contiguous() or dst.stride(-1) != 1 or dst.dim() not in (3, 4)
            or not acc.is_contiguous() or acc.dtype != torch.float32 or acc.shape != dst.shape
            or dst.dtype not in (torch.bfloat16, torch.float16) or dst.numel() == 0):
        dst.copy_(acc)
        return
    rows_cast(dst, acc)


def rows_cast(dst: torch.Tensor, acc: torch.Tensor) -> None:
    """Launch the row kernel: ``dst[...] = acc`` cast to ``dst``'s dtype, ``acc`` contiguous float32
    of ``dst``'s (3- or 4-dim) shape, ``dst``'s last stride 1 (checked by the caller)."""
    d4 = dst if dst.dim() == 4 else dst.unsqueeze(0)
    N0, N1, N2, D = d4.shape
    n_rows = N0 * N1 * N2
    _rows_cast_kernel[(cdiv(n_rows, ROWS_PER_PROGRAM),)](
        acc, d4, n_rows, N1, N2, d4.stride(0), d4.stride(1), d4.stride(2),
        D=D, BLOCK_D=next_pow2(D), BLOCK_R=ROWS_PER_PROGRAM, num_warps=4,
    )
