"""GPU tests of the warp-specialised Hopper attention backward (``kernels/_attention_hopper_bwd.py``).

On an sm_90 GPU the Triton backend's backward runs this kernel wherever it applies (it measured faster
than the portable kernels everywhere) when the call need not be deterministic (``dq_mode="auto"``,
the public op's default); ``dq_mode="separate"`` runs the portable kernels. These cases pass
``bwd_config={"HOPPER": 2}`` (any nonzero value turns it on). Each case checks
that the Hopper backward really ran (or really did not), and that dq, dk, dv (and a learnable
score_mod table's gradient) are as close to the FP32 reference as the portable kernels' (DESIGN.md §5:
error(Hopper) <= 2 x error(portable) + slack). Covers head dims 64/128, bf16/fp16, causal, windows, no
mask, GQA/MQA, cross-attention, the three layouts (a fused QKV projection's strided slices included),
score_mods with and without captured-tensor gradients, a mask_mod on every tile, block masks, rows
that see no key, and the problems that stay on the portable kernels (odd lengths, keys not in whole
tiles, head dim 256), dropout with the reference's mask, and the routing of default, deterministic and score_mod calls.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from fp8ops.testing import assert_close_rule
from fp8ops.testing import attention_inputs as inputs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                       reason="needs an sm_90 (Hopper) GPU"),
]

A = importlib.import_module("fp8ops.attention")
R = importlib.import_module("fp8ops.reference.attention")
K = importlib.import_module("fp8ops.kernels.attention")
DEV = "cuda"
BF16, FP16 = torch.bfloat16, torch.float16


def _qkv(*args, **kwargs):
    return inputs.qkv(*args, device=DEV, **kwargs)


def _fused_qkv(*args):
    return inputs.fused_qkv(*args, device=DEV)


def _docs(S):
    return inputs.docs_mask(S, device=DEV)


CASES = [
    # name, make q/k/v, layout, options, whether the Hopper backward applies
    ("d128_causal_gqa", lambda: _qkv(1, 8, 2, 1024, 1024, 128), "bhsd", dict(causal=True), True),
    ("d64_causal", lambda: _qkv(2, 4, 4, 768, 768, 64), "bhsd", dict(causal=True), True),
    ("d128_none_bshd", lambda: _qkv(2, 4, 4, 768, 768, 128, layout="bshd"), "bshd", {}, True),
    ("d128_window", lambda: _qkv(1, 4, 4, 1024, 1024, 128), "bhsd", dict(window=(100, 37)), True),
    ("d128_fp16_causal_mqa", lambda: _qkv(2, 8, 1, 512, 512, 128, FP16), "bhsd", dict(causal=True), True),
    ("d128_cross_causal", lambda: _qkv(2, 4, 2, 448, 1536, 128), "bhsd", dict(causal=True), True),
    ("d128_long_q_causal", lambda: _qkv(2, 4, 2, 1536, 512, 128), "bhsd", dict(causal=True), True),
    ("sbhd_fused_qkv", lambda: _fused_qkv(640, 2, 8, 128, 3), "sbhd", dict(causal=True), True),
    ("d128_alibi_causal", lambda: _qkv(2, 8, 8, 640, 640, 128, layout="bshd"), "bshd",
     dict(causal=True, score_mod="alibi"), True),
    ("d64_relative_bias_table_grad", lambda: _qkv(1, 4, 2, 512, 512, 64), "bhsd",
     dict(causal=True, score_mod="relative"), True),
    ("d128_alibi_window_mask", lambda: _qkv(1, 8, 2, 768, 768, 128), "bhsd",
     dict(score_mod="alibi", mask_mod="window"), True),
    # ALiBi's query part folded into the LSE row relative to the key tile: queries before and far
    # after the keys (no mask, cross-attention both ways), block masks, rows that see nothing
    ("d128_alibi_none_cross", lambda: _qkv(1, 4, 2, 512, 1024, 128), "bhsd", dict(score_mod="alibi"), True),
    ("d64_alibi_long_q", lambda: _qkv(2, 4, 4, 1536, 512, 64), "bhsd", dict(score_mod="alibi"), True),
    ("d64_alibi_document_block_mask_gqa", lambda: _qkv(1, 8, 2, 1024, 1024, 64), "bhsd",
     dict(score_mod="alibi", block_mask="docs"), True),
    ("alibi_rows_that_see_nothing", lambda: _qkv(1, 4, 4, 512, 512, 128), "bhsd",
     dict(score_mod="alibi", mask_mod="empty_rows"), True),
    # how the kernel calls a mod: a scaled score (derivative 0.5 called), an additive mod in named
    # steps and a frozen bias table (a load per score): derivative 1, skipped
    ("d128_scaled_score_causal", lambda: _qkv(1, 4, 4, 640, 640, 128), "bhsd",
     dict(causal=True, score_mod="scaled"), True),
    ("d128_additive_named_causal", lambda: _qkv(1, 4, 2, 640, 640, 128), "bhsd",
     dict(causal=True, score_mod="named"), True),
    ("d64_relative_bias_frozen_window", lambda: _qkv(1, 4, 4, 512, 512, 64), "bhsd",
     dict(window=(100, 37), score_mod="frozen"), True),
    ("d128_document_block_mask", lambda: _qkv(1, 4, 4, 1024, 1024, 128), "bhsd", dict(block_mask="docs"), True),
    ("d64_document_block_mask_gqa", lambda: _qkv(1, 8, 2, 1024, 1024, 64), "bhsd", dict(block_mask="docs"), True),
    ("rows_that_see_nothing", lambda: _qkv(1, 4, 4, 512, 512, 128), "bhsd", dict(mask_mod="empty_rows"), True),
    # query tiles that no key block visits (their dq all zeros): a block mask with empty query
    # blocks, and a band that ends before queries past the keys
    ("block_mask_tiles_that_see_nothing", lambda: _qkv(1, 4, 2, 512, 512, 128), "bhsd",
     dict(mask_mod="empty_rows", block_mask="from_mask"), True),
    ("d64_window_queries_past_the_keys", lambda: _qkv(2, 4, 4, 1024, 512, 64), "bhsd", dict(window=(64, 0)), True),
    # halves of a key block that see no row of a query tile, skipped: masks known to lie inside a band
    # (the causal mask alone, in a block mask with causal=True, with cross lengths, a sliding window) and
    # a block mask listing tiles in which no row sees either half
    ("d128_causal_mask_mod_gqa", lambda: _qkv(1, 8, 2, 768, 768, 128), "bhsd", dict(mask_mod="causal"), True),
    ("d64_cross_causal_mask_mod", lambda: _qkv(2, 4, 2, 448, 1024, 64), "bhsd", dict(mask_mod="causal"), True),
    ("d128_causal_and_docs_block_mask", lambda: _qkv(1, 4, 2, 1024, 1024, 128), "bhsd",
     dict(causal=True, block_mask="docs"), True),
    ("d128_causal_full_block_mask", lambda: _qkv(1, 4, 4, 512, 512, 128), "bhsd",
     dict(causal=True, mask_mod="all", block_mask="from_mask"), True),
    ("d128_window_mask_mod_block_mask", lambda: _qkv(1, 4, 4, 1024, 1024, 128), "bhsd",
     dict(mask_mod="window", block_mask="from_mask"), True),
    ("d128_diagonal_band", lambda: _qkv(1, 4, 4, 512, 512, 128), "bhsd", dict(window=(0, 0)), True),
    ("odd_length_portable", lambda: _qkv(2, 4, 2, 777, 777, 128), "bhsd", dict(causal=True), False),
    ("keys_not_whole_tiles_portable", lambda: _qkv(1, 4, 4, 512, 576, 128), "bhsd", {}, False),
    ("d256_portable", lambda: _qkv(1, 4, 4, 512, 512, 256), "bhsd", dict(causal=True), False),
    # dropout: the reference's mask (a hash of seed, b, h, i, j) on P for dV and on dP
    ("d128_causal_dropout", lambda: _qkv(1, 4, 4, 512, 512, 128), "bhsd", dict(causal=True, dropout=0.1), True),
    ("d128_none_dropout_fused_qkv", lambda: _fused_qkv(1024, 2, 8, 128, 3), "sbhd", dict(dropout=0.1), True),
    ("d64_window_dropout_gqa", lambda: _qkv(1, 8, 2, 1024, 1024, 64), "bhsd", dict(window=(100, 37), dropout=0.3),
     True),
    ("d128_alibi_document_dropout", lambda: _qkv(1, 4, 4, 1024, 1024, 128), "bhsd",
     dict(score_mod="alibi", block_mask="docs", dropout=0.2), True),
]


HB = importlib.import_module("fp8ops.kernels._attention_hopper_bwd")
_SCORE_MODES = {None: HB.SCORE_MODE_NONE, "alibi": HB.SCORE_MODE_RELATIVE, "named": HB.SCORE_MODE_RELATIVE,
                "relative": HB.SCORE_MODE_NATURAL, "scaled": HB.SCORE_MODE_NATURAL, "frozen": HB.SCORE_MODE_NO_GRAD}


def _run(base, layout, opts, dq_mode, table):
    leaves = [t.clone().requires_grad_() for t in base]
    tab = table.clone().requires_grad_()
    q, k, v = leaves
    q4 = R.to_bhsd(q, layout)
    Sq, Skv = q4.shape[2], R.to_bhsd(k, layout).shape[2]
    left, right = R.normalize_window(opts.get("window"), opts.get("causal", False))
    kw = dict(score_mod=None, mask_mod=None, block_mask=None, left=left, right=right)
    if opts.get("score_mod") == "alibi":
        kw["score_mod"] = A.alibi(q4.shape[1])
    if opts.get("score_mod") == "relative":
        kw["score_mod"] = A.relative_position_bias(tab)
    if opts.get("score_mod") in ("scaled", "named"):
        kw["score_mod"] = A.score_mod(inputs.scaled_score if opts["score_mod"] == "scaled" else inputs.additive_named)
    if opts.get("score_mod") == "frozen":
        kw["score_mod"] = A.relative_position_bias(table.clone())
    if opts.get("mask_mod") == "window":
        kw["mask_mod"] = A.sliding_window_mask(200)
    if opts.get("mask_mod") == "causal":
        kw["mask_mod"] = A.causal_mask()
    if opts.get("mask_mod") == "all":
        kw["mask_mod"] = A.MaskMod(lambda b, h, q_idx, kv_idx: (q_idx >= 0) | (kv_idx >= 0))
    if opts.get("mask_mod") == "empty_rows":
        kw["mask_mod"] = A.MaskMod(lambda b, h, q_idx, kv_idx: (q_idx < 300) & (kv_idx < 384))
    if opts.get("block_mask") == "from_mask":
        kw["block_mask"] = A.create_block_mask(kw["mask_mod"], None, None, Sq, Skv, block_size=128, device=DEV)
    if opts.get("block_mask") == "docs":
        mm = _docs(Sq)
        kw.update(mask_mod=mm, block_mask=A.create_block_mask(mm, None, None, Sq, Skv, block_size=128))
    p = opts.get("dropout", 0.0)
    seed = torch.tensor(1234, dtype=torch.int64, device=DEV) if p else None
    out, lse = A._attention_triton(q, k, v, scale=q4.shape[-1] ** -0.5, layout=layout, cu_q=None, cu_kv=None,
                                   max_q=None, max_kv=None, dropout_p=p, seed=seed, dq_mode=dq_mode,
                                   bwd_config={"HOPPER": 2}, **kw)
    g = torch.Generator(device=DEV).manual_seed(11)
    dout = torch.randn(out.shape, generator=g, device=DEV)
    dlse = torch.randn(lse.shape, generator=g, device=DEV) * 0.1
    loss = (out.float() * dout).sum() + (lse.float().clamp(min=-1e4) * dlse).sum()
    wrt = leaves + ([tab] if opts.get("score_mod") == "relative" else [])
    return torch.autograd.grad(loss, wrt), kw


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_hopper_backward_against_the_reference_and_the_portable_kernels(case, monkeypatch):
    name, make, layout, opts, applies = case
    base = [t.detach() for t in make()]
    table = torch.randn(4, 2 * 40 + 1, device=DEV) * 0.5
    ran = []
    real = K.hopper_bwd

    modes, bands = [], []

    def spy(*args, **kwargs):
        modes.append(kwargs["score_mode"])
        bands.append(kwargs["mask_band"])
        ran.append(real(*args, **kwargs))
        return ran[-1]

    monkeypatch.setattr(K, "hopper_bwd", spy)
    mine, kw = _run(base, layout, opts, "auto", table)
    assert any(ran) == applies, f"{name}: the Hopper backward ran {ran}, expected {applies}"
    if applies:  # how the kernel called the mod
        expected = _SCORE_MODES[opts.get("score_mod")]
        assert modes == [expected], f"{name}: score modes {modes}, expected {expected}"
        # the band the mask is known to lie in (its halves and tiles outside skipped)
        band = (None, 0) if opts.get("block_mask") == "docs" else {"causal": (None, 0), "window": (199, 0)}.get(
            opts.get("mask_mod"))
        assert bands == [band], f"{name}: mask bands {bands}, expected {band}"
    ran.clear()
    portable, _ = _run(base, layout, opts, "separate", table)
    assert not ran
    leaves = [t.float().requires_grad_() for t in base]
    tab = table.clone().requires_grad_()
    score_mod = A.relative_position_bias(tab) if opts.get("score_mod") == "relative" else kw["score_mod"]
    ref_kw = dict(score_mod=score_mod, mask_mod=kw["mask_mod"], block_mask=kw["block_mask"],
                  window=opts.get("window"), causal=opts.get("causal", False), layout=layout,
                  dropout_p=opts.get("dropout", 0.0), dropout_seed=1234 if opts.get("dropout") else None)
    (ro, rl), _ = R.attention(*leaves, return_lse=True, **ref_kw)
    g = torch.Generator(device=DEV).manual_seed(11)
    dout = torch.randn(ro.shape, generator=g, device=DEV)
    dlse = torch.randn(rl.shape, generator=g, device=DEV) * 0.1
    loss = (ro * dout).sum() + (rl.clamp(min=-1e4) * dlse).sum()
    ref = torch.autograd.grad(loss, leaves + ([tab] if opts.get("score_mod") == "relative" else []))
    for what, a, p, e in zip(("dq", "dk", "dv", "dtable"), mine, portable, ref):
        assert not torch.isnan(a).any(), f"{name} {what}: NaN"
        slack = 1e-3 * float(e.detach().abs().max()) + 1e-5
        assert_close_rule(a, e, p, k=2.0, atol=slack, name=f"{name} {what}")


def test_routing_of_default_and_deterministic_calls(monkeypatch):
    ran = []
    real = K.hopper_bwd
    monkeypatch.setattr(K, "hopper_bwd", lambda *a, **kw: ran.append(real(*a, **kw)) or ran[-1])
    for d, det, score_mod, expected in ((128, False, None, [True]), (128, True, None, []),
                                        (128, False, "alibi", [True]), (64, False, "alibi", [True]),
                                        (64, True, "alibi", [])):
        q, k, v = (t.requires_grad_() for t in _qkv(1, 4, 4, 512, 512, d))
        sm = A.alibi(4) if score_mod else None
        out = A.attention(q, k, v, causal=True, deterministic=det, score_mod=sm, backend="triton")[0]
        out.float().sum().backward()
        assert ran == expected, (d, det, score_mod, ran)
        ran.clear()
    # forced (HOPPER=2) but deterministic: the portable kernels
    q, k, v = (t.requires_grad_() for t in _qkv(1, 4, 4, 512, 512, 64))
    left, right = R.normalize_window(None, True)
    args = dict(score_mod=None, mask_mod=None, block_mask=None, scale=64**-0.5, left=left, right=right,
                layout="bhsd", cu_q=None, cu_kv=None, max_q=None, max_kv=None, dropout_p=0.0, seed=None,
                bwd_config={"HOPPER": 2})
    out, _ = A._attention_triton(q, k, v, dq_mode="separate", **args)
    out.float().sum().backward()
    assert not ran
    out, _ = A._attention_triton(q, k, v, dq_mode="auto", **args)
    out.float().sum().backward()
    assert ran == [True]


def test_auto_backend_runs_dropout_on_the_hopper_kernels_eager_and_compiled(monkeypatch):
    """With dropout and no explicit seed, ``backend="auto"`` runs the Hopper forward and backward
    where both apply, causal calls from 2048 queries (a seed drawn from torch's generator: the
    same generator state gives the same mask), in eager calls and in compiled graphs alike, and
    SDPA elsewhere (causal at 1024 queries, and d = 64 rows that see few keys, whose forward stays
    on the portable kernel)."""
    fwd, bwd = [], []
    real_f, real_b = K.hopper_fwd, K.hopper_bwd
    monkeypatch.setattr(K, "hopper_fwd", lambda *a, **kw: fwd.append(real_f(*a, **kw)) or fwd[-1])
    monkeypatch.setattr(K, "hopper_bwd", lambda *a, **kw: bwd.append(real_b(*a, **kw)) or bwd[-1])

    def f(q, k, v):
        return A.attention(q, k, v, layout="sbhd", dropout_p=0.1)[0]

    q, k, v = (t.detach().requires_grad_() for t in _fused_qkv(1024, 2, 8, 128, 3))
    outs = []
    for _ in range(2):
        torch.manual_seed(0)
        outs.append(f(q, k, v))
        outs[-1].float().sum().backward()
    assert fwd == [True, True] and bwd == [True, True], (fwd, bwd)
    assert torch.equal(outs[0], outs[1])
    with torch.no_grad():  # dropout applied: far from the output without it
        plain = A.attention(q, k, v, layout="sbhd")[0]
    assert (outs[0].float() - plain.float()).abs().mean() > 0.05 * plain.float().abs().mean()
    fwd.clear(), bwd.clear()
    out = torch.compile(f, fullgraph=True)(q, k, v)
    out.float().sum().backward()
    assert fwd == [True] and bwd == [True], (fwd, bwd)
    assert torch.isfinite(out).all()
    fwd.clear(), bwd.clear()
    A.attention(q, k, v, layout="sbhd", dropout_p=0.1, causal=True)[0].float().sum().backward()
    assert fwd == [] and bwd == [], (fwd, bwd)  # causal at 1024 queries: cuDNN measured faster
    S = importlib.import_module("fp8ops.attention.op").HOPPER_DROPOUT_CAUSAL_MIN_SEQ
    q2, k2, v2 = (t.detach().requires_grad_() for t in _fused_qkv(S, 1, 4, 128, 4))
    A.attention(q2, k2, v2, layout="sbhd", dropout_p=0.1, causal=True)[0].float().sum().backward()
    assert fwd == [True] and bwd == [True], (fwd, bwd)  # from 2048: the Hopper kernels
    fwd.clear(), bwd.clear()
    q, k, v = (t.detach().requires_grad_() for t in _fused_qkv(512, 2, 8, 64, 3))
    f(q, k, v).float().sum().backward()
    assert fwd == [] and bwd == [], (fwd, bwd)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", ["sbhd", "packed"])
def test_dq_accumulator_into_a_strided_view_rounds_as_torch_copy(dtype, layout):
    """The float32 dQ buffer written into a view of one QKV gradient (``store_accumulated``'s row
    kernel) has the bits of torch's strided copy (round to nearest even), leaves the k and v parts
    alone, and covers the rows past a program's 32."""
    from fp8ops.kernels._accumulate import store_accumulated

    g = torch.Generator(device="cuda").manual_seed(3)
    if layout == "sbhd":
        S, B, H, D = 2048 + 40, 3, 4, 128
        packed = torch.full((S, B, 3 * H * D), 9.0, device="cuda", dtype=dtype)
        dq = packed[..., H * D: 2 * H * D].view(S, B, H, D).permute(1, 2, 0, 3)
    else:
        T, H, D = 1000 + 7, 4, 64
        packed = torch.full((T, 3 * H * D), 9.0, device="cuda", dtype=dtype)
        dq = packed[:, : H * D].view(T, H, D)
    acc = torch.randn(dq.shape, device="cuda", generator=g) * 3.0  # float32, needs rounding
    want = torch.empty_like(dq)
    want.copy_(acc)
    store_accumulated(dq, acc)
    assert torch.equal(dq, want)
    rest = packed[..., : H * D] if layout == "sbhd" else packed[:, H * D:]
    assert (rest == 9.0).all()


