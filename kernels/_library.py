"""Registration of fp8ops's library ops through the dispatcher's low-level API, the CUDA-kernel
adapter that hands launchers the memory layout they need, the launch configuration helper
shared by the launchers, and :func:`fast_launch`, the cached launch path of their Triton kernels.

``torch.library.custom_op`` wraps every call in Python layers (autograd, alias checks, a dynamo
guard) that cost on the order of 100 µs per call on the host, more than the kernels of a whole
small layer. Ops defined here with ``Library.define`` + ``Library.impl`` reach their Python kernel
straight from the dispatcher. To ``torch.compile`` they are one node each (a fake kernel gives the
output shapes), but for the ops with a traced CUDA kernel (:class:`OpSpec`), whose Triton kernels
go into compiled CUDA graphs (:func:`inline_in_graphs`); they have no autograd kernel: fp8ops calls
them inside its autograd.Functions.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

__all__ = ["AMAX_CHAIN", "INLINE_IN_GRAPHS", "OPAQUE_IN_GRAPHS_MIN_ELEMENTS", "OPS", "TMA_STORE_MIN_ELEMENTS", "AmaxChain", "EagerOp", "FastKernel",
           "CPU_PROGRAMS", "OpSpec", "analysis_key", "cdiv", "contiguous_args", "define", "fast_launch", "graph_kernel", "inductor_fallbacks", "inline_in_graphs", "install_analysis_memo",
           "merge_config", "memoized_analysis", "next_pow2", "num_sms", "opaque_for_tma_store", "opaque_in_graphs", "tma_store_in_eager", "tma_store_ok", "tma_store_wanted", "traced_kernel", "transposed_store"]

_LIB = torch.library.Library("fp8ops", "FRAGMENT")  # kept alive for the process


class OpSpec(NamedTuple):
    """A library op as a kernel module provides it: the schema ``"<name>(<args>) -> <returns>"``, the
    CUDA kernel (a launcher) and the fake kernel (output shapes for ``torch.compile``). The op is
    defined by :func:`define`, called from the fp8ops module that also gives its CPU kernel.

    ``traced``, where given, is the CUDA kernel once more, written so that a compiled graph can hold
    its Triton kernels (:func:`inline_in_graphs`): the launcher called with ``traced=True``
    (:func:`traced_kernel`), whose allocations and launches are made through
    ``torch.library.wrap_triton`` (:func:`graph_kernel`), with a fresh zeroed amax word per launch
    and no host tensor maps.

    ``opaque_when``, where given, takes the op's arguments and says whether a call stays one opaque
    node of a compiled graph even so: the calls whose CUDA kernel would store its transposed FP8
    copy through a host tensor map, which a traced launch cannot (torch's tracing of ``wrap_triton``
    takes no TMA descriptors), on outputs large enough for the tensor map to save more than the
    opaque call costs (:func:`opaque_for_tma_store`)."""

    schema: str
    cuda: Callable[..., Any]
    fake: Callable[..., Any]
    traced: Callable[..., Any] | None = None
    opaque_when: Callable[..., bool] | None = None


INLINE_IN_GRAPHS: bool | frozenset[str] = True
"""Whether the ops with a traced CUDA kernel put their Triton kernels into compiled graphs
(:func:`inline_in_graphs`; False: they stay opaque calls; a set of op names: only those ops do;
for measurements and tests)."""


def define(spec: OpSpec, *, cpu: Callable[..., Any]) -> Any:
    """Define ``fp8ops::<name>`` with every kernel side by side: the CUDA and fake kernels of
    ``spec`` and the CPU kernel ``cpu`` (the FP32 reference math).

    Returns the op overload packet ``torch.ops.fp8ops.<name>``.
    """
    name = spec.schema.split("(", 1)[0]
    _LIB.define(spec.schema, tags=(torch.Tag.pt2_compliant_tag,))
    _LIB.impl(name, spec.cuda, "CUDA")
    _LIB.impl(name, cpu, "CPU")
    torch.library.register_fake(f"fp8ops::{name}", _fallbacks_first(spec.fake), lib=_LIB)
    if spec.traced is not None:
        from torch._subclasses.functional_tensor import FunctionalTensorMode

        torch.library.register_torch_dispatch(f"fp8ops::{name}", FunctionalTensorMode,
                                              inline_in_graphs(spec.traced, name, spec.opaque_when), lib=_LIB)
    packet = getattr(torch.ops.fp8ops, name)
    setattr(OPS, name, EagerOp(packet, spec.cuda))
    _DEFINED.append(packet.default)
    if _FALLBACKS_MADE.is_set():  # an op defined after the first trace
        _make_fallbacks([packet.default])
    return packet


_DEFINED: list[Any] = []  # the op overloads define() made, for inductor_fallbacks
_FALLBACKS_MADE = threading.Event()


def inductor_fallbacks() -> None:
    """Give Inductor its fallback lowering (one opaque call) of every library op beforehand, the
    lowering it would otherwise make on first meeting the op in a graph.

    Inductor makes that fallback for an op it has no lowering for when it first lowers a call of
    it, and torch 2.11 formats the call's arguments for a log line there whether the log is on or
    not (``call_function`` in ``torch/_inductor/graph.py``; later versions format it lazily). The
    string of an Inductor IR node holds its inputs' strings, so for an argument made at the end of
    a deep graph it grows exponentially with the depth: ``linear_cross_entropy_fwd``, first met at
    the end of a GPT's forward, kept the compile of bench gpt's graphed step (library ops opaque)
    in that string for minutes, until the run's time limit (stack dumps of
    ``scripts/bench_watch.py``, one H200, torch 2.11). The fallbacks made here take the layout
    constraint Inductor's own fallback of a custom op takes (from the op's tags). Runs once, from
    the first call of a library op's fake kernel (a compile or export trace); a torch without these
    internals keeps its own behaviour."""
    if not _FALLBACKS_MADE.is_set():
        _FALLBACKS_MADE.set()
        _make_fallbacks(_DEFINED)


def _make_fallbacks(ops: list[Any]) -> None:
    try:
        from torch._inductor.lowering import lowerings, make_fallback, tag_to_layout_constraint
        from torch._library.utils import get_layout_constraint_tag
    except ImportError:  # another torch: Inductor makes its fallbacks as it meets the ops
        return
    for op in ops:
        if op not in lowerings:
            try:
                make_fallback(op, layout_constraint=tag_to_layout_constraint(get_layout_constraint_tag(op, with_default=True)))
            except Exception:  # noqa: BLE001  (a torch that refuses it: Inductor makes its own when it meets the op)
                continue


def _fallbacks_first(fake: Callable[..., Any]) -> Callable[..., Any]:
    """``fake``, calling :func:`inductor_fallbacks` on its first call."""

    @functools.wraps(fake)
    def first(*args: Any, **kwargs: Any) -> Any:
        inductor_fallbacks()
        return fake(*args, **kwargs)

    return first


def inline_in_graphs(traced: Callable[..., Any], name: str = "",
                     opaque_when: Callable[..., bool] | None = None) -> Callable[..., Any]:
    """The rule by which an op's call on CUDA tensors is replaced, while ``torch.compile`` (AOT
    autograd) functionalizes a graph, by ``traced``: its Triton kernels, allocations and zero fills
    become nodes of the graph, which Inductor launches from its own code (allocations from the
    graph's buffers, its launcher) instead of calling the op's Python kernel, as it does for
    ``torch.library.triton_op``. Calls on CPU tensors, under ``torch.export``, with
    :data:`INLINE_IN_GRAPHS` off (or not naming the op ``name``), inside :func:`opaque_in_graphs`
    and those for which ``opaque_when(*args, **kwargs)`` is true (:class:`OpSpec`) stay one opaque
    node."""

    def rule(mode: Any, op: Any, types: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if (_inlined(name) and _on_cuda(args) and _traceable_types(types)
                and not (opaque_when is not None and opaque_when(*args, **kwargs))):
            from torch.export._trace import custom_triton_ops_decomposition_disabled

            if not custom_triton_ops_decomposition_disabled():
                install_analysis_memo()
                with mode:
                    return traced(*args, **kwargs)
        return mode.__torch_dispatch__(op, types, args, kwargs)

    return rule


_OPAQUE_HERE = threading.local()


@contextlib.contextmanager
def opaque_in_graphs() -> Iterator[None]:
    """Within the block, graphs that ``torch.compile`` traces in this thread keep every library op
    one opaque call (as with :data:`INLINE_IN_GRAPHS` off); graphs traced before or elsewhere are
    unchanged.

    For steps that will be captured in a CUDA graph (``fp8ops.graph_step`` traces its warm-up and
    capture calls in this block): there a replay costs the host nothing per op, and the ops' own
    launches chain their amax words (:class:`AmaxChain`), where a graph that launches the kernels
    itself zeroes each word with a fill kernel. On an H200, graphed GPT steps of ``bench gpt``:
    6.44-6.53 against 6.93 ms at hidden 512 (337 against 481 kernels), 36.42 against 36.78 ms at
    2048 (``scripts/gpt_ab_check.py --switch inline``, ``docs/benchmarks/gpt.md``).

    AOT autograd's cache is off in the block. Where it applies (to graphs with autograd Functions
    only when ``torch._functorch.config.autograd_cache_allow_custom_autograd_functions`` is on), it
    keys a graph by what Dynamo traced, before this choice is made, so it could hand back a graph
    with the kernels inside (or keep one without them for later compiles elsewhere). Inductor's own
    cache keys the graph after the choice. A function compiled before the block keeps its graph:
    Dynamo does not guard on this setting."""
    from torch._functorch import config as functorch_config

    before = getattr(_OPAQUE_HERE, "on", False)
    _OPAQUE_HERE.on = True
    try:
        with functorch_config.patch(enable_autograd_cache=False):
            yield
    finally:
        _OPAQUE_HERE.on = before


def _inlined(name: str) -> bool:
    if getattr(_OPAQUE_HERE, "on", False):
        return False
    on = INLINE_IN_GRAPHS
    return on if isinstance(on, bool) else name in on


def _on_cuda(args: tuple[Any, ...]) -> bool:
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    return bool(tensors) and all(t.device.type == "cuda" for t in tensors)


def _traceable_types(types: Any) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor

    return all(t is torch.Tensor or t is FunctionalTensor or issubclass(t, FakeTensor) for t in types)


def graph_kernel(fn: Any, traced: bool = True) -> Any:
    """A launcher's Triton kernel as its launch calls it: ``fn`` itself for an eager launch
    (``traced`` False); for a traced CUDA kernel (:class:`OpSpec`), wrapped by
    ``torch.library.wrap_triton`` (the JIT function under :class:`FastKernel`). Under the Triton
    interpreter, which has no JIT function to wrap, the kernel itself (the traced launch then runs
    eagerly, as in the CPU tests of that path)."""
    if not traced:
        return fn
    jit = fn.fn if isinstance(fn, FastKernel) else fn
    if not isinstance(jit, (triton.runtime.JITFunction, triton.runtime.Autotuner)):
        return jit
    return torch.library.wrap_triton(jit)


# ------------------------------------------------------------------------------------------------
# The kernel analysis of compiled graphs, once per kernel and signature

ANALYSIS_MEMO = True
"""Whether :func:`install_analysis_memo` keeps the analysis of a traced Triton kernel call for
the next call with the same signature (False: it leaves torch's analysis as it is; for
measurements and tests)."""

_ANALYSES = ("identify_accessed_tensors", "identify_mutated_tensors")  # newer and older torch
_MEMO_ENTRIES = 4096
_VALUE_KINDS = (int, float, bool, str, torch.dtype, triton.language.dtype)  # by value in a key


def analysis_key(kernel: Any, kwargs: dict[str, Any], tma_descriptor_metadata: Any) -> tuple[Any, ...] | None:
    """What torch's analysis of a Triton kernel call reads of its arguments, or None where an
    argument is of a kind this does not know (the call is then analysed as usual).

    ``torch.compile`` finds the tensors a user-defined Triton kernel reads and writes from the
    kernel's TTIR, which it generates for every call site (``generate_ttir`` in
    ``torch/_higher_order_ops/triton_kernel_wrap.py``): while functionalizing the graph and again
    while Inductor lowers and schedules it. That generation sees of each argument only its kind: a
    tensor (fake, or an Inductor buffer) by its dtype (it stands in a 2-element tensor of that
    dtype), a symbolic size as the value 2, every other argument (constexprs, ints, floats, bools,
    None, strings) as it is, and a TMA descriptor by its metadata; the target is the current
    device's. So two calls with equal keys get the same TTIR and the same analysis."""
    import sys

    from torch._inductor.ir import TensorBox

    sympy = sys.modules.get("sympy")  # symbolic sizes of Inductor's IR (none exist before it is loaded)
    symbolic = (torch.SymInt, torch.SymFloat, torch.SymBool, *((sympy.Expr,) if sympy is not None else ()))
    parts: list[Any] = []
    for name, a in kwargs.items():
        if isinstance(a, (torch.Tensor, TensorBox)):
            parts.append((name, "tensor", a.dtype))
        elif isinstance(a, symbolic):
            parts.append((name, "symbolic"))
        elif a is None or type(a) in _VALUE_KINDS:
            parts.append((name, type(a).__name__, a))
        else:
            return None
    try:
        tma = _frozen(tma_descriptor_metadata)
        which = _kernel_key(kernel)
        hash((which, tma))
    except TypeError:
        return None
    return (which, tuple(parts), tma, _target())


