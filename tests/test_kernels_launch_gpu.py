"""The cached launch path of the Triton kernels (kernels/_library.FastKernel) on the GPU: once a
specialization is compiled, launches skip Triton's binding, and an argument that changes the
specialization (an unaligned pointer, a size of 1 or not a multiple of 16) still gets its own
compiled kernel: every output equal to the FP8 cast computed with torch."""

from __future__ import annotations

import pytest
import torch
from fp8ops.kernels import _library as L
from fp8ops.kernels import quantize as kq

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

E4M3 = torch.float8_e4m3fn


def _expected(x: torch.Tensor, scale: float) -> torch.Tensor:
    return (x.float() * scale).clamp(-448.0, 448.0).to(E4M3)


def test_the_kernels_launch_through_the_cached_path():
    assert isinstance(kq._cast_transpose_fwd_kernel, L.FastKernel)
    x = torch.randn(64, 128, device="cuda").bfloat16()
    scale = torch.tensor(4.0, device="cuda")
    before = kq._cast_transpose_fwd_kernel.direct_launches
    for _ in range(3):
        q, qt, amax, inv = kq.cast_transpose_launch(x, scale, None, 0, False, E4M3)
    assert kq._cast_transpose_fwd_kernel.direct_launches >= before + 2
    torch.testing.assert_close(q.view(torch.uint8), _expected(x, 4.0).view(torch.uint8), rtol=0, atol=0)
    torch.testing.assert_close(qt.view(torch.uint8), q.t().contiguous().view(torch.uint8), rtol=0, atol=0)
    assert float(amax) == float(x.float().abs().max()) and float(inv) == 0.25


@pytest.mark.parametrize("M,K,offset", [(64, 128, 0), (64, 128, 1), (1, 128, 0), (1, 128, 3), (17, 33, 0),
                                        (17, 33, 1), (64, 128, 0), (16, 16, 0), (16, 16, 5)])
def test_every_specialization_gets_its_own_kernel(M, K, offset):
    # run in this order on one process: aligned and unaligned inputs, sizes of 1, odd sizes, and
    # back to an earlier specialization, each checked against torch's cast
    buf = torch.randn(M * K + 8, device="cuda").bfloat16()
    x = buf[offset:offset + M * K].view(M, K)
    scale = torch.tensor(2.0, device="cuda")
    for _ in range(2):  # the second call takes the cached path
        q, qt, amax, _ = kq.cast_transpose_launch(x, scale, None, 0, False, E4M3)
        torch.testing.assert_close(q.view(torch.uint8), _expected(x, 2.0).view(torch.uint8), rtol=0, atol=0)
        torch.testing.assert_close(qt.view(torch.uint8), q.t().contiguous().view(torch.uint8), rtol=0, atol=0)
        assert float(amax) == float(x.float().abs().max())
        q1, _, _ = kq.cast_launch(x.reshape(-1), scale, None, 0, False, E4M3)
        torch.testing.assert_close(q1.view(torch.uint8), _expected(x.reshape(-1), 2.0).view(torch.uint8),
                                   rtol=0, atol=0)


def test_cuda_graph_capture_of_cached_launches():
    x = torch.randn(256, 512, device="cuda").bfloat16()
    scale = torch.tensor(8.0, device="cuda")
    kq.cast_transpose_launch(x, scale, None, 0, False, E4M3)  # compiled and cached before capture
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        kq.cast_transpose_launch(x, scale, None, 0, False, E4M3)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        q, _, amax, _ = kq.cast_transpose_launch(x, scale, None, 0, False, E4M3)
    x.copy_(torch.randn_like(x))
    g.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(q.view(torch.uint8), _expected(x, 8.0).view(torch.uint8), rtol=0, atol=0)
    assert float(amax) == float(x.float().abs().max())


# ------------------------------------------------------------------------------------------------
# Amax words handed from launch to launch (kernels/_library.AmaxChain). The chain's new words are
# poisoned with a huge value: an amax that reads one a kernel did not zero is wrong by that much.

POISON = 3.0e38


