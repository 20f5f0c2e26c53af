"""Host cost of an eager op call: forward+backward of the main ops on tiny tensors.

At 16 tokens and hidden 32 the arithmetic is negligible, so the time of a loop of calls is the
Python and dispatcher glue around the kernels (validation, state handling, autograd Functions,
allocations, pytree work). On the CPU the kernels are the reference functions, which weigh more
than a GPU launch; the glue measured here is common to both devices.

    python scripts/host_profile.py [--device cpu|cuda] [--profile] [--calls N] [--repeats R]
                                   [--cpu-time] [--stub-kernels [--direct]] [--only NAME ...]
                                   [--compare-launch-paths [--rounds N]]

Each case prints the best of ``--repeats`` (3) loops of ``--calls`` (200) calls in µs per call;
on CUDA a loop is launched without synchronization (one ``synchronize`` after it), so the number
is the host's time. ``--profile`` also prints the cProfile top 35 functions of each case by
tottime and by cumtime. ``--stub-kernels`` (CPU only) replaces the CPU kernel of every ``fp8ops::``
library op by its fake kernel (outputs of the right shape, uninitialised, no arithmetic), so the time
left is the glue alone: what a GPU host pays per call besides the launches themselves. With
``--direct`` the library ops are called straight to those kernels, as fp8ops calls its CUDA kernels
in eager mode (``kernels._library.EagerOp``), instead of through ``torch.ops``. On the CPU a case
``fp8_linear floor`` times an autograd Function that calls only what an FP8 linear layer must (three
casts with their transposed copies, three FP8 GEMMs): ``fp8_linear`` less that floor is the library's
own glue around its launches.
``--compare-launch-paths`` times every case as fp8ops runs by default and as it ran before (its
library ops called through ``torch.ops``, its transposed FP8 copies stored through tensor maps, a
fill kernel for each amax output), alternating the two in each of ``--rounds`` rounds.
"""

from __future__ import annotations

import argparse
import cProfile
import math
import os
import pstats
import time
from collections.abc import Callable
from typing import Any

import torch

import fp8ops
from fp8ops._glue import apply
from fp8ops.kernels._library import OPS
from fp8ops.testing.states import calibrate

T, H, FFN, HEADS = 16, 32, 64, 4  # tokens, hidden, ffn, heads
S, B = 8, 2  # the layer's (S, B, H) input


def _calibrated(state: Any, recipe: Any) -> Any:
    if isinstance(state, dict):
        return {k: calibrate(v, recipe) for k, v in state.items()}
    return calibrate(state, recipe)


