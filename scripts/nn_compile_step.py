"""Full training steps of a GPT written with ``torch.nn`` and converted to ``fp8ops.nn`` modules,
eager and under ``torch.compile``, next to the same model in plain bf16 (eager and compiled).

The model is the step suite's torch GPT (``fp8ops.bench.step.TorchGPT``: pre-norm blocks, SDPA
causal attention, gelu-tanh MLP, tied head), bf16 parameters. A step is forward, backward, fused
AdamW and, for FP8 (``fp8ops.nn.convert`` with delayed scaling), ``fp8ops.nn.update_scaling``.
``compile`` compiles the model with ``fullgraph=True`` (each fp8ops.nn module traced whole, taking
the probes made ahead for it); the optimizer step and the update stay eager. Per variant, with the
bench's helpers (``fp8ops.bench.common.host_us`` / ``device_ops``): ms per step (wall until the GPU
has finished, median of ``--rounds`` loops of ``--steps`` steps after 5 warm-up steps), host ms per
step (the same loop launched without synchronization), kernels per step and their summed device
time (profiler, two steps), and the loss after the last step; the variants are timed in turn, round
after round.

    python scripts/nn_compile_step.py [--hidden 768 2048] [--steps 20] [--rounds 3] [--json OUT]

Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import json

import torch

import fp8ops
import fp8ops.nn
from fp8ops.bench.common import device_ops, host_us
from fp8ops.bench.step import TorchGPT

SIZES = {768: dict(layers=12, heads=12), 2048: dict(layers=8, heads=16), 4096: dict(layers=4, heads=32)}


def build(hidden: int, fp8: bool, compiled: bool, seq: int, batch: int, vocab: int):
    torch.manual_seed(0)
    net = TorchGPT(SIZES[hidden]["layers"], hidden, SIZES[hidden]["heads"], seq, vocab).cuda().bfloat16()
    if fp8:
        fp8ops.nn.convert(net, fp8ops.DelayedScaling())
    run = torch.compile(net, fullgraph=True) if compiled else net
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4, fused=True)
    g = torch.Generator(device="cuda").manual_seed(1)
    tokens = torch.randint(0, vocab, (batch, seq), device="cuda", generator=g)
    targets = torch.randint(0, vocab, (batch, seq), device="cuda", generator=g)

    def step() -> torch.Tensor:
        loss = run(tokens, targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if fp8:
            fp8ops.nn.update_scaling(net)
        return loss.detach()

    return step


def main() -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, nargs="+", default=[768, 2048], choices=sorted(SIZES))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    seq, batch, vocab = 1024, 8, 32768
    out: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "seq": seq, "batch": batch,
                 "vocab": vocab, "rows": []}
    for hidden in args.hidden:
        steps = {}
        for name, fp8, compiled in (("bf16 eager", False, False), ("bf16 compile", False, True),
                                    ("FP8 fp8ops.nn eager", True, False), ("FP8 fp8ops.nn compile", True, True)):
            torch._dynamo.reset()
            steps[name] = build(hidden, fp8, compiled, seq, batch, vocab)
            for _ in range(5):  # warm-up: compilation, calibration (one recompilation)
                steps[name]()
        times: dict = {name: [] for name in steps}
        losses: dict = {}
        for _ in range(args.rounds):
            for name, step in steps.items():
                times[name].append(host_us(step, args.steps, warmup=0))
                losses[name] = float(step())
        for name, ts in times.items():
            host_ms, ms = (sorted(t[i] for t in ts)[len(ts) // 2] / 1e3 for i in (0, 1))
            kernels, device_us = device_ops(steps[name], 2)
            row = {"hidden": hidden, "variant": name, "ms_per_step": ms, "host_ms_per_step": host_ms,
                   "kernels_per_step": kernels, "kernel_ms_per_step": device_us / 1e3,
                   "all_host_wall_us": ts, "loss": losses[name], "tokens_per_s": seq * batch / ms * 1e3}
            out["rows"].append(row)
            print(f"hidden {hidden:5d}  {name:24s} {ms:8.2f} ms/step  host {host_ms:7.2f} ms  "
                  f"{kernels:6.0f} kernels ({device_us / 1e3:7.2f} ms)  {row['tokens_per_s']:9.0f} tok/s  "
                  f"loss {losses[name]:.4f}", flush=True)
        del steps
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
