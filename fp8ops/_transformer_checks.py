"""The boundary checks of :func:`fp8ops.transformer_layer`: its parameters, its state and probes,
and its ``weight_cache`` (one :class:`fp8ops.WeightCache` per GEMM weight key), with the cache of
the QKV projection when its weights are separate ``q`` / ``k`` / ``v`` tensors."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from ._checks import FLOAT_DTYPES, check_float_tensor, check_recipe, check_residual
from .attention import MaskMod, modmath
from .fp8_linear import LinearState, WeightCache
from .fused_ln_mlp import LayerNormMLPState
from .layernorm_linear import LayerNormLinearState, check_weight_cache
from .quantize import Float8Value

__all__ = ["STATE_KEYS", "WEIGHT_ROLES", "check_params", "check_state", "check_weight_caches", "qkv_weight_cache", "sdpa_head_views"]

STATE_KEYS = ("qkv", "proj", "mlp")
# GEMM weight key -> (its state's key, its role in that state)
WEIGHT_ROLES = {
    "qkv.weight": ("qkv", "weight"), "q.weight": ("qkv", "weight"), "k.weight": ("qkv", "weight"),
    "v.weight": ("qkv", "weight"), "proj.weight": ("proj", "weight"), "fc1.weight": ("mlp", "fc1_weight"),
    "fc2.weight": ("mlp", "fc2_weight"),
}
_QKV = ("q.weight", "k.weight", "v.weight")


def check_params(params: Any, cfg: Any, x: Tensor, where: str, shapes: dict[str, tuple[int, ...]] | None = None
                 ) -> None:
    if not isinstance(params, Mapping):
        raise TypeError(f"{where}: params must be a dict[str, Tensor] (init_transformer_params), got {type(params).__name__}")
    shapes = cfg.param_shapes() if shapes is None else shapes  # or those of a tensor-parallel shard
    if len(params) == len(shapes) and all(  # the valid case in one pass; the checks below name a fault
            isinstance(t := params.get(k), Tensor) and t.dtype in FLOAT_DTYPES and t.shape == s and t.device == x.device
            for k, s in shapes.items()):
        return
    missing = [k for k in shapes if k not in params]
    extra = [k for k in params if k not in shapes]
    if missing or extra:
        raise ValueError(
            f"{where}: params do not match the config: missing {missing}, unexpected {extra} "
            f"(expected keys {list(shapes)}; see TransformerConfig.param_shapes())"
        )
    for key, shape in shapes.items():
        t = check_float_tensor(params[key], f"params[{key!r}]", where)
        if tuple(t.shape) != shape:
            raise ValueError(f"{where}: params[{key!r}] must have shape {shape}, got {tuple(t.shape)}")
        if t.device != x.device:
            raise ValueError(f"{where}: params[{key!r}] is on {t.device} but x is on {x.device}")


def check_state(state: Any, probes: Any, recipe: Any, where: str) -> None:
    if recipe is None:
        if state is not None:
            raise ValueError(f"{where}: state given with recipe=None; pass the recipe the state was built with, "
                             f"or state=None to run without FP8")
        return
    check_recipe(recipe, where)
    types = {"qkv": LayerNormLinearState, "proj": LinearState, "mlp": LayerNormMLPState}
    if not isinstance(state, Mapping) or set(state) != set(STATE_KEYS):
        got = sorted(state) if isinstance(state, Mapping) else type(state).__name__
        raise ValueError(f"{where}: state must be the dict {{'qkv', 'proj', 'mlp'}} of init_transformer_state, got {got}")
    for key, cls in types.items():
        if not isinstance(state[key], cls):
            raise TypeError(f"{where}: state[{key!r}] must be a {cls.__name__}, got {type(state[key]).__name__}")
    if probes is not None and (not isinstance(probes, Mapping) or set(probes) != set(STATE_KEYS)):
        got = sorted(probes) if isinstance(probes, Mapping) else type(probes).__name__
        raise ValueError(f"{where}: probes must be fp8ops.make_probes(state) (keys 'qkv', 'proj', 'mlp'), got {got}")


def check_weight_caches(weight_cache: Any, params: Mapping[str, Tensor], state: Any, recipe: Any,
                        where: str) -> dict[str, WeightCache]:
    """``weight_cache`` checked against the weight keys of ``params``: a dict key -> WeightCache
    (empty for None). Each cache must be ``quantize_weight(params[key], state[s].<role>, recipe=recipe)``
    with the state's role of that weight (:data:`WEIGHT_ROLES`)."""
    if weight_cache is None:
        return {}
    if recipe is None:
        raise ValueError(f"{where}: weight_cache is only meaningful with FP8 (a state and a recipe); "
                         f"pass weight_cache=None")
    if not isinstance(weight_cache, Mapping):
        raise TypeError(f"{where}: weight_cache must be a dict {{weight key: WeightCache}} (e.g. "
                        f"{{'proj.weight': quantize_weight(params['proj.weight'], state['proj'].weight, recipe=...)[0]}}), "
                        f"got {type(weight_cache).__name__}")
    keys = [k for k in WEIGHT_ROLES if k in params]
    unknown = [k for k in weight_cache if k not in keys]
    if unknown:
        raise ValueError(f"{where}: weight_cache has unknown keys {unknown}; the GEMM weights of this config are {keys}")
    for key, cache in weight_cache.items():
        skey, role = WEIGHT_ROLES[key]
        if not isinstance(cache, WeightCache):
            raise TypeError(f"{where}: weight_cache[{key!r}] must be a WeightCache from quantize_weight(params[{key!r}], "
                            f"state[{skey!r}].{role}, recipe=...), got {type(cache).__name__}")
        try:
            check_weight_cache(cache, params[key], getattr(state[skey], role), recipe, True, where,
                               name=f"weight_cache[{key!r}]", weight_name=f"params[{key!r}]", role=f"[{skey!r}].{role}")
        except ValueError as e:  # the role's path in the state dict reads state['mlp'].fc1_weight
            raise ValueError(str(e).replace("state.[", "state[")) from None
    return dict(weight_cache)


