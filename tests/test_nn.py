"""fp8ops.nn modules on CPU: training steps equal the functional API bit for bit, update_scaling
folds probe gradients into the state, state dicts, recipe=None, device/dtype moves."""

import copy

import pytest
import torch
from torch.utils import _pytree as pytree

import fp8ops
import fp8ops.nn as fnn
from fp8ops import CurrentScaling, DelayedScaling
from fp8ops.layernorm_linear import LayerNormLinearState, layernorm_linear
from fp8ops.fused_ln_mlp import LayerNormMLPState, fused_ln_mlp
from fp8ops.reference.transformer_layer import BasicTransformerLayer
from fp8ops.transformer_layer import (
    TransformerConfig,
    init_transformer_state,
    params_from_basic_layer,
    transformer_layer,
)

DELAYED = DelayedScaling(amax_history_len=4)


def _same_states(a, b):
    la, sa = pytree.tree_flatten(a)
    lb, sb = pytree.tree_flatten(b)
    assert sa == sb
    for x, y in zip(la, lb):
        assert torch.equal(x, y)


def _batches(shape, n=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g) * (1 + i) for i in range(n)]


def _train_module(module, batches, micro=1, lr=0.05):
    opt = torch.optim.SGD(module.parameters(), lr=lr)
    for x in batches:
        for part in x.chunk(micro, dim=0):
            module(part).float().square().mean().backward()
        opt.step()
        opt.zero_grad()
        module.update_scaling()
    return module


def _train_functional(params, state, op, batches, recipe, micro=1, lr=0.05):
    """The same loop written against the functional API: probes per forward, max-merged, one update."""
    opt = torch.optim.SGD(params.values(), lr=lr)
    for x in batches:
        grads = []
        for part in x.chunk(micro, dim=0):
            probes = fp8ops.make_probes(state)
            y, state = op(params, part, state, probes)
            y.float().square().mean().backward()
            grads.append(pytree.tree_map(lambda p: p.grad, probes))
        opt.step()
        opt.zero_grad()
        state = fp8ops.update(state, recipe=recipe, grad_amax=fp8ops.merge(*grads))
    return params, state


def _params_of(module):
    return {k: v.detach().clone().requires_grad_() for k, v in module.named_parameters()}


@pytest.mark.parametrize("micro", [1, 2])
def test_linear_matches_functional(micro):
    torch.manual_seed(0)
    m = fnn.Linear(24, 16, recipe=DELAYED)
    params = _params_of(m)
    batches = _batches((4, 24))
    _train_module(m, batches, micro)

    def op(p, x, st, probe):
        return fp8ops.fp8_linear(x, p["weight"], p["bias"], st, recipe=DELAYED, grad_probe=probe)

    params, st = _train_functional(params, fp8ops.LinearState.init(DELAYED), op, batches, DELAYED, micro)
    for k, v in m.named_parameters():
        assert torch.equal(v, params[k]), k
    _same_states(m.fp8_state, st)


def test_layernorm_linear_and_mlp_match_functional():
    torch.manual_seed(1)
    rec = CurrentScaling()
    ln = fnn.LayerNormLinear(32, 48, recipe=rec)
    params = _params_of(ln)
    batches = _batches((2, 5, 32))
    _train_module(ln, batches)

    def op(p, x, st, probe):
        return layernorm_linear(x, p["layer_norm_weight"], p["layer_norm_bias"], p["weight"], p["bias"], st,
                                recipe=rec, grad_probe=probe)

    params, st = _train_functional(params, LayerNormLinearState.init(rec), op, batches, rec)
    for k, v in ln.named_parameters():
        assert torch.equal(v, params[k]), k
    _same_states(ln.fp8_state, st)

    mlp = fnn.LayerNormMLP(32, 40, normalization="RMSNorm", activation="swiglu", bias=False, recipe=DELAYED)
    assert mlp.layer_norm_bias is None and mlp.fc1_weight.shape == (80, 32)
    params = _params_of(mlp)
    _train_module(mlp, batches)

    def op2(p, x, st, probes):
        return fused_ln_mlp(x, p["layer_norm_weight"], None, p["fc1_weight"], None, p["fc2_weight"], None, st,
                            recipe=DELAYED, normalization="RMSNorm", activation="swiglu", grad_probe=probes)

    params, st = _train_functional(params, LayerNormMLPState.init(DELAYED), op2, batches, DELAYED)
    for k, v in mlp.named_parameters():
        assert torch.equal(v, params[k]), k
    _same_states(mlp.fp8_state, st)


