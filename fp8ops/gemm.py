"""FP8 GEMM dispatch shared by the linear-layer ops: Triton kernel or cuBLAS, padding, CPU path.

``scaled_mm(a, b, scale_a, scale_b, ...)`` computes ``(a @ b.T) * scale_a * scale_b (+ bias)`` with
``a`` (M, K) and ``b`` (N, K) FP8, both row-major (K-major: the layout Hopper's FP8 tensor cores
want), and inverse scales: () for one per tensor, or (M, 1) and (N, 1) for one per row.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .kernels import gemm as _K
from .kernels._library import OPS, define as _define
from ._glue import cast
from .reference import gemm as _ref

__all__ = ["add_bias", "bias_in_epilogue", "resolve_backend", "scaled_mm"]

# The library op, every kernel side by side: CUDA and fake kernels from kernels/gemm.py, the CPU
# kernel is the reference math.
_define(_K.scaled_mm, cpu=_ref.scaled_mm)


def _scaled_mm_vmap(info, in_dims, a, b, scale_a, scale_b, bias, out_dtype, fast_accum):  # type: ignore[no-untyped-def]
    """vmap rule: one GEMM per batch entry (exact "vmap = loop" semantics)."""
    args = (a, b, scale_a, scale_b, bias)
    outs = []
    for i in range(info.batch_size):
        ai, bi, sa, sb, bb = (t if d is None or t is None else t.select(d, i) for t, d in zip(args, in_dims))
        outs.append(torch.ops.fp8ops.scaled_mm(ai, bi, sa, sb, bb, out_dtype, fast_accum))
    return torch.stack(outs), 0


torch.library.register_vmap("fp8ops::scaled_mm", _scaled_mm_vmap)

_MULTIPLE = 16  # torch._scaled_mm needs every dimension to be a multiple of 16


def resolve_backend(backend: str, device: torch.device) -> str:
    """The backend that runs a GEMM: "reference" on the CPU, else "triton" or "cublas".

    "auto" is cuBLAS, which measured faster than the Triton kernel at every seed shape in
    full-precision accumulation and on par in fast accumulation (docs/kernels/gemm.md).
    """
    if device.type != "cuda":
        return "reference"
    if backend != "auto":
        return backend
    return "cublas"


def _pad_rows(t: Tensor, rows: int, fill: float = 0.0) -> Tensor:
    """Append rows of ``fill`` (zeros for FP8 data, ones for scales) without in-place writes."""
    if rows == 0:
        return t
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        z = torch.zeros((rows, *t.shape[1:]), dtype=torch.uint8, device=t.device)
        return torch.cat([t.view(torch.uint8), z], dim=0).view(t.dtype)
    return torch.cat([t, torch.full((rows, *t.shape[1:]), fill, dtype=t.dtype, device=t.device)], dim=0)


def _pad_cols(t: Tensor, cols: int) -> Tensor:
    if cols == 0:
        return t
    z = torch.zeros((t.shape[0], cols), dtype=torch.uint8, device=t.device)
    return torch.cat([t.view(torch.uint8), z], dim=1).view(t.dtype)


def _up(n: int) -> int:
    return -(-n // _MULTIPLE) * _MULTIPLE - n


def bias_in_epilogue(bias: Tensor | None, out_dtype: torch.dtype) -> bool:
    """Whether ``torch._scaled_mm`` (and the symmetric-memory GEMMs built on it) adds ``bias`` in
    its epilogue: a bias of the output dtype, not float32; otherwise :func:`add_bias` after."""
    return bias is not None and out_dtype != torch.float32 and bias.dtype == out_dtype


def add_bias(out: Tensor, bias: Tensor, out_dtype: torch.dtype) -> Tensor:
    """``out + bias`` summed in float32, in ``out_dtype`` (a bias the epilogue did not take)."""
    return cast(out.to(torch.float32) + bias.to(torch.float32), out_dtype)


def _cublas(a: Tensor, b: Tensor, scale_a: Tensor, scale_b: Tensor, bias: Tensor | None,
            out_dtype: torch.dtype, fast_accum: bool) -> Tensor:
    m, k = a.shape
    n = b.shape[0]
    pm, pn, pk = _up(m), _up(n), _up(k)
    if pk:
        a, b = _pad_cols(a, pk), _pad_cols(b, pk)
    rowwise = scale_a.dim() == 2
    if pm:
        a = _pad_rows(a, pm)
        if rowwise:
            scale_a = _pad_rows(scale_a, pm, 1.0)
    if pn:
        b = _pad_rows(b, pn)
        if rowwise:
            scale_b = _pad_rows(scale_b, pn, 1.0)
    sb = scale_b.reshape(1, -1) if rowwise else scale_b
    fused_bias = not pn and bias_in_epilogue(bias, out_dtype)
    out = torch._scaled_mm(
        a, b.t(), scale_a=scale_a, scale_b=sb, bias=bias if fused_bias else None,
        out_dtype=out_dtype, use_fast_accum=fast_accum,
    )
    if pm or pn:
        out = out[:m, :n]
    if bias is not None and not fused_bias:
        out = add_bias(out, bias, out_dtype)
    return out


def scaled_mm(
    a: Tensor,
    b: Tensor,
    scale_a: Tensor,
    scale_b: Tensor,
    *,
    bias: Tensor | None = None,
    out_dtype: torch.dtype,
    fast_accum: bool,
    backend: str = "auto",
) -> Tensor:
    """``(a @ b.T) * scale_a * scale_b (+ bias)`` in ``out_dtype``.

    Args:
        a: (M, K) FP8, row-major. b: (N, K) FP8, row-major.
        scale_a: () or (M, 1) float32 inverse scale. scale_b: () or (N, 1) float32 inverse scale.
        bias: (N,) or None. out_dtype: bfloat16, float16 or float32.
        fast_accum: the FP8 accumulation mode. backend: "auto", "triton" or "cublas".
    """
    which = resolve_backend(backend, a.device)
    if which == "cublas":
        return _cublas(a, b, scale_a, scale_b, bias, out_dtype, fast_accum)
    sb = scale_b.reshape(1, -1) if scale_b.dim() == 2 else scale_b
    return OPS.scaled_mm(a, b, scale_a, sb, bias, out_dtype, fast_accum)
