"""Registration of fp8ops's library ops through the dispatcher's low-level API, the CUDA-kernel
adapter that hands launchers the memory layout they need, and the launch configuration helper
shared by the launchers.

``torch.library.custom_op`` wraps every call in Python layers (autograd, alias checks, a dynamo
guard) that cost on the order of 100 µs per call on the host, more than the kernels of a whole
small layer. Ops defined here with ``Library.define`` + ``Library.impl`` reach their Python kernel
straight from the dispatcher. They are still opaque to ``torch.compile`` (a fake kernel gives the
output shapes) and have no autograd kernel: fp8ops calls them inside its autograd.Functions.

fp8ops calls the ops through :data:`ops` (``ops.<name>(...)``), which is ``torch.ops.fp8ops``
except in plain eager mode: when nothing but the device kernel would run (no ``torch.compile``,
no ``torch.func`` transform, no dispatch or ``__torch_function__`` mode, no profiler or JIT
trace, plain tensors on one device, no autograd recording), the call goes to that kernel
directly and skips the dispatcher's round trip (argument boxing into C++, the dispatch itself
and the conversion back to Python objects). What runs, on which arguments, is what the
dispatcher would run; under ``torch.compile`` the op is what the graph records.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

__all__ = ["OpSpec", "contiguous_args", "define", "merge_config", "ops"]

_LIB = torch.library.Library("fp8ops", "FRAGMENT")  # kept alive for the process
_PARAMETER = torch.nn.Parameter


class OpSpec(NamedTuple):
    """A library op as a kernel module provides it: the schema ``"<name>(<args>) -> <returns>"``, the
    CUDA kernel (a launcher) and the fake kernel (output shapes for ``torch.compile``). The op is
    defined by :func:`define`, called from the fp8ops module that also gives its CPU kernel."""

    schema: str
    cuda: Callable[..., Any]
    fake: Callable[..., Any]


def define(spec: OpSpec, *, cpu: Callable[..., Any]) -> Any:
    """Define ``fp8ops::<name>`` with every kernel side by side: the CUDA and fake kernels of
    ``spec`` and the CPU kernel ``cpu`` (the FP32 reference math).

    Returns the op overload packet ``torch.ops.fp8ops.<name>``; ``ops.<name>`` is its entry point
    for fp8ops's own calls.
    """
    name = spec.schema.split("(", 1)[0]
    _LIB.define(spec.schema, tags=(torch.Tag.pt2_compliant_tag,))
    _LIB.impl(name, spec.cuda, "CUDA")
    _LIB.impl(name, cpu, "CPU")
    torch.library.register_fake(f"fp8ops::{name}", spec.fake, lib=_LIB)
    packet = getattr(torch.ops.fp8ops, name)
    setattr(ops, name, _eager_entry(packet, {"cuda": spec.cuda, "cpu": cpu}))
    return packet


class _Ops:
    """The ops defined by :func:`define`, by name (see :data:`ops`)."""


ops: Any = _Ops()
"""``ops.<name>(*args)``: ``torch.ops.fp8ops.<name>(*args)``, straight to the device kernel in
plain eager mode (module docstring). fp8ops calls its library ops through it."""


def _eager_entry(packet: Any, kernels: dict[str, Callable[..., Any]]) -> Callable[..., Any]:
    """``packet(*args)``, or the device kernel that the dispatcher would reach, called directly.

    Takes the schema's arguments positionally; trailing ones with defaults may be left out (they
    are filled in as the dispatcher fills them).
    """
    arguments = packet.default._schema.arguments
    nargs = len(arguments)
    tensors = tuple(i for i, a in enumerate(arguments) if str(a.type) in ("Tensor", "Optional[Tensor]"))
    tail: list[Any] = []  # the defaults of the trailing arguments that have one
    for a in reversed(arguments):
        if a.kwarg_only or not a.has_default_value():
            break
        tail.insert(0, a.default_value)
    defaults = tuple(tail)
    cuda, cpu = kernels["cuda"], kernels["cpu"]

    def call(*args: Any) -> Any:
        if torch.compiler.is_compiling():
            return packet(*args)
        missing = nargs - len(args)
        if missing:
            if not 0 < missing <= len(defaults):
                return packet(*args)  # the dispatcher's error
            args = args + defaults[len(defaults) - missing:]
        device = _plain_device(args, tensors)
        if device == "cuda":
            return cuda(*args)
        if device == "cpu":
            return cpu(*args)
        return packet(*args)

    call.__name__ = call.__qualname__ = packet._qualified_op_name.replace("::", "_")
    return call


def _plain_device(args: tuple[Any, ...], tensors: tuple[int, ...]) -> str | None:
    """The device type, "cuda" or "cpu", when an eager call with ``args`` (tensors at the positions
    ``tensors``) goes straight to that device's kernel; None when the dispatcher has more to do: a
    mode, a torch.func transform, a profiler or JIT trace, a tensor subclass, autograd recording,
    mixed devices, a negative view, another device."""
    if (torch._C._are_functorch_transforms_active() or torch._C._len_torch_dispatch_stack()
            or torch._C._len_torch_function_stack() or torch._C._autograd._profiler_enabled()
            or torch._C._get_tracing_state() is not None):
        return None
    grad = torch.is_grad_enabled()
    cuda = cpu = False
    for i in tensors:
        a = args[i]
        if a is None:
            continue
        kind = type(a)
        if (kind is not torch.Tensor and kind is not _PARAMETER) or (grad and a.requires_grad) or a.is_neg():
            return None
        if a.is_cuda:
            cuda = True
        elif a.is_cpu:
            cpu = True
        else:
            return None
    if cuda:
        return None if cpu else "cuda"
    return "cpu" if cpu else None


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


def merge_config(default: dict[str, Any], override: dict[str, Any] | None, *, name: str) -> dict[str, Any]:
    """A launcher's block sizes: ``default`` (returned as is, read-only, when there is no override)
    updated with ``override``, whose keys must be among the default's."""
    if not override:
        return default
    unknown = set(override) - set(default)
    if unknown:
        raise ValueError(f"{name}: unknown launch config keys {sorted(unknown)}; expected {sorted(default)}")
    return {**default, **override}
