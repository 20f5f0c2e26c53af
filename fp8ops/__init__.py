"""fp8ops: functional FP8 training ops for PyTorch.

Ops are pure functions ``(inputs, state, *, recipe) -> (outputs, new_state)`` with explicit,
immutable scaling state; they run on CPU (the FP32 reference math) and on CUDA (Triton kernels),
and compose with ``torch.func`` and ``torch.compile``.
"""

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
    "SCHEMA_VERSION",
    "CurrentScaling",
    "DelayedScaling",
    "FakeQuantState",
    "GemmSpec",
    "LinearState",
    "Float8Value",
    "Format",
    "OpState",
    "Recipe",
    "Role",
    "ScalingState",
    "WeightCache",
    "compute_scale",
    "dequantize",
    "fake_quantize",
    "fp8_linear",
    "load_state_dict",
    "make_probes",
    "merge",
    "merge_batched",
    "quantize",
    "quantize_weight",
    "state_dict",
    "update",
]
