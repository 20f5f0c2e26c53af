"""Where the host time of a compiled (not graphed) GPT training step goes: the ``compile`` builds of
``python -m fp8ops.bench gpt`` (torch bf16 and fp8ops FP8), the host time of a step started on an
idle GPU (median of 7), then the cProfile of a few fp8ops steps (the autograd engine's device
threads off, so that the backward runs on the profiled thread) by tottime and by cumtime, and the
library ops a step calls.

    python scripts/compile_host_profile.py [--hidden 512] [--steps 5] [--out DIR] [--ab [--rounds 3]]

``--ab`` instead times the fp8ops step built with the library ops' Triton kernels inlined into its
compiled graphs (``INLINE_IN_GRAPHS``, the default) and with those ops opaque, side by side with
torch's, over ``--rounds`` rounds in alternating order (Inductor's caches off, so that each build
traces anew): host ms of a step started on an idle GPU, ms per step of 20 steps back to back, and
the seconds of the build with its first step (tracing and compiling).

Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import time

import torch

from fp8ops.bench.gpt import SIZES, _size
from fp8ops.bench.step import _variant


def host_ms(step, carry, batch, n: int = 7) -> tuple[float, object]:
    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        carry, _ = step(carry, *batch)
        times.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(times), carry


def step_ms(step, carry, batch, n: int = 20) -> tuple[float, object]:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        carry, _ = step(carry, *batch)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3 / n, carry


def ab(size, rounds: int) -> None:
    from fp8ops.kernels import _library

    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    names = ["torch", "fp8ops FP8, inlined", "fp8ops FP8, opaque"]
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            _library.INLINE_IN_GRAPHS = not name.endswith("opaque")
            torch._dynamo.reset()
            t0 = time.perf_counter()
            step, carry, batch = _variant("gpt2", name.split(",")[0], "compile", size)
            carry, _ = step(carry, *batch)
            torch.cuda.synchronize()
            build_s = time.perf_counter() - t0
            for _ in range(3):
                carry, _ = step(carry, *batch)
            host, carry = host_ms(step, carry, batch)
            ms, carry = step_ms(step, carry, batch)
            print(f"round {r}  {name:22s} host {host:7.2f} ms per step, {ms:7.2f} ms per step back to back, "
                  f"build + first step {build_s:5.1f} s", flush=True)
    _library.INLINE_IN_GRAPHS = True


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=512, choices=sorted(SIZES))
    ap.add_argument("--steps", type=int, default=5, help="profiled fp8ops steps")
    ap.add_argument("--out", default=None, help="write the fp8ops profile to OUT/compile_host.prof")
    ap.add_argument("--ab", action="store_true", help="inlined against opaque library ops (see above)")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    layers, heads = SIZES[args.hidden]
    size = _size(args.hidden, layers, heads, 50304, False)
    if args.ab:
        ab(size, args.rounds)
        return
    results = {}
    for impl in ("torch", "fp8ops FP8"):
        torch._dynamo.reset()
        step, carry, batch = _variant("gpt2", impl, "compile", size)
        for _ in range(4):
            carry, _ = step(carry, *batch)
        with torch.autograd.set_multithreading_enabled(False):
            ms_one, carry = host_ms(step, carry, batch)
        ms, carry = host_ms(step, carry, batch)
        results[impl] = (ms, ms_one)
        print(f"{impl}: host {ms:.2f} ms per step (backward on the engine's thread: {ms_one:.2f} ms)", flush=True)
        if impl != "fp8ops FP8":
            continue
        with torch.autograd.set_multithreading_enabled(False):
            prof = cProfile.Profile()
            torch.cuda.synchronize()
            prof.enable()
            for _ in range(args.steps):
                carry, _ = step(carry, *batch)
            prof.disable()
            torch.cuda.synchronize()
        st = pstats.Stats(prof)
        for key in ("tottime", "cumtime"):
            print(f"\n== fp8ops FP8 compile step, hidden {args.hidden}: cProfile top 45 by {key} "
                  f"({args.steps} steps) ==")
            st.sort_stats(key).print_stats(45)
        if args.out:
            prof.dump_stats(os.path.join(args.out, "compile_host.prof"))
    print({k: [round(v, 2) for v in vals] for k, vals in results.items()})


if __name__ == "__main__":
    main()
