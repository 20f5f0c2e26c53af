"""FP8 weight all-gather inside FSDP2 ``fully_shard``: the parameter subclasses behind
:func:`fp8ops.nn.enable_fp8_all_gather`, and the forwards of the linear-family modules
(``fp8ops.nn.Linear``, ``LayerNormLinear``, ``LayerNormMLP``, ``TransformerLayer``) over the gathered bytes.

FSDP2 all-gathers a parameter whose local shard defines ``fsdp_pre_all_gather`` /
``fsdp_post_all_gather`` through those hooks (torch/distributed/fsdp/_fully_shard/_fsdp_param.py)::

    sharded parameter    DTensor, local tensor an FP8AllGatherWeight (N/w, K), high precision
    fsdp_pre_all_gather  q = sat(shard * scale) as bytes (N/w, K) uint8, padded to FSDP2's shard rows;
                         scale: the weight role's state (calibrated delayed; the role is ``weight``,
                         ``fc1_weight`` or ``fc2_weight`` of the module's state, ``qkv.weight``,
                         ``proj.weight``, ``mlp.fc1_weight``... of a TransformerLayer's), or that of the
                         group's amax (one all_reduce(MAX) of a scalar: current scaling, an
                         uncalibrated state). The backward pass's gather sends the bytes its forward
                         cast (same scale tensor: nothing updates the weight or the state in between)
    all-gather           (w * N/w, K) uint8: one byte per element, half of bfloat16's
    fsdp_post_all_gather the unsharded parameter, a GatheredFP8Weight (N, K) of the param dtype that
                         holds the gathered bytes, 1/scale and the amax of this rank's shard; no
                         high-precision copy of the full weight
    forward              the module's op (fp8_linear, layernorm_linear, fused_ln_mlp, transformer_layer) with a
                         WeightCache of those bytes (no transposed copy) next to the unsharded
                         parameter itself, whose gradient, the (N, K) dW, FSDP2 reduce-scatters as
                         usual
    backward             the op transposes the gathered bytes for its dgrad GEMM (K-major)

FSDP2 frees the all-gather output after the forward (storage resized to 0) and gathers again for
the backward into the same storage, without a version bump, so the bytes the forward saved are
those of the backward's gather when the backward reads them: the transposed copy is made there,
once per step, instead of after every gather.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor
from torch.utils import _pytree as pytree

from ._parallel import check_fp8_gather_recipe, fp8_group_quantize
from ._transformer_checks import WEIGHT_ROLES
from .fp8_linear import LinearState, WeightCache, fp8_linear
from .fused_ln_mlp import LayerNormMLPState, fused_ln_mlp
from .kernels._library import AMAX_CHAIN
from .layernorm_linear import LayerNormLinearState, layernorm_linear
from .quantize import Float8Value, QuantSpec
from .transformer_layer import transformer_layer

__all__ = ["FP8AllGatherWeight", "GatheredFP8Weight", "gathered_fused_ln_mlp", "gathered_layernorm_linear",
           "gathered_linear", "gathered_transformer_layer", "is_fp8_all_gather", "is_gathered", "sharded_fp8_weight",
           "transformer_fp8_weights", "wrap_weights"]

_aten = torch.ops.aten

# Ops whose outputs stay FP8AllGatherWeight: those FSDP2 runs on the parameter to shard, pad and
# move it (a new shard, views of it, copies into it), so that its local shard keeps the hooks.
_KEEP_SUBCLASS = {
    _aten.empty_like.default,
    _aten.new_zeros.default,
    _aten.slice.Tensor,
    _aten.copy_.default,
    _aten.view.default,
    _aten.as_strided.default,
    _aten._to_copy.default,
    _aten._pin_memory.default,
    _aten.split.Tensor,
    _aten.clone.default,
}


def _unwrap_flat(cls: type, args: tuple[Any, ...]) -> tuple[Any, tuple[Any, ...]] | None:
    """``(first instance of cls, args with every instance replaced by its wrapped tensor)`` for
    arguments that are tensors, scalars or flat lists/tuples of them (the optimizers' foreach ops
    pass lists of every parameter), without pytree's per-leaf calls; None for anything nested."""
    src = None
    out: list[Any] = []
    for a in args:
        t = type(a)
        if t is cls:
            src = src if src is not None else a
            a = a._tensor
        elif t is list or t is tuple:
            items = []
            for x in a:
                tx = type(x)
                if tx is cls:
                    src = src if src is not None else x
                    x = x._tensor
                elif tx is list or tx is tuple or tx is dict:
                    return None
                items.append(x)
            a = items if t is list else tuple(items)
        elif t is dict:
            return None
        out.append(a)
    return None if src is None else (src, tuple(out))


