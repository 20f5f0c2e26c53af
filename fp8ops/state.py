"""Immutable FP8 scaling state, and the tree-level operations on a whole model's states.

A :class:`ScalingState` belongs to one quantized tensor *role* at one call site (the input of a
linear layer, its weight, its output gradient). It holds tensors only:

- ``amax_history`` (L,) float32, index 0 the newest step;
- ``scale`` () float32, the multiplier: ``q = saturate(x * scale)``, dequantize by ``1 / scale``;
- ``pending_amax`` () float32, the max of the observations made since the last update (0: none);

and two static fields carried in its pytree structure, not as leaves: ``role`` ("forward" or
"backward") and ``calibrated`` (False until the first update; an uncalibrated state is quantized
with current scaling, so the first step never runs with an arbitrary scale).

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

SCHEMA_VERSION = 2
"""Version of the flat ``dict[str, Tensor]`` layout written by :func:`state_dict`.

Version 2 added the ``fc1_output`` role of :class:`fp8ops.LayerNormMLPState`; a version-1 dict
still loads, those states keeping the values of ``like``."""

# Roles added in a schema version: a dict of an older version loads without them.
_ADDED_ROLES = {2: ("fc1_output",)}

_T = TypeVar("_T")


@attrs.frozen(init=False, eq=False, repr=False)
class ScalingState:
    """Scaling state of one quantized tensor role; immutable, a pytree of three tensors.

    Build it with a recipe (``recipe.init(role=...)``) rather than by hand. The constructor does
    no validation (it also runs inside ``torch.compile`` and ``torch.func`` transforms); the ops
    validate the state they are given.

    Args:
        amax_history: (L,) float32, index 0 the newest step.
        scale: () float32 multiplier applied before the FP8 cast.
        pending_amax: () float32 max of the observations since the last update (0 means none).
        role: "forward" (activations, weights) or "backward" (gradients). Static.
        calibrated: whether an update has run; ops quantize an uncalibrated state with current
            scaling. Static.

    Example:
        >>> import torch, fp8ops
        >>> s = fp8ops.DelayedScaling(amax_history_len=4).init(role="forward")
        >>> s.amax_history.shape, s.scale.item(), s.calibrated
        (torch.Size([4]), 1.0, False)
    """

    amax_history: Tensor
    scale: Tensor
    pending_amax: Tensor
    role: Role
    calibrated: bool

    def __init__(
        self,
        amax_history: Tensor,
        scale: Tensor,
        pending_amax: Tensor,
        *,
        role: Role = "forward",
        calibrated: bool = True,
    ) -> None:
        object.__setattr__(self, "amax_history", amax_history)
        object.__setattr__(self, "scale", scale)
        object.__setattr__(self, "pending_amax", pending_amax)
        object.__setattr__(self, "role", role)
        object.__setattr__(self, "calibrated", calibrated)

    def replace(self, **changes: Any) -> ScalingState:
        """A copy with some fields replaced (the original is untouched)."""
        fields = {
            "amax_history": self.amax_history,
            "scale": self.scale,
            "pending_amax": self.pending_amax,
            "role": self.role,
            "calibrated": self.calibrated,
        }
        fields.update(changes)
        return ScalingState(
            fields["amax_history"],
            fields["scale"],
            fields["pending_amax"],
            role=fields["role"],
            calibrated=fields["calibrated"],
        )

    def observe(self, amax: Tensor) -> ScalingState:
        """A copy with ``amax`` max-merged into ``pending_amax`` (NaN propagates)."""
        return self.replace(pending_amax=torch.maximum(self.pending_amax, amax.to(torch.float32)))

    def __repr__(self) -> str:
        return (
            f"ScalingState(role={self.role!r}, calibrated={self.calibrated}, "
            f"amax_history={self.amax_history!r}, scale={self.scale!r}, pending_amax={self.pending_amax!r})"
        )


def _ss_flatten(s: ScalingState) -> tuple[list[Tensor], tuple[str, bool]]:
    return [s.amax_history, s.scale, s.pending_amax], (s.role, s.calibrated)


def _ss_unflatten(children: Any, context: tuple[str, bool]) -> ScalingState:
    h, sc, p = children
    return ScalingState(h, sc, p, role=context[0], calibrated=context[1])  # type: ignore[arg-type]


def _ss_flatten_with_keys(s: ScalingState) -> tuple[list[tuple[Any, Tensor]], tuple[str, bool]]:
    children, ctx = _ss_flatten(s)
    keys = [pytree.GetAttrKey(n) for n in ("amax_history", "scale", "pending_amax")]
    return list(zip(keys, children)), ctx


pytree.register_pytree_node(
    ScalingState,
    _ss_flatten,
    _ss_unflatten,
    serialized_type_name="fp8ops.ScalingState",
    flatten_with_keys_fn=_ss_flatten_with_keys,
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
        ValueError: the trees differ in structure or in a state's static fields.
    """
    if not trees:
        raise TypeError("merge: expected at least one pytree")
    flat = [pytree.tree_flatten(t, is_leaf=_is_state_or_tensor) for t in trees]
    spec0 = flat[0][1]
    for i, (_, spec) in enumerate(flat[1:], start=1):
        if spec != spec0:
            raise ValueError(f"merge: tree {i} has a different structure from tree 0:\n{spec}\nvs\n{spec0}")
    out = []
    for leaves in zip(*(f[0] for f in flat)):
        first = leaves[0]
        if isinstance(first, ScalingState):
            pending = first.pending_amax
            for s in leaves[1:]:
                if (s.role, s.calibrated) != (first.role, first.calibrated):
                    raise ValueError("merge: states of one role must share role and calibrated (same step)")
                pending = torch.maximum(pending, s.pending_amax)
            out.append(first.replace(pending_amax=pending))
        elif isinstance(first, Tensor):
            acc = first
            for t in leaves[1:]:
                acc = torch.maximum(acc, t)
            out.append(acc)
        else:
            out.append(first)
    return pytree.tree_unflatten(out, spec0)


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


