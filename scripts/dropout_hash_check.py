"""Serial correlation of attention dropout masks along a row: the current hash against the previous one.

The keep decision of weight (i, j) is a hash of (seed, b, h, i, j) (``fp8ops.reference.attention.
dropout_keep``). Its per-row part is a full mix; what each weight adds is the cheap part, so the
decisions of weights a few keys apart in a row are where a weak hash would show. For several seeds
this prints, at each distance L, the correlation of the keep decisions of (i, j) and (i, j + L) in
standard errors (z; about N(0, 1) for independent decisions): the mean and the largest |z| over
the seeds, for the current hash and for the previous one (a second full mix per weight).

    python scripts/dropout_hash_check.py [--rows 1024] [--cols 8192] [--seeds 6] [--p 0.5 0.1]
"""

from __future__ import annotations

import argparse

import torch

from fp8ops.reference import attention as R

LAGS = (1, 2, 3, 4, 5, 6, 7, 8, 16)


def previous_keep(seed: int, q_idx: torch.Tensor, kv_idx: torch.Tensor, p: float) -> torch.Tensor:
    """The previous mask (b = h = 0): ``mix(mix(k2 + i) + j)``, its top 24 bits against ``p * 2**24``."""
    m = R._MASK32
    s = torch.tensor(seed, dtype=torch.int64)
    k0 = R._mix32((s & m) ^ R._mix32((s >> 32) & m))
    k2 = R._mix32(R._mix32(k0 & m) & m)  # + b = 0, + h = 0
    r = R._mix32((R._mix32((k2 + q_idx) & m) + kv_idx) & m)
    return (r >> 8) >= round(p * (1 << 24))


def lag_z(keep: torch.Tensor, p: float) -> dict[int, float]:
    k = keep.double() - (1 - p)
    var = p * (1 - p)
    return {L: ((k[:, :-L] * k[:, L:]).mean() / var * k[:, L:].numel() ** 0.5).item() for L in LAGS}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--cols", type=int, default=8192)
    ap.add_argument("--seeds", type=int, default=6)
    ap.add_argument("--p", type=float, nargs="+", default=[0.5, 0.1])
    args = ap.parse_args()
    q_idx = torch.arange(args.rows).reshape(-1, 1)
    kv_idx = torch.arange(args.cols).reshape(1, -1)
    zero = torch.tensor(0)
    for p in args.p:
        for name in ("current", "previous"):
            zs: dict[int, list[float]] = {L: [] for L in LAGS}
            for seed in range(args.seeds):
                seed = 7919 * seed + 1
                keep = (R.dropout_keep(torch.tensor(seed), zero, zero, q_idx, kv_idx, p) if name == "current"
                        else previous_keep(seed, q_idx, kv_idx, p))
                for L, z in lag_z(keep, p).items():
                    zs[L].append(z)
            cells = " ".join(f"L{L}:{sum(v) / len(v):+.1f}/{max(map(abs, v)):.1f}" for L, v in zs.items())
            print(f"p={p} {name:<8} mean z / max |z| over {args.seeds} seeds: {cells}", flush=True)


if __name__ == "__main__":
    main()
