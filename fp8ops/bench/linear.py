"""fp8_linear forward and forward+backward at the seed layer's GEMM shapes vs bf16, torchao, _scaled_mm.

Shapes: tokens M = 8192, (K -> N) in {4096 -> 12288 (QKV), 4096 -> 4096 (proj), 4096 -> 16384 (fc1),
16384 -> 4096 (fc2)}; bf16 activations and weights, no bias.

Implementations:

- ``bf16 F.linear``: eager PyTorch.
- ``fp8ops <recipe> [<backend>]``: :func:`fp8ops.fp8_linear` with a calibrated delayed-scaling state
  and a probe, current (per-tensor) scaling, row-wise scaling; GEMMs through cuBLAS
  (``torch._scaled_mm``) or fp8ops's Triton GEMM.
- ``torchao tensorwise/rowwise + compile``: ``torchao.float8.convert_to_float8_training`` on an
  ``nn.Linear``, under ``torch.compile`` (if torchao is installed).
- ``fp8ops ... + compile``: the same under ``torch.compile(fullgraph=True)``.
- ``3 GEMMs (_scaled_mm)``: the ceiling: fprop (fast accumulation), dgrad and wgrad (full-precision
  accumulation) on pre-quantized operands, the same accumulation modes as fp8ops's defaults.

TFLOP/s count 2*M*N*K per GEMM (one for forward, three for forward+backward). Times are medians
of CUDA-event-timed iterations after warm-up, on random data, with the weight and input gradients
reset to None before each backward (as after ``zero_grad(set_to_none=True)``). "fwd µs" and "fwd+bwd µs"
time plain launches from Python (what an eager training loop sees, host overhead included);
"graph µs" times CUDA-graph replays of forward+backward (device time), where capture works.

Full training steps (the suite's first table, the one its target is on): at each shape, one step of
a single linear layer as a training loop runs it: fresh probe, forward, backward (dy given),
:func:`fp8ops.update` (FP8), and a fused, capturable AdamW step on the weight; x requires grad (the
layer's input gradient is computed, as inside a model). Each implementation runs in each of its
modes (eager, ``torch.compile``, one CUDA graph per step through :func:`fp8ops.graph_step`, and
both), timed by :func:`fp8ops.bench.step._measure` (steps back to back); the graphs read x and dy
where they are (``args_by_reference``: no copy of dy at each step, as in the eager modes). The
comparison takes each one's fastest mode: bf16 ``F.linear`` (eager, compile, graph, compile + graph), fp8ops delayed
scaling with cuBLAS GEMMs (eager, compile with ``fullgraph=True``, graph, compile + graph), the same
with :func:`fp8ops.adamw_quantize_` in place of torch's AdamW ("+ fused AdamW": the optimizer writes
the weight's FP8 copy, which the next forward takes as its ``weight_cache``; eager, graph, compile +
graph) and torchao float8 tensorwise (compile, compile + graph). Target: fp8ops (the faster of its
two) >= 1.1x torchao at every shape.
``--ops`` adds the op-level table (forward, forward+backward, graph replays, every recipe and GEMM
backend) after it.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from . import common

__all__ = ["add_arguments", "run"]

SHAPES = [(8192, 4096, 12288), (8192, 4096, 4096), (8192, 4096, 16384), (8192, 16384, 4096)]
QUICK_SHAPES = [(8192, 4096, 4096)]


TARGET_VS_TORCHAO = 1.1
"""fp8ops's full step over torchao tensorwise + compile's, fastest modes, at every shape."""
FUSED_OPT = "fp8ops delayed + fused AdamW"
STEP_IMPLS = {"bf16 F.linear": ("eager", "compile", "graph", "compile + graph"),
              "fp8ops delayed": ("eager", "compile", "graph", "compile + graph"),
              FUSED_OPT: ("eager", "graph", "compile + graph"),
              "torchao tensorwise": ("compile", "compile + graph")}
"""implementation -> its modes in the full-step table."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of this suite."""
    parser.add_argument("--no-torchao", action="store_true", help="skip the torchao peers")
    parser.add_argument("--samples", type=int, default=None, help="timed samples per case")
    parser.add_argument("--steps", type=int, default=20, help="timed full steps per variant (default 20)")
    parser.add_argument("--ops", action="store_true",
                        help="also the op-level table: forward, forward+backward and graph replays of every "
                        "recipe and GEMM backend")
    prof = parser.add_argument_group("profile mode (replaces the timed comparison)")
    prof.add_argument("--profile", action="store_true",
                      help="where the host time of fp8_linear goes: host µs per call of each piece, graph-replay "
                      "device time, top CUDA kernels and top host functions, printed")
    prof.add_argument("--profile-shape", type=int, nargs=3, default=None, metavar=("M", "K", "N"),
                      help="problem of --profile (default 8192 4096 4096)")


