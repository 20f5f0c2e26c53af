"""FP32 reference for :func:`fp8ops.linear_cross_entropy`.

Written from the equations: ``z = x W^T`` in float32, each row's loss ``lse(z_r) - z_{r, t_r}``
with ``lse(z) = m + log sum_j exp(z_j - m)``, ``m = max_j z_j``, and the mean over the rows whose
target is not ``ignore_index``. Its gradients come from ``torch.autograd``, so they check the op's
hand-written backward. :func:`linear_cross_entropy_fwd` is the op's CPU kernel: the per-row losses
and their gradient by the logits, by hand.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["linear_cross_entropy", "linear_cross_entropy_fwd"]


def linear_cross_entropy(x: Tensor, weight: Tensor, target: Tensor, *, ignore_index: int = -100) -> Tensor:
    """Mean cross-entropy of ``x W^T`` against ``target`` in float32 (differentiable).

    Args:
        x: (..., K); weight: (V, K); target: (...) class indices.

    Returns:
        () float32: the sum of the kept rows' losses over their count (NaN when no row is kept, as
        ``torch.nn.functional.cross_entropy``).
    """
    z = x.reshape(-1, x.shape[-1]).to(torch.float32) @ weight.to(torch.float32).t()  # (M, V)
    t = target.reshape(-1)
    kept = t != ignore_index
    m = z.max(dim=1, keepdim=True).values.detach()
    lse = m.squeeze(1) + torch.log(torch.exp(z - m).sum(dim=1))
    z_t = z.gather(1, torch.where(kept, t, 0).long().unsqueeze(1)).squeeze(1)
    rows = torch.where(kept, lse - z_t, torch.zeros_like(lse))
    return rows.sum() / kept.sum()


def linear_cross_entropy_fwd(logits: Tensor, target: Tensor, ignore_index: int) -> tuple[Tensor, Tensor]:
    """The CPU kernel of ``fp8ops::linear_cross_entropy_fwd``: ``(loss, d)``, the (M,) float32
    per-row losses (0 where the target is ``ignore_index``, NaN where it lies outside ``[0, V)``)
    and ``d = softmax(z_r) - onehot(t_r)`` (M, V) in the logits' dtype (zero rows where ignored)."""
    z = logits.to(torch.float32)
    V = z.shape[1]
    t = target.long()
    ignored = t == ignore_index
    inside = (t >= 0) & (t < V)
    lse = torch.logsumexp(z, dim=1)
    z_t = z.gather(1, torch.where(inside, t, 0).unsqueeze(1)).squeeze(1)
    loss = torch.where(inside, lse - z_t, torch.full_like(lse, float("nan")))
    loss = torch.where(ignored, torch.zeros_like(loss), loss)
    d = torch.exp(z - lse.unsqueeze(1))
    onehot = torch.arange(V, device=z.device).unsqueeze(0) == t.unsqueeze(1)
    d = torch.where(ignored.unsqueeze(1), torch.zeros_like(d), d - onehot.to(d.dtype))
    return loss, d.to(logits.dtype)
