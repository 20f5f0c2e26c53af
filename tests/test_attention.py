"""attention on the CPU (the reference path): semantics, the mod library, block masks, packed
sequences, numerics, errors, and the composition canaries.

The reference itself is checked against an independent float64 implementation (explicit dense
masks) and against ``F.scaled_dot_product_attention``. Composition matrix (DESIGN.md §4) on CPU:
eager autograd, torch.func grad / grad_and_value / vjp (including a captured, learned bias table),
vmap, torch.compile(fullgraph=True) + .backward(); on CPU the op is plain differentiable PyTorch, so
torch.compile(torch.func.grad(...)) is exact (the fused CUDA path is checked in test_attention_gpu).
"""

from __future__ import annotations

import doctest
import importlib
import math

import pytest
import torch
import torch.nn.functional as F

import fp8ops
from fp8ops.testing import dropout_hash as DH

A = importlib.import_module("fp8ops.attention")
R = importlib.import_module("fp8ops.reference.attention")
K = importlib.import_module("fp8ops.kernels.attention")

attention = A.attention
modmath = A.modmath


def _dense_mask(Sq, Skv, *, left=None, right=None, extra=None):
    i = torch.arange(Sq)[:, None]
    j = torch.arange(Skv)[None, :]
    m = torch.ones(Sq, Skv, dtype=torch.bool)
    if left is not None:
        m &= i - j <= left
    if right is not None:
        m &= j - i <= right
    if extra is not None:
        m = m & extra
    return m


def _naive(q, k, v, mask=None, bias=None, scale=None):
    """float64 attention on (B, H, S, D) with a dense boolean mask; rows that see nothing give 0."""
    q, k, v = q.double(), k.double(), v.double()
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = q @ k.transpose(-1, -2) * (scale if scale is not None else q.shape[-1] ** -0.5)
    if bias is not None:
        s = s + bias.double()
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    out = p @ v
    lse = torch.where(torch.isfinite(lse), lse, torch.full_like(lse, R.MASKED_ROW_LSE))
    return out, lse


def _qkv(B=2, Hq=4, Hkv=2, Sq=9, Skv=9, D=8, Dv=None, dtype=torch.float32, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, Sq, D, generator=g).to(dtype)
    k = torch.randn(B, Hkv, Skv, D, generator=g).to(dtype)
    v = torch.randn(B, Hkv, Skv, Dv or D, generator=g).to(dtype)
    if grad:
        for t in (q, k, v):
            t.requires_grad_()
    return q, k, v


def _close(a, b, tol=2e-5):
    torch.testing.assert_close(a.double(), b.double(), rtol=tol, atol=tol)


# ------------------------------------------------------------------------------------------------
# The reference against independent implementations


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("Hq,Hkv", [(4, 4), (4, 2), (4, 1)])
@pytest.mark.parametrize("Sq,Skv", [(1, 1), (7, 7), (5, 13), (13, 5)])
def test_matches_sdpa(causal, Hq, Hkv, Sq, Skv):
    q, k, v = _qkv(Hq=Hq, Hkv=Hkv, Sq=Sq, Skv=Skv)
    (out, lse), st = attention(q, k, v, causal=causal, return_lse=True)
    assert st is None and out.dtype == q.dtype and out.shape == q.shape
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    mask = _dense_mask(Sq, Skv, right=0 if causal else None)
    visible = mask.any(-1)
    _close(out[..., visible, :], ref[..., visible, :])
    n_out, n_lse = _naive(q, k, v, mask)
    _close(out, n_out)
    _close(lse, n_lse)


@pytest.mark.parametrize("window,causal",
                         [(3, False), ((2, 1), False), ((None, 2), False), ((4, None), True), (1, False)])
def test_window_band(window, causal):
    q, k, v = _qkv(Sq=11, Skv=14)
    out, _ = attention(q, k, v, window=window, causal=causal)
    left, right = R.normalize_window(window, causal)
    n_out, _ = _naive(q, k, v, _dense_mask(11, 14, left=left, right=right))
    _close(out, n_out)


def test_window_int_is_sliding_window_mask():
    q, k, v = _qkv(Sq=12, Skv=12)
    a, _ = attention(q, k, v, window=4)
    b, _ = attention(q, k, v, mask_mod=A.sliding_window_mask(4))
    c, _ = attention(q, k, v, causal=True, window=(3, None))
    _close(a, b, 0)
    _close(a, c, 0)


def test_scale_and_head_dim_v():
    q, k, v = _qkv(D=8, Dv=5)
    out, _ = attention(q, k, v, scale=0.3)
    n_out, _ = _naive(q, k, v, scale=0.3)
    assert out.shape == (2, 4, 9, 5)
    _close(out, n_out)


