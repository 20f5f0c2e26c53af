"""Host cost of one FP8 cast on the GPU machine, layer by layer: the library op, fp8ops's own call of
it (``OPS``, straight to the launcher), its launcher, the bare Triton launch, the compiled kernel
launched directly, and the allocations around it.

Tiny tensors (64 x 64), so the GPU finishes each kernel at once and a loop of N asynchronous calls
measures the host: µs per call, best of 3 loops of 2000 calls.

    python scripts/launch_overhead.py [--profile]

``--profile`` adds the cProfile top functions (own time) of 2000 calls of ``OPS.cast_transpose``.
"""
from __future__ import annotations

import cProfile
import pstats
import sys
import time
from collections.abc import Callable

import torch
import triton

from fp8ops import quantize as _defines_the_library_ops
from fp8ops.kernels import quantize as kq
from fp8ops.kernels._library import AMAX_CHAIN, OPS, merge_config, tma_store_wanted, transposed_store

E4M3 = torch.float8_e4m3fn


def per_call_us(fn: Callable[[], object], calls: int = 2000, repeats: int = 3) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t) / calls * 1e6)
        torch.cuda.synchronize()
    return best


def main() -> None:
    x = torch.randn(64, 64, device="cuda").bfloat16()
    scale = torch.tensor(4.0, device="cuda")
    M, K = x.shape
    cfg = kq._CAST_T_CFG
    q = torch.empty((M, K), dtype=E4M3, device="cuda")
    qt = torch.empty((K, M), dtype=E4M3, device="cuda")
    amax = torch.zeros((), device="cuda")
    inv = torch.empty((), device="cuda")
    grid = (triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(K, cfg["BLOCK_K"]),)
    amax_next = torch.empty((), device="cuda")
    kw = dict(scale_ptr=scale, amax_in_ptr=amax, amax_ptr=amax, amax_next_ptr=amax_next, inv_ptr=inv, FP8_MAX=448.0, MARGIN=0,
              SCALE_FROM_AMAX=False, POWER_2=False)
    kernel = kq._cast_transpose_fwd_kernel

    def bare() -> object:
        return kernel[grid](x, q, qt, qt, dbias_ptr=None, M=M, K=K, stride_xm=x.stride(0), BLOCK_M=cfg["BLOCK_M"],
                            BLOCK_K=cfg["BLOCK_K"], GROUP_M=cfg["GROUP_M"], DBIAS=False, TMA_T=False, num_warps=cfg["num_warps"],
                            **kw)

    jit = getattr(kernel, "fn", kernel)  # the JIT function under the cached launch path

    def triton_path() -> object:
        return jit[grid](x, q, qt, qt, dbias_ptr=None, M=M, K=K, stride_xm=x.stride(0), BLOCK_M=cfg["BLOCK_M"],
                         BLOCK_K=cfg["BLOCK_K"], GROUP_M=cfg["GROUP_M"], DBIAS=False, TMA_T=False, num_warps=cfg["num_warps"],
                         **kw)

    ck = triton_path()
    values = dict(x_ptr=x, q_ptr=q, qt_ptr=qt, qt_desc=qt, dbias_ptr=None, M=M, K=K, stride_xm=x.stride(0),
                  BLOCK_M=cfg["BLOCK_M"], BLOCK_K=cfg["BLOCK_K"], GROUP_M=cfg["GROUP_M"], DBIAS=False, TMA_T=False, **kw)
    args = [values[n] for n in kernel.arg_names]
    stream = torch.cuda.current_stream().cuda_stream
    runner = ck[(grid[0], 1, 1)]

    def direct() -> None:
        runner(*args, stream=stream)

    def no_grad_ops() -> object:
        with torch.no_grad():
            return OPS.cast_transpose(x, scale, None, 0, False, E4M3)

    def amax_words() -> None:
        with AMAX_CHAIN.output(x.device):
            pass

    def tma_choice() -> object:
        tma = tma_store_wanted(qt, None)
        c = merge_config(kq._CAST_T_CFG_TMA if tma else kq._CAST_T_CFG, None, name="cast_transpose")
        return transposed_store(qt, tma, c["BLOCK_K"], c["BLOCK_M"])

    cases: dict[str, Callable[[], object]] = {
        "torch.ops.fp8ops.cast_transpose (library op)": lambda: torch.ops.fp8ops.cast_transpose(
            x, scale, None, 0, False, E4M3),
        "OPS.cast_transpose, no grad (the call fp8ops makes: straight to the launcher)": no_grad_ops,
        "cast_transpose_launch (launcher; pointer stores below 2**24 elements)": lambda: kq.cast_transpose_launch(
            x, scale, None, 0, False, E4M3),
        "cast_transpose_launch, TMA store forced (tensor map encoded)": lambda: kq.cast_transpose_launch(
            x, scale, None, 0, False, E4M3, config={"TMA": True}),
        "kernel[grid](...) (the kernel as the launcher calls it)": bare,
        "JITFunction[grid](...) (Triton's own launch path)": triton_path,
        "CompiledKernel[grid](*args) (direct)": direct,
        "  part: _cast_args (argument checks, the inverse scale's allocation)": lambda: kq._cast_args(
            "cast_transpose", x, scale, None, 0, False, E4M3, flat=False),
        "  part: AMAX_CHAIN.output entered and left (its word allocation included)": amax_words,
        "  part: tma_store_wanted + merge_config + transposed_store": tma_choice,
        "  part: two torch.empty of the outputs": lambda: (torch.empty((M, K), dtype=E4M3, device=x.device),
                                                         torch.empty((K, M), dtype=E4M3, device=x.device)),
        "  part: EagerOp._direct (the check that the call may skip the dispatcher)": lambda: OPS.cast_transpose._direct(
            (x, scale, None, 0, False, E4M3)),
        "  part: torch.cuda.is_current_stream_capturing()": torch.cuda.is_current_stream_capturing,
        "torch.zeros(()) on cuda": lambda: torch.zeros((), device="cuda"),
        "torch.empty((64, 64)) on cuda": lambda: torch.empty((64, 64), device="cuda"),
        "torch.ops.aten.add (x + x)": lambda: x + x,
    }
    assert _defines_the_library_ops.__name__
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}")
    for name, fn in cases.items():
        print(f"{per_call_us(fn):8.1f} µs  {name}", flush=True)
    fk = kq._cast_transpose_fwd_kernel
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    print(f"OPS.cast_transpose direct calls: {OPS.cast_transpose.direct_calls}")
    print(f"cached launch path: {type(fk).__name__}, direct launches {getattr(fk, 'direct_launches', '-')}, "
          f"last fallback {getattr(fk, 'last_fallback', '-')!r}; triton.knobs.runtime "
          f"{'missing' if runtime is None else (runtime.launch_enter_hook, runtime.launch_exit_hook)}")
    if "--profile" in sys.argv:  # where the launcher's own time goes (cProfile inflates small calls)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(2000):
            no_grad_ops()
        torch.cuda.synchronize()
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
