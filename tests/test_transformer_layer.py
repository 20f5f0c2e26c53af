"""transformer_layer on CPU: parity with the seed's BasicTransformerLayer (forward and every
gradient, float32 and bfloat16), the FP32 reference for every config (GQA, causal, padding, packed,
post-norm, RMSNorm + swiglu, unfused QKV), FP8 error budgets, state semantics, dropout, errors, and
the composition canaries (torch.func.grad, torch.compile fullgraph + backward)."""

import copy

import pytest
import torch

import fp8ops
from fp8ops import CurrentScaling, DelayedScaling
from fp8ops.reference import transformer_layer as R
from fp8ops.reference.transformer_layer import BasicTransformerLayer
from fp8ops.testing import assert_close_rule, sqnr
from fp8ops.transformer_layer import (
    TransformerConfig,
    init_transformer_params,
    init_transformer_state,
    params_from_basic_layer,
    transformer_layer,
)

S, B, H, FFN, HEADS = 16, 2, 64, 128, 4
SEED_CFG = TransformerConfig(hidden_size=H, ffn_hidden_size=FFN, num_attention_heads=HEADS,
                             hidden_dropout=0.0, attention_dropout=0.0)


def _seed_layer(seed=0):
    """The seed layer with non-trivial norm weights and biases (so that every gradient is tested)."""
    torch.manual_seed(seed)
    m = BasicTransformerLayer(H, FFN, HEADS, attention_dropout=0.0, hidden_dropout=0.0)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if p.dim() == 1:
                p.copy_(torch.randn_like(p) * 0.1 + (1.0 if n in ("ln1.weight", "ln2.weight") else 0.0))
    return m


def _data(shape=(S, B, H), seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g), torch.randn(*shape, generator=g)


def _leaf(t, dtype=None):
    return t.detach().to(dtype or t.dtype).clone().requires_grad_()


def _run_seed(m, x, dy, dtype, mask=None):
    m = copy.deepcopy(m).to(dtype)
    xx = _leaf(x, dtype)
    y = m(xx, mask)
    y.backward(dy.to(dtype))
    return y.detach(), xx.grad, {n: p.grad for n, p in m.named_parameters()}


def _run_ours(m, x, dy, dtype, cfg=SEED_CFG, recipe=None, state=None, **kw):
    """Our layer on the seed's parameters; gradients land on the seed's tensors (through the converter)."""
    sd = {k: _leaf(v, dtype) for k, v in m.state_dict().items()}
    params = params_from_basic_layer(sd, cfg)
    xx = _leaf(x, dtype)
    probes = fp8ops.make_probes(state) if state is not None else None
    y, st = transformer_layer(params, xx, state, config=cfg, recipe=recipe, probes=probes, **kw)
    y.backward(dy.to(dtype))
    return y.detach(), xx.grad, dict(sd), st, probes


# ------------------------------------------------------------------------------------------------
# Parity with the seed layer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mask", ["none", "causal", "padding"])
def test_matches_seed_layer_forward_and_every_gradient(dtype, mask):
    """err(ours) <= 2 x err(the seed layer in PyTorch at the same precision) + atol, both vs float64."""
    m = _seed_layer()
    x, dy = _data()
    seed_mask, kw, cfg = None, {}, SEED_CFG
    if mask == "causal":
        seed_mask = torch.ones(S, S, dtype=torch.bool).triu(1)  # True = hidden, as the seed
        cfg = attr_evolve(SEED_CFG, self_attn_mask_type="causal")
    elif mask == "padding":
        valid = torch.ones(B, S, dtype=torch.bool)
        valid[0, 11:] = False
        valid[1, 5:] = False
        seed_mask = ~valid[:, None, None, :]
        cfg = attr_evolve(SEED_CFG, self_attn_mask_type="padding")
        kw = {"attention_mask": valid}
    y64, dx64, g64 = _run_seed(m, x, dy, torch.float64, seed_mask)
    yt, dxt, gt = _run_seed(m, x, dy, dtype, seed_mask)
    y, dx, g, st, _ = _run_ours(m, x, dy, dtype, cfg, **kw)
    assert st is None and y.dtype == dtype and y.shape == (S, B, H)
    atol = 1e-6 if dtype == torch.float32 else 1e-3
    assert_close_rule(y, y64, yt, k=2.0, atol=atol, name="y")
    assert_close_rule(dx, dx64, dxt, k=2.0, atol=atol, name="dx")
    assert set(g) == set(g64)
    for name in g64:
        assert_close_rule(g[name].grad, g64[name], gt[name], k=2.0, atol=atol, name=f"d {name}")


def attr_evolve(cfg, **changes):
    import attrs

    return attrs.evolve(cfg, **changes)


