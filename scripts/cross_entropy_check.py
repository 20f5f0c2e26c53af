"""Time the output head and its loss on the GPU: torch's compiled ``F.cross_entropy(x @ W.t())``
against ``fp8ops.linear_cross_entropy`` (eager and compiled), forward + backward with the gradients
of x and W, at the GPT suite's shapes (8192 tokens, vocabulary 50304, bf16); and the loss kernel
alone in a few launch configurations, with its bandwidth (2 bytes read and 2 written per logit);
the tied embedding's backward kernel alone (configurations, against the torch math); and, with the
loss, the gradient of an embedding tied to the head: ``F.embedding`` + the table used again against
``fp8ops.tied_embedding``, compiled.

Usage: python scripts/cross_entropy_check.py [--hidden 512 2048] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

import fp8ops
from fp8ops.kernels import linear_cross_entropy as K

# (BLOCK_V, num_warps, PROGRAMS_PER_SM (0: one program per row), REVERSE)
CONFIGS = [(2048, 4, 0, False), (2048, 4, 0, True), (4096, 8, 0, True), (2048, 4, 4, True), (2048, 4, 8, True),
           (4096, 8, 2, True), (4096, 8, 4, True), (8192, 8, 2, True), (4096, 16, 2, True), (8192, 16, 1, True),
           (8192, 16, 2, True), (8192, 16, 1, False), (16384, 16, 1, True), (8192, 32, 1, True),
           (16384, 32, 1, True)]
# the tied embedding's backward kernel: (BLOCK_K, BLOCK_R, num_warps)
TIED_CONFIGS = [(1024, 16, 4), (512, 16, 4), (256, 16, 2), (2048, 16, 8), (1024, 8, 4), (1024, 32, 8)]


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


def _time_tied_backward(out: dict, M: int, V: int, H: int, g: torch.Generator) -> None:
    """The tied embedding's backward alone: its kernel in a few configurations against the
    out-of-place torch math (the reference, compiled), at (V, H) bf16 with M random tokens."""
    from fp8ops.kernels import tied_embedding as KT
    from fp8ops.reference import tied_embedding as RT

    grad = torch.randn(V, H, device="cuda", generator=g).bfloat16()
    rows = torch.randn(M, H, device="cuda", generator=g).bfloat16()
    tok = torch.randint(0, V, (M,), device="cuda", generator=g)
    work = grad.clone()
    torch_add = torch.compile(RT.add_rows)
    ms = _time(lambda: torch_add(grad, tok, rows))
    row = {"case": "tied backward", "hidden": H, "impl": "torch ops (compiled)", "ms": ms}
    out["rows"].append(row)
    print(row, flush=True)
    for block_k, block_r, warps in TIED_CONFIGS:
        cfg = {"BLOCK_K": block_k, "BLOCK_R": block_r, "num_warps": warps}
        ms = _time(lambda: KT.tied_embedding_bwd_launch(work, tok, rows, config=cfg))
        row = {"case": "tied backward", "hidden": H, "impl": "kernel", **cfg, "ms": ms,
               "tb_s": 3 * M * H * 2 / ms / 1e9}
        out["rows"].append(row)
        print(row, flush=True)
    del grad, rows, work


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
    for block, warps, per_sm, reverse in CONFIGS:
        cfg = {"BLOCK_V": block, "num_warps": warps, "PROGRAMS_PER_SM": per_sm, "REVERSE": reverse}
        ms = _time(lambda: K.linear_cross_entropy_fwd_launch(z, t, -100, config=cfg))
        row = {"case": "kernel", **cfg, "ms": ms, "tb_s": 4 * M * V / ms / 1e9}
        out["rows"].append(row)
        print(row, flush=True)
    del z
    for H in args.hidden:
        _time_tied_backward(out, M, V, H, g)
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