def _fp8ops_case(M, K, N, recipe, backend, dtype=torch.bfloat16, compiled=False):  # type: ignore[no-untyped-def]
    import fp8ops

    gs = fp8ops.GemmSpec
    recipe = type(recipe)(**{**_fields(recipe),
                             "fprop": gs(fast_accum=True, backend=backend),
                             "dgrad": gs(fast_accum=False, backend=backend),
                             "wgrad": gs(fast_accum=False, backend=backend)})
    st = fp8ops.LinearState.init(recipe, device="cuda")
    if recipe.mode == "delayed":
        st = st.replace(
            input=st.input.replace(scale=torch.tensor(448.0 / 5.0, device="cuda"), calibrated=True),
            weight=st.weight.replace(scale=torch.tensor(448.0 / 0.1, device="cuda"), calibrated=True),
            grad_output=st.grad_output.replace(scale=torch.tensor(57344.0 / 1e-2, device="cuda"), calibrated=True),
        )
    w = (torch.randn(N, K, device="cuda") / K**0.5).to(dtype).requires_grad_()

    def layer(x, probe):  # type: ignore[no-untyped-def]
        return fp8ops.fp8_linear(x, w, None, st, recipe=recipe, grad_probe=probe)

    if compiled:
        torch._dynamo.reset()  # each case compiles afresh (the cases share one code object)
    f = torch.compile(layer, fullgraph=True) if compiled else layer

    def fwd(x, dy):  # type: ignore[no-untyped-def]
        with torch.no_grad():
            return f(x, None)[0]

    def fwd_bwd(x, dy):  # type: ignore[no-untyped-def]
        w.grad = x.grad = None  # as after optimizer.zero_grad(set_to_none=True)
        probe = torch.zeros((), device="cuda", requires_grad=True)
        y, _ = f(x, probe)
        y.backward(dy)

    return fwd, fwd_bwd


def _fields(recipe: Any) -> dict[str, Any]:
    import attrs

    return {f.name: getattr(recipe, f.name) for f in attrs.fields(type(recipe))}


def _bf16_case(M, K, N):  # type: ignore[no-untyped-def]
    w = (torch.randn(N, K, device="cuda") / K**0.5).bfloat16().requires_grad_()

    def fwd(x, dy):  # type: ignore[no-untyped-def]
        with torch.no_grad():
            return torch.nn.functional.linear(x, w)

    def fwd_bwd(x, dy):  # type: ignore[no-untyped-def]
        w.grad = x.grad = None
        torch.nn.functional.linear(x, w).backward(dy)

    return fwd, fwd_bwd


def _torchao_case(M, K, N, recipe_name):  # type: ignore[no-untyped-def]
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    m = torch.nn.Sequential(torch.nn.Linear(K, N, bias=False)).cuda().bfloat16()
    convert_to_float8_training(m, config=Float8LinearConfig.from_recipe_name(recipe_name))
    mc = torch.compile(m)

    def fwd(x, dy):  # type: ignore[no-untyped-def]
        with torch.no_grad():
            return mc(x)

    def fwd_bwd(x, dy):  # type: ignore[no-untyped-def]
        m[0].weight.grad = x.grad = None
        mc(x).backward(dy)

    return fwd, fwd_bwd