def _count_casts_after_the_kernel(monkeypatch) -> list[int]:
    """The elements of each cast of the float32 dQ buffer after the kernel, appended as they run."""
    after: list[int] = []
    real_store = HB.store_accumulated

    def counting_store(dst, acc):
        after.append(dst.numel())
        real_store(dst, acc)

    monkeypatch.setattr(HB, "store_accumulated", counting_store)
    return after


_CAST_CASES = [c for c in CASES if c[4] and c[0] in (
    "d128_causal_gqa", "d64_causal", "d128_none_bshd", "d128_fp16_causal_mqa", "d128_cross_causal",
    "d128_long_q_causal", "sbhd_fused_qkv", "d64_window_dropout_gqa", "d128_alibi_document_dropout")]


@pytest.mark.parametrize("ahead", [1, 2])
@pytest.mark.parametrize("case", _CAST_CASES, ids=[c[0] for c in _CAST_CASES])
def test_dq_cast_inside_the_kernel_matches_the_cast_after_it(case, ahead, monkeypatch):
    """dQ cast by the kernel's caster warp (each kv head's float32 rows once every program of that
    head has counted itself off, ``ahead`` heads later) equals the cast after the kernel: dk and dv
    bitwise, dq within the float32 sums' order (the reductions' order differs between runs), and the
    pass after the kernel covers the last ``ahead`` kv heads only (the buffer's memory holds NaN from
    an earlier tensor before its zero fill)."""
    name, make, layout, opts, _ = case
    base = [t.detach() for t in make()]
    table = torch.randn(4, 2 * 40 + 1, device=DEV) * 0.5
    after = _count_casts_after_the_kernel(monkeypatch)
    monkeypatch.setattr(HB, "CAST_IN_KERNEL", False)
    plain, _ = _run(base, layout, opts, "auto", table)
    full = sum(after)
    after.clear()
    monkeypatch.setattr(HB, "CAST_IN_KERNEL", True)
    monkeypatch.setattr(HB, "CAST_AHEAD", ahead)
    torch.full((4 * base[0].numel(),), float("nan"), device=DEV)  # freed at once: NaN in the allocator's cache
    cast, _ = _run(base, layout, opts, "auto", table)
    q4, k4 = R.to_bhsd(base[0], layout), R.to_bhsd(base[1], layout)
    n_kv = k4.shape[0] * k4.shape[1]
    assert full == q4.numel(), f"{name}: the plain run cast {full} of {q4.numel()} elements after the kernel"
    assert sum(after) == q4.numel() * ahead // n_kv, (
        f"{name}: {sum(after)} elements cast after the kernel, expected the last {ahead} of {n_kv} kv heads")
    assert torch.equal(cast[1], plain[1]) and torch.equal(cast[2], plain[2]), f"{name}: dk / dv differ"
    dq, dq0 = cast[0].float(), plain[0].float()
    assert not torch.isnan(dq).any(), f"{name}: NaN in dq"
    torch.testing.assert_close(dq, dq0, rtol=2 ** -6, atol=1e-3 * float(dq0.abs().max()) + 1e-6,
                               msg=lambda m: f"{name}, ahead {ahead}: dq {m}")


