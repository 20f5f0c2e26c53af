"""Kernels of one compiled GPT training step, plain PyTorch bf16 against fp8ops FP8 (delayed), side
by side: every CUDA kernel of a profiled step grouped by name (per step, two steps profiled), each
group's share, and totals by kind (GEMMs, attention, norms, activation, casts, optimizer, the rest).

    python scripts/gpt_kernel_diff.py [--hidden 512] [--rows 60] [--json OUT.json] [--impls A B]

``--impls``: the builds to compare (default ``torch`` and ``"fp8ops FP8"``; e.g. ``"fp8ops FP8"``
and ``"fp8ops FP8 + fused AdamW"`` for what the fused optimizer removes and adds).

The models are those of ``python -m fp8ops.bench gpt`` (seq 1024, 8 sequences, vocabulary 50304);
both compiled (the loss, ``fullgraph=True`` for fp8ops), eager launch order.
"""
from __future__ import annotations

import argparse
import collections
import json
import re

import torch
from torch.profiler import ProfilerActivity, profile

from fp8ops.bench.gpt import BUILDS, SIZES, _size
from fp8ops.bench.step import _variant

KINDS = [
    ("gemm", r"nvjet|gemm|cutlass|sm90_xmma|_scaled_mm"),
    ("attention", r"sdpa|flash|fmha|attention"),
    ("norm", r"norm"),
    ("activation", r"act_|gelu"),
    ("cast", r"cast|transpose|amax|quant"),
    ("optimizer", r"multi_tensor_apply|adam"),
    ("softmax/loss", r"softmax|nll|cross_entropy"),
]


def kind(name: str) -> str:
    for k, pat in KINDS:
        if re.search(pat, name, re.IGNORECASE):
            return k
    return "other"


def step_kernels(impl: str, size: dict[str, int]) -> dict[str, tuple[float, float]]:
    torch._dynamo.reset()
    step, carry, batch = _variant("gpt2", impl, "compile", size)
    for _ in range(4):
        carry, _ = step(carry, *batch)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            carry, _ = step(carry, *batch)
        torch.cuda.synchronize()
    rows: dict[str, list[float]] = collections.defaultdict(list)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            rows[e.name[:100]].append(e.device_time if hasattr(e, "device_time") else e.cuda_time)
    return {k: (len(v) / 2, sum(v) / 2) for k, v in rows.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=512, choices=sorted(SIZES))
    ap.add_argument("--rows", type=int, default=60)
    ap.add_argument("--json", default=None)
    ap.add_argument("--impls", nargs="+", default=["torch", "fp8ops FP8"],
                    choices=sorted({i for i, _ in BUILDS} - {"torchao"}))
    args = ap.parse_args()
    layers, heads = SIZES[args.hidden]
    size = _size(args.hidden, layers, heads, 50304, False)
    result = {}
    for impl in args.impls:
        ks = step_kernels(impl, size)
        result[impl] = ks
        total = sum(t for _, t in ks.values())
        print(f"\n==== {impl}, hidden {args.hidden}: {sum(n for n, _ in ks.values()):.0f} kernels, "
              f"{total / 1e3:.3f} ms per step ====")
        by_kind: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
        for name, (n, t) in ks.items():
            by_kind[kind(name)][0] += n
            by_kind[kind(name)][1] += t
        for k, (n, t) in sorted(by_kind.items(), key=lambda kv: -kv[1][1]):
            print(f"  {k:14s} {n:5.0f} kernels {t:9.1f} µs")
        print("  -- by name --")
        for name, (n, t) in sorted(ks.items(), key=lambda kv: -kv[1][1])[:args.rows]:
            print(f"  {t:9.1f} µs {n:5.0f} x {t / max(n, 1):7.1f} µs  {name}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"hidden": args.hidden, "kernels": result}, f, indent=1)


if __name__ == "__main__":
    main()
