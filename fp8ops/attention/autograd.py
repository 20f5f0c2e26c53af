"""The fused (Triton) path: kernels specialized per mod pair, the library ops
``fp8ops::attention_fwd`` / ``fp8ops::attention_bwd`` with their fake and vmap rules, and the
autograd glue (:class:`_AttentionFunction`) that :func:`_attention_triton` calls.

The static configuration of a call (:class:`_Static`) crosses the op schema as ``repr`` of a tuple;
the kernels are looked up from the registry of mods (:data:`~.mods._SPECS`) by the keys in it.
"""

from __future__ import annotations

import ast
import functools
from typing import Any, NamedTuple

import torch
from torch import Tensor

from .._glue import apply, refuse_compiled_transform
from ..kernels import attention as _K
from ..kernels._library import OPS, OpSpec, define as _define
from ..reference import attention as _ref
from .block_mask import BlockMask
from .codegen import tile_math
from .layouts import _alloc_layout, _alloc_lse
from .mods import _SPECS, MaskMod, ScoreMod


class _Static(NamedTuple):
    """Static configuration of one attention call (Python constants only)."""

    score_key: str | None
    mask_key: str | None
    score_slots: tuple[int, ...]  # unique-buffer index of each score_mod buffer
    mask_slots: tuple[int, ...]
    needs: tuple[bool, ...]  # score_mod buffers that need a gradient
    scale: float
    left: int | None
    right: int | None
    layout: str  # "bhsd" | "bshd" | "sbhd" | "thd"
    max_q: int | None
    max_kv: int | None
    dropout_p: float
    sparse_block: tuple[int, int] | None
    dq_mode: str
    fwd_config: tuple[tuple[str, int], ...] | None
    bwd_config: tuple[tuple[str, int], ...] | None
    packed: tuple[int, int, int] | None = None  # (hq, hkv, d): q, k, v are head slices of one projection


def qkv_heads(qkv: Tensor, hq: int, hkv: int, d: int) -> tuple[Tensor, Tensor, Tensor]:
    """The q, k and v head views (..., h, d) of a projection output (..., (hq + 2 hkv) d) whose
    last dim holds [q heads | k heads | v heads]."""
    lead = qkv.shape[:-1]
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    return q.reshape(*lead, hq, d), k.reshape(*lead, hkv, d), v.reshape(*lead, hkv, d)


def _split_packed(qkv: Tensor, static: _Static) -> tuple[Tensor, Tensor, Tensor]:
    """q, k, v as the kernels take them ((B, H, S, D) views in sbhd, (T, H, D) packed) from one
    projection output ``qkv`` (S, B, (hq + 2 hkv) d) or (T, (hq + 2 hkv) d) (``static.packed``)."""
    assert static.packed is not None
    q, k, v = qkv_heads(qkv, *static.packed)
    if static.layout == "thd":
        return q, k, v
    return _ref.to_bhsd(q, static.layout), _ref.to_bhsd(k, static.layout), _ref.to_bhsd(v, static.layout)


def _packed_shape(q: Tensor, static: _Static) -> tuple[int, ...]:
    # the projection's shape from q's kernel view: (S, B, W) in sbhd, (T, W) packed
    assert static.packed is not None
    hq, hkv, d = static.packed
    width = (hq + 2 * hkv) * d
    return (q.shape[0], width) if static.layout == "thd" else (q.shape[2], q.shape[0], width)


@functools.lru_cache(maxsize=None)
def _kernels(score_key: str | None, mask_key: str | None, needs: tuple[bool, ...]) -> _K.AttentionKernels:
    sm = _SPECS[score_key] if score_key is not None else None
    mm = _SPECS[mask_key] if mask_key is not None else None
    ks = _kernels_of(sm, mm, needs)
    # a mask_mod known to hide everything outside a band (causal, sliding window): the kernels skip the
    # tiles outside it, as with causal=True or window= (kernels.attention._mask_bounded)
    return ks._replace(mask_band=mm.implied_band) if mm is not None else ks


