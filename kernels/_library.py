"""Registration of fp8ops's library ops through the dispatcher's low-level API, and the launch
configuration helper shared by the launchers.

``torch.library.custom_op`` wraps every call in Python layers (autograd, alias checks, a dynamo
guard) that cost on the order of 100 µs per call on the host, more than the kernels of a whole
small layer. Ops defined here with ``Library.define`` + ``Library.impl`` reach their Python kernel
straight from the dispatcher. They are still opaque to ``torch.compile`` (a fake kernel gives the
output shapes) and have no autograd kernel: fp8ops calls them inside its autograd.Functions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["define", "merge_config"]

_LIB = torch.library.Library("fp8ops", "FRAGMENT")  # kept alive for the process


def define(schema: str, *, cuda: Callable[..., Any], fake: Callable[..., Any],
           cpu: Callable[..., Any] | None = None) -> Any:
    """Define ``fp8ops::<schema>`` with a CUDA kernel, a fake kernel and optionally a CPU kernel.

    Returns the op overload packet ``torch.ops.fp8ops.<name>``.
    """
    name = schema.split("(", 1)[0]
    _LIB.define(schema, tags=(torch.Tag.pt2_compliant_tag,))
    _LIB.impl(name, cuda, "CUDA")
    if cpu is not None:
        _LIB.impl(name, cpu, "CPU")
    torch.library.register_fake(f"fp8ops::{name}", fake, lib=_LIB)
    return getattr(torch.ops.fp8ops, name)


def merge_config(default: dict[str, Any], override: dict[str, Any] | None, *, name: str) -> dict[str, Any]:
    """A launcher's block sizes: ``default`` (returned as is, read-only, when there is no override)
    updated with ``override``, whose keys must be among the default's."""
    if not override:
        return default
    unknown = set(override) - set(default)
    if unknown:
        raise ValueError(f"{name}: unknown launch config keys {sorted(unknown)}; expected {sorted(default)}")
    return {**default, **override}
