"""Immutable FP8 scaling state: :class:`ScalingState`, the op state groups, probes and merging.

A :class:`ScalingState` belongs to one quantized tensor *role* at one call site (the input of a
linear layer, its weight, its output gradient). It holds tensors only:

- ``amax_history`` (L,) float32, index 0 the newest step;
- ``scale`` () float32, the multiplier: ``q = saturate(x * scale)``, dequantize by ``1 / scale``;
- ``pending_amax`` () float32, the max of the observations made since the last update (0: none);

and four static fields carried in its pytree structure, not as leaves: ``role`` ("forward" or
"backward"), ``calibrated`` (False until an update has observed something; an uncalibrated state
is quantized with current scaling, so the first step never runs with an arbitrary scale),
``fp8_dtype`` (the FP8 dtype the scale was computed for) and ``mode`` (the ``mode`` of the recipe
that built it: "delayed", "current" or "rowwise"). The last two let ops and :func:`update` refuse
a state used with a recipe it was not built for; None means "unknown, not checked".

Op states (:class:`OpState` subclasses) group the roles of one op, e.g. ``FakeQuantState(input,
grad_output)``. Every op state has at most one *probe*: a float32 zero tensor, 0-d for one
gradient role or (n,) for n, whose gradient carries the output-gradient amaxes out of backward.

The once-per-step update of a whole model's states is :mod:`fp8ops.update`; the flat
``dict[str, Tensor]`` round trip is :mod:`fp8ops.state_dict`.
"""

from __future__ import annotations

from typing import Any, ClassVar, TypeVar

import attrs
import torch
from torch import Tensor
from torch.utils import _pytree as pytree

from ._glue import values_readable
from .formats import _ROLES, Role, check_role

__all__ = [
    "OpState",
    "ScalingState",
    "make_probes",
    "merge",
    "merge_batched",
    "validate_state",
]

_T = TypeVar("_T")

_TENSOR_FIELDS = (("amax_history", 1), ("scale", 0), ("pending_amax", 0))
_FIELDS = ("amax_history", "scale", "pending_amax", "role", "calibrated", "fp8_dtype", "mode", "observed")
# The fields ScalingState.replace sets without checks (the tensors and the observed flag).
_TENSOR_CHANGES = frozenset(("amax_history", "scale", "pending_amax", "observed"))


def _describe(t: Any) -> str:
    if isinstance(t, Tensor):
        return f"shape {tuple(t.shape)} {t.dtype} on {t.device}"
    return type(t).__name__


def _check_static(role: Any, calibrated: Any, fp8_dtype: Any, mode: Any, *, where: str) -> None:
    """Check the static fields of a state (Python values only: free under compile)."""
    check_role(role, where=where)
    if not isinstance(calibrated, bool):
        raise TypeError(f"{where}: calibrated must be a bool, got {calibrated!r}")
    if fp8_dtype is not None and not isinstance(fp8_dtype, torch.dtype):
        raise TypeError(f"{where}: fp8_dtype must be a torch.dtype (e.g. torch.float8_e4m3fn) or None, got {fp8_dtype!r}")
    if mode is not None and not isinstance(mode, str):
        raise TypeError(f"{where}: mode must be a recipe mode ('delayed', 'current', 'rowwise') or None, got {mode!r}")


def _check_tensors(h: Any, s: Any, p: Any, *, where: str, prefix: str = "") -> None:
    """Types, dtypes, dims and devices of a state's tensors (metadata only: no host sync)."""
    for (name, ndim), t in zip(_TENSOR_FIELDS, (h, s, p)):
        if not isinstance(t, Tensor) or t.dtype != torch.float32 or t.dim() != ndim:
            raise ValueError(f"{where}: {prefix}{name} must be a {ndim}-d float32 tensor, got {_describe(t)}")
    if h.shape[0] < 1:
        raise ValueError(f"{where}: {prefix}amax_history must have at least one entry, got shape {tuple(h.shape)}")
    if not (h.device == s.device == p.device):
        raise ValueError(
            f"{where}: {prefix}amax_history, scale and pending_amax must be on one device, "
            f"got {h.device}, {s.device} and {p.device}"
        )