@pytest.fixture
def poisoned_words(monkeypatch):
    monkeypatch.setattr(L.AMAX_CHAIN, "_word", lambda device: torch.full((), POISON, device=device))
    L.AMAX_CHAIN.reset()
    yield L.AMAX_CHAIN
    L.AMAX_CHAIN.reset()


@pytest.fixture
def poisoned(poisoned_words, monkeypatch):
    monkeypatch.setattr(L.AMAX_CHAIN, "eager", True)  # plain launches chained (the default) ...
    monkeypatch.setattr(L.AMAX_CHAIN, "eager_side_streams", True)  # ... on every stream (not the default)
    return poisoned_words


def _casts(xs, scale):
    """One cast with its transposed copy per tensor: their amaxes."""
    return [kq.cast_transpose_launch(x, scale, None, 0, False, E4M3)[2] for x in xs]


def _maxima(xs):
    return [float(x.float().abs().max()) for x in xs]


def test_amax_words_chain_on_a_stream(poisoned):
    xs = [torch.randn(64, 128, device="cuda").bfloat16() * m for m in (4.0, 0.5, 2.0, 0.125)]
    scale = torch.tensor(4.0, device="cuda")
    chained = poisoned.chained
    got = _casts(xs, scale)
    assert poisoned.chained - chained == len(xs) - 1  # all but the first took the word zeroed before them
    assert [float(a) for a in got] == _maxima(xs)


def test_plain_launches_chain_on_the_default_stream_only(poisoned_words):
    """Eager launches on the default stream chain their amax words by default; on another stream
    (torch.compile's CUDA-graph warm-up runs on one of its own) each takes a fill."""
    assert poisoned_words.eager and not poisoned_words.eager_side_streams
    xs = [torch.randn(64, 128, device="cuda").bfloat16() * m for m in (4.0, 0.5, 2.0)]
    scale = torch.tensor(4.0, device="cuda")
    chained = poisoned_words.chained
    got = _casts(xs, scale)
    assert poisoned_words.chained - chained == len(xs) - 1
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        got += _casts(xs, scale)
    torch.cuda.current_stream().wait_stream(side)
    assert poisoned_words.chained - chained == len(xs) - 1
    assert [float(a) for a in got] == _maxima(xs) * 2


def test_amax_words_chain_per_stream(poisoned):
    # launches alternate between two streams: each stream's chain hands its own words on
    a, b = torch.cuda.Stream(), torch.cuda.Stream()
    xs = [torch.randn(256, 512, device="cuda").bfloat16() * (1.0 + i) for i in range(6)]
    scale = torch.tensor(1.0, device="cuda")
    for s in (a, b):
        s.wait_stream(torch.cuda.current_stream())
    got = []
    for i, x in enumerate(xs):
        with torch.cuda.stream(a if i % 2 else b):
            got.append(kq.cast_transpose_launch(x, scale, None, 0, False, E4M3)[2])
    torch.cuda.synchronize()
    assert [float(t) for t in got] == _maxima(xs)