def qkv_weight_cache(caches: Mapping[str, WeightCache], w_qkv: Tensor, state: Any, recipe: Any) -> WeightCache | None:
    """The cache of the QKV projection's weight ``w_qkv`` (None: quantized in the op).

    With separate ``q`` / ``k`` / ``v`` weights, ``w_qkv`` is their concatenation, and the three
    caches concatenated are its FP8 value exactly when they share the state's scale (a calibrated
    delayed scale, one per tensor); otherwise (current scaling, an uncalibrated state, some of the
    three not cached) the op quantizes ``w_qkv`` itself, as without caches.
    """
    if "qkv.weight" in caches:
        return caches["qkv.weight"]
    parts = [caches.get(k) for k in _QKV]
    ws = None if state is None else state["qkv"].weight
    if any(c is None for c in parts) or ws is None or recipe.mode != "delayed" or not ws.calibrated \
            or any(c.inv_scale_t is not None or c.value.data_t is None for c in parts):  # type: ignore[union-attr]
        return None
    dt = parts[0].value.data.dtype  # type: ignore[union-attr]
    data = torch.cat([c.value.data.view(torch.uint8) for c in parts]).view(dt)  # type: ignore[union-attr]
    data_t = torch.cat([c.value.data_t.view(torch.uint8) for c in parts], dim=1).view(dt)  # type: ignore[union-attr]
    return WeightCache(Float8Value(data, parts[0].value.inv_scale, data_t), None, ws.scale, recipe, w_qkv)  # type: ignore[union-attr]


def check_residual_args(residual: Any, return_residual: Any, cfg: Any, x: Tensor, where: str) -> None:
    """``residual`` / ``return_residual`` of a layer: a bool flag, both for pre-norm layers only, and a
    residual of x's shape, dtype and device."""
    if not isinstance(return_residual, bool):
        raise TypeError(f"{where}: return_residual must be a bool, got {return_residual!r}")
    if residual is not None or return_residual:
        if cfg.norm_position != "pre":
            raise ValueError(f"{where}: residual / return_residual need a pre-norm layer (config.norm_position "
                             f"'pre'), got norm_position={cfg.norm_position!r}")
        if residual is not None:
            check_residual(residual, x, where)