class FP8AllGatherWeight(torch.Tensor):
    """A high-precision weight (N, K) of an fp8ops module that FSDP2 all-gathers in FP8.

    Every op runs on the wrapped tensor (the results are plain tensors, except for the ops FSDP2
    uses to shard the parameter, which keep the subclass); FSDP2 calls ``fsdp_pre_all_gather``
    and :meth:`fsdp_post_all_gather` on the local shard. ``owner`` is a weak reference to the
    module (``fp8ops.nn.Linear``, ``LayerNormLinear``, ``LayerNormMLP`` or ``TransformerLayer``)
    whose recipe and weight state quantize it, ``role`` the path of the weight's role in that
    module's state (``"weight"``, ``"fc1_weight"``, ``"fc2_weight"``; ``"qkv.weight"``,
    ``"proj.weight"``, ``"mlp.fc1_weight"``, ``"mlp.fc2_weight"`` in a TransformerLayer's dict); both are carried by every shard and view FSDP2 makes: a
    weight shared by several layers is quantized with its first layer's state, whichever of them
    FSDP2 registers it under.
    """

    _tensor: Tensor
    _owner: weakref.ref[Any]
    _role: str
    _last_cast: tuple[Tensor, Tensor, Any] | None  # (scale, bytes, metadata) of the last forward gather
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, tensor: Tensor, owner: weakref.ref[Any], role: str = "weight") -> FP8AllGatherWeight:
        return torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            cls, tensor.size(), strides=tensor.stride(), storage_offset=tensor.storage_offset(),
            dtype=tensor.dtype, layout=tensor.layout, device=tensor.device, requires_grad=tensor.requires_grad)

    def __init__(self, tensor: Tensor, owner: weakref.ref[Any], role: str = "weight") -> None:
        self._tensor, self._owner, self._role = tensor, owner, role
        self._last_cast = None

    def __repr__(self) -> str:  # type: ignore[override]
        return f"FP8AllGatherWeight({self._tensor!r}, role={self._role!r})"

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is _aten.detach.default:
            return cls(args[0]._tensor, args[0]._owner, args[0]._role)
        flat = None if kwargs else _unwrap_flat(cls, args)
        if flat is None:  # nested arguments: the general path
            src = next(t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, cls))
            args, kwargs = pytree.tree_map_only(cls, lambda t: t._tensor, (args, kwargs or {}))
        else:
            src, args, kwargs = flat[0], flat[1], {}
        out = func(*args, **kwargs)
        if func not in _KEEP_SUBCLASS:
            return out
        return pytree.tree_map_only(Tensor, lambda t: cls(t, src._owner, src._role), out)

    def __tensor_flatten__(self) -> tuple[list[str], tuple[weakref.ref[Any], str]]:
        return ["_tensor"], (self._owner, self._role)

    @staticmethod
    def __tensor_unflatten__(inner: dict[str, Tensor], meta: tuple[weakref.ref[Any], str], outer_size: Any,
                             outer_stride: Any) -> FP8AllGatherWeight:
        return FP8AllGatherWeight(inner["_tensor"], *meta)

    def _pre_all_gather(self, mesh: Any, outer_size: torch.Size, outer_stride: tuple[int, ...],
                        module: torch.nn.Module, mp_policy: Any) -> tuple[tuple[Tensor, ...], Any]:
        """FSDP2 hook (``fsdp_pre_all_gather``): this rank's shard quantized with one scale for the
        shard group, as bytes."""
        owner = self._owner()
        if owner is None:
            raise RuntimeError("FP8AllGatherWeight: the fp8ops.nn module this weight was enabled on "
                               "(fp8ops.nn.enable_fp8_all_gather) no longer exists")
        if tuple(self.shape[1:]) != tuple(outer_size[1:]):
            raise ValueError(f"FP8AllGatherWeight.fsdp_pre_all_gather: the FP8 all-gather needs row shards (FSDP2's "
                             f"default Shard(0) placement) of the {tuple(outer_size)} weight, got a "
                             f"{tuple(self.shape)} shard; do not pass a shard_placement_fn for this weight")
        recipe, ws = owner.recipe, role_state(owner.fp8_state, self._role)
        last, self._last_cast = self._last_cast, None
        in_backward = torch._C._current_graph_task_id() != -1
        if in_backward and last is not None and last[0] is ws.scale:
            # The backward pass gathers again what its forward gathered (the shard and the scale
            # are those of the forward: the optimizer and the state update come after backward).
            return (last[1],), last[2]
        spec = QuantSpec.of(recipe, "forward", ws.calibrated)
        group = mesh.get_group()
        with AMAX_CHAIN.this_stream(self._tensor.device):  # FSDP2's all-gather stream: no fill per shard for its amax
            data, inv, amax = fp8_group_quantize(self._tensor.contiguous(), ws.scale, spec, group)  # (rows, K) uint8
        # FSDP2 gathers equal pieces: a shorter last shard (N not divisible by w) is padded with
        # zero bytes (FP8 zeros) to the rows of the first one, which the unsharded weight drops.
        rows = -(-outer_size[0] // mesh.size())
        if data.shape[0] != rows:
            data = torch.cat([data, data.new_zeros(rows - data.shape[0], data.shape[1])])
        metadata = (outer_size[0], inv, amax, spec.dtype)
        if not in_backward:  # a forward gather: kept for its backward's
            self._last_cast = (ws.scale, data, metadata)
        return (data,), metadata

    def fsdp_post_all_gather(self, all_gather_outputs: tuple[Tensor, ...], metadata: Any, param_dtype: torch.dtype,
                             *, out: Tensor | None = None) -> tuple[GatheredFP8Weight, tuple[Tensor, ...]] | None:
        """FSDP2 hook: the unsharded parameter over the gathered bytes (a new one, or ``out`` refilled)."""
        (gathered,) = all_gather_outputs  # (w * rows, K) uint8
        N, inv, amax, fp8_dtype = metadata
        data = gathered[:N]  # (N, K): the padding rows dropped (a view, no copy)
        if out is not None:
            if not isinstance(out, GatheredFP8Weight):
                raise TypeError(f"FP8AllGatherWeight.fsdp_post_all_gather: out must be the GatheredFP8Weight "
                                f"this hook made, got {type(out).__name__}")
            out._data, out._inv, out._amax = data, inv, amax
            return None
        return GatheredFP8Weight(data, inv, amax, fp8_dtype, param_dtype), ()


class _BoundPreAllGather:
    """``fsdp_pre_all_gather`` of one shard. FSDP2 reads ``inspect.signature`` of the hook at every
    all-gather of every parameter: for a bound method, inspect builds a new ``Signature`` each time,
    even when the function has one stored; for this object, it returns the stored one."""

    __slots__ = ("_w",)
    __signature__: inspect.Signature

    def __init__(self, w: FP8AllGatherWeight) -> None:
        self._w = w

    def __call__(self, *args: Any) -> tuple[tuple[Tensor, ...], Any]:
        return self._w._pre_all_gather(*args)


class _PreAllGatherHook:
    """The ``fsdp_pre_all_gather`` attribute: on a shard, a :class:`_BoundPreAllGather`; on the class,
    this object, called as ``hook(shard, mesh, ...)`` like the plain function."""

    def __get__(self, obj: Any, owner: Any = None) -> Any:
        return self if obj is None else _BoundPreAllGather(obj)

    def __call__(self, w: FP8AllGatherWeight, *args: Any) -> tuple[tuple[Tensor, ...], Any]:
        return w._pre_all_gather(*args)


# The signatures inspect reports: the method's, and the method's without ``self`` for a shard's hook.
_PreAllGatherHook.__signature__ = inspect.signature(FP8AllGatherWeight._pre_all_gather)  # type: ignore[attr-defined]
_BoundPreAllGather.__signature__ = _PreAllGatherHook.__signature__.replace(  # type: ignore[attr-defined]
    parameters=list(_PreAllGatherHook.__signature__.parameters.values())[1:])  # type: ignore[attr-defined]
FP8AllGatherWeight.fsdp_pre_all_gather = _PreAllGatherHook()  # type: ignore[assignment]


class GatheredFP8Weight(torch.Tensor):
    """The unsharded parameter of an :class:`FP8AllGatherWeight` inside FSDP2: (N, K) of the param
    dtype outside, the all-gathered FP8 weight inside.

    The fp8ops modules read the FP8 operands (:func:`gathered_linear` and its siblings); any other op sees the
    dequantized weight ``fp8 * inv_scale`` in the param dtype (a plain tensor). In-place ops raise:
    the unsharded weight is FSDP2's, rebuilt from the shards at every all-gather.
    """

    _data: Tensor
    _inv: Tensor
    _amax: Tensor
    _fp8_dtype: torch.dtype
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, data: Tensor, inv: Tensor, amax: Tensor, fp8_dtype: torch.dtype,
                dtype: torch.dtype) -> GatheredFP8Weight:
        return torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            cls, data.size(), dtype=dtype, device=data.device)

    def __init__(self, data: Tensor, inv: Tensor, amax: Tensor, fp8_dtype: torch.dtype, dtype: torch.dtype) -> None:
        self._data, self._inv, self._amax, self._fp8_dtype = data, inv, amax, fp8_dtype

    def __repr__(self) -> str:  # type: ignore[override]
        return f"GatheredFP8Weight(shape={tuple(self.shape)}, dtype={self.dtype}, fp8_dtype={self._fp8_dtype})"

    # A traceable subclass: torch.compile takes the unsharded weight as its three inner tensors, so the
    # modules' ops over the gathered bytes trace into the compiled graph like any other op.
    def __tensor_flatten__(self) -> tuple[list[str], tuple[torch.dtype, torch.dtype]]:
        return ["_data", "_inv", "_amax"], (self._fp8_dtype, self.dtype)

    @staticmethod
    def __tensor_unflatten__(inner: dict[str, Tensor], meta: tuple[torch.dtype, torch.dtype], outer_size: Any,
                             outer_stride: Any) -> GatheredFP8Weight:
        return GatheredFP8Weight(inner["_data"], inner["_inv"], inner["_amax"], *meta)

    def _same(self) -> GatheredFP8Weight:
        return GatheredFP8Weight(self._data, self._inv, self._amax, self._fp8_dtype, self.dtype)

    def dequantize(self) -> Tensor:
        """The gathered weight as a plain (N, K) tensor of the param dtype: ``fp8 * inv_scale``."""
        return (self._data.view(self._fp8_dtype).to(torch.float32) * self._inv).to(self.dtype)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is _aten.detach.default:
            return args[0]._same()
        if func is _aten.as_strided.default:
            # FSDP2 views the unsharded tensor with the parameter's (contiguous) size once
            w, size, stride = args[0], tuple(args[1]), tuple(args[2])
            offset = args[3] if len(args) > 3 else kwargs.get("storage_offset", 0)
            if size == tuple(w.shape) and stride == tuple(w.stride()) and not offset:
                return w._same()
        if func._schema.is_mutable:
            raise RuntimeError(f"GatheredFP8Weight: {func} would modify the unsharded weight that FSDP2 all-gathered "
                               f"in FP8 (fp8ops.nn.enable_fp8_all_gather); modify the sharded parameter instead")
        args, kwargs = pytree.tree_map_only(cls, lambda t: t.dequantize(), (args, kwargs))
        return func(*args, **kwargs)