def step_case(impl: str, mode: str, M: int, K: int, N: int, device: str = "cuda",
              dtype: torch.dtype = torch.bfloat16) -> tuple[Any, Any, tuple[Any, ...]]:
    """``(step, carry, batch)``: one full training step of a (M, K) -> (M, N) linear layer without
    bias, ``step(carry, x, dy) -> (carry, y[0, 0])``: fresh probe (FP8), forward, ``y.backward(dy)``,
    fused AdamW on the weight (capturable, a tensor learning rate) and :func:`fp8ops.update` (FP8).
    ``impl`` is a key of :data:`STEP_IMPLS`; ``mode`` containing "compile" compiles the forward
    (fp8ops: ``fullgraph=True``, and :func:`fp8ops.update`). The caller wraps the step in :func:`fp8ops.graph_step` for a
    graph mode. x requires grad; its gradient is reset each step. ``step.weight`` is the trained
    weight."""
    import fp8ops

    if impl not in STEP_IMPLS:
        raise ValueError(f"step_case: impl must be one of {sorted(STEP_IMPLS)}, got {impl!r}")
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(M, K, device=device, generator=g).to(dtype).requires_grad_()
    dy = (torch.randn(M, N, device=device, generator=g) * 1e-2).to(dtype)
    compiled = "compile" in mode
    fused = device == "cuda"
    lr = torch.tensor(1e-4, device=device)
    if impl == "torchao tensorwise":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        m = torch.nn.Sequential(torch.nn.Linear(K, N, bias=False)).to(device=device, dtype=dtype)
        convert_to_float8_training(m, config=Float8LinearConfig.from_recipe_name("tensorwise"))
        w = m[0].weight
        fwd: Any = torch.compile(m) if compiled else m
    else:
        w = (torch.randn(N, K, device=device, generator=g) / K**0.5).to(dtype).requires_grad_()
        lin = torch.compile(torch.nn.functional.linear) if compiled else torch.nn.functional.linear
        fwd = lambda xx: lin(xx, w)  # noqa: E731
    opt = torch.optim.AdamW([w], lr=lr, fused=fused, capturable=fused)
    if impl in ("torchao tensorwise", "bf16 F.linear"):

        def plain_step(carry: Any, xx: Tensor, d: Tensor) -> tuple[Any, Tensor]:
            opt.zero_grad(set_to_none=True)
            xx.grad = None
            y = fwd(xx)
            y.backward(d)
            opt.step()
            return carry, y.detach()[0, 0]

        plain_step.weight = w  # type: ignore[attr-defined]
        return plain_step, None, (x, dy)
    gs = fp8ops.GemmSpec
    recipe = fp8ops.DelayedScaling(fprop=gs(fast_accum=True, backend="cublas"),
                                   dgrad=gs(fast_accum=False, backend="cublas"),
                                   wgrad=gs(fast_accum=False, backend="cublas"))

    if impl == FUSED_OPT:
        return _fused_opt_step(w, x, dy, lr, recipe, compiled, device)

    def layer(st: Any, probe: Tensor, xx: Tensor) -> Any:
        return fp8ops.fp8_linear(xx, w, None, st, recipe=recipe, grad_probe=probe)

    f = torch.compile(layer, fullgraph=True) if compiled else layer
    # compiled: the update too (Inductor fuses its dozen small operations); its first, uncalibrated
    # calls read the observations on the host (a graph break), the calibrated ones trace whole
    upd = torch.compile(fp8ops.update) if compiled else fp8ops.update

    def fp8ops_step(st: Any, xx: Tensor, d: Tensor) -> tuple[Any, Tensor]:
        opt.zero_grad(set_to_none=True)
        xx.grad = None
        probe = fp8ops.make_probes(st)
        y, ns = f(st, probe, xx)
        y.backward(d)
        opt.step()
        return upd(ns, recipe=recipe, grad_amax=probe.grad), y.detach()[0, 0]

    fp8ops_step.weight = w  # type: ignore[attr-defined]
    return fp8ops_step, fp8ops.LinearState.init(recipe, device=device), (x, dy)


