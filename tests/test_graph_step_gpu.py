"""Whole training steps as CUDA graphs (marker ``gpu``): :func:`fp8ops.graph_step` against eager
at model level (a 2-layer GPT of ``transformer_layer``, 8 capturable-AdamW steps, every recipe and
no FP8, float32 and bfloat16), the calibrated flip of the first steps, weight caching across
micro-batches, a compiled loss inside the captured step, no host sync in a calibrated step, and
what a step with a host sync gets."""

from __future__ import annotations

import pytest
import torch
from torch.utils import _pytree as pytree

import fp8ops
from fp8ops.testing import composition as C
from fp8ops.testing import rel_error

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
STEPS = 8


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("recipe", C.RECIPES)
def test_graph_step_matches_eager(recipe: str, dtype: str) -> None:
    """The replays run eager's kernels on eager's inputs: the loss curve and the last step's
    gradients equal eager's (bounds far below what a stale buffer or a missed update gives)."""
    want = C.eager_result(recipe, DTYPES[dtype], "cuda", capturable=True)
    got = C.train("graph_step", recipe=C.make_recipe(recipe), dtype=DTYPES[dtype], device="cuda", steps=STEPS)
    stats = got.stats
    assert stats is not None
    # one warm-up call; delayed scaling: the first step synchronizes (the calibration read), then
    # one warm-up call
    assert stats["captures"] == 1 and stats["eager"] + stats["replays"] == STEPS, stats
    assert stats["eager"] == (2 if recipe == "delayed" else 1), stats
    loss_err = max(abs(a - b) / max(abs(b), 1e-30) for a, b in zip(got.losses, want.losses))
    grad_err = max(rel_error(got.last_grads[k], g) for k, g in want.last_grads.items())
    print(f"\ngraph_step {recipe:8s} {dtype:9s} loss {loss_err:.2e} last-step grads {grad_err:.2e}")
    tol = 1e-5 if dtype == "float32" else 2e-3
    assert loss_err <= tol, (got.losses, want.losses)
    assert grad_err <= 10 * tol, grad_err
    if recipe != "none":
        for a, b in zip(pytree.tree_leaves(want.states), pytree.tree_leaves(got.states)):
            assert rel_error(b, a) <= 10 * tol, "the scaling states after 8 updates differ"


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("recipe", ["none", "delayed"])
def test_graph_step_with_compiled_loss(recipe: str, dtype: str) -> None:
    """A loss compiled with fullgraph=True inside the captured step: within the compiled bounds."""
    got = C.train("graph_step.fullgraph", recipe=C.make_recipe(recipe), dtype=DTYPES[dtype], device="cuda",
                  steps=STEPS)
    assert got.stats is not None and got.stats["captures"] == 1, got.stats
    e = C.check_compiled(got, recipe, DTYPES[dtype], "cuda", what=f"graph_step.fullgraph {recipe} {dtype}",
                         capturable=True)
    print(f"\ngraph_step.fullgraph {recipe:8s} {dtype:9s} grad {e['grad']:.2e} loss {e['loss']:.2e}")