def _check_values(h: Tensor, s: Tensor, p: Tensor, *, where: str, prefix: str = "") -> None:
    """Values of a state's tensors: one host read (eager, outside transforms only)."""
    ok = torch.stack(
        [
            torch.isfinite(s) & (s > 0),
            (torch.isfinite(h) & (h >= 0)).all(),
            (p >= 0) | torch.isnan(p),  # NaN and +inf are observations (dropped by the next update)
        ]
    ).tolist()
    if not ok[0]:
        raise ValueError(
            f"{where}: {prefix}scale must be finite and > 0 (the multiplier applied before the FP8 cast), "
            f"got {s.item()!r}"
        )
    if not ok[1]:
        raise ValueError(
            f"{where}: {prefix}amax_history must hold finite amaxes >= 0 (0: no information), got {h.tolist()}"
        )
    if not ok[2]:
        raise ValueError(f"{where}: {prefix}pending_amax must be an amax >= 0 or NaN (0: none observed), got {p.item()!r}")


@attrs.frozen(init=False, eq=False, repr=False)
class ScalingState:
    """Scaling state of one quantized tensor role; immutable, a pytree of three tensors.

    Build it with a recipe (``recipe.init(role=...)``) rather than by hand: the recipe fills in
    ``fp8_dtype`` and ``mode``, which ops check against the recipe they are given. The constructor
    checks its arguments: the static fields and the tensors' dtypes, dims and devices always (no
    host sync), and the values (scale finite and > 0, history finite and >= 0, pending amax >= 0)
    when it runs eagerly on plain tensors. That value check reads the tensors on the host (a sync
    on a GPU); it is skipped under ``torch.compile``, inside ``torch.func`` transforms and on fake
    or meta tensors, so the constructor works there too. ``replace``, ``observe``, the pytree
    unflatten and the updates build states without any check.

    Args:
        amax_history: (L,) float32, index 0 the newest step.
        scale: () float32 multiplier applied before the FP8 cast.
        pending_amax: () float32 max of the observations since the last update (0 means none).
        role: "forward" (activations, weights) or "backward" (gradients). Static.
        calibrated: whether an update has observed something; ops quantize an uncalibrated state
            with current scaling. Static.
        fp8_dtype: the FP8 dtype the scale is computed for (``recipe.dtype(role)``), or None for
            unknown (not checked). Static.
        mode: the ``mode`` of the recipe that built the state ("delayed", "current", "rowwise"),
            or None for unknown (not checked). Static.

    A fifth static field, ``observed``, is set by :meth:`observe` (True), cleared by an update
    (False) and unknown (None) for a hand-made state or one whose ``pending_amax`` was replaced:
    an update reads on the host whether an uncalibrated state saw anything only when it may have
    (see :func:`update`). False promises that nothing is pending (``pending_amax`` is 0).

    Raises:
        TypeError, ValueError: an argument of the wrong type, dtype, shape, device or value.

    Example:
        >>> import torch, fp8ops
        >>> s = fp8ops.DelayedScaling(amax_history_len=4).init(role="forward")
        >>> s.amax_history.shape, s.scale.item(), s.calibrated, s.fp8_dtype, s.mode
        (torch.Size([4]), 1.0, False, torch.float8_e4m3fn, 'delayed')
    """

    amax_history: Tensor
    scale: Tensor
    pending_amax: Tensor
    role: Role
    calibrated: bool
    fp8_dtype: torch.dtype | None
    mode: str | None
    observed: bool | None

    def __init__(
        self,
        amax_history: Tensor,
        scale: Tensor,
        pending_amax: Tensor,
        *,
        role: Role = "forward",
        calibrated: bool = True,
        fp8_dtype: torch.dtype | None = None,
        mode: str | None = None,
    ) -> None:
        _check_static(role, calibrated, fp8_dtype, mode, where="ScalingState")
        _check_tensors(amax_history, scale, pending_amax, where="ScalingState")
        if values_readable(amax_history, scale, pending_amax):
            _check_values(amax_history, scale, pending_amax, where="ScalingState")
        # a hand-made state may hold a pending observation: unknown until an update looks
        _set_fields(self, amax_history, scale, pending_amax, role, calibrated, fp8_dtype, mode, None)

    @classmethod
    def _make(
        cls,
        amax_history: Tensor,
        scale: Tensor,
        pending_amax: Tensor,
        role: Role,
        calibrated: bool,
        fp8_dtype: torch.dtype | None,
        mode: str | None,
        observed: bool | None = False,
    ) -> ScalingState:
        # The library's own constructor: no checks, no host sync (it runs in every op call, on the
        # GPU, under torch.compile and inside torch.func transforms, also on batched tensors).
        self = object.__new__(cls)
        _set_fields(self, amax_history, scale, pending_amax, role, calibrated, fp8_dtype, mode, observed)
        return self

    def replace(self, **changes: Any) -> ScalingState:
        """A copy with some fields replaced (the original is untouched).

        The static fields are checked; the tensors are not (``replace`` also runs on batched and
        traced tensors), so prefer a recipe's ``init`` for a state with new values. A new
        ``pending_amax`` without ``observed`` makes a state that had observed nothing (False) one
        whose observations are unknown (None).
        """
        for k in changes:
            if k not in _TENSOR_CHANGES:  # a static field (checked) or an unknown name
                unknown = [k for k in changes if k not in _FIELDS]
                if unknown:
                    raise TypeError(f"ScalingState.replace: unknown fields {unknown}; the fields are {list(_FIELDS)}")
                _check_static(
                    changes.get("role", self.role),
                    changes.get("calibrated", self.calibrated),
                    changes.get("fp8_dtype", self.fp8_dtype),
                    changes.get("mode", self.mode),
                    where="ScalingState.replace",
                )
                break
        get = changes.get
        observed = self.observed
        if "observed" in changes:
            observed = changes["observed"]
        elif "pending_amax" in changes and observed is False:
            observed = None  # a pending amax given by hand: whether it holds an observation is unknown
        return ScalingState._make(
            get("amax_history", self.amax_history), get("scale", self.scale), get("pending_amax", self.pending_amax),
            get("role", self.role), get("calibrated", self.calibrated), get("fp8_dtype", self.fp8_dtype),
            get("mode", self.mode), observed,
        )

    def observe(self, amax: Tensor) -> ScalingState:
        """A copy with ``amax`` max-merged into ``pending_amax`` (NaN propagates), marked ``observed``."""
        if amax.dtype != torch.float32:
            amax = amax.to(torch.float32)
        return ScalingState._make(self.amax_history, self.scale, torch.maximum(self.pending_amax, amax), self.role,
                                  self.calibrated, self.fp8_dtype, self.mode, True)

    def _observe_amax(self, amax: Tensor) -> ScalingState:
        """:meth:`observe` of an amax that an op computed (float32, >= 0 or NaN).

        A state with ``observed`` False has nothing pending (``pending_amax`` is 0: a fresh or just
        updated state), and ``max(0, amax)`` is ``amax`` itself: the op's amax becomes the pending
        amax as it is, without a kernel launch. Otherwise this is :meth:`observe`.
        """
        if self.observed is not False or amax.dtype != torch.float32:
            return self.observe(amax)
        return ScalingState._make(self.amax_history, self.scale, amax, self.role, self.calibrated, self.fp8_dtype,
                                  self.mode, True)

    def __repr__(self) -> str:
        return (
            f"ScalingState(role={self.role!r}, calibrated={self.calibrated}, fp8_dtype={self.fp8_dtype}, "
            f"mode={self.mode!r}, amax_history={self.amax_history!r}, scale={self.scale!r}, "
            f"pending_amax={self.pending_amax!r})"
        )


