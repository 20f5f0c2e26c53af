"""Whether ``fp8ops.update`` reads the states' histories and scales without a stacking copy in a
GPT training step (``python -m fp8ops.bench gpt``'s fp8ops FP8 step, compiled loss), and which
kernels one update launches.

    python scripts/update_stack_check.py [--hidden 512] [--mode compile|eager]
"""
from __future__ import annotations

import argparse
import collections

import torch
from torch.profiler import ProfilerActivity, profile

import fp8ops.recipes as recipes
from fp8ops.bench.gpt import SIZES, _size
from fp8ops.bench.step import _variant


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=512, choices=sorted(SIZES))
    ap.add_argument("--mode", default="compile", choices=["compile", "eager"])
    args = ap.parse_args()
    layers, heads = SIZES[args.hidden]
    step, carry, batch = _variant("gpt2", "fp8ops FP8", args.mode, _size(args.hidden, layers, heads, 50304, False))
    seen: list[str] = []
    inner = recipes.restack

    def spy(rows):  # type: ignore[no-untyped-def]
        out = inner(rows)
        r0 = rows[0]
        base = r0._base
        seen.append("no copy" if out is base else
                    f"copy (row 0: base {'None' if base is None else tuple(base.shape)}, offset {r0.storage_offset()}, "
                    f"{sum(r._base is base for r in rows)} of {len(rows)} rows share it)")
        return out

    recipes.restack = spy
    for _ in range(4):
        carry, _ = step(carry, *batch)
    torch.cuda.synchronize()
    print(f"hidden {args.hidden} {args.mode}: last step's restacks: {seen[-2:]}")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step(carry, *batch)
        torch.cuda.synchronize()
    rows: dict[str, int] = collections.Counter()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and "Cat" in e.name:
            rows[e.name[:80]] += 1
    print("concatenation kernels in one step:", dict(rows))


if __name__ == "__main__":
    main()
