"""MLP activation kernels fused with the FP8 casts around them.

In an FP8 MLP ``y = fc2(act(fc1(x)))`` the activation sits between two GEMMs: its output is fc2's
FP8 input, and in backward its input gradient is fc1's FP8 output gradient. These kernels read the
high-precision tensor once and write the FP8 operands (and their transposed copies) directly, so the
activation costs no extra pass over memory.

Math (``h`` the fc1 output, all arithmetic in float32)::

    gelu(x)         = x * Phi(x) = 0.5 x (1 + erf(x / sqrt 2))
    gelu'(x)        = Phi(x) + x * exp(-x^2 / 2) / sqrt(2 pi)
    gelu_tanh(x)    = 0.5 x (1 + tanh(u)) = x * sigmoid(2u),   u = sqrt(2/pi) (x + 0.044715 x^3)
    gelu_tanh'(x)   = s + x s (1 - s) * 2 sqrt(2/pi) (1 + 3 * 0.044715 x^2),   s = sigmoid(2u)
    relu(x)         = x if x >= 0 else 0 (NaN stays NaN);   relu'(x) = 1 if x > 0 else 0
    squared_relu(x) = relu(x)^2;                            squared_relu'(x) = 2 relu(x)
    silu(x)         = x * sigmoid(x);                       silu'(x) = s (1 + x (1 - s)),  s = sigmoid(x)
    qgelu(x)        = x * sigmoid(1.702 x);                 qgelu'(x) = s + 1.702 x s (1 - s)

    gated (h = [a | b], two halves of width F; TransformerEngine's convention):
    swiglu = silu(a) * b,  geglu = gelu_tanh(a) * b,  reglu = relu(a) * b
    d a = (da * b) * act'(a),  d b = da * act(a)

``1 + tanh(u) = 2 sigmoid(2u)`` removes the tanh (Triton has none) without cancellation. The FP8
epilogue is the cast of ``kernels/quantize.py`` (its ``@triton.jit`` helpers live in
``kernels/_jit.py``): ``q = rne(sat(v * s))``, ``amax = max |v|`` over the float32 values (NaN
wins), ``inv = 1 / s``, with the scale computed just in time from ``amax_in`` for current scaling.

Kernels:

- ``_act_fwd_kernel``: 2-D tiles of the output ``(M, F)`` in grouped program order; reads the
  tile of ``h`` (both halves when gated), computes ``a32 = act(h)``, and writes any of ``y`` (the
  activation in ``h``'s dtype), ``q`` (FP8) and ``q_t`` (FP8, transposed through a layout
  conversion), folding the tile's amax into one word with an integer ``atomic_max`` on the float
  bits. With every write switched off it is the first pass of current scaling (``act_amax``).
- ``_act_bwd_kernel``: same tiling; reads ``da`` and ``h`` once, computes ``dh32 = da * act'(h)``
  (both halves when gated) and writes any of ``dh``, ``q``, ``q_t`` and, for the bias gradient,
  the column sums of the tile into a ``(num_row_tiles, C)`` float32 buffer that the launcher sums
  (deterministic; no float atomics).

Both kernels also read ``h`` as FP8 codes with its inverse scale (``H_FP8``: ``h = code * h_inv``
after the load), the stored fc1 output of ``fused_ln_mlp(recompute="activation")``.

Traffic per bf16 element of ``h`` with delayed scaling: forward reads 2 B and writes 1 B per FP8
copy; backward reads 2 + 2 B and writes 1 B per FP8 copy. Current scaling adds the amax pass (one
more read of the inputs). The kernels are memory-bound in principle. The gated forward reaches the
copy ceiling on large tensors, while the non-gated forward and the backward kernels are
latency-bound: the float32 math and the transposed epilogue use many registers, leaving too few
bytes in flight (measurements: docs/kernels/activation.md and docs/benchmarks/mlp.md). Tensors of a
few MB are slow relative to the ceiling because launch latency dominates; the erf-GELU is the most
arithmetic-heavy activation.

References: Hendrycks & Gimpel, "Gaussian Error Linear Units" (2016); Shazeer, "GLU Variants
Improve Transformer" (2020); So et al., "Primer" (2021, squared ReLU); NVIDIA Transformer Engine
fused activation + cast kernels.

The ops are registered as opaque ``torch.library`` ops (``fp8ops::act_fwd``, ``fp8ops::act_amax``,
``fp8ops::act_bwd``, ``fp8ops::act_bwd_amax``) with a CUDA kernel (the launchers below), a traced
CUDA kernel (the launchers with ``traced=True``: in a graph compiled for CUDA tensors, Inductor
launches their Triton kernels itself) and a fake kernel; the CPU kernel, the FP32 reference math,
is registered by ``fp8ops.activation``.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from ._jit import abs_bits, atomic_amax, cast_fp8, clear_next_amax, fp8_scale, grouped_tile
from ._library import (
    AMAX_CHAIN,
    OpSpec,
    cdiv,
    contiguous_args,
    fast_launch,
    graph_kernel,
    merge_config,
    opaque_for_tma_store,
    tma_store_wanted,
    traced_kernel,
    transposed_store,
)
from ._reduce import column_sums

__all__ = [
    "ACTIVATIONS",
    "GATED",
    "act_amax_launch",
    "act_bwd_amax_launch",
    "act_bwd_launch",
    "act_fwd_launch",
]

ACTIVATIONS = ("gelu", "gelu_tanh", "relu", "squared_relu", "silu", "qgelu", "swiglu", "geglu", "reglu")
GATED = ("swiglu", "geglu", "reglu")
# A gated activation is its base activation of the first half times the second half.
_BASE = {"swiglu": "silu", "geglu": "gelu_tanh", "reglu": "relu"}
_IN_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


@triton.jit
def _sigmoid(x):
    # An approximate division (div.full.f32, <= 2 ulp): the IEEE-rounded one is a multi-instruction
    # sequence that makes these elementwise kernels compute-bound instead of memory-bound.
    return tl.math.fdiv(1.0 + tl.zeros_like(x), 1.0 + tl.exp(-x), ieee_rounding=False)


@triton.jit
def _act(x, ACT: tl.constexpr):
    """act(x) of an fp32 tile; ACT is a non-gated activation name."""
    if ACT == "gelu":
        return 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))  # 1 / sqrt(2)
    elif ACT == "gelu_tanh":
        # 0.5 x (1 + tanh(u)) = x * sigmoid(2u); 2 * sqrt(2 / pi) = 1.5957691216057308
        return x * _sigmoid(1.5957691216057308 * (x + 0.044715 * x * x * x))
    elif ACT == "relu":
        return tl.where(x < 0.0, 0.0, x)  # a NaN stays NaN
    elif ACT == "squared_relu":
        r = tl.where(x < 0.0, 0.0, x)
        return r * r
    elif ACT == "silu":
        return x * _sigmoid(x)
    else:  # qgelu
        return x * _sigmoid(1.702 * x)


@triton.jit
def _dact(x, ACT: tl.constexpr):
    """act'(x) of an fp32 tile; ACT is a non-gated activation name."""
    if ACT == "gelu":
        cdf = 0.5 * (1.0 + tl.math.erf(x * 0.7071067811865476))
        return cdf + x * (tl.exp(-0.5 * x * x) * 0.3989422804014327)  # 1 / sqrt(2 pi)
    elif ACT == "gelu_tanh":
        s = _sigmoid(1.5957691216057308 * (x + 0.044715 * x * x * x))
        du = 1.5957691216057308 * (1.0 + 0.134145 * x * x)  # 3 * 0.044715 = 0.134145
        return s + x * (s * (1.0 - s)) * du
    elif ACT == "relu":
        return tl.where(x > 0.0, 1.0, 0.0)
    elif ACT == "squared_relu":
        return tl.where(x > 0.0, 2.0 * x, 0.0)
    elif ACT == "silu":
        s = _sigmoid(x)
        return s * (1.0 + x * (1.0 - s))
    else:  # qgelu
        s = _sigmoid(1.702 * x)
        return s + 1.702 * x * (s * (1.0 - s))


