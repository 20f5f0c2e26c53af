"""Sequence-parallel FP8 GEMMs with their collectives, on 2 GPUs: NCCL (functional collectives) next
to the micro-pipelined symmetric-memory ops of torch.distributed (``symm_mem``), at the seed layer's
shapes (8192 tokens, hidden 4096, ffn 16384, TP=2).

- all-gather + GEMM (QKV and fc1 forward; the row-parallel dgrad): ``all_gather_tensor`` of this
  rank's FP8 rows, then ``_scaled_mm``; against ``symm_mem.fused_all_gather_scaled_matmul``, which
  multiplies the local rows while the remote rows are copied (copy engine), and returns the gathered
  rows too (wgrad needs them).
- GEMM + reduce-scatter (proj and fc2 forward): ``_scaled_mm`` then ``reduce_scatter_tensor``;
  against ``symm_mem.fused_scaled_matmul_reduce_scatter`` (the remote rows' partial sums first,
  pulled by the other rank while this rank's rows are computed, then one sum).

Per case: the largest difference between the two results, and µs per call in eager mode and as
CUDA graph replays (ten calls per graph); rank 0 prints one line per case and writes
``$OUT/symm_mem_tp.json`` when OUT is set.

Usage: ``NCCL_NVLS_ENABLE=0 python scripts/symm_mem_tp_check.py`` on a host with two GPUs.
"""

from __future__ import annotations

import json
import os
import tempfile
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TOKENS = 8192
E4M3 = torch.float8_e4m3fn
# (name, kind, K of the GEMM on this rank, N of this rank)
CASES = [
    ("qkv fwd: all-gather + GEMM", "ag", 4096, 6144),
    ("fc1 fwd: all-gather + GEMM", "ag", 4096, 8192),
    ("fc2 dgrad: all-gather + GEMM", "ag", 4096, 8192),
    ("proj fwd: GEMM + reduce-scatter", "rs", 2048, 4096),
    ("fc2 fwd: GEMM + reduce-scatter", "rs", 8192, 4096),
]


def _time(fn, graph: bool, iters: int = 10, reps: int = 5) -> float:
    """µs per call: eager (after warm-up) or replays of a graph of ``iters`` calls."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    if graph:
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
            torch.cuda.synchronize()
            with torch.cuda.graph(g, stream=s):
                for _ in range(iters):
                    fn()
        torch.cuda.current_stream().wait_stream(s)
        g.replay()
        torch.cuda.synchronize()
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            g.replay()
        end.record()
    else:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps * iters):
            fn()
        end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (reps * iters)


def _worker(rank: int, world: int, init: str, out: str | None) -> None:
    import torch.distributed._functional_collectives as fc
    import torch.distributed._symmetric_memory as symm

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init}", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))
    group = dist.group.WORLD
    name = group.group_name
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if hasattr(symm, "enable_symm_mem_for_group"):
            symm.enable_symm_mem_for_group(name)
    g = torch.Generator(device="cuda").manual_seed(rank)
    one = torch.ones((), device="cuda")
    rows = []
    for case, kind, k, n in CASES:
        w = torch.randn(n, k, device="cuda", generator=g).to(E4M3)  # (N, K): B = w.t() is K-major
        ws = torch.full((), 0.5, device="cuda")
        if kind == "ag":
            a = torch.randn(TOKENS // world, k, device="cuda", generator=g).to(E4M3)

            def plain():
                full = fc.all_gather_tensor(a.view(torch.uint8), 0, group).wait().view(E4M3)
                return full, torch._scaled_mm(full, w.t(), scale_a=one, scale_b=ws, out_dtype=torch.bfloat16)

            def fused():
                full, (y,) = torch.ops.symm_mem.fused_all_gather_scaled_matmul(
                    a, [w.t()], one, [ws], 0, name, [None], [None], [torch.bfloat16], [False])
                return full, y

            (fa, ya), (fb, yb) = plain(), fused()
            diff = max(float((fa.float() - fb.float()).abs().max()), float((ya.float() - yb.float()).abs().max()))
        else:
            a = torch.randn(TOKENS, k, device="cuda", generator=g).to(E4M3)

            def plain():
                y = torch._scaled_mm(a, w.t(), scale_a=one, scale_b=ws, out_dtype=torch.bfloat16)
                return fc.reduce_scatter_tensor(y, "sum", 0, group).wait()

            def fused():
                return torch.ops.symm_mem.fused_scaled_matmul_reduce_scatter(
                    a, w.t(), one, ws, "sum", 0, 0, name, [TOKENS, n], out_dtype=torch.bfloat16)

            ya, yb = plain(), fused()
            diff = float((ya.float() - yb.float()).abs().max() / ya.float().abs().max())
        row = {"case": case, "max_diff": diff}
        for label, fn in (("nccl", plain), ("symm_mem", fused)):
            for graph in (False, True):
                key = f"{label}_{'graph' if graph else 'eager'}_us"
                try:
                    t = torch.tensor(_time(fn, graph), device="cuda")
                    dist.all_reduce(t, op=dist.ReduceOp.MAX)
                    row[key] = float(t)
                except Exception as exc:  # noqa: BLE001  (report, go on with the next mode)
                    row[key] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
                    torch.cuda.synchronize()
        rows.append(row)
        if rank == 0:
            print(json.dumps(row), flush=True)
    if rank == 0 and out:
        with open(os.path.join(out, "symm_mem_tp.json"), "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_worker, args=(2, os.path.join(d, "init"), os.environ.get("OUT")), nprocs=2, join=True)


if __name__ == "__main__":
    main()
