"""``@triton.jit`` helpers shared by the kernels of several ops (inlined into each kernel).

The FP8 cast (``kernels/quantize.py`` gives the math)::

    s    = given, or fmax / amax / 2**margin just in time   (scale_from_amax, fp8_scale)
    q    = rne(clamp(y * s, -fmax, fmax))                   (saturate, cast_fp8)
    amax = max |y|                                          (abs_bits, atomic_amax)

- ``saturate``: clamps to the format's finite range; a NaN passes through.
- ``scale_from_amax``: the current-scaling scale of an amax (a scalar or a tile of row amaxes):
  ``fmax / amax / 2**margin``, clamped to the normal float32 range, optionally rounded down to a
  power of two; ``fallback`` where the amax is 0 or not finite. ``scale_from_fmax``: the same with
  the format's maximum as a tensor (one per state in ``kernels/_update.py``).
- ``fp8_scale``: a kernel's cast prologue: the scale read from memory or computed just in time
  from the tensor's amax; program 0 also writes ``1 / scale``.
- ``cast_fp8``: ``saturate(y * scale)`` converted to the element type of an FP8 output pointer.
- ``abs_bits``: ``|x|`` as int32 bit patterns. For non-negative floats the integer order is the
  float order, and a NaN's bits exceed every finite value's, so an integer max is a NaN-propagating
  float max.
- ``atomic_amax``: folds a program's largest ``abs_bits`` value into the fp32 amax word (zero
  initialised) with one integer ``atomic_max``.
- ``clear_next_amax``: program 0 zeroes the amax word of the next amax-producing launch on the
  stream (``_library.AmaxChain``), so that no fill kernel precedes it.
- ``grouped_tile``: the grouped program order of 2-D tilings: ``GROUP_M`` consecutive tile rows
  walk the tile columns together, so the operand strip (GEMM) or output rows (transposed copies)
  they share stay in L2.

References: Micikevicius et al., "FP8 Formats for Deep Learning" (2022); Triton's matmul
tutorials (grouped ordering).
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = [
    "abs_bits",
    "atomic_amax",
    "cast_fp8",
    "clear_next_amax",
    "fp8_scale",
    "grouped_tile",
    "saturate",
    "scale_from_amax",
    "scale_from_fmax",
]


@triton.jit
def saturate(y, FP8_MAX: tl.constexpr):
    # Clamp to the finite range; a NaN passes through unchanged (min/max would drop it).
    return tl.where(y != y, y, tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX))


@triton.jit
def scale_from_amax(
    amax,  # () or (BLOCK,) fp32 amax
    fallback,  # fp32 scale used where the amax is 0 or not finite
    FP8_MAX: tl.constexpr,
    MARGIN: tl.constexpr,
    POWER_2: tl.constexpr,
):
    return scale_from_fmax(amax, fallback, FP8_MAX + tl.zeros_like(amax), MARGIN=MARGIN, POWER_2=POWER_2)


@triton.jit
def scale_from_fmax(
    amax,  # () or (BLOCK,) fp32 amax
    fallback,  # fp32 scale used where the amax is 0 or not finite
    fmax,  # fp32 largest value of the FP8 format, amax's shape (one per state in the fused update)
    MARGIN: tl.constexpr,
    POWER_2: tl.constexpr,
):
    # Step: fmax / amax / 2**margin, clamped to the normal float32 range.
    sf = tl.math.div_rn(fmax, amax)
    if MARGIN > 0:
        sf = sf * (0.5**MARGIN)  # exact: a power of two
    sf = tl.minimum(tl.maximum(sf, 1.1754943508222875e-38), 3.4028234663852886e38)
    if POWER_2:
        # Round down to a power of two: keep the exponent bits, clear the mantissa.
        sf = (sf.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
    valid = (amax > 0.0) & (amax < float("inf"))
    return tl.where(valid, sf, fallback)


@triton.jit
def fp8_scale(
    scale_ptr,  # () fp32 scale (delayed) or fallback scale (current)
    amax_in_ptr,  # () fp32 amax of the cast tensor (current scaling only)
    inv_ptr,  # () fp32 output: 1 / scale, written by program 0
    pid,  # this program's id
    FP8_MAX: tl.constexpr,
    MARGIN: tl.constexpr,
    SCALE_FROM_AMAX: tl.constexpr,
    POWER_2: tl.constexpr,
):
    # Every program reads (or computes) the same scale.
    if SCALE_FROM_AMAX:
        amax = tl.load(amax_in_ptr)
        fallback = tl.load(scale_ptr)
        scale = scale_from_amax(amax, fallback, FP8_MAX=FP8_MAX, MARGIN=MARGIN, POWER_2=POWER_2)
    else:
        scale = tl.load(scale_ptr)
    if pid == 0:
        tl.store(inv_ptr, tl.math.div_rn(1.0 + tl.zeros_like(scale), scale))
    return scale


@triton.jit
def cast_fp8(y, scale, q_ptr, FP8_MAX: tl.constexpr):
    # Saturating cast of the fp32 tile y * scale to q_ptr's FP8 type (round to nearest even).
    return saturate(y * scale, FP8_MAX=FP8_MAX).to(q_ptr.dtype.element_ty)


@triton.jit
def abs_bits(x):
    return tl.abs(x).to(tl.int32, bitcast=True)


@triton.jit
def atomic_amax(
    amax_ptr,  # () fp32 amax, zero-initialised
    bits,  # () int32: the program's largest abs_bits value
):
    tl.atomic_max(amax_ptr.to(tl.pointer_type(tl.int32)), bits, sem="relaxed")


@triton.jit
def clear_next_amax(
    amax_next_ptr,  # () fp32: the amax output of the next amax-producing launch on this stream, or
    # None (a compile-time constant) when the launch is not chained
    pid,  # this program's id
):
    if amax_next_ptr is not None:
        if pid == 0:
            tl.store(amax_next_ptr, 0.0)


@triton.jit
def grouped_tile(tile_id, num_pid_in_group, num_pid_m, GROUP_M: tl.constexpr):
    # (pid_m, pid_n) of tile tile_id; num_pid_in_group = GROUP_M * (number of tile columns).
    # An empty matrix still launches one program (it writes the inverse scale): with no tile row or
    # column, the counts are held at 1 so that no integer division by zero makes a wild tile index.
    num_pid_in_group = tl.maximum(num_pid_in_group, 1)
    group_id = tile_id // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = tl.maximum(tl.minimum(num_pid_m - first_pid_m, GROUP_M), 1)
    pid_m = first_pid_m + (tile_id % group_size_m)
    pid_n = (tile_id % num_pid_in_group) // group_size_m
    return pid_m, pid_n