def _set_fields(self: ScalingState, amax_history: Tensor, scale: Tensor, pending_amax: Tensor, role: str,
                calibrated: bool, fp8_dtype: torch.dtype | None, mode: str | None, observed: bool | None) -> None:
    # One statement per field: a loop over _FIELDS costs twice as much, and this runs for every
    # state an op returns.
    setattr_ = object.__setattr__
    setattr_(self, "amax_history", amax_history)
    setattr_(self, "scale", scale)
    setattr_(self, "pending_amax", pending_amax)
    setattr_(self, "role", role)
    setattr_(self, "calibrated", calibrated)
    setattr_(self, "fp8_dtype", fp8_dtype)
    setattr_(self, "mode", mode)
    setattr_(self, "observed", observed)


_Context = tuple[str, bool, "torch.dtype | None", "str | None", "bool | None"]


def _ss_flatten(s: ScalingState) -> tuple[list[Tensor], _Context]:
    return [s.amax_history, s.scale, s.pending_amax], (s.role, s.calibrated, s.fp8_dtype, s.mode, s.observed)


def _ss_unflatten(children: Any, context: _Context) -> ScalingState:
    h, sc, p = children
    return ScalingState._make(h, sc, p, *context)  # type: ignore[arg-type]


def _ss_flatten_with_keys(s: ScalingState) -> tuple[list[tuple[Any, Tensor]], _Context]:
    children, ctx = _ss_flatten(s)
    keys = [pytree.GetAttrKey(n) for n in ("amax_history", "scale", "pending_amax")]
    return list(zip(keys, children)), ctx