def is_gathered(*weights: Tensor | None) -> bool:
    """Whether any of ``weights`` is an unsharded FP8-gathered weight (inside ``fully_shard``'s forward)."""
    return any(isinstance(w, GatheredFP8Weight) for w in weights)


def _cached(weight: Tensor, scale: Tensor, recipe: Any) -> tuple[Tensor, WeightCache | None]:
    """``(op weight, cache)`` of one weight argument: for a :class:`GatheredFP8Weight`, the weight
    itself and a :class:`WeightCache` over its gathered bytes (built with the role's scale tensor
    itself, as the op checks); for any other weight, the weight itself and no cache. The op reads
    the cache's bytes, not the weight (no op dispatches on it, so it is never dequantized); the
    weight's gradient, dW, becomes the unsharded parameter's."""
    if not isinstance(weight, GatheredFP8Weight):
        return weight, None
    dt = weight._fp8_dtype
    # no transposed copy: the op transposes the bytes in its backward pass, when FSDP2 has gathered
    # them again into the same storage
    value = Float8Value(weight._data.view(dt), weight._inv)
    return weight, WeightCache(value, None, scale, recipe, weight)


def _observe_shards(state: Any, weights: dict[str, Tensor]) -> Any:
    """``state`` with each gathered weight's role observing the amax of this rank's shard (the op
    records none for a cached weight; ``update(..., group=)`` makes it the full weight's)."""
    seen = {role: getattr(state, role).observe(w._amax) for role, w in weights.items()
            if isinstance(w, GatheredFP8Weight)}
    return state.replace(**seen) if seen else state