def _pairs(states: Any, grad_amax: Any, where: str) -> tuple[list[Any], Any, list[list[tuple[ScalingState, Tensor | None]]]]:
    """Flatten states to op/scaling nodes and pair each ScalingState with its gradient amax."""
    nodes, spec = pytree.tree_flatten(states, is_leaf=_is_node)
    if grad_amax is None:
        grads: list[Any] = [None] * len(nodes)
    else:
        grads, gspec = pytree.tree_flatten(grad_amax, is_leaf=lambda x: x is None or isinstance(x, Tensor))
        if gspec != spec:
            raise ValueError(
                f"{where}: grad_amax must have the structure of the states' probes (see make_probes), "
                f"got\n{gspec}\nfor states\n{spec}"
            )
    pairs: list[list[tuple[ScalingState, Tensor | None]]] = []
    for node, g in zip(nodes, grads):
        if isinstance(node, ScalingState):
            pairs.append([(node, g)])
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
                row.append((getattr(node, name), sg))
            pairs.append(row)
        else:
            raise TypeError(f"{where}: expected a pytree of OpState/ScalingState, found a {type(node).__name__} leaf")
    return nodes, spec, pairs


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

    Args:
        states: a pytree of :class:`OpState` / :class:`ScalingState` nodes.
        recipe: the recipe the states were built with.
        grad_amax: None, or the probe gradients, a pytree shaped like ``make_probes(states)``.
        group: a ``torch.distributed`` process group, or None for no reduction.

    Returns:
        The updated states, same structure; the input is not modified.

    Example:
        >>> import torch, fp8ops
        >>> r = fp8ops.DelayedScaling(amax_history_len=2)
        >>> st = {"a": r.init(role="forward")}
        >>> st = {"a": st["a"].observe(torch.tensor(7.0))}
        >>> fp8ops.update(st, recipe=r)["a"].scale
        tensor(64.)
    """
    nodes, spec, pairs = _pairs(states, grad_amax, "update")
    flat = [p for row in pairs for p in row]
    if not flat:
        return states
    obs = []
    for s, g in flat:
        o = s.pending_amax if g is None else torch.maximum(s.pending_amax, g.detach().to(torch.float32))
        obs.append(o.reshape(()))
    obs_t = torch.stack(obs)
    if group is not None:
        import torch.distributed as dist

        # NaN is not reliably propagated by a MAX reduction; inf is, and is dropped the same way.
        obs_t = torch.where(torch.isnan(obs_t), torch.full_like(obs_t, float("inf")), obs_t)
        dist.all_reduce(obs_t, op=dist.ReduceOp.MAX, group=group)
    new_flat = recipe.update_many([s for s, _ in flat], obs_t)
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


def state_dict(states: Any) -> dict[str, Tensor]:
    """Flatten a pytree of states to ``dict[str, Tensor]`` (safetensors / DCP friendly).

    Keys are dotted paths (``"blocks.0.fc1.input.amax_history"``); each state adds
    ``amax_history``, ``scale``, ``pending_amax``, ``role`` (int8: 0 forward, 1 backward) and
    ``calibrated`` (bool); the entry ``"fp8ops.schema_version"`` records :data:`SCHEMA_VERSION`.
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
        out[f"{k}.role"] = torch.tensor(0 if s.role == "forward" else 1, dtype=torch.int8)
        out[f"{k}.calibrated"] = torch.tensor(bool(s.calibrated))
    return out


