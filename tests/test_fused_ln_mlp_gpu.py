"""fused_ln_mlp on the GPU at real sizes: forward and every gradient vs the FP32 reference (same
quantization rule, float32 GEMMs), with and without recompute (fc1's output stored in FP8), and
torch.compile."""

import importlib

import pytest
import torch

import fp8ops
from fp8ops import LayerNormMLPState
from fp8ops.reference import fused_ln_mlp as R
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
@pytest.mark.parametrize("act", ["gelu_tanh", "swiglu", "squared_relu"])
def test_fused_ln_mlp_real_size(rname, act):
    recipe = RECIPES[rname]
    g = torch.Generator(device=DEV).manual_seed(1)
    M, K, F = 2048, 1024, 2736  # F not a multiple of 16 rows of 64
    C = 2 * F if act == "swiglu" else F
    x = (torch.randn(M, K, device=DEV, generator=g) * 2).to(BF16)
    ln_w = (1 + 0.1 * torch.randn(K, device=DEV, generator=g)).to(BF16)
    ln_b = (0.1 * torch.randn(K, device=DEV, generator=g)).to(BF16)
    w1 = (torch.randn(C, K, device=DEV, generator=g) / K**0.5).to(BF16)
    b1 = (0.1 * torch.randn(C, device=DEV, generator=g)).to(BF16)
    w2 = (torch.randn(K, F, device=DEV, generator=g) / F**0.5).to(BF16)
    b2 = (0.1 * torch.randn(K, device=DEV, generator=g)).to(BF16)
    dy = (torch.randn(M, K, device=DEV, generator=g) * 1e-3).to(BF16)
    args = [x, ln_w, ln_b, w1, b1, w2, b2]
    st = _calibrated(LayerNormMLPState, recipe)
    for recompute in (None, "activation"):
        # recompute="activation" stores fc1's output in FP8; the reference quantizes h the same way
        leaves = [_leaf(t) for t in args]
        probes = fp8ops.make_probes(st)
        y, st2 = fp8ops.fused_ln_mlp(*leaves, st, recipe=recipe, activation=act, recompute=recompute,
                                     grad_probe=probes)
        y.backward(dy)
        grads, pg = [t.grad for t in leaves], probes.grad
        # the reference's just-in-time scale of h from the op's observed amax (see R.fused_ln_mlp)
        ref = R.fused_ln_mlp(*args, st, dy, recipe=recipe, activation_name=act, recompute=recompute is not None,
                             h_amax=st2.fc1_output.pending_amax if recompute else None)
        names = ["dx", "dln_w", "dln_b", "dw1", "db1", "dw2", "db2"]
        for name, t in [("y", y)] + list(zip(names, grads)):
            assert rel_error(t, ref[name]) < TOL, f"recompute={recompute} {name}: {rel_error(t, ref[name]):.3e}"
        torch.testing.assert_close(pg, torch.stack([ref["amax_dh"], ref["amax_dy"]]), rtol=2e-2, atol=0)
        torch.testing.assert_close(st2.fc2_input.pending_amax, ref["amax_a"], rtol=1e-2, atol=0)
        if recompute:
            torch.testing.assert_close(st2.fc1_output.pending_amax, ref["amax_h"], rtol=1e-2, atol=0)


def test_backward_allocates_no_zero_gradients_for_saved_outputs(monkeypatch):
    # The op's non-differentiable outputs (amaxes, the FP8 operands saved for backward) get no
    # gradient; autograd must not allocate zero tensors of their shapes when the backward starts.
    mlp_mod = importlib.import_module("fp8ops.fused_ln_mlp")  # the package attribute is the function

    g = torch.Generator(device=DEV).manual_seed(4)
    M, K, F = 4096, 1024, 4096
    x = torch.randn(M, K, device=DEV, generator=g).to(BF16).requires_grad_()
    ln_w, ln_b = torch.ones(K, device=DEV, dtype=BF16), torch.zeros(K, device=DEV, dtype=BF16)
    w1 = (torch.randn(2 * F, K, device=DEV, generator=g) / K**0.5).to(BF16).requires_grad_()
    w2 = (torch.randn(K, F, device=DEV, generator=g) / F**0.5).to(BF16).requires_grad_()
    dy = torch.randn(M, K, device=DEV, generator=g).to(BF16)
    recipe = RECIPES["delayed"]
    st = _calibrated(LayerNormMLPState, recipe)
    at_start = []
    inner = mlp_mod.quantize_grad_db  # the backward's first step: dy's FP8 copies and db2

    def spy(*args, **kwargs):
        torch.cuda.synchronize()
        at_start.append(torch.cuda.memory_allocated())
        return inner(*args, **kwargs)

    monkeypatch.setattr(mlp_mod, "quantize_grad_db", spy)
    for recompute in (None, "activation"):
        y, _ = fp8ops.fused_ln_mlp(x, ln_w, ln_b, w1, None, w2, None, st, recipe=recipe, activation="swiglu",
                                   recompute=recompute, grad_probe=fp8ops.make_probes(st))
        torch.cuda.synchronize()
        after_forward = torch.cuda.memory_allocated()
        y.backward(dy)
        # the first thing the backward allocates is dy's FP8 copies: less than M * K * 2 bytes
        assert at_start[-1] - after_forward < M * K, (recompute, at_start[-1] - after_forward)
        del y
        x.grad = w1.grad = w2.grad = None


