"""GPU tests of the warp-specialised Hopper attention forward (``kernels/_attention_hopper.py``).

On an sm_90 GPU the Triton backend's forward runs this kernel wherever it applies; the portable
kernel (``fwd_config={"HOPPER": 0}``) runs everywhere else. Each case checks that the Hopper kernel
really ran (or really did not), and that its output, LSE and every gradient (the backward starts
from the forward's output and LSE) are as close to the FP32 reference as the portable kernel's,
within the error rule of DESIGN.md §5: error(Hopper) <= 2 x error(portable) + slack. Covers head dims
64/128/256, bf16/fp16, causal, windows, no mask, GQA/MQA, cross-attention, the three layouts
(a fused QKV projection's strided slices included), a score_mod, a mask_mod on every tile, block
masks, rows that see no key, dropout with the reference's mask, and the problems that stay on the portable kernel (odd lengths, a head
dim of 96, short rows or mods at d = 64, a score_mod with per-score transcendental math).
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
H = importlib.import_module("fp8ops.kernels._attention_hopper")
DEV = "cuda"
BF16, FP16 = torch.bfloat16, torch.float16


def _qkv(*args, **kwargs):
    return inputs.qkv(*args, device=DEV, **kwargs)


def _fused_qkv(*args):
    return inputs.fused_qkv(*args, device=DEV)


def _docs(S):
    return inputs.docs_mask(S, device=DEV)


CASES = [
    # name, make q/k/v, layout, options, whether the Hopper kernel applies
    ("d64_causal_gqa", lambda: _qkv(1, 4, 2, 4096, 4096, 64), "bhsd", dict(causal=True), True),
    ("d64_short_rows_portable", lambda: _qkv(2, 8, 2, 1024, 1024, 64), "bhsd", dict(causal=True), False),
    ("d128_none_bshd", lambda: _qkv(2, 4, 4, 768, 768, 128, layout="bshd"), "bshd", {}, True),
    ("d256_window", lambda: _qkv(1, 4, 4, 768, 768, 256), "bhsd", dict(window=(100, 37)), True),
    ("d128_fp16_causal_mqa", lambda: _qkv(2, 8, 1, 512, 512, 128, FP16), "bhsd", dict(causal=True), True),
    ("d128_cross_causal", lambda: _qkv(2, 4, 2, 512, 1536, 128), "bhsd", dict(causal=True), True),
    ("d128_long_q_causal", lambda: _qkv(2, 4, 2, 1536, 512, 128), "bhsd", dict(causal=True), True),
    ("sbhd_fused_qkv", lambda: _fused_qkv(640, 2, 8, 128, 3), "sbhd", dict(causal=True), True),
    ("d128_alibi_causal", lambda: _qkv(2, 8, 8, 640, 640, 128, layout="bshd"), "bshd",
     dict(causal=True, score_mod="alibi"), True),
    ("d128_alibi_window_mask", lambda: _qkv(1, 8, 2, 768, 768, 128), "bhsd",
     dict(score_mod="alibi", mask_mod="window"), True),
    ("d128_scaled_score_causal", lambda: _qkv(1, 4, 4, 640, 640, 128), "bhsd",
     dict(causal=True, score_mod="scaled"), True),
    # relative biases slope * (kv - q) + c: added per key column, the row part folded into the LSE
    ("d128_additive_named_causal", lambda: _qkv(2, 4, 2, 640, 640, 128), "bhsd",
     dict(causal=True, score_mod="additive_named"), True),
    ("d128_additive_named_document", lambda: _qkv(1, 4, 4, 1024, 1024, 128), "bhsd",
     dict(score_mod="additive_named", block_mask="docs"), True),
    ("d64_mods_portable", lambda: _qkv(1, 8, 2, 768, 768, 64), "bhsd", dict(score_mod="alibi", mask_mod="window"),
     False),
    ("d128_softcap_portable", lambda: _qkv(1, 4, 4, 512, 512, 128), "bhsd", dict(causal=True, score_mod="softcap"),
     False),
    ("d128_document_block_mask", lambda: _qkv(1, 4, 4, 1024, 1024, 128), "bhsd", dict(block_mask="docs"), True),
    ("d256_document_block_mask", lambda: _qkv(1, 4, 2, 1024, 1024, 256), "bhsd", dict(block_mask="docs"), True),
    ("rows_that_see_nothing", lambda: _qkv(1, 4, 4, 512, 512, 128), "bhsd", dict(mask_mod="empty_rows"), True),
    ("odd_length_portable", lambda: _qkv(2, 4, 2, 777, 777, 128), "bhsd", dict(causal=True), False),
    ("d96_portable", lambda: _qkv(1, 4, 4, 512, 512, 96), "bhsd", dict(causal=True), False),
    # dropout: the same mask as the reference's (a hash of seed, b, h, i, j) in every tile
    ("d128_none_dropout_fused_qkv", lambda: _fused_qkv(1024, 2, 8, 128, 3), "sbhd", dict(dropout=0.1), True),
    ("d128_causal_dropout_gqa", lambda: _qkv(2, 8, 2, 768, 768, 128), "bhsd", dict(causal=True, dropout=0.3), True),
    ("d256_window_dropout", lambda: _qkv(1, 4, 4, 768, 768, 256), "bhsd", dict(window=(100, 37), dropout=0.1),
     True),
    ("d64_causal_dropout", lambda: _qkv(1, 4, 2, 4096, 4096, 64), "bhsd", dict(causal=True, dropout=0.1), True),
    ("d128_alibi_document_dropout", lambda: _qkv(1, 4, 4, 1024, 1024, 128), "bhsd",
     dict(score_mod="alibi", block_mask="docs", dropout=0.2), True),
]


def _run(base, layout, opts, fwd_config):
    leaves = [t.clone().requires_grad_() for t in base]
    q, k, v = leaves
    q4 = R.to_bhsd(q, layout)
    Sq, Skv = q4.shape[2], R.to_bhsd(k, layout).shape[2]
    left, right = R.normalize_window(opts.get("window"), opts.get("causal", False))
    kw = dict(score_mod=None, mask_mod=None, block_mask=None, left=left, right=right)
    if opts.get("score_mod") == "alibi":
        kw["score_mod"] = A.alibi(q4.shape[1])
    if opts.get("score_mod") == "softcap":
        kw["score_mod"] = A.softcap(5.0)
    if opts.get("score_mod") == "scaled":
        kw["score_mod"] = A.score_mod(inputs.scaled_score)
    if opts.get("score_mod") == "additive_named":
        kw["score_mod"] = A.score_mod(inputs.additive_named)
    if opts.get("mask_mod") == "window":
        kw["mask_mod"] = A.sliding_window_mask(200)
    if opts.get("mask_mod") == "empty_rows":
        kw["mask_mod"] = A.MaskMod(lambda b, h, q_idx, kv_idx: (q_idx < 300) & (kv_idx < 384))
    if opts.get("block_mask") == "docs":
        mm = _docs(Sq)
        kw.update(mask_mod=mm, block_mask=A.create_block_mask(mm, None, None, Sq, Skv, block_size=128))
    p = opts.get("dropout", 0.0)
    out, lse = A._attention_triton(q, k, v, scale=q4.shape[-1] ** -0.5, layout=layout, cu_q=None, cu_kv=None,
                                   max_q=None, max_kv=None, dropout_p=p,
                                   seed=torch.tensor(1234, dtype=torch.int64, device=DEV) if p else None,
                                   fwd_config=fwd_config, **kw)
    g = torch.Generator(device=DEV).manual_seed(11)
    dout = torch.randn(out.shape, generator=g, device=DEV)
    dlse = torch.randn(lse.shape, generator=g, device=DEV) * 0.1
    loss = (out.float() * dout).sum() + (lse.float().clamp(min=-1e4) * dlse).sum()
    return (out, lse, *torch.autograd.grad(loss, leaves)), kw


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_hopper_forward_against_the_reference_and_the_portable_kernel(case, monkeypatch):
    name, make, layout, opts, applies = case
    base = [t.detach() for t in make()]
    ran = []
    real = K.hopper_fwd

    def spy(*args, **kwargs):
        ran.append(real(*args, **kwargs))
        return ran[-1]

    monkeypatch.setattr(K, "hopper_fwd", spy)
    mine, kw = _run(base, layout, opts, None)
    assert any(ran) == applies, f"{name}: the Hopper kernel ran {ran}, expected {applies}"
    ran.clear()
    portable, _ = _run(base, layout, opts, {"HOPPER": 0})
    assert not any(ran)
    # FP32 reference with the same mods, from the same inputs
    leaves = [t.float().requires_grad_() for t in base]
    ref_kw = dict(score_mod=kw["score_mod"], mask_mod=kw["mask_mod"], block_mask=kw["block_mask"],
                  window=opts.get("window"), causal=opts.get("causal", False), layout=layout,
                  dropout_p=opts.get("dropout", 0.0), dropout_seed=1234 if opts.get("dropout") else None)
    (ro, rl), _ = R.attention(*leaves, return_lse=True, **ref_kw)
    g = torch.Generator(device=DEV).manual_seed(11)
    dout = torch.randn(ro.shape, generator=g, device=DEV)
    dlse = torch.randn(rl.shape, generator=g, device=DEV) * 0.1
    loss = (ro * dout).sum() + (rl.clamp(min=-1e4) * dlse).sum()
    ref = (ro, rl, *torch.autograd.grad(loss, leaves))
    for what, a, p, e in zip(("out", "lse", "dq", "dk", "dv"), mine, portable, ref):
        assert not torch.isnan(a).any(), f"{name} {what}: NaN"
        slack = 1e-3 * float(e.detach().abs().max()) + 1e-5
        assert_close_rule(a, e, p, k=2.0, atol=slack, name=f"{name} {what}")
    if opts.get("mask_mod") == "empty_rows":
        out, lse = mine[0], mine[1]
        assert (out[:, :, 300:] == 0).all() and (lse[:, :, 300:] == R.MASKED_ROW_LSE).all()


def test_hopper_supported_refuses_what_it_cannot_run():
    q, k, v = _qkv(1, 4, 4, 512, 512, 128)
    common = dict(varlen=False, descale=False, sparse_q=None, sparse_kv=None)
    assert H.hopper_supported(q, k, v, **common)
    assert not H.hopper_supported(q, k, v, **{**common, "varlen": True})
    assert not H.hopper_supported(q, k, v, **{**common, "descale": True})
    assert not H.hopper_supported(q.float(), k.float(), v.float(), **common)
    assert not H.hopper_supported(q, k, v, **{**common, "sparse_q": 64, "sparse_kv": 64})
    assert not H.hopper_supported(q[:, :, :500], k, v, **common)  # 500 rows: not whole 128-row tiles
    assert not H.hopper_supported(q.cpu(), k.cpu(), v.cpu(), **common)
