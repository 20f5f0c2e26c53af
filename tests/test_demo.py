"""The demo runs end to end (short) and FP8 fake quantization tracks float32 training."""

import torch

import fp8ops.demo as demo


def test_demo_main_runs(capsys):
    assert demo.main(["--steps", "6", "--micro-batches", "2", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "Round-trip error" in out and "final loss" in out


def test_fp8_training_tracks_float32():
    base, _ = demo.train(torch.device("cpu"), fp8=False, steps=60, micro_batches=1)
    fp8, states = demo.train(torch.device("cpu"), fp8=True, steps=60, micro_batches=1)
    assert fp8[-1] < 0.25 * fp8[0]  # it learns
    assert abs(sum(fp8[-5:]) / sum(base[-5:]) - 1.0) < 0.1
    assert all(s.input.calibrated and s.grad_output.calibrated for s in states.values())
