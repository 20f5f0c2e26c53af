"""transformer_layer: the GPT encoder layer of the seed tutorial as one pure function, in FP8.

``y, new_state = transformer_layer(params, x, state, config=..., recipe=...)`` with x (S, B, H), or
(B, S, H) with ``layout="bsh"``::

    pre-norm (GPT, default)                       post-norm (BERT-style)
    qkv = LN1(x) W_qkv^T + b_qkv                  qkv = x W_qkv^T + b_qkv
    q, k, v = split(qkv)   [q heads | k heads | v heads], GQA: h_kv key/value heads
    a = attention(q, k, v, causal/padding mask, attention dropout)
    s = x + dropout(a W_proj^T + b_proj)          h = LN1(x + dropout(a W_proj^T + b_proj))
    y = s + dropout_m(fc2(act(fc1(LN2(s)))))      y = LN2(h + dropout_m(fc2(act(fc1(h)))))

``dropout`` is ``config.hidden_dropout``, ``dropout_m`` is ``config.mlp_hidden_dropout`` (0 by default,
as the seed: the MLP output is added without dropout; set it to ``hidden_dropout`` for a GPT-2 block).

Built from the fused ops: :func:`fp8ops.layernorm_linear` (LN1 + QKV), :func:`fp8ops.attention`,
:func:`fp8ops.fp8_linear` (the output projection) and :func:`fp8ops.fused_ln_mlp` (LN2 + MLP). With
``recipe=None`` and ``state=None`` the same code runs without FP8, in the inputs' precision (the
projection through ``torch.nn.functional.linear``).

The state is a dict ``{"qkv": LayerNormLinearState, "proj": LinearState, "mlp": LayerNormMLPState}``
(:func:`init_transformer_state`); ``fp8ops.make_probes(state)`` gives its probes
``{"qkv": (), "proj": (), "mlp": (2,)}``. Parameters are a flat ``dict[str, Tensor]``
(:func:`init_transformer_params`, or :func:`params_from_basic_layer` from the seed's module).

References:
    NVIDIA Transformer Engine, "Getting Started" (the seed's BasicTransformerLayer) and
    ``transformer_engine.pytorch.TransformerLayer``; Vaswani et al. (2017); Radford et al., GPT-2
    (2019, pre-norm); Devlin et al., BERT (2019, post-norm); Ainslie et al., GQA (2023).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import attrs
import torch
import torch.nn.functional as F
from torch import Tensor

from ._parallel import (
    copy_to_tp,
    copy_to_tp_many,
    enter_replicated,
    exit_replicated,
    tp_config,
    transformer_shard_shapes,
    transformer_split,
)
from ._checks import NORMALIZATIONS, check_float_tensor, check_recipe, check_residual
from ._transformer_checks import (
    attention_mask_mod,
    check_params,
    check_residual_args,
    check_state,
    check_weight_caches,
    _check_layout,
    qkv_weight_cache,
    sdpa_head_views,
)
from .activation import ACTIVATIONS, GATED
from .attention import BlockMask
from .attention.autograd import qkv_heads
from .attention.op import _attention
from .layernorm_linear import LayerNormLinearState, layernorm_linear
from .fp8_linear import LinearState, WeightCache, fp8_linear
from .fused_ln_mlp import LayerNormMLPState, fused_ln_mlp
from .norm import layer_norm, rms_norm

__all__ = [
    "TransformerConfig",
    "init_transformer_params",
    "init_transformer_state",
    "params_from_basic_layer",
    "transformer_layer",
]

NORM_POSITIONS = ("pre", "post")
MASK_TYPES = ("no_mask", "causal", "padding", "padding_causal")
LAYOUTS = ("sbh", "bsh")


def _positive_int(inst: Any, attribute: Any, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"TransformerConfig: {attribute.name} must be a positive int, got {value!r}")


def _optional_positive_int(inst: Any, attribute: Any, value: Any) -> None:
    if value is not None:
        _positive_int(inst, attribute, value)


def _probability(inst: Any, attribute: Any, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
        raise ValueError(f"TransformerConfig: {attribute.name} must be a number in [0, 1), got {value!r}")


def _one_of(options: tuple[str, ...]) -> Any:
    def check(inst: Any, attribute: Any, value: Any) -> None:
        if value not in options:
            raise ValueError(f"TransformerConfig: {attribute.name} must be one of {options}, got {value!r}")

    return check


def _boolean(inst: Any, attribute: Any, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"TransformerConfig: {attribute.name} must be a bool, got {value!r}")


@attrs.frozen(kw_only=True)
class TransformerConfig:
    """Static configuration of :func:`transformer_layer` (keyword-only, hashable, validated).

    Args:
        hidden_size: H, the model width.
        ffn_hidden_size: F, the MLP's inner width (fc1 has 2F outputs for gated activations).
        num_attention_heads: h_q, the query heads.
        num_gqa_groups: h_kv, the key/value heads (GQA; 1 is MQA); None = ``num_attention_heads``.
        kv_channels: d, the head dim; None = ``hidden_size // num_attention_heads``.
        layernorm_epsilon: epsilon of both norms.
        hidden_dropout: dropout on the attention block's output before its residual add.
        mlp_hidden_dropout: dropout on the MLP block's output before its residual add (default 0:
            none, as the seed). A GPT-2 block drops both residual branches: set it to
            ``hidden_dropout``.
        attention_dropout: dropout on the attention probabilities.
        normalization: "LayerNorm" or "RMSNorm" (no bias).
        activation: one of ``fp8ops.activation.ACTIVATIONS`` (default "gelu_tanh", the seed's).
        norm_position: "pre" (GPT: norm before each block) or "post" (BERT: norm after each
            residual add).
        fuse_qkv_params: one "qkv" weight, or separate "q", "k", "v" weights.
        self_attn_mask_type: "no_mask", "causal", "padding" or "padding_causal" (padding needs
            ``attention_mask`` or packed ``cu_seqlens``).
        bias: whether the linear layers (and LayerNorms) have biases.
        zero_centered_gamma: norms scale by ``1 + weight`` (weights initialised to 0).

    Raises:
        ValueError, TypeError: a field is out of range (the message names it).

    Example:
        >>> import fp8ops
        >>> cfg = fp8ops.TransformerConfig(hidden_size=64, ffn_hidden_size=256, num_attention_heads=4,
        ...                                num_gqa_groups=2)
        >>> cfg.head_dim, cfg.num_kv_heads, cfg.param_shapes()["qkv.weight"]
        (16, 2, (128, 64))
    """

    hidden_size: int = attrs.field(validator=_positive_int)
    ffn_hidden_size: int = attrs.field(validator=_positive_int)
    num_attention_heads: int = attrs.field(validator=_positive_int)
    num_gqa_groups: int | None = attrs.field(default=None, validator=_optional_positive_int)
    kv_channels: int | None = attrs.field(default=None, validator=_optional_positive_int)
    layernorm_epsilon: float = 1e-5
    hidden_dropout: float = attrs.field(default=0.1, validator=_probability)
    mlp_hidden_dropout: float = attrs.field(default=0.0, validator=_probability)
    attention_dropout: float = attrs.field(default=0.1, validator=_probability)
    normalization: str = attrs.field(default="LayerNorm", validator=_one_of(NORMALIZATIONS))
    activation: str = attrs.field(default="gelu_tanh", validator=_one_of(tuple(ACTIVATIONS)))
    norm_position: str = attrs.field(default="pre", validator=_one_of(NORM_POSITIONS))
    fuse_qkv_params: bool = attrs.field(default=True, validator=_boolean)
    self_attn_mask_type: str = attrs.field(default="no_mask", validator=_one_of(MASK_TYPES))
    bias: bool = attrs.field(default=True, validator=_boolean)
    zero_centered_gamma: bool = attrs.field(default=False, validator=_boolean)

    def __attrs_post_init__(self) -> None:
        eps = self.layernorm_epsilon
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0 or not math.isfinite(eps):
            raise ValueError(f"TransformerConfig: layernorm_epsilon must be a positive number, got {eps!r}")
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads != 0:
            raise ValueError(
                f"TransformerConfig: hidden_size ({self.hidden_size}) must be a multiple of num_attention_heads "
                f"({self.num_attention_heads}), or set kv_channels (the head dim) explicitly"
            )
        if self.num_attention_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"TransformerConfig: num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_gqa_groups ({self.num_gqa_groups})"
            )

    @property
    def head_dim(self) -> int:
        """d: ``kv_channels``, or ``hidden_size // num_attention_heads``."""
        return self.kv_channels if self.kv_channels is not None else self.hidden_size // self.num_attention_heads

    @property
    def num_kv_heads(self) -> int:
        """h_kv: ``num_gqa_groups``, or ``num_attention_heads``."""
        return self.num_gqa_groups if self.num_gqa_groups is not None else self.num_attention_heads

    @property
    def causal(self) -> bool:
        """Whether queries see only earlier keys ("causal" and "padding_causal")."""
        return self.self_attn_mask_type in ("causal", "padding_causal")

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """The parameters of the layer: key -> shape, in a fixed order (see :func:`init_transformer_params`)."""
        H, F_, d = self.hidden_size, self.ffn_hidden_size, self.head_dim
        hq, hkv = self.num_attention_heads, self.num_kv_heads
        C = 2 * F_ if self.activation in GATED else F_
        norm_bias = self.bias and self.normalization == "LayerNorm"
        shapes: dict[str, tuple[int, ...]] = {"ln1.weight": (H,)}
        if norm_bias:
            shapes["ln1.bias"] = (H,)
        linears: list[tuple[str, int, int]] = []
        if self.fuse_qkv_params:
            linears.append(("qkv", (hq + 2 * hkv) * d, H))
        else:
            linears += [("q", hq * d, H), ("k", hkv * d, H), ("v", hkv * d, H)]
        linears.append(("proj", H, hq * d))
        for name, n, k in linears:
            shapes[f"{name}.weight"] = (n, k)
            if self.bias:
                shapes[f"{name}.bias"] = (n,)
        shapes["ln2.weight"] = (H,)
        if norm_bias:
            shapes["ln2.bias"] = (H,)
        for name, n, k in (("fc1", C, H), ("fc2", H, F_)):
            shapes[f"{name}.weight"] = (n, k)
            if self.bias:
                shapes[f"{name}.bias"] = (n,)
        return shapes


# ------------------------------------------------------------------------------------------------
# Parameters and state


def _check_config(config: Any, where: str) -> TransformerConfig:
    if not isinstance(config, TransformerConfig):
        raise TypeError(f"{where}: config must be a fp8ops.TransformerConfig, got {type(config).__name__}")
    return config


def init_transformer_params(
    config: TransformerConfig,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
    generator: torch.Generator | None = None,
) -> dict[str, Tensor]:
    """Fresh parameters of :func:`transformer_layer`: a flat ``dict[str, Tensor]``.

    Keys (``config.param_shapes()``): ``ln1.weight``, ``ln1.bias``, ``qkv.weight``
    ((h_q + 2 h_kv)·d, H) with rows [all q heads | all k heads | all v heads] (or ``q``/``k``/``v``
    weights when ``fuse_qkv_params`` is False), ``proj.weight`` (H, h_q·d), ``ln2.*``,
    ``fc1.weight`` (C, H) with C = F or 2F for gated activations ([a | b] halves), ``fc2.weight``
    (H, F), and a ``.bias`` for each linear layer. Bias keys are absent when ``config.bias`` is
    False; RMSNorm has no norm biases.

    Initialisation (Transformer Engine's): linear weights ~ N(0, 0.02²), the output projections
    (``proj``, ``fc2``) too; biases 0; norm weights 1 (0 with ``zero_centered_gamma``).

    Args:
        config: the layer's :class:`TransformerConfig`.
        dtype: parameter dtype (float32, bfloat16 or float16).
        device: where to allocate.
        generator: a ``torch.Generator`` for reproducible weights (on ``device``'s type, or CPU).

    Returns:
        ``dict[str, Tensor]`` of leaf tensors (not requiring grad; call ``requires_grad_()``).

    Example:
        >>> import torch, fp8ops
        >>> cfg = fp8ops.TransformerConfig(hidden_size=32, ffn_hidden_size=64, num_attention_heads=4)
        >>> params = fp8ops.init_transformer_params(cfg, generator=torch.Generator().manual_seed(0))
        >>> {k: tuple(v.shape) for k, v in params.items() if k.startswith("qkv")}
        {'qkv.weight': (96, 32), 'qkv.bias': (96,)}
    """
    where = "init_transformer_params"
    _check_config(config, where)
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"{where}: dtype must be float32, bfloat16 or float16, got {dtype}")
    gen_device = generator.device if generator is not None else device
    params: dict[str, Tensor] = {}
    for key, shape in config.param_shapes().items():
        if key.startswith(("ln1.", "ln2.")):
            fill = 1.0 if key.endswith(".weight") and not config.zero_centered_gamma else 0.0
            t = torch.full(shape, fill, dtype=torch.float32, device=device)
        elif key.endswith(".bias"):
            t = torch.zeros(shape, dtype=torch.float32, device=device)
        else:
            t = torch.randn(shape, generator=generator, dtype=torch.float32, device=gen_device) * 0.02
            t = t.to(device) if device is not None else t
        params[key] = t.to(dtype)
    return params


