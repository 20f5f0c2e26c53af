"""The library ops whose Triton kernels go into compiled graphs (``OpSpec.traced``,
``kernels._library.inline_in_graphs``): the casts, the amax, the norms and the activations, forward
and backward (the calls of ``fp8ops.testing.kernel_calls``).

On CUDA, a graph compiled with Inductor launches the op's kernels from its own code (the op's call
is gone from the generated code), with no copy of an output the kernel writes (Inductor's
reinplacing misses nothing) and no write to an input, and gives the eager op's outputs bit for bit,
with delayed and current scaling (the just-in-time scale from ``amax_in``), E4M3 and E5M2; a
compiled ``fp8_linear``, ``layernorm_linear`` and ``fused_ln_mlp`` training step equals its
opaque-op build bit for bit. With ``INLINE_IN_GRAPHS`` off the compiled graph calls the op, as it
does on the CPU in every case. (The traced launches themselves are checked against the ops' own
launches on the CPU under the Triton interpreter: test_kernels_inline_interpret.py.)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch.utils import _pytree as pytree

import fp8ops
from fp8ops.kernels import _library
from fp8ops.testing.kernel_calls import kernel_calls
from fp8ops.testing.states import calibrate

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture
def fresh_graphs() -> Iterator[None]:
    """Every compile traces anew (no cached graph of another setting), the setting restored after."""
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config

    with inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
        torch._dynamo.reset()
        yield
    _library.INLINE_IN_GRAPHS = True
    torch._dynamo.reset()


def _compiled_code(fn: Callable[..., Any], *args: Any) -> tuple[Any, str]:
    from torch._inductor.utils import run_and_get_code

    out, codes = run_and_get_code(torch.compile(fn, fullgraph=True), *args)
    return out, "\n".join(codes)


def _cast_graph(op: str, dtype: torch.dtype) -> Callable[..., Any]:
    packet = getattr(torch.ops.fp8ops, op).default

    def body(x: torch.Tensor, scale: torch.Tensor, amax_in: torch.Tensor | None) -> Any:
        return packet(x * 2, scale, amax_in, 0, False, dtype)

    return body


def test_rule_keeps_cpu_calls_opaque(fresh_graphs: None) -> None:
    x = torch.randn(40, 24)
    scale = torch.tensor(3.0)
    body = _cast_graph("cast_transpose", E4M3)
    with torch.no_grad():
        want = body(x, scale, None)
        got, code = _compiled_code(body, x, scale, None)
    assert "torch.ops.fp8ops.cast_transpose.default" in code
    assert all(torch.equal(a.float(), b.float()) for a, b in zip(got, want))


def test_on_cuda_and_types() -> None:
    assert not _library._on_cuda((torch.ones(2), 3, None))
    assert not _library._on_cuda((1, None))
    assert _library._traceable_types([torch.Tensor])
    assert not _library._traceable_types([torch.Tensor, torch.nn.Parameter])


def test_traced_launch_takes_a_zeroed_word_outside_the_chain() -> None:
    chain = _library.AmaxChain()
    cpu = torch.device("cpu")
    with chain.output(cpu) as (_, kept):  # a chained launch leaves its next word for the next one
        assert kept is not None
    kept.fill_(7.0)  # what the launch's program 0 would have zeroed
    with chain.output(cpu, traced=True) as (amax, nxt):
        assert nxt is None and amax.dtype == torch.float32 and amax.shape == () and amax.item() == 0.0
    with chain.output(cpu) as (word, _):  # the traced launch took nothing from the chain
        assert word is kept
    assert chain.chained == 1


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("op", ["cast", "cast_transpose"])
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("current", [False, True])
def test_compiled_cast_launches_the_kernel_and_matches_eager(fresh_graphs: None, op: str, dtype: torch.dtype,
                                                              current: bool) -> None:
    torch.manual_seed(0)
    x = (torch.randn(300, 200, device="cuda") * 7).to(torch.bfloat16)
    x[3, 5] = 1e4  # saturates at scale 3
    scale = torch.tensor(3.0, device="cuda")
    amax_in = (x.float() * 2).abs().amax() if current else None
    body = _cast_graph(op, dtype)
    kernel = "_cast_transpose_fwd_kernel" if op == "cast_transpose" else "_cast_fwd_kernel"
    with torch.no_grad():
        want = body(x, scale, amax_in)
        got, code = _compiled_code(body, x, scale, amax_in)
        assert f"torch.ops.fp8ops.{op}.default" not in code and kernel in code
        for a, b in zip(got, want, strict=True):
            assert a.dtype == b.dtype and a.shape == b.shape
            assert torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a,
                               b.view(torch.uint8) if b.element_size() == 1 else b)
        _library.INLINE_IN_GRAPHS = False
        torch._dynamo.reset()
        again, code = _compiled_code(body, x, scale, amax_in)
        assert f"torch.ops.fp8ops.{op}.default" in code and kernel not in code
        assert all(torch.equal(a.float(), b.float()) for a, b in zip(again, want))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("name", [c.name for c in kernel_calls("cpu")])
def test_compiled_op_launches_its_kernels_in_place(fresh_graphs: None, name: str) -> None:
    from torch._dynamo.utils import ReinplaceCounters

    call = {c.name: c for c in kernel_calls("cuda", rows=300)}[name]
    packet = getattr(torch.ops.fp8ops, call.op).default

    def body(*args: Any) -> Any:
        return packet(*args)

    inputs = [a.clone() if isinstance(a, torch.Tensor) else a for a in call.args]
    with torch.no_grad():
        want = packet(*call.args)
        ReinplaceCounters.clear()
        got, code = _compiled_code(body, *call.args)
    assert f"torch.ops.fp8ops.{call.op}.default" not in code and call.kernel in code
    assert ReinplaceCounters.get_total_missed() == 0, "an output the kernel writes was copied"
    for a, b in zip(call.args, inputs):
        assert not isinstance(a, torch.Tensor) or torch.equal(_bits(a), _bits(b)), "an input was written"
    want, got = (w if isinstance(w, tuple) else (w,) for w in (want, got))
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a.dtype == b.dtype and a.shape == b.shape, (name, i)
        assert torch.equal(_bits(a), _bits(b)), f"{name}: output {i} differs"


def _layer_step(op: str, recipe: Any) -> tuple[Callable[..., Any], list[torch.Tensor], Any, torch.Tensor]:
    """A training step of ``op`` on bf16 operands: (step(inputs, probe) -> (y, state), inputs, the
    calibrated state, the probe)."""
    torch.manual_seed(0)
    x = torch.randn(300, 200, device="cuda").to(torch.bfloat16)

    def w(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, device="cuda") * 0.1).to(torch.bfloat16)

    if op == "fp8_linear":
        cls, inputs, probe = fp8ops.LinearState, [x, w(96, 200), w(96)], torch.zeros((), device="cuda")
    elif op == "layernorm_linear":
        cls, inputs = fp8ops.LayerNormLinearState, [x, 1 + w(200), w(200), w(96, 200), w(96)]
        probe = torch.zeros((), device="cuda")
    else:
        cls, inputs = fp8ops.LayerNormMLPState, [x, 1 + w(200), w(200), w(384, 200), w(384), w(200, 384), w(200)]
        probe = torch.zeros(2, device="cuda")
    state = cls.init(recipe, device="cuda")
    if isinstance(recipe, fp8ops.DelayedScaling):
        state = calibrate(state, recipe)
    fn = getattr(fp8ops, op)

    def step(inputs: list[torch.Tensor], probe: torch.Tensor) -> Any:
        return fn(*inputs, state, recipe=recipe, grad_probe=probe)

    return step, inputs, state, probe


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("op", ["fp8_linear", "layernorm_linear", "fused_ln_mlp"])
@pytest.mark.parametrize("recipe", [fp8ops.DelayedScaling(), fp8ops.CurrentScaling()], ids=["delayed", "current"])
def test_compiled_step_inlined_equals_opaque(fresh_graphs: None, op: str, recipe: Any) -> None:
    step, inputs, _, probe0 = _layer_step(op, recipe)
    results = {}
    for inline in (True, False):
        _library.INLINE_IN_GRAPHS = inline
        torch._dynamo.reset()
        leaves_in = [t.detach().clone().requires_grad_() for t in inputs]
        probe = probe0.clone().requires_grad_()
        y, new = torch.compile(step, fullgraph=True)(leaves_in, probe)
        y.backward(torch.linspace(-2, 2, y.numel(), device="cuda").view_as(y).to(y.dtype))
        leaves = [t for t in pytree.tree_leaves(new) if isinstance(t, torch.Tensor)]
        results[inline] = [y, *(t.grad for t in leaves_in), probe.grad, *leaves]
    assert len(results[True]) == len(results[False])
    for i, (a, b) in enumerate(zip(results[True], results[False])):
        assert torch.equal(a, b), f"{op}: result {i} differs"


class _Mode:
    """A stand-in for FunctionalTensorMode: the rule either enters it to run the traced kernel or
    hands the call back to it (the opaque node)."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None

    def __torch_dispatch__(self, op: Any, types: Any, args: Any, kwargs: Any) -> str:
        return "opaque"


