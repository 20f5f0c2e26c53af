"""Cross-entropy of a row of logits and its gradient in one kernel.

An output head ends a language model's step with ``logits = x W^T`` (M tokens by a vocabulary of
V) and the mean cross-entropy of the targets. Computed by torch, the loss reads the (M, V) logits
once in the forward (the log-sum-exp of every row) and again in the backward, where it writes their
gradient: two passes over the largest activation of the step. This kernel writes the gradient in
the forward instead, so the logits are read once (twice per row, the second time mostly from L2)
and are not kept for the backward: what the backward needs is the gradient itself, which the head's
two backward GEMMs read (``fp8ops.linear_cross_entropy``).

Math (per row r with target t, all arithmetic in float32)::

    m      = max_j z_j,   s = sum_j exp(z_j - m),   lse = m + log s
    loss_r = lse - z_t                               (0 where t == ignore_index)
    d_rj   = exp(z_j - lse) - [j == t]               (0 where t == ignore_index)

``d`` is the gradient of ``loss_r`` by the logits, before the scale ``g / count`` that the mean and
the gradient arriving at the loss give it; the head's backward GEMMs apply that scale to their
outputs. A target outside ``[0, V)`` other than ``ignore_index`` makes its row's loss NaN (and its
gradient row the softmax alone), so that the mean is NaN: the kernel never reads outside the row.

Kernel:

- ``_linear_cross_entropy_fwd_kernel``: ``PROGRAMS_PER_SM`` programs per SM (0: one per row), each
  walking rows ``pid, pid + programs, ...``. Per row, pass 1 walks the row in blocks of ``BLOCK_V``
  with a running maximum and sum of exponentials per lane (an online softmax), folded into ``lse``
  at the end; pass 2 walks it again, from its last block back when ``REVERSE`` (the blocks pass 1
  read last are the likeliest still in L2), and writes ``d`` in the logits' dtype. The exponentials
  are base 2, the logits scaled by log2(e) as they are loaded. With ``EVICT`` pass 1's loads ask L2
  to keep the row and pass 2's loads and the gradient's stores to go first, so that the second read
  comes from L2 and the kernel moves about 2 bytes in and 2 out per bf16 logit. Measured on an
  H100 at 8192 x 50304 bf16: the hints took it from 783 to 672 µs (a copy of the logits: 545), pass
  2 from the row's end saved 2-4 %, fewer rows in flight did not help, and loading each next block
  ahead did not beat the default (docs/kernels/linear_cross_entropy.md).

References: Milakov & Gimelshein, "Online normalizer calculation for softmax" (2018); the fused
linear cross-entropy of Liger-Kernel (Hsu et al., 2024).

The op is registered as ``fp8ops::linear_cross_entropy_fwd`` with a CUDA kernel (the launcher), a
traced CUDA kernel (Inductor launches the Triton kernel itself in graphs compiled for CUDA tensors)
and a fake kernel; the CPU kernel, the FP32 reference math, is registered by
``fp8ops.linear_cross_entropy``.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from ._library import OpSpec, contiguous_args, fast_launch, graph_kernel, merge_config, num_sms, traced_kernel

__all__ = ["linear_cross_entropy_fwd_launch"]

_IN_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_TARGET_DTYPES = (torch.int64, torch.int32)
_CFG = {"BLOCK_V": 8192, "num_warps": 16, "PROGRAMS_PER_SM": 0, "REVERSE": True, "EVICT": True}
"""Block of the row walked per step, warps per program, programs per SM (0: one per row), pass 2
from the row's end, and L2 eviction hints (pass 1's loads kept, pass 2's loads and the gradient's
stores dropped first). On an H100 at 8192 x 50304 bf16 (``scripts/elementwise_ab.py``): 672 µs,
within 0.3 % of the fastest setting measured, against 783 µs for the previous default (8192 / 16
warps / 2 per SM, no hints) and 545 µs for a copy of the logits
(docs/kernels/linear_cross_entropy.md)."""


LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@fast_launch
@triton.jit
def _linear_cross_entropy_fwd_kernel(
    z_ptr,  # (M, V) logits, unit column stride
    t_ptr,  # (M,) integer targets
    loss_ptr,  # (M,) float32 per-row loss
    d_ptr,  # (M, V) gradient of the row's loss by the logits, in the logits' dtype
    M,
    V,
    stride_zm,  # row stride of z
    stride_dm,  # row stride of d
    ignore_index,
    BLOCK_V: tl.constexpr,
    REVERSE: tl.constexpr,  # pass 2 walks the row from its end (the blocks pass 1 read last)
    EVICT: tl.constexpr,  # pass 1 asks L2 to keep the row; pass 2's loads and d's stores go first
):
    cols = tl.arange(0, BLOCK_V)
    neg_inf = float("-inf")
    last = tl.cdiv(V, BLOCK_V) - 1
    EV_1: tl.constexpr = "evict_last" if EVICT else ""
    EV_2: tl.constexpr = "evict_first" if EVICT else ""
    for row in range(tl.program_id(0).to(tl.int64), M, tl.num_programs(0)):
        z_row = z_ptr + row * stride_zm
        d_row = d_ptr + row * stride_dm
        t = tl.load(t_ptr + row).to(tl.int64)

        # -- pass 1: running maximum and sum of exp per lane (a lane whose maximum is -inf adds 0),
        # in base 2 (exp2 is the hardware's): lse2 = lse * log2(e)
        m = tl.full([BLOCK_V], neg_inf, tl.float32)
        s = tl.zeros([BLOCK_V], tl.float32)
        for start in range(0, V, BLOCK_V):
            c = start + cols
            z = tl.load(z_row + c, mask=c < V, other=neg_inf, eviction_policy=EV_1).to(tl.float32) * LOG2E
            m_new = tl.maximum(m, z, propagate_nan=tl.PropagateNan.ALL)
            live = m_new != neg_inf
            s = tl.where(live, s * tl.exp2(m - m_new) + tl.exp2(z - m_new), 0.0)
            m = m_new
        # a NaN logit makes its lane's maximum and sum NaN, and so the row's lse and loss
        m_row = tl.max(m, axis=0)
        s_row = tl.sum(tl.where(m != neg_inf, s * tl.exp2(m - m_row), 0.0), axis=0)
        lse2 = m_row + tl.log2(s_row)
        lse = lse2 * LN2

        # -- the row's loss: lse - z_t; NaN for a target outside the row (never loaded)
        ignored = t == ignore_index
        inside = (t >= 0) & (t < V)
        z_t = tl.load(z_row + tl.where(inside, t, 0)).to(tl.float32)
        loss = tl.where(inside, lse - z_t, float("nan"))
        tl.store(loss_ptr + row, tl.where(ignored, 0.0, loss))

        # -- pass 2: d = softmax - onehot(t), zero rows for ignored targets
        keep = tl.where(ignored, 0.0, 1.0)
        step = BLOCK_V
        first = 0
        if REVERSE:
            step = -BLOCK_V
            first = last * BLOCK_V
        for i in range(0, last + 1):
            c = first + i * step + cols
            inb = c < V
            z = tl.load(z_row + c, mask=inb, other=neg_inf, eviction_policy=EV_2).to(tl.float32)
            p = tl.exp2(z * LOG2E - lse2)
            d = (p - tl.where(c == t, 1.0, 0.0)) * keep
            tl.store(d_row + c, d.to(d_ptr.dtype.element_ty), mask=inb, eviction_policy=EV_2)


def _check(logits: torch.Tensor, target: torch.Tensor) -> None:
    where = "linear_cross_entropy_fwd_launch"
    if logits.dim() != 2 or logits.dtype not in _IN_DTYPES:
        raise ValueError(f"{where}: logits must be a 2-D (M, V) float32/bfloat16/float16 tensor, got "
                         f"{logits.dtype} of shape {tuple(logits.shape)}")
    if logits.shape[1] > 1 and logits.stride(1) != 1:
        raise ValueError(f"{where}: logits must have a unit column stride, got strides {logits.stride()}")
    if (target.dim() != 1 or target.dtype not in _TARGET_DTYPES or target.shape[0] != logits.shape[0]
            or (target.shape[0] > 1 and target.stride(0) != 1)):
        raise ValueError(f"{where}: target must be a 1-D int64/int32 tensor of the logits' {logits.shape[0]} rows "
                         f"with a unit stride, got {target.dtype} of shape {tuple(target.shape)} and strides "
                         f"{target.stride()}")
    if target.device != logits.device:
        raise ValueError(f"{where}: target is on {target.device}, the logits on {logits.device}")


def linear_cross_entropy_fwd_launch(logits: torch.Tensor, target: torch.Tensor, ignore_index: int, *,
                                    config: dict[str, Any] | None = None,
                                    traced: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row cross-entropy of ``logits`` and its gradient by the logits, in one kernel.

    Args:
        logits: (M, V) float32, bfloat16 or float16, unit column stride.
        target: (M,) int64 or int32 class indices; ``ignore_index`` marks rows left out.
        ignore_index: the target value of rows that contribute neither loss nor gradient.
        config: overrides of ``BLOCK_V`` and ``num_warps``.
        traced: launch through ``torch.library.wrap_triton`` (inside a compiled graph).

    Returns:
        ``(loss, d)``: (M,) float32 ``lse_r - z_{r, t_r}`` (0 for ignored rows, NaN for a target
        outside ``[0, V)``) and (M, V) ``softmax(z_r) - onehot(t_r)`` in the logits' dtype (zero
        rows for ignored targets).
    """
    _check(logits, target)
    cfg = merge_config(_CFG, config, name="linear_cross_entropy_fwd_launch")
    M, V = logits.shape
    loss = torch.empty((M,), dtype=torch.float32, device=logits.device)
    d = torch.empty((M, V), dtype=logits.dtype, device=logits.device)
    if M == 0:
        return loss, d
    block = min(cfg["BLOCK_V"], triton.next_power_of_2(max(V, 16)))
    programs = M if not cfg["PROGRAMS_PER_SM"] else min(M, cfg["PROGRAMS_PER_SM"] * num_sms(logits.device))
    graph_kernel(_linear_cross_entropy_fwd_kernel, traced)[(programs,)](
        logits, target, loss, d, M, V, logits.stride(0), d.stride(0), ignore_index,
        BLOCK_V=block, REVERSE=bool(cfg["REVERSE"]), EVICT=bool(cfg["EVICT"]), num_warps=cfg["num_warps"],
    )
    return loss, d


def _linear_cross_entropy_fwd_fake(logits, target, ignore_index):  # type: ignore[no-untyped-def]
    return (logits.new_empty((logits.shape[0],), dtype=torch.float32), logits.new_empty(logits.shape))


def _unit(t: torch.Tensor) -> torch.Tensor:
    # the kernel takes any row stride of the logits but needs a unit column stride, and reads the
    # targets with a unit stride
    if t.dim() == 2 and (t.stride(1) == 1 or t.shape[1] <= 1):
        return t
    return t if t.dim() == 1 and (t.stride(0) == 1 or t.shape[0] <= 1) else t.contiguous()


linear_cross_entropy_fwd = OpSpec(
    "linear_cross_entropy_fwd(Tensor logits, Tensor target, int ignore_index) -> (Tensor, Tensor)",
    cuda=contiguous_args(linear_cross_entropy_fwd_launch, 2, _unit),
    fake=_linear_cross_entropy_fwd_fake,
    traced=traced_kernel(linear_cross_entropy_fwd_launch, 2, _unit),
)
"""``fp8ops::linear_cross_entropy_fwd``: per-row cross-entropy and its gradient by the logits,
``(loss, d)``; see :func:`linear_cross_entropy_fwd_launch`."""