def params_from_basic_layer(state_dict: Mapping[str, Tensor], config: TransformerConfig) -> dict[str, Tensor]:
    """Parameters of :func:`transformer_layer` from the seed's ``BasicTransformerLayer.state_dict()``.

    The seed's ``qkv_projection`` is viewed per head as (S, B, h, 3d) and split, so its rows are
    interleaved per head: [q_0 | k_0 | v_0 | q_1 | k_1 | v_1 | ...] (d rows each). The fused
    ``qkv.weight`` here is [all q heads | all k heads | all v heads]; this function reorders the
    rows (and the bias) and renames the rest (``projection`` -> ``proj``, ``mlp.linear1`` ->
    ``fc1``, ``mlp.linear2`` -> ``fc2``). It is made of differentiable tensor ops, so gradients
    taken through it land on the seed's tensors in the seed's layout (pass
    ``module.state_dict(keep_vars=True)`` or tensors that require grad). Every returned tensor is
    a new one (no storage shared with ``state_dict``).

    ``config`` must describe the seed's parameter layout: LayerNorm with biases, no GQA, the default
    head dim, a non-gated activation. The seed layer itself is pre-norm with ``gelu_tanh``; other
    ``norm_position`` / ``activation`` / mask settings give a different function of the same
    parameters.

    Args:
        state_dict: the seed module's state dict (keys ``ln1.weight``, ``qkv_projection.weight``, ...).
        config: the :class:`TransformerConfig` of the functional layer.

    Returns:
        The flat parameter dict (keys as :func:`init_transformer_params`).

    Raises:
        KeyError: a seed key is missing (named).
        ValueError: ``config`` does not describe the seed's layout, or a tensor has the wrong shape.

    Example:
        >>> import torch, fp8ops
        >>> from fp8ops.reference.transformer_layer import BasicTransformerLayer
        >>> seed = BasicTransformerLayer(32, 64, 4, attention_dropout=0.0, hidden_dropout=0.0)
        >>> cfg = fp8ops.TransformerConfig(hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
        ...                                hidden_dropout=0.0, attention_dropout=0.0)
        >>> params = fp8ops.params_from_basic_layer(seed.state_dict(), cfg)
        >>> x = torch.randn(8, 2, 32)
        >>> y, _ = fp8ops.transformer_layer(params, x, None, config=cfg, recipe=None)
        >>> torch.allclose(y, seed(x), atol=1e-5)
        True
    """
    where = "params_from_basic_layer"
    cfg = _check_config(config, where)
    wrong = []
    if cfg.normalization != "LayerNorm":
        wrong.append(f"normalization={cfg.normalization!r} (the seed has LayerNorm)")
    if not cfg.bias:
        wrong.append("bias=False (the seed's layers have biases)")
    if cfg.num_kv_heads != cfg.num_attention_heads:
        wrong.append(f"num_gqa_groups={cfg.num_gqa_groups} (the seed has no GQA)")
    if cfg.head_dim * cfg.num_attention_heads != cfg.hidden_size:
        wrong.append(f"kv_channels={cfg.kv_channels} (the seed's head dim is hidden_size // num_attention_heads)")
    if cfg.activation in GATED:
        wrong.append(f"activation={cfg.activation!r} (the seed's MLP is not gated)")
    if cfg.zero_centered_gamma:
        wrong.append("zero_centered_gamma=True (the seed's LayerNorm weights are plain)")
    if wrong:
        raise ValueError(f"{where}: config does not describe the seed's layer: " + "; ".join(wrong))
    H, h, d, F_ = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.ffn_hidden_size
    names = {
        "ln1.weight": ("ln1.weight", (H,)), "ln1.bias": ("ln1.bias", (H,)),
        "qkv.weight": ("qkv_projection.weight", (3 * H, H)), "qkv.bias": ("qkv_projection.bias", (3 * H,)),
        "proj.weight": ("projection.weight", (H, H)), "proj.bias": ("projection.bias", (H,)),
        "ln2.weight": ("ln2.weight", (H,)), "ln2.bias": ("ln2.bias", (H,)),
        "fc1.weight": ("mlp.linear1.weight", (F_, H)), "fc1.bias": ("mlp.linear1.bias", (F_,)),
        "fc2.weight": ("mlp.linear2.weight", (H, F_)), "fc2.bias": ("mlp.linear2.bias", (H,)),
    }
    out: dict[str, Tensor] = {}
    for key, (seed_key, shape) in names.items():
        if seed_key not in state_dict:
            raise KeyError(f"{where}: state_dict has no {seed_key!r} (expected the seed BasicTransformerLayer's keys)")
        t = state_dict[seed_key]
        if not isinstance(t, Tensor) or tuple(t.shape) != shape:
            got = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(f"{where}: state_dict[{seed_key!r}] must have shape {shape} for this config, got {got}")
        if key == "qkv.weight":
            # rows (h, 3, d) -> (3, h, d): per-head [q_h | k_h | v_h] to [all q | all k | all v]
            t = t.reshape(h, 3, d, H).transpose(0, 1).reshape(3 * H, H)
        elif key == "qkv.bias":
            t = t.reshape(h, 3, d).transpose(0, 1).reshape(3 * H)
        out[key] = t.clone(memory_format=torch.contiguous_format)
    if not cfg.fuse_qkv_params:
        w, b = out.pop("qkv.weight"), out.pop("qkv.bias")
        for i, name in enumerate("qkv"):
            out[f"{name}.weight"] = w[i * H:(i + 1) * H].clone()
            out[f"{name}.bias"] = b[i * H:(i + 1) * H].clone()
    return {k: out[k] for k in cfg.param_shapes()}


