"""Where an FSDP2 training step of the parallel suite's GPT spends its time on the GPUs: bf16 against
fp8ops FP8 with bf16 or FP8 weight all-gathers (``fp8ops.bench.parallel._fsdp_gpt``), one process
per GPU over NCCL.

    python scripts/fsdp_gpu_profile.py [--hidden 2048] [--layers 4] [--steps 10] [--compile] [--trace] [--out DIR]

For each variant, on rank 0: ms per step (the slower rank's), the host's time to issue a step when
the GPU is not waited for (``host_ms``: the step call's wall time with the queue not full), the
synchronizing CUDA calls per step (``torch.cuda.set_sync_debug_mode``) with where the first ones
came from, the profiler's device time by kind of kernel against the span of a step, the CPU ops
with the most self time, and the garbage collector's collections per step and their time. Writes
``fsdp_gpu_profile.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import time
import traceback
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

KINDS = ("bf16", "FP8, bf16 all-gather", "FP8, FP8 all-gather")


def _syncs(step: Any, batch: Any) -> tuple[int, list[str]]:
    seen: collections.Counter[str] = collections.Counter()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as ws:
            warnings.simplefilter("always")
            step(None, *batch)
            for w in ws:
                if "synchroniz" in str(w.message):
                    where = [f for f in traceback.extract_stack() if "site-packages" not in f.filename][-3:]
                    seen[f"{w.filename}:{w.lineno} " + " <- ".join(f"{f.name}" for f in where)] += 1
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return sum(seen.values()), [f"{n}x {k}" for k, n in seen.most_common(8)]


class _GCTimer:
    """Collections by Python's garbage collector and the time they take, while installed."""

    def __init__(self) -> None:
        self.count, self.seconds, self._t0 = [0, 0, 0], 0.0, 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.count[info["generation"]] += 1
            self.seconds += time.perf_counter() - self._t0


def _worker(rank: int, world: int, args: argparse.Namespace, init: str) -> None:
    from fp8ops.bench.parallel import _fsdp_gpt, _kernel_profile

    if args.launch_paths != "default":
        from fp8ops.kernels import _library

        _library.EAGER_DIRECT, _library.TMA_STORE_MIN_ELEMENTS, _library.AMAX_CHAIN.eager = False, 0, False
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=init, rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))
    size = {"layers": args.layers, "hidden": args.hidden, "heads": args.hidden // 128, "seq": 1024,
            "batch": args.batch, "vocab": 32768}
    out: dict[str, Any] = {"size": size, "launch_paths": args.launch_paths, "compile": args.compile, "rows": []}
    for kind in [k for k in KINDS if k in args.kinds]:
        torch._dynamo.reset()
        step, _, batch = _fsdp_gpt(size, rank, world, kind, wrap=args.wrap,
                                   compile_backend="inductor" if args.compile else None)
        for _ in range(4):
            step(None, *batch)
        torch.cuda.synchronize()
        if args.no_gc:
            gc.collect()
            gc.disable()
        dist.barrier()
        gct = _GCTimer()
        gc.callbacks.append(gct)
        t0 = time.perf_counter()
        for _ in range(args.steps):
            step(None, *batch)
        torch.cuda.synchronize()
        gc.callbacks.remove(gct)
        ms = torch.tensor((time.perf_counter() - t0) / args.steps * 1e3, device="cuda")
        dist.all_reduce(ms, op=dist.ReduceOp.MAX)
        # host time: each step issued right after a synchronize, timed to its return
        host = []
        for _ in range(args.steps):
            torch.cuda.synchronize()
            dist.barrier()
            h0 = time.perf_counter()
            step(None, *batch)
            host.append((time.perf_counter() - h0) * 1e3)
        torch.cuda.synchronize()
        n_sync, where = _syncs(step, batch)
        torch.cuda.synchronize()
        _, kprof = _kernel_profile(step, None, batch)
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=acts) as prof:  # CUDA too: the runtime calls' host time
            step(None, *batch)
            torch.cuda.synchronize()
        cpu_top = [(e.key[:80], round(e.self_cpu_time_total / 1e3, 3), e.count)
                   for e in sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:25]]
        if args.trace and rank == 0:  # that step's host and device timeline, for chrome://tracing or Perfetto
            name = f"trace_{kind.replace(', ', '_').replace(' ', '-')}.json.gz"
            prof.export_chrome_trace(os.path.join(args.out, name))
        if args.cprofile:  # every rank steps (the collectives pair up); rank 0 prints
            import cProfile
            import io
            import pstats
            cp = cProfile.Profile()
            cp.enable()
            step(None, *batch)
            cp.disable()
            torch.cuda.synchronize()
            if rank == 0:
                buf = io.StringIO()
                stats = pstats.Stats(cp, stream=buf)
                stats.sort_stats("tottime").print_stats(40)
                stats.sort_stats("cumulative").print_stats(60)
                print(kind, buf.getvalue(), flush=True)
        gc.enable()
        row = {"variant": kind, "gc_disabled": args.no_gc, "ms": float(ms),
               "host_ms_median": sorted(host)[len(host) // 2],
               "gc_per_step": {"collections": [c / args.steps for c in gct.count],
                               "ms": gct.seconds / args.steps * 1e3},
               "syncs_per_step": n_sync, "sync_sites": where, "profile": kprof, "cpu_top_ms": cpu_top}
        out["rows"].append(row)
        if rank == 0:
            print(json.dumps({k: row[k] for k in ("variant", "ms", "host_ms_median", "gc_per_step", "syncs_per_step")}),
                  flush=True)
            print("  kernels", json.dumps({k: kprof.get(k) for k in ("kernels_per_step", "span_ms", "kernel_ms")}))
            for s in where:
                print("  sync", s)
            for name, self_ms, count in cpu_top:
                print(f"  cpu {self_ms:8.3f} ms {count:6d}x {name}")
        del step, batch
        torch.cuda.empty_cache()
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "fsdp_gpu_profile.json"), "w") as f:
            json.dump(out, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--wrap", choices=("block", "linear"), default="block", help="FSDP2 groups: per block or per Linear")
    ap.add_argument("--out", default=".")
    ap.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    ap.add_argument("--launch-paths", choices=("default", "before"), default="default",
                    help="'before': every fp8ops library op called through torch.ops, every transposed FP8 copy "
                         "stored through a tensor map and a fill kernel for every amax output "
                         "(kernels/_library.EAGER_DIRECT off, TMA_STORE_MIN_ELEMENTS 0, AMAX_CHAIN.eager off), "
                         "for comparisons")
    ap.add_argument("--compile", action="store_true", help="each FSDP2 group's module compiled (Inductor), as the "
                    "suite's '+ compile' variants")
    ap.add_argument("--no-gc", action="store_true", help="Python's garbage collector off while steps are timed "
                    "and profiled (to see what its collections cost)")
    ap.add_argument("--trace", action="store_true", help="write rank 0's chrome trace of one step per variant "
                    "(trace_<variant>.json.gz under --out)")
    ap.add_argument("--cprofile", action="store_true", help="print rank 0's cProfile top by own and by cumulative time")
    args = ap.parse_args()
    world = torch.cuda.device_count()
    init = f"file://{os.path.abspath(os.path.join(args.out, '.fsdp_init'))}"
    os.makedirs(args.out, exist_ok=True)
    if os.path.exists(init[7:]):
        os.remove(init[7:])
    mp.spawn(_worker, args=(world, args, init), nprocs=world, join=True)


if __name__ == "__main__":
    main()
