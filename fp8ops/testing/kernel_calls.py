"""One call of each library op that a model step runs, on any device: the calls with which the
traced CUDA kernels of the ops (``kernels._library.OpSpec.traced``) are checked against the ops'
own launches, under the Triton interpreter on the CPU and inside compiled graphs on the GPU."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

__all__ = ["KernelCall", "kernel_calls"]

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


class KernelCall(NamedTuple):
    """``name``: what the call covers; ``op``: the op's name (``torch.ops.fp8ops.<op>``);
    ``kernel``: the name of a Triton kernel it launches; ``args``: its arguments."""

    name: str
    op: str
    kernel: str
    args: tuple[Any, ...]


def kernel_calls(device: str | torch.device = "cpu", rows: int = 40, seed: int = 0) -> list[KernelCall]:
    """The calls, on ``rows`` x 24 bf16 operands (48 columns for activation inputs) on ``device``:
    delayed and current scaling, E4M3 and E5M2, transposed FP8 copies, bias and weight gradients,
    plain and gated activations. One element of ``x`` saturates at scale 2."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape: int, s: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * s).to(torch.bfloat16).to(device)

    x, res, dy = r(rows, 24, s=5), r(rows, 24), r(rows, 24)
    x[3, 5] = 3000.0
    w, b = (1 + r(24, s=0.3)).contiguous(), r(24, s=0.3)
    h, da, da_gated = r(rows, 48, s=2), r(rows, 48), r(rows, 24)
    scale = torch.tensor(2.0, device=device)
    amax_in = torch.tensor(600.0, device=device)
    seed = torch.tensor(123456789, dtype=torch.int64, device=device)
    stats: dict[bool, tuple[torch.Tensor, ...]] = {}
    for rms in (False, True):
        out = torch.ops.fp8ops.norm_fwd(x, res, w, None if rms else b, 1e-5, rms, False, False, None, None, 0,
                                        False, None, False)
        stats[rms] = (out[1], out[6], out[7])  # s, mean, rstd

    def call(name: str, op: str, kernel: str, *args: Any) -> KernelCall:
        return KernelCall(name, op, kernel, args)

    return [
        call("amax", "amax", "_amax_fwd_kernel", x),
        call("cast delayed", "cast", "_cast_fwd_kernel", x, scale, None, 0, False, E4M3),
        call("cast current e5m2", "cast", "_cast_fwd_kernel", x, scale, amax_in, 1, True, E5M2),
        call("cast_transpose", "cast_transpose", "_cast_transpose_fwd_kernel", x, scale, None, 0, False, E4M3),
        call("cast_transpose current", "cast_transpose", "_cast_transpose_fwd_kernel", x, scale, amax_in, 0, False,
             E4M3),
        call("cast_transpose_dbias", "cast_transpose_dbias", "_column_sums_kernel", dy, scale, None, 0, False, E5M2),
        call("norm_fwd layernorm fp8 transposed", "norm_fwd", "_norm_fwd_kernel",
             x, res, w, b, 1e-5, False, False, True, scale, None, 0, False, E4M3, True),
        call("norm_fwd rmsnorm current", "norm_fwd", "_norm_fwd_kernel",
             x, None, w, None, 1e-5, True, True, False, scale, amax_in, 0, False, E4M3, False),
        call("norm_fwd no fp8", "norm_fwd", "_norm_fwd_kernel",
             x, res, w, b, 1e-5, False, False, True, None, None, 0, False, None, False),
        call("norm_amax", "norm_amax", "_norm_fwd_kernel", x, res, w, b, 1e-5, False, False),
        call("norm_fwd dropout fp8 transposed", "norm_fwd", "_norm_fwd_kernel",
             x, res, w, b, 1e-5, False, False, True, scale, None, 0, False, E4M3, True, seed, 0.25),
        call("norm_amax dropout", "norm_amax", "_norm_fwd_kernel", x, res, w, b, 1e-5, False, False, seed, 0.25),
        call("norm_bwd_dropout layernorm", "norm_bwd_dropout", "_norm_bwd_kernel",
             dy, stats[False][0], w, stats[False][1], stats[False][2], res, False, False, True, seed, 0.25),
        call("norm_bwd layernorm", "norm_bwd", "_norm_bwd_kernel",
             dy, stats[False][0], w, stats[False][1], stats[False][2], res, False, False, True),
        call("norm_bwd rmsnorm", "norm_bwd", "_norm_bwd_kernel",
             dy, stats[True][0], w, stats[True][1], stats[True][2], None, True, False, False),
        call("act_fwd gelu transposed", "act_fwd", "_act_fwd_kernel",
             h, "gelu", True, scale, None, 0, False, E4M3, True, True),
        call("act_fwd swiglu current", "act_fwd", "_act_fwd_kernel",
             h, "swiglu", False, scale, amax_in, 0, False, E4M3, True, False),
        call("act_amax", "act_amax", "_act_fwd_kernel", h, "gelu_tanh"),
        call("act_bwd gelu dbias transposed", "act_bwd", "_act_bwd_kernel",
             da, h, "gelu", True, scale, None, 0, False, E5M2, True, True),
        call("act_bwd swiglu", "act_bwd", "_act_bwd_kernel",
             da_gated, h, "swiglu", False, scale, amax_in, 0, False, E5M2, True, False),
        call("act_bwd_amax", "act_bwd_amax", "_act_bwd_kernel", da_gated, h, "reglu"),
    ]
