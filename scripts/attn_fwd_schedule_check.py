"""Inner-loop schedules of the attention forward on the GPU: standalone copies of the dense inner
loop (d = 128, bf16, 128 x 128 tiles, eight warps, K and V through tensor descriptors), causal and
without a mask, next to the library's forward kernel at the same shape.

    python scripts/attn_fwd_schedule_check.py OUT_DIR [--batch 2] [--heads 32] [--seqlen 8192] [--rounds 7]

Variants of the loop body (``VARIANT``):

  0  scaled max:      s = qk * scale; m' = max(m, rowmax(s)); p = exp2(s - m')   (the library's form)
  1  raw max:         m' = max(m, rowmax(qk) * scale); p = exp2(qk * scale - m')  (one multiply fewer
                      per score: the scale folds into the exponent's fused multiply-add)
  2  raw max, QK^T ahead: as 1, with the next key tile's QK^T issued before this tile's softmax,
                      so that the tensor cores can run it while the softmax runs
  3  raw max, ``tl.range(..., warp_specialize=True)`` over the unmasked tiles

Prints and writes (``OUT_DIR/attn_fwd_schedule.json``) µs per forward (median over interleaved
rounds), TFLOP/s (causal counted as half the square), the largest difference from SDPA's output,
registers and spills, the ``wgmma.wait_group`` instructions of each compiled variant's PTX (a
wait with a count above zero leaves that many matrix products in flight) and its block-wide
barriers (``bar.sync``), and keeps each variant's PTX in ``OUT_DIR``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

_LOG2E = 1.4426950408889634


@triton.jit
def _softmax_pv(qk, m_i, l_i, acc, v, qk_scale, RAW: tl.constexpr):
    if RAW:
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        p = tl.math.exp2(qk * qk_scale - m_new[:, None])
    else:
        s = qk * qk_scale
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc)
    return m_new, l_i, acc


@triton.jit
def _fwd(q_desc, k_desc, v_desc, o_ptr, S, qk_scale,
         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, CAUSAL: tl.constexpr,
         VARIANT: tl.constexpr):
    pid_m = tl.program_id(0)
    if CAUSAL:  # the longest rows first
        pid_m = tl.num_programs(0) - 1 - pid_m
    row0 = tl.program_id(1) * S
    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    q = q_desc.load([row0 + m0, 0])
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, D), tl.float32)
    hi = S
    if CAUSAL:
        hi = m0
    if VARIANT == 2:
        if hi > 0:
            k = k_desc.load([row0, 0])
            qk = tl.dot(q, tl.trans(k))
            for n in range(0, hi - BLOCK_N, BLOCK_N):
                k_next = k_desc.load([row0 + n + BLOCK_N, 0])
                qk_next = tl.dot(q, tl.trans(k_next))
                v = v_desc.load([row0 + n, 0])
                m_i, l_i, acc = _softmax_pv(qk, m_i, l_i, acc, v, qk_scale, True)
                qk = qk_next
            v = v_desc.load([row0 + hi - BLOCK_N, 0])
            m_i, l_i, acc = _softmax_pv(qk, m_i, l_i, acc, v, qk_scale, True)
    elif VARIANT == 3:
        for n in tl.range(0, hi, BLOCK_N, warp_specialize=True):
            k = k_desc.load([row0 + n, 0])
            qk = tl.dot(q, tl.trans(k))
            v = v_desc.load([row0 + n, 0])
            m_i, l_i, acc = _softmax_pv(qk, m_i, l_i, acc, v, qk_scale, True)
    else:
        for n in range(0, hi, BLOCK_N):
            k = k_desc.load([row0 + n, 0])
            qk = tl.dot(q, tl.trans(k))
            v = v_desc.load([row0 + n, 0])
            m_i, l_i, acc = _softmax_pv(qk, m_i, l_i, acc, v, qk_scale, VARIANT == 1)
    if CAUSAL:  # the diagonal tiles, masked
        for n in range(m0, m0 + BLOCK_M, BLOCK_N):
            k = k_desc.load([row0 + n, 0])
            qk = tl.dot(q, tl.trans(k))
            offs_n = n + tl.arange(0, BLOCK_N)
            qk = tl.where(offs_m[:, None] >= offs_n[None, :], qk, float("-inf"))
            v = v_desc.load([row0 + n, 0])
            m_i, l_i, acc = _softmax_pv(qk, m_i, l_i, acc, v, qk_scale, VARIANT >= 1)
    out = acc / l_i[:, None]
    rows = row0 + offs_m
    tl.store(o_ptr + rows.to(tl.int64)[:, None] * D + tl.arange(0, D)[None, :], out.to(o_ptr.dtype.element_ty))


def _waits(ptx: str) -> dict[str, int]:
    """``wgmma.wait_group N`` instructions by N, and (key ``"bar.sync"``) the block-wide barriers,
    which every warp of the program must reach before any goes on."""
    out: dict[str, int] = {}
    for n in re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", ptx):
        out[n] = out.get(n, 0) + 1
    out["bar.sync"] = len(re.findall(r"\b(?:bar|barrier)\.sync\b", ptx))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--seqlen", type=int, default=8192)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--stages", nargs="+", type=int, default=[3, 2])
    ap.add_argument("--variants", nargs="+", type=int, default=[0, 1, 2, 3])
    args = ap.parse_args()
    from fp8ops.kernels import attention as KA

    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    B, H, S, D = args.batch, args.heads, args.seqlen, 128
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    scale = D ** -0.5
    BM = BN = 128
    q2, k2, v2 = (t.reshape(B * H * S, D) for t in (q, k, v))
    qd = TensorDescriptor(q2, [B * H * S, D], [D, 1], [BM, D])
    kd = TensorDescriptor(k2, [B * H * S, D], [D, 1], [BN, D])
    vd = TensorDescriptor(v2, [B * H * S, D], [D, 1], [BN, D])
    rows = []
    for causal in (True, False):
        ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal).float()
        flops = 4 * B * H * S * S * D / (2 if causal else 1)
        runs: dict[str, object] = {}
        meta: dict[str, dict[str, object]] = {}
        for variant in args.variants:
            for stages in args.stages:
                name = f"v{variant} s{stages}"
                o = torch.empty_like(q)

                def run(o=o, variant=variant, stages=stages):  # type: ignore[no-untyped-def]
                    return _fwd[(S // BM, B * H)](qd, kd, vd, o, S, scale * _LOG2E, BLOCK_M=BM, BLOCK_N=BN, D=D,
                                                  CAUSAL=causal, VARIANT=variant, num_warps=8, num_stages=stages)

                try:
                    ck = run()
                except Exception as exc:  # out of shared memory; a schedule this Triton rejects
                    print(name, "skipped:", str(exc)[:120], flush=True)
                    continue
                torch.cuda.synchronize()
                os.makedirs(args.out, exist_ok=True)
                with open(os.path.join(args.out, f"attn_fwd_v{variant}_s{stages}_{'causal' if causal else 'none'}.ptx"),
                          "w") as f:
                    f.write(ck.asm["ptx"])
                meta[name] = {"err": float((o.float() - ref).abs().max()), "n_regs": ck.n_regs,
                              "n_spills": ck.n_spills, "waits": _waits(ck.asm["ptx"])}
                runs[name] = run
        lo = torch.empty_like(q)
        lse = torch.empty(B, H, S, device="cuda", dtype=torch.float32)

        def lib(lo=lo, lse=lse):  # type: ignore[no-untyped-def]
            KA.attention_fwd_launch(q, k, v, lo, lse, sm_scale=scale, window=(None, 0) if causal else (None, None))

        lib()
        torch.cuda.synchronize()
        meta["library"] = {"err": float((lo.float() - ref).abs().max())}
        runs["library"] = lib
        times: dict[str, list[float]] = {n: [] for n in runs}
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        for _ in range(args.rounds):
            for n, fn in runs.items():
                fn()  # type: ignore[operator]
                ev[0].record()
                for _ in range(5):
                    fn()  # type: ignore[operator]
                ev[1].record()
                torch.cuda.synchronize()
                times[n].append(ev[0].elapsed_time(ev[1]) * 1e3 / 5)
        for n in runs:
            us = statistics.median(times[n])
            row = {"mask": "causal" if causal else "none", "variant": n, "us": round(us, 1),
                   "spread_us": round(max(times[n]) - min(times[n]), 1), "tflops": round(flops / us / 1e6, 1),
                   **meta[n]}
            rows.append(row)
            print(json.dumps(row), flush=True)
    os.makedirs(args.out, exist_ok=True)
    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "shape": {"B": B, "H": H, "S": S, "D": D}}
    with open(os.path.join(args.out, "attn_fwd_schedule.json"), "w") as f:
        json.dump({"env": env, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
