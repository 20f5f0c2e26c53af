"""What attention dropout costs at the seed layer's shape, fp8ops's Triton kernels against SDPA.

The seed layer (hidden 4096, 32 heads of 128, seq 2048, batch 4, no mask) takes q, k and v as
strided (S, B, h, d) views of its QKV projection. This script times, at that shape and layout,
forward and forward+backward of ``fp8ops.attention(backend="triton")`` without dropout and with
``dropout_p`` (a seed tensor), with the Hopper kernels where they apply and with the portable ones
(``fp8ops triton, portable``), and of SDPA (cuDNN, flash) with and without dropout, then prints the
compiled Triton attention kernels' registers and spills and the device time per kernel of one
Triton forward+backward with dropout (profiler).

    python scripts/attn_dropout_check.py [--p 0.1] [--seq 2048] [--batch 4] [--causal] [--contiguous]
                                         [--dq-mode auto|separate|atomic] [--graph] [--out DIR]

``--graph`` times CUDA-graph replays (device time); without it, plain launches (host time included).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import fp8ops
from fp8ops.bench import common

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from attn_tune import _compiled_kernels  # noqa: E402


@contextlib.contextmanager
def _no_hopper() -> Any:
    from fp8ops.kernels import attention as K

    saved = K.hopper_supported, K.hopper_bwd_supported
    K.hopper_supported = K.hopper_bwd_supported = lambda *a, **k: False
    try:
        yield
    finally:
        K.hopper_supported, K.hopper_bwd_supported = saved


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--p", type=float, default=0.1)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--contiguous", action="store_true",
                    help="contiguous (B, h, S, d) q, k, v (layout bhsd) instead of views of the QKV projection")
    ap.add_argument("--dq-mode", choices=("auto", "separate", "atomic"), default="auto",
                    help="the backward's dQ scheme for the fp8ops rows (auto: the library's choice)")
    ap.add_argument("--graph", action="store_true", help="time CUDA-graph replays instead of plain launches")
    ap.add_argument("--impls", nargs="+", default=None,
                    help="implementations to time (default: all; fp8ops triton, fp8ops triton, portable, "
                         "SDPA cuDNN, SDPA flash)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.dq_mode != "auto":
        from fp8ops.attention import op as attention_op

        attention_op._dq_mode = lambda *a, **k: args.dq_mode
    S, B, h, d = args.seq, args.batch, args.heads, args.head_dim
    torch.manual_seed(0)
    qkv = torch.randn(S, B, 3 * h * d, device="cuda", dtype=torch.bfloat16)
    dout = torch.randn(S, B, h, d, device="cuda", dtype=torch.bfloat16)
    seed = torch.tensor(1234, device="cuda", dtype=torch.int64)

    def views() -> tuple[torch.Tensor, ...]:
        leaf = qkv.detach().requires_grad_()
        q, k, v = (t.reshape(S, B, h, d) for t in leaf.split([h * d] * 3, dim=-1))
        if args.contiguous:  # (B, h, S, d) copies, seen as (S, B, h, d)
            q, k, v = (t.permute(1, 2, 0, 3).contiguous().permute(2, 0, 1, 3) for t in (q, k, v))
        return leaf, q, k, v

    def ours(p: float, bwd: bool, portable: bool = False) -> Any:
        def f() -> None:
            if portable:  # the library's Hopper kernels refused: the portable ones run
                with _no_hopper():
                    return ours(p, bwd)()
            leaf, q, k, v = views()
            kw: dict[str, Any] = {"layout": "sbhd"}
            if args.contiguous:
                q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
                kw = {"layout": "bhsd"}
            o, _ = fp8ops.attention(q, k, v, causal=args.causal, dropout_p=p, dropout_seed=seed if p else None,
                                    backend="triton", **kw)
            if bwd:
                o.backward(dout.permute(1, 2, 0, 3) if args.contiguous else dout)
        return f

    def sdpa(p: float, bwd: bool, backend: Any) -> Any:
        def f() -> None:
            leaf, q, k, v = views()
            q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # (B, h, S, d) views
            with sdpa_kernel(backend):
                o = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=args.causal)
            if bwd:
                o.backward(dout.permute(1, 2, 0, 3))
        return f

    flops = 4 * B * h * S * S * d * (0.5 if args.causal else 1.0)
    rows = []
    cases = [("fp8ops triton", lambda p, b: ours(p, b)),
             ("fp8ops triton, portable", lambda p, b: ours(p, b, portable=True)),
             ("SDPA cuDNN", lambda p, b: sdpa(p, b, SDPBackend.CUDNN_ATTENTION)),
             ("SDPA flash", lambda p, b: sdpa(p, b, SDPBackend.FLASH_ATTENTION))]
    for name, make in cases:
        if args.impls is not None and name not in args.impls:
            continue
        for p in (0.0, args.p):
            row: dict[str, Any] = {"impl": name, "dropout_p": p}
            for bwd in (False, True):
                try:
                    t = common.time_cuda(make(p, bwd), [()], samples=15, use_graph=args.graph)
                    row["fwd+bwd ms" if bwd else "fwd ms"] = round(t.median_us / 1e3, 3)
                except Exception as exc:  # a backend that does not take this case
                    row["error"] = f"{type(exc).__name__}: {exc}"[:160]
            if "fwd ms" in row:
                row["fwd TF/s"] = round(flops / row["fwd ms"] / 1e9)
            if "fwd+bwd ms" in row:
                row["f+b TF/s"] = round(3.5 * flops / row["fwd+bwd ms"] / 1e9)
            rows.append(row)
            print(json.dumps(row), flush=True)
    kernels = _compiled_kernels()
    for k in kernels:
        print(json.dumps(k)[:400])
    f = ours(args.p, True)
    f()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            f()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=70)
    print(table)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "attn_dropout.json"), "w") as fh:
            json.dump({"env": common.environment(), "args": vars(args), "rows": rows, "kernels": kernels,
                       "profile": table}, fh, indent=1, default=str)


if __name__ == "__main__":
    main()