@pytest.mark.parametrize("recipe", ["delayed", "current", "rowwise"])
def test_calibrated_step_has_no_host_sync(recipe: str) -> None:
    """Fresh probes, forward, backward, gradient clipping, capturable AdamW and fp8ops.update,
    under torch.cuda.set_sync_debug_mode("error"): any host sync raises."""
    r = C.make_recipe(recipe)
    model, params = C.make_model("cuda")
    leaves, spec = pytree.tree_flatten(params)
    master = [t.detach().clone().requires_grad_() for t in leaves]
    opt = torch.optim.AdamW(master, lr=1e-3, capturable=True)
    states = [fp8ops.init_transformer_state(model.config, r, device="cuda") for _ in range(model.layers)]

    def step(i: int) -> None:
        nonlocal states
        probes = fp8ops.make_probes(states)
        loss, ns = C.gpt_loss(pytree.tree_unflatten(master, spec), states, probes, model.tokens[i],
                              model.targets[i], model=model, recipe=r, dtype=torch.bfloat16)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(master, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        states = fp8ops.update(ns, recipe=r, grad_amax=pytree.tree_map(lambda p: p.grad, probes))

    for i in range(2):  # the first update reads the observations on the host (calibration)
        step(i)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError):  # the check is live: a read of a device value raises
            torch.ones((), device="cuda").item()
        step(2)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_weight_cache_across_micro_batches() -> None:
    """quantize_weight once per step, four micro-batches through fp8_linear with the cache, the
    probes' amaxes max-merged, SGD: the replayed steps equal eager."""
    r = fp8ops.DelayedScaling()

    def run(graphed: bool) -> tuple[list[float], torch.Tensor]:
        g = torch.Generator(device="cuda").manual_seed(0)
        w = (torch.randn(64, 32, device="cuda", generator=g) * 0.2).requires_grad_()
        xs = torch.randn(6, 4, 16, 32, device="cuda", generator=g)  # steps, micro-batches, rows, K
        opt = torch.optim.SGD([w], lr=0.1)

        def step(st: fp8ops.LinearState, x: torch.Tensor) -> tuple[fp8ops.LinearState, torch.Tensor]:
            opt.zero_grad(set_to_none=True)
            wb = w.to(torch.bfloat16)
            cache, st = fp8ops.quantize_weight(wb, st, recipe=r)
            probes, total = [], torch.zeros((), device="cuda")
            for m in range(x.shape[0]):
                p = fp8ops.make_probes(st)
                y, st = fp8ops.fp8_linear(x[m].to(torch.bfloat16), wb, None, st, recipe=r, grad_probe=p,
                                          weight_cache=cache)
                loss = y.float().square().mean() / x.shape[0]
                loss.backward()
                probes.append(p)
                total = total + loss.detach()
            opt.step()
            g_amax = torch.stack([p.grad for p in probes]).amax()
            return fp8ops.update(st, recipe=r, grad_amax=g_amax), total

        fn = fp8ops.graph_step(step) if graphed else step
        st, losses = fp8ops.LinearState.init(r, device="cuda"), []
        for i in range(xs.shape[0]):
            st, loss = fn(st, xs[i])
            losses.append(float(loss))
        if graphed:
            assert fn.stats["captures"] == 1 and fn.stats["replays"] == 4, fn.stats
        return losses, w.detach().clone()

    eager_losses, eager_w = run(False)
    graph_losses, graph_w = run(True)
    assert graph_losses == pytest.approx(eager_losses, rel=1e-6)
    assert rel_error(graph_w, eager_w) <= 1e-6


