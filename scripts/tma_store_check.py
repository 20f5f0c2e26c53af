"""Does a TMA store make the FP8 cast's transposed copy cheaper?

The GELU forward of ``fused_ln_mlp`` writes fc2's FP8 operand and its transposed copy; at 8192 x
2048 it took 36.8 µs against 22.9 µs for Inductor's GELU alone, which moves the same bytes (bf16
in, 2 x FP8 out against bf16 in, bf16 out), and dropping the transposed store took 14.6 µs off. The
cast with transposed copy (``cast_transpose``) stores the same way. Both write the transposed tile
with a pointer store of ``tl.trans(q)``, BLOCK_M contiguous bytes per row of q^T.

This script times, on inputs rotated beyond the L2 cache (device time of CUDA graph replays), for
GELU-tanh forward with the FP8 cast (delayed scaling) and for the plain cast with transposed copy:

- ``pointer``: the library kernel with pointer stores (``TMA: False``), its former default tile and
  a few others; ``library``: the library kernel as it launches now by default;
- ``tma_t``: the same kernel body, the transposed tile stored through a TMA tensor descriptor;
- ``tma``: both FP8 outputs stored through descriptors (and, ``tma_io``, the input loaded
  through one too),

for several tiles each, checks that every variant writes the same bytes as the library kernel, and
prints the best tile of each variant per shape with its ratio to the default.

The GELU backward (its FP8 gradient's transposed copy, also for SwiGLU) is timed as the library
launches it, with and without TMA.

    python scripts/tma_store_check.py --out DIR [--quick] [--only-library]

Writes ``DIR/tma_store_check.json``. Needs a Hopper GPU (TMA).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from fp8ops.bench import common
from fp8ops.kernels import activation as ka
from fp8ops.kernels import quantize as kq
from fp8ops.kernels._jit import abs_bits, atomic_amax, grouped_tile, saturate

E4M3 = torch.float8_e4m3fn
FP8_MAX = 448.0


@triton.jit
def _act_fwd_tma(h_ptr, h_desc, q_desc, qt_desc, scale_ptr, amax_ptr, inv_ptr, M, F, stride_hm, num_m, num_n,
                 ACT: tl.constexpr, FP8_MAX: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 GROUP_M: tl.constexpr, LOAD_TMA: tl.constexpr, Q_TMA: tl.constexpr, q_ptr):
    pid = tl.program_id(0)
    pid_m, pid_n = grouped_tile(pid, GROUP_M * num_n, num_m, GROUP_M=GROUP_M)
    off_m = pid_m * BLOCK_M
    off_n = pid_n * BLOCK_N
    rm = off_m.to(tl.int64) + tl.arange(0, BLOCK_M)
    rn = off_n.to(tl.int64) + tl.arange(0, BLOCK_N)
    mask = (rm[:, None] < M) & (rn[None, :] < F)
    if LOAD_TMA:
        x = h_desc.load([off_m, off_n]).to(tl.float32)  # out-of-bounds elements read as zeros
    else:
        x = tl.load(h_ptr + rm[:, None] * stride_hm + rn[None, :], mask=mask, other=0.0).to(tl.float32)
    a = ka._act(x, ACT=ACT)
    scale = tl.load(scale_ptr)
    if pid == 0:
        tl.store(inv_ptr, tl.math.div_rn(1.0 + tl.zeros_like(scale), scale))
    q = saturate(a * scale, FP8_MAX=FP8_MAX).to(tl.float8e4nv)
    if Q_TMA:
        q_desc.store([off_m, off_n], q)
    else:
        tl.store(q_ptr + rm[:, None] * F + rn[None, :], q, mask=mask)
    qt_desc.store([off_n, off_m], tl.trans(q))
    a = tl.where(mask, a, 0.0)
    atomic_amax(amax_ptr, tl.max(tl.max(abs_bits(a), axis=1), axis=0))


@triton.jit
def _cast_t_tma(x_ptr, x_desc, q_desc, qt_desc, scale_ptr, amax_ptr, inv_ptr, M, K, stride_xm,
                FP8_MAX: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                LOAD_TMA: tl.constexpr, Q_TMA: tl.constexpr, q_ptr):
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_k = tl.cdiv(K, BLOCK_K)
    pid_m, pid_k = grouped_tile(pid, GROUP_M * num_k, num_m, GROUP_M=GROUP_M)
    off_m = pid_m * BLOCK_M
    off_k = pid_k * BLOCK_K
    rm = off_m.to(tl.int64) + tl.arange(0, BLOCK_M)
    rk = off_k.to(tl.int64) + tl.arange(0, BLOCK_K)
    mask = (rm[:, None] < M) & (rk[None, :] < K)
    if LOAD_TMA:
        x = x_desc.load([off_m, off_k]).to(tl.float32)
    else:
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=mask, other=0.0).to(tl.float32)
    scale = tl.load(scale_ptr)
    if pid == 0:
        tl.store(inv_ptr, tl.math.div_rn(1.0 + tl.zeros_like(scale), scale))
    q = saturate(x * scale, FP8_MAX=FP8_MAX).to(tl.float8e4nv)
    if Q_TMA:
        q_desc.store([off_m, off_k], q)
    else:
        tl.store(q_ptr + rm[:, None] * K + rk[None, :], q, mask=mask)
    qt_desc.store([off_k, off_m], tl.trans(q))
    atomic_amax(amax_ptr, tl.max(tl.max(abs_bits(x), axis=1), axis=0))


def _alloc_descriptors() -> None:
    # device-side scratch for descriptors that Triton may need
    triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device="cuda"))


def _outputs(x: torch.Tensor, bm: int, bn: int) -> tuple[Any, ...]:
    """The FP8 outputs of a cast of x (M, N) with its transposed copy, and the descriptors of x, q
    and q^T for (bm, bn) tiles: ``(q, qt, amax, inv, x_desc, q_desc, qt_desc)``."""
    M, N = x.shape
    q = torch.empty((M, N), dtype=E4M3, device=x.device)
    qt = torch.empty((N, M), dtype=E4M3, device=x.device)
    amax = torch.zeros((), dtype=torch.float32, device=x.device)
    inv = torch.empty((), dtype=torch.float32, device=x.device)
    return (q, qt, amax, inv, TensorDescriptor(x, [M, N], [x.stride(0), 1], [bm, bn]),
            TensorDescriptor(q, [M, N], [N, 1], [bm, bn]), TensorDescriptor(qt, [N, M], [M, 1], [bn, bm]))


def act_variant(h: torch.Tensor, scale: torch.Tensor, variant: str, bm: int, bn: int, warps: int,
                group_m: int = 8) -> tuple[torch.Tensor, ...]:
    M, F = h.shape
    q, qt, amax, inv, h_desc, q_desc, qt_desc = _outputs(h, bm, bn)
    num_m, num_n = triton.cdiv(M, bm), triton.cdiv(F, bn)
    _act_fwd_tma[(num_m * num_n,)](
        h, h_desc, q_desc, qt_desc, scale, amax, inv, M, F, h.stride(0), num_m, num_n,
        ACT="gelu_tanh", FP8_MAX=FP8_MAX, BLOCK_M=bm, BLOCK_N=bn, GROUP_M=group_m,
        LOAD_TMA=variant == "tma_io", Q_TMA=variant in ("tma", "tma_io"), q_ptr=q, num_warps=warps)
    return q, qt, amax, inv


def act_library(h: torch.Tensor, scale: torch.Tensor, cfg: dict[str, int] | None) -> tuple[torch.Tensor, ...]:
    _, q, qt, amax, inv = ka.act_fwd_launch(h, "gelu_tanh", False, scale, None, 0, False, E4M3, True, True,
                                            config=cfg)
    return q, qt, amax, inv


def cast_variant(x: torch.Tensor, scale: torch.Tensor, variant: str, bm: int, bk: int, warps: int,
                 group_m: int = 8) -> tuple[torch.Tensor, ...]:
    M, K = x.shape
    q, qt, amax, inv, x_desc, q_desc, qt_desc = _outputs(x, bm, bk)
    grid = (triton.cdiv(M, bm) * triton.cdiv(K, bk),)
    _cast_t_tma[grid](x, x_desc, q_desc, qt_desc, scale, amax, inv, M, K, x.stride(0), FP8_MAX=FP8_MAX,
                      BLOCK_M=bm, BLOCK_K=bk, GROUP_M=group_m, LOAD_TMA=variant == "tma_io",
                      Q_TMA=variant in ("tma", "tma_io"), q_ptr=q, num_warps=warps)
    return q, qt, amax, inv


def cast_library(x: torch.Tensor, scale: torch.Tensor, cfg: dict[str, int] | None) -> tuple[torch.Tensor, ...]:
    q, qt, amax, inv = kq.cast_transpose_launch(x, scale, None, 0, False, E4M3, config=cfg)
    return q, qt, amax, inv


def _same(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> bool:
    return all(torch.equal(x.view(torch.uint8) if x.dtype == E4M3 else x, y.view(torch.uint8) if y.dtype == E4M3 else y)
               for x, y in zip(a, b))


def run_case(kind: str, M: int, N: int, quick: bool, log: list[dict[str, Any]]) -> None:
    sets = []
    for i in range(4 if M * N <= 8192 * 4096 else 2):
        g = torch.Generator(device="cuda").manual_seed(i)
        x = (torch.randn(M, N, generator=g, device="cuda") * 2).bfloat16()
        sets.append((x, torch.tensor(64.0, device="cuda")))
    lib = act_library if kind == "act_fwd" else cast_library
    var = act_variant if kind == "act_fwd" else cast_variant
    ref = lib(*sets[0], {"TMA": False})
    t_default = common.time_cuda(lambda x, s: lib(x, s, {"TMA": False}), sets, samples=10, max_calls=32).median_us
    t_lib = common.time_cuda(lambda x, s: lib(x, s, None), sets, samples=10, max_calls=32).median_us
    rows = [{"kind": kind, "M": M, "N": N, "variant": "pointer", "tile": "default", "us": t_default},
            {"kind": kind, "M": M, "N": N, "variant": "library", "tile": "default", "us": t_lib,
             "same_bytes": _same(lib(*sets[0], None), ref)}]
    tiles = [(32, 128, 4), (64, 64, 4), (64, 128, 4), (64, 128, 8), (128, 64, 4), (128, 128, 8), (128, 64, 8),
             (32, 256, 8), (64, 256, 8)]
    if quick:
        tiles = tiles[:3]
    key = ("BLOCK_M", "BLOCK_N" if kind == "act_fwd" else "BLOCK_K", "num_warps")
    for bm, bn, w in tiles:
        cfg = dict(zip(key, (bm, bn, w)), TMA=False)
        try:
            t = common.time_cuda(lambda x, s, c=cfg: lib(x, s, c), sets, samples=10, max_calls=32).median_us
            rows.append({"kind": kind, "M": M, "N": N, "variant": "pointer", "tile": f"{bm}x{bn}/{w}", "us": t})
        except Exception as e:  # noqa: BLE001 - a tile the library rejects
            print(f"  pointer {bm}x{bn}/{w}: {type(e).__name__}: {str(e)[:100]}")
        for v in ("tma_t", "tma", "tma_io"):
            try:
                out = var(*sets[0], v, bm, bn, w)
                torch.cuda.synchronize()
                if not _same(out, ref):
                    print(f"  {v} {bm}x{bn}/{w}: DIFFERENT BYTES from the library kernel")
                    continue
                t = common.time_cuda(lambda x, s, v=v, a=bm, b=bn, c=w: var(x, s, v, a, b, c), sets,
                                     samples=10, max_calls=32).median_us
                rows.append({"kind": kind, "M": M, "N": N, "variant": v, "tile": f"{bm}x{bn}/{w}", "us": t})
            except Exception as e:  # noqa: BLE001
                print(f"  {v} {bm}x{bn}/{w}: {type(e).__name__}: {str(e)[:160]}")
    log.extend(rows)
    gb = (M * N * (2 + 2)) / 1e9  # bf16 in, two FP8 outputs
    print(f"{kind} {M}x{N}: pointer default {t_default:.1f} µs ({gb / t_default * 1e6:.0f} GB/s); library default "
          f"{t_lib:.1f} µs ({t_lib / t_default:.3f}x, same bytes: {rows[1]['same_bytes']})")
    for v in ("pointer", "tma_t", "tma", "tma_io"):
        cand = [r for r in rows if r["variant"] == v]
        if cand:
            best = min(cand, key=lambda r: r["us"])
            print(f"   best {v:8s} {best['tile']:>12s} {best['us']:7.1f} µs  {best['us'] / t_default:.3f}x default")


def library_tma(kind: str, M: int, N: int, log: list[dict[str, Any]]) -> None:
    """The library kernel with its transposed copy through TMA (``TMA: True``) against pointer
    stores (``TMA: False``), same bytes checked."""
    sets = []
    for i in range(2):
        g = torch.Generator(device="cuda").manual_seed(10 + i)
        a = (torch.randn(M, 2 * N if kind == "act_bwd_gated" else N, generator=g, device="cuda") * 2).bfloat16()
        b = (torch.randn(M, N, generator=g, device="cuda") * 0.1).bfloat16()
        sets.append((a, b))
    scale = torch.tensor(64.0, device="cuda")

    def lib(a: torch.Tensor, b: torch.Tensor, cfg: dict[str, Any]) -> tuple[torch.Tensor, ...]:
        act = "swiglu" if kind == "act_bwd_gated" else "gelu_tanh"
        return ka.act_bwd_launch(b, a, act, False, scale, None, 0, False, E4M3, True, True, config=cfg)

    cfgs = [{"TMA": False}, {"TMA": True}]
    ref = lib(*sets[0], cfgs[0])
    base = None
    for cfg in cfgs:
        try:
            out = lib(*sets[0], cfg)
            same = all(torch.equal(x.view(torch.uint8) if x.dtype == E4M3 else x, y.view(torch.uint8) if y.dtype == E4M3 else y)
                       for x, y in zip(out, ref) if x.numel() and x.dtype in (E4M3, torch.bfloat16))
            t = common.time_cuda(lambda a, b, c=cfg: lib(a, b, c), sets, samples=10, max_calls=32).median_us
        except Exception as e:  # noqa: BLE001
            print(f"  {kind} {cfg}: {type(e).__name__}: {str(e)[:160]}")
            continue
        base = base if base is not None else t
        log.append({"kind": kind, "M": M, "N": N, "variant": "library", "config": cfg, "us": t, "same_bytes": same})
        print(f"{kind} {M}x{N} {cfg}: {t:.1f} µs ({t / base:.3f}x pointer), same bytes: {same}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only-library", action="store_true", help="only the library kernels' TMA on/off")
    args = ap.parse_args()
    _alloc_descriptors()
    log: list[dict[str, Any]] = []
    shapes = {"act_fwd": [(8192, 2048), (8192, 3072), (8192, 8192)],
              "cast_transpose": [(8192, 512), (8192, 1536), (8192, 768), (2048, 512), (8192, 4096)]}
    if args.quick:
        shapes = {k: v[:1] for k, v in shapes.items()}
    if args.only_library:
        shapes = {}
    for kind, ss in shapes.items():
        for M, N in ss:
            run_case(kind, M, N, args.quick, log)
    lib_shapes = {"act_bwd": [(8192, 2048), (8192, 3072), (8192, 8192)], "act_bwd_gated": [(8192, 2048)]}
    for kind, ss in lib_shapes.items():
        for M, N in (ss[:1] if args.quick else ss):
            library_tma(kind, M, N, log)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "tma_store_check.json").write_text(json.dumps({"env": common.environment(), "rows": log}, indent=1))


if __name__ == "__main__":
    main()
