"""Score and mask mods: :class:`ScoreMod`, :class:`MaskMod`, the :func:`score_mod` /
:func:`mask_mod` decorators, :func:`and_masks` / :func:`or_masks`, and the registry of mods.

A mod object holds its Python function (the eager twin) and the tensors it captured. Everything
else, how to build its Triton twins (:mod:`.codegen`), is a :class:`_ModSpec` in the registry
:data:`_SPECS`, keyed by a string: the library ops carry the key, so compiled kernels never hold a
captured tensor. Ready-made mods are in :mod:`.mod_library`.
"""

from __future__ import annotations

import functools
import hashlib
import types
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from ..kernels import attention as _K
from .codegen import (
    _BUF_PARAMS,
    _MAX_BUFFERS,
    _bwd_source,
    _capture,
    _fwd_source,
    _jit_source,
    _lower,
    _Lowered,
    _mod_error,
    _triton_scope,
    relative_bias,
    score_grad_identity,
)

_SCORE_ARITY = 5
_MASK_ARITY = 4


class _ModSpec:
    """Everything about a mod except its tensors: how to build its Triton twins (kept in a registry
    keyed by a string, so the compiled kernels never hold a captured tensor)."""

    def __init__(self, kind: str, n_buffers: int, *, fn: Any = None, lowered: _Lowered | None = None,
                 children: tuple[tuple[_ModSpec, int], ...] = (), op: str = "",
                 triton_fn: Any = None, triton_grad: Any = None, label: str = "") -> None:
        self.kind = kind
        self.n_buffers = n_buffers
        # Only the name of the function is kept (for messages): a spec outlives the tensors that
        # the mod which created it captured.
        self.fn = types.SimpleNamespace(__qualname__=getattr(fn, "__qualname__", label or repr(fn)))
        self.lowered = lowered
        self.children = children
        self.op = op
        self.triton_fn = triton_fn
        self.triton_grad = triton_grad
        self.label = label
        self._fwd: Any = None
        self._grad: dict[tuple[bool, ...], Any] = {}
        self._rel: bool | None = None
        # prepare(buffers) -> buffers: run by the library ops before each launch on the captured
        # tensors (flat), e.g. to derive a table from them (document_mask); None: used as captured
        self.prepare: Callable[[tuple[Tensor, ...]], tuple[Tensor, ...]] | None = None
        # the spec of (causal mask & this mask), with the same buffers, where it has a leaner twin
        # than the two evaluated apart (document_mask); and_masks uses it (_fuse_and)
        self.and_causal: _ModSpec | None = None
        # (left, right): a mask that hides every pair outside q_idx - kv_idx in [-right, left] (None:
        # unbounded on that side), where the library knows it (its causal, sliding-window and causal
        # document masks); see ``implied_band``
        self.band: tuple[int | None, int | None] | None = None
        # the key of a generated spec that reads this one's first buffers at the same indices, for
        # the static index checks of an explicit twin (intervals._mod_facts)
        self.facts_key: str | None = None
        if lowered is not None:
            digest = hashlib.sha256(_fwd_source(lowered, "f").encode()).hexdigest()[:16]
            self.key = f"{kind}:{digest}"
        elif children:
            self.key = f"{kind}:{op}(" + ",".join(f"{c.key}@{off}" for c, off in children) + ")"
        else:
            self.key = f"{kind}:explicit:{id(triton_fn)}:{id(triton_grad)}"
        self.name = "_fp8ops_" + hashlib.sha256(self.key.encode()).hexdigest()[:16]

    def prepare_buffers(self, bufs: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        """The tensors the kernels read for ``bufs`` (this mod's captured tensors, flat): each
        ``prepare`` of this spec or of its children applied to its own slice."""
        if self.prepare is not None:
            return tuple(self.prepare(tuple(bufs)))
        if not self.children:
            return tuple(bufs)
        out = list(bufs)
        for child, off in self.children:
            out[off:off + child.n_buffers] = child.prepare_buffers(tuple(out[off:off + child.n_buffers]))
        return tuple(out)

    @property
    def relative_bias(self) -> bool:
        """A score mod ``score + slope * (kv_idx - q_idx) + c`` with slope and c per (b, h)
        (``codegen.relative_bias``; decided once per spec)."""
        if self._rel is None:
            self._rel = self.kind == "score" and self.lowered is not None and relative_bias(self.lowered)
        return self._rel

    @property
    def implied_band(self) -> tuple[int | None, int | None] | None:
        """(left, right) such that this mask hides every pair outside ``q_idx - kv_idx`` in
        ``[-right, left]`` (None on a side: unbounded), or None where nothing is known: a spec marked
        with its ``band``, the causal mask (None, 0), or an ``and`` of masks, the band inside all of
        theirs. Without a block mask the kernels skip the tiles outside it (the Hopper backward also
        the halves of a key block outside it)."""
        if self.kind != "mask":
            return None
        if self.band is not None:
            return self.band
        if self.key == _causal_key():
            return (None, 0)
        if self.op != "and":
            return None
        bands = [b for b in (child.implied_band for child, _ in self.children) if b is not None]
        return functools.reduce(_K.band_and, bands) if bands else None

    @property
    def differentiable(self) -> bool:
        return self.lowered is not None or self.triton_grad is not None

    def fwd_jit(self) -> Any:
        if self._fwd is None:
            if self.triton_fn is not None:
                self._fwd = self.triton_fn
            elif self.lowered is not None:
                self._fwd = _jit_source(_fwd_source(self.lowered, self.name), self.name, _triton_scope())
            else:
                scope = _triton_scope()
                terms = []
                for i, (child, off) in enumerate(self.children):
                    scope[f"_fp8_m{i}"] = child.fwd_jit()
                    bufs = [f"_fp8_t{off + j}" if j < child.n_buffers else "None" for j in range(_MAX_BUFFERS)]
                    terms.append(f"(_fp8_m{i}(b, h, q_idx, kv_idx, {', '.join(bufs)}))")
                if not terms:
                    terms = ["((q_idx >= 0) | (kv_idx >= 0))"]
                joiner = " & " if self.op == "and" else " | "
                src = f"def {self.name}(b, h, q_idx, kv_idx, {_BUF_PARAMS}):\n    return {joiner.join(terms)}\n"
                self._fwd = _jit_source(src, self.name, scope)
        return self._fwd

    def grad_jit(self, needs: tuple[bool, ...]) -> Any:
        if self.kind != "score":
            raise TypeError("only score mods have a derivative")
        if self.triton_fn is not None:
            if self.triton_grad is None:
                raise NotImplementedError(
                    f"attention: the score_mod {self.label} has an explicit Triton twin but no triton_grad; "
                    f"pass ScoreMod(fn, triton=..., triton_grad=...) to differentiate through it on CUDA")
            return self.triton_grad
        assert self.lowered is not None
        needs = tuple(bool(x) for x in needs)
        if needs not in self._grad:
            if score_grad_identity(self.fn, self.lowered, needs):
                # derivative 1 and nothing to scatter: the kernels' identity, which the Hopper
                # backward skips (kernels/attention.hopper_bwd_score_mode)
                self._grad[needs] = _K._identity_score_grad
            else:
                name = f"{self.name}_bwd" + "".join("1" if x else "0" for x in needs)
                self._grad[needs] = _jit_source(_bwd_source(self.fn, self.lowered, name, needs), name,
                                                _triton_scope())
        return self._grad[needs]

    def sources(self, needs: tuple[bool, ...] = ()) -> tuple[str, str | None]:
        """The generated Triton source of the twin and of its derivative (for reading)."""
        if self.lowered is None:
            raise ValueError("this mod has no generated source")
        fwd = _fwd_source(self.lowered, self.name)
        bwd = _bwd_source(self.fn, self.lowered, f"{self.name}_bwd", needs) if self.kind == "score" else None
        return fwd, bwd


_SPECS: dict[str, _ModSpec] = {}
_LOWER_CACHE: dict[tuple[Any, ...], _ModSpec] = {}


def _register(spec: _ModSpec) -> _ModSpec:
    return _SPECS.setdefault(spec.key, spec)


class _Mod:
    __slots__ = ("buffers", "fn", "key", "name")
    kind = ""
    arity = 0

    def __init__(self, fn: Callable[..., Any], *, triton: Any = None, triton_grad: Any = None,
                 buffers: Sequence[Tensor] = (), name: str | None = None) -> None:
        cls = type(self).__name__
        if isinstance(fn, _Mod):
            raise TypeError(f"{cls}: fn is already a {type(fn).__name__}")
        if not callable(fn):
            raise TypeError(f"{cls}: fn must be a function, got {type(fn).__name__}")
        label = name or getattr(fn, "__qualname__", repr(fn))
        if triton is None:
            if triton_grad is not None or tuple(buffers):
                raise TypeError(f"{cls}: triton_grad and buffers go with an explicit triton twin")
            spec, bufs = self._lowered_spec(fn, label)
        else:
            bufs = tuple(buffers)
            for t in bufs:
                if not isinstance(t, Tensor):
                    raise TypeError(f"{cls}: buffers must be tensors, got {type(t).__name__}")
            if len(bufs) > _MAX_BUFFERS:
                raise ValueError(f"{cls}: at most {_MAX_BUFFERS} buffers, got {len(bufs)}")
            spec = _register(_ModSpec(self.kind, len(bufs), fn=fn, triton_fn=triton, triton_grad=triton_grad,
                                      label=label))
        object.__setattr__(self, "fn", fn)
        object.__setattr__(self, "buffers", bufs)
        object.__setattr__(self, "key", spec.key)
        object.__setattr__(self, "name", label)

    def _lowered_spec(self, fn: Any, label: str) -> tuple[_ModSpec, tuple[Tensor, ...]]:
        # Cheap when the same code with the same constants was seen before (a mod rebuilt every
        # step around new tensors): the source is parsed once.
        if not hasattr(fn, "__code__"):
            raise _mod_error(fn, "it is not a Python function")
        env, bufs, slots, cache_key = _capture(fn)
        full_key = (self.kind, self.arity, *cache_key)
        spec = _LOWER_CACHE.get(full_key)
        if spec is None:
            lowered = _lower(fn, self.arity, env, slots)
            spec = _register(_ModSpec(self.kind, len(bufs), fn=fn, lowered=lowered, label=label))
            _LOWER_CACHE[full_key] = spec
        return spec, bufs

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"{type(self).__name__} is immutable")

    @property
    def spec(self) -> _ModSpec:
        return _SPECS[self.key]

    def triton_source(self) -> str:
        """The generated Triton source of this mod's kernel twin (and derivative, for score mods)."""
        fwd, bwd = self.spec.sources(tuple(t.requires_grad for t in self.buffers))
        return fwd if bwd is None else fwd + "\n" + bwd

    def __repr__(self) -> str:
        t = f", buffers={[tuple(b.shape) for b in self.buffers]}" if self.buffers else ""
        return f"{type(self).__name__}({self.name}{t})"