def _kernel_key(kernel: Any) -> Any:
    # The JIT function whose TTIR is generated, by identity (the memo keeps it alive), and for an
    # Autotuner the first config's values, which the analysis merges into the arguments. torch wraps
    # a launch with launch options (num_warps, ...) into an Autotuner of its own at every call site,
    # so the wrapper's identity would key every call apart.
    if isinstance(kernel, triton.runtime.Autotuner):
        first = kernel.configs[0] if kernel.configs else None
        values = None if first is None else (_frozen(first.kwargs), first.num_warps, first.num_stages)
        return ("autotuner", id(kernel.fn), values)
    return ("jit", id(kernel))


def _jit_function(kernel: Any) -> Any:
    return kernel.fn if isinstance(kernel, triton.runtime.Autotuner) else kernel


def _target() -> Any:
    # the GPU the TTIR is generated for (the current device's), None where there is no driver
    try:
        target = triton.runtime.driver.active.get_current_target()
        hash(target)
        return target
    except Exception:
        return None


def _frozen(v: Any) -> Any:
    if isinstance(v, dict):
        return tuple(sorted((k, _frozen(x)) for k, x in v.items()))
    if isinstance(v, (list, tuple)):
        return tuple(_frozen(x) for x in v)
    return v


def memoized_analysis(analysis: Callable[..., Any]) -> Callable[..., Any]:
    """``analysis(kernel, kwargs, tma_descriptor_metadata)`` (torch's TTIR-based analysis of a
    kernel call) with its results kept by :func:`analysis_key`: a model of N identical layers
    has its kernels analysed once, not N times per compilation stage. Each call returns a copy.
    ``hits``, ``misses`` and ``unkeyed`` (calls with an argument of a kind the key does not know)
    count the calls."""
    import copy

    kept: dict[tuple[Any, ...], tuple[Any, Any]] = {}  # key -> (JIT function, result): it keeps its id

    @functools.wraps(analysis)
    def memo(*args: Any, **kw: Any) -> Any:
        key = None
        if ANALYSIS_MEMO and not kw and len(args) in (2, 3):
            key = analysis_key(args[0], args[1], args[2] if len(args) == 3 else None)
            if key is None:
                memo.unkeyed += 1  # type: ignore[attr-defined]
            elif key in kept:
                memo.hits += 1  # type: ignore[attr-defined]
                return copy.deepcopy(kept[key][1])
        result = analysis(*args, **kw)
        if key is not None:
            memo.misses += 1  # type: ignore[attr-defined]
            if len(kept) < _MEMO_ENTRIES:
                kept[key] = (_jit_function(args[0]), copy.deepcopy(result))
        return result

    memo.hits = memo.misses = memo.unkeyed = 0  # type: ignore[attr-defined]
    memo.fp8ops_memo = True  # type: ignore[attr-defined]
    memo.original = analysis  # type: ignore[attr-defined]
    return memo


