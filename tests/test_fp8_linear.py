"""fp8_linear on CPU: forward and every gradient vs the FP32 reference, state semantics, weight
caching, precision escapes, errors, and the composition canaries."""

import importlib

import pytest
import torch

import fp8ops
from fp8ops import CurrentScaling, DelayedScaling, GemmSpec, LinearState
from fp8ops.reference import fp8_linear as R
from fp8ops.testing import rel_error

DELAYED = DelayedScaling(amax_history_len=4)
RECIPES = [DELAYED, CurrentScaling(), CurrentScaling(granularity="row")]


def _calibrated(recipe, x_scale=16.0, w_scale=64.0, g_scale=2.0**14):
    st = LinearState.init(recipe)
    if recipe.mode != "delayed":
        return st
    return st.replace(
        input=st.input.replace(scale=torch.tensor(x_scale), calibrated=True),
        weight=st.weight.replace(scale=torch.tensor(w_scale), calibrated=True),
        grad_output=st.grad_output.replace(scale=torch.tensor(g_scale), calibrated=True),
    )


def _data(lead=(3, 5), K=40, N=24, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(*lead, K, generator=g) * 2).to(dtype)
    w = (torch.randn(N, K, generator=g) / K**0.5).to(dtype)
    b = torch.randn(N, generator=g).to(dtype)
    dy = (torch.randn(*lead, N, generator=g) * 1e-2).to(dtype)
    return x, w, b, dy


def _run(x, w, b, dy, st, recipe, probe=True, **kw):
    x = x.clone().requires_grad_()
    # a weight cache must come from the weight tensor given to fp8_linear: then use that one
    w = kw["weight_cache"].weight if "weight_cache" in kw else w.clone().requires_grad_()
    b = b.clone().requires_grad_() if b is not None else None
    p = torch.zeros((), requires_grad=True) if probe else None
    y, st2 = fp8ops.fp8_linear(x, w, b, st, recipe=recipe, grad_probe=p, **kw)
    y.backward(dy)
    return y.detach(), x.grad, w.grad, (b.grad if b is not None else None), (p.grad if probe else None), st2


@pytest.mark.parametrize("recipe", RECIPES, ids=["delayed", "current", "rowwise"])
@pytest.mark.parametrize("calibrated", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [((3, 5), 40, 24), ((7,), 17, 13), ((2, 1, 3), 1, 31)])
def test_forward_and_gradients_match_reference(recipe, calibrated, dtype, shape):
    lead, K, N = shape
    st = _calibrated(recipe) if calibrated else LinearState.init(recipe)
    x, w, b, dy = _data(lead, K, N, dtype)
    y, dx, dw, db, pg, st2 = _run(x, w, b, dy, st, recipe)
    y_ref, st_ref = R.fp8_linear(x, w, b, st, recipe=recipe)
    dx_ref, dw_ref, db_ref, amax_ref = R.fp8_linear_grads(x, w, dy, st, recipe=recipe)
    tol = 1e-6 if dtype == torch.float32 else 1e-2  # same FP8 operands; only the output rounding differs
    assert y.shape == (*lead, N) and y.dtype == dtype
    assert rel_error(y, y_ref) < tol and rel_error(dx, dx_ref) < tol and rel_error(dw, dw_ref) < tol
    torch.testing.assert_close(db.float(), db_ref, rtol=1e-2, atol=1e-6)
    assert pg.item() == amax_ref.item()
    assert torch.equal(st2.input.pending_amax, st_ref.input.pending_amax)
    assert torch.equal(st2.weight.pending_amax, st_ref.weight.pending_amax)


@pytest.mark.parametrize("recipe", RECIPES, ids=["delayed", "current", "rowwise"])
def test_close_to_unquantized_linear(recipe):
    """FP8 error budget vs the FP32 linear: relative errors of a few percent (E4M3/E5M2 rounding)."""
    x, w, b, dy = _data((64,), 96, 80)
    st = _calibrated(recipe, x_scale=448.0 / 8, w_scale=448.0 / 0.5, g_scale=57344.0 / 0.05)
    y, dx, dw, db, _, _ = _run(x, w, b, dy, st, recipe)
    xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
    yy = torch.nn.functional.linear(xx, ww, b)
    yy.backward(dy)
    assert rel_error(y, yy) < 0.05 and rel_error(dx, xx.grad) < 0.15 and rel_error(dw, ww.grad) < 0.15
    torch.testing.assert_close(db, dy.sum(0))