def test_converter_layout_and_unfused_qkv():
    m = _seed_layer()
    sd = m.state_dict()
    p = params_from_basic_layer(sd, SEED_CFG)
    d = H // HEADS
    w = sd["qkv_projection.weight"]
    # seed rows per head [q_h | k_h | v_h]; ours [all q | all k | all v]
    for head in range(HEADS):
        for j in range(3):
            assert torch.equal(p["qkv.weight"][j * H + head * d:j * H + (head + 1) * d],
                               w[head * 3 * d + j * d:head * 3 * d + (j + 1) * d])
    assert p["qkv.weight"].data_ptr() != w.data_ptr() and p["ln1.weight"].data_ptr() != sd["ln1.weight"].data_ptr()
    cfg_u = attr_evolve(SEED_CFG, fuse_qkv_params=False)
    pu = params_from_basic_layer(sd, cfg_u)
    assert list(pu) == list(cfg_u.param_shapes())
    x, _ = _data()
    y, _ = transformer_layer(p, x, None, config=SEED_CFG, recipe=None)
    yu, _ = transformer_layer(pu, x, None, config=cfg_u, recipe=None)
    torch.testing.assert_close(yu, y, rtol=0, atol=1e-6)
    torch.testing.assert_close(y, m(x), rtol=0, atol=2e-5)


