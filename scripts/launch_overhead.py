"""Host cost of one FP8 cast on the GPU machine, layer by layer: the library op, fp8ops's own call of
it (``OPS``, straight to the launcher), its launcher, the bare Triton launch, the compiled kernel
launched directly, and the allocations around it.

Tiny tensors (64 x 64), so the GPU finishes each kernel at once and a loop of N asynchronous calls
measures the host: µs per call, best of 3 loops of 2000 calls.

    python scripts/launch_overhead.py
"""
from __future__ import annotations

import time
from collections.abc import Callable

import torch
import triton

from fp8ops import quantize as _defines_the_library_ops
from fp8ops.kernels import quantize as kq
from fp8ops.kernels._library import OPS

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


if __name__ == "__main__":
    main()
