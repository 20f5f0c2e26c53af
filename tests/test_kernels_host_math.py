"""The launchers' host arithmetic (kernels/_library.cdiv, next_pow2) equals Triton's own
``triton.cdiv`` / ``triton.next_power_of_2``, which it replaces on the launch path."""

from __future__ import annotations

import triton

from fp8ops.kernels._library import cdiv, next_pow2


def test_cdiv_and_next_pow2_equal_tritons():
    for a in [0, 1, 2, 15, 16, 17, 255, 256, 257, 4095, 4096, 8193, 2**31 + 5]:
        for b in [1, 2, 3, 16, 64, 128, 1000]:
            assert cdiv(a, b) == triton.cdiv(a, b), (a, b)
    for n in [0, 1, 2, 3, 4, 5, 7, 8, 9, 31, 32, 33, 1000, 1024, 1025, 2**20 - 1, 2**20, 2**31 + 1]:
        assert next_pow2(n) == triton.next_power_of_2(n), n
