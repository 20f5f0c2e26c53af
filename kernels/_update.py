"""The delayed-scaling update of many scaling states in one kernel (``fp8ops.update`` on a GPU).

Per state j, with its two observations (the pending amax and the gradient amax)::

    o         = max(pending_j, grad_j)                  (NaN if either is); if not finite, 0
                                                        (no information)
    seen_j    = o finite and > 0                        (the step observed something)
    history_j = [o, history_j[0 : L-1]]                 (rolled by one step)
    amax      = max(history_j), or o ("most_recent")
    scale_j   = fmax_j / amax / 2**margin               clamped to the normal float32 range,
                                                        optionally rounded down to a power of two;
                                                        the old scale where amax is 0 or not finite

and a zero vector for the cleared pending amaxes. The math is that of
:meth:`fp8ops.DelayedScaling.update_many` with the recipe's default hooks (``amax_from_history``,
``scale_from_amax``), which computes it with a dozen torch operations; this kernel writes every
output in one launch (one program per block of states). Division is round-to-nearest
(``div_rn``), as torch's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._jit import scale_from_fmax
from ._library import cdiv, fast_launch, next_pow2

__all__ = ["scale_update_launch"]


@triton.jit
def _scale_update_kernel(
    obs_ptr,  # (2S,) fp32: the pending amaxes, then the gradient amaxes (or (S,) merged ones)
    hist_ptr,  # (S, L) fp32 amax histories, row stride hist_stride
    scale_ptr,  # (S,) fp32 old scales, stride scale_stride
    fmax_ptr,  # (S,) fp32 the format's largest value per state
    new_hist_ptr,  # (S, L) fp32 out, contiguous
    new_scale_ptr,  # (S,) fp32 out
    seen_ptr,  # (S,) int8 out: 1 where the step observed something
    zeros_ptr,  # (S,) fp32 out: zeros (the cleared pending amaxes)
    S,
    L,
    obs_b,  # offset of the second observations in obs: S, or 0 when obs holds one per state
    hist_stride,
    scale_stride,
    MARGIN: tl.constexpr,
    POWER_2: tl.constexpr,
    MOST_RECENT: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_L: tl.constexpr,
):
    # Step 1: the merged observation; anything not finite (NaN, inf) is recorded as 0.
    rs = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    ok = rs < S
    a = tl.load(obs_ptr + rs, mask=ok, other=0.0)
    b = tl.load(obs_ptr + obs_b + rs, mask=ok, other=0.0)
    o = tl.where((a != a) | (b != b), float("nan"), tl.maximum(a, b))  # a NaN propagates, as in torch
    finite = tl.abs(o) < float("inf")  # NaN compares False
    o = tl.where(finite, o, 0.0)
    tl.store(seen_ptr + rs, (finite & (o > 0.0)).to(tl.int8), mask=ok)
    tl.store(zeros_ptr + rs, tl.zeros_like(o), mask=ok)
    # Step 2: the history rolled by one, the new observation in front.
    cols = tl.arange(0, BLOCK_L)
    inside = ok[:, None] & (cols[None, :] < L)
    old = tl.load(hist_ptr + rs[:, None] * hist_stride + (cols[None, :] - 1),
                  mask=inside & (cols[None, :] >= 1), other=0.0)
    hist = tl.where(cols[None, :] == 0, o[:, None], old)
    tl.store(new_hist_ptr + rs[:, None] * L + cols[None, :], hist, mask=inside)
    # Step 3: the amax of the history (a NaN in it, only from a corrupt state, propagates as in torch).
    if MOST_RECENT:
        amax = o
    else:
        amax = tl.max(tl.where(inside, hist, float("-inf")), axis=1)
        has_nan = tl.max(tl.where(inside & (hist != hist), 1, 0), axis=1) > 0
        amax = tl.where(has_nan, float("nan"), amax)
    # Step 4: fmax / amax / 2**margin, clamped to the normal float32 range; the old scale where the
    # amax is 0 or not finite (the casts' just-in-time scale, with a maximum per state).
    fmax = tl.load(fmax_ptr + rs, mask=ok, other=1.0)
    old_scale = tl.load(scale_ptr + rs * scale_stride, mask=ok, other=1.0)
    tl.store(new_scale_ptr + rs, scale_from_fmax(amax, old_scale, fmax, MARGIN=MARGIN, POWER_2=POWER_2), mask=ok)


_KERNEL = fast_launch(_scale_update_kernel)


def scale_update_launch(obs: torch.Tensor, hist: torch.Tensor, scale: torch.Tensor, fmax: torch.Tensor, *,
                        margin: int, power_2: bool, most_recent: bool
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(new_history (S, L), new_scale (S,), seen (S,) bool, zeros (S,))`` of S states in one launch.

    Args:
        obs: (2S,) float32, the pending amaxes followed by the gradient amaxes (a state without a
            gradient amax repeats its pending amax), or (S,): one merged observation per state.
        hist: (S, L) float32 with unit column stride (rows may be strided); scale: (S,) float32
            (any stride); fmax: (S,) float32 contiguous; all on one device.
        margin, power_2, most_recent: the recipe's margin, power-of-two rounding, and whether the
            amax is the newest observation instead of the history's maximum.
    """
    S, L = hist.shape
    if obs.shape not in ((2 * S,), (S,)) or scale.shape != (S,) or fmax.shape != (S,) or hist.stride(1) != 1:
        raise ValueError(f"scale_update_launch: expected obs (2S,) or (S,), hist (S, L) with unit column stride, scale "
                         f"and fmax (S,), got {tuple(obs.shape)}, {tuple(hist.shape)} stride {hist.stride()}, "
                         f"{tuple(scale.shape)}, {tuple(fmax.shape)}")
    dev = hist.device
    new_hist = torch.empty((S, L), dtype=torch.float32, device=dev)
    new_scale = torch.empty(S, dtype=torch.float32, device=dev)
    seen = torch.empty(S, dtype=torch.int8, device=dev)
    zeros = torch.empty(S, dtype=torch.float32, device=dev)
    block_l = next_pow2(max(L, 1))
    block_s = max(1, min(64, 4096 // block_l, next_pow2(S)))
    _KERNEL[(cdiv(S, block_s),)](
        obs.contiguous(), hist, scale, fmax.contiguous(), new_hist, new_scale, seen, zeros, S, L,
        S if obs.numel() == 2 * S else 0, hist.stride(0),
        scale.stride(0), MARGIN=margin, POWER_2=power_2, MOST_RECENT=most_recent, BLOCK_S=block_s,
        BLOCK_L=block_l, num_warps=4)
    return new_hist, new_scale, seen.view(torch.bool), zeros
