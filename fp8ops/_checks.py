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


def check_probe(probe: Any, where: str, *, shape: tuple[int, ...] = (), name: str = "grad_probe") -> Tensor | None:
    """``probe`` if it is None or a float32 tensor of ``shape`` (() for one gradient role, (n,) for n)."""
    if probe is not None and (
        not isinstance(probe, Tensor) or tuple(probe.shape) != shape or probe.dtype != torch.float32
    ):
        what = "0-d" if not shape else f"{shape}"
        got = f"shape {tuple(probe.shape)} {probe.dtype}" if isinstance(probe, Tensor) else repr(probe)
        raise ValueError(f"{where}: {name} must be a {what} float32 tensor (fp8ops.make_probes), got {got}")
    return probe
