"""Argument checks and edge cases shared by the public ops (fp8ops/_checks.py): each bad case raises a
TypeError/ValueError naming the function, the argument, what was expected and what was received, and
each edge case gives the right result.

On CPU there is only one real device; a tensor on ``meta`` stands for "another device"."""

import copy

import pytest
import torch
from torch.utils import _pytree as pytree

import fp8ops
import fp8ops.nn as fnn
from fp8ops import (
    FakeQuantState,
    LayerNormLinearState,
    LayerNormMLPState,
    LinearState,
)
from fp8ops.testing.composition import RECIPES as RECIPE_NAMES, make_recipe

RECIPES = {name: make_recipe(name) for name in RECIPE_NAMES if name != "none"}  # delayed (history 4), current, rowwise
DELAYED = RECIPES["delayed"]
META = torch.device("meta")


def _lnl_args(K=8, N=6, lead=(4,)):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*lead, K, generator=g)
    return x, torch.ones(K), torch.zeros(K), torch.randn(N, K, generator=g) / 3, torch.randn(N, generator=g)


def _mlp_args(K=8, F=16):
    g = torch.Generator().manual_seed(1)
    x, ln_w, ln_b = torch.randn(4, K, generator=g), torch.ones(K), torch.zeros(K)
    w1, b1 = torch.randn(F, K, generator=g) / 3, torch.zeros(F)
    w2, b2 = torch.randn(K, F, generator=g) / 4, torch.zeros(K)
    return [x, ln_w, ln_b, w1, b1, w2, b2]


def _state(cls, recipe):
    return None if recipe is None else cls.init(recipe)


def _calibrated_linear(recipe=DELAYED):
    st = LinearState.init(recipe)
    return st.replace(**{r: getattr(st, r).replace(scale=torch.tensor(s), calibrated=True)
                         for r, s in (("input", 16.0), ("weight", 64.0), ("grad_output", 2.0**14))})


def _message_tail(exc_info, where):
    msg = str(exc_info.value)
    assert msg.startswith(f"{where}: "), msg
    return msg[len(where) + 2:]


# ------------------------------------------------------------------------------------------------
# 1. norm arguments: eps, zero_centered_gamma, normalization, activation


@pytest.mark.parametrize("recipe", [None, DELAYED], ids=["no_fp8", "delayed"])
@pytest.mark.parametrize("op", ["layernorm_linear", "fused_ln_mlp"])
def test_zero_centered_gamma_must_be_a_bool(op, recipe):
    with pytest.raises(TypeError, match=f"^{op}: zero_centered_gamma must be a bool, got str"):
        if op == "layernorm_linear":
            fp8ops.layernorm_linear(*_lnl_args(), _state(LayerNormLinearState, recipe), recipe=recipe,
                                    zero_centered_gamma="False")
        else:
            fp8ops.fused_ln_mlp(*_mlp_args(), _state(LayerNormMLPState, recipe), recipe=recipe,
                                zero_centered_gamma="False")


@pytest.mark.parametrize("eps", [float("inf"), float("nan"), 0.0, -1e-5, "1e-5", True])
@pytest.mark.parametrize("op", ["layernorm_linear", "fused_ln_mlp"])
def test_eps_must_be_finite_and_positive(op, eps):
    with pytest.raises(ValueError, match=f"^{op}: eps must be a finite number > 0.*got {eps!r}"):
        if op == "layernorm_linear":
            fp8ops.layernorm_linear(*_lnl_args(), None, recipe=None, eps=eps)
        else:
            fp8ops.fused_ln_mlp(*_mlp_args(), None, recipe=None, eps=eps)


def test_norm_checks_are_one_shared_check():
    """layer_norm, rms_norm, layernorm_linear and fused_ln_mlp say the same thing for the same mistake."""
    x, g, beta, w, b = _lnl_args()
    for kw, exc in (({"eps": float("inf")}, ValueError), ({"zero_centered_gamma": 1}, TypeError)):
        tails = set()
        calls = {
            "layer_norm": lambda: fp8ops.layer_norm(x, g, beta, None, **kw),
            "rms_norm": lambda: fp8ops.rms_norm(x, g, None, **kw),
            "layernorm_linear": lambda: fp8ops.layernorm_linear(x, g, beta, w, b, None, recipe=None, **kw),
            "fused_ln_mlp": lambda: fp8ops.fused_ln_mlp(*_mlp_args(), None, recipe=None, **kw),
        }
        for where, call in calls.items():
            with pytest.raises(exc) as e:
                call()
            tails.add(_message_tail(e, where))
        assert len(tails) == 1, tails


