"""Hardware counters of the attention kernels in one forward+backward, as the bench runs them
(B = 8, H = 32, S = 8192, d = 128, bf16; the bench's masks), fp8ops next to compiled Flex.

Run under Nsight Compute, which profiles only the range this script marks (one step per case, after
warm-up steps that compile everything):

    ncu --profile-from-start off --clock-control none --section SpeedOfLight ... \\
        python scripts/attn_ncu.py [sliding_window document ...]

Without ncu it runs the same steps and prints, per case, the range it would have profiled; with
``--summarize CSV`` it reads ncu's ``--csv --page details`` output instead and prints one line per
kernel: duration, SM and memory throughput, tensor pipe activity, achieved occupancy, registers,
and the largest warp stall reasons.
"""

from __future__ import annotations

import csv
import importlib
import sys
from collections import defaultdict

CASES = ["sliding_window", "document"]


def run(variants: list[str]) -> None:
    import torch

    BA = importlib.import_module("fp8ops.bench.attention")
    B, H, S, D = 8, 32, 8192, 128
    torch.manual_seed(0)
    q, k, v, do = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_()
    for variant in variants:
        if variant not in BA.VARIANTS:
            raise SystemExit(f"attn_ncu.py: unknown case {variant!r}; the bench's variants: {BA.VARIANTS}")
        docs = BA._documents(S, seed=S) if variant == "document" else None
        for impl, fn in (("fp8ops", BA._fp8ops_fn(variant, S, H, docs)),
                         ("flex", BA._flex_fn(variant, S, H, docs, gqa=False))):
            step = BA._fwd_bwd(fn)
            for _ in range(3):
                step(q, k, v, do)
            torch.cuda.synchronize()
            print(f"== profiled range: {variant} {impl}", flush=True)
            torch.cuda.profiler.start()
            step(q, k, v, do)
            torch.cuda.synchronize()
            torch.cuda.profiler.stop()


# (label, ncu metric name)
_WANTED = [
    ("ms", "Duration"),
    ("SM %", "Compute (SM) Throughput"),
    ("mem %", "Memory Throughput"),
    ("DRAM %", "DRAM Throughput"),
    ("L2 %", "L2 Cache Throughput"),
    ("spill requests", "Local Memory Spilling Requests"),
    ("occ %", "Achieved Occupancy"),
    ("regs", "Registers Per Thread"),
    ("issue %", "Issue Slots Busy"),
]
_MS = {"nsecond": 1e-6, "usecond": 1e-3, "msecond": 1.0, "ns": 1e-6, "us": 1e-3, "ms": 1.0}


def summarize(path: str) -> None:
    """One line per profiled kernel of an ncu ``--csv --page details`` file."""
    kernels: dict[tuple[str, str], dict[str, tuple[str, str]]] = defaultdict(dict)
    order: list[tuple[str, str]] = []
    with open(path, newline="") as f:
        lines = [line for line in f if line.startswith('"')]  # ncu's own messages are not CSV rows
    for row in csv.DictReader(lines):
        key = (row["ID"], row["Kernel Name"])
        if key not in kernels:
            order.append(key)
        name = row["Metric Name"]
        if name == "Memory Throughput" and row["Metric Unit"] != "%":
            continue  # the memory workload section's bytes per second; the speed-of-light percentage kept
        kernels[key][name] = (row["Metric Value"], row["Metric Unit"])
    for key in order:
        m = kernels[key]
        parts = []
        for label, name in _WANTED:
            if name in m:
                val, unit = m[name]
                if name == "Duration":
                    scale = _MS.get(unit)
                    val = f"{float(val.replace(',', '')) * scale:.3f}" if scale else f"{val} {unit}"
                parts.append(f"{label} {val}")
        tensor = m.get("sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active")
        if tensor:
            parts.append(f"tensor pipe % {tensor[0]}")
        print(f"{key[0]:>4} {key[1][:60]:60s} " + ", ".join(parts))
        stalls = sorted(((float(v[0].replace(",", "")), n) for n, v in m.items()
                         if "issue_stalled" in n and v[0].replace(",", "").replace(".", "", 1).isdigit()), reverse=True)
        if stalls:
            print("      stalls per issue: " + "; ".join(
                f"{n.split('issue_stalled_')[1].split('_per_')[0]} {x:.2f}" for x, n in stalls[:6]))


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "--summarize":
        summarize(sys.argv[2])
    else:
        run(sys.argv[1:] or CASES)