def test_state_semantics_and_no_probe():
    x, w, b, dy = _data()
    st = _calibrated(DELAYED)
    y, dx, dw, db, pg, st2 = _run(x, w, b, dy, st, DELAYED)
    assert st2.input.pending_amax.item() == x.abs().max().item()
    assert st2.weight.pending_amax.item() == w.abs().max().item()
    assert st2.grad_output.pending_amax.item() == 0.0 and pg.item() == dy.abs().max().item()
    assert st.input.pending_amax.item() == 0.0  # input state untouched
    # no probe: the gradient uses current scaling, whatever the grad_output state says
    bad = st.replace(grad_output=st.grad_output.replace(scale=torch.tensor(1.0)))
    _, dx2, dw2, _, _, _ = _run(x, w, b, dy * 1e-4, bad, DELAYED, probe=False)
    dx_ref, dw_ref, _, _ = R.fp8_linear_grads(x, w, dy * 1e-4, bad, recipe=DELAYED, has_probe=False)
    assert rel_error(dx2, dx_ref) < 1e-6 and rel_error(dw2, dw_ref) < 1e-6 and (dx2 != 0).any()


def test_update_after_steps_calibrates_all_roles():
    x, w, b, dy = _data()
    st = LinearState.init(DELAYED)
    for _ in range(2):
        *_, pg, st_new = _run(x, w, b, dy, st, DELAYED)
        st = fp8ops.update(st_new, recipe=DELAYED, grad_amax=pg)
    assert st.input.scale.item() == pytest.approx(448.0 / x.abs().max().item())
    assert st.weight.scale.item() == pytest.approx(448.0 / w.abs().max().item())
    assert st.grad_output.scale.item() == pytest.approx(57344.0 / dy.abs().max().item())


def test_nan_input_gives_nan_output_and_does_not_poison_state():
    x, w, b, dy = _data()
    x[0, 0, 0] = float("nan")
    st = _calibrated(DELAYED)
    y, _, _, _, pg, st2 = _run(x, w, b, dy, st, DELAYED)
    assert torch.isnan(y[0, 0]).all() and torch.isfinite(y[1:]).all()
    assert torch.isnan(st2.input.pending_amax)
    st3 = fp8ops.update(st2, recipe=DELAYED, grad_amax=pg)
    assert torch.isfinite(st3.input.amax_history).all() and st3.input.scale.item() == 16.0


@pytest.mark.parametrize("recipe", [DELAYED, CurrentScaling(granularity="row")], ids=["delayed", "rowwise"])
def test_weight_cache(recipe):
    x, w, b, dy = _data()
    st = _calibrated(recipe)
    ref = _run(x, w, b, dy, st, recipe)
    w = w.clone().requires_grad_()  # the leaf given to fp8_linear by _run
    qw, st_c = fp8ops.quantize_weight(w, st, recipe=recipe)
    assert st_c.weight.pending_amax.item() == w.abs().max().item()
    out = _run(x, w, b, dy, st_c, recipe, weight_cache=qw)
    for a, r in zip(out[:5], ref[:5]):
        assert torch.equal(a, r)  # same FP8 weight: identical results, gradient still reaches w
    assert out[5].weight.pending_amax.item() == w.abs().max().item()
    # the cache also takes a bare weight state
    qw2, ws = fp8ops.quantize_weight(w, st.weight, recipe=recipe)
    assert torch.equal(qw2.value.data.view(torch.uint8), qw.value.data.view(torch.uint8))


@pytest.mark.parametrize("recipe", [DELAYED, CurrentScaling()], ids=["delayed", "current"])
def test_weight_cache_without_transposed_copy(recipe):
    """A cache without ``data_t`` (one scale per tensor): the backward transposes the cached bytes;
    the same output and gradients as with the transposed copy. Row-wise scales are refused."""
    x, w, b, dy = _data()
    st = _calibrated(recipe)
    w = w.clone().requires_grad_()
    qw, st_c = fp8ops.quantize_weight(w, st, recipe=recipe)
    ref = _run(x, w, b, dy, st_c, recipe, weight_cache=qw)
    bare = fp8ops.WeightCache(fp8ops.Float8Value(qw.value.data, qw.value.inv_scale), None, qw.scale, recipe, w)
    out = _run(x, w, b, dy, st_c, recipe, weight_cache=bare)
    for a, r in zip(out[:5], ref[:5]):
        assert torch.equal(a, r)
    rowwise = CurrentScaling(granularity="row")
    qr, st_r = fp8ops.quantize_weight(w, _calibrated(rowwise), recipe=rowwise)
    bare_r = fp8ops.WeightCache(fp8ops.Float8Value(qr.value.data, qr.value.inv_scale), None, qr.scale, rowwise, w)
    with pytest.raises(ValueError, match=r"fp8_linear: weight_cache has no transposed copy .* row-wise"):
        fp8ops.fp8_linear(x, w, b, st_r, recipe=rowwise, weight_cache=bare_r)


