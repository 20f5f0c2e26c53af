"""The Triton launcher of kernels/tied_embedding.py under TRITON_INTERPRET=1, at tiny sizes, on CPU:
hand-computed adds (a token's rows summed before the one rounding into a bf16 row), runs of one
token longer than a step of the kernel, rows of tokens that do not occur left untouched, int32
tokens, strided rows and gradients, column blocks with a partial last one, and the launcher's
argument checks; against the CPU kernel (the reference math) elsewhere. Float32 sums in another
order than the reference's, so float32 results agree to a few ulps; bit-exact results on the GPU
(test_tied_embedding_gpu).
"""

import os

import pytest
import torch

from fp8ops.kernels import tied_embedding as K
from fp8ops.reference import tied_embedding as R

pytestmark = [
    pytest.mark.interpret,
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs only under TRITON_INTERPRET=1"),
]


def test_hand_computed_sum_first_then_one_rounding() -> None:
    # bf16 has 8 significant bits: 256 + 1 rounds back to 256, 256 + 4 = 260 is exact. Four rows
    # of 1 for token 2 must be summed first (4), then added once to 256.
    g = torch.tensor([[0.5, 1.0], [7.0, 7.0], [256.0, -256.0]], dtype=torch.bfloat16)
    tokens = torch.tensor([2, 0, 2, 2, 2])
    rows = torch.tensor([[1.0, -1.0], [0.25, 0.5], [1.0, -1.0], [1.0, -1.0], [1.0, -1.0]], dtype=torch.bfloat16)
    K.tied_embedding_bwd_launch(g, tokens, rows, config={"BLOCK_R": 2, "BLOCK_K": 16, "num_warps": 1})
    expect = torch.tensor([[0.75, 1.5], [7.0, 7.0], [260.0, -260.0]], dtype=torch.bfloat16)
    assert torch.equal(g, expect)


@pytest.mark.parametrize("block_r", [1, 4, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_runs_longer_than_a_step_match_the_reference(dtype: torch.dtype, block_r: int) -> None:
    gen = torch.Generator().manual_seed(block_r)
    V, T, Kd = 9, 40, 37
    tokens = torch.randint(0, 4, (T,), generator=gen)  # tokens 0-3 only, about 10 positions each
    tokens[5:19] = 3  # a run of at least 14 positions of one token, spread over several steps
    g = torch.randn(V, Kd, generator=gen).to(dtype)
    rows = torch.randn(T, Kd, generator=gen).to(dtype)
    want = R.add_rows(g, tokens, rows)
    got = g.clone()
    K.tied_embedding_bwd_launch(got, tokens, rows, config={"BLOCK_R": block_r, "BLOCK_K": 16, "num_warps": 1})
    assert torch.equal(got[4:], g[4:])  # tokens that do not occur: untouched
    tol = {torch.float32: 1e-5, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}[dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_int32_tokens_strided_rows_and_gradient() -> None:
    gen = torch.Generator().manual_seed(3)
    V, T, Kd = 6, 11, 20
    tokens = torch.randint(0, V, (T,), generator=gen, dtype=torch.int32)
    g_base = torch.randn(V, Kd + 5, generator=gen)
    g = g_base[:, :Kd]  # a row stride of Kd + 5
    rows = torch.randn(T, Kd + 3, generator=gen)[:, 3:]  # a row stride of Kd + 3
    want = R.add_rows(g, tokens.long(), rows)
    past = g_base[:, Kd:].clone()
    K.tied_embedding_bwd_launch(g, tokens, rows, config={"BLOCK_R": 4, "BLOCK_K": 16, "num_warps": 1})
    torch.testing.assert_close(g, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(g_base[:, Kd:], past)  # nothing written past the view


def test_empty_tokens_change_nothing() -> None:
    g = torch.randn(4, 8)
    before = g.clone()
    K.tied_embedding_bwd_launch(g, torch.empty(0, dtype=torch.long), torch.empty(0, 8))
    assert torch.equal(g, before)


def test_launcher_checks_its_arguments() -> None:
    g, tokens, rows = torch.zeros(4, 8), torch.tensor([1, 2]), torch.ones(2, 8)
    with pytest.raises(ValueError, match="tied_embedding_bwd_launch: g must be a 2-D"):
        K.tied_embedding_bwd_launch(torch.zeros(8, 4).t(), tokens, rows)
    with pytest.raises(ValueError, match="tokens must be a 1-D int64/int32"):
        K.tied_embedding_bwd_launch(g, tokens.float(), rows)
    with pytest.raises(ValueError, match=r"rows must be a \(2, 8\) float tensor"):
        K.tied_embedding_bwd_launch(g, tokens, torch.ones(3, 8))
    with pytest.raises(ValueError, match="rows must be"):
        K.tied_embedding_bwd_launch(g, tokens, torch.ones(8, 2).t())
    with pytest.raises(ValueError, match="unknown launch config keys"):
        K.tied_embedding_bwd_launch(g, tokens, rows, config={"BLOCK": 4})
