"""``python -m fp8ops.bench mlp --memory``: where the memory of one fused_ln_mlp step goes.

At the seed shape (8192 tokens, 4096 -> 16384 -> 4096; ``--quick``: the suite's small shape), for
gelu_tanh and swiglu, with and without ``recompute="activation"``, delayed scaling (calibrated by one
step), bf16: the bytes saved for backward (counted by a saved-tensors hook, each tensor once), the
memory held after the forward, the peak of the forward and the peak of the backward, all relative
to what was allocated before the step (inputs, weights and dy; parameter gradients cleared).
Prints a table and writes ``mlp_memory.json`` into ``--out``. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import gc
from pathlib import Path
from typing import Any

import torch

from . import common
from .mlp import EPS, QUICK_SHAPE, SHAPE, _weights

__all__ = ["probe", "run"]

MiB = 2**20


def probe(activation: str, recompute: str | None, shape: tuple[int, int, int]) -> dict[str, float]:
    """Memory of one calibrated fused_ln_mlp step (MiB above what was allocated before it)."""
    import fp8ops

    M, K, Fh = shape
    w = _weights(K, Fh, activation, seed=0)
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(M, K, device="cuda", generator=g).bfloat16().requires_grad_()
    dy = (torch.randn(M, K, device="cuda", generator=g) * 1e-3).bfloat16()
    recipe = fp8ops.DelayedScaling()
    state = fp8ops.LayerNormMLPState.init(recipe, device="cuda")

    def step(st):  # type: ignore[no-untyped-def]
        probes = fp8ops.make_probes(st)
        y, st2 = fp8ops.fused_ln_mlp(x, w["ln_w"], w["ln_b"], w["w1"], w["b1"], w["w2"], w["b2"], st,
                                     recipe=recipe, activation=activation, eps=EPS, recompute=recompute,
                                     grad_probe=probes)
        return y, st2, probes

    y, st2, probes = step(state)  # calibration step
    y.backward(dy)
    state = fp8ops.update(st2, recipe=recipe, grad_amax=probes.grad)
    for t in [x, *w.values()]:
        t.grad = None
    del y, st2, probes
    gc.collect()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        return t

    torch.cuda.reset_peak_memory_stats()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y, _st2, _probes = step(state)
    torch.cuda.synchronize()
    fwd_peak = torch.cuda.max_memory_allocated() - base
    after_fwd = torch.cuda.memory_allocated() - base
    torch.cuda.reset_peak_memory_stats()
    y.backward(dy)
    torch.cuda.synchronize()
    bwd_peak = torch.cuda.max_memory_allocated() - base
    inputs = {t.untyped_storage().data_ptr() for t in [x, *w.values()]}
    saved_new = sum(n for ptr, n in seen.items() if ptr not in inputs)  # saved beyond the inputs and weights
    return {"saved_MiB": saved_new / MiB, "after_fwd_MiB": after_fwd / MiB, "fwd_peak_MiB": fwd_peak / MiB,
            "bwd_peak_MiB": bwd_peak / MiB}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Print the memory table of every (activation, recompute) pair; write mlp_memory.json."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    shape = QUICK_SHAPE if args.quick else SHAPE
    activations = args.activations or ["gelu_tanh", "swiglu"]
    env = common.environment()
    print(common.describe_environment(env))
    print(f"fused_ln_mlp, delayed scaling, bf16, M K F = {shape}; MiB relative to before the step")
    print(f"{'activation':<10} {'recompute':<11} {'saved':>8} {'after fwd':>10} {'fwd peak':>9} {'bwd peak':>9}")
    rows: list[dict[str, Any]] = []
    for act in activations:
        for rc in (None, "activation"):
            r = probe(act, rc, shape)
            print(f"{act:<10} {rc!s:<11} {r['saved_MiB']:8.0f} {r['after_fwd_MiB']:10.0f} "
                  f"{r['fwd_peak_MiB']:9.0f} {r['bwd_peak_MiB']:9.0f}", flush=True)
            rows.append({"activation": act, "recompute": rc, **r})
            gc.collect()
            torch.cuda.empty_cache()
    record = {"suite": "mlp", "mode": "memory", "environment": env,
              "shape": {"tokens": shape[0], "hidden": shape[1], "ffn": shape[2]}, "rows": rows,
              "failed_checks": []}
    common.write_json(out / "mlp_memory.json", record)
    return record