def test_carry_round_trip_and_argument_copies() -> None:
    """The returned carry is the graph's own buffers (passing it back copies nothing); new
    argument tensors are copied in; a parameter passed as an argument must stay the same tensor."""
    w = torch.randn(8, 8, device="cuda", requires_grad=True)

    def step(c: torch.Tensor, x: torch.Tensor, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return c + x.sum(), (p * x).sum().detach()

    fn = fp8ops.graph_step(step)
    c = torch.zeros((), device="cuda")
    outs = []
    for i in range(5):
        c, out = fn(c, torch.full((8, 8), float(i), device="cuda"), w)
        outs.append(out)
    assert float(c) == 64 * (0 + 1 + 2 + 3 + 4)
    assert [float(o) for o in outs] == pytest.approx([float((w * i).sum()) for i in range(5)], rel=1e-5)
    assert fn.stats == {"eager": 1, "captures": 1, "replays": 4}
    with pytest.raises(ValueError, match="same tensor"):
        fn(c, torch.ones(8, 8, device="cuda"), w.detach().clone().requires_grad_())


def test_arguments_by_reference_are_read_as_they_are() -> None:
    """An argument named in args_by_reference is not copied: the graph reads the caller's tensor,
    so values written into it in place between calls reach the step, and another tensor in its
    place is refused; the other arguments are still copied at each call."""
    def step(c: torch.Tensor, x: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return c + (x * d).sum(), (x + d).sum()

    d = torch.zeros(8, 8, device="cuda")
    fn = fp8ops.graph_step(step, args_by_reference=[1])
    c = torch.zeros((), device="cuda")
    want_c, outs, wants = 0.0, [], []
    for i in range(5):
        d.fill_(float(i + 1))  # in place: the graph sees it
        x = torch.full((8, 8), float(i), device="cuda")  # a new tensor each call: copied in
        c, out = fn(c, x, d)
        want_c += 64.0 * i * (i + 1)
        outs.append(float(out))
        wants.append(64.0 * (2 * i + 1))
    assert fn.stats == {"eager": 1, "captures": 1, "replays": 4}
    assert float(c) == want_c and outs == wants
    entry = fn._last
    assert entry is not None and entry.static_args[1] is d and entry.static_args[0] is not x
    with pytest.raises(ValueError, match="args_by_reference"):
        fn(c, x, d.clone())


def test_a_step_that_syncs_stays_eager_and_says_so() -> None:
    """A step that reads a device value on the host every call is never captured (the capture
    would fail): it keeps running eagerly, correctly, and a warning after 3 calls says why."""

    def step(c: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, tuple[()]]:
        if float(x.sum()) > 1e30:  # a host read
            x = x * 2
        return c + x.sum(), ()

    fn = fp8ops.graph_step(step)
    c = torch.zeros((), device="cuda")
    with pytest.warns(UserWarning, match="synchronized with the host on 3 calls"):
        for _ in range(4):
            c, _ = fn(c, torch.ones(4, device="cuda"))
    assert fn.stats == {"eager": 4, "captures": 0, "replays": 0}
    assert float(c) == 16.0


def test_compiled_step_with_strided_arguments_is_captured() -> None:
    """Targets sliced from a token buffer (a strided view, as a language model's batch is) reach the
    captured step with their strides: the compiled loss sees the layout it was compiled for in the
    warm-up call and is not recompiled inside the capture, where compiling cannot run. The
    replayed steps equal the eager ones."""
    torch._dynamo.reset()
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(16, 8, device="cuda", generator=g, requires_grad=True)

    @torch.compile(fullgraph=True)
    def loss_fn(w: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy((x @ w).reshape(-1, 8), y.reshape(-1))

    def step(c: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        loss = loss_fn(w, x, y)
        (dw,) = torch.autograd.grad(loss, (w,))
        return c + dw.abs().sum(), loss.detach()

    batches = []
    for _ in range(5):
        tokens = torch.randint(0, 8, (4, 33), device="cuda", generator=g)
        batches.append((torch.randn(4, 32, 16, device="cuda", generator=g), tokens[:, 1:]))
    assert batches[0][1].stride() == (33, 1)
    runs = []
    for fn in (step, fp8ops.graph_step(step)):
        c, outs = torch.zeros((), device="cuda"), []
        for x, y in batches:
            c, out = fn(c, x, y)
            outs.append(out)
        runs.append((c, torch.stack(outs)))
    assert fn.stats == {"eager": 1, "captures": 1, "replays": 4}
    torch.testing.assert_close(runs[1][0], runs[0][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(runs[1][1], runs[0][1], rtol=1e-5, atol=1e-5)


def test_graphs_compiled_in_its_calls_keep_library_ops_opaque() -> None:
    """A loss compiled during graph_step's warm-up calls calls the library ops (their launches are
    captured, with chained amax words); compiled outside it first, the same loss launches their
    kernels from Inductor's code, and its cached graphs are not taken for the graphed build (the
    caches on, as a user has them). The captured step trains as the uncaptured one."""
    from torch._inductor.utils import run_and_get_code

    r = fp8ops.DelayedScaling()
    x = torch.randn(4, 16, 32, device="cuda").to(torch.bfloat16)

    def run(graphed: bool) -> tuple[str, list[float]]:
        torch._dynamo.reset()
        w = (torch.randn(64, 32, device="cuda", generator=torch.Generator("cuda").manual_seed(0)) * 0.2
             ).requires_grad_()
        opt = torch.optim.SGD([w], lr=0.1)

        def loss_of(st: fp8ops.LinearState, p: torch.Tensor, xb: torch.Tensor) -> tuple[torch.Tensor, fp8ops.LinearState]:
            y, st = fp8ops.fp8_linear(xb, w.to(torch.bfloat16), None, st, recipe=r, grad_probe=p)
            return y.float().square().mean(), st

        compiled = torch.compile(loss_of, fullgraph=True)

        def step(st: fp8ops.LinearState, xb: torch.Tensor) -> tuple[fp8ops.LinearState, torch.Tensor]:
            opt.zero_grad(set_to_none=True)
            p = fp8ops.make_probes(st)
            loss, st = compiled(st, p, xb)
            loss.backward()
            opt.step()
            return fp8ops.update(st, recipe=r, grad_amax=p.grad), loss.detach()

        fn = fp8ops.graph_step(step) if graphed else step
        st, losses = fp8ops.LinearState.init(r, device="cuda"), []

        def loop() -> None:
            nonlocal st
            for i in range(x.shape[0]):
                st, loss = fn(st, x[i])
                losses.append(float(loss))

        _, codes = run_and_get_code(loop)
        if graphed:
            assert fn.stats["replays"] >= 1, fn.stats
        return "\n".join(codes), losses

    plain_code, plain = run(False)
    graphed_code, graphed = run(True)
    assert "torch.ops.fp8ops.cast_transpose" in graphed_code
    assert "torch.ops.fp8ops.cast_transpose" not in plain_code
    assert graphed == pytest.approx(plain, rel=1e-5, abs=0.0), (graphed, plain)


def test_replays_draw_a_new_hidden_dropout_mask() -> None:
    """A pre-norm layer's hidden dropout runs in the MLP's norm kernel with a seed drawn from torch's
    generator: each replay of a captured step must draw a new one (a mask frozen into the graph
    would drop the same elements at every step), and the drop rate stays p."""
    from fp8ops.transformer_layer import TransformerConfig, init_transformer_params, transformer_layer

    cfg = TransformerConfig(hidden_size=256, ffn_hidden_size=512, num_attention_heads=4, hidden_dropout=0.5,
                            attention_dropout=0.0)
    params = {k: v.to(device="cuda", dtype=torch.bfloat16).requires_grad_()
              for k, v in init_transformer_params(cfg, generator=torch.Generator().manual_seed(0)).items()}
    # fc2 zeroed: y = s = x + dropout(proj(attention)), so the dropped elements are where y == x
    with torch.no_grad():
        params["fc2.weight"].zero_()
        params["fc2.bias"].zero_()
    x = torch.randn(64, 2, 256, device="cuda", dtype=torch.bfloat16)

    def step(c: torch.Tensor, xx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y, _ = transformer_layer(params, xx, None, config=cfg, recipe=None)
        y.float().sum().backward()
        return c + 1, (y == xx).detach()

    fn = fp8ops.graph_step(step)
    c = torch.zeros((), device="cuda")
    masks = []
    for _ in range(5):
        for p in params.values():
            p.grad = None
        c, dropped = fn(c, x)
        masks.append(dropped.clone())
    assert fn.stats == {"eager": 1, "captures": 1, "replays": 4}
    for m in masks:
        assert abs(float(m.float().mean()) - 0.5) < 0.05
    for a, b in zip(masks[1:], masks[2:]):  # replays
        assert not torch.equal(a, b)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("recipe", C.RECIPES)
def test_graph_step_with_the_library_optimizer_matches_eager(recipe: str, dtype: str) -> None:
    """The same model stepped by fp8ops.adamw_ (every parameter; the harness's ``optimizer="fp8ops"``)
    replayed as CUDA graphs: the eager run's losses, last gradients and states, as above."""
    want = C.train("eager", recipe=C.make_recipe(recipe), dtype=DTYPES[dtype], device="cuda", steps=STEPS,
                   optimizer="fp8ops")
    got = C.train("graph_step", recipe=C.make_recipe(recipe), dtype=DTYPES[dtype], device="cuda", steps=STEPS,
                  optimizer="fp8ops")
    assert got.stats is not None and got.stats["captures"] == 1 and got.stats["replays"] >= 1, got.stats
    loss_err = max(abs(a - b) / max(abs(b), 1e-30) for a, b in zip(got.losses, want.losses))
    grad_err = max(rel_error(got.last_grads[k], g) for k, g in want.last_grads.items())
    print(f"\ngraph_step, fp8ops.adamw_ {recipe:8s} {dtype:9s} loss {loss_err:.2e} last-step grads {grad_err:.2e}")
    tol = 1e-5 if dtype == "float32" else 2e-3
    assert loss_err <= tol, (got.losses, want.losses)
    assert grad_err <= 10 * tol, grad_err
    if recipe != "none":
        for a, b in zip(pytree.tree_leaves(want.states), pytree.tree_leaves(got.states)):
            assert rel_error(b, a) <= 10 * tol, "the scaling states after 8 updates differ"
