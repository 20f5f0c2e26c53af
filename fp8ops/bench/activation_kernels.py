"""The fused activation kernels alone (``kernels/activation.py``), against the device-copy bandwidth.

Two modes of the ``mlp`` suite (they replace its timed comparison):

``python -m fp8ops.bench mlp --activation-kernels``
    act_fwd and act_bwd with delayed scaling and the transposed copy (the FP8 MLP's forward and
    backward), bf16 h of 8192 x 16384 (gelu_tanh, silu, gelu) and 8192 x 32768 (swiglu, F = 16384);
    the backward also reduces the bias gradient. A few launch configurations are timed per case (the
    defaults first), and a torch-eager peer of gelu_tanh's forward. Logical bytes per element of the
    (M, F) output grid::

        non-gated fwd: read h 2 B, write q + q_t 2 B                       = 4 B
        non-gated bwd: read da 2 B + h 2 B, write q + q_t 2 B               = 6 B
        gated fwd:     read h 4 B (both halves), write q + q_t 2 B         = 6 B
        gated bwd:     read da 2 B + h 4 B, write q + q_t 4 B (over C = 2F) = 10 B

    Prints one line per case and writes ``activation_timing.json`` into ``--out``.

``python -m fp8ops.bench mlp --activation-probe``
    What bounds the activation kernels: checks that the conversion's saturation equals the explicit
    clamp (both formats, NaN kept), then times variants of the same kernels at 8192 x 16384 (quantized
    output only, transposed copy only, amax only, with or without dbias) next to the quantize
    kernel's cast + transpose. Prints only.

Both need a CUDA GPU; nothing runs at import.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

from . import common

__all__ = ["run_probe", "run_timing"]

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
CONFIGS: dict[str, list[dict[str, int] | None]] = {
    "fwd": [None, {"BLOCK_M": 64, "BLOCK_N": 64}, {"BLOCK_M": 16, "BLOCK_N": 256},
            {"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 8}, {"BLOCK_M": 32, "BLOCK_N": 256, "num_warps": 8},
            {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8}, {"BLOCK_M": 32, "BLOCK_N": 64, "num_warps": 2}],
    "bwd": [None, {"BLOCK_M": 64, "BLOCK_N": 128}, {"BLOCK_M": 32, "BLOCK_N": 64},
            {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 8}, {"BLOCK_M": 32, "BLOCK_N": 128},
            {"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 8}, {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8}],
}
CASES = [  # (act, M, C, configs timed)
    ("gelu_tanh", 8192, 16384, True),
    ("swiglu", 8192, 32768, True),
    ("silu", 8192, 16384, False),
    ("gelu", 8192, 16384, False),
]


def run_timing(args: argparse.Namespace) -> dict[str, Any]:
    """Time the activation kernels per case and launch config; write activation_timing.json."""
    import torch.nn.functional as Fn

    from fp8ops.kernels import activation as K

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = common.environment()
    ceiling = common.copy_bandwidth(2**30)
    print(f"copy ceiling: {ceiling['tbps']:.2f} TB/s on {torch.cuda.get_device_name()}", flush=True)
    rows = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for act, M, C, sweep in CASES:
        F = C // 2 if act in K.GATED else C
        h = (torch.randn(M, C, generator=g, device="cuda") * 2).bfloat16()
        da = torch.randn(M, F, generator=g, device="cuda").bfloat16()
        s = torch.tensor(16.0, device="cuda")
        gated = act in K.GATED
        nbytes = {"fwd": M * F * (6 if gated else 4), "bwd": M * F * (10 if gated else 6)}
        for kind in ("fwd", "bwd"):
            for cfg in CONFIGS[kind] if sweep else [None]:
                if kind == "fwd":
                    def fn(x, c=cfg, a=act, s=s):  # type: ignore[no-untyped-def]
                        return K.act_fwd_launch(x, a, False, s, None, 0, False, E4M3, True, True, config=c)

                    arg_sets: list[tuple[torch.Tensor, ...]] = [(h,)]
                else:
                    def fn(d, x, c=cfg, a=act, s=s):  # type: ignore[no-untyped-def]
                        return K.act_bwd_launch(d, x, a, False, s, None, 0, False, E5M2, True, True, config=c)

                    arg_sets = [(da, h)]
                t = common.time_cuda(fn, arg_sets, samples=15, max_calls=16)
                tbps = nbytes[kind] / t.median_us / 1e6
                row = {"act": act, "kind": kind, "shape": f"{M}x{C}", "config": cfg or "default",
                       "us": round(t.median_us, 1), "tbps": round(tbps, 3),
                       "pct_copy": round(100 * tbps / ceiling["tbps"], 1)}
                rows.append(row)
                print(row, flush=True)
        if act == "gelu_tanh":
            # Peer: the same forward written with torch ops (activation, cast, transposed copy).
            def eager(x: torch.Tensor, s: torch.Tensor = s) -> tuple[torch.Tensor, torch.Tensor]:
                q = (Fn.gelu(x, approximate="tanh").float() * s).clamp(-448, 448).to(E4M3)
                return q, q.t().contiguous()

            t = common.time_cuda(eager, [(h,)], samples=10, max_calls=8)
            tbps = nbytes["fwd"] / t.median_us / 1e6
            row = {"act": act, "kind": "fwd torch eager", "shape": f"{M}x{C}", "config": "-",
                   "us": round(t.median_us, 1), "tbps": round(tbps, 3),
                   "pct_copy": round(100 * tbps / ceiling["tbps"], 1)}
            rows.append(row)
            print(row, flush=True)
        del h, da
        torch.cuda.empty_cache()
    record = {"suite": "mlp", "mode": "activation-kernels", "environment": env, "copy": ceiling, "rows": rows,
              "failed_checks": []}
    common.write_json(out / "activation_timing.json", record)
    return record


def run_probe(args: argparse.Namespace) -> dict[str, Any]:
    """Saturation check and launch variants of the activation kernels, printed."""
    from fp8ops.kernels import activation as K
    from fp8ops.kernels import quantize as Q

    failed: list[str] = []
    g = torch.Generator(device="cuda").manual_seed(0)
    M, F = 8192, 16384
    h = (torch.randn(M, F, generator=g, device="cuda") * 2).bfloat16()
    hg = (torch.randn(M, 2 * F, generator=g, device="cuda") * 2).bfloat16()
    da = torch.randn(M, F, generator=g, device="cuda").bfloat16()
    s = torch.tensor(16.0, device="cuda")
    print("copy", common.copy_bandwidth(2**30)["tbps"])

    def t(name, fn, *arg_set, nbytes):  # type: ignore[no-untyped-def]
        r = common.time_cuda(fn, [arg_set], samples=5, max_calls=4)
        print(f"{name:70s} {r.median_us:8.1f} us  {nbytes / r.median_us / 1e6:6.2f} TB/s", flush=True)

    def fwd(act, cfg, q=True, qt=True):  # type: ignore[no-untyped-def]
        return lambda x: K.act_fwd_launch(x, act, False, s, None, 0, False, E4M3, q, qt, config=cfg)

    def bwd(act, cfg, qt=True, db=True):  # type: ignore[no-untyped-def]
        return lambda d, x: K.act_bwd_launch(d, x, act, False, s, None, 0, False, E5M2, qt, db, config=cfg)

    # Saturation of the conversion alone equals the explicit clamp (both formats, NaN kept).
    v = torch.tensor([1e30, -1e30, float("inf"), -float("inf"), float("nan"), 470.0, 500.0, 6e4, 7e4, 1.0],
                     device="cuda")
    hv = v.repeat(8, 13)[:, :128].bfloat16().contiguous()
    for dt, fmax in ((E4M3, 448.0), (E5M2, 57344.0)):
        q = K.act_fwd_launch(hv, "relu", False, None, None, 0, False, dt, True, False)[1]
        a = torch.relu(hv.float())
        want = torch.where(a.isnan(), a, a.clamp(-fmax, fmax)).to(dt)
        same = torch.equal(q.view(torch.uint8), want.view(torch.uint8))
        print("saturation", dt, same)
        if not same:
            failed.append(f"act_fwd relu -> {dt}: saturation differs from the explicit clamp")
    t("quantize cast_transpose 8192x16384", lambda x: Q.cast_transpose_launch(x, s, None, 0, False, E4M3), h,
      nbytes=M * F * 4)
    for act, x, nb in (("relu", h, 4), ("silu", h, 4), ("gelu_tanh", h, 4), ("swiglu", hg, 6)):
        t(f"act_fwd {act} q+qt", fwd(act, None), x, nbytes=M * F * nb)
    t("act_fwd relu q only", fwd("relu", None, qt=False), h, nbytes=M * F * 3)
    t("act_fwd relu qt only", fwd("relu", None, q=False), h, nbytes=M * F * 3)
    t("act_fwd relu amax only", lambda x: K.act_amax_launch(x, "relu"), h, nbytes=M * F * 2)
    t("act_bwd gelu_tanh q+qt", bwd("gelu_tanh", None, db=False), da, h, nbytes=M * F * 6)
    t("act_bwd gelu_tanh q+qt+dbias", bwd("gelu_tanh", None), da, h, nbytes=M * F * 6)
    t("act_bwd relu q+qt", bwd("relu", None, db=False), da, h, nbytes=M * F * 6)
    t("act_bwd swiglu q+qt+dbias", bwd("swiglu", None), da, hg, nbytes=M * F * 10)
    t("act_bwd swiglu q only", bwd("swiglu", None, qt=False, db=False), da, hg, nbytes=M * F * 8)
    return {"suite": "mlp", "mode": "activation-probe", "failed_checks": failed}
