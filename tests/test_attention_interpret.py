"""The attention Triton kernels under TRITON_INTERPRET=1, on CPU, at small sizes.

Every feature runs through the fused path (``_attention_triton``: the autograd Function, the
launchers, the forward, preprocess, dK/dV and dQ kernels, mods compiled from their Python source)
and is compared with the FP32 reference, forward and every gradient: GQA/MQA, cross-attention,
causal and windows, layouts, score mods (with captured-tensor gradients), mask mods, block masks,
packed sequences, dropout, fully masked rows, sequence lengths 1 and primes, head dims that are not
powers of two, the atomic-dQ variant, explicit Triton twins and the FP8 descale hook.

Inputs are float32 (the interpreter's bf16 dot is wrong, G6) or float16. Shapes are tiny and the
tile sizes 16 so that every run crosses several tiles, partial tiles and sequence ends.
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch
import triton
import triton.language as tl

from fp8ops.testing import assert_close_rule

pytestmark = [
    pytest.mark.interpret,
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs only under TRITON_INTERPRET=1"),
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),
]

A = importlib.import_module("fp8ops.attention")
R = importlib.import_module("fp8ops.reference.attention")
K = importlib.import_module("fp8ops.kernels.attention")
AG = importlib.import_module("fp8ops.attention.autograd")
HB = importlib.import_module("fp8ops.kernels._attention_hopper_bwd")

FWD16 = {"BLOCK_M": 16, "BLOCK_N": 16}
BWD16 = {"BLOCK_M1": 16, "BLOCK_N1": 16, "BLOCK_M2": 16, "BLOCK_N2": 16}


def _tensors(shapes, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(dtype).requires_grad_() for s in shapes]


def _run_both(q, k, v, *, layout="bhsd", score_mod=None, mask_mod=None, block_mask=None, causal=False, window=None,
              scale=None, cu_q=None, cu_kv=None, dropout_p=0.0, dq_mode="separate", seed=0):
    """(kernel outputs and gradients, reference outputs and gradients) for random dout and dlse."""
    left, right = R.normalize_window(window, causal)
    d = q.shape[-1]
    sm_scale = scale if scale is not None else d**-0.5
    varlen = cu_q is not None
    dseed = torch.tensor(1234567) if dropout_p else None
    mm = mask_mod if mask_mod is not None else (block_mask.mask_mod if block_mask is not None else None)
    if mm is not None and not isinstance(mm, A.MaskMod):
        mm = A.MaskMod(mm)
    lens = None
    if varlen:
        cu_kv = cu_q if cu_kv is None else cu_kv
        lens = (int((cu_q[1:] - cu_q[:-1]).max()), int((cu_kv[1:] - cu_kv[:-1]).max()))
    out, lse = A._attention_triton(
        q, k, v, score_mod=score_mod, mask_mod=mm, block_mask=block_mask, scale=sm_scale, left=left, right=right,
        layout="thd" if varlen else layout, cu_q=cu_q, cu_kv=cu_kv, max_q=lens[0] if lens else None,
        max_kv=lens[1] if lens else None, dropout_p=dropout_p, seed=dseed, dq_mode=dq_mode,
        fwd_config=FWD16, bwd_config=BWD16)
    params = [q, k, v] + [t for t in (score_mod.buffers if score_mod is not None else ()) if t.requires_grad]
    g = torch.Generator().manual_seed(seed + 1)
    dout = torch.randn(out.shape, generator=g).to(out.dtype)
    dlse = torch.randn(lse.shape, generator=g)
    grads = torch.autograd.grad((out.float() * dout.float()).sum() + (lse * dlse).sum(), params)
    kw = dict(score_mod=score_mod, mask_mod=mm, block_mask=block_mask, causal=causal, window=window, scale=scale,
              layout=layout, cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv, return_lse=True, dropout_p=dropout_p,
              dropout_seed=dseed)
    (ro, rl), _ = R.attention(q, k, v, **kw)
    rgrads = torch.autograd.grad((ro.float() * dout.float()).sum() + (rl * dlse).sum(), params)
    low = None
    if q.dtype != torch.float32:
        (lo_o, lo_l), _ = R.attention(q, k, v, compute_dtype=q.dtype, **kw)
        lgrads = torch.autograd.grad((lo_o.float() * dout.float()).sum() + (lo_l * dlse).sum(), params)
        low = (lo_o, lo_l, lgrads)
    return (out, lse, grads), (ro, rl, rgrads), low


def _check(q, k, v, **kw):
    (out, lse, grads), (ro, rl, rgrads), low = _run_both(q, k, v, **kw)
    names = ["out", "lse", "dq", "dk", "dv"] + [f"dbuf{i}" for i in range(len(grads) - 3)]
    assert out.shape == ro.shape and lse.shape == rl.shape and out.dtype == q.dtype
    for t in (out, lse, *grads):
        assert not torch.isnan(t).any()
    if low is None:
        for name, a, b in zip(names, (out, lse, *grads), (ro, rl, *rgrads)):
            scale = max(1.0, float(b.detach().abs().max()))
            assert (a - b).abs().max() <= 2e-5 * scale, f"{name}: {(a - b).abs().max():.3g}"
    else:
        lo_o, lo_l, lgrads = low
        for name, a, b, c in zip(names, (out, lse, *grads), (ro, rl, *rgrads), (lo_o, lo_l, *lgrads)):
            assert_close_rule(a, b, c, k=2.0, atol=2e-3, name=name)
    return out, lse


def _dense(B, Hq, Hkv, Sq, Skv, D, Dv=None, layout="bhsd", dtype=torch.float32, seed=0):
    shape = {"bhsd": lambda H, S, d: (B, H, S, d), "bshd": lambda H, S, d: (B, S, H, d),
             "sbhd": lambda H, S, d: (S, B, H, d)}[layout]
    return _tensors([shape(Hq, Sq, D), shape(Hkv, Skv, D), shape(Hkv, Skv, Dv or D)], dtype, seed)


# ------------------------------------------------------------------------------------------------
# Dense inputs


def _softcap_causal():
    return dict(score_mod=A.softcap(2.0), causal=True)


def _alibi_window_mask():
    return dict(score_mod=A.alibi(4), mask_mod=A.sliding_window_mask(9))


def _relbias_causal():
    return dict(score_mod=A.relative_position_bias((torch.randn(4, 13) * 0.5).requires_grad_()), causal=True)


def _user_mod_prefix():
    tab = (torch.randn(2) * 0.3).requires_grad_()  # a learned per-batch bias, read with a scalar index

    @A.score_mod
    def user(score, b, h, q_idx, kv_idx):
        t = score * 0.5
        near = modmath_abs(q_idx - kv_idx) < 4
        return modmath_where(near, t + modmath_load(tab, b), modmath_exp(t * 0.1) - 1.0)

    return dict(score_mod=user, mask_mod=A.prefix_lm_mask(torch.tensor([3, 11])))


modmath_abs = A.modmath.abs
modmath_where = A.modmath.where
modmath_load = A.modmath.load
modmath_exp = A.modmath.exp


def _doc_block_mask():
    docs = torch.arange(37) // 12
    mm = A.and_masks(A.causal_mask(), A.document_mask(docs))
    return dict(block_mask=A.create_block_mask(mm, None, None, 37, 37, block_size=16))


def _doc_block_mask_wide():
    # 64-key blocks: two kernel tiles per block under the interpreter (tiles of 32), the last block
    # running past the sequence end (100 keys)
    docs = torch.arange(100) // 30
    mm = A.and_masks(A.causal_mask(), A.document_mask(docs))
    return dict(block_mask=A.create_block_mask(mm, None, None, 100, 100, block_size=64))


def _bh_block_mask():
    def shifted(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx + 5 * (b + h)

    return dict(block_mask=A.create_block_mask(shifted, 2, 4, 37, 37, block_size=16))


def _atomic_everything():
    d = _doc_block_mask()
    d.update(score_mod=A.relative_position_bias((torch.randn(13) * 0.5).requires_grad_()), dq_mode="atomic")
    return d


# (name, (B, Hq, Hkv, Sq, Skv, D, Dv), layout, dtype, options factory)
DENSE = [
    ("gqa", (2, 4, 2, 37, 37, 16, None), "bhsd", torch.float32, dict),
    ("mqa_causal", (1, 4, 1, 29, 29, 16, None), "bhsd", torch.float32, lambda: dict(causal=True)),
    ("cross_causal_short_q", (2, 2, 2, 17, 45, 16, None), "bhsd", torch.float32, lambda: dict(causal=True)),
    ("cross_long_q", (1, 2, 1, 45, 17, 16, None), "bshd", torch.float32, lambda: dict(causal=True)),
    ("window_bshd", (2, 4, 2, 40, 40, 16, None), "bshd", torch.float32, lambda: dict(window=7)),
    ("window_lr_sbhd", (2, 2, 2, 40, 33, 16, None), "sbhd", torch.float32, lambda: dict(window=(3, 5))),
    ("len1", (2, 2, 1, 1, 1, 16, None), "bhsd", torch.float32, lambda: dict(causal=True)),
    ("primes_d24_dv40", (1, 3, 3, 31, 23, 24, 40), "bhsd", torch.float32, lambda: dict(scale=0.3)),
    ("softcap_causal", (1, 2, 2, 33, 33, 16, None), "bhsd", torch.float32, _softcap_causal),
    ("alibi_window_mask", (1, 4, 2, 37, 37, 16, None), "bhsd", torch.float32, _alibi_window_mask),
    ("relbias_learned", (1, 4, 4, 30, 30, 16, None), "bshd", torch.float32, _relbias_causal),
    ("user_mod_prefix", (2, 2, 1, 21, 21, 16, None), "bhsd", torch.float32, _user_mod_prefix),
    ("block_mask_docs", (1, 2, 2, 37, 37, 16, None), "bhsd", torch.float32, _doc_block_mask),
    ("block_mask_bh", (2, 4, 2, 37, 37, 16, None), "bhsd", torch.float32, _bh_block_mask),
    ("block_mask_wide_blocks", (1, 2, 1, 100, 100, 16, None), "bhsd", torch.float32, _doc_block_mask_wide),
    ("block_mask_wide_blocks_atomic", (1, 2, 1, 100, 100, 16, None), "bhsd", torch.float32,
     lambda: dict(_doc_block_mask_wide(), dq_mode="atomic")),
    ("dropout", (1, 2, 2, 33, 33, 16, None), "bhsd", torch.float32, lambda: dict(causal=True, dropout_p=0.2)),
    ("fp16_causal_gqa", (1, 4, 2, 40, 40, 32, None), "bhsd", torch.float16, lambda: dict(causal=True)),
    ("atomic_dq_everything", (1, 2, 2, 37, 37, 16, None), "bhsd", torch.float32, _atomic_everything),
]


@pytest.mark.parametrize("case", DENSE, ids=[c[0] for c in DENSE])
def test_dense_forward_and_gradients(case):
    _, (B, Hq, Hkv, Sq, Skv, D, Dv), layout, dtype, opts = case
    q, k, v = _dense(B, Hq, Hkv, Sq, Skv, D, Dv, layout=layout, dtype=dtype)
    _check(q, k, v, layout=layout, **opts())


def test_full_blocks_skip_the_mask_mod():
    # Causal blocks with a sliding-window mask_mod: full blocks must not evaluate it (the reference
    # encodes the same block semantics).
    q, k, v = _dense(1, 2, 2, 32, 32, 16)
    bm = A.create_block_mask(A.causal_mask(), None, None, 32, 32, block_size=16)
    out, _ = _check(q, k, v, block_mask=bm, mask_mod=A.sliding_window_mask(3))
    plain, _ = _check(*_dense(1, 2, 2, 32, 32, 16), window=3)
    assert not torch.allclose(out, plain)


def test_fully_masked_rows():
    q, k, v = _dense(1, 2, 2, 24, 20, 16)
    mm = A.MaskMod(lambda b, h, q_idx, kv_idx: (q_idx < 10) & (kv_idx < 15))
    out, lse = _check(q, k, v, mask_mod=mm)
    assert (out[:, :, 10:] == 0).all() and (lse[:, :, 10:] == R.MASKED_ROW_LSE).all()
    # causal cross-attention where the first rows see keys, and a window that sees none
    out, lse = _check(q, k, v, window=(None, None), mask_mod=lambda b, h, i, j: j > i + 100)
    assert (out == 0).all() and (lse == R.MASKED_ROW_LSE).all()


# ------------------------------------------------------------------------------------------------
# Packed sequences


def _packed(lens_q, lens_kv, Hq, Hkv, D, dtype=torch.float32, extra_q=0, seed=0):
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_kv = torch.tensor([0, *torch.tensor(lens_kv).cumsum(0).tolist()], dtype=torch.int32)
    q, k, v = _tensors([(int(cu_q[-1]) + extra_q, Hq, D), (int(cu_kv[-1]), Hkv, D), (int(cu_kv[-1]), Hkv, D)],
                       dtype, seed)
    return q, k, v, cu_q, cu_kv


PACKED = [
    ("self_causal_gqa", [5, 1, 17, 0, 23], None, dict(causal=True)),
    ("cross_lengths", [3, 20, 7], [9, 2, 40], dict()),
    ("cross_causal_extra_rows", [3, 20, 7], [9, 2, 40], dict(causal=True, extra_q=3)),
    ("window_prefix_atomic", [3, 20, 7], [9, 2, 40],
     dict(window=(2, 3), mask_mod=A.prefix_lm_mask(torch.tensor([1, 5, 3])), dq_mode="atomic")),
    ("alibi_fp16", [12, 31], None, dict(score_mod=A.alibi(4), causal=True, dtype=torch.float16)),
]


@pytest.mark.parametrize("case", PACKED, ids=[c[0] for c in PACKED])
def test_packed_forward_and_gradients(case):
    _, lens_q, lens_kv, opts = case
    opts = dict(opts)
    dtype = opts.pop("dtype", torch.float32)
    extra = opts.pop("extra_q", 0)
    q, k, v, cu_q, cu_kv = _packed(lens_q, lens_kv or lens_q, 4, 2, 16, dtype=dtype, extra_q=extra)
    out, lse = _check(q, k, v, cu_q=cu_q, cu_kv=cu_kv, **opts)
    if extra:
        assert (out[-extra:] == 0).all() and (lse[-extra:] == R.MASKED_ROW_LSE).all()


# ------------------------------------------------------------------------------------------------
# Public glue on the fused path: vmap rule, torch.func, determinism


def _fused(q, k, v, causal=True):
    out, _ = A._attention_triton(q, k, v, score_mod=None, mask_mod=None, block_mask=None, scale=0.25, left=None,
                                 right=0 if causal else None, layout="bhsd", cu_q=None, cu_kv=None, max_q=None,
                                 max_kv=None, dropout_p=0.0, seed=None, fwd_config=FWD16, bwd_config=BWD16)
    return out


def test_vmap_and_func_grad_through_the_fused_path():
    q, k, v = (t.detach() for t in _dense(1, 2, 2, 19, 19, 16))
    qs = torch.stack([q[0], q[0] * 0.5, q[0] * 2.0])  # a vmapped batch of (H, S, D)... with B = 1 inside
    qs = qs[:, None]
    vo = torch.func.vmap(lambda x: _fused(x, k, v))(qs)
    for i in range(3):
        torch.testing.assert_close(vo[i], _fused(qs[i], k, v), rtol=0, atol=0)

    def loss(q):
        return _fused(q, k, v).square().sum()

    gq = torch.func.grad(loss)(q)
    qq = q.clone().requires_grad_()
    loss(qq).backward()
    torch.testing.assert_close(gq, qq.grad, rtol=0, atol=0)
    # vmap of grad: the backward library op runs once per entry
    vg = torch.func.vmap(torch.func.grad(loss))(qs)
    for i in range(3):
        torch.testing.assert_close(vg[i], torch.func.grad(loss)(qs[i]), rtol=0, atol=0)


def test_same_tensor_passed_three_times():
    x = _dense(1, 2, 2, 17, 17, 16)[0]
    out = _fused(x, x, x)
    out.sum().backward()
    xr = x.detach().clone().requires_grad_()
    (ro, _), _ = R.attention(xr, xr, xr, causal=True, scale=0.25, return_lse=True)
    ro.sum().backward()
    assert (out - ro).abs().max() < 1e-5 and (x.grad - xr.grad).abs().max() < 1e-4


# ------------------------------------------------------------------------------------------------
# Explicit Triton twins and the FP8 descale hook (launcher level)


@triton.jit
def _twin_score(score, b, h, q_idx, kv_idx, t0, t1, t2, t3):
    return score * tl.load(t0 + h)


@triton.jit
def _twin_score_grad(ds, score, b, h, q_idx, kv_idx, valid, t0, t1, t2, t3, g0, g1, g2, g3):
    if g0 is not None:
        tl.atomic_add(g0 + h + tl.zeros(ds.shape, tl.int32), ds * score, mask=valid)
    return ds * tl.load(t0 + h)


@triton.jit
def _twin_mask(b, h, q_idx, kv_idx, t0, t1, t2, t3):
    return (q_idx + kv_idx) % 3 != 0


def test_explicit_twins():
    tw_fwd, tw_grad, tw_mask = _twin_score, _twin_score_grad, _twin_mask
    w = torch.tensor([0.5, 2.0]).requires_grad_()
    sm = A.ScoreMod(lambda s, b, h, i, j: s * w[h], triton=tw_fwd, triton_grad=tw_grad, buffers=(w,))
    mm = A.MaskMod(lambda b, h, i, j: (i + j) % 3 != 0, triton=tw_mask)
    q, k, v = _dense(1, 2, 2, 21, 21, 16)
    _check(q, k, v, score_mod=sm, mask_mod=mm)
    no_grad = A.ScoreMod(lambda s, b, h, i, j: s * w[h], triton=tw_fwd, buffers=(w,))
    out2, _ = A._attention_triton(q, k, v, score_mod=no_grad, mask_mod=None, block_mask=None, scale=0.25, left=None,
                                  right=None, layout="bhsd", cu_q=None, cu_kv=None, max_q=None, max_kv=None,
                                  dropout_p=0.0, seed=None)
    with pytest.raises(NotImplementedError, match="triton_grad"):
        out2.sum().backward()


def test_descale_hook():
    # attention(q / qd, k / kd, v / vd) with per-block descales qd, kd, vd equals attention(q, k, v).
    q, k, v = (t.detach() for t in _dense(2, 2, 1, 40, 40, 16))
    gq, gkv = 16, 32
    nq, nkv = -(-40 // gq), -(-40 // gkv)
    g = torch.Generator().manual_seed(5)
    qd = torch.rand(2, 2, nq, generator=g) + 0.5
    kd = torch.rand(2, 1, nkv, generator=g) + 0.5
    vd = torch.rand(2, 1, nkv, generator=g) + 0.5
    rq = qd.repeat_interleave(gq, -1)[..., :40, None]
    rk = kd.repeat_interleave(gkv, -1)[..., :40, None]
    rv = vd.repeat_interleave(gkv, -1)[..., :40, None]
    out = torch.empty_like(q)
    lse = torch.empty(2, 2, 40)
    K.attention_fwd_launch(q / rq, k / rk, v / rv, out, lse, sm_scale=0.25, window=(None, 0),
                           descale=(qd, kd, vd, gq, gkv), config=FWD16)
    (ro, rl), _ = R.attention(q, k, v, scale=0.25, causal=True, return_lse=True)
    assert (out - ro).abs().max() < 1e-5 and (lse - rl).abs().max() < 1e-5
    with pytest.raises(ValueError, match="powers of two"):
        K.attention_fwd_launch(q, k, v, out, lse, sm_scale=0.25, descale=(qd, kd, vd, 8, 16))


def _fused_qkv_sbhd(S, B, H, D, seed):
    # q, k, v as the (S, B, H, D) slices of one (S, B, 3, H, D) projection output (strided views)
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(S, B, 3, H, D, generator=g).half()
    return qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]


TMA_CASES = [
    # (name, (q, k, v) factory, layout, options): every layout, GQA, sequence lengths that end inside
    # a tile (rows past S read as zeros), bands, a block mask with a mask_mod
    ("bhsd_gqa", lambda: _dense(2, 4, 2, 37, 37, 16, dtype=torch.float16), "bhsd", dict()),
    ("bshd_causal", lambda: _dense(2, 2, 2, 40, 40, 32, layout="bshd", dtype=torch.float16), "bshd",
     dict(right=0)),
    ("sbhd_window_cross", lambda: _dense(2, 2, 1, 29, 45, 16, layout="sbhd", dtype=torch.float16), "sbhd",
     dict(left=5, right=3)),
    ("fused_qkv_causal_atomic", lambda: _fused_qkv_sbhd(33, 2, 2, 16, 3), "sbhd", dict(right=0, dq_mode="atomic")),
    ("block_mask_docs", lambda: _dense(1, 2, 2, 37, 37, 16, dtype=torch.float16), "bhsd", "docs"),
]


@pytest.mark.parametrize("case", TMA_CASES, ids=[c[0] for c in TMA_CASES])
def test_loads_through_tensor_descriptors(case, monkeypatch):
    """Forward config TMA=1 loads Q, K and V, backward configs TMA1=1 / TMA2=1 the dK/dV kernel's Q
    and dO / the dQ kernel's K and V, through 3-D tensor descriptors: the launches take that path
    for every layout here (strided fused-QKV slices included), and out, lse and every gradient are
    bit-identical to the pointer loads (rows past a sequence end read as zeros, as the masked loads
    give)."""
    name, make, layout, opts = case
    q, k, v = (t.detach() for t in make())
    kw = dict(score_mod=None, mask_mod=None, block_mask=None, left=None, right=None)
    if opts == "docs":
        docs = torch.arange(37) // 12
        mm = A.and_masks(A.causal_mask(), A.document_mask(docs))
        kw.update(mask_mod=mm, block_mask=A.create_block_mask(mm, None, None, 37, 37, block_size=16))
    else:
        kw.update(opts)
    seen = []
    real = K._launch
    monkeypatch.setattr(K, "_launch", lambda kernel, grid, *a, **kwa: (seen.append((kernel.__name__, kwa.get("TMA"))),
                                                                        real(kernel, grid, *a, **kwa)))
    outs = []
    for tma in (0, 1):
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        out, lse = A._attention_triton(qq, kk, vv, scale=0.3, layout=layout, cu_q=None, cu_kv=None, max_q=None,
                                       max_kv=None, dropout_p=0.0, seed=None, fwd_config={**FWD16, "TMA": tma},
                                       bwd_config={**BWD16, "TMA1": tma, "TMA2": tma}, **kw)
        g = torch.Generator().manual_seed(9)
        (out.float() * torch.randn(out.shape, generator=g)).sum().backward()
        outs.append((out.detach(), lse.detach(), qq.grad, kk.grad, vv.grad))
    per_run = 2 if kw.get("dq_mode") == "atomic" else 3  # forward, dK/dV (and dQ)
    assert [t for n, t in seen if n.endswith(("fwd_kernel", "dkdv_kernel", "dq_kernel"))] == [False] * per_run + [
        True] * per_run
    for name_, a, b in zip(("out", "lse", "dq", "dk", "dv"), *outs):
        assert torch.equal(a, b), name_
    assert not torch.isnan(outs[1][0]).any()


def test_tensor_descriptors_only_where_addressable(monkeypatch):
    """Layouts TMA cannot address fall back to pointer loads with the same result: a head dim that
    is not a power of two, float32, a non-unit last stride."""
    seen = []
    real = K._launch
    monkeypatch.setattr(K, "_launch", lambda kernel, grid, *a, **kwa: (seen.append(kwa["TMA"]),
                                                                        real(kernel, grid, *a, **kwa)))
    h24 = [t.detach() for t in _dense(1, 2, 2, 20, 20, 24, dtype=torch.float16)]
    f32 = [t.detach() for t in _dense(1, 2, 2, 20, 20, 16)]
    g = torch.Generator().manual_seed(4)
    wide = torch.randn(1, 2, 20, 32, generator=g).half()
    strided = [wide[..., ::2]] * 3  # last stride 2
    for q, k, v in (h24, f32, strided):
        out, lse = torch.empty(q.shape, dtype=q.dtype), torch.empty(q.shape[:3])
        K.attention_fwd_launch(q, k, v, out, lse, sm_scale=0.3, config={**FWD16, "TMA": 1})
        ref, rl = torch.empty_like(out), torch.empty_like(lse)
        K.attention_fwd_launch(q, k, v, ref, rl, sm_scale=0.3, config={**FWD16, "TMA": 0})
        assert torch.equal(out, ref) and torch.equal(lse, rl)
    assert seen == [False] * 6


@pytest.mark.parametrize("causal", [False, True])
def test_packed_sequences_through_tensor_descriptors(causal, monkeypatch):
    """Packed (T, H, D) sequences through the TMA loads: a tile that runs past a sequence's end reads
    the next sequence's rows, which the kernels zero on those edge tiles. Rows after the last
    sequence hold inf here (q, dO: 9 rows; k, v: 11 rows), so any unzeroed read would show; out,
    lse and every gradient of the sequences' rows are bit-identical to the pointer loads."""
    seen = []
    real = K._launch
    monkeypatch.setattr(K, "_launch", lambda kernel, grid, *a, **kwa: (seen.append((kernel.__name__, kwa.get("TMA"))),
                                                                        real(kernel, grid, *a, **kwa)))
    lq, lkv = [5, 12, 7, 1], [9, 2, 20, 3]
    q, k, v, cu_q, cu_kv = _packed(lq, lkv, 4, 2, 16, dtype=torch.float16, extra_q=9)
    tq, tkv = int(cu_q[-1]), int(cu_kv[-1])
    pad = torch.full((11, 2, 16), float("inf"), dtype=torch.float16)
    q, k, v = q.detach(), torch.cat([k.detach(), pad]), torch.cat([v.detach(), pad])
    q[tq:] = float("inf")
    runs = []
    for tma in (0, 1):
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        out, lse = A._attention_triton(qq, kk, vv, score_mod=None, mask_mod=None, block_mask=None, scale=0.3,
                                       left=None, right=0 if causal else None, layout="thd", cu_q=cu_q, cu_kv=cu_kv,
                                       max_q=max(lq), max_kv=max(lkv), dropout_p=0.0, seed=None,
                                       fwd_config={**FWD16, "TMA": tma},
                                       bwd_config={**BWD16, "TMA1": tma, "TMA2": tma})
        g = torch.Generator().manual_seed(2)
        dout = torch.randn(out.shape, generator=g).half()
        dout[tq:] = float("inf")  # dO of the rows after the last sequence (out there is never written)
        out.backward(dout)
        runs.append((out[:tq].detach(), lse[:tq].detach(), qq.grad[:tq], kk.grad[:tkv], vv.grad[:tkv]))
    launched = [t for n, t in seen if n.endswith(("fwd_kernel", "dkdv_kernel", "dq_kernel"))]
    assert launched == [False] * 3 + [True] * 3
    for name_, a, b in zip(("out", "lse", "dq", "dk", "dv"), *runs):
        assert torch.isfinite(a).all() and torch.equal(a, b), name_


