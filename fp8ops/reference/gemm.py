"""FP32 reference for the scaled FP8 GEMM: the executable specification of ``fp8ops::scaled_mm``.

Math (``a`` (M, K) and ``b`` (N, K) FP8, inverse scales as ``torch._scaled_mm`` takes them)::

    a_dq = float32(a) * scale_a          # scale_a: () per tensor, or (M, 1) per row of a
    b_dq = float32(b) * scale_b^T        # scale_b: () per tensor, or (1, N) per row of b
    out  = out_dtype(a_dq @ b_dq^T + bias)

The matmul runs in float32 on the dequantized operands (every product of two FP8 values is exact in
float32), so the only roundings are the two dequantizing multiplies, the float32 sums and the final
cast. ``fast_accum`` does not change the reference: it names the accumulation mode of the GPU
kernel, and the reference is the precise answer both modes are measured against. This function is
also the CPU kernel of the ``fp8ops::scaled_mm`` library op.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["scaled_mm"]


def scaled_mm(
    a: Tensor,
    b: Tensor,
    scale_a: Tensor,
    scale_b: Tensor,
    bias: Tensor | None,
    out_dtype: torch.dtype,
    fast_accum: bool,
) -> Tensor:
    """Reference of ``fp8ops::scaled_mm``: ``(a @ b.T) * scale_a * scale_b (+ bias)`` in float32.

    Args:
        a: (M, K) FP8 (``torch.float8_e4m3fn`` or ``torch.float8_e5m2``).
        b: (N, K) FP8, the second operand stored K-major (``out = a @ b.T``).
        scale_a: () float32 (per tensor) or (M, 1) float32 (per row of ``a``): inverse scales.
        scale_b: () float32 (per tensor) or (1, N) float32 (per row of ``b``): inverse scales.
        bias: (N,) or None, any float dtype; added in float32 after scaling.
        out_dtype: dtype of the result (bfloat16, float16 or float32).
        fast_accum: accepted for signature parity with the op; the reference always accumulates
            in float32.

    Returns:
        (M, N) tensor of ``out_dtype``.

    Raises:
        ValueError: the shapes do not fit together.

    Example:
        >>> import torch
        >>> from fp8ops.reference.gemm import scaled_mm
        >>> a = torch.full((2, 32), 0.5).to(torch.float8_e4m3fn)
        >>> b = torch.ones(3, 32).to(torch.float8_e4m3fn)
        >>> scaled_mm(a, b, torch.tensor(2.0), torch.tensor(0.25), None, torch.float32, False)
        tensor([[8., 8., 8.],
                [8., 8., 8.]])
    """
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(
            f"scaled_mm: a must be (M, K) and b (N, K) with the same K, got {tuple(a.shape)} and {tuple(b.shape)}"
        )
    m, n = a.shape[0], b.shape[0]
    if scale_a.dim() not in (0, 2) or (scale_a.dim() == 2 and tuple(scale_a.shape) != (m, 1)):
        raise ValueError(f"scaled_mm: scale_a must be () or ({m}, 1), got {tuple(scale_a.shape)}")
    if scale_b.dim() not in (0, 2) or (scale_b.dim() == 2 and tuple(scale_b.shape) != (1, n)):
        raise ValueError(f"scaled_mm: scale_b must be () or (1, {n}), got {tuple(scale_b.shape)}")
    a_dq = a.to(torch.float32) * scale_a.to(torch.float32)  # (M, K)
    b_dq = b.to(torch.float32) * scale_b.to(torch.float32).reshape(-1, 1)  # (N, K); () -> (1, 1)
    out = a_dq @ b_dq.t()  # (M, N)
    if bias is not None:
        out = out + bias.to(torch.float32)
    return out.to(out_dtype)
