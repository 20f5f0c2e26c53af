"""Time launch variants of the norm kernels (kernels/norm.py) on one GPU, bf16, E4M3 delayed scaling.

Prints µs and the fraction of the device-copy bandwidth (logical bytes: forward FP8 2 + 1 B per element,
+ 1 B with the transposed copy; backward 2 + 2 + 2 B) and checks every variant's outputs against the
default launch (FP8 bytes equal; dx / dweight close).

    python scripts/probe_norm.py [--only fwd,fwd_t,bwd]
"""

# ruff: noqa: B023  (each timed lambda runs inside the iteration that makes it)
from __future__ import annotations

import sys
import time

import torch
from fp8ops.kernels import norm as kn

from fp8ops.bench.common import copy_bandwidth, time_cuda

E4M3 = torch.float8_e4m3fn
SHAPES = [(8192, 4096), (16384, 8192)]
T0 = time.time()


def main() -> None:
    only = sys.argv[sys.argv.index("--only") + 1].split(",") if "--only" in sys.argv else ["fwd", "fwd_t", "bwd"]
    cbw = copy_bandwidth(2**30, samples=10)["tbps"]
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} copy {cbw:.2f} TB/s", flush=True)
    scale = torch.tensor(8.0, device="cuda")
    for M, K in SHAPES:
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(M, K, generator=g, device="cuda").bfloat16()
        dy = torch.randn(M, K, generator=g, device="cuda").bfloat16()
        w = (1 + 0.1 * torch.randn(K, generator=g, device="cuda")).bfloat16()
        b = (0.1 * torch.randn(K, generator=g, device="cuda")).bfloat16()

        def t(name: str, fn, nbytes: int) -> float:  # type: ignore[no-untyped-def]
            r = time_cuda(fn, [()], samples=10, max_calls=16)
            frac = nbytes / r.median_us / 1e6 / cbw
            print(f"{M}x{K} {name:58s} {r.median_us:8.1f} us  {frac:5.3f} of copy  [{time.time() - T0:5.0f}s]", flush=True)
            return frac

        for rms in (False, True):
            norm = "RMS" if rms else "LN"
            bias = None if rms else b
            if "fwd" in only:
                ref = kn.norm_fwd_launch(x, None, w, bias, 1e-5, rms, False, False, scale, None, 0, False, E4M3, False)
                cfgs: list[dict | None] = [None, {"BLOCK_M": 1, "num_warps": 4, "PROGRAMS_PER_SM": 4}]
                for cfg in cfgs:
                    try:
                        out = kn.norm_fwd_launch(x, None, w, bias, 1e-5, rms, False, False, scale, None, 0, False,
                                                 E4M3, False, config=cfg)
                        ok = torch.equal(out[2].view(torch.uint8), ref[2].view(torch.uint8)) and torch.equal(out[4], ref[4])
                        t(f"{norm} fwd fp8 {cfg}{'' if ok else ' MISMATCH'}",
                          lambda c=cfg: kn.norm_fwd_launch(x, None, w, bias, 1e-5, rms, False, False, scale, None, 0,
                                                           False, E4M3, False, config=c), M * K * 3)
                    except Exception as exc:  # noqa: BLE001
                        print(f"{norm} fwd fp8 {cfg} failed: {exc!r}"[:300], flush=True)
            if "fwd_t" in only:
                ref = kn.norm_fwd_launch(x, None, w, bias, 1e-5, rms, False, False, scale, None, 0, False, E4M3, True)
                cfgs = [None, {"BLOCK_M": 32, "BLOCK_K": 128}]
                for cfg in cfgs:
                    try:
                        out = kn.norm_fwd_launch(x, None, w, bias, 1e-5, rms, False, False, scale, None, 0, False,
                                                 E4M3, True, config=cfg)
                        ok = all(torch.equal(out[i].view(torch.uint8), ref[i].view(torch.uint8)) for i in (2, 3))
                        ok = ok and torch.equal(out[4], ref[4]) and torch.equal(out[7], ref[7])
                        t(f"{norm} fwd fp8+t {cfg}{'' if ok else ' MISMATCH'}",
                          lambda c=cfg: kn.norm_fwd_launch(x, None, w, bias, 1e-5, rms, False, False, scale, None, 0,
                                                           False, E4M3, True, config=c), M * K * 4)
                    except Exception as exc:  # noqa: BLE001
                        print(f"{norm} fwd fp8+t {cfg} failed: {exc!r}"[:300], flush=True)
            if "bwd" in only:
                _, _, _, _, _, _, mean, rstd = kn.norm_fwd_launch(x, None, w, bias, 1e-5, rms, False, False, None,
                                                                  None, 0, False, None, False)
                ref = kn.norm_bwd_launch(dy, x, w, mean, rstd, None, rms, False, not rms)
                # the default, and the previous default (one row; 4 warps x 2 per SM, or 8 warps x 1)
                cfgs = [None, {"BLOCK_M": 1, "num_warps": 4 if K <= 4096 else 8, "PROGRAMS_PER_SM": 2 if K <= 4096 else 1}]
                for cfg in cfgs:
                    try:
                        out = kn.norm_bwd_launch(dy, x, w, mean, rstd, None, rms, False, not rms, config=cfg)
                        ok = (out[0].float() - ref[0].float()).abs().max().item() <= 0.02 and torch.allclose(
                            out[1].float(), ref[1].float(), rtol=1e-2, atol=1e-2)
                        t(f"{norm} bwd {cfg}{'' if ok else ' MISMATCH'}",
                          lambda c=cfg: kn.norm_bwd_launch(dy, x, w, mean, rstd, None, rms, False, not rms, config=c),
                          M * K * 6)
                    except Exception as exc:  # noqa: BLE001
                        print(f"{norm} bwd {cfg} failed: {exc!r}"[:300], flush=True)


if __name__ == "__main__":
    main()
