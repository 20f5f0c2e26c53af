"""Immutable FP8 scaling state, and the tree-level operations on a whole model's states.

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
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, TypeVar

import attrs
import torch
from torch import Tensor
from torch.utils import _pytree as pytree

from .formats import Role, check_role

__all__ = [
    "SCHEMA_VERSION",
    "OpState",
    "ScalingState",
    "load_state_dict",
    "make_probes",
    "merge",
    "merge_batched",
    "state_dict",
    "update",
]

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

_TENSOR_FIELDS = (("amax_history", 1), ("scale", 0), ("pending_amax", 0))
_FIELDS = ("amax_history", "scale", "pending_amax", "role", "calibrated", "fp8_dtype", "mode", "observed")


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


def _values_readable(*ts: Tensor) -> bool:
    """Whether reading the tensors' values on the host is possible and cheap to justify: eager,
    no torch.func transform, no dispatch mode (fake / proxy tracing), plain real tensors."""
    if torch.compiler.is_compiling() or torch.jit.is_tracing():
        return False
    if torch._C._functorch.maybe_current_level() is not None:
        return False
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    if _get_current_dispatch_mode() is not None:
        return False
    for t in ts:
        if type(t) not in (Tensor, torch.nn.Parameter) or t.device.type == "meta":
            return False
        if torch._C._functorch.is_functorch_wrapped_tensor(t):
            return False
    return True


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
    (False) and unknown (None) for a hand-made or loaded state: an update reads on the host
    whether an uncalibrated state saw anything only when it may have (see :func:`update`).

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
        if _values_readable(amax_history, scale, pending_amax):
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
        traced tensors), so prefer a recipe's ``init`` for a state with new values.
        """
        unknown = [k for k in changes if k not in _FIELDS]
        if unknown:
            raise TypeError(f"ScalingState.replace: unknown fields {unknown}; the fields are {list(_FIELDS)}")
        if any(k in changes for k in ("role", "calibrated", "fp8_dtype", "mode")):
            _check_static(
                changes.get("role", self.role),
                changes.get("calibrated", self.calibrated),
                changes.get("fp8_dtype", self.fp8_dtype),
                changes.get("mode", self.mode),
                where="ScalingState.replace",
            )
        return ScalingState._make(*(changes[n] if n in changes else getattr(self, n) for n in _FIELDS))

    def observe(self, amax: Tensor) -> ScalingState:
        """A copy with ``amax`` max-merged into ``pending_amax`` (NaN propagates), marked ``observed``."""
        return self.replace(pending_amax=torch.maximum(self.pending_amax, amax.to(torch.float32)), observed=True)

    def __repr__(self) -> str:
        return (
            f"ScalingState(role={self.role!r}, calibrated={self.calibrated}, fp8_dtype={self.fp8_dtype}, "
            f"mode={self.mode!r}, amax_history={self.amax_history!r}, scale={self.scale!r}, "
            f"pending_amax={self.pending_amax!r})"
        )


def _set_fields(self: ScalingState, *values: Any) -> None:
    for name, v in zip(_FIELDS, values):
        object.__setattr__(self, name, v)


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
        fields = {n: getattr(self, n) for n in type(self).ROLES}  # type: ignore[attr-defined]
        fields.update(changes)
        return type(self)(**fields)

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
            )
        if isinstance(x, Tensor):
            return x.amax(dim)
        return x

    return pytree.tree_map(reduce, tree, is_leaf=_is_state_or_tensor)


# ------------------------------------------------------------------------------------------------
# The tree-level update


def _grad_amax_leaf(g: Any, *, where: str) -> Tensor | None:
    """One leaf of ``grad_amax``: None, an amax tensor, or a probe (a leaf that requires grad),
    which stands for its ``.grad``."""
    if g is None:
        return None
    if not isinstance(g, Tensor):
        raise TypeError(
            f"{where} must be a Tensor (a probe gradient, or the probe itself) or None, got {type(g).__name__}"
        )
    if g.is_leaf and g.requires_grad:
        # A probe itself (plain autograd): its gradient is the observation. An amax computed by
        # torch.func, or read from .grad, does not require grad.
        if g.grad is None:
            raise ValueError(f"{where} is a probe that has no gradient: run backward first, or pass None")
        return g.grad
    return g


def _pairs(
    states: Any, grad_amax: Any, where: str
) -> tuple[list[Any], Any, list[list[tuple[ScalingState, Tensor | None, str]]]]:
    """Flatten states to op/scaling nodes and pair each ScalingState with its gradient amax and
    its path (for messages)."""
    entries, spec = pytree.tree_flatten_with_path(states, is_leaf=_is_node)
    nodes = [n for _, n in entries]
    if grad_amax is None:
        grads: list[Any] = [None] * len(nodes)
    else:
        gentries, gspec = pytree.tree_flatten_with_path(grad_amax, is_leaf=lambda x: x is None or isinstance(x, Tensor))
        grads = [_grad_amax_leaf(g, where=f"{where}: grad_amax{pytree.keystr(p)}") for p, g in gentries]
        if gspec != spec:
            raise ValueError(
                f"{where}: grad_amax must have the structure of the states' probes (see make_probes), "
                f"got\n{gspec}\nfor states\n{spec}"
            )
    pairs: list[list[tuple[ScalingState, Tensor | None, str]]] = []
    for (path, node), g in zip(entries, grads):
        key = f"states{pytree.keystr(path)}"
        if isinstance(node, ScalingState):
            pairs.append([(node, g, key)])
        elif isinstance(node, OpState):
            probe_roles = type(node).PROBE_ROLES
            if g is not None:
                want = () if len(probe_roles) == 1 else (len(probe_roles),)
                if not probe_roles or tuple(g.shape) != want:
                    raise ValueError(
                        f"{where}: the gradient amax of a {type(node).__name__} must have shape {want}, "
                        f"got {tuple(g.shape)}"
                    )
            row = []
            for name in type(node).ROLES:
                sg = None
                if g is not None and name in probe_roles:
                    sg = g if g.dim() == 0 else g[probe_roles.index(name)]
                row.append((getattr(node, name), sg, f"{key}.{name}"))
            pairs.append(row)
        else:
            raise TypeError(f"{where}: expected a pytree of OpState/ScalingState, found a {type(node).__name__} leaf")
    return nodes, spec, pairs