def test_masked_backward_at_d64_picks_its_own_tiles(monkeypatch):
    """With a mask_mod at d <= 64 the backward takes 64-key dK/dV tiles and an eight-warp dQ kernel
    (on an H100 with a document block mask: dK/dV 6.7 ms against 127 with the 128-key tiles, dQ 4.5
    against 6.8); unmasked problems keep the causal-tuned tiles, and the launcher tells the table."""
    bf16 = torch.bfloat16
    masked, plain = K._bwd_config(64, 64, bf16, False, mask_mod=True), K._bwd_config(64, 64, bf16, False)
    assert (masked["BLOCK_N1"], masked["num_warps2"], plain["BLOCK_N1"], plain["num_warps2"]) == (64, 8, 128, 4)
    assert K._bwd_config(128, 128, bf16, False, mask_mod=True) == K._bwd_config(128, 128, bf16, False)
    assert K._bwd_config(64, 64, bf16, True, mask_mod=True) == K._bwd_config(64, 64, bf16, True)
    asked = []
    real = K._bwd_config
    monkeypatch.setattr(K, "_bwd_config", lambda *a, **kw: (asked.append(kw.get("mask_mod")), real(*a, **kw))[1])
    q, k, v = _tensors([(1, 2, 16, 16)] * 3, torch.float32, 3)
    for mm in (None, A.causal_mask()):
        A._attention_triton(q, k, v, score_mod=None, mask_mod=mm, block_mask=None, scale=0.3, left=None, right=None,
                            layout="bhsd", cu_q=None, cu_kv=None, max_q=None, max_kv=None, dropout_p=0.0,
                            seed=None)[0].sum().backward()
    assert asked == [False, True]


