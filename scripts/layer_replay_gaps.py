"""The seed layer's replayed training step against the sum of its kernels, measured inside the replay.

``python -m fp8ops.bench layer --graph`` times the layer's full step (fresh probes, forward,
backward, :func:`fp8ops.update`) as CUDA-graph replays; the profile of an unreplayed step sums its
kernels. The two differ by more than the replay's idle time because a kernel profiled after an idle
gap runs at a higher clock than the same kernel in a sustained loop (the H100 holds its power cap in
these steps: ``scripts/clock_check.py``). This script captures one step as a CUDA graph and replays
it under torch.profiler, so the kernels are summed as they run in the replay:

- the wall time of a replayed step (``perf_counter`` around a synchronized loop of replays);
- the replay's device operations: their summed duration, their span and the idle time between them,
  with the largest gaps;
- the same step unreplayed (eager launches, back to back): its kernels' summed duration.

    python scripts/layer_replay_gaps.py [--impls "fp8ops delayed" "basic SDPA bf16"] [--replays 3]
                                        [--dropout 0.1] [--json OUT]

Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpt_replay_gaps import _gaps  # noqa: E402

from fp8ops.bench import common  # noqa: E402
from fp8ops.bench.layer import SEED, _basic, _fp8ops_case, _module_case, seed_layer_inputs  # noqa: E402

IMPLS = ("fp8ops delayed", "basic SDPA bf16")


def _make(impl: str, seed_state: dict[str, torch.Tensor], config: Any, p: float, x0: torch.Tensor,
          dy0: torch.Tensor) -> tuple[Any, list[torch.Tensor]]:
    import fp8ops

    if impl == "fp8ops delayed":
        step, _, params = _fp8ops_case(seed_state, config, fp8ops.DelayedScaling(), x0, dy0)
    else:
        step, _, params = _module_case(_basic(seed_state, SEED, p, "sdpa", torch.bfloat16), False)
    return common.clearing_grads(step, params), params


def measure(impl: str, seed_state: dict[str, torch.Tensor], config: Any, p: float, replays: int, top: int,
            x0: torch.Tensor, dy: torch.Tensor) -> dict[str, Any]:
    x = x0.detach().clone().requires_grad_()
    fn, _ = _make(impl, seed_state, config, p, x, dy)
    for _ in range(3):
        fn(x, dy)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        fn(x, dy)
    torch.cuda.synchronize()
    eager_ms = (time.perf_counter() - t0) / 10 * 1e3
    unreplayed = _gaps(common.device_events(lambda: fn(x, dy), 2), 2, top)

    graph = common.capture_graph(lambda: fn(x, dy), lambda: fn(x, dy))
    replay_ms = common.replay_wall_ms(graph, 20, warmup=5)
    replayed = _gaps(common.device_events(graph.replay, replays), replays, top)
    del graph
    return {"impl": impl, "eager_step_ms": eager_ms, "replay_step_ms": replay_ms, "replay": replayed,
            "unreplayed": unreplayed}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--impls", nargs="+", default=list(IMPLS), choices=list(IMPLS))
    ap.add_argument("--replays", type=int, default=3)
    ap.add_argument("--top", type=int, default=8)
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    config, seed_state, x, dy = seed_layer_inputs(args.dropout)
    print(common.describe_environment(common.environment()))
    out = []
    for impl in args.impls:
        r = measure(impl, seed_state, config, args.dropout, args.replays, args.top, x, dy)
        out.append(r)
        rp, un = r["replay"], r["unreplayed"]
        within = rp["span_ms"] / rp["busy_ms"] - 1
        print(f"== {impl}: eager step {r['eager_step_ms']:.3f} ms, replayed step {r['replay_step_ms']:.3f} ms")
        print(f"   replay: {rp['ops_per_step']:.0f} device ops, kernels {rp['busy_ms']:.3f} ms, span "
              f"{rp['span_ms']:.3f} ms (span / kernels - 1 = {within * 100:.2f} %), idle {rp['idle_ms']:.3f} ms, "
              f"{rp['gaps_over_5us']:.0f} gaps > 5 µs; replayed step / replay kernels - 1 = "
              f"{(r['replay_step_ms'] / rp['busy_ms'] - 1) * 100:.2f} %")
        print(f"   unreplayed: {un['ops_per_step']:.0f} device ops, kernels {un['busy_ms']:.3f} ms")
        for gap, a, b in rp["top_gaps_us"]:
            print(f"   {gap:8.1f} µs  after {a}  before {b}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"dropout": args.dropout, "rows": out}, f, indent=1)


if __name__ == "__main__":
    main()