def test_amax_words_chain_across_threads_on_one_stream(poisoned):
    import threading

    xs = [torch.randn(128, 256, device="cuda").bfloat16() * (0.5 + i) for i in range(8)]
    scale = torch.tensor(1.0, device="cuda")
    got: dict[int, torch.Tensor] = {}

    def work(i: int) -> None:
        for _ in range(20):
            got[i] = kq.cast_transpose_launch(xs[i], scale, None, 0, False, E4M3)[2]

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(xs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    torch.cuda.synchronize()
    assert [float(got[i]) for i in range(len(xs))] == _maxima(xs)


def test_amax_words_under_graph_capture(poisoned_words, monkeypatch):
    # with plain launches not chained (eager off), plain launches and a capture nobody announced
    # take a torch.zeros per launch; a graph_step capture is chained, its words zeroed in the graph
    # at every replay; all give the replayed inputs' amaxes, replay after replay
    import fp8ops

    poisoned = poisoned_words
    monkeypatch.setattr(poisoned, "eager", False)

    xs = [torch.randn(128, 256, device="cuda").bfloat16() for _ in range(3)]
    scale = torch.tensor(2.0, device="cuda")
    _casts(xs, scale)
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        _casts(xs, scale)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    chained = poisoned.chained
    with torch.cuda.graph(g):
        plain = _casts(xs, scale)
    assert poisoned.chained == chained

    def step(carry, a, b, c):
        return carry, torch.stack(_casts([a, b, c], scale))

    graphed = fp8ops.graph_step(step)
    chained_plain = poisoned.chained
    for k in range(5):
        ins = [torch.randn(128, 256, device="cuda").bfloat16() * (k + 1) * m for m in (1.0, 0.25, 3.0)]
        for x, new in zip(xs, ins):
            x.copy_(new)
        g.replay()
        _, out = graphed(None, *ins)
        torch.cuda.synchronize()
        assert [float(a) for a in plain] == _maxima(ins)
        assert out.tolist() == _maxima(ins), f"call {k}"
    # only the capture chained: two of its three casts took the word zeroed before them
    assert chained_plain == chained and poisoned.chained - chained == 2
    assert graphed.stats["captures"] == 1 and graphed.stats["replays"] >= 2


@pytest.mark.parametrize("kw", [dict(), dict(margin=1, power_2_scale=True), dict(amax_compute_algo="most_recent")])
def test_fused_update_equals_the_torch_update(kw, monkeypatch):
    """fp8ops.update of a transformer_layer state on the GPU: the fused kernel (kernels/_update.py)
    gives the states the torch operations give, bit for bit, over three steps (the second and third
    reading the histories and scales the first returned, without a stack), NaN and inf observations
    included; it runs as one kernel plus the stack of the observations."""
    from torch.utils import _pytree as pytree

    import fp8ops
    from fp8ops import recipes

    recipe = fp8ops.DelayedScaling(amax_history_len=4, **kw)
    cfg = fp8ops.TransformerConfig(hidden_size=64, ffn_hidden_size=128, num_attention_heads=4)
    g = torch.Generator(device="cuda").manual_seed(0)

    def observed(st, step):
        def obs(s):
            v = torch.rand((), device="cuda", generator=g) * 10 ** (step - 1)
            if step == 1 and s.role == "backward":
                v = torch.tensor(float("nan") if s.pending_amax.numel() else 0.0, device="cuda")
            return s.observe(v)
        return pytree.tree_map(obs, st, is_leaf=lambda x: isinstance(x, fp8ops.ScalingState))

    from fp8ops.kernels import _update

    calls = []
    orig = _update.scale_update_launch

    def run(fused):
        monkeypatch.setattr(_update, "scale_update_launch", lambda *a, **k: calls.append(1) or orig(*a, **k))
        if not fused:
            monkeypatch.setattr(recipes.Recipe, "_fused_algo", lambda self: None)
            monkeypatch.setattr(recipes.DelayedScaling, "_fused_algo", lambda self: None)
        st = fp8ops.init_transformer_state(cfg, recipe, device="cuda")
        out = []
        torch.manual_seed(0)
        g.manual_seed(0)
        for step in range(3):
            probes = fp8ops.make_probes(st)
            grads = {k: torch.full_like(p, float("inf") if step == 2 else 0.5) for k, p in probes.items()}
            st = fp8ops.update(observed(st, step), recipe=recipe, grad_amax=grads)
            out.append(fp8ops.state_dict(st))
        monkeypatch.undo()
        return out

    fused = run(True)
    assert len(calls) == 3  # one fused update per step
    plain = run(False)
    assert len(calls) == 3
    for a, b in zip(fused, plain):
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k], k