def test_packed_sequences_pick_their_own_tiles(monkeypatch):
    """The launchers tell the config tables whether sequences are packed, and the tables answer with
    the packed-sequence tiles: 64-key dK/dV tiles up to d = 128 (the dense 128-key tiles ran a
    Zipf-length benchmark's backward 2.7x slower at d = 64, 1.1x at d = 128) and 64-row forward
    tiles at d <= 64."""
    asked = []
    for name in ("_fwd_config", "_bwd_config"):
        real = getattr(K, name)
        monkeypatch.setattr(K, name, lambda *a, _real=real, _name=name, **kw: (
            asked.append((_name, kw.get("varlen", a[4] if len(a) > 4 else False))), _real(*a, **kw))[1])
    q, k, v, cu_q, cu_kv = _packed([5, 9], [5, 9], 2, 2, 16)
    A._attention_triton(q, k, v, score_mod=None, mask_mod=None, block_mask=None, scale=0.3, left=None, right=0,
                        layout="thd", cu_q=cu_q, cu_kv=cu_kv, max_q=9, max_kv=9, dropout_p=0.0,
                        seed=None)[0].sum().backward()
    _fused(*_tensors([(1, 2, 8, 16)] * 3, torch.float32, 1)).sum().backward()
    assert asked == [("_fwd_config", True), ("_bwd_config", True), ("_fwd_config", False), ("_bwd_config", False)]
    bf16 = torch.bfloat16
    packed, dense = K._bwd_config(64, 64, bf16, False, varlen=True), K._bwd_config(64, 64, bf16, False)
    assert (packed["BLOCK_M1"], packed["BLOCK_N1"], dense["BLOCK_N1"]) == (16, 64, 128)
    assert K._fwd_config(64, 64, bf16, False, varlen=True)["BLOCK_M"] == 64
    assert K._fwd_config(64, 64, bf16, False)["BLOCK_M"] == 128
    assert K._bwd_config(128, 128, bf16, False, varlen=True)["BLOCK_N1"] == 64
    assert K._bwd_config(128, 128, bf16, False)["BLOCK_N1"] == 128
    # the forward above d = 64, everything above d = 128 and under the interpreter: no packed tiles
    assert K._fwd_config(128, 128, bf16, False, varlen=True) == K._fwd_config(128, 128, bf16, False)
    for args in ((256, 256, bf16, False), (64, 64, bf16, True), (64, 64, torch.float32, False)):
        assert K._fwd_config(*args, varlen=True) == K._fwd_config(*args)
        assert K._bwd_config(*args, varlen=True) == K._bwd_config(*args)