def _fused_opt_step(w: Tensor, x: Tensor, dy: Tensor, lr: Tensor, recipe: Any, compiled: bool, device: str
                    ) -> tuple[Any, Any, tuple[Any, ...]]:
    """The fp8ops step with :func:`fp8ops.adamw_quantize_`: the forward takes the weight's FP8 copy
    that the previous step's optimizer wrote (the first one from :func:`fp8ops.quantize_weight`);
    the update comes before the optimizer, which casts with the next step's scale."""
    import fp8ops

    m, v, t = torch.zeros_like(w), torch.zeros_like(w), torch.zeros((), device=device)
    first, st0 = fp8ops.quantize_weight(w, fp8ops.LinearState.init(recipe, device=device), recipe=recipe)
    value = first.value  # overwritten in place by every step's optimizer

    def layer(st: Any, probe: Tensor, xx: Tensor, cache: Any) -> Any:
        return fp8ops.fp8_linear(xx, w, None, st, recipe=recipe, grad_probe=probe, weight_cache=cache)

    f = torch.compile(layer, fullgraph=True) if compiled else layer
    upd = torch.compile(fp8ops.update) if compiled else fp8ops.update

    def fused_step(st: Any, xx: Tensor, d: Tensor) -> tuple[Any, Tensor]:
        w.grad = None
        xx.grad = None
        probe = fp8ops.make_probes(st)
        cache = fp8ops.WeightCache(value, None, st.weight.scale, recipe, w)
        y, ns = f(st, probe, xx, cache)
        y.backward(d)
        ns = upd(ns, recipe=recipe, grad_amax=probe.grad)
        _, ns = fp8ops.adamw_quantize_(w, w.grad, m, v, t, ns, recipe=recipe, lr=lr, out=cache)
        return ns, y.detach()[0, 0]

    fused_step.weight = w  # type: ignore[attr-defined]
    return fused_step, st0, (x, dy)


