"""fused_ln_mlp on CPU: forward and every gradient vs the FP32 reference, state and probe semantics,
recompute, weight caches, errors, and the composition canaries."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fp8ops
from fp8ops import (
    CurrentScaling,
    DelayedScaling,
    GemmSpec,
    LayerNormLinearState,
    LayerNormMLPState,
)
from fp8ops.reference import fused_ln_mlp as R
from fp8ops.testing import rel_error
from fp8ops.testing.states import calibrate
from fp8ops.testing.composition import RECIPES as RECIPE_NAMES, make_recipe

RECIPES = {name: make_recipe(name) for name in RECIPE_NAMES}  # none, delayed (history 4), current, rowwise
DELAYED = RECIPES["delayed"]

ACTS = ["gelu", "gelu_tanh", "relu", "squared_relu", "silu", "qgelu", "swiglu", "geglu", "reglu"]

GATED = {"swiglu", "geglu", "reglu"}


def _mlp_state(recipe, calibrated):
    if recipe is None:
        return None
    st = LayerNormMLPState.init(recipe)
    scales = {"fc1_input": 64.0, "fc1_weight": 256.0, "fc1_grad_output": 2.0**12,
              "fc2_input": 64.0, "fc2_weight": 256.0, "fc2_grad_output": 2.0**12}
    return calibrate(st, recipe, scales=scales) if calibrated else st


def _tol(dtype, recipe):
    if dtype == torch.float32:
        return 1e-5 if recipe is None else 2e-4
    return 2e-2


def _leaf(t):
    return None if t is None else t.clone().requires_grad_()


def _mlp_data(M, K, F, act, dtype, rms, seed=0):
    g = torch.Generator().manual_seed(seed)
    C = 2 * F if act in GATED else F
    x = (torch.randn(M, K, generator=g) * 2 - 0.5).to(dtype)
    ln_w = (1 + 0.1 * torch.randn(K, generator=g)).to(dtype)
    ln_b = None if rms else (0.1 * torch.randn(K, generator=g)).to(dtype)
    w1 = (torch.randn(C, K, generator=g) / K**0.5).to(dtype)
    b1 = (0.1 * torch.randn(C, generator=g)).to(dtype)
    w2 = (torch.randn(K, F, generator=g) / F**0.5).to(dtype)
    b2 = (0.1 * torch.randn(K, generator=g)).to(dtype)
    dy = (torch.randn(M, K, generator=g) * 1e-2).to(dtype)
    return [x, ln_w, ln_b, w1, b1, w2, b2], dy


def _run_mlp(args, dy, st, recipe, *, probe=True, **kw):
    leaves = [_leaf(t) for t in args]
    p = fp8ops.make_probes(st) if probe and st is not None else None
    y, st2 = fp8ops.fused_ln_mlp(*leaves, st, recipe=recipe, grad_probe=p, **kw)
    y.backward(dy)
    return y.detach(), [None if t is None else t.grad for t in leaves], (p.grad if p is not None else None), st2


def _check_mlp(args, dy, st, recipe, act, norm, dtype, recompute=None, **kw):
    y, grads, pg, st2 = _run_mlp(args, dy, st, recipe, activation=act, normalization=norm, recompute=recompute, **kw)
    ref = R.fused_ln_mlp(*args, st, dy, recipe=recipe, activation_name=act, normalization=norm,
                         recompute=recompute == "activation")
    tol = _tol(dtype, recipe)
    names = ["dx", "dln_w", "dln_b", "dw1", "db1", "dw2", "db2"]
    pairs = [("y", y, ref["y"])] + [(n, g, ref[n]) for n, g in zip(names, grads) if g is not None]
    for name, got, want in pairs:
        err = rel_error(got, want)
        assert err <= tol, f"{act}/{norm}/{recipe}: {name} rel err {err:.2e} > {tol:.0e}"
    if recipe is not None:
        want = torch.stack([ref["amax_dh"], ref["amax_dy"]])
        assert torch.allclose(pg, want, rtol=1e-2 if dtype != torch.float32 else 1e-5), (pg, want)
        # row-wise scaling observes the activations after their rounding to x.dtype
        rtol = 1e-2 if recipe.mode == "rowwise" and dtype != torch.float32 else 1e-5
        assert torch.allclose(st2.fc2_input.pending_amax, ref["amax_a"], rtol=rtol)
        assert torch.allclose(st2.fc1_input.pending_amax, ref["amax_ln"], rtol=rtol)
        assert torch.equal(st2.fc1_weight.pending_amax, ref["amax_w1"])
        assert torch.equal(st2.fc2_weight.pending_amax, ref["amax_w2"])
        if recompute == "activation":  # fc1's output is observed only when it is stored in FP8
            assert torch.allclose(st2.fc1_output.pending_amax, ref["amax_h"], rtol=1e-5)
        else:
            assert torch.equal(st2.fc1_output.pending_amax, st.fc1_output.pending_amax)
            assert torch.equal(st2.fc1_output.amax_history, st.fc1_output.amax_history)
    return y, grads


def _mlp_loss(params, x, st, probes):
    y, st2 = fp8ops.fused_ln_mlp(x, params["g"], params["beta"], params["w1"], params["b1"], params["w2"],
                                 params["b2"], st, recipe=DELAYED, activation="swiglu", grad_probe=probes)
    return (y.float() ** 2).sum(), st2


def _mlp_params():
    args, _ = _mlp_data(6, 16, 8, "swiglu", torch.float32, False, seed=3)
    x, g, beta, w1, b1, w2, b2 = args
    return {"g": g, "beta": beta, "w1": w1, "b1": b1, "w2": w2, "b2": b2}, x


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("rname", ["none", "delayed", "current"])
def test_fused_ln_mlp_every_activation(act, rname):
    recipe = RECIPES[rname]
    args, dy = _mlp_data(12, 24, 20, act, torch.float32, False)
    _check_mlp(args, dy, _mlp_state(recipe, True), recipe, act, "LayerNorm", torch.float32)


@pytest.mark.parametrize("rname", list(RECIPES))
@pytest.mark.parametrize("calibrated", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm", ["LayerNorm", "RMSNorm"])
def test_fused_ln_mlp_recipes_dtypes_norms(rname, calibrated, dtype, norm):
    recipe = RECIPES[rname]
    if recipe is None and not calibrated:
        pytest.skip("no state without FP8")
    args, dy = _mlp_data(9, 33, 17, "swiglu", dtype, norm == "RMSNorm", seed=1)
    _check_mlp(args, dy, _mlp_state(recipe, calibrated), recipe, "swiglu", norm, dtype)


@pytest.mark.parametrize("rname", ["delayed", "current", "rowwise"])
@pytest.mark.parametrize("calibrated", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act", ["gelu_tanh", "geglu", "relu"])
def test_recompute_stores_fc1_output_in_fp8(rname, calibrated, dtype, act):
    # Output, every gradient and the observations against the reference that quantizes h with the
    # fc1_output role (its amax observed); the FP8 copy of h is what the backward reads.
    recipe = RECIPES[rname]
    args, dy = _mlp_data(10, 16, 24, act, dtype, False, seed=2)
    st = _mlp_state(recipe, calibrated)
    if calibrated and recipe.mode == "delayed":
        st = st.replace(fc1_output=st.fc1_output.replace(scale=torch.tensor(32.0), calibrated=True))
    _check_mlp(args, dy, st, recipe, act, "LayerNorm", dtype, recompute="activation")


@pytest.mark.parametrize("rname", ["delayed", "current"])
def test_recompute_differs_from_the_plain_path_by_the_fp8_rounding_of_h(rname):
    recipe = RECIPES[rname]
    args, dy = _mlp_data(16, 32, 48, "swiglu", torch.float32, False, seed=4)
    st = _mlp_state(recipe, False)
    y0, g0, _, _ = _run_mlp(args, dy, st, recipe, activation="swiglu")
    y1, g1, _, _ = _run_mlp(args, dy, st, recipe, activation="swiglu", recompute="activation")
    assert 0 < rel_error(y1, y0) < 0.1  # E4M3 keeps 3 mantissa bits: a few % per element, averaged out
    for a, b in zip(g0, g1):
        assert rel_error(b, a) < 0.2


@pytest.mark.parametrize("act", ["gelu_tanh", "geglu"])
def test_recompute_without_fp8_gives_the_same_bits(act):
    args, dy = _mlp_data(10, 16, 24, act, torch.bfloat16, False, seed=2)
    y0, g0, _, _ = _run_mlp(args, dy, None, None, activation=act)
    y1, g1, _, _ = _run_mlp(args, dy, None, None, activation=act, recompute="activation")
    assert torch.equal(y0, y1)
    for a, b in zip(g0, g1):
        assert (a is None and b is None) or torch.equal(a, b)


def test_partial_gradients_and_no_probe():
    recipe = RECIPES["current"]
    args, dy = _mlp_data(8, 16, 16, "gelu", torch.float32, False)
    st = _mlp_state(recipe, True)
    leaves = [t.clone() for t in args]
    leaves[5].requires_grad_()  # only fc2's weight
    y, _ = fp8ops.fused_ln_mlp(*leaves, st, recipe=recipe, activation="gelu")
    y.backward(dy)
    ref = R.fused_ln_mlp(*args, st, dy, recipe=recipe, activation_name="gelu", has_probe=False)
    assert rel_error(leaves[5].grad, ref["dw2"]) < 2e-4
    assert all(t.grad is None for i, t in enumerate(leaves) if i != 5 and t is not None)


@given(M=st.integers(1, 19), K=st.integers(1, 37), F=st.integers(1, 29),
       act=st.sampled_from(ACTS), rms=st.booleans(), zc=st.booleans())
def test_fused_ln_mlp_shapes(M, K, F, act, rms, zc):
    args, dy = _mlp_data(M, K, F, act, torch.float32, rms, seed=M * 7 + K)
    y, grads, _, _ = _run_mlp(args, dy, _mlp_state(DELAYED, True), DELAYED, activation=act,
                              normalization="RMSNorm" if rms else "LayerNorm", zero_centered_gamma=zc)
    ref = R.fused_ln_mlp(*args, _mlp_state(DELAYED, True), dy, recipe=DELAYED, activation_name=act,
                         normalization="RMSNorm" if rms else "LayerNorm", zero_centered_gamma=zc)
    assert y.shape == (M, K)
    # tiny shapes: one FP8 rounding flip can move a small tensor's norm; bound per element instead
    torch.testing.assert_close(y, ref["y"], rtol=0.07, atol=1e-3)
    torch.testing.assert_close(grads[3], ref["dw1"], rtol=0.07, atol=1e-4)


@pytest.mark.parametrize("kw, match", [
    ({"activation": "tanh"}, "activation"),
    ({"normalization": "BatchNorm"}, "normalization"),
    ({"recompute": "all"}, "recompute"),
    ({"grad_probe": torch.zeros(())}, r"grad_probe must be a \(2,\)"),
    ({"eps": 0.0}, "eps must be a finite number > 0"),
])
def test_mlp_errors(kw, match):
    args, _ = _mlp_data(4, 8, 8, "gelu", torch.float32, False)
    st = _mlp_state(DELAYED, True)
    with pytest.raises((ValueError, TypeError), match=match):
        fp8ops.fused_ln_mlp(*args, st, recipe=DELAYED, **kw)


def test_mlp_shape_errors():
    args, _ = _mlp_data(4, 8, 7, "gelu", torch.float32, False)
    st = _mlp_state(DELAYED, True)
    with pytest.raises(ValueError, match="odd number of rows"):
        fp8ops.fused_ln_mlp(*args, st, recipe=DELAYED, activation="swiglu")
    bad = list(args)
    bad[5] = torch.randn(8, 9)
    with pytest.raises(ValueError, match="fc2_weight"):
        fp8ops.fused_ln_mlp(*bad, st, recipe=DELAYED)
    with pytest.raises(TypeError, match="LayerNormMLPState"):
        fp8ops.fused_ln_mlp(*args, LayerNormLinearState.init(DELAYED), recipe=DELAYED)
    with pytest.raises(ValueError, match="without a recipe"):
        fp8ops.fused_ln_mlp(*args, st, recipe=None)


def test_func_grad_matches_autograd():
    params, x = _mlp_params()
    st = _mlp_state(DELAYED, True)
    probes = torch.zeros(2)
    (gparams, gprobe), _ = torch.func.grad(
        lambda p, pr: _mlp_loss(p, x, st, pr), argnums=(0, 1), has_aux=True
    )(params, probes)
    leaves = {k: v.clone().requires_grad_() for k, v in params.items()}
    probe = fp8ops.make_probes(st)
    loss, _ = _mlp_loss(leaves, x, st, probe)
    loss.backward()
    for k in params:
        torch.testing.assert_close(gparams[k], leaves[k].grad, rtol=0, atol=0)
    torch.testing.assert_close(gprobe, probe.grad, rtol=0, atol=0)


def test_vmap_is_a_loop():
    params, x = _mlp_params()
    st = _mlp_state(DELAYED, True)
    xs = torch.stack([x, 2 * x, -x])

    def f(xi):
        y, st2 = fp8ops.fused_ln_mlp(xi, params["g"], params["beta"], params["w1"], params["b1"], params["w2"],
                                     params["b2"], st, recipe=DELAYED, activation="swiglu")
        return y, st2.fc2_input.pending_amax

    ys, amaxes = torch.vmap(f)(xs)
    for i in range(3):
        y_i, a_i = f(xs[i])
        torch.testing.assert_close(ys[i], y_i, rtol=0, atol=0)
        torch.testing.assert_close(amaxes[i], a_i, rtol=0, atol=0)


def test_compile_fullgraph_forward_backward_matches_eager():
    torch._dynamo.reset()
    params, x = _mlp_params()
    st = _mlp_state(DELAYED, True)

    def step(p, xx, s, probes):
        loss, s2 = _mlp_loss(p, xx, s, probes)
        return loss, s2

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    outs = []
    for fn in (step, compiled):
        leaves = {k: v.clone().requires_grad_() for k, v in params.items()}
        probes = fp8ops.make_probes(st)
        loss, s2 = fn(leaves, x, st, probes)
        loss.backward()
        outs.append((loss.detach(), {k: v.grad for k, v in leaves.items()}, probes.grad, s2.fc2_input.pending_amax))
    (l0, g0, p0, a0), (l1, g1, p1, a1) = outs
    torch.testing.assert_close(l0, l1)
    for k in g0:
        torch.testing.assert_close(g0[k], g1[k])
    torch.testing.assert_close(p0, p1)
    torch.testing.assert_close(a0, a1)


def test_compile_of_func_grad_raises():
    torch._dynamo.reset()
    params, x = _mlp_params()
    st = _mlp_state(DELAYED, True)
    f = torch.compile(torch.func.grad(lambda p: _mlp_loss(p, x, st, None)[0]), fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match="torch.compile cannot trace a torch.func transform"):
        f(params)


def test_update_after_a_step_uses_probe_observations():
    params, x = _mlp_params()
    st = LayerNormMLPState.init(DELAYED)
    leaves = {k: v.clone().requires_grad_() for k, v in params.items()}
    probes = fp8ops.make_probes(st)
    loss, st2 = _mlp_loss(leaves, x, st, probes)
    loss.backward()
    st3 = fp8ops.update(st2, recipe=DELAYED, grad_amax=probes.grad)
    assert st3.fc1_grad_output.calibrated and st3.fc2_grad_output.calibrated
    torch.testing.assert_close(st3.fc1_grad_output.amax_history[0], probes.grad[0])
    torch.testing.assert_close(st3.fc2_grad_output.amax_history[0], probes.grad[1])


@pytest.mark.parametrize("recipe", [DELAYED, CurrentScaling()], ids=["delayed", "current"])
def test_returned_states_carry_no_autograd_history(recipe):
    """A state is passed from step to step; a tensor with a grad_fn in it would keep the step's graph
    alive and make the next backward fail. Every op returns observations only."""
    cfg = fp8ops.TransformerConfig(hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
                                   hidden_dropout=0.0, attention_dropout=0.0, self_attn_mask_type="causal")
    params = {k: v.requires_grad_() for k, v in fp8ops.init_transformer_params(cfg).items()}
    x = torch.randn(6, 2, 32, requires_grad=True)
    st = fp8ops.init_transformer_state(cfg, recipe)
    probes = fp8ops.make_probes(st)
    y, st2 = fp8ops.transformer_layer(params, x, st, config=cfg, recipe=recipe, probes=probes)
    w = torch.randn(16, 32, requires_grad=True)
    _, lin_st = fp8ops.fp8_linear(x, w, None, fp8ops.LinearState.init(recipe), recipe=recipe)
    for tree in (st2, lin_st):
        leaves = torch.utils._pytree.tree_leaves(tree)
        assert leaves and not any(t.requires_grad for t in leaves)
    y.sum().backward()
    st3 = fp8ops.update(st2, recipe=recipe, grad_amax=torch.utils._pytree.tree_map(lambda p: p.grad, probes))
    y, _ = fp8ops.transformer_layer(params, x, st3, config=cfg, recipe=recipe, probes=fp8ops.make_probes(st3))
    y.sum().backward()  # a second step from the updated state


def test_old_probe_name_still_works_with_a_deprecation_warning():
    """``grad_probes`` is the old name of fused_ln_mlp's ``grad_probe`` (one name in every op)."""
    r = DelayedScaling()
    x, g, b = torch.randn(4, 8), torch.ones(8), torch.zeros(8)
    w1, w2 = torch.randn(16, 8), torch.randn(8, 16)
    p_new, p_old = torch.zeros(2, requires_grad=True), torch.zeros(2, requires_grad=True)
    y_new, _ = fp8ops.fused_ln_mlp(x, g, b, w1, None, w2, None, LayerNormMLPState.init(r), recipe=r, grad_probe=p_new)
    with pytest.warns(DeprecationWarning, match="grad_probes is renamed grad_probe"):
        y_old, _ = fp8ops.fused_ln_mlp(x, g, b, w1, None, w2, None, LayerNormMLPState.init(r), recipe=r, grad_probes=p_old)
    assert torch.equal(y_new, y_old)
    (y_new.sum() + y_old.sum()).backward()
    assert torch.equal(p_new.grad, p_old.grad) and float(p_new.grad[1]) == 1.0  # amax(dy) of y.sum()
    with pytest.raises(TypeError, match="pass grad_probe only"):
        fp8ops.fused_ln_mlp(x, g, b, w1, None, w2, None, LayerNormMLPState.init(r), recipe=r, grad_probe=p_new,
                     grad_probes=p_old)


