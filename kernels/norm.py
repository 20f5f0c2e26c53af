"""LayerNorm and RMSNorm kernels: forward with an optional fused residual add and an optional FP8
epilogue (cast + transposed copy + amax in the same pass), and backward with a deterministic
reduction of the weight and bias gradients.

Math (one row ``x`` of length K; statistics in float32)::

    s     = x + residual                          # fp32 add, stored in x.dtype; normalised as stored
    LayerNorm:  mean = sum(s) / K,  rstd = 1 / sqrt(sum((s - mean)^2) / K + eps),  xh = (s - mean) * rstd
    RMSNorm:    rstd = 1 / sqrt(sum(s^2) / K + eps),                               xh = s * rstd
    g     = weight (+ 1 with zero-centred gamma)
    y32   = xh * g (+ bias)
    q     = rne(clamp(y32 * scale, -fmax, fmax))  # FP8, optional; q_t its (K, M) transpose
    amax  = max |y32|                             # always; NaN wins

Backward (``gdy = dy * g``, means over K)::

    LayerNorm:  dx = rstd * (gdy - mean(gdy) - xh * mean(gdy * xh))   (+ ds)
    RMSNorm:    dx = rstd * (gdy - xh * mean(gdy * xh))               (+ ds)
    dweight = sum_rows(dy * xh),   dbias = sum_rows(dy)

Kernels:

- ``_norm_fwd_kernel``: when a row fits in one ``BLOCK_K`` chunk, a persistent program loops over
  blocks of ``BLOCK_M`` whole rows held in registers (statistics, then normalisation), issuing the
  next block's loads before it reduces the current one (the kernel is latency-bound otherwise).
  Longer rows, and the FP8 transposed output, take a program per ``BLOCK_M`` rows that sweeps K
  twice: the first sweep merges per-chunk means and centred sums of squares (Chan et al.'s parallel
  variance, stable in one read), the second normalises ``(BLOCK_M, BLOCK_K)`` tiles and writes y, q
  and q_t (each q_t store is ``BLOCK_M`` contiguous bytes); the second read mostly hits L2. The amax
  is reduced per program and folded into one word with an integer ``atomic_max`` on the float bits
  (see kernels/quantize.py; the shared helpers are in kernels/_jit.py). The same kernel, storing
  nothing but the amax, is ``fp8ops::norm_amax``: the first pass of current scaling, whose scale is
  then computed just in time on the device.
- ``_norm_bwd_kernel``: a persistent grid (about ``#SMs * PROGRAMS_PER_SM`` programs), each looping
  over row blocks. dx is computed per row in one pass (two sweeps when the row is chunked);
  the weight and bias gradients accumulate in float32 registers per program and are written once as
  a ``(G, K)`` partial buffer; no atomics, so the result is deterministic. With chunked rows the
  partial row of a program is updated in place (it is private to that program).
  One launch of ``_reduce.column_sums`` then adds the G partial rows of both buffers in a fixed
  order and writes dweight and dbias in the weight's dtype.

Fast: large M with K in the low thousands, RMSNorm (whole rows in registers, one read of x, one
write of each output), the RMSNorm and LayerNorm backward. Slower: the LayerNorm forward (two
dependent reductions per row), very large K (two sweeps per row), the transposed FP8 output (two
sweeps of 32-row blocks), small tensors (launch latency). Measurements: docs/kernels/norm.md and
docs/benchmarks/norm.md.

References: Ba et al., "Layer Normalization" (2016); Zhang & Sennrich, "Root Mean Square Layer
Normalization" (2019); Chan, Golub & LeVeque, "Algorithms for computing the sample variance" (1983);
NVIDIA Transformer Engine and Apex fused LayerNorm kernels (partial dγ/dβ buffers + finalize).

The ops (``fp8ops::norm_fwd``, ``fp8ops::norm_amax``, ``fp8ops::norm_bwd``) are registered as opaque
library ops (see ``_library.py``) with a CUDA kernel (the launchers below), a traced CUDA kernel
(the same launchers with ``traced=True``: in a graph compiled for CUDA tensors, Inductor launches
their Triton kernels itself) and a fake kernel; the CPU kernel, the FP32 reference math, is
registered by ``fp8ops.norm``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from ._dropout import _dropout_keep_row, _dropout_key, _dropout_pair_row, dropout_threshold
from ._jit import abs_bits, atomic_amax, cast_fp8, clear_next_amax, fp8_scale
from ._library import (
    AMAX_CHAIN,
    OpSpec,
    cdiv,
    contiguous_args,
    fast_launch,
    graph_kernel,
    merge_config,
    next_pow2,
    num_sms,
    traced_kernel,
)
from ._reduce import column_sums

__all__ = ["norm_amax_launch", "norm_bwd_dropout_launch", "norm_bwd_launch", "norm_fwd_launch"]

_IN_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


@triton.jit
def _branch_scale(
    key,  # the dropout hash's key (_dropout_key of the seed, b = h = 0)
    rm,  # (BLOCK_M,) int64 row indices
    rk,  # (BLOCK_K,) column indices
    thresh,  # int32 16-bit threshold (fp8ops.reference.attention.dropout_threshold)
    drop_scale,  # fp32 1 / (1 - p)
):
    # where(keep, 1 / (1 - p), 0) of the (BLOCK_M, BLOCK_K) tile (fp8ops.reference.norm.branch_scale):
    # the attention hash with columns as queries and rows as keys, columns 2j and 2j + 1 the two
    # queries of pair j, so that one per-element hash serves both columns of a pair (a thread holds
    # them side by side in every vectorised layout).
    pair = _dropout_pair_row(key, rk >> 1)
    keep = _dropout_keep_row(pair[None, :], ((rk & 1) << 3)[None, :], rm[:, None], thresh)
    return tl.where(keep, drop_scale, 0.0)


@triton.jit
def _sum_input(
    x,  # (BLOCK_M, BLOCK_K) tile of x in its dtype
    r,  # (BLOCK_M, BLOCK_K) tile of the residual (HAS_RES)
    ks,  # (BLOCK_M, BLOCK_K) fp32 dropout factors of x (DROPOUT)
    HAS_RES: tl.constexpr,
    DROPOUT: tl.constexpr,
):
    # x + residual added in fp32 and rounded to x's dtype (as stored in s), or x; with dropout
    # x * ks + residual, one rounding.
    if HAS_RES:
        if DROPOUT:
            return (x.to(tl.float32) * ks + r.to(tl.float32)).to(x.dtype)
        return (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
    return x


@triton.jit
def _load_input(
    x_ptr,  # (M, K) input, contiguous
    r_ptr,  # (M, K) residual, contiguous (HAS_RES)
    offs,  # (BLOCK_M, BLOCK_K) int64 offsets of the chunk
    mask,  # (BLOCK_M, BLOCK_K) valid elements
    HAS_RES: tl.constexpr,
    EVICT: tl.constexpr,
):
    # A chunk of x and of the residual (x again without one), in x's dtype.
    x = tl.load(x_ptr + offs, mask=mask, other=0.0, eviction_policy=EVICT)
    r = x
    if HAS_RES:
        r = tl.load(r_ptr + offs, mask=mask, other=0.0, eviction_policy=EVICT)
    return x, r


@triton.jit
def _next_chunk(
    x_ptr,  # (M, K) input, contiguous
    r_ptr,  # (M, K) residual, contiguous (HAS_RES)
    row_ok,  # (BLOCK_M,) valid rows
    rk,  # (BLOCK_K,) columns of the current chunk
    offs,  # (BLOCK_M, BLOCK_K) int64 offsets of the current chunk
    K,
    HAS_RES: tl.constexpr,
    EVICT: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # The prefetch of the next chunk of a chunked sweep: (mask, offsets, x, r) of columns rk + BLOCK_K.
    mask_n = row_ok[:, None] & ((rk + BLOCK_K)[None, :] < K)
    offs_n = offs + BLOCK_K
    x_n, r_n = _load_input(x_ptr, r_ptr, offs_n, mask_n, HAS_RES=HAS_RES, EVICT=EVICT)
    return mask_n, offs_n, x_n, r_n


@triton.jit
def _normalize_tile(
    v,  # (BLOCK_M, BLOCK_K) fp32 normalised input
    mean,  # (BLOCK_M,) fp32
    rstd,  # (BLOCK_M,) fp32
    g,  # (BLOCK_K,) fp32 gamma (weight, + 1 when zero-centred; 0 beyond K)
    bias,  # (BLOCK_K,) fp32 bias (HAS_BIAS)
    offs,  # (BLOCK_M, BLOCK_K) int64 offsets into the (M, K) outputs
    offs_t,  # (BLOCK_K, BLOCK_M) int64 offsets into the (K, M) transposed output (TRANSPOSE)
    mask,  # (BLOCK_M, BLOCK_K)
    y_ptr,  # (M, K) output in x's dtype
    q_ptr,  # (M, K) FP8 output
    qt_ptr,  # (K, M) FP8 transposed output
    scale,
    RMS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    STORE_Y: tl.constexpr,
    HAS_Q: tl.constexpr,
    TRANSPOSE: tl.constexpr,
    FP8_MAX: tl.constexpr,
):
    # Step: y32 = xh * g (+ bias), stored; then the FP8 epilogue; returns the row maxima of |y32| bits.
    if RMS:
        xh = v * rstd[:, None]
    else:
        xh = (v - mean[:, None]) * rstd[:, None]
    y = xh * g[None, :]
    if HAS_BIAS:
        y = y + bias[None, :]
    if STORE_Y:
        tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)
    if HAS_Q:
        q = cast_fp8(y, scale, q_ptr, FP8_MAX=FP8_MAX)
        tl.store(q_ptr + offs, q, mask=mask)
        if TRANSPOSE:
            tl.store(qt_ptr + offs_t, tl.trans(q), mask=tl.trans(mask))
    # Padding lanes (columns >= K, rows >= M) hold bias / -mean*rstd terms: keep them out of the amax.
    return tl.max(tl.where(mask, abs_bits(y), 0), axis=1)


@triton.jit
def _load_gamma(
    w_ptr,  # (K,) weight
    rk,  # (BLOCK_K,) column indices
    col_ok,  # (BLOCK_K,) rk < K
    ZERO_CENTERED: tl.constexpr,
):
    # gamma in fp32: weight (+ 1 when zero-centred), 0 beyond K.
    g = tl.load(w_ptr + rk, mask=col_ok, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        g = tl.where(col_ok, g + 1.0, 0.0)
    return g


@triton.jit
def _load_gamma_bias(
    w_ptr,  # (K,) weight
    b_ptr,  # (K,) bias (HAS_BIAS)
    rk,  # (BLOCK_K,) column indices
    col_ok,  # (BLOCK_K,) rk < K
    ZERO_CENTERED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    # (gamma, bias) in fp32; without a bias the second value is gamma, never read.
    g = _load_gamma(w_ptr, rk, col_ok, ZERO_CENTERED=ZERO_CENTERED)
    bias = g
    if HAS_BIAS:
        bias = tl.load(b_ptr + rk, mask=col_ok, other=0.0).to(tl.float32)
    return g, bias


@triton.jit
def _add_pair(a0, a1, b0, b1):
    return a0 + b0, a1 + b1


@triton.jit
def _row_stats(
    v,  # (BLOCK_M, BLOCK_K) fp32 rows (0 beyond K)
    mask,  # (BLOCK_M, BLOCK_K)
    K,
    eps,
    RMS: tl.constexpr,
):
    # Mean (0 for RMSNorm) and rstd of whole rows held in registers; two-pass variance.
    if RMS:
        mean = tl.sum(v, axis=1) * 0.0
        var = tl.sum(v * v, axis=1) / K
    else:
        mean = tl.sum(v, axis=1) / K
        d = tl.where(mask, v - mean[:, None], 0.0)
        var = tl.sum(d * d, axis=1) / K
    rstd = tl.math.div_rn(1.0 + tl.zeros_like(var), tl.sqrt_rn(var + eps))
    return mean, rstd


@fast_launch
@triton.jit
def _norm_fwd_kernel(
    x_ptr,  # (M, K) input, contiguous
    r_ptr,  # (M, K) residual, contiguous (HAS_RES)
    w_ptr,  # (K,) weight
    b_ptr,  # (K,) bias (HAS_BIAS)
    y_ptr,  # (M, K) output in x's dtype (STORE_Y)
    s_ptr,  # (M, K) output x + residual in x's dtype (STORE_S)
    q_ptr,  # (M, K) FP8 output (HAS_Q)
    qt_ptr,  # (K, M) FP8 transposed output (TRANSPOSE)
    scale_ptr,  # () fp32 scale (delayed) or fallback scale (current)
    amax_in_ptr,  # () fp32 amax of y32 (current scaling only)
    amax_ptr,  # () fp32 output, zero-initialised; updated with integer atomics
    amax_next_ptr,  # () fp32: zeroed by program 0 (the next launch's amax, _library.AmaxChain)
    inv_ptr,  # () fp32 output: 1 / scale (HAS_Q)
    mean_ptr,  # (M,) fp32 output (STORE_STATS and not RMS)
    rstd_ptr,  # (M,) fp32 output (STORE_STATS)
    seed_ptr,  # () int64 seed of the dropout on x (DROPOUT)
    M,
    K,
    eps,
    drop_thresh,  # int: x's elements whose 16-bit draw is below it are dropped (DROPOUT)
    drop_scale,  # fp32 1 / (1 - p) (DROPOUT)
    RMS: tl.constexpr,
    ZERO_CENTERED: tl.constexpr,
    HAS_RES: tl.constexpr,
    DROPOUT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    STORE_Y: tl.constexpr,
    STORE_S: tl.constexpr,
    STORE_STATS: tl.constexpr,
    HAS_Q: tl.constexpr,
    TRANSPOSE: tl.constexpr,
    FP8_MAX: tl.constexpr,
    MARGIN: tl.constexpr,
    SCALE_FROM_AMAX: tl.constexpr,
    POWER_2: tl.constexpr,
    SINGLE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    eps = tl.cast(eps, tl.float32)  # a compiled graph passes its float arguments as float64
    # Step 1: the FP8 scale, read or computed just in time (every program computes the same value).
    scale = 1.0
    if HAS_Q:
        scale = fp8_scale(scale_ptr, amax_in_ptr, inv_ptr, pid,
                          FP8_MAX=FP8_MAX, MARGIN=MARGIN, SCALE_FROM_AMAX=SCALE_FROM_AMAX, POWER_2=POWER_2)
    amax_bits = tl.zeros((BLOCK_M,), dtype=tl.int32)
    # The dropout on x (with a residual): a hash of (seed, row, column), as the backward recomputes it.
    # (thresh a tensor: Triton passes an int argument equal to 1 as a constant, which has no .to)
    thresh = pid * 0 + drop_thresh
    drop_scale = tl.cast(drop_scale, tl.float32)
    key = pid.to(tl.uint32) * 0
    if DROPOUT:
        key = _dropout_key(seed_ptr, pid * 0, pid * 0)
    if SINGLE:
        # Whole rows in registers; a persistent program loops over row blocks and prefetches the
        # next block while it normalises the current one (the kernel is latency-bound otherwise).
        num_programs = tl.num_programs(0)
        num_blocks = tl.cdiv(M, BLOCK_M)
        rk = tl.arange(0, BLOCK_K)
        col_ok = rk < K
        # Step 2: gamma and bias once per program.
        g, bias = _load_gamma_bias(w_ptr, b_ptr, rk, col_ok, ZERO_CENTERED=ZERO_CENTERED, HAS_BIAS=HAS_BIAS)
        rows = tl.arange(0, BLOCK_M).to(tl.int64)
        rm_n = rows + pid * BLOCK_M
        mask_n = (rm_n < M)[:, None] & col_ok[None, :]
        x_n = tl.load(x_ptr + rm_n[:, None] * K + rk[None, :], mask=mask_n, other=0.0)
        r_n = x_n
        if HAS_RES:
            r_n = tl.load(r_ptr + rm_n[:, None] * K + rk[None, :], mask=mask_n, other=0.0)
        for blk in range(pid, num_blocks, num_programs):
            rm = rm_n
            mask = mask_n
            x = x_n
            r = r_n
            # Step 3: prefetch the next row block of this program.
            rm_n = rows + (blk + num_programs) * BLOCK_M
            mask_n = (rm_n < M)[:, None] & col_ok[None, :]
            x_n = tl.load(x_ptr + rm_n[:, None] * K + rk[None, :], mask=mask_n, other=0.0)
            if HAS_RES:
                r_n = tl.load(r_ptr + rm_n[:, None] * K + rk[None, :], mask=mask_n, other=0.0)
            # Step 4: statistics, normalisation and the FP8 epilogue of the current block.
            offs = rm[:, None] * K + rk[None, :]
            ks = drop_scale
            if DROPOUT:
                ks = _branch_scale(key, rm, rk, thresh, drop_scale)
            s = _sum_input(x, r, ks, HAS_RES=HAS_RES, DROPOUT=DROPOUT)
            if STORE_S:
                tl.store(s_ptr + offs, s, mask=mask)
            v = s.to(tl.float32)
            mean, rstd = _row_stats(v, mask, K, eps, RMS=RMS)
            row_ok = rm < M
            if STORE_STATS:
                tl.store(rstd_ptr + rm, rstd, mask=row_ok)
                if not RMS:
                    tl.store(mean_ptr + rm, mean, mask=row_ok)
            tile_bits = _normalize_tile(
                v, mean, rstd, g, bias, offs, rk[:, None] * M + rm[None, :], mask, y_ptr, q_ptr, qt_ptr, scale,
                RMS=RMS, HAS_BIAS=HAS_BIAS, STORE_Y=STORE_Y, HAS_Q=HAS_Q, TRANSPOSE=TRANSPOSE, FP8_MAX=FP8_MAX,
            )
            amax_bits = tl.maximum(amax_bits, tile_bits)
    else:
        # Chunked rows: one program per BLOCK_M rows, two sweeps over K; each sweep prefetches its
        # next chunk. The first sweep's loads ask L2 to keep the lines for the second sweep: those
        # of x and the residual, or, where the first sweep stores their sum s (READ_S), that of s,
        # which the second sweep then reads instead (one load, no dropout hash, no add).
        READ_S: tl.constexpr = HAS_RES and STORE_S
        EVICT_1: tl.constexpr = "evict_first" if READ_S else "evict_last"
        rm = pid.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rm < M
        cols = tl.arange(0, BLOCK_K)
        # Step 2: statistics; merge per-chunk (mean, centred sum of squares) pairs (Chan et al.).
        mean = tl.zeros((BLOCK_M,), dtype=tl.float32)
        m2 = tl.zeros((BLOCK_M,), dtype=tl.float32)
        mask_n = row_ok[:, None] & (cols[None, :] < K)
        offs_n = rm[:, None] * K + cols[None, :]
        x_n, r_n = _load_input(x_ptr, r_ptr, offs_n, mask_n, HAS_RES=HAS_RES, EVICT=EVICT_1)
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + cols
            mask, offs, x, r = mask_n, offs_n, x_n, r_n
            mask_n, offs_n, x_n, r_n = _next_chunk(x_ptr, r_ptr, row_ok, rk, offs, K,
                                                   HAS_RES=HAS_RES, EVICT=EVICT_1, BLOCK_K=BLOCK_K)
            ks = drop_scale
            if DROPOUT:
                ks = _branch_scale(key, rm, rk, thresh, drop_scale)
            s = _sum_input(x, r, ks, HAS_RES=HAS_RES, DROPOUT=DROPOUT)
            if STORE_S:
                tl.store(s_ptr + offs, s, mask=mask, eviction_policy="evict_last")
            v = s.to(tl.float32)
            if RMS:
                m2 += tl.sum(v * v, axis=1)
            else:
                nb = tl.sum((rk < K).to(tl.float32), axis=0)  # columns in this chunk
                na = k0 * 1.0  # columns merged so far (every earlier chunk is full)
                cm = tl.sum(v, axis=1) / nb
                d = tl.where(mask, v - cm[:, None], 0.0)
                delta = cm - mean
                n = na + nb
                mean += delta * (nb / n)
                m2 += tl.sum(d * d, axis=1) + delta * delta * (na * nb / n)
        rstd = tl.math.div_rn(1.0 + tl.zeros_like(m2), tl.sqrt_rn(m2 / K + eps))
        if STORE_STATS:
            tl.store(rstd_ptr + rm, rstd, mask=row_ok)
            if not RMS:
                tl.store(mean_ptr + rm, mean, mask=row_ok)
        # Step 3: normalise chunk by chunk (second read mostly from L2), store y / q / q_t. With
        # READ_S the chunks are those of s, which this program's threads stored in step 2: the
        # barrier makes each thread's stores visible to all of them.
        # RES_2 / DROP_2: whether this sweep adds the residual / draws the mask itself.
        RES_2: tl.constexpr = HAS_RES and not READ_S
        DROP_2: tl.constexpr = DROPOUT and not READ_S
        in_ptr = x_ptr
        if READ_S:
            tl.debug_barrier()
            in_ptr = s_ptr
        mask_n = row_ok[:, None] & (cols[None, :] < K)
        offs_n = rm[:, None] * K + cols[None, :]
        x_n, r_n = _load_input(in_ptr, r_ptr, offs_n, mask_n, HAS_RES=RES_2, EVICT="evict_first")
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + cols
            col_ok = rk < K
            mask, offs, x, r = mask_n, offs_n, x_n, r_n
            mask_n, offs_n, x_n, r_n = _next_chunk(in_ptr, r_ptr, row_ok, rk, offs, K,
                                                   HAS_RES=RES_2, EVICT="evict_first", BLOCK_K=BLOCK_K)
            ks = drop_scale
            if DROP_2:
                ks = _branch_scale(key, rm, rk, thresh, drop_scale)
            v = _sum_input(x, r, ks, HAS_RES=RES_2, DROPOUT=DROP_2).to(tl.float32)
            g, bias = _load_gamma_bias(w_ptr, b_ptr, rk, col_ok, ZERO_CENTERED=ZERO_CENTERED, HAS_BIAS=HAS_BIAS)
            tile_bits = _normalize_tile(
                v, mean, rstd, g, bias, offs, rk[:, None] * M + rm[None, :], mask, y_ptr, q_ptr, qt_ptr, scale,
                RMS=RMS, HAS_BIAS=HAS_BIAS, STORE_Y=STORE_Y, HAS_Q=HAS_Q, TRANSPOSE=TRANSPOSE, FP8_MAX=FP8_MAX,
            )
            amax_bits = tl.maximum(amax_bits, tile_bits)
    # Step 5: one atomic per program on the float bits (|y| >= 0: integer order is float order).
    atomic_amax(amax_ptr, tl.max(amax_bits, axis=0))
    clear_next_amax(amax_next_ptr, pid)


@triton.jit
def _bwd_chunk(
    dy_ptr,  # (M, K) gradient of y, contiguous
    s_ptr,  # (M, K) the normalised input, contiguous
    w_ptr,  # (K,) weight
    rm,  # (BLOCK_M,) int64 row indices
    row_ok,  # (BLOCK_M,) rm < M
    k0,  # first column of the chunk
    K,
    mean,  # (BLOCK_M,) fp32 (0 for RMSNorm)
    rstd,  # (BLOCK_M,) fp32
    ZERO_CENTERED: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVICT: tl.constexpr,
):
    # One (BLOCK_M, BLOCK_K) chunk of a chunked row block: its columns, mask and offsets, dy in
    # fp32, xh (0 outside the rows and K) and gdy = dy * gamma.
    rk = k0 + tl.arange(0, BLOCK_K)
    col_ok = rk < K
    mask = row_ok[:, None] & col_ok[None, :]
    offs = rm[:, None] * K + rk[None, :]
    dy = tl.load(dy_ptr + offs, mask=mask, other=0.0, eviction_policy=EVICT).to(tl.float32)
    s = tl.load(s_ptr + offs, mask=mask, other=0.0, eviction_policy=EVICT).to(tl.float32)
    g = _load_gamma(w_ptr, rk, col_ok, ZERO_CENTERED=ZERO_CENTERED)
    xh = tl.where(mask, (s - mean[:, None]) * rstd[:, None], 0.0)
    gdy = dy * g[None, :]
    return rk, col_ok, mask, offs, dy, xh, gdy


@fast_launch
@triton.jit
def _norm_bwd_kernel(
    dy_ptr,  # (M, K) gradient of y, contiguous
    s_ptr,  # (M, K) the normalised input, contiguous
    w_ptr,  # (K,) weight
    mean_ptr,  # (M,) fp32 (LayerNorm only)
    rstd_ptr,  # (M,) fp32
    ds_ptr,  # (M, K) gradient of the sum output s, contiguous (HAS_DS)
    dx_ptr,  # (M, K) output in s's dtype
    dxb_ptr,  # (M, K) output: dx * the forward's dropout factors of x, in s's dtype (DROPOUT)
    seed_ptr,  # () int64 seed of the forward's dropout on x (DROPOUT)
    dw_part_ptr,  # (G, K) fp32 partial sums of dy * xh, one row per program
    db_part_ptr,  # (G, K) fp32 partial sums of dy, one row per program (HAS_BIAS)
    M,
    K,
    drop_thresh,  # int: as the forward's (DROPOUT)
    drop_scale,  # fp32 1 / (1 - p) (DROPOUT)
    RMS: tl.constexpr,
    ZERO_CENTERED: tl.constexpr,
    HAS_DS: tl.constexpr,
    DROPOUT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SINGLE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    num_blocks = tl.cdiv(M, BLOCK_M)
    part_row = pid.to(tl.int64) * K
    rows = tl.arange(0, BLOCK_M).to(tl.int64)
    thresh = pid * 0 + drop_thresh
    drop_scale = tl.cast(drop_scale, tl.float32)
    key = pid.to(tl.uint32) * 0
    if DROPOUT:
        key = _dropout_key(seed_ptr, pid * 0, pid * 0)
    if SINGLE:
        # Step 1: the weight of the whole row, once per program; the first row block prefetched.
        rk = tl.arange(0, BLOCK_K)
        col_ok = rk < K
        g = _load_gamma(w_ptr, rk, col_ok, ZERO_CENTERED=ZERO_CENTERED)
        acc_dw = tl.zeros((BLOCK_K,), dtype=tl.float32)
        acc_db = tl.zeros((BLOCK_K,), dtype=tl.float32)
        rm_n = rows + pid * BLOCK_M
        mask_n = (rm_n < M)[:, None] & col_ok[None, :]
        dy_n = tl.load(dy_ptr + rm_n[:, None] * K + rk[None, :], mask=mask_n, other=0.0)
        s_n = tl.load(s_ptr + rm_n[:, None] * K + rk[None, :], mask=mask_n, other=0.0)
        rstd_n = tl.load(rstd_ptr + rm_n, mask=rm_n < M, other=0.0)
        mean_n = rstd_n * 0.0
        if not RMS:
            mean_n = tl.load(mean_ptr + rm_n, mask=rm_n < M, other=0.0)
        # Step 2: persistent loop over row blocks; dx per row, dγ/dβ partials in registers.
        for blk in range(pid, num_blocks, num_programs):
            rm = rm_n
            mask = mask_n
            dy = dy_n.to(tl.float32)
            s = s_n.to(tl.float32)
            rstd = rstd_n
            mean = mean_n
            offs = rm[:, None] * K + rk[None, :]
            dsv = dy
            if HAS_DS:
                dsv = tl.load(ds_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            # prefetch the next row block (and its statistics) while this one is reduced
            rm_n = rows + (blk + num_programs) * BLOCK_M
            mask_n = (rm_n < M)[:, None] & col_ok[None, :]
            dy_n = tl.load(dy_ptr + rm_n[:, None] * K + rk[None, :], mask=mask_n, other=0.0)
            s_n = tl.load(s_ptr + rm_n[:, None] * K + rk[None, :], mask=mask_n, other=0.0)
            rstd_n = tl.load(rstd_ptr + rm_n, mask=rm_n < M, other=0.0)
            if not RMS:
                mean_n = tl.load(mean_ptr + rm_n, mask=rm_n < M, other=0.0)
            xh = tl.where(mask, (s - mean[:, None]) * rstd[:, None], 0.0)
            gdy = dy * g[None, :]
            if RMS:
                c2 = tl.sum(gdy * xh, axis=1) / K
                dx = (gdy - xh * c2[:, None]) * rstd[:, None]
            else:
                # both row sums in one reduction (one exchange between warps instead of two)
                c1, c2 = tl.reduce((gdy, gdy * xh), 1, _add_pair)
                c1 = c1 / K
                c2 = c2 / K
                dx = (gdy - c1[:, None] - xh * c2[:, None]) * rstd[:, None]
            if HAS_DS:
                dx += dsv
            tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
            if DROPOUT:
                ks = _branch_scale(key, rm, rk, thresh, drop_scale)
                tl.store(dxb_ptr + offs, (dx * ks).to(dxb_ptr.dtype.element_ty), mask=mask)
            acc_dw += tl.sum(dy * xh, axis=0)
            if HAS_BIAS:
                acc_db += tl.sum(dy, axis=0)
        # Step 3: this program's partial sums (the finalize adds the G rows).
        tl.store(dw_part_ptr + part_row + rk, acc_dw, mask=col_ok)
        if HAS_BIAS:
            tl.store(db_part_ptr + part_row + rk, acc_db, mask=col_ok)
    else:
        for blk in range(pid, num_blocks, num_programs):
            rm = rows + blk * BLOCK_M
            row_ok = rm < M
            rstd = tl.load(rstd_ptr + rm, mask=row_ok, other=0.0)
            mean = rstd * 0.0
            if not RMS:
                mean = tl.load(mean_ptr + rm, mask=row_ok, other=0.0)
            # Step 1: the row sums sum(gdy * xh) and sum(gdy) over K chunks (lines kept in L2).
            c1 = tl.zeros((BLOCK_M,), dtype=tl.float32)
            c2 = tl.zeros((BLOCK_M,), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                rk, col_ok, mask, offs, dy, xh, gdy = _bwd_chunk(
                    dy_ptr, s_ptr, w_ptr, rm, row_ok, k0, K, mean, rstd,
                    ZERO_CENTERED=ZERO_CENTERED, BLOCK_K=BLOCK_K, EVICT="evict_last",
                )
                c2 += tl.sum(gdy * xh, axis=1)
                c1 += tl.sum(gdy, axis=1)
            c1 = c1 / K
            c2 = c2 / K
            # Step 2: dx per chunk (second read mostly from L2), and the program's partial sums,
            # read-modify-written in its private row of the partial buffers.
            for k0 in range(0, K, BLOCK_K):
                rk, col_ok, mask, offs, dy, xh, gdy = _bwd_chunk(
                    dy_ptr, s_ptr, w_ptr, rm, row_ok, k0, K, mean, rstd,
                    ZERO_CENTERED=ZERO_CENTERED, BLOCK_K=BLOCK_K, EVICT="evict_first",
                )
                if RMS:
                    dx = (gdy - xh * c2[:, None]) * rstd[:, None]
                else:
                    dx = (gdy - c1[:, None] - xh * c2[:, None]) * rstd[:, None]
                if HAS_DS:
                    dx += tl.load(ds_ptr + offs, mask=mask, other=0.0).to(tl.float32)
                tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
                if DROPOUT:
                    ks = _branch_scale(key, rm, rk, thresh, drop_scale)
                    tl.store(dxb_ptr + offs, (dx * ks).to(dxb_ptr.dtype.element_ty), mask=mask)
                pw = tl.load(dw_part_ptr + part_row + rk, mask=col_ok, other=0.0)
                tl.store(dw_part_ptr + part_row + rk, pw + tl.sum(dy * xh, axis=0), mask=col_ok)
                if HAS_BIAS:
                    pb = tl.load(db_part_ptr + part_row + rk, mask=col_ok, other=0.0)
                    tl.store(db_part_ptr + part_row + rk, pb + tl.sum(dy, axis=0), mask=col_ok)


# ------------------------------------------------------------------------------------------------
# Launchers: they alone know grids and block sizes, and they validate what the kernels assume.

_ROW_LIMIT = 16384  # forward: rows up to this length stay in registers
_BWD_ROW_LIMIT = 8192  # backward: rows up to this length stay in registers
_FWD_T_CFG = {"BLOCK_M": 32, "BLOCK_K": 256, "num_warps": 4, "PROGRAMS_PER_SM": 1}
_FWD_CHUNKED_CFG = {"BLOCK_M": 1, "BLOCK_K": 4096, "num_warps": 8, "PROGRAMS_PER_SM": 1}
_BWD_CHUNKED_CFG = {"BLOCK_M": 4, "BLOCK_K": 1024, "num_warps": 8, "PROGRAMS_PER_SM": 2}


def _fwd_default(K: int, transpose: bool) -> dict[str, Any]:
    """Default forward launch config for rows of length K (PROGRAMS_PER_SM applies to whole-row
    configs, which run on a persistent grid; chunked configs get one program per row block).

    Chosen with ``python -m fp8ops.bench norm --sweep`` (docs/benchmarks/norm.md): K=4096
    BLOCK_M=2, 8 warps, 2 programs per SM; K=8192 BLOCK_M=2, 16 warps, 1 program per SM;
    transposed FP8 output 32x256 tiles, 4 warps.
    """
    if transpose:
        return dict(_FWD_T_CFG)
    bk = next_pow2(K)
    if bk > _ROW_LIMIT:
        return dict(_FWD_CHUNKED_CFG)
    warps = 4 if bk <= 1024 else (8 if bk <= 4096 else 16)
    return {
        "BLOCK_M": 1 if bk > 8192 else max(2, min(16, 8192 // bk)),
        "BLOCK_K": bk,
        "num_warps": warps,
        "PROGRAMS_PER_SM": {4: 4, 8: 2, 16: 1}[warps],
    }


def _bwd_default(K: int) -> dict[str, Any]:
    """Default backward launch config for rows of length K.

    Measured on an H200 at 8192 rows, bf16, inputs rotated beyond L2, the whole launch with its
    finalize (``scripts/small_kernel_sweep.py``): K=512 four rows, 2 warps, 2 programs per SM (17 µs;
    4 warps took 35 µs); K=768 and 1024 four rows, 4 warps, 2 programs per SM (20 and 22 µs); K=2048
    four rows, 8 warps, 1 program per SM (34 µs). K=4096 two rows, 8 warps and K=8192 one row, 16 warps,
    1 program per SM (``python -m fp8ops.bench norm --probe``, docs/benchmarks/norm.md). Shorter rows:
    4 warps, 2 programs per SM.
    """
    bk = next_pow2(K)
    if bk > _BWD_ROW_LIMIT:
        return dict(_BWD_CHUNKED_CFG)
    if bk >= 4096:
        return {"BLOCK_M": 2 if bk == 4096 else 1, "BLOCK_K": bk, "num_warps": 8 if bk == 4096 else 16,
                "PROGRAMS_PER_SM": 1}
    if bk == 2048:
        return {"BLOCK_M": 4, "BLOCK_K": bk, "num_warps": 8, "PROGRAMS_PER_SM": 1}
    if bk >= 512:
        return {"BLOCK_M": 4, "BLOCK_K": bk, "num_warps": 2 if bk == 512 else 4, "PROGRAMS_PER_SM": 2}
    return {"BLOCK_M": max(1, min(16, 2048 // bk)), "BLOCK_K": bk, "num_warps": 4, "PROGRAMS_PER_SM": 2}


def _check_pow2(name: str, cfg: dict[str, Any]) -> None:
    for key in ("BLOCK_M", "BLOCK_K"):
        v = cfg[key]
        if not isinstance(v, int) or v < 1 or v & (v - 1):
            raise ValueError(f"{name}: config {key} must be a power of two, got {v!r}")


def _check_rows(name: str, arg: str, t: torch.Tensor, like: torch.Tensor | None = None) -> None:
    if t.dtype not in _IN_DTYPES:
        raise ValueError(f"{name}: {arg} must be float32, bfloat16 or float16, got {t.dtype}")
    if t.dim() != 2 or not t.is_contiguous():
        raise ValueError(
            f"{name}: {arg} must be a contiguous 2-D (M, K) tensor, got shape {tuple(t.shape)} and strides "
            f"{tuple(t.stride())}; call .reshape(-1, K).contiguous() first"
        )
    if like is not None and (t.shape != like.shape or t.device != like.device):
        raise ValueError(f"{name}: {arg} must have shape {tuple(like.shape)} on {like.device}, "
                         f"got {tuple(t.shape)} on {t.device}")


def _check_vec(name: str, arg: str, t: torch.Tensor | None, K: int, device: torch.device) -> None:
    if t is None:
        return
    if t.dtype not in _IN_DTYPES:
        raise ValueError(f"{name}: {arg} must be float32, bfloat16 or float16, got {t.dtype}")
    if tuple(t.shape) != (K,) or not t.is_contiguous() or t.device != device:
        raise ValueError(f"{name}: {arg} must be a contiguous ({K},) tensor on {device}, got shape "
                         f"{tuple(t.shape)} on {t.device}")


def _check_scalar(name: str, arg: str, t: torch.Tensor | None) -> None:
    if t is not None and (t.dim() != 0 or t.dtype != torch.float32):
        raise ValueError(f"{name}: {arg} must be a 0-d float32 tensor, got shape {tuple(t.shape)} {t.dtype}")


def _dropout_args(name: str, seed: torch.Tensor | None, p: float, device: torch.device,
                  residual: torch.Tensor | None = None, needs_residual: bool = True) -> tuple[int, float] | None:
    """(threshold, 1 / (1 - p)) of the dropout on x, checked; None without one (``seed`` None)."""
    if seed is None:
        if p != 0.0:
            raise ValueError(f"{name}: dropout_p={p} needs a dropout_seed tensor, got None")
        return None
    if not isinstance(seed, torch.Tensor) or seed.dtype != torch.int64 or seed.numel() != 1:
        raise ValueError(f"{name}: dropout_seed must be a 1-element int64 tensor, got "
                         f"{type(seed).__name__ if not isinstance(seed, torch.Tensor) else f'{seed.dtype} {tuple(seed.shape)}'}")
    if seed.device != device:
        raise ValueError(f"{name}: dropout_seed must be on {device}, got {seed.device}")
    if not 0.0 < float(p) < 1.0:
        raise ValueError(f"{name}: dropout_p must be in (0, 1) with a dropout_seed, got {p}")
    if needs_residual and residual is None:
        raise ValueError(f"{name}: the dropout applies to x before its residual add; pass a residual")
    return dropout_threshold(p), 1.0 / (1.0 - float(p))


def _check_fwd_inputs(name: str, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                      bias: torch.Tensor | None, eps: float) -> None:
    _check_rows(name, "x", x)
    if x.shape[1] < 1:
        raise ValueError(f"{name}: x must have K >= 1 columns, got shape {tuple(x.shape)}")
    if residual is not None:
        _check_rows(name, "residual", residual, x)
        if residual.dtype != x.dtype:
            raise ValueError(f"{name}: residual must have x's dtype {x.dtype}, got {residual.dtype}")
    _check_vec(name, "weight", weight, x.shape[1], x.device)
    _check_vec(name, "bias", bias, x.shape[1], x.device)
    if not eps > 0:
        raise ValueError(f"{name}: eps must be > 0, got {eps}")


class _Cast(NamedTuple):
    """The FP8 output of a forward launch, as in :func:`norm_fwd_launch` (``out_dtype`` None: none)."""

    scale: torch.Tensor | None
    amax_in: torch.Tensor | None
    margin: int
    power_2: bool
    out_dtype: torch.dtype | None
    transpose: bool


_NO_CAST = _Cast(scale=None, amax_in=None, margin=0, power_2=False, out_dtype=None, transpose=False)


def _launch_fwd(
    name: str,
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    rms: bool,
    zero_centered_gamma: bool,
    *,
    store_y: bool,
    store_stats: bool,
    store_s: bool,
    cast: _Cast,
    config: dict[str, Any] | None,
    traced: bool,
    dropout_seed: torch.Tensor | None = None,
    dropout_p: float = 0.0,
) -> tuple[torch.Tensor, ...]:
    M, K = x.shape
    dev = x.device
    drop = _dropout_args(name, dropout_seed, dropout_p, dev, residual)
    scale, amax_in, margin, power_2, out_dtype, transpose = cast
    has_q = out_dtype is not None
    fp8_max = 1.0
    if has_q:
        if out_dtype not in _FP8_MAX:
            raise ValueError(f"{name}: out_dtype must be torch.float8_e4m3fn, torch.float8_e5m2 or None, "
                             f"got {out_dtype}")
        fp8_max = _FP8_MAX[out_dtype]
    elif transpose:
        raise ValueError(f"{name}: transpose=True needs an FP8 out_dtype")
    _check_scalar(name, "scale", scale)
    _check_scalar(name, "amax_in", amax_in)
    cfg = merge_config(_fwd_default(K, transpose and has_q), config, name=name)
    _check_pow2(name, cfg)
    # Step: outputs; unused ones are distinct empty tensors.
    y = torch.empty((M, K), dtype=x.dtype, device=dev) if store_y else x.new_empty(0)
    s = torch.empty((M, K), dtype=x.dtype, device=dev) if store_s else x.new_empty(0)
    if has_q:
        q = torch.empty((M, K), dtype=out_dtype, device=dev)
        q_t = torch.empty((K, M), dtype=out_dtype, device=dev) if transpose else x.new_empty(0, dtype=out_dtype)
        inv = torch.empty((), dtype=torch.float32, device=dev)
        if scale is None:
            scale = torch.ones((), dtype=torch.float32, device=dev)
    else:
        q, q_t, inv = x.new_empty(0), x.new_empty(0), x.new_empty(0, dtype=torch.float32)
    f32 = torch.float32
    mean = torch.empty((M,), dtype=f32, device=dev) if store_stats and not rms else x.new_empty(0, dtype=f32)
    rstd = torch.empty((M,), dtype=f32, device=dev) if store_stats else x.new_empty(0, dtype=f32)
    # Whole rows: a persistent grid; chunked rows: one program per BLOCK_M rows. At least one
    # program, so that inv_scale is written when M == 0.
    single = cfg["BLOCK_K"] >= K
    blocks = cdiv(M, cfg["BLOCK_M"])
    if single:
        blocks = min(blocks, num_sms(dev) * cfg["PROGRAMS_PER_SM"])
    grid = (max(1, blocks),)
    kernel = graph_kernel(_norm_fwd_kernel, traced)
    with AMAX_CHAIN.output(dev, traced) as (amax, amax_next):
        kernel[grid](
            x, residual if residual is not None else x, weight, bias if bias is not None else weight,
            y, s, q, q_t, scale if scale is not None else amax, amax_in if amax_in is not None else amax,
            amax, amax_next, inv, mean, rstd, dropout_seed if drop is not None else rstd, M, K, float(eps),
            drop[0] if drop is not None else 0, drop[1] if drop is not None else 1.0,
            RMS=rms, ZERO_CENTERED=zero_centered_gamma, HAS_RES=residual is not None, DROPOUT=drop is not None,
            HAS_BIAS=bias is not None,
            STORE_Y=store_y, STORE_S=store_s, STORE_STATS=store_stats, HAS_Q=has_q, TRANSPOSE=transpose,
            FP8_MAX=fp8_max, MARGIN=margin, SCALE_FROM_AMAX=amax_in is not None, POWER_2=power_2,
            SINGLE=single, BLOCK_M=cfg["BLOCK_M"], BLOCK_K=cfg["BLOCK_K"], num_warps=cfg["num_warps"],
        )
    return y, s, q, q_t, amax, inv, mean, rstd


def norm_fwd_launch(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    rms: bool,
    zero_centered_gamma: bool,
    store_y: bool,
    scale: torch.Tensor | None,
    amax_in: torch.Tensor | None,
    margin: int,
    power_2: bool,
    out_dtype: torch.dtype | None,
    transpose: bool,
    dropout_seed: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    *,
    config: dict[str, Any] | None = None,
    traced: bool = False,
) -> tuple[torch.Tensor, ...]:
    """LayerNorm / RMSNorm forward with optional residual add (x dropped first, optionally) and
    FP8 output, one launch.

    Args:
        x: (M, K) float32/bfloat16/float16, contiguous, K >= 1.
        residual: (M, K) of x's dtype, or None.
        weight, bias: (K,) float32 or any of the input dtypes, contiguous; bias may be None.
        eps: > 0. rms: RMSNorm (no mean, no bias needed). zero_centered_gamma: g = weight + 1.
        store_y: write y in x's dtype.
        scale: () fp32 scale (delayed) or fallback scale (current); None means 1.
        amax_in: () fp32 amax of y32 for current scaling (from :func:`norm_amax_launch`), or None.
        margin, power_2: current-scaling parameters. out_dtype: FP8 dtype of q, or None (no q).
        transpose: also write q_t (K, M) (needs out_dtype).
        dropout_seed: () int64 tensor, or None: with a residual, x is dropped with probability
            ``dropout_p`` before the add (``s = x * keep / (1 - p) + residual``, the mask a hash of
            ``(seed, row, column)``: ``fp8ops.reference.norm.branch_keep``); nothing is stored for
            the backward, which recomputes the mask (:func:`norm_bwd_dropout_launch`).
        dropout_p: in (0, 1) with a seed, else 0.
        config: overrides of ``BLOCK_M``, ``BLOCK_K``, ``num_warps``, ``PROGRAMS_PER_SM``.
        traced: launched from a compiled graph (``_library.traced_kernel``).

    Returns:
        ``(y, s, q, q_t, amax, inv_scale, mean, rstd)`` as in the ``fp8ops::norm_fwd`` schema.
    """
    name = "norm_fwd"
    _check_fwd_inputs(name, x, residual, weight, bias, eps)
    return _launch_fwd(
        name, x, residual, weight, bias, eps, rms, zero_centered_gamma,
        store_y=store_y, store_stats=True, store_s=residual is not None,
        cast=_Cast(scale, amax_in, margin, power_2, out_dtype, transpose), config=config, traced=traced,
        dropout_seed=dropout_seed, dropout_p=dropout_p,
    )


def norm_amax_launch(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    rms: bool,
    zero_centered_gamma: bool,
    dropout_seed: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    *,
    config: dict[str, Any] | None = None,
    traced: bool = False,
) -> torch.Tensor:
    """max |y32| of the norm's output as a () float32 tensor, storing nothing else (the first pass
    of current scaling). Arguments as :func:`norm_fwd_launch`."""
    name = "norm_amax"
    _check_fwd_inputs(name, x, residual, weight, bias, eps)
    out = _launch_fwd(
        name, x, residual, weight, bias, eps, rms, zero_centered_gamma,
        store_y=False, store_stats=False, store_s=False, cast=_NO_CAST, config=config, traced=traced,
        dropout_seed=dropout_seed, dropout_p=dropout_p,
    )
    return out[4]


def norm_bwd_launch(
    dy: torch.Tensor,
    s: torch.Tensor,
    weight: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    ds: torch.Tensor | None,
    rms: bool,
    zero_centered_gamma: bool,
    has_bias: bool,
    *,
    config: dict[str, Any] | None = None,
    traced: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """LayerNorm / RMSNorm backward: dx (one pass per row) and dweight / dbias (persistent grid,
    per-program fp32 partial sums, then a finalize).

    Args:
        dy: (M, K) gradient of y, any float dtype, contiguous.
        s: (M, K) the normalised input (x, or x + residual as stored), contiguous.
        weight: (K,). mean: (M,) fp32 (LayerNorm; ignored for RMSNorm). rstd: (M,) fp32.
        ds: (M, K) gradient of the sum output, added to dx, or None.
        rms, zero_centered_gamma: as in the forward. has_bias: also return dbias.
        config: overrides of ``BLOCK_M``, ``BLOCK_K``, ``num_warps``, ``PROGRAMS_PER_SM``.
        traced: launched from a compiled graph (``_library.traced_kernel``).

    Returns:
        ``(dx, dweight, dbias)``: dx (M, K) in s's dtype; dweight (K,) and dbias (K,) (empty
        without a bias) in weight's dtype.
    """
    dx, _, dweight, dbias = _launch_bwd("norm_bwd", dy, s, weight, mean, rstd, ds, rms, zero_centered_gamma,
                                        has_bias, None, 0.0, config=config, traced=traced)
    return dx, dweight, dbias


def norm_bwd_dropout_launch(
    dy: torch.Tensor,
    s: torch.Tensor,
    weight: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    ds: torch.Tensor | None,
    rms: bool,
    zero_centered_gamma: bool,
    has_bias: bool,
    dropout_seed: torch.Tensor,
    dropout_p: float,
    *,
    config: dict[str, Any] | None = None,
    traced: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward of a forward that dropped x before its residual add (:func:`norm_fwd_launch`
    with ``dropout_seed``): :func:`norm_bwd_launch`'s outputs and ``dx_branch = dx * keep / (1 -
    p)``, the gradient of x (the mask recomputed from the seed), written in the same pass.

    Returns:
        ``(dx, dx_branch, dweight, dbias)``: dx the gradient of s (and of the residual).
    """
    if dropout_seed is None:
        raise ValueError("norm_bwd_dropout: dropout_seed must be the forward's 1-element int64 seed, got None")
    return _launch_bwd("norm_bwd_dropout", dy, s, weight, mean, rstd, ds, rms, zero_centered_gamma, has_bias,
                       dropout_seed, dropout_p, config=config, traced=traced)