def _steps_table(shapes: list[tuple[int, int, int]], args: argparse.Namespace, samples: int
                 ) -> tuple[list[dict[str, Any]], list[str]]:
    """The full-step rows of every implementation and mode at each shape (each row marked whether
    it is its implementation's fastest mode, with the ratios to torchao's and bf16's fastest and to
    the three GEMMs alone), and a row of the three GEMMs; prints the table and the target verdicts."""
    from .step import measure_variant

    impls = {k: v for k, v in STEP_IMPLS.items() if not (args.no_torchao and k.startswith("torchao"))}
    if "torchao tensorwise" in impls:
        try:
            import torchao  # noqa: F401
        except Exception as exc:  # noqa: BLE001  (torchao missing or incompatible: say so, keep going)
            print(f"torchao unavailable: {type(exc).__name__}: {exc}")
            del impls["torchao tensorwise"]
    progress = common.Progress(len(shapes) * sum(len(m) for m in impls.values()), prefix="linear step")
    rows: list[dict[str, Any]] = []
    failed: list[str] = []
    for M, K, N in shapes:
        shape = f"{M}x{K}->{N}"
        ceil = _gemm_ceiling(M, K, N, samples)  # the ceiling: the three GEMMs alone
        rows.append({"shape": shape, "impl": "3 GEMMs (_scaled_mm)", "mode": "-", "us": sum(ceil.values()),
                     "gemms": ceil, "tflops": 3 * 2.0 * M * N * K / sum(ceil.values()) / 1e6})
        for impl, modes in impls.items():
            for mode in modes:
                progress.step(f"{shape} {impl} {mode}")
                # dy stands for the gradient the layers above would produce inside the step: the
                # graph reads it where it is, as the eager modes do, instead of copying it each step
                r = measure_variant(lambda: step_case(impl, mode, M, K, N), mode, args.steps,  # noqa: B023
                                    f"step {shape} {impl} {mode}", failed, progress, args_by_reference=(1,))
                if r is None:
                    continue
                rows.append({"shape": shape, "impl": impl, "mode": mode, "us": r["ms"] * 1e3,
                             "host_us": r["host_ms"] * 1e3, "kernels": r["kernels"],
                             "device_us": r["device_ms"] * 1e3,
                             "tflops": 3 * 2.0 * M * N * K / (r["ms"] * 1e-3) / 1e12})
        mine = [r for r in rows if r["shape"] == shape]
        best = {i: min((r for r in mine if r["impl"] == i), key=lambda r: r["us"]) for i in impls
                if any(r["impl"] == i for r in mine)}
        for r in mine:
            r["fastest"] = best.get(r["impl"]) is r
            r["over_gemms"] = r["us"] / sum(ceil.values())
            if "torchao tensorwise" in best:
                r["x_torchao"] = best["torchao tensorwise"]["us"] / r["us"]
            if "bf16 F.linear" in best:
                r["x_bf16"] = best["bf16 F.linear"]["us"] / r["us"]
    cols = [("shape", "shape", "s"), ("impl", "implementation", "s"), ("mode", "mode", "s"),
            ("us", "µs/step", ".0f"), ("tflops", "TFLOP/s", ".0f"), ("host_us", "host µs", ".0f"),
            ("kernels", "kernels", ".0f"), ("device_us", "device µs", ".0f"),
            ("x_torchao", "x torchao best", ".3f"), ("x_bf16", "x bf16 best", ".3f"),
            ("over_gemms", "/ 3 GEMMs", ".3f")]
    print("\nFull training steps (probe, forward, backward, update, AdamW), µs per step back to back:")
    print(common.format_table(rows, cols))
    for M, K, N in shapes:
        shape = f"{M}x{K}->{N}"
        mine = [r for r in rows if r["shape"] == shape and r["impl"] in ("fp8ops delayed", FUSED_OPT)
                and r.get("fastest") and "x_torchao" in r]
        if not mine:
            print(f"target {shape}: no comparison (a variant failed or torchao is missing)")
            continue
        ours = max(mine, key=lambda r: r["x_torchao"])
        verdict = "met" if ours["x_torchao"] >= TARGET_VS_TORCHAO else f"missed by {TARGET_VS_TORCHAO - ours['x_torchao']:.3f}"
        print(f"target {shape}: {ours['impl']} ({ours['mode']}) {ours['x_torchao']:.3f}x torchao tensorwise's "
              f"fastest mode (>= {TARGET_VS_TORCHAO}): {verdict}; {ours['over_gemms']:.3f}x the GEMMs alone")
    return rows, failed


def _step_chart(path: Path, steps: list[dict[str, Any]]) -> None:
    """µs per full step of each implementation's fastest mode and of the GEMMs alone, per shape."""
    try:
        shapes = list(dict.fromkeys(r["shape"] for r in steps))
        impls = list(dict.fromkeys(r["impl"] for r in steps if r.get("fastest") or r["mode"] == "-"))
        series = {i: [next((r["us"] for r in steps if r["shape"] == s and r["impl"] == i
                            and (r.get("fastest") or r["mode"] == "-")), None) for s in shapes] for i in impls}
        common.write_bar_chart(path, [{"title": "full training step, fastest mode", "groups": shapes,
                                       "series": series}],
                               title=f"linear layer steps ({torch.cuda.get_device_name()})", ylabel="µs per step")
    except Exception as exc:  # noqa: BLE001  (the plot is a convenience; the JSON and the table are the record)
        print(f"plot skipped: {type(exc).__name__}: {exc}")


