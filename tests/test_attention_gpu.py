"""GPU tests of attention: the fused Triton kernels at real sizes, forward and every gradient.

Error rule (DESIGN.md §5): for each output and gradient, the error of fp8ops against the FP32
reference must be at most ``k`` times the error of plain PyTorch at the same precision (SDPA in
bf16/fp16 where it can express the computation, else the reference math with bf16/fp16 GEMMs) plus a
small absolute slack; the failure message carries all three numbers.

Covers head dims 64/128/256, bf16/fp16/fp32, causal and windows, GQA/MQA, cross-attention, the
three dense layouts, score mods (soft-cap, ALiBi, a learned relative-position table and its
gradient), mask mods and block masks (document masking), packed sequences (lengths 1, primes, 0),
fully masked rows, dropout (the same mask as the reference), the atomic-dQ variant, determinism of
the default backward, torch.compile(fullgraph=True) + backward, and torch.func transforms.
"""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from fp8ops.testing import assert_close_rule

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

A = importlib.import_module("fp8ops.attention")
R = importlib.import_module("fp8ops.reference.attention")
DEV = "cuda"
BF16, FP16 = torch.bfloat16, torch.float16


def _rand(shape, dtype, seed, scale=1.0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return (torch.randn(shape, generator=g, device=DEV) * scale).to(dtype).requires_grad_()


def _qkv(B, Hq, Hkv, Sq, Skv, D, dtype, layout="bhsd", seed=0, Dv=None):
    shape = {"bhsd": lambda H, S, d: (B, H, S, d), "bshd": lambda H, S, d: (B, S, H, d),
             "sbhd": lambda H, S, d: (S, B, H, d)}[layout]
    return (_rand(shape(Hq, Sq, D), dtype, seed), _rand(shape(Hkv, Skv, D), dtype, seed + 1),
            _rand(shape(Hkv, Skv, Dv or D), dtype, seed + 2))


def _grads(out, lse, params, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    dout = torch.randn(out.shape, generator=g, device=DEV).to(out.dtype)
    loss = (out.float() * dout.float()).sum()
    if lse is not None:
        loss = loss + (lse.float() * torch.randn(lse.shape, generator=g, device=DEV) * 0.1).sum()
    return torch.autograd.grad(loss, params)


def _check_all(mine, ref32, low, names, k_fwd=2.0, k_bwd=3.0):
    for i, (a, e, p, name) in enumerate(zip(mine, ref32, low, names)):
        if a is None:
            continue
        slack = 1e-3 * float(e.detach().abs().max()) + 1e-5
        assert_close_rule(a, e, p, k=k_fwd if i < 2 else k_bwd, atol=slack, name=name)


def _compare(q, k, v, *, sdpa=None, seed=7, **kw):
    """fp8ops vs the FP32 reference vs plain PyTorch at q's precision: out, lse and every gradient.

    With ``sdpa`` (a function running F.scaled_dot_product_attention) plain PyTorch is SDPA or the
    reference math with GEMMs in q's dtype, whichever gives the looser bound, and the loss uses the
    output only; otherwise it is the reference math and the loss also has an LSE term (its gradient
    is checked too)."""
    sm = kw.get("score_mod")
    bufs = [t for t in (sm.buffers if isinstance(sm, A.ScoreMod) else ()) if t.requires_grad]
    params = [q, k, v, *bufs]
    use_lse = sdpa is None
    (out, lse), _ = A.attention(q, k, v, return_lse=True, **kw)
    mine = (out, lse, *_grads(out, lse if use_lse else None, params, seed))
    ref_kw = {n: x for n, x in kw.items() if n not in ("max_seqlen_q", "max_seqlen_kv")}
    (ro, rl), _ = R.attention(q, k, v, return_lse=True, **ref_kw)
    ref32 = (ro, rl, *_grads(ro, rl if use_lse else None, params, seed))
    (lo, ll), _ = R.attention(q, k, v, return_lse=True, compute_dtype=q.dtype, **ref_kw)
    names = ["out", "lse", "dq", "dk", "dv"] + [f"dbuf{i}" for i in range(len(bufs))]
    for t in mine:
        assert not torch.isnan(t).any()
    math_low = (lo, ll, *_grads(lo, ll if use_lse else None, params, seed))
    if sdpa is None:
        _check_all(mine, ref32, math_low, names)
        return out, lse
    # Plain PyTorch at q's precision is SDPA here, and SDPA's bits are not a fixed target: which
    # cuDNN engine runs (and so how its output rounds) can depend on what ran earlier in the process.
    # The bound is the looser of SDPA's error and that of the reference math at q's precision (P
    # rounded to q's dtype before the PV product, as in every flash kernel); both are plain PyTorch.
    so = sdpa(q, k, v)
    try:
        _check_all(mine, ref32, (so, ll, *_grads(so, None, params, seed)), names)
    except AssertionError as vs_sdpa:
        try:
            _check_all(mine, ref32, math_low, names)
        except AssertionError as vs_math:
            raise AssertionError(f"against SDPA: {vs_sdpa}; against the reference math at {q.dtype}: {vs_math}") from None
    return out, lse


def _sdpa(layout="bhsd", **kw):
    def run(q, k, v):
        q4, k4, v4 = (R.to_bhsd(t, layout) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q4, k4, v4, enable_gqa=q4.shape[1] != k4.shape[1], **kw)
        return R.from_bhsd(out, layout)
    return run


# ------------------------------------------------------------------------------------------------
# Parity with SDPA


@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_head_dims_bf16(D, causal):
    q, k, v = _qkv(2, 8, 2, 1024, 1024, D, BF16)
    _compare(q, k, v, causal=causal, sdpa=_sdpa(is_causal=causal))


@pytest.mark.parametrize("dtype", [FP16, torch.float32])
def test_fp16_and_fp32(dtype):
    q, k, v = _qkv(2, 4, 4, 777, 777, 128, dtype)
    _compare(q, k, v, causal=True, sdpa=_sdpa(is_causal=True))


@pytest.mark.parametrize("layout", ["bshd", "sbhd"])
def test_layouts_mqa(layout):
    q, k, v = _qkv(2, 8, 1, 640, 640, 128, BF16, layout=layout)
    out, _ = _compare(q, k, v, causal=True, layout=layout, sdpa=_sdpa(layout, is_causal=True))
    assert out.is_contiguous()


@pytest.mark.parametrize("Sq,Skv", [(512, 1536), (1536, 512), (1, 1), (1, 999), (997, 13)])
def test_cross_attention_and_odd_lengths(Sq, Skv):
    q, k, v = _qkv(2, 4, 2, Sq, Skv, 128, BF16)
    _compare(q, k, v, causal=False, sdpa=_sdpa())
    _compare(q, k, v, causal=True, sdpa=_sdpa(is_causal=True))  # top-left: every row sees key 0


@pytest.mark.parametrize("window", [256, (100, 37)])
def test_windows(window):
    S = 1024
    q, k, v = _qkv(2, 8, 2, S, S, 128, BF16)
    left, right = R.normalize_window(window, False)
    i, j = torch.arange(S, device=DEV)[:, None], torch.arange(S, device=DEV)[None, :]
    mask = (i - j <= left) & (j - i <= right)
    _compare(q, k, v, window=window, sdpa=_sdpa(attn_mask=mask))


# ------------------------------------------------------------------------------------------------
# Mods and block masks


def test_score_mods():
    q, k, v = _qkv(2, 8, 2, 768, 768, 128, BF16)
    _compare(q, k, v, causal=True, score_mod=A.softcap(5.0))
    _compare(q, k, v, score_mod=A.alibi(8), mask_mod=A.sliding_window_mask(200))


def test_learned_relative_bias_gradient():
    q, k, v = _qkv(1, 4, 4, 512, 512, 64, BF16)
    table = (torch.randn(4, 127, device=DEV) * 0.5).requires_grad_()
    _compare(q, k, v, score_mod=A.relative_position_bias(table), causal=True)


def test_document_block_mask_equals_sdpa_with_a_dense_mask():
    S = 2048
    q, k, v = _qkv(2, 8, 2, S, S, 128, BF16)
    docs = torch.cumsum(torch.rand(S, device=DEV) < 0.003, 0)
    mm = A.and_masks(A.causal_mask(), A.document_mask(docs))
    bm = A.create_block_mask(mm, None, None, S, S)
    assert bm.sparsity() > 0.5
    dense = mm(0, 0, torch.arange(S, device=DEV)[:, None], torch.arange(S, device=DEV)[None, :])
    _compare(q, k, v, block_mask=bm, sdpa=_sdpa(attn_mask=dense))
    # the same numbers without the block mask (mask_mod on every tile)
    a, _ = A.attention(q, k, v, block_mask=bm)
    b, _ = A.attention(q, k, v, mask_mod=mm)
    assert (a.float() - b.float()).abs().max() < 2e-2


@pytest.mark.parametrize("docs", ["split", "batched"])
def test_document_masks_split_and_per_batch_equal_sdpa(docs):
    # split: a document in two runs of positions; batched: (B, S) ids, two documents layouts
    S = 1024
    q, k, v = _qkv(2, 8, 2, S, S, 128, BF16)
    pos = torch.arange(S, device=DEV)
    if docs == "split":
        ids = torch.where((pos >= 300) & (pos < 700), 1, 0) + torch.where(pos >= 900, 2, 0)
    else:
        ids = torch.stack([pos // 200, pos // 300])
    mm = A.and_masks(A.causal_mask(), A.document_mask(ids))
    B = 2 if docs == "batched" else None
    bm = A.create_block_mask(mm, B, None, S, S, device=DEV)
    dense = torch.stack([mm(b, 0, pos[:, None], pos[None, :]) for b in range(2)])[:, None]
    _compare(q, k, v, block_mask=bm, sdpa=_sdpa(attn_mask=dense))


_DECREASING_IDS = """
import torch, fp8ops
ids = torch.arange(1024, device="cuda") // 256
mm = fp8ops.and_masks(fp8ops.causal_mask(), fp8ops.document_mask(ids))
bm = fp8ops.create_block_mask(mm, None, None, 1024, 1024, device="cuda")
q = torch.randn(1, 4, 1024, 128, device="cuda", dtype=torch.bfloat16)
fp8ops.attention(q, q, q, block_mask=bm)
torch.cuda.synchronize()
print("first call ran")
ids.copy_(torch.arange(1024, device="cuda").flip(0) // 256)
fp8ops.attention(q, q, q, block_mask=bm)
torch.cuda.synchronize()
print("second call ran")
"""


def test_document_ids_written_to_decrease_stop_the_call():
    # a mask built from non-decreasing ids reads runs of them; ids then written so that they decrease
    # stop the kernel that derives the runs with a device-side assertion (its own process: the
    # assertion leaves the CUDA context unusable), never a silently wrong result
    run = subprocess.run([sys.executable, "-c", _DECREASING_IDS], capture_output=True, text=True, timeout=300)
    assert "first call ran" in run.stdout
    assert run.returncode != 0 and "second call ran" not in run.stdout
    assert "document_mask" in run.stderr + run.stdout, run.stderr[-2000:]


@pytest.mark.parametrize("mode", ["compile", "reduce-overhead", "cuda_graph", "func"])
def test_document_mask_runs_in_every_execution_mode_and_follows_ids_written_in_place(mode):
    # the runs of ids are derived inside the op at every call, so a compiled function, a captured
    # graph or torch.func see the ids of the call: the same gradients as eager before and after the
    # ids are written in place (mask_mod without a block mask, whose lists would go stale)
    S = 512
    q, k, v = _qkv(2, 4, 2, S, S, 64, BF16)
    pos = torch.arange(S, device=DEV)
    ids = pos // 100
    mm = A.and_masks(A.causal_mask(), A.document_mask(ids))
    assert mm.spec.children[0][0] is A.document_mask(ids).spec.and_causal  # the one-bound twin

    def loss(q, k, v):
        return A.attention(q, k, v, mask_mod=mm, backend="triton")[0].float().square().mean()

    def eager():
        return [g.clone() for g in torch.autograd.grad(loss(q, k, v), [q, k, v])]

    torch._dynamo.reset()
    if mode == "func":
        def run():
            return list(torch.func.grad(loss, argnums=(0, 1, 2))(q, k, v))
    elif mode == "cuda_graph":
        from fp8ops.bench.common import capture_graph

        box = []

        def body():
            box[:] = torch.autograd.grad(loss(q, k, v), [q, k, v])

        graph = capture_graph(body, body)

        def run():
            graph.replay()
            return [g.clone() for g in box]
    else:
        compiled = torch.compile(loss, fullgraph=True, mode=None if mode == "compile" else "reduce-overhead")

        def run():
            return [g.clone() for g in torch.autograd.grad(compiled(q, k, v), [q, k, v])]

    for new_ids in (None, pos // 37, torch.zeros_like(pos)):
        if new_ids is not None:
            ids.copy_(new_ids)
        want = eager()
        for _ in range(2):
            got = run()
            for a, b in zip(got, want):
                assert (a.float() - b.float()).abs().max() <= 1e-2 * float(b.abs().max()) + 1e-6, (mode, new_ids)
    dense = mm(0, 0, pos[:, None], pos[None, :])  # the last ids: one document, the causal mask
    assert torch.equal(dense, pos[:, None] >= pos[None, :])


def test_block_mask_per_batch_and_head():
    S = 1024

    def mm(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx + 128 * (b + h)

    bm = A.create_block_mask(mm, 2, 4, S, S, device=DEV)
    q, k, v = _qkv(2, 4, 4, S, S, 64, BF16)
    _compare(q, k, v, block_mask=bm)


# ------------------------------------------------------------------------------------------------
# Packed sequences


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128])  # d = 64: the packed-sequence tiles of its own
def test_packed_equals_sdpa_per_sequence(causal, d):
    lens = [1, 997, 0, 256, 13, 1024]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
    T = int(cu[-1])
    q, k, v = _rand((T, 8, d), BF16, 1), _rand((T, 2, d), BF16, 2), _rand((T, 2, d), BF16, 3)

    def sdpa(q, k, v):
        outs = []
        for s in range(len(lens)):
            a, b = int(cu[s]), int(cu[s + 1])
            if a == b:
                continue
            qs, ks, vs = (t[a:b].transpose(0, 1)[None] for t in (q, k, v))
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal, enable_gqa=True)
            outs.append(o[0].transpose(0, 1))
        return torch.cat(outs)

    _compare(q, k, v, cu_seqlens_q=cu, causal=causal, max_seqlen_q=1024, max_seqlen_kv=1024, sdpa=sdpa)


def test_packed_cross_lengths_with_mods():
    lq, lkv = [5, 300, 77], [700, 3, 129]
    cq = torch.tensor([0, *torch.tensor(lq).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
    ck = torch.tensor([0, *torch.tensor(lkv).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
    q = _rand((int(cq[-1]), 4, 64), BF16, 1)
    k, v = _rand((int(ck[-1]), 2, 64), BF16, 2), _rand((int(ck[-1]), 2, 64), BF16, 3)
    _compare(q, k, v, cu_seqlens_q=cq, cu_seqlens_kv=ck, score_mod=A.alibi(4),
             mask_mod=A.prefix_lm_mask(torch.tensor([2, 50, 10], device=DEV)))


def test_nested_tensor_input():
    seqs = [torch.randn(n, 8, 64, device=DEV, dtype=BF16) for n in (17, 300, 1)]
    nt = torch.nested.nested_tensor(seqs, layout=torch.jagged)
    out, _ = A.attention(nt, nt, nt, causal=True)
    for s, o in zip(seqs, out.unbind()):
        ref = F.scaled_dot_product_attention(*(s.transpose(0, 1)[None],) * 3, is_causal=True)[0].transpose(0, 1)
        assert (o.float() - ref.float()).abs().max() < 2e-2


# ------------------------------------------------------------------------------------------------
# Numerics and variants


def test_fully_masked_rows():
    q, k, v = _qkv(1, 4, 4, 512, 512, 128, BF16)
    mm = A.MaskMod(lambda b, h, q_idx, kv_idx: (q_idx < 300) & (kv_idx < 400))
    out, lse = _compare(q, k, v, mask_mod=mm)
    assert (out[:, :, 300:] == 0).all() and (lse[:, :, 300:] == R.MASKED_ROW_LSE).all()


def test_dropout_matches_the_reference_mask():
    q, k, v = _qkv(2, 4, 4, 512, 512, 64, BF16)
    _compare(q, k, v, causal=True, dropout_p=0.1, dropout_seed=1234)


def test_atomic_dq_variant_and_determinism():
    q, k, v = _qkv(2, 8, 2, 1024, 1024, 128, BF16)
    left, right = R.normalize_window(None, True)
    args = dict(score_mod=None, mask_mod=None, block_mask=None, scale=128**-0.5, left=left, right=right,
                layout="bhsd", cu_q=None, cu_kv=None, max_q=None, max_kv=None, dropout_p=0.0, seed=None)
    res = {}
    for mode in ("separate", "separate", "atomic"):
        out, lse = A._attention_triton(q, k, v, dq_mode=mode, **args)
        res.setdefault(mode, []).append(_grads(out, lse, [q, k, v], 3))
    a, b = res["separate"]
    for x, y in zip(a, b):
        assert torch.equal(x, y)  # the default backward is deterministic
    for x, y in zip(a, res["atomic"][0]):
        assert (x.float() - y.float()).abs().max() <= 2e-2 * float(x.abs().max())


def test_public_op_dq_scheme_and_deterministic_flag():
    # head dim 256: the only one where a masked attention defaults to the atomic dQ scheme
    q, k, v = _qkv(2, 8, 2, 768, 768, 256, BF16)
    runs = {}
    for det in (True, True, False):
        out = A.attention(q, k, v, causal=True, deterministic=det, backend="triton")[0]
        runs.setdefault(det, []).append(_grads(out, None, [q, k, v], 3))
    for x, y in zip(*runs[True]):
        assert torch.equal(x, y)
    for x, y in zip(runs[True][0], runs[False][0]):
        assert (x.float() - y.float()).abs().max() <= 2e-2 * float(x.abs().max())
    assert A._dq_mode(False) == "auto"
    assert A._dq_mode(True) == "separate"


def test_compile_fullgraph_backward_equals_eager():
    q, k, v = _qkv(2, 8, 2, 512, 512, 128, BF16)
    table = (torch.randn(8, 63, device=DEV) * 0.3).requires_grad_()
    sm = A.relative_position_bias(table)
    bm = A.create_block_mask(A.causal_mask(), None, None, 512, 512, device=DEV)

    def loss(q, k, v):
        out, _ = A.attention(q, k, v, score_mod=sm, block_mask=bm)
        return out.float().square().mean()

    eager = torch.autograd.grad(loss(q, k, v), [q, k, v, table])
    torch._dynamo.reset()
    compiled = torch.compile(loss, fullgraph=True)
    got = torch.autograd.grad(compiled(q, k, v), [q, k, v, table])
    for a, b in zip(got, eager):
        assert (a.float() - b.float()).abs().max() <= 1e-2 * float(b.abs().max()) + 1e-6


def test_alibi_compiled_backward_equals_eager_on_the_relative_path(monkeypatch):
    """ALiBi through torch.compile(fullgraph=True): the compiled graph's backward reaches the same
    kernel path as eager (on an sm_90 GPU the Hopper backward with the bias added per key row) and
    gives the same gradients."""
    K = importlib.import_module("fp8ops.kernels.attention")
    HB = importlib.import_module("fp8ops.kernels._attention_hopper_bwd")
    modes = []
    real = K.hopper_bwd

    def spy(*args, **kwargs):
        modes.append(kwargs["score_mode"])
        return real(*args, **kwargs)

    monkeypatch.setattr(K, "hopper_bwd", spy)
    q, k, v = _qkv(2, 8, 2, 512, 512, 128, BF16)
    sm = A.alibi(8)

    def loss(q, k, v):
        out, _ = A.attention(q, k, v, causal=True, score_mod=sm, backend="triton")
        return out.float().square().mean()

    eager = torch.autograd.grad(loss(q, k, v), [q, k, v])
    eager_modes = list(modes)
    torch._dynamo.reset()
    got = torch.autograd.grad(torch.compile(loss, fullgraph=True)(q, k, v), [q, k, v])
    assert modes[len(eager_modes):] == eager_modes
    if torch.cuda.get_device_capability()[0] == 9:
        assert eager_modes == [HB.SCORE_MODE_RELATIVE]
    for a, b in zip(got, eager):
        assert (a.float() - b.float()).abs().max() <= 1e-2 * float(b.abs().max()) + 1e-6


def test_compile_of_func_grad_is_never_silently_wrong():
    q, k, v = (t.detach() for t in _qkv(1, 4, 4, 256, 256, 64, BF16))

    def loss(q):
        return A.attention(q, k, v, causal=True, backend="triton")[0].float().square().sum()

    want = torch.func.grad(loss)(q)
    torch._dynamo.reset()
    try:
        got = torch.compile(torch.func.grad(loss))(q)
    except Exception:
        return  # raising is acceptable
    assert (got.float() - want.float()).abs().max() <= 1e-2 * float(want.abs().max())


def test_torch_func_grad_and_vmap_of_grad():
    q, k, v = (t.detach() for t in _qkv(1, 4, 2, 256, 256, 64, BF16))
    qs = torch.stack([q, q * 0.5, q * 2.0])

    def loss(q):
        return A.attention(q, k, v, causal=True, score_mod=A.softcap(20.0))[0].float().square().sum()

    vg = torch.func.vmap(torch.func.grad(loss))(qs)
    for i in range(3):
        qq = qs[i].clone().requires_grad_()
        loss(qq).backward()
        assert (vg[i].float() - qq.grad.float()).abs().max() <= 1e-6 * float(qq.grad.abs().max())


def test_auto_backend_uses_sdpa_where_it_applies_and_matches_triton():
    q, k, v = _qkv(2, 8, 2, 512, 512, 128, BF16)
    outs = {}
    for backend in ("auto", "triton", "sdpa"):
        qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
        out = A.attention(qq, kk, vv, causal=True, backend=backend)[0]
        outs[backend] = (out, *_grads(out, None, [qq, kk, vv], 5))
    assert torch.equal(outs["auto"][0], outs["sdpa"][0])  # auto took SDPA (its forward is deterministic)
    for a, b in zip(outs["auto"][1:], outs["sdpa"][1:]):
        assert (a.float() - b.float()).abs().max() <= 1e-3 * float(b.float().abs().max())
    for a, b in zip(outs["sdpa"], outs["triton"]):
        assert (a.float() - b.float()).abs().max() <= 2e-2 * float(b.float().abs().max())
    with pytest.raises(ValueError, match="backend='sdpa' cannot run this call .a window"):
        A.attention(q, k, v, window=64, backend="sdpa")


# ------------------------------------------------------------------------------------------------
# Tensor-descriptor (TMA) loads


def _fused_qkv(S, B, H, D, seed):
    # one (S, B, 3, H, D) projection output; q, k, v are its strided (S, B, H, D) slices
    g = torch.Generator(device=DEV).manual_seed(seed)
    return [torch.randn(S, B, 3, H, D, generator=g, device=DEV).to(BF16)]


TMA_GPU = [
    ("d64_causal", lambda: _qkv(2, 8, 2, 1024, 1024, 64, BF16), "bhsd", dict(causal=True)),
    ("d128_causal_gqa", lambda: _qkv(2, 8, 2, 1024, 1024, 128, BF16), "bhsd", dict(causal=True)),
    ("d256_window", lambda: _qkv(1, 4, 4, 777, 777, 256, BF16), "bhsd", dict(window=(100, 37))),
    ("odd_lengths_cross", lambda: _qkv(2, 4, 2, 997, 13, 128, BF16), "bhsd", dict(causal=True)),  # K/V: fallback
    ("odd_lengths_long_kv", lambda: _qkv(2, 4, 2, 13, 997, 128, BF16), "bhsd", dict(causal=False)),  # Q: fallback
    ("odd_lengths_both", lambda: _qkv(2, 4, 2, 777, 1001, 128, BF16), "bhsd", dict(causal=True)),
    ("sbhd_fused_qkv", lambda: _fused_qkv(640, 2, 8, 128, 3), "sbhd", dict(causal=True)),
    ("bshd_alibi", lambda: _qkv(2, 8, 8, 640, 640, 128, BF16, layout="bshd"), "bshd",
     dict(causal=True, score_mod="alibi")),
    ("document_block_mask", lambda: _qkv(1, 4, 4, 1024, 1024, 128, BF16), "bhsd", dict(block_mask="docs")),
]


@pytest.mark.parametrize("case", TMA_GPU, ids=[c[0] for c in TMA_GPU])
@pytest.mark.parametrize("dq_mode", ["separate", "atomic"])
def test_tensor_descriptor_loads_equal_pointer_loads(case, dq_mode):
    """The TMA load paths (forward TMA, dK/dV TMA1, dQ TMA2) give the pointer loads' outputs and
    gradients: the same tiles and products, so equal up to the atomic dQ's summation order (the
    pointer loads are checked against the reference by the tests above)."""
    name, make, layout, opts = case
    base = [t.detach() for t in make()]
    left, right = R.normalize_window(opts.get("window"), opts.get("causal", False))
    kw = dict(score_mod=None, mask_mod=None, block_mask=None, left=left, right=right)
    runs = []
    for tma in (0, 1):
        leaves = [t.clone().requires_grad_() for t in base]
        q, k, v = (leaves[0][:, :, i] for i in range(3)) if len(leaves) == 1 else leaves
        q4 = R.to_bhsd(q, layout)
        if opts.get("score_mod") == "alibi":
            kw["score_mod"] = A.alibi(q4.shape[1])
        if opts.get("block_mask") == "docs":
            S = q4.shape[2]
            docs = (torch.arange(S, device=DEV) * 5) // S
            mm = A.and_masks(A.causal_mask(), A.document_mask(docs))
            kw.update(mask_mod=mm, block_mask=A.create_block_mask(mm, None, None, S, S, block_size=128))
        out, lse = A._attention_triton(q, k, v, scale=q.shape[-1] ** -0.5, layout=layout, cu_q=None, cu_kv=None,
                                       max_q=None, max_kv=None, dropout_p=0.0, seed=None, dq_mode=dq_mode,
                                       fwd_config={"TMA": tma}, bwd_config={"TMA1": tma, "TMA2": tma}, **kw)
        runs.append((out, lse, *_grads(out, lse, [q, k, v], 11)))
    for what, a, b in zip(("out", "lse", "dq", "dk", "dv"), *runs):
        assert not torch.isnan(a).any() and not torch.isnan(b).any(), what
        tol = 2e-3 if dq_mode == "atomic" and what == "dq" else 1e-5
        err = float((b.float() - a.float()).abs().max())
        assert err <= tol * (float(a.float().abs().max()) + 1e-6), f"{name} {what}: TMA differs by {err:.3g}"
