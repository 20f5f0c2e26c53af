"""graph_step on a CPU (every call eager: the wrapper is the step itself) and its argument checks.
The captured path is tested on the GPU (tests/test_graph_step_gpu.py)."""

from __future__ import annotations

import pytest
import torch

import fp8ops


def test_cpu_calls_run_the_step_eagerly() -> None:
    calls = []

    def step(c: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append(1)
        return c + x.sum(), x.mean()

    fn = fp8ops.graph_step(step)
    c = torch.zeros(())
    for i in range(4):
        c, m = fn(c, torch.full((3,), float(i)))
        assert float(m) == i
    assert float(c) == 3 * (0 + 1 + 2 + 3)
    assert len(calls) == 4 and fn.stats == {"eager": 4, "captures": 0, "replays": 0}


def test_bad_arguments_are_named() -> None:
    with pytest.raises(TypeError, match="graph_step: fn must be callable"):
        fp8ops.graph_step(3)  # type: ignore[arg-type]
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="graph_step: warmup must be an int >= 1"):
            fp8ops.graph_step(lambda c: (c, None), warmup=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("result", [torch.zeros(()), (torch.zeros(()),), (1, 2, 3)])
def test_a_step_must_return_a_pair(result: object) -> None:
    fn = fp8ops.graph_step(lambda c: result)
    with pytest.raises(TypeError, match=r"graph_step: the step must return a pair \(carry, outputs\)"):
        fn(torch.zeros(()))
