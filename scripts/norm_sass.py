"""Compile the norm kernels for sm_90 without a GPU and print, per variant, the static SASS
instruction count, the registers and the spill stack of each kernel (one JSON line).

The variants are the launchers' default configs at K = 4096 (the seed layer's hidden size), bf16
inputs with a residual, FP8 E4M3 output, with and without the dropout on x: the forward with the
transposed FP8 output (``fwd_T``), the forward of whole rows (``fwd``) and the backward (``bwd``).
Pointers and M, K are compiled as the GPU launch specialises them (divisible by 16).

    python scripts/norm_sass.py [--sass VARIANT]   # --sass also writes VARIANT.sass here

Use the Triton of the GPU machine for numbers that match it (its wheel installs beside torch's CPU
build; the counts differ between Triton versions).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from fp8ops.kernels import norm as N

_BF16 = ("x_ptr", "r_ptr", "y_ptr", "s_ptr", "dy_ptr", "ds_ptr", "dx_ptr", "dxb_ptr")
_TOOL = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def _compile(kern, consts: dict, num_warps: int):
    kern = getattr(kern, "fn", kern)  # FastKernel -> its JIT function
    sig, fixed, attrs = {}, {}, {}
    for i, n in enumerate(kern.arg_names):
        if n in consts:
            sig[n], fixed[(i,)] = "constexpr", consts[n]
            continue
        if n in _BF16:
            sig[n] = "*bf16"
        elif n in ("q_ptr", "qt_ptr"):
            sig[n] = "*fp8e4nv"
        elif n == "seed_ptr":
            sig[n] = "*i64"
        elif n.endswith("_ptr"):
            sig[n] = "*fp32"
        elif n in ("eps", "drop_scale"):
            sig[n] = "fp32"
        else:
            sig[n] = "i32"
        if n.endswith("_ptr") or n in ("M", "K"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    return triton.compile(ASTSource(kern, sig, fixed, attrs), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps})


def forward(dropout: bool, transpose: bool, K: int = 4096):
    cfg = N._fwd_default(K, transpose)
    consts = dict(RMS=False, ZERO_CENTERED=False, HAS_RES=True, DROPOUT=dropout, HAS_BIAS=True, STORE_Y=False,
                  STORE_S=True, STORE_STATS=True, HAS_Q=True, TRANSPOSE=transpose, FP8_MAX=448.0, MARGIN=0,
                  SCALE_FROM_AMAX=False, POWER_2=False, SINGLE=cfg["BLOCK_K"] >= K, BLOCK_M=cfg["BLOCK_M"],
                  BLOCK_K=cfg["BLOCK_K"])
    return _compile(N._norm_fwd_kernel, consts, cfg["num_warps"])


def backward(dropout: bool, K: int = 4096):
    cfg = N._bwd_default(K)
    consts = dict(RMS=False, ZERO_CENTERED=False, HAS_DS=True, DROPOUT=dropout, HAS_BIAS=True,
                  SINGLE=cfg["BLOCK_K"] >= K, BLOCK_M=cfg["BLOCK_M"], BLOCK_K=cfg["BLOCK_K"])
    return _compile(N._norm_bwd_kernel, consts, cfg["num_warps"])


VARIANTS = {
    "fwd_T": lambda: forward(False, True), "fwd_T_drop": lambda: forward(True, True),
    "fwd": lambda: forward(False, False), "fwd_drop": lambda: forward(True, False),
    "bwd": lambda: backward(False), "bwd_drop": lambda: backward(True),
}


def _dump(kernel, flag: str) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        return subprocess.run([_TOOL, flag, f.name], capture_output=True, text=True, check=True).stdout


def facts(kernel) -> dict:
    sass = _dump(kernel, "-sass")
    count = sum(1 for line in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4,}\*/", line))
    reg, stack = re.search(r"REG:(\d+) STACK:(\d+)", _dump(kernel, "-res-usage")).groups()
    return {"instructions": count, "registers": int(reg), "stack_bytes": int(stack)}, sass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sass", choices=sorted(VARIANTS), help="also write this variant's SASS to VARIANT.sass")
    args = parser.parse_args()
    out = {"triton": triton.__version__}
    for name, build in VARIANTS.items():
        out[name], sass = facts(build())
        if name == args.sass:
            with open(f"{name}.sass", "w") as f:
                f.write(sass)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
