"""Launch configurations or dQ schemes of the attention kernels side by side on the GPU,
interleaved round by round (the benchmark's variants and inputs, ``fp8ops.bench.attention``).

    python scripts/attn_ab.py OUT.json [--pass fwd|bwd] [--seqlen 8192] [--batch 8] [--heads 32]
        [--head-dim 128] [--variants document] [--configs ARM ...] [--rounds 8] [--gap-ms 100]
        [--calls 3] [--graph]

Arms: the library's default and each ``--configs`` entry. ``--pass fwd`` times the forward and an
arm is a forward launch configuration ``BLOCK_M,BLOCK_N,num_warps,num_stages,TMA``; ``--pass bwd``
times forward+backward and an arm is a dQ scheme with optional backward config overrides,
``separate`` / ``atomic`` / ``atomic:BLOCK_M1=32,num_warps1=4``. Each round times every arm once,
in a new random order, each after ``--gap-ms`` of idle GPU (CUDA events around ``--calls`` calls
after one warm call, or around a replay of a CUDA graph of them with ``--graph``, as ``bench
attention`` times), so that neither the clock's drift nor the heat of the arm before falls on one
arm more than another; prints the median per arm and its ratio to the default, and writes every
sample. An arm equal to the default (its tiles given explicitly, or the default dQ scheme by name)
shows what is left of the noise.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import time
from typing import Any

import torch

from fp8ops.bench import attention as BA
from fp8ops.bench import common


def _arm(pass_: str, variant: str, S: int, H: int, docs: Any, arm: Any) -> Any:
    """The function an arm times: the forward with a launch config, or forward+backward with a dQ
    scheme and backward config (None: the library's default)."""
    if pass_ == "fwd":
        if arm is None:
            return BA._fp8ops_fn(variant, S, H, docs)
        return BA._fp8ops_fn(variant, S, H, docs, dq_mode="separate", fwd_config=arm)
    mode, cfg = arm if arm is not None else (None, None)
    return BA._fwd_bwd(BA._fp8ops_fn(variant, S, H, docs, dq_mode=mode, bwd_config=cfg))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--seqlen", type=int, default=8192)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--variants", nargs="+", default=["document"])
    ap.add_argument("--pass", dest="pass_", choices=("fwd", "bwd"), default="fwd",
                    help="fwd: the forward's launch configs; bwd: forward+backward, dQ schemes")
    ap.add_argument("--configs", nargs="+", default=None, metavar="ARM",
                    help="fwd: M,N,W,S,TMA (default 64,64,4,2,1 64,64,4,3,1 128,64,8,3,1); "
                         "bwd: separate, atomic or atomic:KEY=V,... (default separate atomic)")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--gap-ms", type=float, default=100.0, help="idle time before each arm's timing")
    ap.add_argument("--calls", type=int, default=3, help="calls per timing (default 3)")
    ap.add_argument("--graph", action="store_true", help="time a CUDA graph of the calls (as the bench does)")
    args = ap.parse_args()
    if args.configs is None:
        fwd_arms = ["64,64,4,2,1", "64,64,4,3,1", "128,64,8,3,1"]
        args.configs = fwd_arms if args.pass_ == "fwd" else ["separate", "atomic"]
    B, H, S, D = args.batch, args.heads, args.seqlen, args.head_dim
    sets = BA._inputs(B, H, H, S, D, 2)
    if args.pass_ == "fwd":
        sets = [s[:3] for s in sets]
    arms: dict[str, Any] = {"default": None}
    for c in args.configs:
        if args.pass_ == "fwd":
            m, n, w, st, tma = (int(x) for x in c.split(","))
            arms[c] = {"BLOCK_M": m, "BLOCK_N": n, "num_warps": w, "num_stages": st, "TMA": tma}
        else:
            mode, _, over = c.partition(":")
            arms[c] = (mode, {k: int(v) for k, v in (kv.split("=") for kv in over.split(","))} if over else None)
    record = {"env": common.environment(), "shape": {"B": B, "H": H, "S": S, "D": D}, "rows": []}
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    rng = random.Random(0)
    with torch.no_grad() if args.pass_ == "fwd" else contextlib.nullcontext():
        for variant in args.variants:
            docs = BA._documents(S, 0) if variant == "document" else None
            fns = {name: _arm(args.pass_, variant, S, H, docs, arm) for name, arm in arms.items()}
            for fn in fns.values():
                fn(*sets[0])
            torch.cuda.synchronize()
            graphs: dict[str, torch.cuda.CUDAGraph] = {}
            for name, fn in fns.items() if args.graph else ():  # one graph of --calls calls per arm
                graphs[name] = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graphs[name]):
                    for i in range(args.calls):
                        fn(*sets[i % 2])
            torch.cuda.synchronize()
            samples: dict[str, list[float]] = {n: [] for n in fns}
            for r in range(args.rounds):
                names = list(fns)
                rng.shuffle(names)  # a new order every round
                for name in names:
                    fn = fns[name]
                    torch.cuda.synchronize()
                    time.sleep(args.gap_ms / 1e3)  # every arm starts from an idle GPU
                    if graphs:
                        graphs[name].replay()
                        ev[0].record()
                        graphs[name].replay()
                    else:
                        fn(*sets[r % 2])
                        ev[0].record()
                        for i in range(args.calls):
                            fn(*sets[(r + i) % 2])
                    ev[1].record()
                    torch.cuda.synchronize()
                    samples[name].append(ev[0].elapsed_time(ev[1]) * 1e3 / args.calls)
            base = statistics.median(samples["default"])
            for name, xs in samples.items():
                row = {"variant": variant, "arm": name, "median_us": round(statistics.median(xs), 1),
                       "vs_default": round(statistics.median(xs) / base, 4), "samples_us": [round(x, 1) for x in xs]}
                record["rows"].append(row)
                print(json.dumps(row), flush=True)
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
