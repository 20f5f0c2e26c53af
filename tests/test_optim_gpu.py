"""GPU tests of fp8ops.adamw_quantize_ (the fused kernel fp8ops::adamw_cast_transpose): against
torch's fused AdamW on bf16 weights and moments over several steps, the FP8 copy bit-exact with
torch's own saturating cast of the kernel's updated weight (and its transpose), the amax and the
inverse scale exact, and the step replayed in a CUDA graph (fp8ops.graph_step) equal to the
eager steps."""

from __future__ import annotations

import pytest
import torch

import fp8ops
from fp8ops.testing.states import calibrate

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

BETAS, EPS, WD = (0.9, 0.999), 1e-8, 1e-2


def _weights(N=1000, K=3000, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = (torch.randn(N, K, device="cuda", generator=g) * 0.05).bfloat16()
    grads = [(torch.randn(N, K, device="cuda", generator=g) * 1e-3).bfloat16() for _ in range(3)]
    return w, grads


def test_against_torch_fused_adamw_and_torch_cast():
    r = fp8ops.DelayedScaling()
    w, grads = _weights()
    st = calibrate(fp8ops.LinearState.init(r, device="cuda"), r, forward=512.0).weight
    cache, st = fp8ops.quantize_weight(w, st, recipe=r)
    lr = torch.tensor(1e-3, device="cuda")
    w_ref = w.clone().requires_grad_()
    opt = torch.optim.AdamW([w_ref], lr=lr, betas=BETAS, eps=EPS, weight_decay=WD, fused=True, capturable=True)
    m, v, t = torch.zeros_like(w), torch.zeros_like(w), torch.zeros((), device="cuda")
    for grad in grads:
        st = st.replace(pending_amax=torch.zeros((), device="cuda"))
        w_ref.grad = grad.clone()
        opt.step()
        cache, st = fp8ops.adamw_quantize_(w, grad, m, v, t, st, recipe=r, lr=lr, out=cache)
        # bf16 results of float32 math in another order round apart by a bf16 step now and then, and
        # the moments carry such a step into later ones: within two bf16 steps of each value, and
        # near zero (where terms cancel) within two bf16 steps at the largest magnitudes (|m| up to
        # about 5e-4, v up to about 2.5e-8) or, for the weight, 5 % of lr
        torch.testing.assert_close(w.float(), w_ref.detach().float(), rtol=1.6e-2, atol=5e-5)
        torch.testing.assert_close(m.float(), opt.state[w_ref]["exp_avg"].float(), rtol=1.6e-2, atol=4e-6)
        torch.testing.assert_close(v.float(), opt.state[w_ref]["exp_avg_sq"].float(), rtol=1.6e-2, atol=3e-10)
        want = (w.float() * 512.0).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
        assert torch.equal(cache.value.data.view(torch.uint8), want.view(torch.uint8))
        assert torch.equal(cache.value.data_t.view(torch.uint8), want.view(torch.uint8).t().contiguous())
        assert st.pending_amax.item() == w.float().abs().max().item()
        assert cache.value.inv_scale.item() == 1.0 / 512.0
    assert t.item() == 3.0


def test_graph_replays_equal_eager_steps():
    r = fp8ops.DelayedScaling()
    runs = []
    for graphed in (False, True):
        w, grads = _weights(N=256, K=512, seed=1)
        st0 = calibrate(fp8ops.LinearState.init(r, device="cuda"), r, forward=256.0).weight
        first, st0 = fp8ops.quantize_weight(w, st0, recipe=r)
        value = first.value
        m, v, t = torch.zeros_like(w), torch.zeros_like(w), torch.zeros((), device="cuda")
        lr = torch.tensor(2e-3, device="cuda")
        grad_in = torch.empty_like(w)

        def step(st, grad):
            cache = fp8ops.WeightCache(value, None, st.scale, r, w)
            _, st = fp8ops.adamw_quantize_(w, grad, m, v, t, st, recipe=r, lr=lr, out=cache)
            return st, value.data.float().sum()

        fn = fp8ops.graph_step(step, args_by_reference=(0,)) if graphed else step
        st = st0
        for i in range(6):
            grad_in.copy_(grads[i % 3])
            st, _ = fn(st, grad_in)
        if graphed:
            assert fn.stats["replays"] >= 1, fn.stats
        runs.append((w.clone(), m.clone(), v.clone(), value.data.clone(), value.data_t.clone(), st.pending_amax.clone()))
    for a, b in zip(*runs):
        assert torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a, b.view(torch.uint8) if b.element_size() == 1 else b)