@pytest.mark.parametrize("bad", ["BatchNorm", None, 3])
def test_normalization_name(bad):
    with pytest.raises(ValueError, match=r"^layernorm_linear: normalization must be 'LayerNorm' or 'RMSNorm', got"):
        fp8ops.layernorm_linear(*_lnl_args(), None, recipe=None, normalization=bad)
    with pytest.raises(ValueError, match=r"^fused_ln_mlp: normalization must be 'LayerNorm' or 'RMSNorm', got"):
        fp8ops.fused_ln_mlp(*_mlp_args(), None, recipe=None, normalization=bad)
    with pytest.raises(ValueError, match=r"^LayerNormLinear: normalization must be 'LayerNorm' or 'RMSNorm', got"):
        fnn.LayerNormLinear(8, 4, normalization=bad)


@pytest.mark.parametrize("bad", ["tanh", None, 3])
def test_activation_name(bad):
    # (already checked before the shared checks; kept here as a regression test)
    with pytest.raises(ValueError, match=r"^fused_ln_mlp: activation must be one of 'gelu'.*got"):
        fp8ops.fused_ln_mlp(*_mlp_args(), None, recipe=None, activation=bad)


# ------------------------------------------------------------------------------------------------
# 2. probes on another device than x


def test_probe_on_another_device_is_refused():
    x, g, beta, w, b = _lnl_args()
    p0, p2 = torch.zeros((), device=META), torch.zeros(2, device=META)
    calls = {
        "fp8_linear": lambda: fp8ops.fp8_linear(x, w, b, LinearState.init(DELAYED), recipe=DELAYED, grad_probe=p0),
        "layernorm_linear": lambda: fp8ops.layernorm_linear(x, g, beta, w, b, LayerNormLinearState.init(DELAYED),
                                                            recipe=DELAYED, grad_probe=p0),
        "fused_ln_mlp": lambda: fp8ops.fused_ln_mlp(*_mlp_args(), LayerNormMLPState.init(DELAYED), recipe=DELAYED,
                                                    grad_probe=p2),
        "fake_quantize": lambda: fp8ops.fake_quantize(x, FakeQuantState.init(DELAYED), recipe=DELAYED,
                                                      grad_probe=p0),
    }
    for where, call in calls.items():
        name = "grad_probe"
        with pytest.raises(ValueError, match=f"^{where}: {name} is on meta but x is on cpu"):
            call()


def test_probe_without_requires_grad_is_accepted():
    """torch.func passes plain tensors as probes: one that does not require grad is not an error."""
    x, g, beta, w, b = _lnl_args()
    y, _ = fp8ops.fp8_linear(x, w, b, LinearState.init(DELAYED), recipe=DELAYED, grad_probe=torch.zeros(()))
    y2, _ = fp8ops.layernorm_linear(x, g, beta, w, b, LayerNormLinearState.init(DELAYED), recipe=DELAYED,
                                    grad_probe=torch.zeros(()))
    y3, _ = fp8ops.fused_ln_mlp(*_mlp_args(), LayerNormMLPState.init(DELAYED), recipe=DELAYED,
                                grad_probe=torch.zeros(2))
    assert y.shape == y2.shape == (4, 6) and y3.shape == (4, 8)


# ------------------------------------------------------------------------------------------------
# 3. K = 0: y is the bias broadcast to (M, N), as torch.nn.functional.linear gives


def _k0(lead=(3,), N=5, dtype=torch.float32, bias=True):
    g = torch.Generator().manual_seed(2)
    x = torch.empty(*lead, 0, dtype=dtype).requires_grad_()
    w = torch.empty(N, 0, dtype=dtype).requires_grad_()
    b = torch.randn(N, generator=g).to(dtype).requires_grad_() if bias else None
    dy = torch.randn(*lead, N, generator=g).to(dtype)
    return x, w, b, dy


def _assert_k0_result(y, x, w, b, dy, lead, N):
    expected = torch.zeros(*lead, N, dtype=x.dtype) if b is None else b.detach().expand(*lead, N)
    assert y.shape == (*lead, N) and y.dtype == x.dtype
    torch.testing.assert_close(y.detach(), expected, rtol=0, atol=0)
    y.backward(dy)
    assert x.grad.shape == x.shape and w.grad.shape == (N, 0) and w.grad.dtype == w.dtype
    if b is not None:
        torch.testing.assert_close(b.grad, dy.reshape(-1, N).sum(0), rtol=1e-2, atol=1e-6)


