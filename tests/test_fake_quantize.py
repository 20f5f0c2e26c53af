"""fake_quantize: values and gradients vs the reference, and the composition canaries.

Composition matrix (DESIGN.md §4): eager autograd, eager torch.func grad / grad_and_value / vjp,
vmap, torch.compile(fullgraph) + .backward() all agree; torch.compile(torch.func.grad(...)) raises.
"""

import pytest
import torch

import fp8ops
from fp8ops import DelayedScaling, FakeQuantState
from fp8ops.reference import fake_quantize as R

RECIPE = DelayedScaling(amax_history_len=4)


def _calibrated(scale_in=8.0, scale_grad=1024.0):
    st = FakeQuantState.init(RECIPE)
    return st.replace(
        input=st.input.replace(scale=torch.tensor(scale_in), calibrated=True),
        grad_output=st.grad_output.replace(scale=torch.tensor(scale_grad), calibrated=True),
    )


def _loss(x, w, st, probe):
    y, st2 = fp8ops.fake_quantize(x, st, recipe=RECIPE, grad_probe=probe)
    return ((y * w) ** 2).sum(), st2


@pytest.mark.parametrize("calibrated", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_and_gradients_match_reference(calibrated, dtype):
    torch.manual_seed(0)
    st = _calibrated() if calibrated else FakeQuantState.init(RECIPE)
    x = (torch.randn(5, 7) * 3).to(dtype).requires_grad_()
    probe = torch.zeros((), requires_grad=True)
    y, st2 = fp8ops.fake_quantize(x, st, recipe=RECIPE, grad_probe=probe)
    y_ref, st_ref = R.fake_quantize(x, st, recipe=RECIPE)
    assert y.dtype == dtype and torch.equal(y, y_ref)
    assert torch.equal(st2.input.pending_amax, st_ref.input.pending_amax)
    dy = torch.randn(5, 7).to(dtype) * 1e-3
    y.backward(dy)
    dx_ref, amax_ref = R.fake_quantize_grad(dy, st, recipe=RECIPE)
    assert torch.equal(x.grad, dx_ref)
    assert probe.grad.item() == amax_ref.item()
    # close to the unquantized identity: the error is FP8 rounding only
    torch.testing.assert_close(x.grad.float(), dy.float(), rtol=2.0**-2, atol=1e-5)


def test_no_probe_uses_current_scaling_for_gradient():
    st = _calibrated(scale_grad=1.0)  # a bad gradient scale that the no-probe path must ignore
    x = torch.randn(4, 4, requires_grad=True)
    dy = torch.randn(4, 4) * 1e-6  # underflows E5M2 with scale 1
    y, _ = fp8ops.fake_quantize(x, st, recipe=RECIPE)
    y.backward(dy)
    dx_ref, _ = R.fake_quantize_grad(dy, st, recipe=RECIPE, has_probe=False)
    assert torch.equal(x.grad, dx_ref)
    assert (x.grad != 0).all()


def test_state_protocol_over_steps_plain_autograd():
    """Micro-batches with fresh probes, max-merge, one update per step."""
    torch.manual_seed(1)
    st = FakeQuantState.init(RECIPE)
    w = torch.randn(3, 5)
    for _ in range(2):
        obs_state, obs_probe = None, None
        for mb in range(3):
            x = torch.randn(3, 5) * (mb + 1)
            probe = fp8ops.make_probes(st)
            loss, st_mb = _loss(x.requires_grad_(), w, st, probe)
            loss.backward()
            obs_state = st_mb if obs_state is None else fp8ops.merge(obs_state, st_mb)
            obs_probe = probe.grad if obs_probe is None else fp8ops.merge(obs_probe, probe.grad)
        assert obs_state.input.pending_amax.item() > 0
        st = fp8ops.update(obs_state, recipe=RECIPE, grad_amax=obs_probe)
    assert st.input.calibrated and st.grad_output.calibrated
    assert st.input.amax_history[:2].gt(0).all() and st.grad_output.amax_history[:2].gt(0).all()


def test_reused_probe_sums_across_backward_calls():
    """Documents the hazard: a probe leaf reused across backward() calls reports a sum."""
    st = _calibrated()
    probe = torch.zeros((), requires_grad=True)
    for _ in range(2):
        x = torch.ones(2, 2, requires_grad=True)
        y, _ = fp8ops.fake_quantize(x, st, recipe=RECIPE, grad_probe=probe)
        (y * 3).sum().backward()
    assert probe.grad.item() == 6.0  # 2 x amax(dy) = 2 x 3


def _eager(x, w, st):
    xx = x.clone().requires_grad_()
    probe = torch.zeros((), requires_grad=True)
    loss, st2 = _loss(xx, w, st, probe)
    loss.backward()
    return loss.detach(), xx.grad, probe.grad, st2


@pytest.fixture
def data():
    torch.manual_seed(2)
    return torch.randn(6, 8), torch.randn(6, 8), _calibrated()


def test_torch_func_grad_grad_and_value_vjp(data):
    x, w, st = data
    loss, gx, gp, st2 = _eager(x, w, st)
    (fx, fp), st_f = torch.func.grad(_loss, argnums=(0, 3), has_aux=True)(x, w, st, torch.zeros(()))
    assert torch.equal(fx, gx) and torch.equal(fp, gp)
    assert torch.equal(st_f.input.pending_amax, st2.input.pending_amax)
    (gx2, gp2), (l2, _) = torch.func.grad_and_value(_loss, argnums=(0, 3), has_aux=True)(x, w, st, torch.zeros(()))
    assert torch.equal(gx2, gx) and torch.equal(gp2, gp) and torch.equal(l2, loss)
    out, vjp_fn, _ = torch.func.vjp(lambda x, p: _loss(x, w, st, p), x, torch.zeros(()), has_aux=True)
    vx, vp = vjp_fn(torch.ones(()))
    assert torch.equal(vx, gx) and torch.equal(vp, gp)


def test_vmap_over_micro_batches_equals_loop(data):
    _, w, st = data
    xs = torch.randn(3, 6, 8) * torch.tensor([1.0, 5.0, 0.1])[:, None, None]
    f = torch.func.grad(_loss, argnums=(0, 3), has_aux=True)
    (vx, vp), vst = torch.func.vmap(f, in_dims=(0, None, None, None))(xs, w, st, torch.zeros(()))
    for i in range(3):
        (lx, lp), lst = f(xs[i], w, st, torch.zeros(()))
        assert torch.equal(vx[i], lx) and torch.equal(vp[i], lp)
        assert torch.equal(vst.input.pending_amax[i], lst.input.pending_amax)
    merged = fp8ops.merge_batched({"state": vst, "probe": vp})
    assert merged["probe"].item() == vp.max().item()
    assert merged["state"].input.pending_amax.item() == xs.abs().max().item()


def test_compile_fullgraph_then_backward_equals_eager(data):
    x, w, st = data
    loss, gx, gp, st2 = _eager(x, w, st)
    torch._dynamo.reset()
    compiled = torch.compile(_loss, fullgraph=True)
    xx = x.clone().requires_grad_()
    probe = torch.zeros((), requires_grad=True)
    closs, cst = compiled(xx, w, st, probe)
    closs.backward()
    assert torch.equal(closs.detach(), loss)
    assert torch.equal(xx.grad, gx) and torch.equal(probe.grad, gp)
    assert torch.equal(cst.input.pending_amax, st2.input.pending_amax)


@pytest.mark.parametrize("argnums", [(0, 3), (3,), (0,)])
def test_compile_of_func_grad_raises(data, argnums):
    """pytorch#193279 drops custom backwards under compile(func.grad): it must raise, whatever is
    differentiated (the probe alone too), never return a wrong gradient."""
    x, w, st = data
    torch._dynamo.reset()
    f = torch.compile(torch.func.grad(_loss, argnums=argnums, has_aux=True))
    with pytest.raises(Exception) as info:
        f(x, w, st, torch.zeros(()))
    assert "fp8ops" in str(info.value)


def test_compile_of_func_grad_raises_when_input_comes_from_other_ops():
    st = _calibrated()
    x, w = torch.randn(4, 8), torch.randn(8, 8)

    def f(p, w, x):
        y, _ = fp8ops.fake_quantize(x @ w, st, recipe=RECIPE, grad_probe=p)
        return (y * 3.0).sum()

    assert torch.func.grad(f)(torch.zeros(()), w, x).item() == 3.0
    torch._dynamo.reset()
    with pytest.raises(Exception, match="fp8ops"):
        torch.compile(torch.func.grad(f, argnums=0))(torch.zeros(()), w, x)
    # When tracing breaks earlier, the transform runs eagerly: then it must be right.
    torch._dynamo.reset()
    eager = torch.func.grad(f, argnums=(0, 1))(torch.zeros(()), w, x)
    try:
        got = torch.compile(torch.func.grad(f, argnums=(0, 1)))(torch.zeros(()), w, x)
    except Exception as e:  # raising is the other acceptable outcome
        assert "fp8ops" in str(e)
    else:
        assert torch.equal(got[0], eager[0]) and torch.equal(got[1], eager[1])


def test_errors():
    st = _calibrated()
    x = torch.randn(2, 3)
    with pytest.raises(TypeError, match="state must be a FakeQuantState"):
        fp8ops.fake_quantize(x, st.input, recipe=RECIPE)
    with pytest.raises(ValueError, match="grad_probe must be a 0-d float32"):
        fp8ops.fake_quantize(x, st, recipe=RECIPE, grad_probe=torch.zeros(2))
    with pytest.raises(ValueError, match="row-wise"):
        fp8ops.fake_quantize(x, st, recipe=fp8ops.CurrentScaling(granularity="row"))
