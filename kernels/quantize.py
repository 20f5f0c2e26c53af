"""FP8 quantization kernels: fused cast + amax, cast + transpose + amax, row-wise cast, amax.

Math (per tensor, scale ``s`` a multiplier, ``fmax`` the format's largest finite value)::

    q      = rne(clamp(x * s, -fmax, fmax))      # saturating, round-to-nearest-even; NaN stays NaN
    amax   = max |x|                              # NaN if any x is NaN
    inv    = 1 / s                                # what a scaled GEMM multiplies by to dequantize

With *current* scaling the scale is computed from the amax of the same tensor, just in time::

    s = fmax / amax / 2**margin                   # optionally rounded down to a power of two
    s = fallback       if amax == 0 or amax is not finite
    s = clamp(s, float32 smallest normal, float32 max)

Kernels (one launch each):

- ``_cast_fwd_kernel``: flat pass over ``x``; reads ``x`` once, writes ``q`` once, reduces the amax
  in registers and folds it into one global word with an integer ``atomic_max`` on the float's bit
  pattern (|x| >= 0, so integer order equals float order, and a NaN's bits exceed every finite
  value's, so NaN wins the max).
- ``_cast_transpose_fwd_kernel``: 2-D tiles; writes ``q`` (M, K) and its transpose (K, M), the
  K-major operand that Hopper's FP8 tensor-core instructions want for the B side of dgrad/wgrad.
  The transposed store goes through a layout conversion in shared memory. With ``DBIAS`` it also
  writes the tile's column sums (one float32 row per tile row, summed afterwards): the bias
  gradient of an output gradient in the pass that quantizes it (``fp8ops::cast_transpose_dbias``).
- ``_cast_rowwise_fwd_kernel``: one scale per row; each program owns ``BLOCK_M`` rows and sweeps K
  twice (amax, then cast); the second sweep mostly hits L2.
- ``_amax_fwd_kernel``: the first launch of current scaling (reads ``x`` once).
- ``_transpose_bytes_kernel``: the K-major copy of FP8 bytes that arrived untransposed (an
  all-gathered operand): 2-D tiles read along rows and written along columns, both coalesced.

Delayed scaling is a single launch (3 bytes moved per bf16 element, the roofline); current scaling
is amax + cast (5 bytes per element). The kernels are memory-bound; they are fast when the tensor
is much larger than L2 and slow, relative to the copy ceiling, on tensors of a few MB where launch
latency dominates.

References: Micikevicius et al., "FP8 Formats for Deep Learning" (2022); NVIDIA Transformer Engine
cast/transpose kernels (amax reduced per block, one atomic per block).

The ops are registered as opaque ``torch.library`` ops (``fp8ops::amax``, ``fp8ops::cast``,
``fp8ops::cast_transpose``, ``fp8ops::cast_transpose_dbias``, ``fp8ops::cast_rowwise``,
``fp8ops::transpose_bytes``; see ``_library.py``) with a CUDA kernel (the launchers below)
and a fake kernel; the CPU kernel, the FP32 reference math, is registered by
``fp8ops``. All but ``cast_rowwise`` and ``transpose_bytes`` also have a traced CUDA kernel: in a
graph compiled for CUDA tensors, Inductor launches their Triton kernels itself.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from ._jit import abs_bits, atomic_amax, cast_fp8, clear_next_amax, fp8_scale, grouped_tile, saturate, scale_from_amax
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
    "FP8_DTYPES",
    "amax_launch",
    "cast_launch",
    "cast_rowwise_launch",
    "cast_transpose_dbias_launch",
    "cast_transpose_heads_launch",
    "heads_block_k",
    "cast_transpose_launch",
    "transpose_bytes_launch",
]

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_IN_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


@fast_launch
@triton.jit
def _cast_fwd_kernel(
    x_ptr,  # (N,) input, contiguous
    q_ptr,  # (N,) fp8 output
    scale_ptr,  # () fp32 scale (delayed) or fallback scale (current)
    amax_in_ptr,  # () fp32 amax of x (current scaling only)
    amax_ptr,  # () fp32 output, zero-initialised; updated with integer atomics
    amax_next_ptr,  # () fp32: zeroed by program 0 (the next launch's amax, _library.AmaxChain)
    inv_ptr,  # () fp32 output: 1 / scale
    n_elements,
    FP8_MAX: tl.constexpr,
    MARGIN: tl.constexpr,
    SCALE_FROM_AMAX: tl.constexpr,
    POWER_2: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    # Step 1: the scale, read or computed just in time (every program computes the same value).
    scale = fp8_scale(scale_ptr, amax_in_ptr, inv_ptr, pid,
                      FP8_MAX=FP8_MAX, MARGIN=MARGIN, SCALE_FROM_AMAX=SCALE_FROM_AMAX, POWER_2=POWER_2)
    # Step 2: load, scale, saturate, cast, store.
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elements
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = saturate(x * scale, FP8_MAX=FP8_MAX)
    tl.store(q_ptr + offs, y.to(q_ptr.dtype.element_ty), mask=mask)
    # Step 3: amax of the block on the bit patterns, one atomic per program.
    atomic_amax(amax_ptr, tl.max(abs_bits(x), axis=0))
    clear_next_amax(amax_next_ptr, pid)


@fast_launch
@triton.jit
def _cast_transpose_fwd_kernel(
    x_ptr,  # (M, K) input, row stride stride_xm, unit column stride
    q_ptr,  # (M, K) fp8 output, contiguous
    qt_ptr,  # (K, M) fp8 output, contiguous: the transposed (K-major) copy
    qt_desc,  # TMA descriptor of qt with (BLOCK_K, BLOCK_M) tiles (TMA_T), else unused
    scale_ptr,  # () fp32 scale (delayed) or fallback scale (current)
    amax_in_ptr,  # () fp32 amax of x (current scaling only)
    amax_ptr,  # () fp32 output, zero-initialised; updated with integer atomics
    amax_next_ptr,  # () fp32: zeroed by program 0 (the next launch's amax, _library.AmaxChain)
    inv_ptr,  # () fp32 output: 1 / scale
    dbias_ptr,  # (cdiv(M, BLOCK_M), K) fp32 output with DBIAS: column sums of each tile row of x
    M,
    K,
    stride_xm,
    FP8_MAX: tl.constexpr,
    MARGIN: tl.constexpr,
    SCALE_FROM_AMAX: tl.constexpr,
    POWER_2: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    DBIAS: tl.constexpr,
    TMA_T: tl.constexpr,
):
    # Step 1: tile coordinates, grouped along M so neighbouring programs share output rows of q^T.
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_k = tl.cdiv(K, BLOCK_K)
    pid_m, pid_k = grouped_tile(pid, GROUP_M * num_k, num_m, GROUP_M=GROUP_M)
    # Step 2: the scale.
    scale = fp8_scale(scale_ptr, amax_in_ptr, inv_ptr, pid,
                      FP8_MAX=FP8_MAX, MARGIN=MARGIN, SCALE_FROM_AMAX=SCALE_FROM_AMAX, POWER_2=POWER_2)
    # Step 3: load the tile, cast, store it and its transpose.
    rm = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    rk = pid_k.to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rm[:, None] < M) & (rk[None, :] < K)
    x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=mask, other=0.0).to(tl.float32)
    q = cast_fp8(x, scale, q_ptr, FP8_MAX=FP8_MAX)
    tl.store(q_ptr + rm[:, None] * K + rk[None, :], q, mask=mask)
    if TMA_T:  # the tensor map clips the tile at the edges
        qt_desc.store([pid_k * BLOCK_K, pid_m * BLOCK_M], tl.trans(q))
    else:
        tl.store(qt_ptr + rk[:, None] * M + rm[None, :], tl.trans(q), mask=tl.trans(mask))
    # Step 4: amax of the tile.
    atomic_amax(amax_ptr, tl.max(tl.max(abs_bits(x), axis=1), axis=0))
    clear_next_amax(amax_next_ptr, pid)
    # Step 5 (DBIAS): the tile's column sums, one row of partial sums per tile row (no atomics: the
    # sum over tile rows that follows is deterministic). Rows past M were loaded as zeros.
    if DBIAS:
        tl.store(dbias_ptr + pid_m.to(tl.int64) * K + rk, tl.sum(x, axis=0), mask=rk < K)


@fast_launch
@triton.jit
def _cast_transpose_heads_kernel(
    x0_ptr,  # (B, H0, S, D) first part (query heads), any strides
    x1_ptr,  # (B, H1, S, D) second part (key heads)
    x2_ptr,  # (B, H1, S, D) third part (value heads)
    q_ptr,  # (M, K) fp8 output, contiguous, M = S * B rows in (s, b) order, K = (H0 + 2 H1) D
    qt_ptr,  # (K, M) fp8 output, contiguous
    scale_ptr,
    amax_in_ptr,
    amax_ptr,
    amax_next_ptr,
    inv_ptr,
    dbias_ptr,  # (cdiv(M, BLOCK_M), K) fp32 with DBIAS
    M,
    K,
    NB,  # B: row m is (s, b) = (m // B, m % B)
    W0,  # H0 * D: the first column of the second part
    W01,  # (H0 + H1) * D: the first column of the third part
    s0b, s0h, s0s, s1b, s1h, s1s, s2b, s2h, s2s,  # strides of each part along B, H, S (unit along D)
    D: tl.constexpr,
    FP8_MAX: tl.constexpr,
    MARGIN: tl.constexpr,
    SCALE_FROM_AMAX: tl.constexpr,
    POWER_2: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    DBIAS: tl.constexpr,
):
    # _cast_transpose_fwd_kernel over the concatenation [x0 | x1 | x2] of three head tensors, read
    # where they are: each tile lies in one part (W0 and W01 are multiples of BLOCK_K).
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_k = tl.cdiv(K, BLOCK_K)
    pid_m, pid_k = grouped_tile(pid, GROUP_M * num_k, num_m, GROUP_M=GROUP_M)
    scale = fp8_scale(scale_ptr, amax_in_ptr, inv_ptr, pid,
                      FP8_MAX=FP8_MAX, MARGIN=MARGIN, SCALE_FROM_AMAX=SCALE_FROM_AMAX, POWER_2=POWER_2)
    rm = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    rk = pid_k.to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)
    k0 = pid_k * BLOCK_K
    if k0 < W0:
        base = x0_ptr
        sb = s0b
        sh = s0h
        ss = s0s
        c0 = 0
    elif k0 < W01:
        base = x1_ptr
        sb = s1b
        sh = s1h
        ss = s1s
        c0 = W0
    else:
        base = x2_ptr
        sb = s2b
        sh = s2h
        ss = s2s
        c0 = W01
    col = rk - c0
    row_off = (rm // NB) * ss + (rm % NB) * sb
    col_off = (col // D) * sh + (col % D)
    mask = (rm[:, None] < M) & (rk[None, :] < K)
    x = tl.load(base + row_off[:, None] + col_off[None, :], mask=mask, other=0.0).to(tl.float32)
    q = cast_fp8(x, scale, q_ptr, FP8_MAX=FP8_MAX)
    tl.store(q_ptr + rm[:, None] * K + rk[None, :], q, mask=mask)
    tl.store(qt_ptr + rk[:, None] * M + rm[None, :], tl.trans(q), mask=tl.trans(mask))
    atomic_amax(amax_ptr, tl.max(tl.max(abs_bits(x), axis=1), axis=0))
    clear_next_amax(amax_next_ptr, pid)
    if DBIAS:
        tl.store(dbias_ptr + pid_m.to(tl.int64) * K + rk, tl.sum(x, axis=0), mask=rk < K)


@fast_launch
@triton.jit
def _cast_rowwise_fwd_kernel(
    x_ptr,  # (M, K) input, row stride stride_xm, unit column stride
    q_ptr,  # (M, K) fp8 output, contiguous
    inv_ptr,  # (M,) fp32 output: 1 / scale of each row
    amax_ptr,  # () fp32 output, zero-initialised: amax of the whole tensor
    amax_next_ptr,  # () fp32: zeroed by program 0 (the next launch's amax, _library.AmaxChain)
    M,
    K,
    stride_xm,
    FP8_MAX: tl.constexpr,
    MARGIN: tl.constexpr,
    POWER_2: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    rm = pid.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rm < M
    # Step 1: row amaxes, as float bit patterns (NaN-propagating integer max).
    acc = tl.zeros((BLOCK_M,), dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        mask = row_ok[:, None] & (rk[None, :] < K)
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=mask, other=0.0).to(tl.float32)
        acc = tl.maximum(acc, tl.max(abs_bits(x), axis=1))
    row_amax = acc.to(tl.float32, bitcast=True)
    # Step 2: one scale per row; a zero or non-finite row keeps scale 1.
    scale = scale_from_amax(row_amax, 1.0, FP8_MAX=FP8_MAX, MARGIN=MARGIN, POWER_2=POWER_2)
    tl.store(inv_ptr + rm, tl.math.div_rn(1.0 + tl.zeros_like(scale), scale), mask=row_ok)
    # Step 3: cast with the row scales (the second sweep mostly reads from L2).
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        mask = row_ok[:, None] & (rk[None, :] < K)
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=mask, other=0.0).to(tl.float32)
        y = saturate(x * scale[:, None], FP8_MAX=FP8_MAX)
        tl.store(q_ptr + rm[:, None] * K + rk[None, :], y.to(q_ptr.dtype.element_ty), mask=mask)
    # Step 4: the tensor amax.
    atomic_amax(amax_ptr, tl.max(acc, axis=0))
    clear_next_amax(amax_next_ptr, pid)


@fast_launch
@triton.jit
def _amax_fwd_kernel(
    x_ptr,  # (N,) input, contiguous
    amax_ptr,  # () fp32 output, zero-initialised
    amax_next_ptr,  # () fp32: zeroed by program 0 (the next launch's amax, _library.AmaxChain)
    n_elements,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n_elements, other=0.0).to(tl.float32)
    atomic_amax(amax_ptr, tl.max(abs_bits(x), axis=0))
    clear_next_amax(amax_next_ptr, pid)


@fast_launch
@triton.jit
def _transpose_bytes_kernel(
    x_ptr,  # (M, K) one-byte elements (uint8 view), contiguous
    y_ptr,  # (K, M) output, contiguous
    M,
    K,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # A tile read along K and written along M: both sides coalesced (the swap goes through shared memory).
    rm = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    rk = tl.program_id(1).to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)
    x = tl.load(x_ptr + rm[:, None] * K + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K))
    tl.store(y_ptr + rk[:, None] * M + rm[None, :], tl.trans(x), mask=(rk[:, None] < K) & (rm[None, :] < M))


# ------------------------------------------------------------------------------------------------
# Launchers: they alone know grids and block sizes, and they validate what the kernels assume.

# Defaults chosen with `python -m fp8ops.bench quantize --sweep` (docs/benchmarks/quantize.md).
_CAST_CFG = {"BLOCK": 8192, "num_warps": 8}
# TMA: the transposed copy stored through a tensor map (Hopper and newer, from 2**24 elements unless
# the config says otherwise: _library.tma_store_wanted), 64 x 64 tiles then. On an H200 (scripts/tma_store_check.py, docs/benchmarks/tma_store_check.json):
# 7.5 / 17.0 / 10.3 / 3.7 / 39.6 µs at 8192 x 512 / 1536 / 768, 2048 x 512, 8192 x 4096 against
# 7.6 / 18.9 / 11.3 / 3.8 / 43.8 µs with pointer stores and the 64 x 128 tiles.
_CAST_T_CFG = {"BLOCK_M": 64, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 4, "TMA": False}
_CAST_T_CFG_TMA = {"BLOCK_M": 64, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 4, "TMA": True}
_ROWWISE_CFG = {"BLOCK_M": 1, "BLOCK_K": 2048, "num_warps": 8}
_AMAX_CFG = {"BLOCK": 16384, "num_warps": 4}
_TRANSPOSE_CFG = {"BLOCK_M": 128, "BLOCK_K": 128, "num_warps": 8}
_HEADS_CFG = {"BLOCK_M": 64, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 4}


def _check_input(name: str, x: torch.Tensor, *, flat: bool) -> None:
    if x.dtype not in _IN_DTYPES:
        raise ValueError(f"{name}: x must be float32, bfloat16 or float16, got {x.dtype}")
    if flat:
        if not x.is_contiguous():
            raise ValueError(f"{name}: x must be contiguous; call x.contiguous() first")
    else:
        if x.dim() != 2 or x.stride(1) != 1:
            raise ValueError(
                f"{name}: x must be 2-D (M, K) with unit stride along K, got shape "
                f"{tuple(x.shape)} and strides {tuple(x.stride())}"
            )


def _check_out_dtype(name: str, out_dtype: torch.dtype) -> float:
    if out_dtype not in FP8_DTYPES:
        raise ValueError(f"{name}: out_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {out_dtype}")
    return _FP8_MAX[out_dtype]


def _check_scalar(name: str, arg: str, t: torch.Tensor | None) -> None:
    if t is not None and (t.dim() != 0 or t.dtype != torch.float32):
        raise ValueError(f"{name}: {arg} must be a 0-d float32 tensor, got shape {tuple(t.shape)} {t.dtype}")


def _cast_args(
    name: str,
    x: torch.Tensor,
    scale: torch.Tensor,
    amax_in: torch.Tensor | None,
    margin: int,
    power_2: bool,
    out_dtype: torch.dtype,
    *,
    flat: bool,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """Validate a per-tensor cast; returns ``(inv_scale, kwargs)``: the () float32 inverse-scale
    output and the FP8 cast arguments of the kernel launch (pointers and constexprs) but the amax
    words, which the launch takes from ``AMAX_CHAIN``."""
    _check_input(name, x, flat=flat)
    fp8_max = _check_out_dtype(name, out_dtype)
    _check_scalar(name, "scale", scale)
    _check_scalar(name, "amax_in", amax_in)
    inv = torch.empty((), dtype=torch.float32, device=x.device)
    kwargs = dict(
        scale_ptr=scale, amax_in_ptr=amax_in if amax_in is not None else scale, inv_ptr=inv,
        FP8_MAX=fp8_max, MARGIN=margin, SCALE_FROM_AMAX=amax_in is not None, POWER_2=power_2,
    )
    return inv, kwargs


def amax_launch(x: torch.Tensor, *, config: dict[str, Any] | None = None, traced: bool = False) -> torch.Tensor:
    """max |x| as a 0-d float32 tensor (NaN if x holds a NaN). x: any shape, contiguous. ``traced``:
    launched from a compiled graph (``_library.traced_kernel``)."""
    _check_input("amax", x, flat=True)
    cfg = merge_config(_AMAX_CFG, config, name="amax")
    n = x.numel()
    if not n:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    kernel = graph_kernel(_amax_fwd_kernel, traced)
    with AMAX_CHAIN.output(x.device, traced) as (amax, amax_next):
        grid = (cdiv(n, cfg["BLOCK"]),)
        kernel[grid](x, amax, amax_next, n, BLOCK=cfg["BLOCK"], num_warps=cfg["num_warps"])
    return amax


def transpose_bytes_launch(x: torch.Tensor, *, config: dict[str, Any] | None = None) -> torch.Tensor:
    """The (K, M) contiguous transpose of a 2-D (M, K) tensor of one-byte elements (uint8, an FP8
    dtype), contiguous; the K-major operand of a GEMM from FP8 bytes that arrived untransposed."""
    if x.dim() != 2 or x.element_size() != 1:
        raise ValueError(f"transpose_bytes: x must be a 2-D tensor of one-byte elements, got {x.dtype} "
                         f"of shape {tuple(x.shape)}")
    cfg = merge_config(_TRANSPOSE_CFG, config, name="transpose_bytes")
    M, K = x.shape
    y = torch.empty((K, M), dtype=torch.uint8, device=x.device)
    if x.numel():
        grid = (cdiv(M, cfg["BLOCK_M"]), cdiv(K, cfg["BLOCK_K"]))
        _transpose_bytes_kernel[grid](x.view(torch.uint8), y, M, K, BLOCK_M=cfg["BLOCK_M"], BLOCK_K=cfg["BLOCK_K"],
                                      num_warps=cfg["num_warps"])
    return y.view(x.dtype)


def cast_launch(
    x: torch.Tensor,
    scale: torch.Tensor,
    amax_in: torch.Tensor | None,
    margin: int,
    power_2: bool,
    out_dtype: torch.dtype,
    *,
    config: dict[str, Any] | None = None,
    traced: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Saturating FP8 cast with the amax computed in the same pass.

    Args:
        x: (...) float32/bfloat16/float16, contiguous.
        scale: () float32: the scale (``amax_in`` is None) or the fallback scale (current scaling).
        amax_in: () float32 amax of ``x`` for current scaling, or None for a given scale.
        margin, power_2: current-scaling parameters (ignored when ``amax_in`` is None).
        out_dtype: torch.float8_e4m3fn or torch.float8_e5m2.
        traced: launched from a compiled graph (``_library.traced_kernel``): the kernel through
            ``wrap_triton``, a zeroed amax word of its own, no TMA store.

    Returns:
        ``(q, amax, inv_scale)``: q (...) FP8, amax () and inv_scale () float32.
    """
    return _cast(x, scale, amax_in, margin, power_2, out_dtype, config, traced)