def _layer(recipe=DELAYED, **kw):
    cfg = {"hidden_dropout": 0.0, "attention_dropout": 0.0, "num_gqa_groups": 2, "self_attn_mask_type": "causal"}
    cfg.update(kw)
    return fnn.TransformerLayer(32, 64, 4, recipe=recipe, generator=torch.Generator().manual_seed(2), **cfg)


def test_transformer_layer_matches_functional_and_names_match():
    layer = _layer()
    assert list(dict(layer.named_parameters())) == list(layer.config.param_shapes())
    params = _params_of(layer)
    batches = _batches((6, 2, 32), seed=3)
    _train_module(layer, batches)

    def op(p, x, st, probes):
        return transformer_layer(p, x, st, config=layer.config, recipe=DELAYED, probes=probes)

    params, st = _train_functional(params, init_transformer_state(layer.config, DELAYED), op, batches, DELAYED)
    for k, v in layer.named_parameters():
        assert torch.equal(v, params[k]), k
    _same_states(layer.fp8_state, st)


def test_update_scaling_changes_scales_and_drops_probes():
    layer = _layer()
    before = copy.deepcopy(layer.fp8_state)
    x = torch.randn(6, 2, 32)
    layer(x).square().mean().backward()
    assert len(layer._probes) == 1
    assert float(layer.fp8_state["qkv"].input.pending_amax) > 0  # observed, not yet applied
    assert torch.equal(layer.fp8_state["qkv"].input.scale, before["qkv"].input.scale)
    layer.update_scaling()
    assert layer._probes == []
    for key in ("qkv", "proj", "mlp"):
        for role in type(layer.fp8_state[key]).ROLES:
            if role == "fc1_output":  # observed only with recompute="activation"
                continue
            s, s0 = getattr(layer.fp8_state[key], role), getattr(before[key], role)
            assert s.calibrated and not torch.equal(s.scale, s0.scale), (key, role)
            assert float(s.pending_amax) == 0.0
    # forwards without gradients keep no probes
    with torch.no_grad():
        layer(x)
    assert layer._probes == []


def test_update_scaling_over_a_model_and_missing_backward():
    model = torch.nn.Sequential(fnn.Linear(16, 32, recipe=DELAYED), torch.nn.GELU(),
                                fnn.Linear(32, 8, recipe=DELAYED), fnn.Linear(8, 8, recipe=None))
    out = model(torch.randn(4, 16))
    out.sum().backward()
    model(torch.randn(4, 16))  # a forward whose backward never ran: its probes count as "no observation"
    fnn.update_scaling(model)
    assert model[0].fp8_state.grad_output.calibrated and model[2].fp8_state.grad_output.calibrated
    assert model[3].fp8_state is None
    # the output gradient of model[2] is d(sum)/d(out) through model[3]: ones @ W3
    expected = model[3].weight.detach().sum(0).abs().max()
    assert torch.equal(model[2].fp8_state.grad_output.amax_history[0], expected)


def test_state_dicts():
    layer = _layer()
    sd = layer.state_dict()
    assert set(sd) == set(layer.config.param_shapes())
    layer(torch.randn(6, 2, 32)).sum().backward()
    layer.update_scaling()
    flat = layer.scaling_state_dict()
    assert "fp8ops.schema_version" in flat and any(k.startswith("mlp.fc2_grad_output") for k in flat)
    other = _layer()
    other.load_state_dict(sd)
    other.load_scaling_state_dict(flat)
    _same_states(other.fp8_state, layer.fp8_state)
    assert fnn.TransformerLayer(32, 64, 4).scaling_state_dict() == {}


def test_loads_seed_weights_and_matches_seed_without_fp8():
    torch.manual_seed(4)
    seed = BasicTransformerLayer(32, 64, 4, attention_dropout=0.0, hidden_dropout=0.0)
    cfg = TransformerConfig(hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, hidden_dropout=0.0,
                            attention_dropout=0.0)
    layer = fnn.TransformerLayer.from_config(cfg)
    layer.load_state_dict(params_from_basic_layer(seed.state_dict(), cfg))
    x = torch.randn(8, 2, 32)
    torch.testing.assert_close(layer(x), seed(x), rtol=1e-5, atol=1e-5)
    lin = fnn.Linear(32, 8)
    torch.testing.assert_close(lin(x), torch.nn.functional.linear(x, lin.weight, lin.bias), rtol=0, atol=0)


