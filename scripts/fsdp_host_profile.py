"""Host cost of an FSDP2 training step of the parallel suite's GPT, bf16 against fp8ops FP8 with
bf16 or FP8 weight all-gathers, on one process (gloo, world size 1) on the CPU.

``python -m fp8ops.bench parallel`` found the FSDP2 step with FP8 all-gathers 1.84x the bf16 step at
hidden 2048 on two GPUs, and level with it at hidden 4096: at the small size the step is bound by the
host. This script runs that suite's model construction and step (``fp8ops.bench.parallel._fsdp_gpt``:
``fully_shard`` of every Linear, then of the root; ``MixedPrecisionPolicy(bfloat16, float32)``; AdamW
with ``foreach``; ``fp8ops.nn.update_scaling`` each step) on the CPU at a tiny size, so that the step
time is the host's:

    python scripts/fsdp_host_profile.py [--stub-kernels] [--profile] [--layers 4] [--hidden 64]

``--stub-kernels`` registers each ``fp8ops::`` op's fake kernel as its CPU kernel (shapes only, no
arithmetic: what is left is the Python and dispatch around the ops); ``--profile`` prints cProfile's
top functions of the last variant. Prints ms per step of each variant and the ratios to bf16.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from fp8ops.bench.parallel import _fsdp_gpt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--stub-kernels", action="store_true", help="fp8ops kernels as shape-only stubs")
    ap.add_argument("--profile", action="store_true", help="cProfile the last variant")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--wrap", choices=("block", "linear"), default="block", help="FSDP2 groups: per block or per Linear")
    args = ap.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("gloo", rank=0, world_size=1)
    if args.stub_kernels:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import host_profile

        host_profile.stub_kernels()
    times: dict[str, float] = {}
    kinds = ["bf16", "FP8, bf16 all-gather", "FP8, FP8 all-gather"]
    size = {"layers": args.layers, "hidden": args.hidden, "heads": 4, "seq": 32, "batch": 2, "vocab": 256}
    for kind in kinds:
        step, _, batch = _fsdp_gpt(size, 0, 1, kind, device="cpu", wrap=args.wrap)  # the suite's construction, on the CPU

        def run(step: Any = step, batch: Any = batch) -> None:
            step(None, *batch)

        for _ in range(3):
            run()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            run()
        times[kind] = (time.perf_counter() - t0) / args.steps * 1e3
        print(f"{kind:22s} {times[kind]:7.2f} ms/step  {times[kind] / times['bf16']:.2f}x bf16", flush=True)
    if args.profile:  # the last variant
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(5):
            run()
        prof.disable()
        pstats.Stats(prof).sort_stats("cumulative").print_stats(40)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