def test_no_fp8_path_matches_plain_pytorch():
    g = torch.Generator(device=DEV).manual_seed(2)
    M, K, F = 1024, 768, 3072
    x = torch.randn(M, K, device=DEV, generator=g).to(BF16)
    ln = torch.nn.LayerNorm(K, device=DEV, dtype=BF16)
    fc1 = torch.nn.Linear(K, F, device=DEV, dtype=BF16)
    fc2 = torch.nn.Linear(F, K, device=DEV, dtype=BF16)
    xa = x.clone().requires_grad_()
    y_ref = fc2(torch.nn.functional.gelu(fc1(ln(xa)), approximate="tanh"))
    dy = torch.randn_like(y_ref)
    y_ref.backward(dy)
    xb = x.clone().requires_grad_()
    y, st = fp8ops.fused_ln_mlp(xb, ln.weight, ln.bias, fc1.weight, fc1.bias, fc2.weight, fc2.bias, None,
                                recipe=None, activation="gelu_tanh")
    y.backward(dy)
    assert st is None
    assert rel_error(y, y_ref) < 1e-2 and rel_error(xb.grad, xa.grad) < 2e-2


def test_compile_fullgraph_matches_eager():
    torch._dynamo.reset()
    recipe = RECIPES["delayed"]
    g = torch.Generator(device=DEV).manual_seed(3)
    M, K, F = 512, 512, 1024
    params = {
        "g": torch.ones(K, device=DEV, dtype=BF16), "b": torch.zeros(K, device=DEV, dtype=BF16),
        "w1": (torch.randn(2 * F, K, device=DEV, generator=g) / K**0.5).to(BF16),
        "w2": (torch.randn(K, F, device=DEV, generator=g) / F**0.5).to(BF16),
    }
    x = torch.randn(M, K, device=DEV, generator=g).to(BF16)
    st = _calibrated(LayerNormMLPState, recipe)

    def loss_fn(p, xx, s, probes):
        y, s2 = fp8ops.fused_ln_mlp(xx, p["g"], p["b"], p["w1"], None, p["w2"], None, s, recipe=recipe,
                                    activation="swiglu", grad_probe=probes)
        return y.float().pow(2).mean(), s2

    res = []
    for fn in (loss_fn, torch.compile(loss_fn, fullgraph=True)):
        leaves = {k: v.clone().requires_grad_() for k, v in params.items()}
        probes = fp8ops.make_probes(st)
        loss, _ = fn(leaves, x, st, probes)
        loss.backward()
        res.append((loss.detach(), {k: v.grad for k, v in leaves.items()}, probes.grad))
    (l0, g0, p0), (l1, g1, p1) = res
    torch.testing.assert_close(l0, l1)
    for k in g0:
        torch.testing.assert_close(g0[k], g1[k])
    torch.testing.assert_close(p0, p1)


