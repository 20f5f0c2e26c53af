"""A switch of fp8ops off and on, on compiled, graphed GPT training steps of
``python -m fp8ops.bench gpt``: ``--switch fuse_dbias`` (:data:`fp8ops._operands.FUSE_DBIAS`) or
``--switch amax_chain`` (``fp8ops.kernels._library.AMAX_CHAIN.enabled``: amax words zeroed by the
kernel before, or a fill kernel per launch) or ``--switch inline``
(``fp8ops.kernels._library.INLINE_IN_GRAPHS``: the library ops' Triton kernels launched from the
compiled graph's own code, or each op one opaque call; Inductor's caches off, so that each build
is traced under its own setting).

``fuse_dbias``: with the flag off, each linear layer's bias gradient is ``dy.sum(0)``: under ``torch.compile``
Inductor emits it as a reduction of its own (fused with the kernel that assembles dy where that
kernel is Inductor's, as for the QKV projection, whose dy is the concatenation of dq, dk, dv). With
it on, ``fp8ops::cast_transpose_dbias`` writes per-tile column sums in the pass that quantizes dy
and one fixed-order column-sum kernel finishes them. This script times both builds side by side
in one process (the torch bf16 step as the reference), alternating them ``--rounds`` times, and
prints ms per step, kernels per step and the ratios.

    python scripts/gpt_ab_check.py [--switch fuse_dbias|amax_chain|inline] [--hidden 768 2048] [--rounds 2]
                                   [--steps 20] [--json OUT]

Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import json

import torch

import fp8ops
from fp8ops import _operands
from fp8ops.kernels import _library
from fp8ops.bench.gpt import SIZES, _size
from fp8ops.bench.step import _measure, _variant


def time_build(impl: str, size: dict[str, int], steps: int) -> dict[str, float]:
    torch._dynamo.reset()
    step, carry, batch = _variant("gpt2", impl, "compile", size)
    for _ in range(2):  # compile and calibrate before capturing
        carry, _ = step(carry, *batch)
    graphed = fp8ops.graph_step(step)
    r, _ = _measure(graphed, carry, batch, steps)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return {"ms": r["ms"], "kernels": r["kernels"], "device_ms": r["device_ms"], "loss": r["loss"]}


DEFAULTS = {"fuse_dbias": False, "amax_chain": True, "inline": True}


def _set(switch: str, on: bool) -> None:
    if switch == "fuse_dbias":
        _operands.FUSE_DBIAS = on
    elif switch == "inline":
        _library.INLINE_IN_GRAPHS = on
    else:
        _library.AMAX_CHAIN.enabled = on
        _library.AMAX_CHAIN.reset()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, nargs="+", default=[768, 2048], choices=sorted(SIZES))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--switch", choices=sorted(DEFAULTS), default="fuse_dbias")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.switch == "inline":  # a cached graph of the other setting would be taken as is
        from torch._functorch import config as functorch_config
        from torch._inductor import config as inductor_config

        inductor_config.fx_graph_cache = False
        functorch_config.enable_autograd_cache = False
    out = []
    for hidden in args.hidden:
        layers, heads = SIZES[hidden]
        size = _size(hidden, layers, heads, 50304, False)
        torch_row = time_build("torch", size, args.steps)
        rows = []
        for r in range(args.rounds):
            for on in (False, True):
                _set(args.switch, on)
                try:
                    got = time_build("fp8ops FP8", size, args.steps)
                finally:
                    _set(args.switch, DEFAULTS[args.switch])
                got.update(on=on, round=r, over_bf16=got["ms"] / torch_row["ms"])
                rows.append(got)
                print(f"hidden {hidden} round {r} {args.switch}={on!s:5}: {got['ms']:.3f} ms/step, "
                      f"{got['kernels']:.0f} kernels, device {got['device_ms']:.3f} ms, "
                      f"FP8/bf16 {got['over_bf16']:.3f} (bf16 {torch_row['ms']:.3f} ms)", flush=True)
        for on in (False, True):
            ms = [x["ms"] for x in rows if x["on"] is on]
            print(f"hidden {hidden} {args.switch}={on!s:5}: best {min(ms):.3f} ms, FP8/bf16 {min(ms) / torch_row['ms']:.3f}")
        out.append({"hidden": hidden, "switch": args.switch, "torch": torch_row, "fp8": rows})
        if args.json:  # after each size, so that a run cut short keeps the sizes it finished
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