def cases(device: str) -> dict[str, Callable[[], None]]:
    """Name -> one forward+backward call with fresh probes, as a training loop makes it."""
    torch.manual_seed(0)

    def leaf(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, device=device) * scale).requires_grad_()

    delayed, current = fp8ops.DelayedScaling(), fp8ops.CurrentScaling()
    x, w, b = leaf(T, H), leaf(H, H, scale=0.1), leaf(H, scale=0.1)
    g, beta = leaf(H), leaf(H)
    lin_d = _calibrated(fp8ops.LinearState.init(delayed, device=device), delayed)
    lin_c = fp8ops.LinearState.init(current, device=device)
    lnl = _calibrated(fp8ops.LayerNormLinearState.init(delayed, device=device), delayed)
    cfg = fp8ops.TransformerConfig(hidden_size=H, ffn_hidden_size=FFN, num_attention_heads=HEADS,
                                   hidden_dropout=0.0, attention_dropout=0.0, self_attn_mask_type="causal")
    params = {k: v.to(device).requires_grad_() for k, v in fp8ops.init_transformer_params(cfg).items()}
    tst = _calibrated(fp8ops.init_transformer_state(cfg, delayed, device=device), delayed)
    xl = leaf(S, B, H)

    def back(y: torch.Tensor) -> None:
        y.backward(torch.ones_like(y))

    def probe() -> torch.Tensor:
        return torch.zeros((), device=device, requires_grad=True)

    def linear(state: Any, recipe: Any) -> None:
        back(fp8ops.fp8_linear(x, w, b, state, recipe=recipe, grad_probe=probe())[0])

    def lnl_call() -> None:
        back(fp8ops.layernorm_linear(x, g, beta, w, b, lnl, recipe=delayed, grad_probe=probe())[0])

    def layer() -> None:
        probes = fp8ops.make_probes(tst)
        back(fp8ops.transformer_layer(params, xl, tst, config=cfg, recipe=delayed, probes=probes)[0])

    def update() -> None:
        fp8ops.update(tst, recipe=delayed, grad_amax=fp8ops.make_probes(tst, requires_grad=False))

    torch.manual_seed(0)
    nn_lin = fp8ops.nn.Linear(H, H, recipe=delayed).to(device)
    torch_lin = torch.nn.Linear(H, H).to(device)
    nn_lin(x).sum().backward()
    fp8ops.nn.update_scaling(nn_lin)  # calibrated from here on
    x_in = leaf(T, H)

    extra: dict[str, Callable[[], None]] = {}
    if device == "cuda":  # the fused attention kernels run on the GPU only (the CPU runs the reference)
        qa, ka, va = (torch.randn(B, HEADS, S, H // HEADS, device=device, dtype=torch.bfloat16).requires_grad_()
                      for _ in range(3))
        sdpa = torch.nn.functional.scaled_dot_product_attention
        extra = {
            "torch SDPA causal": lambda: back(sdpa(qa, ka, va, is_causal=True)),
            "attention causal (triton)": lambda: back(fp8ops.attention(qa, ka, va, causal=True, backend="triton")[0]),
        }
    else:
        # applied as the library applies its Functions (no argument binding per call)
        extra = {"fp8_linear floor: 3 casts + 3 GEMMs": lambda: back(apply(_Floor, x, w, b, lin_d.input.scale)[0])}
    return {
        **extra,
        "torch F.linear": lambda: back(torch.nn.functional.linear(x, w, b)),
        "torch nn.Linear": lambda: back(torch_lin(x_in)),
        "fp8ops.nn.Linear delayed": lambda: back(nn_lin(x_in)),
        "fp8ops.nn.update_scaling (1 Linear)": lambda: fp8ops.nn.update_scaling(nn_lin),
        "fp8_linear no FP8": lambda: back(fp8ops.fp8_linear(x, w, b, None, recipe=None)[0]),
        "fp8_linear delayed": lambda: linear(lin_d, delayed),
        "fp8_linear current": lambda: linear(lin_c, current),
        "layernorm_linear delayed": lnl_call,
        "torch F.layer_norm": lambda: back(torch.nn.functional.layer_norm(x, (H,), g, beta)),
        "layer_norm": lambda: back(fp8ops.layer_norm(x, g, beta, None)[0]),
        "transformer_layer delayed": layer,
        "update (transformer_layer state)": update,
    }


class _Floor(torch.autograd.Function):
    """What an FP8 linear layer must call and nothing else: x and W cast with their transposed copies
    and the forward GEMM; in the backward dy's cast and the two GEMMs (no checks, no scaling state,
    no probe; the bias gradient a plain sum). Through the library ops, so that it runs on the CPU
    with their stub kernels; ``scripts/linear_host_floor.py`` is the same floor on a GPU, with the
    cast launchers and ``torch._scaled_mm`` called directly."""

    @staticmethod
    def forward(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, scale: torch.Tensor) -> Any:  # type: ignore[override]
        e4m3 = torch.float8_e4m3fn
        xq, xq_t, _, x_inv = OPS.cast_transpose(x, scale, None, 0, False, e4m3)
        wq, wq_t, _, w_inv = OPS.cast_transpose(w, scale, None, 0, False, e4m3)
        return OPS.scaled_mm(xq, wq, x_inv, w_inv, b, x.dtype, False), xq_t, wq_t, x_inv, w_inv

    @staticmethod
    def setup_context(ctx: Any, inputs: Any, output: Any) -> None:
        ctx.mark_non_differentiable(*output[1:])
        ctx.save_for_backward(*output[1:], inputs[3])

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor, *_: Any) -> Any:  # type: ignore[override]
        xq_t, wq_t, x_inv, w_inv, scale = ctx.saved_tensors
        with torch.no_grad():
            dyq, dyq_t, _, dy_inv = OPS.cast_transpose(dy, scale, None, 0, False, torch.float8_e5m2)
            dx = OPS.scaled_mm(dyq, wq_t, dy_inv, w_inv, None, dy.dtype, False)
            dw = OPS.scaled_mm(dyq_t, xq_t, dy_inv, x_inv, None, dy.dtype, False)
        return dx, dw, dy.sum(0), None