def gathered_linear(x: Tensor, weight: Tensor, bias: Tensor | None, state: LinearState, *, recipe: Any,
                    grad_probe: Tensor | None) -> tuple[Tensor, LinearState]:
    """:func:`fp8_linear` over an unsharded FP8-gathered weight: ``(y, new_state)``, the weight role
    observing the amax of this rank's shard."""
    w, cache = _cached(weight, state.weight.scale, recipe)
    y, new_state = fp8_linear(x, w, bias, state, recipe=recipe, grad_probe=grad_probe, weight_cache=cache)
    return y, _observe_shards(new_state, {"weight": weight})


def gathered_layernorm_linear(x: Tensor, ln_weight: Tensor, ln_bias: Tensor | None, weight: Tensor,
                              bias: Tensor | None, state: LayerNormLinearState, *, recipe: Any, **kw: Any
                              ) -> tuple[Any, LayerNormLinearState]:
    """:func:`layernorm_linear` (keywords as there) over an unsharded FP8-gathered weight; the norm's
    parameters and the bias are used as given. The weight role observes the amax of this rank's shard."""
    w, cache = _cached(weight, state.weight.scale, recipe)
    out, new_state = layernorm_linear(x, ln_weight, ln_bias, w, bias, state, recipe=recipe, weight_cache=cache, **kw)
    return out, _observe_shards(new_state, {"weight": weight})


