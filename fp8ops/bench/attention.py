"""fp8ops.attention vs SDPA (cuDNN, flash) and compiled FlexAttention: forward and forward+backward.

Problem: bf16, head dim 128, 16 heads, sequence lengths S in {1024, 2048, 4096, 8192, 16384} at a
constant token count (batch = 16384 / S), for the variants

- ``none``: plain attention (not causal);
- ``causal``;
- ``alibi``: causal with the ALiBi score_mod (fused in-kernel in fp8ops and Flex);
- ``sliding_window``: causal sliding window of 1024 keys (fp8ops: ``window=1024``; Flex: a block
  mask from the sliding-window mask_mod);
- ``document``: causal attention inside documents of random lengths packed in each sequence
  (fp8ops and Flex: a block mask from ``causal & document`` built once, outside the timing).

Peers: ``F.scaled_dot_product_attention`` restricted to the cuDNN and flash backends (none/causal
only: SDPA cannot express the other variants without a dense bias), and
``torch.compile(flex_attention)`` with the same mods. fp8ops is also timed with the atomic-dQ
backward variant. TFLOP/s follow the convention ``4 B H S^2 d``, halved for causal variants, x3.5
for forward+backward (so window and document variants report "causal-equivalent" TFLOP/s; the
``visible`` column gives the fraction of (query, key) pairs actually visible). Times are medians of
CUDA-graph replays after warm-up (see :mod:`fp8ops.bench.common`). A correctness check compares
fp8ops with each peer's output at the first sequence length.

``--tune`` additionally sweeps fp8ops launch configurations at S = 4096 and reports the fastest.
"""

from __future__ import annotations

import argparse
import importlib
import math
import time
from pathlib import Path
from typing import Any

import torch

from . import common

__all__ = ["add_arguments", "run"]