def load_state_dict(like: _T, flat: Mapping[str, Tensor]) -> _T:
    """Rebuild states shaped like ``like`` from a dict written by :func:`state_dict`.

    A dict of an older schema version loads too: states of roles added since (see
    :data:`SCHEMA_VERSION`) keep the values of ``like``.

    Raises:
        ValueError: the schema version is missing or unknown, a key is missing, or a tensor's
            shape or dtype differs from ``like``'s.
    """
    if _VERSION_KEY not in flat:
        raise ValueError(f"load_state_dict: no {_VERSION_KEY!r} entry; this dict was not written by fp8ops.state_dict")
    version = int(flat[_VERSION_KEY])
    if not 1 <= version <= SCHEMA_VERSION:
        raise ValueError(
            f"load_state_dict: schema version {version} is not supported (this fp8ops reads 1 to {SCHEMA_VERSION})"
        )
    added = {r for v, roles in _ADDED_ROLES.items() if v > version for r in roles}
    leaves, spec = pytree.tree_flatten_with_path(like, is_leaf=lambda x: isinstance(x, ScalingState))
    out = []
    for path, s in leaves:
        k = _key(path)
        if k.rsplit(".", 1)[-1] in added and not any(key.startswith(f"{k}.") for key in flat):
            out.append(s)  # a role this dict's version did not have
            continue
        fields = {}
        for name in ("amax_history", "scale", "pending_amax", "role", "calibrated"):
            if f"{k}.{name}" not in flat:
                raise ValueError(f"load_state_dict: missing key {k}.{name!s}")
            fields[name] = flat[f"{k}.{name}"]
        for name in ("amax_history", "scale", "pending_amax"):
            t, ref = fields[name], getattr(s, name)
            if t.shape != ref.shape or t.dtype != ref.dtype:
                raise ValueError(
                    f"load_state_dict: {k}.{name} has shape {tuple(t.shape)} {t.dtype}, "
                    f"expected {tuple(ref.shape)} {ref.dtype}"
                )
        role = "forward" if int(fields["role"]) == 0 else "backward"
        out.append(
            ScalingState(
                fields["amax_history"].to(s.amax_history.device),
                fields["scale"].to(s.scale.device),
                fields["pending_amax"].to(s.pending_amax.device),
                role=role,
                calibrated=bool(fields["calibrated"]),
            )
        )
    return pytree.tree_unflatten(out, spec)


def validate_state(state: Any, *, where: str, device: torch.device | None = None, recipe: Any = None) -> ScalingState:
    """Check a ScalingState at an op boundary; return it."""
    if not isinstance(state, ScalingState):
        raise TypeError(f"{where}: state must be a ScalingState, got {type(state).__name__}")
    check_role(state.role, where=where)
    for name, ndim in (("amax_history", 1), ("scale", 0), ("pending_amax", 0)):
        t = getattr(state, name)
        if not isinstance(t, Tensor) or t.dtype != torch.float32 or t.dim() != ndim:
            got = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(f"{where}: state.{name} must be a {ndim}-d float32 tensor, got {got}")
        if device is not None and t.device != device:
            raise ValueError(f"{where}: state.{name} is on {t.device} but the input is on {device}")
    return state

