"""The traced CUDA kernels of the library ops (``OpSpec.traced``: the launchers with ``traced=True``,
which a compiled CUDA graph runs in place of the op's call) under TRITON_INTERPRET=1, on CPU.

A traced launch must give what the op's own launch gives, bit for bit: the same kernels with the
same arguments, but a zeroed amax word of its own instead of the chain's, no TMA store and the
bias / norm-weight gradients' finalizing sums launched the same way. Under the interpreter the
traced launch runs its kernels eagerly (``_library.graph_kernel``), so these tests check the traced
code path of every op (arguments, placeholders, outputs, the finalize) on the CPU; that Inductor
launches the kernels inside a compiled graph is checked on the GPU (test_kernels_inline.py).
"""

from __future__ import annotations

import os
import pytest
import torch

from fp8ops.kernels import _library as L
from fp8ops.kernels import activation as KA
from fp8ops.kernels import norm as KN
from fp8ops.kernels import quantize as KQ
from fp8ops.testing.kernel_calls import KernelCall, kernel_calls

pytestmark = [
    pytest.mark.interpret,
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs only under TRITON_INTERPRET=1"),
]

SPECS = {spec.schema.split("(")[0]: spec for module in (KQ, KN, KA) for spec in vars(module).values()
         if isinstance(spec, L.OpSpec)}
CALLS = kernel_calls("cpu")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


@pytest.mark.parametrize("call", CALLS, ids=[c.name for c in CALLS])
def test_traced_launch_equals_the_ops_launch(call: KernelCall) -> None:
    name, spec = call.name, SPECS[call.op]
    want = spec.cuda(*call.args)
    chained = L.AMAX_CHAIN.chained
    got = spec.traced(*call.args)
    assert L.AMAX_CHAIN.chained == chained, "a traced launch took a word from the amax chain"
    want, got = (w if isinstance(w, tuple) else (w,) for w in (want, got))
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a.dtype == b.dtype and a.shape == b.shape, (name, i)
        assert torch.equal(_bits(a), _bits(b)), f"{name}: output {i} differs"
    assert all(t.numel() == 0 or bool(t.float().abs().sum() > 0) for t in want), "an output is all zeros"


def test_the_ops_of_a_model_step_have_a_traced_kernel() -> None:
    # cast_rowwise and transpose_bytes (no model step calls them in a compiled graph) stay opaque,
    # as does scaled_mm and the optimizer's fused op.
    traced = {name for name, spec in SPECS.items() if spec.traced is not None}
    assert traced == {"amax", "cast", "cast_transpose", "cast_transpose_dbias", "norm_fwd", "norm_amax", "norm_bwd",
                      "norm_bwd_dropout", "act_fwd", "act_amax", "act_bwd", "act_bwd_amax"}
    assert {c.op for c in CALLS} == traced


def test_graph_kernel_runs_the_kernel_itself_under_the_interpreter() -> None:
    fn = L.graph_kernel(KA._act_fwd_kernel)
    assert not isinstance(fn, L.FastKernel) and hasattr(fn, "__getitem__")


def test_inline_in_graphs_takes_a_set_of_op_names(monkeypatch: pytest.MonkeyPatch) -> None:
    # INLINE_IN_GRAPHS: True (every traced op inlined), False (none) or a set of op names (those)
    monkeypatch.setattr(L, "INLINE_IN_GRAPHS", frozenset({"cast", "norm_bwd"}))
    assert [L._inlined(n) for n in ("cast", "norm_bwd", "cast_transpose", "act_fwd")] == [True, True, False, False]
    monkeypatch.setattr(L, "INLINE_IN_GRAPHS", False)
    assert not L._inlined("cast")
    monkeypatch.setattr(L, "INLINE_IN_GRAPHS", True)
    assert all(L._inlined(n) for n in SPECS)
