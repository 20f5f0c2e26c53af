"""``python -m fp8ops.bench norm --probe``: launch variants of the norm kernels (``kernels/norm.py``).

LayerNorm and RMSNorm, bf16, E4M3 delayed scaling, at 8192 x 4096 and 16384 x 8192 (``--quick``: the
first only): the default launch and an alternative (the previous default) of the FP8 forward, the
FP8 forward with the transposed copy, and the backward. Prints µs and the fraction of the
device-copy bandwidth (logical bytes: forward FP8 2 + 1 B per element, + 1 B with the transposed
copy; backward 2 + 2 + 2 B) and compares every variant's outputs with the default launch's (FP8
bytes equal; dx / dweight close), printing MISMATCH where they differ. The forward comparison is
bitwise: on an H100 both forward alternatives printed MISMATCH (not investigated; another tiling or
warp count sums the row statistics in another order, which can round a few FP8 values the other
way), so a MISMATCH is a lead to look at and is listed in the record, not a failed check.
``--probe-cases fwd,bwd`` picks the cases. The full launch-config sweep (LayerNorm) is
``norm --sweep``. Needs a CUDA GPU.
"""

# ruff: noqa: B023  (each timed lambda runs inside the iteration that makes it)
from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from . import common

__all__ = ["PROBE_CASES", "run"]

E4M3 = torch.float8_e4m3fn
SHAPES = [(8192, 4096), (16384, 8192)]
PROBE_CASES = ("fwd", "fwd_t", "bwd")


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Time and compare the launch variants; return ``{"mismatches": [...], "errors": [...], ...}``."""
    from fp8ops.kernels import norm as kn

    T0 = time.time()
    only = [c for c in (args.probe_cases or ",".join(PROBE_CASES)).split(",") if c]
    unknown = sorted(set(only) - set(PROBE_CASES))
    if unknown:
        raise ValueError(f"norm --probe-cases: unknown case(s) {unknown}; choose among {list(PROBE_CASES)}")
    mismatches: list[str] = []
    errors: list[str] = []
    cbw = common.copy_bandwidth(2**30, samples=10)["tbps"]
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} copy {cbw:.2f} TB/s", flush=True)
    scale = torch.tensor(8.0, device="cuda")
    for M, K in SHAPES[:1] if args.quick else SHAPES:
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(M, K, generator=g, device="cuda").bfloat16()
        dy = torch.randn(M, K, generator=g, device="cuda").bfloat16()
        w = (1 + 0.1 * torch.randn(K, generator=g, device="cuda")).bfloat16()
        b = (0.1 * torch.randn(K, generator=g, device="cuda")).bfloat16()

        def t(name: str, fn, nbytes: int) -> float:  # type: ignore[no-untyped-def]
            r = common.time_cuda(fn, [()], samples=10, max_calls=16)
            frac = nbytes / r.median_us / 1e6 / cbw
            print(f"{M}x{K} {name:58s} {r.median_us:8.1f} us  {frac:5.3f} of copy  [{time.time() - T0:5.0f}s]",
                  flush=True)
            return frac

        def mismatch(what: str) -> str:
            mismatches.append(f"{M}x{K} {what}")
            return " MISMATCH"

        for rms in (False, True):
            norm = "RMS" if rms else "LN"
            bias = None if rms else b
            if "fwd" in only:
                ref = kn.norm_fwd_launch(x, None, w, bias, 1e-5, rms, False, False, scale, None, 0, False, E4M3, False)
                cfgs: list[dict[str, int] | None] = [None, {"BLOCK_M": 1, "num_warps": 4, "PROGRAMS_PER_SM": 4}]
                for cfg in cfgs:
                    try:
                        out = kn.norm_fwd_launch(x, None, w, bias, 1e-5, rms, False, False, scale, None, 0, False,
                                                 E4M3, False, config=cfg)
                        ok = torch.equal(out[2].view(torch.uint8), ref[2].view(torch.uint8)) and torch.equal(out[4], ref[4])
                        t(f"{norm} fwd fp8 {cfg}{'' if ok else mismatch(f'{norm} fwd fp8 {cfg}')}",
                          lambda c=cfg: kn.norm_fwd_launch(x, None, w, bias, 1e-5, rms, False, False, scale, None, 0,
                                                           False, E4M3, False, config=c), M * K * 3)
                    except Exception as exc:  # noqa: BLE001
                        print(f"{norm} fwd fp8 {cfg} failed: {exc!r}"[:300], flush=True)
                        errors.append(f"{M}x{K} {norm} fwd fp8 {cfg}: {exc!r}"[:300])
            if "fwd_t" in only:
                ref = kn.norm_fwd_launch(x, None, w, bias, 1e-5, rms, False, False, scale, None, 0, False, E4M3, True)
                cfgs = [None, {"BLOCK_M": 32, "BLOCK_K": 128}]
                for cfg in cfgs:
                    try:
                        out = kn.norm_fwd_launch(x, None, w, bias, 1e-5, rms, False, False, scale, None, 0, False,
                                                 E4M3, True, config=cfg)
                        ok = all(torch.equal(out[i].view(torch.uint8), ref[i].view(torch.uint8)) for i in (2, 3))
                        ok = ok and torch.equal(out[4], ref[4]) and torch.equal(out[7], ref[7])
                        t(f"{norm} fwd fp8+t {cfg}{'' if ok else mismatch(f'{norm} fwd fp8+t {cfg}')}",
                          lambda c=cfg: kn.norm_fwd_launch(x, None, w, bias, 1e-5, rms, False, False, scale, None, 0,
                                                           False, E4M3, True, config=c), M * K * 4)
                    except Exception as exc:  # noqa: BLE001
                        print(f"{norm} fwd fp8+t {cfg} failed: {exc!r}"[:300], flush=True)
                        errors.append(f"{M}x{K} {norm} fwd fp8+t {cfg}: {exc!r}"[:300])
            if "bwd" in only:
                _, _, _, _, _, _, mean, rstd = kn.norm_fwd_launch(x, None, w, bias, 1e-5, rms, False, False, None,
                                                                  None, 0, False, None, False)
                ref = kn.norm_bwd_launch(dy, x, w, mean, rstd, None, rms, False, not rms)
                # the default, and the previous default (one row; 4 warps x 2 per SM, or 8 warps x 1)
                cfgs = [None, {"BLOCK_M": 1, "num_warps": 4 if K <= 4096 else 8,
                               "PROGRAMS_PER_SM": 2 if K <= 4096 else 1}]
                for cfg in cfgs:
                    try:
                        out = kn.norm_bwd_launch(dy, x, w, mean, rstd, None, rms, False, not rms, config=cfg)
                        ok = (out[0].float() - ref[0].float()).abs().max().item() <= 0.02 and torch.allclose(
                            out[1].float(), ref[1].float(), rtol=1e-2, atol=1e-2)
                        t(f"{norm} bwd {cfg}{'' if ok else mismatch(f'{norm} bwd {cfg}')}",
                          lambda c=cfg: kn.norm_bwd_launch(dy, x, w, mean, rstd, None, rms, False, not rms, config=c),
                          M * K * 6)
                    except Exception as exc:  # noqa: BLE001
                        print(f"{norm} bwd {cfg} failed: {exc!r}"[:300], flush=True)
                        errors.append(f"{M}x{K} {norm} bwd {cfg}: {exc!r}"[:300])
    return {"suite": "norm", "mode": "probe", "mismatches": mismatches, "errors": errors, "failed_checks": []}