def _cast(x: torch.Tensor, scale: torch.Tensor, amax_in: torch.Tensor | None, margin: int, power_2: bool,
          out_dtype: torch.dtype, config: dict[str, Any] | None, traced: bool
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    inv, cast = _cast_args("cast", x, scale, amax_in, margin, power_2, out_dtype, flat=True)
    cfg = merge_config(_CAST_CFG, config, name="cast")
    q = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    n = x.numel()
    grid = (max(1, cdiv(n, cfg["BLOCK"])),)
    kernel = graph_kernel(_cast_fwd_kernel, traced)
    with AMAX_CHAIN.output(x.device, traced) as (amax, amax_next):
        kernel[grid](x, q, n_elements=n, BLOCK=cfg["BLOCK"], num_warps=cfg["num_warps"], amax_ptr=amax,
                     amax_next_ptr=amax_next, **cast)
    return q, amax, inv


def cast_transpose_launch(
    x: torch.Tensor,
    scale: torch.Tensor,
    amax_in: torch.Tensor | None,
    margin: int,
    power_2: bool,
    out_dtype: torch.dtype,
    *,
    config: dict[str, Any] | None = None,
    traced: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`cast_launch` that also writes the transposed copy in the same pass.

    Args:
        x: (M, K) with unit stride along K.

    Returns:
        ``(q, q_t, amax, inv_scale)``: q (M, K) and q_t (K, M) FP8, both contiguous.
    """
    q, qt, amax, inv, _ = _cast_transpose(x, scale, amax_in, margin, power_2, out_dtype, False, config, traced)
    return q, qt, amax, inv


def cast_transpose_dbias_launch(
    x: torch.Tensor,
    scale: torch.Tensor,
    amax_in: torch.Tensor | None,
    margin: int,
    power_2: bool,
    out_dtype: torch.dtype,
    *,
    config: dict[str, Any] | None = None,
    traced: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`cast_transpose_launch` that also returns the column sums of x: the bias gradient of
    a linear layer whose output gradient is x, without a second pass over x.

    The kernel writes one row of float32 partial sums per tile row of x (``cdiv(M, BLOCK_M)`` rows,
    no atomics), summed over those rows by one small fixed-order reduction (``_reduce.column_sums``):
    deterministic.

    Returns:
        ``(q, q_t, amax, inv_scale, dbias)``; dbias (K,) float32.
    """
    q, qt, amax, inv, partial = _cast_transpose(x, scale, amax_in, margin, power_2, out_dtype, True, config, traced)
    return q, qt, amax, inv, column_sums(partial, traced=traced)[0]


def _cast_transpose(x: torch.Tensor, scale: torch.Tensor, amax_in: torch.Tensor | None, margin: int,
                    power_2: bool, out_dtype: torch.dtype, dbias: bool, config: dict[str, Any] | None, traced: bool
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    name = "cast_transpose_dbias" if dbias else "cast_transpose"
    inv, cast = _cast_args(name, x, scale, amax_in, margin, power_2, out_dtype, flat=False)
    M, K = x.shape
    q = torch.empty((M, K), dtype=out_dtype, device=x.device)
    qt = torch.empty((K, M), dtype=out_dtype, device=x.device)
    tma = not traced and tma_store_wanted(qt, config)
    cfg = merge_config(_CAST_T_CFG_TMA if tma else _CAST_T_CFG, config, name=name)
    # An empty x still launches one program (it writes the inverse scale), which writes one row of
    # zero partial sums.
    partial = (torch.empty((max(1, cdiv(M, cfg["BLOCK_M"])), K), dtype=torch.float32, device=x.device)
               if dbias else None)
    grid = (max(1, cdiv(M, cfg["BLOCK_M"]) * cdiv(K, cfg["BLOCK_K"])),)
    desc = transposed_store(qt, tma, cfg["BLOCK_K"], cfg["BLOCK_M"])
    kernel = graph_kernel(_cast_transpose_fwd_kernel, traced)
    with AMAX_CHAIN.output(x.device, traced) as (amax, amax_next):
        kernel[grid](
            x, q, qt, desc, dbias_ptr=partial, M=M, K=K, stride_xm=x.stride(0), BLOCK_M=cfg["BLOCK_M"],
            BLOCK_K=cfg["BLOCK_K"], GROUP_M=cfg["GROUP_M"], DBIAS=dbias, TMA_T=tma, num_warps=cfg["num_warps"],
            amax_ptr=amax, amax_next_ptr=amax_next, **cast,
        )
    return q, qt, amax, inv, partial


def _heads_check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[int, int, int, int, int]:
    name = "cast_transpose_heads"
    for n, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype not in _IN_DTYPES or t.dim() != 4 or (t.shape[3] > 1 and t.stride(3) != 1):
            raise ValueError(f"{name}: {n} must be a (B, H, S, D) float32/bfloat16/float16 tensor with unit stride "
                             f"along D, got {t.dtype} of shape {tuple(t.shape)} and strides {tuple(t.stride())}")
    B, H0, S, D = q.shape
    if k.shape[0] != B or k.shape[2:] != (S, D) or v.shape != k.shape or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"{name}: k and v must be (B, Hkv, S, D) = ({B}, Hkv, {S}, {D}) of q's dtype, got "
                         f"{tuple(k.shape)} {k.dtype} and {tuple(v.shape)} {v.dtype}")
    return B, H0, k.shape[1], S, D


def heads_block_k(hq: int, hkv: int, d: int) -> int | None:
    """The column tile of ``fp8ops::cast_transpose_heads`` for heads (hq, hkv) of dim d: the largest
    of 128, 64, 32 that divides hq * d and hkv * d (a tile lies in one part), or None."""
    return next((b for b in (128, 64, 32) if (hq * d) % b == 0 and (hkv * d) % b == 0), None)


def cast_transpose_heads_launch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: torch.Tensor,
    amax_in: torch.Tensor | None,
    margin: int,
    power_2: bool,
    out_dtype: torch.dtype,
    *,
    config: dict[str, Any] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`cast_transpose_dbias_launch` of the (S B, (Hq + 2 Hkv) D) matrix whose row (s, b) is
    ``[q[b, :, s, :] | k[b, :, s, :] | v[b, :, s, :]]`` flattened: the gradient of a QKV projection
    assembled from attention's dq, dk, dv (B, H, S, D) where they lie, without writing the
    concatenation.

    Returns:
        ``(x_q (M, K), x_q_t (K, M), amax, inv_scale, dbias (K,) float32)``, M = S B.
    """
    name = "cast_transpose_heads"
    B, H0, H1, S, D = _heads_check(q, k, v)
    fp8_max = _check_out_dtype(name, out_dtype)
    _check_scalar(name, "scale", scale)
    _check_scalar(name, "amax_in", amax_in)
    bk = heads_block_k(H0, H1, D)
    if bk is None:
        raise ValueError(f"{name}: Hq * D = {H0 * D} and Hkv * D = {H1 * D} must be multiples of 32")
    cfg = merge_config({**_HEADS_CFG, "BLOCK_K": bk}, config, name=name)
    M, K = S * B, (H0 + 2 * H1) * D
    inv = torch.empty((), dtype=torch.float32, device=q.device)
    xq = torch.empty((M, K), dtype=out_dtype, device=q.device)
    xqt = torch.empty((K, M), dtype=out_dtype, device=q.device)
    partial = torch.empty((max(1, cdiv(M, cfg["BLOCK_M"])), K), dtype=torch.float32, device=q.device)
    grid = (max(1, cdiv(M, cfg["BLOCK_M"]) * cdiv(K, cfg["BLOCK_K"])),)
    with AMAX_CHAIN.output(q.device, False) as (amax, amax_next):
        _cast_transpose_heads_kernel[grid](
            q, k, v, xq, xqt, scale, amax_in if amax_in is not None else scale, amax, amax_next, inv, partial,
            M, K, max(B, 1), H0 * D, (H0 + H1) * D,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2),
            D=D, FP8_MAX=fp8_max, MARGIN=margin, SCALE_FROM_AMAX=amax_in is not None, POWER_2=power_2,
            BLOCK_M=cfg["BLOCK_M"], BLOCK_K=cfg["BLOCK_K"], GROUP_M=cfg["GROUP_M"], DBIAS=True,
            num_warps=cfg["num_warps"],
        )
    return xq, xqt, amax, inv, column_sums(partial)[0]


def cast_rowwise_launch(
    x: torch.Tensor,
    margin: int,
    power_2: bool,
    out_dtype: torch.dtype,
    *,
    config: dict[str, Any] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Saturating FP8 cast with one just-in-time scale per row.

    Args:
        x: (M, K) with unit stride along K.

    Returns:
        ``(q, inv_scale, amax)``: q (M, K) FP8, inv_scale (M, 1) float32, amax () float32.
    """
    _check_input("cast_rowwise", x, flat=False)
    fp8_max = _check_out_dtype("cast_rowwise", out_dtype)
    cfg = merge_config(_ROWWISE_CFG, config, name="cast_rowwise")
    M, K = x.shape
    q = torch.empty((M, K), dtype=out_dtype, device=x.device)
    inv = torch.empty((M, 1), dtype=torch.float32, device=x.device)
    if not M:
        return q, inv, torch.zeros((), dtype=torch.float32, device=x.device)
    with AMAX_CHAIN.output(x.device) as (amax, amax_next):
        grid = (cdiv(M, cfg["BLOCK_M"]),)
        _cast_rowwise_fwd_kernel[grid](
            x, q, inv, amax, amax_next, M, K, x.stride(0),
            FP8_MAX=fp8_max, MARGIN=margin, POWER_2=power_2,
            BLOCK_M=cfg["BLOCK_M"], BLOCK_K=cfg["BLOCK_K"], num_warps=cfg["num_warps"],
        )
    return q, inv, amax


# ------------------------------------------------------------------------------------------------
# Library ops: a fake kernel gives torch.compile their shapes; CUDA kernels above, also traced (_library.traced_kernel).


def _amax_fake(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty((), dtype=torch.float32)


def _cast_fake(x, scale, amax_in, margin, power_2, out_dtype):  # type: ignore[no-untyped-def]
    return (
        torch.empty(x.shape, dtype=out_dtype, device=x.device),
        x.new_empty((), dtype=torch.float32),
        x.new_empty((), dtype=torch.float32),
    )


def _cast_transpose_fake(x, scale, amax_in, margin, power_2, out_dtype):  # type: ignore[no-untyped-def]
    M, K = x.shape
    return (
        torch.empty((M, K), dtype=out_dtype, device=x.device),
        torch.empty((K, M), dtype=out_dtype, device=x.device),
        x.new_empty((), dtype=torch.float32),
        x.new_empty((), dtype=torch.float32),
    )


def _cast_transpose_dbias_fake(x, scale, amax_in, margin, power_2, out_dtype):  # type: ignore[no-untyped-def]
    return (*_cast_transpose_fake(x, scale, amax_in, margin, power_2, out_dtype),
            x.new_empty((x.shape[1],), dtype=torch.float32))


def _cast_rowwise_fake(x, margin, power_2, out_dtype):  # type: ignore[no-untyped-def]
    M, K = x.shape
    return (
        torch.empty((M, K), dtype=out_dtype, device=x.device),
        x.new_empty((M, 1), dtype=torch.float32),
        x.new_empty((), dtype=torch.float32),
    )


# The schema arguments of a per-tensor cast.
_CAST_SCHEMA = "Tensor x, Tensor scale, Tensor? amax_in, int margin, bool power_2, ScalarType out_dtype"

amax = OpSpec("amax(Tensor x) -> Tensor", cuda=contiguous_args(amax_launch), fake=_amax_fake,
              traced=traced_kernel(amax_launch))
"""``fp8ops::amax``: max |x| over every element, float32, NaN-propagating."""

transpose_bytes = OpSpec("transpose_bytes(Tensor x) -> Tensor", cuda=contiguous_args(transpose_bytes_launch),
                         fake=lambda x: x.new_empty((x.shape[1], x.shape[0])))
"""``fp8ops::transpose_bytes``: the contiguous transpose of a 2-D tensor of one-byte elements."""

cast = OpSpec(
    f"cast({_CAST_SCHEMA}) -> (Tensor, Tensor, Tensor)", cuda=contiguous_args(cast_launch), fake=_cast_fake,
    traced=traced_kernel(cast_launch),
)
"""``fp8ops::cast``: saturating FP8 cast + amax, ``(q, amax, inv_scale)``; see :func:`cast_launch`."""

def _cast_transpose_opaque(x, scale, amax_in, margin, power_2, out_dtype) -> bool:  # type: ignore[no-untyped-def]
    # the call whose eager launch stores q^T through a tensor map stays opaque in compiled graphs
    return x.dim() == 2 and opaque_for_tma_store(x, (x.shape[1], x.shape[0]))


cast_transpose = OpSpec(
    f"cast_transpose({_CAST_SCHEMA}) -> (Tensor, Tensor, Tensor, Tensor)",
    cuda=contiguous_args(cast_transpose_launch),
    fake=_cast_transpose_fake,
    traced=traced_kernel(cast_transpose_launch),
    opaque_when=_cast_transpose_opaque,
)
"""``fp8ops::cast_transpose``: cast + transposed copy + amax, ``(q, q_t, amax, inv_scale)``."""

cast_transpose_dbias = OpSpec(
    f"cast_transpose_dbias({_CAST_SCHEMA}) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
    cuda=contiguous_args(cast_transpose_dbias_launch),
    fake=_cast_transpose_dbias_fake,
    traced=traced_kernel(cast_transpose_dbias_launch),
    opaque_when=_cast_transpose_opaque,
)
"""``fp8ops::cast_transpose_dbias``: :data:`cast_transpose` plus the column sums of x (float32),
``(q, q_t, amax, inv_scale, dbias)``: an output gradient's bias gradient from the same pass."""


def _cast_transpose_heads_fake(q, k, v, scale, amax_in, margin, power_2, out_dtype):  # type: ignore[no-untyped-def]
    B, H0, S, D = q.shape
    M, K = S * B, (H0 + 2 * k.shape[1]) * D
    return (q.new_empty((M, K), dtype=out_dtype), q.new_empty((K, M), dtype=out_dtype),
            q.new_empty((), dtype=torch.float32), q.new_empty((), dtype=torch.float32),
            q.new_empty((K,), dtype=torch.float32))


cast_transpose_heads = OpSpec(
    "cast_transpose_heads(Tensor q, Tensor k, Tensor v, Tensor scale, Tensor? amax_in, int margin, bool power_2, "
    "ScalarType out_dtype) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
    cuda=cast_transpose_heads_launch,
    fake=_cast_transpose_heads_fake,
)
"""``fp8ops::cast_transpose_heads``: :data:`cast_transpose_dbias` of the QKV projection's gradient
assembled from attention's dq, dk, dv (B, H, S, D) in place; ``(q, q_t, amax, inv_scale, dbias)``."""

cast_rowwise = OpSpec(
    "cast_rowwise(Tensor x, int margin, bool power_2, ScalarType out_dtype) -> (Tensor, Tensor, Tensor)",
    cuda=contiguous_args(cast_rowwise_launch),
    fake=_cast_rowwise_fake,
)
"""``fp8ops::cast_rowwise``: cast with one scale per row, ``(q, inv_scale (M, 1), amax)``."""
