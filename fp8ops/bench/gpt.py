"""GPT training steps at four sizes: fp8ops FP8 vs plain PyTorch bf16 vs torchao float8, each in
its fastest mode.

Models (bf16 parameters, seq 1024, 8 sequences = 8192 tokens per step, vocabulary 50304, causal,
head tied to the embedding), (hidden, layers, heads) = (512, 6, 8), (768, 12, 12), (2048, 8, 16),
(4096, 4, 32), ffn 4 x hidden:

- ``torch``: a nanoGPT-style ``nn.Module`` (``nn.Linear``, ``F.scaled_dot_product_attention``),
  bf16;
- ``torchao``: the same module with every block's ``nn.Linear`` converted by
  ``torchao.float8.convert_to_float8_training`` (tensorwise), compiled (the head stays bf16);
- ``fp8ops FP8``: the GPT of :mod:`fp8ops.testing.composition` (:func:`fp8ops.transformer_layer`
  layers, delayed scaling), the loss compiled with ``fullgraph=True`` or not; its output head (tied
  to the embedding) is a bf16 matmul followed by ``F.cross_entropy``, as in the other two;
- ``fp8ops FP8, fused loss``: the same with the head and its loss in one
  :func:`fp8ops.linear_cross_entropy` (the logits' gradient written with the loss, in the forward),
  compiled; its ratios are reported beside the ``fp8ops FP8`` ones;
- ``fp8ops FP8, FP8 head``: the same GPT with the head's three GEMMs in FP8 too
  (:func:`fp8ops.fp8_linear` on the tied embedding, a scaling state of its own, the layers'
  recipe), compiled; a different model numerically, so its ratios are reported beside, not instead
  of, the bf16-head ones (``scripts/gpt_fp8_head.py`` compares the training losses of the two heads);
- ``fp8ops FP8 + fused AdamW``: the ``fp8ops FP8`` model with its layers' GEMM weights stepped by
  :func:`fp8ops.adamw_quantize_`, which writes each weight's FP8 copy for the next forward in the
  optimizer's pass (no cast of the weights in the step), the other parameters by
  :func:`fp8ops.adamw_` (the same AdamW alone, several tensors per kernel); the same model and
  AdamW coefficients, compiled; run only when ``--impls`` names it;
- ``fp8ops FP8, fused loss + AdamW``: both of the above, the library's own loss and optimizer; run
  only when named;
- ``torch + fp8ops AdamW``: the ``torch`` model stepped by :func:`fp8ops.adamw_` instead of
  torch's fused AdamW, compiled; run only when named. The builds with the library's AdamW are also
  reported over it: how much of their lead is the optimizer's, which a bf16 model can use too.

A step is a whole training step: fresh probes, forward, backward, fused capturable AdamW and (FP8)
:func:`fp8ops.update`. A compiled fp8ops build runs its first step, over uncalibrated states, eagerly,
so that its loss is compiled once, for calibrated states. Each build is timed as it is (eager or compiled) and then as one CUDA graph
per step (:func:`fp8ops.graph_step`), so every implementation is seen in eager, compile, graph and
compile + graph: on the same compiled code, but for the compiled fp8ops builds, which are built
again and compile their loss during ``graph_step``'s calls (the library ops then stay opaque calls
in the graph, whose captured launches chain their amax words). Per variant: ms/step, tokens/s, host ms (the time a step
call takes to return when the GPU is idle at its start), kernels per step and their summed device
time (torch.profiler, the unreplayed step), peak memory (``max_memory_allocated`` over the
variant's run: parameters, optimizer state and activations; a graph's pool included).

Targets (fp8ops FP8's fastest mode over bf16's fastest mode): <= 1.00 at hidden 512, <= 0.95 at
768, <= 0.75 at 2048, <= 0.70 at 4096; <= 0.90 of torchao float8's fastest mode at 2048 and 4096.
``--quick``: two small sizes and fewer steps.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

import torch

from .common import Progress, environment, format_table, write_bar_chart, write_json
from .step import FUSED_ADAMW, FUSED_ALL, FUSED_LOSS, TORCH_LIBRARY_ADAMW, _measure, _variant

__all__ = ["add_arguments", "run"]

SIZES = {512: (6, 8), 768: (12, 12), 2048: (8, 16), 4096: (4, 32)}
"""hidden -> (layers, heads)."""
QUICK = {256: (2, 4), 512: (2, 8)}
TARGET_VS_BF16 = {512: 1.0, 768: 0.95, 2048: 0.75, 4096: 0.70}
TARGET_VS_TORCHAO = {2048: 0.9, 4096: 0.9}
BUILDS = [("torch", "eager"), ("torch", "compile"), ("torchao", "compile"), ("fp8ops FP8", "eager"),
          ("fp8ops FP8", "compile"), ("fp8ops FP8, FP8 head", "compile"), (FUSED_ADAMW, "compile"),
          (FUSED_LOSS, "compile"), (FUSED_ALL, "compile"), (TORCH_LIBRARY_ADAMW, "compile")]
"""(impl, build); each build is measured as built and then as one CUDA graph per step."""
ON_REQUEST = {FUSED_ADAMW, FUSED_ALL, TORCH_LIBRARY_ADAMW}
"""Implementations run only when ``--impls`` names them (docs/benchmarks/gpt.md: the builds with
the library's AdamW, and the torch model with that AdamW, which says how much of their speed is the
optimizer's)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of the gpt suite."""
    parser.add_argument("--hidden", nargs="+", type=int, default=None, choices=sorted(SIZES),
                        help="the sizes to run, by hidden size (default: all four)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per variant (default 10)")
    parser.add_argument("--vocab", type=int, default=50304, help="vocabulary size (default 50304)")
    parser.add_argument("--no-torchao", action="store_true", help="skip the torchao peer")
    parser.add_argument("--no-eager", action="store_true",
                        help="skip the eager builds (their graph variants go with them)")
    parser.add_argument("--impls", nargs="+", default=None, choices=sorted({i for i, _ in BUILDS}),
                        help="only these implementations (default: all but "
                             + ", ".join(f'"{i}"' for i in sorted(ON_REQUEST)) + ")")
    parser.add_argument("--profile", action="store_true",
                        help="print the top CUDA kernels of each build's step (torch.profiler)")


def _size(hidden: int, layers: int, heads: int, vocab: int, quick: bool) -> dict[str, int]:
    return {"layers": layers, "hidden": hidden, "heads": heads, "seq": 256 if quick else 1024,
            "batch": 4 if quick else 8, "vocab": 8192 if quick else vocab}


def _one_build(impl: str, build: str, size: dict[str, int], steps: int, profile: bool = False) -> list[dict[str, Any]]:
    """Measure one build as built, then as one CUDA graph per step: the same step, but for a
    compiled fp8ops build, which is built again so that its loss is compiled inside ``graph_step``."""
    import fp8ops

    rows = []
    step, carry, batch = _variant("gpt2", impl, build, size)
    torch.cuda.reset_peak_memory_stats()
    r, carry = _measure(step, carry, batch, steps, f"hidden {size['hidden']} {impl} {build}" if profile else None)
    rows.append({"impl": impl, "mode": build, "peak_mib": torch.cuda.max_memory_allocated() / 2**20, **r})
    if impl.startswith("fp8ops") and build.startswith("compile"):
        # built again, its loss compiled during graph_step's calls: there the library ops stay
        # opaque calls, whose captured launches chain their amax words (kernels._library.opaque_in_graphs)
        del step, carry
        torch._dynamo.reset()
        torch.cuda.empty_cache()
        step, carry, batch = _variant("gpt2", impl, build, size)
    graphed = fp8ops.graph_step(step)
    torch.cuda.reset_peak_memory_stats()
    r, _ = _measure(graphed, carry, batch, steps)
    r["graph_stats"] = dict(graphed.stats)
    rows.append({"impl": impl, "mode": "graph" if build == "eager" else f"{build} + graph",
                 "peak_mib": torch.cuda.max_memory_allocated() / 2**20, **r})
    return rows


def _builds(args: argparse.Namespace) -> list[tuple[str, str]]:
    """The (impl, build) pairs the options select: those named by ``--impls``, else all but
    :data:`ON_REQUEST`; less torchao with ``--no-torchao`` and the eager builds with ``--no-eager``."""
    return [b for b in BUILDS if not (args.no_torchao and b[0] == "torchao")
            and not (args.no_eager and b[1] == "eager")
            and (b[0] in args.impls if args.impls is not None else b[0] not in ON_REQUEST)]


def _ratios(rows: list[dict[str, Any]], hidden: int) -> dict[str, Any]:
    """Fastest mode of each implementation and the ratios the targets are stated in."""
    best = {}
    for impl in ("torch", "torchao", "fp8ops FP8", "fp8ops FP8, FP8 head", FUSED_ADAMW, FUSED_LOSS, FUSED_ALL,
                 TORCH_LIBRARY_ADAMW):
        mine = [r for r in rows if r["impl"] == impl]
        if mine:
            b = min(mine, key=lambda r: r["ms"])
            best[impl] = {"mode": b["mode"], "ms": b["ms"]}
    out: dict[str, Any] = {"hidden": hidden, "best": best, "target_vs_bf16": TARGET_VS_BF16.get(hidden),
                           "target_vs_torchao": TARGET_VS_TORCHAO.get(hidden)}
    if "fp8ops FP8" in best and "torch" in best:
        out["fp8_over_bf16"] = best["fp8ops FP8"]["ms"] / best["torch"]["ms"]
    if "fp8ops FP8" in best and "torchao" in best:
        out["fp8_over_torchao"] = best["fp8ops FP8"]["ms"] / best["torchao"]["ms"]
    head = best.get("fp8ops FP8, FP8 head")
    if head is not None and "torch" in best:
        out["fp8_head_over_bf16"] = head["ms"] / best["torch"]["ms"]
    if head is not None and "torchao" in best:
        out["fp8_head_over_torchao"] = head["ms"] / best["torchao"]["ms"]
    fused_loss = best.get(FUSED_LOSS)
    if fused_loss is not None and "torch" in best:
        out["fused_loss_over_bf16"] = fused_loss["ms"] / best["torch"]["ms"]
    if fused_loss is not None and "torchao" in best:
        out["fused_loss_over_torchao"] = fused_loss["ms"] / best["torchao"]["ms"]
    for impl, key in ((FUSED_ADAMW, "fused_adamw"), (FUSED_ALL, "fused_all")):
        fused = best.get(impl)
        if fused is not None and "torch" in best:
            out[f"{key}_over_bf16"] = fused["ms"] / best["torch"]["ms"]
        if fused is not None and "torchao" in best:
            out[f"{key}_over_torchao"] = fused["ms"] / best["torchao"]["ms"]
        if fused is not None and TORCH_LIBRARY_ADAMW in best:  # both models with the library's AdamW
            out[f"{key}_over_bf16_library_adamw"] = fused["ms"] / best[TORCH_LIBRARY_ADAMW]["ms"]
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Time every build of every size; print the tables and the targets; write gpt.json and gpt.png."""
    table = QUICK if args.quick else {h: SIZES[h] for h in (args.hidden or sorted(SIZES))}
    steps = 3 if args.quick else args.steps
    builds = _builds(args)
    progress = Progress(len(table) * len(builds), prefix="gpt")
    rows: list[dict[str, Any]] = []
    summary: list[dict[str, Any]] = []
    failed: list[str] = []
    for hidden, (layers, heads) in table.items():
        size = _size(hidden, layers, heads, args.vocab, args.quick)
        tokens = size["seq"] * size["batch"]
        mine: list[dict[str, Any]] = []
        for impl, build in builds:
            progress.step(f"hidden {hidden}: {impl} {build}")
            torch._dynamo.reset()
            try:
                got = _one_build(impl, build, size, steps, args.profile)
            except Exception as exc:  # noqa: BLE001  (one failing build must not hide the others)
                failed.append(f"hidden {hidden} {impl} {build}: {type(exc).__name__}: "
                              f"{str(exc).splitlines()[0][:300] if str(exc) else ''}")
                progress.note(failed[-1])
                continue
            finally:
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
            for r in got:
                r.update(hidden=hidden, layers=layers, tok_per_s=tokens / r["ms"] * 1e3)
                if not math.isfinite(r["loss"]):
                    failed.append(f"hidden {hidden} {r['impl']} {r['mode']}: non-finite loss")
                if "graph" in r["mode"] and not r["graph_stats"]["replays"]:
                    failed.append(f"hidden {hidden} {r['impl']} {r['mode']}: never captured ({r['graph_stats']})")
            mine += got
        rows += mine
        summary.append(_ratios(mine, hidden))
    cols = [("hidden", "hidden", ".0f"), ("impl", "impl", ""), ("mode", "mode", ""), ("ms", "ms/step", ".2f"),
            ("tok_per_s", "tokens/s", ".3g"), ("host_ms", "host ms", ".2f"), ("kernels", "kernels", ".0f"),
            ("device_ms", "device ms", ".2f"), ("peak_mib", "peak MiB", ".0f")]
    print(format_table(rows, cols))
    print()
    for s in summary:
        parts = [f"hidden {s['hidden']}: best " + ", ".join(f"{k} {v['ms']:.2f} ms ({v['mode']})"
                                                          for k, v in s["best"].items())]
        for key, tkey, peer in (("fp8_over_bf16", "target_vs_bf16", "bf16"),
                                ("fp8_over_torchao", "target_vs_torchao", "torchao"),
                                ("fp8_head_over_bf16", "target_vs_bf16", "bf16 (FP8 head)"),
                                ("fp8_head_over_torchao", "target_vs_torchao", "torchao (FP8 head)"),
                                ("fused_adamw_over_bf16", "target_vs_bf16", "bf16 (fused AdamW)"),
                                ("fused_adamw_over_torchao", "target_vs_torchao", "torchao (fused AdamW)"),
                                ("fused_loss_over_bf16", "target_vs_bf16", "bf16 (fused loss)"),
                                ("fused_loss_over_torchao", "target_vs_torchao", "torchao (fused loss)"),
                                ("fused_all_over_bf16", "target_vs_bf16", "bf16 (fused loss + AdamW)"),
                                ("fused_all_over_torchao", "target_vs_torchao", "torchao (fused loss + AdamW)"),
                                ("fused_adamw_over_bf16_library_adamw", None, "bf16 with the library's AdamW (fused AdamW)"),
                                ("fused_all_over_bf16_library_adamw", None, "bf16 with the library's AdamW (fused loss + AdamW)")):
            if key in s:
                t = None if tkey is None else s[tkey]  # no target for the comparison with bf16 on adamw_
                verdict = "" if t is None else (f" (target <= {t:.2f}: " + ("met" if s[key] <= t else "MISSED") + ")")
                parts.append(f"FP8 / {peer} {s[key]:.3f}{verdict}")
        print("; ".join(parts))
    record = {"suite": "gpt", "environment": environment(), "sizes": {str(h): v for h, v in table.items()},
              "steps": steps, "vocab": args.vocab, "rows": rows, "summary": summary, "failed_checks": failed}
    out = Path(args.out)
    write_json(out / "gpt.json", record)
    panels = []
    for s in summary:
        mine = [r for r in rows if r["hidden"] == s["hidden"]]
        panels.append({"title": f"hidden {s['hidden']}: ms per step", "groups": [f"{r['impl']}\n{r['mode']}" for r in mine],
                       "series": {"ms/step": [r["ms"] for r in mine]}})
    write_bar_chart(out / "gpt.png", panels, title=f"GPT training steps ({torch.cuda.get_device_name()})",
                    ylabel="ms per step")
    return record
