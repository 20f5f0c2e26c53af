"""``fp8ops.tied_embedding`` on CPU: hand-computed rows and gradients, the gradient against the FP32
reference (the table used twice, added by autograd) and against plain PyTorch at the same
precision, the one-rounding rule of the added rows, either output unused, argument errors, and
its composition with torch.func (grad, vjp, vmap) and torch.compile.

The op's backward is its own (the lookup's rows summed per token and added into the head's
gradient), so comparing with :func:`fp8ops.reference.tied_embedding.tied_embedding`, differentiated
by autograd, checks it.
"""

from __future__ import annotations

import pytest
import torch

from fp8ops import tied_embedding
from fp8ops._glue import GUARD_MESSAGE
from fp8ops.reference import tied_embedding as R
from fp8ops.testing import assert_close_rule
from fp8ops.testing.tied_head import plain_tied as _plain, tied_grad as _grad, tied_inputs, tied_loss as _loss


def _inputs(V: int, K: int, shape: tuple[int, ...], dtype: torch.dtype = torch.float32, seed: int = 0):
    return tied_inputs(V, K, shape, dtype, seed=seed)


# ------------------------------------------------------------------------------------------------
# Hand-computed values


def test_hand_computed_rows_and_gradient() -> None:
    w = torch.tensor([[1.0, 0.0], [0.0, 2.0], [3.0, 3.0]], requires_grad=True)
    rows, head = tied_embedding(torch.tensor([[2, 0], [2, 2]]), w)
    torch.testing.assert_close(rows.detach(), torch.tensor([[[3.0, 3.0], [1.0, 0.0]], [[3.0, 3.0], [3.0, 3.0]]]))
    assert head.data_ptr() == w.data_ptr() and head.shape == w.shape
    # rows weighted (1, 2) per element, the head's row 1 by 10: token 2 three times, token 0 once
    (rows * torch.tensor([1.0, 2.0])).sum().add(10 * head[1].sum()).backward()
    torch.testing.assert_close(w.grad, torch.tensor([[1.0, 2.0], [10.0, 10.0], [3.0, 6.0]]), rtol=0, atol=0)


def test_rows_of_a_token_are_summed_first_then_added_once() -> None:
    # bfloat16 keeps 8 significant bits: 256 + 1 rounds back to 256, so adding a token's rows one
    # at a time to the head's 256 would lose every 1; summed first (4) they are added in one step.
    w = torch.zeros(2, 1, dtype=torch.bfloat16, requires_grad=True)
    rows, head = tied_embedding(torch.tensor([1, 1, 1, 1]), w)
    (rows.sum() + 256 * head[1].sum()).backward()
    assert w.grad[1, 0].item() == 260.0 and w.grad[0, 0].item() == 0.0


def test_library_op_adds_in_place_on_cpu() -> None:
    # fp8ops::tied_embedding_bwd (the backward's CUDA kernel on the GPU) has the reference math as
    # its CPU kernel: the same sum-first rule, written into its first argument
    g = torch.tensor([[0.5, 1.0], [7.0, 7.0], [256.0, -256.0]], dtype=torch.bfloat16)
    rows = torch.tensor([[1.0, -1.0], [0.25, 0.5], [1.0, -1.0], [1.0, -1.0], [1.0, -1.0]], dtype=torch.bfloat16)
    assert torch.ops.fp8ops.tied_embedding_bwd(g, torch.tensor([2, 0, 2, 2, 2], dtype=torch.int32), rows) is None
    assert torch.equal(g, torch.tensor([[0.75, 1.5], [7.0, 7.0], [260.0, -260.0]], dtype=torch.bfloat16))


def test_no_head_gradient_and_no_rows_gradient() -> None:
    w = torch.tensor([[1.0, 2.0], [3.0, 4.0]], requires_grad=True)
    rows, _ = tied_embedding(torch.tensor([1, 1, 0]), w)
    (gw,) = torch.autograd.grad(rows.sum(), w)  # the head unused: the lookup's rows on zeros
    torch.testing.assert_close(gw, torch.tensor([[1.0, 1.0], [2.0, 2.0]]), rtol=0, atol=0)
    _, head = tied_embedding(torch.tensor([1, 1, 0]), w)
    (gw,) = torch.autograd.grad((3 * head).sum(), w)  # the rows unused: the head's gradient as is
    torch.testing.assert_close(gw, torch.full((2, 2), 3.0), rtol=0, atol=0)


# ------------------------------------------------------------------------------------------------
# Against the reference and plain PyTorch


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("V,K,shape", [(1, 3, (4,)), (7, 5, (3, 6)), (300, 16, (2, 64)), (50, 8, (0,))])
def test_gradient_follows_the_reference(dtype: torch.dtype, V: int, K: int, shape: tuple[int, ...]) -> None:
    w, tokens, x, c = _inputs(V, K, shape, dtype, seed=V + K)
    rows, head = tied_embedding(tokens, w)
    ref_rows, _ = R.tied_embedding(tokens, w)
    torch.testing.assert_close(rows, ref_rows.to(dtype), rtol=0, atol=0)
    assert head.dtype == dtype and torch.equal(head, w)
    got = _grad(tied_embedding, w, tokens, x, c)
    want = _grad(R.tied_embedding, w.float(), tokens, x.float(), c.float())
    same = _grad(_plain, w, tokens, x, c)  # plain PyTorch at the op's precision
    assert got.dtype == dtype
    assert_close_rule(got.float(), want, same.float(), name="dW")