# ------------------------------------------------------------------------------------------------
# weight_cache: W1 and W2 quantized once per optimizer step (fp8ops.quantize_weight)

CACHE_CASES = {  # name: (recipe, calibrated state)
    "delayed": (DELAYED, True),
    "delayed-first-step": (DELAYED, False),
    "current": (RECIPES["current"], False),
    "rowwise": (RECIPES["rowwise"], False),
    "dgrad-high": (DelayedScaling(amax_history_len=4, dgrad=GemmSpec(precision="high")), True),
}


def _quantize_weights(params, st, recipe, which):
    """``((cache1, cache2), state)``: caches of W1 / W2 (``params[3]`` / ``params[5]``) for the
    weights named in ``which`` ("fc1", "fc2"), None for the others, and the state with their amaxes."""
    caches = []
    for name, w in (("fc1", params[3]), ("fc2", params[5])):
        if name in which:
            c, ws = fp8ops.quantize_weight(w, getattr(st, f"{name}_weight"), recipe=recipe)
            st = st.replace(**{f"{name}_weight": ws})
            if "no_t" in which:  # without the transposed copy: the op transposes the bytes in its backward
                c = fp8ops.WeightCache(fp8ops.Float8Value(c.value.data, c.value.inv_scale), None, c.scale, c.recipe,
                                       c.weight)
            caches.append(c)
        else:
            caches.append(None)
    return tuple(caches), st