def test_weight_cache_refuses_other_state_or_recipe():
    x, w, b, _ = _data()
    st = _calibrated(DELAYED)
    qw, st = fp8ops.quantize_weight(w, st, recipe=DELAYED)
    with pytest.raises(ValueError, match="another recipe"):
        fp8ops.fp8_linear(x, w, b, st, recipe=DelayedScaling(amax_history_len=4, margin=1), weight_cache=qw)
    st_next = fp8ops.update(st, recipe=DELAYED)
    with pytest.raises(ValueError, match="stale after fp8ops.update"):
        fp8ops.fp8_linear(x, w, b, st_next, recipe=DELAYED, weight_cache=qw)
    with pytest.raises(ValueError, match=r"holds a \(24, 40\) weight"):
        fp8ops.fp8_linear(x[..., :8], w[:, :8], b, st, recipe=DELAYED, weight_cache=qw)


def test_fp32_master_weight_gets_fp32_wgrad():
    x, w, b, dy = _data(dtype=torch.bfloat16)
    w32 = w.float()
    st = _calibrated(DELAYED)
    y, dx, dw, db, _, _ = _run(x, w32, b, dy, st, DELAYED, wgrad_dtype=torch.float32)
    assert y.dtype == torch.bfloat16 and dx.dtype == torch.bfloat16 and dw.dtype == torch.float32
    _, dw_ref, _, _ = R.fp8_linear_grads(x, w32, dy, st, recipe=DELAYED)
    assert rel_error(dw, dw_ref) < 1e-6
    with pytest.raises(ValueError, match="differentiate a torch.float32 weight"):
        fp8ops.fp8_linear(x, w, b, st, recipe=DELAYED, wgrad_dtype=torch.float32)


@pytest.mark.parametrize("which", ["fprop", "dgrad", "wgrad"])
def test_precision_escape(which):
    recipe = DelayedScaling(amax_history_len=4, **{which: GemmSpec(precision="high")})
    x, w, b, dy = _data()
    st = _calibrated(recipe)
    y, dx, dw, db, pg, st2 = _run(x, w, b, dy, st, recipe)
    y_ref, _ = R.fp8_linear(x, w, b, st, recipe=recipe)
    dx_ref, dw_ref, _, amax_ref = R.fp8_linear_grads(x, w, dy, st, recipe=recipe)
    assert rel_error(y, y_ref) < 1e-6 and rel_error(dx, dx_ref) < 1e-6 and rel_error(dw, dw_ref) < 1e-6
    exact = {"fprop": (y, torch.nn.functional.linear(x, w, b)),
             "dgrad": (dx, dy @ w), "wgrad": (dw, dy.reshape(-1, 24).t() @ x.reshape(-1, 40))}[which]
    torch.testing.assert_close(*exact, rtol=1e-5, atol=1e-5)
    assert pg.item() == amax_ref.item()
    assert st2.input.pending_amax.item() == x.abs().max().item()  # still observed


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        ({"x": torch.ones(2, 3, dtype=torch.float64)}, ValueError, "x must be float32, bfloat16 or float16"),
        ({"weight": torch.ones(4)}, ValueError, r"weight must be 2-D \(N, K\)"),
        ({"x": torch.ones(2, 5)}, ValueError, "K=5 in its last dimension"),
        ({"bias": torch.ones(3)}, ValueError, r"bias must have shape \(N,\) = \(4,\)"),
        ({"state": "s"}, TypeError, "state must be a LinearState"),
        ({"recipe": None}, ValueError, "a state was given without a recipe"),
        ({"recipe": "delayed"}, TypeError, "recipe must be a fp8ops recipe"),
        ({"grad_probe": torch.zeros(1)}, ValueError, "grad_probe must be a 0-d float32"),
        ({"weight_cache": object()}, TypeError, "weight_cache must be a WeightCache"),
    ],
)
def test_errors(kwargs, exc, match):
    args = {"x": torch.ones(2, 3), "weight": torch.ones(4, 3), "bias": None,
            "state": LinearState.init(DELAYED), "recipe": DELAYED}
    args.update(kwargs)
    with pytest.raises(exc, match=match):
        fp8ops.fp8_linear(args.pop("x"), args.pop("weight"), args.pop("bias"), args.pop("state"), **args)


# ------------------------------------------------------------------------------------------------
# composition canaries


