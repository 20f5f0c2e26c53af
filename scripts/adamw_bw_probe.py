"""What bounds an AdamW step on the GPU: device time of AdamW-shaped kernels against the copy bandwidth.

At one bf16 weight shape (12288 x 4096 unless ``--shape``), µs and TB/s (bytes read + written) of:

- ``copy``: ``dst.copy_(src)`` of the weight (one read and one write stream);
- ``torch AdamW``: ``torch.optim.AdamW(fused=True, capturable=True)`` on the one weight;
- ``flat BLOCK/warps[/evict][/grid-stride]``: a 1-D Triton AdamW (w, g, m, v read; w, m, v written;
  torch's float32 math), optionally with the weight's FP8 copy (``+q``, no transpose) or with both
  FP8 copies (``+q+qt``: the transposed one written through a (K, N) pointer store of 2-D tiles);
- ``library``: ``kernels.optim.adamw_cast_transpose_launch`` (2-D tiles, both FP8 copies).

Every variant's w / m / v are checked against the library kernel's after one step from the same
values (equal bits). ``--gpt H``: also torch's multi-tensor fused AdamW over every parameter of the
bench's GPT at hidden H against the flat kernel over the same tensors one launch each and against
``fp8ops.adamw_`` (eight tensors a launch).

    python scripts/adamw_bw_probe.py [--json OUT] [--gpt 2048]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

from fp8ops.kernels.optim import _adamw_bias, _adamw_math  # the library's AdamW body, in every variant

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gemm_host_check import device_us  # noqa: E402  (CUDA events around 20 calls, median of 5)

BETAS, EPS, WD = (0.9, 0.999), 1e-8, 1e-2


@triton.jit
def _flat_adamw(w_ptr, g_ptr, m_ptr, v_ptr, q_ptr, step_ptr, lr_ptr, scale_ptr, n, beta1, beta2, eps, wd,
                BLOCK: tl.constexpr, Q: tl.constexpr, EVICT: tl.constexpr, STRIDE: tl.constexpr):
    lr = tl.load(lr_ptr)
    bias1, bias2_sqrt = _adamw_bias(step_ptr, beta1, beta2)
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    nblocks = tl.cdiv(n, BLOCK)
    for b in range(pid, nblocks if STRIDE else pid + 1, nprog if STRIDE else 1):
        offs = b.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        if EVICT:
            w = tl.load(w_ptr + offs, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
            g = tl.load(g_ptr + offs, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
            m = tl.load(m_ptr + offs, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
            v = tl.load(v_ptr + offs, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
        else:
            w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            m = tl.load(m_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            v = tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        w, m, v = _adamw_math(w, g, m, v, lr, bias1, bias2_sqrt, beta1, beta2, eps, wd)
        w_out = w.to(w_ptr.dtype.element_ty)
        tl.store(w_ptr + offs, w_out, mask=mask)
        tl.store(m_ptr + offs, m.to(m_ptr.dtype.element_ty), mask=mask)
        tl.store(v_ptr + offs, v.to(v_ptr.dtype.element_ty), mask=mask)
        if Q:
            s = tl.load(scale_ptr)
            x = tl.clamp(w_out.to(tl.float32) * s, -448.0, 448.0)
            tl.store(q_ptr + offs, x.to(q_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _tile_adamw(w_ptr, g_ptr, m_ptr, v_ptr, q_ptr, qt_ptr, step_ptr, lr_ptr, scale_ptr, amax_ptr, N, K, beta1, beta2,
                eps, wd, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, Q: tl.constexpr,
                QT: tl.constexpr, CS: tl.constexpr):
    # the library kernel's body (kernels/optim.py) with its FP8 stores switchable
    pid = tl.program_id(0)
    num_m = tl.cdiv(N, BLOCK_M)
    num_k = tl.cdiv(K, BLOCK_K)
    width = GROUP_M * num_k
    group_id = pid // width
    first_m = group_id * GROUP_M
    gsize = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % gsize)
    pid_k = (pid % width) // gsize
    lr = tl.load(lr_ptr)
    s = tl.load(scale_ptr)
    bias1, bias2_sqrt = _adamw_bias(step_ptr, beta1, beta2)
    rm = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    rk = pid_k.to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rm[:, None] < N) & (rk[None, :] < K)
    offs = rm[:, None] * K + rk[None, :]
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    m = tl.load(m_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    w, m, v = _adamw_math(w, g, m, v, lr, bias1, bias2_sqrt, beta1, beta2, eps, wd)
    w_out = w.to(w_ptr.dtype.element_ty)
    if CS:
        tl.store(w_ptr + offs, w_out, mask=mask, cache_modifier=".cs")
        tl.store(m_ptr + offs, m.to(m_ptr.dtype.element_ty), mask=mask, cache_modifier=".cs")
        tl.store(v_ptr + offs, v.to(v_ptr.dtype.element_ty), mask=mask, cache_modifier=".cs")
    else:
        tl.store(w_ptr + offs, w_out, mask=mask)
        tl.store(m_ptr + offs, m.to(m_ptr.dtype.element_ty), mask=mask)
        tl.store(v_ptr + offs, v.to(v_ptr.dtype.element_ty), mask=mask)
    ws = tl.where(mask, w_out.to(tl.float32), 0.0)
    qv = tl.clamp(ws * s, -448.0, 448.0).to(q_ptr.dtype.element_ty)
    if Q:
        tl.store(q_ptr + offs, qv, mask=mask)
    if QT:
        tl.store(qt_ptr + rk[:, None] * N + rm[None, :], tl.trans(qv), mask=tl.trans(mask))
    if Q:
        tl.atomic_max(amax_ptr.to(tl.pointer_type(tl.int32)), tl.max(tl.max(tl.abs(ws).to(tl.int32, bitcast=True), 1), 0),
                      sem="relaxed")


def tile(w, g, m, v, q, qt, step, lr, scale, amax, *, bm=32, bk=128, warps=4, group=8, Q=True, QT=True, cs=False):
    N, K = w.shape
    grid = (triton.cdiv(N, bm) * triton.cdiv(K, bk),)
    _tile_adamw[grid](w, g, m, v, q, qt, step, lr, scale, amax, N, K, BETAS[0], BETAS[1], EPS, WD, BLOCK_M=bm,
                      BLOCK_K=bk, GROUP_M=group, Q=Q, QT=QT, CS=cs, num_warps=warps)


def flat(w, g, m, v, q, step, lr, scale, *, block=2048, warps=4, evict=False, stride=0):
    n = w.numel()
    nb = triton.cdiv(n, block)
    grid = (min(nb, stride),) if stride else (nb,)
    _flat_adamw[grid](w, g, m, v, q if q is not None else w, step, lr, scale, n, BETAS[0], BETAS[1], EPS, WD,
                      BLOCK=block, Q=q is not None, EVICT=evict, STRIDE=bool(stride), num_warps=warps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--shape", type=int, nargs=2, default=[12288, 4096])
    ap.add_argument("--gpt", type=int, nargs="*", default=[])
    args = ap.parse_args()
    from fp8ops.kernels.optim import adamw_cast_transpose_launch

    N, K = args.shape
    dev = "cuda"
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "shape": [N, K], "rows": []}
    print(out["gpu"], torch.__version__, triton.__version__, flush=True)
    gen = torch.Generator(device=dev).manual_seed(0)
    w0 = (torch.randn(N, K, device=dev, generator=gen) * 0.02).bfloat16()
    g0 = (torch.randn(N, K, device=dev, generator=gen) * 1e-3).bfloat16()
    m0 = (torch.randn(N, K, device=dev, generator=gen) * 1e-4).bfloat16()
    v0 = (torch.rand(N, K, device=dev, generator=gen) * 1e-7).bfloat16()
    step = torch.ones((), device=dev)
    lr = torch.tensor(1e-3, device=dev)
    scale = torch.tensor(448.0 / 0.1, device=dev)
    q = torch.empty(N, K, dtype=torch.float8_e4m3fn, device=dev)
    qt = torch.empty(K, N, dtype=torch.float8_e4m3fn, device=dev)
    inv = torch.empty((), device=dev)
    n = N * K

    # reference bits: the library kernel after one step
    wr, mr, vr = w0.clone(), m0.clone(), v0.clone()
    adamw_cast_transpose_launch(wr, g0, mr, vr, step, lr, scale, q, qt, inv, *BETAS, EPS, WD)
    qr, qtr = q.clone(), qt.clone()

    def row(name: str, us: float, nbytes: int, same: bool | None = None) -> None:
        r = {"name": name, "us": us, "TB_s": nbytes / us / 1e6, "same_bits": same}
        out["rows"].append(r)
        print(f"{name:40s} {us:9.1f} us {r['TB_s']:6.2f} TB/s  same={same}", flush=True)

    src, dst = w0.clone(), torch.empty_like(w0)
    row("copy (bf16 weight)", device_us(lambda: dst.copy_(src)), 4 * n)
    big = torch.empty(4 * n, dtype=torch.bfloat16, device=dev)
    big2 = torch.empty_like(big)
    row("copy (4x the weight)", device_us(lambda: big2.copy_(big)), 16 * n)

    w_t = w0.clone().requires_grad_()
    w_t.grad = g0.clone()
    opt = torch.optim.AdamW([w_t], lr=lr, betas=BETAS, eps=EPS, weight_decay=WD, fused=True, capturable=True)
    opt.step()
    row("torch AdamW (fused, capturable)", device_us(opt.step), 14 * n)

    w, m, v = w0.clone(), m0.clone(), v0.clone()
    row("library (adamw + q + qt, 2-D)",
        device_us(lambda: adamw_cast_transpose_launch(w, g0, m, v, step, lr, scale, q, qt, inv, *BETAS, EPS, WD)),
        16 * n)

    for cfg in ({"BLOCK_M": 32, "BLOCK_K": 128, "num_warps": 8}, {"BLOCK_M": 32, "BLOCK_K": 64, "num_warps": 4},
                {"BLOCK_M": 32, "BLOCK_K": 64, "num_warps": 8}, {"BLOCK_M": 16, "BLOCK_K": 128, "num_warps": 4},
                {"BLOCK_M": 64, "BLOCK_K": 64, "num_warps": 8}, {"BLOCK_M": 32, "BLOCK_K": 128, "num_warps": 8, "TMA": True},
                {"BLOCK_M": 64, "BLOCK_K": 128, "num_warps": 16}, {"BLOCK_M": 32, "BLOCK_K": 256, "num_warps": 16}):
        w, m, v = w0.clone(), m0.clone(), v0.clone()
        q2, qt2 = torch.empty_like(q), torch.empty_like(qt)
        adamw_cast_transpose_launch(w, g0, m, v, step, lr, scale, q2, qt2, inv, *BETAS, EPS, WD, config=cfg)
        same = (torch.equal(w, wr) and torch.equal(m, mr) and torch.equal(v, vr) and torch.equal(q2.view(torch.uint8), qr.view(torch.uint8))
                and torch.equal(qt2.view(torch.uint8), qtr.view(torch.uint8)))
        row("library " + "/".join(f"{k}={v}" for k, v in cfg.items()),
            device_us(lambda: adamw_cast_transpose_launch(w, g0, m, v, step, lr, scale, q2, qt2, inv, *BETAS, EPS, WD,
                                                          config=cfg)), 16 * n, same)

    variants = []
    for block in (1024, 2048, 4096, 8192):
        for warps in (4, 8):
            variants.append(dict(block=block, warps=warps))
    variants += [dict(block=2048, warps=4, evict=True), dict(block=4096, warps=8, evict=True),
                 dict(block=2048, warps=4, stride=sms * 8), dict(block=4096, warps=8, stride=sms * 4),
                 dict(block=1024, warps=4, stride=sms * 16)]
    for kw in variants:
        name = "flat " + "/".join(f"{k}={v}" for k, v in kw.items())
        w, m, v = w0.clone(), m0.clone(), v0.clone()
        flat(w, g0, m, v, None, step, lr, scale, **kw)
        same = torch.equal(w, wr) and torch.equal(m, mr) and torch.equal(v, vr)
        row(name, device_us(lambda: flat(w, g0, m, v, None, step, lr, scale, **kw)), 14 * n, same)
    for kw in (dict(block=2048, warps=4), dict(block=4096, warps=8), dict(block=2048, warps=4, evict=True)):
        name = "flat +q " + "/".join(f"{k}={v}" for k, v in kw.items())
        w, m, v = w0.clone(), m0.clone(), v0.clone()
        row(name, device_us(lambda: flat(w, g0, m, v, q, step, lr, scale, **kw)), 15 * n)

    amax = torch.zeros((), device=dev)
    tvars = [dict(), dict(QT=False), dict(Q=False, QT=False), dict(cs=True), dict(bm=64, bk=64),
             dict(bm=32, bk=64), dict(bm=16, bk=128, warps=2), dict(bm=32, bk=128, warps=8), dict(bm=64, bk=128, warps=8),
             dict(bm=64, bk=256, warps=8), dict(group=1), dict(group=32), dict(bm=128, bk=128, warps=16)]
    for kw in tvars:
        name = "tile " + "/".join(f"{k}={v}" for k, v in kw.items())
        w, m, v = w0.clone(), m0.clone(), v0.clone()
        tile(w, g0, m, v, q, qt, step, lr, scale, amax, **kw)
        same = torch.equal(w, wr) and torch.equal(m, mr) and torch.equal(v, vr)
        nb = 14 * n + (n if kw.get("Q", True) else 0) + (n if kw.get("QT", True) else 0)
        row(name, device_us(lambda: tile(w, g0, m, v, q, qt, step, lr, scale, amax, **kw)), nb, same)

    for H in args.gpt:
        V, S, L = 50304, 1024, {512: 6, 768: 12, 2048: 8, 4096: 4}[H]
        shapes = [(V, H), (S, H)] + [(H,), (H,)] * (2 * L + 1)
        for _ in range(L):
            shapes += [(3 * H, H), (3 * H,), (H, H), (H,), (4 * H, H), (4 * H,), (H, 4 * H), (H,)]
        ps = [torch.zeros(s, device=dev, dtype=torch.bfloat16).normal_(0, 0.02).requires_grad_() for s in shapes]
        for p in ps:
            p.grad = torch.randn_like(p) * 1e-3
        total = sum(p.numel() for p in ps)
        opt = torch.optim.AdamW(ps, lr=lr, betas=BETAS, eps=EPS, weight_decay=WD, fused=True, capturable=True)
        opt.step()
        row(f"gpt {H}: torch AdamW over {len(ps)} tensors", device_us(opt.step), 14 * total)
        ms = [torch.zeros_like(p) for p in ps]
        vs = [torch.zeros_like(p) for p in ps]
        ws = [p.detach() for p in ps]
        gs = [p.grad for p in ps]

        def all_flat(kw=dict(block=2048, warps=4)):
            for a, b, c, d in zip(ws, gs, ms, vs):
                flat(a, b, c, d, None, step, lr, scale, **kw)
        row(f"gpt {H}: flat, one launch per tensor", device_us(all_flat), 14 * total)
        import fp8ops

        t_lib = torch.zeros((), device=dev)
        row(f"gpt {H}: fp8ops.adamw_ (8 tensors a launch)",
            device_us(lambda: fp8ops.adamw_(ws, gs, ms, vs, t_lib, lr=lr, betas=BETAS, eps=EPS, weight_decay=WD)),
            14 * total)
        out.setdefault("gpt_params", {})[H] = total

    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
