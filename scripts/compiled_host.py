"""Host cost of fp8ops's library ops inside Inductor-compiled graphs, next to the same calls made
eagerly, and of a compiled ``fp8_linear`` forward+backward next to its eager call and torch's.

Tiny tensors (64 x 64), so each kernel finishes at once and a loop of asynchronous calls measures
the host: µs per call (best of ``--repeats`` loops of ``--calls`` calls). A graph case calls
``--ops`` library ops, each on its own input, so the graph holds that many calls; its time is
divided by that count. ``--profile`` adds the cProfile top functions (by own time) of the compiled
cast graph and of the compiled ``fp8_linear`` step.

    python scripts/compiled_host.py [--device cuda|cpu] [--ops 16] [--calls 200] [--profile] [--ab]

``--ab`` times every case twice, with the library ops' Triton kernels put into the compiled graphs
(``INLINE_IN_GRAPHS``, the default) and with the ops left opaque, alternating over ``--rounds``
rounds, after checking that both give the eager results bit for bit.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import math
import pstats
import time
from collections.abc import Callable
from typing import Any

import torch

import fp8ops
from fp8ops.kernels import _library
from fp8ops.kernels._library import OPS
from fp8ops.testing.states import calibrate

E4M3 = torch.float8_e4m3fn


def per_call_us(fn: Callable[[], object], device: str, calls: int, repeats: int, per: int = 1) -> float:
    for _ in range(10):
        fn()
    _sync(device)
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls / per * 1e6)
        _sync(device)
    return best


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def cast_cases(device: str, n_ops: int) -> dict[str, tuple[Callable[[], object], int]]:
    """Name -> (a call making ``n_ops`` casts or GEMMs, n_ops)."""
    xs = [torch.randn(64, 64, device=device).to(torch.bfloat16) for _ in range(n_ops)]
    scale = torch.tensor(4.0, device=device)
    ct = torch.ops.fp8ops.cast_transpose.default

    def eager_ops() -> object:
        with torch.no_grad():
            return [OPS.cast_transpose(x, scale, None, 0, False, E4M3) for x in xs]

    def dispatcher() -> object:
        with torch.no_grad():
            return [ct(x, scale, None, 0, False, E4M3) for x in xs]

    def graph_body(xs: list[torch.Tensor], scale: torch.Tensor) -> list[torch.Tensor]:
        return [ct(x, scale, None, 0, False, E4M3)[1] for x in xs]

    compiled = torch.compile(graph_body, fullgraph=True)

    def graph() -> object:
        with torch.no_grad():
            return compiled(xs, scale)

    ws = [torch.randn(64, 64, device=device).to(torch.bfloat16) for _ in range(n_ops)]

    def mm_body(xs: list[torch.Tensor], ws: list[torch.Tensor]) -> list[torch.Tensor]:
        return [x @ w for x, w in zip(xs, ws)]

    mm_compiled = torch.compile(mm_body, fullgraph=True)

    def mm_graph() -> object:
        with torch.no_grad():
            return mm_compiled(xs, ws)

    def mm_eager() -> object:
        with torch.no_grad():
            return mm_body(xs, ws)

    return {
        "cast_transpose, eager (OPS, straight to the launcher)": (eager_ops, n_ops),
        "cast_transpose, eager through torch.ops (dispatcher)": (dispatcher, n_ops),
        "cast_transpose, inside one Inductor graph": (graph, n_ops),
        "bf16 mm, eager": (mm_eager, n_ops),
        "bf16 mm, inside one Inductor graph": (mm_graph, n_ops),
    }


def linear_cases(device: str) -> dict[str, tuple[Callable[[], object], int]]:
    """Name -> (one forward+backward with a fresh probe, 1)."""
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32

    def leaf(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, device=device) * scale).to(dtype).requires_grad_()

    recipe = fp8ops.DelayedScaling()
    x, w, b = leaf(64, 64), leaf(64, 64, scale=0.1), leaf(64, scale=0.1)
    state = calibrate(fp8ops.LinearState.init(recipe, device=device), recipe)

    def fp8_loss(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, state: Any, probe: torch.Tensor) -> torch.Tensor:
        return fp8ops.fp8_linear(x, w, b, state, recipe=recipe, grad_probe=probe)[0].float().sum()

    def torch_loss(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, w, b).float().sum()

    fp8_compiled = torch.compile(fp8_loss, fullgraph=True)
    torch_compiled = torch.compile(torch_loss, fullgraph=True)

    def probe() -> torch.Tensor:
        return torch.zeros((), device=device, requires_grad=True)

    return {
        "torch F.linear, eager": (lambda: torch_loss(x, w, b).backward(), 1),
        "torch F.linear, compiled": (lambda: torch_compiled(x, w, b).backward(), 1),
        "fp8_linear delayed, eager": (lambda: fp8_loss(x, w, b, state, probe()).backward(), 1),
        "fp8_linear delayed, compiled (fullgraph)": (lambda: fp8_compiled(x, w, b, state, probe()).backward(), 1),
    }


def profile_top(fn: Callable[[], object], device: str, calls: int, top: int = 30) -> str:
    for _ in range(5):
        fn()
    _sync(device)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    _sync(device)
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def check(device: str) -> None:
    """Compiled casts and a compiled fp8_linear step against eager, bit for bit, with the ops inlined
    and opaque; prints what the compiled cast graph's code launches."""
    from torch._inductor.utils import run_and_get_code

    torch.manual_seed(0)
    x = torch.randn(300, 200, device=device).to(torch.bfloat16)
    scale = torch.tensor(3.0, device=device)
    ct = torch.ops.fp8ops.cast_transpose.default

    def body(x: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return ct(x * 2, scale, None, 0, False, E4M3)

    with torch.no_grad():
        want = [t.float() for t in body(x, scale)]
        for inline in (True, False):
            _library.INLINE_IN_GRAPHS = inline
            torch._dynamo.reset()
            got, codes = run_and_get_code(torch.compile(body, fullgraph=True), x, scale)
            same = all(torch.equal(a.float(), b) for a, b in zip(got, want))
            code = "\n".join(codes)
            print(f"cast_transpose compiled, inline={inline}: equal to eager {same}; the code calls "
                  f"torch.ops.fp8ops {code.count('torch.ops.fp8ops')} times, names the cast kernel "
                  f"{code.count('_cast_transpose_fwd_kernel')} times")
    _library.INLINE_IN_GRAPHS = True
    recipe = fp8ops.DelayedScaling()
    w = (torch.randn(96, 200, device=device) * 0.1).to(torch.bfloat16)
    b = torch.randn(96, device=device).to(torch.bfloat16)
    state = calibrate(fp8ops.LinearState.init(recipe, device=device), recipe)
    results = {}
    for name in ("eager", "inline", "opaque"):
        _library.INLINE_IN_GRAPHS = name != "opaque"
        torch._dynamo.reset()
        xs, ws, bs = (t.detach().clone().requires_grad_() for t in (x, w, b))
        probe = torch.zeros((), device=device, requires_grad=True)

        def step(xs: torch.Tensor, ws: torch.Tensor, bs: torch.Tensor, probe: torch.Tensor) -> Any:
            return fp8ops.fp8_linear(xs, ws, bs, state, recipe=recipe, grad_probe=probe)

        fn = step if name == "eager" else torch.compile(step, fullgraph=True)
        y, new = fn(xs, ws, bs, probe)
        y.backward(torch.linspace(-2, 2, y.numel(), device=device).view_as(y).to(y.dtype))
        results[name] = [y, xs.grad, ws.grad, bs.grad, probe.grad, *pytree_leaves(new)]
    _library.INLINE_IN_GRAPHS = True
    same = [torch.equal(a, b) for a, b in zip(results["inline"], results["opaque"])]
    diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(results["inline"], results["eager"]))
    print(f"fp8_linear step compiled, inlined against opaque: output, gradients, probe and new state equal "
          f"{all(same)} {same}; largest difference from eager {diff:.3g}")


