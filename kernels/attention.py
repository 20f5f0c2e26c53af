"""Flash attention kernels with fused score/mask modifications, block sparsity and packed sequences.

Math (FlashAttention-2's online softmax, in base 2; ``L = log2(e)``)::

    s_ij  = scale * q_i . k_j                        score, fp32 (QK^T on the tensor cores)
    s_ij  = score_mod(s_ij, b, h, i, j)              optional, fused, fp32
    s_ij  = -inf  where (i, j) is not visible         band (causal / window), mask_mod, bounds
    m_i   = max_j s_ij * L;  l_i = sum_j 2^(s_ij L - m_i)   updated one key tile at a time
    o_i   = sum_j 2^(s_ij L - m_i) v_j / l_i          P cast to V's dtype for the PV GEMM
    lse_i = (m_i + log2 l_i) / L                      natural log; MASKED_ROW_LSE when l_i == 0

Backward (the "no atomics" schedule of the Triton tutorial and FlexAttention, plus an atomic-dQ
variant)::

    delta_i = sum_d o_id do_id - dlse_i                               (_attention_bwd_preprocess_kernel)
    p_ij    = 2^(s_ij L - lse_i L);  dp_ij = do_i . v_j;  ds_ij = p_ij (dp_ij - delta_i)
    ds_ij  <- ds_ij * d score_mod / d s   (and captured-tensor gradients, scattered with atomics)
    dv_j = sum_i p_ij do_i;  dk_j = scale sum_i ds_ij q_i;  dq_i = scale sum_j ds_ij k_j

- ``_attention_bwd_dkdv_kernel``: one program per (key tile, kv head, batch); loops over the
  query heads of its GQA group and over the query tiles that see the key tile, so dK and dV are
  reduced in registers (deterministic). It computes the transposed products ``s^T = K Q^T`` and
  ``dp^T = V dO^T`` directly (no transpose of a dot result: a Hopper miscompile, G8). With
  ``ATOMIC_DQ`` it also adds ``dq^T = K^T ds^T`` to an fp32 buffer with atomics (5 GEMMs per tile
  pair instead of 7, not deterministic).
- ``_attention_bwd_dq_kernel``: one program per (query tile, head, batch), over key tiles (7-GEMM
  scheme together with the dK/dV kernel, deterministic).

Visibility and sparsity. The band ``i - left <= j <= i + right`` (``causal`` is ``right = 0``,
top-left aligned) gives each query tile a key range; tiles entirely inside the band and the
sequence run an unmasked loop, tiles on its edges a masked loop, tiles outside are never visited.
With a block mask, programs follow its per-row lists of *partial* blocks (mask_mod evaluated) and
*full* blocks (mask_mod skipped); empty blocks are never visited. The dK/dV kernel uses the
transposed (per key block) lists. Kernel tiles divide the block-mask blocks.

Packed sequences (``VARLEN``): ``cu_seqlens`` gives each sequence's rows; loads and stores are
masked at sequence ends (no reads or writes in a neighbour's rows), and the mods see positions
inside the sequence.

Mods are ``@triton.jit`` functions referenced as globals of a *specialized* copy of each kernel
(:func:`specialize`), so each (score_mod, mask_mod) pair compiles once and the kernels never take a
function as an argument (which ``torch.compile`` cannot trace). Signatures::

    score_mod(score, b, h, q_idx, kv_idx, t0, t1, t2, t3) -> score
    score_grad(ds, score, b, h, q_idx, kv_idx, valid, t0, t1, t2, t3, g0, g1, g2, g3) -> ds * dmod/dscore
    mask_mod(b, h, q_idx, kv_idx, t0, t1, t2, t3) -> bool

``t*`` are the mod's captured tensors (pointers, or None), ``g*`` fp32 gradient buffers of them
(or None). Indices are clamped to the sequence, so a mod may index tables by position.

FP8 hooks (not yet used by fp8ops): the forward takes per-block descales of Q, K and V
(``HAS_DESCALE``: ``qk *= dq * dk`` per tile, ``pv *= dv``) and casts P to V's dtype before the PV
GEMM, so FP8 operands need no kernel rewrite.

Loads. Pointer loads everywhere, or (forward config ``TMA=1``: Q, K, V; backward config ``TMA1=1``:
the dK/dV kernel's Q and dO, ``TMA2=1``: the dQ kernel's K and V) tiles through 3-D (outer,
sequence, columns) tensor descriptors (``_tma_view``): TMA copies into shared memory, waited on
with mbarriers, rows past the sequence end read as zeros. Both are software-pipelined (the pointer
loads become ``cp.async`` copies). Compiled for sm_90 with Triton 3.6 and its bundled ptxas (the
GPU machine's toolkit may allocate differently), the descriptors mostly relieve register pressure: the
causal forward at d = 64 / 128 / 256 needs 122 / 174 / 197 registers instead of 164 / 255 / 223,
with ALiBi 207 instead of 255, the dQ kernel spills 120 bytes instead of 372 at d = 64; the dK/dV
kernel gains nothing (it is at 255 registers either way). Timed on an H200 (scripts/attn_tune.py
--tma 0 1), the forward loads through descriptors by default (faster at every head dim), the
backward through pointers (within 2 % at d = 128 and 256, slower at 64). No warp specialisation:
Triton 3.6 does not apply it on sm_90 (a loop marked ``tl.range(..., warp_specialize=True)``
compiles to the same PTX, with pointer or descriptor loads), so one set of warps issues the loads,
both products and the softmax of each tile in turn.

Performance: fast for long sequences with head dims 64/128; masks cost only on edge tiles; a cheap
score_mod (ALiBi, soft-cap) costs a few elementwise ops per score. Slow cases: short sequences with
many heads (launch-bound), head dim 256 in the backward (register pressure: 64-row tiles), and
fp32 inputs (IEEE dots).

References: Dao, "FlashAttention-2" (2023); Shah et al., "FlashAttention-3" (2024); the Triton
fused-attention tutorial; PyTorch FlexAttention (Dong et al., 2024).
"""

from __future__ import annotations

import functools
import types
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources
from triton.tools.tensor_descriptor import TensorDescriptor

from ._accumulate import store_accumulated
from ._dropout import _dropout_keep, _dropout_keep_at, _dropout_key, dropout_threshold
from ._library import cdiv, fast_launch, merge_config, next_pow2
from ._attention_hopper import head_placement, hopper_fwd, hopper_supported
from ._attention_hopper_bwd import (
    SCORE_MODE_NATURAL,
    SCORE_MODE_NO_GRAD,
    SCORE_MODE_NONE,
    SCORE_MODE_RELATIVE,
    band_and,
    hopper_bwd,
    hopper_bwd_supported,
)

__all__ = [
    "MASKED_ROW_LSE",
    "MAX_MOD_BUFFERS",
    "MODMATH_TRITON",
    "NO_BOUND",
    "AttentionKernels",
    "attention_bwd_launch",
    "attention_fwd_launch",
    "band_and",
    "document_bounds",
    "hopper_bwd_score_mode",
    "resolve_dq_mode",
    "specialize",
]

MASKED_ROW_LSE = -1.0e30
"""LSE written for a query row that sees no key (its output is 0)."""

NO_BOUND = 1 << 30
"""Window bound meaning "unbounded" (any sequence is shorter)."""

MAX_MOD_BUFFERS = 4
"""Captured tensors per mod (kernel pointer slots)."""

_MASKED_LSE = tl.constexpr(MASKED_ROW_LSE)
_LOG2E = tl.constexpr(1.4426950408889634)
_LN2 = tl.constexpr(0.6931471805599453)
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# ------------------------------------------------------------------------------------------------
# Triton twins of fp8ops.modmath (the small math namespace that mods may use).


@triton.jit
def _mm_exp(x):
    return tl.exp(x.to(tl.float32))


@triton.jit
def _mm_exp2(x):
    return tl.math.exp2(x.to(tl.float32))


@triton.jit
def _mm_log(x):
    return tl.log(x.to(tl.float32))


@triton.jit
def _mm_log2(x):
    return tl.math.log2(x.to(tl.float32))


@triton.jit
def _mm_sqrt(x):
    return tl.sqrt(x.to(tl.float32))


@triton.jit
def _mm_tanh(x):
    # tanh(x) = 1 - 2 / (exp(2x) + 1): exact limits at +-inf, absolute error ~1e-7 near 0.
    return 1.0 - 2.0 / (tl.exp(2.0 * x.to(tl.float32)) + 1.0)


@triton.jit
def _mm_sigmoid(x):
    return tl.sigmoid(x.to(tl.float32))


@triton.jit
def _mm_abs(x):
    return tl.abs(x)


@triton.jit
def _mm_minimum(a, b):
    return tl.minimum(a, b)


@triton.jit
def _mm_maximum(a, b):
    return tl.maximum(a, b)


@triton.jit
def _mm_where(cond, a, b):
    return tl.where(cond, a, b)


@triton.jit
def _mm_clamp(x, lo, hi):
    return tl.minimum(tl.maximum(x, lo), hi)


@triton.jit
def _mm_load(table, index):
    return tl.load(table + index)


@triton.jit(debug=True)  # its device_assert stays in the compiled kernel
def _document_bounds_kernel(ids_ptr, out_ptr, S, BLOCK: tl.constexpr):
    # One row of non-decreasing document ids: for each position p, the run of equal ids that holds
    # it, [start, end), stored as out[2 r S + p] = start and out[2 r S + S + p] = end (a row of
    # starts, then a row of ends). Ids that decrease (a document in two runs, which a run would not
    # describe) stop the program with an error instead.
    r = tl.program_id(0)
    base = r.to(tl.int64) * S
    offs = tl.arange(0, BLOCK)
    n = tl.cdiv(S, BLOCK)
    carry = r * 0
    n_down = r * 0
    for c in range(0, n):
        p = c * BLOCK + offs
        ok = p < S
        cur = tl.load(ids_ptr + base + p, mask=ok, other=0)
        prev = tl.load(ids_ptr + base + p - 1, mask=ok & (p > 0), other=0)
        first = (p == 0) | (cur != prev)
        run = tl.maximum(tl.associative_scan(tl.where(first & ok, p, 0), 0, _mm_maximum), carry)
        tl.store(out_ptr + 2 * base + p, run, mask=ok)
        carry = tl.max(run, 0)
        n_down += tl.sum((ok & (p > 0) & (cur < prev)).to(tl.int32), 0)
    tl.device_assert(n_down == 0, "fp8ops.document_mask: the document ids were changed in place so that "
                     "they decrease; build the mask again from the new ids")
    carry = r * 0 + S
    for c2 in range(0, n):
        p = (n - 1 - c2) * BLOCK + offs
        ok = p < S
        cur = tl.load(ids_ptr + base + p, mask=ok, other=0)
        nxt = tl.load(ids_ptr + base + p + 1, mask=ok & (p + 1 < S), other=0)
        last = (p == S - 1) | (cur != nxt)
        run = tl.minimum(tl.associative_scan(tl.where(last & ok, p + 1, S), 0, _mm_minimum, reverse=True), carry)
        tl.store(out_ptr + 2 * base + S + p, run, mask=ok)
        carry = tl.min(run, 0)


def document_bounds(ids: torch.Tensor, seq: int) -> torch.Tensor:
    """The runs of equal document ids (flat and non-decreasing along each row of ``seq``
    positions): an int32 tensor of ``2 * rows * seq`` entries, the run ``[start, end)`` of position
    p of row r with start at ``2 r seq + p`` and end at ``2 r seq + seq + p``. One kernel launch, no
    host synchronisation; on the GPU, ids that decrease somewhere stop the kernel with a device-side
    assertion (CPU tensors, for the interpreter: ``ValueError``)."""
    rows = ids.numel() // seq
    if not ids.is_cuda and rows and bool((ids.view(rows, seq).diff(dim=1) < 0).any()):
        raise ValueError("fp8ops.document_mask: the document ids were changed in place so that they decrease; "
                         "build the mask again from the new ids")
    out = torch.empty(2 * rows * seq, dtype=torch.int32, device=ids.device)
    if rows:
        _document_bounds_kernel[(rows,)](ids, out, seq, BLOCK=1024, num_warps=4)
    return out


MODMATH_TRITON: dict[str, Any] = {
    "exp": _mm_exp,
    "exp2": _mm_exp2,
    "log": _mm_log,
    "log2": _mm_log2,
    "sqrt": _mm_sqrt,
    "tanh": _mm_tanh,
    "sigmoid": _mm_sigmoid,
    "abs": _mm_abs,
    "minimum": _mm_minimum,
    "maximum": _mm_maximum,
    "where": _mm_where,
    "clamp": _mm_clamp,
    "load": _mm_load,
}
"""modmath function name -> its ``@triton.jit`` implementation (used by generated mod code)."""


# ------------------------------------------------------------------------------------------------
# Defaults of the mod globals (replaced in specialized kernels).


@triton.jit
def _identity_score_mod(score, b, h, q_idx, kv_idx, t0, t1, t2, t3):
    return score


@triton.jit
def _identity_score_grad(ds, score, b, h, q_idx, kv_idx, valid, t0, t1, t2, t3, g0, g1, g2, g3):
    return ds


@triton.jit
def _all_visible(b, h, q_idx, kv_idx, t0, t1, t2, t3):
    return (q_idx >= 0) | (kv_idx >= 0)


SCORE_MOD = _identity_score_mod
SCORE_GRAD = _identity_score_grad
SCORE_GRAD_DQ = _identity_score_grad
MASK_MOD = _all_visible


# ------------------------------------------------------------------------------------------------
# Shared helpers


@triton.jit
def _load_tile(ptrs, row_ok, col_ok, CHECK_ROWS: tl.constexpr, CHECK_COLS: tl.constexpr):
    # A masked 2-D load (rows x cols), masks compiled in only where needed.
    if CHECK_ROWS:
        if CHECK_COLS:
            x = tl.load(ptrs, mask=row_ok[:, None] & col_ok[None, :], other=0.0)
        else:
            x = tl.load(ptrs, mask=row_ok[:, None], other=0.0)
    else:
        if CHECK_COLS:
            x = tl.load(ptrs, mask=col_ok[None, :], other=0.0)
        else:
            x = tl.load(ptrs)
    return x


@triton.jit
def _head_ptr(ptr, b, h, row, stride_b, stride_h, stride_s):
    # Pointer to row `row` of head (b, h) of a (B, H, S, ...) tensor, in 64-bit offsets.
    return ptr + b.to(tl.int64) * stride_b + h.to(tl.int64) * stride_h + row.to(tl.int64) * stride_s


