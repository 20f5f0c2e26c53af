"""Where a replayed GPT training step spends the time its kernels do not: the idle gaps of CUDA
graph replays, bf16 against fp8ops FP8.

``python -m fp8ops.bench gpt`` times each implementation's fastest mode, compile + one CUDA graph
per step. At hidden 2048 the FP8 step was 3.1 ms above the sum of its kernels in an unreplayed
compiled step, bf16's 1.9 ms. This script replays the same graphed steps under torch.profiler
(CUDA activity: the kernels, memsets and copies of the replays) and reports per step:

- the wall time of a replayed step (CUDA-event-free: ``perf_counter`` around synchronized loops);
- the kernels' summed duration and their span (first start to last end) in the replay;
- the idle time between consecutive device operations, and the largest gaps with the operations on
  either side of them;
- the same kernels' summed duration in an unreplayed compiled step, to see whether they run
  slower inside the replay (clocks, caches) or the time is idle.

    python scripts/gpt_replay_gaps.py [--hidden 2048] [--impls torch "fp8ops FP8"] [--replays 3] [--json OUT]

Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch

from fp8ops.bench.common import device_events
from fp8ops.bench.gpt import SIZES, _size
from fp8ops.bench.step import _variant


def _gaps(evs: list[Any], calls: int, top: int) -> dict[str, Any]:
    """Summed duration, span and idle time per call, and the ``top`` largest gaps."""
    busy = sum(e.time_range.elapsed_us() for e in evs)
    span = evs[-1].time_range.end - evs[0].time_range.start if evs else 0.0
    gaps = []
    end = evs[0].time_range.end if evs else 0.0
    for prev, e in zip(evs, evs[1:]):
        gap = e.time_range.start - end
        if gap > 0:
            gaps.append((gap, prev.name[:60], e.name[:60]))
        end = max(end, e.time_range.end)
    idle = sum(g for g, _, _ in gaps)
    gaps.sort(key=lambda g: -g[0])
    return {"ops_per_step": len(evs) / calls, "busy_ms": busy / calls / 1e3, "span_ms": span / calls / 1e3,
            "idle_ms": idle / calls / 1e3, "gaps_over_5us": sum(1 for g in gaps if g[0] > 5) / calls,
            "top_gaps_us": [(round(g, 1), a, b) for g, a, b in gaps[:top]]}


def measure(impl: str, size: dict[str, int], replays: int, top: int) -> dict[str, Any]:
    import fp8ops

    step, carry, batch = _variant("gpt2", impl, "compile", size)
    state = {"carry": carry}

    def plain() -> None:
        state["carry"], _ = step(state["carry"], *batch)

    for _ in range(4):
        plain()
    unreplayed = _gaps(device_events(plain, 2), 2, top)
    graphed = fp8ops.graph_step(step)

    def replay() -> None:
        state["carry"], _ = graphed(state["carry"], *batch)

    for _ in range(4):  # capture, then warm replays
        replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        replay()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / 10 * 1e3
    replayed = _gaps(device_events(replay, replays), replays, top)
    return {"impl": impl, "step_ms": wall, "replay": replayed, "unreplayed": unreplayed}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=2048, choices=sorted(SIZES))
    ap.add_argument("--impls", nargs="+", default=["torch", "fp8ops FP8"], choices=["torch", "fp8ops FP8"])
    ap.add_argument("--replays", type=int, default=3)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    layers, heads = SIZES[args.hidden]
    size = _size(args.hidden, layers, heads, 50304, False)
    out = []
    for impl in args.impls:
        r = measure(impl, size, args.replays, args.top)
        out.append(r)
        rp, un = r["replay"], r["unreplayed"]
        print(f"== {impl}, hidden {args.hidden}: step {r['step_ms']:.2f} ms; replay: {rp['ops_per_step']:.0f} ops, "
              f"busy {rp['busy_ms']:.2f} ms, span {rp['span_ms']:.2f} ms, idle {rp['idle_ms']:.2f} ms "
              f"({rp['gaps_over_5us']:.0f} gaps > 5 µs); unreplayed busy {un['busy_ms']:.2f} ms")
        for g, a, b in rp["top_gaps_us"]:
            print(f"   {g:8.1f} µs  after {a}  before {b}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"hidden": args.hidden, "rows": out}, f, indent=1)


if __name__ == "__main__":
    main()