def test_short_rows_take_the_small_forward_tiles(monkeypatch):
    """The d = 128 forward takes 64-row tiles of four warps where query rows see at most
    SHORT_ROW_KEYS keys on average (no mask up to 1024 keys, causal up to 2048, a window of up to 1024
    at any length); the 128-row tiles beyond, and under block masks and packed sequences (whose rows'
    lengths the host does not know)."""
    bf16 = torch.bfloat16
    short = K._short_rows
    assert K.SHORT_ROW_KEYS == 1024
    assert short(1024, None, None) and not short(1025, None, None) and not short(2048, None, None)
    assert short(2048, None, 0) and not short(2050, None, 0) and short(2048, 0, None)  # causal either way
    assert short(65536, 1023, 0) and short(65536, 1024, 0) and not short(65536, 1025, 0)  # windows
    assert short(65536, 512, 512) and not short(65536, 512, 513)  # both sides bounded: their sum
    assert short(1500, 1000, 0) and not short(3000, 1000, 100)  # a side counts at most half the keys
    assert not short(2000, 3000, 3000) and short(1024, 3000, 3000)  # bounds that cut nothing: no band
    small = {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3, "TMA": 1}
    assert K._fwd_config(128, 128, bf16, False, False, True) == small
    assert K._fwd_config(96, 128, torch.float16, False, False, True) == small
    assert K._fwd_config(128, 128, bf16, False, False, False)["BLOCK_M"] == 128
    assert K._fwd_config(64, 64, bf16, False, False, True) == K._fwd_config(64, 64, bf16, False)
    assert K._fwd_config(256, 256, bf16, False, False, True) == K._fwd_config(256, 256, bf16, False)
    assert K._fwd_config(128, 128, torch.float32, False, False, True)["BLOCK_N"] == 16
    assert K._fwd_config(128, 128, bf16, True, False, True)["BLOCK_M"] == 32  # the interpreter's tiles
    seen = []
    real = K._fwd_config
    monkeypatch.setattr(K, "_fwd_config", lambda *a: (seen.append(a[5]), real(*a))[1])
    _fused(*_tensors([(1, 2, 24, 16)] * 3, torch.float32, 1)).sum()  # causal, 24 keys
    q, k, v, cu_q, cu_kv = _packed([5, 9], [5, 9], 2, 2, 16)
    A._attention_triton(q, k, v, score_mod=None, mask_mod=None, block_mask=None, scale=0.3, left=None, right=0,
                        layout="thd", cu_q=cu_q, cu_kv=cu_kv, max_q=9, max_kv=9, dropout_p=0.0, seed=None)
    assert seen == [True, False]