@triton.jit
def _desc_tile(desc, outer, row, col, ROWS: tl.constexpr, COLS: tl.constexpr):
    # A (ROWS, COLS) tile of a 3-D (outer, sequence, columns) tensor descriptor (TMA on sm_90):
    # sequence rows row.., columns col..; rows past the sequence read as zeros.
    return desc.load([outer, row, col]).reshape(ROWS, COLS)


@triton.jit
def _block_lists(b, h, row, stride_nb, stride_nh, stride_nm, stride_ib, stride_ih, stride_im):
    # Offsets of the block-mask list of block row `row` of (b, h): (into the counts, into the indices).
    n_off = b * stride_nb + h * stride_nh + row * stride_nm
    i_off = b.to(tl.int64) * stride_ib + h.to(tl.int64) * stride_ih + row.to(tl.int64) * stride_im
    return n_off, i_off


@triton.jit
def _query_program(cu_q_ptr, cu_kv_ptr, seq_q, seq_kv, REVERSE: tl.constexpr, VARLEN: tl.constexpr,
                   BLOCK_M: tl.constexpr):
    # This program's query tile (axis 0; the last tile first with REVERSE), head (axis 1) and
    # sequence (axis 2): (b, h, m0, q_start, q_len, kv_start, kv_len), m0 the tile's first row.
    pid_m = tl.program_id(0)
    if REVERSE:
        pid_m = tl.num_programs(0) - 1 - pid_m
    h = tl.program_id(1)
    b = tl.program_id(2)
    q_start, q_len, kv_start, kv_len = _seq_bounds(cu_q_ptr, cu_kv_ptr, b, seq_q, seq_kv, VARLEN=VARLEN)
    m0 = pid_m * BLOCK_M
    return b, h, m0, q_start, q_len, kv_start, kv_len


@triton.jit
def _seq_bounds(cu_q_ptr, cu_kv_ptr, b, seq_q, seq_kv, VARLEN: tl.constexpr):
    # (q_start, q_len, kv_start, kv_len) of sequence b.
    if VARLEN:
        q_start = tl.load(cu_q_ptr + b)
        q_len = tl.load(cu_q_ptr + b + 1) - q_start
        kv_start = tl.load(cu_kv_ptr + b)
        kv_len = tl.load(cu_kv_ptr + b + 1) - kv_start
    else:
        q_start = b * 0
        q_len = seq_q + b * 0
        kv_start = b * 0
        kv_len = seq_kv + b * 0
    return q_start, q_len, kv_start, kv_len


