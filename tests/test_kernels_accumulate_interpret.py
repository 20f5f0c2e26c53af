"""kernels/_accumulate.py (the float32 dQ accumulator written into a strided 16-bit view) under
TRITON_INTERPRET=1.

The values are exact in bfloat16 (the interpreter truncates its casts, so only exact values can be
checked for equality there); every element lands at its own place of the view, and the elements
between the view's rows stay as they were. Rounding to nearest even is checked on the GPU
(``tests/test_attention_hopper_bwd_gpu.py``).
"""

import os

import pytest
import torch
from fp8ops.kernels._accumulate import ROWS_PER_PROGRAM, rows_cast, store_accumulated

pytestmark = [
    pytest.mark.interpret,
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs only under TRITON_INTERPRET=1"),
]


def _exact(shape):
    # integers below 256 (exact in bfloat16), cycling with a prime period: misplaced rows show
    n = torch.tensor(shape).prod().item()
    return (torch.arange(n, dtype=torch.float32) % 251 - 125).view(shape).contiguous()


@pytest.mark.parametrize("S, B, H, D", [(8, 2, 3, 16), (ROWS_PER_PROGRAM + 3, 1, 2, 24)])
def test_rows_land_in_the_view_of_a_packed_gradient(S, B, H, D):
    # the layer's case: dq a (B, H, S, D) view of an (S, B, 3 H D) gradient, the k and v parts around it
    packed = torch.full((S, B, 3 * H * D), -7.0, dtype=torch.bfloat16)
    dq = packed[..., : H * D].view(S, B, H, D).permute(1, 2, 0, 3)
    acc = _exact((B, H, S, D))
    rows_cast(dq, acc)
    assert torch.equal(dq.float(), acc)
    assert (packed[..., H * D:] == -7.0).all()


def test_three_dim_packed_sequences():
    T, H, D = 37, 2, 8  # (T, H, D) views of a (T, 3 H D) gradient
    packed = torch.full((T, 3 * H * D), 5.0, dtype=torch.float16)
    dq = packed[:, H * D: 2 * H * D].view(T, H, D)
    acc = _exact((T, H, D))
    rows_cast(dq, acc)
    assert torch.equal(dq.float(), acc)
    assert (packed[:, : H * D] == 5.0).all() and (packed[:, 2 * H * D:] == 5.0).all()


def test_cpu_and_contiguous_destinations_take_torch_copy():
    dst = torch.zeros(2, 3, 4, 8, dtype=torch.bfloat16)
    acc = _exact((2, 3, 4, 8))
    store_accumulated(dst, acc)
    assert torch.equal(dst.float(), acc)