def test_tma_view_places_heads_in_rows_or_columns():
    """Where the descriptor puts each head: bhsd heads are outer indices, bshd heads columns of a row
    with the batch outer, sbhd (and fused QKV slices) everything in the columns of a row."""
    def place(t):
        v = K._tma_view(t, 16)
        return None if v is None else (tuple(v.desc.shape), tuple(v.desc.strides), v[1:])

    x = torch.zeros(2, 3, 40, 16, dtype=torch.float16)  # bhsd
    assert place(x) == ((6, 40, 16), (640, 16, 1), (3, 1, 0, 0))
    y = torch.zeros(2, 40, 3, 16, dtype=torch.float16).transpose(1, 2)  # bshd as (B, H, S, D)
    assert place(y) == ((2, 40, 48), (1920, 48, 1), (1, 0, 0, 16))
    z = torch.zeros(40, 2, 3, 16, dtype=torch.float16).permute(1, 2, 0, 3)  # sbhd
    assert place(z) == ((1, 40, 96), (3840, 96, 1), (0, 0, 48, 16))
    qkv = torch.zeros(40, 2, 3, 3, 16, dtype=torch.float16)  # (S, B, 3, H, D): k = [:, :, 1]
    kk = qkv[:, :, 1].permute(1, 2, 0, 3)
    assert place(kk) == ((1, 40, 192), (11520, 288, 1), (0, 0, 144, 16))
    assert place(x.float()) is None and place(x[..., :12]) is None
    assert place(x[:, :, :1].expand(2, 3, 40, 16)) is None  # a broadcast sequence dim (stride 0)
    assert place(x[:, :, :15]) is None  # 15 rows: shorter than a 16-row box
    assert place(x[:, :, :, :8].contiguous().view(2, 3, 40, 8)) is None  # D = 8: rows under 16 bytes


def test_launchers_validate():
    q, k, v = (t.detach() for t in _dense(1, 2, 2, 8, 8, 16))
    out, lse = torch.empty_like(q), torch.empty(1, 2, 8)
    with pytest.raises(ValueError, match="one dtype"):
        K.attention_fwd_launch(q, k.double(), v, out, lse, sm_scale=1.0)
    with pytest.raises(ValueError, match="4-D"):
        K.attention_fwd_launch(q[0], k[0], v[0], out, lse, sm_scale=1.0)
    with pytest.raises(ValueError, match="multiple of"):
        K.attention_fwd_launch(q, k[:, :1].expand(1, 3, 8, 16).contiguous(), v[:, :1].expand(1, 3, 8, 16).contiguous(),
                               out, lse, sm_scale=1.0)
    with pytest.raises(ValueError, match="unknown launch config"):
        K.attention_fwd_launch(q, k, v, out, lse, sm_scale=1.0, config={"BLOK_M": 16})
    with pytest.raises(ValueError, match="max_seqlen"):
        cu = torch.tensor([0, 8], dtype=torch.int32)
        K.attention_fwd_launch(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), out, lse,
                               sm_scale=1.0, cu_seqlens_q=cu, cu_seqlens_kv=cu)
    with pytest.raises(ValueError, match="out must be"):
        K.attention_fwd_launch(q, k, v, out[:, :1], lse, sm_scale=1.0)
    with pytest.raises(ValueError, match="dq_mode"):
        K.attention_bwd_launch(q, q, k, v, out, lse, None, q, k, v, sm_scale=1.0, dq_mode="fast")


