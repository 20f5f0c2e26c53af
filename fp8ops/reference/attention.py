"""FP32 reference for :func:`fp8ops.attention`: the executable specification of the op.

Math, per batch entry ``b`` and query head ``h`` (``hk = h // (Hq // Hkv)`` the key/value head)::

    s[i, j]   = scale * <q[b, h, i], k[b, hk, j]>                  # fp32
    s[i, j]   = score_mod(s[i, j], b, h, i, j)                      # optional, fp32
    vis[i, j] = band(i, j) & mask_mod(b, h, i, j) & block_mask(i, j) & same_sequence(i, j)
    lse[i]    = log sum_{j: vis} exp(s[i, j])                       # MASKED_ROW_LSE if no j is visible
    p[i, j]   = exp(s[i, j] - lse[i])   where vis, else 0
    out[i]    = sum_j p[i, j] * keep[i, j] / (1 - dropout_p) * v[b, hk, j]

with ``band(i, j) = (i - j <= left) & (j - i <= right)`` from ``window=(left, right)`` (``causal``
sets ``right = 0``: top-left aligned, ``j <= i``, as in ``F.scaled_dot_product_attention``), and
``keep`` the counter-based dropout mask of :func:`dropout_keep`. With ``cu_seqlens`` the indices
``b, i, j`` given to the mods are the sequence index and the positions inside the sequence.

A row that sees no key gives ``out = 0`` and ``lse = MASKED_ROW_LSE`` (a large negative finite
number: ``exp(lse) == 0``, and merging partial results with ``logaddexp`` ignores the row), never
NaN. Everything is differentiable with autograd, including tensors captured by ``score_mod``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import Tensor

# The log-sum-exp reported for a query row that sees no key (its output is 0). Defined once, with
# the kernels that write it (they import only torch and triton); re-exported here and by the op.
from ..kernels.attention import MASKED_ROW_LSE

__all__ = [
    "LAYOUTS",
    "BlockMaskLike",
    "MASKED_ROW_LSE",
    "attention",
    "attention_math",
    "dropout_keep",
    "dropout_threshold",
    "from_bhsd",
    "lse_from_bhs",
    "normalize_window",
    "segments",
    "to_bhsd",
]

LAYOUTS: tuple[str, ...] = ("bhsd", "bshd", "sbhd")
"""Dense layouts: the order of the (batch, heads, sequence, head_dim) dimensions in memory."""

_MASK32 = 0xFFFFFFFF
_MIX_M1 = 0x7FEB352D
_MIX_M2 = 0x846CA68B
_DROP_M1 = 0x21F0AAAD  # the per-element round of dropout_keep
_DROP_M2 = 0x735A2D97


# ------------------------------------------------------------------------------------------------
# Layouts


def to_bhsd(x: Tensor, layout: str) -> Tensor:
    """A (B, H, S, D) view of a dense tensor stored in ``layout``."""
    if layout == "bhsd":
        return x
    if layout == "bshd":
        return x.transpose(1, 2)
    if layout == "sbhd":
        return x.permute(1, 2, 0, 3)
    raise ValueError(f"attention: layout must be one of {LAYOUTS}, got {layout!r}")


def from_bhsd(x: Tensor, layout: str) -> Tensor:
    """The inverse of :func:`to_bhsd`: a (B, H, S, D) tensor viewed in ``layout``."""
    if layout == "bhsd":
        return x
    if layout == "bshd":
        return x.transpose(1, 2)
    if layout == "sbhd":
        return x.permute(2, 0, 1, 3)
    raise ValueError(f"attention: layout must be one of {LAYOUTS}, got {layout!r}")


def lse_from_bhs(lse: Tensor, layout: str) -> Tensor:
    """A (B, H, S) log-sum-exp viewed in ``layout`` without its last dim: (B, H, S), (B, S, H), (S, B, H)."""
    if layout == "bhsd":
        return lse
    if layout == "bshd":
        return lse.transpose(1, 2)
    return lse.permute(2, 0, 1)


# ------------------------------------------------------------------------------------------------
# Masks and dropout


def normalize_window(window: Any, causal: bool, *, where: str = "attention") -> tuple[int | None, int | None]:
    """``(left, right)`` bounds of the visible band ``i - left <= j <= i + right`` (None: unbounded).

    ``window=w`` (an int) means the ``w`` most recent keys including the query's own position:
    ``(w - 1, 0)``. ``window=(left, right)`` is taken as is (either may be None). ``causal=True``
    sets ``right = min(right, 0)``.
    """
    left: int | None
    right: int | None
    if window is None:
        left, right = None, None
    elif isinstance(window, bool):
        raise TypeError(f"{where}: window must be an int, a (left, right) pair or None, got {window!r}")
    elif isinstance(window, int):
        if window < 1:
            raise ValueError(f"{where}: window must be >= 1 (the number of visible keys), got {window}")
        left, right = window - 1, 0
    elif isinstance(window, (tuple, list)) and len(window) == 2:
        left, right = window
        for name, val in (("left", left), ("right", right)):
            if val is not None and (isinstance(val, bool) or not isinstance(val, int) or val < 0):
                raise ValueError(f"{where}: window {name} bound must be a non-negative int or None, got {val!r}")
    else:
        raise TypeError(f"{where}: window must be an int, a (left, right) pair or None, got {window!r}")
    if causal:
        right = 0 if right is None else min(right, 0)
    return left, right


def _mul32(x: Tensor, c: int) -> Tensor:
    # (x * c) mod 2**32 for 0 <= x < 2**32 without overflowing int64.
    lo = x & 0xFFFF
    hi = x >> 16
    return ((((hi * c) & 0xFFFF) << 16) + lo * c) & _MASK32


def _mix32(x: Tensor) -> Tensor:
    # A 32-bit integer hash (xor-shift-multiply), the same sequence of operations as the kernel's.
    x = x ^ (x >> 16)
    x = _mul32(x, _MIX_M1)
    x = x ^ (x >> 15)
    x = _mul32(x, _MIX_M2)
    return x ^ (x >> 16)


def dropout_threshold(p: float) -> int:
    """The 16-bit threshold of :func:`dropout_keep`: an element is kept when its 16-bit draw is >=
    it (``round(p * 2**16)``, at most ``2**16 - 1``), so the realised drop rate is within
    ``2**-17`` of ``p``."""
    return min(int(round(float(p) * (1 << 16))), (1 << 16) - 1)


def dropout_keep(seed: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor, p: float) -> Tensor:
    """The dropout mask: True where the attention weight of (b, h, q_idx, kv_idx) is kept.

    A counter-based hash of ``(seed, b, h, q_idx, kv_idx)``, so the forward and backward kernels
    (and this reference) regenerate the same mask without storing it. Queries ``i`` and ``i + 8``
    of each aligned group of 16 share one 32-bit hash (their pair index ``qp``) and take its two
    16-bit halves::

        k0 = mix(seed_lo ^ mix(seed_hi));  k1 = mix(k0 + b);  k2 = mix(k1 + h)
        qp = (q_idx >> 4) * 8 + (q_idx & 7)
        r  = (mix(k2 + qp) ^ kv_idx) * 0x21F0AAAD             # 32-bit wrapping arithmetic
        r  = (r ^ (r >> 15)) * 0x735A2D97
        u  = r >> 16                 if q_idx & 8             # the pair's upper query: top half
             (r ^ (r >> 16)) & 0xFFFF  otherwise              # the lower one: the halves' xor
        keep = u >= round(p * 2**16)

    ``mix`` is a full two-round xor-shift-multiply hash; the per-element part after it (once per
    query pair) is one multiply, xor-shift, multiply round: the integer work a kernel pays per two
    attention weights, since a thread of the wgmma layouts holds both weights of a pair. The keep
    decisions of weights up to 8 apart in a row, of neighbouring rows and of the rows of a pair are
    uncorrelated within sampling error over 2 million weights (tests/test_attention.py).

    Args:
        seed: () int64. b, h, q_idx, kv_idx: broadcastable integer tensors. p: drop probability.

    Returns:
        A bool tensor of the broadcast shape; about ``1 - p`` of it is True.
    """
    seed = seed.to(torch.int64)
    lo = seed & _MASK32
    hi = (seed >> 32) & _MASK32
    k0 = _mix32(lo ^ _mix32(hi))
    k1 = _mix32((k0 + b.to(torch.int64)) & _MASK32)
    k2 = _mix32((k1 + h.to(torch.int64)) & _MASK32)
    q = q_idx.to(torch.int64)
    qp = ((q >> 4) << 3) | (q & 7)
    r = _mix32((k2 + qp) & _MASK32) ^ kv_idx.to(torch.int64)
    r = _mul32(r, _DROP_M1)
    r = _mul32(r ^ (r >> 15), _DROP_M2)
    u = torch.where((q & 8) != 0, r >> 16, (r ^ (r >> 16)) & 0xFFFF)
    return u >= dropout_threshold(p)


def segments(cu_seqlens: Tensor, total: int) -> tuple[Tensor, Tensor]:
    """``(seg, pos)`` of each of ``total`` packed tokens: its sequence index and its position in it.

    Tokens after ``cu_seqlens[-1]`` get ``seg = len(cu_seqlens) - 1`` (no sequence).
    """
    cu = cu_seqlens.to(torch.int64)
    t = torch.arange(total, device=cu.device)
    seg = torch.searchsorted(cu[1:], t, right=True)
    start = cu[:-1].gather(0, seg.clamp(max=cu.numel() - 2))
    return seg, t - start


# ------------------------------------------------------------------------------------------------
# The math


class BlockMaskLike(Protocol):
    """What the reference reads of a block mask (an :class:`fp8ops.BlockMask`): the state of every
    (query block, key block) pair, the block size and the mask applied inside partial blocks."""

    @property
    def block_size(self) -> tuple[int, int]: ...

    @property
    def mask_mod(self) -> Callable[..., Any]: ...

    def block_states(self) -> Tensor: ...


def _block_visibility(block_mask: BlockMaskLike, sq: int, skv: int) -> Tensor:
    """(B', H', Sq, Skv) int8 per element: 0 empty block, 1 partial block, 2 full block."""
    state = block_mask.block_states()  # (B', H', NQ, NKV)
    bq, bkv = block_mask.block_size
    dense = state.repeat_interleave(bq, dim=2).repeat_interleave(bkv, dim=3)
    return dense[:, :, :sq, :skv]


def attention_math(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    score_mod: Callable[..., Tensor] | None = None,
    mask_mod: Callable[..., Tensor] | None = None,
    block_mask: BlockMaskLike | None = None,
    scale: float,
    left: int | None = None,
    right: int | None = None,
    seg_q: Tensor | None = None,
    seg_kv: Tensor | None = None,
    pos_q: Tensor | None = None,
    pos_kv: Tensor | None = None,
    num_seqs: int = 1,
    dropout_p: float = 0.0,
    dropout_seed: Tensor | None = None,
    compute_dtype: torch.dtype = torch.float32,
) -> tuple[Tensor, Tensor]:
    """Attention on (B, H, S, D) tensors: ``(out (B, Hq, Sq, Dv) in q.dtype, lse (B, Hq, Sq) fp32)``.

    ``compute_dtype`` float32 is the reference; bfloat16/float16 give "plain PyTorch at the same
    precision" (GEMMs in that dtype, softmax in float32), the yardstick of the error rule.
    Packed sequences come as B = 1 with ``seg_q``/``seg_kv`` (sequence of each token) and
    ``pos_q``/``pos_kv`` (position inside it), ``num_seqs`` sequences.
    """
    B, Hq, Sq, _ = q.shape
    Hkv, Skv = k.shape[1], k.shape[2]
    dev = q.device
    group = Hq // Hkv
    qc, kc, vc = q.to(compute_dtype), k.to(compute_dtype), v.to(compute_dtype)
    if group > 1:
        kc = kc.repeat_interleave(group, dim=1)
        vc = vc.repeat_interleave(group, dim=1)
    s = torch.matmul(qc, kc.transpose(-1, -2)).to(torch.float32) * scale  # (B, Hq, Sq, Skv)

    # Step 1: the index tensors the mods see (broadcastable to the score tile).
    h_idx = torch.arange(Hq, device=dev).view(1, Hq, 1, 1)
    if seg_q is not None:
        assert seg_kv is not None and pos_q is not None and pos_kv is not None
        same = seg_q.view(1, 1, Sq, 1) == seg_kv.view(1, 1, 1, Skv)
        b_idx = seg_q.clamp(max=max(num_seqs - 1, 0)).view(1, 1, Sq, 1)
        q_idx = pos_q.view(1, 1, Sq, 1)
        # Pairs across sequences are masked; give the mods a valid index there.
        kv_idx = torch.where(same, pos_kv.view(1, 1, 1, Skv), torch.zeros((), dtype=pos_kv.dtype, device=dev))
    else:
        same = None
        b_idx = torch.arange(B, device=dev).view(B, 1, 1, 1)
        q_idx = torch.arange(Sq, device=dev).view(1, 1, Sq, 1)
        kv_idx = torch.arange(Skv, device=dev).view(1, 1, 1, Skv)

    # Step 2: score_mod, in fp32.
    if score_mod is not None:
        s = torch.broadcast_to(score_mod(s, b_idx, h_idx, q_idx, kv_idx), s.shape).to(torch.float32)

    # Step 3: what each query sees.
    vis = torch.ones((1, 1, 1, 1), dtype=torch.bool, device=dev)
    if left is not None:
        vis = vis & (q_idx - kv_idx <= left)
    if right is not None:
        vis = vis & (kv_idx - q_idx <= right)
    if same is not None:
        vis = vis & same
    if block_mask is not None:
        blocks = _block_visibility(block_mask, Sq, Skv)
        mm = mask_mod(b_idx, h_idx, q_idx, kv_idx) if mask_mod is not None else True
        vis = vis & ((blocks == 2) | ((blocks == 1) & mm))
    elif mask_mod is not None:
        vis = vis & mask_mod(b_idx, h_idx, q_idx, kv_idx)
    vis = torch.broadcast_to(vis, s.shape)

    # Step 4: softmax with a guard for rows that see nothing.
    s = s.masked_fill(~vis, float("-inf"))
    if Skv > 0:
        m = s.amax(dim=-1, keepdim=True).detach()
    else:
        m = s.new_zeros((*s.shape[:-1], 1))
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(s - m)
    l = e.sum(dim=-1, keepdim=True)
    seen = l > 0
    l_safe = torch.where(seen, l, torch.ones_like(l))
    p = e / l_safe
    lse = torch.where(seen, m + torch.log(l_safe), torch.full_like(l, MASKED_ROW_LSE)).squeeze(-1)

    # Step 5: dropout on the weights, then the weighted sum of values.
    if dropout_p > 0.0:
        assert dropout_seed is not None
        keep = dropout_keep(dropout_seed, b_idx, h_idx, q_idx, kv_idx, dropout_p)
        p = torch.where(keep, p / (1.0 - dropout_p), torch.zeros_like(p))
    out = torch.matmul(p.to(compute_dtype), vc)
    return out.to(q.dtype), lse


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    state: Any = None,
    *,
    recipe: Any = None,
    score_mod: Callable[..., Tensor] | None = None,
    mask_mod: Callable[..., Tensor] | None = None,
    block_mask: BlockMaskLike | None = None,
    causal: bool = False,
    window: int | tuple[int | None, int | None] | None = None,
    scale: float | None = None,
    layout: str = "bhsd",
    cu_seqlens_q: Tensor | None = None,
    cu_seqlens_kv: Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_kv: int | None = None,
    return_lse: bool = False,
    dropout_p: float = 0.0,
    dropout_seed: int | Tensor | None = None,
    compute_dtype: torch.dtype = torch.float32,
) -> tuple[Any, None]:
    """Reference of :func:`fp8ops.attention` (same arguments, same returns), in plain PyTorch.

    ``max_seqlen_*`` are accepted and ignored. ``compute_dtype`` (not in the public op) selects the
    GEMM precision: float32 for the reference, the input dtype for "plain PyTorch at the same
    precision". ``dropout_p > 0`` needs an explicit ``dropout_seed`` here.

    Returns:
        ``(out, None)``, or ``((out, lse), None)`` with ``return_lse``.
    """
    if state is not None or recipe is not None:
        raise NotImplementedError("reference attention: FP8 attention (state/recipe) is not available yet")
    left, right = normalize_window(window, causal)
    d = q.shape[-1]
    sm_scale = float(scale) if scale is not None else d**-0.5
    seed = None
    if dropout_p > 0.0:
        if dropout_seed is None:
            raise ValueError("reference attention: dropout_p > 0 needs dropout_seed")
        seed = torch.as_tensor(dropout_seed, dtype=torch.int64, device=q.device)
    if mask_mod is None and block_mask is not None:
        mask_mod = block_mask.mask_mod
    if cu_seqlens_q is not None:
        cu_kv = cu_seqlens_kv if cu_seqlens_kv is not None else cu_seqlens_q
        seg_q, pos_q = segments(cu_seqlens_q, q.shape[0])
        seg_kv, pos_kv = segments(cu_kv, k.shape[0])
        # Tokens after the last sequence belong to no sequence: give them distinct segments.
        n = cu_seqlens_q.numel() - 1
        seg_kv = torch.where(seg_kv >= n, seg_kv + 1, seg_kv)
        q4, k4, v4 = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # (1, H, T, D)
        out, lse = attention_math(
            q4, k4, v4, score_mod=score_mod, mask_mod=mask_mod, block_mask=None, scale=sm_scale,
            left=left, right=right, seg_q=seg_q, seg_kv=seg_kv, pos_q=pos_q, pos_kv=pos_kv, num_seqs=n,
            dropout_p=dropout_p, dropout_seed=seed, compute_dtype=compute_dtype,
        )
        out = out.squeeze(0).transpose(0, 1).contiguous()  # (T, Hq, Dv)
        lse = lse.squeeze(0).transpose(0, 1).contiguous()  # (T, Hq)
    else:
        q4, k4, v4 = (to_bhsd(t, layout) for t in (q, k, v))
        out, lse = attention_math(
            q4, k4, v4, score_mod=score_mod, mask_mod=mask_mod, block_mask=block_mask, scale=sm_scale,
            left=left, right=right, dropout_p=dropout_p, dropout_seed=seed, compute_dtype=compute_dtype,
        )
        out = from_bhsd(out, layout).contiguous()
        lse = lse_from_bhs(lse, layout).contiguous()
    return ((out, lse) if return_lse else out), None