def _kernels_of(sm: Any, mm: Any, needs: tuple[bool, ...]) -> _K.AttentionKernels:
    if sm is None:
        return _K.specialize(None, None, None, mm.fwd_jit() if mm is not None else None)
    grad = grad_dq = None
    if sm.differentiable:
        grad = sm.grad_jit(needs)
        grad_dq = sm.grad_jit(tuple(False for _ in needs))
    ks = _K.specialize(sm.fwd_jit(), grad, grad_dq, mm.fwd_jit() if mm is not None else None)
    if sm.lowered is not None and tile_math(sm.lowered):
        # transcendental math per score: the portable forward is the faster one (codegen.tile_math)
        ks = ks._replace(score_mod=None)
    elif sm.relative_bias:
        # slope * (kv - q) + c: the Hopper forward adds it per key column (codegen.relative_bias)
        ks = ks._replace(score_rel=True)
    return ks


@torch._dynamo.assume_constant_result
def _kernel_for(which: str, score_key: str | None, mask_key: str | None, needs: tuple[bool, ...]) -> Any:
    # Runs once per (mods, kernel) even under torch.compile: its result, a @triton.jit kernel, is a
    # constant of the traced graph.
    return getattr(_kernels(score_key, mask_key, needs), which)


def _mask_buffers(st: _Static, flat: list[Any]) -> tuple[Any, ...]:
    # the mask_mod's tensors as its kernel twin reads them (a spec may derive tables from them)
    bufs = tuple(flat[i] for i in st.mask_slots)
    return bufs if st.mask_key is None else _SPECS[st.mask_key].prepare_buffers(bufs)


def _flat(t: Tensor | None) -> Tensor | None:
    return None if t is None else t.reshape(-1) if t.is_contiguous() else t.contiguous().reshape(-1)


def _sparsity(bm: tuple[Tensor | None, ...], static: _Static) -> tuple[Any, Any]:
    if static.sparse_block is None:
        return None, None
    bq, bkv = static.sparse_block
    kvn, kvi, fkvn, fkvi, qn, qi, fqn, fqi = bm
    return (_K.BlockSparsity(kvn, kvi, fkvn, fkvi, bq, bkv), _K.BlockSparsity(qn, qi, fqn, fqi, bq, bkv))


@functools.lru_cache(maxsize=256)
def _static_repr(static: _Static) -> str:
    return repr(tuple(static))


def _static_str(static: _Static) -> str:
    """``repr(tuple(static))``, the form the library ops take (cached per configuration in eager
    mode: the repr of a call's 16 fields is a visible part of its host time)."""
    return repr(tuple(static)) if torch.compiler.is_compiling() else _static_repr(static)


@functools.lru_cache(maxsize=256)
def _parse_static(static: str) -> _Static:
    """The :class:`_Static` of ``repr(tuple(static))`` (the form the library ops take)."""
    return _Static(*ast.literal_eval(static))


def _attention_fwd_outputs(q: Tensor, v: Tensor, layout: str) -> tuple[Tensor, Tensor]:
    varlen = layout == "thd"
    out_shape = (q.shape[0], q.shape[1], v.shape[2]) if varlen else (*q.shape[:3], v.shape[3])
    out = _alloc_layout(out_shape, layout, q.dtype, q.device, zero=varlen)  # type: ignore[arg-type]
    return out, _alloc_lse(q, layout)