def init_transformer_state(
    config: TransformerConfig,
    recipe: Any,
    *,
    device: torch.device | str | None = None,
) -> dict[str, Any]:
    """A fresh scaling state for :func:`transformer_layer`.

    Returns:
        ``{"qkv": LayerNormLinearState, "proj": LinearState, "mlp": LayerNormMLPState}``, each
        built with ``recipe.init`` per role; ``fp8ops.make_probes`` of it gives
        ``{"qkv": (), "proj": (), "mlp": (2,)}`` float32 zeros.

    Example:
        >>> import fp8ops
        >>> cfg = fp8ops.TransformerConfig(hidden_size=32, ffn_hidden_size=64, num_attention_heads=4)
        >>> st = fp8ops.init_transformer_state(cfg, fp8ops.DelayedScaling())
        >>> {k: tuple(p.shape) for k, p in fp8ops.make_probes(st).items()}
        {'qkv': (), 'proj': (), 'mlp': (2,)}
    """
    where = "init_transformer_state"
    _check_config(config, where)
    check_recipe(recipe, where)
    return {
        "qkv": LayerNormLinearState.init(recipe, device=device),
        "proj": LinearState.init(recipe, device=device),
        "mlp": LayerNormMLPState.init(recipe, device=device),
    }


# ------------------------------------------------------------------------------------------------
# The layer


