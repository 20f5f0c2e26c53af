"""Compile time of the ``bench gpt`` fp8ops FP8 ``compile`` build, with and without the memo of
torch's Triton kernel analysis (``fp8ops.kernels._library.ANALYSIS_MEMO``), side by side.

Each variant runs in a process of its own with empty Triton and Inductor caches, so both compile
everything from scratch. A variant builds the GPT of ``bench gpt`` at ``--hidden`` (seq 1024, 8
sequences, bf16, delayed scaling, the loss under ``torch.compile(fullgraph=True)``) and times its
first steps (fresh probes, forward, backward, AdamW, ``fp8ops.update``) to the end of each on the
GPU: the first compiles the uncalibrated graphs, the second the calibrated ones (the ``calibrated``
flip), the third runs compiled code only. It also times the calls of torch's kernel analysis
(TTIR generation and its walk) and counts them, and records each step's loss (the two variants
compile the same graphs, so their first losses agree bit for bit).

    python scripts/compile_time_ab.py [--hidden 512] [--steps 3] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def variant(hidden: int, steps: int, memo: bool) -> dict:
    import torch
    from torch._higher_order_ops import triton_kernel_wrap as twrap

    from fp8ops.bench.gpt import SIZES, _size
    from fp8ops.bench.step import _variant
    from fp8ops.kernels import _library as L

    L.ANALYSIS_MEMO = memo
    name = next(n for n in L._ANALYSES if hasattr(twrap, n))
    analysis = getattr(twrap, name)
    spent = {"s": 0.0, "calls": 0}

    def timed(*args, **kw):  # the analysis itself (under the memo when it is on)
        t0 = time.perf_counter()
        try:
            return analysis(*args, **kw)
        finally:
            spent["s"] += time.perf_counter() - t0
            spent["calls"] += 1

    setattr(twrap, name, timed)
    layers, heads = SIZES[hidden]
    size = _size(hidden, layers, heads, 50304, False)
    t0 = time.perf_counter()
    step, carry, batch = _variant("gpt2", "fp8ops FP8", "compile", size, eager_first=False)
    build_s = time.perf_counter() - t0
    times, losses = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        carry, loss = step(carry, *batch)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))
    memo_fn = getattr(twrap, name)
    return {"memo": memo, "hidden": hidden, "layers": layers, "build_s": build_s, "step_s": times,
            "losses": losses, "analysis_s": spent["s"], "analysis_calls": spent["calls"],
            "memo_hits": getattr(memo_fn, "hits", None), "memo_misses": getattr(memo_fn, "misses", None),
            "memo_unkeyed": getattr(memo_fn, "unkeyed", None), "installed": name}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--json", default=None)
    p.add_argument("--one", choices=("on", "off"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.one:
        print(json.dumps(variant(a.hidden, a.steps, a.one == "on")))
        return
    rows = []
    for which in ("off", "on"):
        with tempfile.TemporaryDirectory() as tmp:
            env = dict(os.environ, TRITON_CACHE_DIR=os.path.join(tmp, "triton"),
                       TORCHINDUCTOR_CACHE_DIR=os.path.join(tmp, "inductor"))
            out = subprocess.run([sys.executable, __file__, "--one", which, "--hidden", str(a.hidden),
                                  "--steps", str(a.steps)], env=env, capture_output=True, text=True)
        if out.returncode:
            print(f"memo {which}: failed\n{out.stderr[-4000:]}", flush=True)
            continue
        r = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append(r)
        print(f"memo {which:3s}: build {r['build_s']:.1f} s, steps " + ", ".join(f"{s:.1f}" for s in r["step_s"])
              + f" s; kernel analysis {r['analysis_s']:.1f} s in {r['analysis_calls']} calls"
              + (f" (memo: {r['memo_hits']} hits, {r['memo_misses']} misses, {r['memo_unkeyed']} unkeyed)"
                 if which == "on" else "")
              + f"; losses {r['losses']}", flush=True)
    if len(rows) == 2:
        off, on = rows
        first = sum(off["step_s"][:2]), sum(on["step_s"][:2])
        print(f"first two steps: {first[0]:.1f} s without the memo, {first[1]:.1f} s with it "
              f"({first[1] / first[0]:.2f}x); first losses equal: {off['losses'][0] == on['losses'][0]}")
    if a.json:
        import torch

        with open(a.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