def test_float32_gradient_equals_plain_pytorch_closely() -> None:
    w, tokens, x, c = _inputs(40, 12, (5, 30), seed=3)
    torch.testing.assert_close(_grad(tied_embedding, w, tokens, x, c), _grad(_plain, w, tokens, x, c),
                               rtol=1e-6, atol=1e-6)


def test_int32_tokens_and_a_strided_head_gradient() -> None:
    w, tokens, x, c = _inputs(20, 6, (3, 9), seed=4)
    want = _grad(tied_embedding, w, tokens, x, c)
    torch.testing.assert_close(_grad(tied_embedding, w, tokens.int(), x, c), want, rtol=0, atol=0)
    wl = w.clone().requires_grad_()  # the head's gradient arrives transposed (x^T g of head.t())
    rows, head = tied_embedding(tokens, wl)
    ht = head.t()
    ((rows * c).sum() + (x.reshape(-1, 6) @ ht).sin().sum()).backward()
    torch.testing.assert_close(wl.grad, want, rtol=1e-6, atol=1e-6)


def test_the_incoming_head_gradient_is_not_changed() -> None:
    w = torch.zeros(3, 2, requires_grad=True)
    rows, head = tied_embedding(torch.tensor([0, 2]), w)
    v = torch.ones(3, 2)
    (gw,) = torch.autograd.grad((rows, head), w, grad_outputs=(torch.ones(2, 2), v))
    torch.testing.assert_close(v, torch.ones(3, 2), rtol=0, atol=0)  # the caller's tensor as it was
    torch.testing.assert_close(gw, torch.tensor([[2.0, 2.0], [1.0, 1.0], [2.0, 2.0]]), rtol=0, atol=0)


# ------------------------------------------------------------------------------------------------
# Errors


def test_token_outside_the_table_raises_on_cpu() -> None:
    w = torch.zeros(4, 2)
    for bad in (4, -1):
        with pytest.raises(IndexError, match=rf"tied_embedding: tokens holds {bad}, outside \[0, 4\)"):
            tied_embedding(torch.tensor([0, bad]), w)


@pytest.mark.parametrize("bad,err,match", [
    (dict(tokens=[0, 1]), TypeError, "tied_embedding: tokens must be a torch.Tensor of token indices, got list"),
    (dict(tokens=torch.zeros(2)), ValueError, "tokens must be int64 or int32 token indices, got torch.float32"),
    (dict(weight="w"), TypeError, "tied_embedding: weight must be a torch.Tensor, got str"),
    (dict(weight=torch.zeros(4, 2, dtype=torch.int64)), ValueError, "weight must be float32, bfloat16 or float16"),
    (dict(weight=torch.zeros(8)), ValueError, r"weight must be a 2-D \(V, K\) table with V >= 1, got shape \(8,\)"),
    (dict(weight=torch.zeros(0, 2)), ValueError, r"V >= 1, got shape \(0, 2\)"),
    (dict(weight=torch.zeros(4, 2, device="meta")), ValueError, "tokens is on cpu but weight is on meta"),
])
def test_bad_arguments_are_named(bad, err, match) -> None:
    args = {"tokens": torch.tensor([0, 1]), "weight": torch.zeros(4, 2)} | bad
    with pytest.raises(err, match=match):
        tied_embedding(args["tokens"], args["weight"])


# ------------------------------------------------------------------------------------------------
# torch.func, vmap, torch.compile


def test_torch_func_grad_and_vjp_match_autograd() -> None:
    w, tokens, x, c = _inputs(30, 8, (4, 7), seed=5)
    want = _grad(tied_embedding, w, tokens, x, c)
    got = torch.func.grad(lambda a: _loss(tied_embedding, a, tokens, x, c))(w)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    (rows, head), vjp = torch.func.vjp(lambda a: tied_embedding(tokens, a), w)
    (gw,) = vjp((c, torch.ones_like(head)))
    want = torch.ones_like(w).index_add(0, tokens.reshape(-1), c.reshape(-1, 8))
    torch.testing.assert_close(gw, want, rtol=1e-6, atol=1e-6)


def test_vmap_over_token_batches() -> None:
    w, tokens, x, c = _inputs(25, 6, (3, 11), seed=6)
    grad = torch.func.grad(lambda a, t, xx, cc: _loss(tied_embedding, a, t, xx, cc))
    got = torch.func.vmap(grad, in_dims=(None, 0, 0, 0))(w, tokens, x, c)
    want = torch.stack([_grad(tied_embedding, w, tokens[i], x[i], c[i]) for i in range(3)])
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_fullgraph_matches_eager(backend: str) -> None:
    w, tokens, x, c = _inputs(60, 8, (2, 40), seed=7)
    want = _grad(tied_embedding, w, tokens, x, c)
    fn = torch.compile(lambda t, a: tied_embedding(t, a), fullgraph=True, backend=backend)
    torch.testing.assert_close(_grad(fn, w, tokens, x, c), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("argnums", [0, (0, 1)])
def test_compiled_func_grad_raises(argnums) -> None:
    w, tokens, x, c = _inputs(10, 4, (6,), seed=8)
    fn = torch.compile(torch.func.grad(lambda a, b: _loss(tied_embedding, a, tokens, b, c), argnums=argnums),
                       backend="aot_eager", fullgraph=True)
    with pytest.raises(Exception, match="pytorch#193279"):
        fn(w, x)
    assert "pytorch#193279" in GUARD_MESSAGE
