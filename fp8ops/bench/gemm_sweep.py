"""FP8 GEMM config sweep: ``fp8ops::scaled_mm`` against ``torch._scaled_mm`` in TFLOP/s.

Run on a CUDA GPU (sm_90 for the TMA kernel)::

    python -m fp8ops.bench.gemm_sweep --out DIR [--quick] [--configs NAME,NAME]

For every shape (M = 8192 with (K, N) in {(4096, 12288), (4096, 4096), (4096, 16384),
(16384, 4096)}, and 8192^3), every scaling (tensorwise, rowwise) and every accumulation mode
(``fast_accum`` False and True), it times ``torch._scaled_mm`` with the same scaling and
``use_fast_accum`` (the ceiling), the library op with its default configuration, and the launcher
with each configuration of :data:`CONFIGS`; bf16 output, E4M3 operands, random data (never zeros).
Timings are medians of CUDA-graph replays between CUDA events after warm-up, rotating among input
sets larger than the L2 cache (:func:`fp8ops.bench.common.time_cuda`). Each kernel's output is
compared once with ``_scaled_mm``'s; a mismatch is reported as a failed check (exit status 1).

Prints a table (TFLOP/s and the ratio to ``_scaled_mm``) and writes ``DIR/gemm_sweep.json`` with
every number, the configurations and the environment.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from .common import (
    Progress,
    cuda_unavailable_reason,
    describe_environment,
    environment,
    format_table,
    input_sets,
    time_cuda,
    write_json,
)

__all__ = ["CONFIGS", "SHAPES", "main", "run"]

SHAPES: list[tuple[int, int, int]] = [  # (M, K, N)
    (8192, 4096, 12288),
    (8192, 4096, 4096),
    (8192, 4096, 16384),
    (8192, 16384, 4096),
    (8192, 8192, 8192),
]
"""The swept GEMM shapes, ``(M, K, N)``: out (M, N) = a (M, K) @ b (N, K)^T."""

CONFIGS: dict[str, dict[str, Any]] = {
    "128x256x128-s3": {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 128, "num_stages": 3, "num_warps": 8},
    "128x256x128-s4": {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 128, "num_stages": 4, "num_warps": 8},
    "128x256x64-s4": {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "num_stages": 4, "num_warps": 8},
    "128x128x128-s4": {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128, "num_stages": 4, "num_warps": 8},
    "128x256x128-s3-noflat": {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 128, "num_stages": 3, "num_warps": 8,
                              "FLATTEN": False},
    "pointer-128x256x128-s3": {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 128, "num_stages": 3, "num_warps": 8,
                               "TMA": False},
}
"""Launch configurations swept besides the default (overrides of ``kernels.gemm.default_config``)."""

_MODES = [("tensorwise", False), ("tensorwise", True), ("rowwise", False), ("rowwise", True)]
_CHECK_REL = 2.0**-5  # max |ours - _scaled_mm| / max |_scaled_mm| above which a kernel is wrong


def _tflops(M: int, K: int, N: int, us: float) -> float:
    return 2.0 * M * N * K / us / 1e6


def _make_inputs(M: int, K: int, N: int, seed: int) -> tuple[torch.Tensor, ...]:
    """E4M3 operands over most of the format's range, and both kinds of inverse scales."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    a = (torch.randn(M, K, device="cuda", generator=g) * 64.0).to(torch.float8_e4m3fn)
    b = (torch.randn(N, K, device="cuda", generator=g) * 64.0).to(torch.float8_e4m3fn)
    sa_t = torch.tensor(1.0 / 64.0, device="cuda")
    sb_t = torch.tensor(1.0 / 64.0, device="cuda")
    sa_r = torch.rand(M, 1, device="cuda", generator=g) / 64.0 + 1e-3
    sb_r = torch.rand(1, N, device="cuda", generator=g) / 64.0 + 1e-3
    return a, b, sa_t, sb_t, sa_r, sb_r


def _scales(inputs: Sequence[torch.Tensor], scaling: str) -> tuple[torch.Tensor, torch.Tensor]:
    return (inputs[2], inputs[3]) if scaling == "tensorwise" else (inputs[4], inputs[5])