def install_analysis_memo() -> None:
    """Put :func:`memoized_analysis` in place of torch's analysis of traced Triton kernel calls
    (once; called as the first traced call is put into a graph, when Inductor is loaded), in its
    module and where Inductor holds the same function; nothing with :data:`ANALYSIS_MEMO` off or a
    torch without it."""
    if not ANALYSIS_MEMO:
        return
    import sys

    from torch._higher_order_ops import triton_kernel_wrap as twrap

    for name in _ANALYSES:
        fn = getattr(twrap, name, None)
        if fn is None or getattr(fn, "fp8ops_memo", False):
            continue
        memo = memoized_analysis(fn)
        setattr(twrap, name, memo)
        for mod_name in ("torch._inductor.ir", "torch._inductor.graph", "torch._inductor.scheduler"):
            mod = sys.modules.get(mod_name)
            if mod is not None and getattr(mod, name, None) is fn:
                setattr(mod, name, memo)


class _Ops:
    """The namespace :data:`OPS`: one :class:`EagerOp` per library op, set by :func:`define`."""

    def __repr__(self) -> str:
        return f"<fp8ops library ops: {', '.join(sorted(vars(self)))}>"


OPS = _Ops()
"""``OPS.<name>(...)`` calls ``torch.ops.fp8ops.<name>(...)``, going straight to the op's CUDA
kernel where the dispatcher would (:class:`EagerOp`); fp8ops's own call sites use it."""