def _loss(x, w, b, st, probe):
    y, st2 = fp8ops.fp8_linear(x, w, b, st, recipe=DELAYED, grad_probe=probe)
    return (y.float() ** 2).sum(), st2


@pytest.fixture
def case():
    x, w, b, _ = _data((4, 6), 32, 16, seed=3)
    return x, w, b, _calibrated(DELAYED, x_scale=32.0, w_scale=128.0, g_scale=512.0)


def _eager(x, w, b, st):
    xx, ww, bb = (t.clone().requires_grad_() for t in (x, w, b))
    p = torch.zeros((), requires_grad=True)
    loss, st2 = _loss(xx, ww, bb, st, p)
    loss.backward()
    return loss.detach(), xx.grad, ww.grad, bb.grad, p.grad, st2


def test_torch_func_transforms(case):
    x, w, b, st = case
    loss, gx, gw, gb, gp, st2 = _eager(x, w, b, st)
    (fx, fw, fb, fp), fst = torch.func.grad(_loss, argnums=(0, 1, 2, 4), has_aux=True)(x, w, b, st, torch.zeros(()))
    for a, e in ((fx, gx), (fw, gw), (fb, gb), (fp, gp)):
        assert torch.equal(a, e)
    assert torch.equal(fst.input.pending_amax, st2.input.pending_amax)
    grads, (l2, _) = torch.func.grad_and_value(_loss, argnums=(1, 4), has_aux=True)(x, w, b, st, torch.zeros(()))
    assert torch.equal(l2, loss) and torch.equal(grads[0], gw) and torch.equal(grads[1], gp)
    _, vjp_fn, _ = torch.func.vjp(lambda w, p: _loss(x, w, b, st, p), w, torch.zeros(()), has_aux=True)
    vw, vp = vjp_fn(torch.ones(()))
    assert torch.equal(vw, gw) and torch.equal(vp, gp)


class _Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(16, 32) / 6)
        self.bias = torch.nn.Parameter(torch.zeros(16))

    def forward(self, x, st, probe):
        return fp8ops.fp8_linear(x, self.weight, self.bias, st, recipe=DELAYED, grad_probe=probe)


def test_functional_call_on_a_module(case):
    x, _, _, st = case
    m = _Tiny()
    params = {k: v.detach() for k, v in m.named_parameters()}

    def loss(params, probe):
        y, st2 = torch.func.functional_call(m, params, (x, st, probe))
        return y.square().sum(), st2

    (g, gp), _ = torch.func.grad(loss, argnums=(0, 1), has_aux=True)(params, torch.zeros(()))
    _, _, gw, gb, gp2, _ = _eager(x, params["weight"], params["bias"], st)
    assert torch.equal(g["weight"], gw) and torch.equal(g["bias"], gb) and torch.equal(gp, gp2)


def test_vmap_over_micro_batches_equals_loop(case):
    _, w, b, st = case
    xs = torch.randn(3, 5, 32) * torch.tensor([1.0, 4.0, 0.25])[:, None, None]
    f = torch.func.grad(_loss, argnums=(1, 4), has_aux=True)
    (vw, vp), vst = torch.func.vmap(f, in_dims=(0, None, None, None, None))(xs, w, b, st, torch.zeros(()))
    for i in range(3):
        (lw, lp), lst = f(xs[i], w, b, st, torch.zeros(()))
        assert torch.equal(vw[i], lw) and torch.equal(vp[i], lp)
        assert torch.equal(vst.input.pending_amax[i], lst.input.pending_amax)
    merged = fp8ops.merge_batched({"s": vst, "p": vp})
    assert merged["s"].input.pending_amax.item() == xs.abs().max().item()


def test_compile_fullgraph_backward_equals_eager(case):
    x, w, b, st = case
    loss, gx, gw, gb, gp, st2 = _eager(x, w, b, st)
    torch._dynamo.reset()
    compiled = torch.compile(_loss, fullgraph=True)
    xx, ww, bb = (t.clone().requires_grad_() for t in (x, w, b))
    p = torch.zeros((), requires_grad=True)
    closs, cst = compiled(xx, ww, bb, st, p)
    closs.backward()
    # the compiled loss (inductor's reduction order) may differ from eager in the last bit
    torch.testing.assert_close(closs.detach(), loss, rtol=1e-6, atol=0)
    for a, e in ((xx.grad, gx), (ww.grad, gw), (bb.grad, gb), (p.grad, gp)):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-6)
    assert torch.equal(cst.input.pending_amax, st2.input.pending_amax)


