"""The gpt suite's fp8ops builds (``fp8ops.bench.step._variant``) on the CPU at a tiny size: the
build with the fused optimizer (``fp8ops.adamw_quantize_`` on the layers' GEMM weights, their FP8
copies handed to the next forward) trains as the build with torch's AdamW, and the copy each step
leaves is the FP8 cast of the weight as it then is, under the scale of the state it goes with."""

from __future__ import annotations

import pytest
import torch
from torch.utils import _pytree as pytree

import fp8ops
from fp8ops._transformer_checks import WEIGHT_ROLES
from fp8ops.bench import step as bench_step
from fp8ops.testing.composition import LibraryAdamW

SIZE = {"layers": 2, "hidden": 32, "heads": 4, "seq": 8, "batch": 2, "vocab": 64}


def _run(impl, steps):
    torch.manual_seed(0)
    step, carry, batch = bench_step._variant("gpt2", impl, "eager", SIZE, device="cpu")
    losses = []
    for _ in range(steps):
        carry, loss = step(carry, *batch)
        losses.append(float(loss))
    return step, carry, losses


def test_fused_adamw_build_trains_as_the_torch_adamw_build():
    _, _, plain = _run("fp8ops FP8", 5)
    _, _, fused = _run(bench_step.FUSED_ADAMW, 5)
    assert plain[0] == fused[0]  # the same model and data: the first loss is before any update
    assert plain[-1] < plain[0] - 1e-3  # lr 1e-4 over 5 steps: the loss moves ...
    # ... and the fused build follows it (both AdamW in float32 math, bf16 weights)
    torch.testing.assert_close(torch.tensor(fused), torch.tensor(plain), rtol=2e-4, atol=0)


def test_fused_adamw_build_hands_on_the_cast_of_the_current_weight(monkeypatch):
    # a large step, so that the weights' amaxes (and with them the scales) move from step to step
    monkeypatch.setattr(bench_step, "LR", 0.05)
    step, carry, _ = _run(bench_step.FUSED_ADAMW, 3)
    recipe = fp8ops.DelayedScaling()
    caches = step.caches(carry)
    checked = 0
    for i, per_layer in enumerate(caches):
        assert sorted(per_layer) == ["fc1.weight", "fc2.weight", "proj.weight", "qkv.weight"]
        for key, cache in per_layer.items():
            skey, role = WEIGHT_ROLES[key]
            rs = getattr(carry[i][skey], role)
            assert rs.calibrated
            want, _ = fp8ops.quantize_weight(cache.weight, rs, recipe=recipe)
            assert torch.equal(cache.value.data.view(torch.uint8), want.value.data.view(torch.uint8)), key
            assert torch.equal(cache.value.data_t.view(torch.uint8), want.value.data_t.view(torch.uint8)), key
            assert torch.equal(cache.value.inv_scale, want.value.inv_scale), key
            checked += 1
    assert checked == 4 * SIZE["layers"]


def test_fused_adamw_build_steps_each_parameter_once():
    """Each parameter is stepped by exactly one optimizer: a weight stepped twice (or not at all)
    would still train, only differently."""
    step, _, _ = bench_step._variant("gpt2", bench_step.FUSED_ADAMW, "eager", SIZE, device="cpu")
    params, opt, fused = step.stepped
    by_torch = [id(p) for g in opt.param_groups for p in g["params"]]
    by_fused = [id(w) for w in fused]
    assert len(by_fused) == 4 * SIZE["layers"]
    assert all(w.dim() == 2 for w in fused)
    assert sorted(by_torch + by_fused) == sorted(id(p) for p in pytree.tree_leaves(params))


def test_ratios_report_the_fused_build_beside_the_plain_one():
    from fp8ops.bench.gpt import _ratios

    rows = [{"impl": "torch", "mode": "compile", "ms": 80.0}, {"impl": "torch", "mode": "compile + graph", "ms": 85.0},
            {"impl": "fp8ops FP8", "mode": "compile", "ms": 60.0},
            {"impl": bench_step.FUSED_ADAMW, "mode": "compile", "ms": 58.0},
            {"impl": bench_step.FUSED_ADAMW, "mode": "compile + graph", "ms": 56.0}]
    r = _ratios(rows, 4096)
    assert r["best"][bench_step.FUSED_ADAMW] == {"mode": "compile + graph", "ms": 56.0}
    assert r["fp8_over_bf16"] == 60.0 / 80.0 and r["fused_adamw_over_bf16"] == 56.0 / 80.0
    assert r["target_vs_bf16"] == 0.70 and "fused_adamw_over_torchao" not in r


def test_the_fused_build_runs_only_when_named():
    import argparse

    from fp8ops.bench import gpt

    parser = argparse.ArgumentParser()
    gpt.add_arguments(parser)
    default = {i for i, _ in gpt._builds(parser.parse_args(["--no-torchao"]))}
    assert default == {"torch", "fp8ops FP8", "fp8ops FP8, FP8 head", bench_step.FUSED_LOSS}
    assert not default & {bench_step.FUSED_ADAMW, bench_step.FUSED_ALL, bench_step.TORCH_LIBRARY_ADAMW}
    named = gpt._builds(parser.parse_args(["--no-eager", "--impls", "torch", bench_step.FUSED_ADAMW]))
    assert named == [("torch", "compile"), (bench_step.FUSED_ADAMW, "compile")]