def test_sdpa_variant_matches_bmm_seed():
    m = _seed_layer()
    s = BasicTransformerLayer(H, FFN, HEADS, attention_dropout=0.0, hidden_dropout=0.0, attention_impl="sdpa")
    s.load_state_dict(m.state_dict())
    x, _ = _data()
    mask = torch.ones(S, S, dtype=torch.bool).triu(1)
    torch.testing.assert_close(s(x, mask), m(x, mask), rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------------
# The reference math for every config


def _small(**kw):
    base = {"hidden_size": 32, "ffn_hidden_size": 48, "num_attention_heads": 4, "hidden_dropout": 0.0,
            "attention_dropout": 0.0}
    base.update(kw)
    return TransformerConfig(**base)


CONFIGS = {
    "gqa_causal": _small(num_gqa_groups=2, self_attn_mask_type="causal"),
    "mqa": _small(num_gqa_groups=1),
    "post_norm": _small(norm_position="post"),
    "rmsnorm_swiglu": _small(normalization="RMSNorm", activation="swiglu", bias=False),
    "unfused_kv_channels": _small(fuse_qkv_params=False, kv_channels=16, num_gqa_groups=2),
    "zero_centered_relu": _small(zero_centered_gamma=True, activation="squared_relu"),
    "post_rms_geglu_causal": _small(norm_position="post", normalization="RMSNorm", activation="geglu",
                                    self_attn_mask_type="causal"),
}


def _random_params(cfg, seed=0):
    g = torch.Generator().manual_seed(seed)
    p = init_transformer_params(cfg, generator=g)
    # non-trivial norms and biases, weights large enough that attention is not uniform
    return {k: (v + 0.1 * torch.randn(v.shape, generator=g) if v.dim() == 1 else v * 8).requires_grad_()
            for k, v in p.items()}


def _grads(fn, params, x, dy):
    pp = {k: _leaf(v) for k, v in params.items()}
    xx = _leaf(x)
    y, _ = fn(pp, xx)
    y.backward(dy)
    return y.detach(), xx.grad, {k: v.grad for k, v in pp.items()}


def _assert_all_close(a, e, rtol=2e-5, atol=2e-5):
    ya, dxa, ga = a
    ye, dxe, ge = e
    torch.testing.assert_close(ya, ye, rtol=rtol, atol=atol)
    torch.testing.assert_close(dxa, dxe, rtol=rtol, atol=atol)
    for k in ge:
        torch.testing.assert_close(ga[k], ge[k], rtol=rtol, atol=atol, msg=lambda m, k=k: f"d params[{k!r}]: {m}")


@pytest.mark.parametrize("name", list(CONFIGS))
def test_configs_match_reference(name):
    cfg = CONFIGS[name]
    params = _random_params(cfg)
    assert {k: tuple(v.shape) for k, v in params.items()} == cfg.param_shapes()
    x, dy = _data((12, 2, 32))
    got = _grads(lambda p, x: transformer_layer(p, x, None, config=cfg, recipe=None, training=False), params, x, dy)
    ref = _grads(lambda p, x: R.transformer_layer(p, x, config=cfg), params, x, dy)
    _assert_all_close(got, ref)


def test_padding_mask_matches_reference_and_ignores_padded_keys():
    cfg = _small(num_gqa_groups=2, self_attn_mask_type="padding_causal")
    params = _random_params(cfg)
    x, dy = _data((10, 3, 32))
    valid = torch.ones(3, 10, dtype=torch.bool)
    valid[1, 6:] = False
    valid[2, 1:] = False
    fn = lambda p, x: transformer_layer(p, x, None, config=cfg, recipe=None, attention_mask=valid)
    got = _grads(fn, params, x, dy)
    ref = _grads(lambda p, x: R.transformer_layer(p, x, config=cfg, attention_mask=valid), params, x, dy)
    _assert_all_close(got, ref)
    # changing padded tokens does not change valid tokens' outputs
    x2 = x.clone()
    x2[6:, 1] = 100.0
    y2, _ = transformer_layer(params, x2, None, config=cfg, recipe=None, attention_mask=valid)
    torch.testing.assert_close(y2[:6, 1], got[0][:6, 1], rtol=1e-5, atol=1e-5)


def test_packed_sequences_equal_separate_runs():
    cfg = _small(num_gqa_groups=2, self_attn_mask_type="causal")
    params = _random_params(cfg)
    lens = [5, 9, 2]
    seqs = [_data((n, 1, 32), seed=10 + i)[0] for i, n in enumerate(lens)]
    cu = torch.tensor([0, 5, 14, 16], dtype=torch.int32)
    packed = torch.cat([s[:, 0] for s in seqs])
    y, _ = transformer_layer(params, packed, None, config=cfg, recipe=None, cu_seqlens=cu, max_seqlen=9)
    assert y.shape == (16, 32)
    for i, s in enumerate(seqs):
        yi, _ = transformer_layer(params, s, None, config=cfg, recipe=None)
        torch.testing.assert_close(y[cu[i]:cu[i + 1]], yi[:, 0], rtol=1e-5, atol=1e-5)
    yr, _ = R.transformer_layer(params, packed, config=cfg, cu_seqlens=cu)
    torch.testing.assert_close(y, yr, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------------
# FP8


def _fp8_run(recipe, steps=2):
    """A few steps of the seed layer's parameters in FP8 (the last one with calibrated delayed scales)."""
    m = _seed_layer()
    state = init_transformer_state(SEED_CFG, recipe)
    for i in range(steps):
        x, dy = _data(seed=1 + (i + 1) % steps)  # the measured step (last) uses seed 1
        y, dx, g, state, probes = _run_ours(m, x, dy, torch.float32, SEED_CFG, recipe, state)
        measured = (y, dx, g, state)
        state = fp8ops.update(state, recipe=recipe, grad_amax={k: p.grad for k, p in probes.items()})
    return m, measured, state


@pytest.mark.parametrize("recipe", [DelayedScaling(amax_history_len=4), CurrentScaling()], ids=["delayed", "current"])
def test_fp8_within_error_budget_of_fp32(recipe):
    """SQNR floors vs the unquantized layer: E4M3 forward operands (~30 dB each), E5M2 gradients."""
    m, (y, dx, g, st), st_after = _fp8_run(recipe)
    x, dy = _data()
    y32, dx32, g32, _, _ = _run_ours(m, x, dy, torch.float32)
    assert sqnr(y, y32) > 30.0, sqnr(y, y32)
    assert sqnr(dx, dx32) > 25.0, sqnr(dx, dx32)
    for k in g32:
        assert sqnr(g[k].grad, g32[k].grad) > 15.0, (k, sqnr(g[k].grad, g32[k].grad))
    # the FP8 path really quantized: not bit-equal to the unquantized layer
    assert not torch.equal(y, y32)
    # every role observed something and every scale is calibrated after the updates
    for key in ("qkv", "proj", "mlp"):
        for role in type(st[key]).ROLES:
            if role == "fc1_output":  # observed only with recompute="activation"
                continue
            assert float(getattr(st[key], role).pending_amax) > 0 or role.endswith("grad_output"), (key, role)
            s = getattr(st_after[key], role)
            assert s.calibrated and float(s.pending_amax) == 0.0 and float(s.scale) > 0


def test_state_update_changes_scales_and_round_trips():
    recipe = DelayedScaling(amax_history_len=4)
    _, _, st = _fp8_run(recipe, steps=1)
    fresh = init_transformer_state(SEED_CFG, recipe)
    assert float(st["proj"].input.scale) != float(fresh["proj"].input.scale)
    assert float(st["mlp"].fc2_grad_output.amax_history[0]) > 0
    flat = fp8ops.state_dict(st)
    back = fp8ops.load_state_dict(fresh, flat)
    for a, b in zip(torch.utils._pytree.tree_leaves(back), torch.utils._pytree.tree_leaves(st)):
        assert torch.equal(a, b)
    assert back["mlp"].fc1_input.calibrated


def test_input_state_is_not_modified_and_no_probe_path_runs():
    recipe = DelayedScaling()
    st = init_transformer_state(SEED_CFG, recipe)
    before = [t.clone() for t in torch.utils._pytree.tree_leaves(st)]
    params = params_from_basic_layer(_seed_layer().state_dict(), SEED_CFG)
    x, _ = _data()
    _, st2 = transformer_layer(params, x, st, config=SEED_CFG, recipe=recipe)  # no probes: current-scaled grads
    for a, b in zip(torch.utils._pytree.tree_leaves(st), before):
        assert torch.equal(a, b)
    assert float(st2["qkv"].input.pending_amax) > 0 and set(st2) == {"qkv", "proj", "mlp"}


# ------------------------------------------------------------------------------------------------
# Dropout


def test_dropout_follows_training_flag_and_seeds():
    cfg = _small(hidden_dropout=0.3, attention_dropout=0.3)
    cfg0 = _small()
    params = _random_params(cfg)
    x, _ = _data((8, 2, 32))
    y_eval, _ = transformer_layer(params, x, None, config=cfg, recipe=None, training=False)
    y_nodrop, _ = transformer_layer(params, x, None, config=cfg0, recipe=None)
    assert torch.equal(y_eval, y_nodrop)
    torch.manual_seed(5)
    y1, _ = transformer_layer(params, x, None, config=cfg, recipe=None, dropout_seed=7)
    torch.manual_seed(5)
    y2, _ = transformer_layer(params, x, None, config=cfg, recipe=None, dropout_seed=7)
    torch.manual_seed(6)
    y3, _ = transformer_layer(params, x, None, config=cfg, recipe=None, dropout_seed=7)
    assert torch.equal(y1, y2) and not torch.equal(y1, y_eval) and not torch.equal(y1, y3)
    # attention dropout alone: the seed changes the output, the hidden generator does not matter
    cfg_a = _small(attention_dropout=0.3)
    ya, _ = transformer_layer(params, x, None, config=cfg_a, recipe=None, dropout_seed=1)
    yb, _ = transformer_layer(params, x, None, config=cfg_a, recipe=None, dropout_seed=1)
    yc, _ = transformer_layer(params, x, None, config=cfg_a, recipe=None, dropout_seed=2)
    assert torch.equal(ya, yb) and not torch.equal(ya, yc)


def test_mlp_hidden_dropout_drops_the_mlp_branch_like_the_reference():
    """mlp_hidden_dropout (GPT-2 style: both residual branches dropped) follows training and matches
    the reference under the same generator state; the default (0) leaves the layer bit for bit as before."""
    cfg0 = _small()
    assert cfg0.mlp_hidden_dropout == 0.0
    params = _random_params(cfg0)
    x, dy = _data((8, 2, 32))
    # default unchanged: an explicit 0 and the default are the same layer, dropout or not
    for training in (True, False):
        cfg_h = _small(hidden_dropout=0.3)
        torch.manual_seed(3)
        ya, _ = transformer_layer(params, x, None, config=cfg_h, recipe=None, training=training)
        torch.manual_seed(3)
        yb, _ = transformer_layer(params, x, None, config=_small(hidden_dropout=0.3, mlp_hidden_dropout=0.0),
                                  recipe=None, training=training)
        assert torch.equal(ya, yb)
    for norm_position in ("pre", "post"):
        cfg = _small(hidden_dropout=0.2, mlp_hidden_dropout=0.4, norm_position=norm_position)
        y_eval, _ = transformer_layer(params, x, None, config=cfg, recipe=None, training=False)
        y_off, _ = transformer_layer(params, x, None, config=_small(norm_position=norm_position), recipe=None)
        assert torch.equal(y_eval, y_off)

        def ours(p, xx, cfg=cfg):
            torch.manual_seed(11)
            return transformer_layer(p, xx, None, config=cfg, recipe=None, training=True)

        def ref(p, xx, cfg=cfg):
            torch.manual_seed(11)
            return R.transformer_layer(p, xx, config=cfg, training=True)

        _assert_all_close(_grads(ours, params, x, dy), _grads(ref, params, x, dy))
        # the MLP branch is dropped: not the layer with hidden dropout alone (same generator state)
        torch.manual_seed(11)
        y_h, _ = transformer_layer(params, x, None, config=attr_evolve(cfg, mlp_hidden_dropout=0.0), recipe=None)
        assert not torch.equal(ours(params, x)[0], y_h)
    # pre-norm, p -> 1: almost every MLP output is dropped, so y == s (the first residual) there
    cfg = _small(mlp_hidden_dropout=0.999)
    torch.manual_seed(0)
    y, _ = transformer_layer(params, x, None, config=cfg, recipe=None)
    # s = x + proj(attn): the reference with the MLP removed (fc2 weight and bias zeroed)
    p_zero = {k: (torch.zeros_like(v) if k.startswith("fc2.") else v) for k, v in params.items()}
    s_ref, _ = R.transformer_layer(p_zero, x, config=_small())
    kept = (y - s_ref).abs() > 1e-4
    assert kept.float().mean() < 0.01
    torch.testing.assert_close(y[~kept], s_ref[~kept], rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------------
# Batch-first layout


def _layout_run(params, x, dy, cfg, recipe, layout, **kw):
    pp = {k: _leaf(v) for k, v in params.items()}
    xx = _leaf(x)
    state = init_transformer_state(cfg, recipe) if recipe is not None else None
    probes = fp8ops.make_probes(state) if state is not None else None
    torch.manual_seed(4)
    y, st = transformer_layer(pp, xx, state, config=cfg, recipe=recipe, probes=probes, layout=layout,
                              dropout_seed=9, **kw)
    y.backward(dy)
    pg = None if probes is None else {k: v.grad for k, v in probes.items()}
    return y.detach(), xx.grad, {k: v.grad for k, v in pp.items()}, st, pg


@pytest.mark.parametrize("recipe", [None, DelayedScaling(), CurrentScaling()], ids=["hp", "delayed", "current"])
@pytest.mark.parametrize("case", ["plain", "gqa_causal_dropout", "padding_post"])
def test_bsh_layout_is_sbh_transposed_bitwise(recipe, case):
    cfg, kw = _small(), {}
    if case == "gqa_causal_dropout":
        cfg = _small(num_gqa_groups=2, self_attn_mask_type="causal", hidden_dropout=0.2, attention_dropout=0.2,
                     mlp_hidden_dropout=0.1)
    elif case == "padding_post":
        cfg = _small(self_attn_mask_type="padding", norm_position="post")
        valid = torch.ones(2, 8, dtype=torch.bool)
        valid[1, 5:] = False
        kw = {"attention_mask": valid}
    params = _random_params(cfg)
    x, dy = _data((8, 2, 32))                                     # (S, B, H)
    y, dx, g, st, pg = _layout_run(params, x, dy, cfg, recipe, "sbh", **kw)
    xb, dyb = x.transpose(0, 1).contiguous(), dy.transpose(0, 1).contiguous()   # (B, S, H)
    yb, dxb, gb, stb, pgb = _layout_run(params, xb, dyb, cfg, recipe, "bsh", **kw)
    assert yb.shape == (2, 8, 32)
    assert torch.equal(yb, y.transpose(0, 1)) and torch.equal(dxb, dx.transpose(0, 1))
    for k in g:
        assert torch.equal(gb[k], g[k]), k
    if recipe is not None:
        _same_tree(stb, st)
        _same_tree(pgb, pg)


def _same_tree(a, b):
    from torch.utils import _pytree as pytree

    la, sa = pytree.tree_flatten(a)
    lb, sb = pytree.tree_flatten(b)
    assert sa == sb
    for u, v in zip(la, lb):
        assert torch.equal(u, v)


def test_bsh_layout_matches_reference_and_checks_the_argument():
    cfg = _small(num_gqa_groups=2, self_attn_mask_type="causal")
    params = _random_params(cfg)
    x, dy = _data((2, 12, 32))                                    # (B, S, H)
    got = _grads(lambda p, xx: transformer_layer(p, xx, None, config=cfg, recipe=None, layout="bsh"), params, x, dy)
    ref = _grads(lambda p, xx: R.transformer_layer(p, xx, config=cfg, layout="bsh"), params, x, dy)
    _assert_all_close(got, ref)
    # the reference's own bsh is its sbh transposed
    r_sbh, _ = R.transformer_layer(params, x.transpose(0, 1), config=cfg)
    assert torch.equal(R.transformer_layer(params, x, config=cfg, layout="bsh")[0], r_sbh.transpose(0, 1))
    for bad in ("bshd", "BSH", None):
        with pytest.raises(ValueError, match="layout must be 'sbh'.*'bsh'"):
            transformer_layer(params, x, None, config=cfg, recipe=None, layout=bad)
    with pytest.raises(ValueError, match=r"layout='bsh', x must be \(B, S, H\)"):
        transformer_layer(params, x[..., :16], None, config=cfg, recipe=None, layout="bsh")


# ------------------------------------------------------------------------------------------------
# Errors


def _ok():
    cfg = _small()
    return cfg, init_transformer_params(cfg), torch.randn(4, 2, 32)


def test_param_errors_name_the_key_and_shape():
    cfg, p, x = _ok()
    bad = dict(p)
    del bad["fc1.bias"]
    with pytest.raises(ValueError, match=r"missing \['fc1.bias'\]"):
        transformer_layer(bad, x, None, config=cfg, recipe=None)
    bad = dict(p, **{"proj.weight": torch.zeros(32, 16)})
    with pytest.raises(ValueError, match=r"params\['proj.weight'\] must have shape \(32, 32\), got \(32, 16\)"):
        transformer_layer(bad, x, None, config=cfg, recipe=None)
    with pytest.raises(ValueError, match=r"unexpected \['ln1.bias', 'ln2.bias'\]"):
        transformer_layer(p, x, None, config=attr_evolve(cfg, normalization="RMSNorm"), recipe=None)


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        ({"x": torch.randn(4, 32)}, ValueError, r"x must be \(S, B, H\)"),
        ({"x": torch.randn(4, 2, 16)}, ValueError, r"\(S, B, 32\)"),
        ({"x": torch.randn(4, 2, 32).long()}, ValueError, "x must be float32"),
        ({"state": "s"}, ValueError, "state given with recipe=None"),
        ({"recipe": DelayedScaling(), "state": {"qkv": None}}, ValueError, "init_transformer_state"),
        ({"attention_mask": torch.ones(2, 4, dtype=torch.bool)}, ValueError, "use 'padding'"),
        ({"config": "cfg"}, TypeError, "TransformerConfig"),
        ({"cu_seqlens": torch.tensor([0, 4], dtype=torch.int32)}, ValueError, r"packed tokens \(T, H\)"),
    ],
)
def test_input_errors(kwargs, exc, match):
    cfg, p, x = _ok()
    args = {"x": x, "state": None, "config": cfg, "recipe": None}
    args.update(kwargs)
    with pytest.raises(exc, match=match):
        transformer_layer(p, args.pop("x"), args.pop("state"), **args)


def test_padding_needs_a_mask_of_the_right_shape():
    cfg = _small(self_attn_mask_type="padding")
    p, x = init_transformer_params(cfg), torch.randn(4, 2, 32)
    with pytest.raises(ValueError, match="pass attention_mask"):
        transformer_layer(p, x, None, config=cfg, recipe=None)
    with pytest.raises(ValueError, match=r"\(B, S\) = \(2, 4\) bool"):
        transformer_layer(p, x, None, config=cfg, recipe=None, attention_mask=torch.ones(4, 2, dtype=torch.bool))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"hidden_size": 30}, "multiple of num_attention_heads"),
        ({"num_gqa_groups": 3}, "multiple of num_gqa_groups"),
        ({"activation": "tanh"}, "activation must be one of"),
        ({"normalization": "BatchNorm"}, "normalization"),
        ({"hidden_dropout": 1.0}, r"hidden_dropout must be a number in \[0, 1\)"),
        ({"layernorm_epsilon": 0.0}, "layernorm_epsilon"),
        ({"self_attn_mask_type": "arbitrary"}, "self_attn_mask_type"),
        ({"ffn_hidden_size": 0}, "ffn_hidden_size must be a positive int"),
    ],
)
def test_config_errors(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        _small(**kwargs)


def test_config_is_hashable_and_converter_checks_layout():
    assert hash(_small()) == hash(_small()) and _small() == _small()
    with pytest.raises(ValueError, match="no GQA"):
        params_from_basic_layer(_seed_layer().state_dict(), attr_evolve(SEED_CFG, num_gqa_groups=2))
    sd = dict(_seed_layer().state_dict())
    del sd["mlp.linear2.bias"]
    with pytest.raises(KeyError, match="mlp.linear2.bias"):
        params_from_basic_layer(sd, SEED_CFG)


# ------------------------------------------------------------------------------------------------
# Composition canaries

CANARY_CFG = _small(num_gqa_groups=2, self_attn_mask_type="causal")
DELAYED = DelayedScaling(amax_history_len=4)


def _loss(params, probes, x, st):
    y, st2 = transformer_layer(params, x, st, config=CANARY_CFG, recipe=DELAYED, probes=probes)
    return y.float().square().mean(), st2


def _canary_case():
    params = _random_params(CANARY_CFG, seed=3)
    params = {k: v.detach() for k, v in params.items()}
    x = _data((8, 2, 32), seed=4)[0]
    return params, x, init_transformer_state(CANARY_CFG, DELAYED)


def _eager(params, x, st):
    pp = {k: _leaf(v) for k, v in params.items()}
    probes = fp8ops.make_probes(st)
    loss, st2 = _loss(pp, probes, x, st)
    loss.backward()
    return loss.detach(), {k: v.grad for k, v in pp.items()}, {k: v.grad for k, v in probes.items()}, st2


def test_torch_func_grad_over_params_equals_eager():
    params, x, st = _canary_case()
    _, g, gp, st2 = _eager(params, x, st)
    (fg, fgp), fst = torch.func.grad(_loss, argnums=(0, 1), has_aux=True)(
        params, fp8ops.make_probes(st, requires_grad=False), x, st)
    for k in g:
        assert torch.equal(fg[k], g[k]), k
    for k in gp:
        assert torch.equal(fgp[k], gp[k]), k
    assert torch.equal(fst["mlp"].fc2_input.pending_amax, st2["mlp"].fc2_input.pending_amax)


def test_compile_fullgraph_backward_equals_eager():
    params, x, st = _canary_case()
    loss, g, gp, st2 = _eager(params, x, st)
    torch._dynamo.reset()
    compiled = torch.compile(_loss, fullgraph=True, backend="aot_eager")
    pp = {k: _leaf(v) for k, v in params.items()}
    probes = fp8ops.make_probes(st)
    closs, cst = compiled(pp, probes, x, st)
    closs.backward()
    torch.testing.assert_close(closs.detach(), loss, rtol=1e-6, atol=0)
    for k in g:
        torch.testing.assert_close(pp[k].grad, g[k], rtol=1e-5, atol=1e-6)
    for k in gp:
        torch.testing.assert_close(probes[k].grad, gp[k], rtol=1e-6, atol=0)
    assert torch.equal(cst["qkv"].input.pending_amax, st2["qkv"].input.pending_amax)


def test_training_loop_with_updates_learns():
    """Three steps of SGD in FP8 with probes and update: the loss goes down, scales stay finite."""
    cfg = CANARY_CFG
    params = {k: v.detach().requires_grad_() for k, v in _random_params(cfg, seed=5).items()}
    opt = torch.optim.SGD(params.values(), lr=0.05)
    st = init_transformer_state(cfg, DELAYED)
    x, target = _data((8, 2, 32), seed=6)
    losses = []
    for _ in range(4):
        probes = fp8ops.make_probes(st)
        y, st = transformer_layer(params, x, st, config=cfg, recipe=DELAYED, probes=probes)
        loss = (y - target).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        st = fp8ops.update(st, recipe=DELAYED, grad_amax={k: p.grad for k, p in probes.items()})
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert all(torch.isfinite(t).all() for t in torch.utils._pytree.tree_leaves(st))


# ------------------------------------------------------------------------------------------------
# weight_cache: FP8 weights quantized once per optimizer step

CACHE_CFGS = {
    "fused": TransformerConfig(hidden_size=32, ffn_hidden_size=48, num_attention_heads=4, hidden_dropout=0.0,
                               attention_dropout=0.0, self_attn_mask_type="causal"),
    "unfused_swiglu": TransformerConfig(hidden_size=32, ffn_hidden_size=48, num_attention_heads=4, num_gqa_groups=2,
                                        hidden_dropout=0.0, attention_dropout=0.0, fuse_qkv_params=False,
                                        activation="swiglu"),
}
CACHE_ROLES = {"qkv.weight": ("qkv", "weight"), "q.weight": ("qkv", "weight"), "k.weight": ("qkv", "weight"),
               "v.weight": ("qkv", "weight"), "proj.weight": ("proj", "weight"),
               "fc1.weight": ("mlp", "fc1_weight"), "fc2.weight": ("mlp", "fc2_weight")}


def _cache_setup(cfg, recipe, calibrated):
    """Parameters, a (calibrated: after one step and an update) state, and two micro-batches (x, dy)."""
    params = init_transformer_params(cfg, generator=torch.Generator().manual_seed(0))
    state = init_transformer_state(cfg, recipe)
    data = [_data((6, 2, cfg.hidden_size), seed=s) for s in (3, 4)]
    if calibrated:
        probes = fp8ops.make_probes(state)
        y, state = transformer_layer({k: _leaf(v) for k, v in params.items()}, data[0][0], state, config=cfg,
                                     recipe=recipe, probes=probes)
        y.backward(data[0][1])
        state = fp8ops.update(state, recipe=recipe, grad_amax={k: p.grad for k, p in probes.items()})
    return params, state, data


def _cache_run(cfg, recipe, calibrated, *, cache, micro=1, keys=None):
    """``micro`` micro-batches with the same parameter leaves and the state threaded through; with
    ``cache`` the weights (``keys``: all GEMM weights by default) are quantized once, first. Returns
    the outputs, dx, probe gradients and parameter gradients, and the flat new state."""
    params, state, data = _cache_setup(cfg, recipe, calibrated)
    params = {k: _leaf(v) for k, v in params.items()}
    caches = {}
    if cache:
        for key in keys or [k for k in CACHE_ROLES if k in params]:
            skey, role = CACHE_ROLES[key]
            caches[key], ws = fp8ops.quantize_weight(params[key], getattr(state[skey], role), recipe=recipe)
            state = {**state, skey: state[skey].replace(**{role: ws})}
    out = []
    for x, dy in data[:micro]:
        x = _leaf(x)
        probes = fp8ops.make_probes(state)
        y, state = transformer_layer(params, x, state, config=cfg, recipe=recipe, probes=probes,
                                     weight_cache=caches if cache else None)
        y.backward(dy)
        out += [y, x.grad, *(probes[k].grad for k in sorted(probes))]
    out += [params[k].grad for k in sorted(params)]
    return out, fp8ops.state_dict(state)


def _assert_same(got, ref):
    (g, g_st), (r, r_st) = got, ref
    assert len(g) == len(r)
    for i, (a, b) in enumerate(zip(g, r)):
        assert a is not None and b is not None and torch.equal(a, b), f"output/gradient {i} differs"
    assert g_st.keys() == r_st.keys()
    for k in r_st:
        assert torch.equal(g_st[k], r_st[k]), f"state {k} differs"


CACHE_RECIPES = {"delayed": (DelayedScaling(amax_history_len=4), True),
                 "delayed_first_step": (DelayedScaling(amax_history_len=4), False),
                 "current": (CurrentScaling(), False)}


@pytest.mark.parametrize("case", list(CACHE_RECIPES))
@pytest.mark.parametrize("cfg", list(CACHE_CFGS))
def test_weight_cache_gives_the_same_bits(cfg, case):
    """With caches: the same outputs, dx, every parameter and probe gradient and the same new state
    (amax(W) recorded by quantize_weight instead of the ops) as without."""
    recipe, calibrated = CACHE_RECIPES[case]
    _assert_same(_cache_run(CACHE_CFGS[cfg], recipe, calibrated, cache=True),
                 _cache_run(CACHE_CFGS[cfg], recipe, calibrated, cache=False))


@pytest.mark.parametrize("keys", [["proj.weight", "fc2.weight"], ["q.weight", "fc1.weight"]], ids=["proj_fc2", "q_fc1"])
def test_weight_cache_subset_reused_over_two_micro_batches(keys):
    cfg = CACHE_CFGS["unfused_swiglu"]
    recipe = DelayedScaling(amax_history_len=4)
    _assert_same(_cache_run(cfg, recipe, True, cache=True, micro=2, keys=keys),
                 _cache_run(cfg, recipe, True, cache=False, micro=2))
    _assert_same(_cache_run(CACHE_CFGS["fused"], CurrentScaling(), False, cache=True, micro=2),
                 _cache_run(CACHE_CFGS["fused"], CurrentScaling(), False, cache=False, micro=2))


def test_weight_cache_is_what_the_gemms_read():
    """The caches are used (not re-quantized from the weights): caches of other weights change y."""
    cfg = CACHE_CFGS["unfused_swiglu"]
    recipe = DelayedScaling(amax_history_len=4)
    params, state, data = _cache_setup(cfg, recipe, True)
    y_ref, _ = transformer_layer(params, data[0][0], state, config=cfg, recipe=recipe)
    for key in ("q.weight", "proj.weight", "fc1.weight", "fc2.weight"):
        skey, role = CACHE_ROLES[key]
        other = dict(params)
        other[key] = params[key] * 2
        qw, _ = fp8ops.quantize_weight(other[key], getattr(state[skey], role), recipe=recipe)
        caches = {key: fp8ops.WeightCache(qw.value, qw.inv_scale_t, qw.scale, recipe, params[key])}
        if key == "q.weight":  # q, k and v are used together
            caches.update({k: fp8ops.quantize_weight(params[k], state["qkv"].weight, recipe=recipe)[0]
                           for k in ("k.weight", "v.weight")})
        y, _ = transformer_layer(params, data[0][0], state, config=cfg, recipe=recipe, weight_cache=caches)
        assert not torch.equal(y, y_ref), key


def test_weight_cache_errors_name_the_function_and_argument():
    cfg = CACHE_CFGS["fused"]
    recipe = DelayedScaling(amax_history_len=4)
    params, state, data = _cache_setup(cfg, recipe, False)
    x = data[0][0]
    qw, _ = fp8ops.quantize_weight(params["proj.weight"], state["proj"].weight, recipe=recipe)

    def call(wc, **kw):
        kw = {"state": state, "recipe": recipe, **kw}
        return transformer_layer(params, x, kw["state"], config=cfg, recipe=kw["recipe"], weight_cache=wc)

    with pytest.raises(ValueError, match=r"transformer_layer: weight_cache has unknown keys \['q.weight'\]"):
        call({"q.weight": qw})
    with pytest.raises(ValueError, match=r"transformer_layer: weight_cache has unknown keys \['ln1.weight'\]"):
        call({"ln1.weight": qw})
    with pytest.raises(TypeError, match=r"transformer_layer: weight_cache\['proj.weight'\] must be a WeightCache"):
        call({"proj.weight": params["proj.weight"]})
    with pytest.raises(TypeError, match=r"transformer_layer: weight_cache must be a dict"):
        call([qw])
    with pytest.raises(ValueError, match=r"transformer_layer: weight_cache is only meaningful with FP8"):
        call({"proj.weight": qw}, state=None, recipe=None)
    with pytest.raises(ValueError, match=r"transformer_layer: weight_cache\['fc1.weight'\] was built with another "
                                         r"weight state.*quantize_weight\(params\['fc1.weight'\], "
                                         r"state\['mlp'\].fc1_weight"):
        call({"fc1.weight": qw})
    with pytest.raises(ValueError, match=r"transformer_layer: weight_cache\['proj.weight'\] was built with another "
                                         r"weight state"):
        call({"proj.weight": fp8ops.quantize_weight(params["proj.weight"], state["qkv"].weight, recipe=recipe)[0]})
    with pytest.raises(ValueError, match=r"transformer_layer: weight_cache\['proj.weight'\] was built from another"):
        call({"proj.weight": fp8ops.quantize_weight(params["proj.weight"].clone(), state["proj"].weight,
                                                    recipe=recipe)[0]})


# ------------------------------------------------------------------------------------------------
# residual= / return_residual=: a stack of pre-norm layers without residual add kernels


@pytest.mark.parametrize("recipe", [None, DelayedScaling(), CurrentScaling()], ids=["hp", "delayed", "current"])
@pytest.mark.parametrize("layout", ["sbh", "bsh"])
def test_two_layers_handing_on_the_residual_equal_the_summed_stack(recipe, layout):
    """Layer 1 with return_residual, layer 2 with residual= and return_residual, the final norm with
    residual=: the same output as the plain stack bit for bit (each sum is the same add, written by the
    next norm), every gradient within the one rounding the fused backward saves."""
    cfg = _small(self_attn_mask_type="causal")
    p1, p2 = _random_params(cfg, 1), _random_params(cfg, 2)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 2, 32, generator=g)
    if layout == "bsh":
        x = x.transpose(0, 1).contiguous()
    dy = torch.randn(x.shape, generator=g)
    lnw, lnb = 1 + 0.1 * torch.randn(32, generator=g), 0.1 * torch.randn(32, generator=g)

    def run(chained):
        q1, q2 = ({k: _leaf(v) for k, v in p.items()} for p in (p1, p2))
        xx = _leaf(x)
        st = [init_transformer_state(cfg, recipe) if recipe is not None else None for _ in range(2)]
        kw = {"config": cfg, "recipe": recipe, "layout": layout}
        if chained:
            (m, s), _ = transformer_layer(q1, xx, st[0], return_residual=True, **kw)
            (m, s), _ = transformer_layer(q2, m, st[1], residual=s, return_residual=True, **kw)
            (y, _), _ = fp8ops.layer_norm(m, lnw, lnb, None, residual=s)
        else:
            h, _ = transformer_layer(q1, xx, st[0], **kw)
            h, _ = transformer_layer(q2, h, st[1], **kw)
            y, _ = fp8ops.layer_norm(h, lnw, lnb, None)
        y.backward(dy)
        return y.detach(), xx.grad, {**{f"1.{k}": v.grad for k, v in q1.items()}, **{f"2.{k}": v.grad for k, v in q2.items()}}

    a, e = run(True), run(False)
    assert torch.equal(a[0], e[0])
    _assert_all_close(a, e, rtol=1e-4, atol=1e-5)


def test_residual_arguments_need_a_pre_norm_layer_and_a_matching_tensor():
    cfg = _small(norm_position="post")
    params = _random_params(cfg)
    x = torch.randn(4, 2, 32)
    with pytest.raises(ValueError, match="transformer_layer: residual / return_residual need a pre-norm layer"):
        transformer_layer(params, x, None, config=cfg, recipe=None, return_residual=True)
    cfg = _small()
    params = _random_params(cfg)
    with pytest.raises(ValueError, match=r"transformer_layer: residual must have x's shape \(4, 2, 32\)"):
        transformer_layer(params, x, None, config=cfg, recipe=None, residual=x[:2])
    with pytest.raises(TypeError, match="transformer_layer: return_residual must be a bool, got 1"):
        transformer_layer(params, x, None, config=cfg, recipe=None, return_residual=1)