def _fake_cuda(*shape: int) -> torch.Tensor:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        return torch.empty(*shape, device="cuda", dtype=torch.bfloat16)


@pytest.fixture
def sm90(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Hopper device 0 as the TMA checks see it, on any machine."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setitem(_library._TMA_DEVICES, 0, True)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def test_rule_leaves_calls_opaque_where_opaque_when_says(sm90: None) -> None:
    h = _fake_cuda(64, 32)
    for opaque, want in ((True, "opaque"), (False, "traced")):
        rule = _library.inline_in_graphs(lambda *a, **k: "traced", "cast", lambda *a, **k: opaque)
        assert rule(_Mode(), None, [type(h)], (h,), {}) == want


def test_calls_with_a_large_transposed_copy_stay_opaque(sm90: None, monkeypatch: pytest.MonkeyPatch) -> None:
    from fp8ops.kernels import activation as KA
    from fp8ops.kernels import quantize as KQ

    assert _library.OPAQUE_IN_GRAPHS_MIN_ELEMENTS == 1 << 26
    big, small, odd = _fake_cuda(8192, 8192), _fake_cuda(300, 200), _fake_cuda(8200, 8192)  # 2**26 elements
    mid = _fake_cuda(8192, 2048)  # stored through a tensor map in eager calls, but inlined: below 2**26
    assert _library.tma_store_in_eager(mid, (2048, 8192))
    fwd = KA.act_fwd.opaque_when
    assert fwd(big, "gelu", False, None, None, 0, False, E4M3, True, True)
    assert not fwd(mid, "gelu", False, None, None, 0, False, E4M3, True, True)
    assert not fwd(big, "gelu", False, None, None, 0, False, E4M3, True, False)  # no transposed copy
    assert not fwd(big, "gelu", True, None, None, 0, False, None, False, False)  # no FP8 output
    assert not fwd(big, "swiglu", False, None, None, 0, False, E4M3, True, True)  # q^T (4096, 8192)
    assert fwd(_fake_cuda(8192, 16384), "swiglu", False, None, None, 0, False, E4M3, True, True)
    assert not fwd(small, "gelu", False, None, None, 0, False, E4M3, True, True)
    assert not fwd(odd, "gelu", False, None, None, 0, False, E4M3, True, True)  # q^T rows of 8200 bytes
    bwd = KA.act_bwd.opaque_when
    assert bwd(big, big, "gelu", False, None, None, 0, False, E5M2, True, True)
    assert not bwd(mid, mid, "gelu", False, None, None, 0, False, E5M2, True, True)
    assert bwd(big, _fake_cuda(8192, 16384), "swiglu", False, None, None, 0, False, E5M2, True, False)
    assert not bwd(_fake_cuda(8192, 8224), _fake_cuda(8192, 16448), "swiglu", False, None, None, 0, False, E5M2,
                   True, False)  # a tile would cross from one half into the other: pointer stores
    assert not bwd(big, big, "gelu", True, None, None, 0, False, None, False, True)
    for spec in (KQ.cast_transpose, KQ.cast_transpose_dbias):
        assert spec.opaque_when(big, None, None, 0, False, E4M3)
        assert not spec.opaque_when(mid, None, None, 0, False, E4M3)
        assert not spec.opaque_when(small, None, None, 0, False, E4M3)
        assert not spec.opaque_when(odd, None, None, 0, False, E4M3)  # q^T (8192, 8200)
    monkeypatch.setitem(_library._TMA_DEVICES, 0, False)  # before Hopper: no tensor maps, so inlined
    assert not KQ.cast_transpose.opaque_when(big, None, None, 0, False, E4M3)
    monkeypatch.setitem(_library._TMA_DEVICES, 0, True)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not KQ.cast_transpose.opaque_when(big, None, None, 0, False, E4M3)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("op", ["cast_transpose", "act_fwd", "act_bwd"])
def test_compiled_call_with_a_large_transposed_copy_stays_opaque(fresh_graphs: None, op: str) -> None:
    # at 2**26 elements the eager launch stores q^T through a tensor map, so the compiled graph
    # calls the op; bytes as eager's
    torch.manual_seed(0)
    x = torch.randn(8192, 8192, device="cuda").to(torch.bfloat16)
    scale = torch.tensor(3.0, device="cuda")
    if op == "cast_transpose":
        args: tuple[Any, ...] = (x, scale, None, 0, False, E4M3)
    elif op == "act_fwd":
        args = (x, "gelu", False, scale, None, 0, False, E4M3, True, True)
    else:
        args = (torch.randn_like(x), x, "gelu", False, scale, None, 0, False, E5M2, True, True)
    packet = getattr(torch.ops.fp8ops, op).default
    big = _library.opaque_for_tma_store(x, (8192, 8192))
    with torch.no_grad():
        want = packet(*args)
        got, code = _compiled_code(lambda *a: packet(*a), *args)
    assert (f"torch.ops.fp8ops.{op}.default" in code) == big
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(_bits(a), _bits(b)), f"{op}: output {i} differs"


def test_opaque_in_graphs_keeps_calls_opaque_in_its_block_and_thread(sm90: None) -> None:
    import threading

    from torch._functorch import config as functorch_config

    h = _fake_cuda(64, 32)
    rule = _library.inline_in_graphs(lambda *a, **k: "traced", "cast")
    other: list[Any] = []
    worker = threading.Thread(target=lambda: other.append(rule(_Mode(), None, [type(h)], (h,), {})))
    assert rule(_Mode(), None, [type(h)], (h,), {}) == "traced"
    with pytest.raises(RuntimeError, match="inside"):
        with _library.opaque_in_graphs():
            assert rule(_Mode(), None, [type(h)], (h,), {}) == "opaque"
            assert not functorch_config.enable_autograd_cache  # its key is Dynamo's graph, before the rule
            with _library.opaque_in_graphs():  # nested: still opaque after the inner block
                pass
            assert rule(_Mode(), None, [type(h)], (h,), {}) == "opaque"
            worker.start()  # another thread traces as before
            worker.join()
            raise RuntimeError("inside")
    assert other == ["traced"]
    assert rule(_Mode(), None, [type(h)], (h,), {}) == "traced"  # restored, also after an exception
    assert functorch_config.enable_autograd_cache