def _check_recipe(recipe: Any, *, where: str) -> None:
    from .recipes import Recipe  # recipes imports this module

    if not isinstance(recipe, Recipe):
        got = "None" if recipe is None else f"{type(recipe).__name__} {recipe!r}"[:200]
        raise TypeError(
            f"{where}: recipe must be a fp8ops recipe (fp8ops.DelayedScaling, fp8ops.CurrentScaling or a "
            f"fp8ops.Recipe subclass): the one the states were built with, got {got}"
        )


def update(
    states: _T,
    *,
    recipe: Any,
    grad_amax: Any = None,
    group: Any = None,
) -> _T:
    """Update every scaling state of a model once per optimizer step.

    For each :class:`ScalingState`: the observation is ``max(pending_amax, gradient amax)``; a
    non-finite observation is dropped (it never enters the history); the history rolls by one step;
    the scale is recomputed by ``recipe`` (amax 0 or non-finite keeps the old scale); the pending
    amax is cleared and the state becomes calibrated. With ``group``, the observations of all
    states are max-reduced across the process group first, in one ``all_reduce(MAX)``.

    An update that observed nothing does not calibrate: an *uncalibrated* state whose observation
    is 0 or non-finite keeps its scale and history (no 0 entry is rolled in), only its pending amax
    is cleared, and it stays uncalibrated (so the next step still quantizes it with current
    scaling). Whether a state was observed at all is static (``ScalingState.observed``: an op's
    ``observe``, or a gradient amax given here), so a role that no op observed (a gradient role
    whose call had no probe, ``fc1_output`` without recompute) stays uncalibrated without any
    host read. For an uncalibrated state that *was* observed, whether the value is finite and
    positive is read on the host: one batched read per call, in the first steps only (the state is
    calibrated afterwards). A call with calibrated or unobserved states only never syncs and traces
    with ``torch.compile(fullgraph=True)``, whereas the read is a graph break.

    Args:
        states: a pytree of :class:`OpState` / :class:`ScalingState` nodes.
        recipe: the recipe the states were built with.
        grad_amax: None, or the probe gradients, a pytree shaped like ``make_probes(states)``. A
            leaf may also be the probe itself (a leaf tensor that requires grad, after backward):
            its ``.grad`` is used.
        group: a ``torch.distributed`` process group, or None for no reduction.

    Returns:
        The updated states, same structure; the input is not modified.

    Raises:
        TypeError: ``recipe`` is not a fp8ops recipe; a ``grad_amax`` leaf is not a Tensor or None.
        ValueError: ``grad_amax`` does not match the probes' structure or shapes; a probe in it has
            no gradient; a state was built by another recipe (FP8 dtype, mode or history length).

    Example:
        >>> import torch, fp8ops
        >>> r = fp8ops.DelayedScaling(amax_history_len=2)
        >>> st = {"a": r.init(role="forward")}
        >>> st = {"a": st["a"].observe(torch.tensor(7.0))}
        >>> fp8ops.update(st, recipe=r)["a"].scale
        tensor(64.)
    """
    _check_recipe(recipe, where="update")
    nodes, spec, pairs = _pairs(states, grad_amax, "update")
    flat = [p for row in pairs for p in row]
    if not flat:
        return states
    obs = []
    to_update = []
    for s, g, key in flat:
        _check_built_for(s, recipe, where=f"update: {key}")
        o = s.pending_amax if g is None else torch.maximum(s.pending_amax, g.detach().to(torch.float32))
        obs.append(o.reshape(()))
        to_update.append(s if g is None else s.replace(observed=True))
    obs_t = torch.stack(obs)
    if group is not None:
        import torch.distributed as dist

        # NaN is not reliably propagated by a MAX reduction; inf is, and is dropped the same way.
        obs_t = torch.where(torch.isnan(obs_t), torch.full_like(obs_t, float("inf")), obs_t)
        dist.all_reduce(obs_t, op=dist.ReduceOp.MAX, group=group)
    new_flat = recipe.update_many(to_update, obs_t)
    it = iter(new_flat)
    new_nodes = []
    for node, row in zip(nodes, pairs):
        if isinstance(node, ScalingState):
            new_nodes.append(next(it))
        else:
            new_nodes.append(node.replace(**{name: next(it) for name in type(node).ROLES}))
    return pytree.tree_unflatten(new_nodes, spec)


# ------------------------------------------------------------------------------------------------
# Flat dict round-trip


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


def validate_state(state: Any, *, where: str, device: torch.device | None = None, recipe: Any = None) -> ScalingState:
    """Check a ScalingState at an op boundary; return it.

    Metadata only (no host sync): the type, the role, the tensors' dtypes, dims and devices, and,
    with ``recipe``, that the state was built for that recipe's FP8 dtype (for its role) and mode.
    """
    if not isinstance(state, ScalingState):
        raise TypeError(f"{where}: state must be a ScalingState, got {type(state).__name__}")
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
