"""``torch.compile`` of a model built from ``fp8ops.nn`` modules against the same model run eagerly.

A model of every module kind (Linear -> LayerNormLinear -> LayerNormMLP -> TransformerLayer) trains
4 SGD steps of 2 micro-batches each, with ``fp8ops.nn.update_scaling`` after each step, eagerly
and under ``torch.compile(model)`` (``fullgraph=False`` with no preparation: a compiled forward
takes a probe made ahead, one per module at first, so the first step's second micro-batch breaks
the graph and makes its probes eagerly, and update_scaling then keeps two ready; and
``fullgraph=True`` after ``fp8ops.nn.prepare_probes(model, forwards=2)``, with ``aot_eager`` on CPU and
Inductor on the GPU), for ``recipe=None``, delayed and current scaling:

- ``aot_eager`` (CPU, float32): the losses, every parameter and every scaling state equal the eager
  run's bit for bit (the same library calls in the same order);
- ``inductor`` (CPU float32; GPU bfloat16): Inductor compiles the torch ops between the library
  calls (reshapes, residual adds, attention, the loss) and may round them differently, so the
  parameter updates must match the eager updates within a relative error (norm of the difference
  over the norm of the eager update: 1e-2 in float32, 5e-2 in bfloat16, where an FP8 rounding
  that flips moves a gradient element by up to 1/16), the scales within 5e-2 and the calibrated
  flags exactly.

With ``fullgraph=True`` and more forwards than probes made ready the compile raises (Dynamo's
``Unsupported``, naming ``prepare_probes``) instead of running something else.
"""

from __future__ import annotations

import pytest
import torch

import fp8ops
import fp8ops.nn