class ScoreMod(_Mod):
    """A score modification ``score_mod(score, b, h, q_idx, kv_idx) -> new score``, with its twins.

    Built from a plain function (usually with the :func:`score_mod` decorator): the function itself
    is the eager PyTorch twin, and a Triton twin plus its derivative are generated from its source.
    ``score`` is fp32; ``b`` the batch (or sequence) index, ``h`` the query head, ``q_idx`` /
    ``kv_idx`` the positions (inside the sequence for packed inputs); all broadcast together. Numbers
    it closes over become kernel constants; tensors (up to 4, read with ``modmath.load``) become
    kernel arguments and receive gradients when they require grad.

    Explicit twins (for bodies the generator cannot express)::

        ScoreMod(fn, triton=jit_fn, triton_grad=jit_grad, buffers=(t0, ...))
        jit_fn(score, b, h, q_idx, kv_idx, t0, t1, t2, t3) -> score
        jit_grad(ds, score, b, h, q_idx, kv_idx, valid, t0, t1, t2, t3, g0, g1, g2, g3) -> ds * d/dscore

    where ``t*`` are the buffers' flat data pointers (None when absent) and ``g*`` fp32 gradient
    buffers (None when not needed).

    Example:
        >>> import torch
        >>> from fp8ops import ScoreMod, modmath
        >>> double = ScoreMod(lambda score, b, h, q_idx, kv_idx: score * 2.0)
        >>> double(torch.ones(2), 0, 0, 0, 0)
        tensor([2., 2.])
    """

    __slots__ = ()
    kind = "score"
    arity = _SCORE_ARITY

    def __call__(self, score: Tensor, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Tensor:
        return self.fn(score, b, h, q_idx, kv_idx)


class MaskMod(_Mod):
    """A mask ``mask_mod(b, h, q_idx, kv_idx) -> bool`` (True: the query attends to the key), with twins.

    Built like :class:`ScoreMod` (see :func:`mask_mod`); explicit twins take
    ``triton=jit_fn`` with ``jit_fn(b, h, q_idx, kv_idx, t0, t1, t2, t3) -> bool``. A mask has no
    gradient.

    Example:
        >>> import torch
        >>> from fp8ops import MaskMod
        >>> causal = MaskMod(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx)
        >>> causal(0, 0, torch.arange(3)[:, None], torch.arange(3)[None, :])
        tensor([[ True, False, False],
                [ True,  True, False],
                [ True,  True,  True]])
    """

    __slots__ = ()
    kind = "mask"
    arity = _MASK_ARITY

    def __call__(self, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Tensor:
        return self.fn(b, h, q_idx, kv_idx)


def score_mod(fn: Callable[..., Any]) -> ScoreMod:
    """Decorator: one Python definition of a score modification for PyTorch and the Triton kernels.

    The body may use its arguments, numbers, arithmetic, comparisons, ``&``/``|``/``~``, local
    assignments and :data:`modmath`; it may close over numbers (kernel constants) and tensors (read
    with ``modmath.load(table, index)``; gradients flow to them). ``//`` and ``%`` truncate toward
    zero in Triton and floor in PyTorch: keep their operands non-negative.

    Example:
        >>> import torch, fp8ops
        >>> from fp8ops import modmath
        >>> @fp8ops.score_mod
        ... def soft(score, b, h, q_idx, kv_idx):
        ...     return 5.0 * modmath.tanh(score / 5.0)
        >>> q = k = v = torch.randn(1, 2, 4, 8)
        >>> out, _ = fp8ops.attention(q, k, v, score_mod=soft)
        >>> out.shape
        torch.Size([1, 2, 4, 8])
    """
    return ScoreMod(fn)


def mask_mod(fn: Callable[..., Any]) -> MaskMod:
    """Decorator: one Python definition of a mask for PyTorch and the Triton kernels (see :func:`score_mod`).

    Example:
        >>> import torch, fp8ops
        >>> @fp8ops.mask_mod
        ... def local(b, h, q_idx, kv_idx):
        ...     return (q_idx - kv_idx <= 2) & (kv_idx - q_idx <= 2)
        >>> q = k = v = torch.randn(1, 1, 8, 4)
        >>> fp8ops.attention(q, k, v, mask_mod=local)[0].shape
        torch.Size([1, 1, 8, 4])
    """
    return MaskMod(fn)


def _combine(op: str, mods: tuple[Any, ...]) -> MaskMod:
    where = f"{op}_masks"
    ms: list[MaskMod] = []
    for m in mods:
        if isinstance(m, MaskMod):
            ms.append(m)
        elif isinstance(m, ScoreMod):
            raise TypeError(f"{where}: expected mask mods, got a ScoreMod")
        elif callable(m):
            ms.append(MaskMod(m))
        else:
            raise TypeError(f"{where}: expected mask mods, got {type(m).__name__}")
    if op == "and":
        ms = _fuse_and(ms)
    bufs: list[Tensor] = []
    children: list[tuple[_ModSpec, int]] = []
    for m in ms:
        children.append((m.spec, len(bufs)))
        bufs.extend(m.buffers)
    if len(bufs) > _MAX_BUFFERS:
        raise ValueError(f"{where}: the masks capture {len(bufs)} tensors together; at most {_MAX_BUFFERS}")
    spec = _register(_ModSpec("mask", len(bufs), children=tuple(children), op=op,
                              label=f"{where}({', '.join(m.name for m in ms)})"))
    fns = tuple(ms)

    def eager(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        out: Any = True
        for m in fns:
            r = m(b, h, q_idx, kv_idx)
            out = r if out is True else (out & r if op == "and" else out | r)
        if out is True:
            return (torch.as_tensor(q_idx) >= 0) | (torch.as_tensor(kv_idx) >= 0)
        return out

    mod = MaskMod.__new__(MaskMod)
    object.__setattr__(mod, "fn", eager)
    object.__setattr__(mod, "buffers", tuple(bufs))
    object.__setattr__(mod, "key", spec.key)
    object.__setattr__(mod, "name", spec.label)
    return mod


@functools.cache
def _causal_key() -> str:
    return MaskMod(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx).key


def _fuse_and(ms: list[MaskMod]) -> list[MaskMod]:
    """``ms`` with a causal mask and a mask that has a spec for (causal & itself) replaced by one mod
    of that spec (the same function, a leaner kernel twin: see ``_ModSpec.and_causal``)."""
    causal = next((i for i, m in enumerate(ms) if m.key == _causal_key()), None)
    other = next((i for i, m in enumerate(ms) if m.spec.and_causal is not None), None)
    if causal is None or other is None:
        return ms
    c, m = ms[causal], ms[other]
    spec = m.spec.and_causal
    assert spec is not None

    def eager(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return c(b, h, q_idx, kv_idx) & m(b, h, q_idx, kv_idx)

    fused = MaskMod.__new__(MaskMod)
    object.__setattr__(fused, "fn", eager)
    object.__setattr__(fused, "buffers", m.buffers)
    object.__setattr__(fused, "key", spec.key)
    object.__setattr__(fused, "name", f"{c.name} & {m.name}")
    return [fused if i == other else x for i, x in enumerate(ms) if i != causal]


def and_masks(*mods: MaskMod | Callable[..., Any]) -> MaskMod:
    """A mask visible where all of ``mods`` are (no mods: everything visible).

    Example:
        >>> import torch, fp8ops
        >>> m = fp8ops.and_masks(fp8ops.causal_mask(), fp8ops.sliding_window_mask(2))
        >>> m(0, 0, torch.tensor(3), torch.arange(4))
        tensor([False, False,  True,  True])
    """
    return _combine("and", mods)


def or_masks(*mods: MaskMod | Callable[..., Any]) -> MaskMod:
    """A mask visible where any of ``mods`` is.

    Example:
        >>> import torch, fp8ops
        >>> m = fp8ops.or_masks(fp8ops.causal_mask(), fp8ops.prefix_lm_mask(2))
        >>> m(0, 0, torch.tensor(0), torch.arange(4))
        tensor([ True,  True, False, False])
    """
    return _combine("or", mods)
