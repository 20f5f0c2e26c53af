"""The demo trains the byte-level GPT end to end (tiny size) in BF16 and FP8, and its step-0 loss
matches an independent FP32 forward of the same model built from the reference layer."""

import json
import math

import torch
import torch.nn.functional as F
from torch.utils import _pytree as pytree

import fp8ops
from fp8ops import demo
from fp8ops.reference.transformer_layer import transformer_layer as reference_layer

TINY = ["--device", "cpu", "--steps", "4", "--layers", "1", "--hidden", "32", "--heads", "2", "--seq", "16",
        "--batch", "4", "--eval-every", "2", "--eval-batches", "1", "--max-data-mb", "1"]


def _reference_loss(params, tokens, targets, config):
    """The GPT's loss in float32 from the reference layer and F.layer_norm (no fp8ops ops)."""
    S = tokens.shape[1]
    x = (F.embedding(tokens, params["tok"]) + params["pos"][:S]).transpose(0, 1)  # (S, B, H)
    for lp in params["layers"]:
        x, _ = reference_layer(lp, x, config=config, training=False)
    x = F.layer_norm(x, (x.shape[-1],), params["lnf.weight"], params["lnf.bias"], config.layernorm_epsilon)
    logits = x.transpose(0, 1) @ params["tok"].t()
    return F.cross_entropy(logits.reshape(-1, demo.VOCAB), targets.reshape(-1))


def test_demo_main_tiny(tmp_path, capsys):
    assert demo.main([*TINY, "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "final train loss" in out and "tokens/s" in out and "peak memory" in out
    assert "float32 (CPU" in out and "FP8 GEMMs" in out  # the precision that ran is stated
    record = json.loads((tmp_path / "demo.json").read_text())
    runs = record["runs"]
    assert set(runs) == {"BF16", "FP8"}
    for r in runs.values():
        assert len(r["train_loss"]) == 4 and r["val_steps"] == [0, 2, 4]
        assert all(math.isfinite(v) for v in r["train_loss"] + r["val_loss"])
        assert r["tokens_per_s"] > 0 and r["peak_memory_bytes"] > 0
    # Shared initialization and batches: the runs start from the same loss (FP8 error only).
    b, f = runs["BF16"], runs["FP8"]
    assert abs(f["train_loss"][0] - b["train_loss"][0]) < 0.02 * b["train_loss"][0]
    assert abs(f["val_loss"][0] - b["val_loss"][0]) < 0.02 * b["val_loss"][0]
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "no plot" in out
    else:
        png = tmp_path / "demo_loss.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_compile_defaults_to_the_device(monkeypatch, tmp_path):
    """The loss is compiled by default on a GPU only (both runs in their fastest mode there);
    --compile and --no-compile decide on any device."""
    asked = []

    def fake_train(**kw):
        asked.append(kw["compile"])
        raise SystemExit(0)  # stop after the first run's settings are known

    monkeypatch.setattr(demo, "train", fake_train)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "a GPU")
    for extra in ([], ["--compile"], ["--no-compile"]):
        try:
            demo.main([*TINY, "--out", str(tmp_path), *extra])
        except SystemExit:
            pass
    assert asked == [False, True, False]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for extra in ([], ["--no-compile"]):
        try:
            demo.main([*TINY[2:], "--device", "cuda", "--out", str(tmp_path), *extra])
        except SystemExit:
            pass
    assert asked == [False, True, False, True, False]


def test_step0_loss_matches_fp32_reference():
    corpus = demo.load_corpus(1_000_000)
    config = demo.make_config(32, 2)
    params = demo.init_gpt(config, layers=2, seq=16, seed=3, device=torch.device("cpu"))
    (x, y), = demo.train_batches(corpus.train, batch=4, seq=16, steps=1, seed=3)
    with torch.no_grad():
        ref = _reference_loss(params, x, y, config).item()
        hp, _ = demo.gpt_loss(params, None, None, x, y, config=config, recipe=None, dtype=torch.float32)
    assert abs(hp.item() - ref) < 1e-4 * ref, (hp.item(), ref)
    # FP8 (first step: current-scaling calibration) within FP8 error of the FP32 reference.
    recipe = fp8ops.DelayedScaling()
    from fp8ops.transformer_layer import init_transformer_state

    states = [init_transformer_state(config, recipe) for _ in range(2)]
    probes = fp8ops.make_probes(states)
    loss, new_states = demo.gpt_loss(params, states, probes, x, y, config=config, recipe=recipe,
                                     dtype=torch.float32)
    assert abs(loss.item() - ref) < 2e-2 * ref, (loss.item(), ref)
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in pytree.tree_leaves(params))
    assert all(float(pr["proj"].grad) > 0 and float(pr["mlp"].grad.min()) > 0 for pr in probes)
    assert all(float(s["qkv"].input.pending_amax) > 0 for s in new_states)


def test_fp8_run_updates_scales_and_learns():
    corpus = demo.load_corpus(1_000_000)
    r = demo.train(fp8=True, corpus=corpus, device=torch.device("cpu"), steps=12, layers=1, hidden=32, heads=2,
                   seq=16, batch=8, lr=1e-2, eval_every=12, eval_batches=1, seed=0)
    states = r.states[0]
    used = [getattr(s, role) for s in states.values() for role in type(s).ROLES
            if role != "fc1_output"]  # fc1_output is observed only with recompute="activation"
    assert all(st.calibrated for st in used)
    assert all(float(st.scale) != 1.0 for st in used)
    assert r.val_loss[-1] < r.val_loss[0] - 0.3  # it learns (from about ln 256 = 5.55)