def _padding_mask_mod(attention_mask: Tensor) -> MaskMod:
    """A mask mod that hides padded keys: ``attention_mask`` (B, S) is True at valid tokens."""
    valid = attention_mask.to(torch.int32).contiguous()
    seq = int(valid.shape[1])

    def padding(b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
        return modmath.load(valid, b * seq + kv_idx) != 0

    return MaskMod(padding)


def attention_mask_mod(attention_mask: Any, cfg: Any, x: Tensor, packed: bool, block_mask: Any, seq_shards: int,
                       where: str) -> MaskMod | None:
    """The mask mod of a layer's ``attention_mask`` (None without one), after checking it against the
    config's mask type, the other mask arguments and x ((S / seq_shards, B, H) with sequence parallelism)."""
    if attention_mask is None:
        if cfg.self_attn_mask_type in ("padding", "padding_causal") and not packed and block_mask is None:
            raise ValueError(f"{where}: config.self_attn_mask_type is {cfg.self_attn_mask_type!r}: pass "
                             f"attention_mask (B, S) or packed tokens with cu_seqlens")
        return None
    if cfg.self_attn_mask_type not in ("padding", "padding_causal"):
        raise ValueError(f"{where}: attention_mask given but config.self_attn_mask_type is "
                         f"{cfg.self_attn_mask_type!r}; use 'padding' or 'padding_causal'")
    if packed:
        raise ValueError(f"{where}: attention_mask and cu_seqlens are exclusive (packed tokens have no padding)")
    if block_mask is not None:
        raise ValueError(f"{where}: attention_mask and block_mask are exclusive; fold the padding into the "
                         f"block mask's mask_mod")
    S, B = x.shape[0] * seq_shards, x.shape[1]
    if not isinstance(attention_mask, Tensor) or attention_mask.dtype != torch.bool \
            or tuple(attention_mask.shape) != (B, S):
        got = (f"{tuple(attention_mask.shape)} {attention_mask.dtype}" if isinstance(attention_mask, Tensor)
               else type(attention_mask).__name__)
        raise ValueError(f"{where}: attention_mask must be a (B, S) = ({B}, {S}) bool tensor, True at valid "
                         f"tokens, got {got}")
    if attention_mask.device != x.device:
        raise ValueError(f"{where}: attention_mask is on {attention_mask.device} but x is on {x.device}")
    return _padding_mask_mod(attention_mask)


def sdpa_head_views(cfg: Any, x: Tensor, packed: bool, tp: Any, mask_mod: Any, block_mask: Any, training: bool,
                    d: int) -> bool:
    """Whether the layer's attention runs on SDPA (a dense causal or unmasked CUDA call in bf16/fp16,
    no dropout, no mods; :func:`fp8ops.attention`'s ``backend="auto"`` choice) with a pre-norm QKV
    projection: the projection then hands SDPA its head views (``layernorm_linear(qkv_heads=)``)."""
    return (HEAD_VIEWS and cfg.norm_position == "pre" and not packed and tp is None and mask_mod is None
            and block_mask is None and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)
            and (not training or cfg.attention_dropout == 0.0) and d % 8 == 0 and d <= 256)


HEAD_VIEWS = True
"""Whether a pre-norm layer whose attention runs on SDPA takes q, k, v as the QKV projection's head
views (:func:`sdpa_head_views`; False: views of the projection output taken outside it, whose
gradients autograd concatenates; for measurements and tests)."""


def _check_layout(layout: Any, where: str) -> str:
    """``layout`` if it is one of ``LAYOUTS`` ("sbh", "bsh"); a ValueError naming it otherwise."""
    if not isinstance(layout, str) or layout not in ("sbh", "bsh"):
        raise ValueError(f"{where}: layout must be 'sbh' (x is (S, B, H)) or 'bsh' (x is (B, S, H)), got {layout!r}")
    return layout
