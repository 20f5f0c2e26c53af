"""Autograd glue shared by the ops' ``torch.autograd.Function`` classes.

- :func:`refuse_compiled_transform`: ``torch.compile`` tracing a ``torch.func`` gradient transform
  (``grad``, ``grad_and_value``, ``vjp``, ``jacrev``, ...) through a custom ``autograd.Function``
  drops its backward and returns wrong gradients, zeros among them (pytorch#193279). Every op calls
  this before applying its Function, so that such a trace raises instead, whatever is
  differentiated. It costs nothing outside ``torch.compile``.
- :func:`apply`: ``Function.apply`` without its per-call argument binding. ``Function.apply``
  binds the arguments to ``inspect.signature(forward)`` on every call (tens of µs on the host);
  the ops pass every argument positionally, so in plain eager mode the binding is the identity
  and :func:`apply` goes straight to the C++ ``apply``. Under ``torch.compile`` and inside
  ``torch.func`` transforms it is ``Function.apply`` itself.
- :func:`cast`: a dtype conversion recorded only when it converts. ``t.to(dtype)`` of a tensor
  already of that dtype returns ``t`` itself, which torch.compile records as a second graph value
  for one tensor; when a ``Function.forward`` returns it, torch 2.11's compiled forward routes the
  output's gradient to the other value, and the backward runs on zeros.
- :func:`autocast_dtype` / :func:`autocast_inputs`: ``torch.autocast`` support. A public op that
  computes like ``F.linear`` asks ``autocast_dtype(x.device.type)`` first (a cheap check, None
  outside autocast); when autocast is on, it casts its floating inputs with
  :func:`autocast_inputs` *outside* its autograd Function (so autograd of the cast carries the
  gradients back to the float32 originals in float32, as with ``F.linear`` under autocast) and
  calls itself again with autocast disabled, so that torch ops inside (the high-precision GEMMs,
  the CPU reference math) do not cast a second time.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch._functorch.utils import unwrap_dead_wrappers

__all__ = [
    "GUARD_MESSAGE",
    "apply",
    "autocast_dtype",
    "autocast_inputs",
    "cast",
    "refuse_compiled_transform",
    "values_readable",
]

GUARD_MESSAGE = (
    "torch.compile cannot trace a torch.func transform (grad, vjp, grad_and_value, jacrev, ...) through "
    "fp8ops ops: it would drop their custom backward and return wrong gradients (pytorch#193279). "
    "Use torch.func eagerly, or torch.compile the loss and call .backward() / torch.autograd.grad."
)

_LIB = torch.library.Library("fp8ops", "FRAGMENT")  # kept alive for the process
_LIB.define("refuse_compiled_transform(Tensor x, str where) -> Tensor")


def _refuse(x: Tensor, where: str) -> Tensor:
    raise RuntimeError(f"{where}: {GUARD_MESSAGE}")


# Every implementation raises: the op is only ever called while torch.compile traces a transform,
# and the fake kernel raising makes the trace fail hard (a Python raise would only break the graph
# and silently fall back to eager).
_LIB.impl("refuse_compiled_transform", _refuse, "CompositeExplicitAutograd")
torch.library.register_fake("fp8ops::refuse_compiled_transform", _refuse, lib=_LIB)


def _gradient_transform_active() -> bool:
    """Whether a torch.func transform other than one outermost ``vmap`` is active."""
    if not torch._C._are_functorch_transforms_active():
        return False
    from torch._C._functorch import TransformType
    from torch._functorch.pyfunctorch import retrieve_current_functorch_interpreter

    interp = retrieve_current_functorch_interpreter()
    # A single vmap (level 1) batches the op's own Function; anything else may differentiate it.
    return not (interp.key() == TransformType.Vmap and interp.level() == 1)


def refuse_compiled_transform(where: str, x: Tensor) -> None:
    """Raise when ``torch.compile`` traces a ``torch.func`` gradient transform through op ``where``.

    Args:
        where: the public op's name, for the message.
        x: any tensor argument of the op (the check runs on it under the fake-tensor trace).

    Raises:
        RuntimeError: under ``torch.compile`` with a ``torch.func`` transform active (one outermost
            ``vmap`` excepted), naming ``where`` and pytorch#193279.
    """
    if torch.compiler.is_compiling() and _gradient_transform_active():
        torch.ops.fp8ops.refuse_compiled_transform(x, where)


def apply(fn: type[torch.autograd.Function], *args: Any) -> Any:
    """``fn.apply(*args)`` for a Function whose ``forward`` takes exactly ``args`` positionally.

    In plain eager mode this is what ``Function.apply`` does after binding the arguments (which is
    the identity for positional arguments without defaults): torch.func wrappers left over from a
    finished transform are unwrapped, then the C++ ``apply`` runs ``forward`` and records the
    graph node. Under ``torch.compile`` or an active ``torch.func`` transform it calls
    ``fn.apply`` (Dynamo's and torch.func's handling of autograd.Function).
    """
    if torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active():
        return fn.apply(*args)
    return super(torch.autograd.Function, fn).apply(*unwrap_dead_wrappers(args))  # type: ignore[misc]


def cast(t: Tensor, dtype: torch.dtype) -> Tensor:
    """``t`` in ``dtype``: ``t`` itself when it has that dtype already (no no-op ``.to`` node)."""
    return t if t.dtype == dtype else t.to(dtype)


# Device types whose autocast state the ops follow (torch.is_autocast_enabled rejects some others,
# e.g. "meta").
_AUTOCAST_DEVICES = ("cpu", "cuda")
_CASTABLE = (torch.float32, torch.bfloat16, torch.float16)


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype ``torch.autocast`` computes linear-like ops in on ``device_type``, or None when
    autocast is off there (or the device type has no autocast we follow).

    Traceable by ``torch.compile(fullgraph=True)``; outside autocast it costs one thread-local read.

    Example:
        >>> import torch
        >>> from fp8ops._glue import autocast_dtype
        >>> autocast_dtype("cpu") is None
        True
        >>> with torch.autocast("cpu", dtype=torch.bfloat16):
        ...     autocast_dtype("cpu")
        torch.bfloat16
    """
    if device_type not in _AUTOCAST_DEVICES or not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


def autocast_inputs(dtype: torch.dtype, *ts: Any) -> tuple[Any, ...]:
    """Each of ``ts`` cast to ``dtype`` when it is a float32/bfloat16/float16 tensor; anything else
    (None, non-tensors, integer tensors) as given, for the op's own checks to judge."""
    return tuple(cast(t, dtype) if isinstance(t, Tensor) and t.dtype in _CASTABLE else t for t in ts)


def values_readable(*ts: Tensor) -> bool:
    """Whether the values of ``ts`` can be read on the host for a check: eager, no torch.func
    transform, no dispatch mode (fake or proxy tracing), plain tensors not on the meta device.

    A read is a host sync on a GPU: checks that read values run only where this is True.
    """
    if torch.compiler.is_compiling() or torch.jit.is_tracing():
        return False
    if torch._C._functorch.maybe_current_level() is not None:
        return False
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    if _get_current_dispatch_mode() is not None:
        return False
    for t in ts:
        if type(t) not in (Tensor, torch.nn.Parameter) or t.device.type == "meta":
            return False
        if torch._C._functorch.is_functorch_wrapped_tensor(t):
            return False
    return True
