"""Which operation launches each kernel of the seed layer's training step.

One fp8ops delayed step of ``python -m fp8ops.bench layer`` (fresh probes, forward, backward,
:func:`fp8ops.update`; dropout as given), profiled after warm-up steps. Each CUDA kernel is listed
with its device time, its full name and the chain of operations that launched it (the innermost
first, up to the autograd node or the top-level call), grouped by (kernel, chain) and sorted by
time; then the time per top-level operation. It answers "what are these elementwise kernels" where
a plain kernel table only names the functor.

    python scripts/layer_kernel_ops.py [--dropout 0.1] [--steps 2] [--json OUT]

Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import collections
import json
from typing import Any

import torch

from fp8ops.bench import common
from fp8ops.bench.layer import _fp8ops_case, seed_layer_inputs


def _chain(event: Any, depth: int = 4) -> str:
    names = []
    e = event
    while e is not None and len(names) < depth:
        names.append(e.name)
        e = e.cpu_parent
    return " < ".join(names)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--steps", type=int, default=2, help="profiled steps (times are per step)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import fp8ops
    from torch.profiler import ProfilerActivity, profile

    config, seed_state, x, dy = seed_layer_inputs(args.dropout)
    step, _, params = _fp8ops_case(seed_state, config, fp8ops.DelayedScaling(), x, dy)
    fn = common.clearing_grads(step, params)
    for _ in range(3):
        fn(x, dy)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        for _ in range(args.steps):
            fn(x, dy)
        torch.cuda.synchronize()
    rows: dict[tuple[str, str], list[float]] = collections.defaultdict(lambda: [0.0, 0])
    shapes: dict[tuple[str, str], str] = {}
    for e in prof.events():
        for k in getattr(e, "kernels", []):
            key = (k.name, _chain(e))
            rows[key][0] += k.duration / args.steps
            rows[key][1] += 1 / args.steps
            shapes.setdefault(key, str(e.input_shapes)[:120])
    print(common.describe_environment(common.environment()))
    total = sum(v[0] for v in rows.values())
    print(f"kernels per step: {sum(v[1] for v in rows.values()):.0f}, {total:.1f} µs")
    out = []
    for (name, chain), (us, n) in sorted(rows.items(), key=lambda kv: -kv[1][0]):
        print(f"{us:9.1f} µs  {n:4.0f}x  {name[:110]}\n{'':22s}{chain}\n{'':22s}{shapes[(name, chain)]}")
        out.append({"kernel": name, "chain": chain, "us_per_step": us, "launches_per_step": n,
                    "input_shapes": shapes[(name, chain)]})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": common.environment(), "dropout": args.dropout, "rows": out}, f, indent=1)


if __name__ == "__main__":
    main()
