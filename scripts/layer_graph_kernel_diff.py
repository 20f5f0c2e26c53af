"""The seed layer's fp8ops delayed step as one CUDA graph, eager against compiled, kernel by kernel.

``python -m fp8ops.bench layer`` times both builds' full steps (fresh probes, forward, backward,
:func:`fp8ops.update`) as :func:`fp8ops.graph_step` replays. Where the compiled graph is slower
than the eager one, this script says which kernels make the difference: it builds both steps as
the suite does, times each (every step started on an idle GPU, and back to back), replays each
under torch.profiler and groups the replays' device operations by kernel name, then prints

- per build: kernels per step, their summed duration, the span of a replay and its idle time;
- the kernel names whose time per step differs most between the builds (count and µs of each);
- the kernels one build runs and the other does not.

    python scripts/layer_graph_kernel_diff.py [--dropout 0.1] [--rows 30] [--json OUT]

Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpt_replay_gaps import _gaps  # noqa: E402

import fp8ops  # noqa: E402
from fp8ops.bench import common  # noqa: E402
from fp8ops.bench.layer import _fp8ops_case, seed_layer_inputs  # noqa: E402

BUILDS = ("eager", "compiled")


def _build(compiled: bool, seed_state: dict[str, torch.Tensor], config: Any, x: torch.Tensor,
           dy: torch.Tensor) -> Any:
    step, _, _ = _fp8ops_case(seed_state, config, fp8ops.DelayedScaling(), x, dy, compiled=compiled)
    fn, carry0 = step.carry_step
    graphed = fp8ops.graph_step(fn, args_by_reference=(1,))
    carry = [carry0]

    def call() -> None:
        carry[0], _ = graphed(carry[0], x, dy)

    call.graphed = graphed  # type: ignore[attr-defined]
    return call


def _kernels(evs: list[Any], calls: int) -> dict[str, tuple[float, float]]:
    rows: dict[str, list[float]] = collections.defaultdict(list)
    for e in evs:
        rows[e.name[:100]].append(e.time_range.elapsed_us())
    return {k: (len(v) / calls, sum(v) / calls) for k, v in rows.items()}


def measure(compiled: bool, seed_state: dict[str, torch.Tensor], config: Any, x0: torch.Tensor,
            dy: torch.Tensor, replays: int) -> dict[str, Any]:
    x = x0.detach().clone().requires_grad_()
    call = _build(compiled, seed_state, config, x, dy)
    for _ in range(6):  # eager calls, the capture, warm replays
        call()
    torch.cuda.synchronize()
    stats = dict(call.graphed.stats)
    idle = common.time_cuda(lambda a, b: call(), [(x, dy)], samples=20, use_graph=False).median_us
    b2b = statistics.median(common._loop_times(lambda a, b: call(), [(x, dy)], 8, 7))
    evs = common.device_events(call, replays)
    out = {"build": "compiled" if compiled else "eager", "idle_us": idle, "b2b_us": b2b, "stats": stats,
           "gaps": _gaps(evs, replays, 8), "kernels": _kernels(evs, replays)}
    torch._dynamo.reset()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--rows", type=int, default=30)
    ap.add_argument("--replays", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    config, seed_state, x, dy = seed_layer_inputs(args.dropout)
    print(common.describe_environment(common.environment()))
    res = [measure(c, seed_state, config, x, dy, args.replays) for c in (False, True)]
    for r in res:
        g = r["gaps"]
        print(f"== {r['build']}: graph step {r['idle_us']:.0f} µs from idle, {r['b2b_us']:.0f} µs back to back; "
              f"{g['ops_per_step']:.0f} device ops, kernels {g['busy_ms'] * 1e3:.0f} µs, span {g['span_ms'] * 1e3:.0f} µs, "
              f"idle {g['idle_ms'] * 1e3:.0f} µs ({r['stats']})")
        for gap, a, b in g["top_gaps_us"][:4]:
            print(f"   gap {gap:7.1f} µs after {a} before {b}")
    ke, kc = res[0]["kernels"], res[1]["kernels"]
    names = set(ke) | set(kc)
    diff = sorted(names, key=lambda n: -abs(kc.get(n, (0, 0))[1] - ke.get(n, (0, 0))[1]))
    print(f"\n{'eager n':>7} {'µs':>8} {'compiled n':>10} {'µs':>8} {'diff µs':>8}  kernel")
    for n in diff[:args.rows]:
        a, b = ke.get(n, (0, 0.0)), kc.get(n, (0, 0.0))
        print(f"{a[0]:7.0f} {a[1]:8.1f} {b[0]:10.0f} {b[1]:8.1f} {b[1] - a[1]:8.1f}  {n}")
    only_e = sum(ke[n][1] for n in ke if n not in kc)
    only_c = sum(kc[n][1] for n in kc if n not in ke)
    print(f"\nkernels only in eager: {sum(1 for n in ke if n not in kc)} names, {only_e:.0f} µs; "
          f"only in compiled: {sum(1 for n in kc if n not in ke)} names, {only_c:.0f} µs")
    if args.json:
        common.write_json(args.json, {"dropout": args.dropout, "environment": common.environment(), "builds": res})


if __name__ == "__main__":
    main()
