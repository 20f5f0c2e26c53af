"""Triton kernels of fp8ops, installed as ``fp8ops.kernels``.

Kernels take raw tensors and scalars only; they never see scaling states, recipes or configs.
Each module describes its ``fp8ops::<name>`` library ops as :class:`_library.OpSpec` (schema, CUDA
kernel, fake kernel); the fp8ops module of the same stem defines each op with all its kernels side
by side, the CPU kernel being the FP32 reference math (``_library.define(spec, cpu=...)``).
"""

from . import gemm, quantize

__all__ = ["gemm", "quantize"]
