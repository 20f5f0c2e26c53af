"""The full training step that ``python -m fp8ops.bench linear`` times (fp8ops.bench.linear.step_case),
run on the CPU: the fp8ops FP8 step calibrates its state and trains the weight in the direction of
the bf16 step, within FP8's error, through fp8ops.graph_step as well (eager on the CPU)."""

from __future__ import annotations

import pytest
import torch

import fp8ops
from fp8ops.bench.linear import STEP_IMPLS, step_case


def _train(impl: str, steps: int = 3, graph: bool = False):
    step, carry, batch = step_case(impl, "eager", 32, 16, 24, device="cpu", dtype=torch.float32)
    w0 = step.weight.detach().clone()
    fn = fp8ops.graph_step(step) if graph else step
    outs = []
    for _ in range(steps):
        carry, y00 = fn(carry, *batch)
        outs.append(float(y00))
    return step.weight.detach() - w0, carry, outs


@pytest.mark.parametrize("graph", [False, True])
def test_fp8_step_trains_like_the_bf16_step(graph: bool) -> None:
    d_ref, none, y_ref = _train("bf16 F.linear")
    d, state, y = _train("fp8ops delayed", graph=graph)
    assert none is None
    assert isinstance(state, fp8ops.LinearState) and bool(state.input.calibrated) and bool(state.weight.calibrated)
    assert bool(state.grad_output.calibrated) and float(state.grad_output.scale) != 1.0
    assert d_ref.abs().max() > 0 and d.abs().max() > 0
    cos = float(torch.nn.functional.cosine_similarity(d.flatten(), d_ref.flatten(), dim=0))
    assert cos > 0.95, cos
    # y[0, 0] of each step: the FP8 forward within a few percent of the float32 one
    assert y == pytest.approx(y_ref, rel=0.1, abs=0.05)


def test_step_case_rejects_an_unknown_implementation() -> None:
    assert "fp8ops delayed" in STEP_IMPLS
    with pytest.raises(ValueError, match="step_case: impl must be one of"):
        step_case("fp8ops current", "eager", 8, 8, 8, device="cpu")
