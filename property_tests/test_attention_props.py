"""Properties of fp8ops.attention on random shapes, masks and packings.

On the CPU the op runs the reference math. For every drawn problem (sides 1, primes and
non-multiples of 16; GQA ratios; layouts; causal/window bands; document masks; packed sequences
with empty and length-1 sequences):

- it equals an independent float64 computation with an explicit dense mask;
- with v = 1 every row that sees a key outputs 1 and every other row 0 with the masked-row LSE;
- packed sequences equal the per-sequence dense computation;
- a block mask built from a mask_mod gives the result of the mask_mod itself, for any block size;
- under TRITON_INTERPRET=1, the fused kernels equal the reference (few, tiny examples).
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch
from hypothesis import given, note, settings
from hypothesis import strategies as st

from fp8ops.testing.strategies import INTERESTING_SIDES

A = importlib.import_module("fp8ops.attention")
R = importlib.import_module("fp8ops.reference.attention")

SIDES = st.sampled_from([s for s in INTERESTING_SIDES if s <= 40]) | st.integers(1, 40)


@st.composite
def problems(draw):
    hkv = draw(st.sampled_from([1, 2]))
    return dict(
        B=draw(st.integers(1, 2)),
        Hkv=hkv,
        Hq=hkv * draw(st.sampled_from([1, 2, 3])),
        Sq=draw(SIDES),
        Skv=draw(SIDES),
        D=draw(st.sampled_from([1, 4, 8, 13])),
        layout=draw(st.sampled_from(["bhsd", "bshd", "sbhd"])),
        causal=draw(st.booleans()),
        window=draw(st.none() | st.integers(1, 8)
                    | st.tuples(st.none() | st.integers(0, 6), st.none() | st.integers(0, 6))),
        seed=draw(st.integers(0, 2**16)),
    )


def _make(p, ones_v=False):
    g = torch.Generator().manual_seed(p["seed"])
    shp = {"bhsd": lambda H, S: (p["B"], H, S, p["D"]), "bshd": lambda H, S: (p["B"], S, H, p["D"]),
           "sbhd": lambda H, S: (S, p["B"], H, p["D"])}[p["layout"]]
    q = torch.randn(shp(p["Hq"], p["Sq"]), generator=g)
    k = torch.randn(shp(p["Hkv"], p["Skv"]), generator=g)
    v = torch.ones(shp(p["Hkv"], p["Skv"])) if ones_v else torch.randn(shp(p["Hkv"], p["Skv"]), generator=g)
    return q, k, v


def _dense_visible(p):
    left, right = R.normalize_window(p["window"], p["causal"])
    i = torch.arange(p["Sq"])[:, None]
    j = torch.arange(p["Skv"])[None, :]
    vis = torch.ones(p["Sq"], p["Skv"], dtype=torch.bool)
    if left is not None:
        vis &= i - j <= left
    if right is not None:
        vis &= j - i <= right
    return vis


@given(p=problems())
def test_matches_float64_with_a_dense_mask(p):
    note(p)
    q, k, v = _make(p)
    (out, lse), _ = A.attention(q, k, v, causal=p["causal"], window=p["window"], layout=p["layout"], return_lse=True)
    q4, k4, v4 = (R.to_bhsd(t, p["layout"]).double() for t in (q, k, v))
    g = p["Hq"] // p["Hkv"]
    s = q4 @ k4.repeat_interleave(g, 1).transpose(-1, -2) * p["D"] ** -0.5
    vis = _dense_visible(p)
    s = s.masked_fill(~vis, float("-inf"))
    ref_lse = torch.logsumexp(s, -1)
    ref = (torch.exp(s - ref_lse[..., None]).nan_to_num(0.0)) @ v4.repeat_interleave(g, 1)
    ref_lse = torch.where(vis.any(-1), ref_lse, torch.full_like(ref_lse, R.MASKED_ROW_LSE))
    torch.testing.assert_close(R.to_bhsd(out, p["layout"]).double(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(_lse_to_bhs(lse, p["layout"]).double(), ref_lse, rtol=1e-5, atol=1e-5)


def _lse_to_bhs(lse, layout):
    return {"bhsd": lse, "bshd": lse.transpose(1, 2), "sbhd": lse.permute(1, 2, 0)}[layout]


@given(p=problems())
def test_rows_are_convex_combinations(p):
    q, k, v = _make(p, ones_v=True)
    (out, lse), _ = A.attention(q, k, v, causal=p["causal"], window=p["window"], layout=p["layout"], return_lse=True)
    seen = _dense_visible(p).any(-1)  # (Sq,)
    o = R.to_bhsd(out, p["layout"])
    assert torch.allclose(o[:, :, seen], torch.ones(()), atol=1e-5)
    assert (o[:, :, ~seen] == 0).all()
    assert torch.isfinite(lse).all()


@given(lens=st.lists(st.integers(0, 17), min_size=1, max_size=4), causal=st.booleans(),
       window=st.none() | st.integers(1, 6), seed=st.integers(0, 1000))
def test_packed_equals_per_sequence(lens, causal, window, seed):
    g = torch.Generator().manual_seed(seed)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    T = int(cu[-1])
    q, k, v = torch.randn(T, 2, 4, generator=g), torch.randn(T, 1, 4, generator=g), torch.randn(T, 1, 4, generator=g)
    out, _ = A.attention(q, k, v, cu_seqlens_q=cu, causal=causal, window=window)
    for s in range(len(lens)):
        a, b = int(cu[s]), int(cu[s + 1])
        if a == b:
            continue
        o, _ = A.attention(*(t[a:b].transpose(0, 1)[None] for t in (q, k, v)), causal=causal, window=window)
        torch.testing.assert_close(out[a:b], o[0].transpose(0, 1), rtol=1e-5, atol=1e-6)


@given(S=SIDES, block=st.sampled_from([16, 32]), cuts=st.lists(st.integers(1, 39), max_size=4),
       causal=st.booleans(), seed=st.integers(0, 1000))
def test_block_mask_equals_its_mask_mod(S, block, cuts, causal, seed):
    docs = torch.zeros(S, dtype=torch.int64)
    for c in cuts:
        docs[min(c, S):] += 1
    mm = A.document_mask(docs)
    if causal:
        mm = A.and_masks(A.causal_mask(), mm)
    bm = A.create_block_mask(mm, None, None, S, S, block_size=block)
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 2, S, 8, generator=g) for _ in range(3))
    a, _ = A.attention(q, k, v, block_mask=bm)
    b, _ = A.attention(q, k, v, mask_mod=mm)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    st_ = bm.block_states()[0, 0]
    assert bm.kv_num_blocks.sum() == (st_ == 1).sum() and bm.full_kv_num_blocks.sum() == (st_ == 2).sum()


@pytest.mark.interpret
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs only under TRITON_INTERPRET=1")
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@settings(max_examples=6, deadline=None)
@given(p=problems())
def test_fused_kernels_equal_the_reference(p):
    note(p)
    q, k, v = _make(p)
    left, right = R.normalize_window(p["window"], p["causal"])
    out, lse = A._attention_triton(
        q, k, v, score_mod=None, mask_mod=None, block_mask=None, scale=p["D"] ** -0.5, left=left, right=right,
        layout=p["layout"], cu_q=None, cu_kv=None, max_q=None, max_kv=None, dropout_p=0.0, seed=None,
        fwd_config={"BLOCK_M": 16, "BLOCK_N": 16})
    (ro, rl), _ = R.attention(q, k, v, causal=p["causal"], window=p["window"], layout=p["layout"], return_lse=True)
    torch.testing.assert_close(out, ro, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, rl, rtol=1e-5, atol=1e-5)
