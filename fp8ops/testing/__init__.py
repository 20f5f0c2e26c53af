"""Testing helpers of fp8ops: tolerances, comparison rules and hypothesis strategies.

Public, so that tests of code built on fp8ops can use the same rules as fp8ops' own tests.

- :mod:`fp8ops.testing.tolerances`: per-format quantization bounds, the comparison rule
  "error vs the FP32 reference <= k x (error of plain PyTorch at the same precision) + atol",
  bitwise equality and SQNR. Needs only torch; its names are re-exported here.
- :mod:`fp8ops.testing.states`: :func:`~fp8ops.testing.states.calibrate`, an op's state with
  chosen calibrated scales.
- :mod:`fp8ops.testing.distributed`: modules over pure ops and a tensor-parallel layer shard for
  ``fully_shard`` / DDP, and :func:`~fp8ops.testing.distributed.count_all_reduces`.
- :mod:`fp8ops.testing.attention_inputs`: seeded q/k/v in each attention layout, a fused QKV
  projection's strided slices and a causal document mask, on any device.
- :mod:`fp8ops.testing.kernel_calls`: one call of each library op a model step runs, on any
  device (the traced kernels' checks).
- :mod:`fp8ops.testing.tied_head`: seeded inputs and a loss for an embedding tied to its output
  head (``fp8ops.tied_embedding`` against plain PyTorch and the reference), on any device.
- :mod:`fp8ops.testing.dropout_hash`: the attention and norm kernels' dropout hash in plain Python
  integers, a model to pin their masks against.
- :mod:`fp8ops.testing.strategies`: hypothesis strategies for shapes, tensors, recipes, scales,
  amax observations and scaling states. Needs ``hypothesis`` (the ``test`` extra); import it
  explicitly: ``from fp8ops.testing import strategies``.
"""

from .tolerances import (
    E4M3_HALF_ULP,
    E4M3_SMALLEST_NORMAL,
    E5M2_HALF_ULP,
    E5M2_SMALLEST_NORMAL,
    HALF_ULP_REL,
    SMALLEST_NORMAL,
    RuleErrors,
    assert_close_rule,
    assert_same_bits,
    half_ulp_rel,
    rel_error,
    smallest_normal,
    sqnr,
)

__all__ = [
    "E4M3_HALF_ULP",
    "E4M3_SMALLEST_NORMAL",
    "E5M2_HALF_ULP",
    "E5M2_SMALLEST_NORMAL",
    "HALF_ULP_REL",
    "SMALLEST_NORMAL",
    "RuleErrors",
    "assert_close_rule",
    "assert_same_bits",
    "half_ulp_rel",
    "rel_error",
    "smallest_normal",
    "sqnr",
]
