"""Launch configurations of the LayerNorm backward and the GELU activation kernels at the sizes of
small models (8192 tokens, hidden 512-2048), where a GPT step runs them after every GEMM.

At hidden 512 a compiled fp8ops GPT step spent 28 µs per LayerNorm backward (plus two reductions
and two dtype conversions for the weight and bias gradients) where Inductor's fused LayerNorm
backward took 10 µs. This script times, on inputs rotated beyond the L2 cache (device time of CUDA
graph replays):

- ``norm_bwd``: the whole ``norm_bwd_launch`` (row kernel + finalize) for every configuration of
  ``BLOCK_M`` x ``num_warps`` x ``PROGRAMS_PER_SM``, next to the default and to ATen's
  ``native_layer_norm_backward``; and the bytes moved as a fraction of a device copy;
- ``norm_fwd_t``: the LayerNorm forward writing the FP8 operand and its transposed copy (what
  ``layernorm_linear`` launches), for tiles ``BLOCK_M`` x ``BLOCK_K`` x ``num_warps``;
- ``act_fwd`` / ``act_bwd``: GELU (tanh) forward writing the FP8 operand and its transposed copy,
  backward writing the FP8 gradient, its transposed copy and the bias gradient (what
  ``fused_ln_mlp`` launches), for tiles ``BLOCK_M`` x ``BLOCK_N`` x ``num_warps``, next to the default.

    python scripts/small_kernel_sweep.py --out DIR [--cases norm_bwd,norm_fwd_t,act_fwd,act_bwd] [--quick]

Writes ``DIR/small_kernel_sweep.json`` (every timing) and prints the best configuration per shape
with its ratio to the default. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path
from typing import Any

import torch
import triton
import triton.language as tl

from fp8ops.bench import common
from fp8ops.kernels import activation as ka
from fp8ops.kernels import norm as kn
from fp8ops.kernels import quantize as kq
from fp8ops.kernels._jit import abs_bits, atomic_amax, cast_fp8, grouped_tile

E4M3 = torch.float8_e4m3fn
M = 8192


def _time(fn: Any, sets: list[Any]) -> float:
    return common.time_cuda(fn, sets, samples=10, max_calls=32).median_us


def sweep_norm_bwd(Ks: list[int], quick: bool, log: list[dict[str, Any]], cbw: float) -> None:
    for K in Ks:
        bk = 1 << (K - 1).bit_length()

        def make(i: int, K: int = K) -> tuple[torch.Tensor, ...]:
            g = torch.Generator(device="cuda").manual_seed(i)
            x = torch.randn(M, K, generator=g, device="cuda").bfloat16()
            dy = torch.randn(M, K, generator=g, device="cuda").bfloat16()
            w = (1 + 0.1 * torch.randn(K, generator=g, device="cuda")).bfloat16()
            b = (0.1 * torch.randn(K, generator=g, device="cuda")).bfloat16()
            _, mean, rstd = torch.ops.aten.native_layer_norm(x, [K], w, b, 1e-5)
            return dy, x, w, b, mean.view(-1).contiguous(), rstd.view(-1).contiguous()

        sets = common.input_sets(make, 3 * M * K * 2)
        nbytes = 3 * M * K * 2  # read dy and x, write dx (bf16)
        ref = kn.norm_bwd_launch(*[sets[0][i] for i in (0, 1, 2, 4, 5)], None, False, False, True)

        def ours(dy: Any, x: Any, w: Any, b: Any, mean: Any, rstd: Any, cfg: Any = None) -> Any:
            return kn.norm_bwd_launch(dy, x, w, mean, rstd, None, False, False, True, config=cfg)

        def aten(dy: Any, x: Any, w: Any, b: Any, mean: Any, rstd: Any) -> Any:
            return torch.ops.aten.native_layer_norm_backward(dy, x, [K], mean.view(M, 1), rstd.view(M, 1), w, b,
                                                             [True, True, True])

        base = _time(ours, sets)
        at = _time(aten, sets)
        print(f"norm_bwd {M}x{K}: default {kn._bwd_default(K)} {base:.1f} us ({nbytes / base / 1e6 / cbw:.2f} of copy); "
              f"aten {at:.1f} us", flush=True)
        log.append({"case": "norm_bwd", "K": K, "config": "default", "us": base, "default": kn._bwd_default(K)})
        log.append({"case": "norm_bwd", "K": K, "config": "aten", "us": at})
        bms = [1, 2, 4] if quick else [1, 2, 4, 8, 16]
        warps = [4] if quick else [1, 2, 4, 8]
        ppss = [2, 8] if quick else [1, 2, 4, 8, 16]
        best = (base, "default")
        for bm, nw, pps in itertools.product(bms, warps, ppss):
            if bm * bk > 16384:
                continue
            cfg = {"BLOCK_M": bm, "BLOCK_K": bk, "num_warps": nw, "PROGRAMS_PER_SM": pps}
            got = ours(*sets[0], cfg=cfg)
            # another warp count sums the rows in another order: dx may differ in the last bit
            ok = bool(torch.allclose(got[0].float(), ref[0].float(), rtol=1e-2, atol=1e-2)
                      and torch.allclose(got[1].float(), ref[1].float(), rtol=2e-2, atol=1e-2))
            us = _time(lambda *a, cfg=cfg: ours(*a, cfg=cfg), sets)
            log.append({"case": "norm_bwd", "K": K, "config": cfg, "us": us, "same_dx": ok})
            if us < best[0] and ok:
                best = (us, str(cfg))
        print(f"  best {best[1]} {best[0]:.1f} us = {best[0] / base:.2f} x default", flush=True)


def sweep_norm_fwd(Ks: list[int], quick: bool, log: list[dict[str, Any]]) -> None:
    """The LayerNorm forward as ``layernorm_linear`` runs it: FP8 output and its transposed copy."""
    for K in Ks:
        def make(i: int, K: int = K) -> tuple[torch.Tensor, ...]:
            g = torch.Generator(device="cuda").manual_seed(i)
            x = torch.randn(M, K, generator=g, device="cuda").bfloat16()
            w = (1 + 0.1 * torch.randn(K, generator=g, device="cuda")).bfloat16()
            b = (0.1 * torch.randn(K, generator=g, device="cuda")).bfloat16()
            return x, w, b

        sets = common.input_sets(make, 4 * M * K)
        scale = torch.tensor(8.0, device="cuda")

        def run(x: Any, w: Any, b: Any, cfg: Any = None) -> Any:
            return kn.norm_fwd_launch(x, None, w, b, 1e-5, False, False, False, scale, None, 0, False, E4M3, True,
                                      config=cfg)

        ref = run(*sets[0])
        base = _time(run, sets)
        print(f"norm_fwd_t {M}x{K}: default {kn._fwd_default(K, True)} {base:.1f} us", flush=True)
        log.append({"case": "norm_fwd_t", "K": K, "config": "default", "us": base})
        best = (base, "default")
        bms = [16, 32] if quick else [8, 16, 32, 64]
        bks = [128, 256] if quick else [64, 128, 256, 512]
        for bm, bk, nw in itertools.product(bms, bks, [2, 4, 8]):
            if bm * bk > 16384 or bm * bk < 1024:
                continue
            cfg = {"BLOCK_M": bm, "BLOCK_K": bk, "num_warps": nw, "PROGRAMS_PER_SM": 1}
            got = run(*sets[0], cfg=cfg)
            same = sum(int(torch.equal(a.view(torch.uint8), b.view(torch.uint8))) for a, b in zip(got[2:4], ref[2:4]))
            us = _time(lambda *a, cfg=cfg: run(*a, cfg=cfg), sets)
            log.append({"case": "norm_fwd_t", "K": K, "config": cfg, "us": us, "same_bytes": same == 2})
            if us < best[0]:
                best = (us, f"{cfg} same bytes: {same == 2}")
        print(f"  best {best[1]} {best[0]:.1f} us = {best[0] / base:.2f} x default", flush=True)


def sweep_act(case: str, Fs: list[int], quick: bool, log: list[dict[str, Any]]) -> None:
    for F in Fs:
        def make(i: int, F: int = F) -> tuple[torch.Tensor, ...]:
            g = torch.Generator(device="cuda").manual_seed(i)
            h = torch.randn(M, F, generator=g, device="cuda").bfloat16()
            da = torch.randn(M, F, generator=g, device="cuda").bfloat16()
            return h, da

        sets = common.input_sets(make, 2 * M * F * 2)
        scale = torch.tensor(8.0, device="cuda")

        def run(h: Any, da: Any, cfg: Any = None) -> Any:
            if case == "act_fwd":
                return ka.act_fwd_launch(h, "gelu_tanh", False, scale, None, 0, False, E4M3, True, True, config=cfg)
            return ka.act_bwd_launch(da, h, "gelu_tanh", False, scale, None, 0, False, E4M3, True, True, config=cfg)

        ref = run(*sets[0])
        base = _time(run, sets)
        default = ka._FWD_CFG_TMA if case == "act_fwd" else ka._BWD_CFG
        print(f"{case} {M}x{F}: default {default} {base:.1f} us", flush=True)
        log.append({"case": case, "F": F, "config": "default", "us": base, "default": dict(default)})
        best = (base, "default")
        bms = [32, 64] if quick else [16, 32, 64, 128]
        bns = [64, 128] if quick else [32, 64, 128, 256]
        for bm, bn, nw in itertools.product(bms, bns, [4, 8]):
            if bm * bn > 16384 or bm * bn < 1024:
                continue
            cfg = {"BLOCK_M": bm, "BLOCK_N": bn, "GROUP_M": 8, "num_warps": nw}
            got = run(*sets[0], cfg=cfg)
            ok = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(got[1:3], ref[1:3]))
            us = _time(lambda *a, cfg=cfg: run(*a, cfg=cfg), sets)
            log.append({"case": case, "F": F, "config": cfg, "us": us, "same_bytes": ok})
            if us < best[0] and ok:
                best = (us, str(cfg))
        print(f"  best {best[1]} {best[0]:.1f} us = {best[0] / base:.2f} x default", flush=True)


@triton.jit
def _act_cast_transpose_kernel(x_ptr, q_ptr, qt_ptr, scale_ptr, amax_ptr, M, K,
                               BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    # The cast_transpose kernel's code with the tanh-GELU applied after the load: what the
    # activation forward costs when written in the cast's order.
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_k = tl.cdiv(K, BLOCK_K)
    pid_m, pid_k = grouped_tile(pid, GROUP_M * num_k, num_m, GROUP_M=GROUP_M)
    scale = tl.load(scale_ptr)
    rm = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    rk = pid_k.to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rm[:, None] < M) & (rk[None, :] < K)
    x = tl.load(x_ptr + rm[:, None] * K + rk[None, :], mask=mask, other=0.0).to(tl.float32)
    x = ka._act(x, ACT="gelu_tanh")
    q = cast_fp8(x, scale, q_ptr, FP8_MAX=448.0)
    tl.store(q_ptr + rm[:, None] * K + rk[None, :], q, mask=mask)
    tl.store(qt_ptr + rk[:, None] * M + rm[None, :], tl.trans(q), mask=tl.trans(mask))
    atomic_amax(amax_ptr, tl.max(tl.max(abs_bits(x), axis=1), axis=0))


@triton.jit
def _act_persistent_kernel(x_ptr, q_ptr, qt_ptr, scale_ptr, amax_ptr, M, K,
                           BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    # The same on a persistent grid: each program walks tiles pid, pid + P, ... and issues the
    # next tile's load before it computes and stores the current one.
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_k = tl.cdiv(K, BLOCK_K)
    num_tiles = num_m * num_k
    scale = tl.load(scale_ptr)
    pid_m, pid_k = grouped_tile(pid, GROUP_M * num_k, num_m, GROUP_M=GROUP_M)
    rm_n = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    rk_n = pid_k.to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask_n = (rm_n[:, None] < tl.where(pid < num_tiles, M, 0)) & (rk_n[None, :] < K)
    x_n = tl.load(x_ptr + rm_n[:, None] * K + rk_n[None, :], mask=mask_n, other=0.0)
    run = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.int32)
    for t in range(pid, num_tiles, nprog):
        rm = rm_n
        rk = rk_n
        mask = mask_n
        x = x_n.to(tl.float32)
        tn = t + nprog
        pid_m, pid_k = grouped_tile(tn, GROUP_M * num_k, num_m, GROUP_M=GROUP_M)
        rm_n = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        rk_n = pid_k.to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)
        mask_n = (rm_n[:, None] < tl.where(tn < num_tiles, M, 0)) & (rk_n[None, :] < K)
        x_n = tl.load(x_ptr + rm_n[:, None] * K + rk_n[None, :], mask=mask_n, other=0.0)
        a = ka._act(x, ACT="gelu_tanh")
        q = cast_fp8(a, scale, q_ptr, FP8_MAX=448.0)
        tl.store(q_ptr + rm[:, None] * K + rk[None, :], q, mask=mask)
        tl.store(qt_ptr + rk[:, None] * M + rm[None, :], tl.trans(q), mask=tl.trans(mask))
        run = tl.maximum(run, abs_bits(a))
    atomic_amax(amax_ptr, tl.max(tl.max(run, axis=1), axis=0))


def _compiled(kernel: Any) -> list[str]:
    """Register and spill counts of every compiled variant of a Triton kernel."""
    out = []
    for cache in kernel.device_caches.values():
        for k in cache[0].values():
            out.append(f"regs {k.n_regs} spills {k.n_spills} warps {k.metadata.num_warps} shared {k.metadata.shared}")
    return out


def act_decompose(Fs: list[int], log: list[dict[str, Any]]) -> None:
    """Where the activation forward's time goes: the default launch with other activations (no
    transcendental functions: relu) and with fewer outputs, next to a plain cast_transpose of h."""
    for F in Fs:
        def make(i: int, F: int = F) -> tuple[torch.Tensor]:
            g = torch.Generator(device="cuda").manual_seed(i)
            return (torch.randn(M, F, generator=g, device="cuda").bfloat16(),)

        sets = common.input_sets(make, 3 * M * F)
        da = torch.randn(M, F, device="cuda").bfloat16()
        scale = torch.tensor(8.0, device="cuda")
        variants = {
            "gelu_tanh q+q_t": lambda h: ka.act_fwd_launch(h, "gelu_tanh", False, scale, None, 0, False, E4M3, True, True),
            "gelu_tanh q": lambda h: ka.act_fwd_launch(h, "gelu_tanh", False, scale, None, 0, False, E4M3, True, False),
            "gelu_tanh y (bf16)": lambda h: ka.act_fwd_launch(h, "gelu_tanh", True, None, None, 0, False, None, False,
                                                             False),
            "relu q+q_t": lambda h: ka.act_fwd_launch(h, "relu", False, scale, None, 0, False, E4M3, True, True),
            "gelu q+q_t": lambda h: ka.act_fwd_launch(h, "gelu", False, scale, None, 0, False, E4M3, True, True),
            "cast_transpose of h": lambda h: kq.cast_transpose_launch(h, scale, None, 0, False, E4M3),
            "torch gelu tanh (bf16)": lambda h: torch.nn.functional.gelu(h, approximate="tanh"),
            "bwd q+q_t+dbias": lambda h: ka.act_bwd_launch(da, h, "gelu_tanh", False, scale, None, 0, False, E4M3,
                                                           True, True),
            "bwd q+q_t": lambda h: ka.act_bwd_launch(da, h, "gelu_tanh", False, scale, None, 0, False, E4M3, True,
                                                     False),
            "bwd q": lambda h: ka.act_bwd_launch(da, h, "gelu_tanh", False, scale, None, 0, False, E4M3, False, False),
            "torch gelu_backward (bf16)": lambda h: torch.ops.aten.gelu_backward(da, h, approximate="tanh"),
        }
        for bm, bn, nw in ((64, 128, 4), (32, 128, 4), (64, 64, 4)):
            def exp_kernel(h: torch.Tensor, bm: int = bm, bn: int = bn, nw: int = nw) -> Any:
                q = torch.empty(h.shape, dtype=E4M3, device=h.device)
                qt = torch.empty((h.shape[1], h.shape[0]), dtype=E4M3, device=h.device)
                amax = torch.zeros((), device=h.device)
                grid = (triton.cdiv(h.shape[0], bm) * triton.cdiv(h.shape[1], bn),)
                _act_cast_transpose_kernel[grid](h, q, qt, scale, amax, h.shape[0], h.shape[1], BLOCK_M=bm,
                                                 BLOCK_K=bn, GROUP_M=8, num_warps=nw)
                return q, qt, amax
            variants[f"cast-order gelu_tanh {bm}x{bn}/{nw}"] = exp_kernel
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        for bm, bn, nw, pps in ((32, 128, 4, 4), (32, 128, 4, 8), (64, 64, 4, 4), (64, 64, 4, 8), (32, 64, 4, 8),
                                (32, 64, 4, 16), (64, 128, 8, 2), (64, 128, 8, 4)):
            def pers_kernel(h: torch.Tensor, bm: int = bm, bn: int = bn, nw: int = nw, pps: int = pps) -> Any:
                q = torch.empty(h.shape, dtype=E4M3, device=h.device)
                qt = torch.empty((h.shape[1], h.shape[0]), dtype=E4M3, device=h.device)
                amax = torch.zeros((), device=h.device)
                tiles = triton.cdiv(h.shape[0], bm) * triton.cdiv(h.shape[1], bn)
                _act_persistent_kernel[(min(tiles, sms * pps),)](h, q, qt, scale, amax, h.shape[0], h.shape[1],
                                                                 BLOCK_M=bm, BLOCK_K=bn, GROUP_M=8, num_warps=nw)
                return q, qt, amax
            variants[f"persistent gelu_tanh {bm}x{bn}/{nw} x{pps}"] = pers_kernel
        for name, fn in variants.items():
            us = _time(fn, sets)
            print(f"act decompose {M}x{F}: {name:26s} {us:7.1f} us", flush=True)
            log.append({"case": "act_decompose", "F": F, "variant": name, "us": us})
        ref = variants["gelu_tanh q+q_t"](sets[0][0])
        for name in [n for n in variants if n.startswith("persistent")]:
            got = variants[name](sets[0][0])
            print(f"  {name} equal to act_fwd's: q {torch.equal(ref[1].view(torch.uint8), got[0].view(torch.uint8))}"
                  f" q_t {torch.equal(ref[2].view(torch.uint8), got[1].view(torch.uint8))} amax {float(got[2])} "
                  f"{float(ref[3])}", flush=True)
        got = variants["cast-order gelu_tanh 64x128/4"](sets[0][0])
        print(f"  cast-order bytes equal to act_fwd's: q {torch.equal(ref[1].view(torch.uint8), got[0].view(torch.uint8))}"
              f" q_t {torch.equal(ref[2].view(torch.uint8), got[1].view(torch.uint8))}", flush=True)
    for name, kern in (("act_fwd", ka._act_fwd_kernel), ("act_bwd", ka._act_bwd_kernel), ("cast-order", _act_cast_transpose_kernel),
                       ("persistent", _act_persistent_kernel),
                       ("cast_transpose", kq._cast_transpose_fwd_kernel)):
        for line in _compiled(kern):
            print(f"  {name}: {line}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--cases", default="norm_bwd,norm_fwd_t,act_fwd,act_bwd")
    p.add_argument("--quick", action="store_true")
    a = p.parse_args()
    t0 = time.time()
    cbw = common.copy_bandwidth(2**30, samples=10)["tbps"]
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} copy {cbw:.2f} TB/s", flush=True)
    log: list[dict[str, Any]] = []
    cases = a.cases.split(",")
    if "norm_bwd" in cases:
        sweep_norm_bwd([512, 768, 1024, 2048], a.quick, log, cbw)
    if "act_decompose" in cases:
        act_decompose([2048, 8192], log)
    if "norm_fwd_t" in cases:
        sweep_norm_fwd([512, 768, 1024, 2048], a.quick, log)
    for case in ("act_fwd", "act_bwd"):
        if case in cases:
            sweep_act(case, [2048, 3072, 8192], a.quick, log)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "small_kernel_sweep.json").write_text(json.dumps(
        {"environment": common.environment(), "copy_tbps": cbw, "M": M, "timings": log}, indent=1, default=str))
    print(f"done in {time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