def _mlp_micro_batches(recipe, calibrated, *, cache, micro=1, act="swiglu", grads="all", dtype=torch.float32,
                       **kw):
    """``micro`` micro-batches through fused_ln_mlp with the same parameter leaves (their gradients
    accumulate) and the state threaded through; ``cache`` names the weights quantized once, first
    ("fc1", "fc2", both, or none). ``grads``: "all", "no_x" (x and the norm's parameters need no
    gradient: no dgrad into the norm) or "w2_only" (only W2 needs one: no gradient through the
    activation). Returns the per-micro-batch outputs, x gradients and probe gradients, the
    parameters' gradients, and the final state as a flat dict."""
    data = [_mlp_data(12, 16, 24, act, dtype, False, seed=i) for i in range(micro)]
    batches = [(args[0], dy) for args, dy in data]
    need = {"all": range(6), "no_x": range(2, 6), "w2_only": [4]}[grads]
    params = [t.clone().requires_grad_(i in need) for i, t in enumerate(data[0][0][1:])]
    st = _mlp_state(recipe, calibrated)
    extra = {}
    if cache:
        extra["weight_cache"], st = _quantize_weights([None, *params], st, recipe, cache)
    out = []
    for xb, dyb in batches:
        xl = xb.clone().requires_grad_(grads == "all")
        p = fp8ops.make_probes(st)
        y, st = fp8ops.fused_ln_mlp(xl, *params, st, recipe=recipe, activation=act, grad_probe=p, **extra, **kw)
        y.backward(dyb)
        out += [y.detach(), xl.grad, p.grad]
    return out + [t.grad for t in params], fp8ops.state_dict(st)


