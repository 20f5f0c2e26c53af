"""``python -m fp8ops.bench linear --profile``: where the host time of fp8_linear goes.

Prints host µs per call (launch loop, no synchronization) for fp8_linear forward, forward+backward
and for each piece alone, the device time per forward+backward (CUDA-graph replay), the top CUDA
kernels of a step (torch.profiler) and the top host functions (cProfile) of the small,
host-bound case. ``--profile-shape M K N`` sets the problem (default 8192 4096 4096). Prints only;
needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
from typing import Any

import torch

from .common import capture_graph, host_us, replay_wall_ms

__all__ = ["DEFAULT_SHAPE", "run"]

DEFAULT_SHAPE = (8192, 4096, 4096)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Print the host-time breakdown, the graph-replay time and the profiles."""
    import fp8ops
    from fp8ops._glue import refuse_compiled_transform
    from fp8ops.kernels import quantize as KQ

    M, K, N = args.profile_shape or DEFAULT_SHAPE
    r = fp8ops.DelayedScaling()
    st = fp8ops.LinearState.init(r, device="cuda")
    st = st.replace(**{k: getattr(st, k).replace(calibrated=True) for k in ("input", "weight", "grad_output")})
    x = torch.randn(M, K, device="cuda").bfloat16().requires_grad_()
    w = (torch.randn(N, K, device="cuda") / 64).bfloat16().requires_grad_()
    dy = (torch.randn(M, N, device="cuda") * 1e-2).bfloat16()
    one = torch.ones((), device="cuda")
    xs = x.detach()

    def step() -> None:
        w.grad = None
        x.grad = None
        p = torch.zeros((), device="cuda", requires_grad=True)
        y, _ = fp8ops.fp8_linear(x, w, None, st, recipe=r, grad_probe=p)
        y.backward(dy)

    def fwd() -> None:
        with torch.no_grad():
            fp8ops.fp8_linear(x, w, None, st, recipe=r)

    small_x = torch.randn(64, 64, device="cuda").bfloat16()
    small_w = torch.randn(64, 64, device="cuda").bfloat16().requires_grad_()
    small_x.requires_grad_()

    def small_step() -> None:
        small_w.grad = None
        small_x.grad = None
        p = torch.zeros((), device="cuda", requires_grad=True)
        y, _ = fp8ops.fp8_linear(small_x, small_w, None, st, recipe=r, grad_probe=p)
        y.backward(torch.ones_like(y))

    print(f"fp8_linear, DelayedScaling (calibrated), bf16, M K N = {M} {K} {N}, {torch.cuda.get_device_name()}")
    pieces = {
        "fp8_linear forward (no grad)": fwd,
        "fp8_linear forward+backward": step,
        "fp8_linear fwd+bwd at 64x64x64 (host-bound: pure overhead)": small_step,
        "op cast_transpose (dispatcher + launcher)": lambda: torch.ops.fp8ops.cast_transpose(
            xs, one, None, 0, False, torch.float8_e4m3fn),
        "launcher cast_transpose_launch only": lambda: KQ.cast_transpose_launch(xs, one, None, 0, False,
                                                                                torch.float8_e4m3fn),
        "refuse_compiled_transform check (eager)": lambda: refuse_compiled_transform("fp8_linear", xs),
        "torch.zeros(()) on cuda": lambda: torch.zeros((), device="cuda"),
        "torch.maximum(0-d, 0-d)": lambda: torch.maximum(one, one),
    }
    rows = []
    for name, fn in pieces.items():
        h, wl = host_us(fn)
        rows.append({"what": name, "host_us": h, "wall_us": wl})
        print(f"{name:60s} host {h:8.1f} µs/call   wall {wl:8.1f} µs/call", flush=True)
    try:
        g = capture_graph(lambda: [step() for _ in range(3)], step)
        print(f"{'fp8_linear forward+backward, graph replay (device time)':60s} "
              f"{replay_wall_ms(g, 50, warmup=3) * 1e3:8.1f} µs/call")
    except Exception as exc:  # noqa: BLE001  (capture can fail; the host numbers above stand on their own)
        print("graph capture failed:", type(exc).__name__, exc)
    # device kernels of one forward+backward (after warm-up), to see where device time goes
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as tp:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    print(tp.key_averages().table(sort_by="self_cuda_time_total", row_limit=12))
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(50):
        small_step()
    prof.disable()
    torch.cuda.synchronize()
    st_ = pstats.Stats(prof)
    st_.sort_stats("tottime").print_stats(30)
    st_.sort_stats("cumulative").print_stats(30)
    return {"suite": "linear", "mode": "profile", "shape": [M, K, N], "rows": rows, "failed_checks": []}
