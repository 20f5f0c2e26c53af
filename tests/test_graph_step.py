"""graph_step on a CPU (every call eager: the wrapper is the step itself) and its argument checks.
The captured path is tested on the GPU (tests/test_graph_step_gpu.py)."""

from __future__ import annotations

import pytest
import torch

import fp8ops


def test_cpu_calls_run_the_step_eagerly() -> None:
    calls = []

    def step(c: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append(1)
        return c + x.sum(), x.mean()

    fn = fp8ops.graph_step(step)
    c = torch.zeros(())
    for i in range(4):
        c, m = fn(c, torch.full((3,), float(i)))
        assert float(m) == i
    assert float(c) == 3 * (0 + 1 + 2 + 3)
    assert len(calls) == 4 and fn.stats == {"eager": 4, "captures": 0, "replays": 0}


def test_bad_arguments_are_named() -> None:
    with pytest.raises(TypeError, match="graph_step: fn must be callable"):
        fp8ops.graph_step(3)  # type: ignore[arg-type]
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="graph_step: warmup must be an int >= 1"):
            fp8ops.graph_step(lambda c: (c, None), warmup=bad)  # type: ignore[arg-type]


def test_bad_args_by_reference_are_named() -> None:
    with pytest.raises(TypeError, match="graph_step: args_by_reference must be an iterable"):
        fp8ops.graph_step(lambda c, x: (c, None), args_by_reference=1)  # type: ignore[arg-type]
    for bad in ([-1], [0.5], [True], ["x"]):
        with pytest.raises(ValueError, match="graph_step: args_by_reference must hold positions"):
            fp8ops.graph_step(lambda c, x: (c, None), args_by_reference=bad)  # type: ignore[arg-type]
    fn = fp8ops.graph_step(lambda c, x: (c, None), args_by_reference=range(1))  # an iterable of ints is fine
    assert fn(torch.zeros(()), torch.ones(2))[1] is None
    past = fp8ops.graph_step(lambda c, x: (c, None), args_by_reference=[1])
    with pytest.raises(ValueError, match=r"graph_step: args_by_reference names argument 1 .* called with 1 argument"):
        past(torch.zeros(()), torch.ones(2))


@pytest.mark.parametrize("result", [torch.zeros(()), (torch.zeros(()),), (1, 2, 3)])
def test_a_step_must_return_a_pair(result: object) -> None:
    fn = fp8ops.graph_step(lambda c: result)
    with pytest.raises(TypeError, match=r"graph_step: the step must return a pair \(carry, outputs\)"):
        fn(torch.zeros(()))


def test_static_copies_keep_the_arguments_strides() -> None:
    """The graph's own copy of an argument has the argument's strides (a compiled step guards on
    them and would recompile inside the capture otherwise); an overlapping (expanded) argument,
    which cannot be written in place, is copied contiguous. Values and requires_grad are kept."""
    from fp8ops.graph_step import _static_copy

    buf = torch.arange(4 * 9, dtype=torch.float32).reshape(4, 9)
    for t in (buf[:, 1:], buf.t(), buf[::2, ::3], torch.randn(3, 5).requires_grad_()):
        c = _static_copy(t)
        assert c.stride() == t.stride() and c.shape == t.shape and torch.equal(c, t.detach())
        assert c.requires_grad == t.requires_grad and c.data_ptr() != t.data_ptr()
        assert c._base is None and not c.grad_fn  # a tensor of its own, not a view into t
    expanded = torch.randn(1, 5).expand(4, 5)
    c = _static_copy(expanded)
    assert c.is_contiguous() and torch.equal(c, expanded)
    assert _static_copy(3) == 3 and _static_copy(None) is None


def test_warm_up_calls_trace_compiled_graphs_with_opaque_library_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    """A warm-up call that may be followed by a capture runs inside kernels._library.opaque_in_graphs
    (a graph compiled there keeps the library ops opaque calls, whose launches chain their amax
    words in the capture); a call that will never be captured (here: on a CPU) does not."""
    import importlib

    from fp8ops.kernels import _library

    G = importlib.import_module("fp8ops.graph_step")  # the module (fp8ops.graph_step is the function)

    seen: list[bool] = []

    def step(c: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        seen.append(_library._inlined("cast"))
        return c + x.sum(), x.mean()

    fp8ops.graph_step(step)(torch.zeros(()), torch.ones(3))  # CPU tensors: never captured
    assert seen == [True]
    # as if on a GPU: the calls would be captured once warmed up
    monkeypatch.setattr(G.GraphStep, "_eager_reason", staticmethod(lambda leaves: None))
    monkeypatch.setattr(G, "_watching_syncs", lambda fn: (fn(), False))
    fn = fp8ops.graph_step(step, warmup=3)
    c = torch.zeros(())
    for _ in range(2):
        c, _ = fn(c, torch.ones(3))
    assert seen == [True, False, False] and fn.stats["eager"] == 2
    assert _library._inlined("cast")  # restored after each call
    # a step that synchronizes on every call: once graph_step has given up on capturing it, its
    # calls trace as any other
    seen.clear()
    monkeypatch.setattr(G, "_watching_syncs", lambda fn: (fn(), True))
    fn = fp8ops.graph_step(step)
    with pytest.warns(UserWarning, match="keeps running eagerly"):
        for _ in range(4):
            c, _ = fn(c, torch.ones(3))
    assert seen == [False, False, False, True]
