"""Autograd glue shared by the ops' ``torch.autograd.Function`` classes.

- :func:`refuse_compiled_transform`: ``torch.compile`` tracing a ``torch.func`` gradient transform
  (``grad``, ``grad_and_value``, ``vjp``, ``jacrev``, ...) through a custom ``autograd.Function``
  drops its backward and returns wrong gradients, zeros among them (pytorch#193279). Every op calls
  this before applying its Function, so that such a trace raises instead, whatever is
  differentiated. It costs nothing outside ``torch.compile``.
- :func:`cast`: a dtype conversion recorded only when it converts. ``t.to(dtype)`` of a tensor
  already of that dtype returns ``t`` itself, which torch.compile records as a second graph value
  for one tensor; when a ``Function.forward`` returns it, torch 2.11's compiled forward routes the
  output's gradient to the other value, and the backward runs on zeros.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["GUARD_MESSAGE", "cast", "refuse_compiled_transform"]

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


def cast(t: Tensor, dtype: torch.dtype) -> Tensor:
    """``t`` in ``dtype``: ``t`` itself when it has that dtype already (no no-op ``.to`` node)."""
    return t if t.dtype == dtype else t.to(dtype)
