"""FP8 formats: E4M3, E5M2 and HYBRID, with their torch dtypes and largest finite values.

A *role* says which side of training a quantized tensor belongs to:

- ``"forward"``: activations and weights (the operands of the forward GEMMs);
- ``"backward"``: gradients (the output gradient that feeds dgrad and wgrad).

``HYBRID`` is E4M3 for forward tensors and E5M2 for gradients, the usual choice for training
(Micikevicius et al., "FP8 Formats for Deep Learning", 2022).
"""

from __future__ import annotations

import enum
from typing import Literal

import torch

__all__ = ["E4M3_MAX", "E5M2_MAX", "Format", "Role", "check_role"]

Role = Literal["forward", "backward"]
"""Which side of training a quantized tensor belongs to."""

E4M3_MAX: float = 448.0
"""Largest finite value of ``torch.float8_e4m3fn``."""

E5M2_MAX: float = 57344.0
"""Largest finite value of ``torch.float8_e5m2``."""

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


def fp8_max_of(dtype: torch.dtype) -> float:
    """Largest finite value of an FP8 torch dtype."""
    if dtype == torch.float8_e4m3fn:
        return E4M3_MAX
    if dtype == torch.float8_e5m2:
        return E5M2_MAX
    raise ValueError(f"fp8_max_of: expected torch.float8_e4m3fn or torch.float8_e5m2, got {dtype}")
