"""Input checks of :func:`fp8ops.attention` that go beyond types and shapes: packed-sequence
offsets, dropout seeds, integer arguments, and mods checked against a call.

Mods are checked twice over: their eager results (shape, dtype, ``modmath.load`` index errors) on
the reference path, and, before the kernels run, the index ranges of their ``modmath.load`` reads
(interval arithmetic from :mod:`.intervals`). Each check raises a TypeError or ValueError naming the
function, the argument and the fix.
"""

from __future__ import annotations

import math
import operator
from typing import Any

import torch
from torch import Tensor

from .intervals import _dtype_kind, _mod_facts
from .mod_math import _LoadIndexError
from .mods import _Mod


def _index(v: Any) -> int | None:
    """``v`` as an int (None stays None) for integer-like arguments; bools and non-integers give None."""
    # No try/except around operator.index: torch 2.11's compiler turns the TypeError of
    # operator.index(None) into an internal error instead of letting it be caught.
    if v is None or isinstance(v, (bool, float)):
        return None
    if isinstance(v, int):
        return int(v)
    if not hasattr(type(v), "__index__"):
        return None
    return int(operator.index(v))


def _check_seed(seed: Any, where: str) -> None:
    """``dropout_seed``: None, an int in int64 range or a 1-element integer tensor (checked even when
    ``dropout_p`` is 0: a wrong seed is a bug either way)."""
    if seed is None:
        return
    if isinstance(seed, Tensor):
        if seed.dtype == torch.bool or seed.is_floating_point() or seed.is_complex():
            raise TypeError(f"{where}: dropout_seed must be an int or a 1-element integer tensor, got a tensor of "
                            f"dtype {seed.dtype}")
        if seed.numel() != 1:
            raise ValueError(f"{where}: dropout_seed must be an int or a 1-element integer tensor, got a tensor of "
                             f"shape {tuple(seed.shape)}")
        return
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"{where}: dropout_seed must be an int, a 1-element integer tensor or None, got {seed!r}")
    if not -(2**63) <= seed < 2**63:
        raise ValueError(f"{where}: dropout_seed must fit in int64 ([-2**63, 2**63)), got {seed}")


def _seed_tensor(seed: Any, device: torch.device, where: str) -> Tensor:
    _check_seed(seed, where)
    if seed is None:
        return torch.randint(-(2**62), 2**62, (), dtype=torch.int64, device=device)
    if isinstance(seed, Tensor):
        return seed.reshape(()).to(device=device, dtype=torch.int64)
    return torch.tensor(seed, dtype=torch.int64, device=device)


def _check_cu(cu: Any, name: str, device: torch.device, where: str) -> None:
    """The form of a ``cu_seqlens`` argument (its values are checked by :func:`_check_offsets`)."""
    what = "a 1-D int32 tensor (B + 1,) of the sequences' start offsets in the packed tokens"
    if not isinstance(cu, Tensor):
        raise TypeError(f"{where}: {name} must be {what}, got {type(cu).__name__}")
    if cu.dtype != torch.int32:
        raise ValueError(f"{where}: {name} must be {what}, got dtype {cu.dtype}; convert it once with "
                         f"{name}.to(torch.int32)")
    if cu.dim() != 1:
        raise ValueError(f"{where}: {name} must be {what}, got shape {tuple(cu.shape)}")
    if cu.numel() < 2:
        raise ValueError(f"{where}: {name} must be {what} with at least 2 entries (0 and the end of the first "
                         f"sequence), got {cu.numel()} entr{'y' if cu.numel() == 1 else 'ies'}")
    if cu.device != device:
        raise ValueError(f"{where}: {name} must be on q's device {device}, got {cu.device}; move it once with "
                         f"{name}.to(q.device)")


def _shown(vals: list[int]) -> str:
    return str(vals) if len(vals) <= 12 else f"[{', '.join(map(str, vals[:6]))}, ..., {', '.join(map(str, vals[-3:]))}]"


def _check_offsets(cu_q: Tensor, cu_kv: Tensor | None, tq: int, tkv: int, where: str) -> tuple[int, int]:
    """Check the values of the packed-sequence offsets; returns the longest query and key sequences.

    One device-to-host read for both tensors (``cu_kv`` None: ``cu_q`` serves k and v too). Offsets
    must start at 0, never decrease, and end at the packed length: ``cu[-1] == T`` (a token after
    ``cu[-1]`` would belong to no sequence and come out as 0 without a word).
    """
    vals = (cu_q if cu_kv is None else torch.cat([cu_q, cu_kv])).tolist()
    n = cu_q.numel()
    if cu_kv is None:
        checks = [("cu_seqlens_q", vals, tq, "q"),
                  ("cu_seqlens_q (used for k and v too: cu_seqlens_kv is None)", vals, tkv, "k and v")]
    else:
        checks = [("cu_seqlens_q", vals[:n], tq, "q"), ("cu_seqlens_kv", vals[n:], tkv, "k and v")]
    longest = []
    for name, offs, total, of in checks:
        short = name.split(" ")[0]
        if offs[0] != 0:
            raise ValueError(f"{where}: {name} must start at 0 (offsets of sequences packed without a gap), got "
                             f"{_shown(offs)}")
        lens = [b - a for a, b in zip(offs[:-1], offs[1:])]
        bad = next((i for i, m in enumerate(lens) if m < 0), None)
        if bad is not None:
            raise ValueError(f"{where}: {name} must be non-decreasing (sequence i spans {short}[i]:{short}[i + 1]), "
                             f"got {short}[{bad}] = {offs[bad]} > {short}[{bad + 1}] = {offs[bad + 1]} in "
                             f"{_shown(offs)}")
        if offs[-1] != total:
            where_ = "past" if offs[-1] > total else "before the end of"
            raise ValueError(f"{where}: {name} ends at {offs[-1]}, {where_} the {total} packed tokens of {of} "
                             f"(dim 0); the offsets must end at T = {total}, every token in one sequence "
                             f"({_shown(offs)})")
        longest.append(max(lens))
    return longest[0], longest[-1]