def _launch_bwd(name: str, dy: torch.Tensor, s: torch.Tensor, weight: torch.Tensor, mean: torch.Tensor,
                rstd: torch.Tensor, ds: torch.Tensor | None, rms: bool, zero_centered_gamma: bool, has_bias: bool,
                dropout_seed: torch.Tensor | None, dropout_p: float, *, config: dict[str, Any] | None,
                traced: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    _check_rows(name, "s", s)
    _check_rows(name, "dy", dy, s)
    if ds is not None:
        _check_rows(name, "ds", ds, s)
    M, K = s.shape
    dev = s.device
    _check_vec(name, "weight", weight, K, dev)
    for arg, t, need in (("rstd", rstd, True), ("mean", mean, not rms)):
        if need and (t.dtype != torch.float32 or tuple(t.shape) != (M,) or not t.is_contiguous()):
            raise ValueError(f"{name}: {arg} must be a contiguous ({M},) float32 tensor, got shape "
                             f"{tuple(t.shape)} {t.dtype}")
    drop = _dropout_args(name, dropout_seed, dropout_p, dev, needs_residual=False)
    cfg = merge_config(_bwd_default(K), config, name=name)
    _check_pow2(name, cfg)
    single = cfg["BLOCK_K"] >= K
    dx = torch.empty((M, K), dtype=s.dtype, device=dev)
    dxb = torch.empty((M, K), dtype=s.dtype, device=dev) if drop is not None else s.new_empty(0)
    G = max(1, min(cdiv(M, cfg["BLOCK_M"]), num_sms(dev) * cfg["PROGRAMS_PER_SM"]))
    alloc = torch.empty if single else torch.zeros  # chunked rows accumulate in place
    dw_part = alloc((G, K), dtype=torch.float32, device=dev)
    db_part = alloc((G, K), dtype=torch.float32, device=dev) if has_bias else dw_part
    kernel = graph_kernel(_norm_bwd_kernel, traced)
    kernel[(G,)](
        dy, s, weight, mean if not rms else rstd, rstd, ds if ds is not None else dy, dx,
        dxb if drop is not None else dx, dropout_seed if drop is not None else rstd, dw_part, db_part, M, K,
        drop[0] if drop is not None else 0, drop[1] if drop is not None else 1.0,
        RMS=rms, ZERO_CENTERED=zero_centered_gamma, HAS_DS=ds is not None, DROPOUT=drop is not None,
        HAS_BIAS=has_bias,
        SINGLE=single, BLOCK_M=cfg["BLOCK_M"], BLOCK_K=cfg["BLOCK_K"], num_warps=cfg["num_warps"],
    )
    # Step: finalize, a deterministic fp32 sum of the G partial rows of both buffers, one launch.
    dweight, dbias = column_sums(dw_part, db_part if has_bias else None, dtype=weight.dtype, traced=traced)
    return dx, dxb, dweight, (dbias if dbias is not None else weight.new_empty(0))


# ------------------------------------------------------------------------------------------------
# Library ops: a fake kernel gives torch.compile their shapes; CUDA kernels above, also traced.


def _norm_fwd_fake(x, residual, weight, bias, eps, rms, zero_centered_gamma, store_y, scale, amax_in,  # type: ignore[no-untyped-def]
                   margin, power_2, out_dtype, transpose, dropout_seed=None, dropout_p=0.0):
    M, K = x.shape
    f32 = torch.float32
    y = x.new_empty((M, K)) if store_y else x.new_empty(0)
    s = x.new_empty((M, K)) if residual is not None else x.new_empty(0)
    if out_dtype is not None:
        q = x.new_empty((M, K), dtype=out_dtype)
        q_t = x.new_empty((K, M), dtype=out_dtype) if transpose else x.new_empty(0, dtype=out_dtype)
        inv = x.new_empty((), dtype=f32)
    else:
        q, q_t, inv = x.new_empty(0), x.new_empty(0), x.new_empty(0, dtype=f32)
    mean = x.new_empty(0, dtype=f32) if rms else x.new_empty((M,), dtype=f32)
    return y, s, q, q_t, x.new_empty((), dtype=f32), inv, mean, x.new_empty((M,), dtype=f32)


def _norm_amax_fake(x, residual, weight, bias, eps, rms, zero_centered_gamma,  # type: ignore[no-untyped-def]
                    dropout_seed=None, dropout_p=0.0):
    return x.new_empty((), dtype=torch.float32)


def _norm_bwd_fake(dy, s, weight, mean, rstd, ds, rms, zero_centered_gamma, has_bias):  # type: ignore[no-untyped-def]
    K = s.shape[1]
    return s.new_empty(s.shape), weight.new_empty((K,)), weight.new_empty((K,) if has_bias else 0)


def _norm_bwd_dropout_fake(dy, s, weight, mean, rstd, ds, rms, zero_centered_gamma, has_bias,  # type: ignore[no-untyped-def]
                           dropout_seed, dropout_p):
    K = s.shape[1]
    return (s.new_empty(s.shape), s.new_empty(s.shape), weight.new_empty((K,)),
            weight.new_empty((K,) if has_bias else 0))


norm_fwd = OpSpec(
    "norm_fwd(Tensor x, Tensor? residual, Tensor weight, Tensor? bias, float eps, bool rms, "
    "bool zero_centered_gamma, bool store_y, Tensor? scale, Tensor? amax_in, int margin, bool power_2, "
    "ScalarType? out_dtype, bool transpose, Tensor? dropout_seed=None, float dropout_p=0.0) "
    "-> (Tensor y, Tensor s, Tensor q, Tensor q_t, Tensor amax, Tensor inv_scale, Tensor mean, Tensor rstd)",
    cuda=contiguous_args(norm_fwd_launch, 4),
    fake=_norm_fwd_fake,
    traced=traced_kernel(norm_fwd_launch, 4),
)
"""``fp8ops::norm_fwd``: LayerNorm / RMSNorm forward (+ residual, + FP8 output); see :func:`norm_fwd_launch`."""

norm_amax = OpSpec(
    "norm_amax(Tensor x, Tensor? residual, Tensor weight, Tensor? bias, float eps, bool rms, "
    "bool zero_centered_gamma, Tensor? dropout_seed=None, float dropout_p=0.0) -> Tensor",
    cuda=contiguous_args(norm_amax_launch, 4),
    fake=_norm_amax_fake,
    traced=traced_kernel(norm_amax_launch, 4),
)
"""``fp8ops::norm_amax``: max |y32| of the norm output (first pass of current scaling)."""

norm_bwd = OpSpec(
    "norm_bwd(Tensor dy, Tensor s, Tensor weight, Tensor mean, Tensor rstd, Tensor? ds, bool rms, "
    "bool zero_centered_gamma, bool has_bias) -> (Tensor dx, Tensor dweight, Tensor dbias)",
    cuda=contiguous_args(norm_bwd_launch, 6),
    fake=_norm_bwd_fake,
    traced=traced_kernel(norm_bwd_launch, 6),
)
"""``fp8ops::norm_bwd``: LayerNorm / RMSNorm backward ``(dx, dweight, dbias)``; see :func:`norm_bwd_launch`."""

norm_bwd_dropout = OpSpec(
    "norm_bwd_dropout(Tensor dy, Tensor s, Tensor weight, Tensor mean, Tensor rstd, Tensor? ds, bool rms, "
    "bool zero_centered_gamma, bool has_bias, Tensor dropout_seed, float dropout_p) "
    "-> (Tensor dx, Tensor dx_branch, Tensor dweight, Tensor dbias)",
    cuda=contiguous_args(norm_bwd_dropout_launch, 6),
    fake=_norm_bwd_dropout_fake,
    traced=traced_kernel(norm_bwd_dropout_launch, 6),
)
"""``fp8ops::norm_bwd_dropout``: the backward of a forward that dropped x before its residual add
``(dx, dx_branch, dweight, dbias)``; see :func:`norm_bwd_dropout_launch`."""
