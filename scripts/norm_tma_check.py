"""The norm forward's transposed FP8 output through pointer stores and through a tensor map, side
by side: LayerNorm of 8192 x 4096 bf16 rows to E4M3 with its transposed copy, without and with a
residual (the seed layer's LN1 and LN2), CUDA-graph replays, bits compared.

    python scripts/norm_tma_check.py [--out DIR]

Needs a CUDA GPU of compute capability 9.0 or newer.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from fp8ops.bench import common
from fp8ops.kernels import norm as kn


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--shape", type=int, nargs=2, default=[8192, 4096])
    args = ap.parse_args()
    M, K = args.shape
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(M, K, device="cuda", generator=g).bfloat16()
    r = torch.randn(M, K, device="cuda", generator=g).bfloat16()
    w = (1 + 0.1 * torch.randn(K, device="cuda", generator=g)).bfloat16()
    b = (0.1 * torch.randn(K, device="cuda", generator=g)).bfloat16()
    scale = torch.tensor(8.0, device="cuda")
    rows = []
    for residual in (False, True):
        out = {}
        for tma in (False, True):
            def fn(tma=tma, residual=residual):
                return kn.norm_fwd_launch(x, r if residual else None, w, b, 1e-5, False, False, True, scale, None,
                                          0, False, torch.float8_e4m3fn, True, config={"TMA": tma})
            t = common.time_cuda(fn, [()], samples=30)
            out[tma] = fn()
            nbytes = M * K * (2 + 2 + (4 if residual else 0))  # read x (+ r, write s), write q and q^T
            rows.append({"residual": residual, "tma": tma, "us": t.median_us, "tbps": nbytes / t.median_us / 1e6})
            print(json.dumps(rows[-1]))
        same = all(torch.equal(a.view(torch.uint8) if a.dtype.itemsize == 1 else a,
                               c.view(torch.uint8) if c.dtype.itemsize == 1 else c)
                   for a, c in zip(out[False][1:6], out[True][1:6]))
        rows[-1]["bits_equal"] = same
        print(f"residual={residual}: bits equal {same}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "norm_tma_check.json"), "w") as f:
            json.dump({"environment": common.environment(), "shape": [M, K], "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
