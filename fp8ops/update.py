"""The once-per-optimizer-step update of every scaling state of a model: :func:`update`.

Observations (pending forward amaxes, probe gradients for the gradient roles) are merged, reduced
across a process group in one ``all_reduce(MAX)``, and handed to the recipe's ``update_many``.
"""

from __future__ import annotations

from typing import Any, TypeVar

import torch
from torch import Tensor
from torch.utils import _pytree as pytree

from .state import OpState, ScalingState, _check_built_for, _is_node

__all__ = ["update"]

_T = TypeVar("_T")



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
    from ._checks import check_recipe  # _checks imports recipes, which imports this module
    from .recipes import Recipe

    check_recipe(recipe, "update")
    nodes, spec, pairs = _pairs(states, grad_amax, "update")
    flat = [p for row in pairs for p in row]
    if not flat:
        return states
    # One merged observation per state, max(pending amax, gradient amax), for the whole tree at
    # once: one stack of both lists, (2, S), merged by the recipe's update (inside its fused kernel
    # on a GPU) or, before an all-reduce, by a maximum here.
    pending, grads = [], []
    for s, g, key in flat:
        _check_built_for(s, recipe, where=f"update: {key}")
        p = s.pending_amax
        if p.dim():
            p = p.reshape(())
        if g is not None and g.device != p.device:  # e.g. a CPU scalar: merged on its own
            p = torch.maximum(p, g.detach().to(torch.float32)).reshape(())
            g = None
        pending.append(p)
        if g is not None:
            if g.requires_grad:
                g = g.detach()
            if g.dtype != torch.float32:
                g = g.to(torch.float32)
            if g.dim():
                g = g.reshape(())
        grads.append(p if g is None else g)
    to_update = [s if g is None else s.replace(observed=True) for s, g, _ in flat]
    obs_t = torch.stack(pending + grads).view(2, len(flat))
    own = type(recipe).update_many is Recipe.update_many  # not overridden: the states are checked above
    if group is not None or not own:
        obs_t = obs_t.amax(0)  # NaN propagates, as in torch.maximum
    if group is not None:
        import torch.distributed as dist

        # NaN is not reliably propagated by a MAX reduction; inf is, and is dropped the same way.
        obs_t = torch.where(torch.isnan(obs_t), torch.full_like(obs_t, float("inf")), obs_t)
        dist.all_reduce(obs_t, op=dist.ReduceOp.MAX, group=group)
    new_flat = recipe._update_built(to_update, obs_t) if own else recipe.update_many(to_update, obs_t)
    it = iter(new_flat)
    new_nodes = []
    for node, row in zip(nodes, pairs):
        if isinstance(node, ScalingState):
            new_nodes.append(next(it))
        else:
            new_nodes.append(node.replace(**{name: next(it) for name in type(node).ROLES}))
    return pytree.tree_unflatten(new_nodes, spec)