# ------------------------------------------------------------------------------------------------
# Checking mods against a call: eager results (the reference path) and, before the kernels run,
# the index ranges of their modmath.load reads (interval arithmetic on the lowered code).


def _mod_label(m: Any) -> str:
    return str(getattr(m, "name", None) or getattr(m, "__qualname__", None) or repr(m))


def _check_mod_result(r: Any, kind: str, label: str, where: str, shape: tuple[int, ...], shown: str,
                      full: tuple[int, ...] | None = None) -> Any:
    """The eager result of a mod, checked: a score (real tensor or number) or a mask (bool tensor or
    bool), of ``shape`` or broadcastable to it with the same number of dims (or 0-d). ``full``: the
    shape to name in the message (``shape`` is a chunk of it)."""
    if kind == "mask_mod":
        if isinstance(r, bool):
            return r
        if not isinstance(r, Tensor):
            raise TypeError(f"{where}: mask_mod {label} must return a bool tensor (True: visible), got "
                            f"{type(r).__name__}")
        if r.dtype != torch.bool:
            raise TypeError(f"{where}: mask_mod {label} must return a bool tensor (True: visible), got dtype "
                            f"{r.dtype}; return a comparison, e.g. (x != 0) for a 0/1 tensor x")
    else:
        if isinstance(r, (int, float)) and not isinstance(r, bool):
            return torch.tensor(float(r))
        if not isinstance(r, Tensor):
            raise TypeError(f"{where}: score_mod {label} must return the new score as a tensor, got "
                            f"{type(r).__name__}")
        if r.dtype == torch.bool or r.is_complex():
            raise TypeError(f"{where}: score_mod {label} must return a real-valued score tensor, got dtype "
                            f"{r.dtype} (a mask belongs in mask_mod)")
    if r.dim() != 0 and (r.dim() != len(shape) or any(a not in (1, b) for a, b in zip(r.shape, shape))):
        args = "(b, h, q_idx, kv_idx)" if kind == "mask_mod" else "(score, b, h, q_idx, kv_idx)"
        raise ValueError(f"{where}: {kind} {label} returned shape {tuple(r.shape)}; expected the shape of the "
                         f"scores {shown} = {full or shape}, or one that broadcasts to it with the same "
                         f"{len(shape)} dims (each 1 or the full size): compute it elementwise from the mod's "
                         f"arguments {args}, which broadcast to that shape")
    return r


def _load_error(e: IndexError, kind: str, label: str, where: str, dims_name: str, dims: tuple[int, ...]) -> str:
    if isinstance(e, _LoadIndexError) and e.lo is not None:
        got = (f"reads a captured tensor of shape {e.shape} ({e.numel} elements) at flat indices "
               f"[{e.lo}, {e.hi}] with modmath.load, which needs 0 <= index < {e.numel}")
    else:
        got = f"raised IndexError ({e}): a tensor it captures is too small"
    return (f"{where}: {kind} {label} {got}, for this call's {dims_name} = {dims}; the mod was built for other "
            f"sizes: rebuild it (and the tensors it captures) for these")


def _checked_mod(mod: Any, kind: str, where: str, shape: tuple[int, ...], shown: str, dims_name: str,
                 dims: tuple[int, ...]) -> Any:
    """``mod`` wrapped for the reference math: its result checked, its read errors made ValueErrors."""
    if mod is None:
        return None
    label = _mod_label(mod)

    def run(*args: Any) -> Any:
        try:
            r = mod(*args)
        except IndexError as e:
            raise ValueError(_load_error(e, kind, label, where, dims_name, dims)) from None
        return _check_mod_result(r, kind, label, where, shape, shown)

    return run


def _check_mod_statically(mod: Any, kind: str, where: str, dims_name: str, dims: tuple[int, int, int, int]) -> None:
    """Before the kernels run a mod: refuse a mask that is not boolean and a modmath.load whose index
    range (interval arithmetic over b, h, q_idx, kv_idx in [0, dims)) leaves its captured tensor —
    the kernels would read outside it. Indices that depend on loaded values or the score are not
    bounded here, and are not checked."""
    if mod is None or min(dims) < 1 or not isinstance(mod, _Mod):
        return
    bufs = mod.buffers
    result, loads = _mod_facts(mod.key, dims, tuple(_dtype_kind(t.dtype) for t in bufs))
    label = _mod_label(mod)
    if kind == "mask_mod" and result in ("int", "float"):
        raise TypeError(f"{where}: mask_mod {label} must return a bool tensor (True: visible), but it returns "
                        f"{'an integer' if result == 'int' else 'a float'} expression; return a comparison, e.g. "
                        f"(x != 0) for a 0/1 value x")
    for slot, lo, hi in loads:
        n = bufs[slot].numel()
        if math.isinf(lo) or math.isinf(hi) or (lo >= 0 and hi < n):
            continue
        raise ValueError(
            f"{where}: {kind} {label} reads a captured tensor of shape {tuple(bufs[slot].shape)} ({n} elements) "
            f"with modmath.load at flat indices up to [{int(lo)}, {int(hi)}] for this call's {dims_name} = {dims}, "
            f"which needs 0 <= index < {n}; the mod was built for other sizes: rebuild it (and the tensors it "
            f"captures) for these, or bound the index with modmath.clamp")