@pytest.mark.parametrize("layout", ["bshd", "sbhd"])
def test_layouts(layout):
    q, k, v = _qkv(Sq=6, Skv=10)
    (ref, ref_lse), _ = attention(q, k, v, causal=True, return_lse=True)
    conv = {"bshd": lambda t: t.transpose(1, 2).contiguous(),
            "sbhd": lambda t: t.permute(2, 0, 1, 3).contiguous()}[layout]
    (out, lse), _ = attention(conv(q), conv(k), conv(v), causal=True, layout=layout, return_lse=True)
    assert out.is_contiguous()
    _close(out, conv(ref), 0)
    assert lse.shape == conv(ref_lse[..., None]).shape[:-1]
    _close(lse, conv(ref_lse[..., None])[..., 0], 0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs_computed_in_fp32(dtype):
    q, k, v = _qkv(dtype=dtype)
    out, _ = attention(q, k, v)
    assert out.dtype == dtype
    n_out, _ = _naive(q, k, v)
    assert (out.double() - n_out).abs().max() <= 2.0**-7 * 4


# ------------------------------------------------------------------------------------------------
# Mods


def _idx(B, H, Sq, Skv):
    return (torch.arange(B).view(B, 1, 1, 1), torch.arange(H).view(1, H, 1, 1),
            torch.arange(Sq).view(1, 1, Sq, 1), torch.arange(Skv).view(1, 1, 1, Skv))


def test_score_mod_is_applied_in_fp32_before_softmax():
    q, k, v = _qkv(Sq=6, Skv=8)

    @A.score_mod
    def shifted(score, b, h, q_idx, kv_idx):
        bias = (h + 1) * 0.5 - modmath.abs(q_idx - kv_idx) * 0.25
        return score * 0.5 + bias

    out, _ = attention(q, k, v, score_mod=shifted)
    b, h, i, j = _idx(2, 4, 6, 8)
    s = (q.double() @ k.double().repeat_interleave(2, 1).transpose(-1, -2)) * 8**-0.5
    s = s * 0.5 + (h + 1) * 0.5 - (i - j).abs() * 0.25
    p = torch.softmax(s, -1)
    _close(out, p @ v.double().repeat_interleave(2, 1))


def _alibi_slopes(n):
    # The ALiBi paper's reference code.
    def pow2(n):
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start**i for i in range(n)]

    if math.log2(n).is_integer():
        return pow2(n)
    c = 2 ** math.floor(math.log2(n))
    return pow2(c) + _alibi_slopes(2 * c)[0::2][: n - c]


@pytest.mark.parametrize("H", [1, 4, 6, 12])
def test_alibi_slopes_match_the_paper(H):
    mod = A.alibi(H)
    b, h, i, j = _idx(1, H, 1, 2)
    got = mod(torch.zeros(1, H, 1, 2), b, h, i, j)[0, :, 0, 1]  # slope * (1 - 0)
    torch.testing.assert_close(got, torch.tensor(_alibi_slopes(H), dtype=torch.float32))
    t = A.alibi(torch.tensor(_alibi_slopes(H)))
    torch.testing.assert_close(t(torch.zeros(1, H, 1, 2), b, h, i, j)[0, :, 0, 1], got)


def test_softcap_and_relative_bias_values():
    s = torch.tensor([-100.0, -1.0, 0.0, 3.0, 100.0])
    torch.testing.assert_close(A.softcap(5.0)(s, 0, 0, 0, 0), 5.0 * torch.tanh(s / 5.0))
    table = torch.arange(2 * 7).float().view(2, 7)  # R = 3
    b, h, i, j = _idx(1, 2, 4, 9)
    got = A.relative_position_bias(table)(torch.zeros(1, 2, 4, 9), b, h, i, j)
    want = table[h, (j - i).clamp(-3, 3) + 3]
    torch.testing.assert_close(got, want.float())


def test_mask_library_values():
    b, h, i, j = _idx(2, 1, 6, 6)
    assert torch.equal(A.causal_mask()(b, h, i, j), (i >= j).expand(2, 1, 6, 6)[:1])
    assert torch.equal(A.sliding_window_mask(2)(b, h, i, j), ((i - j >= 0) & (i - j < 2)))
    assert torch.equal(A.prefix_lm_mask(3)(b, h, i, j), (j <= i) | (j < 3))
    per_b = A.prefix_lm_mask(torch.tensor([1, 4]))(b, h, i, j)
    assert torch.equal(per_b[1], ((j <= i) | (j < 4))[0])
    assert torch.equal(per_b[0], ((j <= i) | (j < 1))[0])
    docs = torch.tensor([[0, 0, 1, 1, 1, 2], [0, 1, 1, 1, 1, 1]])
    got = A.document_mask(docs)(b, h, i, j)
    for bb in range(2):
        assert torch.equal(got[bb, 0], docs[bb][:, None] == docs[bb][None, :])
    assert torch.equal(A.document_mask(docs[0])(b, h, i, j)[0, 0], docs[0][:, None] == docs[0][None, :])


def test_and_or_masks():
    b, h, i, j = _idx(1, 1, 5, 5)
    c, p = A.causal_mask(), A.prefix_lm_mask(2)
    assert torch.equal(A.and_masks(c, p)(b, h, i, j), c(b, h, i, j) & p(b, h, i, j))
    assert torch.equal(A.or_masks(c, lambda b, h, q, k: k == 4)(b, h, i, j), c(b, h, i, j) | (j == 4))
    assert A.and_masks()(b, h, i, j).all()


def test_mask_mod_and_score_mod_in_attention_match_naive():
    q, k, v = _qkv(Sq=10, Skv=10)
    docs = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2, 3])
    mm = A.and_masks(A.causal_mask(), A.document_mask(docs))
    sm = A.alibi(4)
    out, _ = attention(q, k, v, score_mod=sm, mask_mod=mm)
    b, h, i, j = _idx(2, 4, 10, 10)
    bias = sm(torch.zeros(2, 4, 10, 10), b, h, i, j)
    mask = (i >= j) & (docs[i] == docs[j])
    n_out, _ = _naive(q, k, v, mask, bias=bias)
    _close(out, n_out)


def test_plain_functions_are_accepted_as_mods():
    q, k, v = _qkv()
    a, _ = attention(q, k, v, score_mod=lambda s, b, h, i, j: s * 2.0, mask_mod=lambda b, h, i, j: i >= j)
    b_, _ = attention(q, k, v, score_mod=A.ScoreMod(lambda s, b, h, i, j: s * 2.0), causal=True)
    _close(a, b_, 0)


