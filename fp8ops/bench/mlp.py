"""fused_ln_mlp forward+backward vs a bf16 PyTorch MLP (eager, torch.compile) and torchao float8.

Problem: tokens M = 8192, hidden K = 4096, ffn F = 16384, bf16 activations and weights, with biases;
``LayerNorm -> fc1 -> activation -> fc2`` with activation ``gelu_tanh`` (fc1 (F, K)) and ``swiglu``
(fc1 (2F, K): ``silu(a) * b`` of its two halves, as Transformer Engine). ``--quick``: M = 2048,
K = 1024, F = 4096.

Implementations (all share the same weights and inputs):

- ``torch eager``: ``F.layer_norm``, ``F.linear``, the activation, ``F.linear`` in bf16;
- ``torch.compile``: the same function under ``torch.compile``;
- ``torchao tensorwise + compile``: that MLP as an ``nn.Module`` whose Linear layers
  ``torchao.float8.convert_to_float8_training`` converts, under ``torch.compile`` (if importable);
- ``fp8ops bf16``: :func:`fp8ops.fused_ln_mlp` with ``recipe=None`` (fused norm and activation
  kernels, bf16 GEMMs);
- ``fp8ops delayed``: ``DelayedScaling`` with a state calibrated by one real step and fresh probes
  every step; ``... recompute=activation``: fc1's output stored in FP8 and the activation's FP8
  copy recomputed in backward; ``... + compile``: under ``torch.compile(fullgraph=True)``.

Measured per implementation: the forward+backward step time (median of CUDA-event-timed loops
of plain launches after warm-up, what an eager training loop sees; ``graph µs``: CUDA-graph
replays, device time, where capture works), TFLOP/s (2 GEMMs x 3 x 2·M·K·C), the ratio to torchao
tensorwise + compile, and the peak memory of one step: ``torch.cuda.max_memory_allocated`` after
``reset_peak_memory_stats`` minus the memory allocated before the step (inputs, weights and the
output gradient allocated, parameter gradients cleared), so it counts activations saved for
backward, temporaries and the new gradients. Targets printed: fp8ops delayed >= 1.2x torchao
tensorwise + compile at no higher peak memory.

Checks (recorded in ``failed_checks``), relative errors (norm of the difference over the peer's norm)
on the first input set: fp8ops bf16 vs torch eager, output and input gradient < 2e-2; fp8ops FP8 vs
torch eager, output < 0.1 and input gradient < 0.2 (the gradient passes two E5M2 casts, half-ulp
2^-3 each, in series); the same bounds for recompute (fc1's output stored in FP8 adds one E4M3
rounding of the activation's input).
"""

from __future__ import annotations

import argparse
import gc
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from . import common

__all__ = ["add_arguments", "run"]

SHAPE = (8192, 4096, 16384)  # M tokens, K hidden, F ffn
QUICK_SHAPE = (2048, 1024, 4096)
ACTIVATIONS = ("gelu_tanh", "swiglu")
TARGET_SPEEDUP = 1.2
PEER = "torchao tensorwise + compile"
EPS = 1e-5


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of this suite."""
    parser.add_argument("--activations", nargs="*", default=None, choices=ACTIVATIONS,
                        help="activations to run (default: all)")
    parser.add_argument("--no-torchao", action="store_true", help="skip the torchao peer")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile cases")
    parser.add_argument("--samples", type=int, default=None, help="timed samples per case (default 20, 8 with --quick)")
    mode = parser.add_argument_group("other modes (each replaces the timed comparison)").add_mutually_exclusive_group()
    mode.add_argument("--memory", action="store_true",
                      help="where the memory of one fused_ln_mlp step goes (saved for backward, held after the "
                      "forward, forward and backward peaks), per activation, with and without "
                      "recompute='activation'; writes mlp_memory.json")
    mode.add_argument("--activation-kernels", action="store_true",
                      help="time the fused activation kernels alone against the copy bandwidth, with a few launch "
                      "configs per case; writes activation_timing.json")
    mode.add_argument("--activation-probe", action="store_true",
                      help="what bounds the activation kernels: a saturation check and launch variants, printed")


# ------------------------------------------------------------------------------------------------
# The MLP in torch ops and as a module


def _act(h: Tensor, activation: str) -> Tensor:
    if activation == "swiglu":
        a, b = h.chunk(2, dim=-1)
        return F.silu(a) * b
    return F.gelu(h, approximate="tanh")


def torch_mlp(x: Tensor, ln_w: Tensor, ln_b: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor,
              activation: str) -> Tensor:
    """``fc2(act(fc1(LayerNorm(x))))`` in plain torch ops (the bf16 peer)."""
    h = F.layer_norm(x, (x.shape[-1],), ln_w, ln_b, EPS)
    return F.linear(_act(F.linear(h, w1, b1), activation), w2, b2)


class TorchMLP(torch.nn.Module):
    """The same MLP as modules (LayerNorm, Linear, activation, Linear), for torchao's conversion."""

    def __init__(self, weights: dict[str, Tensor], activation: str) -> None:
        super().__init__()
        K = weights["ln_w"].numel()
        self.activation = activation
        self.ln = torch.nn.LayerNorm(K, eps=EPS)
        self.fc1 = torch.nn.Linear(K, weights["w1"].shape[0])
        self.fc2 = torch.nn.Linear(weights["w2"].shape[1], weights["w2"].shape[0])
        with torch.no_grad():
            for mod, w, b in ((self.ln, "ln_w", "ln_b"), (self.fc1, "w1", "b1"), (self.fc2, "w2", "b2")):
                mod.weight.copy_(weights[w])
                mod.bias.copy_(weights[b])

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(_act(self.fc1(self.ln(x)), self.activation))


