"""fp8ops: functional FP8 training ops for PyTorch.

Ops are pure functions ``(inputs, state, *, recipe) -> (outputs, new_state)`` with explicit,
immutable scaling state; they run on CPU (the FP32 reference math) and on CUDA (Triton kernels),
and compose with ``torch.func`` and ``torch.compile``.
"""

from .attention import (
    MASKED_ROW_LSE,
    BlockMask,
    MaskMod,
    ScoreMod,
    alibi,
    and_masks,
    attention,
    causal_mask,
    create_block_mask,
    document_mask,
    mask_mod,
    modmath,
    or_masks,
    prefix_lm_mask,
    relative_position_bias,
    score_mod,
    sliding_window_mask,
    softcap,
)
from .fake_quantize import FakeQuantState, fake_quantize
from .formats import E4M3_MAX, E5M2_MAX, Format, Role
from .layernorm_linear import LayerNormLinearState, layernorm_linear
from .fp8_linear import LinearState, WeightCache, fp8_linear, quantize_weight
from .fused_ln_mlp import LayerNormMLPState, fused_ln_mlp
from .linear_cross_entropy import linear_cross_entropy
from .tied_embedding import tied_embedding
from .norm import layer_norm, rms_norm
from .quantize import Float8Value, dequantize, quantize
from .recipes import CurrentScaling, DelayedScaling, GemmSpec, Recipe, compute_scale
from . import nn
from .state import OpState, ScalingState, make_probes, merge, merge_batched
from .state_dict import SCHEMA_VERSION, load_state_dict, state_dict
from .update import update

from .transformer_layer import (
    TransformerConfig,
    init_transformer_params,
    init_transformer_state,
    params_from_basic_layer,
    transformer_layer,
)
from .parallel import all_gather_weight, gather_transformer_params, shard_transformer_params
from .graph_step import GraphStep, graph_step
from .optim import adamw_, adamw_quantize_

__version__ = "0.1.0"

__all__ = [
    "E4M3_MAX",
    "E5M2_MAX",
    "MASKED_ROW_LSE",
    "SCHEMA_VERSION",
    "BlockMask",
    "CurrentScaling",
    "DelayedScaling",
    "FakeQuantState",
    "Float8Value",
    "Format",
    "GemmSpec",
    "GraphStep",
    "LayerNormLinearState",
    "LayerNormMLPState",
    "LinearState",
    "MaskMod",
    "OpState",
    "Recipe",
    "Role",
    "ScalingState",
    "ScoreMod",
    "TransformerConfig",
    "WeightCache",
    "adamw_",
    "adamw_quantize_",
    "alibi",
    "all_gather_weight",
    "and_masks",
    "attention",
    "causal_mask",
    "compute_scale",
    "create_block_mask",
    "dequantize",
    "document_mask",
    "fake_quantize",
    "fp8_linear",
    "fused_ln_mlp",
    "gather_transformer_params",
    "graph_step",
    "init_transformer_params",
    "init_transformer_state",
    "layer_norm",
    "layernorm_linear",
    "linear_cross_entropy",
    "load_state_dict",
    "make_probes",
    "mask_mod",
    "merge",
    "merge_batched",
    "modmath",
    "nn",
    "or_masks",
    "params_from_basic_layer",
    "prefix_lm_mask",
    "quantize",
    "quantize_weight",
    "relative_position_bias",
    "rms_norm",
    "score_mod",
    "shard_transformer_params",
    "sliding_window_mask",
    "softcap",
    "state_dict",
    "tied_embedding",
    "transformer_layer",
    "update",
]