def _attention_fwd_impl(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor | None, cu_kv: Tensor | None,
                        seed: Tensor | None, kvn: Tensor | None, kvi: Tensor | None, fkvn: Tensor | None,
                        fkvi: Tensor | None, buffers: list[Tensor], static: str) -> tuple[Tensor, Tensor]:
    """``fp8ops::attention_fwd``: the fused forward, ``(out, lse)`` as (B, Hq, Sq, Dv) / (B, Hq, Sq)
    views stored in the layout of ``static`` (packed: (Tq, Hq, Dv) / (Tq, Hq)). The kernel comes
    from the registry of generated mods (:data:`_SPECS`) through the keys in ``static``, the
    ``repr`` of the call's :class:`_Static`; ``buffers`` are the unique captured tensors."""
    st = _parse_static(static)
    ks = _kernels(st.score_key, st.mask_key, st.needs)
    kern = _K.AttentionKernels(ks.fwd, None, None, None, ks.score_mod, ks.mask_mod, score_rel=ks.score_rel,
                                mask_band=ks.mask_band)
    out, lse = _attention_fwd_outputs(q, v, st.layout)
    flat = [_flat(t) for t in buffers]
    bs = None
    if st.sparse_block is not None:
        assert kvn is not None and kvi is not None and fkvn is not None and fkvi is not None
        bs = _K.BlockSparsity(kvn, kvi, fkvn, fkvi, *st.sparse_block)
    _K.attention_fwd_launch(
        q, k, v, out, lse, sm_scale=st.scale, kernels=kern,
        cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv, max_seqlen_q=st.max_q, max_seqlen_kv=st.max_kv,
        window=(st.left, st.right), has_score_mod=st.score_key is not None, has_mask_mod=st.mask_key is not None,
        score_buffers=tuple(flat[i] for i in st.score_slots), mask_buffers=_mask_buffers(st, flat),
        block_sparsity=bs, dropout_p=st.dropout_p, dropout_seed=seed,
        config=dict(st.fwd_config) if st.fwd_config else None,
    )
    return out, lse


def _attention_fwd_fake(q, k, v, cu_q, cu_kv, seed,  # type: ignore[no-untyped-def]
                        kvn, kvi, fkvn, fkvi, buffers, static):
    return _attention_fwd_outputs(q, v, _parse_static(static).layout)


def _attention_fwd_vmap(info: Any, in_dims: tuple[Any, ...], *args: Any) -> tuple[Any, Any]:
    # vmap = a loop over the batch entries (the autograd.Function's own vmap rule normally runs
    # first; this one covers direct calls of the op under vmap).
    def pick(a: Any, d: Any, i: int) -> Any:
        if isinstance(a, (list, tuple)):
            dims = d if isinstance(d, (list, tuple)) else [d] * len(a)
            return [pick(x, dd, i) for x, dd in zip(a, dims)]
        return a if d is None or not isinstance(a, Tensor) else a.select(d, i)

    outs = [torch.ops.fp8ops.attention_fwd(*[pick(a, d, i) for a, d in zip(args, in_dims)])
            for i in range(info.batch_size)]
    return (torch.stack([o[0] for o in outs]), torch.stack([o[1] for o in outs])), (0, 0)


# A low-level library op (kernels/_library.py: no custom_op wrapper layers on the host path). The
# CPU kernel serves CPU tensors under TRITON_INTERPRET=1 (the CPU path of attention() runs the
# reference math and never calls it).
_define(
    OpSpec("attention_fwd(Tensor q, Tensor k, Tensor v, Tensor? cu_q, Tensor? cu_kv, Tensor? seed, Tensor? kvn, "
           "Tensor? kvi, Tensor? fkvn, Tensor? fkvi, Tensor[] buffers, str static) -> (Tensor, Tensor)",
           cuda=_attention_fwd_impl, fake=_attention_fwd_fake),
    cpu=_attention_fwd_impl,
)
torch.library.register_vmap("fp8ops::attention_fwd", _attention_fwd_vmap)


