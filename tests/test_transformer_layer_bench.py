"""The layer suite's fp8ops step (``fp8ops.bench.layer._fp8ops_case``) on the CPU at a tiny size: a
training step is fresh probes, forward, backward and ``fp8ops.update``, and the next step runs
with the updated state; an eval step leaves the state alone."""

from __future__ import annotations

import pytest
import torch
from torch.utils import _pytree as pytree

import fp8ops
from fp8ops.bench.layer import _fp8ops_case
from fp8ops.reference.transformer_layer import BasicTransformerLayer

H, FFN, HEADS, S, B = 32, 64, 4, 8, 2


def _setup():
    config = fp8ops.TransformerConfig(hidden_size=H, ffn_hidden_size=FFN, num_attention_heads=HEADS,
                                      hidden_dropout=0.0, attention_dropout=0.0)
    torch.manual_seed(0)
    seed_state = {k: v.clone() for k, v in BasicTransformerLayer(H, FFN, HEADS).state_dict().items()}
    g = torch.Generator().manual_seed(1)
    xs = [(torch.randn(S, B, H, generator=g).requires_grad_(), torch.randn(S, B, H, generator=g)) for _ in range(3)]
    return config, seed_state, xs


def _flat(state):
    return [t.clone() for t in pytree.tree_leaves(state)]


@pytest.mark.parametrize("recipe", [fp8ops.DelayedScaling(amax_history_len=4), fp8ops.CurrentScaling()],
                         ids=["delayed", "current"])
def test_layer_bench_step_updates_the_state_it_carries(recipe):
    config, seed_state, xs = _setup()
    x0, dy0 = xs[0]
    step, eval_step, params = _fp8ops_case(seed_state, config, recipe, x0.float(), dy0.float(), device="cpu")
    # the same layer by hand, from the state the bench's step holds: forward, backward, update
    ref_params = {k: v.requires_grad_() for k, v in fp8ops.params_from_basic_layer(seed_state, config).items()}
    state = step.state()
    before = _flat(state)
    eval_step(*xs[1])
    assert all(torch.equal(a, b) for a, b in zip(before, _flat(step.state()))), "an eval step changed the state"
    for x, dy in xs[1:]:
        st = step.state()
        probes = fp8ops.make_probes(st) if recipe.mode == "delayed" else None
        y_ref, new = fp8ops.transformer_layer(ref_params, x.detach(), st, config=config, recipe=recipe, probes=probes)
        y_ref.backward(dy)
        want = fp8ops.update(new, recipe=recipe, grad_amax=probes)
        y = step(x, dy)
        assert torch.equal(y, y_ref.detach())
        got = step.state()
        assert got is not st
        for a, b in zip(pytree.tree_leaves(want), pytree.tree_leaves(got)):
            assert torch.equal(a, b)
    if recipe.mode == "delayed":  # the histories rolled: the state is not the calibrated one any more
        assert any(not torch.equal(a, b) for a, b in zip(before, _flat(step.state())))


def test_layer_bench_graph_rows_step_as_the_eager_rows():
    """The graph rows replay ``step.carry_step`` through ``fp8ops.graph_step`` (eager on a CPU): it
    takes the state and returns the next one, gradients cleared first, and steps as the eager row's
    step does, state for state and gradient for gradient."""
    recipe = fp8ops.DelayedScaling(amax_history_len=4)
    config, seed_state, xs = _setup()
    x0, dy0 = xs[0]
    step, _, params = _fp8ops_case(seed_state, config, recipe, x0.float(), dy0.float(), device="cpu")
    carry_fn, carry = step.carry_step
    assert carry is step.state()
    graphed = fp8ops.graph_step(carry_fn, args_by_reference=(1,))
    x, dy = xs[1]
    for _ in range(3):
        for p in params:
            p.grad = None
        x.grad = None
        step(x, dy)
        want_state, want_grads = _flat(step.state()), [p.grad.clone() for p in params]
        carry, out = graphed(carry, x, dy)
        assert out == ()
        got_state = _flat(carry)
        assert len(got_state) == len(want_state)
        assert all(torch.equal(a, b) for a, b in zip(want_state, got_state))
        assert all(torch.equal(p.grad, g) for p, g in zip(params, want_grads))  # cleared, not summed
    assert graphed.stats["eager"] == 3


@pytest.mark.parametrize("eager_first, graphs", [(True, 1), (False, 2)], ids=["eager_first", "compiled_first"])
def test_bench_step_compiles_the_loss_once_after_an_eager_first_step(compiled_graphs, eager_first, graphs):
    """The step suites' fp8ops compile build (``fp8ops.bench.step._variant``) runs its first step,
    over uncalibrated states, eagerly: the loss is then compiled once, for calibrated states, instead
    of once before and once after the flip."""
    from fp8ops.bench import step as bench_step

    compiled = compiled_graphs
    torch._dynamo.reset()
    size = {"hidden": H, "ffn": FFN, "heads": HEADS, "seq": S, "batch": B}
    step, carry, batch = bench_step._variant("seed", "fp8ops FP8", "compile", size, eager_first=eager_first,
                                             device="cpu")
    for _ in range(3):
        carry, loss = step(carry, *batch)
        assert torch.isfinite(loss)
    assert carry["qkv"].input.calibrated and carry["proj"].grad_output.calibrated
    assert len(compiled) == graphs


def test_layer_bench_ratios_take_each_implementations_fastest_mode():
    """The suite's ratios (hand-made rows): as launched, back to back, and fastest mode of each,
    where fp8ops delayed's fastest mode is the best of its eager and compiled rows and their
    graphs, and a row without a graph counts as launched."""
    from fp8ops.bench.layer import _ratios, _targets

    def row(impl, step, b2b, graph=None, graph_b2b=None, peak=100):
        return {"impl": impl, "step_us": step, "b2b_us": b2b, "graph_us": graph, "graph_b2b_us": graph_b2b,
                "peak_bytes": peak}

    rows = [row("basic fp16", 2000.0, 2100.0, 1900.0, 2000.0),
            row("torchao tensorwise + compile", 1500.0, 1400.0, 1300.0, 1450.0, peak=200),
            row("fp8ops delayed", 1100.0, 1000.0, 1050.0, 990.0),
            row("fp8ops delayed + compile", 1200.0, 1010.0, 1000.0, 995.0, peak=150),
            row("fp8ops current", 1250.0, 1150.0)]
    _ratios(rows, None)
    d = rows[2]
    assert d["speedup_vs_torchao"] == 1500 / 1100 and d["b2b_speedup_vs_torchao"] == 1400 / 1000
    assert d["best_speedup_vs_torchao"] == 1300 / 1000  # the compiled row's graph
    assert d["best_b2b_speedup_vs_basic_fp16"] == 2000 / 990  # the eager row's graph
    assert rows[4]["best_speedup_vs_torchao"] == 1300 / 1250  # no graph: as launched
    assert d["memory_vs_torchao"] == 0.5
    lines = {t["target"]: t for t in _targets(rows)}
    best = [t for k, t in lines.items() if "fastest mode" in k and "basic fp16" in k and "idle" in k][0]
    assert best["value"] == 1900 / 1000 and best["met"] is False
