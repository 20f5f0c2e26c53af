"""Input checks shared by the public ops: each raises TypeError/ValueError naming the function,
the argument, what was expected and what was received."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from .recipes import Recipe
from .state import _state_ok, validate_state

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
NORMALIZATIONS = ("LayerNorm", "RMSNorm")


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
        got = "None" if recipe is None else f"{type(recipe).__name__} {recipe!r}"[:200]
        raise TypeError(f"{where}: recipe must be a fp8ops recipe (fp8ops.DelayedScaling, fp8ops.CurrentScaling or a "
                        f"fp8ops.Recipe subclass), got {got}")
    return recipe


def check_state_recipe(state: Any, recipe: Any, cls: type, x: Tensor, where: str) -> bool:
    """Validate ``(state, recipe)``: both given (FP8) or both None (high precision); returns fp8.

    ``cls`` is the op's state class (an ``OpState`` with ``ROLES``); every role's state is checked
    against ``recipe`` and ``x``'s device.
    """
    if state is None and recipe is None:
        return False
    if recipe is None:
        raise ValueError(f"{where}: a state was given without a recipe; pass recipe=... (the one the state was "
                         f"built with), or state=None and recipe=None for no FP8")
    check_recipe(recipe, where)
    if state is None:
        raise ValueError(f"{where}: recipe given without a state; pass state={cls.__name__}.init(recipe) "
                         f"(or state=None and recipe=None for no FP8)")
    if not isinstance(state, cls):
        raise TypeError(f"{where}: state must be a {cls.__name__} ({cls.__name__}.init(recipe)), got {type(state).__name__}")
    device = x.device
    for role in cls.ROLES:  # type: ignore[attr-defined]
        s = getattr(state, role)
        if not _state_ok(s, device, recipe):  # validate_state names what is wrong
            validate_state(s, where=f"{where}: state.{role}", device=device, recipe=recipe)
    return True


def check_probe(probe: Any, where: str, *, shape: tuple[int, ...] = (), name: str = "grad_probe",
                device: torch.device | None = None) -> Tensor | None:
    """``probe`` if it is None or a float32 tensor of ``shape`` (() for one gradient role, (n,) for n)
    on ``device`` (x's: the op writes amax(dy) into the probe's gradient there).

    A probe need not require grad: torch.func passes plain tensors and differentiates them itself.
    """
    if probe is None:
        return None
    if not isinstance(probe, Tensor) or tuple(probe.shape) != shape or probe.dtype != torch.float32:
        what = "0-d" if not shape else f"{shape}"
        got = f"shape {tuple(probe.shape)} {probe.dtype}" if isinstance(probe, Tensor) else repr(probe)
        raise ValueError(f"{where}: {name} must be a {what} float32 tensor (fp8ops.make_probes), got {got}")
    if device is not None and probe.device != device:
        raise ValueError(f"{where}: {name} is on {probe.device} but x is on {device}; make it on x's device "
                         f"(fp8ops.make_probes(state) puts it on the state's device)")
    return probe


def check_device(t: Tensor | None, name: str, x: Tensor, where: str) -> None:
    """Raise unless ``t`` (when given) is on ``x``'s device."""
    if t is not None and t.device != x.device:
        raise ValueError(f"{where}: {name} is on {t.device} but x is on {x.device}; move it with .to(x.device)")


# ------------------------------------------------------------------------------------------------
# Normalisation arguments (layer_norm, rms_norm, layernorm_linear, fused_ln_mlp, the nn modules)


def check_eps(eps: Any, where: str) -> float:
    """``eps`` as a float if it is a finite real number > 0 (not a bool)."""
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (math.isfinite(eps) and eps > 0):
        raise ValueError(f"{where}: eps must be a finite number > 0 (e.g. 1e-5), got {eps!r}")
    return float(eps)


def check_zero_centered_gamma(value: Any, where: str) -> bool:
    """``value`` if it is a bool (a string such as "False" would be truthy)."""
    if not isinstance(value, bool):
        raise TypeError(f"{where}: zero_centered_gamma must be a bool, got {type(value).__name__} ({value!r})")
    return value