_DEFAULT_CAST_CASES = [c for c in CASES if c[0] in (
    "d128_document_block_mask", "d64_document_block_mask_gqa", "d128_causal_gqa", "d128_window", "d128_none_bshd")]


@pytest.mark.parametrize("case", _DEFAULT_CAST_CASES, ids=[c[0] for c in _DEFAULT_CAST_CASES])
def test_default_casts_dq_inside_the_kernel_with_a_block_mask_only(case, monkeypatch):
    """By default (``CAST_IN_KERNEL = None``) the caster runs with a block mask (where the document
    mask measured faster with it), and the cast after the kernel covers only the last ``ahead`` kv
    heads; without a block mask (causal, a window, no mask) the whole dq is cast after the kernel."""
    name, make, layout, opts, _ = case
    base = [t.detach() for t in make()]
    table = torch.randn(4, 2 * 40 + 1, device=DEV) * 0.5
    after = _count_casts_after_the_kernel(monkeypatch)
    monkeypatch.setattr(HB, "CAST_IN_KERNEL", None)
    monkeypatch.setattr(HB, "CAST_AHEAD", 1)
    _run(base, layout, opts, "auto", table)
    q4, k4 = R.to_bhsd(base[0], layout), R.to_bhsd(base[1], layout)
    n_kv = k4.shape[0] * k4.shape[1]
    want = q4.numel() // n_kv if "block_mask" in opts else q4.numel()
    assert sum(after) == want, f"{name}: {sum(after)} elements cast after the kernel, expected {want}"
