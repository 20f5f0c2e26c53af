"""layernorm_linear on the GPU at real sizes: forward and every gradient vs the FP32 reference (same
quantization rule, float32 GEMMs)."""

import pytest
import torch

import fp8ops
from fp8ops import LayerNormLinearState
from fp8ops.reference import layernorm_linear as R
from fp8ops.testing import rel_error
from fp8ops.testing.states import calibrate
from fp8ops.testing.composition import RECIPES as RECIPE_NAMES, make_recipe

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

DEV = "cuda"

BF16 = torch.bfloat16

RECIPES = {name: make_recipe(name) for name in RECIPE_NAMES if name != "none"}  # delayed (history 4), current, rowwise


def _calibrated(cls, recipe):
    return calibrate(cls.init(recipe, device=DEV), recipe)


def _leaf(t):
    return None if t is None else t.clone().requires_grad_()


TOL = 2e-2


@pytest.mark.parametrize("rname", list(RECIPES))
@pytest.mark.parametrize("norm", ["LayerNorm", "RMSNorm"])
def test_layernorm_linear_real_size(rname, norm):
    recipe = RECIPES[rname]
    g = torch.Generator(device=DEV).manual_seed(0)
    M, K, N = 4096, 1536, 2304 + 8
    x = (torch.randn(M, K, device=DEV, generator=g) * 2 + 0.5).to(BF16)
    ln_w = (1 + 0.1 * torch.randn(K, device=DEV, generator=g)).to(BF16)
    ln_b = None if norm == "RMSNorm" else (0.1 * torch.randn(K, device=DEV, generator=g)).to(BF16)
    w = (torch.randn(N, K, device=DEV, generator=g) / K**0.5).to(BF16)
    b = torch.randn(N, device=DEV, generator=g).to(BF16)
    dy = (torch.randn(M, N, device=DEV, generator=g) * 1e-3).to(BF16)
    st = _calibrated(LayerNormLinearState, recipe)
    leaves = [_leaf(t) for t in (x, ln_w, ln_b, w, b)]
    probe = torch.zeros((), device=DEV, requires_grad=True)
    y, st2 = fp8ops.layernorm_linear(*leaves, st, recipe=recipe, normalization=norm, grad_probe=probe)
    y.backward(dy)
    ref = R.layernorm_linear(x, ln_w, ln_b, w, b, st, dy, recipe=recipe, normalization=norm)
    got = {"y": y, "dx": leaves[0].grad, "dln_w": leaves[1].grad, "dw": leaves[3].grad, "db": leaves[4].grad}
    if ln_b is not None:
        got["dln_b"] = leaves[2].grad
    for name, t in got.items():
        assert rel_error(t, ref[name]) < TOL, f"{name}: {rel_error(t, ref[name]):.3e}"
    torch.testing.assert_close(probe.grad, ref["amax_dy"], rtol=1e-2, atol=0)
    torch.testing.assert_close(st2.input.pending_amax, ref["amax_ln"], rtol=1e-2, atol=0)


@pytest.mark.parametrize("rname", ["delayed", "current"])
def test_weight_cache_gives_the_same_bits_on_the_gpu(rname):
    """A weight quantized once (``quantize_weight``) gives the bits of the op quantizing it: output,
    dx, every parameter gradient and the probe gradient, over 2 micro-batches."""
    recipe = RECIPES[rname]
    g = torch.Generator(device=DEV).manual_seed(0)
    M, K, N = 512, 1024, 768
    xs = [torch.randn(M, K, device=DEV, generator=g).to(BF16) for _ in range(2)]
    dys = [torch.randn(M, N, device=DEV, generator=g).to(BF16) for _ in range(2)]
    params = [torch.ones(K, device=DEV, dtype=BF16), torch.zeros(K, device=DEV, dtype=BF16),
              (torch.randn(N, K, device=DEV, generator=g) / 32).to(BF16), torch.zeros(N, device=DEV, dtype=BF16)]
    runs = []
    for cached in (False, True):
        st = _calibrated(LayerNormLinearState, recipe) if rname == "delayed" else LayerNormLinearState.init(recipe, device=DEV)
        leaves = [_leaf(t) for t in params]
        kw = {}
        if cached:
            kw["weight_cache"], st = fp8ops.quantize_weight(leaves[2], st, recipe=recipe)
        got = []
        for x, dy in zip(xs, dys):
            xl, p = _leaf(x), torch.zeros((), device=DEV, requires_grad=True)
            y, st = fp8ops.layernorm_linear(xl, *leaves, st, recipe=recipe, grad_probe=p, **kw)
            y.backward(dy)
            got += [y.detach(), xl.grad, p.grad]
        runs.append(got + [t.grad for t in leaves])
    for i, (a, b) in enumerate(zip(*runs)):
        assert torch.equal(a, b), f"{rname}: output/gradient {i} differs with a weight cache"


