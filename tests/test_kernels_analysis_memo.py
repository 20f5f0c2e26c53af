"""The memo of torch's analysis of traced Triton kernel calls (``_library.memoized_analysis``).

``torch.compile`` generates a kernel's TTIR to find the tensors a call writes, at every call site
and compilation stage; the memo keeps one analysis per kernel and signature (``analysis_key``).
Wrong keys would give a call the writes of another: the tests pin what the key separates, that a
kept result is a copy, and, on the real analysis of a library kernel (TTIR generated for an sm_90
target without a GPU, in a process without the Triton interpreter), that a kept answer equals a
fresh one and that a constexpr that changes the written outputs changes the answer.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import torch
from torch._higher_order_ops import triton_kernel_wrap as twrap

from fp8ops.kernels import _library as L


class _Stub:
    """An analysis that counts its calls and answers the written names it was told."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, kernel, kwargs, tma=None):  # type: ignore[no-untyped-def]
        self.calls += 1
        return {"writes": [n for n, a in kwargs.items() if isinstance(a, torch.Tensor) and a.dtype == torch.float32]}


def _kernel() -> object:
    return object()


def test_equal_signatures_share_one_analysis_and_get_copies() -> None:
    stub = _Stub()
    memo = L.memoized_analysis(stub)
    k = _kernel()
    kw = {"x": torch.empty(3, dtype=torch.float32), "M": 8, "BLOCK": 64, "flag": True, "p": None}
    first = memo(k, kw, {})
    first["writes"].append("garbage")  # a caller may change what it got
    second = memo(k, {**kw, "x": torch.empty(100, dtype=torch.float32)}, {})  # sizes are not in the TTIR
    assert second == {"writes": ["x"]}
    second["writes"].clear()
    assert memo(k, kw, {}) == {"writes": ["x"]}
    assert stub.calls == 1 and memo.hits == 2 and memo.misses == 1


def test_what_the_key_separates() -> None:
    stub = _Stub()
    memo = L.memoized_analysis(stub)
    k = _kernel()
    base = {"x": torch.empty(3, dtype=torch.float32), "M": 8, "BLOCK": 64, "flag": True}
    memo(k, base, {})
    variants = [
        {**base, "x": torch.empty(3, dtype=torch.bfloat16)},  # a tensor's dtype
        {**base, "M": 9},  # an int's value (Triton specializes on 1 and on divisibility)
        {**base, "BLOCK": 128},  # a constexpr
        {**base, "flag": 1},  # True == 1, but a bool and an int are different arguments
        {**base, "flag": None},
        {**base, "y": torch.empty(3, dtype=torch.float32)},  # another argument name
    ]
    for v in variants:
        memo(k, v, {})
    memo(_kernel(), base, {})  # another kernel
    memo(k, base, {"x": ("stable", ([64, 64],))})  # TMA metadata
    assert stub.calls == 2 + len(variants) + 1 and memo.hits == 0


def test_autotuner_wrappers_of_one_kernel_share_a_key() -> None:
    # torch wraps a launch with launch options (num_warps=...) into an Autotuner of its own at every
    # call site; the analysis reads the wrapped JIT function and the first config's values
    import triton

    from fp8ops.kernels import quantize as KQ

    fn = KQ._cast_transpose_fwd_kernel  # the JIT function (here, under the interpreter, its stand-in)
    fn = fn if hasattr(fn, "arg_names") and not isinstance(fn, L.FastKernel) else fn.fn
    kw = {"x": torch.empty(2), "M": 8}

    def wrapper(num_warps: int = 4, **values: int) -> object:
        return triton.autotune(configs=[triton.Config(dict(values), num_warps=num_warps)], key=[])(fn)

    a, b = wrapper(), wrapper()
    assert a is not b
    assert L.analysis_key(a, kw, {}) == L.analysis_key(b, kw, {})
    assert L.analysis_key(a, kw, {}) != L.analysis_key(wrapper(BLOCK_M=32), kw, {})
    assert L.analysis_key(a, kw, {}) != L.analysis_key(wrapper(num_warps=8), kw, {})
    assert L.analysis_key(a, kw, {}) != L.analysis_key(fn, kw, {})


def test_symbolic_sizes_share_one_key() -> None:
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    env = ShapeEnv()
    s = env.create_unbacked_symint()
    t = env.create_unbacked_symint()
    stub = _Stub()
    memo = L.memoized_analysis(stub)
    k = _kernel()
    memo(k, {"x": torch.empty(2), "M": s}, {})
    memo(k, {"x": torch.empty(2), "M": t}, {})  # the TTIR sees every symbolic size as 2
    assert stub.calls == 1