def gathered_fused_ln_mlp(x: Tensor, ln_weight: Tensor, ln_bias: Tensor | None, fc1_weight: Tensor,
                          fc1_bias: Tensor | None, fc2_weight: Tensor, fc2_bias: Tensor | None,
                          state: LayerNormMLPState, *, recipe: Any, **kw: Any) -> tuple[Tensor, LayerNormMLPState]:
    """:func:`fused_ln_mlp` (keywords as there) over its unsharded FP8-gathered weights (either may
    be a plain weight, quantized in the op); the roles ``fc1_weight`` / ``fc2_weight`` observe the
    amax of this rank's shard of a gathered weight."""
    w1, c1 = _cached(fc1_weight, state.fc1_weight.scale, recipe)
    w2, c2 = _cached(fc2_weight, state.fc2_weight.scale, recipe)
    y, new_state = fused_ln_mlp(x, ln_weight, ln_bias, w1, fc1_bias, w2, fc2_bias, state, recipe=recipe,
                                weight_cache=(c1, c2), **kw)
    return y, _observe_shards(new_state, {"fc1_weight": fc1_weight, "fc2_weight": fc2_weight})


def transformer_fp8_weights(config: Any) -> dict[str, str]:
    """The weights of ``fp8ops.nn.TransformerLayer`` all-gathered in FP8: parameter name -> the path
    of its role in the layer's state. Separate q, k, v weights are not among them: each would be
    gathered with its own scale, while the layer quantizes their concatenation with one."""
    names = ["proj.weight", "fc1.weight", "fc2.weight"]
    if config.fuse_qkv_params:
        names.insert(0, "qkv.weight")
    return {n: ".".join(WEIGHT_ROLES[n]) for n in names}


def role_state(state: Any, role: str) -> Any:
    """The ScalingState at the path ``role`` ("weight", "mlp.fc1_weight") of a module's state."""
    for part in role.split("."):
        state = state[part] if isinstance(state, Mapping) else getattr(state, part)
    return state


def gathered_transformer_layer(params: Mapping[str, Tensor], x: Tensor, state: dict[str, Any], *, recipe: Any,
                               **kw: Any) -> tuple[Tensor, dict[str, Any]]:
    """:func:`fp8ops.transformer_layer` (keywords as there) with its unsharded FP8-gathered weights
    as its ``weight_cache``; their roles observe the amax of this rank's shard."""
    gathered = {k: WEIGHT_ROLES[k] for k, w in params.items() if isinstance(w, GatheredFP8Weight)}
    p, caches = dict(params), {}
    for key, (skey, role) in gathered.items():
        p[key], caches[key] = _cached(params[key], getattr(state[skey], role).scale, recipe)
    y, new_state = transformer_layer(p, x, state, recipe=recipe, weight_cache=caches, **kw)
    if new_state is not None:
        new_state = dict(new_state)
        for key, (skey, role) in gathered.items():
            new_state[skey] = _observe_shards(new_state[skey], {role: params[key]})
    return y, new_state  # type: ignore[return-value]