EAGER_DIRECT = True
"""Whether :class:`EagerOp` calls a CUDA kernel directly in plain eager mode (False: always through
the dispatcher; for measurements and tests)."""


class EagerOp:
    """A library op called the way the dispatcher would call it, minus the dispatcher's host time.
    ``OPS`` holds one per op with its CUDA kernel (``device_type`` is for tests).

    Going through ``torch.ops`` costs a library op 13-35 µs of host time per call on top of its
    CUDA kernel (the boxed call into Python and the argument conversion;
    ``scripts/launch_overhead.py``). Where nothing but that kernel could run, this calls the kernel
    (the launcher) itself: every tensor argument a plain dense CUDA ``torch.Tensor`` (or
    ``nn.Parameter``; not a ``torch.func`` wrapper), gradients off (fp8ops calls its library ops
    inside autograd Functions, whose forward and backward run without gradients), and none of what
    reroutes a dispatch active:
    ``torch.compile`` tracing, a ``torch.func`` transform, a ``TorchDispatchMode`` (fake tensors,
    functionalization, ``FlopCounterMode``...), a ``TorchFunctionMode``. Arguments the call leaves
    out get the schema's defaults, as the dispatcher gives them. Everything else, keyword
    arguments included, goes through ``torch.ops``.
    """

    def __init__(self, packet: Any, kernel: Callable[..., Any], device_type: str = "cuda") -> None:
        self.packet = packet
        self.kernel = kernel  # the op's kernel for tensors on ``device_type``
        self.device_type = device_type
        args = packet.default._schema.arguments
        self._n = len(args)
        self._defaults: list[Any] = [a.default_value if a.has_default_value() else _NO_DEFAULT for a in args]
        # the arguments a call must give: those up to the last one without a default
        self._required = max((i + 1 for i, d in enumerate(self._defaults) if d is _NO_DEFAULT), default=0)
        self.direct_calls = 0  # calls that went straight to the CUDA kernel (for tests and profiles)

    def __repr__(self) -> str:
        return f"EagerOp({self.packet._qualified_op_name})"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs or torch.compiler.is_compiling() or not self._direct(args):
            return self.packet(*args, **kwargs)
        self.direct_calls += 1
        return self.kernel(*self.full_args(args))

    def full_args(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        """``args`` completed with the schema's defaults of the arguments left out."""
        if len(args) == self._n:
            return args
        if not self._required <= len(args) <= self._n:
            raise TypeError(f"{self!r}: {len(args)} arguments given, the schema takes {self._required} to {self._n}")
        return (*args, *self._defaults[len(args):])

    def _direct(self, args: tuple[Any, ...]) -> bool:
        if not EAGER_DIRECT or torch.is_grad_enabled() or not self._required <= len(args) <= self._n:
            return False
        seen = False
        for a in args:
            if isinstance(a, torch.Tensor):
                if not self._plain(a):
                    return False
                seen = True
            elif type(a) is list and not all(self._plain(t) for t in a if isinstance(t, torch.Tensor)):
                return False  # a Tensor[] argument
        if not seen:
            return False
        return not (torch._C._are_functorch_transforms_active() or torch._C._len_torch_dispatch_stack()
                    or torch._C._is_torch_function_mode_enabled())

    def _plain(self, t: torch.Tensor) -> bool:
        # a dense tensor with storage on this op's device: no subclass, no torch.func wrapper (the
        # tensors of a vjp's backward after its transform has exited are wrappers of a plain type)
        return (type(t) in _PLAIN and t.device.type == self.device_type and t.layout == torch.strided
                and not t.is_nested and not _is_functorch_wrapped(t))


_is_functorch_wrapped = torch._C._functorch.is_functorch_wrapped_tensor
_NO_DEFAULT = object()
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def contiguous_args(
    launch: Callable[..., Any], count: int = 1, layout: Callable[[torch.Tensor], torch.Tensor] | None = None
) -> Callable[..., Any]:
    """A CUDA kernel for :func:`define`: ``launch`` called with its first ``count`` arguments made
    contiguous (or passed through ``layout``); None arguments pass through, the others are unchanged."""
    fix = layout if layout is not None else torch.Tensor.contiguous

    def kernel(*args: Any, **kwargs: Any) -> Any:
        head = [a if a is None else fix(a) for a in args[:count]]
        return launch(*head, *args[count:], **kwargs)

    return kernel


def traced_kernel(
    launch: Callable[..., Any], count: int = 1, layout: Callable[[torch.Tensor], torch.Tensor] | None = None
) -> Callable[..., Any]:
    """The traced CUDA kernel of an op (:class:`OpSpec`): its launcher called with ``traced=True``,
    arguments laid out as :func:`contiguous_args` does for the CUDA kernel."""
    return contiguous_args(functools.partial(launch, traced=True), count, layout)


def merge_config(default: dict[str, Any], override: dict[str, Any] | None, *, name: str) -> dict[str, Any]:
    """A launcher's block sizes: ``default`` (returned as is, read-only, when there is no override)
    updated with ``override``, whose keys must be among the default's."""
    if not override:
        return default
    unknown = set(override) - set(default)
    if unknown:
        raise ValueError(f"{name}: unknown launch config keys {sorted(unknown)}; expected {sorted(default)}")
    return {**default, **override}


# ------------------------------------------------------------------------------------------------
# Transposed FP8 copies through TMA stores

_TMA_DEVICES: dict[int, bool] = {}


def _tma_device(device: torch.device) -> bool:
    """Whether a CUDA device has tensor maps (compute capability 9.0 or newer), cached per index."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    ok = _TMA_DEVICES.get(index)
    if ok is None:
        ok = _TMA_DEVICES[index] = torch.cuda.get_device_capability(index)[0] >= 9
    return ok


def tma_store_ok(out: torch.Tensor) -> bool:
    """Whether a kernel can write the 2-D FP8 output ``out`` (contiguous, freshly allocated) with TMA
    stores: a CUDA device of compute capability 9.0 or newer, not the interpreter, a non-empty
    tensor whose base address and row stride are multiples of 16 bytes (what a tensor map needs)."""
    if not out.is_cuda or out.numel() == 0 or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    if out.stride(0) * out.element_size() % 16 or out.data_ptr() % 16 or out.stride(1) != 1:
        return False
    return _tma_device(out.device)


TMA_STORE_MIN_ELEMENTS = 1 << 24
"""The size from which a launcher stores a transposed FP8 copy through a tensor map by default.

The tensor map is encoded on the host at every launch (15-38 µs on the H100 and H200 machines
measured, ``docs/benchmarks/host.md``) and saves device time in proportion to the copy: on an H200, 0.1 µs for a cast of 8192 x 512, 1-2 µs
at 8192 x 768 and 8192 x 1536, 4-5 µs at 8192 x 4096, 12 µs for the activation forward at 8192 x 2048
(``docs/benchmarks/tma_store_check.json``). Below 2**24 elements the host's cost is the larger one."""


def tma_store_wanted(out: torch.Tensor, config: dict[str, Any] | None) -> bool:
    """Whether a launcher writes the transposed FP8 copy ``out`` through TMA stores: as the launch
    configuration's ``"TMA"`` key says when it has one, else for outputs of at least
    :data:`TMA_STORE_MIN_ELEMENTS` elements; and only where :func:`tma_store_ok`."""
    want = config.get("TMA") if config else None
    if want is None:
        want = out.numel() >= TMA_STORE_MIN_ELEMENTS
    return bool(want) and tma_store_ok(out)


def tma_store_in_eager(x: torch.Tensor, shape: tuple[Any, ...]) -> bool:
    """Whether an eager launch on ``x``'s device would store a freshly allocated transposed FP8
    output of ``shape`` (rows, cols) through a tensor map with the default configuration
    (:func:`tma_store_wanted`): static sizes of at least :data:`TMA_STORE_MIN_ELEMENTS` elements,
    rows of a multiple of 16 bytes, a CUDA device of compute capability 9.0 or newer, not the
    interpreter. Decided from shapes alone (``x`` may be a fake tensor): the eager launch checks
    the real output again and stores through pointers where it cannot."""
    if len(shape) != 2 or not all(type(d) is int for d in shape) or x.device.type != "cuda":
        return False
    rows, cols = shape
    if rows * cols < TMA_STORE_MIN_ELEMENTS or cols % 16 or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return _tma_device(x.device)


OPAQUE_IN_GRAPHS_MIN_ELEMENTS = 1 << 26
"""The size of a transposed FP8 output from which an op with a traced CUDA kernel stays opaque in
compiled graphs when its eager launch would store that output through a tensor map
(:func:`opaque_for_tma_store`).

On an H200, GPT steps of ``python -m fp8ops.bench gpt`` (each size's fastest mode) with the rule
from 2**24 elements: 61.23 ms against 63.17 earlier that day at hidden 4096 (GELU outputs of 2**27
elements; the GELU forward 197.6 against 291.6 µs a call, its backward 294.1 against 330.2 µs) and
35.71 against 36.67 ms at 2048 (2**26); but 14.65 ms at 768 (25.2M), as before, and 6.82 against
6.53 ms (an older tree's run) at 512 (2**24), with 23 more kernels a step
(``docs/benchmarks/gpt.md``). So the rule starts above those two sizes."""


def opaque_for_tma_store(x: torch.Tensor, shape: tuple[Any, ...]) -> bool:
    """Whether a call on ``x`` that writes a transposed FP8 output of ``shape`` stays opaque in a
    compiled graph: from :data:`OPAQUE_IN_GRAPHS_MIN_ELEMENTS` elements, where the eager launch
    stores it through a tensor map (:func:`tma_store_in_eager`)."""
    # tma_store_in_eager first: it refuses symbolic sizes, which a comparison here would guard on
    return tma_store_in_eager(x, shape) and shape[0] * shape[1] >= OPAQUE_IN_GRAPHS_MIN_ELEMENTS


def transposed_store(qt: torch.Tensor, tma: bool, block_rows: int, block_cols: int) -> Any:
    """The kernel argument that receives a transposed tile: a TMA tensor descriptor of ``qt``
    (rows, cols) with (block_rows, block_cols) tiles when ``tma``, else ``qt`` itself (the kernel then
    stores through pointers and never reads the descriptor slot)."""
    if not tma:
        return qt
    return TensorDescriptor(qt, list(qt.shape), [qt.stride(0), 1], [block_rows, block_cols])


# ------------------------------------------------------------------------------------------------
# The launch path of a compiled kernel


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` of ints, as ``triton.cdiv``, for launch grids: Triton's is a constexpr
    function whose call layer costs a few µs of host time per call."""
    return -(-a // b)


CPU_PROGRAMS = 4
"""The "SMs" of a device that is not CUDA (the Triton interpreter) for :func:`num_sms`: few, so that
tests run the loops of grids sized by the SM count."""


@functools.lru_cache(maxsize=None)
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """The SM count of a CUDA ``device`` (cached), :data:`CPU_PROGRAMS` for any other device; for
    grids of a few programs per SM that walk their work in a loop."""
    if device.type != "cuda":
        return CPU_PROGRAMS
    return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())


def next_pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (0 for 0), as ``triton.next_power_of_2``, without its
    call layer."""
    n = int(n)
    return 1 << (n - 1).bit_length() if n > 0 else 0


_I32 = 2**31
_U63 = 2**63
_T, _P = torch.Tensor, torch.nn.Parameter
# runtime arguments keyed by value; bools and floats by _spec (True == 1 == 1.0, and Triton takes a
# runtime float's type, not its value; a constexpr float's value is in the key as it is)
_SCALARS = frozenset((int, str, type(None)))
BY_VALUE_ENTRIES = 4096
"""Launch keys by value kept per kernel (sizes that change at every call would grow it without end;
past this many, launches of new values look their kernel up by specialization each time)."""


def _spec(v: Any) -> Any:
    """What a Triton compilation may depend on in a runtime argument, or finer: a tensor's dtype and
    16-byte alignment; an int's value 1, divisibility by 16 and width; a bool's value; a float; None;
    a host TMA descriptor's element type, block shape and padding (with the alignments)."""
    if isinstance(v, torch.Tensor):
        return (v.dtype, v.data_ptr() % 16 == 0)
    if isinstance(v, bool):
        return ("b", v)
    if isinstance(v, int):
        return ("i", v == 1, v % 16 == 0, -(2**31) <= v < 2**31, v >= 2**63)
    if isinstance(v, float):
        return "f"
    if v is None:
        return None
    if isinstance(v, TensorDescriptor):  # a host TMA descriptor
        # Triton specializes on the element type and the block shape (and a padding option where it
        # has one); the base's alignment and the shape/strides' divisibility are kept in the key too
        return ("desc", v.base.dtype, tuple(v.block_shape), getattr(v, "padding", None), v.base.data_ptr() % 16 == 0,
                tuple(int(d) % 16 == 0 for d in v.shape), tuple(int(d) % 16 == 0 for d in v.strides))
    raise TypeError(f"fast_launch: unsupported kernel argument of type {type(v).__name__}")


def _hook_set(hook: Any) -> bool:
    # a hook, None, or (newer Triton) a chain of hooks that may be empty
    return hook is not None and bool(getattr(hook, "calls", True))


def _hooks_set() -> bool:
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    if runtime is None:
        return True  # an unknown Triton: take its own path
    return _hook_set(runtime.launch_enter_hook) or _hook_set(runtime.launch_exit_hook)


class FastKernel:
    """A ``@triton.jit`` kernel launched with ``kernel[grid](*args, **kwargs)`` as usual, that skips
    Triton's per-call argument binding once the compiled kernel of the call's specialization is known.

    Triton's ``JITFunction.run`` binds the arguments, computes their specialization, builds a cache
    key and looks up the compiled kernel on every launch: 26-36 µs of host time per launch of the
    cast kernel on an H200 machine, against 11-12 µs for the compiled kernel's own launcher and
    20-23 µs for this path (``scripts/launch_overhead.py``). Here the first launch of each
    specialization goes through Triton (which compiles) and keeps the compiled kernel under a key
    that is at least as fine as Triton's (:func:`_spec` of every runtime argument, the constexpr values, ``num_warps``,
    ``num_stages``, the device); later launches with the same key call the compiled kernel's
    launcher directly on the current stream. A second, cheaper key looks first: the arguments by
    value (constexprs, ints and strings as they are; tensors by dtype and alignment, bools, floats
    and descriptors as in :func:`_spec`), filled from the first one for the values a loop repeats;
    for the attention kernels' hundred arguments it halves the key's cost (21 -> 11 µs per launch
    with a stand-in launcher on a development CPU). Triton's own path is taken under the interpreter, when
    launch hooks are installed (profilers such as Proton), and for arguments of other types.
    """

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self._names = list(fn.arg_names)
        params = fn.params
        self._constexpr = [p.is_constexpr for p in params]
        self._defaults = {p.name: p.default for p in params if p.has_default}
        self._cache: dict[Any, Any] = {}  # Triton's specialization (or finer) -> compiled kernel
        self._by_value: dict[Any, Any] = {}  # the arguments' values -> compiled kernel (see _launch)
        self.direct_launches = 0  # launches that skipped Triton's binding (for tests and profiles)
        self.last_fallback = ""  # why the last launch took Triton's path (empty: none did)

    def __getattr__(self, name: str) -> Any:  # device_caches, arg_names, ... of the JIT function
        return getattr(self.fn, name)

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., Any]:
        def launch(*args: Any, num_warps: int = 4, num_stages: int | None = None, **kwargs: Any) -> Any:
            return self._launch(grid, args, num_warps, num_stages, kwargs)

        return launch

    def _launch(self, grid: tuple[int, ...], args: tuple[Any, ...], num_warps: int, num_stages: int | None,
                kwargs: dict[str, Any]) -> Any:
        opts = {"num_warps": num_warps} if num_stages is None else {"num_warps": num_warps, "num_stages": num_stages}
        if callable(grid):
            self.last_fallback = "callable grid"
            return self.fn[grid](*args, **opts, **kwargs)
        try:
            values = list(args)
            used = 0
            for name in self._names[len(args):]:
                if name in kwargs:
                    values.append(kwargs[name])
                    used += 1
                else:
                    values.append(self._defaults[name])
            if len(values) != len(self._names) or used != len(kwargs):  # too many, or unknown keywords
                raise TypeError("arguments")
            device = torch.cuda.current_device()
            # First by value: constexprs, ints and strings as they are, tensors by dtype and
            # alignment (a key finer than Triton's specialization, and cheaper to build); the
            # launches of a training loop repeat their sizes and strides, so this finds the kernel.
            by_value = (device, num_warps, num_stages,
                        *[v if c else (v.dtype, v.data_ptr() % 16 == 0) if (t := type(v)) is _T or t is _P
                          else v if t in _SCALARS else _spec(v) for v, c in zip(values, self._constexpr)])
            kernel = self._by_value.get(by_value)  # TypeError for an unhashable constexpr
            if kernel is None:
                parts: list[Any] = [device, num_warps, num_stages]
                for v, c in zip(values, self._constexpr):  # _spec, with its two common cases inline
                    t = type(v)
                    if c:
                        parts.append(v)
                    elif t is torch.Tensor:
                        parts.append((v.dtype, v.data_ptr() % 16 == 0))
                    elif t is int:
                        parts.append(("i", v == 1, v % 16 == 0, -_I32 <= v < _I32, v >= _U63))
                    else:
                        parts.append(_spec(v))
                key = tuple(parts)
                kernel = self._cache.get(key)
                if kernel is not None and len(self._by_value) < BY_VALUE_ENTRIES:
                    self._by_value[by_value] = kernel
        except (KeyError, TypeError) as e:
            self.last_fallback = f"arguments: {e!r}"
            return self.fn[grid](*args, **opts, **kwargs)  # Triton's path reports what is wrong
        if kernel is None or _hooks_set():
            self.last_fallback = "first launch" if kernel is None else "launch hooks installed"
            kernel = self.fn[grid](*args, **opts, **kwargs)
            self._cache[key] = kernel
            return kernel
        g0, g1, g2 = (tuple(grid) + (1, 1))[:3]
        kernel.run(g0, g1, g2, torch._C._cuda_getCurrentRawStream(device), kernel.function, kernel.packed_metadata,
                   None, None, None, *values)
        self.direct_launches += 1
        return kernel


def fast_launch(fn: Any) -> Any:
    """Wrap a ``@triton.jit`` kernel launched from Python in :class:`FastKernel` (under
    ``TRITON_INTERPRET=1`` it is returned unchanged: the interpreter runs it)."""
    if os.environ.get("TRITON_INTERPRET") == "1" or not hasattr(fn, "arg_names"):
        return fn
    return FastKernel(fn)


# ------------------------------------------------------------------------------------------------
# Amax outputs without a fill kernel each


class AmaxChain:
    """Zero-initialised amax outputs for the kernels that fold their tiles' maxima into one word
    with integer atomics, without a fill kernel per launch inside a captured CUDA graph.

    Each such kernel also zeroes one more word, ``amax_next``, from its program 0: the amax output
    of the next such launch on the same stream, which kernel order on a stream makes zero before
    that launch starts. :meth:`output` hands a launch ``(amax, amax_next)``: ``amax`` is the word the
    launch before zeroed, or a ``torch.zeros`` (a fill) when there is none; each launch gets a new
    tensor, its caller's. ``amax_next`` is a new uninitialised word, kept for the next launch once
    this one has been issued; None for a launch that is not chained (the kernel, compiled for a None
    argument, then zeroes nothing, and no word is allocated). The launch happens inside the
    ``with`` block, under a lock, so that words are handed on in launch order also when several
    threads launch on one stream.

    Which launches are chained:

    - those of a CUDA graph capture that :meth:`capturing` announced (``fp8ops.graph_step``), per
      (device, capture stream): the capture's first amax word is a fill node of the graph, the
      others are zeroed inside the graph by the kernel before them, at every replay;
    - plain launches (outside captures) on a device's default stream, with :attr:`eager` on (the
      default); on other streams only with :attr:`eager_side_streams` on (off by default):
      ``torch.compile``'s CUDA graphs (``mode="reduce-overhead"``) run their warm-up calls on a
      stream of their own with allocations from their own memory pool, and a word kept for that
      stream's next launch would stay alive in the pool, which they reject ("tensor(s) in the
      cudagraph pool not tracked as outputs");
    - plain launches on a side stream inside :meth:`this_stream` (FSDP2's all-gather stream, on
      which the FP8 all-gather quantizes each weight shard);
    - no launch of any other capture, and none when :attr:`enabled` is off.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._next: dict[tuple[Any, ...], torch.Tensor] = {}
        self._captures: dict[tuple[int, int], object] = {}
        self.chained = 0  # launches that took a word zeroed by the launch before (for tests)
        self.enabled = True  # False: a torch.zeros for every launch (for measurements)
        self.eager = True  # chain plain launches on the default stream (see the class notes)
        self.eager_side_streams = False  # ... and on every other stream (for tests)
        self._streams: set[tuple[int, int]] = set()  # side streams chained inside this_stream

    def _key(self, device: torch.device) -> tuple[Any, ...] | None:
        if not self.enabled:
            return None
        if device.type != "cuda":  # the interpreter: kernels run one after the other
            return (device.type,) if self.eager else None
        where = _current_stream(device)
        if torch.cuda.is_current_stream_capturing():
            token = self._captures.get(where)
            return None if token is None else (*where, token)
        # the default stream's raw handle is 0
        return where if self.eager and (where[1] == 0 or self.eager_side_streams or where in self._streams) else None

    @contextlib.contextmanager
    def this_stream(self, device: torch.device) -> Iterator[None]:
        """Chain the plain launches on ``device``'s current stream within the block, also when it
        is a side stream: one that no CUDA graph's memory pool owns (FSDP2's all-gather stream), whose
        word kept for its next launch may stay allocated between blocks."""
        if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
            yield
            return
        where = _current_stream(device)
        with self._lock:
            added = where not in self._streams
            self._streams.add(where)
        try:
            yield
        finally:
            if added:
                with self._lock:
                    self._streams.discard(where)

    @contextlib.contextmanager
    def output(self, device: torch.device, traced: bool = False
               ) -> Iterator[tuple[torch.Tensor, torch.Tensor | None]]:
        """``(amax, amax_next)`` for one launch on ``device``'s current stream, made inside the block;
        ``amax_next`` None when the launch is not chained. ``traced``: a launch of a traced CUDA
        kernel (:class:`OpSpec`), which a compiled graph runs: a ``torch.zeros`` word of its own and
        no chain."""
        if traced:
            yield torch.zeros((), dtype=torch.float32, device=device), None
            return
        with self._lock:
            key = self._key(device)
            amax = None if key is None else self._next.pop(key, None)
            if amax is None:
                amax = torch.zeros((), dtype=torch.float32, device=device)
            else:
                self.chained += 1
            amax_next = None if key is None else self._word(device)
            yield amax, amax_next
            # issued: the next launch on this stream may take amax_next (on an exception it takes a
            # fresh torch.zeros instead, as the word was popped above)
            if key is not None:
                self._next[key] = amax_next

    @contextlib.contextmanager
    def capturing(self, device: torch.device) -> Iterator[list[torch.Tensor]]:
        """Chain the launches of a CUDA graph capture in progress on ``device``'s current stream,
        within the block (entered after the capture began, left before it ends). Yields a list that
        receives, on exit, the word the capture's last launch zeroes at every replay: keep it as
        long as the graph, so that its memory is not handed to another tensor meanwhile."""
        where = _current_stream(device)
        token = object()
        keep: list[torch.Tensor] = []
        with self._lock:
            self._captures[where] = token
        try:
            yield keep
        finally:
            with self._lock:
                self._captures.pop(where, None)
                last = self._next.pop((*where, token), None)
            if last is not None:
                keep.append(last)

    def _word(self, device: torch.device) -> torch.Tensor:
        # a new uninitialised () float32 word (tests substitute words full of garbage)
        return torch.empty((), dtype=torch.float32, device=device)

    def reset(self) -> None:
        """Forget every chain: the next launch on each stream takes a ``torch.zeros``."""
        with self._lock:
            self._next.clear()


def _current_stream(device: torch.device) -> tuple[int, int]:
    """(device index, raw handle of its current stream) of a CUDA device."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return index, torch._C._cuda_getCurrentRawStream(index)


AMAX_CHAIN = AmaxChain()
"""The process's :class:`AmaxChain`, shared by every launcher of an amax-producing kernel."""