def _ss_to_dumpable(context: _Context) -> Any:
    role, calibrated, dt, mode, observed = context
    return [role, calibrated, None if dt is None else str(dt).removeprefix("torch."), mode, observed]


def _ss_from_dumpable(dumped: Any) -> _Context:
    role, calibrated, dt, mode, observed = dumped
    return (role, calibrated, None if dt is None else getattr(torch, dt), mode, observed)


pytree.register_pytree_node(
    ScalingState,
    _ss_flatten,
    _ss_unflatten,
    serialized_type_name="fp8ops.ScalingState",
    to_dumpable_context=_ss_to_dumpable,
    from_dumpable_context=_ss_from_dumpable,
    flatten_with_keys_fn=_ss_flatten_with_keys,
)


def _check_built_for(state: ScalingState, recipe: Any, *, where: str) -> None:
    """Refuse a state built for another FP8 dtype or another kind of recipe than ``recipe``."""
    want_mode = getattr(recipe, "mode", None)
    if state.mode is not None and want_mode is not None and state.mode != want_mode:
        raise ValueError(
            f"{where}: state was built for a {state.mode!r} recipe but recipe is {type(recipe).__name__} "
            f"(mode {want_mode!r}); build the state with this recipe's init(), or use the recipe it was built for"
        )
    if state.fp8_dtype is not None and hasattr(recipe, "dtype"):
        want = recipe.dtype(state.role)
        if state.fp8_dtype != want:
            raise ValueError(
                f"{where}: state scales {state.role} tensors for {state.fp8_dtype} but recipe "
                f"{type(recipe).__name__}(fp8_format={getattr(recipe, 'fp8_format', None)}) quantizes them to "
                f"{want}; build the state with this recipe's init(), or use the recipe it was built for"
            )


class OpState:
    """Base of the per-op state groups: one :class:`ScalingState` per quantized tensor role.

    Subclasses declare ``ROLES`` (field name -> role, in order) and ``PROBE_ROLES`` (the fields
    whose observations arrive through the op's probe, in probe-slot order). Instances are
    immutable pytrees of their fields.
    """

    ROLES: ClassVar[dict[str, Role]] = {}
    PROBE_ROLES: ClassVar[tuple[str, ...]] = ()

    def __init__(self, **fields: ScalingState) -> None:
        missing = [n for n in self.ROLES if n not in fields]
        extra = [n for n in fields if n not in self.ROLES]
        if missing or extra:
            raise TypeError(
                f"{type(self).__name__}: expected fields {list(self.ROLES)}, "
                f"missing {missing}, unexpected {extra}"
            )
        for name in self.ROLES:
            object.__setattr__(self, name, fields[name])

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        names = tuple(cls.ROLES)

        def flatten(s: OpState) -> tuple[list[Any], None]:
            return [getattr(s, n) for n in names], None

        def unflatten(children: Any, context: None) -> OpState:
            return cls(**dict(zip(names, children)))

        def flatten_with_keys(s: OpState) -> tuple[list[tuple[Any, Any]], None]:
            return [(pytree.GetAttrKey(n), getattr(s, n)) for n in names], None

        pytree.register_pytree_node(
            cls,
            flatten,
            unflatten,
            serialized_type_name=f"{cls.__module__}.{cls.__qualname__}",
            flatten_with_keys_fn=flatten_with_keys,
        )

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"{type(self).__name__} is immutable; use .replace({name}=...)")

    def replace(self: _T, **changes: ScalingState) -> _T:
        """A copy with some roles replaced."""
        cls = type(self)
        roles = cls.ROLES  # type: ignore[attr-defined]
        for name in changes:
            if name not in roles:  # the constructor names the unexpected field
                return cls(**{**{n: getattr(self, n) for n in roles}, **changes})
        new = object.__new__(cls)
        for name in roles:
            object.__setattr__(new, name, changes[name] if name in changes else getattr(self, name))
        return new

    @classmethod
    def init(cls: type[_T], recipe: Any, *, device: torch.device | str | None = None) -> _T:
        """A fresh state: ``recipe.init`` for each role."""
        return cls(**{n: recipe.init(role=r, device=device) for n, r in cls.ROLES.items()})  # type: ignore[attr-defined]

    def __repr__(self) -> str:
        inner = ", ".join(f"{n}={getattr(self, n)!r}" for n in type(self).ROLES)
        return f"{type(self).__name__}({inner})"


def _is_node(x: Any) -> bool:
    return isinstance(x, (ScalingState, OpState))


