"""Time the fused activation kernels against the device copy bandwidth (run on a GPU machine).

Usage: python3 scripts/time_activation.py [OUTDIR]

Cases: act_fwd and act_bwd with delayed scaling and the transposed copy (the FP8 MLP's forward and
backward), bf16 h of 8192 x 16384 (gelu_tanh, gelu) and 8192 x 32768 (swiglu, F = 16384); the
backward also reduces the bias gradient. Logical bytes per element of the (M, F) output grid:

    non-gated fwd: read h 2 B, write q + q_t 2 B                       = 4 B
    non-gated bwd: read da 2 B + h 2 B, write q + q_t 2 B               = 6 B
    gated fwd:     read h 4 B (both halves), write q + q_t 2 B         = 6 B
    gated bwd:     read da 2 B + h 4 B, write q + q_t 4 B (over C = 2F) = 10 B

A few launch configurations are timed per case (the defaults first). Prints a table and writes
activation_timing.json to OUTDIR (default: the current directory).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as Fn
from fp8ops.kernels import activation as K

from fp8ops.bench.common import copy_bandwidth, environment, time_cuda

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
CONFIGS = {
    "fwd": [None, {"BLOCK_M": 64, "BLOCK_N": 64}, {"BLOCK_M": 16, "BLOCK_N": 256},
            {"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 8}, {"BLOCK_M": 32, "BLOCK_N": 256, "num_warps": 8},
            {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8}, {"BLOCK_M": 32, "BLOCK_N": 64, "num_warps": 2}],
    "bwd": [None, {"BLOCK_M": 64, "BLOCK_N": 128}, {"BLOCK_M": 32, "BLOCK_N": 64},
            {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 8}, {"BLOCK_M": 32, "BLOCK_N": 128},
            {"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 8}, {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8}],
}
CASES = [  # (act, M, C, configs timed)
    ("gelu_tanh", 8192, 16384, True),
    ("swiglu", 8192, 32768, True),
    ("silu", 8192, 16384, False),
    ("gelu", 8192, 16384, False),
]


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(".")
    out.mkdir(parents=True, exist_ok=True)
    env = environment()
    ceiling = copy_bandwidth(2**30)
    print(f"copy ceiling: {ceiling['tbps']:.2f} TB/s on {torch.cuda.get_device_name()}", flush=True)
    rows = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for act, M, C, sweep in CASES:
        F = C // 2 if act in K.GATED else C
        h = (torch.randn(M, C, generator=g, device="cuda") * 2).bfloat16()
        da = torch.randn(M, F, generator=g, device="cuda").bfloat16()
        s = torch.tensor(16.0, device="cuda")
        gated = act in K.GATED
        nbytes = {"fwd": M * F * (6 if gated else 4), "bwd": M * F * (10 if gated else 6)}
        for kind in ("fwd", "bwd"):
            for cfg in CONFIGS[kind] if sweep else [None]:
                if kind == "fwd":
                    def fn(x, c=cfg, a=act, s=s):  # type: ignore[no-untyped-def]
                        return K.act_fwd_launch(x, a, False, s, None, 0, False, E4M3, True, True, config=c)

                    args = [(h,)]
                else:
                    def fn(d, x, c=cfg, a=act, s=s):  # type: ignore[no-untyped-def]
                        return K.act_bwd_launch(d, x, a, False, s, None, 0, False, E5M2, True, True, config=c)

                    args = [(da, h)]
                t = time_cuda(fn, args, samples=15, max_calls=16)
                tbps = nbytes[kind] / t.median_us / 1e6
                row = {"act": act, "kind": kind, "shape": f"{M}x{C}", "config": cfg or "default",
                       "us": round(t.median_us, 1), "tbps": round(tbps, 3),
                       "pct_copy": round(100 * tbps / ceiling["tbps"], 1)}
                rows.append(row)
                print(row, flush=True)
        if act == "gelu_tanh":
            # Peer: the same forward written with torch ops (activation, cast, transposed copy).
            def eager(x: torch.Tensor, s: torch.Tensor = s) -> tuple[torch.Tensor, torch.Tensor]:
                q = (Fn.gelu(x, approximate="tanh").float() * s).clamp(-448, 448).to(E4M3)
                return q, q.t().contiguous()

            t = time_cuda(eager, [(h,)], samples=10, max_calls=8)
            tbps = nbytes["fwd"] / t.median_us / 1e6
            row = {"act": act, "kind": "fwd torch eager", "shape": f"{M}x{C}", "config": "-",
                   "us": round(t.median_us, 1), "tbps": round(tbps, 3),
                   "pct_copy": round(100 * tbps / ceiling["tbps"], 1)}
            rows.append(row)
            print(row, flush=True)
        del h, da
        torch.cuda.empty_cache()
    (out / "activation_timing.json").write_text(json.dumps({"environment": env, "copy": ceiling, "rows": rows},
                                                           indent=1, default=str))


if __name__ == "__main__":
    main()
