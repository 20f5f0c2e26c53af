"""The public op :func:`attention`: argument handling, the choice of path (PyTorch's SDPA, the
fused Triton kernels of :mod:`.autograd`, or the FP32 reference math of
``fp8ops.reference.attention``) and the repackaging of its outputs.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from .._checks import check_float_tensor
from .._glue import autocast_dtype, autocast_inputs
from ..reference import attention as _ref
from ..reference.attention import LAYOUTS
from .autograd import _attention_triton
from .block_mask import BlockMask
from .checks import (
    _check_cu,
    _check_mod_statically,
    _check_offsets,
    _check_seed,
    _checked_mod,
    _index,
    _seed_tensor,
)
from .._glue import values_readable
from .mods import _MASK_ARITY, _SCORE_ARITY, MaskMod, ScoreMod


def _as_mod(m: Any, cls: type, name: str, where: str, arity: int) -> Any:
    if m is None or isinstance(m, cls):
        return m
    other = MaskMod if cls is ScoreMod else ScoreMod
    if isinstance(m, other):
        raise TypeError(f"{where}: {name} got a {other.__name__}; pass it as "
                        f"{'mask_mod' if other is MaskMod else 'score_mod'}")
    if not callable(m):
        raise TypeError(f"{where}: {name} must be a {cls.__name__} or a function, got {type(m).__name__}")
    if not torch.compiler.is_compiling():
        try:
            n = len(inspect.signature(m).parameters)
        except (TypeError, ValueError):
            n = arity
        if n != arity:
            args = "(score, b, h, q_idx, kv_idx)" if arity == 5 else "(b, h, q_idx, kv_idx)"
            raise TypeError(f"{where}: {name} must take {args}, got a function of {n} argument(s) "
                            f"(a mod factory such as fp8ops.softcap must be called: softcap(30.0))")
    return m


HOPPER_DROPOUT = True
"""``backend="auto"`` runs dense calls with dropout on the Hopper kernels where they apply
(:func:`_hopper_dropout_faster`); False keeps SDPA for them (for measurements and tests)."""

HOPPER_DROPOUT_CAUSAL_MIN_SEQ = 2048
"""The fewest queries at which ``backend="auto"`` runs a causal call with dropout on the Hopper
kernels (:func:`_hopper_dropout_faster`); shorter ones stay on SDPA."""

QKV_GRADIENT = True
"""A layer's attention on the fused kernels returns one gradient of its QKV projection
(:func:`_packed_qkv`); False: three, concatenated by autograd (for measurements and tests)."""


def _use_kernels(q: Tensor) -> bool:
    """Whether the fused Triton kernels run (CUDA tensors) or the reference math (anything else)."""
    return q.is_cuda


def _max_len(cu: Tensor) -> int:
    # A host sync; used only where the offsets were not read by _check_offsets (torch.compile tracing).
    return int((cu[1:] - cu[:-1]).max().item()) if cu.numel() > 1 else 0


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    state: Any = None,
    *,
    recipe: Any = None,
    score_mod: ScoreMod | Callable[..., Tensor] | None = None,
    mask_mod: MaskMod | Callable[..., Tensor] | None = None,
    block_mask: BlockMask | None = None,
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
    deterministic: bool = False,
    backend: str = "auto",
) -> tuple[Any, None]:
    """Scaled dot-product attention with score/mask mods, block sparsity, packed sequences and GQA.

    Math::

        s_ij = scale * q_i . k_j;   s_ij = score_mod(s_ij, b, h, i, j)          (fp32)
        visible(i, j) = (i - left <= j <= i + right) & mask_mod(b, h, i, j) & block_mask
        lse_i = log sum_{visible j} exp(s_ij);   out_i = sum_{visible j} exp(s_ij - lse_i) v_j

    A query row with no visible key gets ``out = 0`` and ``lse = MASKED_ROW_LSE`` (-1e30: finite,
    and ``exp`` of it is 0, so it drops out of any ``logaddexp`` merge) — never NaN.

    Args:
        q: (B, Hq, Sq, D) in ``layout`` (``"bshd"``: (B, Sq, Hq, D); ``"sbhd"``: (Sq, B, Hq, D)), or
            packed (Tq, Hq, D) with ``cu_seqlens_q``, or a jagged nested tensor (B, j, Hq, D).
            float32, bfloat16 or float16. Inside ``torch.autocast`` q, k and v are cast to the
            autocast dtype first (as ``scaled_dot_product_attention`` takes them there) and the
            output has that dtype.
        k: (B, Hkv, Skv, D) in the same layout (packed (Tkv, Hkv, D)); ``Hq`` a multiple of ``Hkv``
            (GQA/MQA). Skv may differ from Sq (cross-attention).
        v: (B, Hkv, Skv, Dv), like k.
        state: None (attention in the input precision). FP8 attention will take a state here.
        recipe: None (reserved for FP8 attention).
        score_mod: a :class:`ScoreMod` (or a function ``(score, b, h, q_idx, kv_idx) -> score``,
            wrapped with :func:`score_mod`). Elementwise: its result has the scores' shape
            (B, H, Sq, Skv), or broadcasts to it with the same 4 dims (each 1 or the full size).
        mask_mod: a :class:`MaskMod` (or a function ``(b, h, q_idx, kv_idx) -> bool``) returning a
            bool tensor shaped like the scores (or broadcasting to them, as for ``score_mod``).
            Evaluated on every key tile in the band unless ``block_mask`` says which blocks are
            full. Tensors that mods read with ``modmath.load`` must cover every index the call
            produces (b < B, h < H, q_idx < Sq, kv_idx < Skv; for packed sequences b is the sequence
            and the positions are inside it).
        block_mask: a :class:`BlockMask` for (Sq, Skv) from :func:`create_block_mask`; its
            ``mask_mod`` is used when ``mask_mod`` is None. Not with packed sequences.
        causal: query ``i`` sees keys ``j <= i`` (top-left aligned, as SDPA's ``is_causal``).
        window: ``w`` (the ``w`` most recent keys: ``i - w < j <= i``) or ``(left, right)``
            (``i - left <= j <= i + right``, None = unbounded). Combines with ``causal``.
        scale: score scale, a finite number > 0; default ``D ** -0.5``.
        layout: ``"bhsd"``, ``"bshd"`` or ``"sbhd"`` for dense inputs (outputs use the same).
        cu_seqlens_q: (B + 1,) int32 start offsets of the packed sequences in q, on q's device:
            ``0 = cu[0] <= cu[1] <= ... <= cu[B] <= Tq`` (sequence ``i`` is rows
            ``cu[i]:cu[i + 1]``, no gaps). Rows after ``cu[B]`` belong to no sequence: their
            output is 0 and their lse ``MASKED_ROW_LSE``.
        cu_seqlens_kv: the same for k/v (default: ``cu_seqlens_q``).
        max_seqlen_q, max_seqlen_kv: the longest sequences, or None (computed). In eager mode the
            offsets are validated on every call with one small device-to-host read of
            ``cu_seqlens_*`` (which also yields these maxima), whether or not they are passed; a
            value below the longest sequence is an error. Under ``torch.compile`` the offsets are
            not read (not validated); pass both there to avoid a host sync.
        return_lse: also return the log-sum-exp (natural log), shaped like q without its last dim.
        dropout_p: probability of dropping an attention weight (training); 0 disables it. The
            mask draws 16 bits per weight, so the drop rate is realised within 2**-17 of it.
        dropout_seed: int or 1-element integer tensor; None draws one from torch's generator. The
            mask is a hash of (seed, b, h, i, j): the same seed gives the same mask everywhere.
        deterministic: on CUDA, compute dQ in its own kernel so that gradients are bitwise
            reproducible. Otherwise dQ is summed in float32 out of order where that measured
            faster: on an sm_90 GPU at head dims 64 and 128 (one Hopper backward kernel adds it with
            TMA reductions, docs/kernels/attention.md), and above head dim 128 for a masked
            attention (float32 atomics; causal, window, ``mask_mod`` or ``block_mask``;
            docs/benchmarks/attention_s8192.md); dQ has its own kernel everywhere else.
        backend: ``"triton"`` (fp8ops's fused kernels), ``"sdpa"`` (PyTorch's
            ``scaled_dot_product_attention``, cuDNN first, then flash) or ``"auto"``: on CUDA, SDPA
            for the cases it covers — dense bf16/fp16 inputs without ``score_mod``, ``mask_mod``,
            ``block_mask``, window or packed sequences (``causal`` allowed), without ``return_lse``,
            ``deterministic`` or an explicit ``dropout_seed`` (SDPA draws its dropout mask from
            torch's generator) — where cuDNN's attention is the faster kernel; Triton otherwise,
            and for such calls with dropout on an sm_90 GPU wherever the library's Hopper forward
            and backward apply, causal ones from 2048 queries (measured faster than cuDNN with
            dropout; the seed drawn from torch's generator).
            The CPU always runs the reference math.

    Returns:
        ``(out, None)`` where ``out`` is shaped like q with head dim Dv, or ``((out, lse), None)``
        with ``return_lse``. Gradients flow to q, k, v, to tensors captured by ``score_mod``, and
        through ``lse``.

    Raises:
        TypeError, ValueError: bad input (the message names the argument and the fix), including
            offsets that are not valid packed-sequence offsets, a ``score_mod``/``mask_mod`` result
            of the wrong shape or (masks) not bool, and a ``modmath.load`` index outside its
            captured tensor (a mod built for a smaller batch, head count or sequence length; on
            CUDA found before the kernels run for indices computed from b, h, q_idx, kv_idx).
        NotImplementedError: a ``state`` or ``recipe`` (FP8 attention is not available yet).

    Example:
        >>> import torch, fp8ops
        >>> q, k, v = torch.randn(2, 8, 16, 32), torch.randn(2, 2, 16, 32), torch.randn(2, 2, 16, 32)
        >>> out, state = fp8ops.attention(q, k, v, causal=True)     # GQA: 8 query heads, 2 kv heads
        >>> out.shape, state
        (torch.Size([2, 8, 16, 32]), None)
        >>> ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        >>> torch.allclose(out, ref, atol=1e-5)
        True

    References:
        Vaswani et al. (2017); Dao, "FlashAttention-2" (2023); Dong et al., "Flex Attention" (2024).
    """
    return _attention(q, k, v, state, recipe=recipe, score_mod=score_mod, mask_mod=mask_mod, block_mask=block_mask,
                      causal=causal, window=window, scale=scale, layout=layout, cu_seqlens_q=cu_seqlens_q,
                      cu_seqlens_kv=cu_seqlens_kv, max_seqlen_q=max_seqlen_q, max_seqlen_kv=max_seqlen_kv,
                      return_lse=return_lse, dropout_p=dropout_p, dropout_seed=dropout_seed,
                      deterministic=deterministic, backend=backend)


def _attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    state: Any = None,
    *,
    recipe: Any = None,
    score_mod: ScoreMod | Callable[..., Tensor] | None = None,
    mask_mod: MaskMod | Callable[..., Tensor] | None = None,
    block_mask: BlockMask | None = None,
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
    deterministic: bool = False,
    backend: str = "auto",
    qkv: Tensor | None = None,
) -> tuple[Any, None]:
    """:func:`attention`, and for the library's layers ``qkv``: the projection output (S, B, W) in
    layout "sbhd" or (T, W) with ``cu_seqlens_q``, whose last dim is [q heads | k heads | v heads]
    and of which q, k and v are the head views. Where the fused kernels run, the gradient then
    reaches ``qkv`` as one tensor that the backward writes dq, dk and dv into (no concatenation of
    three gradients, as autograd's backward of the split would add), and q, k, v get none."""
    where = "attention"
    ac = autocast_dtype(q.device.type) if isinstance(q, Tensor) else None
    if ac is not None:
        # torch.autocast: q, k, v in the autocast dtype, as scaled_dot_product_attention takes them
        # there (cast outside the autograd Function: gradients reach them in their own dtype); then
        # the op with autocast off inside, so that the reference math is not cast again.
        cast = autocast_inputs(ac, q, k, v)
        same = all(a is b for a, b in zip(cast, (q, k, v)))  # still views of qkv
        q, k, v = cast
        with torch.autocast(q.device.type, enabled=False):
            return _attention(
                q, k, v, state, recipe=recipe, score_mod=score_mod, mask_mod=mask_mod, block_mask=block_mask,
                causal=causal, window=window, scale=scale, layout=layout, cu_seqlens_q=cu_seqlens_q,
                cu_seqlens_kv=cu_seqlens_kv, max_seqlen_q=max_seqlen_q, max_seqlen_kv=max_seqlen_kv,
                return_lse=return_lse, dropout_p=dropout_p, dropout_seed=dropout_seed,
                deterministic=deterministic, backend=backend, qkv=qkv if same else None)
    if state is not None or recipe is not None:
        raise NotImplementedError(
            f"{where}: FP8 attention (state/recipe) is not available yet; pass state=None and recipe=None "
            f"to run in the input precision")
    for name, m in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_kv", max_seqlen_kv)):
        if m is not None and (_index(m) is None or _index(m) < 0):  # type: ignore[operator]
            raise TypeError(f"{where}: {name} must be None or an int >= 0 (the longest sequence), got {m!r}")
    max_seqlen_q = _index(max_seqlen_q)
    max_seqlen_kv = _index(max_seqlen_kv)
    # Step 1: nested (jagged) tensors are sugar for packed sequences.
    nested = isinstance(q, Tensor) and q.is_nested
    njt_transposed = False
    offsets = None
    if nested:
        if not (isinstance(k, Tensor) and k.is_nested and isinstance(v, Tensor) and v.is_nested):
            raise TypeError(f"{where}: q is a nested tensor, so k and v must be nested tensors too")
        if cu_seqlens_q is not None or cu_seqlens_kv is not None:
            raise ValueError(f"{where}: nested tensors carry their own offsets; do not pass cu_seqlens")
        if q.layout != torch.jagged:
            raise ValueError(f"{where}: nested tensors must use layout=torch.jagged")
        njt_transposed = q._ragged_idx == 2  # (B, H, j, D), as SDPA takes them
        if njt_transposed:
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if q._ragged_idx != 1 or q.dim() != 4:
            raise ValueError(f"{where}: nested tensors must be (B, j, H, D) or (B, H, j, D) with the ragged dim j")
        offsets = q.offsets()
        cu_seqlens_q = offsets.to(torch.int32)
        cu_seqlens_kv = k.offsets().to(torch.int32)
        max_seqlen_q = q._maybe_max_seqlen if max_seqlen_q is None else max_seqlen_q
        max_seqlen_kv = k._maybe_max_seqlen if max_seqlen_kv is None else max_seqlen_kv
        q, k, v = q.values(), k.values(), v.values()

    # Step 2: validate.
    q = check_float_tensor(q, "q", where)
    k = check_float_tensor(k, "k", where)
    v = check_float_tensor(v, "v", where)
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"{where}: q, k, v must have one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"{where}: q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    varlen = cu_seqlens_q is not None
    if cu_seqlens_kv is not None and not varlen:
        raise ValueError(f"{where}: cu_seqlens_kv needs cu_seqlens_q")
    longest: tuple[int, int] | None = None  # (longest q, longest kv sequence) when the offsets were read
    if varlen:
        for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_kv", cu_seqlens_kv)):
            if cu is not None:
                _check_cu(cu, name, q.device, where)
        cu_q = cu_seqlens_q
        cu_kv = cu_seqlens_kv if cu_seqlens_kv is not None else cu_q
        if cu_kv.shape != cu_q.shape:  # type: ignore[union-attr]
            raise ValueError(f"{where}: cu_seqlens_q and cu_seqlens_kv must have the same length (B + 1), got "
                             f"{cu_q.numel()} and {cu_kv.numel()}")  # type: ignore[union-attr]
        if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
            raise ValueError(f"{where}: with cu_seqlens, q, k, v must be packed (T, H, D), got shapes "
                             f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
        # The values: one host read of the offsets per call in eager mode, also when max_seqlen_* are
        # given (wrong offsets silently drop or zero rows); not while torch.compile traces. Nested
        # tensors' offsets are valid by construction: read only when their longest sequence is unknown.
        if nested and max_seqlen_q is not None and max_seqlen_kv is not None:
            longest = (int(max_seqlen_q), int(max_seqlen_kv))
        elif values_readable(cu_q) and values_readable(cu_kv):  # type: ignore[arg-type]
            longest = _check_offsets(cu_q, None if cu_kv is cu_q else cu_kv,  # type: ignore[arg-type]
                                     q.shape[0], k.shape[0], where)
            for name, m, n, of in (("max_seqlen_q", max_seqlen_q, longest[0], "cu_seqlens_q"),
                                   ("max_seqlen_kv", max_seqlen_kv, longest[1], "cu_seqlens_kv")):
                if m is not None and m < n:
                    raise ValueError(f"{where}: {name} = {m} is less than the longest sequence in {of} ({n}); "
                                     f"the kernels would skip the rows past it. Pass {name} >= {n}, or None")
        if block_mask is not None:
            raise ValueError(f"{where}: block_mask is not available with packed sequences; use mask_mod "
                             f"(positions are inside each sequence), or pack into one batch with document_mask")
        hq, hkv, d = q.shape[1], k.shape[1], q.shape[2]
        if k.shape[2] != d or v.shape[:2] != k.shape[:2]:
            raise ValueError(f"{where}: k must be (Tkv, Hkv, {d}) and v (Tkv, Hkv, Dv), got {tuple(k.shape)}, "
                             f"{tuple(v.shape)}")
        eff_layout = "thd"
        nseq = cu_q.numel() - 1  # type: ignore[union-attr]

        def mod_dims(longest: tuple[int, int] | None) -> tuple[Any, str]:
            # The ranges of the mods' (b, h, q_idx, kv_idx): sequence index and positions inside it.
            return (None if longest is None else (nseq, hq, *longest)), "(sequences, H, longest Sq, longest Skv)"
    else:
        if layout not in LAYOUTS:
            raise ValueError(f"{where}: layout must be one of {LAYOUTS}, got {layout!r}")
        if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
            raise ValueError(f"{where}: q, k, v must be 4-D in layout {layout!r}, got shapes {tuple(q.shape)}, "
                             f"{tuple(k.shape)}, {tuple(v.shape)} (packed (T, H, D) inputs need cu_seqlens_q)")
        q4, k4, v4 = (_ref.to_bhsd(t, layout) for t in (q, k, v))
        if k4.shape[0] != q4.shape[0] or k4.shape[3] != q4.shape[3] or v4.shape[:3] != k4.shape[:3]:
            raise ValueError(
                f"{where}: shapes do not match in layout {layout!r} (as (B, H, S, D): q {tuple(q4.shape)}, "
                f"k {tuple(k4.shape)}, v {tuple(v4.shape)}): k needs q's batch and head dim, v k's (B, H, S)")
        hq, hkv, d = q4.shape[1], k4.shape[1], q4.shape[3]
        eff_layout = layout
        dense_dims = (q4.shape[0], hq, q4.shape[2], k4.shape[2])

        def mod_dims(longest: tuple[int, int] | None) -> tuple[Any, str]:
            return dense_dims, "(B, H, Sq, Skv)"
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"{where}: the query heads ({hq}) must be a multiple of the key/value heads ({hkv})")
    if not isinstance(causal, bool):
        raise TypeError(f"{where}: causal must be a bool, got {causal!r}")
    left, right = _ref.normalize_window(window, causal, where=where)
    if scale is None:
        sm_scale = d**-0.5 if d > 0 else 1.0
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"{where}: scale must be a number or None, got {scale!r}")
    elif not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"{where}: scale must be a finite number > 0 (the softmax temperature), got {scale!r}")
    else:
        sm_scale = float(scale)
    if not isinstance(return_lse, bool):
        raise TypeError(f"{where}: return_lse must be True or False, got {return_lse!r}")
    score_mod = _as_mod(score_mod, ScoreMod, "score_mod", where, _SCORE_ARITY)
    mask_mod = _as_mod(mask_mod, MaskMod, "mask_mod", where, _MASK_ARITY)
    if block_mask is not None:
        if not isinstance(block_mask, BlockMask):
            raise TypeError(f"{where}: block_mask must be a BlockMask (fp8ops.create_block_mask), got "
                            f"{type(block_mask).__name__}")
        sq, skv = q4.shape[2], k4.shape[2]
        b_, h_, bsq, bskv = block_mask.shape
        if (bsq, bskv) != (sq, skv):
            raise ValueError(f"{where}: block_mask was built for (Sq, Skv) = {(bsq, bskv)}, got {(sq, skv)}")
        if b_ not in (1, q4.shape[0]) or h_ not in (1, hq):
            raise ValueError(f"{where}: block_mask covers (B, H) = {(b_, h_)}; expected 1 or {(q4.shape[0], hq)}")
        if block_mask.device != q.device:
            raise ValueError(f"{where}: block_mask is on {block_mask.device}, q on {q.device}; use "
                             f"block_mask.to(q.device) once, or create_block_mask(..., device=q.device)")
        if mask_mod is None:
            mask_mod = block_mask.mask_mod
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)):
        raise TypeError(f"{where}: dropout_p must be a number in [0, 1), got {dropout_p!r}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"{where}: dropout_p must be a number in [0, 1), got {dropout_p!r}")
    dropout_p = float(dropout_p)
    _check_seed(dropout_seed, where)
    seed = _seed_tensor(dropout_seed, q.device, where) if dropout_p > 0.0 else None
    if not isinstance(deterministic, bool):
        raise TypeError(f"{where}: deterministic must be True or False, got {deterministic!r}")
    for name, t in (("score_mod", score_mod), ("mask_mod", mask_mod)):
        for buf in getattr(t, "buffers", ()):
            if buf.device != q.device:
                raise ValueError(f"{where}: a tensor captured by {name} is on {buf.device}, q on {q.device}")

    # Step 3: run: SDPA or the fused kernels on CUDA, the reference math elsewhere.
    if backend not in ("auto", "triton", "sdpa"):
        raise ValueError(f"{where}: backend must be 'auto', 'triton' or 'sdpa', got {backend!r}")
    why_not_sdpa = _sdpa_unsupported(
        q, v, nested=nested, varlen=varlen, score_mod=score_mod, mask_mod=mask_mod, block_mask=block_mask,
        left=left, right=right, return_lse=return_lse, deterministic=deterministic, dropout_p=dropout_p,
        dropout_seed=dropout_seed)
    if backend == "sdpa" and why_not_sdpa is not None:
        raise ValueError(f"{where}: backend='sdpa' cannot run this call ({why_not_sdpa}); use backend='triton'")
    if backend == "auto" and why_not_sdpa is None and _hopper_dropout_faster(q, k, v, layout, dropout_p, left, right):
        why_not_sdpa = "dropout on an sm_90 GPU, where the Hopper kernels are faster"
    if backend != "triton" and why_not_sdpa is None:
        q4, k4, v4 = (_ref.to_bhsd(t, layout) for t in (q, k, v))
        out4 = _sdpa(q4, k4, v4, causal=right == 0, scale=sm_scale, dropout_p=dropout_p, gqa=hq != hkv)
        return _ref.from_bhsd(out4, layout), None
    if _use_kernels(q):
        if max(d, v.shape[-1]) > 256:
            raise ValueError(f"{where}: head dims up to 256 are supported on CUDA, got {d} and {v.shape[-1]}")
        if score_mod is not None and not isinstance(score_mod, ScoreMod):
            score_mod = ScoreMod(score_mod)
        if mask_mod is not None and not isinstance(mask_mod, MaskMod):
            mask_mod = MaskMod(mask_mod)
        if varlen:
            if max_seqlen_q is None:
                max_seqlen_q = longest[0] if longest is not None else _max_len(cu_q)
            if max_seqlen_kv is None:
                max_seqlen_kv = longest[1] if longest is not None else _max_len(cu_kv)
        dims, dims_name = mod_dims(longest)
        if dims is not None and not torch.compiler.is_compiling():
            _check_mod_statically(score_mod, "score_mod", where, dims_name, dims)
            _check_mod_statically(mask_mod, "mask_mod", where, dims_name, dims)
        out, lse = _attention_triton(
            q, k, v, score_mod=score_mod, mask_mod=mask_mod, block_mask=block_mask, scale=sm_scale,
            left=left, right=right, layout=eff_layout, cu_q=cu_q if varlen else None,
            cu_kv=cu_kv if varlen else None, max_q=max_seqlen_q if varlen else None,
            max_kv=max_seqlen_kv if varlen else None, dropout_p=dropout_p, seed=seed,
            dq_mode=_dq_mode(deterministic), qkv=_packed_qkv(qkv, q, k, v, varlen, nested, eff_layout, where),
        )
    else:
        out, lse = _reference_path(q, k, v, score_mod=score_mod, mask_mod=mask_mod, block_mask=block_mask,
                                   scale=sm_scale, left=left, right=right, layout=eff_layout,
                                   cu_q=cu_q if varlen else None, cu_kv=cu_kv if varlen else None,
                                   dropout_p=dropout_p, seed=seed, dims=mod_dims(longest))

    # Step 4: repackage.
    if nested:
        out = torch.nested.nested_tensor_from_jagged(out, offsets)
        lse = torch.nested.nested_tensor_from_jagged(lse, offsets)
        if njt_transposed:
            out, lse = out.transpose(1, 2), lse.transpose(1, 2)
    return ((out, lse) if return_lse else out), None


def _packed_qkv(qkv: Tensor | None, q: Tensor, k: Tensor, v: Tensor, varlen: bool, nested: bool, layout: str,
                where: str) -> Tensor | None:
    """``qkv`` for the fused kernels where q, k and v are its [q | k | v] head views (layout "sbhd"
    or packed sequences), else None; a ``qkv`` of which they are not raises (checked by address
    where the tensors have one: not while ``torch.compile`` traces or inside ``torch.func``
    transforms, whose tensors have no storage)."""
    if qkv is None or nested or not (varlen or layout == "sbhd") or not QKV_GRADIENT:
        return None
    hq, hkv, d = q.shape[-2], k.shape[-2], q.shape[-1]
    lead = q.shape[:-2]
    if (v.shape[-1] != d or tuple(qkv.shape) != (*lead, (hq + 2 * hkv) * d) or not qkv.is_contiguous()
            or k.shape[:-2] != lead or v.shape[:-2] != lead):
        raise ValueError(f"{where}: qkv of shape {tuple(qkv.shape)} is not the projection whose head views q, k, v "
                         f"({tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}) are")
    if not torch.compiler.is_compiling() and all(_has_storage(t) for t in (qkv, q, k, v)):
        es, p0 = qkv.element_size(), qkv.data_ptr()
        if (q.data_ptr(), k.data_ptr(), v.data_ptr()) != (p0, p0 + hq * d * es, p0 + (hq + hkv) * d * es) or any(
                t.stride()[-2:] != (d, 1) or t.stride()[:-2] != qkv.stride()[:-1] for t in (q, k, v)):
            raise ValueError(f"{where}: q, k, v are not the [q | k | v] head views of qkv")
    return qkv


def _has_storage(t: Tensor) -> bool:
    return not torch._C._functorch.is_functorch_wrapped_tensor(t)


def _sdpa_unsupported(q: Tensor, v: Tensor, *, nested: bool, varlen: bool, score_mod: Any, mask_mod: Any,
                      block_mask: Any, left: int | None, right: int | None, return_lse: bool,
                      deterministic: bool, dropout_p: float, dropout_seed: Any) -> str | None:
    """Why PyTorch's SDPA cannot run this call with fp8ops's semantics (None: it can)."""
    reasons = [
        (not q.is_cuda, "not on CUDA"),
        (q.dtype not in (torch.bfloat16, torch.float16), "dtype is not bf16/fp16"),
        (nested or varlen, "packed sequences"),
        (score_mod is not None or mask_mod is not None or block_mask is not None, "a score/mask mod or block mask"),
        (left is not None or right not in (None, 0), "a window"),
        (return_lse, "return_lse"),
        (deterministic, "deterministic=True"),
        (dropout_p > 0.0 and dropout_seed is not None, "an explicit dropout_seed"),
        (q.shape[-1] != v.shape[-1] or q.shape[-1] > 256 or q.shape[-1] % 8 != 0, "the head dims"),
    ]
    return next((why for bad, why in reasons if bad), None)


def _hopper_dropout_faster(q: Tensor, k: Tensor, v: Tensor, layout: str, dropout_p: float, left: int | None,
                           right: int | None) -> bool:
    """Whether ``backend="auto"`` runs a dense call with dropout (and no explicit seed: one is drawn
    from torch's generator) on the library's Hopper forward and backward instead of SDPA: on an
    sm_90 GPU wherever both kernels apply, causal calls from :data:`HOPPER_DROPOUT_CAUSAL_MIN_SEQ`
    queries (the same choice in eager calls and in compiled graphs, where the attention ops stay
    opaque calls). Dropout 0.1 (H200, B=4, S=2048, views of the QKV projection, graph replays),
    forward / forward+backward ms, Hopper kernels against cuDNN (docs/benchmarks/layer.md): 32
    heads of d=128 0.512 / 2.183 against 0.961 / 2.798, causal 0.405 / 1.528 against 0.536 /
    1.641; 64 heads of d=64 0.791 / 2.952 against 1.536 / 3.793, causal 0.677 / 2.011 against
    0.847 / 2.305; but causal at B=8, S=1024, 16 heads of d=128 0.159 / 0.575 against 0.162 /
    0.547 (without dropout cuDNN is level or faster: 0.430 / 1.936 against 0.427 / 1.840 at the
    first shape, so SDPA keeps those calls)."""
    if not HOPPER_DROPOUT or dropout_p <= 0.0 or not q.is_cuda or left is not None or right not in (None, 0):
        return False
    from ..kernels import attention as K
    from ..kernels._attention_hopper import _view2d

    q4, k4, v4 = (_ref.to_bhsd(t, layout) for t in (q, k, v))
    if right == 0 and q4.shape[2] < HOPPER_DROPOUT_CAUSAL_MIN_SEQ:  # causal
        return False
    kw = dict(varlen=False, sparse_q=None, sparse_kv=None, traced=True)
    if not (K.hopper_supported(q4, k4, v4, descale=False, short_rows=K._short_rows(k4.shape[2], left, right), **kw)
            and K.hopper_bwd_supported(q4, k4, v4, **kw)):
        return False
    # the kernels' descriptor views (a traced call's fake tensors have no address: checked at the call)
    if torch.compiler.is_compiling() or not all(_has_storage(t) for t in (q4, k4, v4)):
        return True
    return all(_view2d(t, 64) is not None for t in (q4, k4, v4))


def _sdpa(q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float, dropout_p: float, gqa: bool) -> Tensor:
    """PyTorch's fused attention on (B, H, S, D) views, cuDNN's kernel first, flash second.

    The order is set under ``torch.compile`` too: left to itself, the compiled seed layer (hidden
    4096, attention dropout 0.1; H200, torch 2.11) ran flash attention, whose backward took 2.68 ms
    against cuDNN's 1.75 ms in the eager step."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def call() -> Tensor:
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, dropout_p=dropout_p, is_causal=causal, scale=scale, enable_gqa=gqa)

    order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
    with sdpa_kernel(order, set_priority=True):
        return call()


def _dq_mode(deterministic: bool) -> str:
    """The dQ scheme of the backward: "separate" (a dQ kernel of its own, bitwise deterministic)
    when asked to be deterministic, else "auto": the launcher runs the Hopper backward (dQ summed
    in float32 by TMA reductions from the dK/dV kernel) wherever it applies, else the portable
    kernels with ``kernels.attention.resolve_dq_mode``'s scheme."""
    return "separate" if deterministic else "auto"


def _reference_path(q: Tensor, k: Tensor, v: Tensor, *, score_mod: Any, mask_mod: Any, block_mask: Any,
                    scale: float, left: int | None, right: int | None, layout: str, cu_q: Tensor | None,
                    cu_kv: Tensor | None, dropout_p: float, seed: Tensor | None,
                    dims: tuple[Any, str] = (None, "")) -> tuple[Tensor, Tensor]:
    """The FP32 reference math, differentiable with autograd (the CPU path). ``dims``: the ranges of
    the mods' (b, h, q_idx, kv_idx) and their name, for the messages of the mod checks."""
    mod_dims, dims_name = dims
    if layout == "thd":
        assert cu_q is not None and cu_kv is not None
        seg_q, pos_q = _ref.segments(cu_q, q.shape[0])
        seg_kv, pos_kv = _ref.segments(cu_kv, k.shape[0])
        n = cu_q.numel() - 1
        seg_kv = torch.where(seg_kv >= n, seg_kv + 1, seg_kv)
        q4, k4, v4 = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        shape = (1, q.shape[1], q.shape[0], k.shape[0])
        shown = "(1, H, Tq, Tkv) (packed sequences)"
        score_mod = _checked_mod(score_mod, "score_mod", "attention", shape, shown, dims_name, mod_dims)
        mask_mod = _checked_mod(mask_mod, "mask_mod", "attention", shape, shown, dims_name, mod_dims)
        out, lse = _ref.attention_math(
            q4, k4, v4, score_mod=score_mod, mask_mod=mask_mod, scale=scale, left=left, right=right,
            seg_q=seg_q, seg_kv=seg_kv, pos_q=pos_q, pos_kv=pos_kv, num_seqs=n,
            dropout_p=dropout_p, dropout_seed=seed)
        return out.squeeze(0).transpose(0, 1).contiguous(), lse.squeeze(0).transpose(0, 1).contiguous()
    q4, k4, v4 = (_ref.to_bhsd(t, layout) for t in (q, k, v))
    shape = (q4.shape[0], q4.shape[1], q4.shape[2], k4.shape[2])
    score_mod = _checked_mod(score_mod, "score_mod", "attention", shape, "(B, H, Sq, Skv)", dims_name, mod_dims)
    mask_mod = _checked_mod(mask_mod, "mask_mod", "attention", shape, "(B, H, Sq, Skv)", dims_name, mod_dims)
    out, lse = _ref.attention_math(q4, k4, v4, score_mod=score_mod, mask_mod=mask_mod, block_mask=block_mask,
                                   scale=scale, left=left, right=right, dropout_p=dropout_p, dropout_seed=seed)
    return _ref.from_bhsd(out, layout).contiguous(), _ref.lse_from_bhs(lse, layout).contiguous()
