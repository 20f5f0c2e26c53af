"""Outputs allocated in the caller's memory layout (``bhsd``, ``bshd``, ``sbhd``, or packed
``thd``) and viewed as (B, H, S, D) for the kernels. The layouts themselves (``LAYOUTS``,
``to_bhsd`` and its inverses) belong to the reference, ``fp8ops.reference.attention``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..reference import attention as _ref
from ..reference.attention import MASKED_ROW_LSE


def _alloc_layout(shape4: tuple[int, int, int, int], layout: str, dtype: torch.dtype, device: torch.device,
                  zero: bool) -> Tensor:
    """A (B, H, S, D) view of a new tensor stored in ``layout`` (``thd``: (T, H, D) itself)."""
    make = torch.zeros if zero else torch.empty
    if layout == "thd":
        return make(shape4, dtype=dtype, device=device)
    B, H, S, D = shape4
    phys = {"bhsd": (B, H, S, D), "bshd": (B, S, H, D), "sbhd": (S, B, H, D)}[layout]
    return _ref.to_bhsd(make(phys, dtype=dtype, device=device), layout)


def _alloc_lse(q: Tensor, layout: str) -> Tensor:
    """A (B, H, S) fp32 log-sum-exp for q, stored in ``layout`` without its last dim (packed: (T, H))."""
    if layout == "thd":
        # Packed rows after the last sequence are never visited: they keep the masked-row value.
        return torch.full(q.shape[:2], MASKED_ROW_LSE, dtype=torch.float32, device=q.device)
    B, H, S, _ = q.shape
    phys = {"bhsd": (B, H, S), "bshd": (B, S, H), "sbhd": (S, B, H)}[layout]
    t = torch.empty(phys, dtype=torch.float32, device=q.device)
    return {"bhsd": t, "bshd": t.transpose(1, 2), "sbhd": t.permute(1, 2, 0)}[layout]
