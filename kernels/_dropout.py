"""The attention dropout mask: a hash of (seed, b, h, i, j), the same in every attention kernel.

The portable kernels of ``attention.py`` and the Hopper ones of ``_attention_hopper.py`` and
``_attention_hopper_bwd.py`` call these functions (element-wise integer math, so they run in Triton
and Gluon programs alike); ``fp8ops.reference.attention.dropout_keep`` computes the same bits on the
CPU and documents the hash.

Queries ``i`` and ``i + 8`` of each aligned group of 16 share one per-element hash and take its two
16-bit halves. In the wgmma accumulator layout a thread holds both rows of such a pair in the
forward (rows ``r`` and ``r + 8`` of each 16-row slab) and both columns in the backward's transposed
tiles (columns ``c`` and ``c + 8``), so the compiler computes each hash once for two weights; the
bits do not depend on the layout.
"""

from __future__ import annotations

import triton
import triton.language as tl


def dropout_threshold(p: float) -> int:
    """The kernels' 16-bit threshold of drop probability p (fp8ops.reference.attention.dropout_threshold):
    a weight is kept when its 16-bit draw is >= it."""
    return min(int(round(float(p) * (1 << 16))), (1 << 16) - 1)


@triton.jit
def _mix32(x):
    # A 32-bit xor-shift-multiply hash on uint32 (wrapping), as in fp8ops.reference.attention.
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    x = x ^ (x >> 16)
    return x


@triton.jit
def _dropout_key(seed_ptr, b, h):
    # The per-(batch, head) part of the dropout hash.
    seed = tl.load(seed_ptr)
    lo = (seed & 0xFFFFFFFF).to(tl.uint32)
    hi = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    k0 = _mix32(lo ^ _mix32(hi))
    k1 = _mix32(k0 + b.to(tl.uint32))
    return _mix32(k1 + h.to(tl.uint32))


@triton.jit
def _dropout_pair_row(key, qp):
    # The per-query part of a query pair qp ((i >> 4) * 8 + (i & 7) of its queries i): one full mix.
    return _mix32(key + qp.to(tl.uint32))


@triton.jit
def _dropout_row(key, q0, q_off):
    # _dropout_pair_row of query q0 + q_off (q0 a multiple of 16, e.g. a tile's first row); with q0
    # split off, the compiler sees that the two rows of a pair in a tile agree.
    return _dropout_pair_row(key, (q0 >> 1) + (((q_off >> 4) << 3) | (q_off & 7)))


@triton.jit
def _dropout_draws(row, kv_idx):
    # The draws (lower query, upper query) of a query pair's row hash and kv_idx: uint32 values whose
    # top 16 bits are the 16-bit draws and whose low bits are zero (lower) or below them (upper), so
    # that a weight is kept when its value is >= the threshold << 16. Per pair: one xor, two
    # multiplies and an xor-shift, then a shift and a logic op for the lower query's draw (the xor of
    # the two halves); the upper query's is the top half as it stands.
    r = row ^ kv_idx.to(tl.uint32)
    r = r * 0x21F0AAAD
    r = r ^ (r >> 15)
    r = r * 0x735A2D97
    return (r << 16) ^ (r & 0xFFFF0000), r


@triton.jit
def _dropout_draw(row, q_off, kv_idx):
    # The draw of (q0 + q_off, kv_idx) (_dropout_draws); where q_off & 8 is known per register (the
    # Hopper forward's rows), only the draw used is computed.
    lo, hi = _dropout_draws(row, kv_idx)
    return tl.where((q_off & 8) != 0, hi, lo)


@triton.jit
def _dropout_keep_row(row, q_off, kv_idx, drop_thresh):
    # True where the weight of (q0 + q_off, kv_idx) is kept, from its query's _dropout_row; all
    # broadcast to the tile.
    return _dropout_draw(row, q_off, kv_idx) >= (drop_thresh.to(tl.uint32) << 16)


@triton.jit
def _kept(draw, drop_thresh, x):
    # x (float32) where its weight is kept (draw >= drop_thresh << 16), else 0.0: a compare and a
    # select on the 32-bit value in PTX, which the compiler cannot move past a later conversion to
    # 16 bits (a select there costs byte permutes to take the packed halves apart and back). GPU
    # kernels only (inline PTX).
    t = draw * 0 + (drop_thresh.to(tl.uint32) << 16)
    return tl.inline_asm_elementwise(
        "{ .reg .pred %p; setp.ge.u32 %p, $1, $2; selp.b32 $0, $3, 0, %p; }", "=r,r,r,r",
        [draw, t, x], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _dropout_keep(key, q_idx, kv_idx, drop_thresh):
    # True where the weight of (q_idx, kv_idx) is kept (q_idx broadcast to the tile), the row hash
    # computed here.
    return _dropout_keep_row(_dropout_row(key, 0, q_idx), q_idx, kv_idx, drop_thresh)


@triton.jit
def _dropout_keep_at(key, q0, q_off, kv_idx, drop_thresh):
    # _dropout_keep of queries q0 + q_off (q_off broadcast to the tile, q0 a scalar such as a tile's
    # first row): the same bits for any q0; where q0 is a multiple of 16 the compiler can see that
    # the two rows of a pair agree.
    if q0 % 16 == 0:
        keep = _dropout_keep_row(_dropout_row(key, q0, q_off), q_off, kv_idx, drop_thresh)
    else:
        keep = _dropout_keep(key, q0 + q_off, kv_idx, drop_thresh)
    return keep
