"""Triton kernels of fp8ops, installed as ``fp8ops.kernels``.

Kernels take raw tensors and scalars only; they never see scaling states, recipes or configs.
Each module registers its ``fp8ops::<name>`` library ops (CUDA and fake kernels) on import; the CPU
kernels (the FP32 reference math) are registered by ``fp8ops``.
"""

from . import gemm, quantize

__all__ = ["gemm", "quantize"]
