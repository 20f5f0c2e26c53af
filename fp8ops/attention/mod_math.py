"""``modmath``: the math namespace of score/mask mods, as PyTorch (the mods' eager twin).

A mod body may call these functions besides arithmetic and comparisons. Called eagerly (the CPU
path, the reference math, :func:`~fp8ops.create_block_mask`) they run here; inside the kernels
each call is lowered by :mod:`.codegen` to its Triton twin (``fp8ops.kernels.attention.
MODMATH_TRITON``), whose derivative the code generator knows. ``modmath.load`` checks its index
range here (an IndexError that :mod:`.checks` turns into a ValueError naming the mod).
"""

from __future__ import annotations

import builtins
import math
from typing import Any

import torch
from torch import Tensor

from .._glue import values_readable


def _is_t(x: Any) -> bool:
    return isinstance(x, Tensor)


class _LoadIndexError(IndexError):
    """``modmath.load(table, index)`` with an index outside ``[0, table.numel())`` (the eager twin).

    The public ops catch it around mod calls and raise a ValueError naming the mod and the call's
    sizes; it stays an IndexError for code that calls a mod directly."""

    def __init__(self, table: Tensor, lo: int | None, hi: int | None, detail: str = "") -> None:
        self.shape = tuple(table.shape)
        self.numel = table.numel()
        self.lo, self.hi = lo, hi
        got = f"indices in [{lo}, {hi}]" if lo is not None else detail
        super().__init__(f"modmath.load: index out of range for a table of shape {self.shape} "
                         f"({self.numel} elements, valid flat indices [0, {self.numel - 1}]): got {got}")


class _ModMath:
    """The math namespace of score/mask mods: ``from fp8ops import modmath``.

    Each function takes tensors (or numbers) and works elementwise with broadcasting, in PyTorch
    (the eager twin) and in Triton (inside the kernels), where its derivative is known too:

    ``exp, exp2, log, log2, sqrt, tanh, sigmoid, abs`` (one argument), ``minimum(a, b)``,
    ``maximum(a, b)``, ``where(cond, a, b)``, ``clamp(x, lo, hi)``, and ``load(table, index)``:
    ``table.reshape(-1)[index]`` for a captured tensor (flat, row-major integer index in
    ``[0, table.numel())``; outside it the eager twin raises IndexError, where the kernels would
    read outside the table).

    Example:
        >>> import torch
        >>> from fp8ops import modmath
        >>> modmath.clamp(torch.tensor([-2.0, 0.5, 3.0]), 0.0, 1.0)
        tensor([0.0000, 0.5000, 1.0000])
    """

    __slots__ = ()

    @staticmethod
    def exp(x: Any) -> Any:
        return torch.exp(x) if _is_t(x) else math.exp(x)

    @staticmethod
    def exp2(x: Any) -> Any:
        return torch.exp2(x) if _is_t(x) else 2.0**x

    @staticmethod
    def log(x: Any) -> Any:
        return torch.log(x) if _is_t(x) else math.log(x)

    @staticmethod
    def log2(x: Any) -> Any:
        return torch.log2(x) if _is_t(x) else math.log2(x)

    @staticmethod
    def sqrt(x: Any) -> Any:
        return torch.sqrt(x) if _is_t(x) else math.sqrt(x)

    @staticmethod
    def tanh(x: Any) -> Any:
        return torch.tanh(x) if _is_t(x) else math.tanh(x)

    @staticmethod
    def sigmoid(x: Any) -> Any:
        return torch.sigmoid(x) if _is_t(x) else 1.0 / (1.0 + math.exp(-x))

    @staticmethod
    def abs(x: Any) -> Any:
        return torch.abs(x) if _is_t(x) else builtins.abs(x)

    @staticmethod
    def minimum(a: Any, b: Any) -> Any:
        if _is_t(a) and _is_t(b):
            return torch.minimum(a, b)
        if _is_t(a):
            return torch.clamp(a, max=b)
        if _is_t(b):
            return torch.clamp(b, max=a)
        return builtins.min(a, b)

    @staticmethod
    def maximum(a: Any, b: Any) -> Any:
        if _is_t(a) and _is_t(b):
            return torch.maximum(a, b)
        if _is_t(a):
            return torch.clamp(a, min=b)
        if _is_t(b):
            return torch.clamp(b, min=a)
        return builtins.max(a, b)

    @staticmethod
    def where(cond: Any, a: Any, b: Any) -> Any:
        if not _is_t(cond):
            return a if cond else b
        return torch.where(cond, a, b)

    @staticmethod
    def clamp(x: Any, lo: Any, hi: Any) -> Any:
        return _ModMath.minimum(_ModMath.maximum(x, lo), hi)

    @staticmethod
    def load(table: Tensor, index: Any) -> Tensor:
        flat = table.reshape(-1)
        n = flat.numel()
        if _is_t(index):
            if index.dtype == torch.bool or index.is_floating_point() or index.is_complex():
                raise TypeError(f"modmath.load: index must be an integer tensor (a flat, row-major position "
                                f"in the table), got {index.dtype}")
            # Negative indices would wrap here but read before the table in the kernels: refuse both
            # ends. One host read, skipped where values cannot be read (tracing, vmap-batched).
            if index.numel() and values_readable(index):
                lo, hi = torch.stack(index.aminmax()).tolist()
                if lo < 0 or hi >= n:
                    raise _LoadIndexError(table, lo, hi)
        elif isinstance(index, int) and not isinstance(index, bool) and not 0 <= index < n:
            raise _LoadIndexError(table, index, index)
        try:
            return flat[index]
        except IndexError as e:
            raise _LoadIndexError(table, None, None, str(e)) from None


modmath = _ModMath()
"""The math namespace of mods (see :class:`_ModMath`): ``exp exp2 log log2 sqrt tanh sigmoid abs
minimum maximum where clamp load``."""

_NS_FUNCS = ("exp", "exp2", "log", "log2", "sqrt", "tanh", "sigmoid", "abs", "minimum", "maximum", "where",
             "clamp", "load")
_NS_BY_ID = {id(getattr(_ModMath, n)): n for n in _NS_FUNCS}
