"""Sweep the attention kernels' launch configurations at one shape on the GPU.

Usage: python scripts/attn_tune.py OUT.json [--seqlen 8192] [--head-dim 128] [--batch 8] [--heads 32]
       [--variants causal document] [--budget-s 300] [--samples 10] [--tma 0 1]
       python scripts/attn_tune.py OUT.json --variants varlen --head-dim 64  # the varlen benchmark's case

For each variant it times forward alone over the forward configs, and forward+backward over the
backward configs (both dQ schemes), each with pointer loads and with TMA tensor descriptors
(``--tma``; the backward's TMA1 and TMA2 together), then writes every row with the compiled
kernels' register and spill counts (ptxas, through Triton's compiled-kernel metadata) and the per-kernel device time of
the default configuration (profiler). The defaults in kernels/attention.py come from such runs.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from typing import Any

import torch
import triton

from fp8ops.bench import attention as BA
from fp8ops.bench import attention_varlen as AV
from fp8ops.bench import common

FWD = [(128, 64, 8, 3), (128, 64, 8, 2), (128, 128, 8, 2), (128, 64, 4, 3), (64, 64, 4, 3), (128, 32, 4, 3),
       (128, 128, 8, 3), (64, 128, 4, 3), (128, 64, 8, 4)]  # the last: a deeper pipeline, cheap with TMA loads
BWD = [(16, 128, 8, 2, 128, 32, 8, 3), (32, 128, 8, 2, 128, 32, 8, 3), (64, 128, 8, 2, 128, 64, 8, 2),
       (64, 128, 8, 3, 128, 64, 8, 3), (32, 128, 4, 3, 128, 32, 4, 3), (32, 128, 4, 5, 128, 32, 4, 5),
       (64, 64, 4, 3, 64, 64, 4, 3), (32, 64, 4, 3, 128, 64, 8, 3), (64, 128, 8, 2, 128, 32, 8, 3),
       (32, 128, 8, 3, 64, 64, 4, 3), (64, 64, 8, 3, 128, 64, 8, 2), (16, 64, 4, 3, 64, 32, 4, 3)]


def _compiled_kernels() -> list[dict[str, Any]]:
    """Register and spill counts of every compiled attention kernel in this process."""
    out = []
    for obj in gc.get_objects():
        if not isinstance(obj, triton.runtime.jit.JITFunction):
            continue
        name = getattr(obj, "__name__", "")
        if "attention" not in name:
            continue
        for entry in obj.device_caches.values():
            cache = entry[0]
            for ck in list(cache.values()):
                try:
                    ck._init_handles()
                    consts = {k: v for k, v in getattr(ck.src, "constants", {}).items()
                              if isinstance(v, int) and not isinstance(v, bool)}
                    out.append({"kernel": name, "num_warps": ck.metadata.num_warps,
                                "num_stages": ck.metadata.num_stages, "shared": ck.metadata.shared,
                                "n_regs": ck.n_regs, "n_spills": ck.n_spills, "constants": str(consts)[:300]})
                except Exception as exc:  # metadata layout differs across Triton versions
                    out.append({"kernel": name, "error": f"{type(exc).__name__}: {exc}"[:200]})
    return out


def _kernel_times(fn: Any, sets: list[tuple[torch.Tensor, ...]]) -> dict[str, float]:
    """Device microseconds per call of each kernel of fn (profiler, 5 calls)."""
    for s in sets:
        fn(*s)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for i in range(5):
            fn(*sets[i % len(sets)])
        torch.cuda.synchronize()
    times: dict[str, float] = {}
    for e in prof.key_averages():
        if e.device_time_total > 0:
            times[e.key[:80]] = e.device_time_total / 5
    return dict(sorted(times.items(), key=lambda kv: -kv[1])[:8])


def _dropout_fn(p: float, dq_mode: str | None = None, fwd_config: dict[str, int] | None = None,
                bwd_config: dict[str, int] | None = None) -> Any:
    """Causal attention with dropout p through the fused kernels (a fixed seed)."""
    from fp8ops.attention import _attention_triton
    from fp8ops.attention.op import _seed_tensor

    seed = _seed_tensor(1234, torch.device("cuda"), "attn_tune")

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return _attention_triton(
            q, k, v, score_mod=None, mask_mod=None, block_mask=None, scale=q.shape[-1] ** -0.5, left=None,
            right=0, layout="bhsd", cu_q=None, cu_kv=None, max_q=None, max_kv=None, dropout_p=p, seed=seed,
            dq_mode=dq_mode or "separate", fwd_config=fwd_config, bwd_config=bwd_config)[0]

    return fn


def _varlen_fn(cu: torch.Tensor, max_len: int, dq_mode: str | None = None, fwd_config: dict[str, int] | None = None,
               bwd_config: dict[str, int] | None = None) -> Any:
    """Causal attention over packed (T, h, d) sequences with offsets cu, through the fused kernels."""
    from fp8ops.attention import _attention_triton

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return _attention_triton(
            q, k, v, score_mod=None, mask_mod=None, block_mask=None, scale=q.shape[-1] ** -0.5, left=None,
            right=0, layout="thd", cu_q=cu, cu_kv=cu, max_q=max_len, max_kv=max_len, dropout_p=0.0, seed=None,
            dq_mode=dq_mode or "separate", fwd_config=fwd_config, bwd_config=bwd_config)[0]

    return fn


def _varlen_sets(heads: int, head_dim: int, n: int) -> tuple[torch.Tensor, int, list[tuple[torch.Tensor, ...]]]:
    """(offsets, longest, input sets) of the variable-length benchmark's lengths (512 Zipf(1.2)
    sequences up to 1024 tokens, seed 0): q, k, v as (T, h, d) views of one packed projection, as
    the benchmark's block makes them, and do."""
    lengths = AV.zipf_lengths(AV.SEQS, alpha=AV.ALPHA, max_len=AV.MAX_LEN, seed=0)
    cu = AV.cu_seqlens(lengths, "cuda")
    T = int(lengths.sum())
    sets = []
    for i in range(n):
        g = torch.Generator(device="cuda").manual_seed(i)
        qkv = torch.randn(T, 3, heads, head_dim, device="cuda", generator=g, dtype=torch.bfloat16)
        q, k, v = (t.detach().requires_grad_() for t in qkv.unbind(1))
        do = torch.randn(T, heads, head_dim, device="cuda", generator=g, dtype=torch.bfloat16)
        sets.append((q, k, v, do))
    return cu, int(lengths.max()), sets


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--seqlen", type=int, default=8192)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--heads", type=int, default=None,
                   help="query heads (default 32; the varlen variant: the benchmark's 8)")
    p.add_argument("--variants", nargs="+", default=["causal"])
    p.add_argument("--budget-s", type=float, default=300)
    p.add_argument("--samples", type=int, default=10)
    p.add_argument("--skip-fwd", action="store_true")
    p.add_argument("--fwd", nargs="*", default=None, metavar="M,N,W,S", help="forward configs (default: a built-in list)")
    p.add_argument("--tma", nargs="+", type=int, default=[0, 1], choices=[0, 1],
                   help="loads to time each config with: 0 pointers, 1 TMA descriptors (default both)")
    p.add_argument("--bwd", nargs="*", default=None, metavar="M1,N1,W1,S1,M2,N2,W2,S2",
                   help="backward configs (default: a built-in list)")
    p.add_argument("--dropout", type=float, default=0.0, help="attention dropout (causal variant only)")
    p.add_argument("--modes", nargs="+", default=["separate", "atomic"], choices=["separate", "atomic"])
    a = p.parse_args()
    reason = common.cuda_unavailable_reason()
    if reason is not None:
        p.error(reason)
    t0 = time.time()
    fwd_list = [tuple(int(x) for x in c.split(",")) for c in a.fwd] if a.fwd is not None else FWD
    bwd_list = [tuple(int(x) for x in c.split(",")) for c in a.bwd] if a.bwd is not None else BWD
    varlen = a.variants == ["varlen"]
    S, D, B = a.seqlen, a.head_dim, a.batch
    H = a.heads if a.heads is not None else (AV.HEADS if varlen else 32)
    if "varlen" in a.variants and not varlen:
        p.error("the varlen variant runs alone (--variants varlen)")
    if varlen:  # the benchmark's variable-length case: its own heads, lengths and tokens
        cu, max_len, sets = _varlen_sets(H, D, 2)
        S, B = max_len, cu.numel() - 1
    else:
        sets = BA._inputs(B, H, H, S, D, 2)
    if a.dropout > 0.0 and a.variants != ["causal"]:
        p.error("--dropout runs the causal variant only")

    def make(variant: str, S: int, H: int, docs: Any, **kw: Any) -> Any:
        """The attention function of a variant (with configs), through the fused kernels."""
        if a.dropout > 0.0:
            return _dropout_fn(a.dropout, **kw)
        if variant == "varlen":
            return _varlen_fn(cu, max_len, **kw)
        return BA._fp8ops_fn(variant, S, H, docs, **kw)
    print(f"S={S} D={D} B={B} H={H}", flush=True)
    notes: list[str] = []
    rows: list[dict[str, Any]] = []
    profiles: dict[str, Any] = {}

    def left() -> float:
        return a.budget_s - (time.time() - t0)

    for variant in a.variants:
        docs = BA._documents(S, 0) if variant == "document" else None
        if variant == "varlen":  # causal flops of each sequence: 2 products of L(L+1)/2 scores
            lens = (cu[1:] - cu[:-1]).double()
            frac, causal_flops = 1.0, float((4 * H * D * lens * (lens + 1) / 2).sum())
        else:
            frac = BA._visible_fraction(variant, S, docs)
            causal_flops = BA._flops(B, H, S, D, True, False)
        # effective TFLOP/s as in the table: causal flops for every masked case
        base = causal_flops if variant != "none" else BA._flops(B, H, S, D, False, False)
        default = make(variant, S, H, docs)
        profiles[variant] = {"fwd+bwd": _kernel_times(BA._fwd_bwd(default), sets), "visible": frac}
        us = BA._time(BA._fwd_bwd(default), sets, a.samples, notes, "default").median_us
        rows.append({"variant": variant, "kind": "default fwd+bwd", "config": "default", "us": us,
                     "tflops": base * 3.5 / us / 1e6})
        us = BA._time(default, [s[:3] for s in sets], a.samples, notes, "default").median_us
        rows.append({"variant": variant, "kind": "default fwd", "config": "default", "us": us,
                     "tflops": base / us / 1e6})
        print(rows[-2], rows[-1], flush=True)
        if not a.skip_fwd:
            for (bm, bn, w, s), tma in ((c, t) for c in fwd_list for t in a.tma):
                if left() < 20:
                    notes.append("budget reached")
                    break
                cfg = dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=s, TMA=tma)
                try:
                    fn = make(variant, S, H, docs, fwd_config=cfg)
                    us = BA._time(fn, [s_[:3] for s_ in sets], a.samples, notes, "fwd").median_us
                    rows.append({"variant": variant, "kind": "fwd", "config": str(cfg), "us": us,
                                 "tflops": base / us / 1e6})
                except Exception as exc:
                    rows.append({"variant": variant, "kind": "fwd", "config": str(cfg), "error": str(exc)[:200]})
                print(rows[-1], flush=True)
        for (m1, n1, w1, s1, m2, n2, w2, s2), tma in ((c, t) for c in bwd_list for t in a.tma):
            cfg = dict(BLOCK_M1=m1, BLOCK_N1=n1, num_warps1=w1, num_stages1=s1, BLOCK_M2=m2, BLOCK_N2=n2,
                       num_warps2=w2, num_stages2=s2, TMA1=tma, TMA2=tma)
            for mode in a.modes:
                if left() < 20:
                    notes.append("budget reached")
                    break
                try:
                    fn = BA._fwd_bwd(make(variant, S, H, docs, dq_mode=mode, bwd_config=cfg))
                    us = BA._time(fn, sets, a.samples, notes, "bwd").median_us
                    rows.append({"variant": variant, "kind": f"fwd+bwd {mode}", "config": str(cfg), "us": us,
                                 "tflops": base * 3.5 / us / 1e6})
                except Exception as exc:
                    rows.append({"variant": variant, "kind": f"fwd+bwd {mode}", "config": str(cfg),
                                 "error": str(exc)[:200]})
                print(rows[-1], flush=True)
    record = {"shape": dict(S=S, D=D, B=B, H=H), "rows": rows, "profiles": profiles,
              "kernels": _compiled_kernels(), "notes": notes, "env": common.environment()}
    with open(a.out, "w") as f:
        json.dump(record, f, indent=1, default=str)
    for k in record["kernels"]:
        print(k)
    return 0


if __name__ == "__main__":
    sys.exit(main())
