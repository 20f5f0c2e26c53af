"""kernels/_library.EagerOp (``OPS``): fp8ops's calls of its library ops go straight to the op's
kernel in plain eager mode and through ``torch.ops`` whenever anything else could intercept the
call; and ``tma_store_wanted``, the size rule for TMA stores of transposed copies.

On the CPU the ops are built with ``device_type="cpu"`` around the CPU reference kernels, so that
the rule is exercised with CPU tensors; a recording kernel tells which way each call went. (The GPU
tests check the CUDA ops: tests/test_kernels_launch_gpu.py.)"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import fp8ops  # noqa: F401  (defines the library ops)
from fp8ops.kernels import _library as L
from fp8ops.reference import activation as ref_act
from fp8ops.reference import quantize as ref_q

E4M3 = torch.float8_e4m3fn


class _Recorder:
    """A kernel that records its calls and computes with ``fn``."""

    def __init__(self, fn: Any) -> None:
        self.fn, self.calls = fn, []

    def __call__(self, *args: Any) -> Any:
        self.calls.append(args)
        return self.fn(*args)


def _op(name: str, ref: Any) -> tuple[L.EagerOp, _Recorder]:
    kernel = _Recorder(ref)
    return L.EagerOp(getattr(torch.ops.fp8ops, name), kernel, device_type="cpu"), kernel


class _Sub(torch.Tensor):
    pass


class _PassDispatch(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        return func(*args, **(kwargs or {}))


class _PassFunction(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        return func(*args, **(kwargs or {}))


def _cast_args() -> tuple[Any, ...]:
    x = torch.linspace(-3, 3, 48).reshape(6, 8)
    return x, torch.tensor(16.0), None, 0, False, E4M3


def _same(a: Any, b: Any) -> None:
    for u, v in zip(a, b):
        assert torch.equal(u.view(torch.uint8) if u.dtype == E4M3 else u, v.view(torch.uint8) if v.dtype == E4M3 else v)


def test_plain_eager_call_without_gradients_goes_straight_to_the_kernel() -> None:
    op, kernel = _op("cast_transpose", ref_q.cast_transpose)
    args = _cast_args()
    with torch.no_grad():
        out = op(*args)
    assert op.direct_calls == 1 and len(kernel.calls) == 1 and kernel.calls[0] == args
    _same(out, torch.ops.fp8ops.cast_transpose(*args))
    # hand-computed: amax 3, inverse scale 1/16, 3 * 16 = 48 is exact in E4M3
    assert out[2].item() == 3.0 and out[3].item() == 1 / 16 and out[0].float().max().item() == 48.0


def test_left_out_arguments_get_the_schemas_defaults() -> None:
    op, kernel = _op("act_amax", ref_act.act_amax)
    h = torch.linspace(-2, 2, 12).reshape(3, 4)
    with torch.no_grad():
        got = op(h, "relu")
    assert kernel.calls[0][2] is None and len(kernel.calls[0]) == 3  # h_inv=None from the schema
    assert got.item() == 2.0
    assert op.full_args((h, "relu", None)) == (h, "relu", None)
    with pytest.raises(TypeError, match="takes 2 to 3"):
        op.full_args((h,))


@pytest.mark.parametrize("case", ["grad enabled", "keyword", "subclass", "subclass in a list", "dispatch mode",
                                  "function mode", "switched off"])
def test_calls_anything_could_intercept_go_through_torch_ops(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    op, kernel = _op("cast_transpose", ref_q.cast_transpose)
    args = list(_cast_args())
    expected = torch.ops.fp8ops.cast_transpose(*args)
    kwargs: dict[str, Any] = {}
    mode: Any = torch.no_grad()
    if case == "grad enabled":
        mode = torch.enable_grad()
    elif case == "keyword":
        kwargs = {"out_dtype": args.pop()}
    elif case == "subclass":
        args[0] = args[0].as_subclass(_Sub)
    elif case == "dispatch mode":
        mode = _PassDispatch()
    elif case == "function mode":
        mode = _PassFunction()
    elif case == "switched off":
        monkeypatch.setattr(L, "EAGER_DIRECT", False)
    if case == "subclass in a list":
        assert not op._direct((torch.ones(2), [torch.ones(2), torch.ones(2).as_subclass(_Sub)]))
        assert op._direct((torch.ones(2), [torch.ones(2)])) is not torch.is_grad_enabled()
        return
    with torch.no_grad(), mode:
        out = op(*args, **kwargs)
    assert op.direct_calls == 0 and not kernel.calls
    _same(out[:4], expected)


def test_torch_func_transforms_go_through_torch_ops() -> None:
    op, _ = _op("amax", ref_q.amax)
    x = torch.randn(4, 5)
    seen = []

    def f(t: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            seen.append(op._direct((x,)))
        return t * 2

    torch.func.vmap(f)(x)
    torch.func.grad(lambda t: f(t).sum())(x)
    assert seen == [False, False]
    with torch.no_grad():
        assert op._direct((x,))


def test_the_backward_of_a_vjp_goes_through_torch_ops() -> None:
    """A vjp's backward runs after its transform has exited, with saved tensors that are torch.func
    wrappers of a plain type (without storage on CUDA): they go through torch.ops, which unwraps them."""
    op, kernel = _op("amax", ref_q.amax)
    seen = []

    class Double(torch.autograd.Function):
        @staticmethod
        def forward(x: torch.Tensor) -> torch.Tensor:
            return x * 2

        @staticmethod
        def setup_context(ctx: Any, inputs: Any, output: Any) -> None:
            ctx.save_for_backward(inputs[0])

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
            (saved,) = ctx.saved_tensors  # a wrapper of the transform's level
            with torch.no_grad():
                seen.append((op._direct((saved,)), op(saved).item()))
            return g * 2

    x = torch.tensor([1.0, -3.0, 2.0])
    _, vjp_fn = torch.func.vjp(Double.apply, x)
    (dx,) = vjp_fn(torch.tensor([0.5, 1.5, -4.0]))
    assert seen == [(False, 3.0)] and not kernel.calls
    assert dx.tolist() == [1.0, 3.0, -8.0]
    with torch.no_grad():
        assert op(x).item() == 3.0 and len(kernel.calls) == 1


def test_tensors_on_another_device_go_through_torch_ops() -> None:
    op, kernel = _op("amax", ref_q.amax)
    with torch.no_grad():
        assert op(torch.ones(3, device="meta")).device.type == "meta"
    assert not kernel.calls


def test_compiled_calls_trace_the_library_op() -> None:
    """Under torch.compile (fullgraph) the op is traced as the library op, never called directly."""
    op, kernel = _op("cast_transpose", ref_q.cast_transpose)
    args = _cast_args()

    @torch.compile(backend="aot_eager", fullgraph=True)
    def f(x: torch.Tensor, scale: torch.Tensor) -> Any:
        return op(x, scale, None, 0, False, E4M3)

    with torch.no_grad():
        out = f(args[0], args[1])
    assert op.direct_calls == 0 and not kernel.calls
    _same(out, torch.ops.fp8ops.cast_transpose(*args))


def test_every_library_op_is_in_OPS_with_its_cuda_kernel() -> None:
    names = {"amax", "cast", "cast_transpose", "cast_transpose_dbias", "cast_rowwise", "transpose_bytes",
             "norm_fwd", "norm_amax", "norm_bwd", "act_fwd", "act_amax", "act_bwd", "act_bwd_amax", "scaled_mm",
             "attention_fwd", "attention_bwd"}
    assert names <= set(vars(L.OPS))
    for name in names:
        op = getattr(L.OPS, name)
        assert op.packet is getattr(torch.ops.fp8ops, name) and op.device_type == "cuda"


def test_tma_stores_from_two_to_the_24_elements_unless_the_config_says(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(L, "tma_store_ok", lambda out: True)
    small = torch.empty(4096, 4095, dtype=torch.uint8, device="meta")  # 2**24 - 4096 elements
    big = torch.empty(4096, 4096, dtype=torch.uint8, device="meta")  # 2**24
    assert L.TMA_STORE_MIN_ELEMENTS == 2**24
    assert not L.tma_store_wanted(small, None) and L.tma_store_wanted(big, None)
    assert not L.tma_store_wanted(small, {"BLOCK_M": 64}) and L.tma_store_wanted(big, {"BLOCK_M": 64})
    assert L.tma_store_wanted(small, {"TMA": True}) and not L.tma_store_wanted(big, {"TMA": False})
    monkeypatch.setattr(L, "tma_store_ok", lambda out: False)  # a device or layout without tensor maps
    assert not L.tma_store_wanted(big, None) and not L.tma_store_wanted(small, {"TMA": True})