def _is_state_or_tensor(x: Any) -> bool:
    return isinstance(x, (ScalingState, Tensor))


# ------------------------------------------------------------------------------------------------
# Probes


def make_probes(states: Any, *, requires_grad: bool = True) -> Any:
    """Fresh probes for every op state in ``states``: a pytree of the same shape.

    Each :class:`OpState` with gradient roles gets a float32 zero (0-d for one role, (n,) for n)
    on its device; a bare :class:`ScalingState` gets ``None``. Make new probes for every forward
    pass in plain autograd: a probe's ``.grad`` accumulates by *sum* across ``backward()`` calls.

    Args:
        states: any pytree of :class:`OpState` / :class:`ScalingState` nodes.
        requires_grad: make leaf tensors that require grad (plain autograd); False for torch.func.

    Returns:
        The probes pytree: pass each op its probe, and give the probe gradients to :func:`update`.
    """
    nodes, spec = pytree.tree_flatten(states, is_leaf=_is_node)
    probes = []
    for node in nodes:
        if isinstance(node, OpState) and node.PROBE_ROLES:
            first = getattr(node, node.PROBE_ROLES[0])
            shape = () if len(node.PROBE_ROLES) == 1 else (len(node.PROBE_ROLES),)
            probes.append(torch.zeros(shape, device=first.scale.device, requires_grad=requires_grad))
        elif isinstance(node, (OpState, ScalingState)):
            probes.append(None)
        else:
            raise TypeError(f"make_probes: expected a pytree of OpState/ScalingState, found a {type(node).__name__} leaf")
    return pytree.tree_unflatten(probes, spec)


# ------------------------------------------------------------------------------------------------
# Merging observations


def merge(*trees: _T) -> _T:
    """Max-merge observations from several pytrees of the same structure.

    For each :class:`ScalingState` the ``pending_amax`` values are max-merged (the other fields
    come from the first tree); tensors (for example probe gradients) are max-merged elementwise;
    ``None`` stays ``None``. NaN propagates. This is the accumulation rule across micro-batches,
    call sites and ``vmap`` batches: observations merge by max, never by sum.

    Raises:
        ValueError: the trees differ in structure, in a state's static fields (``role``,
            ``calibrated``, ``fp8_dtype``, ``mode``), or in the shape or dtype of a tensor at the
            same place (merging never broadcasts; a ``vmap`` batch dimension goes through
            :func:`merge_batched`).
    """
    if not trees:
        raise TypeError("merge: expected at least one pytree")
    flat = [pytree.tree_flatten(t, is_leaf=_is_state_or_tensor) for t in trees]
    spec0 = flat[0][1]
    for i, (_, spec) in enumerate(flat[1:], start=1):
        if spec != spec0:
            raise ValueError(f"merge: tree {i} has a different structure from tree 0:\n{spec}\nvs\n{spec0}")
    out = []
    for n, leaves in enumerate(zip(*(f[0] for f in flat))):
        first = leaves[0]
        for i, other in enumerate(leaves[1:], start=1):
            _check_mergeable(first, other, i, lambda: _leaf_name(trees[0], n))
        if isinstance(first, ScalingState):
            pending = first.pending_amax
            for s in leaves[1:]:
                pending = torch.maximum(pending, s.pending_amax)
            out.append(first.replace(pending_amax=pending, observed=_merged_observed(leaves)))
        elif isinstance(first, Tensor):
            acc = first
            for t in leaves[1:]:
                acc = torch.maximum(acc, t)
            out.append(acc)
        else:
            out.append(first)
    return pytree.tree_unflatten(out, spec0)


def _leaf_name(tree: Any, n: int) -> str:
    """The path of leaf ``n`` of ``tree`` (for messages), e.g. ``['blocks'][0].input``."""
    try:
        path = pytree.tree_flatten_with_path(tree, is_leaf=_is_state_or_tensor)[0][n][0]
    except Exception:  # a user's pytree node without key support
        return f"leaf {n}"
    return pytree.keystr(path) or "<root>"