def _backward(static: _Static, dout: Tensor | None, dlse: Tensor | None, qkv: tuple[Tensor, Tensor, Tensor],
              out: Tensor, lse: Tensor, cu_q: Tensor | None, cu_kv: Tensor | None, seed: Tensor | None,
              bm: list[Any], buffers: list[Tensor]) -> list[Tensor] | None:
    """The backward library op's gradients (None when neither output has one): ``[dq, dk, dv,
    *buffer_grads]``, or ``[dqkv, *buffer_grads]`` with ``static.packed``."""
    with torch.no_grad():
        if dout is None and dlse is None:
            return None
        if dout is None:
            dout = torch.zeros_like(out)
        if static.score_key is not None and not _SPECS[static.score_key].differentiable:
            _SPECS[static.score_key].grad_jit(static.needs)  # raises, naming the mod
        # A library op, so that torch.func transforms (grad, vmap of grad) see plain tensors.
        return OPS.attention_bwd(dout, dlse, *qkv, out, lse, cu_q, cu_kv, seed, *bm, list(buffers),
                                 _static_str(static))


class _AttentionFunction(torch.autograd.Function):
    """Autograd glue of the Triton path. Inputs: q, k, v as (B, H, S, D) views (or packed (T, H, D)),
    cu_seqlens, dropout seed, the 8 block-mask tensors, the static config, the unique captured
    tensors of the mods. Outputs: out (B, Hq, Sq, Dv) view and lse (B, Hq, Sq) view."""

    @staticmethod
    def forward(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor | None, cu_kv: Tensor | None,  # type: ignore[override]
                seed: Tensor | None, kvn: Any, kvi: Any, fkvn: Any, fkvi: Any, qn: Any, qi: Any, fqn: Any,
                fqi: Any, static: _Static, *buffers: Tensor) -> tuple[Tensor, Tensor]:
        # One opaque library op (see _attention_fwd_impl): torch.compile records a single node and
        # never re-generates the kernel, whose mods are globals of a specialized copy.
        out, lse = OPS.attention_fwd(q, k, v, cu_q, cu_kv, seed, kvn, kvi, fkvn, fkvi,
                                     list(buffers), _static_str(static))
        return out, lse

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        q, k, v, cu_q, cu_kv, seed, *rest = inputs
        bm, static, buffers = rest[:8], rest[8], rest[9:]
        out, lse = output
        ctx.static = static
        ctx.n_buffers = len(buffers)
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_kv, seed, *bm, *buffers)
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx: Any, dout: Tensor | None, dlse: Tensor | None) -> tuple[Any, ...]:  # type: ignore[override]
        static: _Static = ctx.static
        q, k, v, out, lse, cu_q, cu_kv, seed, *rest = ctx.saved_tensors
        grads = _backward(static, dout, dlse, (q, k, v), out, lse, cu_q, cu_kv, seed, rest[:8], rest[8:])
        if grads is None:
            return (None,) * (15 + ctx.n_buffers)
        buf_grads = [g if _needs_slot(static, i) else None for i, g in enumerate(grads[3:])]
        return (grads[0], grads[1], grads[2], None, None, None, *([None] * 8), None, *buf_grads)

    @staticmethod
    def vmap(info: Any, in_dims: tuple[Any, ...], *args: Any) -> tuple[Any, Any]:
        return _vmap_loop(_AttentionFunction, info, in_dims, args)


