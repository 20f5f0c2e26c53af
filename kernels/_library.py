"""Registration of fp8ops's library ops through the dispatcher's low-level API, the CUDA-kernel
adapter that hands launchers the memory layout they need, and the launch configuration helper
shared by the launchers.

``torch.library.custom_op`` wraps every call in Python layers (autograd, alias checks, a dynamo
guard) that cost on the order of 100 µs per call on the host, more than the kernels of a whole
small layer. Ops defined here with ``Library.define`` + ``Library.impl`` reach their Python kernel
straight from the dispatcher. They are still opaque to ``torch.compile`` (a fake kernel gives the
output shapes) and have no autograd kernel: fp8ops calls them inside its autograd.Functions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

__all__ = ["OpSpec", "contiguous_args", "define", "merge_config"]

_LIB = torch.library.Library("fp8ops", "FRAGMENT")  # kept alive for the process


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

    Returns the op overload packet ``torch.ops.fp8ops.<name>``.
    """
    name = spec.schema.split("(", 1)[0]
    _LIB.define(spec.schema, tags=(torch.Tag.pt2_compliant_tag,))
    _LIB.impl(name, spec.cuda, "CUDA")
    _LIB.impl(name, cpu, "CPU")
    torch.library.register_fake(f"fp8ops::{name}", spec.fake, lib=_LIB)
    return getattr(torch.ops.fp8ops, name)


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
