"""kernels/_reduce.py (``column_sums``, the finalize of row reductions) under TRITON_INTERPRET=1.

Hand-computed sums: integer-valued partials are summed exactly in float32, so every output is
checked for equality; the shapes cross the kernel's 64-row slabs and 32-column blocks.
"""

import os

import pytest
import torch
from fp8ops.kernels._reduce import column_sums

pytestmark = [
    pytest.mark.interpret,
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs only under TRITON_INTERPRET=1"),
]


@pytest.mark.parametrize("G,K", [(1, 1), (64, 32), (130, 45), (3, 100)])
def test_sums_every_row_of_every_column(G, K):
    # part[g, k] = g + 1000 k: column k sums to G (G - 1) / 2 + 1000 k G
    g = torch.arange(G, dtype=torch.float32)[:, None]
    k = torch.arange(K, dtype=torch.float32)[None, :]
    a = (g + 1000 * k).contiguous()
    out, none = column_sums(a)
    assert none is None and out.dtype == torch.float32 and out.shape == (K,)
    assert out.tolist() == [G * (G - 1) / 2 + 1000 * j * G for j in range(K)]


def test_two_buffers_in_one_launch_and_the_output_dtype():
    G, K = 70, 40
    a = torch.ones(G, K)
    b = torch.arange(G * K, dtype=torch.float32).view(G, K) % 3  # column j: rows cycle through 0, 1, 2
    sa, sb = column_sums(a, b, dtype=torch.bfloat16)
    assert sa.dtype == sb.dtype == torch.bfloat16
    assert sa.tolist() == [70.0] * K
    assert sb.tolist() == [float(c) for c in b.sum(0).tolist()]  # small integers: exact in bf16


def test_empty_partials_give_zeros():
    out, _ = column_sums(torch.zeros(0, 5))
    assert out.tolist() == [0.0] * 5
    assert column_sums(torch.zeros(4, 0))[0].shape == (0,)


def test_errors_name_the_argument():
    with pytest.raises(ValueError, match="column_sums: a must be a contiguous 2-D float32"):
        column_sums(torch.ones(4, 4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="column_sums: a must be a contiguous 2-D float32"):
        column_sums(torch.ones(4, 4).t())
    with pytest.raises(ValueError, match="column_sums: b must be a contiguous float32 tensor of a's shape"):
        column_sums(torch.ones(4, 4), torch.ones(4, 3))
