"""``python -m fp8ops.demo``: FP8 quantization error per format and recipe, then a short training
run with FP8 fake quantization and delayed scaling state, next to the same run in float32.

Runs on a CUDA GPU when there is one (Triton kernels), else on the CPU (the reference kernels).
"""

from __future__ import annotations

import argparse
import math
import time

import torch

import fp8ops
from fp8ops import CurrentScaling, DelayedScaling, FakeQuantState, Format


def _sqnr_db(x: torch.Tensor, y: torch.Tensor) -> float:
    err = (x - y).float().pow(2).mean().item()
    sig = x.float().pow(2).mean().item()
    return float("inf") if err == 0 else 10.0 * math.log10(sig / err)


def quantization_table(device: torch.device, seed: int = 0) -> list[tuple[str, str, float, float]]:
    """Round-trip error of a heavy-tailed activation-like tensor under each format and recipe."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(512, 1024, generator=g) * torch.exp(torch.randn(512, 1, generator=g))  # rows of varied scale
    x = x.to(device=device, dtype=torch.bfloat16)
    rows = []
    for fmt in (Format.E4M3, Format.E5M2):
        recipes: list[tuple[str, fp8ops.Recipe]] = [
            ("delayed (history 16)", DelayedScaling(fp8_format=fmt)),
            ("current, per tensor", CurrentScaling(fp8_format=fmt)),
            ("current, per row", CurrentScaling(fp8_format=fmt, granularity="row")),
        ]
        for name, recipe in recipes:
            state = recipe.init(role="forward", device=device)
            if recipe.mode == "delayed":
                # one step to observe, one update to calibrate; then quantize with the delayed scale
                _, state = fp8ops.quantize(x, state, recipe=recipe)
                state = recipe.update(state)
            q, _ = fp8ops.quantize(x, state, recipe=recipe)
            y = fp8ops.dequantize(q, dtype=torch.float32)
            rel = ((y - x.float()).norm() / x.float().norm()).item()
            rows.append((fmt.value, name, rel, _sqnr_db(x.float(), y)))
    return rows


def _mlp(params: dict[str, torch.Tensor], x: torch.Tensor, states, probes, recipe):
    """A 2-layer MLP; with ``states``, activations and their gradients pass through FP8."""
    new_states = {}
    h = x
    for name in ("l1", "l2"):
        if states is not None:
            h, new_states[name] = fp8ops.fake_quantize(h, states[name], recipe=recipe, grad_probe=probes[name])
        h = h @ params[f"{name}.w"].t() + params[f"{name}.b"]
        if name == "l1":
            h = torch.nn.functional.gelu(h, approximate="tanh")
    return h, new_states


def train(device: torch.device, *, fp8: bool, steps: int, micro_batches: int, seed: int = 0, on_step=None):
    """Regression on a fixed random teacher; returns (losses, final states)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    d_in, d_h, d_out = 64, 256, 16
    teacher = torch.randn(d_out, d_in, generator=g) / math.sqrt(d_in)
    params = {
        "l1.w": torch.randn(d_h, d_in, generator=g) / math.sqrt(d_in),
        "l1.b": torch.zeros(d_h),
        "l2.w": torch.randn(d_out, d_h, generator=g) / math.sqrt(d_h),
        "l2.b": torch.zeros(d_out),
    }
    params = {k: v.to(device).requires_grad_() for k, v in params.items()}
    opt = torch.optim.Adam(params.values(), lr=3e-3)
    recipe = DelayedScaling(amax_history_len=8)
    states = {n: FakeQuantState.init(recipe, device=device) for n in ("l1", "l2")} if fp8 else None
    losses = []
    for _ in range(steps):
        merged_states, merged_probes, step_loss = None, None, 0.0
        for _ in range(micro_batches):
            x = torch.randn(128, d_in, generator=g).to(device)
            y = torch.tanh(x @ teacher.t().to(device)) * 3.0
            probes = fp8ops.make_probes(states) if fp8 else None  # fresh probes every forward
            out, new_states = _mlp(params, x, states, probes, recipe)
            loss = torch.nn.functional.mse_loss(out, y) / micro_batches
            loss.backward()
            step_loss += loss.item()
            if fp8:
                grads = {k: p.grad for k, p in probes.items()}
                merged_states = new_states if merged_states is None else fp8ops.merge(merged_states, new_states)
                merged_probes = grads if merged_probes is None else fp8ops.merge(merged_probes, grads)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if fp8:  # once per optimizer step: observations in, scales out
            states = fp8ops.update(merged_states, recipe=recipe, grad_amax=merged_probes)
        losses.append(step_loss)
        if on_step is not None:
            on_step(len(losses), step_loss)
    return losses, states


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fp8ops.demo", description=__doc__)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--micro-batches", type=int, default=2)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    print(f"fp8ops {fp8ops.__version__} on {device} (torch {torch.__version__})\n")

    print("1. Round-trip error of a bf16 tensor (512 x 1024, rows of varied scale)")
    print(f"   {'format':<7}{'recipe':<24}{'rel. error':>12}{'SQNR dB':>10}")
    for fmt, name, rel, sqnr in quantization_table(device):
        print(f"   {fmt:<7}{name:<24}{rel:>12.4f}{sqnr:>10.1f}")

    print(f"\n2. Training a 2-layer MLP, {args.steps} steps x {args.micro_batches} micro-batches")
    results = {}
    for label, fp8 in (("float32", False), ("fp8 fake-quant, delayed scaling", True)):
        every = max(1, args.steps // 4)

        def progress(step: int, loss: float, label: str = label, every: int = every) -> None:
            if step == 1 or step % every == 0:
                print(f"   {label:<34} step {step:>4}/{args.steps}  loss {loss:.4f}", flush=True)

        t0 = time.perf_counter()
        losses, states = train(device, fp8=fp8, steps=args.steps, micro_batches=args.micro_batches, on_step=progress)
        results[label] = (losses, states, time.perf_counter() - t0)
        print(f"   {label:<34} final loss {sum(losses[-10:]) / 10:.4f}  ({results[label][2]:.1f} s)")
    _, states, _ = results["fp8 fake-quant, delayed scaling"]
    print("\n   scaling state after training (input / grad_output scale):")
    for name, st in states.items():
        print(f"   {name}: {st.input.scale.item():10.2f} / {st.grad_output.scale.item():12.1f}"
              f"   history[0] = {st.input.amax_history[0].item():.3f} / {st.grad_output.amax_history[0].item():.2e}")
    base = sum(results["float32"][0][-10:]) / 10
    fp8_loss = sum(results["fp8 fake-quant, delayed scaling"][0][-10:]) / 10
    print(f"\n   FP8 / float32 final loss ratio: {fp8_loss / base:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
