"""The full training step that ``python -m fp8ops.bench linear`` times (fp8ops.bench.linear.step_case),
run on the CPU: the fp8ops FP8 step calibrates its state and trains the weight in the direction of
the bf16 step, within FP8's error, through fp8ops.graph_step as well (eager on the CPU). Also the host
profile's launch-free floor of an FP8 linear layer (scripts/host_profile.py) runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fp8ops
from fp8ops.bench.linear import FUSED_OPT, STEP_IMPLS, step_case


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


@pytest.mark.parametrize("graph", [False, True])
def test_fused_optimizer_step_trains_like_the_fp8_step(graph: bool) -> None:
    # fp8ops.adamw_quantize_ writes the next forward's weight copy with the scale that forward would
    # cast with, and records the weight's amax for the same update: the same training as
    # torch's AdamW followed by the forward's own cast, up to AdamW's float32 bias corrections
    d_ref, st_ref, y_ref = _train("fp8ops delayed")
    d, st, y = _train(FUSED_OPT, graph=graph)
    torch.testing.assert_close(d, d_ref, rtol=1e-3, atol=1e-6)  # steps of about 3e-4
    assert y == pytest.approx(y_ref, rel=1e-5, abs=1e-6)
    for role in ("input", "weight", "grad_output"):
        torch.testing.assert_close(getattr(st, role).amax_history, getattr(st_ref, role).amax_history, rtol=1e-5,
                                   atol=0.0)
        assert torch.equal(getattr(st, role).scale, getattr(st_ref, role).scale) or role == "weight"


def test_step_case_rejects_an_unknown_implementation() -> None:
    assert "fp8ops delayed" in STEP_IMPLS
    with pytest.raises(ValueError, match="step_case: impl must be one of"):
        step_case("fp8ops current", "eager", 8, 8, 8, device="cpu")


def test_measure_variant_times_a_step_and_reports_failures(monkeypatch) -> None:
    """fp8ops.bench.step.measure_variant (shared by bench step, bench linear) on the CPU, with the
    CUDA calls stubbed: a record for a step run as built; for a graph mode that never replays (on
    the CPU graph_step runs eagerly) or a build that raises, None and a message naming the variant."""
    from fp8ops.bench import step as bench_step

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda *a, **k: None)
    monkeypatch.setattr(bench_step, "device_ops", lambda fn, calls, table=None: (fn(), (7.0, 21.0))[1])
    failed: list[str] = []
    progress = bench_step.Progress(3, prefix="t")

    def build():
        return step_case("fp8ops delayed", "eager", 32, 16, 24, device="cpu", dtype=torch.float32)

    r = bench_step.measure_variant(build, "eager", 2, "eager case", failed, progress)
    assert r is not None and r["ms"] > 0 and r["kernels"] == 7.0 and r["device_ms"] == 0.021 and failed == []
    assert bench_step.measure_variant(build, "graph", 2, "graph case", failed, progress) is None
    assert len(failed) == 1 and failed[0].startswith("graph case: RuntimeError: never captured")

    def broken():
        raise ValueError("no such variant")

    assert bench_step.measure_variant(broken, "eager", 2, "broken case", failed, progress) is None
    assert failed[1] == "broken case: ValueError: no such variant"


def test_host_profile_floor_runs_with_direct_stub_kernels() -> None:
    # scripts/host_profile.py's launch-free floor: the stubs replace this process's CPU kernels, so it
    # runs in a process of its own; both cases time, and the library ops were called straight
    root = Path(__file__).resolve().parents[1]
    code = ("import sys; sys.argv[0] = 'host_profile'; sys.path.insert(0, 'scripts'); import host_profile as h; "
            "from fp8ops.kernels._library import OPS; "
            "h.main(['--stub-kernels', '--direct', '--calls', '2', '--repeats', '1', '--only', 'floor', "
            "'fp8_linear delayed']); print('direct', OPS.cast_transpose.direct_calls, OPS.scaled_mm.direct_calls)")
    run = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    lines = run.stdout.splitlines()
    assert any(line.startswith("fp8_linear floor: 3 casts + 3 GEMMs") and line.endswith("us/call") for line in lines)
    assert any(line.startswith("fp8_linear delayed") and line.endswith("us/call") for line in lines)
    casts, gemms = (int(v) for v in lines[-1].split()[1:])
    assert casts >= 3 * 12 and gemms >= 3 * 12, lines[-1]  # three of each per call, 12 calls at least
    bad = subprocess.run([sys.executable, "scripts/host_profile.py", "--direct"], cwd=root, capture_output=True,
                         text=True, timeout=300)
    assert bad.returncode == 2 and "--direct: only with --stub-kernels" in bad.stderr
