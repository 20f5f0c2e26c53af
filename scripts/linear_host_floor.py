"""The host-time floor of an eager FP8 linear layer, next to fp8_linear and torch's F.linear.

An eager FP8 linear forward+backward must at least run three FP8 casts (x and W in the forward, dy
in the backward, each with its transposed copy) and three FP8 GEMMs inside one autograd Function.
This script times, on one GPU at a tiny size (64 tokens, 64 -> 64, bf16: every kernel finishes at
once, so the time is the host's), the CPU time of the calling thread per forward+backward (the
autograd engine's device threads off, so that the backward runs on it too; the cases in turn, in
several rounds, the best loop of each case counting):

- torch's ``F.linear`` (three bf16 GEMMs and a bias sum: the control);
- an autograd Function that launches nothing (allocation of its outputs only): the Python
  Function's and the engine's own cost;
- **the floor**: that Function with the three casts (the library's launchers, called directly) and
  three ``torch._scaled_mm``, with no validation, no scaling state, no probe, no amax bookkeeping;
- ``fp8ops.fp8_linear`` with a calibrated delayed-scaling state and a fresh probe per call, as a
  training loop calls it, without and with a ``weight_cache`` (the weight quantized once per
  optimizer step, by ``quantize_weight`` or ``adamw_quantize_``), and the floor with a cached weight
  (two casts);
- the floor without its GEMMs (casts only) and without its casts (GEMMs only, on the bytes of the
  bf16 tensors reinterpreted as FP8 operands);
- the pieces alone: a cast launch to E4M3 and to E5M2, ``torch._scaled_mm`` as the three GEMMs call
  it (with a bias and fast accumulation; E5M2 x E4M3; with a transposed copy as the second operand),
  one bf16 ``torch.mm``, one ``torch.empty``.

``fp8_linear`` minus the floor is what the library's own Python costs around the kernels; the floor
minus the kernel-less Function is what the launches themselves cost.

    python scripts/linear_host_floor.py [--calls 400] [--rounds 3] [--json OUT]

Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from host_profile import time_us  # noqa: E402  (best of loops, optional thread CPU time)

import fp8ops  # noqa: E402
from fp8ops.bench import common  # noqa: E402
from fp8ops.kernels import quantize as KQ  # noqa: E402
from fp8ops.testing.states import calibrate  # noqa: E402

E4M3, E5M2, BF16 = torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16


class _NoKernels(torch.autograd.Function):
    @staticmethod
    def forward(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.new_empty((x.shape[0], w.shape[0]))

    @staticmethod
    def setup_context(ctx: Any, inputs: Any, output: Any) -> None:
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> Any:  # type: ignore[override]
        x, w, b = ctx.saved_tensors
        return torch.empty_like(x), torch.empty_like(w), torch.empty_like(b)


def _stand_in(t: torch.Tensor) -> torch.Tensor:
    """A (K, M) one-byte tensor over t's memory (t: (M, K) bf16), in place of a transposed copy."""
    return t.view(torch.uint8).view(-1)[:t.numel()].view(t.shape[1], t.shape[0]).view(E4M3)


