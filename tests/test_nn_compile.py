"""``torch.compile`` of a model built from ``fp8ops.nn`` modules against the same model run eagerly.

A model of every module kind (Linear -> LayerNormLinear -> LayerNormMLP -> TransformerLayer) trains
4 SGD steps of 2 micro-batches each (a squared error to random targets), with
``fp8ops.nn.update_scaling`` after each step, eagerly; beside it a twin under
``torch.compile(model)`` takes each step from the eager model's parameters and scaling states
(``fullgraph=False`` with no preparation: a compiled forward takes a probe made ahead, one per module
at first, so the first step's second micro-batch breaks the graph and makes its probes eagerly, and
update_scaling then keeps two ready; and ``fullgraph=True`` after
``fp8ops.nn.prepare_probes(model, forwards=2)``, with ``aot_eager`` on CPU and Inductor on the GPU),
for ``recipe=None``, delayed and current scaling. Each step is compared with the eager step from the
same point:

- ``aot_eager`` (CPU, float32): the losses, every gradient and every scaling state after the update
  equal the eager step's bit for bit (the same library calls in the same order);
- ``inductor`` (CPU float32; GPU bfloat16): Inductor compiles the torch ops between the library
  calls (reshapes, residual adds, attention, the loss, the scales' arithmetic) and may round them
  differently, so the losses and every gradient must match the eager step's within a relative
  error (for a gradient: norm of the difference over the norm of the eager gradient; 1e-2 in
  float32, 5e-2 in bfloat16, where an FP8 rounding that flips moves a gradient element by up to
  1/16), the scales after the update within the same and the calibrated flags exactly.

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


def _states(model):
    return {f"{i}.{k}": v for i, m in enumerate(model) if m.fp8_state is not None
            for k, v in fp8ops.state_dict(m.fp8_state).items()}


def _steps(recipe, device, dtype, backend, fullgraph=False):
    """4 SGD steps of an eager model and, beside it, its compiled twin, which starts every step from
    the eager model's parameters and scaling states: each step of the twin is compared with the
    eager step from the same point, so that rounding differences cannot compound over the steps
    (the training's own dynamics amplify them: with a loss linear in the output the parameters grew
    1000-fold in 4 steps). Returns per step the losses of both (two micro-batches each), the
    gradients of both and the states of both after ``update_scaling``."""
    eager, twin = _model(recipe, device, dtype), _model(recipe, device, dtype)
    if fullgraph:
        fp8ops.nn.prepare_probes(twin, forwards=2)
    run = torch.compile(twin, backend=backend, fullgraph=fullgraph)
    opt = torch.optim.SGD(eager.parameters(), lr=0.01)
    g = torch.Generator(device=device).manual_seed(1)
    steps = []
    for _ in range(4):
        with torch.no_grad():
            for p, q in zip(twin.parameters(), eager.parameters(), strict=True):
                p.copy_(q)
        for t, e in zip(twin, eager, strict=True):
            t.fp8_state = e.fp8_state  # immutable: shared, each module keeps the new one it makes
        losses = ([], [])
        for _ in range(2):  # micro-batches: one probe set per forward
            x = torch.randn(S, B, H, device=device, generator=g).to(dtype)
            target = torch.randn(S, B, H, device=device, generator=g).to(dtype)
            for out, net in zip(losses, (eager, run)):
                loss = (net(x).float() - target.float()).square().sum() / 2
                loss.backward()
                out.append(loss.detach())
        grads = {n: (q.grad.detach().float().clone(), p.grad.detach().float().clone())
                 for (n, q), (_, p) in zip(eager.named_parameters(), twin.named_parameters(), strict=True)}
        opt.step()
        opt.zero_grad()
        twin.zero_grad()
        fp8ops.nn.update_scaling(eager)
        fp8ops.nn.update_scaling(twin)
        steps.append((torch.stack(losses[0]), torch.stack(losses[1]), grads, _states(eager), _states(twin)))
    return steps


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
    steps = _steps(recipe, device, dtype, backend, fullgraph)
    tol = 1e-2 if dtype == torch.float32 else 5e-2
    errors = []  # (relative error, what) over every step, gradient and scale
    for i, (losses, c_losses, grads, states, c_states) in enumerate(steps):
        assert states.keys() == c_states.keys()
        if backend == "aot_eager":
            assert torch.equal(c_losses, losses), i
            for k, (ge, gc) in grads.items():
                assert torch.equal(gc, ge), (i, k)
            for k in states:
                assert torch.equal(c_states[k], states[k]), (i, k)
            continue
        torch.testing.assert_close(c_losses, losses, rtol=tol, atol=tol * float(losses.abs().mean()), msg=str(i))
        for k, (ge, gc) in grads.items():
            errors.append((float((gc - ge).norm() / ge.norm().clamp_min(1e-12)), f"step {i} gradient of {k}"))
        for k in states:
            if k.endswith(".scale"):
                errors.append((float(((c_states[k] - states[k]).abs() / states[k].abs()).max()), f"step {i} {k}"))
            elif k.endswith(".calibrated"):
                assert torch.equal(c_states[k], states[k]), (i, k)
    worst = sorted(errors, reverse=True)[:6]
    assert not worst or worst[0][0] < tol, "relative errors above " + str(tol) + ": " + "; ".join(
        f"{w}: {e:.3g}" for e, w in worst)
    if recipe is not None and recipe.mode == "delayed":  # the compiled steps observed: forward amaxes and
        # the probes' gradients reached the histories of every module
        c_states = steps[-1][4]
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


def test_probe_bookkeeping_is_not_compiled_as_a_function_of_its_own():
    # fullgraph=False without prepare_probes: the first step's second forward breaks the graph at
    # the probe bookkeeping; called from the broken forward, FP8Module._next_probes runs as it is
    # instead of compiling twice per module class (four classes reached Dynamo's recompile limit
    # in the second step, and it warned). The forwards themselves still compile.
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    torch._dynamo.reset()
    model = _model(fp8ops.DelayedScaling(), "cpu", torch.float32)
    run = torch.compile(model, backend="aot_eager")
    for step in range(3):
        for _ in range(2):
            run(torch.randn(S, B, H)).square().sum().backward()
        if step == 0:  # the graph broke: update_scaling says so, naming the fix
            with pytest.warns(UserWarning, match=r"Linear ran 2 training forwards this step with 1 probe set\(s\) "
                              r"made ready.*\(4 module\(s\)\).*prepare_probes\(model, forwards=2\)"):
                fp8ops.nn.update_scaling(model)
        else:
            fp8ops.nn.update_scaling(model)
    assert len(_debug_get_cache_entry_list(fp8ops.nn.FP8Module._next_probes.__code__)) == 0
    assert len(_debug_get_cache_entry_list(fp8ops.nn.Linear.forward.__code__)) >= 1


def test_no_warning_when_probes_were_made_ready():
    import warnings

    torch._dynamo.reset()
    model = _model(fp8ops.DelayedScaling(), "cpu", torch.float32)
    fp8ops.nn.prepare_probes(model, forwards=2)
    run = torch.compile(model, backend="aot_eager")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="update_scaling")
        for _ in range(2):
            for _ in range(2):
                run(torch.randn(S, B, H)).square().sum().backward()
            fp8ops.nn.update_scaling(model)
        for _ in range(3):  # eager forwards make their own probes: no warning either
            model(torch.randn(S, B, H)).square().sum().backward()
        fp8ops.nn.update_scaling(model)
