"""kernels/_library.FastKernel, the cached launch path of the Triton kernels, with a stand-in JIT
function on CPU: which calls reuse a compiled kernel, which go back through Triton, and the argument
order handed to the compiled kernel's launcher. (The GPU test compares it with Triton's own path.)"""

from __future__ import annotations

import inspect
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from fp8ops.kernels import _library as L


class _Param:
    def __init__(self, p: inspect.Parameter) -> None:
        self.name = p.name
        self.is_constexpr = "constexpr" in str(p.annotation)
        self.default = p.default
        self.has_default = p.default is not inspect.Parameter.empty


class _Compiled:
    """A compiled kernel whose launcher records its calls."""

    def __init__(self, n: int) -> None:
        self.n, self.function, self.packed_metadata, self.calls = n, f"function{n}", "meta", []

    def run(self, *a: Any) -> None:
        self.calls.append(a)


class _JIT:
    """A JIT function with the signature of ``kernel``; each Triton launch "compiles" a new kernel."""

    def __init__(self, kernel: Any) -> None:
        sig = inspect.signature(kernel)
        self.arg_names = list(sig.parameters)
        self.params = [_Param(p) for p in sig.parameters.values()]
        self.triton_launches: list[tuple[Any, tuple[Any, ...], dict[str, Any]]] = []
        self.compiled: list[_Compiled] = []

    def __getitem__(self, grid: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> _Compiled:
            self.triton_launches.append((grid, args, kwargs))
            self.compiled.append(_Compiled(len(self.compiled)))
            return self.compiled[-1]
        return run


constexpr = "constexpr"  # what the stand-in reads from a parameter's annotation


def _kernel(x_ptr, y_ptr, n, alpha, BLOCK: constexpr, FLAG: constexpr = False):  # noqa: ANN001
    pass


@pytest.fixture
def fk(monkeypatch: pytest.MonkeyPatch) -> tuple[L.FastKernel, _JIT]:
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 1234, raising=False)
    monkeypatch.setattr(L, "_hooks_set", lambda: False)
    jit = _JIT(_kernel)
    return L.FastKernel(jit), jit


def test_second_launch_of_a_specialization_calls_the_compiled_kernel_in_signature_order(fk):
    k, jit = fk
    x, y = torch.zeros(64), torch.zeros(64)
    k[(3,)](x, y, 64, 0.5, BLOCK=32, num_warps=4)
    assert len(jit.triton_launches) == 1 and jit.triton_launches[0][2]["num_warps"] == 4
    k[(5, 2)](x, y, n=64, alpha=2.0, BLOCK=32)
    assert len(jit.triton_launches) == 1  # no second trip through Triton
    (call,) = jit.compiled[0].calls
    # grid padded to 3-D, the current stream, the compiled function, no launch metadata or hooks,
    # then every argument in signature order with the default of FLAG filled in
    assert call[:9] == (5, 2, 1, 1234, "function0", "meta", None, None, None)
    assert call[9:11] == (x, y) and call[11:] == (64, 2.0, 32, False)


@pytest.mark.parametrize("change", ["unaligned pointer", "dtype", "int 1", "int not multiple of 16", "int64",
                                    "constexpr", "num_warps", "bool for int"])
def test_what_a_compilation_depends_on_goes_back_through_triton(fk, change):
    k, jit = fk
    base = torch.zeros(64)
    # n starts at 17 when the change is to 1: then only "== 1" tells them apart
    x, n, block, warps = base[:32], (17 if change == "int 1" else 32), 32, 4
    k[(1,)](x, base, n, 1.0, BLOCK=block, num_warps=warps)
    if change == "unaligned pointer":
        x = base[1:33]  # 4 bytes past a 16-byte boundary
    elif change == "dtype":
        x = torch.zeros(32, dtype=torch.bfloat16)
    elif change == "int 1":
        n = 1
    elif change == "int not multiple of 16":
        n = 33
    elif change == "int64":
        n = 2**32
    elif change == "constexpr":
        block = 64
    elif change == "num_warps":
        warps = 8
    else:
        n = True
    k[(1,)](x, base, n, 1.0, BLOCK=block, num_warps=warps)
    assert len(jit.triton_launches) == 2 and not jit.compiled[0].calls
    k[(1,)](x, base, n, 1.0, BLOCK=block, num_warps=warps)  # now known: direct
    assert len(jit.triton_launches) == 2 and len(jit.compiled[1].calls) == 1