SEQLENS = [1024, 2048, 4096, 8192, 16384]
QUICK_SEQLENS = [1024, 4096]
VARIANTS = ["none", "causal", "alibi", "sliding_window", "document"]
CAUSAL_VARIANTS = {"causal", "alibi", "sliding_window", "document"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of this suite."""
    parser.add_argument("--tokens", type=int, default=16384, help="batch x sequence length (default 16384)")
    parser.add_argument("--heads", type=int, default=16, help="attention heads (default 16)")
    parser.add_argument("--head-dim", type=int, default=128, help="head dim (default 128)")
    parser.add_argument("--seqlens", type=int, nargs="*", default=None, help="sequence lengths")
    parser.add_argument("--variants", nargs="*", default=None, choices=VARIANTS, help="variants to run")
    parser.add_argument("--samples", type=int, default=None, help="timed samples per case")
    parser.add_argument("--no-flex", action="store_true", help="skip FlexAttention")
    parser.add_argument("--tune", action="store_true", help="also sweep fp8ops launch configs at S=4096")


def _flops(B: int, H: int, S: int, D: int, causal: bool, backward: bool) -> float:
    f = 4.0 * B * H * S * S * D
    if causal:
        f /= 2.0
    return f * 3.5 if backward else f


def _documents(S: int, seed: int) -> torch.Tensor:
    # Document ids of S positions, lengths drawn around S / 4 (at least 64).
    g = torch.Generator().manual_seed(seed)
    ids = torch.empty(S, dtype=torch.int64)
    pos, doc = 0, 0
    while pos < S:
        n = max(64, int(torch.empty(1).exponential_(4.0 / S, generator=g).item()))
        ids[pos:pos + n] = doc
        pos += n
        doc += 1
    return ids


def _visible_fraction(variant: str, S: int, docs: torch.Tensor | None) -> float:
    if variant == "none":
        return 1.0
    if variant in ("causal", "alibi"):
        return (S + 1) / (2 * S)
    if variant == "sliding_window":
        w = min(1024, S)
        return (w * (w + 1) / 2 + (S - w) * w) / (S * S)
    assert docs is not None
    counts = torch.bincount(docs).double()
    return float((counts * (counts + 1) / 2).sum() / (S * S))


def _fp8ops_fn(variant: str, S: int, H: int, docs: torch.Tensor | None, dq_mode: str | None = None,
               fwd_config: dict[str, int] | None = None, bwd_config: dict[str, int] | None = None) -> Any:
    A = importlib.import_module("fp8ops.attention")
    R = importlib.import_module("fp8ops.reference.attention")
    kw: dict[str, Any] = {}
    if variant == "causal":
        kw = dict(causal=True)
    elif variant == "alibi":
        kw = dict(causal=True, score_mod=A.alibi(H))
    elif variant == "sliding_window":
        kw = dict(window=1024)
    elif variant == "document":
        assert docs is not None
        mm = A.and_masks(A.causal_mask(), A.document_mask(docs.cuda()))
        kw = dict(block_mask=A.create_block_mask(mm, None, None, S, S, device="cuda"))
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


def _sdpa_fn(variant: str, backend: str) -> Any:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    be = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[backend]
    causal = variant == "causal"

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        with sdpa_kernel([be]):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return fn


def _flex_fn(variant: str, S: int, H: int, docs: torch.Tensor | None) -> Any:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    # A fresh compile cache per (variant, S): flex_attention's code object would otherwise reach
    # Dynamo's recompile limit across the sweep and fall back to the (slow) eager path.
    torch._dynamo.reset()
    compiled = torch.compile(flex_attention, dynamic=False)
    score_mod = None
    mask_mod = None
    if variant in ("causal", "alibi"):
        def mask_mod(b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
            return q_idx >= kv_idx
    if variant == "alibi":
        n = 2 ** int(math.floor(math.log2(H)))
        slopes = torch.tensor([2 ** (-8.0 * (i + 1) / n) if i < n else 2 ** (-4.0 * (2 * (i - n) + 1) / n)
                               for i in range(H)], device="cuda")

        def score_mod(score, b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
            return score + slopes[h] * (kv_idx - q_idx)
    if variant == "sliding_window":
        def mask_mod(b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
            return (q_idx >= kv_idx) & (q_idx - kv_idx < 1024)
    if variant == "document":
        assert docs is not None
        d = docs.cuda()

        def mask_mod(b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
            return (q_idx >= kv_idx) & (d[q_idx] == d[kv_idx])
    block_mask = create_block_mask(mask_mod, None, None, S, S, device="cuda") if mask_mod is not None else None

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return compiled(q, k, v, score_mod=score_mod, block_mask=block_mask)

    return fn


def _fwd_bwd(fn: Any) -> Any:
    def step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor) -> Any:
        return torch.autograd.grad(fn(q, k, v), (q, k, v), do)

    return step


def _inputs(B: int, H: int, S: int, D: int, n: int) -> list[tuple[torch.Tensor, ...]]:
    sets = []
    for i in range(n):
        g = torch.Generator(device="cuda").manual_seed(i)
        q, k, v, do = (torch.randn(B, H, S, D, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(4))
        sets.append((q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), do))
    return sets


def _time(fn: Any, sets: list[tuple[torch.Tensor, ...]], samples: int, notes: list[str], label: str) -> float:
    t = common.time_cuda(fn, sets, samples=samples, on_fallback=lambda m: notes.append(f"{label}: {m}"))
    return t.median_us


def _tune(tokens: int, H: int, D: int, samples: int, progress: common.Progress,
          notes: list[str]) -> list[dict[str, Any]]:
    """Sweep a few fp8ops launch configs at S = 4096 (causal and not); rows of the results."""
    S = 4096
    b = max(1, tokens // S)
    sets = _inputs(b, H, S, D, 2)
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
                us = _time(fn, [s[:3] for s in sets], samples, notes, "tune")
                rows.append({"tune": "fwd", "variant": variant, "config": str(cfg), "us": us,
                             "tflops": _flops(b, H, S, D, causal, False) / us / 1e6})
            except Exception as exc:
                notes.append(f"tune fwd {cfg}: {type(exc).__name__}: {str(exc)[:200]}")
        for cfg in bwd_cfgs:
            for mode in ("separate", "atomic"):
                progress.note(f"tune fwd+bwd {variant} {mode} {cfg}")
                try:
                    us = _time(_fwd_bwd(_fp8ops_fn(variant, S, H, None, dq_mode=mode, bwd_config=cfg)), sets, samples,
                               notes, "tune")
                    rows.append({"tune": f"fwd+bwd {mode}", "variant": variant, "config": str(cfg), "us": us,
                                 "tflops": _flops(b, H, S, D, causal, True) / us / 1e6})
                except Exception as exc:
                    notes.append(f"tune bwd {mode} {cfg}: {type(exc).__name__}: {str(exc)[:200]}")
    return rows


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the suite; print the table; write attention.json and attention.png; return the record."""
    out = Path(getattr(args, "out", "bench_out"))
    out.mkdir(parents=True, exist_ok=True)
    quick = bool(getattr(args, "quick", False))
    tokens = getattr(args, "tokens", 16384)
    H = getattr(args, "heads", 16)
    D = getattr(args, "head_dim", 128)
    seqlens = getattr(args, "seqlens", None) or (QUICK_SEQLENS if quick else SEQLENS)
    variants = getattr(args, "variants", None) or VARIANTS
    samples = getattr(args, "samples", None) or (8 if quick else 20)
    use_flex = not getattr(args, "no_flex", False)
    env = common.environment()
    print(common.describe_environment(env))

    impl_names = ["fp8ops", "fp8ops (deterministic)", "SDPA cuDNN", "SDPA flash"]
    if use_flex:
        impl_names.append("Flex (compiled)")
    progress = common.Progress(len(seqlens) * len(variants) * len(impl_names), prefix="attention")
    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    failed: list[str] = []
    t0 = time.perf_counter()
    for si, S in enumerate(seqlens):
        B = max(1, tokens // S)
        sets = _inputs(B, H, S, D, 2)
        fwd_sets = [s[:3] for s in sets]
        for variant in variants:
            causal = variant in CAUSAL_VARIANTS
            docs = _documents(S, seed=S) if variant == "document" else None
            vis = _visible_fraction(variant, S, docs)
            makers: dict[str, Any] = {
                "fp8ops": lambda: _fp8ops_fn(variant, S, H, docs),
                "fp8ops (deterministic)": lambda: _fp8ops_fn(variant, S, H, docs, dq_mode="separate"),
            }
            if variant in ("none", "causal"):
                makers["SDPA cuDNN"] = lambda: _sdpa_fn(variant, "cudnn")
                makers["SDPA flash"] = lambda: _sdpa_fn(variant, "flash")
            if use_flex:
                makers["Flex (compiled)"] = lambda: _flex_fn(variant, S, H, docs)
            outputs: dict[str, torch.Tensor] = {}
            for name in impl_names:
                progress.step(f"S={S} B={B} {variant} {name}")
                if name not in makers:
                    continue
                try:
                    fn = makers[name]()
                    if si == 0 and name != "fp8ops (deterministic)":
                        with torch.no_grad():
                            outputs[name] = fn(*fwd_sets[0]).float()
                    fwd_us = None if name == "fp8ops (deterministic)" else _time(fn, fwd_sets, samples, notes, name)
                    fb_us = _time(_fwd_bwd(fn), sets, samples, notes, name)
                except Exception as exc:
                    msg = f"{name} {variant} S={S}: {type(exc).__name__}: {str(exc)[:300]}"
                    progress.note(f"skipped: {msg}")
                    notes.append(f"skipped: {msg}")
                    continue
                rows.append({
                    "seqlen": S, "batch": B, "variant": variant, "impl": name, "visible": vis,
                    "fwd_ms": None if fwd_us is None else fwd_us / 1e3,
                    "fwd_tflops": None if fwd_us is None else _flops(B, H, S, D, causal, False) / fwd_us / 1e6,
                    "fwd_bwd_ms": fb_us / 1e3, "fwd_bwd_tflops": _flops(B, H, S, D, causal, True) / fb_us / 1e6,
                })
            ref = outputs.get("fp8ops")
            for name, o in outputs.items():
                if name == "fp8ops" or ref is None:
                    continue
                err = float((o - ref).abs().max())
                if err > 3e-2:
                    failed.append(f"{variant} S={S}: fp8ops and {name} differ by {err:.3g}")
            del outputs
        del sets, fwd_sets
        torch.cuda.empty_cache()
    # Ratios against the peers (forward and forward+backward), per (S, variant).
    for r in rows:
        for peer, key in (("SDPA cuDNN", "cudnn"), ("Flex (compiled)", "flex")):
            p = next((x for x in rows if x["seqlen"] == r["seqlen"] and x["variant"] == r["variant"]
                      and x["impl"] == peer), None)
            if p is not None and r["impl"].startswith("fp8ops"):
                if r.get("fwd_ms") and p.get("fwd_ms"):
                    r[f"fwd_vs_{key}"] = p["fwd_ms"] / r["fwd_ms"]
                r[f"fwd_bwd_vs_{key}"] = p["fwd_bwd_ms"] / r["fwd_bwd_ms"]
    tune_rows = _tune(tokens, H, D, samples, progress, notes) if getattr(args, "tune", False) else []
    cols = [("seqlen", "S", ""), ("batch", "B", ""), ("variant", "variant", "s"), ("impl", "implementation", "s"),
            ("fwd_ms", "fwd ms", ".3f"), ("fwd_tflops", "fwd TF/s", ".0f"), ("fwd_bwd_ms", "fwd+bwd ms", ".3f"),
            ("fwd_bwd_tflops", "fwd+bwd TF/s", ".0f"), ("fwd_vs_cudnn", "fwd x cuDNN", ".2f"),
            ("fwd_vs_flex", "fwd x Flex", ".2f"), ("fwd_bwd_vs_flex", "f+b x Flex", ".2f")]
    print()
    print(common.format_table(rows, cols))
    if tune_rows:
        print()
        print(common.format_table(sorted(tune_rows, key=lambda r: (r["tune"], r["variant"], r["us"])),
                                  [("tune", "kernel", "s"), ("variant", "variant", "s"), ("config", "config", "s"),
                                   ("us", "µs", ".0f"), ("tflops", "TF/s", ".0f")]))
    for n in notes:
        print(f"note: {n}")
    record = {
        "suite": "attention", "environment": env,
        "description": (f"bf16, d={D}, H={H}, batch x S = {tokens} tokens. TFLOP/s = 4 B H S^2 d (halved for causal "
                        f"variants, x3.5 for fwd+bwd); 'visible' is the fraction of (query, key) pairs computed "
                        f"by a perfect block-sparse kernel."),
        "rows": rows, "tune": tune_rows, "notes": notes, "failed_checks": failed,
        "seconds": time.perf_counter() - t0,
    }
    common.write_json(out / "attention.json", record)
    _write_markdown(out / "attention.md", record, cols)
    try:
        panels = []
        for variant in variants:
            groups = [str(s) for s in seqlens]
            for key, title in (("fwd_tflops", "fwd"), ("fwd_bwd_tflops", "fwd+bwd")):
                series = {i: [next((r.get(key) for r in rows if r["seqlen"] == s and r["variant"] == variant
                                    and r["impl"] == i), None) for s in seqlens] for i in impl_names}
                series = {k: v for k, v in series.items() if any(x is not None for x in v)}
                panels.append({"title": f"{variant} {title}", "groups": groups, "series": series})
        common.write_bar_chart(out / "attention.png", panels, title=f"attention TFLOP/s (bf16, d={D}, {tokens} tokens)",
                               ylabel="TFLOP/s")
    except Exception as exc:  # the plot is a convenience; the JSON and the table are the record
        print(f"plot skipped: {type(exc).__name__}: {exc}")
    return record


def _write_markdown(path: Path, record: dict[str, Any], cols: list[tuple[str, str, str]]) -> None:
    env = record["environment"]
    lines = ["# Attention benchmark", "", f"GPU: {env.get('gpu')}; torch {env.get('torch')}; triton "
             f"{env.get('triton')}; CUDA {env.get('cuda')}; {env.get('date_utc')}.", "", record["description"], "",
             "```", common.format_table(record["rows"], cols), "```", ""]
    if record["tune"]:
        lines += ["Launch-config sweep at S = 4096:", "", "```",
                  common.format_table(sorted(record["tune"], key=lambda r: (r["tune"], r["variant"], r["us"])),
                                      [("tune", "kernel", "s"), ("variant", "variant", "s"), ("config", "config", "s"),
                                       ("us", "µs", ".0f"), ("tflops", "TF/s", ".0f")]), "```", ""]
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