@triton.jit
def _load_h(ptrs, mask, h_inv_ptr, H_FP8: tl.constexpr):
    """A tile of h in fp32; FP8 codes are dequantized with the inverse scale (``code * h_inv``)."""
    x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    if H_FP8:
        x = x * tl.load(h_inv_ptr)
    return x


@triton.jit
def _tile(num_m, num_n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    # This program's tile: (pid, pid_m, pid_n, row indices, column indices), in grouped order along M
    # so that neighbouring programs write neighbouring rows of the transposed copy.
    pid = tl.program_id(0)
    pid_m, pid_n = grouped_tile(pid, GROUP_M * num_n, num_m, GROUP_M=GROUP_M)
    rm = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    return pid, pid_m, pid_n, rm, rn


@fast_launch
@triton.jit
def _act_fwd_kernel(
    h_ptr,  # (M, C) input, row stride stride_hm, unit column stride; C = 2F when GATED else F
    y_ptr,  # (M, F) output in h's dtype, contiguous (written when STORE_Y)
    q_ptr,  # (M, F) fp8 output, contiguous (written when STORE_Q)
    qt_ptr,  # (F, M) fp8 output, contiguous: the transposed copy (written when TRANSPOSE)
    qt_desc,  # TMA descriptor of qt with (BLOCK_N, BLOCK_M) tiles (TMA_T), else unused
    scale_ptr,  # () fp32 scale (delayed) or fallback scale (current)
    amax_in_ptr,  # () fp32 amax of act(h) (current scaling only)
    amax_ptr,  # () fp32 output, zero-initialised; updated with integer atomics
    amax_next_ptr,  # () fp32: zeroed by program 0 (the next launch's amax, _library.AmaxChain)
    inv_ptr,  # () fp32 output: 1 / scale (written when HAS_FP8)
    h_inv_ptr,  # () fp32 inverse scale of h (read when H_FP8: h holds FP8 codes, h = code * h_inv)
    M,
    F,
    stride_hm,
    num_m,  # number of row tiles (at least 1)
    num_n,  # number of column tiles (at least 1)
    ACT: tl.constexpr,
    GATED: tl.constexpr,
    H_FP8: tl.constexpr,
    HAS_FP8: tl.constexpr,
    STORE_Y: tl.constexpr,
    STORE_Q: tl.constexpr,
    TRANSPOSE: tl.constexpr,
    TMA_T: tl.constexpr,
    FP8_MAX: tl.constexpr,
    MARGIN: tl.constexpr,
    SCALE_FROM_AMAX: tl.constexpr,
    POWER_2: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # Step 1: tile coordinates.
    pid, pid_m, pid_n, rm, rn = _tile(num_m, num_n, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, GROUP_M=GROUP_M)
    mask = (rm[:, None] < M) & (rn[None, :] < F)
    # Step 2: load the tile of h (and of the gate half; dequantized when h is FP8), activation in fp32.
    h_rows = h_ptr + rm[:, None] * stride_hm
    x = _load_h(h_rows + rn[None, :], mask, h_inv_ptr, H_FP8=H_FP8)
    if GATED:
        g = _load_h(h_rows + F + rn[None, :], mask, h_inv_ptr, H_FP8=H_FP8)
        a = _act(x, ACT=ACT) * g
    else:
        a = _act(x, ACT=ACT)
    # Step 3: the high-precision output.
    if STORE_Y:
        tl.store(y_ptr + rm[:, None] * F + rn[None, :], a.to(y_ptr.dtype.element_ty), mask=mask)
    # Step 4: the FP8 cast with the given or just-in-time scale, and its transposed copy.
    if HAS_FP8:
        scale = fp8_scale(scale_ptr, amax_in_ptr, inv_ptr, pid,
                          FP8_MAX=FP8_MAX, MARGIN=MARGIN, SCALE_FROM_AMAX=SCALE_FROM_AMAX, POWER_2=POWER_2)
        q = cast_fp8(a, scale, q_ptr, FP8_MAX=FP8_MAX)
        if STORE_Q:
            tl.store(q_ptr + rm[:, None] * F + rn[None, :], q, mask=mask)
        if TRANSPOSE:
            if TMA_T:  # the tensor map clips the tile at the edges
                qt_desc.store([pid_n * BLOCK_N, pid_m * BLOCK_M], tl.trans(q))
            else:
                tl.store(qt_ptr + rn[:, None] * M + rm[None, :], tl.trans(q), mask=tl.trans(mask))
    # Step 5: amax of the tile on the float bits, one atomic per program.
    bits = tl.where(mask, tl.abs(a), 0.0).to(tl.int32, bitcast=True)
    atomic_amax(amax_ptr, tl.max(tl.max(bits, axis=1), axis=0))
    clear_next_amax(amax_next_ptr, pid)


@triton.jit
def _bwd_epilogue(
    d,  # (BLOCK_M, BLOCK_N) fp32 tile of dh32
    rm,  # (BLOCK_M,) int64 row indices
    cols,  # (BLOCK_N,) int64 column indices into C
    mask,  # (BLOCK_M, BLOCK_N) valid elements
    col_ok,  # (BLOCK_N,) valid columns of this half
    scale,  # fp32 scale (unused without HAS_FP8)
    dh_ptr,  # (M, C) output in h's dtype, contiguous
    q_ptr,  # (M, C) fp8 output, contiguous
    qt_ptr,  # (C, M) fp8 output, contiguous
    qt_desc,  # TMA descriptor of qt (TMA_T)
    col0,  # first column of this tile (the row of qt where the TMA store starts)
    part_ptr,  # (num_m, C) fp32 partial column sums
    pid_m,
    M,
    C,
    HAS_FP8: tl.constexpr,
    STORE_DH: tl.constexpr,
    TRANSPOSE: tl.constexpr,
    DBIAS: tl.constexpr,
    FP8_MAX: tl.constexpr,
    TMA_T: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    d = tl.where(mask, d, 0.0)
    if STORE_DH:
        tl.store(dh_ptr + rm[:, None] * C + cols[None, :], d.to(dh_ptr.dtype.element_ty), mask=mask)
    if HAS_FP8:
        q = cast_fp8(d, scale, q_ptr, FP8_MAX=FP8_MAX)
        tl.store(q_ptr + rm[:, None] * C + cols[None, :], q, mask=mask)
        if TRANSPOSE:
            if TMA_T:  # the tensor map clips the tile at the edges
                qt_desc.store([col0, pid_m * BLOCK_M], tl.trans(q))
            else:
                tl.store(qt_ptr + cols[:, None] * M + rm[None, :], tl.trans(q), mask=tl.trans(mask))
    if DBIAS:
        tl.store(part_ptr + pid_m.to(tl.int64) * C + cols, tl.sum(d, axis=0), mask=col_ok)
    return tl.max(tl.max(abs_bits(d), axis=1), axis=0)


@fast_launch
@triton.jit
def _act_bwd_kernel(
    da_ptr,  # (M, F) gradient of the activation output, row stride stride_dam, unit column stride
    h_ptr,  # (M, C) activation input, row stride stride_hm, unit column stride; C = 2F when GATED
    dh_ptr,  # (M, C) output in h's dtype, contiguous (written when STORE_DH)
    q_ptr,  # (M, C) fp8 output, contiguous (written when HAS_FP8)
    qt_ptr,  # (C, M) fp8 output, contiguous: the transposed copy (written when TRANSPOSE)
    qt_desc,  # TMA descriptor of qt with (BLOCK_N, BLOCK_M) tiles (TMA_T), else unused
    part_ptr,  # (num_m, C) fp32 partial column sums of dh32 (written when DBIAS)
    scale_ptr,  # () fp32 scale (delayed) or fallback scale (current)
    amax_in_ptr,  # () fp32 amax of dh32 (current scaling only)
    amax_ptr,  # () fp32 output, zero-initialised; updated with integer atomics
    amax_next_ptr,  # () fp32: zeroed by program 0 (the next launch's amax, _library.AmaxChain)
    inv_ptr,  # () fp32 output: 1 / scale (written when HAS_FP8)
    h_inv_ptr,  # () fp32 inverse scale of h (read when H_FP8: h holds FP8 codes, h = code * h_inv)
    M,
    F,
    stride_dam,
    stride_hm,
    num_m,  # number of row tiles (at least 1)
    num_n,  # number of column tiles over F (at least 1)
    ACT: tl.constexpr,
    GATED: tl.constexpr,
    H_FP8: tl.constexpr,
    HAS_FP8: tl.constexpr,
    STORE_DH: tl.constexpr,
    TRANSPOSE: tl.constexpr,
    TMA_T: tl.constexpr,  # q^T through qt_desc (gated: only when BLOCK_N divides F, so no tile crosses halves)
    DBIAS: tl.constexpr,
    FP8_MAX: tl.constexpr,
    MARGIN: tl.constexpr,
    SCALE_FROM_AMAX: tl.constexpr,
    POWER_2: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # Step 1: tile coordinates (over the (M, F) grid of da).
    pid, pid_m, pid_n, rm, rn = _tile(num_m, num_n, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, GROUP_M=GROUP_M)
    col0 = pid_n * BLOCK_N  # this tile's first column (where a TMA store of q^T starts)
    col_ok = rn < F
    mask = (rm[:, None] < M) & col_ok[None, :]
    # Step 2: the scale.
    scale = 1.0
    if HAS_FP8:
        scale = fp8_scale(scale_ptr, amax_in_ptr, inv_ptr, pid,
                          FP8_MAX=FP8_MAX, MARGIN=MARGIN, SCALE_FROM_AMAX=SCALE_FROM_AMAX, POWER_2=POWER_2)
    # Step 3: load da and h once (h dequantized when FP8); the gradient in fp32 and the epilogue
    # of each half.
    da = tl.load(da_ptr + rm[:, None] * stride_dam + rn[None, :], mask=mask, other=0.0).to(tl.float32)
    h_rows = h_ptr + rm[:, None] * stride_hm
    x = _load_h(h_rows + rn[None, :], mask, h_inv_ptr, H_FP8=H_FP8)
    if GATED:
        C = 2 * F
        g = _load_h(h_rows + F + rn[None, :], mask, h_inv_ptr, H_FP8=H_FP8)
        d_a = (da * g) * _dact(x, ACT=ACT)
        d_b = da * _act(x, ACT=ACT)
        m1 = _bwd_epilogue(d_a, rm, rn, mask, col_ok, scale, dh_ptr, q_ptr, qt_ptr, qt_desc, col0, part_ptr, pid_m,
                           M, C, HAS_FP8=HAS_FP8, STORE_DH=STORE_DH, TRANSPOSE=TRANSPOSE, DBIAS=DBIAS,
                           FP8_MAX=FP8_MAX, TMA_T=TMA_T, BLOCK_M=BLOCK_M)
        m2 = _bwd_epilogue(d_b, rm, rn + F, mask, col_ok, scale, dh_ptr, q_ptr, qt_ptr, qt_desc, col0 + F, part_ptr,
                           pid_m, M, C, HAS_FP8=HAS_FP8, STORE_DH=STORE_DH, TRANSPOSE=TRANSPOSE, DBIAS=DBIAS,
                           FP8_MAX=FP8_MAX, TMA_T=TMA_T, BLOCK_M=BLOCK_M)
        tile_max = tl.maximum(m1, m2)
    else:
        tile_max = _bwd_epilogue(da * _dact(x, ACT=ACT), rm, rn, mask, col_ok, scale, dh_ptr, q_ptr, qt_ptr, qt_desc,
                                 col0, part_ptr, pid_m, M, F,
                                 HAS_FP8=HAS_FP8, STORE_DH=STORE_DH, TRANSPOSE=TRANSPOSE, DBIAS=DBIAS, FP8_MAX=FP8_MAX,
                                 TMA_T=TMA_T, BLOCK_M=BLOCK_M)
    # Step 4: the amax, one atomic per program.
    atomic_amax(amax_ptr, tile_max)
    clear_next_amax(amax_next_ptr, pid)


# ------------------------------------------------------------------------------------------------
# Launchers: they alone know grids and block sizes, and they validate what the kernels assume.

# Defaults chosen with `python -m fp8ops.bench mlp --activation-kernels` (docs/kernels/activation.md):
# larger forward tiles spill registers.
# TMA: the transposed FP8 copy stored through a tensor map (Hopper and newer, from 2**24 elements
# unless the config says otherwise: _library.tma_store_wanted); 64 x 64 tiles then. GELU-tanh forward with the FP8 cast and transposed copy
# on an H200 (scripts/tma_store_check.py, docs/benchmarks/tma_store_check.json): 25.0 / 35.0 / 85.5 µs
# at 8192 x 2048 / 3072 / 8192 against 38.2 / 53.7 / 132.6 µs with pointer stores (32 x 128 tiles,
# the best pointer tile within 1 %).
_FWD_CFG = {"BLOCK_M": 32, "BLOCK_N": 128, "GROUP_M": 8, "num_warps": 4, "TMA": False}
_FWD_CFG_TMA = {"BLOCK_M": 64, "BLOCK_N": 64, "GROUP_M": 8, "num_warps": 4, "TMA": True}
# TMA: the backward's transposed FP8 gradient through a tensor map when it can (see act_bwd_launch):
# 42.0 / 58.4 / 140.7 µs against 46.4 / 64.8 / 157.9 µs with pointer stores for GELU-tanh at 8192 x
# 2048 / 3072 / 8192 on an H200, 109.2 against 111.1 µs for SwiGLU at 8192 x 2 x 2048
# (scripts/tma_store_check.py --only-library, docs/benchmarks/tma_store_check_library.json).
_BWD_CFG = {"BLOCK_M": 64, "BLOCK_N": 64, "GROUP_M": 8, "num_warps": 4, "TMA": True}


def _halves_split(gated: bool, F: int, cfg: dict[str, Any]) -> bool:
    # a gated backward tile must not cross from one half into the other: pointer stores then
    return bool(gated and F % cfg["BLOCK_N"])


def _check_act(name: str, act: str) -> tuple[str, bool]:
    if act not in ACTIVATIONS:
        raise ValueError(f"{name}: act must be one of {', '.join(ACTIVATIONS)}; got {act!r}")
    return _BASE.get(act, act), act in GATED


def _check_2d(name: str, arg: str, t: torch.Tensor, *, fp8_ok: bool = False) -> None:
    if t.dtype not in _IN_DTYPES and not (fp8_ok and t.dtype in _FP8_MAX):
        raise ValueError(f"{name}: {arg} must be float32, bfloat16 or float16, got {t.dtype}")
    if t.dim() != 2 or (t.stride(1) != 1 and t.shape[1] > 1):
        raise ValueError(
            f"{name}: {arg} must be 2-D with unit stride along its last dim, got shape {tuple(t.shape)} "
            f"and strides {tuple(t.stride())}; call .contiguous() first"
        )


def _hp(h: torch.Tensor, hp_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype of y / dh: ``hp_dtype``, else h's (bfloat16 for an FP8 h; only placeholders then)."""
    if hp_dtype is not None:
        return hp_dtype
    return torch.bfloat16 if h.dtype in _FP8_MAX else h.dtype


def _check_h(name: str, h: torch.Tensor, h_inv: torch.Tensor | None, hp_dtype: torch.dtype | None,
             store_hp: bool) -> torch.dtype:
    """Validate h (high precision, or FP8 codes with ``h_inv``); the dtype of the high-precision output."""
    _check_2d(name, "h", h, fp8_ok=True)
    if h.dtype in _FP8_MAX:
        if h_inv is None:
            raise ValueError(f"{name}: h is {h.dtype} (FP8 codes); pass its inverse scale h_inv (a 0-d float32 tensor)")
        _check_scalar(name, "h_inv", h_inv)
        if hp_dtype is None and store_hp:
            raise ValueError(f"{name}: h is FP8, so the high-precision output needs a dtype: pass hp_dtype "
                             "(torch.float32, torch.bfloat16 or torch.float16)")
    elif h_inv is not None:
        raise ValueError(f"{name}: h_inv is only for FP8 h, but h is {h.dtype}; pass h_inv=None")
    out = _hp(h, hp_dtype)
    if out not in _IN_DTYPES:
        raise ValueError(f"{name}: hp_dtype must be float32, bfloat16 or float16, got {out}")
    return out


def _check_width(name: str, h: torch.Tensor, gated: bool, act: str) -> int:
    C = h.shape[1]
    if gated and C % 2:
        raise ValueError(
            f"{name}: a gated activation ({act}) needs h of even width (M, 2F) = [a | b], got shape {tuple(h.shape)}"
        )
    return C // 2 if gated else C


def _check_scalar(name: str, arg: str, t: torch.Tensor | None) -> None:
    if t is not None and (t.dim() != 0 or t.dtype != torch.float32):
        raise ValueError(f"{name}: {arg} must be a 0-d float32 tensor, got shape {tuple(t.shape)} {t.dtype}")


def _cast_args(
    name: str,
    h: torch.Tensor,
    scale: torch.Tensor | None,
    amax_in: torch.Tensor | None,
    margin: int,
    power_2: bool,
    out_dtype: torch.dtype | None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """Validate the FP8 cast of a launch; returns ``(inv_scale, kwargs)``: the inverse-scale output
    (empty (0,) without ``out_dtype``) and the cast arguments of the kernel launch (pointers and
    constexprs) but the amax words, which the launch takes from ``AMAX_CHAIN``."""
    _check_scalar(name, "scale", scale)
    _check_scalar(name, "amax_in", amax_in)
    has_fp8 = out_dtype is not None
    if has_fp8 and out_dtype not in _FP8_MAX:
        raise ValueError(f"{name}: out_dtype must be torch.float8_e4m3fn, torch.float8_e5m2 or None, got {out_dtype}")
    dev = h.device
    inv = torch.empty((), dtype=torch.float32, device=dev) if has_fp8 else h.new_empty(0, dtype=torch.float32)
    if scale is None:
        scale = torch.ones((), dtype=torch.float32, device=dev)
    kwargs = dict(
        scale_ptr=scale, amax_in_ptr=amax_in if amax_in is not None else scale,
        inv_ptr=inv if has_fp8 else scale, HAS_FP8=has_fp8, FP8_MAX=_FP8_MAX[out_dtype] if has_fp8 else 0.0,
        MARGIN=margin, SCALE_FROM_AMAX=amax_in is not None, POWER_2=bool(power_2),
    )
    return inv, kwargs


def _output(shape: tuple[int, int], dtype: torch.dtype, device: torch.device, written: bool) -> torch.Tensor:
    # An output of the given shape, or an empty (0,) placeholder when the kernel does not write it.
    return torch.empty(shape if written else (0,), dtype=dtype, device=device)


def _tiles(M: int, N: int, cfg: dict[str, Any]) -> tuple[int, int]:
    return max(1, cdiv(M, cfg["BLOCK_M"])), max(1, cdiv(N, cfg["BLOCK_N"]))


def act_fwd_launch(
    h: torch.Tensor,
    act: str,
    store_y: bool,
    scale: torch.Tensor | None,
    amax_in: torch.Tensor | None,
    margin: int,
    power_2: bool,
    out_dtype: torch.dtype | None,
    store_q: bool,
    transpose: bool,
    h_inv: torch.Tensor | None = None,
    hp_dtype: torch.dtype | None = None,
    *,
    config: dict[str, Any] | None = None,
    traced: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Activation with its FP8 cast (and transposed copy) in one pass.

    Args:
        h: (M, C) float32/bfloat16/float16, or FP8 codes with ``h_inv``; unit stride along C;
            C = 2F for gated activations.
        act: one of :data:`ACTIVATIONS`.
        store_y: write ``y = act(h)`` (M, F) in ``h.dtype``.
        scale: () float32 scale (``amax_in`` None) or fallback scale (current scaling); None means 1.
        amax_in: () float32 amax of ``act(h)`` for current scaling, or None.
        margin, power_2: current-scaling parameters (ignored when ``amax_in`` is None).
        out_dtype: torch.float8_e4m3fn / torch.float8_e5m2, or None for no FP8 output.
        store_q: write ``q`` (M, F); transpose: write ``q_t`` (F, M) (both need ``out_dtype``).
        h_inv: () float32 inverse scale when h is FP8 (the kernel reads ``h = code * h_inv``).
        hp_dtype: dtype of ``y``; default h's dtype (required with FP8 h and ``store_y``).
        traced: launched from a compiled graph (``_library.traced_kernel``): the kernel through
            ``wrap_triton``, a zeroed amax word of its own, no TMA store.

    Returns:
        ``(y, q, q_t, amax, inv_scale)``; outputs not written are empty (0,) tensors; amax () is
        always max |act(h)| in float32.
    """
    name = "act_fwd"
    ACT, gated = _check_act(name, act)
    ydt = _check_h(name, h, h_inv, hp_dtype, bool(store_y))
    F = _check_width(name, h, gated, act)
    inv, cast = _cast_args(name, h, scale, amax_in, margin, power_2, out_dtype)
    M = h.shape[0]
    dev = h.device
    has_fp8 = out_dtype is not None
    store_q, transpose = bool(store_q and has_fp8), bool(transpose and has_fp8)
    qdt = out_dtype if has_fp8 else h.dtype
    y = _output((M, F), ydt, dev, bool(store_y))
    q = _output((M, F), qdt, dev, store_q)
    qt = _output((F, M), qdt, dev, transpose)
    tma = transpose and not traced and tma_store_wanted(qt, config)
    cfg = merge_config(_FWD_CFG_TMA if tma else _FWD_CFG, config, name=name)
    num_m, num_n = _tiles(M, F, cfg)
    desc = transposed_store(qt, tma, cfg["BLOCK_N"], cfg["BLOCK_M"])
    kernel = graph_kernel(_act_fwd_kernel, traced)
    with AMAX_CHAIN.output(dev, traced) as (amax, amax_next):
        kernel[(num_m * num_n,)](
            h, y, q, qt, desc, amax_ptr=amax, amax_next_ptr=amax_next,
            h_inv_ptr=h_inv if h_inv is not None else cast["scale_ptr"],
            M=M, F=F, stride_hm=h.stride(0), num_m=num_m, num_n=num_n,
            ACT=ACT, GATED=gated, H_FP8=h_inv is not None, STORE_Y=bool(store_y), STORE_Q=store_q,
            TRANSPOSE=transpose, TMA_T=tma, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], GROUP_M=cfg["GROUP_M"],
            num_warps=cfg["num_warps"], **cast,
        )
    return y, q, qt, amax, inv


def act_amax_launch(h: torch.Tensor, act: str, h_inv: torch.Tensor | None = None, *,
                    config: dict[str, Any] | None = None, traced: bool = False) -> torch.Tensor:
    """max |act(h)| as a 0-d float32 tensor: the first pass of current scaling (reads h once)."""
    return act_fwd_launch(h, act, store_y=False, scale=None, amax_in=None, margin=0, power_2=False, out_dtype=None,
                          store_q=False, transpose=False, h_inv=h_inv, config=config, traced=traced)[3]


def act_bwd_launch(
    da: torch.Tensor,
    h: torch.Tensor,
    act: str,
    store_dh: bool,
    scale: torch.Tensor | None,
    amax_in: torch.Tensor | None,
    margin: int,
    power_2: bool,
    out_dtype: torch.dtype | None,
    transpose: bool,
    dbias: bool,
    h_inv: torch.Tensor | None = None,
    hp_dtype: torch.dtype | None = None,
    *,
    config: dict[str, Any] | None = None,
    traced: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Activation gradient with its FP8 cast, transposed copy and bias gradient in one pass.

    Args:
        da: (M, F) gradient of the activation output, any float dtype, unit stride along F.
        h: (M, C) the activation input (C = 2F for gated activations), unit stride along C; FP8
            codes with ``h_inv``.
        act: one of :data:`ACTIVATIONS`.
        store_dh: write ``dh`` (M, C) in ``h.dtype``.
        scale, amax_in, margin, power_2, out_dtype: as :func:`act_fwd_launch` (amax_in: of dh32).
        transpose: write ``q_t`` (C, M) (needs ``out_dtype``).
        dbias: return the column sums of dh32, (C,) float32.
        h_inv, hp_dtype: as :func:`act_fwd_launch` (hp_dtype: of ``dh``). traced: as there.

    Returns:
        ``(dh, q, q_t, amax, inv_scale, dbias)``; outputs not written are empty (0,) tensors.
    """
    name = "act_bwd"
    ACT, gated = _check_act(name, act)
    dhdt = _check_h(name, h, h_inv, hp_dtype, bool(store_dh))
    _check_2d(name, "da", da)
    F = _check_width(name, h, gated, act)
    M, C = h.shape
    if tuple(da.shape) != (M, F):
        raise ValueError(f"{name}: da must have shape (M, F) = {(M, F)} for h of shape {tuple(h.shape)} and "
                         f"act={act!r}, got {tuple(da.shape)}")
    inv, cast = _cast_args(name, h, scale, amax_in, margin, power_2, out_dtype)
    cfg = merge_config(_BWD_CFG, config, name=name)
    dev = h.device
    has_fp8 = out_dtype is not None
    transpose = bool(transpose and has_fp8)
    qdt = out_dtype if has_fp8 else h.dtype
    dh = _output((M, C), dhdt, dev, bool(store_dh))
    q = _output((M, C), qdt, dev, has_fp8)
    qt = _output((C, M), qdt, dev, transpose)
    # TMA store of q^T (see _FWD_CFG_TMA); a gated tile must not cross from one half into the other
    tma = transpose and not traced and tma_store_wanted(qt, config) and not _halves_split(gated, F, cfg)
    num_m, num_n = _tiles(M, F, cfg)
    part = torch.empty((num_m, C), dtype=torch.float32, device=dev) if dbias else cast["scale_ptr"]
    desc = transposed_store(qt, tma, cfg["BLOCK_N"], cfg["BLOCK_M"])
    kernel = graph_kernel(_act_bwd_kernel, traced)
    with AMAX_CHAIN.output(dev, traced) as (amax, amax_next):
        kernel[(num_m * num_n,)](
            da, h, dh, q, qt, desc, part, amax_ptr=amax, amax_next_ptr=amax_next,
            h_inv_ptr=h_inv if h_inv is not None else cast["scale_ptr"],
            M=M, F=F, stride_dam=da.stride(0), stride_hm=h.stride(0), num_m=num_m, num_n=num_n,
            ACT=ACT, GATED=gated, H_FP8=h_inv is not None, STORE_DH=bool(store_dh), TRANSPOSE=transpose, TMA_T=tma,
            DBIAS=bool(dbias), BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], GROUP_M=cfg["GROUP_M"],
            num_warps=cfg["num_warps"], **cast,
        )
    # Finalize the bias gradient: a fixed-order sum over the row tiles' partial sums.
    db = column_sums(part, traced=traced)[0] if dbias else h.new_empty(0, dtype=torch.float32)
    return dh, q, qt, amax, inv, db


def act_bwd_amax_launch(da: torch.Tensor, h: torch.Tensor, act: str, h_inv: torch.Tensor | None = None, *,
                        config: dict[str, Any] | None = None, traced: bool = False) -> torch.Tensor:
    """max |da * act'(h)| as a 0-d float32 tensor: the first pass of current scaling."""
    return act_bwd_launch(da, h, act, store_dh=False, scale=None, amax_in=None, margin=0, power_2=False,
                          out_dtype=None, transpose=False, dbias=False, h_inv=h_inv, config=config, traced=traced)[3]


# ------------------------------------------------------------------------------------------------
# Library ops: a fake kernel gives torch.compile their shapes; CUDA kernels above, also traced.


def _width(h: torch.Tensor, act: str) -> int:
    return h.shape[1] // 2 if act in GATED else h.shape[1]


def _act_fwd_fake(h, act, store_y, scale, amax_in, margin, power_2, out_dtype, store_q, transpose,  # type: ignore[no-untyped-def]
                  h_inv=None, hp_dtype=None):
    M, F = h.shape[0], _width(h, act)
    qdt = out_dtype if out_dtype is not None else h.dtype
    has = out_dtype is not None
    return (
        h.new_empty((M, F) if store_y else (0,), dtype=_hp(h, hp_dtype)),
        h.new_empty((M, F) if store_q and has else (0,), dtype=qdt),
        h.new_empty((F, M) if transpose and has else (0,), dtype=qdt),
        h.new_empty((), dtype=torch.float32),
        h.new_empty(() if has else (0,), dtype=torch.float32),
    )


def _act_amax_fake(h, act, h_inv=None):  # type: ignore[no-untyped-def]
    return h.new_empty((), dtype=torch.float32)


def _act_bwd_fake(da, h, act, store_dh, scale, amax_in, margin, power_2, out_dtype, transpose, dbias,  # type: ignore[no-untyped-def]
                  h_inv=None, hp_dtype=None):
    M, C = h.shape
    qdt = out_dtype if out_dtype is not None else h.dtype
    has = out_dtype is not None
    return (
        h.new_empty((M, C) if store_dh else (0,), dtype=_hp(h, hp_dtype)),
        h.new_empty((M, C) if has else (0,), dtype=qdt),
        h.new_empty((C, M) if transpose and has else (0,), dtype=qdt),
        h.new_empty((), dtype=torch.float32),
        h.new_empty(() if has else (0,), dtype=torch.float32),
        h.new_empty((C,) if dbias else (0,), dtype=torch.float32),
    )


def _act_bwd_amax_fake(da, h, act, h_inv=None):  # type: ignore[no-untyped-def]
    return h.new_empty((), dtype=torch.float32)


def _unit(t: torch.Tensor) -> torch.Tensor:
    # The kernels take any row stride but need a unit column stride.
    return t if t.dim() == 2 and (t.stride(1) == 1 or t.shape[1] <= 1) else t.contiguous()


def _act_fwd_opaque(h, act, store_y, scale, amax_in, margin, power_2, out_dtype, store_q, transpose,  # type: ignore[no-untyped-def]
                    h_inv=None, hp_dtype=None) -> bool:
    # the call whose eager launch stores q^T through a tensor map stays opaque in compiled graphs
    return bool(transpose) and out_dtype is not None and opaque_for_tma_store(h, (_width(h, act), h.shape[0]))


def _act_bwd_opaque(da, h, act, store_dh, scale, amax_in, margin, power_2, out_dtype, transpose, dbias,  # type: ignore[no-untyped-def]
                    h_inv=None, hp_dtype=None) -> bool:
    # as _act_fwd_opaque, where act_bwd_launch would take the tensor map
    return (bool(transpose) and out_dtype is not None and not _halves_split(act in GATED, _width(h, act), _BWD_CFG)
            and opaque_for_tma_store(h, (h.shape[1], h.shape[0])))


act_fwd = OpSpec(
    "act_fwd(Tensor h, str act, bool store_y, Tensor? scale, Tensor? amax_in, int margin, bool power_2, "
    "ScalarType? out_dtype, bool store_q, bool transpose, Tensor? h_inv=None, ScalarType? hp_dtype=None) "
    "-> (Tensor, Tensor, Tensor, Tensor, Tensor)",
    cuda=contiguous_args(act_fwd_launch, 1, _unit),
    fake=_act_fwd_fake,
    traced=traced_kernel(act_fwd_launch, 1, _unit),
    opaque_when=_act_fwd_opaque,
)
"""``fp8ops::act_fwd``: activation + FP8 cast, ``(y, q, q_t, amax, inv_scale)``; see :func:`act_fwd_launch`."""

act_amax = OpSpec(
    "act_amax(Tensor h, str act, Tensor? h_inv=None) -> Tensor",
    cuda=contiguous_args(act_amax_launch, 1, _unit),
    fake=_act_amax_fake,
    traced=traced_kernel(act_amax_launch, 1, _unit),
)
"""``fp8ops::act_amax``: max |act(h)|, float32, NaN-propagating."""

act_bwd = OpSpec(
    "act_bwd(Tensor da, Tensor h, str act, bool store_dh, Tensor? scale, Tensor? amax_in, int margin, "
    "bool power_2, ScalarType? out_dtype, bool transpose, bool dbias, Tensor? h_inv=None, "
    "ScalarType? hp_dtype=None) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
    cuda=contiguous_args(act_bwd_launch, 2, _unit),
    fake=_act_bwd_fake,
    traced=traced_kernel(act_bwd_launch, 2, _unit),
    opaque_when=_act_bwd_opaque,
)
"""``fp8ops::act_bwd``: activation gradient + FP8 cast + bias gradient,
``(dh, q, q_t, amax, inv_scale, dbias)``; see :func:`act_bwd_launch`."""

act_bwd_amax = OpSpec(
    "act_bwd_amax(Tensor da, Tensor h, str act, Tensor? h_inv=None) -> Tensor",
    cuda=contiguous_args(act_bwd_amax_launch, 2, _unit),
    fake=_act_bwd_amax_fake,
    traced=traced_kernel(act_bwd_amax_launch, 2, _unit),
)
"""``fp8ops::act_bwd_amax``: max |da * act'(h)|, float32, NaN-propagating."""