def _gemm_ceiling(M, K, N, samples):  # type: ignore[no-untyped-def]
    """Median times (µs) of the three GEMMs alone through _scaled_mm on pre-quantized operands."""
    e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
    one = torch.ones((), device="cuda")

    def q(shape, dt):  # type: ignore[no-untyped-def]
        return (torch.randn(shape, device="cuda") * 8).to(dt)

    xq, wq, wq_t, xq_t = q((M, K), e4), q((N, K), e4), q((K, N), e4), q((K, M), e4)
    dyq, dyq_t = q((M, N), e5), q((N, M), e5)
    mm = torch._scaled_mm
    cases = {
        "fprop": lambda: mm(xq, wq.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16, use_fast_accum=True),
        "dgrad": lambda: mm(dyq, wq_t.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16, use_fast_accum=False),
        "wgrad": lambda: mm(dyq_t, xq_t.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16, use_fast_accum=False),
    }
    return {k: common.time_cuda(fn, [()], samples=samples).median_us for k, fn in cases.items()}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the suite; print the table; write linear.json and linear.png; return the record.

    ``--profile`` runs :mod:`fp8ops.bench.linear_profile` instead.
    """
    if getattr(args, "profile", False):
        from . import linear_profile

        return linear_profile.run(args)
    import fp8ops

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    samples = args.samples or (10 if args.quick else 25)
    shapes = QUICK_SHAPES if args.quick else SHAPES
    env = common.environment()
    print(common.describe_environment(env))
    t0 = time.perf_counter()
    steps, failed = _steps_table(shapes, args, samples)
    record: dict[str, Any] = {"suite": "linear", "environment": env, "steps": steps, "rows": [],
                              "failed_checks": failed}
    _step_chart(out / "linear.png", steps)
    if not getattr(args, "ops", False):
        record["seconds"] = time.perf_counter() - t0
        common.write_json(out / "linear.json", record)
        return record
    impls: list[tuple[str, Any]] = [("bf16 F.linear", lambda M, K, N: _bf16_case(M, K, N))]
    for label, recipe in (("delayed", fp8ops.DelayedScaling()), ("current", fp8ops.CurrentScaling()),
                          ("rowwise", fp8ops.CurrentScaling(granularity="row"))):
        for backend in ("cublas", "triton"):
            impls.append((f"fp8ops {label} [{backend}]",
                          lambda M, K, N, r=recipe, b=backend: _fp8ops_case(M, K, N, r, b)))
        impls.append((f"fp8ops {label} [cublas] + compile",
                      lambda M, K, N, r=recipe: _fp8ops_case(M, K, N, r, "cublas", compiled=True)))
    if not args.no_torchao:
        try:
            import torchao  # noqa: F401

            for name in ("tensorwise", "rowwise"):
                impls.append((f"torchao {name} + compile", lambda M, K, N, n=name: _torchao_case(M, K, N, n)))
        except Exception as exc:  # torchao missing or incompatible: say so, keep going
            print(f"torchao unavailable: {type(exc).__name__}: {exc}")
    progress = common.Progress(len(shapes) * (len(impls) + 1), prefix="linear")
    rows: list[dict[str, Any]] = record["rows"]
    for M, K, N in shapes:
        flops = 2.0 * M * N * K
        x_sets = [(torch.randn(M, K, device="cuda").bfloat16().requires_grad_(),
                   (torch.randn(M, N, device="cuda") * 1e-2).bfloat16()) for _ in range(2)]
        progress.step(f"{M}x{K}->{N} _scaled_mm ceiling")
        ceil = _gemm_ceiling(M, K, N, samples)
        ceil_fb = ceil["fprop"] + ceil["dgrad"] + ceil["wgrad"]
        rows.append({"shape": f"{M}x{K}->{N}", "impl": "3 GEMMs (_scaled_mm)", "fwd_us": ceil["fprop"],
                     "fwd_bwd_us": ceil_fb, "fwd_tflops": flops / ceil["fprop"] / 1e6,
                     "fwd_bwd_tflops": 3 * flops / ceil_fb / 1e6, "gemms": ceil})
        for label, make in impls:
            progress.step(f"{M}x{K}->{N} {label}")
            try:
                fwd, fwd_bwd = make(M, K, N)
                tf = common.time_cuda(fwd, x_sets, samples=samples, use_graph=False).median_us
                tb = common.time_cuda(fwd_bwd, x_sets, samples=samples, use_graph=False).median_us
                notes: list[str] = []
                tg = common.time_cuda(fwd_bwd, x_sets, samples=samples, use_graph=True,
                                      on_fallback=notes.append)
                tb_dev = tg.median_us if tg.method == "cuda-graph" else None
            except Exception as exc:
                msg = f"{label} at {M}x{K}->{N}: {type(exc).__name__}: {str(exc)[:300]}"
                print(f"\n  failed: {msg}")
                failed.append(msg)
                continue
            rows.append({"shape": f"{M}x{K}->{N}", "impl": label, "fwd_us": tf, "fwd_bwd_us": tb,
                         "fwd_tflops": flops / tf / 1e6, "fwd_bwd_tflops": 3 * flops / tb / 1e6,
                         "vs_gemms": tb / ceil_fb, "fwd_bwd_graph_us": tb_dev,
                         "graph_vs_gemms": (tb_dev / ceil_fb) if tb_dev else None})
        del x_sets
        torch.cuda.empty_cache()
    # speed-ups vs torchao tensorwise + compile, per shape
    for r in rows:
        peer = next((p for p in rows if p["shape"] == r["shape"] and p["impl"] == "torchao tensorwise + compile"), None)
        if peer is not None:
            r["speedup_vs_torchao_tw"] = peer["fwd_bwd_us"] / r["fwd_bwd_us"]
    cols = [("shape", "shape", "s"), ("impl", "implementation", "s"), ("fwd_us", "fwd µs", ".0f"),
            ("fwd_tflops", "fwd TF/s", ".0f"), ("fwd_bwd_us", "fwd+bwd µs", ".0f"),
            ("fwd_bwd_tflops", "fwd+bwd TF/s", ".0f"), ("vs_gemms", "/ 3 GEMMs", ".3f"),
            ("fwd_bwd_graph_us", "graph µs", ".0f"), ("graph_vs_gemms", "graph / 3 GEMMs", ".3f"),
            ("speedup_vs_torchao_tw", "x torchao tw", ".3f")]
    print()
    print(common.format_table(rows, cols))
    record["seconds"] = time.perf_counter() - t0
    common.write_json(out / "linear.json", record)
    try:
        shape_names = list(dict.fromkeys(r["shape"] for r in rows))
        impl_names = list(dict.fromkeys(r["impl"] for r in rows))
        panels = []
        for key, title in (("fwd_tflops", "forward"), ("fwd_bwd_tflops", "forward + backward")):
            series = {i: [next((r[key] for r in rows if r["shape"] == s and r["impl"] == i), None)
                          for s in shape_names] for i in impl_names}
            panels.append({"title": title, "groups": shape_names, "series": series})
        common.write_bar_chart(out / "linear_ops.png", panels, title="fp8_linear TFLOP/s (M x K -> N)",
                               ylabel="TFLOP/s")
    except Exception as exc:  # the plot is a convenience; the JSON and the table are the record
        print(f"plot skipped: {type(exc).__name__}: {exc}")
    return record


if __name__ == "__main__":
    import sys

    _p = argparse.ArgumentParser(prog="python -m fp8ops.bench.linear")
    _p.add_argument("--out", default="bench_out")
    _p.add_argument("--quick", action="store_true")
    add_arguments(_p)
    _rec = run(_p.parse_args())
    sys.exit(1 if _rec["failed_checks"] else 0)
