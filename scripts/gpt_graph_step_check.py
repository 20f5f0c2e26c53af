"""The graphed GPT steps of ``python -m fp8ops.bench gpt`` alone, each build wrapped in
:func:`fp8ops.graph_step` before its first call (the fp8ops loss is then compiled during the
wrapper's calls, with the library ops opaque), side by side in one process: torch bf16 compiled
and fp8ops FP8 compiled, ms per step, kernels per step and their device time, and the ratio.

    python scripts/gpt_graph_step_check.py [--hidden 512] [--steps 20] [--json OUT]

Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import json

import torch

import fp8ops
from fp8ops.bench.gpt import SIZES, _size
from fp8ops.bench.step import _measure, _variant


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, nargs="+", default=[512], choices=sorted(SIZES))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    out = []
    for hidden in args.hidden:
        layers, heads = SIZES[hidden]
        size = _size(hidden, layers, heads, 50304, False)
        row: dict[str, object] = {"hidden": hidden}
        for impl in ("torch", "fp8ops FP8"):
            torch._dynamo.reset()
            step, carry, batch = _variant("gpt2", impl, "compile", size)
            graphed = fp8ops.graph_step(step)
            r, _ = _measure(graphed, carry, batch, args.steps)
            r["graph_stats"] = dict(graphed.stats)
            row[impl] = r
            print(f"hidden {hidden} {impl}: {r['ms']:.3f} ms/step, {r['kernels']:.0f} kernels, "
                  f"device {r['device_ms']:.3f} ms, {graphed.stats}", flush=True)
            del step, carry, graphed
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        ratio = row["fp8ops FP8"]["ms"] / row["torch"]["ms"]  # type: ignore[index]
        row["fp8_over_bf16"] = ratio
        print(f"hidden {hidden}: FP8 / bf16 {ratio:.3f}", flush=True)
        out.append(row)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