def _assert_same(got, ref):
    (g, g_st), (r, r_st) = got, ref
    assert len(g) == len(r)
    for i, (a, b) in enumerate(zip(g, r)):
        assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), f"output/gradient {i} differs"
    assert g_st.keys() == r_st.keys()
    for k in r_st:
        assert torch.equal(g_st[k], r_st[k]), f"state {k}: {g_st[k]} != {r_st[k]}"


@pytest.mark.parametrize("case", list(CACHE_CASES))
@pytest.mark.parametrize("cache", ["fc1+fc2", "fc1", "fc2"])
def test_weight_cache_gives_the_same_bits(case, cache):
    """With caches: the same output, every gradient and probe gradient, and the same state (amax(W)
    recorded by quantize_weight instead of the op) as without."""
    recipe, calibrated = CACHE_CASES[case]
    _assert_same(_mlp_micro_batches(recipe, calibrated, cache=cache),
                 _mlp_micro_batches(recipe, calibrated, cache=""))


@pytest.mark.parametrize("act", ["gelu_tanh", "reglu"])
@pytest.mark.parametrize("recompute", [None, "activation"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_cache_gives_the_same_bits_activations_recompute_dtypes(act, recompute, dtype):
    recipe, calibrated = CACHE_CASES["delayed"]
    kw = {"act": act, "recompute": recompute, "dtype": dtype}
    _assert_same(_mlp_micro_batches(recipe, calibrated, cache="fc1+fc2", **kw),
                 _mlp_micro_batches(recipe, calibrated, cache="", **kw))


@pytest.mark.parametrize("case", ["delayed", "current"])
@pytest.mark.parametrize("grads", ["all", "no_x", "w2_only"])
def test_weight_cache_reused_over_two_micro_batches(case, grads):
    recipe, calibrated = CACHE_CASES[case]
    _assert_same(_mlp_micro_batches(recipe, calibrated, cache="fc1+fc2", micro=2, grads=grads),
                 _mlp_micro_batches(recipe, calibrated, cache="", micro=2, grads=grads))


@pytest.mark.parametrize("case", ["delayed", "current"])
@pytest.mark.parametrize("cache", ["fc1+fc2+no_t", "fc1+no_t", "fc2+no_t"])
@pytest.mark.parametrize("grads", ["all", "no_x"])
def test_weight_cache_without_transposed_copy_gives_the_same_bits(case, cache, grads):
    """Caches without ``data_t`` (one scale per tensor): the backward transposes the cached bytes."""
    recipe, calibrated = CACHE_CASES[case]
    _assert_same(_mlp_micro_batches(recipe, calibrated, cache=cache, micro=2, grads=grads),
                 _mlp_micro_batches(recipe, calibrated, cache="", micro=2, grads=grads))


@pytest.mark.parametrize("case", ["delayed", "current", "rowwise"])
def test_weight_cache_operands_are_what_the_gemms_read(case):
    """The forward and dgrad GEMMs read the cached FP8 operands only, never the weights' values:
    caches of W1 and W2 next to all-zero stand-in weights (as FSDP's FP8 all-gather passes) give
    the results of W1 and W2, and their gradients reach the stand-ins."""
    recipe, calibrated = CACHE_CASES[case]
    (x, *params), dy = _mlp_data(12, 16, 24, "swiglu", torch.float32, False)
    (q1, q2), st_c = _quantize_weights([x, *params], _mlp_state(recipe, calibrated), recipe, "fc1+fc2")
    s1, s2 = torch.zeros_like(params[2], requires_grad=True), torch.zeros_like(params[4], requires_grad=True)
    caches = tuple(fp8ops.WeightCache(q.value, q.inv_scale_t, q.scale, recipe, s) for q, s in ((q1, s1), (q2, s2)))
    got, ref = [], []
    for w1, w2, kw, out in ((s1, s2, {"weight_cache": caches}, got),
                            (params[2].clone().requires_grad_(), params[4].clone().requires_grad_(), {}, ref)):
        xl = x.clone().requires_grad_()
        ln_w, ln_b, _, b1, _, b2 = params
        y, _ = fp8ops.fused_ln_mlp(xl, ln_w, ln_b, w1, b1, w2, b2, st_c, recipe=recipe, activation="swiglu", **kw)
        y.backward(dy)
        out += [y, xl.grad, w1.grad, w2.grad]
    for name, a, r in zip(["y", "dx", "dw1", "dw2"], got, ref):
        assert torch.equal(a, r), name


def test_weight_cache_amax_is_recorded_by_quantize_weight_not_the_op():
    recipe, calibrated = CACHE_CASES["delayed"]
    args, _ = _mlp_data(6, 16, 24, "gelu", torch.float32, False)
    st = _mlp_state(recipe, calibrated)
    caches, st_c = _quantize_weights(args, st, recipe, "fc1+fc2")
    amax1, amax2 = args[3].abs().max().item(), args[5].abs().max().item()
    _, st2 = fp8ops.fused_ln_mlp(*args, st_c, recipe=recipe, activation="gelu", weight_cache=caches)
    assert st2.fc1_weight.pending_amax.item() == amax1 and st2.fc2_weight.pending_amax.item() == amax2
    # given the state from before quantize_weight (same scales: accepted), the op records no amax(W)
    # of a cached weight, and that of the other one
    _, st3 = fp8ops.fused_ln_mlp(*args, st, recipe=recipe, activation="gelu", weight_cache=(None, caches[1]))
    assert st3.fc1_weight.pending_amax.item() == amax1 and st3.fc2_weight.pending_amax.item() == 0.0
    assert st3.fc1_input.pending_amax.item() > 0 and st3.fc2_input.pending_amax.item() > 0


def test_weight_cache_under_autocast_uses_the_weights_as_built():
    """Inside torch.autocast a cached weight is not cast (its cache was built from the FP32 weight)
    and an uncached one is: the same bits as the op on the cast inputs with the FP32 W1's cache."""
    recipe, calibrated = CACHE_CASES["delayed"]
    (x, ln_w, ln_b, w1, b1, w2, b2), dy = _mlp_data(6, 16, 24, "gelu", torch.float32, False)
    w1 = w1.requires_grad_()
    (q1, _), st = _quantize_weights([x, ln_w, ln_b, w1, b1, w2, b2], _mlp_state(recipe, calibrated), recipe, "fc1")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, _ = fp8ops.fused_ln_mlp(x, ln_w, ln_b, w1, b1, w2, b2, st, recipe=recipe, activation="gelu",
                                   weight_cache=(q1, None))
    bf = [t.to(torch.bfloat16) for t in (x, ln_w, ln_b, b1, w2, b2)]
    y_ref, _ = fp8ops.fused_ln_mlp(*bf[:3], w1, *bf[3:], st, recipe=recipe, activation="gelu", weight_cache=(q1, None))
    assert y.dtype == torch.bfloat16 and torch.equal(y, y_ref)
    y.backward(dy.to(y.dtype))
    assert w1.grad.dtype == torch.float32


def test_weight_cache_errors():
    args, _ = _mlp_data(4, 8, 16, "gelu", torch.float32, False)
    x, ln_w, ln_b, w1, b1, w2, b2 = args
    st0 = _mlp_state(DELAYED, True)
    (q1, q2), st = _quantize_weights(args, st0, DELAYED, "fc1+fc2")

    def call(cache, state=st, recipe=DELAYED, weights=(w1, w2)):
        return fp8ops.fused_ln_mlp(x, ln_w, ln_b, weights[0], b1, weights[1], b2, state, recipe=recipe,
                                   weight_cache=cache)

    def fix(i):
        return rf"rebuild it with quantize_weight\(fc{i}_weight, state\.fc{i}_weight, recipe=\.\.\.\)"

    stale = fp8ops.update(st, recipe=DELAYED)
    cases = [
        (dict(cache=(q1, q2), state=None, recipe=None), ValueError,
         "weight_cache is only meaningful with FP8 .* pass weight_cache=None"),
        (dict(cache=q1), TypeError, r"weight_cache must be a pair \(fc1's, fc2's\) of WeightCache .*got WeightCache$"),
        (dict(cache=(q1, q2, None)), TypeError, r"weight_cache must be a pair .*got tuple of length 3"),
        (dict(cache=(object(), None)), TypeError, r"weight_cache\[0\] must be a WeightCache from quantize_weight"),
        (dict(cache=(None, q2), recipe=DelayedScaling(amax_history_len=4, margin=1)), ValueError,
         r"weight_cache\[1\] was built with another recipe .*; " + fix(2)),
        (dict(cache=(q1, q2), state=stale.replace(fc2_weight=st.fc2_weight)), ValueError,
         r"weight_cache\[0\] was built with another weight state \(stale after fp8ops\.update\?\); " + fix(1)),
        (dict(cache=(q1, q2), state=stale.replace(fc1_weight=st.fc1_weight)), ValueError,
         r"weight_cache\[1\] was built with another weight state \(stale after fp8ops\.update\?\); " + fix(2)),
        (dict(cache=(q2, q1), state=st.replace(fc1_weight=st.fc2_weight, fc2_weight=st.fc1_weight)), ValueError,
         r"weight_cache\[0\] holds a \(8, 16\) weight, expected \(16, 8\) \(fc1_weight's shape\)"),
        (dict(cache=(q1, q2), weights=(w1, w2.clone())), ValueError,
         r"weight_cache\[1\] was built from another weight tensor than fc2_weight; " + fix(2)),
    ]
    for kw, exc, match in cases:
        with pytest.raises(exc, match="^fused_ln_mlp: " + match):
            call(**kw)
    # None entries, or no cache: the weights are quantized in the op
    y, _ = call((None, None))
    assert torch.equal(y, call(None)[0]) and torch.equal(y, call((q1, q2))[0])


def test_weight_cache_under_func_grad_and_compile():
    """The caches pass through torch.func.grad (the weights wrapped by the transform are still
    theirs) and torch.compile(fullgraph=True), forward and backward, with the eager results."""
    params, x = _mlp_params()
    w1, w2 = params["w1"].requires_grad_(), params["w2"].requires_grad_()
    st = _mlp_state(DELAYED, True)
    (q1, q2), st = _quantize_weights([x, None, None, w1, None, w2], st, DELAYED, "fc1+fc2")

    def loss(x, w1, w2, st, caches, probes):
        y, _ = fp8ops.fused_ln_mlp(x, params["g"], params["beta"], w1, params["b1"], w2, params["b2"], st,
                                   recipe=DELAYED, activation="swiglu", grad_probe=probes, weight_cache=caches)
        return (y.float() ** 2).sum()

    compiled = torch.compile(loss, backend="aot_eager", fullgraph=True)
    grads = []
    for fn in (loss, compiled):
        xl, p = x.clone().requires_grad_(), torch.zeros(2, requires_grad=True)
        fn(xl, w1, w2, st, (q1, q2), p).backward()
        grads.append((xl.grad, w1.grad, w2.grad, p.grad))
        w1.grad = w2.grad = None
    grads.append(torch.func.grad(lambda *a: loss(a[0], a[1], a[2], st, (q1, q2), a[3]), argnums=(0, 1, 2, 3))(
        x, w1, w2, torch.zeros(2)))
    for name, a, c, f in zip(["dx", "dw1", "dw2", "probe"], *grads):
        assert torch.equal(a, c) and torch.equal(a, f), name


# ------------------------------------------------------------------------------------------------
# residual=: the norm kernel adds the residual stream and returns s = x + residual


def _residual_case(dtype, seed=5):
    args, dy = _mlp_data(12, 16, 24, "gelu_tanh", dtype, False, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    r = (torch.randn(12, 16, generator=g) * 3).to(dtype)
    ds = (torch.randn(12, 16, generator=g) * 1e-2).to(dtype)
    return args, r, dy, ds


@pytest.mark.parametrize("rname", list(RECIPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_residual_equals_the_add_in_front_with_every_gradient(rname, dtype):
    """fused_ln_mlp(x, ..., residual=r) returns (y, s) with s = x + r as torch adds it and y the op
    on s, bit for bit; x and r get the gradient of s: dy through the MLP and norm plus ds, the
    gradient that reached s directly."""
    recipe = RECIPES[rname]
    args, r, dy, ds = _residual_case(dtype)
    st = _mlp_state(recipe, True)
    outs = []
    for fused in (True, False):
        leaves = [_leaf(t) for t in args]
        rl = r.clone().requires_grad_()
        p = fp8ops.make_probes(st) if st is not None else None
        if fused:
            (y, s), st2 = fp8ops.fused_ln_mlp(*leaves, st, recipe=recipe, grad_probe=p, residual=rl)
        else:
            s = leaves[0] + rl
            y, st2 = fp8ops.fused_ln_mlp(s, *leaves[1:], st, recipe=recipe, grad_probe=p)
        torch.autograd.backward([y, s], [dy, ds])
        outs.append((y.detach(), s.detach(), [t.grad for t in leaves if t is not None], rl.grad,
                     None if p is None else p.grad, st2))
    (y1, s1, g1, r1, p1, st1), (y0, s0, g0, r0, p0, st0) = outs
    assert torch.equal(s1, s0) and torch.equal(y1, y0)
    # the fused backward adds ds to the norm's dx in fp32 and rounds once; the unfused one rounds
    # the norm's dx first, then adds in x's dtype
    tol = 0 if dtype == torch.float32 and recipe is None else (1e-6 if dtype == torch.float32 else 1e-2)
    assert torch.equal(g1[0], r1), "x and the residual share the gradient of s"
    assert rel_error(g1[0], g0[0]) <= max(tol, 1e-6), rel_error(g1[0], g0[0])
    for a, b in zip(g1[1:], g0[1:]):
        assert torch.equal(a, b)
    if recipe is not None:
        assert torch.equal(p1, p0)
        assert torch.equal(st1.fc1_input.pending_amax, st0.fc1_input.pending_amax)


def test_residual_sum_is_rounded_once_to_x_dtype():
    """Hand-computed: in bfloat16, 1 + 2^-9 rounds to 1 (8 bits of mantissa), 1 + 3 * 2^-9 to
    1 + 2^-7 (round half to even at 1.5 ulps), and s carries those values."""
    x = torch.tensor([[1.0, 1.0, 256.0, -3.0]], dtype=torch.bfloat16)
    r = torch.tensor([[2.0**-9, 3 * 2.0**-9, 1.0, 0.5]], dtype=torch.bfloat16)
    K = 4
    args = [x, torch.ones(K, dtype=torch.bfloat16), torch.zeros(K, dtype=torch.bfloat16),
            torch.eye(K, dtype=torch.bfloat16), None, torch.eye(K, dtype=torch.bfloat16), None]
    (y, s), _ = fp8ops.fused_ln_mlp(*args, None, recipe=None, activation="relu", residual=r)
    assert s.tolist() == [[1.0, 1.0 + 2.0**-7, 256.0, -2.5]]
    want, _ = fp8ops.fused_ln_mlp(s, *args[1:], None, recipe=None, activation="relu")
    assert torch.equal(y, want)


def test_residual_only_s_used_passes_its_gradient_and_observes_nothing():
    """With y unused, x and the residual get ds unchanged and the probe gets no gradient (an
    update must not see a zero observation)."""
    args, r, _, ds = _residual_case(torch.float32)
    st = _mlp_state(DELAYED, True)
    x, rl = args[0].clone().requires_grad_(), r.clone().requires_grad_()
    p = fp8ops.make_probes(st)
    (y, s), _ = fp8ops.fused_ln_mlp(x, *args[1:], st, recipe=DELAYED, grad_probe=p, residual=rl)
    s.backward(ds)
    assert torch.equal(x.grad, ds) and torch.equal(rl.grad, ds)
    assert p.grad is None


@pytest.mark.parametrize("drop", [0.0, 0.3], ids=["plain", "residual_dropout"])
def test_residual_under_func_grad_and_compile_matches_eager(drop):
    args, r, dy, ds = _residual_case(torch.float32)
    st = _mlp_state(DELAYED, True)
    seed = torch.tensor(77)

    def loss(x, res):
        (y, s), _ = fp8ops.fused_ln_mlp(x, *args[1:], st, recipe=DELAYED, residual=res, residual_dropout=drop,
                                        dropout_seed=seed)
        return (y * dy).sum() + (s * ds).sum()

    x, rl = args[0].clone().requires_grad_(), r.clone().requires_grad_()
    loss(x, rl).backward()
    gx, gr = torch.func.grad(loss, argnums=(0, 1))(args[0], r)
    assert torch.equal(gx, x.grad) and torch.equal(gr, rl.grad)
    torch._dynamo.reset()
    x2, r2 = args[0].clone().requires_grad_(), r.clone().requires_grad_()
    torch.compile(loss, fullgraph=True, backend="aot_eager")(x2, r2).backward()
    assert torch.equal(x2.grad, x.grad) and torch.equal(r2.grad, rl.grad)


@pytest.mark.parametrize("bad, match", [
    (lambda x: x[:, :-1], r"residual must have x's shape \(12, 16\), got \(12, 15\)"),
    (lambda x: x.double(), "residual must be float32, bfloat16 or float16, got torch.float64"),
    (lambda x: x.bfloat16(), "residual must have x's dtype torch.float32, got torch.bfloat16"),
    (lambda x: "x", "residual must be a torch.Tensor, got str"),
])
def test_residual_errors(bad, match):
    args, r, _, _ = _residual_case(torch.float32)
    with pytest.raises((TypeError, ValueError), match=f"fused_ln_mlp: {match}"):
        fp8ops.fused_ln_mlp(*args, None, recipe=None, residual=bad(r))


# ------------------------------------------------------------------------------------------------
# residual_dropout=: x dropped before the residual add, inside the norm kernel


@pytest.mark.parametrize("rname", list(RECIPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_residual_dropout_is_the_op_on_the_dropped_input_with_every_gradient(rname, dtype):
    """fused_ln_mlp(x, residual=r, residual_dropout=p) is the op on x' = x * scale (scale the
    norm's mask: 0 where dropped, 1 / (1 - p) where kept) with residual r: the same y, s and
    gradients of r and every weight, and x's gradient is x''s times scale."""
    recipe = RECIPES[rname]
    args, r, dy, ds = _residual_case(dtype)
    st = _mlp_state(recipe, True)
    p, seed = 0.4, 31
    scale = fp8ops.reference.norm.branch_scale(torch.tensor(seed), 12, 16, p)
    assert 0.2 < float((scale == 0).float().mean()) < 0.6 and set(scale.unique().tolist()) == {0.0, float(torch.tensor(1 / 0.6))}
    outs = []
    for fused in (True, False):
        leaves = [_leaf(t) for t in args]
        rl = r.clone().requires_grad_()
        pr = fp8ops.make_probes(st) if st is not None else None
        if fused:
            (y, s), st2 = fp8ops.fused_ln_mlp(*leaves, st, recipe=recipe, grad_probe=pr, residual=rl,
                                              residual_dropout=p, dropout_seed=seed)
        else:
            xd = (leaves[0].float() * scale).to(dtype)  # exact in float32; in bf16 x * scale rounds once more
            (y, s), st2 = fp8ops.fused_ln_mlp(xd, *leaves[1:], st, recipe=recipe, grad_probe=pr, residual=rl)
        torch.autograd.backward([y, s], [dy, ds])
        outs.append((y.detach(), s.detach(), [t.grad for t in leaves if t is not None], rl.grad,
                     None if pr is None else pr.grad))
    (y1, s1, g1, r1, p1), (y0, s0, g0, r0, p0) = outs
    if dtype == torch.float32:
        assert torch.equal(s1, s0) and torch.equal(y1, y0) and torch.equal(r1, r0)
        for a, b in zip(g1[1:], g0[1:]):
            assert torch.equal(a, b)
        if recipe is not None:
            assert torch.equal(p1, p0)
        torch.testing.assert_close(g1[0], g0[0], rtol=1e-6, atol=0)
    else:
        assert rel_error(s1, s0) <= 1e-2 and rel_error(y1, y0) <= 3e-2 and rel_error(r1, r0) <= 3e-2
    assert bool((g1[0][scale == 0] == 0).all()) and bool((g1[0][scale != 0] != 0).all())
    # x's gradient is the residual's times the mask's factor (in bf16 both are rounded from the
    # same float32 value: within one rounding of each other)
    rtol = 0 if dtype == torch.float32 else 2.0**-7
    torch.testing.assert_close(g1[0].float(), r1.float() * scale, rtol=rtol, atol=0)


def test_residual_dropout_matches_the_fp32_reference_of_the_whole_op():
    """Forward and every gradient against a float32 autograd reference written out here: s = x *
    keep / (1 - p) + r with the reference mask, then LayerNorm, fc1, gelu_tanh, fc2."""
    args, r, dy, ds = _residual_case(torch.float32, seed=9)
    p = 0.15
    leaves = [_leaf(t) for t in args]
    rl = r.clone().requires_grad_()
    (y, s), _ = fp8ops.fused_ln_mlp(*leaves, None, recipe=None, residual=rl, residual_dropout=p, dropout_seed=-5)
    torch.autograd.backward([y, s], [dy, ds])
    ref = [_leaf(t) for t in args]
    rr = r.clone().requires_grad_()
    x, ln_w, ln_b, w1, b1, w2, b2 = ref
    keep = fp8ops.reference.norm.branch_keep(torch.tensor(-5), 12, 16, p)
    sr = torch.where(keep, x / (1 - p), 0.0) + rr
    h = torch.nn.functional.gelu(torch.nn.functional.linear(
        torch.nn.functional.layer_norm(sr, (16,), ln_w, ln_b, 1e-5), w1, b1), approximate="tanh")
    yr = torch.nn.functional.linear(h, w2, b2)
    torch.autograd.backward([yr, sr], [dy, ds])
    torch.testing.assert_close(s, sr, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(y, yr, rtol=1e-5, atol=1e-5)
    for a, b in zip([*leaves, rl], [*ref, rr]):
        if a is not None:
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-5)


def test_residual_dropout_rate_seeds_and_generator():
    M, K = 256, 64
    x, r = torch.ones(M, K), torch.zeros(M, K)
    args = [torch.ones(K), torch.zeros(K), torch.eye(K), None, torch.eye(K), None]

    def s_of(**kw):
        (_, s), _ = fp8ops.fused_ln_mlp(x, *args, None, recipe=None, activation="relu", residual=r, **kw)
        return s

    s = s_of(residual_dropout=0.25, dropout_seed=3)
    dropped = float((s == 0).float().mean())
    assert abs(dropped - 0.25) < 0.01, dropped  # 16384 draws: 4 standard deviations is 0.0135
    assert set(s.unique().tolist()) == {0.0, float(torch.tensor(1 / 0.75))}
    assert torch.equal(s, s_of(residual_dropout=0.25, dropout_seed=torch.tensor([3])))
    assert not torch.equal(s, s_of(residual_dropout=0.25, dropout_seed=4))
    torch.manual_seed(8)
    a = s_of(residual_dropout=0.25)
    torch.manual_seed(8)
    assert torch.equal(a, s_of(residual_dropout=0.25))
    assert not torch.equal(a, s_of(residual_dropout=0.25))  # the generator moved on
    assert torch.equal(s_of(), x)  # no dropout by default


@pytest.mark.parametrize("kw, match", [
    ({"residual_dropout": 1.0}, r"residual_dropout must be a number in \[0, 1\), got 1.0"),
    ({"residual_dropout": -0.1}, r"residual_dropout must be a number in \[0, 1\)"),
    ({"residual_dropout": "0.1"}, r"residual_dropout must be a number in \[0, 1\), got '0.1'"),
    ({"residual_dropout": 0.1, "dropout_seed": 1.5}, "dropout_seed must be an int, a 1-element integer tensor"),
    ({"residual_dropout": 0.1, "dropout_seed": torch.zeros(2, dtype=torch.int64)}, "1-element integer tensor"),
])
def test_residual_dropout_errors(kw, match):
    args, r, _, _ = _residual_case(torch.float32)
    with pytest.raises((TypeError, ValueError), match=match):
        fp8ops.fused_ln_mlp(*args, None, recipe=None, residual=r, **kw)


def test_residual_dropout_needs_a_residual():
    args, _, _, _ = _residual_case(torch.float32)
    with pytest.raises(ValueError, match="fused_ln_mlp: residual_dropout=0.1 drops x before its residual add; "
                                         "pass residual="):
        fp8ops.fused_ln_mlp(*args, None, recipe=None, residual_dropout=0.1)


def test_residual_dropout_only_s_used_drops_the_gradient_of_x():
    args, r, _, ds = _residual_case(torch.float32)
    x, rl = args[0].clone().requires_grad_(), r.clone().requires_grad_()
    (y, s), _ = fp8ops.fused_ln_mlp(x, *args[1:], None, recipe=None, residual=rl, residual_dropout=0.5,
                                    dropout_seed=2)
    s.backward(ds)
    scale = fp8ops.reference.norm.branch_scale(torch.tensor(2), 12, 16, 0.5)
    assert torch.equal(rl.grad, ds) and torch.equal(x.grad, ds * scale)
