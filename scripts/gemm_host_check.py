"""Host and device time of one FP8 GEMM by each launch path, at tiny and at GPT shapes.

An eager `fp8_linear` forward+backward runs three FP8 GEMMs. This script measures, on one GPU, what
each way of launching one costs the host (a loop of asynchronous calls on tiny operands, where the
GPU finishes each kernel at once: µs per call, best of 3 loops) and the device (CUDA events around
a loop of 20 calls on the GPT benchmark's GEMM shapes, median of 5):

- ``torch._scaled_mm`` (cuBLASLt; one inverse scale per tensor, bf16 out);
- ``fp8ops.gemm.scaled_mm(backend="cublas")``, the library's call of it;
- ``scaled_mm_launch`` with the TMA kernel (where it applies) and with pointer loads, through
  Triton's launch path;
- the pointer-load kernel through the library's cached launch path (``FastKernel``).

    python scripts/gemm_host_check.py [--json OUT]

Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from collections.abc import Callable
from typing import Any

import torch
import triton

from fp8ops.gemm import scaled_mm
from fp8ops.kernels import gemm as kg
from fp8ops.kernels._library import FastKernel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from launch_overhead import per_call_us  # noqa: E402  (host µs per call: best of 3 asynchronous loops)

E4M3 = torch.float8_e4m3fn
# (M, N, K) of the GPT benchmark's layers at hidden 512 and 768 (8192 tokens): fprop QKV / proj /
# fc1 / fc2, and a wgrad (M = out features, K = tokens)
SHAPES = [(8192, 1536, 512), (8192, 512, 512), (8192, 2048, 512), (8192, 512, 2048),
          (8192, 2304, 768), (8192, 3072, 768), (8192, 768, 3072), (1536, 512, 8192), (3072, 768, 8192)]


def device_us(fn: Callable[[], Any], calls: int = 20, samples: int = 5) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(samples):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(calls):
            fn()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) * 1e3 / calls)
    return statistics.median(times)


def paths(M: int, N: int, K: int, fast_accum: bool) -> dict[str, Callable[[], Any]]:
    a = (torch.randn(M, K, device="cuda") * 0.5).to(E4M3)
    b = (torch.randn(N, K, device="cuda") * 0.5).to(E4M3)
    sa, sb = torch.tensor(0.5, device="cuda"), torch.tensor(0.25, device="cuda")
    fast = FastKernel(kg._scaled_mm_fwd_kernel)
    cfg = kg.default_config(fast_accum, tma=False)
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    programs = torch.cuda.get_device_properties(0).multi_processor_count * cfg["PROGRAMS_PER_SM"]
    grid = (min(programs, triton.cdiv(M, bm) * triton.cdiv(N, bn)),)

    def cached() -> torch.Tensor:
        out = torch.empty((M, N), dtype=torch.bfloat16, device="cuda")
        fast[grid](a, b, out, sa, sb, sa, M, N, K, a.stride(0), b.stride(0), N, 0, 0, 0,
                   ROWWISE_A=False, ROWWISE_B=False, HAS_BIAS=False, FAST_ACCUM=fast_accum,
                   PROMOTE_K=min(cfg["PROMOTE_K"], bk), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cfg["GROUP_M"],
                   NUM_PROGRAMS=programs, FLATTEN=bool(cfg["FLATTEN"]), WARP_SPECIALIZE=bool(cfg["WARP_SPECIALIZE"]),
                   num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
        return out

    return {
        "torch._scaled_mm": lambda: torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16,
                                                     use_fast_accum=fast_accum),
        "scaled_mm cublas": lambda: scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16, fast_accum=fast_accum,
                                              backend="cublas"),
        "launch (TMA if possible)": lambda: kg.scaled_mm_launch(a, b, sa, sb, None, torch.bfloat16, fast_accum),
        "launch pointer": lambda: kg.scaled_mm_launch(a, b, sa, sb, None, torch.bfloat16, fast_accum,
                                                      config={"TMA": False}),
        "pointer, cached launch": cached,
        "torch.mm bf16 (control)": (lambda x=a.to(torch.bfloat16), y=b.to(torch.bfloat16): torch.mm(x, y.t())),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)
    rec: dict[str, Any] = {"gpu": torch.cuda.get_device_name(), "host_us": {}, "device_us": []}
    for fast_accum in (False, True):
        for name, fn in paths(128, 128, 128, fast_accum).items():
            us = per_call_us(fn, calls=1000)
            rec["host_us"][f"{name}, fast_accum={fast_accum}"] = us
            print(f"host  128x128x128 fast_accum={fast_accum!s:5}  {name:<26} {us:7.1f} µs")
    for M, N, K in SHAPES:
        for fast_accum in (False, True):
            row: dict[str, Any] = {"M": M, "N": N, "K": K, "fast_accum": fast_accum}
            for name, fn in paths(M, N, K, fast_accum).items():
                row[name] = device_us(fn)
            rec["device_us"].append(row)
            print(f"device {M}x{N}x{K} fast_accum={fast_accum!s:5} "
                  + "  ".join(f"{k}: {v:.1f}" for k, v in row.items() if isinstance(v, float)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rec, f, indent=1)


if __name__ == "__main__":
    main()