def _linear_step(direct: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[list[torch.Tensor], dict[str, int]]:
    """fp8_linear (delayed scaling, bf16, with bias) forward + backward + update, twice, with the
    library ops called straight (``direct``) or through torch.ops; returns every output and the
    number of direct calls per op."""
    import fp8ops

    monkeypatch.setattr(L, "EAGER_DIRECT", direct)
    before = {n: op.direct_calls for n, op in vars(L.OPS).items()}
    g = torch.Generator(device="cuda").manual_seed(7)
    x = torch.randn(96, 64, device="cuda", generator=g).bfloat16().requires_grad_()
    w = (0.1 * torch.randn(48, 64, device="cuda", generator=g)).bfloat16().requires_grad_()
    b = torch.randn(48, device="cuda", generator=g).bfloat16().requires_grad_()
    dy = torch.randn(96, 48, device="cuda", generator=g).bfloat16()
    r = fp8ops.DelayedScaling()
    st = fp8ops.LinearState.init(r, device="cuda")
    outs = []
    for _ in range(2):
        probe = torch.zeros((), device="cuda", requires_grad=True)
        y, st2 = fp8ops.fp8_linear(x, w, b, st, recipe=r, grad_probe=probe)
        y.backward(dy)
        st = fp8ops.update(st2, recipe=r, grad_amax=probe.grad)
        outs += [y, x.grad, w.grad, b.grad, probe.grad,
                 *[t for t in torch.utils._pytree.tree_leaves(st) if isinstance(t, torch.Tensor)]]
        x.grad = w.grad = b.grad = None
    counts = {n: op.direct_calls - before[n] for n, op in vars(L.OPS).items() if op.direct_calls != before[n]}
    return outs, counts


def test_fp8_linear_calls_its_library_ops_straight_and_computes_the_same(monkeypatch):
    """An eager fp8_linear step calls its casts straight to the CUDA launcher (three per step: x, W,
    dy; in the first step, with a state not yet calibrated, each after an amax for its just-in-time
    scale) and gives bit for bit what the calls through torch.ops give."""
    straight, counts = _linear_step(True, monkeypatch)
    dispatched, none = _linear_step(False, monkeypatch)
    assert counts == {"cast_transpose": 6, "amax": 3} and none == {}
    assert len(straight) == len(dispatched)
    for a, b in zip(straight, dispatched):
        assert torch.equal(a, b)


def test_eager_ops_under_grad_go_through_torch_ops():
    x = torch.randn(64, 64, device="cuda").bfloat16()
    scale = torch.tensor(4.0, device="cuda")
    before = L.OPS.cast_transpose.direct_calls
    q1 = L.OPS.cast_transpose(x, scale, None, 0, False, E4M3)[0]  # gradients on: the dispatcher
    assert L.OPS.cast_transpose.direct_calls == before
    with torch.no_grad():
        q2 = L.OPS.cast_transpose(x, scale, None, 0, False, E4M3)[0]
    assert L.OPS.cast_transpose.direct_calls == before + 1
    assert torch.equal(q1.view(torch.uint8), q2.view(torch.uint8))


def test_tma_store_of_transposed_copies_from_two_to_the_24_elements():
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA needs compute capability 9.0")
    small = torch.empty(512, 8192, dtype=E4M3, device="cuda")
    big = torch.empty(2048, 8192, dtype=E4M3, device="cuda")
    assert not L.tma_store_wanted(small, None) and L.tma_store_wanted(small, {"TMA": True})
    assert L.tma_store_wanted(big, None) and not L.tma_store_wanted(big, {"TMA": False})


def test_amax_words_chain_on_a_side_stream_inside_this_stream(poisoned_words):
    """Within ``AMAX_CHAIN.this_stream`` the launches on a side stream (FSDP2's all-gather stream)
    chain their amax words, across blocks; outside it, each takes a fill; the amaxes are right."""
    xs = [torch.randn(64, 128, device="cuda").bfloat16() * m for m in (4.0, 0.5, 2.0)]
    scale = torch.tensor(4.0, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    got, counts = [], []
    with torch.cuda.stream(side):
        for _ in range(2):
            chained = poisoned_words.chained
            with poisoned_words.this_stream(torch.device("cuda")):
                got += _casts(xs, scale)
            counts.append(poisoned_words.chained - chained)
        chained = poisoned_words.chained
        got += _casts(xs, scale)
        counts.append(poisoned_words.chained - chained)
    torch.cuda.current_stream().wait_stream(side)
    assert counts == [len(xs) - 1, len(xs), 0]  # the second block takes the word the first one left
    assert [float(a) for a in got] == _maxima(xs) * 3
