"""Attention backward for Hopper (sm_90) in Gluon: dK, dV and dQ in one warp-specialised kernel.

The same math as the backward of ``kernels/attention.py`` (``delta`` from its preprocess kernel,
``p = 2^(s L - lse L)``, ``ds = p (dp - delta)``, ``score_mod``'s derivative), with FlashAttention-3's
five products per tile pair instead of the portable kernels' seven, and dQ summed in float32 by TMA
reductions (so not bitwise deterministic: ``deterministic=True`` keeps the portable kernels)::

    program: 128 keys of one kv head (two halves of 64, one per consumer warp group), every query
             head of its GQA group, every 64-row query tile that sees the keys
    loader (1 warp)        K, V halves once; per query tile Q_m and dO_m into a ring of STAGES
                           buffers, each after its "empty" barrier says both consumers are done,
                           then the tile's lse and delta rows (the Q barrier's second arrival)
    consumer c (4 warps,   S^T = K_c Q_m^T and dP^T = V_c dO_m^T (async, both in flight);
      keys c*64..c*64+63)  P^T = 2^(S^T L - lse L) while dP^T runs; dV_c += P^T dO_m (async);
                           dS^T = P^T (dP^T - delta); dK_c += dS^T Q_m (async); dS^T to shared
                           memory; dQ_m += dS K (async, A read transposed); release Q_m/dO_m;
                           dQ_m * scale to shared memory, added to a float32 buffer by one TMA
                           reduction (cp.reduce.async.bulk.tensor .add), left in flight
    caster (1 warp,        (CAST) the float32 dQ rows of the kv head `ahead` heads before its own,
      24 registers)        this program's share, cast into dq once both consumers of every program
                           of that head have counted themselves off (after their last reduction
                           landed); TMA copies of 16 rows into two buffers, two rows per step. The
                           launcher casts the last `ahead` heads after the kernel
    (with a band)          at the walk's leading and trailing tiles in which no row sees a key of
                           its half (the diagonal's upper half, a window's far edge): zeros as its
                           dS^T, its dQ columns from the other half's dS^T alone, no other product

The transposed products keep every operand in the layout wgmma reads (K-major or MN-major 16-bit
tiles from shared memory, P^T and dS^T from registers). The two consumers split dQ by columns: each
stores its dS^T, they meet on an mbarrier, and each multiplies both halves' dS^T by its d / 2
columns of K, so every tile pair adds 64 x d floats once (half the traffic of each consumer adding
the dQ of its own keys, which measured 35 % slower at d = 128). The reduction leaves through the
copy engine: vector atomics from the consumers' registers measured 35 % slower at d = 128 (the
warps waited for the atomics to read their registers, and the row addresses spilled), and a
reducer warp pair reading the tile back from shared memory for them 15 % slower (it could not keep
up: each read waited out the shared memory's latency). The loader sets its registers down to 24,
the consumers up. The launcher runs it by default wherever it applies: it measured faster than the
portable kernels in every case measured (``hopper_bwd_supported``;
``docs/benchmarks/attention_hopper_h100.md``).

What it covers (``hopper_bwd_supported`` / ``hopper_bwd``; the portable kernels run otherwise): an
sm_90 GPU, 16-bit q/k/v with one head dim D = Dv in {64, 128}, the same descriptor-addressable views
as the Hopper forward, query lengths that are multiples of 64 and key lengths multiples of 128, a
band (also one that a ``mask_mod`` is known to lie in: the causal, sliding-window and causal
document masks, ``_ModSpec.implied_band``; it then bounds the walk and the skipped halves, and only
the mask hides pairs), a ``score_mod`` with its derivative (captured-tensor gradients scatter with
atomics, as in the portable kernel; the derivative of an additive mod with no table that learns, 1,
is not called), a
``mask_mod``, block-mask lists (blocks of a multiple of 64 query rows and 128 keys) and dropout (the
forward's mask, hashed once per weight: dV from the kept weights, scaled by 1 / (1 - p) once at the
end, and dP^T through the mask and the same scale before dS^T); no packed sequences or
``deterministic=True``.

References: Shah et al., "FlashAttention-3" (2024), section 3 and its backward (dQ accumulated in
float32 through TMA reductions from the dK/dV kernel); Dao, "FlashAttention-2" (2023), algorithm 2.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from ._accumulate import store_accumulated
from ._attention_hopper import AVAILABLE, _view2d
from ._dropout import _dropout_draws, _dropout_key, _dropout_pair_row, _kept
from ._library import cdiv, num_sms

if AVAILABLE:
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

    from ._attention_hopper import (_NEW_WS, _relative_bias, _thread_barrier, _tile_range, _tile_start,
                                    _tma_load)
    try:  # TMA reductions into global memory (Triton after 3.6)
        from triton.experimental.gluon.language.nvidia.hopper.tma import async_atomic_add as _tma_add
    except ImportError:  # Triton 3.6: the builder has the operation, the language no wrapper
        from triton._C.libtriton import ir as _ir
        from triton.language.core import builtin as _builtin

        @_builtin
        def _tma_add(tensor_desc, coord, src, _semantic=None):
            coord = _semantic._convert_to_ir_values(coord, require_i64=False)
            _semantic.builder.create_async_tma_reduce(_ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord,
                                                      src.handle)

__all__ = ["BWD_BLOCK_M", "BWD_BLOCK_N", "BWD_STAGES", "band_and", "hopper_bwd", "hopper_bwd_supported"]

BWD_BLOCK_M = 64  # query rows per step
BWD_BLOCK_N = 128  # keys per program: two consumer warpgroups of 64
BWD_STAGES = 2  # Q / dO ring depth

# How the backward calls a score_mod (constexpr SCORE_MODE): none; on the natural-units score with its
# derivative; the same with the derivative skipped (an additive mod, derivative 1, with no captured
# tensor that needs a gradient: the code generator's derivative is then the identity); not at all for
# such a mod that is a relative bias slope * (kv - q) + c (codegen.relative_bias): the key part
# slope * (kv - n0) is added per key row, the query part slope * (q - n0) - c goes into the tile's
# LSE row with the loader (the mod is called twice per head, for c and the slope).
SCORE_MODE_NONE, SCORE_MODE_NATURAL, SCORE_MODE_NO_GRAD, SCORE_MODE_RELATIVE = 0, 1, 2, 3
_NO_BOUND = 1 << 30  # kernels/attention.NO_BOUND


if AVAILABLE:

    @gluon.jit
    def _relative_bias2(SCORE_FN: gl.constexpr, sm_scale, b, h, st0, st1, st2, st3):
        # a relative bias's slope and constant in base-2 units
        slope, c = _relative_bias(SCORE_FN, sm_scale, b, h, st0, st1, st2, st3)
        return slope * 1.4426950408889634, c * 1.4426950408889634

    @gluon.jit
    def _draws_pairs(drop_key, m0, key0, ROWS: gl.constexpr, COLS: gl.constexpr, layout: gl.constexpr):
        # The dropout draws of a transposed tile (keys key0.. by queries m0.., m0 a multiple of 16) in
        # `layout`, the wgmma accumulator layout (kernels/_dropout.py). Each hash is computed once, on
        # a (keys, query pairs) tile whose layout gives a thread the pairs of its own columns: query
        # 16 G + 8 e + c is half e of pair 8 G + c, and in both layouts a thread holds c = 2 t, 2 t + 1.
        gl.static_assert(COLS % 16 == 0, "the query tile must hold whole groups of 16")
        pair_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                              instr_shape=[16, COLS // 2, 16])
        keys = gl.expand_dims(key0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, pair_layout)), 1)
        qp = gl.expand_dims((m0 >> 1) + gl.arange(0, COLS // 2, layout=gl.SliceLayout(0, pair_layout)), 0)
        lo, hi = _dropout_draws(_dropout_pair_row(drop_key, qp), keys)
        u = gl.reshape(gl.join(lo, hi), [ROWS, COLS // 16, 8, 2])  # (key, G, c, e)
        u = gl.reshape(gl.permute(u, [0, 1, 3, 2]), [ROWS, COLS])  # (key, 16 G + 8 e + c)
        return gl.convert_layout(u, layout)

    @gluon.jit
    def _bulk_wait_all(x):
        # Every TMA reduction this thread issued complete, its sums written to global memory
        # (cp.async.bulk.wait_group 0; tma.store_wait's .read form waits only until the shared memory
        # is read), and ordered before this thread's later generic-proxy accesses. `x`: any int32
        # scalar (the asm takes an operand).
        gl.inline_asm_elementwise("cp.async.bulk.wait_group 0;\n\tfence.proxy.async;\n\tmov.b32 $0, $1;",
                                  "=r,r", [x], dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _nap(x):
        # a pause of about 256 ns between polls (nanosleep). `x`: any int32 scalar
        gl.inline_asm_elementwise("nanosleep.u32 256;\n\tmov.b32 $0, $1;", "=r,r", [x], dtype=gl.int32,
                                  is_pure=False, pack=1)

    @gluon.jit
    def _proxy_fence(x):
        # this thread's generic-proxy accesses ordered before its later TMA copies. `x`: any int32 scalar
        gl.inline_asm_elementwise("fence.proxy.async;\n\tmov.b32 $0, $1;", "=r,r", [x], dtype=gl.int32,
                                  is_pure=False, pack=1)

    @gluon.jit
    def _bwd_caster(a, d, dk_ptr, dv_ptr, dk_off, dv_off, stride_dks, stride_dvs,
                    st0, st1, st2, st3, mt0, mt1, mt2, mt3, g0, g1, g2, g3,
                    SCORE_FN: gl.constexpr, GRAD_FN: gl.constexpr, MASK_FN: gl.constexpr,
                    SCORE_MODE: gl.constexpr, HAS_MASK_MOD: gl.constexpr, BAND: gl.constexpr,
                    BLOCK_SPARSE: gl.constexpr, SPARSE_Q: gl.constexpr, SPARSE_KV: gl.constexpr,
                    BLOCK_M: gl.constexpr, HALF: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr,
                    DROPOUT: gl.constexpr, CAST: gl.constexpr, CAST_ROWS: gl.constexpr):
        # One warp beside the loader: while this program's consumers compute, it casts into dq this
        # program's share of the float32 dQ buffer of the kv head `ahead` heads before its own (all
        # query heads of that head's group), once both consumers of every program of that head have
        # counted themselves off (their reductions landed). Programs start in grid order, so the awaited
        # ones are running or done; the launcher casts the last `ahead` heads after the kernel.
        (q_desc, k_desc, v_desc, do_desc, k_smem, v_smem, q_smem, do_smem, kv_bar, q_ready, do_ready, empty,
         ds_smem, lse_smem, dl_smem, ds_bar, dq_desc, dq_smem, ca) = a
        (b, hk, n0, group, seq_q, k_row, k_col, q_rb, q_rh, q_cb, q_ch, g_rb, g_rh, g_cb, g_ch,
         lse_ptr, delta_ptr, stride_lb, stride_lh, stride_ls, n_heads,
         qn_ptr, qi_ptr, fqn_ptr, fqi_ptr, stride_nb, stride_nh, stride_nm, stride_ib, stride_ih, stride_im,
         sm_scale, win_left, win_right, seed_ptr, drop_thresh, drop_scale, cd) = d
        if CAST:
            cast_desc, cast_smem, cast_bar = ca
            cnt_ptr, dq_ptr, stride_dqb, stride_dqh, stride_dqs, ahead, seq_kv = cd
            n_kv = n_heads // group  # per batch entry
            j = b * n_kv + hk
            jj = j - ahead  # the head cast here
            progs = seq_kv // (2 * HALF)  # programs per head
            rows = group * seq_q  # its buffer rows, from row jj * rows
            per = (rows + progs - 1) // progs
            per = (per + CAST_ROWS - 1) // CAST_ROWS * CAST_ROWS
            r_lo = (n0 // (2 * HALF)) * per
            r_hi = gl.minimum(r_lo + per, rows)
            pair: gl.constexpr = gl.BlockedLayout([1, HEAD_D // 16], [2, 16], [1, 1], [1, 0])
            if (jj >= 0) & (r_lo < r_hi):
                seen = gl.atomic_add(cnt_ptr + jj, 0, sem="relaxed", scope="gpu")
                while seen < 2 * progs:
                    _nap(seen)
                    seen = gl.atomic_add(cnt_ptr + jj, 0, sem="relaxed", scope="gpu")
                seen = gl.atomic_add(cnt_ptr + jj, 0, sem="acquire", scope="gpu")
                _proxy_fence(seen)
                bj = jj // n_kv
                h0 = (jj - bj * n_kv) * group
                # two rows at a time, HEAD_D / 16 floats per thread (the warp holds 24 registers)
                offs = (gl.expand_dims(gl.arange(0, 2, layout=gl.SliceLayout(1, pair)), 1).to(gl.int64) * stride_dqs
                        + gl.expand_dims(gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, pair)), 0))
                n_chunks = (r_hi - r_lo) // CAST_ROWS
                mbarrier.expect(cast_bar.index(0), cast_desc.block_type.nbytes)
                _tma_load(cast_desc, [jj * rows + r_lo, 0], cast_bar.index(0), cast_smem.index(0))
                for i in range(0, n_chunks):
                    if i + 1 < n_chunks:  # the next chunk's copy in flight while this one is cast
                        nb = (i + 1) % 2
                        fence_async_shared()  # the buffer's reads two chunks ago before the copy's writes
                        mbarrier.expect(cast_bar.index(nb), cast_desc.block_type.nbytes)
                        _tma_load(cast_desc, [jj * rows + r_lo + (i + 1) * CAST_ROWS, 0], cast_bar.index(nb),
                                  cast_smem.index(nb))
                    mbarrier.wait(cast_bar.index(i % 2), (i // 2) & 1)
                    r = r_lo + i * CAST_ROWS  # a chunk lies in one query head: seq_q % CAST_ROWS == 0
                    g = r // seq_q
                    base = (dq_ptr + bj.to(gl.int64) * stride_dqb + (h0 + g).to(gl.int64) * stride_dqh
                            + (r - g * seq_q).to(gl.int64) * stride_dqs)
                    chunk = cast_smem.index(i % 2)
                    for k in gl.static_range(CAST_ROWS // 2):
                        x = chunk.slice(2 * k, 2, dim=0).load(pair)
                        gl.store(base + (2 * k) * stride_dqs + offs, x.to(dq_ptr.dtype.element_ty))

    @gluon.jit
    def _bwd_loader(a, d, dk_ptr, dv_ptr, dk_off, dv_off, stride_dks, stride_dvs,
                    st0, st1, st2, st3, mt0, mt1, mt2, mt3, g0, g1, g2, g3,
                    SCORE_FN: gl.constexpr, GRAD_FN: gl.constexpr, MASK_FN: gl.constexpr,
                    SCORE_MODE: gl.constexpr, HAS_MASK_MOD: gl.constexpr, BAND: gl.constexpr,
                    BLOCK_SPARSE: gl.constexpr, SPARSE_Q: gl.constexpr, SPARSE_KV: gl.constexpr,
                    BLOCK_M: gl.constexpr, HALF: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr,
                    DROPOUT: gl.constexpr, CAST: gl.constexpr, CAST_ROWS: gl.constexpr):
        (q_desc, k_desc, v_desc, do_desc, k_smem, v_smem, q_smem, do_smem, kv_bar, q_ready, do_ready, empty,
         ds_smem, lse_smem, dl_smem, ds_bar, dq_desc, dq_smem, ca) = a
        (b, hk, n0, group, seq_q, k_row, k_col, q_rb, q_rh, q_cb, q_ch, g_rb, g_rh, g_cb, g_ch,
         lse_ptr, delta_ptr, stride_lb, stride_lh, stride_ls, n_heads,
         qn_ptr, qi_ptr, fqn_ptr, fqi_ptr, stride_nb, stride_nh, stride_nm, stride_ib, stride_ih, stride_im,
         sm_scale, win_left, win_right, seed_ptr, drop_thresh, drop_scale, cd) = d
        for c in gl.static_range(2):
            mbarrier.expect(kv_bar.index(c), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
            _tma_load(k_desc, [k_row + c * HALF, k_col], kv_bar.index(c), k_smem.index(c))
            _tma_load(v_desc, [k_row + c * HALF, k_col], kv_bar.index(c), v_smem.index(c))
        r_off = gl.arange(0, BLOCK_M, layout=gl.BlockedLayout([2], [32], [1], [0]))
        it = 0
        for g in range(0, group):
            h = hk * group + g
            n, lo_t, flo_t, fhi_t, n_part, part_ptr, full_ptr = _tile_range(
                b, h, n0, seq_q, win_right, win_left, qn_ptr, qi_ptr, fqn_ptr, fqi_ptr,
                stride_nb, stride_nh, stride_nm, stride_ib, stride_ih, stride_im,
                BAND, BLOCK_SPARSE, SPARSE_KV, SPARSE_Q, 2 * HALF, BLOCK_M)
            q_row0 = (b * q_rb + h * q_rh) * seq_q
            g_row0 = (b * g_rb + h * g_rh) * seq_q
            q_col = b * q_cb + h * q_ch
            g_col = b * g_cb + h * g_ch
            l_off = b.to(gl.int64) * stride_lb + h.to(gl.int64) * stride_lh
            rel2 = 0.0
            c2 = 0.0
            if SCORE_MODE == 3:  # SCORE_MODE_RELATIVE
                rel2, c2 = _relative_bias2(SCORE_FN, sm_scale, b, h, st0, st1, st2, st3)
            for t in range(0, n):
                m0 = _tile_start(t, lo_t, n_part, part_ptr, full_ptr, BLOCK_SPARSE, SPARSE_Q, BLOCK_M)
                st = it % STAGES
                mbarrier.wait(empty.index(st), ((it // STAGES) & 1) ^ 1)  # a new barrier passes parity 1
                # the copies first, so that they are in flight while the rows below load
                mbarrier.expect(q_ready.index(st), q_desc.block_type.nbytes)
                _tma_load(q_desc, [q_row0 + m0, q_col], q_ready.index(st), q_smem.index(st))
                mbarrier.expect(do_ready.index(st), do_desc.block_type.nbytes)
                _tma_load(do_desc, [g_row0 + m0, g_col], do_ready.index(st), do_smem.index(st))
                # lse (base 2) and delta of the tile's rows, stored by the whole warp before its
                # second arrival on the Q barrier (the first came with the copy) publishes them
                rows_l = (m0 + r_off).to(gl.int64) * stride_ls
                lse2 = gl.load(lse_ptr + l_off + rows_l) * 1.4426950408889634
                if SCORE_MODE == 3:  # the bias's query part, slope * (q - n0) - c (exact integer offsets)
                    lse2 += ((m0 - n0) + r_off).to(gl.float32) * rel2 - c2
                lse_smem.index(st).store(lse2)
                dl_smem.index(st).store(gl.load(delta_ptr + l_off + rows_l))
                _thread_barrier()
                mbarrier.arrive(q_ready.index(st), count=1)
                it += 1

    @gluon.jit
    def _half_unseen(t, n, lo_t, key0, win_left, win_right, BLOCK_M: gl.constexpr, HALF: gl.constexpr):
        # whether no row of the dense walk's tile t (its rows from (lo_t + t) * BLOCK_M) sees a key of the
        # half [key0, key0 + HALF): q - kv outside [-win_right, win_left]. t is clamped into the walk,
        # which changes no answer of _unseen_ends; kept because it is the form measured on the GPU
        # (the same sm_90 code as with the clamp inside _tile_start, where it guarded list loads)
        m0 = (lo_t + gl.maximum(gl.minimum(t, n - 1), 0)) * BLOCK_M
        return (m0 - key0 - (HALF - 1) > win_left) | (m0 + (BLOCK_M - 1) - key0 < -win_right)

    @gluon.jit
    def _unseen_ends(n, lo_t, key0, win_left, win_right, BLOCK_M: gl.constexpr, HALF: gl.constexpr):
        # (t0, t1): in the dense walk's tiles [0, t0) and [t1, n) the half sees no row
        t0 = n * 0
        while (t0 < n) & _half_unseen(t0, n, lo_t, key0, win_left, win_right, BLOCK_M, HALF):
            t0 += 1
        t1 = n
        while (t1 > t0) & _half_unseen(t1 - 1, n, lo_t, key0, win_left, win_right, BLOCK_M, HALF):
            t1 -= 1
        return t0, t1

    @gluon.jit
    def _bwd_unseen_step(c: gl.constexpr, a, b, h, n_heads, seq_q, m0, it, q_zero, sm_scale, BLOCK_M: gl.constexpr,
                         HALF: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr, s_layout: gl.constexpr):
        # A tile step in which no row sees a key of consumer c's half: no products of its own. Its dS^T
        # half is zeros for the other consumer's dQ columns, its own dQ columns take only the other
        # half's dS^T, and the ring's, the dS barrier's and the reduction's turns run as in a full step.
        (q_desc, k_desc, v_desc, do_desc, k_smem, v_smem, q_smem, do_smem, kv_bar, q_ready, do_ready, empty,
         ds_smem, lse_smem, dl_smem, ds_bar, dq_desc, dq_smem, ca) = a
        DQ_COLS: gl.constexpr = HEAD_D // 2
        st = it % STAGES
        ph = (it // STAGES) & 1
        buf = it % 2
        mbarrier.wait(q_ready.index(st), ph)
        mbarrier.wait(do_ready.index(st), ph)
        ds_smem.index(buf * 2 + c).store(gl.zeros([HALF, BLOCK_M], q_desc.dtype, layout=s_layout))
        fence_async_shared()
        _thread_barrier()
        mbarrier.arrive(ds_bar.index(buf), count=1)
        mbarrier.wait(ds_bar.index(buf), (it // 2) & 1)
        dq = warpgroup_mma(ds_smem.index(buf * 2 + 1 - c).permute((1, 0)),
                           k_smem.index(1 - c).slice(c * DQ_COLS, DQ_COLS, dim=1), q_zero, use_acc=False,
                           is_async=True)
        dq = warpgroup_mma_wait(0, deps=[dq])
        mbarrier.arrive(empty.index(st), count=1)
        tma.store_wait(0)
        dq_smem.index(c).store(dq * sm_scale)
        fence_async_shared()
        _tma_add(dq_desc, [(b * n_heads + h) * seq_q + m0, c * DQ_COLS], dq_smem.index(c))

    @gluon.jit
    def _bwd_consume(c: gl.constexpr, a, d, st0, st1, st2, st3, mt0, mt1, mt2, mt3, g0, g1, g2, g3,
                     SCORE_FN: gl.constexpr, GRAD_FN: gl.constexpr, MASK_FN: gl.constexpr,
                     SCORE_MODE: gl.constexpr, HAS_MASK_MOD: gl.constexpr, BAND: gl.constexpr,
                     BLOCK_SPARSE: gl.constexpr, SPARSE_Q: gl.constexpr, SPARSE_KV: gl.constexpr,
                     BLOCK_M: gl.constexpr, HALF: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr,
                    DROPOUT: gl.constexpr, CAST: gl.constexpr, CAST_ROWS: gl.constexpr):
        (q_desc, k_desc, v_desc, do_desc, k_smem, v_smem, q_smem, do_smem, kv_bar, q_ready, do_ready, empty,
         ds_smem, lse_smem, dl_smem, ds_bar, dq_desc, dq_smem, ca) = a
        (b, hk, n0, group, seq_q, k_row, k_col, q_rb, q_rh, q_cb, q_ch, g_rb, g_rh, g_cb, g_ch,
         lse_ptr, delta_ptr, stride_lb, stride_lh, stride_ls, n_heads,
         qn_ptr, qi_ptr, fqn_ptr, fqi_ptr, stride_nb, stride_nh, stride_nm, stride_ib, stride_ih, stride_im,
         sm_scale, win_left, win_right, seed_ptr, drop_thresh, drop_scale, cd) = d
        dtype: gl.constexpr = q_desc.dtype
        k_width: gl.constexpr = 32 // dtype.primitive_bitwidth
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_M, 16])
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, HEAD_D, 16])
        DQ_COLS: gl.constexpr = HEAD_D // 2  # each consumer's dQ columns
        dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                            instr_shape=[16, DQ_COLS, 16])
        op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=k_width)
        qk_scale = sm_scale * 1.4426950408889634
        SKIP_HALVES: gl.constexpr = BAND and not BLOCK_SPARSE
        kc_ = k_smem.index(c)
        vc_ = v_smem.index(c)
        key0 = n0 + c * HALF
        keys = gl.expand_dims(key0 + gl.arange(0, HALF, layout=gl.SliceLayout(1, s_layout)), 1)
        qoff = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, s_layout))
        col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
        s_zero = gl.zeros([HALF, BLOCK_M], gl.float32, layout=s_layout)
        q_zero = gl.zeros([BLOCK_M, DQ_COLS], gl.float32, layout=dq_layout)
        dk = gl.zeros([HALF, HEAD_D], gl.float32, layout=acc_layout)
        dv = gl.zeros([HALF, HEAD_D], gl.float32, layout=acc_layout)
        mbarrier.wait(kv_bar.index(c), 0)
        it = 0
        for g in range(0, group):
            h = hk * group + g
            n, lo_t, flo_t, fhi_t, n_part, part_ptr, full_ptr = _tile_range(
                b, h, n0, seq_q, win_right, win_left, qn_ptr, qi_ptr, fqn_ptr, fqi_ptr,
                stride_nb, stride_nh, stride_nm, stride_ib, stride_ih, stride_im,
                BAND, BLOCK_SPARSE, SPARSE_KV, SPARSE_Q, 2 * HALF, BLOCK_M)
            if DROPOUT:
                drop_key = _dropout_key(seed_ptr, b, h)
            key2 = 0.0
            if SCORE_MODE == 3:  # the bias's key part, slope * (kv - n0), per key row
                rel2, c2 = _relative_bias2(SCORE_FN, sm_scale, b, h, st0, st1, st2, st3)
                key2 = gl.expand_dims((c * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(1, s_layout)))
                                      .to(gl.float32) * rel2, 1)
            # the walk's leading and trailing tiles in which no row sees a key of this half run without
            # this consumer's products (_bwd_unseen_step); tiles between them take the full step. Not
            # with a block mask: finding them there loads the lists, and on a document mask (one H100,
            # S = 8192) the skipped halves' loops cost the backward more than they saved
            t0 = n * 0
            t1 = n
            if SKIP_HALVES:
                t0, t1 = _unseen_ends(n, lo_t, key0, win_left, win_right, BLOCK_M, HALF)
                for t in range(0, t0):
                    m0 = _tile_start(t, lo_t, n_part, part_ptr, full_ptr, BLOCK_SPARSE, SPARSE_Q, BLOCK_M)
                    _bwd_unseen_step(c, a, b, h, n_heads, seq_q, m0, it, q_zero, sm_scale, BLOCK_M, HALF, HEAD_D,
                                     STAGES, s_layout)
                    it += 1
            for t in range(t0, t1):
                m0 = _tile_start(t, lo_t, n_part, part_ptr, full_ptr, BLOCK_SPARSE, SPARSE_Q, BLOCK_M)
                st = it % STAGES
                ph = (it // STAGES) & 1
                mbarrier.wait(q_ready.index(st), ph)
                sT = warpgroup_mma(kc_, q_smem.index(st).permute((1, 0)), s_zero, use_acc=False, is_async=True)
                mbarrier.wait(do_ready.index(st), ph)
                dpT = warpgroup_mma(vc_, do_smem.index(st).permute((1, 0)), s_zero, use_acc=False, is_async=True)
                sT = warpgroup_mma_wait(1, deps=[sT])
                # P^T: scores in base 2 (score_mod in natural units), invisible entries -inf.
                if SCORE_MODE == 3:
                    s2 = sT * qk_scale + key2
                elif SCORE_MODE:
                    s_nat = sT * sm_scale
                    s2 = SCORE_FN(s_nat, b, h, gl.expand_dims(m0 + qoff, 0), keys, st0, st1, st2, st3)
                    s2 = s2.to(gl.float32) * 1.4426950408889634
                else:
                    s2 = sT * qk_scale
                if BAND == 1:  # (BAND 2: the mask hides what lies outside the band)
                    edge = True
                    if not BLOCK_SPARSE:
                        tt = lo_t + t
                        edge = (tt < flo_t) | (tt >= fhi_t)
                    if edge:
                        diff = gl.expand_dims(m0 + qoff, 0) - keys
                        s2 = gl.where((diff <= win_left) & (-diff <= win_right), s2, float("-inf"))
                if HAS_MASK_MOD:
                    partial = True
                    if BLOCK_SPARSE:
                        partial = t < n_part * (SPARSE_Q // BLOCK_M)
                    if partial:
                        s2 = gl.where(MASK_FN(b, h, gl.expand_dims(m0 + qoff, 0), keys, mt0, mt1, mt2, mt3), s2,
                                      float("-inf"))
                pT = gl.exp2(s2 - gl.expand_dims(lse_smem.index(st).load(col_layout), 0))
                if DROPOUT:  # dV from the kept weights (scaled once at the end), dP^T through the mask
                    # dP^T first: both masked products next to each other, so that the draws are
                    # compared where they are made (kept across the wait, the mask's predicates
                    # would be packed into and unpacked from registers bit by bit)
                    u = _draws_pairs(drop_key, m0, key0, HALF, BLOCK_M, s_layout)
                    dpT = warpgroup_mma_wait(0, deps=[dpT])
                    dv = warpgroup_mma(gl.convert_layout(_kept(u, drop_thresh, pT).to(dtype), op_layout),
                                       do_smem.index(st), dv, is_async=True)
                    dpT = _kept(u, drop_thresh, dpT * drop_scale)
                else:
                    dv = warpgroup_mma(gl.convert_layout(pT.to(dtype), op_layout), do_smem.index(st), dv,
                                       is_async=True)
                    dpT = warpgroup_mma_wait(1, deps=[dpT])  # S^T and dP^T done, dV may run
                dsT = pT * (dpT - gl.expand_dims(dl_smem.index(st).load(col_layout), 0))
                # SCORE_MODE_NO_GRAD, an additive mod with no table gradient: its derivative is 1, and
                # ds is already 0 wherever p is.
                if SCORE_MODE == 1:  # SCORE_MODE_NATURAL
                    # visible: what the band and mask_mod left finite (p and ds are 0 elsewhere)
                    vis = s2 != float("-inf")
                    dsT = GRAD_FN(dsT, s_nat, b, h, gl.expand_dims(m0 + qoff, 0), keys, vis, st0, st1, st2, st3,
                                  g0, g1, g2, g3).to(gl.float32)
                    dsT = gl.where(vis, dsT, 0.0)
                ds16 = dsT.to(dtype)
                dk = warpgroup_mma(gl.convert_layout(ds16, op_layout), q_smem.index(st), dk, is_async=True)
                # dS^T to shared memory (double-buffered by tile parity), read transposed for dQ
                buf = it % 2
                ds_smem.index(buf * 2 + c).store(ds16)
                fence_async_shared()
                # this consumer's dQ columns over all 128 keys: both halves' dS^T, once both are in
                _thread_barrier()
                mbarrier.arrive(ds_bar.index(buf), count=1)
                mbarrier.wait(ds_bar.index(buf), (it // 2) & 1)
                dq = warpgroup_mma(ds_smem.index(buf * 2).permute((1, 0)),
                                   k_smem.index(0).slice(c * DQ_COLS, DQ_COLS, dim=1), q_zero,
                                   use_acc=False, is_async=True)
                dq = warpgroup_mma(ds_smem.index(buf * 2 + 1).permute((1, 0)),
                                   k_smem.index(1).slice(c * DQ_COLS, DQ_COLS, dim=1), dq, is_async=True)
                dq, dv, dk = warpgroup_mma_wait(0, deps=[dq, dv, dk])
                mbarrier.arrive(empty.index(st), count=1)
                # this consumer's dQ columns added to the float32 buffer by a TMA reduction from shared
                # memory, once the last tile's has read the buffer
                tma.store_wait(0)
                dq_smem.index(c).store(dq * sm_scale)
                fence_async_shared()
                _tma_add(dq_desc, [(b * n_heads + h) * seq_q + m0, c * DQ_COLS], dq_smem.index(c))
                it += 1
            if SKIP_HALVES:
                for t in range(t1, n):
                    m0 = _tile_start(t, lo_t, n_part, part_ptr, full_ptr, BLOCK_SPARSE, SPARSE_Q, BLOCK_M)
                    _bwd_unseen_step(c, a, b, h, n_heads, seq_q, m0, it, q_zero, sm_scale, BLOCK_M, HALF, HEAD_D,
                                     STAGES, s_layout)
                    it += 1
        if CAST:  # every reduction landed, then this consumer counts itself off its head (_bwd_caster)
            _bulk_wait_all(b)
            _thread_barrier()
            gl.atomic_add(cd[0] + (b * (n_heads // group) + hk), 1, sem="release", scope="gpu")
        else:
            tma.store_wait(0)  # the last reduction has read the buffer before the program ends
        return dk, dv

    @gluon.jit
    def _store_rows(ptr, stride_s, row0, x, ROWS: gl.constexpr, HEAD_D: gl.constexpr, layout: gl.constexpr):
        rows = gl.expand_dims(row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout)), 1)
        cols = gl.expand_dims(gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, layout)), 0)
        gl.store(ptr + rows.to(gl.int64) * stride_s + cols, x.to(ptr.dtype.element_ty))

    @gluon.jit
    def _bwd_consumer(c: gl.constexpr, a, d, dk_ptr, dv_ptr, dk_off, dv_off, stride_dks, stride_dvs,
                      st0, st1, st2, st3, mt0, mt1, mt2, mt3, g0, g1, g2, g3,
                      SCORE_FN: gl.constexpr, GRAD_FN: gl.constexpr, MASK_FN: gl.constexpr,
                      SCORE_MODE: gl.constexpr, HAS_MASK_MOD: gl.constexpr, BAND: gl.constexpr,
                      BLOCK_SPARSE: gl.constexpr, SPARSE_Q: gl.constexpr, SPARSE_KV: gl.constexpr,
                      BLOCK_M: gl.constexpr, HALF: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr,
                    DROPOUT: gl.constexpr, CAST: gl.constexpr, CAST_ROWS: gl.constexpr):
        dk, dv = _bwd_consume(c, a, d, st0, st1, st2, st3, mt0, mt1, mt2, mt3, g0, g1, g2, g3,
                              SCORE_FN, GRAD_FN, MASK_FN, SCORE_MODE, HAS_MASK_MOD, BAND, BLOCK_SPARSE,
                              SPARSE_Q, SPARSE_KV, BLOCK_M, HALF, HEAD_D, STAGES, DROPOUT, CAST, CAST_ROWS)
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, HEAD_D, 16])
        (b_, hk_, n0_, group_, seq_q_, k_row_, k_col_, q_rb_, q_rh_, q_cb_, q_ch_, g_rb_, g_rh_, g_cb_, g_ch_,
         lse_ptr_, delta_ptr_, stride_lb_, stride_lh_, stride_ls_, n_heads_,
         qn_ptr_, qi_ptr_, fqn_ptr_, fqi_ptr_, stride_nb_, stride_nh_, stride_nm_, stride_ib_, stride_ih_,
         stride_im_, sm_scale, win_left_, win_right_, seed_ptr_, drop_thresh_, drop_scale, cd) = d
        _store_rows(dk_ptr + dk_off, stride_dks, c * HALF, dk * sm_scale, HALF, HEAD_D, acc_layout)
        if DROPOUT:  # the kept weights' 1 / (1 - p), once
            dv = dv * drop_scale
        _store_rows(dv_ptr + dv_off, stride_dvs, c * HALF, dv, HALF, HEAD_D, acc_layout)

    # One entry point per consumer (the half is a compile-time constant; see _attention_hopper); the
    # loader takes the same arguments (the older warp_specialize gives the workers one tuple).
    @gluon.jit
    def _bwd_consumer_0(a, d, dk_ptr, dv_ptr, dk_off, dv_off, stride_dks, stride_dvs,
                        st0, st1, st2, st3, mt0, mt1, mt2, mt3, g0, g1, g2, g3,
                        SCORE_FN: gl.constexpr, GRAD_FN: gl.constexpr, MASK_FN: gl.constexpr,
                        SCORE_MODE: gl.constexpr, HAS_MASK_MOD: gl.constexpr, BAND: gl.constexpr,
                        BLOCK_SPARSE: gl.constexpr, SPARSE_Q: gl.constexpr, SPARSE_KV: gl.constexpr,
                        BLOCK_M: gl.constexpr, HALF: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr,
                    DROPOUT: gl.constexpr, CAST: gl.constexpr, CAST_ROWS: gl.constexpr):
        _bwd_consumer(0, a, d, dk_ptr, dv_ptr, dk_off, dv_off, stride_dks, stride_dvs,
                      st0, st1, st2, st3, mt0, mt1, mt2, mt3, g0, g1, g2, g3, SCORE_FN, GRAD_FN, MASK_FN,
                      SCORE_MODE, HAS_MASK_MOD, BAND, BLOCK_SPARSE, SPARSE_Q, SPARSE_KV, BLOCK_M, HALF,
                      HEAD_D, STAGES, DROPOUT, CAST, CAST_ROWS)

    @gluon.jit
    def _bwd_consumer_1(a, d, dk_ptr, dv_ptr, dk_off, dv_off, stride_dks, stride_dvs,
                        st0, st1, st2, st3, mt0, mt1, mt2, mt3, g0, g1, g2, g3,
                        SCORE_FN: gl.constexpr, GRAD_FN: gl.constexpr, MASK_FN: gl.constexpr,
                        SCORE_MODE: gl.constexpr, HAS_MASK_MOD: gl.constexpr, BAND: gl.constexpr,
                        BLOCK_SPARSE: gl.constexpr, SPARSE_Q: gl.constexpr, SPARSE_KV: gl.constexpr,
                        BLOCK_M: gl.constexpr, HALF: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr,
                    DROPOUT: gl.constexpr, CAST: gl.constexpr, CAST_ROWS: gl.constexpr):
        _bwd_consumer(1, a, d, dk_ptr, dv_ptr, dk_off, dv_off, stride_dks, stride_dvs,
                      st0, st1, st2, st3, mt0, mt1, mt2, mt3, g0, g1, g2, g3, SCORE_FN, GRAD_FN, MASK_FN,
                      SCORE_MODE, HAS_MASK_MOD, BAND, BLOCK_SPARSE, SPARSE_Q, SPARSE_KV, BLOCK_M, HALF,
                      HEAD_D, STAGES, DROPOUT, CAST, CAST_ROWS)

    @gluon.jit
    def _hopper_bwd_kernel(
        q_desc, k_desc, v_desc, do_desc,  # 2-D descriptors as in the Hopper forward ((64, D) tiles)
        lse_ptr, delta_ptr,  # (B, Hq, Sq) fp32: the forward's LSE, the preprocess kernel's delta
        dq_desc,  # (B * Hq * Sq, D) fp32 zero-initialised dQ accumulator, (64, D / 2) tiles
        cast_desc,  # the same buffer in (CAST_ROWS, D) tiles, the caster's copies (CAST)
        cnt_ptr,  # (B * Hkv) int32, zeros: per kv head, the consumers that finished (CAST)
        dq_ptr, stride_dqb, stride_dqh, stride_dqs,  # (B, Hq, Sq, D) output, last dim contiguous (CAST)
        cast_ahead,  # the caster of kv head j casts head j - cast_ahead (CAST)
        dk_ptr, dv_ptr,  # (B, Hkv, Skv, D) outputs, last dim contiguous
        seq_q, seq_kv, group, sm_scale, win_left, win_right,
        seed_ptr, drop_thresh, drop_scale,  # dropout (DROPOUT): the () int64 seed, the threshold, 1 / (1 - p)
        q_rb, q_rh, q_cb, q_ch, k_rb, k_rh, k_cb, k_ch, g_rb, g_rh, g_cb, g_ch,
        stride_lb, stride_lh, stride_ls,
        stride_dkb, stride_dkh, stride_dks, stride_dvb, stride_dvh, stride_dvs,
        qn_ptr, qi_ptr, fqn_ptr, fqi_ptr,  # per-key-block lists of query blocks (BLOCK_SPARSE)
        stride_nb, stride_nh, stride_nm, stride_ib, stride_ih, stride_im,
        st0, st1, st2, st3, mt0, mt1, mt2, mt3, g0, g1, g2, g3,  # the mods' tensors, score_mod gradients
        SCORE_FN: gl.constexpr, GRAD_FN: gl.constexpr, MASK_FN: gl.constexpr,
        SCORE_MODE: gl.constexpr, HAS_MASK_MOD: gl.constexpr, BAND: gl.constexpr,
        BLOCK_SPARSE: gl.constexpr, SPARSE_Q: gl.constexpr, SPARSE_KV: gl.constexpr,
        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr,
        CONSUMER_REGS: gl.constexpr, NEW_WS: gl.constexpr, DROPOUT: gl.constexpr,
        CAST: gl.constexpr, CAST_ROWS: gl.constexpr,
    ):
        HALF: gl.constexpr = BLOCK_N // 2
        dtype: gl.constexpr = q_desc.dtype
        n0 = gl.program_id(0) * BLOCK_N
        hk = gl.program_id(1)
        n_heads = gl.num_programs(1) * group  # query heads (the dQ buffer's rows: (b, h, s))
        b = gl.program_id(2)
        k_row = (b * k_rb + hk * k_rh) * seq_kv + n0
        k_col = b * k_cb + hk * k_ch
        k_smem = gl.allocate_shared_memory(dtype, [2, HALF, HEAD_D], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [2, HALF, HEAD_D], v_desc.layout)
        q_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_D], q_desc.layout)
        do_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_D], do_desc.layout)
        ds_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        ds_smem = gl.allocate_shared_memory(dtype, [4, HALF, BLOCK_M], ds_layout)  # [tile parity * 2 + half]
        ds_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        row_smem: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], row_smem)
        dl_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], row_smem)
        kv_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        dq_smem = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M, HEAD_D // 2], dq_desc.layout)  # per consumer
        q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        do_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(kv_bar.index(i), count=1)
            mbarrier.init(ds_bar.index(i), count=2)  # both halves' dS^T stored
        for i in gl.static_range(STAGES):
            mbarrier.init(q_ready.index(i), count=2)  # the Q copy's arrival and the rows' (lse, delta)
            mbarrier.init(do_ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)  # both consumers release each buffer
        if CAST:  # the caster's two chunks of the float32 buffer and their copies' barriers
            cast_smem = gl.allocate_shared_memory(gl.float32, [2, CAST_ROWS, HEAD_D], cast_desc.layout)
            cast_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
            for i in gl.static_range(2):
                mbarrier.init(cast_bar.index(i), count=1)
            ca = (cast_desc, cast_smem, cast_bar)
        else:
            ca = (cast_desc, dq_smem, kv_bar)  # placeholders, never used
        a = (q_desc, k_desc, v_desc, do_desc, k_smem, v_smem, q_smem, do_smem, kv_bar, q_ready, do_ready, empty,
             ds_smem, lse_smem, dl_smem, ds_bar, dq_desc, dq_smem, ca)
        cd = (cnt_ptr, dq_ptr, stride_dqb, stride_dqh, stride_dqs, cast_ahead, seq_kv)
        d = (b, hk, n0, group, seq_q, k_row, k_col, q_rb, q_rh, q_cb, q_ch, g_rb, g_rh, g_cb, g_ch,
             lse_ptr, delta_ptr, stride_lb, stride_lh, stride_ls, n_heads,
             qn_ptr, qi_ptr, fqn_ptr, fqi_ptr, stride_nb, stride_nh, stride_nm, stride_ib, stride_ih, stride_im,
             sm_scale, win_left, win_right, seed_ptr, drop_thresh, drop_scale, cd)
        dk_off = b.to(gl.int64) * stride_dkb + hk.to(gl.int64) * stride_dkh + n0.to(gl.int64) * stride_dks
        dv_off = b.to(gl.int64) * stride_dvb + hk.to(gl.int64) * stride_dvh + n0.to(gl.int64) * stride_dvs
        if NEW_WS:
            gl.warp_specialize([
                (_bwd_consumer_0, (a, d, dk_ptr, dv_ptr, dk_off, dv_off, stride_dks, stride_dvs,
                                   st0, st1, st2, st3, mt0, mt1, mt2, mt3, g0, g1, g2, g3, SCORE_FN, GRAD_FN,
                                   MASK_FN, SCORE_MODE, HAS_MASK_MOD, BAND, BLOCK_SPARSE, SPARSE_Q, SPARSE_KV,
                                   BLOCK_M, HALF, HEAD_D, STAGES, DROPOUT, CAST, CAST_ROWS)),
                (_bwd_consumer_1, (a, d, dk_ptr, dv_ptr, dk_off, dv_off, stride_dks, stride_dvs,
                                   st0, st1, st2, st3, mt0, mt1, mt2, mt3, g0, g1, g2, g3, SCORE_FN, GRAD_FN,
                                   MASK_FN, SCORE_MODE, HAS_MASK_MOD, BAND, BLOCK_SPARSE, SPARSE_Q, SPARSE_KV,
                                   BLOCK_M, HALF, HEAD_D, STAGES, DROPOUT, CAST, CAST_ROWS)),
                (_bwd_loader, (a, d, dk_ptr, dv_ptr, dk_off, dv_off, stride_dks, stride_dvs,
                                     st0, st1, st2, st3, mt0, mt1, mt2, mt3, g0, g1, g2, g3, SCORE_FN, GRAD_FN,
                                     MASK_FN, SCORE_MODE, HAS_MASK_MOD, BAND, BLOCK_SPARSE, SPARSE_Q,
                                     SPARSE_KV, BLOCK_M, HALF, HEAD_D, STAGES, DROPOUT, CAST, CAST_ROWS)),
                (_bwd_caster, (a, d, dk_ptr, dv_ptr, dk_off, dv_off, stride_dks, stride_dvs,
                               st0, st1, st2, st3, mt0, mt1, mt2, mt3, g0, g1, g2, g3, SCORE_FN, GRAD_FN,
                               MASK_FN, SCORE_MODE, HAS_MASK_MOD, BAND, BLOCK_SPARSE, SPARSE_Q,
                               SPARSE_KV, BLOCK_M, HALF, HEAD_D, STAGES, DROPOUT, CAST, CAST_ROWS)),
            ], [4, 1, 1], [CONSUMER_REGS, 24, 24])
        else:
            gl.warp_specialize(
                (a, d, dk_ptr, dv_ptr, dk_off, dv_off, stride_dks, stride_dvs, st0, st1, st2, st3, mt0, mt1, mt2,
                 mt3, g0, g1, g2, g3, SCORE_FN, GRAD_FN, MASK_FN, SCORE_MODE, HAS_MASK_MOD, BAND, BLOCK_SPARSE,
                 SPARSE_Q, SPARSE_KV, BLOCK_M, HALF, HEAD_D, STAGES, DROPOUT, CAST, CAST_ROWS), _bwd_consumer_0,
                (a, d, dk_ptr, dv_ptr, dk_off, dv_off, stride_dks, stride_dvs, st0, st1, st2, st3, mt0, mt1, mt2,
                 mt3, g0, g1, g2, g3, SCORE_FN, GRAD_FN, MASK_FN, SCORE_MODE, HAS_MASK_MOD, BAND, BLOCK_SPARSE,
                 SPARSE_Q, SPARSE_KV, BLOCK_M, HALF, HEAD_D, STAGES, DROPOUT, CAST, CAST_ROWS),
                [_bwd_consumer_1, _bwd_loader, _bwd_caster], [4, 1, 1], [CONSUMER_REGS, 24, 24])


def band_and(a: tuple[int | None, int | None], b: tuple[int | None, int | None]) -> tuple[int | None, int | None]:
    # the pairs inside both (left, right) bands (None: unbounded on that side)
    return (a[0] if b[0] is None else b[0] if a[0] is None else min(a[0], b[0]),
            a[1] if b[1] is None else b[1] if a[1] is None else min(a[1], b[1]))


@functools.lru_cache(maxsize=None)
def _dq_layout(d: int) -> Any:
    # the shared-memory layout of a consumer's (64, d / 2) float32 dQ tile, built once per head dim
    return gl.NVMMASharedLayout.get_default_for([BWD_BLOCK_M, d // 2], gl.float32)


def hopper_bwd_supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, varlen: bool,
                         sparse_q: int | None, sparse_kv: int | None, traced: bool = False) -> bool:
    """Whether :func:`hopper_bwd` can run this problem (shape and feature checks; no launch). Where
    it can, it measured faster than the portable kernels in every case measured (one H100, B=8,
    S=8192, backward ms, Hopper / portable: d = 128 causal 21.9 / 31.3, no mask 40.2 / 56.7, ALiBi
    25.9 / 32.9 (22.6 since its derivative is skipped), document mask 6.07 / 6.82, window 1024 7.82 /
    10.08; d = 64 causal 28.4 / 35.2, ALiBi 30.3 / 48.1, document 6.78 / 8.08, window 9.78 / 11.78; at
    S = 1024, 2048 and 4096 too, but the document mask at S = 1024, at parity: 4.01 / 3.92), so the
    launcher runs it wherever it applies. ``traced``: as in ``hopper_supported``."""
    if not AVAILABLE or varlen or (torch.compiler.is_compiling() and not traced):
        return False
    if not q.is_cuda or torch.cuda.get_device_capability(q.device)[0] != 9:
        return False
    if q.dtype not in (torch.bfloat16, torch.float16) or q.dim() != 4:
        return False
    d = q.shape[3]
    if d not in (64, 128) or v.shape[3] != d:
        return False
    if q.shape[2] % BWD_BLOCK_M or k.shape[2] % BWD_BLOCK_N or min(q.shape[2], k.shape[2]) == 0:
        return False
    return sparse_q is None or not (sparse_q % BWD_BLOCK_M or sparse_kv % BWD_BLOCK_N)


def hopper_bwd(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lse: torch.Tensor,
               delta: torch.Tensor, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, *, sm_scale: float,
               window: tuple[int | None, int | None], score_fn: Any, grad_fn: Any, mask_fn: Any,
               score_mode: int, has_mask_mod: bool, score_buffers: tuple[Any, ...],
               mask_buffers: tuple[Any, ...], score_grads: tuple[Any, ...], sparse_t: tuple[Any, ...] | None,
               sparse_q: int, sparse_kv: int, dropout: tuple[torch.Tensor, int, float] | None = None,
               mask_band: tuple[int | None, int | None] | None = None) -> bool:
    """Launch the Hopper backward into ``dq``, ``dk``, ``dv`` (``delta`` from the preprocess kernel);
    return whether it ran (q, k, v and do need descriptor views, dk and dv a contiguous last dim;
    nothing is allocated or written otherwise). dQ is summed in a float32 buffer, then cast into
    ``dq`` (:func:`store_accumulated`). ``sparse_t``: the portable dK/dV kernel's 10 block-mask
    arguments (per key block), or None. ``score_mode``: one of SCORE_MODE_* (NO_GRAD: an additive bias, derivative 1 and no
    captured-tensor gradient, so ``grad_fn`` is not called; RELATIVE: such a bias that is
    ``slope * (kv - q) + c`` per batch and head, ALiBi, added per key row and query column without
    calling ``score_fn`` per score). ``mask_band``: (left, right) such that ``mask_fn`` hides every
    pair outside ``q - kv`` in ``[-right, left]`` (a causal mask: (None, 0)), or None: the kernel
    skips the tiles and halves outside it without comparing positions against it."""
    views = (_view2d(q, BWD_BLOCK_M), _view2d(k, BWD_BLOCK_N // 2), _view2d(v, BWD_BLOCK_N // 2),
             _view2d(do, BWD_BLOCK_M))
    if any(x is None for x in views) or views[1][1:] != views[2][1:]:
        return False
    if dk.stride(3) != 1 or dv.stride(3) != 1:
        return False
    qv, kv, vv, gv = views
    B, H, S, D = q.shape
    Hk, Skv = k.shape[1], k.shape[2]
    # the caster casts head j - ahead while head j computes (_bwd_caster); heads from n_kv - ahead are
    # cast after the kernel. `ahead` exceeds the heads in flight (about twice the SMs' worth of programs)
    n_kv, progs = B * Hk, Skv // BWD_BLOCK_N
    ahead = CAST_AHEAD or cdiv(2 * num_sms(q.device), progs) + 2
    want = CAST_IN_KERNEL if CAST_IN_KERNEL is not None else sparse_t is not None
    cast = bool(want) and ahead < n_kv and dq.stride(3) == 1 and S % CAST_ROWS == 0
    # one zero fill for the float32 buffer (contiguous: the reductions' target) and the heads' counters
    flat = torch.zeros(B * H * S * D + (n_kv if cast else 0), dtype=torch.float32, device=q.device)
    dqa = flat[:B * H * S * D].view(B, H, S, D)
    cnt = flat[B * H * S * D:].view(torch.int32) if cast else lse
    dq_desc = TensorDescriptor(dqa.view(B * H * S, D), [B * H * S, D], [D, 1], [BWD_BLOCK_M, D // 2],
                               _dq_layout(D))
    cast_desc = (TensorDescriptor(dqa.view(B * H * S, D), [B * H * S, D], [D, 1], [CAST_ROWS, D], _cast_layout())
                 if cast else dq_desc)
    # BAND: 1, pairs outside the window hidden (and within the mask's band, if any); 2, the mask's band
    # only bounds the walk and the halves skipped (the mask hides those pairs)
    # only without a block mask, whose lists already bound the walk (the kernel skips no halves with one)
    if sparse_t is not None:
        mask_band = None
    band = 1 if window != (None, None) else 2 if mask_band not in (None, (None, None)) else 0
    if mask_band is not None:
        window = band_and(window, mask_band)
    left, right = window
    # the block-mask lists go to every partition, which take no None: the placeholder is never read
    sp = sparse_t if sparse_t is not None else (lse, lse, lse, lse, 0, 0, 0, 0, 0, 0)
    grid = (Skv // BWD_BLOCK_N, Hk, B)
    slots = (*score_buffers, *mask_buffers, *score_grads)
    _hopper_bwd_kernel[grid](
        qv.desc, kv.desc, vv.desc, gv.desc, lse, delta, dq_desc, cast_desc, cnt, dq, *dq.stride()[:3], ahead,
        dk, dv,
        S, Skv, H // Hk, float(sm_scale),
        _NO_BOUND if left is None else int(left), _NO_BOUND if right is None else int(right),
        *(dropout if dropout is not None else (lse, 0, 1.0)),
        *qv[1:], *kv[1:], *gv[1:], *lse.stride(),
        *dk.stride()[:3], *dv.stride()[:3], *sp,
        # slots a mod does not use get a placeholder pointer (partitions take no None arguments)
        *(lse if t is None else t for t in slots),
        SCORE_FN=score_fn, GRAD_FN=grad_fn, MASK_FN=mask_fn, SCORE_MODE=score_mode,
        HAS_MASK_MOD=has_mask_mod, BAND=band, BLOCK_SPARSE=sparse_t is not None,
        SPARSE_Q=sparse_q, SPARSE_KV=sparse_kv, BLOCK_M=BWD_BLOCK_M, BLOCK_N=BWD_BLOCK_N, HEAD_D=D,
        STAGES=BWD_STAGES, CONSUMER_REGS=240, NEW_WS=_NEW_WS,
        DROPOUT=dropout is not None, CAST=cast, CAST_ROWS=CAST_ROWS, num_warps=4, maxnreg=168,
    )
    if not cast:
        store_accumulated(dq, dqa)
        return True
    # the last `ahead` kv heads (all query heads of their groups: a run of (b, h) rows of the buffer)
    first = (n_kv - ahead) * (H // Hk)
    for b in range(first // H, B):
        h0 = max(0, first - b * H)
        store_accumulated(dq[b, h0:], dqa[b, h0:])
    return True


# hopper_bwd casts dQ inside the kernel (_bwd_caster) where it can: with a block mask only (None), always
# (True), never (False). Measured on an H100 (B = 8, H = 32, S = 8192, d = 128, backward ms with the passes,
# against the cast after the kernel; docs/benchmarks/attention_hopper_h100.md): document mask 7.41-7.61
# against 7.71-7.89, sliding window 1024 7.63-7.77 against 7.27-7.32, causal 22.7-24.2 against 21.2-21.9;
# a causal mask given as a block mask level (20.7-22.0 against 20.9-21.6)
CAST_IN_KERNEL: bool | None = None
CAST_ROWS = 16  # rows of the caster's copies
CAST_AHEAD: int | None = None  # the caster's distance in heads (None: from the SM count; tests set it)


@functools.lru_cache(maxsize=None)
def _cast_layout() -> Any:
    # the caster's (CAST_ROWS, d) float32 chunks, unswizzled: read a row at a time
    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