def test_gpt_loss_names_a_wrong_number_of_weight_caches():
    from fp8ops.testing import composition

    gpt, params = composition.make_model("cpu", layers=2, hidden=32, heads=4, seq=8, batch=2, vocab=64)
    with pytest.raises(ValueError, match=r"gpt_loss: weight_caches must be a list .* per layer \(2\), got 1 entries"):
        composition.gpt_loss(params, None, None, gpt.tokens[0], gpt.targets[0], model=gpt, recipe=None,
                             dtype=torch.float32, weight_caches=[None])


def test_fused_adamw_build_compiles_the_loss_once_and_trains_as_eager(compiled_graphs):
    """Compiled (``fullgraph=True``), the build traces its weight caches as inputs: one graph for
    the calibrated states (the first step runs eagerly), and the eager build's losses."""
    compiled = compiled_graphs
    _, _, eager = _run(bench_step.FUSED_ADAMW, 4)
    torch._dynamo.reset()
    torch.manual_seed(0)
    step, carry, batch = bench_step._variant("gpt2", bench_step.FUSED_ADAMW, "compile", SIZE, device="cpu")
    losses = []
    for _ in range(4):
        carry, loss = step(carry, *batch)
        losses.append(float(loss))
    assert len(compiled) == 1
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(eager), rtol=1e-5, atol=0)


def test_fused_adamw_build_casts_no_weight_in_its_step():
    """The forward takes the optimizer's copies: a step of the build casts only activations and
    gradients, four casts per layer fewer than the plain build's."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Casts(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            # the library's casts (the optimizer's own op, adamw_cast_transpose, is not one)
            if func.namespace == "fp8ops" and func.name().split("::")[-1].split(".")[0] in ("cast", "cast_transpose"):
                Casts.n += 1
            return func(*args, **(kwargs or {}))

    counts = {}
    for impl in ("fp8ops FP8", bench_step.FUSED_ADAMW):
        step, carry, _ = _run(impl, 2)  # calibrated states from here on
        _, _, batch = bench_step._variant("gpt2", impl, "eager", SIZE, device="cpu")
        Casts.n = 0
        with Casts():
            step(carry, *batch)
        counts[impl] = Casts.n
    assert counts["fp8ops FP8"] - counts[bench_step.FUSED_ADAMW] == 4 * SIZE["layers"], counts


def test_fused_loss_build_trains_as_the_plain_build(monkeypatch):
    """The fused-loss build takes the head and the loss through linear_cross_entropy; the plain
    build, through a matmul and F.cross_entropy: the same losses to float32 reassociation, and only
    the former calls the fused op."""
    import importlib

    lce = importlib.import_module("fp8ops.linear_cross_entropy")  # the module (the package's name is the op)
    calls = []
    real = lce._LinearCrossEntropy.forward
    monkeypatch.setattr(lce._LinearCrossEntropy, "forward", staticmethod(lambda *a: calls.append(1) or real(*a)))
    _, _, plain = _run("fp8ops FP8", 3)
    assert not calls
    _, _, fused = _run(bench_step.FUSED_LOSS, 3)
    assert len(calls) == 3
    torch.testing.assert_close(torch.tensor(fused), torch.tensor(plain), rtol=1e-3, atol=0)


def test_ratios_report_the_fused_loss_build_beside():
    from fp8ops.bench.gpt import _ratios

    rows = [{"impl": "torch", "mode": "compile", "ms": 80.0}, {"impl": "fp8ops FP8", "mode": "compile", "ms": 60.0},
            {"impl": bench_step.FUSED_LOSS, "mode": "compile + graph", "ms": 64.0}]
    r = _ratios(rows, 2048)
    assert r["fp8_over_bf16"] == 60.0 / 80.0 and r["fused_loss_over_bf16"] == 64.0 / 80.0


def test_library_loss_and_adamw_build_trains_as_the_fused_loss_build():
    """``fp8ops FP8, fused loss + AdamW``: the fused-loss model with every parameter stepped by the
    library (adamw_quantize_ on the GEMM weights, adamw_ on the rest): the same losses."""
    _, _, plain = _run(bench_step.FUSED_LOSS, 4)
    step, _, both = _run(bench_step.FUSED_ALL, 4)
    assert plain[0] == both[0] and plain[-1] < plain[0] - 1e-3
    torch.testing.assert_close(torch.tensor(both), torch.tensor(plain), rtol=2e-4, atol=0)
    params, opt, fused = step.stepped
    assert isinstance(opt, LibraryAdamW)
    assert sorted([id(p) for p in opt.params] + [id(w) for w in fused]) == sorted(id(p) for p in pytree.tree_leaves(params))


def test_library_adamw_steps_as_torch_adamw():
    g = torch.Generator().manual_seed(0)
    ps = [torch.randn(s, generator=g).requires_grad_() for s in ((4, 3), (5,), (2,))]
    refs = [p.detach().clone().requires_grad_() for p in ps]
    ours = bench_step._library_adamw(ps, device="cpu")
    theirs = bench_step._optimizer(refs, device="cpu")
    for _ in range(3):
        grads = [torch.randn(p.shape, generator=g) for p in ps]
        ours.zero_grad(set_to_none=True)
        theirs.zero_grad(set_to_none=True)
        for p, r, gr in zip(ps, refs, grads):
            p.grad, r.grad = gr.clone(), gr.clone()
        ours.step()
        theirs.step()
        for p, r in zip(ps, refs):
            torch.testing.assert_close(p.detach(), r.detach(), rtol=1e-6, atol=1e-7)
    ps[1].grad = None  # one step count for all: a parameter without a gradient is refused
    with pytest.raises(ValueError, match=r"LibraryAdamW.step: parameters \[1\] have no gradient"):
        ours.step()