H, FFN, HEADS, S, B = 32, 64, 4, 8, 2
RECIPES = {"none": None, "delayed": fp8ops.DelayedScaling(), "current": fp8ops.CurrentScaling()}
CASES = [pytest.param("cpu", torch.float32, "aot_eager", id="cpu-fp32-aot_eager"),
         pytest.param("cpu", torch.float32, "inductor", id="cpu-fp32-inductor"),
         pytest.param("cuda", torch.bfloat16, "inductor", id="cuda-bf16-inductor",
                      marks=[pytest.mark.gpu,
                             pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")])]


def _model(recipe, device, dtype):
    torch.manual_seed(0)
    kw = {"recipe": recipe, "device": device, "dtype": dtype}
    return torch.nn.Sequential(
        fp8ops.nn.Linear(H, H, **kw),
        fp8ops.nn.LayerNormLinear(H, H, **kw),
        fp8ops.nn.LayerNormMLP(H, FFN, **kw),
        fp8ops.nn.TransformerLayer(H, FFN, HEADS, hidden_dropout=0.0, attention_dropout=0.0, **kw),
    )


def _train(recipe, device, dtype, backend, fullgraph=False):
    model = _model(recipe, device, dtype)
    if fullgraph:
        fp8ops.nn.prepare_probes(model, forwards=2)
    run = model if backend is None else torch.compile(model, backend=backend, fullgraph=fullgraph)
    init = {k: v.detach().clone() for k, v in model.state_dict().items()}
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator(device=device).manual_seed(1)
    losses = []
    for _ in range(4):
        for _ in range(2):  # micro-batches: one probe set per forward
            x = torch.randn(S, B, H, device=device, generator=g).to(dtype)
            gy = torch.randn(S, B, H, device=device, generator=g).to(dtype)
            loss = (run(x).float() * gy.float()).sum()
            loss.backward()
            losses.append(loss.detach())
        opt.step()
        opt.zero_grad()
        fp8ops.nn.update_scaling(model)
    states = {f"{i}.{k}": v for i, m in enumerate(model) if m.fp8_state is not None
              for k, v in fp8ops.state_dict(m.fp8_state).items()}
    updates = {k: v.detach().float() - init[k].float() for k, v in model.state_dict().items()}
    return torch.stack(losses), updates, states


# fullgraph=True on CPU with aot_eager (bitwise) and on the GPU with Inductor; the CPU Inductor run
# of it would only repeat those at a minute of compilation per recipe
FULLGRAPH_CASES = [pytest.param(*c.values, False, id=f"{c.id}-graph_breaks", marks=c.marks) for c in CASES] + [
    pytest.param(*c.values, True, id=f"{c.id}-fullgraph", marks=c.marks) for c in CASES if c.id != "cpu-fp32-inductor"]


# every recipe in every case, but the CPU Inductor run with graph breaks takes recipe=None and
# delayed scaling only (current scaling repeats the aot_eager run's calls at 15 s of compilation;
# the GPU Inductor runs take all three)
MATRIX = [pytest.param(r, *c.values, id=f"{c.id}-{r}", marks=c.marks) for c in FULLGRAPH_CASES for r in RECIPES
          if not (c.id == "cpu-fp32-inductor-graph_breaks" and r == "current")]


@pytest.mark.parametrize("recipe_name,device,dtype,backend,fullgraph", MATRIX)
def test_compiled_nn_model_trains_as_eager(device, dtype, backend, recipe_name, fullgraph):
    recipe = RECIPES[recipe_name]
    torch._dynamo.reset()
    losses, updates, states = _train(recipe, device, dtype, None)
    torch._dynamo.reset()
    c_losses, c_updates, c_states = _train(recipe, device, dtype, backend, fullgraph)
    assert updates.keys() == c_updates.keys() and states.keys() == c_states.keys()
    if backend == "aot_eager":
        assert torch.equal(c_losses, losses)
        for k in updates:
            assert torch.equal(c_updates[k], updates[k]), k
        for k in states:
            assert torch.equal(c_states[k], states[k]), k
    else:
        tol = 1e-2 if dtype == torch.float32 else 5e-2
        torch.testing.assert_close(c_losses, losses, rtol=tol, atol=tol * float(losses.abs().mean()))
        for k in updates:
            err = float((c_updates[k] - updates[k]).norm() / updates[k].norm().clamp_min(1e-12))
            assert err < tol, f"{k}: update differs from eager's by {err:.3g} (relative)"
        for k in states:
            if k.endswith(".scale"):
                torch.testing.assert_close(c_states[k], states[k], rtol=5e-2, atol=0, msg=k)
            elif k.endswith(".calibrated"):
                assert torch.equal(c_states[k], states[k]), k
    if recipe is not None and recipe.mode == "delayed":  # the compiled steps observed: forward amaxes and
        # the probes' gradients reached the histories of every module
        for i in range(4):
            for role in ("input", "grad_output"):
                hist = [v for k, v in c_states.items() if k.startswith(f"{i}.") and k.endswith(f"{role}.amax_history")]
                assert hist and all(h.abs().max() > 0 for h in hist), (i, role)


def test_fullgraph_compile_takes_probes_made_ahead():
    # one forward per step: the one probe each module keeps ready; a second forward in the step with
    # none left raises, naming the fix; after prepare_probes (or a step that broke the graph there)
    # the compiled forwards make no graph break
    m = fp8ops.nn.Linear(H, H, recipe=fp8ops.DelayedScaling())
    torch._dynamo.reset()
    step = torch.compile(m, backend="aot_eager", fullgraph=True)
    step(torch.randn(4, H)).sum().backward()
    fix = r"fp8ops.nn.Linear: .*has used the 1 made for this step; call fp8ops.nn.prepare_probes\(model, forwards=N\)"
    with pytest.raises(torch._dynamo.exc.Unsupported, match=fix):
        step(torch.randn(4, H))
    fp8ops.nn.update_scaling(m)
    assert len(m._ready) == 1  # the step's one forward taken, one made again
    fp8ops.nn.prepare_probes(m, forwards=3)
    for _ in range(2):
        torch._dynamo.utils.counters.clear()
        for _ in range(3):
            step(torch.randn(4, H)).sum().backward()
        assert not torch._dynamo.utils.counters["graph_break"] and len(m._probes) == 3 and not m._ready
        fp8ops.nn.update_scaling(m)
        assert len(m._ready) == 3
    eager = fp8ops.nn.Linear(H, H, recipe=fp8ops.DelayedScaling())
    eager(torch.randn(4, H)).sum().backward()
    fp8ops.nn.update_scaling(eager)
    assert len(eager._ready) == 1 and eager._ready_size == 1  # eager forwards make their own: none refilled
    with pytest.raises(ValueError, match=r"prepare_probes: forwards must be an int >= 1 .*got 0"):
        fp8ops.nn.prepare_probes(m, forwards=0)


def test_fullgraph_with_more_forwards_than_the_recompile_limit_allows():
    # each forward of a step compiles its own graph (how many probes are left), twice with the
    # calibrated flip: 5 forwards a step pass Dynamo's default limit of 8 and raise; a limit of at least
    # twice the forwards trains as eager
    def train(limit):
        m = fp8ops.nn.Linear(H, H, recipe=fp8ops.DelayedScaling())
        ref = fp8ops.nn.Linear(H, H, recipe=fp8ops.DelayedScaling())
        ref.load_state_dict(m.state_dict())
        fp8ops.nn.prepare_probes(m, forwards=5)
        torch._dynamo.reset()
        with torch._dynamo.config.patch(recompile_limit=limit):
            step = torch.compile(m, backend="aot_eager", fullgraph=True)
            g = torch.Generator().manual_seed(0)
            for _ in range(3):
                for _ in range(5):
                    x = torch.randn(4, H, generator=g)
                    step(x).square().sum().backward()
                    ref(x).square().sum().backward()
                fp8ops.nn.update_scaling(m)
                fp8ops.nn.update_scaling(ref)
        assert torch.equal(m.weight.grad, ref.weight.grad)
        assert torch.equal(m.fp8_state.grad_output.scale, ref.fp8_state.grad_output.scale)

    with pytest.raises(torch._dynamo.exc.FailOnRecompileLimitHit):
        train(8)
    train(10)