class _Floor(torch.autograd.Function):
    """Three casts and three FP8 GEMMs, nothing else."""

    @staticmethod
    def forward(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, one: torch.Tensor, casts: bool = True,
                gemms: bool = True, cached: Any = None) -> Any:  # type: ignore[override]
        if casts:
            xq, xqt, _, xinv = KQ.cast_transpose_launch(x, one, None, 0, False, E4M3)
            if cached is not None:  # the weight's FP8 operands from a cache
                wq, wqt, winv = cached
            else:
                wq, wqt, _, winv = KQ.cast_transpose_launch(w, one, None, 0, False, E4M3)
        else:  # the operands as stand-ins (bytes reinterpreted, no kernel)
            # (the scales as views of `one`: a Function may return an input it saves only as a view)
            xq, xqt, xinv = x.view(torch.uint8)[:, :x.shape[1]].view(E4M3), _stand_in(x), one.view(())
            wq, wqt, winv = w.view(torch.uint8)[:, :w.shape[1]].view(E4M3), _stand_in(w), one.view(())
        if gemms:
            y = torch._scaled_mm(xq, wq.t(), scale_a=xinv, scale_b=winv, bias=b, out_dtype=BF16, use_fast_accum=True)
        else:
            y = x.new_empty((x.shape[0], w.shape[0]))
        return y, xqt, xinv, wqt, winv

    @staticmethod
    def setup_context(ctx: Any, inputs: Any, output: Any) -> None:
        _, xqt, xinv, wqt, winv = output
        ctx.save_for_backward(xqt, xinv, wqt, winv, inputs[3])
        ctx.mark_non_differentiable(*output[1:])
        ctx.casts, ctx.gemms = inputs[4:6] if len(inputs) > 4 else (True, True)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor, *_: Any) -> Any:  # type: ignore[override]
        xqt, xinv, wqt, winv, one = ctx.saved_tensors
        if ctx.casts:
            dyq, dyqt, _, dyinv = KQ.cast_transpose_launch(dy.contiguous(), one, None, 0, False, E5M2)
        else:
            dyq, dyqt, dyinv = dy.view(torch.uint8)[:, :dy.shape[1]].view(E5M2), _stand_in(dy), one
        if ctx.gemms:
            dx = torch._scaled_mm(dyq, wqt.t(), scale_a=dyinv, scale_b=winv, out_dtype=BF16)
            dw = torch._scaled_mm(dyqt, xqt.t(), scale_a=dyinv, scale_b=xinv, out_dtype=BF16)
        else:
            dx, dw = torch.empty_like(dy), torch.empty_like(dy)
        return dx, dw, dy.sum(0), None, None, None, None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    M = K = N = 64
    dev = "cuda"
    x = torch.randn(M, K, device=dev, dtype=BF16, requires_grad=True)
    w = (torch.randn(N, K, device=dev) / 8).to(BF16).requires_grad_()
    b = torch.zeros(N, device=dev, dtype=BF16, requires_grad=True)
    one = torch.ones((), device=dev)
    r = fp8ops.DelayedScaling()
    st = calibrate(fp8ops.LinearState.init(r, device=dev), r)
    xs, ws = x.detach(), w.detach()
    a8, b8 = xs.to(E4M3), ws.to(E4M3)
    a16, b16 = xs, ws
    e8, bt8, bs = xs.to(E5M2), ws.t().contiguous().to(E4M3), b.detach()

    def back(y: torch.Tensor) -> None:
        y.backward(torch.ones_like(y))

    def fp8_linear() -> None:
        p = torch.zeros((), device=dev, requires_grad=True)
        back(fp8ops.fp8_linear(x, w, b, st, recipe=r, grad_probe=p)[0])

    cache, _ = fp8ops.quantize_weight(w, st, recipe=r)  # once per optimizer step, outside the timed calls

    def fp8_linear_cached() -> None:
        p = torch.zeros((), device=dev, requires_grad=True)
        back(fp8ops.fp8_linear(x, w, b, st, recipe=r, grad_probe=p, weight_cache=cache)[0])

    wq0, wqt0, _, winv0 = KQ.cast_transpose_launch(ws, one, None, 0, False, E4M3)
    cached = (wq0, wqt0, winv0)

    cases = {
        "torch F.linear": lambda: back(torch.nn.functional.linear(x, w, b)),
        "autograd.Function, no kernels": lambda: back(_NoKernels.apply(x, w, b)),
        "floor: 3 casts + 3 _scaled_mm": lambda: back(_Floor.apply(x, w, b, one)[0]),
        "fp8ops.fp8_linear delayed": fp8_linear,
        "fp8ops.fp8_linear delayed, weight_cache": fp8_linear_cached,
        "floor with a cached weight: 2 casts + 3 _scaled_mm": lambda: back(_Floor.apply(x, w, b, one, True, True,
                                                                                       cached)[0]),
        "floor without the GEMMs (casts only)": lambda: back(_Floor.apply(x, w, b, one, True, False)[0]),
        "floor without the casts (GEMMs only)": lambda: back(_Floor.apply(x, w, b, one, False, True)[0]),
        "piece: cast_transpose_launch E4M3": lambda: KQ.cast_transpose_launch(xs, one, None, 0, False, E4M3),
        "piece: cast_transpose_launch E5M2": lambda: KQ.cast_transpose_launch(xs, one, None, 0, False, E5M2),
        "piece: torch._scaled_mm": lambda: torch._scaled_mm(a8, b8.t(), scale_a=one, scale_b=one, out_dtype=BF16),
        "piece: torch._scaled_mm, bias, fast": lambda: torch._scaled_mm(a8, b8.t(), scale_a=one, scale_b=one, bias=bs,
                                                                        out_dtype=BF16, use_fast_accum=True),
        "piece: torch._scaled_mm E5M2 x E4M3": lambda: torch._scaled_mm(e8, b8.t(), scale_a=one, scale_b=one,
                                                                        out_dtype=BF16),
        "piece: torch._scaled_mm E5M2 x E4M3, b a transposed copy": lambda: torch._scaled_mm(
            e8, bt8.t(), scale_a=one, scale_b=one, out_dtype=BF16),
        "piece: torch.mm bf16": lambda: torch.mm(a16, b16.t()),
        "piece: torch.empty": lambda: torch.empty((M, K), device=dev, dtype=BF16),
    }
    y_floor = _Floor.apply(x, w, b, one)[0]
    print(common.describe_environment(common.environment()))
    print(f"64 x 64 -> 64, bf16, thread CPU time per call, best of {args.rounds} rounds of 3 loops of {args.calls}")
    # the cases in turn, --rounds times (this kind of host drifts by tens of percent within minutes);
    # each case's best round counts
    best = {name: float("inf") for name in cases}
    for _ in range(args.rounds):
        for name, fn in cases.items():
            best[name] = min(best[name], time_us(fn, dev, args.calls, clock=time.thread_time))
    rows = [{"case": name, "us": us} for name, us in best.items()]
    for name, us in best.items():
        print(f"{name:55s} {us:8.1f} µs", flush=True)
    ref = torch.nn.functional.linear(x, w, b).float()
    err = (y_floor.float() - ref).abs().max().item()
    print(f"floor output against F.linear: max abs difference {err:.4f} (FP8 rounding)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": common.environment(), "rows": rows, "floor_max_abs_diff": err}, f, indent=1)


if __name__ == "__main__":
    main()
