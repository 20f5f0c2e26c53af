"""Attention forward for Hopper (sm_90) in Gluon: warp-specialised, TMA-fed, wgmma kept in flight.

The same math as ``kernels/attention.py`` (FlashAttention-2's online softmax in base 2, the same
output and natural-log LSE, ``MASKED_ROW_LSE`` for rows that see no key), with the schedule written
out instead of left to the compiler, which on sm_90 waits for every matrix product at once and
synchronises the whole block around each load::

    loader (1 warp)        Q halves; then K_0, and per tile t: K_{t+1}, V_t into a ring of STAGES
                           buffers, each after its "empty" barrier says both consumers are done
    consumer h (4 warps,   S_t = Q_h K_t^T (async); O += P_{t-1} V_{t-1} (async);
      rows h*64..h*64+63)  wait for S_t only, release K_t, softmax of S_t while P V runs;
                           wait for P V, release V_{t-1}, rescale O; P_t to bf16/fp16 in registers

Two consumer warpgroups share each K/V tile and run independently of each other, so the warp
schedulers overlap one's softmax with the other's products (the effect of FlashAttention-3's
ping-pong without its named barriers). The loader sets its registers down to 24, the consumers up.

The grid is persistent: one program per SM, each running work items (a 128-row query tile of one
head; the tiles of a head in a row, the longest first under a causal-like band) until none is left.
Each program starts with the item of its own index; the loader claims every further one from an
int32 counter (one atomic, issued once the current item's last copy is out, so that a busy program
does not hold an item an idle one could run) and publishes its index to the consumers in shared
memory with the Q copy's barrier. The K/V ring runs on across items, and at d <= 128 Q is
double-buffered, so the next item's Q and first K/V tiles load while the consumers finish the
current one; each consumer hands its Q buffer back once the O store (staged through it) has read
it. Same items, same math per item: outputs are bitwise those of one program per tile, which this
replaced (one H100, S = 8192, d = 128, forward ms: document mask 2.71 against 2.77, window 2.32
against 2.39, ALiBi 8.91 against 9.10 in ``bench attention``).

A score mod that is a relative bias, ``score + slope * (kv - q) + c`` with slope and c per (b, h)
(ALiBi; ``codegen.relative_bias``), is not called per score: the consumer evaluates it twice per
item for c and the slope, adds ``slope * (kv - m)`` per key column (m: its first row, an exact
integer difference) with one fused multiply-add per score, and adds the row part ``-slope * (q - m)
+ c`` to the row's LSE (ALiBi forward 8.04 ms against 8.90 calling the mod, same H100 and shape).

What it covers (``hopper_supported`` / ``hopper_fwd``; the portable kernel runs otherwise): an sm_90
GPU, 16-bit q/k/v with one head dim D = Dv in {64, 128, 256}, dense (B, H, S, D) views whose rows
each head can address through a 2-D tensor descriptor (bhsd, bshd, sbhd and their GQA forms),
sequence lengths that are multiples of the tiles (128 query rows, 64 or 128 keys), a band (causal /
sliding window), a ``score_mod``, a ``mask_mod``, block-mask lists and dropout (the mask of
``_dropout.py``, hashed per weight after the softmax step: the row sums see every weight, P V only
the kept ones, and the output is scaled by 1 / (1 - p) once); no packed sequences or FP8 descales. Mods are the same ``@triton.jit`` functions the portable kernels call. Where it was
measured slower the launcher keeps the portable kernel: at d = 64 for short rows, mods and block
masks, and for score mods with transcendental math per score (``fp8ops.attention.codegen.tile_math``).
Forward times, one H100, B=8, S=8192 (``docs/benchmarks/attention_hopper_h100.md``): d = 128 causal
7.58 ms against 9.19 for the portable kernel, 7.54 for cuDNN and 10.64 for compiled FlexAttention.

References: Shah et al., "FlashAttention-3" (2024), sections 3.1-3.2 (producer/consumer warp
specialisation, intra-warpgroup overlap of softmax and GEMMs); the Gluon tutorials on wgmma, TMA and
warp specialisation in the Triton repository.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, NamedTuple

import torch

from ._dropout import _dropout_draw, _dropout_key, _dropout_row, _kept
from ._library import num_sms

try:  # Gluon (triton.experimental) with its Hopper dialect; absent on older Triton
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    AVAILABLE = hasattr(gl, "warp_specialize")
except ImportError:  # pragma: no cover - depends on the installed Triton
    AVAILABLE = False

__all__ = ["AVAILABLE", "HopperConfig", "head_placement", "hopper_config", "hopper_fwd", "hopper_supported"]

_LN2 = 0.6931471805599453
_LOG2E = 1.4426950408889634
_MASKED_LSE = -1.0e30  # kernels/attention.MASKED_ROW_LSE
_NO_BOUND = 1 << 30  # kernels/attention.NO_BOUND


class HopperConfig(NamedTuple):
    """Key tile and ring depth per head dim (one H100, B=1, H=32, S=8192, bf16, causal and no mask;
    ``docs/benchmarks/attention_hopper_h100.md``)."""

    block_n: int
    stages: int
    q_bufs: int  # Q buffers: two where shared memory holds them (the next item's Q loads early)


def hopper_config(d: int) -> HopperConfig:
    # d=64: 3 stages of 128 keys 308 / 375 TFLOP/s (causal / none) against 301 / 377 with 2 and
    # 270 / 344 with 64 keys x 4; d=128: 128 keys x 2 526 / 575 against 64 x 3 451 / 518 and
    # 64 x 4 476 / 507; d=256: 64 keys x 2 571 / 678 against 32 x 4 469 / 503.
    if d <= 64:
        return HopperConfig(128, 3, 2)
    if d <= 128:
        return HopperConfig(128, 2, 2)
    return HopperConfig(64, 2, 1)


BLOCK_M = 128  # query rows per program: two consumer warpgroups of 64


if AVAILABLE:
    # TMA copies were renamed after Triton 3.6 (async_copy_* -> async_load / async_store).
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    _tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
    # warp_specialize's signature changed after Triton 3.6: [(fn, args), ...] instead of
    # (default_args, default_fn, worker_args, worker_fns).
    _NEW_WS = next(iter(inspect.signature(gl.warp_specialize).parameters)) == "functions_and_args"
    # a barrier of the calling partition's warps (renamed after Triton 3.6)
    _thread_barrier = getattr(gl, "thread_barrier", None) or gl.barrier

    @gluon.jit
    def _tile_range(b, h, own0, seq_other, before, after, n_ptr, i_ptr, fn_ptr, fi_ptr,
                    stride_nb, stride_nh, stride_nm, stride_ib, stride_ih, stride_im,
                    BAND: gl.constexpr, BLOCK_SPARSE: gl.constexpr, OWN_SPARSE: gl.constexpr,
                    OTHER_SPARSE: gl.constexpr, OWN_BLOCK: gl.constexpr, OTHER_BLOCK: gl.constexpr):
        # The tiles of the other side that a program's OWN_BLOCK positions [own0, own0 + OWN_BLOCK)
        # of head (b, h) see, the band reaching `before` positions back and `after` ahead (the
        # forward: a query tile's key tiles, before / after = the window's left / right; the
        # backward: a key block's query tiles, right / left): (n, lo_t, flo_t, fhi_t, n_part,
        # part_ptr, full_ptr). Dense tiles run lo_t .. lo_t + n - 1, the ones outside [flo_t, fhi_t)
        # on the band's edges (masked); block-sparse ones walk the own block's partial list, then
        # its full list (_tile_start gives tile t's first position).
        zero = seq_other * 0
        n_part = zero
        part_ptr = i_ptr  # read only with a block mask
        full_ptr = fi_ptr
        lo_t = zero
        flo_t = zero
        fhi_t = seq_other // OTHER_BLOCK
        if BLOCK_SPARSE:
            blk = own0 // OWN_SPARSE
            n_off = b * stride_nb + h * stride_nh + blk * stride_nm
            i_off = b.to(gl.int64) * stride_ib + h.to(gl.int64) * stride_ih + blk.to(gl.int64) * stride_im
            n_part = gl.load(n_ptr + n_off)
            n = (n_part + gl.load(fn_ptr + n_off)) * (OTHER_SPARSE // OTHER_BLOCK)
            part_ptr = i_ptr + i_off
            full_ptr = fi_ptr + i_off
        elif BAND:
            lo = gl.maximum(own0 - before, 0)
            hi = gl.minimum(seq_other, own0 + OWN_BLOCK + after)
            lo_t = lo // OTHER_BLOCK
            n = gl.maximum((hi + OTHER_BLOCK - 1) // OTHER_BLOCK - lo_t, 0)
            flo_t = (gl.maximum(own0 + OWN_BLOCK - 1 - before, 0) + OTHER_BLOCK - 1) // OTHER_BLOCK
            fhi_t = gl.maximum((own0 + after + 1) // OTHER_BLOCK, flo_t)
        else:
            n = seq_other // OTHER_BLOCK
        return n, lo_t, flo_t, fhi_t, n_part, part_ptr, full_ptr

    @gluon.jit
    def _relative_bias(SCORE_FN: gl.constexpr, sm_scale, b, h, st0, st1, st2, st3):
        # A relative bias's slope and constant (codegen.relative_bias: score + slope * (kv - q) + c,
        # slope and c per (b, h)): the mod at (q, kv) = (0, 0) and (0, 1)
        pos0 = b * 0
        c = SCORE_FN(sm_scale * 0.0, b, h, pos0, pos0, st0, st1, st2, st3).to(gl.float32)
        slope = SCORE_FN(sm_scale * 0.0, b, h, pos0, pos0 + 1, st0, st1, st2, st3).to(gl.float32) - c
        return slope, c

    @gluon.jit
    def _tile_start(t, lo_t, n_part, part_ptr, full_ptr, BLOCK_SPARSE: gl.constexpr, SPARSE_KV: gl.constexpr,
                    BLOCK_N: gl.constexpr):
        # First key of tile t: dense tiles run from lo_t; block-sparse ones walk the partial list's
        # blocks, then the full list's, SPARSE_KV // BLOCK_N tiles per block.
        if BLOCK_SPARSE:
            per: gl.constexpr = SPARSE_KV // BLOCK_N
            n_part_t = n_part * per
            if t < n_part_t:
                start = gl.load(part_ptr + t // per) * SPARSE_KV + (t % per) * BLOCK_N
            else:
                j = t - n_part_t
                start = gl.load(full_ptr + j // per) * SPARSE_KV + (j % per) * BLOCK_N
        else:
            start = (lo_t + t) * BLOCK_N
        return start

    @gluon.jit
    def _load_k(k_desc, k_smem, k_ready, k_empty, t, row, col, STAGES: gl.constexpr):
        st = t % STAGES
        mbarrier.wait(k_empty.index(st), ((t // STAGES) & 1) ^ 1)  # a new barrier passes parity 1
        mbarrier.expect(k_ready.index(st), k_desc.block_type.nbytes)
        _tma_load(k_desc, [row, col], k_ready.index(st), k_smem.index(st))

    @gluon.jit
    def _item(w, d, BAND: gl.constexpr, REVERSE: gl.constexpr, BLOCK_SPARSE: gl.constexpr,
              SPARSE_Q: gl.constexpr, SPARSE_KV: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
        # Work item w: query tile m0 of head (b, h), the tiles of one head in a row (its K and V stay in
        # L2 while its tiles run), the longest first under a causal-like band; its key tiles.
        (seq_q, seq_kv, group, n_heads, n_items, sched_ptr, q_rb, q_rh, q_cb, q_ch, k_rb, k_rh, k_cb, k_ch,
         o_rb, o_rh, o_cb, o_ch, stride_lb, stride_lh, stride_ls, kvn_ptr, kvi_ptr, fkvn_ptr, fkvi_ptr,
         stride_nb, stride_nh, stride_nm, stride_ib, stride_ih, stride_im, sm_scale, win_left, win_right,
         seed_ptr, drop_thresh, drop_scale) = d
        n_m = seq_q // BLOCK_M
        pid = w % n_m
        if REVERSE:
            pid = n_m - 1 - pid
        hb = w // n_m
        h = hb % n_heads
        b = hb // n_heads
        m0 = pid * BLOCK_M
        hk = h // group
        q_row = (b * q_rb + h * q_rh) * seq_q + m0
        q_col = b * q_cb + h * q_ch
        k_row0 = (b * k_rb + hk * k_rh) * seq_kv
        k_col = b * k_cb + hk * k_ch
        o_row = (b * o_rb + h * o_rh) * seq_q + m0
        o_col = b * o_cb + h * o_ch
        lse_off = b.to(gl.int64) * stride_lb + h.to(gl.int64) * stride_lh
        n, lo_t, flo_t, fhi_t, n_part, part_ptr, full_ptr = _tile_range(
            b, h, m0, seq_kv, win_left, win_right, kvn_ptr, kvi_ptr, fkvn_ptr, fkvi_ptr,
            stride_nb, stride_nh, stride_nm, stride_ib, stride_ih, stride_im,
            BAND, BLOCK_SPARSE, SPARSE_Q, SPARSE_KV, BLOCK_M, BLOCK_N)
        return (b, h, m0, q_row, q_col, k_row0, k_col, o_row, o_col, lse_off, n, lo_t, flo_t, fhi_t, n_part,
                part_ptr, full_ptr)

    @gluon.jit
    def _loader(a, d, st0, st1, st2, st3, mt0, mt1, mt2, mt3, SCORE_FN: gl.constexpr, MASK_FN: gl.constexpr,
                HAS_SCORE_MOD: gl.constexpr, SCORE_REL: gl.constexpr, HAS_MASK_MOD: gl.constexpr,
                BAND: gl.constexpr, REVERSE: gl.constexpr,
                BLOCK_SPARSE: gl.constexpr, SPARSE_Q: gl.constexpr, SPARSE_KV: gl.constexpr, HALF: gl.constexpr,
                BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr, Q_BUFS: gl.constexpr,
                DROPOUT: gl.constexpr):
        (q_desc, k_desc, v_desc, o_desc, lse_ptr, q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, v_ready,
         k_empty, v_empty, slot_smem) = a
        (seq_q, seq_kv, group, n_heads, n_items, sched_ptr, q_rb, q_rh, q_cb, q_ch, k_rb, k_rh, k_cb, k_ch,
         o_rb, o_rh, o_cb, o_ch, stride_lb, stride_lh, stride_ls, kvn_ptr, kvi_ptr, fkvn_ptr, fkvi_ptr,
         stride_nb, stride_nh, stride_nm, stride_ib, stride_ih, stride_im, sm_scale, win_left, win_right,
         seed_ptr, drop_thresh, drop_scale) = d
        lane = gl.arange(0, 32, layout=gl.BlockedLayout([1], [32], [1], [0]))
        w = gl.program_id(0)
        first = gl.num_programs(0)  # items handed out by the counter start after the programs' own
        i = 0
        kc = 0  # K/V ring position of the item's first tile (running over items)
        while w < n_items:
            qb = i % Q_BUFS
            for c in gl.static_range(2):
                mbarrier.wait(q_empty.index(qb * 2 + c), ((i // Q_BUFS) & 1) ^ 1)
            # the item's index, stored by the whole warp before the arrival (made with the Q copy)
            # that publishes it to the consumers
            slot_smem.index(i % 2).store(lane * 0 + w)
            _thread_barrier()
            (b, h, m0, q_row, q_col, k_row0, k_col, o_row, o_col, lse_off, n, lo_t, flo_t, fhi_t, n_part,
             part_ptr, full_ptr) = _item(w, d, BAND, REVERSE, BLOCK_SPARSE, SPARSE_Q, SPARSE_KV, 2 * HALF, BLOCK_N)
            for c in gl.static_range(2):
                mbarrier.expect(q_bar.index(qb * 2 + c), q_desc.block_type.nbytes)
                _tma_load(q_desc, [q_row + c * HALF, q_col], q_bar.index(qb * 2 + c), q_smem.index(qb * 2 + c))
            if n > 0:
                k0 = _tile_start(0, lo_t, n_part, part_ptr, full_ptr, BLOCK_SPARSE, SPARSE_KV, BLOCK_N)
                _load_k(k_desc, k_smem, k_ready, k_empty, kc, k_row0 + k0, k_col, STAGES)
            for t in range(0, n):
                if t + 1 < n:
                    k1 = _tile_start(t + 1, lo_t, n_part, part_ptr, full_ptr, BLOCK_SPARSE, SPARSE_KV, BLOCK_N)
                    _load_k(k_desc, k_smem, k_ready, k_empty, kc + t + 1, k_row0 + k1, k_col, STAGES)
                g = kc + t
                st = g % STAGES
                mbarrier.wait(v_empty.index(st), ((g // STAGES) & 1) ^ 1)
                mbarrier.expect(v_ready.index(st), v_desc.block_type.nbytes)
                kt = _tile_start(t, lo_t, n_part, part_ptr, full_ptr, BLOCK_SPARSE, SPARSE_KV, BLOCK_N)
                _tma_load(v_desc, [k_row0 + kt, k_col], v_ready.index(st), v_smem.index(st))
            kc += n
            # the next item, claimed once this one's last copy is issued (a few tiles before its
            # consumers finish it): claimed earlier, it would wait behind this one while idle programs
            # had nothing left to take
            got = gl.atomic_add(sched_ptr + lane * 0, lane * 0 + 1, mask=lane == 0)
            w = first + gl.max(gl.where(lane == 0, got, 0), 0)
            i += 1
        # no more items: publish an index past the end (no copy)
        qb = i % Q_BUFS
        for c in gl.static_range(2):
            mbarrier.wait(q_empty.index(qb * 2 + c), ((i // Q_BUFS) & 1) ^ 1)
        slot_smem.index(i % 2).store(lane * 0 + w)
        _thread_barrier()
        for c in gl.static_range(2):
            mbarrier.arrive(q_bar.index(qb * 2 + c), count=1)

    @gluon.jit
    def _scores(s, t, k0, mh, b, h, sm_scale, qk_scale, rel2, win_left, win_right, lo_t, flo_t, fhi_t, n_part,
                st0, st1, st2, st3, mt0, mt1, mt2, mt3, SCORE_FN: gl.constexpr, MASK_FN: gl.constexpr,
                HAS_SCORE_MOD: gl.constexpr, SCORE_REL: gl.constexpr, HAS_MASK_MOD: gl.constexpr,
                BAND: gl.constexpr, BLOCK_SPARSE: gl.constexpr, SPARSE_KV: gl.constexpr, HALF: gl.constexpr,
                BLOCK_N: gl.constexpr, layout: gl.constexpr):
        # One tile's scores in base-2 units: score_mod in natural units, then the band and mask_mod
        # where the tile needs them (-inf where a key is not visible). A relative bias (SCORE_REL:
        # slope * (kv - q) + c) adds rel2 * (kv - mh) per column; its row part, -slope * (q - mh) + c,
        # is the same for the whole row and goes into the row's LSE instead (the softmax ignores it).
        rows = gl.expand_dims(mh + gl.arange(0, HALF, layout=gl.SliceLayout(1, layout)), 1)
        col_off = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
        cols = gl.expand_dims(k0 + col_off, 0)
        if SCORE_REL:
            s2 = s * qk_scale + gl.expand_dims(((k0 - mh) + col_off).to(gl.float32) * rel2, 0)
        elif HAS_SCORE_MOD:
            s2 = SCORE_FN(s * sm_scale, b, h, rows, cols, st0, st1, st2, st3).to(gl.float32) * 1.4426950408889634
        else:
            s2 = s * qk_scale
        if BAND:
            edge = True
            if not BLOCK_SPARSE:
                kt = lo_t + t
                edge = (kt < flo_t) | (kt >= fhi_t)
            if edge:  # -win_right <= q - kv <= win_left, as one unsigned comparison (the sum fits 32 bits)
                width = win_left.to(gl.uint32) + win_right.to(gl.uint32)
                s2 = gl.where(((rows + win_right) - cols).to(gl.uint32) <= width, s2, float("-inf"))
        if HAS_MASK_MOD:
            partial = True
            if BLOCK_SPARSE:
                partial = t < n_part * (SPARSE_KV // BLOCK_N)
            if partial:
                s2 = gl.where(MASK_FN(b, h, rows, cols, mt0, mt1, mt2, mt3), s2, float("-inf"))
        return s2

    @gluon.jit
    def _drop_rows(drop_key, m0, ROWS: gl.constexpr, layout: gl.constexpr):
        # (row hashes, offsets from m0) of rows m0.. as (ROWS, 1) columns; m0 a multiple of 16
        # (kernels/_dropout.py)
        gl.static_assert(ROWS % 16 == 0, "the query tile must hold whole groups of 16")
        rows = gl.expand_dims(gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout)), 1)
        return _dropout_row(drop_key, m0, rows), rows

    @gluon.jit
    def _drop(p, drop_row, rows, k0, drop_thresh, COLS: gl.constexpr, layout: gl.constexpr):
        # p of one tile (rows of _drop_rows, keys k0..) with its dropped weights zeroed
        cols = gl.expand_dims(k0 + gl.arange(0, COLS, layout=gl.SliceLayout(0, layout)), 0)
        return _kept(_dropout_draw(drop_row, rows, cols), drop_thresh, p)

    @gluon.jit
    def _softmax(s2, m_i, l_i):
        # Online softmax step; a row with no visible key so far keeps m = -inf, l = 0.
        m_new = gl.maximum(m_i, gl.max(s2, 1))
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(s2 - gl.expand_dims(m_use, 1))
        alpha = gl.exp2(m_i - m_use)
        return p, alpha, m_new, l_i * alpha + gl.sum(p, 1)

    @gluon.jit
    def _consume(half: gl.constexpr, a, d, st0, st1, st2, st3, mt0, mt1, mt2, mt3, SCORE_FN: gl.constexpr,
                 MASK_FN: gl.constexpr, HAS_SCORE_MOD: gl.constexpr, SCORE_REL: gl.constexpr,
                 HAS_MASK_MOD: gl.constexpr, BAND: gl.constexpr, REVERSE: gl.constexpr, BLOCK_SPARSE: gl.constexpr,
                 SPARSE_Q: gl.constexpr, SPARSE_KV: gl.constexpr, HALF: gl.constexpr, BLOCK_N: gl.constexpr,
                 HEAD_D: gl.constexpr, STAGES: gl.constexpr, Q_BUFS: gl.constexpr, DROPOUT: gl.constexpr):
        (q_desc, k_desc, v_desc, o_desc, lse_ptr, q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, v_ready,
         k_empty, v_empty, slot_smem) = a
        (seq_q, seq_kv, group, n_heads, n_items, sched_ptr, q_rb, q_rh, q_cb, q_ch, k_rb, k_rh, k_cb, k_ch,
         o_rb, o_rh, o_cb, o_ch, stride_lb, stride_lh, stride_ls, kvn_ptr, kvi_ptr, fkvn_ptr, fkvi_ptr,
         stride_nb, stride_nh, stride_nm, stride_ib, stride_ih, stride_im, sm_scale, win_left, win_right,
         seed_ptr, drop_thresh, drop_scale) = d
        qk_scale = sm_scale * 1.4426950408889634
        dtype: gl.constexpr = q_desc.dtype
        k_width: gl.constexpr = 32 // dtype.primitive_bitwidth
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, HEAD_D, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=k_width)
        slot_layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
        s_zero = gl.zeros([HALF, BLOCK_N], gl.float32, layout=s_layout)
        i = 0
        kc = 0
        mbarrier.wait(q_bar.index(half), 0)
        w = gl.max(slot_smem.index(0).load(slot_layout), 0)
        while w < n_items:
            (b, h, m0, q_row, q_col, k_row0, k_col, o_row, o_col, lse_off, n, lo_t, flo_t, fhi_t, n_part,
             part_ptr, full_ptr) = _item(w, d, BAND, REVERSE, BLOCK_SPARSE, SPARSE_Q, SPARSE_KV, 2 * HALF, BLOCK_N)
            qb = i % Q_BUFS
            mh = m0 + half * HALF
            qh = q_smem.index(qb * 2 + half)
            if DROPOUT:
                drop_row, drop_q = _drop_rows(_dropout_key(seed_ptr, b, h), mh, HALF, s_layout)
            rel2 = 0.0
            rel_c = 0.0
            rel_slope = 0.0
            if SCORE_REL:
                rel_slope, rel_c = _relative_bias(SCORE_FN, sm_scale, b, h, st0, st1, st2, st3)
                rel2 = rel_slope * 1.4426950408889634
            acc = gl.zeros([HALF, HEAD_D], gl.float32, layout=o_layout)
            m_i = gl.full([HALF], float("-inf"), gl.float32, layout=row_s)
            l_i = gl.zeros([HALF], gl.float32, layout=row_s)
            p_op = gl.zeros([HALF, BLOCK_N], dtype, layout=p_layout)
            if n > 0:  # tile 0: scores and the first softmax step, no P V in flight yet
                st = kc % STAGES
                mbarrier.wait(k_ready.index(st), (kc // STAGES) & 1)
                s = warpgroup_mma(qh, k_smem.index(st).permute((1, 0)), s_zero, use_acc=False, is_async=True)
                s = warpgroup_mma_wait(0, deps=[s])
                mbarrier.arrive(k_empty.index(st), count=1)
                k0 = _tile_start(0, lo_t, n_part, part_ptr, full_ptr, BLOCK_SPARSE, SPARSE_KV, BLOCK_N)
                s2 = _scores(s, 0, k0, mh, b, h, sm_scale, qk_scale, rel2, win_left, win_right, lo_t, flo_t, fhi_t,
                             n_part, st0, st1, st2, st3, mt0, mt1, mt2, mt3, SCORE_FN, MASK_FN, HAS_SCORE_MOD,
                             SCORE_REL, HAS_MASK_MOD, BAND, BLOCK_SPARSE, SPARSE_KV, HALF, BLOCK_N, s_layout)
                p, alpha, m_i, l_i = _softmax(s2, m_i, l_i)
                if DROPOUT:
                    p = _drop(p, drop_row, drop_q, k0, drop_thresh, BLOCK_N, s_layout)
                p_op = gl.convert_layout(p.to(dtype), p_layout)
            for t in range(1, n):
                g = kc + t
                st = g % STAGES
                ps = (g - 1) % STAGES
                mbarrier.wait(k_ready.index(st), (g // STAGES) & 1)
                mbarrier.wait(v_ready.index(ps), ((g - 1) // STAGES) & 1)
                s = warpgroup_mma(qh, k_smem.index(st).permute((1, 0)), s_zero, use_acc=False, is_async=True)
                acc = warpgroup_mma(p_op, v_smem.index(ps), acc, is_async=True)
                s = warpgroup_mma_wait(1, deps=[s])  # S_t done, P V may still run
                mbarrier.arrive(k_empty.index(st), count=1)
                kt = _tile_start(t, lo_t, n_part, part_ptr, full_ptr, BLOCK_SPARSE, SPARSE_KV, BLOCK_N)
                s2 = _scores(s, t, kt, mh, b, h, sm_scale, qk_scale, rel2, win_left, win_right, lo_t, flo_t, fhi_t,
                             n_part, st0, st1, st2, st3, mt0, mt1, mt2, mt3, SCORE_FN, MASK_FN, HAS_SCORE_MOD,
                             SCORE_REL, HAS_MASK_MOD, BAND, BLOCK_SPARSE, SPARSE_KV, HALF, BLOCK_N, s_layout)
                p, alpha, m_i, l_i = _softmax(s2, m_i, l_i)
                if DROPOUT:
                    p = _drop(p, drop_row, drop_q, kt, drop_thresh, BLOCK_N, s_layout)
                acc = warpgroup_mma_wait(0, deps=[acc])
                mbarrier.arrive(v_empty.index(ps), count=1)
                acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
                p_op = gl.convert_layout(p.to(dtype), p_layout)
            if n > 0:
                g = kc + n - 1
                ps = g % STAGES
                mbarrier.wait(v_ready.index(ps), (g // STAGES) & 1)
                acc = warpgroup_mma(p_op, v_smem.index(ps), acc, is_async=True)
                acc = warpgroup_mma_wait(0, deps=[acc])
                mbarrier.arrive(v_empty.index(ps), count=1)
            # Normalise once; rows that saw nothing give 0 and the masked-row LSE. O goes out through
            # this half's Q buffer (its last product is done), which the loader refills once the copy
            # engine has read it.
            seen = l_i > 0.0
            l_safe = gl.where(seen, l_i, 1.0)
            l_out = l_safe
            if DROPOUT:  # the kept weights scaled by 1 / (1 - p); the LSE is the one before dropout
                l_out = l_safe / drop_scale
            out = acc / gl.expand_dims(gl.convert_layout(l_out, row_o), 1)
            lse = (m_i + gl.log2(l_safe)) * 0.6931471805599453
            if SCORE_REL:  # the bias's row part: -slope * (q - mh) + c
                lse += rel_c - rel_slope * gl.arange(0, HALF, layout=row_s).to(gl.float32)
            lse = gl.where(seen, lse, -1.0e30)
            offs = (mh + gl.arange(0, HALF, layout=row_s)).to(gl.int64)
            gl.store(lse_ptr + lse_off + offs * stride_ls, lse)
            qh.store(out.to(dtype))
            fence_async_shared()
            _tma_store(o_desc, [o_row + half * HALF, o_col], qh)
            tma.store_wait(0)
            mbarrier.arrive(q_empty.index(qb * 2 + half), count=1)
            kc += n
            i += 1
            qb = i % Q_BUFS
            mbarrier.wait(q_bar.index(qb * 2 + half), (i // Q_BUFS) & 1)
            w = gl.max(slot_smem.index(i % 2).load(slot_layout), 0)

    # One entry point per consumer: the half is a compile-time constant of each partition, and with
    # the older warp_specialize the worker partitions (consumer 1 and the loader) share one argument
    # tuple, so it cannot travel as an argument.
    @gluon.jit
    def _consumer_0(a, d, st0, st1, st2, st3, mt0, mt1, mt2, mt3, SCORE_FN: gl.constexpr, MASK_FN: gl.constexpr,
                    HAS_SCORE_MOD: gl.constexpr, SCORE_REL: gl.constexpr, HAS_MASK_MOD: gl.constexpr,
                    BAND: gl.constexpr, REVERSE: gl.constexpr, BLOCK_SPARSE: gl.constexpr, SPARSE_Q: gl.constexpr,
                    SPARSE_KV: gl.constexpr, HALF: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr,
                    STAGES: gl.constexpr, Q_BUFS: gl.constexpr, DROPOUT: gl.constexpr):
        _consume(0, a, d, st0, st1, st2, st3, mt0, mt1, mt2, mt3, SCORE_FN, MASK_FN, HAS_SCORE_MOD, SCORE_REL,
                 HAS_MASK_MOD,
                 BAND, REVERSE, BLOCK_SPARSE, SPARSE_Q, SPARSE_KV, HALF, BLOCK_N, HEAD_D, STAGES, Q_BUFS, DROPOUT)

    @gluon.jit
    def _consumer_1(a, d, st0, st1, st2, st3, mt0, mt1, mt2, mt3, SCORE_FN: gl.constexpr, MASK_FN: gl.constexpr,
                    HAS_SCORE_MOD: gl.constexpr, SCORE_REL: gl.constexpr, HAS_MASK_MOD: gl.constexpr,
                    BAND: gl.constexpr, REVERSE: gl.constexpr, BLOCK_SPARSE: gl.constexpr, SPARSE_Q: gl.constexpr,
                    SPARSE_KV: gl.constexpr, HALF: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr,
                    STAGES: gl.constexpr, Q_BUFS: gl.constexpr, DROPOUT: gl.constexpr):
        _consume(1, a, d, st0, st1, st2, st3, mt0, mt1, mt2, mt3, SCORE_FN, MASK_FN, HAS_SCORE_MOD, SCORE_REL,
                 HAS_MASK_MOD,
                 BAND, REVERSE, BLOCK_SPARSE, SPARSE_Q, SPARSE_KV, HALF, BLOCK_N, HEAD_D, STAGES, Q_BUFS, DROPOUT)

    @gluon.jit
    def _hopper_fwd_kernel(
        q_desc, k_desc, v_desc, o_desc,  # 2-D descriptors: head (b, h) rows at (b*rb + h*rh) * S, cols b*cb + h*ch
        lse_ptr,  # (B, Hq, Sq) fp32
        sched_ptr,  # int32 zero: the counter that hands out work items after each program's first
        seq_q, seq_kv, group, n_heads, n_items, sm_scale, win_left, win_right,
        seed_ptr, drop_thresh, drop_scale,  # dropout (DROPOUT): the () int64 seed, the threshold, 1 / (1 - p)
        q_rb, q_rh, q_cb, q_ch, k_rb, k_rh, k_cb, k_ch, o_rb, o_rh, o_cb, o_ch,
        stride_lb, stride_lh, stride_ls,
        kvn_ptr, kvi_ptr, fkvn_ptr, fkvi_ptr,  # block-mask lists (BLOCK_SPARSE), as in kernels/attention.py
        stride_nb, stride_nh, stride_nm, stride_ib, stride_ih, stride_im,
        st0, st1, st2, st3, mt0, mt1, mt2, mt3,  # the mods' captured tensors
        SCORE_FN: gl.constexpr, MASK_FN: gl.constexpr, HAS_SCORE_MOD: gl.constexpr, SCORE_REL: gl.constexpr,
        HAS_MASK_MOD: gl.constexpr, BAND: gl.constexpr, REVERSE: gl.constexpr, BLOCK_SPARSE: gl.constexpr,
        SPARSE_Q: gl.constexpr, SPARSE_KV: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr,
        STAGES: gl.constexpr, Q_BUFS: gl.constexpr, CONSUMER_REGS: gl.constexpr, NEW_WS: gl.constexpr,
        DROPOUT: gl.constexpr,
    ):
        HALF: gl.constexpr = BLOCK_M // 2
        dtype: gl.constexpr = q_desc.dtype
        q_smem = gl.allocate_shared_memory(dtype, [Q_BUFS * 2, HALF, HEAD_D], q_desc.layout)  # [buffer * 2 + half]
        k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_D], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_D], v_desc.layout)
        slot_smem = gl.allocate_shared_memory(gl.int32, [2, 32], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        q_bar = gl.allocate_shared_memory(gl.int64, [Q_BUFS * 2, 1], mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [Q_BUFS * 2, 1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(Q_BUFS * 2):
            mbarrier.init(q_bar.index(i), count=1)
            mbarrier.init(q_empty.index(i), count=1)  # the consumer of that half
        for i in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(k_empty.index(i), count=2)  # both consumers release each buffer
            mbarrier.init(v_empty.index(i), count=2)
        a = (q_desc, k_desc, v_desc, o_desc, lse_ptr, q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, v_ready,
             k_empty, v_empty, slot_smem)
        d = (seq_q, seq_kv, group, n_heads, n_items, sched_ptr, q_rb, q_rh, q_cb, q_ch, k_rb, k_rh, k_cb, k_ch,
             o_rb, o_rh, o_cb, o_ch, stride_lb, stride_lh, stride_ls, kvn_ptr, kvi_ptr, fkvn_ptr, fkvi_ptr,
             stride_nb, stride_nh, stride_nm, stride_ib, stride_ih, stride_im, sm_scale, win_left, win_right,
             seed_ptr, drop_thresh, drop_scale)
        if NEW_WS:
            gl.warp_specialize([
                (_consumer_0, (a, d, st0, st1, st2, st3, mt0, mt1, mt2, mt3, SCORE_FN, MASK_FN, HAS_SCORE_MOD,
                               SCORE_REL, HAS_MASK_MOD, BAND, REVERSE, BLOCK_SPARSE, SPARSE_Q, SPARSE_KV, HALF,
                               BLOCK_N, HEAD_D, STAGES, Q_BUFS, DROPOUT)),
                (_consumer_1, (a, d, st0, st1, st2, st3, mt0, mt1, mt2, mt3, SCORE_FN, MASK_FN, HAS_SCORE_MOD,
                               SCORE_REL, HAS_MASK_MOD, BAND, REVERSE, BLOCK_SPARSE, SPARSE_Q, SPARSE_KV, HALF,
                               BLOCK_N, HEAD_D, STAGES, Q_BUFS, DROPOUT)),
                (_loader, (a, d, st0, st1, st2, st3, mt0, mt1, mt2, mt3, SCORE_FN, MASK_FN, HAS_SCORE_MOD,
                           SCORE_REL, HAS_MASK_MOD, BAND, REVERSE, BLOCK_SPARSE, SPARSE_Q, SPARSE_KV, HALF,
                           BLOCK_N, HEAD_D, STAGES, Q_BUFS, DROPOUT)),
            ], [4, 1], [CONSUMER_REGS, 24])
        else:
            gl.warp_specialize(
                (a, d, st0, st1, st2, st3, mt0, mt1, mt2, mt3, SCORE_FN, MASK_FN, HAS_SCORE_MOD, SCORE_REL,
                 HAS_MASK_MOD, BAND, REVERSE, BLOCK_SPARSE, SPARSE_Q, SPARSE_KV, HALF, BLOCK_N, HEAD_D, STAGES,
                 Q_BUFS, DROPOUT), _consumer_0,
                (a, d, st0, st1, st2, st3, mt0, mt1, mt2, mt3, SCORE_FN, MASK_FN, HAS_SCORE_MOD, SCORE_REL,
                 HAS_MASK_MOD, BAND, REVERSE, BLOCK_SPARSE, SPARSE_Q, SPARSE_KV, HALF, BLOCK_N, HEAD_D, STAGES,
                 Q_BUFS, DROPOUT),
                [_consumer_1, _loader], [4, 1], [CONSUMER_REGS, 24])


class _View2d(NamedTuple):
    desc: Any
    rb: int
    rh: int
    cb: int
    ch: int


def head_placement(t: torch.Tensor, so: int) -> tuple[list[tuple[int, int]], int, int] | None:
    """Where each head (b, h) of a (B, H, S, D) view starts when its rows are addressed as
    ``(outer, row, column)`` with outer stride ``so`` and the row stride: per dim B and H an (outer,
    column) coefficient (an outer index if its stride is a multiple of ``so``, else a column offset
    inside a row), the row width the heads span, and the outer count; None where a dim is neither
    or the heads of one row would run into the next row. Shared by the portable kernels' 3-D
    descriptors (``attention._tma_view``) and the Hopper kernel's 2-D ones."""
    B, H, S, D = t.shape
    sb, sh, ss, _ = t.stride()
    coef = []
    for n, st in ((B, sb), (H, sh)):
        if n == 1:
            coef.append((0, 0))
        elif st >= ss:
            if st % so:
                return None
            coef.append((st // so, 0))
        else:
            coef.append((0, st))
    width = sum((n - 1) * c for n, (_, c) in zip((B, H), coef)) + D
    if width > ss and S > 1:
        return None
    return coef, width, 1 + sum((n - 1) * o for n, (o, _) in zip((B, H), coef))


@functools.lru_cache(maxsize=None)
def _smem_layout(rows: int, d: int, dtype: torch.dtype) -> Any:
    # the shared-memory layout of a (rows, d) tile, built once per shape (it is on every launch's path)
    return gl.NVMMASharedLayout.get_default_for([rows, d], gl.bfloat16 if dtype == torch.bfloat16 else gl.float16)


def _view2d(t: torch.Tensor, rows: int) -> _View2d | None:
    """A (B, H, S, D) view as one 2-D descriptor [outer * S, width] with (rows, D) tiles: head
    (b, h) starts at row ``(b * rb + h * rh) * S`` and column ``b * cb + h * ch``. None where the
    view has no such form: a non-unit last stride, a head dim that is not a power of two >= 16,
    unaligned rows, S not a multiple of ``rows``, a batch or head stride that is neither a whole
    number of sequences nor an offset inside a row, or rows of one head running into the next."""
    _, _, S, D = t.shape
    _, _, ss, sd = t.stride()
    es = t.element_size()
    if sd != 1 or D < 16 or D & (D - 1) or ss < D or (ss * es) % 16 or t.data_ptr() % 16 or S % rows:
        return None
    placed = head_placement(t, ss * S)  # outer index unit: a whole sequence of rows
    if placed is None:
        return None
    coef, width, count = placed
    desc = TensorDescriptor(t, [count * S, width], [ss, 1], [rows, D], _smem_layout(rows, D, t.dtype))
    return _View2d(desc, coef[0][0], coef[1][0], coef[0][1], coef[1][1])


def hopper_supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, varlen: bool, descale: bool,
                     sparse_q: int | None, sparse_kv: int | None, short_rows: bool = False,
                     mods: bool = False, traced: bool = False) -> bool:
    """Whether :func:`hopper_fwd` can run this problem and should (shape, feature and measured-speed
    checks; no launch). ``short_rows``: the rows see at most ``attention.SHORT_ROW_KEYS`` keys on
    average; ``mods``: a score_mod or mask_mod is in use; ``traced``: asked while ``torch.compile``
    traces a call that stays an opaque op (the launcher itself never runs the kernel while traced)."""
    if not AVAILABLE or varlen or descale or (torch.compiler.is_compiling() and not traced):
        return False
    if not q.is_cuda or torch.cuda.get_device_capability(q.device)[0] != 9:
        return False
    if q.dtype not in (torch.bfloat16, torch.float16) or q.dim() != 4:
        return False
    d = q.shape[3]
    if d not in (64, 128, 256) or v.shape[3] != d:
        return False
    cfg = hopper_config(d)
    if q.shape[2] % BLOCK_M or k.shape[2] % cfg.block_n or min(q.shape[2], k.shape[2]) == 0:
        return False
    if sparse_q is not None and (sparse_q % BLOCK_M or sparse_kv % cfg.block_n):
        return False
    # d = 64: only long rows without mods or block masks (H100, S=8192, forward ms against the
    # portable kernel: no mask 19.8 / 21.5, causal 10.4 / 11.1; a window of 1024 3.58 / 3.33, document
    # block mask 4.25 / 3.77, soft-capping 32.1 / 20.7: the softmax tile, not the products, bounds those)
    return d > 64 or not (short_rows or mods or sparse_q is not None)


def hopper_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, *,
               sm_scale: float, window: tuple[int | None, int | None], score_fn: Any, mask_fn: Any,
               has_score_mod: bool, has_mask_mod: bool, score_buffers: tuple[Any, ...],
               mask_buffers: tuple[Any, ...], sparse: tuple[Any, ...] | None, sparse_q: int, sparse_kv: int,
               score_rel: bool = False, dropout: tuple[torch.Tensor, int, float] | None = None) -> bool:
    """Launch the Hopper forward into ``out`` and ``lse`` if every tensor has a descriptor view;
    return whether it ran. ``sparse``: the portable kernel's 10 block-mask arguments, or None. The
    persistent grid takes one program per SM and a zeroed int32 work counter per launch.
    ``score_rel``: the score mod is a relative bias ``score + slope * (kv - q) + c`` with slope and c
    per (b, h) (``codegen.relative_bias``), added per key column, its row part folded into the LSE.
    ``dropout``: the () int64 seed tensor, the threshold of ``kernels/_dropout.py`` and 1 / (1 - p),
    or None."""
    cfg = hopper_config(q.shape[3])
    views = (_view2d(q, BLOCK_M // 2), _view2d(k, cfg.block_n), _view2d(v, cfg.block_n),
             _view2d(out, BLOCK_M // 2))
    if any(x is None for x in views) or views[1][1:] != views[2][1:]:
        return False
    qv, kv, vv, ov = views
    B, H, S, D = q.shape
    left, right = window
    # the block-mask lists reach the partitions, which take no None: the placeholder is never read
    sp = sparse if sparse is not None else (lse, lse, lse, lse, 0, 0, 0, 0, 0, 0)
    n_items = B * H * (S // BLOCK_M)
    sched = torch.zeros(1, dtype=torch.int32, device=q.device)
    # the persistent grid: one program per SM (each takes the whole SM's shared memory)
    _hopper_fwd_kernel[(min(n_items, num_sms(q.device)),)](
        qv.desc, kv.desc, vv.desc, ov.desc, lse, sched,
        S, k.shape[2], H // k.shape[1], H, n_items, float(sm_scale),
        _NO_BOUND if left is None else int(left), _NO_BOUND if right is None else int(right),
        *(dropout if dropout is not None else (sched, 0, 1.0)),
        *qv[1:], *kv[1:], *ov[1:], *lse.stride(), *sp,
        # slots a mod does not use get a placeholder pointer (partitions take no None arguments)
        *(lse if t is None else t for t in (*score_buffers, *mask_buffers)),
        SCORE_FN=score_fn, MASK_FN=mask_fn, HAS_SCORE_MOD=has_score_mod, SCORE_REL=has_score_mod and score_rel,
        HAS_MASK_MOD=has_mask_mod, BAND=left is not None or right is not None, REVERSE=right is not None,
        BLOCK_SPARSE=sparse is not None,
        SPARSE_Q=sparse_q, SPARSE_KV=sparse_kv, BLOCK_M=BLOCK_M, BLOCK_N=cfg.block_n, HEAD_D=D,
        STAGES=cfg.stages, Q_BUFS=cfg.q_bufs, CONSUMER_REGS=240, NEW_WS=_NEW_WS,
        DROPOUT=dropout is not None,
        num_warps=4, maxnreg=168,
    )
    return True

