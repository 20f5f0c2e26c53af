"""The library of ready mods: causal, sliding-window, prefix-LM and document masks; ALiBi,
tanh soft-capping and relative-position bias scores.

Each factory validates its arguments and returns a :class:`~.mods.MaskMod` or
:class:`~.mods.ScoreMod` built from a plain function over :data:`~.mod_math.modmath`, so its
Triton twin (and derivative) is generated like a user's mod.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
from torch import Tensor

from ..kernels import attention as _K
from .codegen import _jit_source, _triton_scope
from .mod_math import modmath
from .mods import MaskMod, ScoreMod


def causal_mask() -> MaskMod:
    """Causal mask: query ``i`` sees keys ``j <= i`` (top-left aligned). Prefer ``causal=True``,
    which skips the invisible blocks without a block mask.

    Example:
        >>> import torch, fp8ops
        >>> fp8ops.causal_mask()(0, 0, torch.tensor(1), torch.arange(3))
        tensor([ True,  True, False])
    """

    def causal(b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
        return q_idx >= kv_idx

    return MaskMod(causal)


def sliding_window_mask(window: int) -> MaskMod:
    """Causal sliding window: query ``i`` sees the ``window`` keys ``i - window < j <= i``.

    Equivalent to ``window=window`` of :func:`attention`, which also skips invisible blocks.

    Example:
        >>> import torch, fp8ops
        >>> fp8ops.sliding_window_mask(2)(0, 0, torch.tensor(3), torch.arange(5))
        tensor([False, False,  True,  True, False])
    """
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"sliding_window_mask: window must be an int >= 1, got {window!r}")
    w = int(window)

    def sliding_window(b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
        d = q_idx - kv_idx
        return (d >= 0) & (d < w)

    mod = MaskMod(sliding_window)
    mod.spec.band = (w - 1, 0)
    return mod


def prefix_lm_mask(prefix_len: int | Tensor) -> MaskMod:
    """Prefix-LM: keys in the prefix are visible to every query, the rest causally.

    Args:
        prefix_len: the prefix length, an int for every sequence or a (B,) integer tensor (one
            per batch entry / packed sequence).

    Example:
        >>> import torch, fp8ops
        >>> fp8ops.prefix_lm_mask(2)(0, 0, torch.tensor(0), torch.arange(4))
        tensor([ True,  True, False, False])
    """
    if isinstance(prefix_len, Tensor):
        if prefix_len.dim() != 1 or prefix_len.is_floating_point():
            raise ValueError(f"prefix_lm_mask: a tensor prefix_len must be a 1-D integer (B,) tensor, "
                             f"got {tuple(prefix_len.shape)} {prefix_len.dtype}")
        lengths = prefix_len

        def prefix_lm(b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
            return (kv_idx <= q_idx) | (kv_idx < modmath.load(lengths, b))

        return MaskMod(prefix_lm)
    if isinstance(prefix_len, bool) or not isinstance(prefix_len, int) or prefix_len < 0:
        raise ValueError(f"prefix_lm_mask: prefix_len must be an int >= 0 or a (B,) tensor, got {prefix_len!r}")
    n = int(prefix_len)

    def prefix_lm_const(b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
        return (kv_idx <= q_idx) | (kv_idx < n)

    return MaskMod(prefix_lm_const)


def document_mask(document_ids: Tensor) -> MaskMod:
    """Document masking over packed sequences: a query sees only keys of its own document.

    Combine with :func:`causal_mask` (``and_masks``) for causal packed training, and build a
    :class:`BlockMask` from it so that blocks between documents are skipped.

    With ids that never decrease along a sequence (documents packed one after another, the usual
    case) the fused kernels test each score against the run of equal ids that holds its query or
    key, derived from the ids at every call: loads per tile row instead of per score, one bound
    per row when combined with :func:`causal_mask` by ``and_masks`` (two without); other ids are
    compared score by score. The mask reads the ids at each call, so they may be
    written in place between calls; ids that were non-decreasing when the mask was built and are
    then written so that they decrease raise an error in the call (on the GPU a device-side
    assertion): build the mask again from such ids.

    Args:
        document_ids: (S,) or (B, S) integer tensor: the document of each position (the same
            ids for queries and keys, so Sq == Skv == S).

    Example:
        >>> import torch, fp8ops
        >>> m = fp8ops.document_mask(torch.tensor([0, 0, 1, 1]))
        >>> m(0, 0, torch.tensor(2), torch.arange(4))
        tensor([False, False,  True,  True])
    """
    if not isinstance(document_ids, Tensor) or document_ids.is_floating_point() or document_ids.dim() not in (1, 2):
        raise ValueError("document_mask: document_ids must be an (S,) or (B, S) integer tensor")
    ids = document_ids
    seq = int(ids.shape[-1])
    batched = ids.dim() == 2

    def document(b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
        return modmath.load(ids, q_idx) == modmath.load(ids, kv_idx)

    def document_batched(b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
        return modmath.load(ids, b * seq + q_idx) == modmath.load(ids, b * seq + kv_idx)

    fn = document_batched if batched else document

    if ids.shape[-1] < 2 or bool((ids.diff(dim=-1) < 0).any()):
        return MaskMod(fn, name="document_mask")  # the kernels compare the ids of each query and key
    # Non-decreasing ids (packed documents): the kernels read [start, end) of each position's run
    # of equal ids, derived from the ids at every call (one small kernel, no host synchronisation),
    # so a tile needs loads per row instead of one per score. Ids later changed in place so that
    # they decrease stop that kernel with an error.
    twin, causal_twin, prepare = _document_twins(seq, batched)
    # two slots for the starts and the ends of the runs, derived at each call
    bounds = torch.empty(0, dtype=torch.int32, device=ids.device)
    mod = MaskMod(fn, triton=twin, buffers=(ids, bounds, bounds), name="document_mask")
    mod.spec.prepare = prepare
    # the index checks before a call read the ids as the comparison does (the runs: the same rows)
    mod.spec.facts_key = MaskMod(fn).key

    def causal_document(b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
        return (q_idx >= kv_idx) & fn(b, h, q_idx, kv_idx)

    # and_masks(causal_mask(), this) reads one bound per row instead of two (see mods._fuse_and)
    fused = MaskMod(causal_document, triton=causal_twin, buffers=(ids, bounds, bounds), name="causal & document_mask")
    fused.spec.prepare = prepare
    fused.spec.facts_key = mod.spec.facts_key
    fused.spec.band = (None, 0)  # causal
    mod.spec.and_causal = fused.spec
    return mod


@functools.lru_cache(maxsize=64)
def _document_twins(seq: int, batched: bool) -> tuple[Any, Any, Any]:
    """The Triton twins of a document mask of non-decreasing ids over sequences of ``seq``
    positions, alone and with the causal mask, and the ``prepare`` that derives their table of runs
    from the ids (:func:`~fp8ops.kernels.attention.document_bounds`: a row of starts, then a row of
    ends). Where the query index runs along a tile's rows (forward and dQ kernels) the runs are read
    by query position and the keys compared with them; where the key index does (dK/dV kernels), by
    key position. With the causal mask one bound suffices: ``kv >= start[q]`` by query rows,
    ``q < end[kv]`` by key rows, each with the causal bound as one unsigned comparison per score
    (``q - kv`` against the run's length from ``kv`` or to ``q``): two signed comparisons per score
    made ptxas pack the tile's predicates into registers bit by bit in the Hopper backward (sm_90,
    Triton 3.9: 929 instructions per tile step against 672)."""
    row = f"2 * {seq} * b + " if batched else ""
    name = f"_fp8ops_document_{seq}_{int(batched)}"
    src = f"""def {name}(b, h, q_idx, kv_idx, _fp8_t0, _fp8_t1, _fp8_t2, _fp8_t3):
    if q_idx.shape[0] == 1:
        at = {row}kv_idx
        vis = (q_idx >= tl.load(_fp8_t1 + at)) & (q_idx < tl.load(_fp8_t2 + at))
    else:
        at = {row}q_idx
        vis = (kv_idx >= tl.load(_fp8_t1 + at)) & (kv_idx < tl.load(_fp8_t2 + at))
    return vis