@triton.jit
def _kv_range(m0, m1, kv_len, win_left, win_right, BAND: tl.constexpr, BLOCK_N: tl.constexpr):
    # Key range of query rows [m0, m1): (lo, full_lo, full_hi, hi). Tiles in [full_lo, full_hi)
    # are inside the band and the sequence for every row (no masking); [lo, full_lo) and
    # [full_hi, hi) are edge tiles. All values are >= 0 before any division (C-style division).
    if BAND:
        lo = tl.maximum(m0 - win_left, 0)
        hi = tl.minimum(kv_len, m1 + win_right)
        lo = (lo // BLOCK_N) * BLOCK_N
        full_lo = tl.maximum(m1 - 1 - win_left, 0)
        full_lo = tl.maximum(((full_lo + BLOCK_N - 1) // BLOCK_N) * BLOCK_N, lo)
        full_hi = tl.minimum(((m0 + win_right + 1) // BLOCK_N) * BLOCK_N, (kv_len // BLOCK_N) * BLOCK_N)
        full_hi = tl.maximum(full_hi, full_lo)
    else:
        lo = kv_len * 0
        hi = kv_len
        full_lo = lo
        full_hi = (kv_len // BLOCK_N) * BLOCK_N
    return lo, full_lo, full_hi, hi


@triton.jit
def _q_range(n0, n1, owned_full, q_len, win_left, win_right, BAND: tl.constexpr, BLOCK_M: tl.constexpr):
    # Query range that sees keys [n0, n1) (the mirror of _kv_range): (lo, full_lo, full_hi, hi).
    if BAND:
        lo = tl.maximum(n0 - win_right, 0)
        hi = tl.minimum(q_len, n1 + win_left)
        lo = (lo // BLOCK_M) * BLOCK_M
        full_lo = tl.maximum(n1 - 1 - win_right, 0)
        full_lo = tl.maximum(((full_lo + BLOCK_M - 1) // BLOCK_M) * BLOCK_M, lo)
        full_hi = tl.minimum(((n0 + win_left + 1) // BLOCK_M) * BLOCK_M, (q_len // BLOCK_M) * BLOCK_M)
    else:
        lo = q_len * 0
        hi = q_len
        full_lo = lo
        full_hi = (q_len // BLOCK_M) * BLOCK_M
    full_lo = tl.where(owned_full, full_lo, lo)
    full_hi = tl.where(owned_full, tl.maximum(full_hi, full_lo), lo)
    return lo, full_lo, full_hi, hi


@triton.jit
def _visible(q_rows, kv_cols, q_len, kv_len, b, h, win_left, win_right,
             mm_t0, mm_t1, mm_t2, mm_t3, MASK_FN: tl.constexpr,
             CHECK_Q: tl.constexpr, CHECK_KV: tl.constexpr, CHECK_BAND: tl.constexpr, APPLY_MASK_MOD: tl.constexpr):
    # Visibility of a tile; q_rows and kv_cols are broadcastable index tiles (rows x 1, 1 x cols or
    # transposed). Returns a full-shape bool tile.
    vis = (q_rows >= 0) & (kv_cols >= 0)
    if CHECK_Q:
        vis = vis & (q_rows < q_len)
    if CHECK_KV:
        vis = vis & (kv_cols < kv_len)
    if CHECK_BAND:
        vis = vis & (q_rows - kv_cols <= win_left) & (kv_cols - q_rows <= win_right)
    if APPLY_MASK_MOD:
        qc = tl.minimum(q_rows, q_len - 1)
        kc = tl.minimum(kv_cols, kv_len - 1)
        vis = vis & MASK_FN(b, h, qc, kc, mm_t0, mm_t1, mm_t2, mm_t3)
    return vis


# ------------------------------------------------------------------------------------------------
# Forward


@triton.jit
def _attn_fwd_tiles(
    m_i, l_i, acc,  # running row max (base 2), row sum and output accumulator of the query tile
    q,
    k_base,  # pointer to k[b, hk, seq_start]; rows at stride_ks
    v_base,  # pointer to v[b, hk, seq_start]
    start, stop,  # [start, stop) in BLOCK_N steps, or (LIST) tiles [start, stop) of the listed blocks
    idx_ptr,  # LIST: the block-mask list of key blocks (SPARSE_KV keys each)
    q_len, kv_len, offs_m, offs_d, offs_dv,
    stride_ks, stride_kd, stride_vs, stride_vd,
    qk_scale, sm_scale, b, h, win_left, win_right,
    sm_t0, sm_t1, sm_t2, sm_t3, mm_t0, mm_t1, mm_t2, mm_t3,
    drop_key, drop_thresh, kds_base, vds_base,
    k_desc, v_desc, k_outer, k_col, v_outer, v_col, tma_row0,  # TMA: descriptors, this head's place, 1st row
    SCORE_FN: tl.constexpr, MASK_FN: tl.constexpr,
    HAS_SCORE_MOD: tl.constexpr, APPLY_MASK_MOD: tl.constexpr, CHECK_KV: tl.constexpr,
    CHECK_BAND: tl.constexpr, DROPOUT: tl.constexpr, HAS_DESCALE: tl.constexpr, DESCALE_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
    LIST: tl.constexpr = False, SPARSE_KV: tl.constexpr = 1, TMA: tl.constexpr = False,
    ZERO_TAIL: tl.constexpr = False,
):
    # The key tiles of one query tile, in order: scores, online softmax, P V. LIST: tile j of the listed
    # blocks (SPARSE_KV // BLOCK_N per block) in one loop, so the next block's loads pipeline as in a range.
    per_block = SPARSE_KV // BLOCK_N
    for j in range(start, stop, 1 if LIST else BLOCK_N):
        start_n = j
        if LIST:
            start_n = tl.load(idx_ptr + j // per_block) * SPARSE_KV + (j % per_block) * BLOCK_N
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kv_ok = offs_n < kv_len
        # Step 1: K tile (BLOCK_N, D) and the scores (BLOCK_M, BLOCK_N), fp32.
        if TMA:
            k = _desc_tile(k_desc, k_outer, tma_row0 + start_n, k_col, BLOCK_N, BLOCK_D)
        else:
            k_ptrs = k_base + offs_n[:, None] * stride_ks + offs_d[None, :] * stride_kd
            k = _load_tile(k_ptrs, kv_ok, offs_d < HEAD_DIM, CHECK_ROWS=CHECK_KV, CHECK_COLS=BLOCK_D != HEAD_DIM)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if HAS_DESCALE:
            qk = qk * tl.load(kds_base + start_n // DESCALE_KV)
        # Step 2: score_mod in natural units, then base-2 units.
        if HAS_SCORE_MOD:
            s = qk * sm_scale
            qc = tl.minimum(offs_m, q_len - 1)[:, None]
            kc = tl.minimum(offs_n, kv_len - 1)[None, :]
            s = SCORE_FN(s, b, h, qc, kc, sm_t0, sm_t1, sm_t2, sm_t3).to(tl.float32)
            s2 = s * _LOG2E
        else:
            s2 = qk * qk_scale
        # Step 3: visibility (edge tiles only).
        if CHECK_KV or CHECK_BAND or APPLY_MASK_MOD:
            vis = _visible(offs_m[:, None], offs_n[None, :], q_len, kv_len, b, h, win_left, win_right,
                           mm_t0, mm_t1, mm_t2, mm_t3, MASK_FN=MASK_FN, CHECK_Q=False, CHECK_KV=CHECK_KV,
                           CHECK_BAND=CHECK_BAND, APPLY_MASK_MOD=APPLY_MASK_MOD)
            s2 = tl.where(vis, s2, float("-inf"))
        # Step 4: online softmax update; a row with no visible key so far keeps m = -inf, l = 0.
        m_new = tl.maximum(m_i, tl.max(s2, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s2 - m_use[:, None])
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if DROPOUT:
            # the plain form: with m0 split off (as in the backward kernels) this forward measured 0.831
            # against 0.790 ms at the seed layer's shape on an H200
            keep = _dropout_keep(drop_key, offs_m[:, None], offs_n[None, :], drop_thresh)
            p = tl.where(keep, p, 0.0)
        # Step 5: P V, with P in V's dtype (bf16/fp16 now, FP8 later).
        if TMA:
            v = _desc_tile(v_desc, v_outer, tma_row0 + start_n, v_col, BLOCK_N, BLOCK_DV)
            if ZERO_TAIL and CHECK_KV:  # packed: rows past this sequence are the next one's
                v = tl.where(kv_ok[:, None], v, 0.0)
        else:
            v_ptrs = v_base + offs_n[:, None] * stride_vs + offs_dv[None, :] * stride_vd
            v = _load_tile(v_ptrs, kv_ok, offs_dv < HEAD_DIM_V, CHECK_ROWS=CHECK_KV, CHECK_COLS=BLOCK_DV != HEAD_DIM_V)
        if HAS_DESCALE:
            acc += tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION) * tl.load(vds_base + start_n // DESCALE_KV)
        else:
            acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
        m_i = m_new
    return m_i, l_i, acc


def _attention_fwd_kernel(
    q_ptr,  # (B, Hq, Sq, D) through strides, or packed (Tq, Hq, D) with stride_qb = 0 (VARLEN)
    k_ptr,  # (B, Hkv, Skv, D) / (Tkv, Hkv, D)
    v_ptr,  # (B, Hkv, Skv, Dv) / (Tkv, Hkv, Dv)
    o_ptr,  # (B, Hq, Sq, Dv) output, q's dtype
    lse_ptr,  # (B, Hq, Sq) fp32 output: natural-log LSE
    stride_qb, stride_qh, stride_qs, stride_qd,  # strides of q along (B, H, S, D)
    stride_kb, stride_kh, stride_ks, stride_kd,  # strides of k along (B, H, S, D)
    stride_vb, stride_vh, stride_vs, stride_vd,  # strides of v along (B, H, S, D)
    stride_ob, stride_oh, stride_os, stride_od,  # strides of out along (B, H, S, D)
    stride_lb, stride_lh, stride_ls,  # strides of lse along (B, H, S)
    cu_q_ptr,  # (B + 1,) int32 sequence starts in the packed q (VARLEN), or None
    cu_kv_ptr,  # (B + 1,) int32 sequence starts in the packed k/v (VARLEN), or None
    seq_q, seq_kv, group, sm_scale, win_left, win_right,  # lengths (dense), Hq // Hkv, scale, band bounds
    kvn_ptr,  # (B', H', NQ) int32: partial key blocks per query block (BLOCK_SPARSE)
    kvi_ptr,  # (B', H', NQ, NKV) int32: their indices
    fkvn_ptr,  # (B', H', NQ) int32: full key blocks per query block
    fkvi_ptr,  # (B', H', NQ, NKV) int32: their indices
    stride_nb, stride_nh, stride_nm,  # strides of the count tensors (0 on broadcast dims)
    stride_ib, stride_ih, stride_im,  # strides of the index tensors (last dim unit)
    sm_t0, sm_t1, sm_t2, sm_t3,  # score_mod captured tensors (flat), or None
    mm_t0, mm_t1, mm_t2, mm_t3,  # mask_mod captured tensors (flat), or None
    seed_ptr,  # () int64 dropout seed (DROPOUT), or None
    drop_thresh, drop_scale,
    qds_ptr,  # (B, Hq, ceil(Sq / DESCALE_Q)) fp32 descales of q (HAS_DESCALE), or None
    kds_ptr,  # (B, Hkv, ceil(Skv / DESCALE_KV)) fp32 descales of k
    vds_ptr,  # (B, Hkv, ceil(Skv / DESCALE_KV)) fp32 descales of v
    stride_dqb, stride_dqh, stride_dkb, stride_dkh,  # strides of the q / kv descales along (B, H)
    q_desc, k_desc, v_desc,  # TMA: 3-D (outer, sequence, columns) tensor descriptors, or None
    q_ob, q_oh, q_cb, q_ch,  # TMA: head (b, h) of q at outer index b*q_ob + h*q_oh, column b*q_cb + h*q_ch
    k_ob, k_oh, k_cb, k_ch,  # the same for k
    v_ob, v_oh, v_cb, v_ch,  # and v
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    VARLEN: tl.constexpr, BAND: tl.constexpr, HAS_SCORE_MOD: tl.constexpr, HAS_MASK_MOD: tl.constexpr,
    BLOCK_SPARSE: tl.constexpr, SPARSE_Q: tl.constexpr, SPARSE_KV: tl.constexpr, DROPOUT: tl.constexpr,
    HAS_DESCALE: tl.constexpr, DESCALE_Q: tl.constexpr, DESCALE_KV: tl.constexpr,
    REVERSE: tl.constexpr, DOT_PRECISION: tl.constexpr, TMA: tl.constexpr = False,
):
    # Step 1: program coordinates; causal-like bands run the longest query tiles first.
    b, h, m0, q_start, q_len, kv_start, kv_len = _query_program(cu_q_ptr, cu_kv_ptr, seq_q, seq_kv, REVERSE=REVERSE,
                                                                VARLEN=VARLEN, BLOCK_M=BLOCK_M)
    if m0 >= q_len:
        return
    hk = h // group
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q_ok = offs_m < q_len

    # Step 2: the query tile stays in registers.
    if TMA:
        q = _desc_tile(q_desc, b * q_ob + h * q_oh, q_start + m0, b * q_cb + h * q_ch, BLOCK_M, BLOCK_D)
    else:
        q_base = _head_ptr(q_ptr, b, h, q_start + m0, stride_qb, stride_qh, stride_qs)
        q_ptrs = q_base + tl.arange(0, BLOCK_M)[:, None] * stride_qs + offs_d[None, :] * stride_qd
        q = _load_tile(q_ptrs, q_ok, offs_d < HEAD_DIM, CHECK_ROWS=True, CHECK_COLS=BLOCK_D != HEAD_DIM)
    k_base = _head_ptr(k_ptr, b, hk, kv_start, stride_kb, stride_kh, stride_ks)
    v_base = _head_ptr(v_ptr, b, hk, kv_start, stride_vb, stride_vh, stride_vs)
    k_outer, k_col = b * k_ob + hk * k_oh, b * k_cb + hk * k_ch
    v_outer, v_col = b * v_ob + hk * v_oh, b * v_cb + hk * v_ch

    qk_scale = sm_scale * _LOG2E
    kds_base = kds_ptr
    vds_base = vds_ptr
    if HAS_DESCALE:
        qk_scale = qk_scale * tl.load(qds_ptr + b * stride_dqb + h * stride_dqh + m0 // DESCALE_Q)
        sm_scale = sm_scale * tl.load(qds_ptr + b * stride_dqb + h * stride_dqh + m0 // DESCALE_Q)
        kds_base = kds_ptr + b * stride_dkb + hk * stride_dkh
        vds_base = vds_ptr + b * stride_dkb + hk * stride_dkh
    drop_key = b.to(tl.uint32)
    if DROPOUT:
        drop_key = _dropout_key(seed_ptr, b, h)

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_DV), tl.float32)

    if BLOCK_SPARSE:
        # Step 3a: the block mask's lists for this query block: partial blocks (mask_mod evaluated),
        # then full ones (mask_mod skipped).
        n_off, i_off = _block_lists(b, h, m0 // SPARSE_Q, stride_nb, stride_nh, stride_nm,
                                    stride_ib, stride_ih, stride_im)
        for full in tl.static_range(2):
            num = tl.load((fkvn_ptr if full else kvn_ptr) + n_off)
            m_i, l_i, acc = _attn_fwd_tiles(
                m_i, l_i, acc, q, k_base, v_base, 0, num * (SPARSE_KV // BLOCK_N),
                (fkvi_ptr if full else kvi_ptr) + i_off,
                q_len, kv_len, offs_m, offs_d, offs_dv, stride_ks, stride_kd, stride_vs, stride_vd,
                qk_scale, sm_scale, b, h, win_left, win_right, sm_t0, sm_t1, sm_t2, sm_t3,
                mm_t0, mm_t1, mm_t2, mm_t3, drop_key, drop_thresh, kds_base, vds_base,
                k_desc, v_desc, k_outer, k_col, v_outer, v_col, kv_start,
                APPLY_MASK_MOD=HAS_MASK_MOD and not full, CHECK_KV=True, CHECK_BAND=BAND,
                SCORE_FN=SCORE_MOD, MASK_FN=MASK_MOD, HAS_SCORE_MOD=HAS_SCORE_MOD, DROPOUT=DROPOUT,
                HAS_DESCALE=HAS_DESCALE, DESCALE_KV=DESCALE_KV, HEAD_DIM=HEAD_DIM, HEAD_DIM_V=HEAD_DIM_V,
                BLOCK_D=BLOCK_D, BLOCK_DV=BLOCK_DV, BLOCK_N=BLOCK_N, DOT_PRECISION=DOT_PRECISION,
                LIST=True, SPARSE_KV=SPARSE_KV, TMA=TMA, ZERO_TAIL=TMA and VARLEN)
    else:
        # Step 3b: the band's key range: masked edge tiles [lo, full_lo) and [full_hi, hi) around
        # the unmasked tiles [full_lo, full_hi), visited in that order.
        lo, full_lo, full_hi, hi = _kv_range(m0, tl.minimum(m0 + BLOCK_M, q_len), kv_len, win_left, win_right,
                                             BAND=BAND, BLOCK_N=BLOCK_N)
        for part in tl.static_range(3):
            edge = part != 1
            m_i, l_i, acc = _attn_fwd_tiles(
                m_i, l_i, acc, q, k_base, v_base,
                lo if part == 0 else (full_lo if part == 1 else full_hi),
                full_lo if part == 0 else (full_hi if part == 1 else hi), kvi_ptr,
                q_len, kv_len, offs_m, offs_d, offs_dv, stride_ks, stride_kd, stride_vs, stride_vd,
                qk_scale, sm_scale, b, h, win_left, win_right, sm_t0, sm_t1, sm_t2, sm_t3,
                mm_t0, mm_t1, mm_t2, mm_t3, drop_key, drop_thresh, kds_base, vds_base,
                k_desc, v_desc, k_outer, k_col, v_outer, v_col, kv_start,
                APPLY_MASK_MOD=HAS_MASK_MOD, CHECK_KV=edge, CHECK_BAND=BAND and edge,
                SCORE_FN=SCORE_MOD, MASK_FN=MASK_MOD, HAS_SCORE_MOD=HAS_SCORE_MOD, DROPOUT=DROPOUT,
                HAS_DESCALE=HAS_DESCALE, DESCALE_KV=DESCALE_KV, HEAD_DIM=HEAD_DIM, HEAD_DIM_V=HEAD_DIM_V,
                BLOCK_D=BLOCK_D, BLOCK_DV=BLOCK_DV, BLOCK_N=BLOCK_N, DOT_PRECISION=DOT_PRECISION, TMA=TMA,
                ZERO_TAIL=TMA and VARLEN)

    # Step 4: normalise once; rows that saw nothing give 0 and MASKED_ROW_LSE.
    seen = l_i > 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    out = acc / l_safe[:, None]
    if DROPOUT:
        out = out * drop_scale
    lse = tl.where(seen, (m_i + tl.math.log2(l_safe)) * _LN2, _MASKED_LSE)
    o_base = _head_ptr(o_ptr, b, h, q_start + m0, stride_ob, stride_oh, stride_os)
    o_ptrs = o_base + tl.arange(0, BLOCK_M)[:, None] * stride_os + offs_dv[None, :] * stride_od
    if BLOCK_DV != HEAD_DIM_V:
        tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=q_ok[:, None] & (offs_dv < HEAD_DIM_V)[None, :])
    else:
        tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=q_ok[:, None])
    l_base = _head_ptr(lse_ptr, b, h, q_start + m0, stride_lb, stride_lh, stride_ls)
    tl.store(l_base + tl.arange(0, BLOCK_M) * stride_ls, lse, mask=q_ok)


# ------------------------------------------------------------------------------------------------
# Backward


def _attention_bwd_preprocess_kernel(
    o_ptr,  # (B, Hq, Sq, Dv) forward output
    do_ptr,  # (B, Hq, Sq, Dv) output gradient
    dlse_ptr,  # (B, Hq, Sq) gradient of the LSE, or None
    delta_ptr,  # (B, Hq, Sq) fp32 output: rowsum(o * do) - dlse (lse's strides)
    stride_ob, stride_oh, stride_os, stride_od,  # strides of out along (B, H, S, D)
    stride_gb, stride_gh, stride_gs, stride_gd,  # strides of do along (B, H, S, D)
    stride_eb, stride_eh, stride_es,  # of dlse
    stride_lb, stride_lh, stride_ls,  # of delta (= lse)
    cu_q_ptr, seq_q,
    HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr,
    VARLEN: tl.constexpr, HAS_DLSE: tl.constexpr,
):
    b, h, m0, q_start, q_len, _, _ = _query_program(cu_q_ptr, cu_q_ptr, seq_q, seq_q, REVERSE=False, VARLEN=VARLEN,
                                                    BLOCK_M=BLOCK_M)
    if m0 >= q_len:
        return
    rows = tl.arange(0, BLOCK_M)
    offs_dv = tl.arange(0, BLOCK_DV)
    ok = (m0 + rows) < q_len
    # Step 1: delta = rowsum(o * do) in fp32.
    pos = (q_start + m0).to(tl.int64)
    o = tl.load(_head_ptr(o_ptr, b, h, pos, stride_ob, stride_oh, stride_os)
                + rows[:, None] * stride_os + offs_dv[None, :] * stride_od,
                mask=ok[:, None] & (offs_dv < HEAD_DIM_V)[None, :], other=0.0).to(tl.float32)
    do = tl.load(_head_ptr(do_ptr, b, h, pos, stride_gb, stride_gh, stride_gs)
                 + rows[:, None] * stride_gs + offs_dv[None, :] * stride_gd,
                 mask=ok[:, None] & (offs_dv < HEAD_DIM_V)[None, :], other=0.0).to(tl.float32)
    delta = tl.sum(o * do, axis=1)
    # Step 2: a gradient flowing into the LSE enters as -dlse (d lse / d s = p).
    if HAS_DLSE:
        delta -= tl.load(_head_ptr(dlse_ptr, b, h, pos, stride_eb, stride_eh, stride_es)
                         + rows * stride_es, mask=ok, other=0.0).to(tl.float32)
    tl.store(_head_ptr(delta_ptr, b, h, pos, stride_lb, stride_lh, stride_ls) + rows * stride_ls,
             delta, mask=ok)


@triton.jit
def _attn_bwd_dkdv_tiles(
    dk, dv, k, v,
    q_base,  # pointer to q[b, hq, seq_start]
    do_base,  # pointer to do[b, hq, seq_start]
    l_base,  # pointer to lse[b, hq, seq_start]
    e_base,  # pointer to delta[b, hq, seq_start]
    dq_base,  # pointer to the fp32 dq accumulator [b, hq, seq_start] (ATOMIC_DQ)
    start, stop,  # [start, stop) in BLOCK_M steps, or (LIST) tiles [start, stop) of the listed blocks
    idx_ptr,  # LIST: the block-mask list of query blocks (SPARSE_Q rows each)
    q_len, kv_len, offs_n, offs_d, offs_dv,
    stride_qs, stride_qd, stride_gs, stride_gd, stride_ls, stride_as, stride_ad,
    qk_scale, sm_scale, b, h, win_left, win_right,
    sm_t0, sm_t1, sm_t2, sm_t3, mm_t0, mm_t1, mm_t2, mm_t3, g0, g1, g2, g3,
    drop_key, drop_thresh, drop_scale,
    q_desc, do_desc, q_outer, q_col, g_outer, g_col, tma_row0,  # TMA: descriptors, this head's place, 1st row
    SCORE_FN: tl.constexpr, GRAD_FN: tl.constexpr, MASK_FN: tl.constexpr,
    HAS_SCORE_MOD: tl.constexpr, MASKED: tl.constexpr, CHECK_BAND: tl.constexpr, APPLY_MASK_MOD: tl.constexpr,
    DROPOUT: tl.constexpr, ATOMIC_DQ: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
    LIST: tl.constexpr = False, SPARSE_Q: tl.constexpr = 1, TMA: tl.constexpr = False,
    ZERO_TAIL: tl.constexpr = False,
):
    # The query tiles that see one key tile, in order: dV, dK (and dQ with atomics). LIST: tile j of the
    # listed blocks (SPARSE_Q // BLOCK_M per block) in one loop, so the next block's loads pipeline.
    per_block = SPARSE_Q // BLOCK_M
    for j in range(start, stop, 1 if LIST else BLOCK_M):
        start_m = j
        if LIST:
            start_m = tl.load(idx_ptr + j // per_block) * SPARSE_Q + (j % per_block) * BLOCK_M
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q_ok = offs_m < q_len
        # Step 1: Q and dO tiles, and the row statistics.
        if TMA:
            q = _desc_tile(q_desc, q_outer, tma_row0 + start_m, q_col, BLOCK_M, BLOCK_D)
            do = _desc_tile(do_desc, g_outer, tma_row0 + start_m, g_col, BLOCK_M, BLOCK_DV)
            if ZERO_TAIL and MASKED:  # packed: rows past this sequence are the next one's
                q = tl.where(q_ok[:, None], q, 0.0)
                do = tl.where(q_ok[:, None], do, 0.0)
        else:
            q = _load_tile(q_base + offs_m[:, None] * stride_qs + offs_d[None, :] * stride_qd, q_ok,
                           offs_d < HEAD_DIM, CHECK_ROWS=MASKED, CHECK_COLS=BLOCK_D != HEAD_DIM)
            do = _load_tile(do_base + offs_m[:, None] * stride_gs + offs_dv[None, :] * stride_gd, q_ok,
                            offs_dv < HEAD_DIM_V, CHECK_ROWS=MASKED, CHECK_COLS=BLOCK_DV != HEAD_DIM_V)
        if MASKED:
            lse2 = tl.load(l_base + offs_m * stride_ls, mask=q_ok, other=0.0) * _LOG2E
            delta = tl.load(e_base + offs_m * stride_ls, mask=q_ok, other=0.0)
        else:
            lse2 = tl.load(l_base + offs_m * stride_ls) * _LOG2E
            delta = tl.load(e_base + offs_m * stride_ls)
        # Step 2: transposed scores s^T = K Q^T (BLOCK_N, BLOCK_M) and probabilities p^T.
        qkT = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)
        if HAS_SCORE_MOD:
            sT = qkT * sm_scale
            qc = tl.minimum(offs_m, q_len - 1)[None, :]
            kc = tl.minimum(offs_n, kv_len - 1)[:, None]
            s2 = SCORE_FN(sT, b, h, qc, kc, sm_t0, sm_t1, sm_t2, sm_t3).to(tl.float32) * _LOG2E
        else:
            s2 = qkT * qk_scale
        if MASKED:
            # Masking the exponent (not the result) keeps exp2 finite for rows that see nothing.
            vis = _visible(offs_m[None, :], offs_n[:, None], q_len, kv_len, b, h, win_left, win_right,
                           mm_t0, mm_t1, mm_t2, mm_t3, MASK_FN=MASK_FN, CHECK_Q=True, CHECK_KV=True,
                           CHECK_BAND=CHECK_BAND, APPLY_MASK_MOD=APPLY_MASK_MOD)
            s2 = tl.where(vis, s2, float("-inf"))
        else:
            vis = (offs_m[None, :] >= 0) & (offs_n[:, None] >= 0)
        pT = tl.math.exp2(s2 - lse2[None, :])
        # Step 3: dV += P^T dO (dropped; scaled once at the end), dP^T = V dO^T.
        if DROPOUT:
            keep = _dropout_keep_at(drop_key, start_m, tl.arange(0, BLOCK_M)[None, :], offs_n[:, None],
                                    drop_thresh)
            dv = tl.dot(tl.where(keep, pT, 0.0).to(do.dtype), do, dv, input_precision=DOT_PRECISION)
        else:
            dv = tl.dot(pT.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
        dpT = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
        if DROPOUT:
            dpT = tl.where(keep, dpT * drop_scale, 0.0)
        # Step 4: dS^T, through score_mod's derivative (captured-tensor gradients scatter here).
        dsT = pT * (dpT - delta[None, :])
        if HAS_SCORE_MOD:
            dsT = GRAD_FN(dsT, sT, b, h, qc, kc, vis, sm_t0, sm_t1, sm_t2, sm_t3, g0, g1, g2, g3).to(tl.float32)
            dsT = tl.where(vis, dsT, 0.0)
        # Step 5: dK += dS^T Q; optionally dQ^T += K^T dS^T with atomics (fp32 accumulator).
        dk = tl.dot(dsT.to(q.dtype), q, dk, input_precision=DOT_PRECISION)
        if ATOMIC_DQ:
            dqT = tl.dot(tl.trans(k), dsT.to(k.dtype), input_precision=DOT_PRECISION) * sm_scale
            dq_ptrs = dq_base + offs_m[None, :] * stride_as + offs_d[:, None] * stride_ad
            tl.atomic_add(dq_ptrs, dqT, mask=q_ok[None, :] & (offs_d < HEAD_DIM)[:, None], sem="relaxed")
    return dk, dv


def _attention_bwd_dkdv_kernel(
    q_ptr,  # (B, Hq, Sq, D) / packed (Tq, Hq, D)
    k_ptr,  # (B, Hkv, Skv, D)
    v_ptr,  # (B, Hkv, Skv, Dv)
    do_ptr,  # (B, Hq, Sq, Dv) output gradient
    lse_ptr,  # (B, Hq, Sq) fp32 natural-log LSE from the forward
    delta_ptr,  # (B, Hq, Sq) fp32 from the preprocess kernel (lse's strides)
    dqa_ptr,  # (B, Hq, Sq, D) fp32 zero-initialised dq accumulator (ATOMIC_DQ), or None
    dk_ptr,  # (B, Hkv, Skv, D) output
    dv_ptr,  # (B, Hkv, Skv, Dv) output
    stride_qb, stride_qh, stride_qs, stride_qd,  # strides of q along (B, H, S, D)
    stride_kb, stride_kh, stride_ks, stride_kd,  # strides of k along (B, H, S, D)
    stride_vb, stride_vh, stride_vs, stride_vd,  # strides of v along (B, H, S, D)
    stride_gb, stride_gh, stride_gs, stride_gd,  # strides of do along (B, H, S, D)
    stride_ab, stride_ah, stride_as, stride_ad,  # strides of the dq accumulator along (B, H, S, D)
    stride_dkb, stride_dkh, stride_dks, stride_dkd,  # strides of dk along (B, H, S, D)
    stride_dvb, stride_dvh, stride_dvs, stride_dvd,  # strides of dv along (B, H, S, D)
    stride_lb, stride_lh, stride_ls,  # strides of lse and delta along (B, H, S)
    cu_q_ptr, cu_kv_ptr,  # (B + 1,) int32 (VARLEN), or None
    seq_q, seq_kv, group, sm_scale, win_left, win_right,  # lengths (dense), Hq // Hkv, scale, band bounds
    qn_ptr,  # (B', H', NKV) int32: partial query blocks per key block (BLOCK_SPARSE)
    qi_ptr,  # (B', H', NKV, NQ) int32: their indices
    fqn_ptr,  # (B', H', NKV) int32: full query blocks per key block
    fqi_ptr,  # (B', H', NKV, NQ) int32: their indices
    stride_nb, stride_nh, stride_nm, stride_ib, stride_ih, stride_im,  # of the block lists, as in the forward
    sm_t0, sm_t1, sm_t2, sm_t3, mm_t0, mm_t1, mm_t2, mm_t3,
    g0, g1, g2, g3,  # fp32 gradients of the score_mod tensors (flat), or None
    seed_ptr, drop_thresh, drop_scale,
    q_desc, do_desc,  # TMA: 3-D (outer, sequence, columns) tensor descriptors of q and do, or None
    q_ob, q_oh, q_cb, q_ch,  # TMA: head (b, h) of q at outer index b*q_ob + h*q_oh, column b*q_cb + h*q_ch
    g_ob, g_oh, g_cb, g_ch,  # the same for do
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    VARLEN: tl.constexpr, BAND: tl.constexpr, HAS_SCORE_MOD: tl.constexpr, HAS_MASK_MOD: tl.constexpr,
    BLOCK_SPARSE: tl.constexpr, SPARSE_Q: tl.constexpr, SPARSE_KV: tl.constexpr, DROPOUT: tl.constexpr,
    ATOMIC_DQ: tl.constexpr, DOT_PRECISION: tl.constexpr, TMA: tl.constexpr = False,
):
    # Step 1: this program's key tile, kept in registers with its dK, dV accumulators.
    pid_n = tl.program_id(0)
    hk = tl.program_id(1)
    b = tl.program_id(2)
    q_start, q_len, kv_start, kv_len = _seq_bounds(cu_q_ptr, cu_kv_ptr, b, seq_q, seq_kv, VARLEN=VARLEN)
    n0 = pid_n * BLOCK_N
    if n0 >= kv_len:
        return
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    kv_ok = offs_n < kv_len
    owned_full = n0 + BLOCK_N <= kv_len
    k_base = _head_ptr(k_ptr, b, hk, kv_start, stride_kb, stride_kh, stride_ks)
    v_base = _head_ptr(v_ptr, b, hk, kv_start, stride_vb, stride_vh, stride_vs)
    k = _load_tile(k_base + offs_n[:, None] * stride_ks + offs_d[None, :] * stride_kd, kv_ok, offs_d < HEAD_DIM,
                   CHECK_ROWS=True, CHECK_COLS=BLOCK_D != HEAD_DIM)
    v = _load_tile(v_base + offs_n[:, None] * stride_vs + offs_dv[None, :] * stride_vd, kv_ok,
                   offs_dv < HEAD_DIM_V, CHECK_ROWS=True, CHECK_COLS=BLOCK_DV != HEAD_DIM_V)
    dk = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_DV), tl.float32)
    qk_scale = sm_scale * _LOG2E
    lo, full_lo, full_hi, hi = _q_range(n0, tl.minimum(n0 + BLOCK_N, kv_len), owned_full, q_len,
                                        win_left, win_right, BAND=BAND, BLOCK_M=BLOCK_M)

    # Step 2: every query head of the GQA group, every query tile that sees this key tile.
    for g in range(0, group):
        h = hk * group + g
        seq = (q_start).to(tl.int64)
        q_base = _head_ptr(q_ptr, b, h, seq, stride_qb, stride_qh, stride_qs)
        do_base = _head_ptr(do_ptr, b, h, seq, stride_gb, stride_gh, stride_gs)
        l_base = _head_ptr(lse_ptr, b, h, seq, stride_lb, stride_lh, stride_ls)
        e_base = _head_ptr(delta_ptr, b, h, seq, stride_lb, stride_lh, stride_ls)
        q_outer, q_col = b * q_ob + h * q_oh, b * q_cb + h * q_ch
        g_outer, g_col = b * g_ob + h * g_oh, b * g_cb + h * g_ch
        dq_base = dqa_ptr
        if ATOMIC_DQ:
            dq_base = _head_ptr(dqa_ptr, b, h, seq, stride_ab, stride_ah, stride_as)
        drop_key = b.to(tl.uint32)
        if DROPOUT:
            drop_key = _dropout_key(seed_ptr, b, h)
        if BLOCK_SPARSE:
            # The block mask's lists for this key block: partial blocks (mask_mod evaluated), then
            # full ones (mask_mod skipped).
            n_off, i_off = _block_lists(b, h, n0 // SPARSE_KV, stride_nb, stride_nh, stride_nm,
                                        stride_ib, stride_ih, stride_im)
            for full in tl.static_range(2):
                num = tl.load((fqn_ptr if full else qn_ptr) + n_off)
                dk, dv = _attn_bwd_dkdv_tiles(
                    dk, dv, k, v, q_base, do_base, l_base, e_base, dq_base,
                    0, num * (SPARSE_Q // BLOCK_M), (fqi_ptr if full else qi_ptr) + i_off,
                    q_len, kv_len, offs_n, offs_d, offs_dv, stride_qs, stride_qd, stride_gs, stride_gd,
                    stride_ls, stride_as, stride_ad, qk_scale, sm_scale, b, h, win_left, win_right,
                    sm_t0, sm_t1, sm_t2, sm_t3, mm_t0, mm_t1, mm_t2, mm_t3, g0, g1, g2, g3,
                    drop_key, drop_thresh, drop_scale, q_desc, do_desc, q_outer, q_col, g_outer, g_col, q_start,
                    MASKED=True, CHECK_BAND=BAND, APPLY_MASK_MOD=HAS_MASK_MOD and not full,
                    SCORE_FN=SCORE_MOD, GRAD_FN=SCORE_GRAD, MASK_FN=MASK_MOD, HAS_SCORE_MOD=HAS_SCORE_MOD,
                    DROPOUT=DROPOUT, ATOMIC_DQ=ATOMIC_DQ, HEAD_DIM=HEAD_DIM, HEAD_DIM_V=HEAD_DIM_V,
                    BLOCK_D=BLOCK_D, BLOCK_DV=BLOCK_DV, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
                    DOT_PRECISION=DOT_PRECISION, LIST=True, SPARSE_Q=SPARSE_Q, TMA=TMA,
                    ZERO_TAIL=TMA and VARLEN)
        else:
            # Masked edge tiles [lo, full_lo) and [full_hi, hi) around the tiles [full_lo, full_hi)
            # that need no band or bounds check, visited in that order.
            for part in tl.static_range(3):
                edge = part != 1
                dk, dv = _attn_bwd_dkdv_tiles(
                    dk, dv, k, v, q_base, do_base, l_base, e_base, dq_base,
                    lo if part == 0 else (full_lo if part == 1 else full_hi),
                    full_lo if part == 0 else (full_hi if part == 1 else hi), qi_ptr,
                    q_len, kv_len, offs_n, offs_d, offs_dv, stride_qs, stride_qd, stride_gs, stride_gd,
                    stride_ls, stride_as, stride_ad, qk_scale, sm_scale, b, h, win_left, win_right,
                    sm_t0, sm_t1, sm_t2, sm_t3, mm_t0, mm_t1, mm_t2, mm_t3, g0, g1, g2, g3,
                    drop_key, drop_thresh, drop_scale, q_desc, do_desc, q_outer, q_col, g_outer, g_col, q_start,
                    MASKED=edge or HAS_MASK_MOD, CHECK_BAND=BAND and edge, APPLY_MASK_MOD=HAS_MASK_MOD,
                    SCORE_FN=SCORE_MOD, GRAD_FN=SCORE_GRAD, MASK_FN=MASK_MOD, HAS_SCORE_MOD=HAS_SCORE_MOD,
                    DROPOUT=DROPOUT, ATOMIC_DQ=ATOMIC_DQ, HEAD_DIM=HEAD_DIM, HEAD_DIM_V=HEAD_DIM_V,
                    BLOCK_D=BLOCK_D, BLOCK_DV=BLOCK_DV, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
                    DOT_PRECISION=DOT_PRECISION, TMA=TMA, ZERO_TAIL=TMA and VARLEN)

    # Step 3: store dK and dV (scaled once); rows past the sequence end are not written.
    dk = dk * sm_scale
    if DROPOUT:
        dv = dv * drop_scale
    row0 = (kv_start + n0).to(tl.int64)
    dk_base = _head_ptr(dk_ptr, b, hk, row0, stride_dkb, stride_dkh, stride_dks)
    dv_base = _head_ptr(dv_ptr, b, hk, row0, stride_dvb, stride_dvh, stride_dvs)
    rows = tl.arange(0, BLOCK_N)
    tl.store(dk_base + rows[:, None] * stride_dks + offs_d[None, :] * stride_dkd, dk.to(dk_ptr.dtype.element_ty),
             mask=kv_ok[:, None] & (offs_d < HEAD_DIM)[None, :])
    tl.store(dv_base + rows[:, None] * stride_dvs + offs_dv[None, :] * stride_dvd, dv.to(dv_ptr.dtype.element_ty),
             mask=kv_ok[:, None] & (offs_dv < HEAD_DIM_V)[None, :])


@triton.jit
def _attn_bwd_dq_tiles(
    dq, q, do, lse2, delta,
    k_base, v_base,
    start, stop,  # [start, stop) in BLOCK_N steps, or (LIST) tiles [start, stop) of the listed blocks
    idx_ptr,  # LIST: the block-mask list of key blocks (SPARSE_KV keys each)
    q_len, kv_len, offs_m, m0, offs_d, offs_dv,
    stride_ks, stride_kd, stride_vs, stride_vd,
    qk_scale, sm_scale, b, h, win_left, win_right,
    sm_t0, sm_t1, sm_t2, sm_t3, mm_t0, mm_t1, mm_t2, mm_t3,
    drop_key, drop_thresh, drop_scale,
    k_desc, v_desc, k_outer, k_col, v_outer, v_col, tma_row0,  # TMA: descriptors, this head's place, 1st row
    SCORE_FN: tl.constexpr, GRAD_FN: tl.constexpr, MASK_FN: tl.constexpr,
    HAS_SCORE_MOD: tl.constexpr, APPLY_MASK_MOD: tl.constexpr, CHECK_KV: tl.constexpr, CHECK_BAND: tl.constexpr,
    DROPOUT: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
    LIST: tl.constexpr = False, SPARSE_KV: tl.constexpr = 1, TMA: tl.constexpr = False,
    ZERO_TAIL: tl.constexpr = False,
):
    # The key tiles seen by one query tile, in order: dS, then dQ += dS K. LIST: tile j of the listed
    # blocks (SPARSE_KV // BLOCK_N per block) in one loop, so the next block's loads pipeline.
    per_block = SPARSE_KV // BLOCK_N
    for j in range(start, stop, 1 if LIST else BLOCK_N):
        start_n = j
        if LIST:
            start_n = tl.load(idx_ptr + j // per_block) * SPARSE_KV + (j % per_block) * BLOCK_N
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kv_ok = offs_n < kv_len
        # Step 1: K, V tiles; scores and probabilities (BLOCK_M, BLOCK_N).
        if TMA:
            k = _desc_tile(k_desc, k_outer, tma_row0 + start_n, k_col, BLOCK_N, BLOCK_D)
            v = _desc_tile(v_desc, v_outer, tma_row0 + start_n, v_col, BLOCK_N, BLOCK_DV)
            if ZERO_TAIL and CHECK_KV:  # packed: rows past this sequence are the next one's
                k = tl.where(kv_ok[:, None], k, 0.0)
                v = tl.where(kv_ok[:, None], v, 0.0)
        else:
            k = _load_tile(k_base + offs_n[:, None] * stride_ks + offs_d[None, :] * stride_kd, kv_ok,
                           offs_d < HEAD_DIM, CHECK_ROWS=CHECK_KV, CHECK_COLS=BLOCK_D != HEAD_DIM)
            v = _load_tile(v_base + offs_n[:, None] * stride_vs + offs_dv[None, :] * stride_vd, kv_ok,
                           offs_dv < HEAD_DIM_V, CHECK_ROWS=CHECK_KV, CHECK_COLS=BLOCK_DV != HEAD_DIM_V)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if HAS_SCORE_MOD:
            s = qk * sm_scale
            qc = tl.minimum(offs_m, q_len - 1)[:, None]
            kc = tl.minimum(offs_n, kv_len - 1)[None, :]
            s2 = SCORE_FN(s, b, h, qc, kc, sm_t0, sm_t1, sm_t2, sm_t3).to(tl.float32) * _LOG2E
        else:
            s2 = qk * qk_scale
        if CHECK_KV or CHECK_BAND or APPLY_MASK_MOD:
            vis = _visible(offs_m[:, None], offs_n[None, :], q_len, kv_len, b, h, win_left, win_right,
                           mm_t0, mm_t1, mm_t2, mm_t3, MASK_FN=MASK_FN, CHECK_Q=False, CHECK_KV=CHECK_KV,
                           CHECK_BAND=CHECK_BAND, APPLY_MASK_MOD=APPLY_MASK_MOD)
            s2 = tl.where(vis, s2, float("-inf"))
        else:
            vis = (offs_m[:, None] >= 0) & (offs_n[None, :] >= 0)
        p = tl.math.exp2(s2 - lse2[:, None])
        # Step 2: dP = dO V^T, dS = P (dP - delta), through score_mod's derivative.
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        if DROPOUT:
            keep = _dropout_keep_at(drop_key, m0, (offs_m - m0)[:, None], offs_n[None, :], drop_thresh)
            dp = tl.where(keep, dp * drop_scale, 0.0)
        ds = p * (dp - delta[:, None])
        if HAS_SCORE_MOD:
            ds = GRAD_FN(ds, s, b, h, qc, kc, vis, sm_t0, sm_t1, sm_t2, sm_t3, None, None, None, None).to(tl.float32)
            ds = tl.where(vis, ds, 0.0)
        # Step 3: dQ += dS K.
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION)
    return dq


def _attention_bwd_dq_kernel(
    q_ptr,  # (B, Hq, Sq, D) / packed (Tq, Hq, D)
    k_ptr,  # (B, Hkv, Skv, D)
    v_ptr,  # (B, Hkv, Skv, Dv)
    do_ptr,  # (B, Hq, Sq, Dv)
    lse_ptr,  # (B, Hq, Sq) fp32
    delta_ptr,  # (B, Hq, Sq) fp32 (lse's strides)
    dq_ptr,  # (B, Hq, Sq, D) output
    stride_qb, stride_qh, stride_qs, stride_qd,  # strides of q along (B, H, S, D)
    stride_kb, stride_kh, stride_ks, stride_kd,  # strides of k along (B, H, S, D)
    stride_vb, stride_vh, stride_vs, stride_vd,  # strides of v along (B, H, S, D)
    stride_gb, stride_gh, stride_gs, stride_gd,  # strides of do along (B, H, S, D)
    stride_dqb, stride_dqh, stride_dqs, stride_dqd,  # strides of dq along (B, H, S, D)
    stride_lb, stride_lh, stride_ls,  # strides of lse and delta along (B, H, S)
    cu_q_ptr, cu_kv_ptr,
    seq_q, seq_kv, group, sm_scale, win_left, win_right,  # lengths (dense), Hq // Hkv, scale, band bounds
    kvn_ptr, kvi_ptr, fkvn_ptr, fkvi_ptr,  # block mask lists per query block, as in the forward
    stride_nb, stride_nh, stride_nm, stride_ib, stride_ih, stride_im,  # of the block lists, as in the forward
    sm_t0, sm_t1, sm_t2, sm_t3, mm_t0, mm_t1, mm_t2, mm_t3,
    seed_ptr, drop_thresh, drop_scale,
    k_desc, v_desc,  # TMA: 3-D (outer, sequence, columns) tensor descriptors of k and v, or None
    k_ob, k_oh, k_cb, k_ch,  # TMA: head (b, h) of k at outer index b*k_ob + h*k_oh, column b*k_cb + h*k_ch
    v_ob, v_oh, v_cb, v_ch,  # the same for v
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    VARLEN: tl.constexpr, BAND: tl.constexpr, HAS_SCORE_MOD: tl.constexpr, HAS_MASK_MOD: tl.constexpr,
    BLOCK_SPARSE: tl.constexpr, SPARSE_Q: tl.constexpr, SPARSE_KV: tl.constexpr, DROPOUT: tl.constexpr,
    REVERSE: tl.constexpr, DOT_PRECISION: tl.constexpr, TMA: tl.constexpr = False,
):
    # Step 1: this program's query tile, dO, LSE and delta stay in registers.
    b, h, m0, q_start, q_len, kv_start, kv_len = _query_program(cu_q_ptr, cu_kv_ptr, seq_q, seq_kv, REVERSE=REVERSE,
                                                                VARLEN=VARLEN, BLOCK_M=BLOCK_M)
    if m0 >= q_len:
        return
    hk = h // group
    offs_m = m0 + tl.arange(0, BLOCK_M)
    rows = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q_ok = offs_m < q_len
    pos = (q_start + m0).to(tl.int64)
    q = _load_tile(_head_ptr(q_ptr, b, h, pos, stride_qb, stride_qh, stride_qs)
                   + rows[:, None] * stride_qs + offs_d[None, :] * stride_qd, q_ok, offs_d < HEAD_DIM,
                   CHECK_ROWS=True, CHECK_COLS=BLOCK_D != HEAD_DIM)
    do = _load_tile(_head_ptr(do_ptr, b, h, pos, stride_gb, stride_gh, stride_gs)
                    + rows[:, None] * stride_gs + offs_dv[None, :] * stride_gd, q_ok, offs_dv < HEAD_DIM_V,
                    CHECK_ROWS=True, CHECK_COLS=BLOCK_DV != HEAD_DIM_V)
    l_off = b.to(tl.int64) * stride_lb + h.to(tl.int64) * stride_lh + pos * stride_ls + rows * stride_ls
    lse2 = tl.load(lse_ptr + l_off, mask=q_ok, other=0.0) * _LOG2E
    delta = tl.load(delta_ptr + l_off, mask=q_ok, other=0.0)
    k_base = _head_ptr(k_ptr, b, hk, kv_start, stride_kb, stride_kh, stride_ks)
    v_base = _head_ptr(v_ptr, b, hk, kv_start, stride_vb, stride_vh, stride_vs)
    k_outer, k_col = b * k_ob + hk * k_oh, b * k_cb + hk * k_ch
    v_outer, v_col = b * v_ob + hk * v_oh, b * v_cb + hk * v_ch
    qk_scale = sm_scale * _LOG2E
    drop_key = b.to(tl.uint32)
    if DROPOUT:
        drop_key = _dropout_key(seed_ptr, b, h)
    dq = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)

    # Step 2: the key tiles this query tile sees (same lists and ranges as the forward).
    if BLOCK_SPARSE:
        n_off, i_off = _block_lists(b, h, m0 // SPARSE_Q, stride_nb, stride_nh, stride_nm,
                                    stride_ib, stride_ih, stride_im)
        for full in tl.static_range(2):
            num = tl.load((fkvn_ptr if full else kvn_ptr) + n_off)
            dq = _attn_bwd_dq_tiles(
                dq, q, do, lse2, delta, k_base, v_base,
                0, num * (SPARSE_KV // BLOCK_N), (fkvi_ptr if full else kvi_ptr) + i_off,
                q_len, kv_len, offs_m, m0, offs_d, offs_dv, stride_ks, stride_kd, stride_vs, stride_vd,
                qk_scale, sm_scale, b, h, win_left, win_right, sm_t0, sm_t1, sm_t2, sm_t3,
                mm_t0, mm_t1, mm_t2, mm_t3, drop_key, drop_thresh, drop_scale,
                k_desc, v_desc, k_outer, k_col, v_outer, v_col, kv_start,
                APPLY_MASK_MOD=HAS_MASK_MOD and not full, CHECK_KV=True, CHECK_BAND=BAND,
                SCORE_FN=SCORE_MOD, GRAD_FN=SCORE_GRAD_DQ, MASK_FN=MASK_MOD, HAS_SCORE_MOD=HAS_SCORE_MOD,
                DROPOUT=DROPOUT, HEAD_DIM=HEAD_DIM, HEAD_DIM_V=HEAD_DIM_V, BLOCK_D=BLOCK_D,
                BLOCK_DV=BLOCK_DV, BLOCK_N=BLOCK_N, DOT_PRECISION=DOT_PRECISION, LIST=True, SPARSE_KV=SPARSE_KV,
                TMA=TMA, ZERO_TAIL=TMA and VARLEN)
    else:
        lo, full_lo, full_hi, hi = _kv_range(m0, tl.minimum(m0 + BLOCK_M, q_len), kv_len, win_left, win_right,
                                             BAND=BAND, BLOCK_N=BLOCK_N)
        for part in tl.static_range(3):
            edge = part != 1
            dq = _attn_bwd_dq_tiles(
                dq, q, do, lse2, delta, k_base, v_base,
                lo if part == 0 else (full_lo if part == 1 else full_hi),
                full_lo if part == 0 else (full_hi if part == 1 else hi), kvi_ptr,
                q_len, kv_len, offs_m, m0, offs_d, offs_dv, stride_ks, stride_kd, stride_vs, stride_vd,
                qk_scale, sm_scale, b, h, win_left, win_right, sm_t0, sm_t1, sm_t2, sm_t3,
                mm_t0, mm_t1, mm_t2, mm_t3, drop_key, drop_thresh, drop_scale,
                k_desc, v_desc, k_outer, k_col, v_outer, v_col, kv_start,
                APPLY_MASK_MOD=HAS_MASK_MOD, CHECK_KV=edge, CHECK_BAND=BAND and edge,
                SCORE_FN=SCORE_MOD, GRAD_FN=SCORE_GRAD_DQ, MASK_FN=MASK_MOD, HAS_SCORE_MOD=HAS_SCORE_MOD,
                DROPOUT=DROPOUT, HEAD_DIM=HEAD_DIM, HEAD_DIM_V=HEAD_DIM_V, BLOCK_D=BLOCK_D,
                BLOCK_DV=BLOCK_DV, BLOCK_N=BLOCK_N, DOT_PRECISION=DOT_PRECISION, TMA=TMA,
                ZERO_TAIL=TMA and VARLEN)

    # Step 3: store dQ (scaled once).
    dq = dq * sm_scale
    dq_base = _head_ptr(dq_ptr, b, h, pos, stride_dqb, stride_dqh, stride_dqs)
    tl.store(dq_base + rows[:, None] * stride_dqs + offs_d[None, :] * stride_dqd, dq.to(dq_ptr.dtype.element_ty),
             mask=q_ok[:, None] & (offs_d < HEAD_DIM)[None, :])


# ------------------------------------------------------------------------------------------------
# Specialization: one compiled copy of each kernel per (score_mod, score_grad, mask_mod).


class AttentionKernels(NamedTuple):
    """The kernels of one (score_mod, mask_mod) pair (``@triton.jit`` functions), and the mods
    themselves for the Hopper forward, which takes them as arguments (None: no mod, or a mod that
    the Hopper forward should not run: with a mod in use and its function absent here, the forward
    stays on the portable kernel)."""

    fwd: Any
    bwd_preprocess: Any
    bwd_dkdv: Any
    bwd_dq: Any
    score_mod: Any = None
    mask_mod: Any = None
    score_grad: Any = None  # score_mod's derivative for the Hopper backward (the dK/dV kernel's)
    score_rel: bool = False  # score_mod is a relative bias slope * (kv - q) + c (codegen.relative_bias)
    # (left, right): the band q - kv in [-right, left] outside which mask_mod hides every pair (None:
    # unbounded on that side, or not known); without a block mask the kernels walk only its tiles
    # (_mask_bounded), and the Hopper backward also skips the halves outside it
    mask_band: tuple[int | None, int | None] | None = None


def _jit(raw: Any, mods: dict[str, Any]) -> Any:
    if not mods:
        return triton.jit(raw)
    scope = dict(raw.__globals__)
    scope.update(mods)
    fn = types.FunctionType(raw.__code__, scope, raw.__name__, raw.__defaults__, raw.__closure__)
    fn.__qualname__ = raw.__qualname__
    fn.__module__ = raw.__module__
    fn.__doc__ = raw.__doc__
    fn.__annotations__ = dict(raw.__annotations__)  # tl.constexpr marks
    fn.__kwdefaults__ = raw.__kwdefaults__
    return triton.jit(fn)


_PREPROCESS = triton.jit(_attention_bwd_preprocess_kernel)


@functools.lru_cache(maxsize=None)
def specialize(score_mod: Any = None, score_grad: Any = None, score_grad_dq: Any = None,
               mask_mod: Any = None) -> AttentionKernels:
    """The attention kernels compiled against the given ``@triton.jit`` mods (None: the default).

    ``score_grad`` is the derivative used by the dK/dV kernel (it may scatter captured-tensor
    gradients); ``score_grad_dq`` the one used by the dQ kernel (never scatters). Cached: the same
    functions give the same kernel objects.
    """
    mods: dict[str, Any] = {}
    if score_mod is not None:
        mods["SCORE_MOD"] = score_mod
    if score_grad is not None:
        mods["SCORE_GRAD"] = score_grad
    if score_grad_dq is not None:
        mods["SCORE_GRAD_DQ"] = score_grad_dq
    if mask_mod is not None:
        mods["MASK_MOD"] = mask_mod
    return AttentionKernels(
        fwd=_jit(_attention_fwd_kernel, mods),
        bwd_preprocess=_PREPROCESS,
        bwd_dkdv=_jit(_attention_bwd_dkdv_kernel, mods),
        bwd_dq=_jit(_attention_bwd_dq_kernel, mods),
        score_mod=score_mod,
        mask_mod=mask_mod,
        score_grad=score_grad,
    )


# ------------------------------------------------------------------------------------------------
# Launchers: they alone know grids and block sizes, and they validate what the kernels assume.


class BlockSparsity(NamedTuple):
    """The block-mask lists a launch follows (int32 tensors, broadcast dims of size 1).

    ``num``: (B', H', R) blocks per row; ``idx``: (B', H', R, C) their indices (last dim unit
    stride); ``full_*`` the same for full blocks. Rows are query blocks (forward, dQ) or key blocks
    (dK/dV). ``block_q``, ``block_kv``: the block sizes (powers of two).
    """

    num: torch.Tensor
    idx: torch.Tensor
    full_num: torch.Tensor
    full_idx: torch.Tensor
    block_q: int
    block_kv: int


def _pow2(n: int) -> int:
    return max(16, next_pow2(int(n)))


@triton.jit
def _interpreter_probe_kernel(x_ptr):  # never launched: tells whether @triton.jit interprets
    pass


# Whether kernels run under the Triton interpreter is fixed when they are defined; decided once
# here, so launchers read a constant (torch.compile cannot trace isinstance on a JITFunction).
_INTERPRETED = not isinstance(_interpreter_probe_kernel, triton.runtime.jit.JITFunction)


def _is_interpreter(kernel: Any) -> bool:
    return _INTERPRETED


# Pipeline depths that fit in shared memory, per (kernel, depth asked, launch signature): the
# tuned depths leave little headroom, and a mod's extra tiles (a captured tensor's gradient, say)
# can push a kernel over the limit; it then runs one stage shallower, decided once.
_STAGES_THAT_FIT: dict[Any, int] = {}


_FAST: dict[Any, Any] = {}  # kernel -> its launch path (fast_launch)


def _launch(kernel: Any, grid: tuple[Any, ...], *args: Any, **kwargs: Any) -> None:
    # fp8ops launches from inside its opaque library ops (fp8ops::attention_fwd / attention_bwd),
    # which torch.compile never traces: the kernel is called directly (no wrap_triton dispatch on
    # the host path). A launcher traced by torch.compile itself goes through wrap_triton;
    # interpreted kernels (TRITON_INTERPRET=1, CPU tensors) are always called directly.
    if _is_interpreter(kernel):
        kernel[grid](*args, **kwargs)
        return
    if torch.compiler.is_compiling():
        torch.library.wrap_triton(kernel)[grid](*args, **kwargs)
        return
    fast = _FAST.get(kernel)
    if fast is None:  # the cached launch path (kernels/_library.FastKernel), one per kernel
        fast = _FAST[kernel] = fast_launch(kernel)
    if "num_stages" not in kwargs:
        fast[grid](*args, **kwargs)
        return
    asked = kwargs["num_stages"]
    key = None
    if _STAGES_THAT_FIT:  # the signature is built only once some launch has needed a fallback
        key = _launch_key(kernel, args, kwargs)
        kwargs["num_stages"] = _STAGES_THAT_FIT.get(key, asked)
    while True:
        try:
            fast[grid](*args, **kwargs)
            return
        except OutOfResources:
            if kwargs["num_stages"] <= 1:
                raise
            kwargs["num_stages"] -= 1
            if key is None:
                key = _launch_key(kernel, args, dict(kwargs, num_stages=asked))
            _STAGES_THAT_FIT[key] = kwargs["num_stages"]


def _launch_key(kernel: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    # What decides a compiled kernel's shared memory: the constexprs and launch options, and which
    # arguments are absent (None) and of which dtype.
    return (kernel, tuple(sorted((k, v) for k, v in kwargs.items() if isinstance(v, (bool, int)))),
            tuple(a.dtype if isinstance(a, torch.Tensor) else a is None for a in args))


def _fwd_config(d: int, dv: int, dtype: torch.dtype, interpret: bool, varlen: bool = False,
                short_rows: bool = False) -> dict[str, int]:
    # 16-bit values timed on an H200 (triton 3.6, causal, B=8, H=32, S=8192; scripts/attn_tune.py,
    # docs/benchmarks/attention_tune_tma.json) with no spills in ptxas's register report. TMA: 1 loads
    # Q, K and V through tensor descriptors where _tma_view allows it (pointer loads otherwise, with
    # the same tiles); it lowers register pressure and was faster at every head dim. ``short_rows``:
    # see :func:`_short_rows` (never under block masks or with packed sequences, whose rows' lengths
    # the host does not know).
    if interpret:
        return {"BLOCK_M": 32, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1, "TMA": 0}
    dmax = max(d, dv)
    if dtype == torch.float32:
        # IEEE fp32 products run on the CUDA cores with both operands in registers: small tiles.
        return {"BLOCK_M": 32, "BLOCK_N": 16, "num_warps": 4, "num_stages": 2, "TMA": 0}
    if dmax <= 64 and varlen:
        # packed sequences (the variable-length benchmark's 512 Zipf(1.2) lengths, mean 268; H100):
        # 0.583 ms against 0.641 with the 128-row tiles below
        return {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3, "TMA": 1}
    if dmax <= 64:
        # d=64: 5.64 ms against 6.97 with (128, 64, 8 warps, 3 stages, pointer loads); 5.84 pointer
        return {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3, "TMA": 1}
    if dmax <= 128 and short_rows:
        # d=128, rows of at most 1024 keys on average (H100, 32 heads; scripts/attn_tune.py and
        # `bench attention`, docs/benchmarks/attention_short_rows_h100.md): 64-row tiles of four
        # warps, two or three programs per SM. Forward µs against the 128-row tiles below, side by
        # side: causal S=1024 391 / 470, S=2048 645 / 728; a window of 1024 at S=2048..8192 538-657
        # / 627-753; no mask S=1024 594 / 628-647. Longer rows: level in the sweep or slower (no mask
        # S=2048 1146 / 1133-1180; causal S=4096 1177 / 1263, but 5.75 / 4.90 ms in two bench runs
        # with 16 sequences on two machines; causal S=8192 2650 / 2359).
        return {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3, "TMA": 1}
    if dmax <= 128:
        # d=128: 9.25 ms against 9.95 with (128, 64, 8, 3, pointer loads); 9.56 pointer (224 / 255
        # registers). Shared memory is near the limit: a mod's extra tiles make it one stage shallower.
        return {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3, "TMA": 1}
    # d=256: 16.8 ms against 35.7 with (64, 64, 8, 2, pointer loads); 17.6 pointer
    return {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2, "TMA": 1}


SHORT_ROW_KEYS = 1024  # query rows that see at most this many keys on average: short rows


def _short_rows(seq_kv: int, left: int | None, right: int | None) -> bool:
    """Whether a dense problem's query rows see at most ``SHORT_ROW_KEYS`` keys on average, for the
    small forward tiles. Without a band (or with bounds that cut nothing) every row sees ``seq_kv``
    keys; in a band a bounded side adds its bound (at most half the keys) and an unbounded one half
    the keys: causal about ``seq_kv / 2``, a window ``w`` about ``w``."""
    left, right = (None if b is None or b >= seq_kv - 1 else b for b in (left, right))
    if left is None and right is None:
        return seq_kv <= SHORT_ROW_KEYS

    def side(bound: int | None) -> float:
        return seq_kv / 2 if bound is None else min(bound, seq_kv / 2)

    return side(left) + side(right) <= SHORT_ROW_KEYS


class _TmaView(NamedTuple):
    """A (B, H, S, D) view as a 3-D (outer, sequence, columns) tensor descriptor: head (b, h) is
    outer index ``b * ob + h * oh``, its rows start at column ``b * cb + h * ch``."""

    desc: Any
    ob: int
    oh: int
    cb: int
    ch: int


def _tma_view(t: torch.Tensor, rows: int) -> _TmaView | None:
    """The descriptor view of a dense (B, H, S, D) tensor with (rows, D) tiles, or None where TMA
    cannot address it: the last dim must be contiguous, the base and the row/outer strides 16-byte
    aligned, D a power of two, S at least ``rows``; each of B and H is an outer index (a stride of
    at least a row, a multiple of the smallest such stride) or a column offset inside a row (the
    heads of a row laid side by side). Rows past S are outside the descriptor: TMA reads them as
    zeros."""
    B, H, S, D = t.shape
    sb, sh, ss, sd = t.stride()
    es = t.element_size()
    if (sd != 1 or S == 0 or D < 16 or D & (D - 1) or D > 256 or t.data_ptr() % 16 or (ss * es) % 16
            or ss < D or S < rows or t.dtype not in (torch.bfloat16, torch.float16)):
        # ss < D: rows that overlap (a broadcast sequence dim), which TMA cannot describe; S < rows:
        # a box larger than its tensor (avoided, as the GEMM launcher does)
        return None
    outer = [st for n, st in ((B, sb), (H, sh)) if n > 1 and st >= ss]
    so = min(outer) if outer else ss * S
    placed = head_placement(t, so)
    if placed is None or (so * es) % 16:
        return None  # a stride neither outer nor inside a row, or heads running into the next row
    coef, width, count = placed
    desc = TensorDescriptor(t, [count, S, width], [so, ss, 1], [1, rows, D])
    return _TmaView(desc, coef[0][0], coef[1][0], coef[0][1], coef[1][1])


def _tma_args(use: bool, tensors: tuple[torch.Tensor, ...], rows: tuple[int, ...], interp: bool
              ) -> tuple[bool, tuple[Any, ...]]:
    """(whether the kernel loads through TMA, its descriptor arguments): descriptors of every tensor,
    then each one's (ob, oh, cb, ch); all of them or none (a GPU before sm_90, a tensor TMA cannot
    address). Packed (T, H, D) tensors are one sequence of T rows: a tile that runs past a sequence's
    end reads the next sequence's rows, which the kernels zero on those edge tiles (ZERO_TAIL)."""
    none = (None,) * len(tensors) + (0,) * (4 * len(tensors))
    if not use:
        return False, none
    if not interp and (not tensors[0].is_cuda or torch.cuda.get_device_capability(tensors[0].device)[0] < 9):
        return False, none
    views = [_tma_view(t, r) for t, r in zip(tensors, rows)]
    if any(v is None for v in views):
        return False, none
    return True, (*(v.desc for v in views), *(x for v in views for x in v[1:]))


def _bwd_config(d: int, dv: int, dtype: torch.dtype, interpret: bool, atomic: bool = False,
                varlen: bool = False, mask_mod: bool = False) -> dict[str, int]:
    # *1: the dK/dV kernel (BLOCK_M1 inner query tile, BLOCK_N1 owned key tile); *2: the dQ kernel
    # (BLOCK_M2 owned query tile, BLOCK_N2 inner key tile). 16-bit values measured on an H200
    # (triton 3.6, B=8, S=8192; scripts/attn_tune.py): 64-row query tiles in the dK/dV kernel run
    # 1.3-1.4x faster than 16 or 32 at d <= 128 although they use all 255 registers (no spills in
    # the separate-dQ kernel; a few dozen with atomic dQ, still the fastest), and 2.7x at d = 256.
    # TMA1 / TMA2: 1 loads the dK/dV kernel's Q and dO tiles / the dQ kernel's K and V tiles through
    # tensor descriptors (as the forward's TMA); off: timed against pointer loads it gained 1.5 % at
    # d = 128, nothing at d = 256 and lost 6 % at d = 64.
    if interpret:
        return {"BLOCK_M1": 32, "BLOCK_N1": 32, "num_warps1": 4, "num_stages1": 1,
                "BLOCK_M2": 32, "BLOCK_N2": 32, "num_warps2": 4, "num_stages2": 1, "TMA1": 0, "TMA2": 0}
    dmax = max(d, dv)
    if dtype == torch.float32:
        return {"BLOCK_M1": 16, "BLOCK_N1": 16, "num_warps1": 4, "num_stages1": 1,
                "BLOCK_M2": 64, "BLOCK_N2": 16, "num_warps2": 4, "num_stages2": 2, "TMA1": 0, "TMA2": 0}
    if dmax <= 64 and varlen and not atomic:
        # packed sequences (the variable-length benchmark's lengths, mean 268; H100): fwd+bwd 2.37 ms
        # against 6.52 with the dense tiles below, whose dK/dV kernel took 4.9 ms of it
        return {"BLOCK_M1": 16, "BLOCK_N1": 64, "num_warps1": 4, "num_stages1": 3,
                "BLOCK_M2": 64, "BLOCK_N2": 32, "num_warps2": 4, "num_stages2": 3, "TMA1": 0, "TMA2": 0}
    if dmax <= 128 and varlen and not atomic:
        # packed sequences at d=128 (the same lengths, 8 heads; H200): 4.30 ms fwd+bwd against 4.78
        # with the dense tiles below
        return {"BLOCK_M1": 32, "BLOCK_N1": 64, "num_warps1": 4, "num_stages1": 3,
                "BLOCK_M2": 64, "BLOCK_N2": 32, "num_warps2": 4, "num_stages2": 3, "TMA1": 0, "TMA2": 0}
    if dmax <= 64 and not atomic and mask_mod:
        # d=64 with a mask_mod (H100, B=8, 64 heads, S=8192, causal document block mask, kernel ms):
        # dK/dV 6.73 with 64-key tiles against 127.3 with the 128-key tiles below (7.64 with eight
        # warps), dQ 4.48 with eight warps against 6.79
        return {"BLOCK_M1": 64, "BLOCK_N1": 64, "num_warps1": 4, "num_stages1": 3,
                "BLOCK_M2": 128, "BLOCK_N2": 64, "num_warps2": 8, "num_stages2": 3, "TMA1": 0, "TMA2": 0}
    if dmax <= 64 and not atomic:
        # causal d=64: 47.8 ms fwd+bwd against 51.9 with eight warps (atomic dQ with four warps: 144);
        # H100, dK/dV kernel alone: 20.1 ms against 24.2 with eight warps
        return {"BLOCK_M1": 64, "BLOCK_N1": 128, "num_warps1": 4, "num_stages1": 3,
                "BLOCK_M2": 128, "BLOCK_N2": 64, "num_warps2": 4, "num_stages2": 3, "TMA1": 0, "TMA2": 0}
    if dmax <= 128:
        # causal d=128: 40.4 ms (separate) / 39.9 (atomic) against 59.4 / 56.1 with BLOCK_M1 = 16
        return {"BLOCK_M1": 64, "BLOCK_N1": 128, "num_warps1": 8, "num_stages1": 3,
                "BLOCK_M2": 128, "BLOCK_N2": 64, "num_warps2": 8, "num_stages2": 3, "TMA1": 0, "TMA2": 0}
    # causal d=256 (B=8, H=32, the earlier 64-row forward): 142.5 ms fwd+bwd (separate dQ) against
    # 159.1 with a 64-row dQ tile (the 128-row dQ kernel fits one pipeline stage in shared memory and
    # spills 72 bytes, still faster); an earlier B=1 run: 79.8 / 77.0 (atomic) against 216.7 / 206.8
    # with (16, 32, 64, 16)
    return {"BLOCK_M1": 64, "BLOCK_N1": 64, "num_warps1": 8, "num_stages1": 2,
            "BLOCK_M2": 128, "BLOCK_N2": 64, "num_warps2": 8, "num_stages2": 1, "TMA1": 0, "TMA2": 0}


def _fit_block(block: int, sparse: int | None) -> int:
    # Kernel tiles must divide the block-mask blocks.
    return block if sparse is None else min(block, sparse)


class _Problem(NamedTuple):
    varlen: bool
    batch: int  # B (dense) or number of sequences (varlen)
    hq: int
    hkv: int
    seq_q: int  # Sq (dense) or max_seqlen_q (varlen)
    seq_kv: int
    d: int
    dv: int


def _as4(t: torch.Tensor, varlen: bool) -> torch.Tensor:
    # Packed (T, H, D) tensors are addressed as (1, H, T, D); see _st for the batch stride.
    return t.transpose(0, 1).unsqueeze(0) if varlen else t


def _st(t: torch.Tensor | None, n: int, varlen: bool) -> tuple[int, ...]:
    # Strides of a (B, H, S[, D]) view; packed tensors get batch stride 0 (sequence b starts at
    # row cu_seqlens[b], found by the kernel).
    if t is None:
        return (0,) * n
    st = tuple(t.stride())
    return (0, *st[1:]) if varlen else st


def _check_problem(name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor | None,
                   cu_kv: torch.Tensor | None, max_q: int | None, max_kv: int | None) -> _Problem:
    if q.dtype not in _DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"{name}: q, k, v must share one dtype among float32/bfloat16/float16, got "
                         f"{q.dtype}, {k.dtype}, {v.dtype}")
    varlen = cu_q is not None
    if varlen:
        if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
            raise ValueError(f"{name}: packed q, k, v must be 3-D (T, H, D), got {tuple(q.shape)}, "
                             f"{tuple(k.shape)}, {tuple(v.shape)}")
        if cu_kv is None or cu_q.dtype != torch.int32 or cu_kv.dtype != torch.int32 or cu_q.shape != cu_kv.shape:
            raise ValueError(f"{name}: cu_seqlens_q and cu_seqlens_kv must be int32 tensors of one shape (B + 1,)")
        if max_q is None or max_kv is None:
            raise ValueError(f"{name}: packed sequences need max_seqlen_q and max_seqlen_kv")
        batch, hq, d = cu_q.shape[0] - 1, q.shape[1], q.shape[2]
        hkv, dv = k.shape[1], v.shape[2]
        if k.shape[2] != d or v.shape[1] != hkv or v.shape[0] != k.shape[0]:
            raise ValueError(f"{name}: k (Tkv, Hkv, D) and v (Tkv, Hkv, Dv) do not match q (Tq, Hq, D): "
                             f"{tuple(k.shape)}, {tuple(v.shape)}")
        seq_q, seq_kv = int(max_q), int(max_kv)
    else:
        if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
            raise ValueError(f"{name}: q, k, v must be 4-D (B, H, S, D) views, got {tuple(q.shape)}, "
                             f"{tuple(k.shape)}, {tuple(v.shape)}")
        batch, hq, seq_q, d = q.shape
        _, hkv, seq_kv, _ = k.shape
        dv = v.shape[3]
        if k.shape[0] != batch or k.shape[3] != d or v.shape[:3] != k.shape[:3]:
            raise ValueError(f"{name}: k (B, Hkv, Skv, D) and v (B, Hkv, Skv, Dv) do not match q (B, Hq, Sq, D): "
                             f"{tuple(k.shape)}, {tuple(v.shape)}")
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"{name}: the query heads ({hq}) must be a multiple of the key/value heads ({hkv})")
    if max(d, dv) > 256:
        raise ValueError(f"{name}: head dims up to 256 are supported, got {d} and {dv}")
    return _Problem(varlen, batch, hq, hkv, seq_q, seq_kv, d, dv)


def _slots(bufs: tuple[torch.Tensor | None, ...] | None) -> tuple[torch.Tensor | None, ...]:
    bufs = tuple(bufs or ())
    if len(bufs) > MAX_MOD_BUFFERS:
        raise ValueError(f"a mod captures at most {MAX_MOD_BUFFERS} tensors, got {len(bufs)}")
    return bufs + (None,) * (MAX_MOD_BUFFERS - len(bufs))


def _sparse_args(bs: BlockSparsity | None) -> tuple[Any, ...]:
    if bs is None:
        return (None, None, None, None, 0, 0, 0, 0, 0, 0)
    for t in (bs.num, bs.idx, bs.full_num, bs.full_idx):
        if t.dtype != torch.int32:
            raise ValueError("block-mask tensors must be int32")
    if bs.idx.stride(-1) != 1 or bs.full_idx.stride() != bs.idx.stride() or bs.full_num.stride() != bs.num.stride():
        raise ValueError("block-mask index tensors must have a unit last stride, and the partial and full "
                         "lists the same strides")

    def st(t: torch.Tensor, i: int) -> int:
        return 0 if t.shape[i] == 1 else t.stride(i)

    return (bs.num, bs.idx, bs.full_num, bs.full_idx,
            st(bs.num, 0), st(bs.num, 1), bs.num.stride(2), st(bs.idx, 0), st(bs.idx, 1), bs.idx.stride(2))


def attention_fwd_launch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    sm_scale: float,
    kernels: AttentionKernels | None = None,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_kv: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_kv: int | None = None,
    window: tuple[int | None, int | None] = (None, None),
    has_score_mod: bool = False,
    has_mask_mod: bool = False,
    score_buffers: tuple[torch.Tensor, ...] | None = None,
    mask_buffers: tuple[torch.Tensor, ...] | None = None,
    block_sparsity: BlockSparsity | None = None,
    dropout_p: float = 0.0,
    dropout_seed: torch.Tensor | None = None,
    descale: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int] | None = None,
    config: dict[str, Any] | None = None,
) -> None:
    """Attention forward into ``out`` and ``lse``.

    Args:
        q: (B, Hq, Sq, D) (any strides: a bhsd/bshd/sbhd view), or packed (Tq, Hq, D) with
            ``cu_seqlens_q``. k: (B, Hkv, Skv, D) / (Tkv, Hkv, D). v: (B, Hkv, Skv, Dv) / (Tkv, Hkv, Dv).
        out: (B, Hq, Sq, Dv) / (Tq, Hq, Dv) in q's dtype, written. lse: (B, Hq, Sq) / (Tq, Hq) fp32.
        sm_scale: the score scale. kernels: from :func:`specialize` (default: no mods).
        cu_seqlens_q, cu_seqlens_kv: (B + 1,) int32 sequence starts; max_seqlen_*: grid sizes.
        window: (left, right) band bounds, None unbounded (causal: right = 0).
        has_score_mod, has_mask_mod: whether ``kernels`` carry mods to call.
        score_buffers, mask_buffers: flat contiguous tensors the mods capture (<= 4 each).
        block_sparsity: per-query-block lists of partial/full key blocks (dense only).
        dropout_p, dropout_seed: drop probability and a () int64 seed tensor.
        descale: (q_descale (B, Hq, nq), k_descale (B, Hkv, nkv), v_descale (B, Hkv, nkv), block_q,
            block_kv) fp32 per-block descales (FP8 operands), or None.
        config: overrides of BLOCK_M, BLOCK_N, num_warps, num_stages and TMA (1: Q, K and V tiles
            through tensor descriptors where the layout allows it, else pointer loads), and HOPPER
            (1, the default on a GPU: the warp-specialised sm_90 kernel of ``_attention_hopper`` where
            it applies; 0: always this module's kernel, as does any override of the other keys).
    """
    name = "attention_fwd_launch"
    prob = _check_problem(name, q, k, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv)
    want_out = (q.shape[0], prob.hq, prob.dv) if prob.varlen else (prob.batch, prob.hq, prob.seq_q, prob.dv)
    want_lse = (q.shape[0], prob.hq) if prob.varlen else (prob.batch, prob.hq, prob.seq_q)
    if tuple(out.shape) != want_out or out.dtype != q.dtype:
        raise ValueError(f"{name}: out must be {want_out} {q.dtype}, got {tuple(out.shape)} {out.dtype}")
    if tuple(lse.shape) != want_lse or lse.dtype != torch.float32:
        raise ValueError(f"{name}: lse must be {want_lse} float32, got {tuple(lse.shape)} {lse.dtype}")
    if descale is not None:
        for g in descale[3:]:
            if isinstance(g, bool) or not isinstance(g, int) or g < 16 or g & (g - 1):
                raise ValueError(f"{name}: descale block sizes must be powers of two >= 16, got {descale[3:]}")
    kernels = kernels or specialize()
    interp = _is_interpreter(kernels.fwd)
    bs = block_sparsity
    window = _mask_bounded(window, kernels, has_mask_mod, bs)
    short = not prob.varlen and bs is None and _short_rows(prob.seq_kv, *window)
    # HOPPER: 1 runs kernels/_attention_hopper.py where it applies (sm_90, see hopper_supported); a config
    # that sets any of the portable kernel's own keys asks for that kernel.
    cfg = merge_config({**_fwd_config(prob.d, prob.dv, q.dtype, interp, prob.varlen, short), "HOPPER": int(not interp)},
                       config, name="attention_fwd")
    if bs is not None and prob.varlen:
        raise ValueError(f"{name}: block sparsity is not available with packed sequences")
    block_m = _fit_block(cfg["BLOCK_M"], bs.block_q if bs else None)
    block_n = _fit_block(cfg["BLOCK_N"], bs.block_kv if bs else None)
    if descale is not None:
        block_m = _fit_block(block_m, descale[3])
        block_n = _fit_block(block_n, descale[4])
    vl = prob.varlen
    q4, k4, v4, o4 = (_as4(t, vl) for t in (q, k, v, out))
    l3 = lse.transpose(0, 1).unsqueeze(0) if vl else lse
    left, right = window
    band = left is not None or right is not None
    sm, mm = _slots(score_buffers), _slots(mask_buffers)
    if dropout_p > 0.0 and dropout_seed is None:
        raise ValueError(f"{name}: dropout needs a seed tensor")
    if descale is not None:
        qds, kds, vds, gq, gkv = descale
        ds_args = (qds, kds, vds, qds.stride(0), qds.stride(1), kds.stride(0), kds.stride(1))
    else:
        gq, gkv = 1, 1
        ds_args = (None, None, None, 0, 0, 0, 0)
    grid = (cdiv(prob.seq_q, block_m), prob.hq, prob.batch)
    if grid[0] == 0 or prob.batch == 0 or prob.hq == 0:
        return
    if cfg["HOPPER"] and not set(config or ()) - {"HOPPER"}:
        # The Hopper kernel takes the mods as arguments: a mod in use whose function ``kernels`` does
        # not carry keeps this module's kernel (see AttentionKernels).
        fns = (kernels.score_mod if has_score_mod else _identity_score_mod,
               kernels.mask_mod if has_mask_mod else _all_visible)
        if (None not in fns
                and hopper_supported(q, k, v, varlen=vl, descale=descale is not None,
                                     sparse_q=bs.block_q if bs else None, sparse_kv=bs.block_kv if bs else None,
                                     short_rows=short, mods=has_score_mod or has_mask_mod)
                and hopper_fwd(q, k, v, out, lse, sm_scale=sm_scale, window=window, score_fn=fns[0], mask_fn=fns[1],
                               has_score_mod=has_score_mod, has_mask_mod=has_mask_mod, score_buffers=sm,
                               mask_buffers=mm, sparse=_sparse_args(bs) if bs else None,
                               sparse_q=bs.block_q if bs else 1, sparse_kv=bs.block_kv if bs else 1,
                               score_rel=kernels.score_rel,
                               dropout=(dropout_seed, dropout_threshold(dropout_p), 1.0 / (1.0 - dropout_p))
                               if dropout_p > 0.0 else None)):
            return
    tma, tma_args = _tma_args(bool(cfg["TMA"]) and descale is None, (q4, k4, v4), (block_m, block_n, block_n), interp)
    _launch(
        kernels.fwd, grid,
        q4, k4, v4, o4, l3,
        *_st(q4, 4, vl), *_st(k4, 4, vl), *_st(v4, 4, vl), *_st(o4, 4, vl), *_st(l3, 3, vl),
        cu_seqlens_q, cu_seqlens_kv, prob.seq_q, prob.seq_kv, prob.hq // prob.hkv, float(sm_scale),
        NO_BOUND if left is None else int(left), NO_BOUND if right is None else int(right),
        *_sparse_args(bs), *sm, *mm,
        dropout_seed if dropout_p > 0.0 else None, dropout_threshold(dropout_p), 1.0 / (1.0 - dropout_p),
        *ds_args, *tma_args,
        HEAD_DIM=prob.d, HEAD_DIM_V=prob.dv, BLOCK_D=_pow2(prob.d), BLOCK_DV=_pow2(prob.dv),
        BLOCK_M=block_m, BLOCK_N=block_n,
        VARLEN=prob.varlen, BAND=band, HAS_SCORE_MOD=has_score_mod, HAS_MASK_MOD=has_mask_mod,
        BLOCK_SPARSE=bs is not None, SPARSE_Q=bs.block_q if bs else 1, SPARSE_KV=bs.block_kv if bs else 1,
        DROPOUT=dropout_p > 0.0, HAS_DESCALE=descale is not None, DESCALE_Q=gq, DESCALE_KV=gkv,
        REVERSE=right is not None and not prob.varlen, DOT_PRECISION=_precision(q.dtype), TMA=tma,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )


def _precision(dtype: torch.dtype) -> str:
    # fp32 inputs get IEEE products (plain PyTorch's default for fp32 matmul); 16-bit ones ignore it.
    return "ieee" if dtype == torch.float32 else "tf32"


def attention_bwd_launch(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dlse: torch.Tensor | None,
    dq: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    *,
    sm_scale: float,
    kernels: AttentionKernels | None = None,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_kv: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_kv: int | None = None,
    window: tuple[int | None, int | None] = (None, None),
    has_score_mod: bool = False,
    has_mask_mod: bool = False,
    score_buffers: tuple[torch.Tensor, ...] | None = None,
    mask_buffers: tuple[torch.Tensor, ...] | None = None,
    score_buffer_grads: tuple[torch.Tensor | None, ...] | None = None,
    block_sparsity: BlockSparsity | None = None,
    block_sparsity_t: BlockSparsity | None = None,
    dropout_p: float = 0.0,
    dropout_seed: torch.Tensor | None = None,
    dq_mode: str = "separate",
    config: dict[str, Any] | None = None,
) -> None:
    """Attention backward into ``dq``, ``dk``, ``dv`` (and ``score_buffer_grads``, accumulated).

    Args:
        do: output gradient, shaped like ``out``. dlse: gradient of ``lse`` or None.
        dq, dk, dv: outputs shaped like q, k, v (any strides); dk/dv are written only where a
            sequence has keys (allocate zeros for packed inputs).
        score_buffer_grads: fp32 zero-initialised flat tensors, one per score_mod buffer that needs
            a gradient (None for the others); atomically accumulated.
        block_sparsity / block_sparsity_t: the block mask's per-query-block lists (dQ kernel) and
            per-key-block lists (dK/dV kernel).
        dq_mode: "separate" (deterministic dQ kernel), "atomic" (dQ accumulated by the dK/dV
            kernel with fp32 atomics) or "auto" (need not be deterministic: the Hopper backward of
            ``_attention_hopper_bwd`` where config HOPPER lets it run, else
            :func:`resolve_dq_mode`'s choice).
        config: overrides of the *1 (dK/dV kernel) and *2 (dQ kernel) BLOCK_M, BLOCK_N, num_warps,
            num_stages and TMA (1: the dK/dV kernel's Q and dO tiles, the dQ kernel's K and V tiles
            through tensor descriptors where the layout allows it), and HOPPER (with ``dq_mode``
            "auto": nonzero, the default on a GPU, the Hopper backward wherever it applies; 0, or
            any override of the other keys: this module's kernels).
        Other arguments: as in :func:`attention_fwd_launch`.
    """
    name = "attention_bwd_launch"
    prob = _check_problem(name, q, k, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv)
    if dq_mode not in ("separate", "atomic", "auto"):
        raise ValueError(f"{name}: dq_mode must be 'separate', 'atomic' or 'auto', got {dq_mode!r}")
    kernels = kernels or specialize()
    interp = _is_interpreter(kernels.bwd_dkdv)
    auto = dq_mode == "auto"
    masked = window != (None, None) or has_mask_mod or block_sparsity is not None
    dq_mode = resolve_dq_mode(dq_mode, masked=masked, head_dim=max(prob.d, prob.dv))
    # HOPPER: nonzero (1, the default on a GPU) runs kernels/_attention_hopper_bwd.py wherever it
    # applies (hopper_bwd_supported: it measured faster everywhere); 0, or a config that sets any of the
    # portable kernels' own keys, keeps those kernels
    cfg = merge_config({**_bwd_config(prob.d, prob.dv, q.dtype, interp, atomic=dq_mode == "atomic",
                                      varlen=prob.varlen, mask_mod=has_mask_mod), "HOPPER": int(not interp)},
                       config, name="attention_bwd")
    bs, bst = block_sparsity, block_sparsity_t
    if (bs is None) != (bst is None):
        raise ValueError(f"{name}: pass both block_sparsity and block_sparsity_t, or neither")
    if bs is not None and prob.varlen:
        raise ValueError(f"{name}: block sparsity is not available with packed sequences")
    m1 = _fit_block(cfg["BLOCK_M1"], bs.block_q if bs else None)
    n1 = _fit_block(cfg["BLOCK_N1"], bs.block_kv if bs else None)
    m2 = _fit_block(cfg["BLOCK_M2"], bs.block_q if bs else None)
    n2 = _fit_block(cfg["BLOCK_N2"], bs.block_kv if bs else None)
    vl = prob.varlen
    v4 = lambda t: _as4(t, vl)  # noqa: E731
    q4, k4, vv4, o4, do4, dq4, dk4, dv4 = (v4(t) for t in (q, k, v, out, do, dq, dk, dv))
    l3 = lse.transpose(0, 1).unsqueeze(0) if prob.varlen else lse
    e3 = None if dlse is None else (dlse.transpose(0, 1).unsqueeze(0) if prob.varlen else dlse)
    delta = torch.empty_like(lse)
    d3 = delta.transpose(0, 1).unsqueeze(0) if prob.varlen else delta
    # the portable kernels' walks end where the mask's band does (the Hopper backward takes the
    # band from ``kernels`` itself, below, and does not compare positions against it)
    left, right = _mask_bounded(window, kernels, has_mask_mod, bst)
    band = left is not None or right is not None
    wl = NO_BOUND if left is None else int(left)
    wr = NO_BOUND if right is None else int(right)
    sm, mm = _slots(score_buffers), _slots(mask_buffers)
    gs = _slots(score_buffer_grads)
    seed = dropout_seed if dropout_p > 0.0 else None
    drop = (seed, dropout_threshold(dropout_p), 1.0 / (1.0 - dropout_p))
    common = dict(
        HEAD_DIM=prob.d, HEAD_DIM_V=prob.dv, BLOCK_D=_pow2(prob.d), BLOCK_DV=_pow2(prob.dv),
        VARLEN=prob.varlen, BAND=band, HAS_SCORE_MOD=has_score_mod, HAS_MASK_MOD=has_mask_mod,
        BLOCK_SPARSE=bs is not None, SPARSE_Q=bs.block_q if bs else 1, SPARSE_KV=bs.block_kv if bs else 1,
        DROPOUT=dropout_p > 0.0, DOT_PRECISION=_precision(q.dtype),
    )
    if prob.batch == 0 or prob.hq == 0 or prob.seq_q == 0 or prob.seq_kv == 0:
        for t in (dq, dk, dv):
            t.zero_()
        return

    # Step 1: delta = rowsum(o * do) - dlse.
    bm0 = 64 if not interp else 32
    _launch(
        kernels.bwd_preprocess, (cdiv(prob.seq_q, bm0), prob.hq, prob.batch),
        o4, do4, e3, d3, *_st(o4, 4, vl), *_st(do4, 4, vl), *_st(e3, 3, vl), *_st(d3, 3, vl),
        cu_seqlens_q, prob.seq_q,
        HEAD_DIM_V=prob.dv, BLOCK_DV=_pow2(prob.dv), BLOCK_M=bm0, VARLEN=prob.varlen, HAS_DLSE=e3 is not None,
        num_warps=4,
    )
    # Step 2 (Hopper): dK, dV and dQ in one warp-specialised kernel, where it applies.
    if auto and cfg["HOPPER"] and not set(config or ()) - {"HOPPER"} and _hopper_bwd(
            kernels, do, q, k, v, lse, delta, dq, dk, dv, sm_scale=sm_scale, window=window,
            has_score_mod=has_score_mod, has_mask_mod=has_mask_mod, sm=sm, mm=mm, gs=gs, bst=bst,
            dropout=drop if dropout_p > 0.0 else None, varlen=prob.varlen):
        return
    # Step 2: dK, dV (and dQ with atomics).
    atomic = dq_mode == "atomic"
    dqa = torch.zeros(dq.shape, dtype=torch.float32, device=dq.device) if atomic else None
    dqa4 = v4(dqa) if dqa is not None else None
    tma1, tma1_args = _tma_args(bool(cfg["TMA1"]), (q4, do4), (m1, m1), interp)
    _launch(
        kernels.bwd_dkdv, (cdiv(prob.seq_kv, n1), prob.hkv, prob.batch),
        q4, k4, vv4, do4, l3, d3, dqa4, dk4, dv4,
        *_st(q4, 4, vl), *_st(k4, 4, vl), *_st(vv4, 4, vl), *_st(do4, 4, vl), *_st(dqa4, 4, vl),
        *_st(dk4, 4, vl), *_st(dv4, 4, vl), *_st(l3, 3, vl),
        cu_seqlens_q, cu_seqlens_kv, prob.seq_q, prob.seq_kv, prob.hq // prob.hkv, float(sm_scale), wl, wr,
        *_sparse_args(bst), *sm, *mm, *gs, *drop, *tma1_args,
        BLOCK_M=m1, BLOCK_N=n1, ATOMIC_DQ=atomic, TMA=tma1, **common,
        num_warps=cfg["num_warps1"], num_stages=cfg["num_stages1"],
    )
    # Step 3: dQ (its own deterministic kernel, or the atomic accumulator cast).
    if atomic:
        assert dqa is not None
        store_accumulated(dq, dqa)
        return
    tma, tma_args = _tma_args(bool(cfg["TMA2"]), (k4, vv4), (n2, n2), interp)
    _launch(
        kernels.bwd_dq, (cdiv(prob.seq_q, m2), prob.hq, prob.batch),
        q4, k4, vv4, do4, l3, d3, dq4,
        *_st(q4, 4, vl), *_st(k4, 4, vl), *_st(vv4, 4, vl), *_st(do4, 4, vl), *_st(dq4, 4, vl), *_st(l3, 3, vl),
        cu_seqlens_q, cu_seqlens_kv, prob.seq_q, prob.seq_kv, prob.hq // prob.hkv, float(sm_scale), wl, wr,
        *_sparse_args(bs), *sm, *mm, *drop, *tma_args,
        BLOCK_M=m2, BLOCK_N=n2, REVERSE=right is not None and not prob.varlen, TMA=tma, **common,
        num_warps=cfg["num_warps2"], num_stages=cfg["num_stages2"],
    )


def _mask_bounded(window: tuple[int | None, int | None], kernels: AttentionKernels, has_mask_mod: bool,
                  sparsity: BlockSparsity | None) -> tuple[int | None, int | None]:
    """``window`` within the band outside which the mask_mod hides every pair (``kernels.mask_band``:
    the causal and sliding-window masks and their ``and``), where no block mask's lists bound the
    walk: the kernels then visit only the band's tiles, as with ``causal=True`` or ``window=``,
    instead of evaluating the mask on every tile. The same pairs stay visible."""
    if not has_mask_mod or sparsity is not None or kernels.mask_band is None:
        return window
    return band_and(window, kernels.mask_band)


def resolve_dq_mode(dq_mode: str, *, masked: bool, head_dim: int) -> str:
    """The portable kernels' dQ scheme for ``dq_mode``: "auto" becomes "atomic" (dQ accumulated by
    the dK/dV kernel) for a masked attention above head dim 128, else "separate" (measured on an
    H200, B=8, S=8192: with the tuned tiles the separate kernel is as fast or faster up to d = 128,
    causal 40.4 against 39.9 ms, ALiBi 44.2 / 48.5, document mask 13.4 / 14.4; atomics 4 % faster at
    d = 256); "separate" and "atomic" stay."""
    if dq_mode != "auto":
        return dq_mode
    return "atomic" if masked and head_dim > 128 else "separate"


def hopper_bwd_score_mode(kernels: AttentionKernels, has_score_mod: bool) -> int:
    """How the Hopper backward calls the score_mod (``_attention_hopper_bwd.SCORE_MODE_*``): it skips
    the derivative of an additive mod with no captured-tensor gradient (the code generator then
    gives the identity as its derivative, ``codegen.score_grad_identity``), and of such a mod that
    is a relative bias (``kernels.score_rel``) the calls per score as well, else calls both."""
    if not has_score_mod:
        return SCORE_MODE_NONE
    if kernels.score_grad is not _identity_score_grad:
        return SCORE_MODE_NATURAL
    return SCORE_MODE_RELATIVE if kernels.score_rel else SCORE_MODE_NO_GRAD


def _hopper_bwd(kernels: AttentionKernels, do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                lse: torch.Tensor, delta: torch.Tensor, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, *,
                sm_scale: float, window: tuple[int | None, int | None], has_score_mod: bool,
                has_mask_mod: bool,
                sm: tuple[Any, ...], mm: tuple[Any, ...], gs: tuple[Any, ...], bst: BlockSparsity | None,
                dropout: tuple[Any, int, float] | None, varlen: bool) -> bool:
    # The Hopper backward takes the mods as arguments: a mod in use whose function ``kernels`` does
    # not carry keeps this module's kernels (see AttentionKernels).
    fns = (kernels.score_mod if has_score_mod else _identity_score_mod,
           kernels.score_grad if has_score_mod else _identity_score_grad,
           kernels.mask_mod if has_mask_mod else _all_visible)
    if None in fns or not hopper_bwd_supported(q, k, v, varlen=varlen,
                                               sparse_q=bst.block_q if bst else None,
                                               sparse_kv=bst.block_kv if bst else None):
        return False
    return hopper_bwd(do, q, k, v, lse, delta, dq, dk, dv, sm_scale=sm_scale, window=window,
                      score_fn=fns[0], grad_fn=fns[1], mask_fn=fns[2],
                      score_mode=hopper_bwd_score_mode(kernels, has_score_mod), has_mask_mod=has_mask_mod,
                      score_buffers=sm, mask_buffers=mm, score_grads=gs,
                      sparse_t=_sparse_args(bst) if bst else None, sparse_q=bst.block_q if bst else 1,
                      sparse_kv=bst.block_kv if bst else 1, dropout=dropout,
                      mask_band=kernels.mask_band if has_mask_mod else None)


def flops(batch: int, heads: int, seq_q: int, seq_kv: int, head_dim: int, *, causal: bool = False,
          backward: bool = False) -> float:
    """The FLOP count convention of the benchmarks: 4 B H Sq Skv D, halved for causal, x3.5 fwd+bwd."""
    f = 4.0 * batch * heads * seq_q * seq_kv * head_dim
    if causal:
        f /= 2.0
    if backward:
        f *= 3.5
    return f