# ------------------------------------------------------------------------------------------------
# Cases: each is (step(x, dy) -> output, params to clear before a step)


def _weights(K: int, Fh: int, activation: str, seed: int) -> dict[str, Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    C = 2 * Fh if activation == "swiglu" else Fh

    def rnd(*shape: int, std: float) -> Tensor:
        return (torch.randn(*shape, device="cuda", generator=g) * std).bfloat16().requires_grad_()

    return {"ln_w": (1.0 + 0.1 * torch.randn(K, device="cuda", generator=g)).bfloat16().requires_grad_(),
            "ln_b": rnd(K, std=0.1), "w1": rnd(C, K, std=K**-0.5), "b1": rnd(C, std=0.02),
            "w2": rnd(K, Fh, std=Fh**-0.5), "b2": rnd(K, std=0.02)}


def _torch_case(w: dict[str, Tensor], activation: str, compiled: bool) -> tuple[Any, list[Tensor]]:
    fn = torch.compile(torch_mlp) if compiled else torch_mlp
    order = ("ln_w", "ln_b", "w1", "b1", "w2", "b2")

    def step(x: Tensor, dy: Tensor) -> Tensor:
        y = fn(x, *(w[k] for k in order), activation)
        y.backward(dy)
        return y.detach()  # keeps no autograd graph alive between steps (CUDA-graph capture needs that)

    return step, list(w.values())


def _torchao_case(w: dict[str, Tensor], activation: str) -> tuple[Any, list[Tensor]]:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    m = TorchMLP({k: v.detach() for k, v in w.items()}, activation).cuda().bfloat16()
    convert_to_float8_training(m, config=Float8LinearConfig.from_recipe_name("tensorwise"))
    mc = torch.compile(m)

    def step(x: Tensor, dy: Tensor) -> Tensor:
        y = mc(x)
        y.backward(dy)
        return y.detach()

    return step, list(m.parameters())


def _fp8ops_case(w: dict[str, Tensor], activation: str, recipe: Any, x0: Tensor, dy0: Tensor, *,
                 recompute: str | None = None, compiled: bool = False) -> tuple[Any, list[Tensor]]:
    import fp8ops
    from fp8ops.fused_ln_mlp import LayerNormMLPState, fused_ln_mlp

    def mlp(x: Tensor, state: Any, probes: Any) -> tuple[Tensor, Any]:
        return fused_ln_mlp(x, w["ln_w"], w["ln_b"], w["w1"], w["b1"], w["w2"], w["b2"], state, recipe=recipe,
                            activation=activation, eps=EPS, recompute=recompute, grad_probe=probes)

    state = None
    if recipe is not None:
        # One real step calibrates the state (first-step current scaling), as in training.
        state = LayerNormMLPState.init(recipe, device="cuda")
        probes = torch.zeros(2, device="cuda", requires_grad=True)
        y, new_state = mlp(x0, state, probes)
        y.backward(dy0)
        state = fp8ops.update(new_state, recipe=recipe, grad_amax=probes.grad)
        del y
        for t in list(w.values()) + [x0]:
            t.grad = None
    if compiled:
        torch._dynamo.reset()
    fn = torch.compile(mlp, fullgraph=True) if compiled else mlp

    def step(x: Tensor, dy: Tensor) -> Tensor:
        probes = torch.zeros(2, device="cuda", requires_grad=True) if recipe is not None else None
        y, _ = fn(x, state, probes)
        y.backward(dy)
        return y.detach()

    return step, list(w.values())


# ------------------------------------------------------------------------------------------------
# The suite


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the suite; print the table; write mlp.json and mlp.png; return the record.

    ``--memory``, ``--activation-kernels`` and ``--activation-probe`` run their mode instead
    (:mod:`fp8ops.bench.mlp_memory`, :mod:`fp8ops.bench.activation_kernels`).
    """
    if getattr(args, "memory", False):
        from . import mlp_memory

        return mlp_memory.run(args)
    if getattr(args, "activation_kernels", False):
        from . import activation_kernels

        return activation_kernels.run_timing(args)
    if getattr(args, "activation_probe", False):
        from . import activation_kernels

        return activation_kernels.run_probe(args)
    import fp8ops

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    samples = args.samples or (8 if args.quick else 20)
    M, K, Fh = QUICK_SHAPE if args.quick else SHAPE
    activations = args.activations or list(ACTIVATIONS)
    env = common.environment()
    print(common.describe_environment(env))
    print(f"MLP: tokens {M}, hidden {K}, ffn {Fh}, bf16, biases; activations {', '.join(activations)}")
    delayed = fp8ops.DelayedScaling()
    impls: list[tuple[str, Any]] = [("torch eager", lambda w, a, x0, dy0: _torch_case(w, a, False))]
    if not args.no_compile:
        impls.append(("torch.compile", lambda w, a, x0, dy0: _torch_case(w, a, True)))
    if not args.no_torchao:
        try:
            import torchao  # noqa: F401

            impls.append((PEER, lambda w, a, x0, dy0: _torchao_case(w, a)))
        except Exception as exc:  # noqa: BLE001  (torchao missing or incompatible: say so, keep going)
            print(f"torchao unavailable: {type(exc).__name__}: {exc}")
    impls += [
        ("fp8ops bf16", lambda w, a, x0, dy0: _fp8ops_case(w, a, None, x0, dy0)),
        ("fp8ops delayed", lambda w, a, x0, dy0: _fp8ops_case(w, a, delayed, x0, dy0)),
        ("fp8ops delayed recompute=activation",
         lambda w, a, x0, dy0: _fp8ops_case(w, a, delayed, x0, dy0, recompute="activation")),
    ]
    if not args.no_compile:
        impls.append(("fp8ops delayed + compile",
                      lambda w, a, x0, dy0: _fp8ops_case(w, a, delayed, x0, dy0, compiled=True)))
    progress = common.Progress(len(activations) * len(impls), prefix="mlp")
    rows: list[dict[str, Any]] = []
    failed: list[str] = []
    t0 = time.perf_counter()
    for activation in activations:
        C = 2 * Fh if activation == "swiglu" else Fh
        flops = 3 * (2.0 * M * K * C + 2.0 * M * Fh * K)
        w = _weights(K, Fh, activation, seed=0)
        g = torch.Generator(device="cuda").manual_seed(1)
        x_sets = [((torch.randn(M, K, device="cuda", generator=g) * 2 + 0.5).bfloat16().requires_grad_(),
                   (torch.randn(M, K, device="cuda", generator=g) * 1e-2).bfloat16()) for _ in range(2)]
        outputs: dict[str, tuple[Tensor, Tensor]] = {}
        for label, make in impls:
            progress.step(f"{activation}: {label}")
            try:
                step, params = make(w, activation, *x_sets[0])
                fn = common.clearing_grads(step, params)
                # Output and input gradient on the first input set, for the checks.
                x, dy = x_sets[0]
                y = fn(x, dy)
                outputs[label] = (y.detach().clone(), x.grad.detach().clone())
                notes: list[str] = []
                te = common.time_cuda(fn, x_sets, samples=samples, use_graph=False)
                tg = common.time_cuda(fn, x_sets, samples=samples, use_graph=True, on_fallback=notes.append)
                peak = common.step_peak_bytes(step, params, *x_sets[0])
            except Exception as exc:  # noqa: BLE001  (recorded as a failed check)
                msg = f"{label} ({activation}): {type(exc).__name__}: {str(exc)[:300]}"
                progress.note(f"failed: {msg}")
                failed.append(msg)
                continue
            for n in notes:
                progress.note(f"{label}: {n}")
            rows.append({"activation": activation, "impl": label, "step_us": te.median_us,
                         "graph_us": tg.median_us if tg.method == "cuda-graph" else None,
                         "tflops": flops / te.median_us / 1e6, "peak_mib": peak / 2**20, "peak_bytes": peak,
                         "timing": te.as_dict()})
            del step, params, fn
            torch.cuda.empty_cache()
        failed += _checks(outputs, activation)
        del w, x_sets, outputs
        gc.collect()
        torch.cuda.empty_cache()
    for r in rows:
        peer = next((p for p in rows if p["activation"] == r["activation"] and p["impl"] == PEER), None)
        if peer is not None:
            r["speedup_vs_torchao"] = peer["step_us"] / r["step_us"]
            r["memory_vs_torchao"] = r["peak_bytes"] / peer["peak_bytes"]
    cols = [("activation", "activation", "s"), ("impl", "implementation", "s"), ("step_us", "fwd+bwd µs", ".0f"),
            ("graph_us", "graph µs", ".0f"), ("tflops", "TFLOP/s", ".0f"),
            ("speedup_vs_torchao", "x torchao", ".3f"), ("peak_mib", "peak MiB", ".0f"),
            ("memory_vs_torchao", "mem / torchao", ".3f")]
    print()
    print(common.format_table(rows, cols))
    targets = _targets(rows, activations)
    print()
    for t in targets:
        print(t["line"])
    record = {"suite": "mlp", "environment": env, "shape": {"tokens": M, "hidden": K, "ffn": Fh},
              "rows": rows, "targets": targets, "failed_checks": failed, "seconds": time.perf_counter() - t0}
    common.write_json(out / "mlp.json", record)
    try:
        impl_names = list(dict.fromkeys(r["impl"] for r in rows))
        panels = []
        for key, title in (("tflops", "forward + backward TFLOP/s"), ("peak_mib", "peak memory of a step (MiB)")):
            series = {i: [next((r[key] for r in rows if r["activation"] == a and r["impl"] == i), None)
                          for a in activations] for i in impl_names}
            panels.append({"title": title, "groups": activations, "series": series})
        common.write_bar_chart(out / "mlp.png", panels, title=f"LayerNorm + MLP, {M} tokens, {K} -> {Fh} -> {K}, bf16",
                               ylabel="TFLOP/s | MiB")
    except Exception as exc:  # noqa: BLE001  (the plot is a convenience; the JSON and the table are the record)
        print(f"plot skipped: {type(exc).__name__}: {exc}")
    return record


def _checks(outputs: dict[str, tuple[Tensor, Tensor]], activation: str) -> list[str]:
    failed = []
    ref = outputs.get("torch eager")
    # (label, peer, bound on the output, bound on the input gradient)
    bounds = [("fp8ops bf16", "torch eager", 2e-2, 2e-2), ("fp8ops delayed", "torch eager", 0.1, 0.2),
              ("fp8ops delayed + compile", "torch eager", 0.1, 0.2),
              ("fp8ops delayed recompute=activation", "torch eager", 0.1, 0.2)]
    for label, peer, *bound_of in bounds:
        if label not in outputs or peer not in outputs or ref is None:
            continue
        for i, what in enumerate(("output", "input gradient")):
            bound = bound_of[i]
            err = common.rel_err(outputs[label][i], outputs[peer][i])
            print(f"  check ({activation}) {label} vs {peer}: {what} relative error {err:.2e} (bound {bound:g})")
            if not err < bound:
                failed.append(f"{label} ({activation}): {what} differs from {peer}: relative error {err:.3e} "
                              f"> {bound:g}")
    return failed


def _targets(rows: list[dict[str, Any]], activations: list[str]) -> list[dict[str, Any]]:
    out = []
    for a in activations:
        r = next((r for r in rows if r["activation"] == a and r["impl"] == "fp8ops delayed"), None)
        if r is None or "speedup_vs_torchao" not in r:
            out.append({"activation": a, "met": None,
                        "line": f"target ({a}): fp8ops delayed >= {TARGET_SPEEDUP}x {PEER} at no higher memory: "
                                "not measured"})
            continue
        best = max((x for x in rows if x["activation"] == a and x["impl"].startswith("fp8ops delayed")),
                   key=lambda x: x["speedup_vs_torchao"])
        met = r["speedup_vs_torchao"] >= TARGET_SPEEDUP and r["memory_vs_torchao"] <= 1.0
        out.append({"activation": a, "met": met, "speedup": r["speedup_vs_torchao"],
                    "memory_ratio": r["memory_vs_torchao"], "best_impl": best["impl"],
                    "best_speedup": best["speedup_vs_torchao"], "best_memory_ratio": best["memory_vs_torchao"],
                    "line": f"target ({a}): fp8ops delayed >= {TARGET_SPEEDUP}x {PEER} at no higher peak memory: "
                            f"{r['speedup_vs_torchao']:.2f}x, memory {r['memory_vs_torchao']:.2f}x -> "
                            f"{'met' if met else 'NOT met'} (best fp8ops variant: {best['impl']}, "
                            f"{best['speedup_vs_torchao']:.2f}x, memory {best['memory_vs_torchao']:.2f}x)"})
    return out


if __name__ == "__main__":
    import sys

    _p = argparse.ArgumentParser(prog="python -m fp8ops.bench.mlp")
    _p.add_argument("--out", default="bench_out")
    _p.add_argument("--quick", action="store_true")
    add_arguments(_p)
    _rec = run(_p.parse_args())
    sys.exit(1 if _rec["failed_checks"] else 0)
