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
