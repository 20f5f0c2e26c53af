"""fp8ops.attention vs SDPA (cuDNN, flash) and compiled FlexAttention: forward and forward+backward.

Problem: bf16 at a constant token count (``--tokens``, default 65536 = 8 x 8192; batch = tokens / S),
sequence lengths S in {1024, 4096, 8192, 16384}, head dims d in {64, 128, 256} (``--head-dims``)
with ``4096 / d`` query heads (32 at d = 128; ``--heads`` fixes the count) and as many key/value
heads, or fewer with ``--kv-heads`` (GQA, e.g. 32 : 8: passed to fp8ops as k/v with fewer heads, to
Flex and SDPA with ``enable_gqa=True``), for the variants

- ``none``: plain attention (not causal);
- ``causal``;
- ``alibi``: causal with the ALiBi score_mod (fused in-kernel in fp8ops and Flex);
- ``softcap``: causal with tanh soft-capping of the scores, ``50 tanh(s / 50)`` (fp8ops:
  ``fp8ops.softcap(50.0)``; Flex: a score_mod of the same math);
- ``sliding_window``: causal sliding window of 1024 keys (fp8ops: ``window=1024``; Flex: a block
  mask from the sliding-window mask_mod);
- ``document``: causal attention inside 8 documents of random lengths packed in each sequence
  (fp8ops and Flex: a block mask from ``causal & document``).

Peers, in the same run for every case: ``F.scaled_dot_product_attention`` restricted to the cuDNN
and to the flash backend (``none`` and ``causal`` only: SDPA cannot express the other variants
without a dense bias), and ``torch.compile(flex_attention)`` with the same mods (causal variants get
a block mask). Block masks are built once per case, outside the timing. fp8ops is also timed with
``deterministic=True`` (the portable kernels with the separate dQ kernel),
and as ``fp8ops (portable fwd)``: the forward through the portable Triton kernel instead of the
warp-specialised Hopper kernel that runs by default on sm_90 (launch config ``HOPPER=0``; the same
backward; ``--no-portable`` skips it), its output checked against the default's.

TFLOP/s follow one convention for every implementation: ``4 B H S^2 d`` with H the query heads,
halved for every causal variant whatever the mask skips beyond causality, x3.5 for
forward+backward. Sliding-window and document rows therefore report "effective" (causal-equivalent)
TFLOP/s; the ``visible`` field of a row gives the fraction of (query, key) pairs actually visible.
"x Flex" / "x cuDNN" are the peer's time over fp8ops's (above 1: fp8ops is faster). Times are
medians of CUDA-graph replays after warm-up (see :mod:`fp8ops.bench.common`). A correctness check
compares fp8ops's output with each peer's at the first sequence length of each head dim.

After the table, the targets are flagged per case (fp8ops's default dQ scheme): forward and
forward+backward >= 1.3x Flex for causal, ALiBi, sliding window and document at d = 128, >= 1.0x
Flex for every variant at the other head dims; causal >= 0.9x SDPA cuDNN in both.

``--varlen`` also times a variable-length causal attention block (packed sequences in fp8ops,
nested tensors through SDPA, padding through ``nn.MultiheadAttention``; see
:mod:`fp8ops.bench.attention_varlen`); ``--varlen-only`` runs only that comparison. ``--tune``
additionally sweeps fp8ops launch configurations at S = 4096 (first head dim) and reports the fastest.
"""

from __future__ import annotations

import argparse
import importlib
import math
import time
from pathlib import Path
from typing import Any

import torch

from . import attention_varlen, common

__all__ = ["add_arguments", "run"]

