"""fp8_linear on CUDA: forward and gradients vs the FP32 reference, both GEMM backends, compile."""

import pytest
import torch

import fp8ops
from fp8ops import CurrentScaling, DelayedScaling, GemmSpec, LinearState
from fp8ops.reference import fp8_linear as R
from fp8ops.testing import rel_error

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _recipe(base, backend):
    specs = {k: GemmSpec(fast_accum=(k == "fprop"), backend=backend) for k in ("fprop", "dgrad", "wgrad")}
    if isinstance(base, DelayedScaling):
        return DelayedScaling(amax_history_len=4, **specs)
    return CurrentScaling(granularity=base.granularity, **specs)


def _state(recipe):
    st = LinearState.init(recipe, device="cuda")
    if recipe.mode != "delayed":
        return st
    return st.replace(
        input=st.input.replace(scale=torch.tensor(448.0 / 8, device="cuda"), calibrated=True),
        weight=st.weight.replace(scale=torch.tensor(448.0 / 0.5, device="cuda"), calibrated=True),
        grad_output=st.grad_output.replace(scale=torch.tensor(57344.0 / 0.05, device="cuda"), calibrated=True),
    )


@pytest.mark.parametrize("base", [DelayedScaling(), CurrentScaling(), CurrentScaling(granularity="row")],
                         ids=["delayed", "current", "rowwise"])
@pytest.mark.parametrize("backend", ["cublas", "triton"])
@pytest.mark.parametrize("shape", [(256, 512, 384), (1000, 1024, 2048), (77, 40, 24)])
def test_matches_reference(base, backend, shape):
    M, K, N = shape
    recipe = _recipe(base, backend)
    st = _state(recipe)
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(M, K, device="cuda", generator=g).bfloat16().requires_grad_()
    w = (torch.randn(N, K, device="cuda", generator=g) / K**0.5).bfloat16().requires_grad_()
    b = torch.randn(N, device="cuda", generator=g).bfloat16().requires_grad_()
    dy = (torch.randn(M, N, device="cuda", generator=g) * 1e-2).bfloat16()
    probe = torch.zeros((), device="cuda", requires_grad=True)
    y, st2 = fp8ops.fp8_linear(x, w, b, st, recipe=recipe, grad_probe=probe)
    y.backward(dy)
    y_ref, st_ref = R.fp8_linear(x, w, b, st, recipe=recipe)
    dx_ref, dw_ref, db_ref, amax_ref = R.fp8_linear_grads(x, w, dy, st, recipe=recipe)
    # the GEMM operands are the same FP8 values; errors are accumulation order and bf16 outputs
    assert rel_error(y, y_ref) < 1e-2 and rel_error(x.grad, dx_ref) < 1e-2 and rel_error(w.grad, dw_ref) < 1e-2
    torch.testing.assert_close(b.grad.float(), db_ref, rtol=2e-2, atol=1e-3)
    assert probe.grad.item() == amax_ref.item()
    assert torch.equal(st2.input.pending_amax, st_ref.input.pending_amax)


def test_backends_agree_and_weight_cache():
    M, K, N = 512, 1024, 768
    x = torch.randn(M, K, device="cuda").bfloat16()
    w = (torch.randn(N, K, device="cuda") / 32).bfloat16()
    outs = []
    for backend in ("cublas", "triton"):
        recipe = _recipe(DelayedScaling(), backend)
        st = _state(recipe)
        y, _ = fp8ops.fp8_linear(x, w, None, st, recipe=recipe)
        qw, st = fp8ops.quantize_weight(w, st, recipe=recipe)
        y2, _ = fp8ops.fp8_linear(x, w, None, st, recipe=recipe, weight_cache=qw)
        assert torch.equal(y, y2)
        outs.append(y)
    assert rel_error(outs[0], outs[1]) < 5e-3


def test_compile_backward_equals_eager_and_compile_func_grad_raises():
    recipe = _recipe(DelayedScaling(), "cublas")
    st = _state(recipe)
    x = torch.randn(256, 512, device="cuda").bfloat16()
    w = (torch.randn(384, 512, device="cuda") / 16).bfloat16()

    def loss(x, w, st, p):
        y, st2 = fp8ops.fp8_linear(x, w, None, st, recipe=recipe, grad_probe=p)
        return y.float().square().sum(), st2

    grads = []
    for fn in (loss, torch.compile(loss, fullgraph=True)):
        ww = w.clone().requires_grad_()
        p = torch.zeros((), device="cuda", requires_grad=True)
        out, _ = fn(x, ww, st, p)
        out.backward()
        grads.append((ww.grad, p.grad))
    torch.testing.assert_close(grads[0][0], grads[1][0], rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(grads[0][1], grads[1][1], rtol=1e-2, atol=0)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="fp8ops"):
        torch.compile(torch.func.grad(loss, argnums=(1, 3), has_aux=True))(x, w, st, torch.zeros((), device="cuda"))
