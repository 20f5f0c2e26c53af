"""The FP8 casts with and without their explicit clamp (``kernels/_jit.saturate``): device µs and the bits.

On CUDA GPUs of compute capability 8.9+ Triton converts float32 to FP8 with ``cvt.rn.satfinite``,
which saturates by itself, and ``saturate`` leaves the clamp out there. This script times the kernels
that cast, in two processes, one with the clamp forced back in (``converts_saturating`` patched to
False before any kernel compiles, with a Triton cache of its own), and compares every output bit for
bit: inputs with values beyond the formats' range, infinities and NaNs included.

Kernels (bf16 inputs): ``cast_transpose`` 8192 x 4096 to E4M3 and E5M2, ``act_fwd`` gelu_tanh
8192 x 16384 (FP8 and transposed copy), ``act_bwd`` gelu_tanh 8192 x 16384 (E5M2, transposed copy,
bias gradient), ``norm_fwd`` LayerNorm 8192 x 4096 (FP8 and transposed copy),
``adamw_cast_transpose`` 12288 x 4096. µs: CUDA events around 20 calls, median of 5.

    python scripts/saturate_ab.py --json OUT.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _child(mode: str, out: str) -> None:
    import torch
    import triton

    if mode == "clamp":
        from fp8ops.kernels import _jit

        _jit.converts_saturating = triton.constexpr_function(lambda: False)
    from fp8ops.kernels.activation import act_bwd_launch, act_fwd_launch
    from fp8ops.kernels.norm import norm_fwd_launch
    from fp8ops.kernels.optim import adamw_cast_transpose_launch
    from fp8ops.kernels.quantize import cast_transpose_launch

    sys.path.insert(0, str(HERE))
    from gemm_host_check import device_us

    E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2
    g = torch.Generator(device="cuda").manual_seed(0)

    def wild(*shape):  # values across the format's range and beyond, with infinities and NaNs
        x = torch.randn(*shape, device="cuda", generator=g) * 3.0
        x.view(-1)[::997] = float("inf")
        x.view(-1)[5::1009] = float("-inf")
        x.view(-1)[7::1013] = float("nan")
        return x.bfloat16()

    s_big = torch.tensor(4000.0, device="cuda")  # pushes |x| > 0.11 beyond E4M3's 448, > 14 beyond E5M2's
    s_one = torch.tensor(1.0, device="cuda")
    x = wild(8192, 4096)
    h = wild(8192, 16384)
    da = wild(8192, 16384)
    w_n, b_n = torch.ones(4096, device="cuda").bfloat16(), torch.zeros(4096, device="cuda").bfloat16()
    xn = (torch.randn(8192, 4096, device="cuda", generator=g)).bfloat16()
    N, K = 12288, 4096
    w0 = (torch.randn(N, K, device="cuda", generator=g) * 0.05).bfloat16()
    g0 = (torch.randn(N, K, device="cuda", generator=g) * 1e-3).bfloat16()
    m0 = torch.zeros(N, K, device="cuda").bfloat16()
    v0 = torch.zeros(N, K, device="cuda").bfloat16()
    q = torch.empty(N, K, dtype=E4, device="cuda")
    qt = torch.empty(K, N, dtype=E4, device="cuda")
    inv = torch.empty((), device="cuda")
    step, lr = torch.ones((), device="cuda"), torch.tensor(1e-3, device="cuda")

    cases = {
        "cast_transpose e4m3 8192x4096": lambda: cast_transpose_launch(x, s_big, None, 0, False, E4),
        "cast_transpose e5m2 8192x4096": lambda: cast_transpose_launch(x, s_big, None, 0, False, E5),
        "act_fwd gelu_tanh 8192x16384": lambda: act_fwd_launch(h, "gelu_tanh", False, s_big, None, 0, False, E4,
                                                               True, True),
        "act_bwd gelu_tanh 8192x16384": lambda: act_bwd_launch(da, h, "gelu_tanh", False, s_big, None, 0, False, E5,
                                                               True, True),
        "norm_fwd layernorm 8192x4096": lambda: norm_fwd_launch(xn, None, w_n, b_n, 1e-5, False, False, False, s_big,
                                                                None, 0, False, E4, True),
        "adamw_cast_transpose 12288x4096": lambda: (adamw_cast_transpose_launch(
            w0.clone(), g0, m0.clone(), v0.clone(), step, lr, torch.tensor(4000.0, device="cuda"), q, qt, inv,
            0.9, 0.999, 1e-8, 0.01), q, qt),
    }
    rec = {"mode": mode, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "rows": {}}
    for name, fn in cases.items():
        outs = fn()
        torch.cuda.synchronize()
        digest = hashlib.sha256()
        for t in (o for o in outs if isinstance(o, torch.Tensor)):
            digest.update(t.reshape(-1).view(torch.uint8).cpu().numpy().tobytes() if t.numel() else b"")
        if name.startswith("adamw"):  # time the kernel alone, on buffers it may overwrite
            w, m, v = w0.clone(), m0.clone(), v0.clone()
            us = device_us(lambda: adamw_cast_transpose_launch(w, g0, m, v, step, lr, s_one, q, qt, inv, 0.9, 0.999,
                                                               1e-8, 0.01))
        else:
            us = device_us(fn)
        rec["rows"][name] = {"us": us, "sha256": digest.hexdigest()}
        print(f"{mode:6s} {name:36s} {us:8.1f} us", flush=True)
    Path(out).write_text(json.dumps(rec))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _child(*args.child)
        return
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for mode in ("hw", "clamp") if r % 2 == 0 else ("clamp", "hw"):
                env = dict(os.environ, TRITON_CACHE_DIR=str(Path(tmp) / f"cache_{mode}"))
                out = Path(tmp) / f"{mode}_{r}.json"
                subprocess.run([sys.executable, __file__, "--child", mode, str(out)], env=env, check=True)
                runs.append(json.loads(out.read_text()))
    names = list(runs[0]["rows"])
    summary = {}
    for name in names:
        hw = [x["rows"][name]["us"] for x in runs if x["mode"] == "hw"]
        cl = [x["rows"][name]["us"] for x in runs if x["mode"] == "clamp"]
        same = len({x["rows"][name]["sha256"] for x in runs}) == 1
        summary[name] = {"hw_us": hw, "clamp_us": cl, "same_bits": same}
        print(f"{name:36s} without clamp {min(hw):8.1f}  with clamp {min(cl):8.1f} us  "
              f"({min(hw) / min(cl):.3f})  same bits: {same}")
    if args.json:
        Path(args.json).write_text(json.dumps({"gpu": runs[0]["gpu"], "torch": runs[0]["torch"],
                                               "triton": runs[0]["triton"], "summary": summary, "runs": runs},
                                              indent=1))


if __name__ == "__main__":
    main()
