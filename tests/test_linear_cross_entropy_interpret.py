"""The Triton launcher of kernels/linear_cross_entropy.py under TRITON_INTERPRET=1, at tiny sizes, on
CPU: per-row losses and the logits' gradient against the CPU kernel (the reference math), with rows
that span several blocks, a last partial block, ignored rows, a target outside the vocabulary, -inf
and NaN logits. Float32 to a few ulps (the interpreter's exp and log are numpy's); the half-precision
gradients to one ulp of their dtype (the interpreter truncates the downcast). Bit-exact rounding is
checked on the GPU (test_linear_cross_entropy_gpu).
"""

import os

import pytest
import torch

from fp8ops.kernels import linear_cross_entropy as K
from fp8ops.reference import linear_cross_entropy as R

pytestmark = [
    pytest.mark.interpret,
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs only under TRITON_INTERPRET=1"),
]


def _case(M: int, V: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    z = (torch.randn(M, V, generator=g) * 4.0).to(dtype)
    t = torch.randint(0, V, (M,), generator=g)
    return z, t


# (programs per "SM", pass 2 from the row's end, L2 eviction hints): one program per row, and a grid
# of 4 or 8 programs that walk several rows each (the interpreter's "SM" count is 4), forwards or
# backwards, with and without the hints
GRIDS = [(0, False, False), (1, True, False), (2, False, False), (0, True, True), (2, False, True)]


@pytest.mark.parametrize("grid", GRIDS, ids=lambda g: f"per_sm{g[0]}_rev{int(g[1])}_evict{int(g[2])}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M,V,block", [(1, 5, 16), (7, 37, 16), (5, 64, 16), (11, 300, 128)])
def test_launcher_matches_the_reference(dtype: torch.dtype, M: int, V: int, block: int, grid) -> None:
    z, t = _case(M, V, dtype, seed=M * V)
    if M > 2:
        t[1] = -100
    cfg = {"BLOCK_V": block, "num_warps": 1, "PROGRAMS_PER_SM": grid[0], "REVERSE": grid[1], "EVICT": grid[2]}
    loss, d = K.linear_cross_entropy_fwd_launch(z, t, -100, config=cfg)
    rl, rd = R.linear_cross_entropy_fwd(z, t, -100)
    torch.testing.assert_close(loss, rl, rtol=1e-5, atol=1e-5)
    assert d.dtype == dtype
    ulp = {torch.float32: 1e-5, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}[dtype]
    torch.testing.assert_close(d.float(), rd.float(), rtol=ulp, atol=1e-6)
    if M > 2:
        assert loss[1].item() == 0.0 and d[1].float().abs().sum() == 0


@pytest.mark.parametrize("evict", [False, True])
def test_strided_rows_special_values_and_bad_targets(evict: bool) -> None:
    big = torch.randn(4, 40) * 3.0
    z = big[:, :33]  # a row stride of 40
    z[0, 3] = float("-inf")
    z[2, 5] = float("nan")
    t = torch.tensor([3, 0, 1, 33])  # row 0's target is the -inf logit; row 3's is outside [0, 33)
    t[1] = 12
    z[1, 16:32] = float("-inf")  # a whole block of row 1 masked out
    cfg = {"BLOCK_V": 16, "num_warps": 1, "PROGRAMS_PER_SM": 1, "REVERSE": True,  # 4 programs, 4 rows
           "EVICT": evict}
    loss, d = K.linear_cross_entropy_fwd_launch(z, t, -100, config=cfg)
    rl, rd = R.linear_cross_entropy_fwd(z, t, -100)
    assert loss[0].item() == float("inf")  # -log(0), as torch
    assert loss[2].isnan() and loss[3].isnan()
    torch.testing.assert_close(loss[1], rl[1], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(d[[0, 1, 3]], rd[[0, 1, 3]], rtol=1e-5, atol=1e-6)
    assert d[2].isnan().all()


def test_empty_batch() -> None:
    loss, d = K.linear_cross_entropy_fwd_launch(torch.empty(0, 9), torch.empty(0, dtype=torch.long), -100)
    assert loss.shape == (0,) and d.shape == (0, 9)


def test_strided_targets_through_the_op() -> None:
    z, t = _case(6, 20, torch.float32, seed=3)
    t2 = torch.stack([t, t.flip(0)], 1)[:, 0]  # a 1-D view with stride 2
    with pytest.raises(ValueError, match="with a unit stride"):
        K.linear_cross_entropy_fwd_launch(z, t2, -100)
    got = K.linear_cross_entropy_fwd_launch(z, t2.contiguous(), -100, config={"BLOCK_V": 16, "num_warps": 1})
    torch.testing.assert_close(got[0], R.linear_cross_entropy_fwd(z, t, -100)[0], rtol=1e-5, atol=1e-5)