def stub_kernels(direct: bool = False) -> list[str]:
    """Register each ``fp8ops::`` op's fake kernel as its CPU kernel (for this process); the op names.
    ``direct``: the library's own call sites (``kernels._library.OPS``) call those kernels straight,
    as they call the CUDA kernels in eager mode, instead of through ``torch.ops``."""
    from torch._library.simple_registry import singleton

    lib = torch.library.Library("fp8ops", "IMPL")
    stubbed = []
    for name in dir(torch.ops.fp8ops):
        fake = getattr(singleton.find(f"fp8ops::{name}").fake_impl, "kernel", None)
        if name.startswith("_") or fake is None:
            continue
        lib.impl(name, fake, "CPU")
        stubbed.append(name)
        if direct and hasattr(OPS, name):
            op = getattr(OPS, name)
            op.kernel, op.device_type = fake, "cpu"
    stub_kernels.lib = lib  # type: ignore[attr-defined]  # keep the registrations alive
    return stubbed


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_us(fn: Callable[[], None], device: str, calls: int, repeats: int = 3, warmup: int = 10,
            clock: Callable[[], float] = time.perf_counter) -> float:
    """Best of ``repeats`` loops of ``calls`` calls, µs per call (host time: no sync inside a loop)."""
    for _ in range(warmup):
        fn()
    _sync(device)
    best = math.inf
    # CPU time of this thread: with the autograd engine's device threads off, the backward runs here too
    one_thread = clock is time.thread_time and device == "cuda"
    with torch.autograd.set_multithreading_enabled(not one_thread):
        for _ in range(repeats):
            t0 = clock()
            for _ in range(calls):
                fn()
            best = min(best, (clock() - t0) / calls * 1e6)
            _sync(device)
    return best


def profile(name: str, fn: Callable[[], None], device: str, calls: int, out: str | None = None) -> None:
    """Print the cProfile top 35 of ``calls`` calls by tottime and by cumtime; with ``out``, also
    write the whole profile to ``out/<name>.prof`` (for pstats)."""
    for _ in range(5):
        fn()
    _sync(device)
    prof = cProfile.Profile()
    # On CUDA the autograd engine runs the backward on a device thread, which cProfile does not see;
    # without its worker threads the backward runs on this thread and shows up in the profile.
    with torch.autograd.set_multithreading_enabled(False):
        prof.enable()
        for _ in range(calls):
            fn()
        _sync(device)
        prof.disable()
    for key in ("tottime", "cumtime"):
        print(f"\n== {name}: cProfile top 35 by {key} ({calls} calls) ==")
        pstats.Stats(prof).sort_stats(key).print_stats(35)
    if out:
        prof.dump_stats(os.path.join(out, "".join(c if c.isalnum() else "_" for c in name) + ".prof"))


