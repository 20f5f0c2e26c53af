"""FP32 reference for :func:`fp8ops.tied_embedding`.

Written from the definition: the lookup ``W[tokens]`` and the table itself, both differentiable,
so that ``torch.autograd`` adds the two uses' gradients of ``W`` the plain way (a dense gradient
of the lookup plus the head's), which checks the op's own backward.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["tied_embedding"]


def tied_embedding(tokens: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
    """``(W[tokens], W)`` in float32 (differentiable).

    Args:
        tokens: (...) integer token indices in ``[0, V)``; weight: (V, K).

    Returns:
        (..., K) rows and the (V, K) table, both float32.
    """
    w = weight.to(torch.float32)
    return w[tokens.long()], w