def pytree_leaves(tree: Any) -> list[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--ops", type=int, default=16)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--ab", action="store_true")
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args(argv)
    dev = args.device
    print(f"torch {torch.__version__}, device {dev}"
          + (f" ({torch.cuda.get_device_name()})" if dev == "cuda" else ""))
    if args.ab:
        torch._inductor.config.fx_graph_cache = False  # each setting traces its graphs anew
        torch._functorch.config.enable_autograd_cache = False
        check(dev)
        settings = [True, False]
        for r in range(args.rounds):
            for inline in settings if r % 2 == 0 else settings[::-1]:
                _library.INLINE_IN_GRAPHS = inline
                torch._dynamo.reset()
                print(f"\nround {r}, library ops' kernels inlined into compiled graphs: {inline}")
                for name, (fn, per) in {**cast_cases(dev, args.ops), **linear_cases(dev)}.items():
                    calls = args.calls if per == 1 else max(1, args.calls // 4)
                    print(f"{per_call_us(fn, dev, calls, args.repeats, per):9.1f} µs  {name}", flush=True)
        _library.INLINE_IN_GRAPHS = True
        torch._dynamo.reset()
    casts = cast_cases(dev, args.ops)
    lins = linear_cases(dev)
    if not args.ab:
        for name, (fn, per) in {**casts, **lins}.items():
            calls = args.calls if per == 1 else max(1, args.calls // 4)
            print(f"{per_call_us(fn, dev, calls, args.repeats, per):9.1f} µs  {name}")
    if args.profile:
        for name in ("cast_transpose, inside one Inductor graph", "cast_transpose, eager (OPS, straight to the launcher)"):
            print(f"\n## cProfile, {name}, {args.calls // 4} calls of {args.ops} ops")
            print(profile_top(casts[name][0], dev, args.calls // 4))
        name = "fp8_linear delayed, compiled (fullgraph)"
        print(f"\n## cProfile, {name}, {args.calls} calls")
        print(profile_top(lins[name][0], dev, args.calls))


if __name__ == "__main__":
    main()