SEQLENS = [1024, 4096, 8192, 16384]
QUICK_SEQLENS = [1024]
HEAD_DIMS = [64, 128, 256]
QUICK_HEAD_DIMS = [128]
HIDDEN = 4096  # query heads x head dim when --heads is not given
VARIANTS = ["none", "causal", "alibi", "softcap", "sliding_window", "document"]
CAUSAL_VARIANTS = {"causal", "alibi", "softcap", "sliding_window", "document"}
SDPA_VARIANTS = ("none", "causal")
WINDOW = 1024
SOFTCAP = 50.0
DOCUMENTS = 8
IMPLS = ["fp8ops", "fp8ops (deterministic)", "fp8ops (portable fwd)", "SDPA cuDNN", "SDPA flash", "Flex (compiled)"]
# "fp8ops (portable fwd)": the forward of kernels/attention.py (launch config HOPPER = 0) where the
# default runs the Hopper kernel of kernels/_attention_hopper.py; the same backward, the public
# op's dQ scheme.
PORTABLE_FWD_CONFIG = {"HOPPER": 0}
# Targets, on the peer's time over fp8ops's, forward and forward+backward (see the module docstring).
FLEX_TARGET_VARIANTS = ("causal", "alibi", "sliding_window", "document")
FLEX_TARGET, FLEX_TARGET_OTHER_D, CUDNN_TARGET, TARGET_HEAD_DIM = 1.3, 1.0, 0.9, 128
DEVICE = "cuda"  # where inputs, masks and block masks live (the timing helpers need CUDA)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of this suite."""
    parser.add_argument("--tokens", type=int, default=65536, help="batch x sequence length (default 65536 = 8 x 8192)")
    parser.add_argument("--head-dims", "--head-dim", dest="head_dims", type=int, nargs="+", default=None,
                        metavar="D", help="head dims (default 64 128 256; with --quick 128)")
    parser.add_argument("--heads", type=int, default=None,
                        help=f"query heads (default {HIDDEN} / head dim: 32 at d=128, 64 at d=64, 16 at d=256)")
    parser.add_argument("--kv-heads", type=int, default=None,
                        help="key/value heads, a divisor of the query heads (default: as many; fewer is GQA, "
                             "e.g. --heads 32 --kv-heads 8)")
    parser.add_argument("--seqlens", type=int, nargs="*", default=None, help="sequence lengths")
    parser.add_argument("--variants", nargs="*", default=None, choices=VARIANTS, help="variants to run")
    parser.add_argument("--samples", type=int, default=None, help="timed samples per case")
    parser.add_argument("--no-flex", action="store_true", help="skip FlexAttention")
    parser.add_argument("--no-deterministic", action="store_true",
                        help="skip the fp8ops deterministic=True (separate dQ kernel) rows")
    parser.add_argument("--no-portable", action="store_true",
                        help="skip the fp8ops run with the portable forward kernel (launch config HOPPER = 0)")
    parser.add_argument("--tune", action="store_true", help="also sweep fp8ops launch configs at S=4096")
    parser.add_argument("--varlen", action="store_true",
                        help="also time the variable-length attention block (fp8ops packed sequences vs SDPA on "
                             "nested tensors + compile vs padded nn.MultiheadAttention + compile)")
    parser.add_argument("--varlen-only", action="store_true", help="only the variable-length comparison")
    attention_varlen.add_arguments(parser)


def _flops(B: int, H: int, S: int, D: int, causal: bool, backward: bool) -> float:
    f = 4.0 * B * H * S * S * D
    if causal:
        f /= 2.0
    return f * 3.5 if backward else f