# ------------------------------------------------------------------------------------------------
# Mod code generation (the Triton twin is text; compiled in the interpreter/GPU tests)


def test_generated_twin_and_derivative():
    table = torch.zeros(3, 9, requires_grad=True)
    src = A.relative_position_bias(table).triton_source()
    assert "_fp8_mm_load(_fp8_t0" in src and "tl.atomic_add(_fp8_g0" in src
    src = A.softcap(30.0).triton_source()
    assert "30.0 * _fp8_mm_tanh" in src and "_bwd" in src
    assert "_fp8_mm_exp2" in A.alibi(8).triton_source()


def test_mods_with_the_same_code_and_constants_share_a_kernel():
    assert A.softcap(10.0).key == A.softcap(10.0).key
    assert A.softcap(10.0).key != A.softcap(20.0).key
    t1, t2 = torch.zeros(2, 5), torch.ones(2, 5)
    assert A.relative_position_bias(t1).key == A.relative_position_bias(t2).key
    assert A.relative_position_bias(t1).buffers[0] is t1


def test_user_mod_with_locals_augassign_power_and_where():
    cap = 4.0

    @A.score_mod
    def fancy(score, b, h, q_idx, kv_idx):
        x = score / cap
        x += 0.0
        y = modmath.where(q_idx >= kv_idx, x, x * 0.5)
        return cap * modmath.tanh(y) + (score**2) * 0.01

    src = fancy.triton_source()
    assert "4.0" in src and "**" not in src.split("def")[1]  # powers are expanded to products
    q, k, v = _qkv()
    out, _ = attention(q, k, v, score_mod=fancy)
    assert torch.isfinite(out).all()


TABLE = torch.zeros(4)
_BAD_MODS = [
    (lambda s, b, h, i, j: torch.tanh(s), "not supported"),
    (lambda s, b, h, i, j: s if True else s, "modmath.where"),
    (lambda s, b, h, i, j: s and s, "use & and |"),
    (lambda s, b, h, i, j: TABLE[i], "modmath.load"),
    (lambda s, b, h, i, j: s + TABLE, "modmath.load"),
    (lambda s, b, h, i, j: s ** 0.5, "exponent"),
    (lambda s, b, h, i, j: 0 < s < 1, "chained"),
    (lambda s, b, h, i, j: modmath.cosh(s), "no function"),
    (lambda s, b, h: s, "5 arguments"),
]


@pytest.mark.parametrize("fn,msg", _BAD_MODS, ids=[m for _, m in _BAD_MODS])
def test_unsupported_mod_bodies_raise_clearly(fn, msg):
    with pytest.raises(A.ModError, match=msg):
        A.ScoreMod(fn)


def test_mod_without_source_raises():
    fn = eval("lambda s, b, h, i, j: s")  # noqa: S307
    with pytest.raises(A.ModError, match="source is not available"):
        A.ScoreMod(fn)


def test_mod_with_if_statement_raises():
    def branchy(score, b, h, q_idx, kv_idx):
        if score > 0:
            return score
        return -score

    with pytest.raises(A.ModError, match="straight-line"):
        A.ScoreMod(branchy)


def test_too_many_captured_tensors():
    a, b_, c, d, e = (torch.zeros(3) for _ in range(5))

    def many(score, b, h, q_idx, kv_idx):
        t = modmath.load(a, h) + modmath.load(b_, h) + modmath.load(c, h)
        return score + t + modmath.load(d, h) + modmath.load(e, h)

    with pytest.raises(A.ModError, match="at most 4"):
        A.ScoreMod(many)


# ------------------------------------------------------------------------------------------------
# Block masks