# ------------------------------------------------------------------------------------------------
# qkv_heads: fp8ops::cast_transpose_heads bit for bit against the cast of the concatenated gradient,
# and the transformer layer whose attention runs on SDPA with and without the head views (the same
# outputs and gradients, eager and compiled, every recipe, bf16).

import fp8ops._transformer_checks as TC  # noqa: E402  (where HEAD_VIEWS lives)
from fp8ops.reference import quantize as RQ  # noqa: E402

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _u8(t):
    return t.view(torch.uint8)


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("dims", [(8, 16, 16, 1024, 128), (2, 12, 4, 300, 64), (3, 6, 6, 77, 32)])
@pytest.mark.parametrize("layout", ["bhsd", "sbhd"])
@pytest.mark.parametrize("current", [False, True])
def test_cast_transpose_heads_matches_the_reference_bit_for_bit(dtype, dims, layout, current):
    B, Hq, Hkv, S, D = dims
    g = torch.Generator(device=DEV).manual_seed(1)

    def part(h):
        x = (torch.randn(B, h, S, D, device=DEV, generator=g) * 3).bfloat16()
        return x if layout == "bhsd" else x.permute(2, 0, 1, 3).contiguous().permute(1, 2, 0, 3)

    q, k, v = part(Hq), part(Hkv), part(Hkv)
    x2 = RQ.heads_2d(q, k, v)
    scale = torch.tensor(7.0, device=DEV)
    amax_in = x2.float().abs().max() if current else None
    got = torch.ops.fp8ops.cast_transpose_heads(q, k, v, scale, amax_in, 0, False, dtype)
    want = torch.ops.fp8ops.cast_transpose_dbias(x2, scale, amax_in, 0, False, dtype)
    assert torch.equal(_u8(got[0]), _u8(want[0])) and torch.equal(_u8(got[1]), _u8(want[1]))
    assert got[2].item() == want[2].item() == x2.float().abs().max().item()
    assert got[3].item() == want[3].item()
    torch.testing.assert_close(got[4], x2.float().sum(0), rtol=1e-5, atol=1e-3)


def _layer_grads(recipe_name, head_views, compiled, monkeypatch):
    monkeypatch.setattr(TC, "HEAD_VIEWS", head_views)
    torch._dynamo.reset()
    recipe = make_recipe(recipe_name)
    cfg = fp8ops.TransformerConfig(hidden_size=512, ffn_hidden_size=1024, num_attention_heads=8,
                                   num_gqa_groups=4, hidden_dropout=0.0, attention_dropout=0.0,
                                   self_attn_mask_type="causal")
    g = torch.Generator().manual_seed(0)
    params = {k: v.to(DEV, torch.bfloat16).requires_grad_()
              for k, v in fp8ops.init_transformer_params(cfg, dtype=torch.float32, generator=g).items()}
    x = torch.randn(256, 4, 512, generator=g).to(DEV, torch.bfloat16).requires_grad_()
    r = torch.randn(256, 4, 512, generator=g).to(DEV, torch.bfloat16).requires_grad_()
    state = fp8ops.init_transformer_state(cfg, recipe, device=DEV) if recipe is not None else None
    probes = fp8ops.make_probes(state) if recipe is not None else None

    def f(params, x, r, state, probes):
        (m, s), _ = fp8ops.transformer_layer(params, x, state, config=cfg, recipe=recipe, probes=probes,
                                             residual=r, return_residual=True)
        return (m.float().square().mean() + (s.float() * m.float()).mean()), m

    fn = torch.compile(f, fullgraph=True) if compiled else f
    loss, m = fn(params, x, r, state, probes)
    names = ["x", "r", *params, *(f"probe {k}" for k in (probes or {}))]
    leaves = [x, r, *params.values(), *(probes.values() if probes is not None else ())]
    return m.detach(), dict(zip(names, torch.autograd.grad(loss, leaves)))


@pytest.mark.parametrize("recipe_name", RECIPE_NAMES)
@pytest.mark.parametrize("compiled", [False, True])
def test_layer_with_head_views_matches_the_concatenated_gradient(recipe_name, compiled, monkeypatch):
    import fp8ops._operands as O

    calls = []
    if not compiled:
        real = O._ops.cast_transpose_heads
        monkeypatch.setattr(O._ops, "cast_transpose_heads", lambda *a: calls.append(1) or real(*a))
    m0, g0 = _layer_grads(recipe_name, False, compiled, monkeypatch)
    assert not calls
    m1, g1 = _layer_grads(recipe_name, True, compiled, monkeypatch)
    if not compiled:
        assert len(calls) == (1 if recipe_name in ("delayed", "current") else 0)
    assert torch.equal(m0, m1)
    for name, a in g0.items():
        b = g1[name]
        if name == "qkv.bias":  # summed in another order (fp32 partial sums, rounded to bf16 once)
            torch.testing.assert_close(b.float(), a.float(), rtol=1e-2, atol=1e-5, msg=name)
        else:
            assert torch.equal(a, b), name