def _same_tree(a, b):
    la, sa = pytree.tree_flatten(a)
    lb, sb = pytree.tree_flatten(b)
    assert sa == sb
    assert all(torch.equal(u, v) for u, v in zip(la, lb))


@pytest.mark.parametrize("recipe", [None, *RECIPES.values()], ids=["no_fp8", *RECIPES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lead,bias", [((3,), True), ((2, 3), True), ((4,), False)])
def test_fp8_linear_with_k0_returns_the_bias(recipe, dtype, lead, bias):
    N = 5
    x, w, b, dy = _k0(lead, N, dtype, bias)
    st = _state(LinearState, recipe)
    probe = torch.zeros((), requires_grad=True) if recipe is not None else None
    y, st2 = fp8ops.fp8_linear(x, w, b, st, recipe=recipe, grad_probe=probe)
    _assert_k0_result(y, x, w, b, dy, lead, N)
    if recipe is None:
        assert st2 is None
    else:
        assert type(st2) is LinearState
        _same_tree(st2, st)  # amax of an empty tensor: no observation
        assert probe.grad is None or float(probe.grad) == 0.0


@pytest.mark.parametrize("recipe", [None, *RECIPES.values()], ids=["no_fp8", *RECIPES])
@pytest.mark.parametrize("return_ln", [False, True])
def test_layernorm_linear_with_k0_returns_the_bias(recipe, return_ln):
    N, lead = 5, (2, 3)
    x, w, b, dy = _k0(lead, N)
    ln_w, ln_b = torch.ones(0, requires_grad=True), torch.zeros(0, requires_grad=True)
    st = _state(LayerNormLinearState, recipe)
    out, st2 = fp8ops.layernorm_linear(x, ln_w, ln_b, w, b, st, recipe=recipe,
                                       return_layernorm_output=return_ln)
    y = out[0] if return_ln else out
    if return_ln:
        assert out[1].shape == (*lead, 0)
    _assert_k0_result(y, x, w, b, dy, lead, N)
    assert ln_w.grad is None or ln_w.grad.shape == (0,)
    if recipe is None:
        assert st2 is None
    else:
        assert type(st2) is LayerNormLinearState
        _same_tree(st2, st)


# ------------------------------------------------------------------------------------------------
# 4. biases (and weights) on another device than x


def test_bias_on_another_device_is_named_at_the_boundary():
    x, g, beta, w, b = _lnl_args()
    mb = b.to(META)
    with pytest.raises(ValueError, match="^fp8_linear: bias is on meta but x is on cpu"):
        fp8ops.fp8_linear(x, w, mb, LinearState.init(DELAYED), recipe=DELAYED)
    with pytest.raises(ValueError, match="^fp8_linear: bias is on meta but x is on cpu"):
        fp8ops.fp8_linear(x, w, mb, None, recipe=None)
    with pytest.raises(ValueError, match="^layernorm_linear: bias is on meta but x is on cpu"):
        fp8ops.layernorm_linear(x, g, beta, w, mb, LayerNormLinearState.init(DELAYED), recipe=DELAYED)
    for i, name in ((4, "fc1_bias"), (6, "fc2_bias"), (3, "fc1_weight"), (5, "fc2_weight"), (2, "ln_bias")):
        args = _mlp_args()
        args[i] = args[i].to(META)
        with pytest.raises(ValueError, match=f"^fused_ln_mlp: {name} is on meta but x is on cpu"):
            fp8ops.fused_ln_mlp(*args, LayerNormMLPState.init(DELAYED), recipe=DELAYED)


# ------------------------------------------------------------------------------------------------
# 5. a weight cache built from another weight tensor


def test_weight_cache_from_another_weight_is_refused():
    x, _, _, w, b = _lnl_args()
    st = _calibrated_linear()
    other = w.clone()
    qw, st = fp8ops.quantize_weight(other, st, recipe=DELAYED)
    msg = ("fp8_linear: weight_cache was built from another weight tensor; "
           "rebuild it with quantize_weight(weight, ...)")
    with pytest.raises(ValueError, match="^" + msg.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        fp8ops.fp8_linear(x, w, b, st, recipe=DELAYED, weight_cache=qw)


def test_weight_cache_of_the_same_weight_is_accepted_through_aliases_and_transforms():
    x, _, _, w, b = _lnl_args()
    w = w.requires_grad_()
    st = _calibrated_linear()
    qw, st = fp8ops.quantize_weight(w, st, recipe=DELAYED)
    y_ref, _ = fp8ops.fp8_linear(x, w, b, st, recipe=DELAYED)
    y, _ = fp8ops.fp8_linear(x, w, b, st, recipe=DELAYED, weight_cache=qw)
    assert torch.equal(y, y_ref)
    # a detached alias of the same weight is the same weight
    y2, _ = fp8ops.fp8_linear(x, w.detach(), b, st, recipe=DELAYED, weight_cache=qw)
    assert torch.equal(y2, y_ref)
    # the cache is a pytree: flattening and rebuilding it keeps the weight it was built from
    leaves, spec = pytree.tree_flatten(qw)
    qw2 = pytree.tree_unflatten(leaves, spec)
    y3, _ = fp8ops.fp8_linear(x, w, b, st, recipe=DELAYED, weight_cache=qw2)
    assert torch.equal(y3, y_ref)

    # torch.func: the weight is wrapped inside the transform

    def loss(w, p):
        y, _ = fp8ops.fp8_linear(x, w, b, st, recipe=DELAYED, grad_probe=p, weight_cache=qw)
        return y.square().sum()

    gw, gp = torch.func.grad(loss, argnums=(0, 1))(w, torch.zeros(()))
    assert gw.shape == w.shape and float(gp) > 0


def test_weight_cache_under_compile():
    x, _, _, w, b = _lnl_args()
    st = _calibrated_linear()
    qw, st = fp8ops.quantize_weight(w, st, recipe=DELAYED)

    def f(x, w, st, qw):
        return fp8ops.fp8_linear(x, w, b, st, recipe=DELAYED, weight_cache=qw)[0]

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x, w, st, qw), f(x, w, st, qw), rtol=0, atol=0)


# ------------------------------------------------------------------------------------------------
# 6. fp8_linear with recipe=None, state=None: no FP8


@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
def test_fp8_linear_without_recipe_is_a_plain_linear(wdtype):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 8, generator=g, dtype=torch.bfloat16).requires_grad_()
    w = (torch.randn(6, 8, generator=g) / 3).to(wdtype).requires_grad_()
    b = torch.randn(6, generator=g).requires_grad_()  # float32 bias
    y, st = fp8ops.fp8_linear(x, w, b, None, recipe=None)
    assert st is None and y.dtype == torch.bfloat16
    xr, wr, br = (t.detach().clone().requires_grad_() for t in (x, w, b))
    yr = torch.nn.functional.linear(xr, wr.to(xr.dtype), br.to(xr.dtype))
    torch.testing.assert_close(y, yr, rtol=0, atol=0)
    dy = torch.randn(y.shape, generator=g).to(y.dtype)
    y.backward(dy)
    yr.backward(dy)
    for t, r in ((x, xr), (w, wr), (b, br)):
        assert t.grad.dtype == t.dtype
        torch.testing.assert_close(t.grad, r.grad, rtol=0, atol=0)


