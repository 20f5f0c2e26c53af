"""GPU clocks and power while full training steps run eagerly and as CUDA-graph replays.

Kernels of a replayed step have measured 6-12 % longer than the same kernels in an eagerly launched,
host-bound step (``docs/benchmarks/linear.md``, ``layer.md``, ``gpt.md``). This script runs the
full steps of ``python -m fp8ops.bench linear`` (one linear layer: probe, forward, backward,
``fp8ops.update``, fused AdamW) for a few seconds in each mode while ``nvidia-smi`` samples the SM
clock, the power draw and the active clock-event reasons every 20 ms, and prints per phase: the
time per step, the median and lowest SM clock, the median power, and the reasons seen (bit 0x4:
software power cap; 0x1: idle).

    python scripts/clock_check.py OUT_DIR [--shape 8192 4096 12288] [--seconds 4]

``--layer`` runs the seed layer's training steps of ``python -m fp8ops.bench layer`` instead (fp8ops
delayed, torchao tensorwise + compile, the basic fp16 layer; dropout 0.1), each in two phases:
steps back to back, and bursts of two steps each started on an idle GPU (a synchronize and 50 ms
of idle before each burst, CUDA events around it), as the suite times a step. Each row also gives
the energy per step (median power x time per step), which bounds the step where the GPU holds its
power cap.

    python scripts/clock_check.py OUT_DIR --layer [--impls "fp8ops delayed" ...] [--seconds 4] [--graph]

``--layer --graph``: each implementation's step captured once as a CUDA graph
(``fp8ops.graph_step``, the fp8ops state carried from call to call) and replayed in both phases.

Needs a CUDA GPU and ``nvidia-smi``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import threading
import time

import torch

import fp8ops
from fp8ops.bench.linear import step_case

FIELDS = "clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active"


class Sampler:
    """``nvidia-smi`` samples stamped with this process's clock as they arrive."""

    def __init__(self, index: int) -> None:
        self.rows: list[tuple[float, list[str]]] = []
        self.proc = subprocess.Popen(
            ["nvidia-smi", "-i", str(index), f"--query-gpu={FIELDS}", "--format=csv,noheader,nounits", "-lms", "20"],
            stdout=subprocess.PIPE, text=True, bufsize=1)
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.rows.append((time.perf_counter(), [x.strip() for x in line.split(",")]))

    def between(self, t0: float, t1: float) -> dict[str, object]:
        got = [r for t, r in self.rows if t0 <= t <= t1]
        clocks = [float(r[0]) for r in got if r[0].replace(".", "").isdigit()]
        power = [float(r[1]) for r in got if r[1].replace(".", "").isdigit()]
        reasons = sorted({r[3] for r in got})
        return {"samples": len(got), "sm_mhz_median": statistics.median(clocks) if clocks else None,
                "sm_mhz_min": min(clocks) if clocks else None,
                "power_w_median": statistics.median(power) if power else None,
                "temp_c_max": max((float(r[2]) for r in got if r[2].isdigit()), default=None),
                "reasons": reasons}

    def stop(self) -> None:
        self.proc.terminate()


def phase(step, carry, batch, seconds: float, sampler: Sampler) -> tuple[dict[str, object], object]:
    for _ in range(3):
        carry, _ = step(carry, *batch)
    torch.cuda.synchronize()
    time.sleep(1.0)  # idle: the GPU cools down to the same start in every phase
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(10):
            carry, _ = step(carry, *batch)
        n += 10
        torch.cuda.synchronize()
    t1 = time.perf_counter()
    # the second half of the phase: the GPU in its steady state
    return {"us_per_step": (t1 - t0) / n * 1e6, "steps": n, **sampler.between(t0 + (t1 - t0) / 2, t1)}, carry