@pytest.mark.parametrize("rname", ["delayed", "current"])
def test_weight_cache_gives_the_same_bits_on_the_gpu(rname):
    """fc1 and fc2 quantized once (``quantize_weight``) give the bits of the op quantizing them:
    output, dx, every parameter gradient and the probe gradients, over 2 micro-batches."""
    recipe = RECIPES[rname]
    g = torch.Generator(device=DEV).manual_seed(0)
    M, H, F = 512, 1024, 2048
    xs = [torch.randn(M, H, device=DEV, generator=g).to(BF16) for _ in range(2)]
    dys = [torch.randn(M, H, device=DEV, generator=g).to(BF16) for _ in range(2)]
    params = [torch.ones(H, device=DEV, dtype=BF16), torch.zeros(H, device=DEV, dtype=BF16),
              (torch.randn(F, H, device=DEV, generator=g) / 32).to(BF16), torch.zeros(F, device=DEV, dtype=BF16),
              (torch.randn(H, F, device=DEV, generator=g) / 45).to(BF16), torch.zeros(H, device=DEV, dtype=BF16)]
    runs = []
    for cached in (False, True):
        st = _calibrated(LayerNormMLPState, recipe) if rname == "delayed" else LayerNormMLPState.init(recipe, device=DEV)
        leaves = [_leaf(t) for t in params]
        kw = {}
        if cached:
            c1, w1 = fp8ops.quantize_weight(leaves[2], st.fc1_weight, recipe=recipe)
            c2, w2 = fp8ops.quantize_weight(leaves[4], st.fc2_weight, recipe=recipe)
            st = st.replace(fc1_weight=w1, fc2_weight=w2)
            kw["weight_cache"] = (c1, c2)
        got = []
        for x, dy in zip(xs, dys):
            xl, p = _leaf(x), torch.zeros(2, device=DEV, requires_grad=True)
            y, st = fp8ops.fused_ln_mlp(xl, *leaves, st, recipe=recipe, grad_probe=p, **kw)
            y.backward(dy)
            got += [y.detach(), xl.grad, p.grad]
        runs.append(got + [t.grad for t in leaves])
    for i, (a, b) in enumerate(zip(*runs)):
        assert torch.equal(a, b), f"{rname}: output/gradient {i} differs with weight caches"


@pytest.mark.parametrize("rname", ["delayed", "current"])
def test_residual_fused_into_the_norm_on_the_gpu(rname):
    """residual=: s = x + r written by the norm kernel equals torch's add bit for bit, y equals
    the op on s bit for bit, and x and r get the norm's dx plus the gradient of s within the
    rounding of the one add the kernel does in fp32."""
    recipe = RECIPES[rname]
    g = torch.Generator(device=DEV).manual_seed(3)
    M, K, F = 4096, 768, 3072
    x = torch.randn(M, K, device=DEV, generator=g).to(BF16)
    r = (3 * torch.randn(M, K, device=DEV, generator=g)).to(BF16)
    ln_w = (1 + 0.1 * torch.randn(K, device=DEV, generator=g)).to(BF16)
    ln_b = (0.1 * torch.randn(K, device=DEV, generator=g)).to(BF16)
    w1 = (torch.randn(F, K, device=DEV, generator=g) / K**0.5).to(BF16)
    w2 = (torch.randn(K, F, device=DEV, generator=g) / F**0.5).to(BF16)
    dy = (torch.randn(M, K, device=DEV, generator=g) * 1e-3).to(BF16)
    ds = (torch.randn(M, K, device=DEV, generator=g) * 1e-3).to(BF16)
    st = _calibrated(LayerNormMLPState, recipe)
    outs = []
    for fused in (True, False):
        xl, rl, wl = x.clone().requires_grad_(), r.clone().requires_grad_(), ln_w.clone().requires_grad_()
        p = fp8ops.make_probes(st)
        if fused:
            (y, s), _ = fp8ops.fused_ln_mlp(xl, wl, ln_b, w1, None, w2, None, st, recipe=recipe, grad_probe=p,
                                            residual=rl)
        else:
            s = xl + rl
            y, _ = fp8ops.fused_ln_mlp(s, wl, ln_b, w1, None, w2, None, st, recipe=recipe, grad_probe=p)
        torch.autograd.backward([y, s], [dy, ds])
        outs.append((y, s, xl.grad, rl.grad, wl.grad, p.grad))
    (y1, s1, dx1, dr1, dw1, p1), (y0, s0, dx0, dr0, dw0, p0) = outs
    assert torch.equal(s1, s0) and torch.equal(y1, y0)
    assert torch.equal(dx1, dr1)
    assert rel_error(dx1, dx0) < 1e-2, rel_error(dx1, dx0)
    assert torch.equal(dw1, dw0) and torch.equal(p1, p0)