@pytest.mark.parametrize("change", ["block shape", "dtype"])
def test_tma_descriptors_are_keyed_by_what_triton_specializes_on(fk, change):
    """A host TMA descriptor argument (the transposed FP8 stores) reuses the compiled kernel only
    for the same element type and block shape; the launcher gets the descriptor. (A descriptor
    of an unaligned base or row stride cannot be built: Triton refuses it.)"""
    from triton.tools.tensor_descriptor import TensorDescriptor

    k, jit = fk
    base = torch.zeros(64 * 64)
    t = base[:32 * 64].view(32, 64)
    d = TensorDescriptor(t, [32, 64], [64, 1], [16, 16])
    k[(1,)](d, t, 32, 1.0, BLOCK=16)
    k[(1,)](TensorDescriptor(t, [32, 64], [64, 1], [16, 16]), t, 32, 1.0, BLOCK=16)  # a new descriptor, same key
    assert len(jit.triton_launches) == 1 and jit.compiled[0].calls[0][9] is not d
    if change == "block shape":
        d = TensorDescriptor(t, [32, 64], [64, 1], [16, 32])
    else:
        tb = torch.zeros(32, 64, dtype=torch.bfloat16)
        d = TensorDescriptor(tb, [32, 64], [64, 1], [16, 16])
    k[(1,)](d, t, 32, 1.0, BLOCK=16)
    assert len(jit.triton_launches) == 2


def test_unknown_arguments_and_callable_grids_take_tritons_path(fk):
    k, jit = fk
    x = torch.zeros(16)
    k[(1,)](x, x, 16, 1.0, BLOCK=16)
    k[(1,)](x, x, 16, 1.0, BLOCK=16, BLOK=3)  # a misspelt keyword: Triton reports it
    k[lambda meta: (1,)](x, x, 16, 1.0, BLOCK=16)
    k[(1,)](x, x, 16, [1.0], BLOCK=16)  # an argument type the key does not know
    assert len(jit.triton_launches) == 4 and not jit.compiled[0].calls


def test_launch_hooks_take_tritons_path(fk, monkeypatch):
    k, jit = fk
    x = torch.zeros(16)
    k[(1,)](x, x, 16, 1.0, BLOCK=16)
    monkeypatch.setattr(L, "_hooks_set", lambda: True)
    k[(1,)](x, x, 16, 1.0, BLOCK=16)
    assert len(jit.triton_launches) == 2


def test_the_interpreter_runs_kernels_unwrapped(monkeypatch):
    jit = _JIT(_kernel)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert L.fast_launch(jit) is jit
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    wrapped = L.fast_launch(jit)
    assert isinstance(wrapped, L.FastKernel) and wrapped.arg_names == jit.arg_names  # attributes pass through
    assert L.fast_launch(SimpleNamespace()) is not None


def test_launch_hooks_of_either_triton_form():
    assert not L._hook_set(None) and L._hook_set(print)
    assert not L._hook_set(SimpleNamespace(calls=[])) and L._hook_set(SimpleNamespace(calls=[print]))
    runtime = getattr(getattr(L.triton, "knobs", None), "runtime", None)
    if runtime is not None:  # the installed Triton, with no profiler attached
        assert not L._hooks_set()


def test_launches_repeating_their_values_find_the_kernel_by_value(fk, monkeypatch):
    """The by-value key (ints as they are, tensors by dtype and alignment) is finer than Triton's
    specialization: other sizes of the same specialization find the compiled kernel through the
    specialization, once, and then by value; the by-value entries are bounded."""
    k, jit = fk
    x = torch.zeros(64)
    k[(1,)](x, x, 32, 1.0, BLOCK=16)
    k[(1,)](x, x, 48, 1.0, BLOCK=16)  # another multiple of 16: the same compiled kernel
    k[(1,)](x, x, 48, 3.0, BLOCK=16)  # floats are keyed by type, not value
    assert len(jit.triton_launches) == 1 and len(jit.compiled[0].calls) == 2
    assert len(k._by_value) == 1  # (48, float): the first launch of 32 went through Triton
    monkeypatch.setattr(L, "BY_VALUE_ENTRIES", 3)
    for n in range(64, 64 + 16 * 6, 16):
        k[(1,)](x, x, n, 1.0, BLOCK=16)
    assert len(k._by_value) == 3 and len(jit.triton_launches) == 1 and len(jit.compiled[0].calls) == 8


@pytest.mark.parametrize("first, second", [(1, 1.0), (1, True), (0, False), (16, 16.0)])
def test_equal_values_of_other_types_are_other_kernels(fk, first, second):
    """1, 1.0 and True are equal in Python but compile to different kernels (an int, a float and a
    bool parameter): a launch with one never reuses the kernel of another by value."""
    k, jit = fk
    x = torch.zeros(64)
    k[(1,)](x, x, first, 1.0, BLOCK=16)
    k[(1,)](x, x, first, 1.0, BLOCK=16)
    k[(1,)](x, x, second, 1.0, BLOCK=16)
    assert len(jit.triton_launches) == 2 and len(jit.compiled[0].calls) == 1


def test_a_constexpr_float_is_keyed_by_its_value(fk):
    """Constexprs compile into the kernel by value, floats too (an FP8 format's largest value, say):
    a launch with another constexpr float never reuses a kernel by value, although runtime floats
    are keyed by type only."""
    k, jit = fk
    x = torch.zeros(64)
    k[(1,)](x, x, 32, 1.0, BLOCK=16, FLAG=448.0)
    k[(1,)](x, x, 32, 1.0, BLOCK=16, FLAG=448.0)  # direct, now also known by value
    k[(1,)](x, x, 32, 1.0, BLOCK=16, FLAG=57344.0)
    assert len(jit.triton_launches) == 2 and len(jit.compiled[0].calls) == 1