@pytest.mark.parametrize("shape", [(1008, 3000), (4096, 4096)])
def test_transposed_copy_through_a_tensor_map_equals_pointer_stores(shape):
    # the TMA store (default from 2**24 elements) against pointer stores, from the same values; the
    # first shape's edge tiles are partial in both dimensions (the tensor map clips them)
    from fp8ops.kernels import _library
    from fp8ops.kernels.optim import adamw_cast_transpose_launch

    N, K = shape
    w, (g, m, _) = _weights(N, K, seed=2)
    m = m * 0.1
    v = m.float().square().bfloat16()
    step, lr, scale = (torch.full((), x, device="cuda") for x in (1.0, 1e-3, 512.0))
    outs = {}
    for tma in (False, True):
        ws = (w.clone(), g, m.clone(), v.clone())
        q = torch.empty(N, K, dtype=torch.float8_e4m3fn, device="cuda")
        qt = torch.empty(K, N, dtype=torch.float8_e4m3fn, device="cuda")
        inv = torch.empty((), device="cuda")
        amax = adamw_cast_transpose_launch(*ws, step, lr, scale, q, qt, inv, *BETAS, EPS, WD, config={"TMA": tma})
        outs[tma] = (ws[0], ws[2], ws[3], q.view(torch.uint8), qt.view(torch.uint8), amax, inv)
    assert _library.tma_store_wanted(torch.empty(K, N, dtype=torch.float8_e4m3fn, device="cuda"), {"TMA": True})
    for i, (a, b) in enumerate(zip(outs[True], outs[False], strict=True)):
        assert torch.equal(a, b), f"output {i} differs"
    assert torch.equal(outs[True][4], outs[True][3].t().contiguous())


# ------------------------------------------------------------------------------------------------
# adamw_ (fp8ops::adamw, several tensors per launch)


def _param_set(seed=0):
    # a GPT's kinds of parameters, small: an embedding, norm weights and biases, a weight matrix;
    # more tensors than one launch takes
    g = torch.Generator(device="cuda").manual_seed(seed)
    shapes = [(1000, 64), (64,), (64,), (192, 64), (192,), (64, 64), (64,), (1,), (3000,), (64,), (255, 257)]
    ps = [(torch.randn(s, device="cuda", generator=g) * 0.05).bfloat16() for s in shapes]
    grads = [[(torch.randn(s, device="cuda", generator=g) * 1e-3).bfloat16() for s in shapes] for _ in range(3)]
    return ps, grads


def test_adamw_equals_the_fused_kernels_step_bit_for_bit():
    # the same AdamW math as fp8ops::adamw_cast_transpose: a weight stepped by each is equal
    r = fp8ops.DelayedScaling()
    w, grads = _weights(N=700, K=900, seed=3)
    st = calibrate(fp8ops.LinearState.init(r, device="cuda"), r, forward=512.0).weight
    cache, st = fp8ops.quantize_weight(w, st, recipe=r)
    w2 = w.clone()
    m, v, t = torch.zeros_like(w), torch.zeros_like(w), torch.zeros((), device="cuda")
    m2, v2, t2 = torch.zeros_like(w), torch.zeros_like(w), torch.zeros((), device="cuda")
    for grad in grads:
        st = st.replace(pending_amax=torch.zeros((), device="cuda"))
        cache, st = fp8ops.adamw_quantize_(w, grad, m, v, t, st, recipe=r, lr=1e-3, out=cache)
        fp8ops.adamw_([w2], [grad], [m2], [v2], t2, lr=1e-3)
    assert torch.equal(w, w2) and torch.equal(m, m2) and torch.equal(v, v2)


