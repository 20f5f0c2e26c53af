"""FP32 reference for :func:`fp8ops.tied_embedding`.

Written from the definition: the lookup ``W[tokens]`` and the table itself, both differentiable,
so that ``torch.autograd`` adds the two uses' gradients of ``W`` the plain way (a dense gradient
of the lookup plus the head's), which checks the op's own backward; and the backward's math as the
op computes it on CPU (``add_rows``, the CPU kernel of ``fp8ops::tied_embedding_bwd``).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["add_rows", "tied_embedding", "tied_embedding_bwd"]


def tied_embedding(tokens: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
    """``(W[tokens], W)`` in float32 (differentiable).

    Args:
        tokens: (...) integer token indices in ``[0, V)``; weight: (V, K).

    Returns:
        (..., K) rows and the (V, K) table, both float32.
    """
    w = weight.to(torch.float32)
    return w[tokens.long()], w


def add_rows(g: Tensor, tokens: Tensor, rows: Tensor) -> Tensor:
    """``g`` with each token's rows of ``rows`` added to its row, out of place: the rows of one
    token summed in float32 first, then added once (the one rounding of ``g[v] + sum``, as a float32
    dense gradient of the lookup added to ``g`` would give).

    Static shapes, no host sync: the first position of each token (a (V,) minimum), the rows summed
    at those positions in a (T, K) float32 buffer, then one accumulating write per position, whose
    rows are zero except at first positions.

    Args:
        g: (V, K) float; tokens: (T,) int64 in ``[0, V)``; rows: (T, K) float.
    """
    T = tokens.numel()
    pos = torch.arange(T, device=tokens.device)
    first = torch.full((g.shape[0],), T, device=tokens.device, dtype=torch.int64)
    first = first.scatter_reduce(0, tokens, pos, "amin")  # (V,) the first position of each token
    sums = torch.zeros(T, g.shape[1], device=g.device, dtype=torch.float32)
    sums = sums.index_add(0, first[tokens], rows.to(torch.float32))
    return torch.index_put(g, (tokens,), sums.to(g.dtype), accumulate=True)


def tied_embedding_bwd(g: Tensor, tokens: Tensor, rows: Tensor) -> None:
    """The CPU kernel of ``fp8ops::tied_embedding_bwd``: :func:`add_rows` written into ``g``."""
    g.copy_(add_rows(g, tokens.long(), rows))
