"""Inputs and a loss for tests of an embedding tied to its output head
(:func:`fp8ops.tied_embedding` against plain PyTorch and the FP32 reference), on any device.

A "tied lookup" is any function ``(tokens, weight) -> (rows, head)``: ``fp8ops.tied_embedding``,
:func:`plain_tied` or ``fp8ops.reference.tied_embedding.tied_embedding``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["plain_tied", "tied_grad", "tied_inputs", "tied_loss"]


def tied_inputs(V: int, K: int, shape: tuple[int, ...], dtype: torch.dtype = torch.float32, *, seed: int = 0,
                device: str = "cpu", few: int | None = None, w_scale: float = 1.0
                ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Seeded ``(w, tokens, x, c)``: a (V, K) table (times ``w_scale``), tokens of ``shape`` drawn
    from the first ``few`` entries (all V when None), the head's input x and the rows' weights c,
    both (*shape, K), drawn in that order from a generator on ``device``."""
    g = torch.Generator(device=device).manual_seed(seed)
    w = (torch.randn(V, K, device=device, generator=g) * w_scale).to(dtype)
    tokens = torch.randint(0, few or V, shape, device=device, generator=g)
    x = torch.randn(*shape, K, device=device, generator=g).to(dtype)  # the head's input
    c = torch.randn(*shape, K, device=device, generator=g).to(dtype)  # weights of the rows in the loss
    return w, tokens, x, c


def tied_loss(fn: Callable[[Tensor, Tensor], Any], w: Tensor, tokens: Tensor, x: Tensor, c: Tensor) -> Tensor:
    """A tied GPT's two uses of the table through ``fn``: the lookup (weighted by c) and the head
    (logits of x), summed in float32."""
    rows, head = fn(tokens, w)
    logits = x.reshape(-1, x.shape[-1]) @ head.t()
    return (rows.float() * c.float()).sum() + logits.float().sin().sum()


def tied_grad(fn: Callable[[Tensor, Tensor], Any], w: Tensor, tokens: Tensor, x: Tensor, c: Tensor) -> Tensor:
    """The gradient of :func:`tied_loss` by a fresh leaf copy of ``w``."""
    wl = w.detach().clone().requires_grad_()
    tied_loss(fn, wl, tokens, x, c).backward()
    return wl.grad


def plain_tied(tokens: Tensor, w: Tensor) -> tuple[Tensor, Tensor]:
    """Plain PyTorch: the table looked up and used again."""
    return F.embedding(tokens, w), w