class _PackedAttentionFunction(torch.autograd.Function):
    """:class:`_AttentionFunction` on one projection output ``qkv`` whose last dim holds the q, k and
    v heads (``_Static.packed``): the same ops on its head views, and one gradient of ``qkv`` that
    the backward op writes dq, dk and dv into (no concatenation of three gradients, which autograd's
    backward of splitting ``qkv`` would add). Inputs: ``qkv``, then as :class:`_AttentionFunction`
    from ``cu_q`` on."""

    @staticmethod
    def forward(qkv: Tensor, cu_q: Tensor | None, cu_kv: Tensor | None,  # type: ignore[override]
                seed: Tensor | None, kvn: Any, kvi: Any, fkvn: Any, fkvi: Any, qn: Any, qi: Any, fqn: Any,
                fqi: Any, static: _Static, *buffers: Tensor) -> tuple[Tensor, Tensor]:
        q, k, v = _split_packed(qkv, static)
        out, lse = OPS.attention_fwd(q, k, v, cu_q, cu_kv, seed, kvn, kvi, fkvn, fkvi,
                                     list(buffers), _static_str(static))
        return out, lse

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        qkv, cu_q, cu_kv, seed, *rest = inputs
        bm, static, buffers = rest[:8], rest[8], rest[9:]
        out, lse = output
        ctx.static = static
        ctx.n_buffers = len(buffers)
        ctx.save_for_backward(qkv, out, lse, cu_q, cu_kv, seed, *bm, *buffers)
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx: Any, dout: Tensor | None, dlse: Tensor | None) -> tuple[Any, ...]:  # type: ignore[override]
        static: _Static = ctx.static
        qkv, out, lse, cu_q, cu_kv, seed, *rest = ctx.saved_tensors
        grads = _backward(static, dout, dlse, _split_packed(qkv, static), out, lse, cu_q, cu_kv, seed, rest[:8],
                          rest[8:])
        if grads is None:
            return (None,) * (13 + ctx.n_buffers)
        buf_grads = [g if _needs_slot(static, i) else None for i, g in enumerate(grads[1:])]
        return (grads[0], None, None, None, *([None] * 8), None, *buf_grads)

    @staticmethod
    def vmap(info: Any, in_dims: tuple[Any, ...], *args: Any) -> tuple[Any, Any]:
        return _vmap_loop(_PackedAttentionFunction, info, in_dims, args)


def _vmap_loop(function: Any, info: Any, in_dims: tuple[Any, ...], args: tuple[Any, ...]) -> tuple[Any, Any]:
    # vmap of an attention Function = a loop over the batched entries (exact semantics; the batches
    # seen in practice, micro-batches or ensembles, are small).
    outs = []
    for i in range(info.batch_size):
        sample = [a if d is None or not isinstance(a, Tensor) else a.select(d, i) for a, d in zip(args, in_dims)]
        outs.append(function.apply(*sample))
    return (torch.stack([o[0] for o in outs]), torch.stack([o[1] for o in outs])), (0, 0)


def _needs_slot(static: _Static, slot: int) -> bool:
    return any(static.needs[j] for j, i in enumerate(static.score_slots) if i == slot)


def _bwd_static(static: str) -> _Static:
    return _parse_static(static)