def test_block_mask_classification():
    Sq, Skv, bs = 70, 50, 16
    docs = torch.arange(70) // 23

    def mm(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (modmath.load(docs, q_idx) == modmath.load(docs, kv_idx))

    mod = A.MaskMod(mm)
    bm = A.create_block_mask(mod, None, None, Sq, Skv, block_size=bs)
    st = bm.block_states()[0, 0]
    i = torch.arange(Sq)[:, None]
    j = torch.arange(Skv)[None, :]
    dense = (i >= j) & (docs[i] == docs[j.clamp(max=69)])
    for qb in range(st.shape[0]):
        for kb in range(st.shape[1]):
            blk = dense[qb * bs:(qb + 1) * bs, kb * bs:(kb + 1) * bs]
            want = 0 if not blk.any() else 2 if blk.all() else 1
            assert st[qb, kb].item() == want, (qb, kb)
    # transposed lists describe the same blocks
    t = A.BlockMask(bm.q_num_blocks, bm.q_indices, bm.full_q_num_blocks, bm.full_q_indices,
                    bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices,
                    (Skv, Sq), (bs, bs), mod).block_states()[0, 0]
    assert torch.equal(t, st.t())
    assert 0.0 < bm.sparsity() < 1.0 and "BlockMask" in repr(bm)


def test_block_mask_depending_on_batch_and_head():
    def mm(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx + (b + h) * 16

    bm = A.create_block_mask(mm, 2, 3, 64, 64, block_size=16)
    assert bm.kv_num_blocks.shape == (2, 3, 4)
    st = bm.block_states()
    assert not torch.equal(st[0, 0], st[1, 2])


def test_attention_with_block_mask_equals_mask_mod():
    q, k, v = _qkv(Sq=40, Skv=40, grad=True)
    docs = torch.arange(40) // 13
    mm = A.and_masks(A.causal_mask(), A.document_mask(docs))
    bm = A.create_block_mask(mm, None, None, 40, 40, block_size=16)
    a, _ = attention(q, k, v, block_mask=bm)
    b_, _ = attention(q, k, v, mask_mod=mm)
    _close(a, b_, 0)


def test_block_mask_semantics_full_blocks_skip_the_mask_mod():
    # As in FlexAttention: inside full blocks the mask_mod is not evaluated. A block mask built from
    # another mask than the one passed shows it: here causal blocks with a sliding-window mask_mod.
    q, k, v = _qkv(Sq=32, Skv=32)
    bm = A.create_block_mask(A.causal_mask(), None, None, 32, 32, block_size=16)
    out, _ = attention(q, k, v, block_mask=bm, mask_mod=A.sliding_window_mask(4))
    i, j = torch.arange(32)[:, None], torch.arange(32)[None, :]
    full = (i // 16) > (j // 16)
    partial = (i // 16) == (j // 16)
    n_out, _ = _naive(q, k, v, full | (partial & (i - j >= 0) & (i - j < 4)))
    _close(out, n_out)


# ------------------------------------------------------------------------------------------------
# Packed sequences


def _packed(lens_q, lens_kv, Hq=4, Hkv=2, D=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_kv = torch.tensor([0, *torch.tensor(lens_kv).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(cu_q[-1]), Hq, D, generator=g)
    k = torch.randn(int(cu_kv[-1]), Hkv, D, generator=g)
    v = torch.randn(int(cu_kv[-1]), Hkv, D, generator=g)
    return q, k, v, cu_q, cu_kv


@pytest.mark.parametrize("causal", [False, True])
def test_packed_equals_per_sequence(causal):
    lens_q, lens_kv = [3, 1, 7, 5], [4, 2, 7, 9]
    q, k, v, cu_q, cu_kv = _packed(lens_q, lens_kv)
    sm = A.alibi(4)
    (out, lse), _ = attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv, causal=causal, score_mod=sm,
                              return_lse=True)
    assert out.shape == q.shape and lse.shape == q.shape[:2]
    for s in range(4):
        qs = q[cu_q[s]:cu_q[s + 1]].transpose(0, 1)[None]
        ks = k[cu_kv[s]:cu_kv[s + 1]].transpose(0, 1)[None]
        vs = v[cu_kv[s]:cu_kv[s + 1]].transpose(0, 1)[None]
        (o, l), _ = attention(qs, ks, vs, causal=causal, score_mod=sm, return_lse=True)
        # mods see positions inside the sequence, and b is the sequence index (b = 0 here: alibi ignores it)
        _close(out[cu_q[s]:cu_q[s + 1]], o[0].transpose(0, 1))
        _close(lse[cu_q[s]:cu_q[s + 1]], l[0].transpose(0, 1))


def test_packed_mods_see_the_sequence_index():
    q, k, v, cu_q, cu_kv = _packed([4, 6], [4, 6])
    mm = A.prefix_lm_mask(torch.tensor([1, 3]))
    out, _ = attention(q, k, v, cu_seqlens_q=cu_q, mask_mod=mm)
    for s, n in enumerate([1, 3]):
        a, b_ = int(cu_q[s]), int(cu_q[s + 1])
        o, _ = attention(q[a:b_].transpose(0, 1)[None], k[a:b_].transpose(0, 1)[None], v[a:b_].transpose(0, 1)[None],
                         mask_mod=A.prefix_lm_mask(n))
        _close(out[a:b_], o[0].transpose(0, 1))


def test_packed_tokens_after_the_last_sequence_are_refused():
    """Offsets that end before T would leave the trailing tokens in no sequence (output 0)."""
    q, k, v, cu_q, _ = _packed([3, 4], [3, 4])
    q2 = torch.cat([q, torch.randn(2, 4, 8)])
    with pytest.raises(ValueError, match=r"cu_seqlens_q ends at 7, before the end of the 9 packed tokens"):
        attention(q2, k, v, cu_seqlens_q=cu_q, cu_seqlens_kv=cu_q, return_lse=True)


def test_nested_tensors_are_sugar_for_packed():
    seqs = [torch.randn(n, 4, 8) for n in (3, 1, 6)]
    nt = torch.nested.nested_tensor(seqs, layout=torch.jagged)
    (out, lse), _ = attention(nt, nt, nt, causal=True, return_lse=True)
    assert out.is_nested and lse.is_nested
    for s, o in zip(seqs, out.unbind()):
        ref = F.scaled_dot_product_attention(*(s.transpose(0, 1)[None],) * 3, is_causal=True)[0].transpose(0, 1)
        _close(o, ref)
    nt_t = nt.transpose(1, 2)  # (B, H, j, D), the layout SDPA takes
    out_t, _ = attention(nt_t, nt_t, nt_t, causal=True)
    _close(out_t.transpose(1, 2).values(), out.values(), 0)


# ------------------------------------------------------------------------------------------------
# Numerics


def test_fully_masked_rows_give_zero_and_finite_lse_and_gradients():
    q, k, v = _qkv(Sq=8, Skv=8, grad=True)
    mm = A.MaskMod(lambda b, h, q_idx, kv_idx: (q_idx < 4) & (kv_idx < 6))
    (out, lse), _ = attention(q, k, v, mask_mod=mm, return_lse=True)
    assert (out[:, :, 4:] == 0).all()
    assert (lse[:, :, 4:] == R.MASKED_ROW_LSE).all() and torch.isfinite(lse).all()
    (out.sum() + lse[:, :, :4].sum()).backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    assert (q.grad[:, :, 4:] == 0).all()
    # a window that excludes every key, and cross-attention with causal and Sq > Skv
    out2, _ = attention(q, k, v, window=(None, None), mask_mod=lambda b, h, i, j: i < 0)
    assert (out2 == 0).all()


def test_score_mod_minus_inf_masks_rows_too():
    q, k, v = _qkv(grad=True)
    sm = A.ScoreMod(lambda s, b, h, i, j: modmath.where(i >= 3, s, float("-inf")))
    (out, lse), _ = attention(q, k, v, score_mod=sm, return_lse=True)
    assert (out[:, :, :3] == 0).all() and (lse[:, :, :3] == R.MASKED_ROW_LSE).all()
    out.sum().backward()
    assert torch.isfinite(q.grad).all()


@pytest.mark.parametrize("S", [1, 2, 13, 31])
def test_sequence_lengths_one_and_primes(S):
    q, k, v = _qkv(Sq=S, Skv=S, D=16)
    out, _ = attention(q, k, v, causal=True)
    n_out, _ = _naive(q, k, v, _dense_mask(S, S, right=0))
    _close(out, n_out)


def test_lse_gradient_flows():
    q, k, v = _qkv(Hq=2, Hkv=2, grad=True)
    (out, lse), _ = attention(q, k, v, return_lse=True)
    lse.sum().backward()
    # d lse_i / d q_i = scale * sum_j p_ij k_j
    p = torch.softmax(q.detach() @ k.detach().transpose(-1, -2) * 8**-0.5, -1)
    _close(q.grad, 8**-0.5 * p @ k.detach(), 1e-5)
    assert v.grad is None


def test_dropout_mask_statistics_and_determinism():
    q, k, v = _qkv(B=1, Hq=2, Hkv=2, Sq=64, Skv=64)
    a, _ = attention(q, k, v, dropout_p=0.25, dropout_seed=7)
    b_, _ = attention(q, k, v, dropout_p=0.25, dropout_seed=7)
    c, _ = attention(q, k, v, dropout_p=0.25, dropout_seed=8)
    assert torch.equal(a, b_) and not torch.equal(a, c)
    idx = _idx(4, 4, 64, 64)
    keep = R.dropout_keep(torch.tensor(7), *idx, 0.25)
    assert abs(keep.float().mean().item() - 0.75) < 0.01
    # the expectation over masks is plain attention: average many seeds
    mean = torch.stack([attention(q, k, v, dropout_p=0.5, dropout_seed=s)[0] for s in range(64)]).mean(0)
    ref, _ = attention(q, k, v)
    assert (mean - ref).abs().mean() < 0.08


def test_dropout_hash_matches_a_scalar_model():
    # The hash in plain Python integers (the kernels' uint32 arithmetic): queries i and i + 8 of an
    # aligned 16 share one hash, query i + 8 takes its top half
    def draw(seed, b, h, i, j):
        return DH.draw(DH.key(seed, b, h), (i >> 4) * 8 + (i & 7), j, bool(i & 8))

    def keep(seed, b, h, i, j, p):
        return bool(R.dropout_keep(torch.tensor(seed), torch.tensor(b), torch.tensor(h), torch.tensor(i),
                                   torch.tensor(j), p))

    seed, b, h, j = -123456789012, 1, 2, 4
    assert [R.dropout_threshold(p) for p in (0.0, 0.1, 0.5, 1.0)] == [0, 6554, 1 << 15, (1 << 16) - 1]
    for i in (3, 11, 19, 24, 31):
        for p in (0.1, 0.5, 0.9):
            assert keep(seed, b, h, i, j, p) == (draw(seed, b, h, i, j) >= round(p * 2**16)), (i, p)
    # hand-computed: queries 3 and 11 share the hash 0x9122512e; query 11 takes its top half,
    # 0x9122 = 37154 (0.567 * 2**16, between the thresholds of p = 0.5 and 0.6), query 3 the xor of
    # the halves, 0x9122 ^ 0x512e = 49164 (0.750: between p = 0.7 and 0.8); query 19 has a hash of
    # its own (pair index 11)
    assert (draw(seed, b, h, 11, j), draw(seed, b, h, 3, j), draw(seed, b, h, 19, j)) == (37154, 49164, 27351)
    assert [keep(seed, b, h, 11, j, p) for p in (0.5, 0.6)] == [True, False]
    assert [keep(seed, b, h, 3, j, p) for p in (0.7, 0.8)] == [True, False]
    assert [keep(seed, b, h, 19, j, p) for p in (0.4, 0.45)] == [True, False]


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_dropout_mask_neighbours_are_uncorrelated(p):
    # Keep decisions of weights 1..8 apart along a row (the per-element part of the hash), of
    # neighbouring rows and of rows 8 apart (the two halves of one hash where the pair is aligned):
    # their correlation within 4.5 standard errors of zero, over 2 heads x 512 rows x 2048 keys; the
    # keep rate within 4.5 standard errors of 1 - p. (A one-round variant, (row + col) * m1 ^ >> 16,
    # * m2, has a correlation at distance 3 of 13 standard errors here.)
    q_idx = torch.arange(512).reshape(1, 512, 1)
    kv_idx = torch.arange(2048).reshape(1, 1, 2048)
    keep = R.dropout_keep(torch.tensor(2024), torch.tensor(0), torch.arange(2).reshape(2, 1, 1), q_idx, kv_idx, p)
    k = keep.double() - (1 - p)
    var = p * (1 - p)
    rate_z = k.mean().item() / (var / k.numel()) ** 0.5
    assert abs(rate_z) < 4.5, rate_z
    for lag in range(1, 9):
        a, b = k[..., :-lag], k[..., lag:]
        z = (a * b).mean().item() / var * a.numel() ** 0.5
        assert abs(z) < 4.5, (lag, z)
    for lag in (1, 8, 16):
        a, b = k[:, :-lag], k[:, lag:]
        z = (a * b).mean().item() / var * a.numel() ** 0.5
        assert abs(z) < 4.5, ("rows", lag, z)
    # the rows of a pair alone (i and i + 8, i & 8 == 0)
    rows = torch.arange(512).reshape(-1, 16)[:, :8].reshape(-1)
    a, b = k[:, rows], k[:, rows + 8]
    z = (a * b).mean().item() / var * a.numel() ** 0.5
    assert abs(z) < 4.5, ("pairs", z)


def test_constants_agree():
    assert K.MASKED_ROW_LSE == R.MASKED_ROW_LSE == A.MASKED_ROW_LSE
    assert K.flops(1, 1, 10, 10, 4, causal=True, backward=True) == 4 * 100 * 4 / 2 * 3.5


# ------------------------------------------------------------------------------------------------
# Errors


def test_errors():
    q, k, v = _qkv()
    with pytest.raises(NotImplementedError, match="FP8 attention"):
        attention(q, k, v, object())
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        attention(q.numpy(), k, v)
    with pytest.raises(ValueError, match="one dtype"):
        attention(q, k.double().float().half(), v)
    with pytest.raises(ValueError, match="layout must be one of"):
        attention(q, k, v, layout="bhds")
    with pytest.raises(ValueError, match="multiple of the key/value heads"):
        attention(q, k[:, :1].expand(2, 3, 9, 8), v[:, :1].expand(2, 3, 9, 8))
    with pytest.raises(ValueError, match="4-D"):
        attention(q[0], k[0], v[0])
    with pytest.raises(ValueError, match="window must be >= 1"):
        attention(q, k, v, window=0)
    with pytest.raises(TypeError, match="window must be"):
        attention(q, k, v, window="big")
    with pytest.raises(ValueError, match="dropout_p"):
        attention(q, k, v, dropout_p=1.0)
    with pytest.raises(TypeError, match="must be called"):
        attention(q, k, v, score_mod=A.softcap)
    with pytest.raises(TypeError, match="pass it as mask_mod"):
        attention(q, k, v, score_mod=A.causal_mask())
    with pytest.raises(TypeError, match="BlockMask"):
        attention(q, k, v, block_mask="x")
    bm = A.create_block_mask(A.causal_mask(), None, None, 16, 16, block_size=16)
    with pytest.raises(ValueError, match="built for"):
        attention(q, k, v, block_mask=bm)
    qp, kp, vp, cu, _ = _packed([3, 4], [3, 4])
    with pytest.raises(ValueError, match="packed"):
        attention(q, k, v, cu_seqlens_q=cu)
    with pytest.raises(ValueError, match="block_mask is not available with packed"):
        attention(qp, kp, vp, cu_seqlens_q=cu, block_mask=bm)
    with pytest.raises(ValueError, match="cu_seqlens_kv needs cu_seqlens_q"):
        attention(q, k, v, cu_seqlens_kv=cu)
    with pytest.raises(ValueError, match="power of two"):
        A.create_block_mask(A.causal_mask(), None, None, 16, 16, block_size=24)
    with pytest.raises(ValueError, match="window must be an int"):
        A.sliding_window_mask(0)
    with pytest.raises(ValueError, match="cap"):
        A.softcap(-1.0)
    with pytest.raises(ValueError, match="2R \\+ 1"):
        A.relative_position_bias(torch.zeros(4, 4))


# ------------------------------------------------------------------------------------------------
# Composition canaries (CPU path)


def _loss(q, k, v, table):
    out, _ = attention(q, k, v, score_mod=A.relative_position_bias(table), mask_mod=A.prefix_lm_mask(3))
    return (out * out).sum()


@pytest.fixture
def data():
    q, k, v = _qkv(B=2, Hq=2, Hkv=1, Sq=6, Skv=6, seed=3)
    table = torch.randn(2, 11) * 0.5
    return q, k, v, table


def _eager(q, k, v, table):
    ts = [t.clone().requires_grad_() for t in (q, k, v, table)]
    loss = _loss(*ts)
    loss.backward()
    return loss.detach(), [t.grad for t in ts]


def test_eager_gradients_match_naive(data):
    q, k, v, table = data
    loss, grads = _eager(q, k, v, table)
    ts = [t.clone().double().requires_grad_() for t in (q, k, v, table)]
    b, h, i, j = _idx(2, 2, 6, 6)
    bias = ts[3][h, (j - i).clamp(-5, 5) + 5]
    mask = (j <= i) | (j < 3)
    g = 2
    s = ts[0] @ ts[1].repeat_interleave(g, 1).transpose(-1, -2) * 8**-0.5 + bias
    p = torch.softmax(s.masked_fill(~mask, float("-inf")), -1)
    out = p @ ts[2].repeat_interleave(g, 1)
    (out * out).sum().backward()
    for a, b_ in zip(grads, ts):
        _close(a, b_.grad, 1e-4)


def test_torch_func_grad_grad_and_value_vjp(data):
    q, k, v, table = data
    loss, grads = _eager(q, k, v, table)
    g = torch.func.grad(_loss, argnums=(0, 1, 2, 3))(q, k, v, table)
    for a, b_ in zip(g, grads):
        _close(a, b_, 1e-5)
    g2, l2 = torch.func.grad_and_value(_loss, argnums=3)(q, k, v, table)
    _close(g2, grads[3], 1e-5)
    _close(l2, loss, 1e-6)
    _, vjp_fn = torch.func.vjp(lambda t: _loss(q, k, v, t), table)
    _close(vjp_fn(torch.ones(()))[0], grads[3], 1e-5)


def test_vmap_equals_loop(data):
    q, k, v, table = data
    qs = torch.stack([q, q * 0.5, q * 2.0])
    f = torch.func.grad(_loss, argnums=(0, 3))
    vq, vt = torch.func.vmap(f, in_dims=(0, None, None, None))(qs, k, v, table)
    for i in range(3):
        lq, lt = f(qs[i], k, v, table)
        _close(vq[i], lq, 1e-5)
        _close(vt[i], lt, 1e-5)


def test_compile_fullgraph_then_backward_equals_eager(data):
    q, k, v, table = data
    loss, grads = _eager(q, k, v, table)
    sm = A.relative_position_bias(table.clone().requires_grad_())
    mm = A.prefix_lm_mask(3)

    def f(q, k, v):
        out, _ = attention(q, k, v, score_mod=sm, mask_mod=mm, causal=False)
        return (out * out).sum()

    torch._dynamo.reset()
    ts = [t.clone().requires_grad_() for t in (q, k, v)]
    closs = torch.compile(f, fullgraph=True)(*ts)
    closs.backward()
    _close(closs.detach(), loss, 1e-5)
    for a, b_ in zip([t.grad for t in ts] + [sm.buffers[0].grad], grads):
        _close(a, b_, 1e-4)


def test_compile_of_func_grad_is_exact_on_cpu(data):
    q, k, v, table = data
    _, grads = _eager(q, k, v, table)
    torch._dynamo.reset()
    g = torch.compile(torch.func.grad(_loss, argnums=3))(q, k, v, table)
    _close(g, grads[3], 1e-4)


def test_module_doctests(monkeypatch):
    # The docstrings use the package-level names (fp8ops.<name>).
    for name in A.__all__:
        monkeypatch.setattr(fp8ops, name, getattr(A, name), raising=False)
    res = doctest.testmod(A, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert res.attempted > 20 and res.failed == 0


_TRACE_SCRIPT = r"""
import torch.utils._triton as _tu
_tu.has_triton = lambda: True  # a CPU machine: let Dynamo treat @triton.jit kernels as on a GPU one
import importlib, torch
A = importlib.import_module("fp8ops.attention")

class Traced(Exception):
    pass

codes = []

def backend(gm, inputs):
    codes.append(gm.code + gm.fwd_body_0.code + gm.bwd_body_0.code)
    raise Traced()

sm = A.relative_position_bias(torch.randn(2, 9, requires_grad=True))
mm = A.and_masks(A.causal_mask(), A.document_mask(torch.arange(32) // 10))
bm = A.create_block_mask(mm, None, None, 32, 32, block_size=16)

def f(q, k, v):
    out, lse = A._attention_triton(q, k, v, score_mod=sm, mask_mod=mm, block_mask=bm, scale=0.25, left=None,
                                   right=0, layout="bshd", cu_q=None, cu_kv=None, max_q=None, max_kv=None,
                                   dropout_p=0.0, seed=None)
    return out.float().square().sum() + lse.sum()

q = torch.randn(1, 32, 2, 16, dtype=torch.bfloat16, requires_grad=True)
k = torch.randn(1, 32, 1, 16, dtype=torch.bfloat16, requires_grad=True)
v = torch.randn(1, 32, 1, 16, dtype=torch.bfloat16, requires_grad=True)
try:
    torch.compile(f, fullgraph=True, backend=backend)(q, k, v)
except Exception as e:
    assert "Traced" in repr(e) or "Traced" in str(e), repr(e)[:2000]
code = codes[0]
# Forward and backward are each one opaque library op: no user kernel for Inductor to re-generate.
assert "fp8ops.attention_fwd" in code and "fp8ops.attention_bwd" in code, code
assert "triton_kernel_wrapper" not in code, code

# The public op, routed to the kernels as on CUDA.
importlib.import_module("fp8ops.attention.op")._use_kernels = lambda t: True
codes.clear()

prefix = A.prefix_lm_mask(3)  # mods are built outside compiled code (their creation reads source)

def g(q, k, v):
    out, _ = A.attention(q, k, v, score_mod=sm, block_mask=bm, layout="bshd")
    o2, _ = A.attention(q, k, v, window=8, mask_mod=prefix, layout="bshd")
    return out.float().sum() + o2.float().sum()

torch._dynamo.reset()
try:
    torch.compile(g, fullgraph=True, backend=backend)(q, k, v)
except Exception as e:
    assert "Traced" in repr(e) or "Traced" in str(e), repr(e)[:2000]
assert codes and "fp8ops.attention_fwd" in codes[0] and "triton_kernel_wrapper" not in codes[0], codes
print("TRACED")
"""


def test_fused_path_traces_with_fullgraph_and_no_graph_break(tmp_path):
    """torch.compile(fullgraph=True) traces the CUDA path (forward and backward as opaque library ops
    that look their kernels up from the mod registry) without a graph break. Traced on this machine with compiled
    (not interpreted) kernels; the graph is not run (the GPU tests run it)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = tmp_path / "trace.py"
    script.write_text(_TRACE_SCRIPT)
    res = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert "TRACED" in res.stdout, res.stdout[-2000:] + res.stderr[-4000:]


def test_deterministic_flag_is_validated_and_masks_choose_the_dq_scheme():
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(TypeError, match="deterministic must be True or False"):
        fp8ops.attention(q, q, q, deterministic="yes")
    out, _ = fp8ops.attention(q, q, q, causal=True, deterministic=True)  # CPU: the reference path
    torch.testing.assert_close(out, fp8ops.attention(q, q, q, causal=True)[0])
    assert A._dq_mode(False) == "auto"
    assert A._dq_mode(True) == "separate"
    # what the portable kernels make of "auto" (the Hopper backward aside)
    from fp8ops.kernels.attention import resolve_dq_mode
    assert resolve_dq_mode("auto", masked=True, head_dim=256) == "atomic"
    assert resolve_dq_mode("auto", masked=False, head_dim=256) == "separate"
    assert resolve_dq_mode("auto", masked=True, head_dim=128) == "separate"
    assert resolve_dq_mode("auto", masked=True, head_dim=64) == "separate"
    assert resolve_dq_mode("separate", masked=True, head_dim=256) == "separate"
    assert resolve_dq_mode("atomic", masked=False, head_dim=64) == "atomic"


def test_backend_argument_is_validated():
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="backend must be"):
        fp8ops.attention(q, q, q, backend="cudnn")
    with pytest.raises(ValueError, match="backend='sdpa' cannot run this call .not on CUDA"):
        fp8ops.attention(q, q, q, backend="sdpa")
    why = A._sdpa_unsupported(q, q, nested=False, varlen=False, score_mod=None, mask_mod=None, block_mask=None,
                              left=None, right=0, return_lse=False, deterministic=False, dropout_p=0.0,
                              dropout_seed=None)
    assert why == "not on CUDA"


def test_launch_drops_a_pipeline_stage_when_shared_memory_runs_out(monkeypatch):
    # A launch whose depth does not fit runs one stage shallower, and the depth that fits is
    # remembered per launch signature (no second failing compile); a kernel that does not fit at
    # one stage raises. (Compiled kernels: the interpreter has no shared memory to run out of.)
    from triton.runtime.errors import OutOfResources

    monkeypatch.setattr(K, "_INTERPRETED", False)
    monkeypatch.setattr(K, "_STAGES_THAT_FIT", {})
    class FakeKernel:
        def __init__(self, fits):
            self.fits, self.tried = fits, []

        def __getitem__(self, grid):
            def run(*args, num_stages, **kw):
                self.tried.append(num_stages)
                if num_stages > self.fits:
                    raise OutOfResources(1000 * num_stages, 1000 * self.fits, "shared memory")
            return run

    kern = FakeKernel(fits=2)
    x = torch.zeros(2)
    K._launch(kern, (1,), x, None, BLOCK_M=64, num_warps=8, num_stages=3)
    assert kern.tried == [3, 2]
    K._launch(kern, (1,), x, None, BLOCK_M=64, num_warps=8, num_stages=3)
    assert kern.tried == [3, 2, 2]
    K._launch(kern, (1,), x, None, BLOCK_M=32, num_warps=8, num_stages=3)  # another signature
    assert kern.tried == [3, 2, 2, 3, 2]
    with pytest.raises(OutOfResources):
        K._launch(FakeKernel(fits=0), (1,), x, BLOCK_M=64, num_stages=2)


def test_the_static_configuration_string_is_its_repr_and_parses_back():
    """The fused path hands its library ops ``repr(tuple(static))`` (cached per configuration in
    eager mode); the ops parse it back into the same configuration."""
    G = importlib.import_module("fp8ops.attention.autograd")
    st = G._Static(score_key=None, mask_key="m", score_slots=(0,), mask_slots=(), needs=(True,), scale=0.125,
                   left=None, right=0, layout="bshd", max_q=None, max_kv=None, dropout_p=0.1, sparse_block=(128, 64),
                   dq_mode="separate", fwd_config=(("BLOCK_M", 64),), bwd_config=None)
    text = G._static_str(st)
    assert text == repr(tuple(st)) and G._static_str(st._replace()) is text  # one string per configuration
    assert G._parse_static(text) == st
    assert G._static_str(st._replace(scale=0.25)) != text


def test_seeded_attention_inputs_of_the_testing_helpers():
    from fp8ops.testing import attention_inputs as inputs

    q, k, v = inputs.qkv(2, 4, 2, 8, 16, 32, layout="bshd", seed=3, device="cpu")
    assert q.shape == (2, 8, 4, 32) and k.shape == v.shape == (2, 16, 2, 32) and q.dtype == torch.bfloat16
    again = inputs.qkv(2, 4, 2, 8, 16, 32, layout="bshd", seed=3, device="cpu")
    assert all(torch.equal(a, b) for a, b in zip((q, k, v), again))
    assert not torch.equal(q[..., :16].float(), k[:, :8, :2, :16].float())  # three seeds, three tensors
    f = inputs.fused_qkv(6, 2, 3, 16, 0, device="cpu")
    assert f[0].shape == (6, 2, 3, 16) and f[0].data_ptr() + 3 * 16 * 2 == f[1].data_ptr()
    mm = inputs.docs_mask(10, device="cpu")  # five documents of 2 rows, causal inside each
    z = torch.zeros(1, 1, 10, 8)
    out, _ = A.attention(z, z, torch.eye(10).view(1, 1, 10, 10), mask_mod=mm)  # uniform over visible keys
    assert torch.allclose(out[0, 0, 3], torch.tensor([0, 0, 0.5, 0.5, 0, 0, 0, 0, 0, 0.0]))
    assert torch.allclose(out[0, 0, 4], torch.eye(10)[4])
