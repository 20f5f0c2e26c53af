"""The attention backward's last pass at the seed layer's shape: the float32 dQ buffer written into
the (B, H, S, D) view of the layer's one QKV gradient, by torch's strided copy and by
``kernels._accumulate.store_accumulated`` (a kernel over rows), CUDA-graph replays; bits compared.

    python scripts/dq_cast_check.py [--out DIR]

Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from fp8ops.bench import common
from fp8ops.kernels._accumulate import store_accumulated


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    S, B, H, D = 2048, 4, 32, 128
    packed = torch.zeros(S, B, 3 * H * D, device="cuda", dtype=torch.bfloat16)
    dq = packed[..., : H * D].view(S, B, H, D).permute(1, 2, 0, 3)
    acc = torch.randn(B, H, S, D, device="cuda")
    nbytes = acc.numel() * 6  # 4 read, 2 written
    rows = []
    for name, fn in (("torch copy_", lambda: dq.copy_(acc)), ("store_accumulated", lambda: store_accumulated(dq, acc))):
        t = common.time_cuda(fn, [()], samples=30)
        rows.append({"impl": name, "us": t.median_us, "tbps": nbytes / t.median_us / 1e6})
        print(json.dumps(rows[-1]))
    want = torch.empty_like(dq)
    want.copy_(acc)
    store_accumulated(dq, acc)
    same = bool(torch.equal(dq, want))
    copy = common.copy_bandwidth()
    print(f"bits equal: {same}; copy bandwidth {copy['tbps']:.2f} TB/s")
    rec = {"environment": common.environment(), "shape": [B, H, S, D], "rows": rows, "bits_equal": same,
           "copy_tbps": copy["tbps"]}
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "dq_cast_check.json"), "w") as f:
            json.dump(rec, f, indent=1)


if __name__ == "__main__":
    main()