def _heads(args: argparse.Namespace, D: int) -> tuple[int, int]:
    """(query heads, key/value heads) at head dim D; ValueError with the fix if they do not divide."""
    H = getattr(args, "heads", None) or max(1, HIDDEN // D)
    Hkv = getattr(args, "kv_heads", None) or H
    if H % Hkv != 0:
        raise ValueError(f"fp8ops.bench attention: --kv-heads {Hkv} does not divide the {H} query heads at head "
                         f"dim {D}; pass a divisor of {H} (or --heads with a multiple of {Hkv})")
    return H, Hkv


def _documents(S: int, seed: int, n: int = DOCUMENTS) -> torch.Tensor:
    """(S,) int64 document ids: ``n`` documents of random lengths (each at least S / (8 n)) packed
    in one sequence."""
    g = torch.Generator().manual_seed(seed)
    n = max(1, min(n, S))
    least = max(1, S // (8 * n))
    share = torch.empty(n, dtype=torch.float64).exponential_(1.0, generator=g)  # Dirichlet(1, ..., 1)
    lengths = least + torch.floor(share / share.sum() * (S - n * least)).long()
    lengths[-1] += S - int(lengths.sum())
    return torch.repeat_interleave(torch.arange(n), lengths)


def _visible_fraction(variant: str, S: int, docs: torch.Tensor | None) -> float:
    if variant == "none":
        return 1.0
    if variant in ("causal", "alibi", "softcap"):
        return (S + 1) / (2 * S)
    if variant == "sliding_window":
        w = min(WINDOW, S)
        return (w * (w + 1) / 2 + (S - w) * w) / (S * S)
    assert docs is not None
    counts = torch.bincount(docs).double()
    return float((counts * (counts + 1) / 2).sum() / (S * S))


def _fp8ops_kwargs(variant: str, S: int, H: int, docs: torch.Tensor | None) -> dict[str, Any]:
    """The keyword arguments of ``fp8ops.attention`` for a variant (block masks built here, once)."""
    A = importlib.import_module("fp8ops.attention")
    if variant == "none":
        return {}
    if variant == "causal":
        return dict(causal=True)
    if variant == "alibi":
        return dict(causal=True, score_mod=A.alibi(H))
    if variant == "softcap":
        return dict(causal=True, score_mod=A.softcap(SOFTCAP))
    if variant == "sliding_window":
        return dict(window=WINDOW)
    assert variant == "document" and docs is not None
    mm = A.and_masks(A.causal_mask(), A.document_mask(docs.to(DEVICE)))
    return dict(block_mask=A.create_block_mask(mm, None, None, S, S, device=DEVICE))


def _fp8ops_fn(variant: str, S: int, H: int, docs: torch.Tensor | None, dq_mode: str | None = None,
               fwd_config: dict[str, int] | None = None, bwd_config: dict[str, int] | None = None) -> Any:
    A = importlib.import_module("fp8ops.attention")
    R = importlib.import_module("fp8ops.reference.attention")
    kw = _fp8ops_kwargs(variant, S, H, docs)
    if fwd_config is None and bwd_config is None and dq_mode in (None, "separate"):
        # the public op: its default dQ scheme, or deterministic=True for the separate dQ kernel
        return lambda q, k, v: A.attention(q, k, v, deterministic=dq_mode == "separate", backend="triton", **kw)[0]
    dq_mode = dq_mode or "separate"
    left, right = R.normalize_window(kw.get("window"), kw.get("causal", False))
    bm = kw.get("block_mask")
    sm = kw.get("score_mod")

    def fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return A._attention_triton(
            q, k, v, score_mod=sm, mask_mod=bm.mask_mod if bm is not None else None, block_mask=bm,
            scale=q.shape[-1] ** -0.5, left=left, right=right, layout="bhsd", cu_q=None, cu_kv=None, max_q=None,
            max_kv=None, dropout_p=0.0, seed=None, dq_mode=dq_mode, fwd_config=fwd_config,
            bwd_config=bwd_config)[0]

    return fused


def _sdpa_fn(variant: str, backend: str, gqa: bool) -> Any:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    be = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[backend]
    causal = variant == "causal"

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        with sdpa_kernel([be]):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)

    return fn


def _flex_mods(variant: str, H: int, docs: torch.Tensor | None) -> tuple[Any, Any]:
    """(score_mod, mask_mod) of FlexAttention for a variant: the same math as fp8ops's mods."""

    def causal(b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
        return q_idx >= kv_idx

    if variant == "none":
        return None, None
    if variant == "causal":
        return None, causal
    if variant == "alibi":
        n = 2 ** int(math.floor(math.log2(H)))
        slopes = torch.tensor([2 ** (-8.0 * (i + 1) / n) if i < n else 2 ** (-4.0 * (2 * (i - n) + 1) / n)
                               for i in range(H)], device=DEVICE)

        def alibi(score, b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
            return score + slopes[h] * (kv_idx - q_idx)

        return alibi, causal
    if variant == "softcap":
        cap = SOFTCAP

        def softcap(score, b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
            return cap * torch.tanh(score / cap)

        return softcap, causal
    if variant == "sliding_window":
        def sliding_window(b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
            return (q_idx >= kv_idx) & (q_idx - kv_idx < WINDOW)

        return None, sliding_window
    assert variant == "document" and docs is not None
    ids = docs.to(DEVICE)

    def document(b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
        return (q_idx >= kv_idx) & (ids[q_idx] == ids[kv_idx])

    return None, document


def _flex_fn(variant: str, S: int, H: int, docs: torch.Tensor | None, gqa: bool) -> Any:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    # A fresh compile cache per case: flex_attention's code object would otherwise reach Dynamo's
    # recompile limit across the sweep and fall back to the (slow) eager path.
    torch._dynamo.reset()
    compiled = torch.compile(flex_attention, dynamic=False)
    score_mod, mask_mod = _flex_mods(variant, H, docs)
    block_mask = create_block_mask(mask_mod, None, None, S, S, device=DEVICE) if mask_mod is not None else None

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return compiled(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=gqa)

    return fn


def _fwd_bwd(fn: Any) -> Any:
    def step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor) -> Any:
        return torch.autograd.grad(fn(q, k, v), (q, k, v), do)

    return step


def _inputs(B: int, H: int, Hkv: int, S: int, D: int, n: int) -> list[tuple[torch.Tensor, ...]]:
    sets = []
    for i in range(n):
        g = torch.Generator(device=DEVICE).manual_seed(i)
        q, do = (torch.randn(B, H, S, D, device=DEVICE, generator=g, dtype=torch.bfloat16) for _ in range(2))
        k, v = (torch.randn(B, Hkv, S, D, device=DEVICE, generator=g, dtype=torch.bfloat16) for _ in range(2))
        sets.append((q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), do))
    return sets


def _time(fn: Any, sets: list[tuple[torch.Tensor, ...]], samples: int, notes: list[str], label: str) -> common.Timing:
    return common.time_cuda(fn, sets, samples=samples, on_fallback=lambda m: notes.append(f"{label}: {m}"))


def _mismatch(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(max |out - ref|, max of |out - ref| - 0.02 |ref|): outputs agree when the second is <= 0.02."""
    err = (out - ref).abs()
    return float(err.max()), float((err - 0.02 * ref.abs()).max())


def _tune(tokens: int, H: int, Hkv: int, D: int, samples: int, progress: common.Progress,
          notes: list[str]) -> list[dict[str, Any]]:
    """Sweep a few fp8ops launch configs at S = 4096 (causal and not); rows of the results."""
    S = 4096
    b = max(1, tokens // S)
    sets = _inputs(b, H, Hkv, S, D, 2)
    fwd_cfgs = [dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=s)
                for bm, bn, w, s in [(128, 64, 8, 3), (128, 64, 8, 2), (128, 128, 8, 2), (64, 64, 4, 3),
                                     (128, 32, 4, 3), (64, 128, 4, 2)]]
    bwd_cfgs = [dict(BLOCK_M1=m1, BLOCK_N1=n1, num_warps1=w1, num_stages1=s1, BLOCK_M2=m2, BLOCK_N2=n2,
                     num_warps2=w2, num_stages2=s2)
                for m1, n1, w1, s1, m2, n2, w2, s2 in [
                    (16, 128, 8, 2, 128, 32, 8, 3), (32, 128, 8, 2, 128, 32, 8, 3), (32, 64, 4, 2, 64, 32, 4, 2),
                    (64, 64, 8, 2, 64, 64, 8, 2), (16, 64, 4, 2, 128, 64, 8, 3), (32, 128, 8, 3, 128, 32, 4, 3)]]
    rows = []
    for variant in ("none", "causal"):
        causal = variant == "causal"
        for cfg in fwd_cfgs:
            progress.note(f"tune fwd {variant} {cfg}")
            try:
                fn = _fp8ops_fn(variant, S, H, None, fwd_config=cfg)
                us = _time(fn, [s[:3] for s in sets], samples, notes, "tune").median_us
                rows.append({"tune": "fwd", "variant": variant, "config": str(cfg), "us": us,
                             "tflops": _flops(b, H, S, D, causal, False) / us / 1e6})
            except Exception as exc:
                notes.append(f"tune fwd {cfg}: {type(exc).__name__}: {str(exc)[:200]}")
        for cfg in bwd_cfgs:
            for mode in ("separate", "atomic"):
                progress.note(f"tune fwd+bwd {variant} {mode} {cfg}")
                try:
                    us = _time(_fwd_bwd(_fp8ops_fn(variant, S, H, None, dq_mode=mode, bwd_config=cfg)), sets, samples,
                               notes, "tune").median_us
                    rows.append({"tune": f"fwd+bwd {mode}", "variant": variant, "config": str(cfg), "us": us,
                                 "tflops": _flops(b, H, S, D, causal, True) / us / 1e6})
                except Exception as exc:
                    notes.append(f"tune bwd {mode} {cfg}: {type(exc).__name__}: {str(exc)[:200]}")
    return rows


def _brief(exc: Exception) -> str:
    """An exception as one line of at most about 300 characters, for a note."""
    return f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"


def _skip(progress: common.Progress, notes: list[str], msg: str) -> None:
    progress.note(f"skipped: {msg}")
    notes.append(f"skipped: {msg}")


def _add_ratios(rows: list[dict[str, Any]]) -> None:
    """Peer time over fp8ops time, forward and forward+backward, on every fp8ops row."""
    index = {(r["head_dim"], r["seqlen"], r["variant"], r["impl"]): r for r in rows}
    for r in rows:
        if not r["impl"].startswith("fp8ops"):
            continue
        for peer, key in (("SDPA cuDNN", "cudnn"), ("SDPA flash", "flash"), ("Flex (compiled)", "flex")):
            p = index.get((r["head_dim"], r["seqlen"], r["variant"], peer))
            if p is None:
                continue
            for k in ("fwd", "fwd_bwd"):
                if r.get(f"{k}_ms") and p.get(f"{k}_ms"):
                    r[f"{k}_vs_{key}"] = p[f"{k}_ms"] / r[f"{k}_ms"]


def _targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The targets of each case that has fp8ops and the peer: ratio, target, met."""
    out = []
    for r in rows:
        if r["impl"] != "fp8ops":
            continue
        d, v = r["head_dim"], r["variant"]
        flex = (FLEX_TARGET if v in FLEX_TARGET_VARIANTS else None) if d == TARGET_HEAD_DIM else FLEX_TARGET_OTHER_D
        checks = [("Flex (compiled)", "flex", flex), ("SDPA cuDNN", "cudnn", CUDNN_TARGET if v == "causal" else None)]
        for peer, key, target in checks:
            fwd, fb = r.get(f"fwd_vs_{key}"), r.get(f"fwd_bwd_vs_{key}")
            if target is None or (fwd is None and fb is None):
                continue
            met = fwd is not None and fb is not None and fwd >= target and fb >= target
            out.append({"head_dim": d, "seqlen": r["seqlen"], "variant": v, "peer": peer, "target": target,
                        "fwd_x": fwd, "fwd_bwd_x": fb, "met": "yes" if met else "MISS"})
    return out


def _panels(rows: list[dict[str, Any]], variants: list[str], head_dims: list[int],
            seqlens: list[int]) -> list[dict[str, Any]]:
    """One panel per (variant, pass); a group per (head dim, S); a bar per implementation (TFLOP/s)."""
    cases = [(d, s) for d in head_dims for s in seqlens]
    groups = [str(s) if len(head_dims) == 1 else f"d{d} S{s}" for d, s in cases]
    index = {(r["head_dim"], r["seqlen"], r["variant"], r["impl"]): r for r in rows}
    panels = []
    for variant in variants:
        for key, title in (("fwd_tflops", "fwd"), ("fwd_bwd_tflops", "fwd+bwd")):
            series = {i: [(index.get((d, s, variant, i)) or {}).get(key) for d, s in cases] for i in IMPLS}
            series = {k: v for k, v in series.items() if any(x is not None for x in v)}
            panels.append({"title": f"{variant} {title}", "groups": groups, "series": series})
    return panels


COLUMNS = [("head_dim", "d", ""), ("seqlen", "S", ""), ("batch", "B", ""), ("variant", "variant", "s"),
           ("impl", "implementation", "s"), ("fwd_ms", "fwd ms", ".3f"), ("fwd_tflops", "fwd TF/s", ".0f"),
           ("fwd_bwd_ms", "fwd+bwd ms", ".3f"), ("fwd_bwd_tflops", "fwd+bwd TF/s", ".0f"),
           ("fwd_vs_cudnn", "fwd x cuDNN", ".2f"), ("fwd_bwd_vs_cudnn", "f+b x cuDNN", ".2f"),
           ("fwd_vs_flex", "fwd x Flex", ".2f"), ("fwd_bwd_vs_flex", "f+b x Flex", ".2f")]
TARGET_COLUMNS = [("head_dim", "d", ""), ("seqlen", "S", ""), ("variant", "variant", "s"), ("peer", "peer", "s"),
                  ("target", "target", ".1f"), ("fwd_x", "fwd x", ".2f"), ("fwd_bwd_x", "f+b x", ".2f"),
                  ("met", "met", "s")]
TUNE_COLUMNS = [("tune", "kernel", "s"), ("variant", "variant", "s"), ("config", "config", "s"),
                ("us", "µs", ".0f"), ("tflops", "TF/s", ".0f")]


def _run_dense(args: argparse.Namespace, head_dims: list[int], seqlens: list[int], variants: list[str],
               samples: int, notes: list[str], failed: list[str]) -> list[dict[str, Any]]:
    """Time every (head dim, S, variant, implementation); the rows, with ratios to the peers."""
    tokens = getattr(args, "tokens", 65536)
    use_flex = not getattr(args, "no_flex", False)
    impl_names = [i for i in IMPLS if (use_flex or i != "Flex (compiled)")
                  and not (getattr(args, "no_deterministic", False) and i == "fp8ops (deterministic)")
                  and not (getattr(args, "no_portable", False) and i == "fp8ops (portable fwd)")]
    progress = common.Progress(len(head_dims) * len(seqlens) * len(variants) * len(impl_names), prefix="attention")
    rows: list[dict[str, Any]] = []
    for D in head_dims:
        H, Hkv = _heads(args, D)
        gqa = Hkv != H
        for si, S in enumerate(seqlens):
            B = max(1, tokens // S)
            sets = _inputs(B, H, Hkv, S, D, 2)
            fwd_sets = [s[:3] for s in sets]
            for variant in variants:
                causal = variant in CAUSAL_VARIANTS
                docs = _documents(S, seed=S) if variant == "document" else None
                vis = _visible_fraction(variant, S, docs)
                makers: dict[str, Any] = {"fp8ops": lambda: _fp8ops_fn(variant, S, H, docs)}
                makers["fp8ops (deterministic)"] = lambda: _fp8ops_fn(variant, S, H, docs, dq_mode="separate")
                makers["fp8ops (portable fwd)"] = lambda: _fp8ops_fn(
                    variant, S, H, docs, dq_mode="auto", fwd_config=PORTABLE_FWD_CONFIG)
                if variant in SDPA_VARIANTS:
                    makers["SDPA cuDNN"] = lambda: _sdpa_fn(variant, "cudnn", gqa)
                    makers["SDPA flash"] = lambda: _sdpa_fn(variant, "flash", gqa)
                if use_flex:
                    makers["Flex (compiled)"] = lambda: _flex_fn(variant, S, H, docs, gqa)
                ref: torch.Tensor | None = None
                for name in impl_names:
                    progress.step(f"d={D} H={H}:{Hkv} S={S} B={B} {variant} {name}")
                    if name not in makers:
                        continue
                    label = f"{name} {variant} d={D} S={S}"
                    try:
                        fn = makers[name]()
                        if si == 0 and name != "fp8ops (deterministic)":
                            # with autograd on, as timed: a no_grad call would compile Flex once more
                            out = fn(*fwd_sets[0]).detach().float()
                            if name == "fp8ops":
                                ref = out
                            elif ref is not None:
                                err, excess = _mismatch(out, ref)
                                if excess > 0.02:
                                    failed.append(f"d={D} {variant} S={S}: fp8ops and {name} differ by {err:.3g} "
                                                  f"(more than 0.02 + 0.02 |out|)")
                            del out
                        fwd = None if name == "fp8ops (deterministic)" else _time(fn, fwd_sets, samples, notes, label)
                    except Exception as exc:
                        _skip(progress, notes, f"{label}: {_brief(exc)}")
                        continue
                    try:  # a backward that fails (an unsupported head dim, say) keeps the forward's row
                        fb: common.Timing | None = _time(_fwd_bwd(fn), sets, samples, notes, label)
                    except Exception as exc:
                        _skip(progress, notes, f"{label} backward: {_brief(exc)}")
                        fb = None
                    if fwd is None and fb is None:
                        continue
                    rows.append({
                        "head_dim": D, "heads": H, "kv_heads": Hkv, "seqlen": S, "batch": B, "variant": variant,
                        "impl": name, "visible": vis,
                        "fwd_ms": None if fwd is None else fwd.median_us / 1e3,
                        "fwd_tflops": None if fwd is None else _flops(B, H, S, D, causal, False) / fwd.median_us / 1e6,
                        "fwd_bwd_ms": None if fb is None else fb.median_us / 1e3,
                        "fwd_bwd_tflops": None if fb is None else _flops(B, H, S, D, causal, True) / fb.median_us / 1e6,
                        "fwd_timing": None if fwd is None else fwd.as_dict(),
                        "fwd_bwd_timing": None if fb is None else fb.as_dict(),
                    })
                del ref
            del sets, fwd_sets
            torch.cuda.empty_cache()
    _add_ratios(rows)
    return rows


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the suite; print the tables; write attention.json and attention.png; return the record."""
    out = Path(getattr(args, "out", "bench_out"))
    out.mkdir(parents=True, exist_ok=True)
    quick = bool(getattr(args, "quick", False))
    tokens = getattr(args, "tokens", 65536)
    head_dims = getattr(args, "head_dims", None) or (QUICK_HEAD_DIMS if quick else HEAD_DIMS)
    seqlens = getattr(args, "seqlens", None) or (QUICK_SEQLENS if quick else SEQLENS)
    variants = getattr(args, "variants", None) or VARIANTS
    samples = getattr(args, "samples", None) or (8 if quick else 20)
    varlen_only = bool(getattr(args, "varlen_only", False))
    # Fails here, before any work, if --kv-heads does not divide the query heads.
    heads = {} if varlen_only else {D: _heads(args, D) for D in head_dims}
    env = common.environment()
    print(common.describe_environment(env))

    notes: list[str] = []
    failed: list[str] = []
    t0 = time.perf_counter()
    rows = [] if varlen_only else _run_dense(args, head_dims, seqlens, variants, samples, notes, failed)
    targets = _targets(rows)
    varlen = None
    if varlen_only or getattr(args, "varlen", False):
        varlen = attention_varlen.run_varlen(args, samples=samples, notes=notes, failed=failed)
    tune_rows = []
    if getattr(args, "tune", False) and not varlen_only:
        H, Hkv = heads[head_dims[0]]
        tune_rows = _tune(tokens, H, Hkv, head_dims[0], samples, common.Progress(0, prefix="tune"), notes)

    if rows:
        print()
        print(common.format_table(rows, COLUMNS))
    if targets:
        print()
        print("Targets (fp8ops's default dQ scheme; 'x': peer time / fp8ops time):")
        print(common.format_table(targets, TARGET_COLUMNS))
        met = sum(t["met"] == "yes" for t in targets)
        print(f"targets met: {met} of {len(targets)}")
    if varlen is not None:
        print()
        print(attention_varlen.format_tables(varlen))
    if tune_rows:
        print()
        print(common.format_table(sorted(tune_rows, key=lambda r: (r["tune"], r["variant"], r["us"])), TUNE_COLUMNS))
    for n in notes:
        print(f"note: {n}")
    head_text = ", ".join(f"d={D}: {H} heads" + (f" ({Hkv} k/v)" if Hkv != H else "") for D, (H, Hkv) in heads.items())
    description = (f"bf16, batch x S = {tokens} tokens; {head_text}. TFLOP/s = 4 B H S^2 d (H: query heads), halved "
                   f"for every causal variant (sliding window and document: effective, causal-equivalent TFLOP/s), "
                   f"x3.5 for fwd+bwd; 'visible' is the fraction of (query, key) pairs computed by a perfect "
                   f"block-sparse kernel; 'x Flex' / 'x cuDNN': the peer's time over fp8ops's.")
    record = {
        "suite": "attention", "environment": env,
        "description": varlen["description"] if varlen_only and varlen is not None else description,
        "config": {"tokens": tokens, "head_dims": head_dims, "heads": {str(D): h for D, h in heads.items()},
                   "seqlens": seqlens, "variants": variants, "samples": samples, "window": WINDOW,
                   "softcap": SOFTCAP, "documents": DOCUMENTS, "varlen_only": varlen_only},
        "rows": rows, "targets": targets, "varlen": varlen, "tune": tune_rows, "notes": notes,
        "failed_checks": failed, "seconds": time.perf_counter() - t0,
    }
    common.write_json(out / "attention.json", record)
    _write_markdown(out / "attention.md", record)
    try:
        if rows:
            common.write_bar_chart(out / "attention.png", _panels(rows, variants, head_dims, seqlens),
                                   title=f"attention TFLOP/s (bf16, {tokens} tokens; {head_text})", ylabel="TFLOP/s")
        if varlen is not None:
            attention_varlen.write_chart(out / "attention_varlen.png", varlen)
    except Exception as exc:  # the plot is a convenience; the JSON and the table are the record
        print(f"plot skipped: {type(exc).__name__}: {exc}")
    return record


def _write_markdown(path: Path, record: dict[str, Any]) -> None:
    env = record["environment"]
    lines = ["# Attention benchmark", "", f"GPU: {env.get('gpu')}; torch {env.get('torch')}; triton "
             f"{env.get('triton')}; CUDA {env.get('cuda')}; {env.get('date_utc')}.", "", record["description"], ""]
    if record["rows"]:
        lines += ["```", common.format_table(record["rows"], COLUMNS), "```", ""]
    if record["targets"]:
        met = sum(t["met"] == "yes" for t in record["targets"])
        lines += [f"Targets ({met} of {len(record['targets'])} met):", "", "```",
                  common.format_table(record["targets"], TARGET_COLUMNS), "```", ""]
    if record["varlen"] is not None:
        lines += ["```", attention_varlen.format_tables(record["varlen"]), "```", ""]
    if record["tune"]:
        lines += ["Launch-config sweep at S = 4096:", "", "```",
                  common.format_table(sorted(record["tune"], key=lambda r: (r["tune"], r["variant"], r["us"])),
                                      TUNE_COLUMNS), "```", ""]
    lines += [f"- {n}" for n in record["notes"]] + [f"- failed: {f}" for f in record["failed_checks"]]
    path.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    import sys

    _p = argparse.ArgumentParser(prog="python -m fp8ops.bench.attention", description=__doc__.splitlines()[0])
    _p.add_argument("--out", default="bench_out", metavar="DIR", help="output folder (default: bench_out/)")
    _p.add_argument("--quick", action="store_true", help="fewer sizes and samples (a smoke run)")
    add_arguments(_p)
    _args = _p.parse_args()
    _reason = common.cuda_unavailable_reason()
    if _reason is not None:
        print(f"fp8ops.bench.attention: {_reason}", file=sys.stderr)
        sys.exit(2)
    _rec = run(_args)
    sys.exit(1 if _rec["failed_checks"] else 0)