def test_fp8_linear_state_and_recipe_go_together():
    x, _, _, w, b = _lnl_args()
    with pytest.raises(ValueError, match=r"^fp8_linear: a state was given without a recipe.*recipe="):
        fp8ops.fp8_linear(x, w, b, LinearState.init(DELAYED), recipe=None)
    with pytest.raises(ValueError, match=r"^fp8_linear: recipe given without a state.*state=LinearState\.init"):
        fp8ops.fp8_linear(x, w, b, None, recipe=DELAYED)
    with pytest.raises(ValueError, match="^fp8_linear: grad_probe is only meaningful with FP8"):
        fp8ops.fp8_linear(x, w, b, None, recipe=None, grad_probe=torch.zeros(()))
    with pytest.raises(TypeError, match="^fp8_linear: recipe must be a fp8ops recipe"):
        fp8ops.fp8_linear(x, w, b, LinearState.init(DELAYED), recipe="delayed")
    qw, _ = fp8ops.quantize_weight(w, LinearState.init(DELAYED), recipe=DELAYED)
    with pytest.raises(ValueError, match="^fp8_linear: weight_cache is only meaningful with FP8"):
        fp8ops.fp8_linear(x, w, b, None, recipe=None, weight_cache=qw)


def test_a_bad_state_or_parameter_after_good_calls_of_the_same_shapes_is_refused():
    """The checks of a valid call take a fast path; a bad input of the same shapes right after
    valid calls still gets its message."""
    x, _, _, w, b = _lnl_args()
    st = LinearState.init(DELAYED)
    for _ in range(2):
        fp8ops.fp8_linear(x, w, b, st, recipe=DELAYED)
    bad_states = {
        "pending_amax must be a 0-d float32 tensor": st.input.replace(pending_amax=torch.zeros((), dtype=torch.float64)),
        "scale must be a 0-d float32 tensor": st.input.replace(scale=torch.ones(1)),
        "amax_history is on meta": st.input.replace(amax_history=st.input.amax_history.to(META)),
        "built for a 'current' recipe": RECIPES["current"].init(role="forward"),
        "state must be a ScalingState": "input",
    }
    for message, bad in bad_states.items():
        with pytest.raises((TypeError, ValueError), match=f"^fp8_linear: state.input: .*{message}"):
            fp8ops.fp8_linear(x, w, b, st.replace(input=bad), recipe=DELAYED)
        fp8ops.fp8_linear(x, w, b, st, recipe=DELAYED)  # and good again
    cfg = fp8ops.TransformerConfig(hidden_size=16, ffn_hidden_size=32, num_attention_heads=2,
                                   self_attn_mask_type="causal")
    params = fp8ops.init_transformer_params(cfg)
    xl = torch.randn(3, 2, 16)
    for _ in range(2):
        fp8ops.transformer_layer(params, xl, None, config=cfg, recipe=None)
    bad_params = {
        r"params\['fc1.weight'\] must have shape \(32, 16\)": {"fc1.weight": torch.zeros(16, 32)},
        r"params\['fc1.weight'\] is on meta": {"fc1.weight": params["fc1.weight"].to(META)},
        r"params\['fc1.bias'\] must be float32, bfloat16 or float16": {"fc1.bias": torch.zeros(32, dtype=torch.int64)},
        r"params\['ln1.weight'\] must be a torch.Tensor": {"ln1.weight": [1.0] * 16},
        r"unexpected \['extra'\]": {"extra": torch.zeros(1)},
    }
    for message, change in bad_params.items():
        with pytest.raises((TypeError, ValueError), match=f"^transformer_layer: .*{message}"):
            fp8ops.transformer_layer({**params, **change}, xl, None, config=cfg, recipe=None)
    missing = {k: v for k, v in params.items() if k != "qkv.bias"}
    with pytest.raises(ValueError, match=r"^transformer_layer: params do not match the config: missing \['qkv.bias'\]"):
        fp8ops.transformer_layer(missing, xl, None, config=cfg, recipe=None)


