"""Time the output head and its loss on the GPU: torch's compiled ``F.cross_entropy(x @ W.t())``
against ``fp8ops.linear_cross_entropy`` (eager and compiled), forward + backward with the gradients
of x and W, at the GPT suite's shapes (8192 tokens, vocabulary 50304, bf16); and the loss kernel
alone in a few launch configurations, with its bandwidth (2 bytes read and 2 written per logit);
and, with the loss, the gradient of an embedding tied to the head: ``F.embedding`` + the table used
again against ``fp8ops.tied_embedding``, compiled.

Usage: python scripts/cross_entropy_check.py [--hidden 512 2048] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

import fp8ops
from fp8ops.kernels import linear_cross_entropy as K

CONFIGS = [(2048, 4), (4096, 4), (4096, 8), (8192, 8), (8192, 16)]


def _time(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", nargs="+", type=int, default=[512, 2048])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    M, V = args.tokens, args.vocab
    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "tokens": M, "vocab": V, "rows": []}
    g = torch.Generator(device="cuda").manual_seed(0)
    z = torch.randn(M, V, device="cuda", generator=g).bfloat16() * 3
    t = torch.randint(0, V, (M,), device="cuda", generator=g)
    for block, warps in CONFIGS:
        cfg = {"BLOCK_V": block, "num_warps": warps}
        ms = _time(lambda: K.linear_cross_entropy_fwd_launch(z, t, -100, config=cfg))
        row = {"case": "kernel", **cfg, "ms": ms, "tb_s": 4 * M * V / ms / 1e9}
        out["rows"].append(row)
        print(row, flush=True)
    del z
    for H in args.hidden:
        x = (torch.randn(M, H, device="cuda", generator=g)).bfloat16().requires_grad_()
        w = (torch.randn(V, H, device="cuda", generator=g) * H**-0.5).bfloat16().requires_grad_()

        def torch_ce(a, b, c):
            return F.cross_entropy((a @ b.t()).float(), c)

        def plain(tok, table):
            return F.embedding(tok, table), table

        tok = torch.randint(0, V, (M,), device="cuda", generator=g)
        c = torch.randn(M, H, device="cuda", generator=g).bfloat16()
        for name, emb in (("F.embedding, table used again", plain), ("fp8ops.tied_embedding", fp8ops.tied_embedding)):
            def tied_loss(table, emb=emb):
                rows, head = emb(tok, table)
                return fp8ops.linear_cross_entropy(x.detach() + rows * c, head, t)

            fn = torch.compile(tied_loss, fullgraph=True)

            def step(fn=fn) -> None:
                w.grad = None
                fn(w).backward()
            row = {"case": "embedding + head + loss", "hidden": H, "impl": name, "ms": _time(step)}
            out["rows"].append(row)
            print(row, flush=True)
        impls = {"torch compiled": torch.compile(torch_ce), "fp8ops eager": fp8ops.linear_cross_entropy,
                 "fp8ops compiled": torch.compile(fp8ops.linear_cross_entropy, fullgraph=True),
                 "head GEMMs alone (bf16 mm x3)": None}
        for name, fn in impls.items():
            if fn is None:
                dz = torch.randn(M, V, device="cuda", generator=g).bfloat16()

                def step() -> None:
                    x.detach() @ w.detach().t()
                    dz @ w.detach()
                    dz.t() @ x.detach()
            else:
                def step(fn=fn) -> None:
                    x.grad = w.grad = None
                    fn(x, w, t).backward()
            ms = _time(step)
            loss = None if fn is None else float(fn(x, w, t))
            row = {"case": "head + loss", "hidden": H, "impl": name, "ms": ms, "loss": loss}
            out["rows"].append(row)
            print(row, flush=True)
        torch._dynamo.reset()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
