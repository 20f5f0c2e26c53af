"""Kernels of one full linear-layer training step (the step ``python -m fp8ops.bench linear`` times),
fp8ops delayed against torchao float8 tensorwise + compile, at one shape:

    python scripts/linear_step_profile.py [--shape 8192 4096 12288]

Prints, for each implementation, the profiler's table of the step's CUDA kernels (two steps, after
warm-up) and its kernel count and summed kernel time per step.
"""

from __future__ import annotations

import argparse

import torch

from fp8ops.bench.common import device_ops
from fp8ops.bench.linear import step_case


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", type=int, nargs=3, default=[8192, 4096, 12288], metavar=("M", "K", "N"))
    ap.add_argument("--impls", nargs="+", default=["fp8ops delayed", "torchao tensorwise"])
    args = ap.parse_args()
    M, K, N = args.shape
    for impl in args.impls:
        mode = "compile" if impl.startswith("torchao") else "eager"
        step, carry, batch = step_case(impl, mode, M, K, N)
        for _ in range(4):
            carry, _ = step(carry, *batch)
        torch.cuda.synchronize()
        box = {"carry": carry}

        def one() -> None:
            box["carry"], _ = step(box["carry"], *batch)  # noqa: B023  (run before the next impl)

        n, us = device_ops(one, 2, table=f"{impl} ({mode}) at {M}x{K}->{N}")
        print(f"{impl} ({mode}): {n:.0f} kernels, {us:.0f} µs of kernel time per step\n")


if __name__ == "__main__":
    main()