def _attention_bwd_op(
    dout: Tensor, dlse: Tensor | None, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
    cu_q: Tensor | None, cu_kv: Tensor | None, seed: Tensor | None,
    kvn: Tensor | None, kvi: Tensor | None, fkvn: Tensor | None, fkvi: Tensor | None,
    qn: Tensor | None, qi: Tensor | None, fqn: Tensor | None, fqi: Tensor | None,
    buffers: list[Tensor], static: str,
) -> list[Tensor]:
    """Attention backward (the fused kernels): ``[dq, dk, dv, *buffer_grads]``; a buffer that needs
    no gradient gets an empty tensor. ``static`` is ``repr`` of the call's :class:`_Static`."""
    st = _bwd_static(static)
    varlen = st.layout == "thd"
    kern = _K.AttentionKernels(
        None,
        _kernel_for("bwd_preprocess", st.score_key, st.mask_key, st.needs),
        _kernel_for("bwd_dkdv", st.score_key, st.mask_key, st.needs),
        _kernel_for("bwd_dq", st.score_key, st.mask_key, st.needs),
        # the mods themselves, for the Hopper backward (None keeps the portable kernels)
        _kernel_for("score_mod", st.score_key, st.mask_key, st.needs),
        _kernel_for("mask_mod", st.score_key, st.mask_key, st.needs),
        _kernel_for("score_grad", st.score_key, st.mask_key, st.needs),
        _kernel_for("score_rel", st.score_key, st.mask_key, st.needs),
        _kernel_for("mask_band", st.score_key, st.mask_key, st.needs),
    )
    if st.packed is not None:  # dq, dk, dv written into one gradient of the projection they came from
        shape = _packed_shape(q, st)
        dqkv = (torch.zeros if varlen else torch.empty)(shape, dtype=q.dtype, device=q.device)
        dq, dk, dv = _split_packed(dqkv, st)
    else:
        dq = torch.zeros_like(q) if varlen else torch.empty_like(q)
        dk = torch.zeros_like(k) if varlen else torch.empty_like(k)
        dv = torch.zeros_like(v) if varlen else torch.empty_like(v)
    flat = [_flat(t) for t in buffers]
    grads = [torch.zeros(b.numel() if _needs_slot(st, i) else 0, dtype=torch.float32, device=q.device)
             for i, b in enumerate(buffers)]
    bs, bst = _sparsity((kvn, kvi, fkvn, fkvi, qn, qi, fqn, fqi), st)
    _K.attention_bwd_launch(
        dout, q, k, v, out, lse, dlse, dq, dk, dv, sm_scale=st.scale, kernels=kern,
        cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv, max_seqlen_q=st.max_q, max_seqlen_kv=st.max_kv,
        window=(st.left, st.right), has_score_mod=st.score_key is not None, has_mask_mod=st.mask_key is not None,
        score_buffers=tuple(flat[i] for i in st.score_slots), mask_buffers=_mask_buffers(st, flat),
        score_buffer_grads=tuple(grads[i] if st.needs[j] else None for j, i in enumerate(st.score_slots)),
        block_sparsity=bs, block_sparsity_t=bst, dropout_p=st.dropout_p, dropout_seed=seed,
        dq_mode=st.dq_mode, config=dict(st.bwd_config) if st.bwd_config else None,
    )
    return ([dqkv] if st.packed is not None else [dq, dk, dv]) + [
        g.view(b.shape).to(b.dtype) if g.numel() else g.to(b.dtype) for g, b in zip(grads, buffers)]


def _attention_bwd_fake(dout, dlse, q, k, v, out, lse, cu_q, cu_kv, seed,  # type: ignore[no-untyped-def]
                        kvn, kvi, fkvn, fkvi, qn, qi, fqn, fqi, buffers, static):
    st = _bwd_static(static)
    first = ([q.new_empty(_packed_shape(q, st))] if st.packed is not None
             else [torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)])
    return first + [
        torch.empty_like(b) if _needs_slot(st, i) else b.new_empty((0,)) for i, b in enumerate(buffers)]


def _attention_bwd_vmap(info: Any, in_dims: tuple[Any, ...], *args: Any) -> tuple[Any, Any]:
    # vmap (e.g. of torch.func.grad) = a loop over the batch entries.
    def pick(a: Any, d: Any, i: int) -> Any:
        if isinstance(a, (list, tuple)):
            dims = d if isinstance(d, (list, tuple)) else [d] * len(a)
            return [pick(x, dd, i) for x, dd in zip(a, dims)]
        return a if d is None or not isinstance(a, Tensor) else a.select(d, i)

    outs = [torch.ops.fp8ops.attention_bwd(*[pick(a, d, i) for a, d in zip(args, in_dims)])
            for i in range(info.batch_size)]
    return [torch.stack([o[j] for o in outs]) for j in range(len(outs[0]))], [0] * len(outs[0])


# A library op defined like attention_fwd (the dispatcher straight to the launcher: a
# torch.library.custom_op adds its Python layers, a few hundred µs of host time per call).
_define(
    OpSpec("attention_bwd(Tensor dout, Tensor? dlse, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
           "Tensor? cu_q, Tensor? cu_kv, Tensor? seed, Tensor? kvn, Tensor? kvi, Tensor? fkvn, Tensor? fkvi, "
           "Tensor? qn, Tensor? qi, Tensor? fqn, Tensor? fqi, Tensor[] buffers, str static) -> Tensor[]",
           cuda=_attention_bwd_op, fake=_attention_bwd_fake),
    cpu=_attention_bwd_op,
)
torch.library.register_vmap("fp8ops::attention_bwd", _attention_bwd_vmap)


