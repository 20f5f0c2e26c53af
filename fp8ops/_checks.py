"""Input checks shared by the public ops: each raises TypeError/ValueError naming the function,
the argument, what was expected and what was received."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .recipes import Recipe

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_float_tensor(t: Any, name: str, where: str, *, min_dim: int = 0) -> Tensor:
    """``t`` if it is a float32/bfloat16/float16 tensor with at least ``min_dim`` dimensions."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{where}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{where}: {name} must be float32, bfloat16 or float16, got {t.dtype}")
    if t.dim() < min_dim:
        raise ValueError(
            f"{where}: {name} must have at least {min_dim} dimension(s) (..., K), got shape {tuple(t.shape)}"
        )
    return t


def check_recipe(recipe: Any, where: str) -> Recipe:
    """``recipe`` if it is a fp8ops recipe."""
    if not isinstance(recipe, Recipe):
        raise TypeError(f"{where}: recipe must be a fp8ops recipe (DelayedScaling, CurrentScaling, ...), got {recipe!r}")
    return recipe


def check_probe(probe: Any, where: str) -> Tensor | None:
    """``probe`` if it is None or a 0-d float32 tensor (one gradient role)."""
    if probe is not None and (not isinstance(probe, Tensor) or probe.dim() != 0 or probe.dtype != torch.float32):
        raise ValueError(f"{where}: grad_probe must be a 0-d float32 tensor (fp8ops.make_probes), got {probe!r}")
    return probe
