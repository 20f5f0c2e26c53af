"""Scaling states for tests: a state whose roles are calibrated with chosen scales."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["calibrate"]


def calibrate(state: Any, recipe: Any, *, forward: float = 32.0, backward: float = 2.0**14,
              scales: Mapping[str, float] | None = None) -> Any:
    """``state`` (an op's state, e.g. :class:`fp8ops.LinearState`) with calibrated roles: with
    ``scales``, exactly the roles it names, at its scales (the others unchanged); without, every
    role, at ``forward`` or ``backward`` by the role's direction.

    Only delayed scaling keeps scales; for other recipes (and ``recipe=None``, ``state=None``)
    ``state`` is returned unchanged.

    Example:
        >>> import fp8ops
        >>> from fp8ops.testing.states import calibrate
        >>> r = fp8ops.DelayedScaling()
        >>> st = calibrate(fp8ops.LinearState.init(r), r, scales={"input": 64.0})
        >>> float(st.input.scale), st.weight.calibrated
        (64.0, False)
        >>> st = calibrate(fp8ops.LinearState.init(r), r)
        >>> float(st.weight.scale), float(st.grad_output.scale)
        (32.0, 16384.0)
    """
    if state is None or recipe is None or recipe.mode != "delayed":
        return state
    roles = type(state).ROLES
    unknown = set(scales or {}) - set(roles)
    if unknown:
        raise ValueError(f"calibrate: scales names roles {sorted(unknown)} that {type(state).__name__} does not "
                         f"have; its roles are {sorted(roles)}")
    if not scales:
        scales = {name: forward if direction == "forward" else backward for name, direction in roles.items()}
    new = {}
    for name, s in scales.items():
        role = getattr(state, name)
        new[name] = role.replace(scale=torch.tensor(float(s), device=role.scale.device), calibrated=True)
    return state.replace(**new)