def _check_mergeable(first: Any, other: Any, i: int, name: Any) -> None:
    """Tree ``i``'s leaf must match tree 0's: kind, static fields, shapes, dtypes (metadata only).
    ``name()`` gives the leaf's path, computed only for a message."""
    if (isinstance(first, ScalingState), isinstance(first, Tensor)) != (
        isinstance(other, ScalingState), isinstance(other, Tensor)
    ):
        raise ValueError(f"merge: tree {i} holds a {type(other).__name__} at {name()} but tree 0 a {type(first).__name__}")
    if isinstance(first, ScalingState):
        static0 = (first.role, first.calibrated, first.fp8_dtype, first.mode)
        static = (other.role, other.calibrated, other.fp8_dtype, other.mode)
        if static != static0:
            raise ValueError(
                f"merge: the state at {name()} of tree {i} has (role, calibrated, fp8_dtype, mode) = {static} "
                f"but tree 0's has {static0}; only states of one role from the same step merge"
            )
        pairs = [(f".{n}", getattr(first, n), getattr(other, n)) for n, _ in _TENSOR_FIELDS]
    elif isinstance(first, Tensor):
        pairs = [("", first, other)]
    else:
        return  # another leaf (a Python value): the first tree's is kept
    for suffix, a, b in pairs:
        if a.shape != b.shape or a.dtype != b.dtype:
            raise ValueError(
                f"merge: tree {i} has shape {tuple(b.shape)} {b.dtype} at {name()}{suffix} but tree 0 has "
                f"{tuple(a.shape)} {a.dtype}; merge takes the max of equal shapes and never broadcasts "
                f"(a vmap batch dimension goes through merge_batched)"
            )


def _merged_observed(states: Any) -> bool | None:
    """True if any state observed something, None (unknown) if any is unknown, else False."""
    flags = [s.observed for s in states]
    return True if True in flags else (None if None in flags else False)


def merge_batched(tree: _T, *, dim: int = 0) -> _T:
    """Reduce a batch dimension added by ``torch.func.vmap`` over micro-batches.

    Each :class:`ScalingState` keeps the max of ``pending_amax`` over ``dim`` and the first entry of
    ``amax_history`` and ``scale`` (which are the same across the batch when the state was not
    batched); tensors (probe gradients) are reduced with a max over ``dim``.
    """

    def reduce(x: Any) -> Any:
        if isinstance(x, ScalingState):
            return x.replace(
                amax_history=x.amax_history.select(dim, 0) if x.amax_history.dim() == 2 else x.amax_history,
                scale=x.scale.select(dim, 0) if x.scale.dim() == 1 else x.scale,
                pending_amax=x.pending_amax.amax(dim) if x.pending_amax.dim() == 1 else x.pending_amax,
                observed=x.observed,
            )
        if isinstance(x, Tensor):
            return x.amax(dim)
        return x

    return pytree.tree_map(reduce, tree, is_leaf=_is_state_or_tensor)


def _state_ok(state: Any, device: torch.device, recipe: Any) -> bool:
    """Whether ``state`` passes :func:`validate_state` for ``device`` and ``recipe``: the check of
    every op call, in one expression (metadata only). False where validate_state may still accept
    it (a recipe whose ``mode`` is None): call validate_state then, for the verdict and the
    message."""
    if not isinstance(state, ScalingState):
        return False
    h, s, p = state.amax_history, state.scale, state.pending_amax
    f32 = torch.float32
    return (state.role in _ROLES and isinstance(h, Tensor) and isinstance(s, Tensor) and isinstance(p, Tensor)
            and h.dtype == f32 and s.dtype == f32 and p.dtype == f32 and h.dim() == 1 and s.dim() == 0
            and p.dim() == 0 and h.device == device and s.device == device and p.device == device
            and (state.mode is None or state.mode == recipe.mode)
            and (state.fp8_dtype is None or state.fp8_dtype == recipe.dtype(state.role)))


def validate_state(state: Any, *, where: str, device: torch.device | None = None, recipe: Any = None) -> ScalingState:
    """Check a ScalingState at an op boundary; return it.

    Metadata only (no host sync): the type, the role, the tensors' dtypes, dims and devices, and,
    with ``recipe``, that the state was built for that recipe's FP8 dtype (for its role) and mode.
    """
    if not isinstance(state, ScalingState):
        raise TypeError(f"{where}: state must be a ScalingState, got {type(state).__name__}")
    if device is not None and recipe is not None and _state_ok(state, device, recipe):
        return state
    check_role(state.role, where=where)
    for name, ndim in _TENSOR_FIELDS:
        t = getattr(state, name)
        if not isinstance(t, Tensor) or t.dtype != torch.float32 or t.dim() != ndim:
            got = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(f"{where}: state.{name} must be a {ndim}-d float32 tensor, got {got}")
        if device is not None and t.device != device:
            raise ValueError(f"{where}: state.{name} is on {t.device} but the input is on {device}")
    if recipe is not None:
        _check_built_for(state, recipe, where=where)
    return state
