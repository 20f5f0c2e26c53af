"""An AdamW step that also writes the updated weight's FP8 copy (the next forward's weight operand).

Per element of a weight ``w`` (N, K), its gradient ``g`` and moments ``m``, ``v``, with the step
count ``t`` after this step and the learning rate ``lr`` read from device memory (so that a CUDA
graph replays the step with new values), all arithmetic in float32 (torch's AdamW)::

    w  = w - lr * weight_decay * w
    m  = beta1 * m + (1 - beta1) * g
    v  = beta2 * v + (1 - beta2) * g * g
    w  = w - lr / (1 - beta1**t) * m / (sqrt(v) / sqrt(1 - beta2**t) + eps)
    q  = rne(clamp(w' * s, -fmax, fmax))          # w' = w as stored (rounded to w's dtype)
    amax = max |w'|

``w``, ``m`` and ``v`` are written back in place in their own dtypes; ``q`` (N, K) and its
transpose ``q_t`` (K, N), the dgrad GEMM's K-major operand, are written in the same pass with the
delayed-scaling scale ``s`` of the weight's state, so the forward of the next step needs no cast
of the weight (``fp8ops.adamw_quantize_``). ``1 / s`` goes to ``inv``. One launch, 2-D tiles,
grouped as in the cast-and-transpose kernel (``kernels/quantize.py``).

Unlike the ops' library ops, ``fp8ops::adamw_cast_transpose`` writes its arguments: an optimizer
step runs outside autograd and in place, as ``torch.optim``'s do (a CUDA graph of a training step
replays it on the same buffers). Its schema marks them mutable (``Tensor(a!)``), so
``torch.compile`` functionalizes the call.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from ._jit import abs_bits, atomic_amax, cast_fp8, clear_next_amax, fp8_scale, grouped_tile
from ._library import AMAX_CHAIN, OpSpec, cdiv, fast_launch, merge_config, tma_store_wanted, transposed_store

__all__ = ["adamw", "adamw_cast_transpose", "adamw_cast_transpose_launch", "adamw_launch"]

# 12288 x 4096 bf16 on an H100 (scripts/adamw_cast_check.py --sweep), µs: 32 x 128 with 4 warps 322,
# 64 x 64 / 4 324, 32 x 256 / 8 348, 128 x 64 / 8 357, 16 x 256 / 4 409, 64 x 128 / 8 427, 64 x 128 / 4
# 494, 128 x 128 / 8 496; torch's fused AdamW alone took 329 and with the library's cast 417. Later
# (scripts/adamw_bw_probe.py, docs/benchmarks/adamw_bw_probe_h100.json): 32 x 128 with 8 warps 286
# against 316 with 4 (4096 x 4096: 98.7 against 111.9), 64 x 64 / 8 287, 32 x 64 / 4 290; the flat
# AdamW without the copies runs at the copy bandwidth there (2.94 against 3.02 TB/s).
_CFG = {"BLOCK_M": 32, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 8, "TMA": False}
_FLAT_CFG = {"BLOCK": 2048, "num_warps": 4, "SLOTS": 8}
"""The multi-tensor AdamW (:func:`adamw_launch`): elements per program, warps, and tensors per
launch (scripts/adamw_bw_probe.py: blocks of 1024 to 8192 elements with 4 or 8 warps within 2 %
of each other at 12288 x 4096, a grid-stride loop 5-10 % slower)."""


@triton.jit
def _adamw_bias(step_ptr, beta1, beta2):
    # the bias corrections 1 - beta1**t and sqrt(1 - beta2**t) of the step count t in step_ptr
    t = tl.load(step_ptr)
    bias1 = 1.0 - tl.math.exp2(t * tl.math.log2(beta1))
    bias2_sqrt = tl.math.sqrt_rn(1.0 - tl.math.exp2(t * tl.math.log2(beta2)))
    return bias1, bias2_sqrt


@triton.jit
def _adamw_math(w, g, m, v, lr, bias1, bias2_sqrt, beta1, beta2, eps, weight_decay):
    # torch's AdamW on float32 tiles: returns the new (w, m, v)
    w = w - lr * weight_decay * w
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    denom = tl.math.sqrt_rn(v) / bias2_sqrt + eps
    w = w - (lr / bias1) * (m / denom)
    return w, m, v


@fast_launch
@triton.jit
def _adamw_cast_transpose_kernel(
    w_ptr,  # (N, K) weight, contiguous: read and written
    g_ptr,  # (N, K) gradient, contiguous
    m_ptr,  # (N, K) first moment, contiguous: read and written
    v_ptr,  # (N, K) second moment, contiguous: read and written
    q_ptr,  # (N, K) fp8 out
    qt_ptr,  # (K, N) fp8 out: the transposed copy
    qt_desc,  # TMA descriptor of qt with (BLOCK_K, BLOCK_M) tiles (TMA_T), else unused
    scale_ptr,  # () fp32 scale of the cast
    inv_ptr,  # () fp32 out: 1 / scale
    amax_ptr,  # () fp32 out, zero-initialised: max |w| after the step
    amax_next_ptr,  # () fp32: zeroed by program 0 (_library.AmaxChain), or None
    step_ptr,  # () fp32: the step count t after this step
    lr_ptr,  # () fp32 learning rate
    N,
    K,
    beta1,
    beta2,
    eps,
    weight_decay,
    FP8_MAX: tl.constexpr,
    TMA_T: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # Step 1: the tile, and the step's scalars.
    pid = tl.program_id(0)
    num_m = tl.cdiv(N, BLOCK_M)
    num_k = tl.cdiv(K, BLOCK_K)
    pid_m, pid_k = grouped_tile(pid, GROUP_M * num_k, num_m, GROUP_M=GROUP_M)
    scale = fp8_scale(scale_ptr, scale_ptr, inv_ptr, pid, FP8_MAX=FP8_MAX, MARGIN=0, SCALE_FROM_AMAX=False,
                      POWER_2=False)  # the given scale; program 0 writes 1 / scale
    lr = tl.load(lr_ptr)
    bias1, bias2_sqrt = _adamw_bias(step_ptr, beta1, beta2)
    # Step 2: AdamW on the tile, in float32; the weight and the moments written back.
    rm = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    rk = pid_k.to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rm[:, None] < N) & (rk[None, :] < K)
    offs = rm[:, None] * K + rk[None, :]
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    m = tl.load(m_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    w, m, v = _adamw_math(w, g, m, v, lr, bias1, bias2_sqrt, beta1, beta2, eps, weight_decay)
    w_out = w.to(w_ptr.dtype.element_ty)
    tl.store(w_ptr + offs, w_out, mask=mask)
    tl.store(m_ptr + offs, m.to(m_ptr.dtype.element_ty), mask=mask)
    tl.store(v_ptr + offs, v.to(v_ptr.dtype.element_ty), mask=mask)
    # Step 3: the FP8 copy of the weight as stored, its transpose, and its amax (lanes outside the
    # weight held at 0: with eps = 0 their 0 / 0 would be a NaN).
    ws = tl.where(mask, w_out.to(tl.float32), 0.0)
    q = cast_fp8(ws, scale, q_ptr, FP8_MAX=FP8_MAX)
    tl.store(q_ptr + offs, q, mask=mask)
    if TMA_T:  # the tensor map clips the tile at the edges
        qt_desc.store([pid_k * BLOCK_K, pid_m * BLOCK_M], tl.trans(q))
    else:
        tl.store(qt_ptr + rk[:, None] * N + rm[None, :], tl.trans(q), mask=tl.trans(mask))
    atomic_amax(amax_ptr, tl.max(tl.max(abs_bits(ws), axis=1), axis=0))
    clear_next_amax(amax_next_ptr, pid)


def adamw_cast_transpose_launch(
    w: torch.Tensor,
    g: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    step: torch.Tensor,
    lr: torch.Tensor,
    scale: torch.Tensor,
    q: torch.Tensor,
    q_t: torch.Tensor,
    inv: torch.Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    *,
    config: dict[str, Any] | None = None,
) -> torch.Tensor:
    """One AdamW step on ``w``, ``m``, ``v`` in place and the FP8 copy of the new ``w`` into ``q``,
    ``q_t`` and ``inv`` (in place); returns the amax of the new ``w`` (a new () float32 tensor).

    ``w``, ``g``, ``m``, ``v``: (N, K) contiguous, one device, float32/bfloat16/float16 each;
    ``step``, ``lr``, ``scale``: () float32 (``step`` already counts this step); ``q`` (N, K) and
    ``q_t`` (K, N) contiguous FP8 of one dtype; ``inv``: () float32. The caller validates.
    """
    cfg = merge_config(_CFG, config, name="adamw_cast_transpose")
    N, K = w.shape
    fp8_max = torch.finfo(q.dtype).max
    grid = (max(1, cdiv(N, cfg["BLOCK_M"]) * cdiv(K, cfg["BLOCK_K"])),)
    tma = tma_store_wanted(q_t, {"TMA": cfg["TMA"]})
    desc = transposed_store(q_t, tma, cfg["BLOCK_K"], cfg["BLOCK_M"])
    with AMAX_CHAIN.output(w.device) as (amax, amax_next):
        _adamw_cast_transpose_kernel[grid](
            w, g, m, v, q, q_t, desc, scale, inv, amax, amax_next, step, lr, N, K,
            float(beta1), float(beta2), float(eps), float(weight_decay),
            FP8_MAX=fp8_max, TMA_T=tma, BLOCK_M=cfg["BLOCK_M"], BLOCK_K=cfg["BLOCK_K"], GROUP_M=cfg["GROUP_M"],
            num_warps=cfg["num_warps"],
        )
    return amax


# ------------------------------------------------------------------------------------------------
# Library op: the weight, the moments and the FP8 outputs are written in place (mutable arguments).


def _adamw_cast_transpose_fake(w, g, m, v, step, lr, scale, q, q_t, inv, beta1, beta2, eps,  # type: ignore[no-untyped-def]
                               weight_decay):
    return scale.new_empty(())


adamw_cast_transpose = OpSpec(
    "adamw_cast_transpose(Tensor(a!) w, Tensor g, Tensor(b!) m, Tensor(c!) v, Tensor step, Tensor lr, Tensor scale,"
    " Tensor(d!) q, Tensor(e!) q_t, Tensor(f!) inv, float beta1, float beta2, float eps, float weight_decay) -> Tensor",
    cuda=lambda w, g, m, v, step, lr, scale, q, q_t, inv, beta1, beta2, eps, weight_decay: adamw_cast_transpose_launch(
        w, g, m, v, step, lr, scale, q, q_t, inv, beta1, beta2, eps, weight_decay
    ),
    fake=_adamw_cast_transpose_fake,
)
"""``fp8ops::adamw_cast_transpose``: see :func:`adamw_cast_transpose_launch`; returns the amax."""


# ------------------------------------------------------------------------------------------------
# AdamW alone over a list of tensors (the parameters without an FP8 copy: embeddings, norms, biases)


@triton.jit
def _adamw_kernel(
    ws,  # tuple of SLOTS pointers: the parameters, contiguous, read and written
    gs,  # tuple of SLOTS pointers: their gradients, contiguous
    ms,  # tuple of SLOTS pointers: first moments, read and written
    vs,  # tuple of SLOTS pointers: second moments, read and written
    ns,  # tuple of SLOTS element counts
    ends,  # tuple of SLOTS: the number of programs up to and including each tensor's
    step_ptr,  # () fp32: the step count t after this step
    lr_ptr,  # () fp32 learning rate
    beta1,
    beta2,
    eps,
    weight_decay,
    SLOTS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # Program pid steps BLOCK elements of the tensor whose range of programs holds pid.
    pid = tl.program_id(0)
    lr = tl.load(lr_ptr)
    bias1, bias2_sqrt = _adamw_bias(step_ptr, beta1, beta2)
    start = 0
    for i in tl.static_range(SLOTS):
        if (pid >= start) & (pid < ends[i]):
            offs = (pid - start).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
            mask = offs < ns[i]
            w = tl.load(ws[i] + offs, mask=mask, other=0.0).to(tl.float32)
            g = tl.load(gs[i] + offs, mask=mask, other=0.0).to(tl.float32)
            m = tl.load(ms[i] + offs, mask=mask, other=0.0).to(tl.float32)
            v = tl.load(vs[i] + offs, mask=mask, other=0.0).to(tl.float32)
            w, m, v = _adamw_math(w, g, m, v, lr, bias1, bias2_sqrt, beta1, beta2, eps, weight_decay)
            tl.store(ws[i] + offs, w.to(ws[i].dtype.element_ty), mask=mask)
            tl.store(ms[i] + offs, m.to(ms[i].dtype.element_ty), mask=mask)
            tl.store(vs[i] + offs, v.to(vs[i].dtype.element_ty), mask=mask)
        start = ends[i]


def adamw_launch(
    ws: list[torch.Tensor],
    gs: list[torch.Tensor],
    ms: list[torch.Tensor],
    vs: list[torch.Tensor],
    step: torch.Tensor,
    lr: torch.Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    *,
    config: dict[str, Any] | None = None,
) -> None:
    """One AdamW step on every ``ws[i]``, ``ms[i]``, ``vs[i]`` in place (the math of
    :func:`adamw_cast_transpose_launch` without the FP8 copy), ``SLOTS`` tensors per launch.

    ``ws[i]``, ``gs[i]``, ``ms[i]``, ``vs[i]``: one shape, contiguous, on one device, each
    float32/bfloat16/float16; ``step``, ``lr``: () float32 (``step`` already counts this step).
    Empty tensors are skipped. The caller validates.
    """
    cfg = merge_config(_FLAT_CFG, config, name="adamw")
    block, slots = cfg["BLOCK"], cfg["SLOTS"]
    items = [(w, g, m, v) for w, g, m, v in zip(ws, gs, ms, vs) if w.numel()]
    for first in range(0, len(items), slots):
        group = items[first:first + slots]
        ends, total = [], 0
        for w, *_ in group:
            total += cdiv(w.numel(), block)
            ends.append(total)
        pad = slots - len(group)  # unused slots: no programs (their end is the last one's)
        cols = [tuple(x[j] for x in group) + (group[-1][j],) * pad for j in range(4)]
        _adamw_kernel[(total,)](
            *cols, tuple(x[0].numel() for x in group) + (0,) * pad, tuple(ends) + (total,) * pad, step, lr,
            float(beta1), float(beta2), float(eps), float(weight_decay), SLOTS=slots, BLOCK=block,
            num_warps=cfg["num_warps"],
        )


def _adamw_fake(w, g, m, v, step, lr, beta1, beta2, eps, weight_decay):  # type: ignore[no-untyped-def]
    return None


adamw = OpSpec(
    "adamw(Tensor(a!)[] w, Tensor[] g, Tensor(b!)[] m, Tensor(c!)[] v, Tensor step, Tensor lr, float beta1,"
    " float beta2, float eps, float weight_decay) -> ()",
    cuda=lambda w, g, m, v, step, lr, beta1, beta2, eps, weight_decay: adamw_launch(
        w, g, m, v, step, lr, beta1, beta2, eps, weight_decay
    ),
    fake=_adamw_fake,
)
"""``fp8ops::adamw``: see :func:`adamw_launch`."""