def test_dropout_follows_module_mode_and_dtype_moves_keep_fp32_state():
    layer = _layer(hidden_dropout=0.5, attention_dropout=0.5)
    x = torch.randn(6, 2, 32)
    layer.eval()
    with torch.no_grad():
        a, b = layer(x), layer(x)
    assert torch.equal(a, b)
    layer.train()
    with torch.no_grad():
        c = layer(x)
    assert not torch.equal(a, c)
    layer.to(torch.float64)
    assert layer.qkv.weight.dtype == torch.float64
    assert all(t.dtype == torch.float32 for t in pytree.tree_leaves(layer.fp8_state))


def test_bad_recipe():
    with pytest.raises(TypeError, match="recipe"):
        fnn.Linear(4, 4, recipe="fp8")


def test_transformer_layer_bsh_layout_trains_like_sbh_bitwise():
    """TransformerLayer(layout="bsh") on (B, S, H) batches is the "sbh" layer on the transposed
    batches bit for bit: outputs, gradients, and after several steps parameters and FP8 states."""
    sbh, bsh = _layer(mlp_hidden_dropout=0.0), _layer(layout="bsh")
    assert bsh.layout == "bsh" and sbh.layout == "sbh" and "layout='bsh'" in repr(bsh)
    batches = _batches((6, 2, 32), seed=5)                           # (S, B, H)
    x = batches[0]
    y, yb = sbh(x), bsh(x.transpose(0, 1).contiguous())
    assert yb.shape == (2, 6, 32) and torch.equal(yb, y.transpose(0, 1))
    y.square().mean().backward()
    yb.square().mean().backward()
    for (n, p), (nb, pb) in zip(sbh.named_parameters(), bsh.named_parameters()):
        assert n == nb and torch.equal(p.grad, pb.grad), n
    sbh.zero_grad(), bsh.zero_grad()
    sbh.reset_scaling(), bsh.reset_scaling()
    _train_module(sbh, batches)
    _train_module(bsh, [b.transpose(0, 1).contiguous() for b in batches])
    for (n, p), (_, pb) in zip(sbh.named_parameters(), bsh.named_parameters()):
        assert torch.equal(p, pb), n
    _same_states(bsh.fp8_state, sbh.fp8_state)
    cfg = TransformerConfig(hidden_size=32, ffn_hidden_size=64, num_attention_heads=4)
    assert fnn.TransformerLayer.from_config(cfg, layout="bsh").layout == "bsh"
    with pytest.raises(ValueError, match="TransformerLayer: layout must be 'sbh'"):
        fnn.TransformerLayer(32, 64, 4, layout="bshd")


def test_transformer_layer_mlp_hidden_dropout_follows_module_mode():
    layer = _layer(recipe=None, mlp_hidden_dropout=0.5)
    assert layer.config.mlp_hidden_dropout == 0.5
    x = torch.randn(6, 2, 32)
    base = _layer(recipe=None)
    layer.eval()
    assert torch.equal(layer(x), base(x))                           # eval: no dropout, the same layer
    layer.train()
    assert not torch.equal(layer(x), base(x))                       # only the MLP branch is dropped


@pytest.mark.parametrize("recipe", [None, DelayedScaling()], ids=["hp", "delayed"])
def test_transformer_layers_handing_on_the_residual_equal_the_plain_stack(recipe):
    """Two TransformerLayer modules chained with return_residual / residual= give the plain stack's
    output bit for bit, and its gradients within the one rounding the fused backward saves."""
    def run(chained):
        a, b = _layer(recipe), _layer(recipe)
        with torch.no_grad():  # b differs from a
            for p in b.parameters():
                p.mul_(1.1).add_(0.01)
        x = torch.randn(6, 2, 32, generator=torch.Generator().manual_seed(5), requires_grad=True)
        if chained:
            m, s = a(x, return_residual=True)
            m, s = b(m, residual=s, return_residual=True)
            y = m + s
        else:
            y = b(a(x))
        y.square().sum().backward()
        return y.detach(), x.grad, [p.grad for p in (*a.parameters(), *b.parameters())]

    (y1, dx1, g1), (y0, dx0, g0) = run(True), run(False)
    assert torch.equal(y1, y0)
    torch.testing.assert_close(dx1, dx0, rtol=1e-4, atol=1e-5)
    for u, v in zip(g1, g0):
        torch.testing.assert_close(u, v, rtol=1e-4, atol=1e-5)