def test_unknown_kinds_and_memo_off_are_analysed_every_time(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    stub = _Stub()
    memo = L.memoized_analysis(stub)
    k = _kernel()
    odd = {"x": torch.empty(2), "cfg": [1, 2]}  # a list: not a kind the key knows
    memo(k, odd, {})
    memo(k, odd, {})
    assert stub.calls == 2 and memo.unkeyed == 2
    monkeypatch.setattr(L, "ANALYSIS_MEMO", False)
    plain = {"x": torch.empty(2), "M": 4}
    memo(k, plain, {})
    memo(k, plain, {})
    assert stub.calls == 4 and memo.hits == 0


def test_older_two_argument_analysis() -> None:
    calls = []

    def analysis(kernel, kwargs):  # type: ignore[no-untyped-def]
        calls.append(1)
        return ["x"]

    memo = L.memoized_analysis(analysis)
    k = _kernel()
    assert memo(k, {"x": torch.empty(2)}) == ["x"] and memo(k, {"x": torch.empty(2)}) == ["x"]
    assert len(calls) == 1


def test_install_replaces_torchs_analysis_once(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    name = next(n for n in L._ANALYSES if hasattr(twrap, n))
    original = getattr(twrap, name)
    original = getattr(original, "original", original)
    monkeypatch.setattr(twrap, name, original)
    L.install_analysis_memo()
    installed = getattr(twrap, name)
    assert installed.fp8ops_memo and installed.original is original
    L.install_analysis_memo()
    assert getattr(twrap, name) is installed
    monkeypatch.setattr(twrap, name, original)
    monkeypatch.setattr(L, "ANALYSIS_MEMO", False)
    L.install_analysis_memo()
    assert getattr(twrap, name) is original


_REAL = textwrap.dedent("""
    import torch, triton
    from triton.backends.compiler import GPUTarget

    class Target:  # TTIR for an sm_90 GPU, on a machine without one
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

    triton.runtime.driver.set_active(Target())
    from torch._higher_order_ops import triton_kernel_wrap as twrap
    from torch._subclasses.fake_tensor import FakeTensorMode
    from fp8ops.kernels import _library as L
    from fp8ops.kernels import quantize as KQ

    name = next(n for n in L._ANALYSES if hasattr(twrap, n))
    analysis = getattr(twrap, name)
    analysis = getattr(analysis, "original", analysis)
    memo = L.memoized_analysis(analysis)
    kernel = KQ._cast_transpose_fwd_kernel
    kernel = getattr(kernel, "fn", kernel)

    def written(result):
        if isinstance(result, list):
            return sorted(result)
        return sorted(d.name for d in result.read_writes.writes)

    def args(dbias, make):
        f8, f32 = torch.float8_e4m3fn, torch.float32
        return dict(x_ptr=make(torch.bfloat16), q_ptr=make(f8), qt_ptr=make(f8), qt_desc=make(f8),
                    scale_ptr=make(f32), amax_in_ptr=make(f32), amax_ptr=make(f32), amax_next_ptr=make(f32),
                    inv_ptr=make(f32), dbias_ptr=make(f32), M=8192, K=512, stride_xm=512, FP8_MAX=448.0,
                    MARGIN=0, SCALE_FROM_AMAX=False, POWER_2=False, BLOCK_M=64, BLOCK_K=64, GROUP_M=8,
                    DBIAS=dbias, TMA_T=False)

    # as torch launches it: an Autotuner of its own around the kernel at every call site
    site = lambda: triton.autotune(configs=[triton.Config({}, num_warps=4)], key=[])(kernel)
    real = lambda dt: torch.empty(4, dtype=dt)
    fresh = [written(analysis(site(), args(d, real), {})) for d in (False, True)]
    kept = [written(memo(site(), args(d, real), {})) for d in (False, True)]
    with FakeTensorMode() as mode:
        fake = lambda dt: torch.empty(4, dtype=dt)
        again = [written(memo(site(), args(d, fake), {})) for d in (False, True)]
    print(repr((fresh, kept, again, memo.hits, memo.misses)))
""")


def test_real_analysis_of_a_library_kernel() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    out = subprocess.run([sys.executable, "-c", _REAL], capture_output=True, text=True, env=env, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    fresh, kept, again, hits, misses = eval(out.stdout.strip().splitlines()[-1])
    assert "dbias_ptr" not in fresh[0] and "dbias_ptr" in fresh[1]
    assert {"q_ptr", "qt_ptr", "amax_ptr", "inv_ptr"} <= set(fresh[0])
    assert kept == fresh and again == fresh
    assert (hits, misses) == (2, 2)