def _distinct(*ts: Tensor) -> list[Tensor]:
    # autograd.Function.apply under torch.compile cannot take the same tensor twice.
    out: list[Tensor] = []
    for t in ts:
        if any(t is o for o in out):
            t = t.view(t.shape)
        out.append(t)
    return out


def _attention_triton(
    q: Tensor, k: Tensor, v: Tensor, *, score_mod: ScoreMod | None, mask_mod: MaskMod | None,
    block_mask: BlockMask | None, scale: float, left: int | None, right: int | None, layout: str,
    cu_q: Tensor | None, cu_kv: Tensor | None, max_q: int | None, max_kv: int | None,
    dropout_p: float, seed: Tensor | None, dq_mode: str = "separate",
    fwd_config: dict[str, int] | None = None, bwd_config: dict[str, int] | None = None,
    qkv: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """The fused path on tensors in ``layout`` (or packed with ``layout="thd"``): ``(out, lse)`` in
    the same layout. Works on CUDA, and on CPU tensors under ``TRITON_INTERPRET=1`` (tests).

    ``qkv``: the projection output (S, B, W) in layout "sbhd" or (T, W) packed whose last dim is
    [q heads | k heads | v heads], of which q, k and v are the head views; gradients then reach
    ``qkv`` as one tensor (:class:`_PackedAttentionFunction`), and q, k, v get none."""
    varlen = layout == "thd"
    if varlen:
        q4, k4, v4 = q, k, v
    else:
        q4, k4, v4 = (_ref.to_bhsd(t, layout) for t in (q, k, v))
    uniq: list[Tensor] = []

    def slot(t: Tensor) -> int:
        for i, u in enumerate(uniq):
            if u is t:
                return i
        uniq.append(t)
        return len(uniq) - 1

    sm_bufs = score_mod.buffers if score_mod is not None else ()
    mm_bufs = mask_mod.buffers if mask_mod is not None else ()
    score_slots = tuple(slot(t) for t in sm_bufs)
    mask_slots = tuple(slot(t) for t in mm_bufs)
    needs = tuple(bool(t.requires_grad) and torch.is_grad_enabled() for t in sm_bufs)
    bm: tuple[Any, ...] = (None,) * 8
    if block_mask is not None:
        bm = (block_mask.kv_num_blocks, block_mask.kv_indices, block_mask.full_kv_num_blocks,
              block_mask.full_kv_indices, block_mask.q_num_blocks, block_mask.q_indices,
              block_mask.full_q_num_blocks, block_mask.full_q_indices)
    static = _Static(
        score_key=score_mod.key if score_mod is not None else None,
        mask_key=mask_mod.key if mask_mod is not None else None,
        score_slots=score_slots, mask_slots=mask_slots, needs=needs, scale=float(scale),
        left=left, right=right, layout=layout, max_q=max_q, max_kv=max_kv, dropout_p=float(dropout_p),
        sparse_block=block_mask.block_size if block_mask is not None else None, dq_mode=dq_mode,
        fwd_config=tuple(sorted(fwd_config.items())) if fwd_config else None,
        bwd_config=tuple(sorted(bwd_config.items())) if bwd_config else None,
        packed=None if qkv is None else (q4.shape[1], k4.shape[1], q4.shape[-1]),
    )
    q4, k4, v4 = _distinct(q4, k4, v4)
    refuse_compiled_transform("attention", q4)
    if qkv is not None:
        out4, lse3 = apply(_PackedAttentionFunction, qkv, cu_q, cu_kv, seed, *bm, static, *uniq)
    else:
        out4, lse3 = apply(_AttentionFunction, q4, k4, v4, cu_q, cu_kv, seed, *bm, static, *uniq)
    if varlen:
        return out4, lse3
    return _ref.from_bhsd(out4, layout), _ref.lse_from_bhs(lse3, layout)
