"""The flat ``dict[str, Tensor]`` round trip of a pytree of scaling states (safetensors / DCP
friendly, no pickled objects): :func:`state_dict` and :func:`load_state_dict`, with a schema version.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

import torch
from torch import Tensor
from torch.utils import _pytree as pytree

from .state import _TENSOR_FIELDS, ScalingState, _check_values

__all__ = ["SCHEMA_VERSION", "load_state_dict", "state_dict"]

SCHEMA_VERSION = 3
"""Version of the flat ``dict[str, Tensor]`` layout written by :func:`state_dict`.

Version 2 added the ``fc1_output`` role of :class:`fp8ops.LayerNormMLPState`; version 3 added each
state's ``fp8_dtype`` and ``mode`` entries. Older dicts still load: the roles they lack keep the
values of ``like``, and so do the fields they lack."""

# Roles added in a schema version: a dict of an older version loads without them.
_ADDED_ROLES = {2: ("fc1_output",)}
# Per-state entries of each schema version.
_BASE_FIELDS = ("amax_history", "scale", "pending_amax", "role", "calibrated")
_V3_FIELDS = ("fp8_dtype", "mode")

_T = TypeVar("_T")



def _key(path: tuple[Any, ...]) -> str:
    parts = []
    for k in path:
        if isinstance(k, pytree.MappingKey):
            parts.append(str(k.key))
        elif isinstance(k, pytree.SequenceKey):
            parts.append(str(k.idx))
        elif isinstance(k, pytree.GetAttrKey):
            parts.append(k.name)
        else:
            parts.append(str(k))
    return ".".join(parts) if parts else "state"


_VERSION_KEY = "fp8ops.schema_version"

# Codes of the static fields in the flat dict (int8); 0 = not recorded (None, or a value without
# a code, e.g. a research recipe's own mode): loading then takes the value of ``like``.
_ROLE_CODES: dict[str, int] = {"forward": 0, "backward": 1}
_DTYPE_CODES: dict[Any, int] = {None: 0, torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}
_MODE_CODES: dict[Any, int] = {None: 0, "delayed": 1, "current": 2, "rowwise": 3}


def _code(table: Mapping[Any, int], value: Any) -> Tensor:
    return torch.tensor(table.get(value, 0), dtype=torch.int8)


def state_dict(states: Any) -> dict[str, Tensor]:
    """Flatten a pytree of states to ``dict[str, Tensor]`` (safetensors / DCP friendly).

    Keys are dotted paths (``"blocks.0.fc1.input.amax_history"``); each state adds
    ``amax_history``, ``scale``, ``pending_amax``, ``role`` (int8: 0 forward, 1 backward),
    ``calibrated`` (bool), ``fp8_dtype`` (int8: 0 unknown, 1 float8_e4m3fn, 2 float8_e5m2) and
    ``mode`` (int8: 0 unknown, 1 delayed, 2 current, 3 rowwise); the entry
    ``"fp8ops.schema_version"`` records :data:`SCHEMA_VERSION`.
    """
    out: dict[str, Tensor] = {_VERSION_KEY: torch.tensor(SCHEMA_VERSION, dtype=torch.int64)}
    leaves, _ = pytree.tree_flatten_with_path(states, is_leaf=lambda x: isinstance(x, ScalingState))
    for path, s in leaves:
        if not isinstance(s, ScalingState):
            raise TypeError(f"state_dict: expected a pytree of states, found a {type(s).__name__} at {_key(path)!r}")
        k = _key(path)
        out[f"{k}.amax_history"] = s.amax_history
        out[f"{k}.scale"] = s.scale
        out[f"{k}.pending_amax"] = s.pending_amax
        out[f"{k}.role"] = _code(_ROLE_CODES, s.role)
        out[f"{k}.calibrated"] = torch.tensor(bool(s.calibrated))
        out[f"{k}.fp8_dtype"] = _code(_DTYPE_CODES, s.fp8_dtype)
        out[f"{k}.mode"] = _code(_MODE_CODES, s.mode)
    return out


def _read_int(v: Any, *, what: str, allow_bool: bool = False) -> int:
    """An integer stored as a one-element tensor (or a Python int); host read."""
    where = "load_state_dict"
    if isinstance(v, Tensor):
        if v.numel() != 1:
            raise ValueError(f"{where}: {what} must be a one-element tensor, got shape {tuple(v.shape)}")
        if v.dtype == torch.bool and not allow_bool:
            raise ValueError(f"{where}: {what} must be an integer, got a bool tensor {v!r}")
        if v.is_complex():
            raise ValueError(f"{where}: {what} must be an integer, got {v!r}")
        x = v.reshape(()).item()
    else:
        x = v
    if isinstance(x, bool):
        if not allow_bool:
            raise ValueError(f"{where}: {what} must be an integer, got {x!r}")
        return int(x)
    if isinstance(x, float) and x.is_integer():
        return int(x)
    if not isinstance(x, int):
        raise ValueError(f"{where}: {what} must be an integer, got {v!r}")
    return x


def _decode(table: Mapping[Any, int], v: Any, *, key: str) -> Any:
    code = _read_int(v, what=key)
    inverse = {c: name for name, c in table.items()}
    if code not in inverse:
        raise ValueError(f"load_state_dict: {key} must be one of the codes {sorted(inverse)}, got {code}")
    return inverse[code]


def load_state_dict(like: _T, flat: Mapping[str, Tensor]) -> _T:
    """Rebuild states shaped like ``like`` from a dict written by :func:`state_dict`.

    A dict of an older schema version loads too: states of roles added since (see
    :data:`SCHEMA_VERSION`) keep the values of ``like``, and so do the fields added since
    (``fp8_dtype`` and ``mode`` before version 3). Every value is checked (host reads): the role
    codes must match ``like``'s roles, a recorded ``fp8_dtype`` and ``mode`` must match ``like``'s
    where both are known (a checkpoint of another recipe is refused), the scale must be finite and
    > 0, the history finite and >= 0, the pending amax >= 0 or NaN (an observation not yet
    dropped by an update).

    Raises:
        ValueError: the schema version is missing, not an integer or unknown; a key is missing;
            ``flat`` has keys ``like`` does not have; a tensor's shape or dtype differs from
            ``like``'s; a role, fp8_dtype or mode differs from ``like``'s or is no valid code; a
            value is out of its domain.
    """
    where = "load_state_dict"
    if not isinstance(flat, Mapping):
        raise TypeError(
            f"{where}: flat must be a mapping of str to Tensor (from fp8ops.state_dict), got {type(flat).__name__}"
        )
    if _VERSION_KEY not in flat:
        raise ValueError(f"{where}: no {_VERSION_KEY!r} entry; this dict was not written by fp8ops.state_dict")
    version = _read_int(flat[_VERSION_KEY], what=repr(_VERSION_KEY))
    if not 1 <= version <= SCHEMA_VERSION:
        raise ValueError(f"{where}: schema version {version} is not supported (this fp8ops reads 1 to {SCHEMA_VERSION})")
    added = {r for v, roles in _ADDED_ROLES.items() if v > version for r in roles}
    names = _BASE_FIELDS + (_V3_FIELDS if version >= 3 else ())
    leaves, spec = pytree.tree_flatten_with_path(like, is_leaf=lambda x: isinstance(x, ScalingState))
    expected = {_VERSION_KEY}
    out = []
    for path, s in leaves:
        k = _key(path)
        if not isinstance(s, ScalingState):
            raise TypeError(f"{where}: like must be a pytree of states, found a {type(s).__name__} at {k!r}")
        expected.update(f"{k}.{n}" for n in names)
        if k.rsplit(".", 1)[-1] in added and not any(key.startswith(f"{k}.") for key in flat):
            out.append(s)  # a role this dict's version did not have
            continue
        fields = {}
        for name in names:
            if f"{k}.{name}" not in flat:
                raise ValueError(f"{where}: missing key {k}.{name!s}")
            fields[name] = flat[f"{k}.{name}"]
        for name, _ in _TENSOR_FIELDS:
            t, ref = fields[name], getattr(s, name)
            if not isinstance(t, Tensor) or t.shape != ref.shape or t.dtype != ref.dtype:
                got = f"shape {tuple(t.shape)} {t.dtype}" if isinstance(t, Tensor) else f"a {type(t).__name__}"
                raise ValueError(f"{where}: {k}.{name} has {got}, expected shape {tuple(ref.shape)} {ref.dtype}")
        role = _decode(_ROLE_CODES, fields["role"], key=f"{k}.role")
        if role != s.role:
            raise ValueError(
                f"{where}: {k}.role is {role!r} but like's state at {k} is {s.role!r}; "
                f"was this dict saved from another model?"
            )
        calibrated = bool(_read_int(fields["calibrated"], what=f"{k}.calibrated", allow_bool=True))
        static = {"fp8_dtype": s.fp8_dtype, "mode": s.mode}
        for name, table in (("fp8_dtype", _DTYPE_CODES), ("mode", _MODE_CODES)):
            if name not in fields:
                continue  # an older dict: like's value
            saved, mine = _decode(table, fields[name], key=f"{k}.{name}"), static[name]
            if saved is not None and mine is not None and saved != mine:
                raise ValueError(
                    f"{where}: {k} was saved with {name}={saved} but like's state has {name}={mine}: its "
                    f"scale and history belong to another recipe; load it into states of that recipe"
                )
            static[name] = mine if mine is not None else saved
        h, sc, p = (fields[n].to(getattr(s, n).device) for n, _ in _TENSOR_FIELDS)
        _check_values(h, sc, p, where=where, prefix=f"{k}.")
        observed = not bool(p == 0)  # a pending observation (NaN included) waits for the next update
        out.append(ScalingState._make(h, sc, p, role, calibrated, static["fp8_dtype"], static["mode"], observed))
    extra = sorted(set(flat) - expected)
    if extra:
        shown = ", ".join(repr(e) for e in extra[:5]) + (f" and {len(extra) - 5} more" if len(extra) > 5 else "")
        raise ValueError(
            f"{where}: flat has {len(extra)} keys that like does not have: {shown}; "
            f"was this dict saved from another model, or with another schema version?"
        )
    return pytree.tree_unflatten(out, spec)
