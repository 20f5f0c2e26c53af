"""Host cost of an FSDP2 training step of the parallel suite's GPT, bf16 against fp8ops FP8 with
bf16 or FP8 weight all-gathers, on one process (gloo, world size 1) on the CPU.

``python -m fp8ops.bench parallel`` found the FSDP2 step with FP8 all-gathers 1.84x the bf16 step at
hidden 2048 on two GPUs, and level with it at hidden 4096: at the small size the step is bound by the
host. This script runs the same model construction (``fully_shard`` of every Linear, then of the
root; ``MixedPrecisionPolicy(bfloat16, float32)``; AdamW with ``foreach``; ``fp8ops.nn.update_scaling``
each step) at a tiny size, so that the step time is the host's:

    python scripts/fsdp_host_profile.py [--stub-kernels] [--profile] [--layers 4] [--hidden 64]

``--stub-kernels`` registers each ``fp8ops::`` op's fake kernel as its CPU kernel (shapes only, no
arithmetic: what is left is the Python and dispatch around the ops); ``--profile`` prints cProfile's
top functions of the last variant. Prints ms per step of each variant and the ratios to bf16.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist


def build(kind: str, layers: int, hidden: int, heads: int, seq: int, vocab: int) -> Callable[[], None]:
    """One training step of the FSDP2 GPT: kind "bf16", "FP8, bf16 all-gather" or "FP8, FP8 all-gather"."""
    import fp8ops
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from fp8ops.bench.step import TorchGPT

    torch.manual_seed(0)
    net = TorchGPT(layers, hidden, heads, seq, vocab)
    recipe = None
    if kind != "bf16":
        recipe = fp8ops.DelayedScaling()
        fp8ops.nn.convert(net, recipe)
        if kind == "FP8, FP8 all-gather":
            fp8ops.nn.enable_fp8_all_gather(net)
    mesh = init_device_mesh("cpu", (1,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for m in list(net.modules()):
        if isinstance(m, (torch.nn.Linear, fp8ops.nn.Linear)):
            fully_shard(m, mesh=mesh, mp_policy=mp)
    fully_shard(net, mesh=mesh, mp_policy=mp)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4, foreach=True)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab, (2, seq), generator=g)
    targets = torch.randint(0, vocab, (2, seq), generator=g)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        net(tokens, targets).backward()
        opt.step()
        if recipe is not None:
            fp8ops.nn.update_scaling(net, group=dist.group.WORLD)

    return step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--stub-kernels", action="store_true", help="fp8ops kernels as shape-only stubs")
    ap.add_argument("--profile", action="store_true", help="cProfile the last variant")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("gloo", rank=0, world_size=1)
    if args.stub_kernels:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import host_profile

        host_profile.stub_kernels()
    times: dict[str, float] = {}
    kinds = ["bf16", "FP8, bf16 all-gather", "FP8, FP8 all-gather"]
    step: Any = None
    for kind in kinds:
        step = build(kind, args.layers, args.hidden, heads=4, seq=32, vocab=256)
        for _ in range(3):
            step()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            step()
        times[kind] = (time.perf_counter() - t0) / args.steps * 1e3
        print(f"{kind:22s} {times[kind]:7.2f} ms/step  {times[kind] / times['bf16']:.2f}x bf16", flush=True)
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(5):
            step()
        prof.disable()
        pstats.Stats(prof).sort_stats("cumulative").print_stats(40)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