def test_opcheck_backward_library_op():
    q, k, v = (t.detach() for t in _dense(1, 2, 1, 19, 19, 16))
    table = torch.randn(2, 9)
    sm = A.relative_position_bias(table.requires_grad_())
    out, lse = A._attention_triton(q, k, v, score_mod=sm, mask_mod=None, block_mask=None, scale=0.25, left=None,
                                   right=0, layout="bhsd", cu_q=None, cu_kv=None, max_q=None, max_kv=None,
                                   dropout_p=0.0, seed=None, fwd_config=FWD16, bwd_config=BWD16)
    static = A._Static(sm.key, None, (0,), (), (True,), 0.25, None, 0, "bhsd", None, None, 0.0, None, "separate",
                       None, tuple(sorted(BWD16.items())))
    args = (torch.randn_like(out), torch.randn_like(lse), q, k, v, out.detach(), lse.detach(), None, None, None,
            *([None] * 8), [table.detach()], repr(tuple(static)))
    grads = torch.ops.fp8ops.attention_bwd(*args)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape, table.shape]
    torch.library.opcheck(torch.ops.fp8ops.attention_bwd.default, args,
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


def _fwd_op_args(q, k, v, *, layout, score_mod=None, mask_mod=None, block_mask=None, right=None, cu=None,
                 max_len=None):
    uniq = []
    sm_bufs = score_mod.buffers if score_mod is not None else ()
    for t in (*sm_bufs, *(mask_mod.buffers if mask_mod is not None else ())):
        if not any(t is u for u in uniq):
            uniq.append(t)
    slots = [next(i for i, u in enumerate(uniq) if u is t) for t in (score_mod.buffers if score_mod else ())]
    mslots = [next(i for i, u in enumerate(uniq) if u is t) for t in (mask_mod.buffers if mask_mod else ())]
    static = A._Static(score_mod.key if score_mod else None, mask_mod.key if mask_mod else None, tuple(slots),
                       tuple(mslots), tuple(False for _ in slots), 0.25, None, right, layout, max_len, max_len, 0.0,
                       block_mask.block_size if block_mask is not None else None, "separate",
                       tuple(sorted(FWD16.items())), None)
    bm = ((block_mask.kv_num_blocks, block_mask.kv_indices, block_mask.full_kv_num_blocks,
           block_mask.full_kv_indices) if block_mask is not None else (None,) * 4)
    return (q, k, v, cu, cu, None, *bm, [u.detach() for u in uniq], repr(tuple(static)))


def test_opcheck_forward_library_op():
    # Dense bshd (non-contiguous outputs) with a captured-tensor score_mod and a block mask.
    q, k, v = (t.detach() for t in _dense(1, 2, 1, 32, 32, 16, layout="bshd"))
    q4, k4, v4 = (R.to_bhsd(t, "bshd") for t in (q, k, v))
    sm = A.relative_position_bias(torch.randn(2, 9))
    bm = A.create_block_mask(A.causal_mask(), None, None, 32, 32, block_size=16)
    args = _fwd_op_args(q4, k4, v4, layout="bshd", score_mod=sm, mask_mod=bm.mask_mod, block_mask=bm, right=0)
    out, lse = torch.ops.fp8ops.attention_fwd(*args)
    (ro, rl), _ = R.attention(q, k, v, score_mod=sm, causal=True, scale=0.25, layout="bshd", return_lse=True)
    assert (R.from_bhsd(out, "bshd") - ro).abs().max() < 1e-5
    assert (R.lse_from_bhs(lse, "bshd") - rl).abs().max() < 1e-5
    utils = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(torch.ops.fp8ops.attention_fwd.default, args, test_utils=utils)
    # Packed sequences with a mask_mod.
    cu = torch.tensor([0, 7, 20, 23], dtype=torch.int32)
    qp, kp, vp = (t.detach() for t in _tensors([(26, 2, 16), (26, 1, 16), (26, 1, 16)], torch.float32, 3))
    args = _fwd_op_args(qp, kp, vp, layout="thd", mask_mod=A.sliding_window_mask(5), cu=cu, max_len=13)
    torch.library.opcheck(torch.ops.fp8ops.attention_fwd.default, args, test_utils=utils)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_fullgraph_runs_the_fused_path(backend):
    # The fused path under torch.compile(fullgraph=True), run (here on CPU through the interpreter):
    # forward and backward are opaque library ops, so nothing re-generates a kernel with mods.
    q, k, v = _dense(1, 2, 1, 32, 32, 16, layout="bshd")
    table = (torch.randn(2, 9) * 0.3).requires_grad_()
    sm = A.relative_position_bias(table)
    bm = A.create_block_mask(A.and_masks(A.causal_mask(), A.document_mask(torch.arange(32) // 10)), None, None,
                             32, 32, block_size=16)

    def loss(q, k, v):
        out, lse = A._attention_triton(q, k, v, score_mod=sm, mask_mod=bm.mask_mod, block_mask=bm, scale=0.25,
                                       left=None, right=0, layout="bshd", cu_q=None, cu_kv=None, max_q=None,
                                       max_kv=None, dropout_p=0.0, seed=None, fwd_config=FWD16, bwd_config=BWD16)
        return out.square().sum() + lse.sum()

    want = torch.autograd.grad(loss(q, k, v), [q, k, v, table])
    torch._dynamo.reset()
    got = torch.autograd.grad(torch.compile(loss, fullgraph=True, backend=backend)(q, k, v), [q, k, v, table])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_additive_mod_whose_derivative_is_skipped_under_compile_and_func():
    """ALiBi's derivative is the identity the kernels may skip: eager, torch.compile(fullgraph) and
    torch.func.grad / vmap of grad of the fused path agree, and eager agrees with the reference."""
    q, k, v = (t.detach() for t in _dense(1, 4, 2, 24, 24, 16))
    sm = A.alibi(4)
    assert sm.spec.grad_jit(()) is K._identity_score_grad

    def fused(q):
        out, _ = A._attention_triton(q, k, v, score_mod=sm, mask_mod=None, block_mask=None, scale=0.25, left=None,
                                     right=0, layout="bhsd", cu_q=None, cu_kv=None, max_q=None, max_kv=None,
                                     dropout_p=0.0, seed=None, fwd_config=FWD16, bwd_config=BWD16)
        return out.square().sum()

    qq = q.clone().requires_grad_()
    fused(qq).backward()
    qr = q.clone().requires_grad_()
    (ro, _), _ = R.attention(qr, k, v, causal=True, scale=0.25, score_mod=sm, return_lse=True)
    ro.square().sum().backward()
    torch.testing.assert_close(qq.grad, qr.grad, rtol=2e-4, atol=2e-4)
    torch.testing.assert_close(torch.func.grad(fused)(q), qq.grad, rtol=0, atol=0)
    qs = torch.stack([q, q * 0.5])
    vg = torch.func.vmap(torch.func.grad(fused))(qs)
    torch.testing.assert_close(vg[0], qq.grad, rtol=0, atol=0)
    torch._dynamo.reset()
    q2 = q.clone().requires_grad_()
    torch.compile(fused, fullgraph=True, backend="aot_eager")(q2).backward()
    torch.testing.assert_close(q2.grad, qq.grad, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------------
# Document masks: packed runs of ids, a document in two runs, ids per batch, ids written in place.
# For ids that never decrease the kernels read each position's run of equal ids ([start, end),
# derived from the ids at every call); other ids are compared score by score.


def test_document_bounds_by_hand():
    def runs(ids, seq):
        out = K.document_bounds(ids.reshape(-1), seq).view(-1, 2, seq)  # a row of starts, a row of ends
        return out[:, 0].tolist(), out[:, 1].tolist()

    assert runs(torch.tensor([0, 0, 1, 1, 1, 2]), 6) == ([[0, 0, 2, 2, 2, 5]], [[2, 2, 5, 5, 5, 6]])
    starts, ends = runs(torch.tensor([[0, 0, 1, 1], [3, 3, 3, 3], [0, 1, 1, 4]]), 4)
    assert starts == [[0, 0, 2, 2], [0, 0, 0, 0], [0, 1, 1, 3]]
    assert ends == [[2, 2, 4, 4], [4, 4, 4, 4], [1, 3, 3, 4]]
    long = torch.repeat_interleave(torch.arange(3), torch.tensor([700, 1500, 300]))  # runs across 1024-blocks
    (starts,), (ends,) = runs(long, 2500)
    assert (starts[699], ends[699]) == (0, 700) and (starts[700], ends[700]) == (700, 2200)
    assert (starts[2199], ends[2199]) == (700, 2200) and (starts[2200], ends[2499]) == (2200, 2500)
    with pytest.raises(ValueError, match="document_mask: the document ids were changed in place"):
        K.document_bounds(torch.tensor([0, 1, 1, 0]), 4)


def test_document_mask_twins_chosen_from_the_ids():
    runs = A.document_mask(torch.tensor([0, 0, 1, 1, 2]))
    assert runs.spec.prepare is not None and len(runs.buffers) == 3 and runs.spec.and_causal is not None
    split = A.document_mask(torch.tensor([0, 1, 1, 0, 2]))  # document 0 in two runs: ids compared
    assert split.spec.prepare is None and len(split.buffers) == 1 and split.spec.and_causal is None
    assert A.document_mask(torch.tensor([[0, 0, 1], [0, 1, 1]])).spec.prepare is not None
    assert A.document_mask(torch.tensor([[0, 0, 1], [1, 0, 1]])).spec.prepare is None
    # with the causal mask, in either order and beside other masks, one mod of the causal twin
    for mods in ((A.causal_mask(), runs), (runs, A.causal_mask()), (A.causal_mask(), A.sliding_window_mask(3), runs)):
        children = [c for c, _ in A.and_masks(*mods).spec.children]
        assert len(children) == len(mods) - 1 and runs.spec.and_causal in children
    assert [c for c, _ in A.and_masks(A.causal_mask(), split).spec.children] == [A.causal_mask().spec, split.spec]
    assert runs.spec.and_causal not in [c for c, _ in A.or_masks(A.causal_mask(), runs).spec.children]


def test_bands_that_masks_imply():
    # (left, right): every pair outside q - kv in [-right, left] hidden (the Hopper backward skips
    # it); checked by hand and against each mask evaluated on a grid
    runs = A.document_mask(torch.tensor([0, 0, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2]))
    cases = [
        (A.causal_mask(), (None, 0)),
        (A.sliding_window_mask(3), (2, 0)),
        (A.and_masks(A.causal_mask(), runs), (None, 0)),  # the one-bound twin
        (A.and_masks(runs, A.sliding_window_mask(5)), (4, 0)),
        (A.and_masks(A.sliding_window_mask(5), A.causal_mask(), A.sliding_window_mask(2)), (1, 0)),
        (runs, None),
        (A.or_masks(A.causal_mask(), A.prefix_lm_mask(2)), None),
        (A.and_masks(runs, A.prefix_lm_mask(2)), None),
        (A.MaskMod(lambda b, h, q_idx, kv_idx: q_idx - kv_idx <= 1), None),  # not known: nothing skipped
    ]
    q_idx, kv_idx = torch.arange(12)[:, None], torch.arange(12)[None, :]
    for mod, band in cases:
        assert mod.spec.implied_band == band, mod.name
        assert AG._kernels(None, mod.key, ()).mask_band == band, mod.name
        if band is not None:
            d = (q_idx - kv_idx).expand(12, 12)
            inside = torch.ones(12, 12, dtype=torch.bool)
            if band[0] is not None:
                inside &= d <= band[0]
            if band[1] is not None:
                inside &= -d <= band[1]
            visible = mod(0, 0, q_idx, kv_idx).expand(12, 12)
            assert not (visible & ~inside).any(), mod.name
    assert HB.band_and((None, None), (None, 0)) == (None, 0)
    assert HB.band_and((100, 37), (None, 0)) == (100, 0)
    assert HB.band_and((3, None), (7, 2)) == (3, 2)


@pytest.mark.parametrize("case", ["causal", "window", "window_and_mask", "block_mask", "unknown"])
def test_mask_band_bounds_the_portable_kernels_walks(case, monkeypatch):
    # a mask_mod known to lie in a band, without a block mask: every portable kernel gets the band as
    # its window (BAND on, its bounds as arguments) and so visits only the band's tiles; the same pairs
    # stay visible (the reference check); a block mask's lists bound the walk instead, and a mask whose
    # band is not known keeps every tile
    S = 40

    def sparse(b, h, q_idx, kv_idx):
        return (q_idx + kv_idx) % 3 != 1

    def lower(b, h, q_idx, kv_idx):  # a band, but not one the library knows (nothing bounded)
        return q_idx - kv_idx <= 1

    mm = {"causal": A.causal_mask(), "window": A.sliding_window_mask(7),
          "window_and_mask": A.and_masks(A.sliding_window_mask(9), A.MaskMod(sparse)),
          "block_mask": A.causal_mask(), "unknown": A.MaskMod(lower)}[case]
    kw = dict(mask_mod=mm, window=(30, 2) if case == "window_and_mask" else None)
    if case == "block_mask":
        kw["block_mask"] = A.create_block_mask(mm, None, None, S, S, block_size=16)
    want = {"causal": (K.NO_BOUND, 0), "window": (6, 0), "window_and_mask": (8, 0),
            "block_mask": None, "unknown": None}[case]
    seen = []
    launch = K._launch

    def spy(kernel, grid, *args, **kwargs):
        if "HAS_MASK_MOD" in kwargs:  # forward, dK/dV, dQ (not the preprocess)
            i = next(j for j, a in enumerate(args) if isinstance(a, float))  # sm_scale, then the bounds
            seen.append((kwargs["BAND"], args[i + 1:i + 3]))
        return launch(kernel, grid, *args, **kwargs)

    monkeypatch.setattr(K, "_launch", spy)
    _check(*_dense(1, 2, 2, S, S, 16, seed=5), **kw)
    assert len(seen) == 3
    for band, bounds in seen:
        if want is None:
            assert not band and bounds == (K.NO_BOUND, K.NO_BOUND), case
        else:
            assert band and bounds == want, (case, bounds)


@pytest.mark.parametrize("docs", ["runs", "split", "batched"])
def test_document_masks_against_the_reference(docs):
    # runs: documents one after another (the runs read by query rows in the forward and dQ kernels,
    # by key rows in the dK/dV kernels; one bound with the causal mask, two without); split: document 0
    # in two separate runs of positions, whose queries see each other's keys (so the kernels compare
    # ids: a run would hide the first run's keys from the second's queries); batched: (B, S) ids
    S = 37
    if docs == "runs":
        ids = torch.arange(S) // 12
    elif docs == "split":
        ids = torch.tensor([0] * 10 + [1] * 10 + [0] * 10 + [2] * 7)
    else:
        ids = torch.stack([torch.arange(S) // 12, torch.arange(S) // 7])
    mm = A.and_masks(A.causal_mask(), A.document_mask(ids))
    bm = A.create_block_mask(mm, 2 if docs == "batched" else None, None, S, S, block_size=16)
    _check(*_dense(2, 2, 2, S, S, 16), block_mask=bm)
    _check(*_dense(2, 2, 2, S, S, 16, seed=3), mask_mod=A.document_mask(ids))  # no block mask: every tile
    _check(*_dense(2, 2, 2, S, S, 16, seed=4), mask_mod=mm)


def test_document_mask_reads_ids_written_in_place():
    # the runs are derived from the ids at each call: a mask built once follows ids written in place;
    # ids written so that they decrease raise (the runs would not describe them)
    ids = torch.arange(37) // 12
    for mm in (A.and_masks(A.causal_mask(), A.document_mask(ids)), A.document_mask(ids)):
        ids.copy_(torch.arange(37) // 12)
        q, k, v = _dense(1, 2, 2, 37, 37, 16)
        _check(q, k, v, mask_mod=mm)
        ids.copy_(torch.arange(37) // 5)
        _check(q, k, v, mask_mod=mm)
        ids.copy_(torch.tensor([1] * 20 + [0] * 17))
        with pytest.raises(ValueError, match="changed in place so that they decrease"):
            _check(q, k, v, mask_mod=mm)
    split = torch.tensor([0] * 10 + [1] * 10 + [0] * 17)  # built from decreasing ids: compared, any ids
    mm = A.and_masks(A.causal_mask(), A.document_mask(split))
    _check(q, k, v, mask_mod=mm)
    split.copy_(torch.tensor([2] * 20 + [1] * 17))
    _check(q, k, v, mask_mod=mm)


@pytest.mark.parametrize("mode", ["compile", "func"])
def test_document_mask_compiled_and_under_func_follows_ids_written_in_place(mode):
    # the runs are derived inside the op at each call: torch.compile (fullgraph) and torch.func give
    # the eager gradients for the ids of each call (the reference: the FP32 math of the same mask)
    ids = torch.arange(37) // 12
    mm = A.and_masks(A.causal_mask(), A.document_mask(ids))
    q, k, v = _dense(1, 2, 2, 37, 37, 16)

    def loss(q, k, v):  # the fused path (kernels under the interpreter)
        out, _ = A._attention_triton(q, k, v, score_mod=None, mask_mod=mm, block_mask=None, scale=0.25, left=None,
                                     right=None, layout="bhsd", cu_q=None, cu_kv=None, max_q=None, max_kv=None,
                                     dropout_p=0.0, seed=None, fwd_config=FWD16, bwd_config=BWD16)
        return out.square().sum()

    torch._dynamo.reset()
    if mode == "compile":
        compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")

        def run():
            return torch.autograd.grad(compiled(q, k, v), [q, k, v])
    else:
        def run():
            return torch.func.grad(loss, argnums=(0, 1, 2))(q, k, v)

    for new_ids in (None, torch.arange(37) // 5, torch.zeros(37, dtype=torch.int64)):
        if new_ids is not None:
            ids.copy_(new_ids)
        want = torch.autograd.grad(R.attention(q, k, v, mask_mod=mm, scale=0.25)[0].square().sum(), [q, k, v])
        for a, b in zip(run(), want):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------------------------------------
# One projection's head views: the gradient as one tensor


def _packed_views(qkv, hq, hkv, d, layout):
    lead = qkv.shape[:-1]
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    return q.reshape(*lead, hq, d), k.reshape(*lead, hkv, d), v.reshape(*lead, hkv, d)


PACKED_QKV = [
    # name, layout, hq, hkv, options
    ("sbhd_gqa_causal", "sbhd", 4, 2, dict(right=0)),
    ("sbhd_mha_dropout_window", "sbhd", 2, 2, dict(left=5, right=0, dropout_p=0.3)),
    ("sbhd_mask_mod", "sbhd", 2, 1, dict(mask_mod=A.MaskMod(lambda b, h, i, j: (i + j) % 3 != 0))),
    ("thd_gqa_causal", "thd", 4, 2, dict(right=0)),
]


@pytest.mark.parametrize("case", PACKED_QKV, ids=[c[0] for c in PACKED_QKV])
def test_projection_views_give_one_gradient_equal_to_the_split_ones(case):
    """With ``qkv`` the backward writes dq, dk and dv into one gradient of the projection; it equals
    the gradient autograd makes from the three (its backward of the split: a concatenation), bit for
    bit, and the forward is the same."""
    _, layout, hq, hkv, opts = case
    opts = dict(opts)
    d, S, B = 16, 37, 2
    g = torch.Generator().manual_seed(5)
    if layout == "thd":
        cu = torch.tensor([0, 11, 37, 50], dtype=torch.int32)
        base = torch.randn(50, (hq + 2 * hkv) * d, generator=g)
        varlen = dict(cu_q=cu, cu_kv=cu, max_q=26, max_kv=26)
    else:
        base = torch.randn(S, B, (hq + 2 * hkv) * d, generator=g)
        varlen = dict(cu_q=None, cu_kv=None, max_q=None, max_kv=None)
    p = opts.pop("dropout_p", 0.0)
    kw = dict(score_mod=None, mask_mod=opts.pop("mask_mod", None), block_mask=None, scale=0.25,
              left=opts.pop("left", None), right=opts.pop("right", None), layout=layout, dropout_p=p,
              seed=torch.tensor(99) if p else None, fwd_config=FWD16, bwd_config=BWD16, **varlen)
    results = []
    for packed in (False, True):
        qkv = base.clone().requires_grad_()
        q, k, v = _packed_views(qkv, hq, hkv, d, layout)
        out, lse = A._attention_triton(q, k, v, qkv=qkv if packed else None, **kw)
        dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(6))
        (out * dout).sum().add(lse.sum()).backward()
        results.append((out.detach(), lse.detach(), qkv.grad))
    for what, a, b in zip(("out", "lse", "dqkv"), *results):
        assert torch.equal(a, b), what


def test_projection_views_under_func_grad_and_vmap():
    hq = hkv = 2
    d = 16
    base = torch.randn(19, 1, (hq + 2 * hkv) * d, generator=torch.Generator().manual_seed(7))
    kw = dict(score_mod=None, mask_mod=None, block_mask=None, scale=0.25, left=None, right=0, layout="sbhd",
              cu_q=None, cu_kv=None, max_q=None, max_kv=None, dropout_p=0.0, seed=None, fwd_config=FWD16,
              bwd_config=BWD16)

    def loss(qkv, packed):
        q, k, v = _packed_views(qkv, hq, hkv, d, "sbhd")
        return A._attention_triton(q, k, v, qkv=qkv if packed else None, **kw)[0].square().sum()

    torch.testing.assert_close(torch.func.grad(loss)(base, True), torch.func.grad(loss)(base, False), rtol=0, atol=0)
    batch = torch.stack([base, base * 0.5])
    vg = torch.func.vmap(torch.func.grad(loss), in_dims=(0, None))(batch, True)
    for i in range(2):
        torch.testing.assert_close(vg[i], torch.func.grad(loss)(batch[i], False), rtol=0, atol=0)


def test_projection_views_are_checked():
    op = importlib.import_module("fp8ops.attention.op")
    qkv = torch.randn(8, 2, 3 * 2 * 16)
    q, k, v = _packed_views(qkv, 2, 2, 16, "sbhd")
    assert op._packed_qkv(qkv, q, k, v, False, False, "sbhd", "attention") is qkv
    assert op._packed_qkv(qkv, q, k, v, False, False, "bshd", "attention") is None  # not this layout
    with pytest.raises(ValueError, match="head views of qkv"):
        op._packed_qkv(qkv, k, q, v, False, False, "sbhd", "attention")  # q and k swapped
    with pytest.raises(ValueError, match="not the projection"):
        op._packed_qkv(qkv[:, :, :80], q, k, v, False, False, "sbhd", "attention")

    def inside_grad(x):  # torch.func's tensors have no address: the shapes and strides are checked
        qq, kk, vv = _packed_views(x, 2, 2, 16, "sbhd")
        assert op._packed_qkv(x, qq, kk, vv, False, False, "sbhd", "attention") is x
        return x.sum()

    torch.func.grad(inside_grad)(qkv)


@triton.jit
def _keep_at_kernel(out_ptr, seed_ptr, b, h, q0, thresh, ROWS: tl.constexpr, COLS: tl.constexpr):
    from fp8ops.kernels._dropout import _dropout_keep_at, _dropout_key

    q_off = tl.arange(0, ROWS)[:, None]
    kv = tl.arange(0, COLS)[None, :]
    keep = _dropout_keep_at(_dropout_key(seed_ptr, b, h), q0, q_off, kv, thresh)
    tl.store(out_ptr + q_off * COLS + kv, keep.to(tl.int8))


@pytest.mark.parametrize("q0", [0, 32, 5, 13])
def test_dropout_keep_at_any_first_row_is_the_reference_mask(q0):
    # The kernels' mask of rows q0.. (the split form where q0 is a multiple of 16, the plain one
    # otherwise) is the reference's bits.
    seed = torch.tensor([987654321012], dtype=torch.int64)
    out = torch.empty(64, 32, dtype=torch.int8)
    _keep_at_kernel[(1,)](out, seed, 1, 2, q0, R.dropout_threshold(0.3), ROWS=64, COLS=32)
    want = R.dropout_keep(seed[0], torch.tensor(1), torch.tensor(2), (q0 + torch.arange(64))[:, None],
                          torch.arange(32)[None, :], 0.3)
    assert torch.equal(out.bool(), want)
