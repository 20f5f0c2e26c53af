"""How many compiled graphs a step of a compiled ``fp8ops.nn`` model runs, with and without
``fp8ops.nn.prepare_probes``.

The model of ``tests/test_nn_compile.py`` (Linear -> LayerNormLinear -> LayerNormMLP ->
TransformerLayer, delayed scaling, float32 on the CPU) under ``torch.compile`` with the default
``fullgraph=False``, 2 forwards (micro-batches) per step and ``update_scaling`` after each step,
through a backend that counts the compiled graphs it runs, forward and backward (``aot_eager``
inside). Without ``prepare_probes`` the first step's second forward finds no probe ready and breaks
the graph, and Dynamo keeps that break for later calls; ``prepare_probes(model, forwards=2)`` before
the first step avoids it.

    python scripts/nn_compile_graphs.py [--steps 5]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import warnings

import torch

import fp8ops
import fp8ops.nn

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def graphs_per_step(prepare: bool, steps: int) -> list[int]:
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    spec = importlib.util.spec_from_file_location("nn_compile", os.path.join(REPO, "tests", "test_nn_compile.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    runs = [0]

    def count(gm, _inputs):
        def run(*args):
            runs[0] += 1
            return gm(*args)
        return make_boxed_func(run)

    torch._dynamo.reset()
    model = mod._model(fp8ops.DelayedScaling(), "cpu", torch.float32)
    if prepare:
        fp8ops.nn.prepare_probes(model, forwards=2)
    run = torch.compile(model, backend=aot_autograd(fw_compiler=count, bw_compiler=count))
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        runs[0] = 0
        for _ in range(2):
            run(torch.randn(mod.S, mod.B, mod.H, generator=g)).square().sum().backward()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fp8ops.nn.update_scaling(model)
        out.append(runs[0])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=5)
    a = p.parse_args()
    print("torch", torch.__version__)
    for prepare in (False, True):
        print(f"prepare_probes={prepare!s:5}  compiled graphs run per step (forward and backward): {graphs_per_step(prepare, a.steps)}")


if __name__ == "__main__":
    main()