def test_adamw_against_torch_fused_adamw():
    ps, grads = _param_set()
    refs = [p.clone().requires_grad_() for p in ps]
    lr = torch.tensor(1e-3, device="cuda")
    opt = torch.optim.AdamW(refs, lr=lr, betas=BETAS, eps=EPS, weight_decay=WD, fused=True, capturable=True)
    ms, vs = [torch.zeros_like(p) for p in ps], [torch.zeros_like(p) for p in ps]
    t = torch.zeros((), device="cuda")
    for gs in grads:
        for r, g in zip(refs, gs):
            r.grad = g.clone()
        opt.step()
        fp8ops.adamw_(ps, gs, ms, vs, t, lr=lr, betas=BETAS, eps=EPS, weight_decay=WD)
        # as in test_against_torch_fused_adamw_and_torch_cast: float32 math in another order
        for p, m, v, r in zip(ps, ms, vs, refs):
            torch.testing.assert_close(p.float(), r.detach().float(), rtol=1.6e-2, atol=5e-5)
            torch.testing.assert_close(m.float(), opt.state[r]["exp_avg"].float(), rtol=1.6e-2, atol=4e-6)
            torch.testing.assert_close(v.float(), opt.state[r]["exp_avg_sq"].float(), rtol=1.6e-2, atol=3e-10)
    assert t.item() == 3.0


def test_adamw_graph_replays_equal_eager_steps():
    runs = []
    for graphed in (False, True):
        ps, grads = _param_set(seed=1)
        ms, vs = [torch.zeros_like(p) for p in ps], [torch.zeros_like(p) for p in ps]
        t = torch.zeros((), device="cuda")
        lr = torch.tensor(2e-3, device="cuda")
        g_in = [torch.empty_like(p) for p in ps]

        def step(carry, gs):
            fp8ops.adamw_(ps, gs, ms, vs, t, lr=lr)
            return carry, ps[0].float().sum()

        fn = fp8ops.graph_step(step, args_by_reference=(0,)) if graphed else step
        for i in range(6):
            for a, b in zip(g_in, grads[i % 3]):
                a.copy_(b)
            fn(None, g_in)
        if graphed:
            assert fn.stats["replays"] >= 1, fn.stats
        runs.append([x.clone() for x in ps + ms + vs + [t]])
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("impl", ["fp8ops FP8 + fused AdamW", "fp8ops FP8, fused loss + AdamW"])
def test_gpt_stepped_by_the_library_optimizers_compiled_and_graphed_trains_as_eager(impl):
    """Model level: the bench's GPT (2 layers, bf16) stepped by adamw_quantize_ on its GEMM weights
    and adamw_ on the rest, six full steps eager, compiled, and compiled inside graph_step: the same
    losses to bf16 rounding, and the same parameter updates. The updates are compared as a whole
    and per GEMM weight, not element by element: AdamW turns a gradient that is rounding noise (the
    keys' bias, to which softmax is blind) into full steps of random sign, which two orders of
    bf16 rounding take apart."""
    from fp8ops.bench import step as bench_step

    size = {"layers": 2, "hidden": 256, "heads": 4, "seq": 128, "batch": 4, "vocab": 2048}
    runs = {}
    for mode in ("eager", "compile", "compile + graph"):
        torch._dynamo.reset()
        torch.manual_seed(0)
        step, carry, batch = bench_step._variant("gpt2", impl, "eager" if mode == "eager" else "compile", size)
        params, opt, fused = step.stepped
        tensors = opt.params + fused
        before = [p.detach().float().clone() for p in tensors]
        fn = fp8ops.graph_step(step) if mode.endswith("graph") else step
        losses = []
        for _ in range(6):
            carry, loss = fn(carry, *batch)
            losses.append(float(loss))
        if mode.endswith("graph"):
            assert fn.stats["replays"] >= 1, fn.stats
        runs[mode] = (losses, [p.detach().float() - b for p, b in zip(tensors, before)], len(opt.params))
    eager_losses, eager_deltas, n_rest = runs["eager"]
    assert eager_losses[-1] < eager_losses[0]
    for mode in ("compile", "compile + graph"):
        losses, deltas, _ = runs[mode]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(eager_losses), rtol=2e-3, atol=0)
        whole = (torch.cat([d.flatten() for d in deltas]) - torch.cat([d.flatten() for d in eager_deltas])).norm()
        rel = float(whole / torch.cat([d.flatten() for d in eager_deltas]).norm())
        per_weight = [float((d - e).norm() / e.norm()) for d, e in zip(deltas[n_rest:], eager_deltas[n_rest:])]
        print(f"{impl}, {mode}: updates differ by {rel:.4f} of their norm; GEMM weights {per_weight}")
        assert rel < 0.2, (mode, rel)
        assert max(per_weight) < 0.3, (mode, per_weight)
