"""fp8ops.adamw_quantize_ on the CPU (the library op's CPU kernel is the FP32 reference): a step
worked by hand, agreement with torch.optim.AdamW followed by fp8ops.quantize_weight over several
steps, the fallback paths (current scaling, an uncalibrated state), the returned cache feeding
fp8_linear, and the argument checks."""

from __future__ import annotations

import pytest
import torch

import fp8ops
from fp8ops.testing.states import calibrate

BETAS, EPS, WD = (0.9, 0.999), 1e-8, 1e-2


def _setup(recipe, N=24, K=40, seed=0, dtype=torch.float32, calibrated=True):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(N, K, generator=g) * 0.5).to(dtype)
    st = fp8ops.LinearState.init(recipe)
    if calibrated:
        st = calibrate(st, recipe, forward=64.0)
    cache, st = fp8ops.quantize_weight(w, st, recipe=recipe)
    return w, st, cache, g


def test_one_step_by_hand():
    # w = 1, g = 0.5, fresh moments, lr 0.1, weight decay 0.1, step 0 -> 1:
    #   w = 1 - 0.1 * 0.1 * 1 = 0.99;  m = 0.05;  v = 0.00025;  bias corrections 0.1 and 0.001
    #   w = 0.99 - 0.1 / 0.1 * 0.05 / (sqrt(0.00025) / sqrt(0.001) + 1e-8) = 0.99 - 0.1 = 0.89
    # scale 448 (calibrated state): 0.89 * 448 = 398.72 -> E4M3 (spacing 32 from 256) rounds to 384
    r = fp8ops.DelayedScaling()
    st = calibrate(fp8ops.LinearState.init(r), r, scales={"weight": 448.0})
    w = torch.ones(1, 1)
    cache, st = fp8ops.quantize_weight(w, st, recipe=r)
    st = st.replace(weight=st.weight.replace(pending_amax=torch.zeros(())))
    m, v, t = torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(())
    cache, st = fp8ops.adamw_quantize_(w, torch.full((1, 1), 0.5), m, v, t, st, recipe=r, lr=0.1,
                                       betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, out=cache)
    assert t.item() == 1.0
    # (float32 coefficients: 1 - 0.999 is 0.99998713e-3 in float32, hence the tolerance on v)
    assert m.item() == pytest.approx(0.05, rel=1e-6) and v.item() == pytest.approx(0.00025, rel=2e-5)
    assert w.item() == pytest.approx(0.89, rel=1e-5)
    assert cache.value.data.float().item() == 384.0 and cache.value.data_t.float().item() == 384.0
    assert cache.value.inv_scale.item() == pytest.approx(1 / 448)
    assert st.weight.pending_amax.item() == pytest.approx(0.89, rel=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_torch_adamw_then_quantize_weight(dtype):
    r = fp8ops.DelayedScaling()
    w, st, cache, g = _setup(r, dtype=dtype)
    w_ref = w.clone().requires_grad_()
    opt = torch.optim.AdamW([w_ref], lr=3e-2, betas=BETAS, eps=EPS, weight_decay=WD, foreach=False)
    m, v, t = torch.zeros_like(w), torch.zeros_like(w), torch.zeros(())
    for _ in range(3):
        st = st.replace(weight=st.weight.replace(pending_amax=torch.zeros(())))  # as fp8ops.update leaves it
        grad = torch.randn(w.shape, generator=g).to(dtype)
        w_ref.grad = grad.clone()
        opt.step()
        cache, st = fp8ops.adamw_quantize_(w, grad, m, v, t, st, recipe=r, lr=3e-2, betas=BETAS, eps=EPS,
                                           weight_decay=WD, out=cache)
        tol = 1e-6 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(w.float(), w_ref.detach().float(), rtol=tol, atol=tol)
        torch.testing.assert_close(m.float(), opt.state[w_ref]["exp_avg"].float(), rtol=tol, atol=tol)
        # the FP8 copy is exactly the library's cast of the weight as stored, under the state's scale
        want, st_want = fp8ops.quantize_weight(w, st, recipe=r)
        assert torch.equal(cache.value.data.view(torch.uint8), want.value.data.view(torch.uint8))
        assert torch.equal(cache.value.data_t.view(torch.uint8), want.value.data_t.view(torch.uint8))
        assert torch.equal(cache.value.inv_scale, want.value.inv_scale)
        assert st.weight.pending_amax.item() == w.abs().max().float().item()
    assert t.item() == 3.0


@pytest.mark.parametrize("which", ["current", "uncalibrated"])
def test_fallback_paths_write_the_same_copy(which):
    r = fp8ops.CurrentScaling() if which == "current" else fp8ops.DelayedScaling()
    w, st, cache, g = _setup(r, calibrated=False)
    m, v, t = torch.zeros_like(w), torch.zeros_like(w), torch.zeros(())
    data_ptr = cache.value.data.data_ptr()
    cache, st2 = fp8ops.adamw_quantize_(w, torch.randn(w.shape, generator=g), m, v, t, st, recipe=r, lr=1e-2,
                                        out=cache)
    assert cache.value.data.data_ptr() == data_ptr  # written in place
    want, _ = fp8ops.quantize_weight(w, st, recipe=r)
    assert torch.equal(cache.value.data.view(torch.uint8), want.value.data.view(torch.uint8))
    assert torch.equal(cache.value.data_t.view(torch.uint8), want.value.data_t.view(torch.uint8))
    assert torch.equal(cache.value.inv_scale, want.value.inv_scale)


def test_cache_feeds_the_next_forward():
    r = fp8ops.DelayedScaling()
    w, st, cache, g = _setup(r)
    x = torch.randn(8, w.shape[1], generator=g)
    m, v, t = torch.zeros_like(w), torch.zeros_like(w), torch.zeros(())
    w.requires_grad_()
    y, st = fp8ops.fp8_linear(x, w, None, st, recipe=r, grad_probe=torch.zeros((), requires_grad=True),
                              weight_cache=cache)
    y.sum().backward()
    st = fp8ops.update(st, recipe=r)
    cache, st = fp8ops.adamw_quantize_(w, w.grad, m, v, t, st, recipe=r, lr=1e-2, out=cache)
    y_cached, _ = fp8ops.fp8_linear(x, w, None, st, recipe=r, weight_cache=cache)
    st_plain = st.replace(weight=st.weight.replace(pending_amax=torch.zeros(())))
    y_plain, _ = fp8ops.fp8_linear(x, w, None, st_plain, recipe=r)
    assert torch.equal(y_cached, y_plain)


def test_errors():
    r = fp8ops.DelayedScaling()
    w, st, cache, _ = _setup(r)
    m, v, t = torch.zeros_like(w), torch.zeros_like(w), torch.zeros(())
    g = torch.zeros_like(w)

    def call(**kw):
        args = dict(weight=w, grad=g, exp_avg=m, exp_avg_sq=v, step=t, state=st)
        args.update({k: kw.pop(k) for k in list(kw) if k in args})
        opts = dict(recipe=r, lr=1e-3, out=cache)
        opts.update(kw)
        return fp8ops.adamw_quantize_(args["weight"], args["grad"], args["exp_avg"], args["exp_avg_sq"],
                                      args["step"], args["state"], **opts)

    with pytest.raises(ValueError, match="adamw_quantize_: grad must have the weight's shape"):
        call(grad=torch.zeros(3, 3))
    with pytest.raises(ValueError, match="adamw_quantize_: exp_avg must be float32"):
        call(exp_avg=m.to(torch.int32))
    with pytest.raises(TypeError, match="adamw_quantize_: exp_avg_sq must be a torch.Tensor"):
        call(exp_avg_sq=1.0)
    with pytest.raises(ValueError, match="adamw_quantize_: step must be a 0-d float32 tensor"):
        call(step=torch.zeros(1))
    with pytest.raises(ValueError, match="adamw_quantize_: lr must be a finite number"):
        call(lr=-1.0)
    with pytest.raises(ValueError, match=r"adamw_quantize_: betas\[1\] must be a finite number in \[0.0, 1.0\)"):
        call(betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="adamw_quantize_: betas must be a pair"):
        call(betas=0.9)
    with pytest.raises(ValueError, match="adamw_quantize_: weight must be 2-D"):
        call(weight=w[0])
    with pytest.raises(TypeError, match="adamw_quantize_: out must be a WeightCache"):
        call(out=cache.value)
    other, _ = fp8ops.quantize_weight(torch.zeros(4, 4), st, recipe=r)
    with pytest.raises(ValueError, match=r"adamw_quantize_: out must hold this weight's FP8 copy"):
        call(out=other)
    with pytest.raises(TypeError, match="adamw_quantize_: state must be a ScalingState or a LinearState"):
        call(state=object())
    rw = fp8ops.CurrentScaling(granularity="row")
    with pytest.raises(ValueError, match="adamw_quantize_: row-wise scaling is not supported"):
        call(recipe=rw, state=fp8ops.LinearState.init(rw))
    assert t.item() == 0.0 and torch.equal(m, torch.zeros_like(w))  # nothing was changed by a refused call


def test_reference_and_library_op():
    # the public function's fused path is the library op, whose CPU kernel is the reference
    from fp8ops.reference import optim as ref

    r = fp8ops.DelayedScaling()
    w, st, cache, g = _setup(r)
    grad = torch.randn(w.shape, generator=g)
    w2, m2, v2, t2 = w.clone(), torch.zeros_like(w), torch.zeros_like(w), torch.zeros(())
    q, q_t, inv, amax = ref.adamw_quantize_(w2, grad, m2, v2, t2, st.weight.scale, lr=torch.tensor(1e-2),
                                            betas=BETAS, eps=EPS, weight_decay=WD, fp8_dtype=torch.float8_e4m3fn)
    m, v, t = torch.zeros_like(w), torch.zeros_like(w), torch.zeros(())
    st = st.replace(weight=st.weight.replace(pending_amax=torch.zeros(())))
    cache, st = fp8ops.adamw_quantize_(w, grad, m, v, t, st, recipe=r, lr=1e-2, betas=BETAS, eps=EPS,
                                       weight_decay=WD, out=cache)
    assert torch.equal(w, w2) and torch.equal(m, m2) and torch.equal(v, v2) and torch.equal(t, t2)
    assert torch.equal(cache.value.data.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(cache.value.data_t.view(torch.uint8), q_t.view(torch.uint8))
    assert torch.equal(cache.value.inv_scale, inv) and torch.equal(st.weight.pending_amax, amax)


def test_opcheck():
    w = torch.randn(8, 24)
    args = (w, torch.randn(8, 24), torch.zeros(8, 24), torch.zeros(8, 24), torch.ones(()), torch.tensor(1e-3),
            torch.tensor(16.0), torch.empty(8, 24, dtype=torch.float8_e4m3fn),
            torch.empty(24, 8, dtype=torch.float8_e4m3fn), torch.empty(()), 0.9, 0.999, 1e-8, 0.01)
    # test_schema compares the mutated arguments with arithmetic that torch does not have for FP8 on
    # the CPU; the mutations themselves are checked above (test_reference_and_library_op)
    torch.library.opcheck(torch.ops.fp8ops.adamw_cast_transpose.default, args,
                          test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))


def test_compile_fullgraph_matches_eager():
    # traced whole (validation, the mutating library op, the new cache and state), the in-place
    # writes visible to the caller as in eager mode
    r = fp8ops.DelayedScaling()
    w, st, cache, g = _setup(r, N=16, K=32)
    grad = torch.randn(w.shape, generator=g)
    runs = []
    for compiled in (False, True):
        w_i, cache_i = w.clone(), fp8ops.quantize_weight(w.clone(), st, recipe=r)[0]
        m, v, t = torch.zeros_like(w), torch.zeros_like(w), torch.zeros(())

        def f(w_, m_, v_, t_, st_, cache_):
            return fp8ops.adamw_quantize_(w_, grad, m_, v_, t_, st_, recipe=r, lr=1e-3, out=cache_)

        fn = torch.compile(f, fullgraph=True) if compiled else f
        cache_out, st_out = fn(w_i, m, v, t, st, cache_i)
        assert cache_out.value.data.data_ptr() == cache_i.value.data.data_ptr()
        runs.append((w_i, m, v, t, cache_i.value.data.view(torch.uint8), cache_i.value.data_t.view(torch.uint8),
                     st_out.weight.pending_amax))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


# ------------------------------------------------------------------------------------------------
# adamw_: the same step over a list of parameters, no FP8 copy


def _params(shapes=((5,), (3, 4), (2, 3, 2), (1,)), seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(s, generator=g) * 0.5).to(dtype) for s in shapes], g


