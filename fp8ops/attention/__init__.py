"""Attention with fused score/mask modifications, block sparsity, packed sequences and GQA.

``out, new_state = attention(q, k, v, state=None, ...)`` is scaled dot-product attention::

    s_ij   = scale * q_i . k_j               then  s_ij = score_mod(s_ij, b, h, i, j)
    out_i  = sum_j softmax_j(s_ij over the visible j) v_j
    visible(i, j) = window/causal band  &  mask_mod(b, h, i, j)  &  block_mask  &  same sequence

On CUDA it runs fused Triton kernels (``fp8ops.kernels.attention``): softmax in fp32 with exp2,
the mods compiled into the kernels, empty blocks skipped and full blocks run without the mask.
On the CPU it runs the FP32 reference math (:mod:`fp8ops.reference.attention`), so it works
everywhere and composes with ``torch.func`` and ``torch.compile``.

Mods are written once as plain Python over a few operations (arithmetic, comparisons, ``&``,
``|``, ``~`` and :data:`modmath`), and run both as PyTorch (the eager twin: the function itself)
and inside the Triton kernels (a twin generated from its source, with its derivative for the
backward)::

    @fp8ops.score_mod
    def softcap30(score, b, h, q_idx, kv_idx):
        return 30.0 * modmath.tanh(score / 30.0)

Numbers and tensors a mod closes over are captured: numbers become constants of the kernel,
tensors (read with ``modmath.load(table, index)``) become kernel arguments and get gradients when
they require them (a learned bias table). Ready mods: :func:`causal_mask`,
:func:`sliding_window_mask`, :func:`prefix_lm_mask`, :func:`document_mask`, :func:`alibi`,
:func:`softcap`, :func:`relative_position_bias`; combine masks with :func:`and_masks` /
:func:`or_masks`.

The package, one concern per module; each imports only modules below it in this list, and the
reference (``fp8ops.reference.attention``) imports none of them:

- ``op``: the public :func:`attention`, its argument handling and the choice of path;
- ``autograd``: the fused path: library ops ``fp8ops::attention_fwd/bwd``, autograd glue, vmap;
- ``layouts``: outputs allocated in the caller's memory layout;
- ``block_mask``: :class:`BlockMask` and :func:`create_block_mask`;
- ``checks``: offsets, seeds and mods checked against a call; ``intervals``: the index ranges
  of a mod's ``modmath.load`` reads, by interval arithmetic;
- ``mod_library``: the ready mods; ``mods``: :class:`ScoreMod`, :class:`MaskMod`, the
  decorators, the mask combinators and the registry of mods;
- ``codegen``: a mod's Triton twin and derivative generated from its source;
- ``mod_math``: :data:`modmath`, the math a mod may use.
"""

from __future__ import annotations

import inspect

from ..reference.attention import MASKED_ROW_LSE
from .autograd import _attention_triton, _Static  # noqa: F401  (tests, benchmarks)
from .block_mask import BlockMask, create_block_mask
from .checks import _check_mod_statically  # noqa: F401  (tests)
from .codegen import ModError  # noqa: F401  (tests)
from .mod_library import (
    alibi,
    causal_mask,
    document_mask,
    prefix_lm_mask,
    relative_position_bias,
    sliding_window_mask,
    softcap,
)
from .mod_math import _ModMath, modmath
from .mods import MaskMod, ScoreMod, and_masks, mask_mod, or_masks, score_mod
from .op import _dq_mode, _sdpa_unsupported, _use_kernels, attention  # noqa: F401  (tests)

__all__ = [
    "MASKED_ROW_LSE",
    "BlockMask",
    "MaskMod",
    "ScoreMod",
    "alibi",
    "and_masks",
    "attention",
    "causal_mask",
    "create_block_mask",
    "document_mask",
    "mask_mod",
    "modmath",
    "or_masks",
    "prefix_lm_mask",
    "relative_position_bias",
    "score_mod",
    "sliding_window_mask",
    "softcap",
]

# ModError and the private names imported above stay reachable as fp8ops.attention.<name> for the
# tests and benchmarks. Patching one here changes nothing: a test that monkeypatches one (e.g.
# _use_kernels) patches the submodule that looks it up (fp8ops.attention.op).

# doctest.testmod(fp8ops.attention) runs the examples of the names re-exported here: their
# docstrings live in the submodules, where doctest would not look from this package.
__test__ = {"modmath": _ModMath} | {
    name: obj for name, obj in list(globals().items())
    if name in __all__ and (inspect.isclass(obj) or inspect.isfunction(obj))
}