def _fp8_weights(m: Any) -> dict[str, str]:
    """Parameter name -> state role path of the FP8 weights of an fp8ops.nn module."""
    names = m._FP8_WEIGHTS
    return dict(names) if isinstance(names, Mapping) else {n: n for n in names}


def _owner_slot(m: torch.nn.Module, name: str) -> tuple[int, str]:
    """(id of the module that registers the parameter ``name`` of ``m``, its name there)."""
    path, _, pname = name.rpartition(".")
    return id(m.get_submodule(path) if path else m), pname


def sharded_fp8_weight(weight: Tensor) -> bool:
    """Whether ``weight`` is an FSDP2 shard (a DTensor) of an :class:`FP8AllGatherWeight` over more
    than one rank, or its unsharded :class:`GatheredFP8Weight`."""
    if isinstance(weight, GatheredFP8Weight):
        return True
    local = getattr(weight, "_local_tensor", None)
    return isinstance(local, FP8AllGatherWeight) and weight.device_mesh.size() > 1  # type: ignore[attr-defined]


def is_fp8_all_gather(weight: Tensor) -> bool:
    """Whether ``weight`` is all-gathered in FP8 under FSDP2 (sharded or not yet sharded)."""
    local = getattr(weight, "_local_tensor", weight)
    return isinstance(local, (FP8AllGatherWeight, GatheredFP8Weight))


def wrap_weights(model: torch.nn.Module, selected: list[tuple[str, Any]], where: str) -> None:
    """Check the selected ``(fqn, module)`` fp8ops modules of ``model`` and give each of their FP8
    weights (the parameters named in the module's ``_FP8_WEIGHTS``: names that are also their
    roles in the module's state, or a dict name -> role path) an :class:`FP8AllGatherWeight` parameter, in place
    (``fp8ops.nn.enable_fp8_all_gather``)."""
    for fqn, m in selected:
        recipe = m.recipe
        name = f"layer {fqn!r}" if fqn else "model"
        check_fp8_gather_recipe(recipe, where, f"{name} has a recipe with ", " (or leave this layer out with filter=)")
        for wname in _fp8_weights(m):
            if type(m.get_parameter(wname)).__name__ == "DTensor":
                raise ValueError(f"{where}: the {wname} of {name} is already sharded (a DTensor): call "
                                 f"enable_fp8_all_gather before fully_shard")
    # A weight must be read as an FP8 weight wherever it is registered: a weight tied to another
    # module (an embedding), or to another parameter of a selected one, would be read as its FP8 value.
    owners = {id(m.get_parameter(wname)): (fqn, wname) for fqn, m in selected for wname in _fp8_weights(m)}
    allowed = {_owner_slot(m, wname) for _, m in selected for wname in _fp8_weights(m)}
    for mfqn, mod in model.named_modules(remove_duplicate=False):
        for pname, p in mod._parameters.items():
            if p is not None and id(p) in owners and (id(mod), pname) not in allowed:
                fqn, wname = owners[id(p)]
                name = f"layer {fqn!r}" if fqn else "model"
                raise ValueError(f"{where}: the {wname} of {name} is also a parameter of {mfqn!r} "
                                 f"({type(mod).__name__}, as {pname!r}), which would read it as its FP8 value under "
                                 f"fully_shard; leave the layer out with filter= (e.g. filter=lambda fqn, m: "
                                 f"fqn != {fqn!r})")
    new: dict[int, torch.nn.Parameter] = {}
    for _, m in selected:
        for wname, role in _fp8_weights(m).items():
            w = m.get_parameter(wname)
            if id(w) not in new and not is_fp8_all_gather(w):
                # a weight shared by several layers is quantized with the first one's state
                new[id(w)] = torch.nn.Parameter(FP8AllGatherWeight(w.detach(), weakref.ref(m), role),
                                                requires_grad=w.requires_grad)
    # Swap every reference (a weight tied between selected layers stays tied).
    for mod in model.modules():
        for pname, p in list(mod._parameters.items()):
            if p is not None and id(p) in new:
                mod._parameters[pname] = new[id(p)]