def check_normalization(name: Any, where: str) -> str:
    """``name`` if it is one of :data:`NORMALIZATIONS`."""
    if not isinstance(name, str) or name not in NORMALIZATIONS:
        raise ValueError(f"{where}: normalization must be 'LayerNorm' or 'RMSNorm', got {name!r}")
    return name


def check_norm_args(x: Any, ln_weight: Any, ln_bias: Any, normalization: Any, eps: Any, zero_centered_gamma: Any,
                    where: str) -> int:
    """Validate the arguments of the norm in front of a GEMM; returns K (x's last dimension)."""
    check_float_tensor(x, "x", where)
    if x.dim() < 1:
        raise ValueError(f"{where}: x must be (..., K), got a 0-d tensor")
    K = x.shape[-1]
    check_normalization(normalization, where)
    check_float_tensor(ln_weight, "ln_weight", where)
    if tuple(ln_weight.shape) != (K,):
        raise ValueError(f"{where}: ln_weight must have shape (K,) = ({K},) like x's last dimension, got {tuple(ln_weight.shape)}")
    if ln_bias is not None:
        if normalization == "RMSNorm":
            raise ValueError(f"{where}: RMSNorm has no bias; pass ln_bias=None")
        check_float_tensor(ln_bias, "ln_bias", where)
        if tuple(ln_bias.shape) != (K,):
            raise ValueError(f"{where}: ln_bias must have shape (K,) = ({K},), got {tuple(ln_bias.shape)}")
    check_eps(eps, where)
    check_zero_centered_gamma(zero_centered_gamma, where)
    check_device(ln_weight, "ln_weight", x, where)
    check_device(ln_bias, "ln_bias", x, where)
    return K


def check_weight(weight: Any, bias: Any, K: int, x: Tensor, name: str, where: str) -> int:
    """Validate a (N, K) weight and its (N,) bias (``name`` with "weight" -> "bias"), both on x's
    device; returns N."""
    check_float_tensor(weight, name, where)
    if weight.dim() != 2:
        raise ValueError(f"{where}: {name} must be 2-D (N, K), got shape {tuple(weight.shape)}")
    N = weight.shape[0]
    if weight.shape[1] != K:
        raise ValueError(f"{where}: {name} is {tuple(weight.shape)} but its input has K={K} in the last dimension")
    check_device(weight, name, x, where)
    bname = name.replace("weight", "bias")
    if bias is not None:
        check_float_tensor(bias, bname, where)
        if tuple(bias.shape) != (N,):
            raise ValueError(f"{where}: {bname} must have shape (N,) = ({N},), got {tuple(bias.shape)}")
        check_device(bias, bname, x, where)
    return N


def check_residual_dropout(residual_dropout: Any, residual: Any, where: str) -> None:
    """``residual_dropout`` must be a number in [0, 1), and above 0 only with a residual."""
    if isinstance(residual_dropout, bool) or not isinstance(residual_dropout, (int, float)) \
            or not 0.0 <= float(residual_dropout) < 1.0:
        raise ValueError(f"{where}: residual_dropout must be a number in [0, 1), got {residual_dropout!r}")
    if residual_dropout > 0 and residual is None:
        raise ValueError(f"{where}: residual_dropout={residual_dropout} drops x before its residual add; "
                         f"pass residual= (or apply F.dropout to x yourself)")


def check_residual(residual: Any, x: Any, where: str) -> None:
    """``residual`` must be a float tensor of x's shape, dtype and device."""
    check_float_tensor(residual, "residual", where)
    if not isinstance(x, Tensor):
        return  # x's own check names it
    if residual.shape != x.shape:
        raise ValueError(f"{where}: residual must have x's shape {tuple(x.shape)}, got {tuple(residual.shape)}")
    if residual.dtype != x.dtype:
        raise ValueError(f"{where}: residual must have x's dtype {x.dtype}, got {residual.dtype}; cast one of them")
    if residual.device != x.device:
        raise ValueError(f"{where}: residual must be on x's device {x.device}, got {residual.device}")
