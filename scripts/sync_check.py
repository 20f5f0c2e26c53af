"""Host syncs in an eager training step of the seed layer: runs warm steps with
``torch.cuda.set_sync_debug_mode("warn")`` and prints where each synchronizing CUDA call came from.

    python scripts/sync_check.py [--recipe delayed|current|none] [--dropout 0.1]
"""
from __future__ import annotations

import argparse
import collections
import traceback
import warnings

import torch

import fp8ops
from fp8ops.bench.layer import SEED, _fp8ops_case
from fp8ops.reference.transformer_layer import BasicTransformerLayer
from fp8ops.transformer_layer import TransformerConfig


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--recipe", default="delayed", choices=["delayed", "current", "none"])
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--small", action="store_true", help="hidden 1024 instead of the seed's 4096")
    args = ap.parse_args()
    H, Fh, h, S, B = (SEED[k] for k in ("hidden", "ffn", "heads", "seq", "batch"))
    if args.small:
        H, Fh, h = 1024, 4096, 8
    cfg = TransformerConfig(hidden_size=H, ffn_hidden_size=Fh, num_attention_heads=h, hidden_dropout=args.dropout,
                            attention_dropout=args.dropout)
    recipe = {"delayed": fp8ops.DelayedScaling(), "current": fp8ops.CurrentScaling(), "none": None}[args.recipe]
    seed_state = {k: v.clone() for k, v in BasicTransformerLayer(H, Fh, h).state_dict().items()}
    x = torch.randn(S, B, H, device="cuda").bfloat16().requires_grad_()
    dy = (torch.randn(S, B, H, device="cuda") * 1e-2).bfloat16()
    step, _, params = _fp8ops_case(seed_state, cfg, recipe, x, dy)
    for _ in range(2):
        step(x, dy)
    torch.cuda.synchronize()
    seen: collections.Counter[str] = collections.Counter()

    def show(message, category, filename, lineno, file=None, line=None):  # noqa: ARG001
        stack = [f for f in traceback.extract_stack()[:-1] if "warnings" not in f.filename]
        where = " <- ".join(f"{f.filename.split('/')[-1]}:{f.lineno} {f.name}" for f in reversed(stack[-6:]))
        seen[f"{str(message)[:80]} | {where}"] += 1

    warnings.showwarning = show
    warnings.simplefilter("always")
    torch.cuda.set_sync_debug_mode("warn")
    for _ in range(3):
        for p in params:
            p.grad = None
        x.grad = None
        step(x, dy)
    torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    print(f"recipe {args.recipe}, dropout {args.dropout}: {sum(seen.values())} synchronizing calls in 3 steps")
    for k, n in seen.most_common():
        print(f"  {n:3d} x {k}")


if __name__ == "__main__":
    main()
