"""FP8 formats: E4M3, E5M2 and HYBRID, with their torch dtypes and largest finite values.

A *role* says which side of training a quantized tensor belongs to:

- ``"forward"``: activations and weights (the operands of the forward GEMMs);
- ``"backward"``: gradients (the output gradient that feeds dgrad and wgrad).

``HYBRID`` is E4M3 for forward tensors and E5M2 for gradients, the usual choice for training
(Micikevicius et al., "FP8 Formats for Deep Learning", 2022).
"""

from __future__ import annotations

import enum
import math
from typing import Literal

import torch

__all__ = ["E4M3_MAX", "E5M2_MAX", "Format", "Role", "check_role"]

Role = Literal["forward", "backward"]
"""Which side of training a quantized tensor belongs to."""

E4M3_MAX: float = 448.0
"""Largest finite value of ``torch.float8_e4m3fn``."""

E5M2_MAX: float = 57344.0
"""Largest finite value of ``torch.float8_e5m2``."""

E4M3_MIN_NORMAL: float = 2.0**-6
"""Smallest positive normal value of ``torch.float8_e4m3fn``."""

E5M2_MIN_NORMAL: float = 2.0**-14
"""Smallest positive normal value of ``torch.float8_e5m2``."""

_ROLES = ("forward", "backward")


def check_role(role: object, *, where: str) -> Role:
    """Return ``role`` if it is ``"forward"`` or ``"backward"``, else raise ``ValueError``."""
    if role not in _ROLES:
        raise ValueError(f"{where}: role must be 'forward' or 'backward', got {role!r}")
    return role  # type: ignore[return-value]


class Format(enum.Enum):
    """An FP8 format, or a pair of formats chosen by role.

    Members:
        E4M3: ``torch.float8_e4m3fn`` for every tensor (max 448, 3 mantissa bits).
        E5M2: ``torch.float8_e5m2`` for every tensor (max 57344, 2 mantissa bits).
        HYBRID: E4M3 for forward tensors, E5M2 for gradients.

    Example:
        >>> from fp8ops import Format
        >>> Format.HYBRID.dtype("backward")
        torch.float8_e5m2
        >>> Format.HYBRID.max("forward")
        448.0
    """

    E4M3 = "E4M3"
    E5M2 = "E5M2"
    HYBRID = "HYBRID"

    def dtype(self, role: Role = "forward") -> torch.dtype:
        """The torch FP8 dtype this format uses for tensors of ``role``."""
        check_role(role, where="Format.dtype")
        if self is Format.E4M3 or (self is Format.HYBRID and role == "forward"):
            return torch.float8_e4m3fn
        return torch.float8_e5m2

    def max(self, role: Role = "forward") -> float:
        """The largest finite value of :meth:`dtype` for ``role``."""
        return E4M3_MAX if self.dtype(role) == torch.float8_e4m3fn else E5M2_MAX

    def min_normal(self, role: Role = "forward") -> float:
        """The smallest positive normal value of :meth:`dtype` for ``role``."""
        return E4M3_MIN_NORMAL if self.dtype(role) == torch.float8_e4m3fn else E5M2_MIN_NORMAL

    def max_margin(self) -> int:
        """The largest scaling margin this format allows, for every role.

        A scale is divided by ``2**margin``, so the largest value of a tensor lands on
        ``fp8_max / 2**margin``; that must stay at least the smallest normal number, or whole tensors
        flush to subnormals and zero. The bound is ``floor(log2(fp8_max / min_normal))``: 14 for E4M3
        (448 / 2**14 >= 2**-6), 29 for E5M2 (57344 / 2**29 >= 2**-14), and the stricter 14 for
        HYBRID.

        Example:
            >>> from fp8ops import Format
            >>> Format.E4M3.max_margin(), Format.E5M2.max_margin(), Format.HYBRID.max_margin()
            (14, 29, 14)
        """
        return min(math.floor(math.log2(self.max(r) / self.min_normal(r))) for r in _ROLES)  # type: ignore[arg-type]


def fp8_max_of(dtype: torch.dtype) -> float:
    """Largest finite value of an FP8 torch dtype."""
    if dtype == torch.float8_e4m3fn:
        return E4M3_MAX
    if dtype == torch.float8_e5m2:
        return E5M2_MAX
    raise ValueError(f"fp8_max_of: expected torch.float8_e4m3fn or torch.float8_e5m2, got {dtype}")
