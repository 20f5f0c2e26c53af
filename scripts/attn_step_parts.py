"""Device time of each kernel in one forward+backward of ``fp8ops.attention`` and of compiled Flex,
as the bench runs them (B = 8, H = 32, S = 8192, d = 128, bf16; the bench's masks), from the torch
profiler: the kernels of five steps after warm-up, summed by name and divided by five. Prints a table
per case and writes ``$OUT/attn_step_parts.json`` (or ./).

    python scripts/attn_step_parts.py [sliding_window document causal ...]

Besides the bench's variants: ``causal_mask`` (fp8ops only), ``causal_mask()`` as a mask_mod without a
block mask, and ``causal_mask_unbounded``, the same with the mask's band kept from the portable
kernels and the forward (``kernels.attention._mask_bounded`` made the identity), as before it bounded
their walks.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from fp8ops.bench import attention as BA

A = importlib.import_module("fp8ops.attention")
K = importlib.import_module("fp8ops.kernels.attention")


def _parts(step, args, steps: int = 5) -> list[tuple[str, float, int]]:
    for _ in range(3):
        step(*args)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step(*args)
        torch.cuda.synchronize()
    total: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            total[ev.name[:90]] += ev.device_time / 1000.0  # device_time is in µs
            count[ev.name[:90]] += 1
    rows = [(name, ms / steps, count[name] // steps) for name, ms in total.items()]
    return sorted(rows, key=lambda r: -r[1])


def main(variants: list[str]) -> dict:
    B, H, S, D = 8, 32, 8192, 128
    torch.manual_seed(0)
    q, k, v, do = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_()
    out: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "B": B, "H": H, "S": S, "D": D}
    for variant in variants:
        if variant.startswith("causal_mask"):
            impls = [("fp8ops", lambda q, k, v: A.attention(q, k, v, mask_mod=A.causal_mask(), backend="triton")[0])]
        else:
            docs = BA._documents(S, seed=S) if variant == "document" else None
            impls = [("fp8ops", BA._fp8ops_fn(variant, S, H, docs)), ("flex", BA._flex_fn(variant, S, H, docs, gqa=False))]
        for impl, fn in impls:
            step = BA._fwd_bwd(fn)
            bounded = K._mask_bounded
            if variant == "causal_mask_unbounded":
                K._mask_bounded = lambda window, *_: window
            try:
                rows = _parts(step, (q, k, v, do))
            finally:
                K._mask_bounded = bounded
            out[f"{variant}/{impl}"] = [{"kernel": n, "ms": round(ms, 4), "calls": c} for n, ms, c in rows]
            print(f"== {variant} {impl}: {sum(r[1] for r in rows):.3f} ms of kernels per step")
            for n, ms, c in rows:
                print(f"  {ms:8.3f} ms  x{c:<3d} {n}")
    return out


if __name__ == "__main__":
    picked = sys.argv[1:] or ["sliding_window", "document", "causal", "causal_mask", "causal_mask_unbounded"]
    record = main(picked)
    path = os.path.join(os.environ.get("OUT", "."), "attn_step_parts.json")
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
