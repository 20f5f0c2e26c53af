"""Scaled FP8 GEMM with a fused epilogue: ``out = (a @ b.T) * scale_a * scale_b (+ bias)``.

Math (``a`` (M, K) and ``b`` (N, K) FP8, ``scale_a`` / ``scale_b`` the *inverse* scales that
dequantize them, as ``torch._scaled_mm`` takes them)::

    acc[m, n] = sum_k a[m, k] * b[n, k]                      # FP8 x FP8 products, float32 accumulator
    out[m, n] = cast(acc[m, n] * sa[m] * sb[n] + bias[n])    # sa, sb: one value per tensor or per row

Each scale is either per tensor (a 0-d tensor) or per row (``scale_a`` (M, 1), ``scale_b`` (1, N));
the two choices are independent constexprs. The bias (N,) (bfloat16, float16 or float32) is added in
float32 after scaling, and the result is cast once to bfloat16, float16 or float32.

Operand layout. Both operands are K-major: ``a`` row-major (M, K) and ``b`` row-major (N, K), which
is what Hopper's FP8 ``wgmma`` reads (it has no transpose bits for 8-bit types; a K-minor B forces a
register transpose and disables pipelining). The kernels never transpose ``b`` in memory: a tile of
``b`` is loaded as (BLOCK_N, BLOCK_K) and handed to ``tl.dot`` as the view ``b.T``. The operands may
mix formats (E5M2 gradient x E4M3 weight for a HYBRID dgrad): ``tl.dot`` accepts any pair of FP8
types, and on sm_90 Triton lowers the pair to ``wgmma`` instructions with separate A and B element
types (``.e5m2.e4m3``), so nothing is upcast on the GPU; the CPU interpreter upcasts both operands
to float16 (exact for every FP8 value) and multiplies in float32.

Accumulation (``fast_accum``, matching ``torch._scaled_mm(use_fast_accum=...)``). On sm_90 an FP8
``wgmma`` accumulates in the tensor core at reduced precision (about 14 bits kept, per the
DeepSeek-V3 report); Triton's
default for FP8 dots there is to keep the whole K loop in that accumulator (the fast mode, like
cuBLAS's fast accumulation). The precise mode passes ``max_num_imprecise_acc=PROMOTE_K`` (128 by
default, at most BLOCK_K) to ``tl.dot``: Triton then accumulates each group of PROMOTE_K products
into a fresh partial accumulator and adds it to the float32 accumulator with ordinary FP32 adds
(the 2-level accumulation of CUTLASS and DeepSeek-V3, promotion every 128 elements). It costs a
second set of accumulator registers, so the precise default tile is 128 x 128. Values of
``max_num_imprecise_acc`` below 32 would push Triton off ``wgmma`` and are rejected. Before sm_90
Triton ignores the setting (FP8 dots use ``mma.sync``), so both modes run the same code there.

Kernels (one launch each; both persistent):

- ``_scaled_mm_tma_fwd_kernel``: ``min(tiles, SMs x PROGRAMS_PER_SM)`` programs loop over output
  tiles in grouped order (GROUP_M tile rows share the same column strip of ``b`` while it is in L2),
  loading operand tiles through host-built TMA descriptors
  (``triton.tools.tensor_descriptor.TensorDescriptor``), pipelined over ``num_stages`` stages and,
  with ``FLATTEN``, across tile boundaries; the epilogue scales, adds the bias, casts and writes the
  tile with a TMA store, in two halves with ``EPILOGUE_SUBTILE`` (half the shared memory).
- ``_scaled_mm_fwd_kernel``: the same schedule and epilogue with masked pointer loads and stores;
  used where TMA is not available: the CPU interpreter, GPUs before sm_90, and shapes TMA cannot
  describe (descriptors need 16-byte aligned bases and row strides, so K % 16 == 0 and
  N * out.element_size() % 16 == 0; the launcher also requires every dimension to be at least its
  block size so that no TMA box is larger than its tensor).

Both kernels run the same ``tl.dot`` over the same K blocks in the same order and share the
epilogue code, so they compute the same thing; on the GPU their results agree to rounding.

Where it is fast or slow: it is compute-bound at training shapes (M, N, K in the thousands). The
schedule is the one of Triton's persistent-matmul tutorial (triton PR #5461); this kernel's numbers,
per configuration and against ``torch._scaled_mm`` in the same accumulation mode, come from
``python -m fp8ops.bench.gemm_sweep`` (docs/benchmarks/gemm_sweep.md). Small GEMMs (a few
tiles per SM or fewer) are limited by launch latency and by tile quantization (a 128-row tile
wastes most of an M=16 GEMM, which also takes the pointer kernel); the precise mode pays for its
FP32 adds, a second accumulator and narrower tiles. FP8 dots need sm_89 or newer (Triton rejects
float8e4nv before that).

References: Triton tutorial "Persistent Matmul" (python/tutorials/09-persistent-matmul.py, the TMA
and grouped persistent schedule); NVIDIA PTX ISA, ``wgmma.mma_async`` (FP8 operands must be K-major);
DeepSeek-AI, "DeepSeek-V3 Technical Report" (2024), section 3.3 (FP8 accumulation precision and
promotion to FP32 every 128 elements); Micikevicius et al., "FP8 Formats for Deep Learning" (2022).

The op is registered as the opaque ``torch.library`` custom op ``fp8ops::scaled_mm`` with a CUDA
kernel (the launcher below) and a fake kernel; the CPU kernel, the FP32 reference math, is
registered by ``fp8ops``.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import triton
import triton.language as tl

from triton.tools.tensor_descriptor import TensorDescriptor

from ._jit import grouped_tile
from ._library import OpSpec, cdiv, merge_config, num_sms

__all__ = [
    "FP8_DTYPES",
    "OUT_DTYPES",
    "default_config",
    "scaled_mm_launch",
    "uses_tma",
]

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_BIAS_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _schedule(M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    # The persistent tile schedule: (tile rows, tiles per group of GROUP_M tile rows, K blocks, tiles).
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    num_tiles = num_pid_m * num_pid_n
    num_pid_in_group = GROUP_M * num_pid_n
    return num_pid_m, num_pid_in_group, k_tiles, num_tiles


@triton.jit
def _dot(a, b, acc, FAST_ACCUM: tl.constexpr, PROMOTE_K: tl.constexpr):
    # acc + a @ b.T; the precise mode adds every PROMOTE_K products to acc in FP32.
    if FAST_ACCUM:
        acc = tl.dot(a, b.T, acc)
    else:
        acc = tl.dot(a, b.T, acc, max_num_imprecise_acc=PROMOTE_K)
    return acc


@triton.jit
def _epilogue(
    acc,  # (BLOCK_M, BLOCK_N) fp32 accumulator of a @ b.T
    offs_m,  # (BLOCK_M,) int32 row indices of the tile
    offs_n,  # (BLOCK_N,) int32 column indices of the tile
    M,
    N,
    scale_a_ptr,  # () or (M, 1) fp32, row stride stride_sa
    scale_b_ptr,  # () or (1, N) fp32, column stride stride_sb
    bias_ptr,  # (N,) bias, stride stride_bias (read only when HAS_BIAS)
    stride_sa,
    stride_sb,
    stride_bias,
    ROWWISE_A: tl.constexpr,
    ROWWISE_B: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    # Step: dequantize (one multiply per element when both scales are per tensor).
    if ROWWISE_A:
        sa = tl.load(scale_a_ptr + offs_m * stride_sa, mask=offs_m < M, other=1.0)
        if ROWWISE_B:
            sb = tl.load(scale_b_ptr + offs_n * stride_sb, mask=offs_n < N, other=1.0)
            acc = acc * sa[:, None] * sb[None, :]
        else:
            acc = acc * (sa * tl.load(scale_b_ptr))[:, None]
    else:
        if ROWWISE_B:
            sb = tl.load(scale_b_ptr + offs_n * stride_sb, mask=offs_n < N, other=1.0)
            acc = acc * (sb * tl.load(scale_a_ptr))[None, :]
        else:
            acc = acc * (tl.load(scale_a_ptr) * tl.load(scale_b_ptr))
    # Step: bias, in float32 after scaling.
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n * stride_bias, mask=offs_n < N, other=0.0).to(tl.float32)
        acc = acc + bias[None, :]
    return acc


@triton.jit
def _scaled_mm_tma_fwd_kernel(
    a_desc,  # TMA descriptor of a (M, K) fp8, block (BLOCK_M, BLOCK_K)
    b_desc,  # TMA descriptor of b (N, K) fp8, block (BLOCK_N, BLOCK_K)
    out_desc,  # TMA descriptor of out (M, N), block (BLOCK_M, BLOCK_N) or (BLOCK_M, BLOCK_N // 2)
    scale_a_ptr,  # () or (M, 1) fp32 inverse scale of a
    scale_b_ptr,  # () or (1, N) fp32 inverse scale of b
    bias_ptr,  # (N,) bias (read only when HAS_BIAS)
    M,
    N,
    K,
    stride_sa,
    stride_sb,
    stride_bias,
    ROWWISE_A: tl.constexpr,
    ROWWISE_B: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    FAST_ACCUM: tl.constexpr,
    PROMOTE_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,
    EPILOGUE_SUBTILE: tl.constexpr,
    FLATTEN: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
):
    # Step 1: the tile schedule. Program p owns tiles p, p + NUM_PROGRAMS, ...
    start_pid = tl.program_id(0)
    num_pid_m, num_pid_in_group, k_tiles, num_tiles = _schedule(
        M, N, K, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, GROUP_M=GROUP_M)
    # A separate counter for the epilogue keeps the prologue of the next tile free of epilogue
    # values, which the flattened software pipeline needs.
    tile_id_c = start_pid - NUM_PROGRAMS
    for tile_id in tl.range(start_pid, num_tiles, NUM_PROGRAMS, flatten=FLATTEN, warp_specialize=WARP_SPECIALIZE):
        pid_m, pid_n = grouped_tile(tile_id, num_pid_in_group, num_pid_m, GROUP_M=GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        # Step 2: the K loop. TMA zero-fills the part of a box past K, M or N.
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):
            off_k = ki * BLOCK_K
            a = a_desc.load([off_m, off_k])  # (BLOCK_M, BLOCK_K) fp8
            b = b_desc.load([off_n, off_k])  # (BLOCK_N, BLOCK_K) fp8, K-major
            acc = _dot(a, b, acc, FAST_ACCUM=FAST_ACCUM, PROMOTE_K=PROMOTE_K)
        # Step 3: the epilogue: scales, bias, cast, TMA store (clipped at the tensor's edge).
        tile_id_c += NUM_PROGRAMS
        pid_m, pid_n = grouped_tile(tile_id_c, num_pid_in_group, num_pid_m, GROUP_M=GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        offs_m = off_m + tl.arange(0, BLOCK_M)
        offs_n = off_n + tl.arange(0, BLOCK_N)
        acc = _epilogue(acc, offs_m, offs_n, M, N, scale_a_ptr, scale_b_ptr, bias_ptr, stride_sa, stride_sb,
                        stride_bias, ROWWISE_A=ROWWISE_A, ROWWISE_B=ROWWISE_B, HAS_BIAS=HAS_BIAS)
        if EPILOGUE_SUBTILE:
            # Two (BLOCK_M, BLOCK_N // 2) stores: half the shared-memory staging buffer.
            acc = tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1))
            acc0, acc1 = tl.split(acc)
            out_desc.store([off_m, off_n], acc0.to(out_desc.dtype))
            out_desc.store([off_m, off_n + BLOCK_N // 2], acc1.to(out_desc.dtype))
        else:
            out_desc.store([off_m, off_n], acc.to(out_desc.dtype))


@triton.jit
def _scaled_mm_fwd_kernel(
    a_ptr,  # (M, K) fp8, row stride stride_am, unit stride along K
    b_ptr,  # (N, K) fp8, row stride stride_bn, unit stride along K
    out_ptr,  # (M, N) output, row stride stride_om, unit stride along N
    scale_a_ptr,  # () or (M, 1) fp32 inverse scale of a
    scale_b_ptr,  # () or (1, N) fp32 inverse scale of b
    bias_ptr,  # (N,) bias (read only when HAS_BIAS)
    M,
    N,
    K,
    stride_am,
    stride_bn,
    stride_om,
    stride_sa,
    stride_sb,
    stride_bias,
    ROWWISE_A: tl.constexpr,
    ROWWISE_B: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    FAST_ACCUM: tl.constexpr,
    PROMOTE_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,
    FLATTEN: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
):
    # Step 1: the tile schedule, as in the TMA kernel.
    start_pid = tl.program_id(0)
    num_pid_m, num_pid_in_group, k_tiles, num_tiles = _schedule(
        M, N, K, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, GROUP_M=GROUP_M)
    offs_k0 = tl.arange(0, BLOCK_K)
    tile_id_c = start_pid - NUM_PROGRAMS
    for tile_id in tl.range(start_pid, num_tiles, NUM_PROGRAMS, flatten=FLATTEN, warp_specialize=WARP_SPECIALIZE):
        pid_m, pid_n = grouped_tile(tile_id, num_pid_in_group, num_pid_m, GROUP_M=GROUP_M)
        # Step 2: row indices past M or N are clamped to row 0 rather than masked: the loads stay
        # unmasked along M/N (vectorized), and those rows are never stored.
        offs_am = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_bn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_am = tl.max_contiguous(tl.multiple_of(tl.where(offs_am < M, offs_am, 0), BLOCK_M), BLOCK_M)
        offs_bn = tl.max_contiguous(tl.multiple_of(tl.where(offs_bn < N, offs_bn, 0), BLOCK_N), BLOCK_N)
        a_rows = a_ptr + offs_am.to(tl.int64)[:, None] * stride_am  # (BLOCK_M, 1) row pointers
        b_rows = b_ptr + offs_bn.to(tl.int64)[:, None] * stride_bn  # (BLOCK_N, 1) row pointers
        # Step 3: the K loop; the K tail is masked to zero, which adds nothing to the dot.
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):
            offs_k = ki * BLOCK_K + offs_k0
            k_ok = offs_k0 < K - ki * BLOCK_K
            a = tl.load(a_rows + offs_k[None, :], mask=k_ok[None, :], other=0.0)  # (BLOCK_M, BLOCK_K)
            b = tl.load(b_rows + offs_k[None, :], mask=k_ok[None, :], other=0.0)  # (BLOCK_N, BLOCK_K)
            acc = _dot(a, b, acc, FAST_ACCUM=FAST_ACCUM, PROMOTE_K=PROMOTE_K)
        # Step 4: the epilogue: scales, bias, cast, masked store.
        tile_id_c += NUM_PROGRAMS
        pid_m, pid_n = grouped_tile(tile_id_c, num_pid_in_group, num_pid_m, GROUP_M=GROUP_M)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = _epilogue(acc, offs_m, offs_n, M, N, scale_a_ptr, scale_b_ptr, bias_ptr, stride_sa, stride_sb,
                        stride_bias, ROWWISE_A=ROWWISE_A, ROWWISE_B=ROWWISE_B, HAS_BIAS=HAS_BIAS)
        out_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
        mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


# ------------------------------------------------------------------------------------------------
# Launcher: it alone knows grids and block sizes, and it validates what the kernels assume.

# Block sizes per accumulation mode. The precise mode keeps a second (partial) accumulator in
# registers, so a 128 x 256 tile would spill; it uses 128 x 128 with one more pipeline stage.
# Shared memory of the fast default: 3 stages x (128 + 256) x 128 B = 144 KiB for the operands, plus
# a 128 x 128 staging buffer for the subtiled TMA store (32 KiB bf16, 64 KiB fp32), under the
# 227 KiB of an H100/H200.
_TMA_FAST_CFG: dict[str, Any] = {
    "BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 128, "GROUP_M": 8, "num_stages": 3, "num_warps": 8,
    "EPILOGUE_SUBTILE": True, "PROGRAMS_PER_SM": 1, "FLATTEN": True, "WARP_SPECIALIZE": False,
    "PROMOTE_K": 128, "TMA": None,
}
_TMA_PRECISE_CFG: dict[str, Any] = dict(_TMA_FAST_CFG, BLOCK_N=128, num_stages=4)
# The pointer kernel also serves GPUs with ~100 KiB of shared memory (sm_89) and stages its operands
# through registers: 3 stages x (128 + 128) x 64 B = 48 KiB fits everywhere.
_POINTER_CFG: dict[str, Any] = dict(_TMA_FAST_CFG, BLOCK_N=128, BLOCK_K=64, num_stages=3)


def default_config(fast_accum: bool, *, tma: bool = True) -> dict[str, Any]:
    """The launch configuration used when no ``config`` is given (a copy; safe to modify).

    Args:
        fast_accum: the accumulation mode (the precise mode uses narrower tiles).
        tma: the configuration of the TMA kernel (True) or of the pointer-load kernel (False).

    Keys: ``BLOCK_M``, ``BLOCK_N``, ``BLOCK_K``, ``GROUP_M`` (tile rows per L2 group),
    ``num_stages``, ``num_warps``, ``EPILOGUE_SUBTILE`` (TMA kernel: store the tile in two halves),
    ``PROGRAMS_PER_SM`` (persistent programs per SM), ``FLATTEN`` (pipeline across tiles),
    ``WARP_SPECIALIZE`` (Triton's automatic warp specialization, experimental on sm_90),
    ``PROMOTE_K`` (precise mode: products accumulated in the tensor core between two FP32 adds;
    capped at BLOCK_K), ``TMA`` (None: TMA where possible; False: never; True: required).
    """
    if not tma:
        return dict(_POINTER_CFG)
    return dict(_TMA_FAST_CFG if fast_accum else _TMA_PRECISE_CFG)


def _cfg(fast_accum: bool, tma: bool, override: dict[str, Any] | None) -> dict[str, Any]:
    cfg = merge_config(default_config(fast_accum, tma=tma), override, name="scaled_mm")
    for key, lo in (("BLOCK_M", 16), ("BLOCK_N", 16), ("BLOCK_K", 32)):
        v = cfg[key]
        if not isinstance(v, int) or v < lo or v & (v - 1):
            raise ValueError(f"scaled_mm: config {key} must be a power of two >= {lo}, got {v!r}")
    for key in ("GROUP_M", "PROGRAMS_PER_SM", "num_stages", "num_warps"):
        if not isinstance(cfg[key], int) or cfg[key] < 1:
            raise ValueError(f"scaled_mm: config {key} must be a positive int, got {cfg[key]!r}")
    pk = cfg["PROMOTE_K"]
    if not isinstance(pk, int) or pk < 32 or pk % 32:
        raise ValueError(
            f"scaled_mm: config PROMOTE_K must be a multiple of 32 (one FP8 wgmma step), got {pk!r}; "
            "below 32 Triton cannot use wgmma at all"
        )
    if cfg["TMA"] not in (None, True, False):
        raise ValueError(f"scaled_mm: config TMA must be None, True or False, got {cfg['TMA']!r}")
    return cfg


@functools.lru_cache(maxsize=None)
def _has_tma(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def _tma_obstacle(
    a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype, cfg: dict[str, Any], *, need_gpu: bool
) -> str | None:
    """None if the TMA kernel can run these operands, else why not (for the error message)."""
    M, K = a.shape
    N = b.shape[0]
    if need_gpu:
        if a.device.type != "cuda":
            return "the tensors are not on a CUDA device"
        if not _has_tma(a.device.index if a.device.index is not None else torch.cuda.current_device()):
            return "the GPU has no TMA (needs compute capability 9.0 or newer)"
    if K % 16 or a.stride(0) % 16 or b.stride(0) % 16:
        return f"the row strides of a and b (K = {K} FP8 bytes) must be multiples of 16 bytes"
    if a.stride(0) < K or b.stride(0) < K:
        return "a and b must not have overlapping (e.g. broadcast) rows"
    if (N * out_dtype.itemsize) % 16:
        return f"the output row (N = {N} x {out_dtype}) must be a multiple of 16 bytes"
    if a.data_ptr() % 16 or b.data_ptr() % 16:
        return "a and b must start at 16-byte aligned addresses"
    if M < cfg["BLOCK_M"] or N < cfg["BLOCK_N"] or K < cfg["BLOCK_K"]:
        return (
            f"(M, N, K) = ({M}, {N}, {K}) is smaller than the block "
            f"({cfg['BLOCK_M']}, {cfg['BLOCK_N']}, {cfg['BLOCK_K']}) along some dimension"
        )
    return None


def _check_scale(arg: str, s: torch.Tensor, rows: tuple[int, int]) -> bool:
    """Validate a scale; return True for per-row scales, False for one per tensor."""
    if not isinstance(s, torch.Tensor) or s.dtype != torch.float32:
        got = s.dtype if isinstance(s, torch.Tensor) else type(s).__name__
        raise ValueError(f"scaled_mm: {arg} must be a float32 tensor, got {got}")
    if s.dim() == 0:
        return False
    if tuple(s.shape) == rows:
        return True
    raise ValueError(
        f"scaled_mm: {arg} must be () (one inverse scale per tensor) or {rows} (one per row), "
        f"got shape {tuple(s.shape)}"
    )


def _validate(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> tuple[bool, bool]:
    """Metadata checks shared by the launcher and the fake kernel; returns (ROWWISE_A, ROWWISE_B)."""
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"scaled_mm: {name} must be a tensor, got {type(t).__name__}")
        if t.dtype not in FP8_DTYPES:
            raise ValueError(
                f"scaled_mm: {name} must be torch.float8_e4m3fn or torch.float8_e5m2, got {t.dtype}; "
                "quantize it first (fp8ops.quantize)"
            )
    if a.dim() != 2 or b.dim() != 2:
        raise ValueError(
            f"scaled_mm: a must be 2-D (M, K) and b 2-D (N, K), got shapes {tuple(a.shape)} and {tuple(b.shape)}"
        )
    if a.shape[1] != b.shape[1]:
        raise ValueError(
            f"scaled_mm: a (M, K) and b (N, K) must share K, got {tuple(a.shape)} and {tuple(b.shape)}; "
            "b is the second operand stored K-major (out = a @ b.T): pass w, not w.t()"
        )
    K = a.shape[1]
    if K > 1 and a.stride(1) != 1:
        raise ValueError(
            f"scaled_mm: a must be row-major (unit stride along K), got strides {tuple(a.stride())}; "
            "call a.contiguous()"
        )
    if K > 1 and b.stride(1) != 1:
        raise ValueError(
            f"scaled_mm: b must be row-major (N, K) (unit stride along K: the K-major layout FP8 tensor "
            f"cores need), got strides {tuple(b.stride())}; call b.contiguous(), or quantize with a "
            "transposed copy (fp8ops.quantize(..., transpose=True))"
        )
    if out_dtype not in OUT_DTYPES:
        raise ValueError(
            f"scaled_mm: out_dtype must be torch.bfloat16, torch.float16 or torch.float32, got {out_dtype}"
        )
    M, N = a.shape[0], b.shape[0]
    rowwise_a = _check_scale("scale_a", scale_a, (M, 1))
    rowwise_b = _check_scale("scale_b", scale_b, (1, N))
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or bias.dtype not in _BIAS_DTYPES:
            got = bias.dtype if isinstance(bias, torch.Tensor) else type(bias).__name__
            raise ValueError(f"scaled_mm: bias must be a bfloat16, float16 or float32 tensor, got {got}")
        if tuple(bias.shape) != (N,):
            raise ValueError(f"scaled_mm: bias must have shape (N,) = ({N},), got {tuple(bias.shape)}")
    devices = {t.device for t in (a, b, scale_a, scale_b, bias) if t is not None}
    if len(devices) != 1:
        raise ValueError(f"scaled_mm: all tensors must be on one device, got {sorted(map(str, devices))}")
    return rowwise_a, rowwise_b


def _choose(
    a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype, fast_accum: bool, config: dict[str, Any] | None
) -> tuple[bool, dict[str, Any]]:
    """(use the TMA kernel?, its launch config). Raises ValueError if TMA is required but impossible."""
    cfg = _cfg(fast_accum, True, config)
    if cfg["TMA"] is False or a.numel() == 0 or b.numel() == 0:
        return False, _cfg(fast_accum, False, config)
    forced = cfg["TMA"] is True
    # A forced TMA launch on CPU tensors (the interpreter) skips the device checks.
    obstacle = _tma_obstacle(a, b, out_dtype, cfg, need_gpu=not (forced and a.device.type == "cpu"))
    if obstacle is None:
        return True, cfg
    if forced:
        raise ValueError(
            f"scaled_mm: config TMA=True but the TMA kernel cannot run: {obstacle}; "
            "pass TMA=None to fall back to pointer loads"
        )
    return False, _cfg(fast_accum, False, config)


def uses_tma(
    a: torch.Tensor,
    b: torch.Tensor,
    out_dtype: torch.dtype,
    fast_accum: bool = True,
    *,
    config: dict[str, Any] | None = None,
) -> bool:
    """Whether :func:`scaled_mm_launch` would run the TMA kernel for these operands and config.

    Raises:
        ValueError: the config is invalid, or requires TMA (``TMA=True``) where it cannot run.
    """
    return _choose(a, b, out_dtype, fast_accum, config)[0]


def scaled_mm_launch(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    fast_accum: bool,
    *,
    config: dict[str, Any] | None = None,
) -> torch.Tensor:
    """``(a @ b.T) * scale_a * scale_b (+ bias)`` cast to ``out_dtype``, in one kernel launch.

    Args:
        a: (M, K) FP8 (E4M3 or E5M2), unit stride along K.
        b: (N, K) FP8 (E4M3 or E5M2, may differ from ``a``), unit stride along K (K-major).
        scale_a: () or (M, 1) float32 inverse scale(s) of ``a``.
        scale_b: () or (1, N) float32 inverse scale(s) of ``b``.
        bias: (N,) bfloat16/float16/float32 or None.
        out_dtype: torch.bfloat16, torch.float16 or torch.float32.
        fast_accum: keep the whole K loop in the tensor core's FP8 accumulator (True) or promote
            to FP32 every ``PROMOTE_K`` products (False); see the module docstring.
        config: overrides of :func:`default_config` (block sizes, stages, warps, TMA on/off),
            applied to the defaults of whichever kernel runs.

    Returns:
        (M, N) tensor of ``out_dtype``, contiguous. For K == 0 it is the bias (or zeros).

    Raises:
        ValueError: a dtype, shape, stride or config is not supported; the message says which
            argument and what to do.
    """
    rowwise_a, rowwise_b = _validate(a, b, scale_a, scale_b, bias, out_dtype)
    # Step 1: which kernel, with which blocks.
    use_tma, cfg = _choose(a, b, out_dtype, fast_accum, config)
    M, K = a.shape
    N = b.shape[0]
    out = torch.empty((M, N), dtype=out_dtype, device=a.device)
    if M == 0 or N == 0:
        return out
    if K == 0:
        zeros = torch.zeros((M, N), dtype=torch.float32, device=a.device)
        return (zeros + bias.to(torch.float32) if bias is not None else zeros).to(out_dtype)
    # Step 2: the persistent grid.
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    num_programs = num_sms(a.device) * cfg["PROGRAMS_PER_SM"]
    grid = (min(num_programs, cdiv(M, bm) * cdiv(N, bn)),)
    sa_stride = scale_a.stride(0) if rowwise_a else 0
    sb_stride = scale_b.stride(1) if rowwise_b else 0
    bias_arg = bias if bias is not None else scale_a  # never read without HAS_BIAS
    bias_stride = bias.stride(0) if bias is not None else 0
    common = dict(
        ROWWISE_A=rowwise_a, ROWWISE_B=rowwise_b, HAS_BIAS=bias is not None,
        FAST_ACCUM=bool(fast_accum), PROMOTE_K=min(cfg["PROMOTE_K"], bk),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cfg["GROUP_M"], NUM_PROGRAMS=num_programs,
        FLATTEN=bool(cfg["FLATTEN"]), WARP_SPECIALIZE=bool(cfg["WARP_SPECIALIZE"]),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    # Step 3: launch.
    if use_tma:
        subtile = bool(cfg["EPILOGUE_SUBTILE"]) and bn >= 32
        a_desc = TensorDescriptor(a, [M, K], [a.stride(0), 1], [bm, bk])
        b_desc = TensorDescriptor(b, [N, K], [b.stride(0), 1], [bn, bk])
        out_desc = TensorDescriptor(out, [M, N], [N, 1], [bm, bn // 2 if subtile else bn])
        _scaled_mm_tma_fwd_kernel[grid](
            a_desc, b_desc, out_desc, scale_a, scale_b, bias_arg,
            M, N, K, sa_stride, sb_stride, bias_stride,
            EPILOGUE_SUBTILE=subtile, **common,
        )
    else:
        _scaled_mm_fwd_kernel[grid](
            a, b, out, scale_a, scale_b, bias_arg,
            M, N, K, a.stride(0), b.stride(0), N, sa_stride, sb_stride, bias_stride,
            **common,
        )
    return out


# ------------------------------------------------------------------------------------------------
# Library op: opaque to torch.compile (a fake kernel gives shapes), CUDA kernel above.


def _scaled_mm_fake(a, b, scale_a, scale_b, bias, out_dtype, fast_accum):  # type: ignore[no-untyped-def]
    _validate(a, b, scale_a, scale_b, bias, out_dtype)
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)


scaled_mm = OpSpec(
    "scaled_mm(Tensor a, Tensor b, Tensor scale_a, Tensor scale_b, Tensor? bias, ScalarType out_dtype,"
    " bool fast_accum) -> Tensor",
    cuda=lambda a, b, scale_a, scale_b, bias, out_dtype, fast_accum: scaled_mm_launch(
        a, b, scale_a, scale_b, bias, out_dtype, fast_accum
    ),
    fake=_scaled_mm_fake,
)
"""``fp8ops::scaled_mm``: ``(a @ b.T) * scale_a * scale_b (+ bias)`` in ``out_dtype``; see
:func:`scaled_mm_launch`."""