# ------------------------------------------------------------------------------------------------
# 7. fp8ops.nn modules observe only in training forwards with gradients enabled


def _modules():
    torch.manual_seed(5)
    return {
        "Linear": (fnn.Linear(8, 6, recipe=DELAYED), (4, 8)),
        "LayerNormLinear": (fnn.LayerNormLinear(8, 6, recipe=DELAYED), (4, 8)),
        "LayerNormMLP": (fnn.LayerNormMLP(8, 16, recipe=DELAYED), (4, 8)),
        "TransformerLayer": (fnn.TransformerLayer(16, 32, 2, recipe=DELAYED, hidden_dropout=0.0,
                                                  attention_dropout=0.0), (3, 2, 16)),
    }


@pytest.mark.parametrize("name", ["Linear", "LayerNormLinear", "LayerNormMLP", "TransformerLayer"])
def test_evaluation_forwards_do_not_move_the_scales(name):
    module, shape = _modules()[name]
    g = torch.Generator().manual_seed(6)
    x = torch.randn(shape, generator=g)
    for _ in range(2):  # calibrated training
        module(x).square().mean().backward()
        module.update_scaling()
    module(x).square().mean().backward()  # a training step, its update pending
    reference = copy.deepcopy(module)
    big = 1000.0 * torch.randn(shape, generator=g)
    big[..., 0] = 1e6  # one outlier per row: a large amax after a norm too
    n_probes = len(module._probes)
    with torch.no_grad():  # evaluation in training mode, gradients off
        module(big)
    module.eval()
    with torch.no_grad():
        module(big)
    module(big).square().mean().backward()  # eval mode with gradients on
    module.train()
    assert len(module._probes) == n_probes  # no probe was made for the evaluation forwards
    module.update_scaling()
    reference.update_scaling()
    _same_tree(module.fp8_state, reference.fp8_state)


def test_norm_modules_check_their_norm_arguments_at_construction():
    for cls, args in ((fnn.LayerNormLinear, (8, 4)), (fnn.LayerNormMLP, (8, 16))):
        where = cls.__name__
        with pytest.raises(TypeError, match=f"^{where}: zero_centered_gamma must be a bool, got str"):
            cls(*args, zero_centered_gamma="False")
        with pytest.raises(ValueError, match=f"^{where}: eps must be a finite number > 0"):
            cls(*args, eps=float("inf"))