def test_compile_of_func_grad_raises(case):
    x, w, b, st = case
    torch._dynamo.reset()
    f = torch.compile(torch.func.grad(_loss, argnums=(1, 4), has_aux=True))
    with pytest.raises(Exception, match="fp8ops"):
        f(x, w, b, st, torch.zeros(()))


@pytest.mark.parametrize("bias_dtype", [torch.bfloat16, torch.float32])
def test_bias_gradient_is_one_reduction_in_the_bias_dtype(bias_dtype):
    """db is dy.sum(0) written in the bias's dtype by the reduction itself (float32 accumulation,
    one rounding): no float32 result converted by a second kernel."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.seen.append((str(func), tuple(out.shape) if isinstance(out, torch.Tensor) else None))
            return out

    st = _calibrated(DELAYED)
    x, w, _, dy = _data((6,), 40, 24, torch.bfloat16)
    x.requires_grad_()
    w.requires_grad_()
    b = torch.randn(24, dtype=bias_dtype, requires_grad=True)
    y, _ = fp8ops.fp8_linear(x, w, b, st, recipe=DELAYED, grad_probe=torch.zeros((), requires_grad=True))
    with Ops() as mode:
        y.backward(dy)
    sums = [f for f, shape in mode.seen if f.startswith("aten.sum") and shape == (24,)]
    converts = [f for f, shape in mode.seen if f.startswith(("aten._to_copy", "aten.to")) and shape == (24,)]
    assert len(sums) == 1 and not converts, mode.seen
    assert b.grad.dtype == bias_dtype
    assert torch.equal(b.grad, dy.float().sum(0).to(bias_dtype))


def test_bias_gradient_of_another_dtype_than_dy_is_rounded_once():
    """A bf16 bias next to float32 activations: db is the float32 column sum rounded once to bf16,
    not a sum of dy's elements each rounded to bf16 first (what a reduction with dtype=bf16 does)."""
    st = _calibrated(DELAYED)
    x, w, _, dy = _data((256,), 40, 24, torch.float32, seed=3)
    dy = dy * 100
    b = torch.zeros(24, dtype=torch.bfloat16, requires_grad=True)
    y, _ = fp8ops.fp8_linear(x.requires_grad_(), w.requires_grad_(), b, st, recipe=DELAYED)
    y.backward(dy)
    exact = dy.double().sum(0).to(torch.bfloat16)
    assert torch.equal(b.grad, exact)
    assert not torch.equal(dy.sum(0, dtype=torch.bfloat16), exact)  # the data tells the two apart


def test_bias_gradient_comes_from_the_quantizing_pass_in_every_mode_when_switched_on(monkeypatch):
    """By default every mode takes dy.sum(0). With FUSE_DBIAS on, the cast of dy with its transposed
    copy also returns the bias gradient (no second pass), in eager and compiled steps alike, so the
    two compute the same bias gradient."""
    operands = importlib.import_module("fp8ops._operands")
    assert operands.FUSE_DBIAS is False
    calls = []
    inner = operands.quantize_2d_dbias

    def spy(*args, **kwargs):
        calls.append(1)
        return inner(*args, **kwargs)

    monkeypatch.setattr(operands, "quantize_2d_dbias", spy)
    st = _calibrated(DELAYED)
    x, w, b, dy = _data((6,), 40, 24, torch.bfloat16)
    db_ref = dy.float().sum(0).to(torch.bfloat16)
    _, _, _, db_sep, _, _ = _run(x, w, b, dy, st, DELAYED)
    assert not calls and torch.equal(db_sep, db_ref)
    monkeypatch.setattr(operands, "FUSE_DBIAS", True)
    _, _, _, db, _, _ = _run(x, w, b, dy, st, DELAYED)
    assert len(calls) == 1 and torch.equal(db, db_ref)

    def step(x, w, b, p):
        return fp8ops.fp8_linear(x, w, b, st, recipe=DELAYED, grad_probe=p)[0]

    from torch._dynamo.backends.common import aot_autograd

    seen = []

    def bw_compiler(gm, _):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm

    monkeypatch.setattr(operands, "quantize_2d_dbias", inner)  # a list append would break the trace
    torch._dynamo.reset()
    xx, ww, bb = (t.clone().requires_grad_() for t in (x, w, b))
    p = torch.zeros((), requires_grad=True)
    backend = aot_autograd(fw_compiler=lambda gm, _: gm, bw_compiler=bw_compiler)
    torch.compile(step, fullgraph=True, backend=backend)(xx, ww, bb, p).backward(dy)
    assert any("cast_transpose_dbias" in t for t in seen), seen
    assert torch.equal(bb.grad, db)