def test_adamw_by_hand():
    # step 0 -> 1, fresh moments, lr 0.1, g = +-0.5: m = +-0.05, v = 0.00025, bias corrections 0.1
    # and 0.001, so the step is lr / 0.1 * 0.05 / (sqrt(0.00025) / sqrt(0.001) + 1e-8) = 0.1:
    #   weight decay 0:   w = 1 -+ 0.1              -> 0.9 and 1.1
    #   weight decay 0.1: w = 1 - 0.1 * 0.1 -+ 0.1  -> 0.89 and 1.09
    for wd, want in ((0.0, (0.9, 1.1)), (0.1, (0.89, 1.09))):
        ps = [torch.ones(3), torch.ones(2, 2)]
        gs = [torch.full((3,), 0.5), torch.full((2, 2), -0.5)]
        ms, vs = [torch.zeros_like(p) for p in ps], [torch.zeros_like(p) for p in ps]
        t = torch.zeros(())
        fp8ops.adamw_(ps, gs, ms, vs, t, lr=0.1, weight_decay=wd)
        assert t.item() == 1.0
        assert torch.allclose(ps[0], torch.full((3,), want[0]), rtol=1e-6)
        assert torch.allclose(ps[1], torch.full((2, 2), want[1]), rtol=1e-6)
        assert torch.allclose(ms[1], torch.full((2, 2), -0.05), rtol=1e-6)
        # (1 - 0.999 in float32 is 0.99998713e-3, hence the tolerance)
        assert torch.allclose(vs[0], torch.full((3,), 0.00025), rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_adamw_matches_torch_adamw(dtype):
    ps, g = _params(dtype=dtype)
    refs = [p.clone().requires_grad_() for p in ps]
    opt = torch.optim.AdamW(refs, lr=3e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.05, foreach=False)
    ms, vs = [torch.zeros_like(p) for p in ps], [torch.zeros_like(p) for p in ps]
    t = torch.zeros(())
    lr = torch.tensor(3e-2)
    for _ in range(4):
        gs = [torch.randn(p.shape, generator=g).to(dtype) for p in ps]
        for r, gr in zip(refs, gs):
            r.grad = gr.clone()
        opt.step()
        fp8ops.adamw_(ps, gs, ms, vs, t, lr=lr, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.05)
        tol = 1e-6 if dtype == torch.float32 else 1e-2
        for p, m, v, r in zip(ps, ms, vs, refs):
            torch.testing.assert_close(p.float(), r.detach().float(), rtol=tol, atol=tol)
            torch.testing.assert_close(m.float(), opt.state[r]["exp_avg"].float(), rtol=tol, atol=tol)
            torch.testing.assert_close(v.float(), opt.state[r]["exp_avg_sq"].float(), rtol=tol, atol=1e-8)
    assert t.item() == 4.0


def test_adamw_steps_a_weight_as_adamw_quantize_does():
    # the two functions are one AdamW: the same weight stepped by each agrees bit for bit
    r = fp8ops.DelayedScaling()
    w, st, cache, g = _setup(r)
    w2 = w.clone()
    m, v, t = torch.zeros_like(w), torch.zeros_like(w), torch.zeros(())
    m2, v2, t2 = torch.zeros_like(w), torch.zeros_like(w), torch.zeros(())
    for _ in range(2):
        grad = torch.randn(w.shape, generator=g)
        st = st.replace(weight=st.weight.replace(pending_amax=torch.zeros(())))
        cache, st = fp8ops.adamw_quantize_(w, grad, m, v, t, st, recipe=r, lr=1e-2, out=cache)
        fp8ops.adamw_([w2], [grad], [m2], [v2], t2, lr=1e-2)
    assert torch.equal(w, w2) and torch.equal(m, m2) and torch.equal(v, v2) and torch.equal(t, t2)


def test_adamw_errors():
    ps, _ = _params()
    gs = [torch.zeros_like(p) for p in ps]
    ms, vs = [torch.zeros_like(p) for p in ps], [torch.zeros_like(p) for p in ps]
    t = torch.zeros(())
    before = [p.clone() for p in ps]

    def call(params=ps, grads=gs, exp_avgs=ms, exp_avg_sqs=vs, step=t, **kw):
        kw.setdefault("lr", 1e-3)
        return fp8ops.adamw_(params, grads, exp_avgs, exp_avg_sqs, step, **kw)

    with pytest.raises(TypeError, match="adamw_: params must be a list or tuple of tensors, got Tensor"):
        call(params=ps[0])
    with pytest.raises(ValueError, match=r"adamw_: grads must have one tensor per parameter \(4\), got 3"):
        call(grads=gs[:3])
    with pytest.raises(ValueError, match="adamw_: params is empty"):
        call(params=[], grads=[], exp_avgs=[], exp_avg_sqs=[])
    with pytest.raises(ValueError, match=r"adamw_: grads\[1\] must have params\[1\]'s shape \(3, 4\), got \(4, 3\)"):
        call(grads=[gs[0], torch.zeros(4, 3), *gs[2:]])
    with pytest.raises(TypeError, match=r"adamw_: exp_avgs\[2\] must be a torch.Tensor, got float"):
        call(exp_avgs=[ms[0], ms[1], 0.0, ms[3]])
    with pytest.raises(ValueError, match=r"adamw_: exp_avg_sqs\[0\] must be float32, bfloat16 or float16"):
        call(exp_avg_sqs=[vs[0].int(), *vs[1:]])
    with pytest.raises(ValueError, match=r"adamw_: params\[1\] must be contiguous"):
        call(params=[ps[0], torch.zeros(4, 3).t(), *ps[2:]])
    with pytest.raises(ValueError, match="adamw_: step must be a 0-d float32 tensor on the parameters' device"):
        call(step=torch.zeros(1))
    with pytest.raises(ValueError, match="adamw_: lr must be a finite number"):
        call(lr=float("nan"))
    with pytest.raises(ValueError, match=r"adamw_: betas\[0\] must be a finite number in \[0.0, 1.0\)"):
        call(betas=(1.5, 0.9))
    with pytest.raises(ValueError, match="adamw_: weight_decay must be a finite number"):
        call(weight_decay=-1.0)
    assert t.item() == 0.0 and all(torch.equal(a, b) for a, b in zip(ps, before))  # nothing changed


def test_adamw_reference_and_opcheck():
    from fp8ops.reference import optim as ref

    ps, g = _params()
    gs = [torch.randn(p.shape, generator=g) for p in ps]
    ms, vs = [torch.zeros_like(p) for p in ps], [torch.zeros_like(p) for p in ps]
    t = torch.zeros(())
    ps2, ms2, vs2 = [p.clone() for p in ps], [m.clone() for m in ms], [v.clone() for v in vs]
    fp8ops.adamw_(ps, gs, ms, vs, t, lr=1e-2)
    ref.adamw(ps2, gs, ms2, vs2, torch.ones(()), torch.tensor(1e-2), 0.9, 0.999, 1e-8, 1e-2)
    for a, b in zip(ps + ms + vs, ps2 + ms2 + vs2):
        assert torch.equal(a, b)
    args = (ps2, gs, ms2, vs2, torch.ones(()), torch.tensor(1e-3), 0.9, 0.999, 1e-8, 0.01)
    torch.library.opcheck(torch.ops.fp8ops.adamw.default, args)


def test_adamw_compile_fullgraph_matches_eager():
    runs = []
    for compiled in (False, True):
        ps, g = _params(seed=3)
        gs = [torch.randn(p.shape, generator=g) for p in ps]
        ms, vs = [torch.zeros_like(p) for p in ps], [torch.zeros_like(p) for p in ps]
        t = torch.zeros(())

        def f(ps_, gs_, ms_, vs_, t_):
            fp8ops.adamw_(ps_, gs_, ms_, vs_, t_, lr=1e-3)

        fn = torch.compile(f, fullgraph=True) if compiled else f
        fn(ps, gs, ms, vs, t)
        fn(ps, gs, ms, vs, t)
        runs.append(ps + ms + vs + [t])
    for a, b in zip(*runs):
        assert torch.equal(a, b)
