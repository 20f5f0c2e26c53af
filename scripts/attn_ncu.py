"""One forward+backward of ``fp8ops.attention`` per case, with the CUDA profiler started around it
only, for Nsight Compute (B = 8, H = 32, S = 8192, d = 128, bf16; the bench's masks). Warm-up steps
run first with the profiler off, so that compiling and the first launches stay out of the report.

    ncu --profile-from-start off --clock-control none --kernel-name regex:hopper ... \\
        python scripts/attn_ncu.py [sliding_window document causal ...]

``scripts/attn_ncu.sh OUTDIR`` runs it under ``ncu`` with the sections used in
``docs/benchmarks/attention_hopper_h100.md`` and exports their tables as CSV.
"""

from __future__ import annotations

import sys

import torch

from fp8ops.bench import attention as BA


def main(variants: list[str]) -> None:
    B, H, S, D = 8, 32, 8192, 128
    torch.manual_seed(0)
    q, k, v, do = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_()
    for variant in variants:
        docs = BA._documents(S, seed=S) if variant == "document" else None
        step = BA._fwd_bwd(BA._fp8ops_fn(variant, S, H, docs))
        for _ in range(3):
            step(q, k, v, do)
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        step(q, k, v, do)
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
        print(f"profiled: {variant}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or ["sliding_window", "document", "causal"])