"""
    cname = f"_fp8ops_causal_document_{seq}_{int(batched)}"
    csrc = f"""def {cname}(b, h, q_idx, kv_idx, _fp8_t0, _fp8_t1, _fp8_t2, _fp8_t3):
    if q_idx.shape[0] == 1:  # kv <= q < end[kv]: q - kv below end[kv] - kv (> 0), as unsigned
        vis = (q_idx - kv_idx).to(tl.uint32) < (tl.load(_fp8_t2 + ({row}kv_idx)) - kv_idx).to(tl.uint32)
    else:  # start[q] <= kv <= q: q - kv at most q - start[q] (>= 0), as unsigned
        vis = (q_idx - kv_idx).to(tl.uint32) <= (q_idx - tl.load(_fp8_t1 + ({row}q_idx))).to(tl.uint32)
    return vis
"""
    twin = _jit_source(src, name, _triton_scope())
    causal_twin = _jit_source(csrc, cname, _triton_scope())

    def prepare(bufs: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        bounds = _K.document_bounds(bufs[0], seq)
        return bufs[0], bounds, bounds[seq:]  # the starts of row r at 2 r seq, its ends at 2 r seq + seq

    return twin, causal_twin, prepare


def alibi(num_heads: int | Tensor) -> ScoreMod:
    """ALiBi: adds ``slope_h * (kv_idx - q_idx)`` to the score (Press et al., 2022).

    Args:
        num_heads: the number of query heads (the paper's geometric slopes, computed in the
            kernel, including the rule for head counts that are not powers of two), or an (H,)
            tensor of slopes (learnable: it receives a gradient when it requires grad).

    Example:
        >>> import torch, fp8ops
        >>> fp8ops.alibi(2)(torch.zeros(()), 0, torch.tensor(0), torch.tensor(3), torch.arange(4))
        tensor([-0.1875, -0.1250, -0.0625,  0.0000])
    """
    if isinstance(num_heads, Tensor):
        if num_heads.dim() != 1 or not num_heads.is_floating_point():
            raise ValueError("alibi: a slopes tensor must be a 1-D float (H,) tensor")
        slopes = num_heads

        def alibi_slopes(score, b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
            return score + modmath.load(slopes, h) * (kv_idx - q_idx)

        return ScoreMod(alibi_slopes)
    if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1:
        raise ValueError(f"alibi: num_heads must be an int >= 1 or a slopes tensor, got {num_heads!r}")
    n = 2 ** int(math.floor(math.log2(num_heads)))  # closest power of two <= num_heads
    step = -8.0 / n
    step2 = -4.0 / n

    def alibi_geometric(score, b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
        # Heads < n: 2^(-8 (h + 1) / n); the others interleave the 2n-head sequence.
        slope = modmath.where(h < n, modmath.exp2(step * (h + 1)), modmath.exp2(step2 * (2 * (h - n) + 1)))
        return score + slope * (kv_idx - q_idx)

    return ScoreMod(alibi_geometric)


def softcap(cap: float) -> ScoreMod:
    """Tanh soft-capping: ``cap * tanh(score / cap)`` (Gemma 2 uses cap 50 for attention logits).

    Example:
        >>> import torch, fp8ops
        >>> fp8ops.softcap(10.0)(torch.tensor([0.0, 5.0]), 0, 0, 0, 0)
        tensor([0.0000, 4.6212])
    """
    if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not cap > 0 or not math.isfinite(cap):
        raise ValueError(f"softcap: cap must be a finite number > 0, got {cap!r}")
    c = float(cap)
    inv = 1.0 / c

    def tanh_softcap(score, b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
        return c * modmath.tanh(score * inv)

    return ScoreMod(tanh_softcap)


def relative_position_bias(table: Tensor) -> ScoreMod:
    """Adds a bias by relative position: ``score + table[h, kv_idx - q_idx + R]`` (learnable).

    Args:
        table: (H, 2R + 1) or (2R + 1,) float tensor (one row per query head, or shared); relative
            distances beyond ``R`` are clamped to the ends. It receives a gradient when it
            requires grad.

    Example:
        >>> import torch, fp8ops
        >>> mod = fp8ops.relative_position_bias(torch.tensor([-1.0, 0.0, 1.0]))
        >>> mod(torch.zeros(()), 0, 0, torch.tensor(2), torch.arange(5))
        tensor([-1., -1.,  0.,  1.,  1.])
    """
    if not isinstance(table, Tensor) or not table.is_floating_point() or table.dim() not in (1, 2) \
            or table.shape[-1] % 2 != 1:
        raise ValueError("relative_position_bias: table must be a float (H, 2R + 1) or (2R + 1,) tensor")
    width = int(table.shape[-1])
    r = (width - 1) // 2
    bias = table
    if table.dim() == 1:

        def rel_bias_shared(score, b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
            return score + modmath.load(bias, modmath.clamp(kv_idx - q_idx, -r, r) + r)

        return ScoreMod(rel_bias_shared)

    def rel_bias(score, b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
        return score + modmath.load(bias, h * width + modmath.clamp(kv_idx - q_idx, -r, r) + r)

    return ScoreMod(rel_bias)