def _norm(x: Tensor, params: Mapping[str, Tensor], name: str, cfg: TransformerConfig, residual: Tensor,
          dropout: float = 0.0) -> tuple[Tensor, Tensor]:
    """(norm(x + residual), x + residual) with the layer's normalization; with ``dropout`` x is
    dropped first, in the norm's kernel (a seed drawn from torch's generator)."""
    kw = {"eps": cfg.layernorm_epsilon, "zero_centered_gamma": cfg.zero_centered_gamma, "residual": residual,
          "residual_dropout": dropout}
    if cfg.normalization == "RMSNorm":
        out, _ = rms_norm(x, params[f"{name}.weight"], None, **kw)
    else:
        out, _ = layer_norm(x, params[f"{name}.weight"], params.get(f"{name}.bias"), None, **kw)
    return out


def _hp_linear(x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
    return F.linear(x, w.to(x.dtype), None if b is None else b.to(x.dtype))



def transformer_layer(
    params: Mapping[str, Tensor],
    x: Tensor,
    state: dict[str, Any] | None,
    *,
    config: TransformerConfig,
    recipe: Any,
    probes: dict[str, Tensor | None] | None = None,
    attention_mask: Tensor | None = None,
    block_mask: BlockMask | None = None,
    cu_seqlens: Tensor | None = None,
    max_seqlen: int | None = None,
    training: bool = True,
    dropout_seed: int | Tensor | None = None,
    layout: str = "sbh",
    tp_group: Any = None,
    sequence_parallel: bool = False,
    weight_cache: Mapping[str, WeightCache] | None = None,
    residual: Tensor | None = None,
    return_residual: bool = False,
) -> tuple[Any, dict[str, Any] | None]:
    """One transformer encoder layer (the seed's GPT layer, generalised) with FP8 GEMMs.

    Math (pre-norm; post-norm in the module docstring)::

        q, k, v = split(LN1(x) W_qkv^T + b_qkv)           [h_q·d | h_kv·d | h_kv·d]
        s = x + dropout_h(attention(q, k, v) W_proj^T + b_proj)
        y = s + dropout_m(act(LN2(s) W_fc1^T + b_fc1) W_fc2^T + b_fc2)

    The attention is ``softmax(q k^T / sqrt(d))`` over the visible keys (causal and/or padding
    masks, the sequence of each token when packed), each key/value head shared by
    h_q / h_kv consecutive query heads. ``dropout_h`` is ``config.hidden_dropout``;
    ``dropout_m`` is ``config.mlp_hidden_dropout``, 0 by default (the MLP output is added without
    dropout, as in the seed).

    Args:
        params: the flat parameter dict (:func:`init_transformer_params`, keys and shapes
            ``config.param_shapes()``); differentiable (``torch.func.grad`` over it works).
        x: (S, B, H) (the seed's "sbhd" layout; (B, S, H) with ``layout="bsh"``), or packed
            (T, H) tokens with ``cu_seqlens``; float32, bfloat16 or float16. y has its shape and
            dtype.
        state: the dict of :func:`init_transformer_state`, or None with ``recipe=None``.
        config: the :class:`TransformerConfig`.
        recipe: the FP8 recipe the state was built with, or None (no FP8: every GEMM in the
            inputs' precision).
        probes: ``fp8ops.make_probes(state)`` (fresh for each forward): the output-gradient
            amaxes leave through their gradients; None quantizes gradients with current scaling.
        attention_mask: (B, S) bool, True at valid (non-padding) tokens; keys at False are
            hidden. Needs ``self_attn_mask_type`` "padding" or "padding_causal".
        block_mask: a :class:`fp8ops.BlockMask` for (S, S) (its ``mask_mod`` defines the mask);
            not with ``attention_mask`` (fold the padding into the block mask's ``mask_mod``).
        cu_seqlens: (N + 1,) int32 start offsets of the packed sequences in x (T, H).
        max_seqlen: the longest packed sequence (computed with a host sync if None).
        training: apply dropout (``config.hidden_dropout`` then ``config.mlp_hidden_dropout``
            with torch's generator, ``config.attention_dropout`` inside the attention op).
        dropout_seed: seed of the attention dropout mask (int or 1-element integer tensor); None
            draws one from torch's generator.
        layout: ``"sbh"`` (default: x and y are (S, B, H), sequence first, as the seed) or
            ``"bsh"`` (batch first: x and y are (B, S, H)). For ``"bsh"`` the layer runs on the
            (S, B, H) view ``x.transpose(0, 1)`` and returns ``y`` as the (B, S, H) view of its
            (S, B, H) result, so it computes exactly (bit for bit, gradients too) what ``"sbh"``
            computes on the transposed input, and a stack of ``"bsh"`` layers makes no copies
            between layers (y is not contiguous; its transpose is). ``attention_mask`` is (B, S)
            in both layouts. Ignored for packed (T, H) tokens.
        tp_group: a ``torch.distributed`` process group for tensor parallelism, or None. params
            are then this rank's shard (:func:`fp8ops.shard_transformer_params`): QKV and fc1
            column-parallel, the projection and fc2 row-parallel, the heads (and GQA groups) and
            the MLP width split across the group; the state observes this rank's amaxes.
        sequence_parallel: with ``tp_group``, x and y are this rank's contiguous slice of the
            sequence (S/w rows of (S, B, H)); dropout, residuals and the post-norm norms run on
            the slice. See ``docs/parallel.md``.
        weight_cache: FP8 weights quantized once per optimizer step, reused by every micro-batch:
            a dict from GEMM weight key ("qkv.weight", or "q.weight" / "k.weight" / "v.weight"
            unfused; "proj.weight", "fc1.weight", "fc2.weight"), any subset, to
            ``quantize_weight(params[key], role, recipe=recipe)`` with the state's role of that
            weight: ``state["qkv"].weight`` (also for q, k, v), ``state["proj"].weight``,
            ``state["mlp"].fc1_weight``, ``state["mlp"].fc2_weight``; pass the state
            ``quantize_weight`` returns (it holds amax(W)). Unfused q, k, v caches are used together
            under a calibrated delayed scale; otherwise the op quantizes their concatenation.
        residual: pre-norm only: x's shape and dtype, or None. The layer's input is then
            ``x + residual``, added by LN1's kernel (which normalises the sum) instead of a
            separate add (and, in the backward, LN1 adds the gradient of the sum's other use).
        return_residual: pre-norm only: return ``(m, s)`` with ``y = s + m`` unsummed (m the MLP
            branch after its dropout, s the residual stream after the attention block), to be
            passed on as the next layer's ``(x, residual)``. A stack of layers then runs no
            residual add kernel of its own: each sum is written by the next norm (the last one by
            ``fp8ops.layer_norm(m, ..., residual=s)``).

    Returns:
        ``(y, new_state)``: y like x (``((m, s), new_state)`` with ``return_residual``);
        ``new_state`` with this call's forward amaxes recorded (None without a recipe). Call ``fp8ops.update(state, recipe=..., grad_amax=probe grads)``
        once per optimizer step.

    Raises:
        TypeError, ValueError: bad config, params (missing keys, wrong shapes: the key and the
            expected shape are named), state, x shape, mask arguments or ``weight_cache``
            (unknown key, not a WeightCache, no recipe, stale or from another weight).

    Example:
        >>> import torch, fp8ops
        >>> cfg = fp8ops.TransformerConfig(hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
        ...                                self_attn_mask_type="causal")
        >>> params = {k: v.requires_grad_() for k, v in fp8ops.init_transformer_params(cfg).items()}
        >>> recipe = fp8ops.DelayedScaling()
        >>> state = fp8ops.init_transformer_state(cfg, recipe)
        >>> probes = fp8ops.make_probes(state)
        >>> x = torch.randn(8, 2, 32)                                  # (S, B, H)
        >>> y, state = fp8ops.transformer_layer(params, x, state, config=cfg, recipe=recipe, probes=probes)
        >>> y.shape
        torch.Size([8, 2, 32])
        >>> y.square().mean().backward()
        >>> grad_amax = {k: p.grad for k, p in probes.items()}
        >>> state = fp8ops.update(state, recipe=recipe, grad_amax=grad_amax)
        >>> bool(state["proj"].grad_output.calibrated)
        True

    References:
        NVIDIA Transformer Engine quickstart and ``TransformerLayer``; Ainslie et al., GQA (2023).
    """
    where = "transformer_layer"
    cfg = _check_config(config, where)
    tp = tp_config(where, tp_group, None, sequence_parallel)
    # with tp_group, params are this rank's shard: (the group size, the shard's parameter shapes)
    shard = (1, None) if tp is None else (tp.world, transformer_shard_shapes(cfg, tp.world, cfg.activation in GATED,
                                                                             where))
    # Step 1: validate.
    check_float_tensor(x, "x", where)
    _check_layout(layout, where)
    H = cfg.hidden_size
    packed = cu_seqlens is not None
    if layout == "bsh" and not packed:
        if x.dim() != 3 or x.shape[2] != H:
            raise ValueError(f"{where}: with layout='bsh', x must be (B, S, H) = (B, S, {H}), got {tuple(x.shape)}")
        # Batch first: run the sequence-first layer on the transposed view (exact), return the view back.
        if residual is not None:
            check_residual(residual, x, where)
            residual = residual.transpose(0, 1)
        y, new_state = transformer_layer(
            params, x.transpose(0, 1), state, config=cfg, recipe=recipe, probes=probes,
            attention_mask=attention_mask, block_mask=block_mask, cu_seqlens=None, max_seqlen=max_seqlen,
            training=training, dropout_seed=dropout_seed, layout="sbh", tp_group=tp_group,
            sequence_parallel=sequence_parallel, weight_cache=weight_cache, residual=residual,
            return_residual=return_residual)
        if return_residual:
            return (y[0].transpose(0, 1), y[1].transpose(0, 1)), new_state
        return y.transpose(0, 1), new_state
    if packed:
        if x.dim() != 2 or x.shape[1] != H:
            raise ValueError(f"{where}: with cu_seqlens, x must be packed tokens (T, H) = (T, {H}), got {tuple(x.shape)}")
    elif x.dim() != 3 or x.shape[2] != H:
        raise ValueError(
            f"{where}: x must be (S, B, H) = (S, B, {H}) (sequence first, as the seed), got {tuple(x.shape)}; "
            f"pass layout='bsh' for batch-first (B, S, H), or cu_seqlens for packed (T, H) tokens"
        )
    check_params(params, cfg, x, where, shard[1])
    check_state(state, probes, recipe, where)
    check_residual_args(residual, return_residual, cfg, x, where)
    caches = check_weight_caches(weight_cache, params, state, recipe, where)
    if recipe is None and probes is not None:
        raise ValueError(f"{where}: probes given with recipe=None (there is no FP8 state to observe into)")
    mask_mod = attention_mask_mod(attention_mask, cfg, x, packed, block_mask,
                                  tp.world if tp is not None and tp.sp else 1, where)
    if not isinstance(training, bool):
        raise TypeError(f"{where}: training must be a bool, got {training!r}")

    fp8 = recipe is not None
    p = params
    if tp is not None and tp.sp:
        # The replicated parameters (norms, row-parallel biases) enter through one autograd node
        # whose backward sums all their gradients over the group in one all-reduce; inside, the
        # ops leave them as they are.
        tp_split = transformer_split(cfg, cfg.activation in GATED)
        p = {**p, **copy_to_tp_many({k: v for k, v in p.items() if v is not None and k in tp_split
                                     and tp_split[k] is None}, tp.group)}
        enter_replicated()
    try:
        st: dict[str, Any] = dict(state) if fp8 else {}  # type: ignore[arg-type]
        pr: Mapping[str, Any] = probes if probes is not None else {"qkv": None, "proj": None, "mlp": None}
        hq, hkv, d = cfg.num_attention_heads // shard[0], cfg.num_kv_heads // shard[0], cfg.head_dim
        norm_kw = {"normalization": cfg.normalization, "eps": cfg.layernorm_epsilon,
                   "zero_centered_gamma": cfg.zero_centered_gamma}
        if cfg.fuse_qkv_params:
            w_qkv, b_qkv = p["qkv.weight"], p.get("qkv.bias")
        else:
            w_qkv = torch.cat([p["q.weight"], p["k.weight"], p["v.weight"]])
            b_qkv = torch.cat([p["q.bias"], p["k.bias"], p["v.bias"]]) if cfg.bias else None
        c_qkv = qkv_weight_cache(caches, w_qkv, state, recipe) if caches else None
        new_state: dict[str, Any] = {}
        col = row = mlp_tp = {}
        pn = p  # the post-norms' parameters: with SP a rank normalises its slice, their gradients are partial sums
        if tp is not None:
            mlp_tp = {"tp_group": tp_group, "sequence_parallel": tp.sp}
            col, row = {**mlp_tp, "parallel_mode": "column"}, {**mlp_tp, "parallel_mode": "row"}
            pn = {k: copy_to_tp(v, tp.group) for k, v in p.items() if k.startswith("ln")} if tp.sp else p

        # Step 2: the QKV projection (fused with LN1 in pre-norm).
        heads = sdpa_head_views(cfg, x, packed, tp, mask_mod, block_mask, training, d)
        if cfg.norm_position == "pre":
            # LN1's kernel writes x + residual (with one) and normalises it; for SDPA: the head views
            qkv, new_state["qkv"] = layernorm_linear(
                x, p["ln1.weight"], p.get("ln1.bias"), w_qkv, b_qkv, st.get("qkv"), recipe=recipe,
                grad_probe=pr["qkv"], weight_cache=c_qkv, residual=residual, qkv_heads=(hq, hkv, d) if heads else None,
                **norm_kw, **col)
            if residual is not None:
                qkv, x = qkv
        elif fp8 or tp:  # post-norm: the QKV input is x itself (a LayerNormLinearState is a LinearState)
            qkv, new_state["qkv"] = fp8_linear(x, w_qkv, b_qkv, st.get("qkv"), recipe=recipe, grad_probe=pr["qkv"],
                                               weight_cache=c_qkv, **col)
        else:
            qkv = _hp_linear(x, w_qkv, b_qkv)

        # Step 3: attention on per-head views of the projection, (S, B, h, d) or packed (T, h, d).
        if heads:
            ctx = _attention(*qkv, causal=cfg.causal, layout="bhsd")[0].permute(2, 0, 1, 3).reshape(*x.shape[:-1], hq * d)
        else:
            lead = qkv.shape[:-1]
            q, k, v = qkv_heads(qkv, hq, hkv, d)
            attn_kw: dict[str, Any] = {}
            if packed:
                attn_kw = {"cu_seqlens_q": cu_seqlens, "max_seqlen_q": max_seqlen}
            else:
                attn_kw = {"layout": "sbhd"}
            # qkv: where the fused kernels run, its gradient comes back as one tensor (no concatenation)
            ctx, _ = _attention(q, k, v, causal=cfg.causal, mask_mod=mask_mod, block_mask=block_mask,
                                dropout_p=cfg.attention_dropout if training else 0.0, dropout_seed=dropout_seed,
                                qkv=qkv, **attn_kw)
            ctx = ctx.reshape(*lead, hq * d)

        # Step 4: the output projection, hidden dropout and the first residual.
        if fp8 or tp:
            out, new_state["proj"] = fp8_linear(ctx, p["proj.weight"], p.get("proj.bias"), st.get("proj"), recipe=recipe,
                                                grad_probe=pr["proj"], weight_cache=caches.get("proj.weight"), **row)
        else:
            out = _hp_linear(ctx, p["proj.weight"], p.get("proj.bias"))
        # Without tensor parallelism the hidden dropout runs inside the norm kernel that adds the
        # residual (a hash mask of a seed drawn from torch's generator: no mask stored, no pass of
        # its own): the MLP's norm (pre-norm) or LN1 (post-norm); with it, F.dropout.
        hidden_drop = cfg.hidden_dropout if training else 0.0
        fuse_drop = tp is None
        if hidden_drop > 0 and not fuse_drop:
            out = F.dropout(out, hidden_drop, training=True)
        mlp_drop = cfg.mlp_hidden_dropout if training else 0.0

        # Step 5: the MLP (fused with its norm) and the second residual.
        mlp_kw = {"activation": cfg.activation, "grad_probe": pr["mlp"], **norm_kw, **mlp_tp,
                  "weight_cache": (caches.get("fc1.weight"), caches.get("fc2.weight")) if caches else None}
        mlp_params = (p["fc1.weight"], p.get("fc1.bias"), p["fc2.weight"], p.get("fc2.bias"))
        if cfg.norm_position == "pre":
            # s = x + out: written by the MLP's norm kernel, which normalises it (and in the
            # backward adds the residual stream's gradient into its dx).
            (m, s), new_state["mlp"] = fused_ln_mlp(out, p["ln2.weight"], p.get("ln2.bias"), *mlp_params,
                                                    st.get("mlp"), recipe=recipe, residual=x,
                                                    residual_dropout=hidden_drop if fuse_drop else 0.0, **mlp_kw)
            if mlp_drop > 0:
                m = F.dropout(m, mlp_drop, training=True)
            if return_residual:
                return (m, s), (new_state if fp8 else None)
            y = s + m
        else:
            # h = LN1(x + out) is both the MLP input (normalised again inside the fused op, which
            # quantizes its own LN output) and the residual.
            h, s = _norm(out, pn, "ln1", cfg, residual=x, dropout=hidden_drop if fuse_drop else 0.0)
            m, new_state["mlp"] = fused_ln_mlp(s, p["ln1.weight"], p.get("ln1.bias"), *mlp_params, st.get("mlp"),
                                               recipe=recipe, **mlp_kw)
            if mlp_drop > 0 and not fuse_drop:
                m = F.dropout(m, mlp_drop, training=True)
            y, _ = _norm(m, pn, "ln2", cfg, residual=h, dropout=mlp_drop if fuse_drop else 0.0)
        return y, (new_state if fp8 else None)
    finally:
        if tp is not None and tp.sp:
            exit_replicated()
