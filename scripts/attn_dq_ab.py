"""The attention backward's two dQ schemes side by side on the GPU, interleaved round by round.

    python scripts/attn_dq_ab.py OUT.json [--batch 2] [--heads 32] [--seqlen 8192] [--head-dim 128]
                                 [--variants causal none alibi sliding_window] [--rounds 6]

Arms, each forward+backward through the fused kernels (``fp8ops.bench.attention``'s functions):
``separate`` (the dQ kernel of its own, deterministic) and ``atomic`` (dQ accumulated by the dK/dV
kernel with float32 atomics); with ``--config KEY=VALUE ...``, each arm also as a backward launch
config override (an experimental kernel's switch, for instance). Each round times every arm once (CUDA events around 3 calls
after one warm call), so drifts of the GPU's clock fall on every arm alike; prints the median per
arm and its ratio to ``separate``, and writes every sample.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from fp8ops.bench import attention as BA
from fp8ops.bench import common


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--seqlen", type=int, default=8192)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--variants", nargs="+", default=["causal", "none", "alibi", "sliding_window"])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--config", nargs="*", default=[], metavar="KEY=VALUE",
                    help="extra arms: each scheme with this backward launch config override")
    args = ap.parse_args()
    B, H, S, D = args.batch, args.heads, args.seqlen, args.head_dim
    sets = BA._inputs(B, H, H, S, D, 2)
    arms: dict[str, tuple[str, dict[str, int] | None]] = {"separate": ("separate", None), "atomic": ("atomic", None)}
    for item in args.config:
        key, _, value = item.partition("=")
        for mode in ("separate", "atomic"):
            arms[f"{mode} {key}={value}"] = (mode, {key: int(value)})
    record = {"env": common.environment(), "shape": {"B": B, "H": H, "S": S, "D": D}, "rows": []}
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    for variant in args.variants:
        fns = {}
        for name, (mode, cfg) in arms.items():
            fns[name] = BA._fwd_bwd(BA._fp8ops_fn(variant, S, H, None, dq_mode=mode, bwd_config=cfg))
            fns[name](*sets[0])
        torch.cuda.synchronize()
        samples: dict[str, list[float]] = {n: [] for n in fns}
        for r in range(args.rounds):
            for name, fn in fns.items():
                fn(*sets[r % 2])
                ev[0].record()
                for i in range(3):
                    fn(*sets[(r + i) % 2])
                ev[1].record()
                torch.cuda.synchronize()
                samples[name].append(ev[0].elapsed_time(ev[1]) * 1e3 / 3)
        base = statistics.median(samples["separate"])
        for name, xs in samples.items():
            row = {"variant": variant, "arm": name, "median_us": round(statistics.median(xs), 1),
                   "vs_separate": round(statistics.median(xs) / base, 4), "samples_us": [round(x, 1) for x in xs]}
            record["rows"].append(row)
            print(json.dumps(row), flush=True)
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
