"""The seed layer's fp8ops delayed step, eager and under torch.compile(fullgraph=True), side by side:
CUDA-event time of each (median of 20 steps, each started on an idle GPU, as ``bench layer`` times
them), the per-step time of 10 steps launched back to back (steady state: the host prepares a step
while the GPU runs the one before), the host time of one step started on an idle GPU, the kernels of
a profiled step grouped by name with the rows where the two differ, and the GPU's largest idle gaps
between kernels.

    python scripts/layer_compile_profile.py [--dropout 0.1] [--rows 40]
"""
from __future__ import annotations

import argparse
import collections
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

import fp8ops
from fp8ops.bench import common
from fp8ops.bench.layer import _fp8ops_case, seed_layer_inputs


def kernels(fn, x, dy, gaps: int) -> tuple[dict[str, tuple[int, float]], float]:
    fn(x, dy)  # the step before the profiled one is in flight when it starts, as in a training loop
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn(x, dy)
        fn(x, dy)
        torch.cuda.synchronize()
    rows: dict[str, list[float]] = collections.defaultdict(list)
    spans = []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            rows[e.name[:90]].append(e.device_time if hasattr(e, "device_time") else e.cuda_time)
            spans.append((e.time_range.start, e.time_range.end, e.name[:60]))
    out = {k: (len(v) // 2, sum(v) / 2) for k, v in rows.items()}  # per step (two were profiled)
    if gaps:
        # the largest idle stretches of the GPU between consecutive kernels (both profiled steps)
        spans.sort()
        idle, end, prev = [], spans[0][1], spans[0][2]
        for s0, s1, name in spans[1:]:
            if s0 > end:
                idle.append((s0 - end, prev, name))
            if s1 > end:
                end, prev = s1, name
        total = sum(g for g, _, _ in idle)
        print(f"  GPU idle between kernels: {total / 2:.0f} µs per step in {len(idle)} gaps; largest:")
        for g, a, b in sorted(idle, reverse=True)[:gaps]:
            print(f"    {g:7.1f} µs  after {a}  before {b}")
    return out, sum(t for _, t in out.values())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--rows", type=int, default=40)
    ap.add_argument("--gaps", type=int, default=12, help="print the largest GPU idle gaps (0: none)")
    ap.add_argument("--host-profile", type=int, default=0, metavar="N",
                    help="also print the cProfile top N host functions of 5 steps of each mode (backward on the "
                         "calling thread)")
    args = ap.parse_args()
    cfg, seed_state, x, dy = seed_layer_inputs(args.dropout)
    res = {}
    for label, compiled in (("eager", False), ("compile", True)):
        step, _, params = _fp8ops_case(seed_state, cfg, fp8ops.DelayedScaling(), x, dy, compiled=compiled)
        fn = common.clearing_grads(step, params)
        for _ in range(3):
            fn(x, dy)
        t = common.time_cuda(fn, [(x, dy)], samples=20, use_graph=False)
        loop = statistics.median(common._loop_times(fn, [(x, dy)], 10, 5))
        host = []
        for _ in range(5):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn(x, dy)
            host.append((time.perf_counter() - t0) * 1e6)
        torch.cuda.synchronize()
        if args.host_profile:
            import cProfile
            import pstats

            prof = cProfile.Profile()
            with torch.autograd.set_multithreading_enabled(False):
                prof.enable()
                for _ in range(5):
                    fn(x, dy)
                torch.cuda.synchronize()
                prof.disable()
            print(f"== {label}: cProfile of 5 steps, top {args.host_profile} by tottime")
            pstats.Stats(prof).sort_stats("tottime").print_stats(args.host_profile)
        print(f"{label}: step started on an idle GPU {t.median_us:.0f} µs; 10 steps back to back {loop:.0f} µs "
              f"per step; host time of a step {statistics.median(host):.0f} µs", flush=True)
        k, total = kernels(fn, x, dy, args.gaps)
        res[label] = (t.median_us, k, total)
        print(f"{label}: step {t.median_us:.0f} µs, {sum(n for n, _ in k.values())} kernels, "
              f"kernel time {total:.0f} µs", flush=True)
    (_, ke, _), (_, kc, _) = res["eager"], res["compile"]
    names = sorted(set(ke) | set(kc), key=lambda n: -abs(kc.get(n, (0, 0.0))[1] - ke.get(n, (0, 0.0))[1]))
    print(f"\n{'kernel':90s} {'eager n':>7s} {'µs':>8s} {'compile n':>9s} {'µs':>8s}")
    for n in names[:args.rows]:
        a, b = ke.get(n, (0, 0.0)), kc.get(n, (0, 0.0))
        print(f"{n:90s} {a[0]:7d} {a[1]:8.1f} {b[0]:9d} {b[1]:8.1f}")


if __name__ == "__main__":
    main()
