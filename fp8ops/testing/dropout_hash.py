"""The dropout hash of the attention and norm kernels written out in plain Python integers (the
kernels' uint32 arithmetic): a model independent of the torch reference
(:func:`fp8ops.reference.attention.dropout_keep`, :func:`fp8ops.reference.norm.branch_keep`) that
tests pin both against.

Example:
    >>> from fp8ops.testing import dropout_hash as H
    >>> k2 = H.key(-123456789012, 1, 2)          # seed, batch, head
    >>> H.draw(k2, (11 >> 4) * 8 + (11 & 7), 4, upper=True)   # query 11, key 4: its pair's top half
    37154
"""

from __future__ import annotations

__all__ = ["draw", "key", "mix"]

_M32 = 0xFFFFFFFF


def mix(x: int) -> int:
    """The full two-round xor-shift-multiply hash of a uint32."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def key(seed: int, b: int, h: int) -> int:
    """The per-(seed, batch, head) part of the hash."""
    lo, hi = seed & _M32, (seed >> 32) & _M32
    return mix((mix((mix(lo ^ mix(hi)) + b) & _M32) + h) & _M32)


def draw(k2: int, pair: int, j: int, upper: bool) -> int:
    """The 16-bit draw of the pair index ``pair`` and key index ``j`` under the key ``k2``: the top
    half of the pair's hash for its upper member, the xor of the halves for the lower one."""
    r = ((mix((k2 + pair) & _M32) ^ j) * 0x21F0AAAD) & _M32
    r = ((r ^ (r >> 15)) * 0x735A2D97) & _M32
    return r >> 16 if upper else (r ^ (r >> 16)) & 0xFFFF
