"""Launch settings of three memory-bound kernels of a GPT step, timed side by side on the GPU, each
setting's outputs checked bit for bit against the default's first:

- the loss kernel (``linear_cross_entropy_fwd``, 8192 x 50304 bf16 logits): the grid, pass 2's
  direction and the L2 eviction hints (``EVICT``), next to
  two ceilings on the same tensor: a copy (its bytes read once and written once, what the kernel
  moves when its second read comes from L2) and a row maximum (read once);
- the norm forward with the transposed FP8 output (8192 x 4096 bf16, E4M3, with and without a
  residual, as the GPT's and the seed layer's pre-norms run): the default 32 x 256 tiles against
  other tiles and against whole rows (``BLOCK_K`` >= K) on a persistent grid;
- the cast with the transposed copy (``cast_transpose``, with and without the bias gradient's
  column sums; 8192 x 4096 bf16 to E4M3, as the GPT's output gradients): tiles and warps, with the
  transposed copy stored through TMA (the eager launch, and so a step captured whole) and through
  pointers (the kernel inside a compiled graph);
- the sort of the tied embedding's backward (8192 tokens): int64 against int32 keys, with the
  device operations each launches.

    python scripts/elementwise_ab.py [--out DIR]

Device time of CUDA-graph replays (``fp8ops.bench.common.time_cuda``), the norm's inputs rotated
beyond L2. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from fp8ops.bench import common
from fp8ops.kernels import linear_cross_entropy as KL
from fp8ops.kernels import norm as KN

LOSS_CONFIGS = [
    {},
    {"EVICT": False},
    {"PROGRAMS_PER_SM": 2, "EVICT": False},
    {"PROGRAMS_PER_SM": 2},
    {"PROGRAMS_PER_SM": 1},
    {"BLOCK_V": 4096, "num_warps": 8},
    {"BLOCK_V": 2048, "num_warps": 4},
    {"BLOCK_V": 4096, "num_warps": 8, "PROGRAMS_PER_SM": 2},
    {"REVERSE": False},
]
NORM_CONFIGS = [
    {},
    {"BLOCK_M": 16, "BLOCK_K": 256, "num_warps": 4},
    {"BLOCK_M": 32, "BLOCK_K": 512, "num_warps": 8},
    {"BLOCK_M": 64, "BLOCK_K": 128, "num_warps": 4},
    {"BLOCK_M": 64, "BLOCK_K": 256, "num_warps": 8},
    {"BLOCK_M": 4, "BLOCK_K": 4096, "num_warps": 8, "PROGRAMS_PER_SM": 2},
    {"BLOCK_M": 8, "BLOCK_K": 4096, "num_warps": 8, "PROGRAMS_PER_SM": 1},
    {"BLOCK_M": 8, "BLOCK_K": 4096, "num_warps": 16, "PROGRAMS_PER_SM": 1},
    {"BLOCK_M": 16, "BLOCK_K": 4096, "num_warps": 16, "PROGRAMS_PER_SM": 1},
    {"BLOCK_M": 16, "BLOCK_K": 4096, "num_warps": 32, "PROGRAMS_PER_SM": 1},
]

CAST_CONFIGS = [
    {"TMA": True},
    {"TMA": True, "BLOCK_M": 64, "BLOCK_K": 128},
    {"TMA": True, "BLOCK_M": 128, "BLOCK_K": 64},
    {"TMA": True, "BLOCK_M": 128, "BLOCK_K": 128, "num_warps": 8},
    {"TMA": True, "BLOCK_M": 32, "BLOCK_K": 128},
    {"TMA": True, "BLOCK_M": 64, "BLOCK_K": 64, "num_warps": 2},
    {"TMA": True, "BLOCK_M": 64, "BLOCK_K": 64, "GROUP_M": 1},
    {"TMA": False},
    {"TMA": False, "BLOCK_M": 128, "BLOCK_K": 128, "num_warps": 8},
    {"TMA": False, "BLOCK_M": 64, "BLOCK_K": 256, "num_warps": 8},
    {"TMA": False, "BLOCK_M": 32, "BLOCK_K": 256},
    {"TMA": False, "BLOCK_M": 64, "BLOCK_K": 64},
]


def _equal(a, b) -> bool:
    return all(torch.equal(x.view(torch.uint8) if x.dtype.itemsize == 1 else x,
                           y.view(torch.uint8) if y.dtype.itemsize == 1 else y) for x, y in zip(a, b))


def _loss(rows: list) -> None:
    M, V = 8192, 50304
    g = torch.Generator(device="cuda").manual_seed(0)
    z = torch.randn(M, V, device="cuda", generator=g).bfloat16() * 3
    t = torch.randint(0, V, (M,), device="cuda", generator=g)
    t[5] = -100
    want = KL.linear_cross_entropy_fwd_launch(z, t, -100)
    out = torch.empty_like(z)
    nbytes = M * V * 2
    for name, fn in (("copy (read once, write once)", lambda: out.copy_(z)),
                     ("row maximum (read once)", lambda: z.amax(dim=1))):
        tm = common.time_cuda(fn, [()], samples=20)
        moved = nbytes * (2 if name.startswith("copy") else 1)
        rows.append({"kernel": "loss", "case": name, "us": round(tm.median_us, 1),
                     "tb_s": round(moved / tm.median_us / 1e6, 3)})
        print(json.dumps(rows[-1]), flush=True)
    del out
    for cfg in LOSS_CONFIGS:
        got = KL.linear_cross_entropy_fwd_launch(z, t, -100, config=cfg)
        same = _equal(got, want)
        tm = common.time_cuda(lambda cfg=cfg: KL.linear_cross_entropy_fwd_launch(z, t, -100, config=cfg), [()],
                              samples=20)
        rows.append({"kernel": "loss", "case": "kernel", "config": cfg, "equal_to_default": same,
                     "us": round(tm.median_us, 1), "tb_s_2_bytes_in_2_out": round(2 * nbytes / tm.median_us / 1e6, 3)})
        print(json.dumps(rows[-1]), flush=True)


def _norm(rows: list) -> None:
    M, D = 8192, 4096
    dev, bf = "cuda", torch.bfloat16
    torch.manual_seed(0)
    w, b = torch.randn(D, device=dev), torch.randn(D, device=dev)
    cast = (torch.ones((), device=dev) * 8, None, 0, False, torch.float8_e4m3fn, True)

    def one_set(i: int):
        g = torch.Generator(device=dev).manual_seed(i)
        return (torch.randn(M, D, device=dev, dtype=bf, generator=g),
                torch.randn(M, D, device=dev, dtype=bf, generator=g))

    sets = common.input_sets(one_set, 2 * M * D * 2)
    for residual in (True, False):
        def fwd(x, r, cfg=None, residual=residual):
            y, s, q, q_t, amax, inv, mean, rstd = KN.norm_fwd_launch(
                x, r if residual else None, w, b, 1e-5, False, False, False, *cast, config=cfg)
            return s, q, q_t, amax, mean, rstd

        want = fwd(*sets[0])
        # bytes: x (+ the residual) read, s written with a residual, q and q_t written
        nbytes = M * D * ((2 + 2 + 2) if residual else 2) + 2 * M * D
        for cfg in NORM_CONFIGS:
            got = fwd(*sets[0], cfg=cfg)
            same = _equal(got, want)
            tm = common.time_cuda(lambda x, r, cfg=cfg: fwd(x, r, cfg), sets, samples=20)
            rows.append({"kernel": "norm forward, transposed FP8", "residual": residual, "config": cfg,
                         "equal_to_default": same, "us": round(tm.median_us, 1),
                         "tb_s": round(nbytes / tm.median_us / 1e6, 3)})
            print(json.dumps(rows[-1]), flush=True)


def _cast(rows: list) -> None:
    from fp8ops.kernels import quantize as KQ

    M, D = 8192, 4096
    scale = torch.full((), 8.0, device="cuda")

    def one_set(i: int):
        g = torch.Generator(device="cuda").manual_seed(i)
        return (torch.randn(M, D, device="cuda", dtype=torch.bfloat16, generator=g),)

    sets = common.input_sets(one_set, M * D * 2)
    for dbias in (False, True):
        launch = KQ.cast_transpose_dbias_launch if dbias else KQ.cast_transpose_launch

        def fn(x, cfg=None, launch=launch):
            return launch(x, scale, None, 0, False, torch.float8_e4m3fn, config=cfg)

        want = fn(*sets[0], cfg={"TMA": False})
        for cfg in CAST_CONFIGS:
            got = fn(*sets[0], cfg=cfg)
            # the column sums add tile rows in another order with another BLOCK_M
            same = _equal(got[:4], want[:4]) and (not dbias or torch.allclose(got[4], want[4], rtol=1e-5, atol=1e-3))
            tm = common.time_cuda(lambda x, cfg=cfg: fn(x, cfg), sets, samples=20)
            rows.append({"kernel": "cast_transpose" + ("_dbias" if dbias else ""), "config": cfg,
                         "equal_to_pointer_default": same, "us": round(tm.median_us, 1),
                         "tb_s": round(4 * M * D / tm.median_us / 1e6, 3)})
            print(json.dumps(rows[-1]), flush=True)


def _sort(rows: list) -> None:
    from torch.profiler import ProfilerActivity, profile

    tok = torch.randint(0, 50304, (8192,), device="cuda")
    for name, fn in (("int64 keys", lambda: torch.sort(tok, stable=True)),
                     ("int32 keys", lambda: torch.sort(tok.to(torch.int32), stable=True))):
        a, b = torch.sort(tok, stable=True)
        a2, b2 = fn()
        same = torch.equal(a, a2.long()) and torch.equal(b, b2)
        tm = common.time_cuda(fn, [()], samples=20)
        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        ops = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        rows.append({"kernel": "tied backward's sort", "case": name, "equal": same, "us": round(tm.median_us, 1),
                     "device_ops": len(ops), "names": sorted({e.name[:60] for e in ops})})
        print(json.dumps(rows[-1]), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--only", nargs="+", choices=["loss", "norm", "cast", "sort"],
                    default=["loss", "norm", "cast", "sort"])
    args = ap.parse_args()
    rows: list = []
    for part in args.only:
        {"loss": _loss, "norm": _norm, "cast": _cast, "sort": _sort}[part](rows)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        common.write_json(os.path.join(args.out, "elementwise_ab.json"),
                          {"environment": common.environment(), "rows": rows})


if __name__ == "__main__":
    main()
