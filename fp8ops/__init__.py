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
from .linear import LinearState, WeightCache, fp8_linear, quantize_weight
from .quantize import Float8Value, dequantize, quantize
from .recipes import CurrentScaling, DelayedScaling, GemmSpec, Recipe, compute_scale
from .state import (
    SCHEMA_VERSION,
    OpState,
    ScalingState,
    load_state_dict,
    make_probes,
    merge,
    merge_batched,
    state_dict,
    update,
)

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
    "LinearState",
    "MaskMod",
    "OpState",
    "Recipe",
    "Role",
    "ScalingState",
    "ScoreMod",
    "WeightCache",
    "alibi",
    "and_masks",
    "attention",
    "causal_mask",
    "compute_scale",
    "create_block_mask",
    "dequantize",
    "document_mask",
    "fake_quantize",
    "fp8_linear",
    "load_state_dict",
    "make_probes",
    "mask_mod",
    "merge",
    "merge_batched",
    "modmath",
    "or_masks",
    "prefix_lm_mask",
    "quantize",
    "quantize_weight",
    "relative_position_bias",
    "score_mod",
    "sliding_window_mask",
    "softcap",
    "state_dict",
    "update",
]