def layer_cases(names: list[str], graph: bool = False) -> dict[str, object]:
    """name -> ``make()`` returning ``(step(x, dy), (x, dy))`` for the seed layer's training step."""
    from fp8ops.bench import common
    from fp8ops.bench.layer import _basic, _fp8ops_case, _module_case, _torchao_case, seed_layer_inputs

    config, seed_state, x, dy = seed_layer_inputs(0.1)
    dims = {"hidden": config.hidden_size, "ffn": config.ffn_hidden_size, "heads": config.num_attention_heads}

    def made(case, batch):
        step, _, params = case
        if not graph:
            return common.clearing_grads(step, params), batch
        fn, carry0 = step.carry_step  # what bench layer's graph rows replay
        graphed = fp8ops.graph_step(fn, args_by_reference=(1,))
        carry = [carry0]

        def run(xx, dd):
            carry[0], _ = graphed(carry[0], xx, dd)

        run.stats = graphed.stats
        return run, batch

    def fp8ops_delayed():
        return made(_fp8ops_case(seed_state, config, fp8ops.DelayedScaling(), x, dy), (x, dy))

    def torchao():
        return made(_torchao_case(_basic(seed_state, dims, 0.1, "sdpa", torch.bfloat16), "tensorwise"), (x, dy))

    def basic_fp16():
        xh = x.detach().half().requires_grad_()
        return made(_module_case(_basic(seed_state, dims, 0.1, "bmm", torch.float16), False), (xh, dy.half()))

    known = {"fp8ops delayed": fp8ops_delayed, "torchao tensorwise + compile": torchao, "basic fp16": basic_fp16}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"clock_check.py: --impls {unknown} with --layer: expected some of {sorted(known)}")
    return {n: known[n] for n in names}


def layer_phases(step, batch, seconds: float, sampler: Sampler) -> list[dict[str, object]]:
    """Back-to-back steps, then bursts of two steps each started on an idle GPU."""
    for _ in range(3):
        step(*batch)
    torch.cuda.synchronize()
    time.sleep(1.0)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(10):
            step(*batch)
        n += 10
        torch.cuda.synchronize()
    t1 = time.perf_counter()
    b2b = {"phase": "back to back", "us_per_step": (t1 - t0) / n * 1e6, "steps": n,
           **sampler.between(t0 + (t1 - t0) / 2, t1)}
    torch.cuda.synchronize()
    time.sleep(1.0)
    times, t0 = [], time.perf_counter()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    while time.perf_counter() - t0 < seconds:
        torch.cuda.synchronize()
        time.sleep(0.05)
        start.record()
        step(*batch)
        step(*batch)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / 2)
    t1 = time.perf_counter()
    bursts = {"phase": "bursts from idle", "us_per_step": statistics.median(times), "steps": 2 * len(times),
              **sampler.between(t0, t1)}
    for r in (b2b, bursts):
        if r.get("power_w_median") is not None:
            r["energy_j_per_step"] = r["power_w_median"] * r["us_per_step"] * 1e-6
    return [b2b, bursts]


def main_layer(args: argparse.Namespace) -> None:
    names = args.impls if args.impls_given else ["fp8ops delayed", "torchao tensorwise + compile", "basic fp16",
                                                 "fp8ops delayed"]
    cases = layer_cases(names, args.graph)
    sampler = Sampler(torch.cuda.current_device())
    rows = []
    try:
        for name in names:
            torch._dynamo.reset()
            step, batch = cases[name]()
            for r in layer_phases(step, batch, args.seconds, sampler):
                rows.append({"impl": name, "graph": args.graph, **r})
                if args.graph:
                    rows[-1]["graph_stats"] = dict(step.stats)
                print(json.dumps(rows[-1]), flush=True)
            del step, batch
            torch.cuda.empty_cache()
    finally:
        sampler.stop()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "clock_check_layer_graph.json" if args.graph else "clock_check_layer.json"),
              "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "case": "seed layer, dropout 0.1",
                   "rows": rows}, f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--shape", type=int, nargs=3, default=[8192, 4096, 12288], metavar=("M", "K", "N"))
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--impls", nargs="+", default=None)
    ap.add_argument("--layer", action="store_true", help="the seed layer's training steps (see the module docstring)")
    ap.add_argument("--graph", action="store_true", help="with --layer: each step replayed as one CUDA graph")
    args = ap.parse_args()
    args.impls_given = args.impls is not None
    if args.layer:
        main_layer(args)
        return
    if args.impls is None:
        args.impls = ["fp8ops delayed", "bf16 F.linear"]
    M, K, N = args.shape
    sampler = Sampler(torch.cuda.current_device())
    rows = []
    try:
        for impl in args.impls:
            for mode in ("eager", "graph", "eager"):
                torch._dynamo.reset()
                step, carry, batch = step_case(impl, mode, M, K, N)
                fn = fp8ops.graph_step(step, args_by_reference=(1,)) if mode == "graph" else step
                r, _ = phase(fn, carry, batch, args.seconds, sampler)
                rows.append({"impl": impl, "mode": mode, **r})
                print(json.dumps(rows[-1]), flush=True)
                del step, fn, carry, batch
                torch.cuda.empty_cache()
    finally:
        sampler.stop()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "clock_check.json"), "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "shape": [M, K, N],
                   "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