def _rel_diff(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30))


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the sweep; print the table; write ``gemm_sweep.json``; return the record."""
    from fp8ops.kernels import gemm as G  # registers fp8ops::scaled_mm

    env = environment()
    print(describe_environment(env), flush=True)
    shapes = [(8192, 8192, 8192)] if args.quick else SHAPES
    names = list(CONFIGS) if not args.configs else [c for c in args.configs.split(",") if c]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        raise SystemExit(f"gemm_sweep: unknown config(s) {unknown}; choose from {sorted(CONFIGS)}")
    if args.quick:
        names = names[:1]
    samples = 10 if args.quick else 20
    bf16 = torch.bfloat16
    progress = Progress(len(shapes) * len(_MODES) * (2 + len(names)), prefix="gemm_sweep ")
    rows: list[dict[str, Any]] = []
    failed: list[str] = []
    broken: dict[tuple[str, str, bool], str] = {}  # configs that failed to compile or launch

    for M, K, N in shapes:
        nbytes = M * K + N * K + 2 * M * N
        sets = input_sets(lambda i, M=M, K=K, N=N: _make_inputs(M, K, N, seed=i), nbytes)
        for scaling, fast in _MODES:
            base = {"M": M, "K": K, "N": N, "scaling": scaling, "fast_accum": fast}
            first = sets[0]
            sa, sb = _scales(first, scaling)

            # The ceiling: torch._scaled_mm with the same scaling and accumulation mode.
            progress.step(f"{M}x{K}x{N} {scaling} fast={fast}: torch._scaled_mm")

            def peer(a, b, sa_t, sb_t, sa_r, sb_r, scaling=scaling, fast=fast):  # type: ignore[no-untyped-def]
                s1, s2 = (sa_t, sb_t) if scaling == "tensorwise" else (sa_r, sb_r)
                return torch._scaled_mm(a, b.t(), scale_a=s1, scale_b=s2, out_dtype=bf16, use_fast_accum=fast)

            try:
                ref = peer(*first)
                t = time_cuda(peer, sets, samples=samples, on_fallback=progress.note)
                peer_us: float | None = t.median_us
                rows.append({**base, "impl": "torch._scaled_mm", "config": "-", "path": "cublas",
                             "us": t.median_us, "tflops": _tflops(M, K, N, t.median_us), "ratio": 1.0,
                             "timing": t.as_dict()})
            except RuntimeError as exc:  # this torch build may not support the combination
                progress.note(f"torch._scaled_mm unavailable here: {exc}")
                ref, peer_us = None, None

            candidates: list[tuple[str, str, dict[str, Any] | None]] = [("fp8ops::scaled_mm", "default", None)]
            candidates += [("launcher", n, CONFIGS[n]) for n in names]
            for impl, name, cfg in candidates:
                progress.step(f"{M}x{K}x{N} {scaling} fast={fast}: {impl} {name}")
                key = (name, scaling, fast)
                if key in broken:
                    rows.append({**base, "impl": impl, "config": name, "error": broken[key]})
                    continue

                def ours(  # type: ignore[no-untyped-def]
                    a, b, sa_t, sb_t, sa_r, sb_r, scaling=scaling, fast=fast, cfg=cfg
                ):
                    s1, s2 = (sa_t, sb_t) if scaling == "tensorwise" else (sa_r, sb_r)
                    if cfg is None:  # the library op, default configuration
                        return torch.ops.fp8ops.scaled_mm(a, b, s1, s2, None, bf16, fast)
                    return G.scaled_mm_launch(a, b, s1, s2, None, bf16, fast, config=cfg)
                try:
                    path = "tma" if G.uses_tma(first[0], first[1], bf16, fast, config=cfg) else "pointer"
                    out = ours(*first)
                    torch.cuda.synchronize()
                except Exception as exc:  # a config that does not compile or fit: record, go on
                    msg = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
                    broken[key] = msg
                    progress.note(f"{name} failed: {msg}")
                    rows.append({**base, "impl": impl, "config": name, "error": msg})
                    continue
                rel = _rel_diff(out, ref) if ref is not None else None
                if rel is not None and not rel <= _CHECK_REL:
                    failed.append(f"{M}x{K}x{N} {scaling} fast={fast} {name}: max rel diff vs "
                                  f"torch._scaled_mm {rel:.3g} > {_CHECK_REL:.3g}")
                del out
                t = time_cuda(ours, sets, samples=samples, on_fallback=progress.note)
                rows.append({**base, "impl": impl, "config": name, "path": path, "us": t.median_us,
                             "tflops": _tflops(M, K, N, t.median_us),
                             "ratio": (peer_us / t.median_us) if peer_us else None,
                             "rel_diff_vs_scaled_mm": rel, "timing": t.as_dict()})
        del sets
        torch.cuda.empty_cache()

    # Report.
    table_rows = [
        {**r, "shape": f"{r['M']}x{r['K']}x{r['N']}", "accum": "fast" if r["fast_accum"] else "precise",
         "what": r["impl"] if r["impl"] != "launcher" else r["config"]}
        for r in rows
    ]
    columns = [("shape", "M x K x N", ""), ("scaling", "scaling", ""), ("accum", "accum", ""),
               ("what", "kernel / config", ""), ("path", "path", ""), ("us", "us", ".1f"),
               ("tflops", "TFLOP/s", ".0f"), ("ratio", "vs _scaled_mm", ".3f"), ("error", "error", "")]
    print(format_table(table_rows, columns))
    best: list[dict[str, Any]] = []
    for M, K, N in shapes:
        for scaling, fast in _MODES:
            want = (M, K, N, scaling, fast)
            mine = [r for r in rows if (r["M"], r["K"], r["N"], r["scaling"], r["fast_accum"]) == want
                    and r["impl"] != "torch._scaled_mm" and "tflops" in r]
            if mine:
                top = max(mine, key=lambda r: r["tflops"])
                best.append({"shape": f"{M}x{K}x{N}", "scaling": scaling, "accum": "fast" if fast else "precise",
                             "config": top["config"], "tflops": top["tflops"], "ratio": top.get("ratio")})
    print("\nbest configuration per shape and mode:")
    print(format_table(best, [("shape", "M x K x N", ""), ("scaling", "scaling", ""), ("accum", "accum", ""),
                              ("config", "config", ""), ("tflops", "TFLOP/s", ".0f"),
                              ("ratio", "vs _scaled_mm", ".3f")]))
    record = {
        "suite": "gemm_sweep",
        "environment": env,
        "method": "median of CUDA-graph replays between CUDA events (fp8ops.bench.common.time_cuda); "
                  "bf16 output, E4M3 operands, random data; TFLOP/s = 2*M*N*K / time",
        "configs": CONFIGS,
        "default_configs": {"fast": G.default_config(True), "precise": G.default_config(False),
                            "pointer": G.default_config(True, tma=False)},
        "rows": rows,
        "best": best,
        "failed_checks": failed,
    }
    path = write_json(Path(args.out) / "gemm_sweep.json", record)
    print(f"\nwrote {path}")
    return record


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv``, refuse cleanly without CUDA, run; return the exit status."""
    parser = argparse.ArgumentParser(prog="python -m fp8ops.bench.gemm_sweep", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench_out", metavar="DIR", help="output folder (default: bench_out/)")
    parser.add_argument("--quick", action="store_true", help="8192^3 only, one config, fewer samples (a smoke run)")
    parser.add_argument("--configs", default="", metavar="NAMES",
                        help=f"comma-separated subset of the configs to sweep (default: all of {', '.join(CONFIGS)})")
    args = parser.parse_args(argv)
    reason = cuda_unavailable_reason()
    if reason is not None:
        print(f"gemm_sweep: cannot run: {reason}", file=sys.stderr)
        return 2
    record = run(args)
    if record["failed_checks"]:
        print(f"gemm_sweep: {len(record['failed_checks'])} check(s) failed:", file=sys.stderr)
        for f in record["failed_checks"]:
            print(f"  - {f}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