def _compare_launch_paths(todo: dict[str, Callable[[], None]], args: argparse.Namespace,
                          clock: Callable[[], float], width: int) -> None:
    """Each case timed in ``--rounds`` rounds, each round both launch paths one after the other (the
    best of each path counts): the default, and "before": the library ops through torch.ops,
    tensor-map stores at every size, a fill kernel for every amax output."""
    from fp8ops.kernels import _library as L

    default = (L.EAGER_DIRECT, L.TMA_STORE_MIN_ELEMENTS, L.AMAX_CHAIN.eager)
    paths = {"default": default, "before": (False, 0, False)}
    print(f"{'case':<{width}}  {'default':>9}  {'before':>9}  (µs/call)")
    try:
        for name, fn in todo.items():
            best = {p: math.inf for p in paths}
            for _ in range(args.rounds):
                for path, (direct, tma_min, chain) in paths.items():
                    L.EAGER_DIRECT, L.TMA_STORE_MIN_ELEMENTS, L.AMAX_CHAIN.eager = direct, tma_min, chain
                    L.AMAX_CHAIN.reset()
                    best[path] = min(best[path], time_us(fn, args.device, args.calls, args.repeats, clock=clock))
            print(f"{name:<{width}}  {best['default']:9.1f}  {best['before']:9.1f}", flush=True)
    finally:
        L.EAGER_DIRECT, L.TMA_STORE_MIN_ELEMENTS, L.AMAX_CHAIN.eager = default


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--profile", action="store_true", help="print the cProfile top 35 of each case")
    parser.add_argument("--calls", type=int, default=200, help="calls per timed loop (default 200)")
    parser.add_argument("--repeats", type=int, default=3, help="timed loops per case, the best counts (default 3)")
    parser.add_argument("--cpu-time", action="store_true",
                        help="time the calling thread's CPU time instead of wall time: steadier on a busy "
                             "machine (on CUDA the backward then runs on the calling thread, the autograd "
                             "engine's device threads off)")
    parser.add_argument("--stub-kernels", action="store_true",
                        help="CPU only: run each fp8ops library op's fake kernel instead of its reference "
                             "math, so the time is the glue around the kernels")
    parser.add_argument("--direct", action="store_true",
                        help="with --stub-kernels: the library ops called straight to those kernels, as "
                             "fp8ops calls its CUDA kernels in eager mode, not through torch.ops")
    parser.add_argument("--only", nargs="*", default=None, help="case names (substrings) to run")
    parser.add_argument("--rounds", type=int, default=2, help="with --compare-launch-paths: rounds per case")
    parser.add_argument("--compare-launch-paths", action="store_true",
                        help="time each case twice over, alternating: as fp8ops runs by default, and with "
                             "every library op called through torch.ops, every transposed FP8 copy "
                             "stored through a tensor map and a fill kernel for every amax output "
                             "(kernels/_library.EAGER_DIRECT off, TMA_STORE_MIN_ELEMENTS 0, "
                             "AMAX_CHAIN.eager off)")
    parser.add_argument("--profile-out", default=None, metavar="DIR",
                        help="with --profile: also write each case's whole profile to DIR/<case>.prof")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device")
    if args.stub_kernels:
        if args.device != "cpu":
            parser.error("--stub-kernels: only with --device cpu")
        stub_kernels(args.direct)
    elif args.direct:
        parser.error("--direct: only with --stub-kernels")
    todo = cases(args.device)
    if args.only:
        todo = {k: v for k, v in todo.items() if any(s in k for s in args.only)}
    print(f"torch {torch.__version__}, device {args.device}, {T} tokens, hidden {H}, "
          f"best of {args.repeats} x {args.calls} calls")
    clock = time.thread_time if args.cpu_time else time.perf_counter
    width = max(len(k) for k in todo)
    if args.compare_launch_paths:
        _compare_launch_paths(todo, args, clock, width)
        return
    for name, fn in todo.items():
        print(f"{name:<{width}}  {time_us(fn, args.device, args.calls, args.repeats, clock=clock):8.1f} us/call", flush=True)
    if args.profile:
        for name, fn in todo.items():
            profile(name, fn, args.device, max(args.calls // 4, 20), args.profile_out)


if __name__ == "__main__":
    main()
