"""What the dropout on x costs the norm kernels at the seed layer's shape (8192 x 4096, bf16, a
residual, E4M3 output with its transposed copy, as the layer's MLP norm runs), device time of
CUDA-graph replays, inputs rotated beyond L2; with the bits of the mask checked against the
reference first.

    python scripts/norm_dropout_cost.py [--out DIR]

Rows: the forward without and with dropout (and without a residual, the layer's LN1), the
backward without dropout and with it (its second output). Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from fp8ops.bench import common
from fp8ops.kernels import norm as K
from fp8ops.reference import norm as R

M, D, P = 8192, 4096, 0.1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev, bf = "cuda", torch.bfloat16
    torch.manual_seed(0)
    w = torch.randn(D, device=dev)
    b = torch.randn(D, device=dev)
    seed = torch.tensor(20261205, dtype=torch.int64, device=dev)
    e4m3 = torch.float8_e4m3fn
    cast = (torch.ones((), device=dev), None, 0, False, e4m3, True)

    # Step 1: the kernel's mask is the reference's, element by element (s == r exactly where dropped)
    x, r = torch.randn(M, D, device=dev, dtype=bf), torch.randn(M, D, device=dev, dtype=bf)
    _, s, *_ = K.norm_fwd_launch(x, r, w, b, 1e-5, False, False, False, *cast, seed, P)
    keep = R.branch_keep(seed, M, D, P)
    mask_ok = bool(torch.equal(s[~keep], r[~keep])) and bool((s[keep] != r[keep]).float().mean() > 0.99)
    rate = 1 - float(keep.float().mean())

    def fwd_set(i: int):
        g = torch.Generator(device=dev).manual_seed(i)
        return (torch.randn(M, D, device=dev, dtype=bf, generator=g), torch.randn(M, D, device=dev, dtype=bf, generator=g))

    def bwd_set(i: int):
        g = torch.Generator(device=dev).manual_seed(100 + i)
        xs, rs = (torch.randn(M, D, device=dev, dtype=bf, generator=g) for _ in range(2))
        _, ss, *_, mean, rstd = K.norm_fwd_launch(xs, rs, w, b, 1e-5, False, False, False, *cast, seed, P)
        return (torch.randn(M, D, device=dev, dtype=bf, generator=g), ss, mean, rstd,
                torch.randn(M, D, device=dev, dtype=bf, generator=g))

    fsets = common.input_sets(fwd_set, 2 * M * D * 2)
    bsets = common.input_sets(bwd_set, 3 * M * D * 2)
    cases = {
        "forward, residual": (lambda x, r: K.norm_fwd_launch(x, r, w, b, 1e-5, False, False, False, *cast), fsets),
        "forward, residual, dropout": (
            lambda x, r: K.norm_fwd_launch(x, r, w, b, 1e-5, False, False, False, *cast, seed, P), fsets),
        "forward, no residual": (lambda x, r: K.norm_fwd_launch(x, None, w, b, 1e-5, False, False, False, *cast), fsets),
        "backward": (lambda dy, s, mean, rstd, ds: K.norm_bwd_launch(dy, s, w, mean, rstd, ds, False, False, True),
                     bsets),
        "backward, dropout": (lambda dy, s, mean, rstd, ds: K.norm_bwd_dropout_launch(
            dy, s, w, mean, rstd, ds, False, False, True, seed, P), bsets),
    }
    rows = []
    for name, (fn, sets) in cases.items():
        t = common.time_cuda(fn, sets, samples=30)
        rows.append({"case": name, "us": round(t.median_us, 2), "p20_us": round(t.p20_us, 2),
                     "p80_us": round(t.p80_us, 2), "method": t.method})
        print(json.dumps(rows[-1]), flush=True)
    by = {r["case"]: r["us"] for r in rows}
    record = {
        "environment": common.environment(), "shape": {"M": M, "K": D, "p": P, "dtype": "bfloat16"},
        "mask_matches_reference": mask_ok, "drop_rate": rate, "rows": rows,
        "dropout_cost_us": {"forward": round(by["forward, residual, dropout"] - by["forward, residual"], 2),
                            "backward": round(by["backward, dropout"] - by["backward"], 2)},
    }
    print(json.dumps({k: record[k] for k in ("mask_matches_reference", "drop_rate", "dropout_cost_us")}))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        common.write_json(os.path.join(args.out, "norm_dropout_cost.json"), record)


if __name__ == "__main__":
    main()
