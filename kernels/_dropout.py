"""The attention dropout mask: a hash of (seed, b, h, i, j), the same in every attention kernel.

The portable kernels of ``attention.py`` and the Hopper ones of ``_attention_hopper.py`` and
``_attention_hopper_bwd.py`` call these functions (element-wise integer math, so they run in Triton
and Gluon programs alike); ``fp8ops.reference.attention`` computes the same bits on the CPU.
"""

from __future__ import annotations

import triton
import triton.language as tl


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
def _dropout_keep(key, q_idx, kv_idx, drop_thresh):
    # True where the weight of (q_idx, kv_idx) is kept; q_idx / kv_idx broadcast to the tile. The
    # row's hash is a vector (one full mix per row); each element costs one xor, two multiplies and
    # one xor-shift (a second full mix per element made the forward kernel 21 % slower at the seed
    # layer's shape), and its top 31 bits are compared with the threshold.
    r = _mix32(key + q_idx.to(tl.uint32)) ^ kv_idx.to(tl.uint32)
    r = r * 0x21F0AAAD
    r = r ^ (r >> 15)
    r = r * 0x735A2D97
    return (r >> 1).to(tl.int32) >= drop_thresh
