"""Tensor + sequence parallelism on 2 GPUs: the seed layer with TP=2 + SP, and FSDP2 of a small GPT
with bf16 vs FP8 weight all-gathers; full training steps per GPU.

Run on one host with two GPUs (NCCL): ``python -m fp8ops.bench parallel``. The suite spawns one
process per GPU; every variant runs on both ranks in lockstep and its time is the slower rank's.

Seed layer (hidden 4096, ffn 16384, 32 heads, seq 2048, batch 4, dropout 0.1; bf16 parameters), a
step = fresh probes, forward, backward, AdamW and (FP8) :func:`fp8ops.update` over the group:

- ``fp8ops FP8, 1 GPU``: the whole layer on rank 0 (rank 1 idles), eager and as one CUDA graph;
- ``fp8ops FP8, TP=2+SP``: :func:`fp8ops.transformer_layer` on this rank's shard
  (:func:`fp8ops.shard_transformer_params`) and sequence slice (S/2, B, H), delayed scaling, the
  all-gathers before the column-parallel GEMMs in FP8; eager and as one CUDA graph;
- ``torch bf16, DTensor TP=2+SP + compile``: the seed's basic layer (SDPA) under
  ``parallelize_module`` with ``ColwiseParallel`` / ``RowwiseParallel`` / ``SequenceParallel``;
- ``torchao float8, TP=2+SP + compile``: the same with its Linear layers converted by
  ``torchao.float8.convert_to_float8_training`` (tensorwise) and torchao's float8 parallel styles.

FSDP2 (``fully_shard`` of each transformer block and of the root over both GPUs, data parallel, bf16
compute with float32 master weights; ``--fsdp-wrap linear``: of each Linear instead of each block):
a GPT (4 layers, hidden 2048 with 16 heads and hidden 4096 with 32 heads, seq 1024, 4 sequences per
GPU, vocabulary 32768) in plain
bf16, and the same with its block Linears converted to :class:`fp8ops.nn.Linear` (delayed
scaling), all-gathering the weights in bf16 or in FP8 (:func:`fp8ops.nn.enable_fp8_all_gather`);
each eager and with each block compiled (``+ compile``, Inductor; not with ``--no-compile``). The
FSDP2 ratios compare each kind in its fastest mode.

Per variant: ms/step, peak memory, and the bytes each rank sends into collectives per step, by
kind (the inputs of the ``_c10d_functional`` collectives and of FSDP2's all-gathers and
reduce-scatters, read from torch.profiler with their shapes and dtypes).

Targets (seed layer): TP=2+SP step <= 0.6x fp8ops on one GPU, >= 1.3x faster than torchao float8
TP + compile, >= 1.5x faster than bf16 DTensor TP + compile; FP8 all-gather bytes half of bf16's;
FSDP2 with FP8 all-gather moves half the weight bytes of bf16 and is no slower.
``--quick``: small sizes (a smoke run). ``--no-seed`` / ``--no-fsdp`` run one part;
``--fsdp-batch N``: N sequences per GPU in the FSDP2 GPT (4 by default). ``--overlap SPEC ...`` also
times the TP=2+SP graph step with ways of overlapping its collectives with its GEMMs, each SPEC a
``+``-joined set of: ``c<N>``, the row-parallel forward GEMMs (proj, fc2) in N column chunks, each
chunk's reduce-scatter in flight while the next chunk is computed (``row_chunks`` of
:func:`fp8ops.parallel.set_comm_options`);
``s<N>``, the GEMMs that run while a collective of their op is in flight leave N SMs free
(``sm_carveout``); ``hp``, the collectives on a process group whose NCCL stream
has high priority; ``nf``, the FP8 GEMMs and their collectives not fused (NCCL collectives next
to the GEMMs, instead of the default: torch's pipelined symmetric-memory ops,
``pipelined_gemms``). Each is reported as ``overlap_<SPEC>_over_default``; the target ratios use the
default (one GEMM, every SM, the default group). ``--overlap none`` (or ``--overlap`` with no SPEC)
times none of them.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from .common import Progress, environment, format_table, time_cuda, write_bar_chart, write_json

__all__ = ["add_arguments", "run"]

SEED = {"hidden": 4096, "ffn": 16384, "heads": 32, "seq": 2048, "batch": 4}
SEED_QUICK = {"hidden": 512, "ffn": 2048, "heads": 8, "seq": 256, "batch": 2}
GPTS = [{"layers": 4, "hidden": 2048, "heads": 16, "seq": 1024, "batch": 4, "vocab": 32768},
        {"layers": 4, "hidden": 4096, "heads": 32, "seq": 1024, "batch": 4, "vocab": 32768}]
GPTS_QUICK = [{"layers": 2, "hidden": 256, "heads": 4, "seq": 128, "batch": 2, "vocab": 1024}]
TARGETS = {"tp_over_1gpu": 0.6, "vs_torchao_tp": 1.3, "vs_bf16_tp": 1.5}
OVERLAP_DEFAULT = ("nf", "hp", "s16+hp")

_DTYPE_BYTES = {"unsigned char": 1, "signed char": 1, "bool": 1, "c10::Float8_e4m3fn": 1, "c10::Float8_e5m2": 1,
                "c10::BFloat16": 2, "c10::Half": 2, "short int": 2, "float": 4, "int": 4, "double": 8,
                "long int": 8}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of the parallel suite."""
    parser.add_argument("--steps", type=int, default=10, help="timed steps per variant (default 10)")
    parser.add_argument("--no-torchao", action="store_true", help="skip the torchao float8 TP peer")
    parser.add_argument("--no-compile", action="store_true", help="run the DTensor peers without torch.compile")
    parser.add_argument("--no-fsdp", action="store_true", help="skip the FSDP2 GPT")
    parser.add_argument("--no-seed", action="store_true", help="skip the seed layer (run only the FSDP2 GPT)")
    parser.add_argument("--fsdp-wrap", choices=("block", "linear"), default="block",
                        help="FSDP2 groups of the GPT: one per transformer block (default) or one per Linear")
    parser.add_argument("--fsdp-batch", type=int, default=None, metavar="N",
                        help="sequences of 1024 tokens per GPU in the FSDP2 GPT (default 4)")
    parser.add_argument("--overlap", nargs="*", default=list(OVERLAP_DEFAULT), metavar="SPEC",
                        help="also time the TP=2+SP graph step with these overlaps: '+'-joined c<N> (row-parallel "
                             "forward GEMMs in N chunks), s<N> (N SMs left to collectives in flight), hp "
                             "(high-priority NCCL stream), nf (GEMMs and collectives not fused through symmetric "
                             f"memory); default: {' '.join(OVERLAP_DEFAULT)}; 'none' (or no SPEC): no overlap variant")
    parser.add_argument("--row-chunks", type=int, nargs="*", default=[], metavar="N",
                        help="the same as --overlap c<N>+nf for each N (the row-parallel forward GEMMs in N chunks, "
                             "NCCL collectives), added to the --overlap variants")
    parser.add_argument("--profile", action="store_true",
                        help="profile the eager fp8ops steps (1 GPU and TP=2+SP) on rank 0: kernel time by kind "
                             "and the top kernels per step")


# ------------------------------------------------------------------------------------------------
# Bytes into collectives


def _collective_bytes(prof: Any, steps: int) -> dict[str, float]:
    """Bytes per step this rank gave to each kind of collective (all_gather, reduce_scatter,
    all_reduce), from the profiler's records (shapes and dtypes) of the functional collectives, of
    the c10d ops that FSDP2 calls directly (a c10d op inside a functional one is not counted twice)
    and of the pipelined symmetric-memory GEMMs (A's FP8 rows for an all-gather; for a
    reduce-scatter the (M, N) partial sums, counted as bf16, the suite's output dtype)."""
    events = [(e.name(), e.shapes(), e.dtypes(), e.start_thread_id(), e.start_ns(), e.start_ns() + e.duration_ns())
              for e in prof.profiler.kineto_results.events() if "c10d" in e.name() or "symm_mem::" in e.name()]
    functional = [(t, s, f) for name, _, _, t, s, f in events if name.startswith("_c10d_functional::")]
    out: dict[str, float] = {}
    for name, shapes, dtypes, thread, start, end in events:
        if name.startswith("symm_mem::fused_"):  # the pipelined GEMMs: A's rows move, or the bf16 partial sums
            if "all_gather" in name and shapes and shapes[0]:
                out["all_gather"] = out.get("all_gather", 0.0) + _numel(shapes[0]) * _DTYPE_BYTES.get(dtypes[0], 0) / steps
            elif "reduce_scatter" in name and len(shapes) > 1 and shapes[0] and shapes[1]:
                out["reduce_scatter"] = out.get("reduce_scatter", 0.0) + shapes[0][0] * shapes[1][1] * 2 / steps
            continue
        if name.startswith("_c10d_functional::"):
            op, i = name.split("::", 1)[1], 0
        elif name in ("c10d::_allgather_base_", "c10d::_reduce_scatter_base_", "c10d::allreduce_"):
            if any(t == thread and s <= start and end <= f for t, s, f in functional):
                continue  # counted at its functional caller
            # _allgather_base_ / _reduce_scatter_base_ take (output, input): the input is the second
            op, i = name.split("::", 1)[1], 0 if name == "c10d::allreduce_" else 1
        else:
            continue
        if "wait" in op or "wrap" in op or i >= len(shapes) or not shapes[i]:
            continue
        kind = ("all_gather" if "gather" in op else "reduce_scatter" if "reduce_scatter" in op
                else "all_reduce" if "reduce" in op else op)
        out[kind] = out.get(kind, 0.0) + _numel(shapes[i]) * _DTYPE_BYTES.get(dtypes[i], 0) / steps
    return out


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


# ------------------------------------------------------------------------------------------------
# Variants: each returns (step, carry, batch) with step(carry, *batch) -> (carry, loss)


def _adamw(params: list[torch.Tensor], capturable: bool, device: str) -> torch.optim.Optimizer:
    if capturable and device == "cuda":
        return torch.optim.AdamW(params, lr=torch.tensor(1e-4, device=device), fused=True, capturable=True)
    return torch.optim.AdamW(params, lr=1e-4, foreach=True)


def _layer_batch(size: dict[str, int], rank: int, world: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's sequence slice of the same (S, B, H) input and output gradient on every rank."""
    g = torch.Generator(device=device).manual_seed(1)
    S, B, H = size["seq"], size["batch"], size["hidden"]
    x = torch.randn(S, B, H, device=device, generator=g).bfloat16()
    dy = (torch.randn(S, B, H, device=device, generator=g) * 1e-2).bfloat16()
    sl = slice(rank * S // world, (rank + 1) * S // world)
    return x[sl].contiguous().requires_grad_(), dy[sl].contiguous()


def _fp8ops_tp(size: dict[str, int], rank: int, world: int, group: Any, device: str = "cuda"
               ) -> tuple[Callable[..., Any], Any, tuple[Any, ...]]:
    import fp8ops

    recipe = fp8ops.DelayedScaling()
    cfg = fp8ops.TransformerConfig(hidden_size=size["hidden"], ffn_hidden_size=size["ffn"],
                                   num_attention_heads=size["heads"], hidden_dropout=0.1, attention_dropout=0.1)
    full = fp8ops.init_transformer_params(cfg, generator=torch.Generator().manual_seed(0))
    shard = fp8ops.shard_transformer_params(full, cfg, rank=rank, world_size=world)
    params = {k: v.detach().to(device, torch.bfloat16).contiguous().requires_grad_() for k, v in shard.items()}
    opt = _adamw(list(params.values()), capturable=True, device=device)
    state = fp8ops.init_transformer_state(cfg, recipe, device=device)

    def step(st: Any, x: torch.Tensor, dy: torch.Tensor) -> tuple[Any, torch.Tensor]:
        opt.zero_grad(set_to_none=True)
        probes = fp8ops.make_probes(st)
        y, ns = fp8ops.transformer_layer(params, x, st, config=cfg, recipe=recipe, probes=probes, tp_group=group,
                                         sequence_parallel=True)
        loss = (y.float() * dy.float()).sum()
        loss.backward()
        opt.step()
        ns = fp8ops.update(ns, recipe=recipe, grad_amax=pytree.tree_map(lambda p: p.grad, probes), group=group)
        return ns, loss.detach()

    return step, state, _layer_batch(size, rank, world, device)


def _dtensor_tp(size: dict[str, int], rank: int, world: int, float8: bool, compiled: bool, device: str = "cuda"
                ) -> tuple[Callable[..., Any], Any, tuple[Any, ...]]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    from fp8ops.reference.transformer_layer import BasicTransformerLayer

    torch.manual_seed(0)
    net = BasicTransformerLayer(size["hidden"], size["ffn"], size["heads"], attention_dropout=0.1, hidden_dropout=0.1,
                                attention_impl="sdpa").to(device, torch.bfloat16)
    col, row = ColwiseParallel, RowwiseParallel
    if float8:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

        convert_to_float8_training(net, config=Float8LinearConfig.from_recipe_name("tensorwise"))
        col, row = Float8ColwiseParallel, Float8RowwiseParallel
    mesh = init_device_mesh(device, (world,))
    # the residual stream stays the local (S/w, B, H) slice; the norms run on it as DTensors
    # sharded on dim 0; the column-parallel GEMMs all-gather their input, the row-parallel ones
    # reduce-scatter their output back to the slice
    parallelize_module(net, mesh, {
        "ln1": SequenceParallel(sequence_dim=0),
        "qkv_projection": col(input_layouts=Shard(0)),
        "projection": row(output_layouts=Shard(0)),
        "ln2": SequenceParallel(sequence_dim=0),
        "mlp.linear1": col(input_layouts=Shard(0)),
        "mlp.linear2": row(output_layouts=Shard(0)),
    })
    net.num_attention_heads //= world  # each rank runs its heads
    net.attention.projection_size //= world
    fwd: Callable[..., Any] = torch.compile(net) if compiled else net
    opt = _adamw(list(net.parameters()), capturable=False, device=device)

    def step(carry: Any, x: torch.Tensor, dy: torch.Tensor) -> tuple[Any, torch.Tensor]:
        opt.zero_grad(set_to_none=True)
        y = fwd(x)
        y.backward(dy)
        opt.step()
        return carry, y.detach().float().square().mean()

    return step, None, _layer_batch(size, rank, world, device)


def _fsdp_gpt(size: dict[str, int], rank: int, world: int, kind: str, device: str = "cuda", wrap: str = "block",
              compile_backend: str | None = None) -> tuple[Callable[..., Any], Any, tuple[Any, ...]]:
    """FSDP2 of the step suite's torch GPT: kind "bf16", "FP8, bf16 all-gather", "FP8, FP8 all-gather";
    ``wrap`` "block": one FSDP2 group per transformer block, "linear": one per Linear (then the root);
    ``compile_backend``: each wrapped module compiled with that backend, the root left eager (FSDP2's
    hooks run eagerly around each compiled module; the FP8 all-gather layers' ops trace into the
    compiled graphs over the gathered bytes)."""
    import fp8ops
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from .step import TorchBlock, TorchGPT

    if wrap not in ("block", "linear"):
        raise ValueError(f"fp8ops.bench parallel: the FSDP2 wrap must be 'block' or 'linear', got {wrap!r}")
    torch.manual_seed(0)
    L, H, heads, S, B, V = (size[k] for k in ("layers", "hidden", "heads", "seq", "batch", "vocab"))
    net = TorchGPT(L, H, heads, S, V).to(device)  # float32 master weights
    recipe = None
    if kind != "bf16":
        recipe = fp8ops.DelayedScaling()
        fp8ops.nn.convert(net, recipe)
        if kind == "FP8, FP8 all-gather":
            fp8ops.nn.enable_fp8_all_gather(net)
    mesh = init_device_mesh(device, (world,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    # one FSDP2 group per block (or per Linear), then the root (embeddings, final norm)
    kinds = (TorchBlock,) if wrap == "block" else (torch.nn.Linear, fp8ops.nn.Linear)
    for m in list(net.modules()):
        if isinstance(m, kinds):
            fully_shard(m, mesh=mesh, mp_policy=mp)
            if compile_backend is not None:
                m.compile(backend=compile_backend)
    fully_shard(net, mesh=mesh, mp_policy=mp)
    opt = _adamw(list(net.parameters()), capturable=False, device=device)
    g = torch.Generator(device=device).manual_seed(2 + rank)  # each rank its own batch
    tokens = torch.randint(0, V, (B, S), device=device, generator=g)
    targets = torch.randint(0, V, (B, S), device=device, generator=g)

    def step(carry: Any, tok: torch.Tensor, tgt: torch.Tensor) -> tuple[Any, torch.Tensor]:
        opt.zero_grad(set_to_none=True)
        loss = net(tok, tgt)
        loss.backward()
        opt.step()
        if recipe is not None:
            fp8ops.nn.update_scaling(net, group=dist.group.WORLD)
        return carry, loss.detach()

    step.model = net  # type: ignore[attr-defined]  (the wrapped model, for tests and profiles)
    return step, None, (tokens, targets)


# ------------------------------------------------------------------------------------------------
# The processes


def _kernel_profile(step: Callable[..., Any], carry: Any, batch: tuple[Any, ...], steps: int = 2
                    ) -> tuple[Any, dict[str, Any]]:
    """(carry, profile) of ``steps`` steps on this rank: device time per step by kind of kernel
    (communication = NCCL kernels), the span from the first kernel's start to the last one's end,
    and the 15 kernels with the most time."""
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            carry, _ = step(carry, *batch)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    if not kernels:
        return carry, {}
    by_name: dict[str, float] = {}
    kinds = {"communication": 0.0, "gemm": 0.0, "attention": 0.0, "other": 0.0}
    for e in kernels:
        us = e.time_range.elapsed_us() / steps
        by_name[e.name] = by_name.get(e.name, 0.0) + us
        low = e.name.lower()
        kind = ("communication" if "nccl" in low else
                "gemm" if any(k in low for k in ("gemm", "matmul", "sm90_xmma", "cutlass", "nvjet")) else
                "attention" if any(k in low for k in ("attn", "attention", "flash", "fmha")) else "other")
        kinds[kind] += us
    span = (max(e.time_range.end for e in kernels) - min(e.time_range.start for e in kernels)) / steps
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:15]
    return carry, {"kernels_per_step": len(kernels) / steps, "span_ms": span / 1e3,
                   "kernel_ms": {k: v / 1e3 for k, v in kinds.items()},
                   "top": [(name[:90], us / 1e3) for name, us in top]}


def _measure(step: Callable[..., Any], carry: Any, batch: tuple[Any, ...], steps: int) -> dict[str, Any]:
    for _ in range(4):  # warm-up: compilation, calibration, a graph's capture
        carry, loss = step(carry, *batch)
    torch.cuda.synchronize()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        carry, loss = step(carry, *batch)
    torch.cuda.synchronize()
    ms = torch.tensor((time.perf_counter() - t0) / steps * 1e3, device="cuda")
    dist.all_reduce(ms, op=dist.ReduceOp.MAX)  # the slower rank's time
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(2):
            carry, loss = step(carry, *batch)
        torch.cuda.synchronize()
    return {"ms": float(ms), "loss": float(loss), "comm_bytes": _collective_bytes(prof, 2)}


def _gpts(opts: dict[str, Any]) -> list[dict[str, int]]:
    """The FSDP2 GPT sizes of a run (``--fsdp-batch`` sequences per GPU, if given)."""
    gpts = GPTS_QUICK if opts["quick"] else GPTS
    if opts.get("fsdp_batch"):
        gpts = [dict(g, batch=opts["fsdp_batch"]) for g in gpts]
    return gpts


def _variants(opts: dict[str, Any], rank: int, world: int, group: Any, groups: dict[str, Any] | None = None
              ) -> list[tuple[str, str, Callable[[], Any]]]:
    """(suite part, name, build) in run order; a name containing "graph" is run through graph_step;
    ``groups["hp"]``: the high-priority group of the "hp" overlap variants."""
    groups = groups or {}
    seed = SEED_QUICK if opts["quick"] else SEED
    gpts = _gpts(opts)
    compiled = not opts["no_compile"]
    suffix = " + compile" if compiled else ""
    from .step import _variant

    out = [] if opts["no_seed"] else [
        ("seed", "fp8ops FP8, 1 GPU", lambda: _variant("seed", "fp8ops FP8", "eager", seed)),
        ("seed", "fp8ops FP8, 1 GPU, graph", lambda: _variant("seed", "fp8ops FP8", "eager", seed)),
        ("seed", "fp8ops FP8, TP=2+SP", lambda: _fp8ops_tp(seed, rank, world, group)),
        ("seed", "fp8ops FP8, TP=2+SP, graph", lambda: _fp8ops_tp(seed, rank, world, group)),
        *[("seed", f"fp8ops FP8, TP=2+SP, graph, overlap {spec}",
           lambda hp=_overlap_of(f"overlap {spec}")[2]: _fp8ops_tp(seed, rank, world, groups["hp"] if hp else group))
          for spec in opts.get("overlap", ())],
        ("seed", f"torch bf16, DTensor TP=2+SP{suffix}", lambda: _dtensor_tp(seed, rank, world, False, compiled)),
    ]
    if not opts["no_torchao"] and not opts["no_seed"]:
        out.append(("seed", f"torchao float8, TP=2+SP{suffix}", lambda: _dtensor_tp(seed, rank, world, True, compiled)))
    if not opts["no_fsdp"]:
        for gpt in gpts:
            for mode in ("",) + ((" + compile",) if compiled else ()):  # eager; each block compiled
                for kind in ("bf16", "FP8, bf16 all-gather", "FP8, FP8 all-gather"):
                    out.append((f"fsdp2 gpt {gpt['hidden']}", f"FSDP2 {kind}{mode}, hidden {gpt['hidden']}",
                                lambda k=kind, size=gpt, c=bool(mode): _fsdp_gpt(
                                    size, rank, world, k, wrap=opts["fsdp_wrap"],
                                    compile_backend="inductor" if c else None)))
    return out


def overlap_specs(args: argparse.Namespace) -> list[str]:
    """The overlap SPECs to time: ``--overlap`` ("none", or no SPEC, for none) and ``--row-chunks``;
    a malformed SPEC raises before any process starts."""
    given = list(getattr(args, "overlap", []))
    if "none" in given:
        if len(given) > 1:
            raise ValueError(f"fp8ops.bench parallel: --overlap none times no overlap variant and takes no other "
                             f"SPEC, got {' '.join(given)!r}")
        given = []
    specs = [*given, *(f"c{n}+nf" for n in getattr(args, "row_chunks", []))]
    for spec in specs:
        _overlap_of(f"overlap {spec}")
    return specs


def _overlap_of(name: str) -> tuple[int, int, bool, bool]:
    """(row-parallel forward chunks, SMs left to collectives in flight, high-priority group, fused
    GEMMs and collectives) of a variant: (1, 0, False, True) unless its name ends with "overlap
    SPEC" (see the module's doc)."""
    if "overlap " not in name:
        return 1, 0, False, True
    spec = name.rsplit("overlap ", 1)[1]
    chunks, sms, hp, fused = 1, 0, False, True
    for part in spec.split("+"):
        n = int(part[1:]) if part[:1] in ("c", "s") and part[1:].isdigit() else None
        if part == "hp":
            hp = True
        elif part == "nf":
            fused = False
        elif n is not None and n >= (2 if part[0] == "c" else 1):
            chunks, sms = (n, sms) if part[0] == "c" else (chunks, n)
        else:
            raise ValueError(f"fp8ops.bench parallel: --overlap {spec!r}: expected '+'-joined c<N> (row chunks, "
                             f"N >= 2), s<N> (SMs, N >= 1), hp and nf, got {part!r}")
    return chunks, sms, hp, fused


def _carveout_check(sms: list[int]) -> dict[str, float]:
    """Whether cuBLAS honours an SM carveout: ms of one FP8 GEMM (8192 x 4096 x 4096) with each
    number of SMs left free, and with half the GPU's SMs left free (which should take about twice
    as long); keyed by the SMs left free ("0": every SM used)."""
    from fp8ops._parallel import overlap_carveout

    a = torch.randn(8192, 4096, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(4096, 4096, device="cuda").to(torch.float8_e4m3fn)
    one = torch.ones((), device="cuda")

    def gemm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)

    out = {}
    for n in [0, *sms, torch.cuda.get_device_properties(0).multi_processor_count // 2]:
        with overlap_carveout(n):  # set at launch: plain launches, no graph
            out[str(n)] = time_cuda(gemm, [(a, b)], samples=10, use_graph=False).median_us / 1e3
    return out


def _worker(rank: int, world: int, out_dir: str, opts: dict[str, Any]) -> None:
    import fp8ops

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{os.path.join(out_dir, 'init')}", rank=rank,
                            world_size=world, device_id=torch.device("cuda", rank))
    group = dist.group.WORLD
    rows: list[dict[str, Any]] = []
    failed: list[str] = []
    groups = {}
    if any(_overlap_of(f"overlap {spec}")[2] for spec in opts.get("overlap", ())):
        # the same ranks, with the NCCL stream at high priority: its kernels take SMs ahead of queued compute
        groups["hp"] = dist.new_group(backend="nccl",
                                      pg_options=dist.ProcessGroupNCCL.Options(is_high_priority_stream=True))
    variants = _variants(opts, rank, world, group, groups)
    sms = sorted({_overlap_of(f"overlap {spec}")[1] for spec in opts.get("overlap", ())} - {0})
    carveout = _carveout_check(sms) if sms and rank == 0 else {}
    progress = Progress(len(variants), prefix="parallel") if rank == 0 else None
    for part, name, build in variants:
        if progress is not None:
            progress.step(name)
        torch._dynamo.reset()
        torch.cuda.reset_peak_memory_stats()
        one_gpu = "1 GPU" in name
        chunks, sms, _, fused = _overlap_of(name)
        defaults = fp8ops.parallel.set_comm_options(pipelined_gemms=fused, sm_carveout=sms, row_chunks=chunks)
        try:
            if not one_gpu or rank == 0:
                step, carry, batch = build()
                fn = fp8ops.graph_step(step) if "graph" in name else step
                if one_gpu:  # rank 0 alone: no collectives, no barrier inside
                    for _ in range(4):
                        carry, _ = fn(carry, *batch)
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    for _ in range(opts["steps"]):
                        carry, loss = fn(carry, *batch)
                    torch.cuda.synchronize()
                    r = {"ms": (time.perf_counter() - t0) / opts["steps"] * 1e3, "loss": float(loss), "comm_bytes": {}}
                else:
                    r = _measure(fn, carry, batch, opts["steps"])
                if "graph" in name:
                    r["graph_stats"] = dict(fn.stats)  # type: ignore[union-attr]
                if opts.get("profile"):
                    carry, r["profile"] = _kernel_profile(fn, carry, batch)
                rows.append({"part": part, "variant": name, "peak_mib": torch.cuda.max_memory_allocated() / 2**20, **r})
                del step, carry, batch, fn
        except Exception as exc:  # noqa: BLE001  (one failing variant must not hide the others)
            failed.append(f"{name}: {type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}")
            if progress is not None:
                progress.note(failed[-1])
        fp8ops.parallel.set_comm_options(**defaults._asdict())
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        dist.barrier()
    if rank == 0:
        with open(os.path.join(out_dir, "rows.json"), "w") as f:
            json.dump({"rows": rows, "failed": failed, "carveout_check": carveout}, f)
    dist.destroy_process_group()


def _ratios(rows: list[dict[str, Any]]) -> dict[str, Any]:
    by = {r["variant"]: r for r in rows}

    def ms(prefix: str) -> float | None:  # the fastest default variant (no overlap option)
        got = [r["ms"] for name, r in by.items() if name.startswith(prefix) and "overlap " not in name]
        return min(got) if got else None

    tp, one, ao, bf = ms("fp8ops FP8, TP=2+SP"), ms("fp8ops FP8, 1 GPU"), ms("torchao float8"), ms("torch bf16")
    out: dict[str, Any] = {}
    if tp and one:
        out["tp_over_1gpu"] = tp / one
    if tp and ao:
        out["vs_torchao_tp"] = ao / tp
    if tp and bf:
        out["vs_bf16_tp"] = bf / tp
    default = by.get("fp8ops FP8, TP=2+SP, graph")
    for name, r in by.items():
        if default and "overlap " in name:
            out[f"overlap_{name.rsplit('overlap ', 1)[1]}_over_default"] = r["ms"] / default["ms"]
    gathers = {name: r["comm_bytes"].get("all_gather", 0.0) for name, r in by.items()}
    fp8_tp = gathers.get("fp8ops FP8, TP=2+SP")
    bf_tp = next((v for k, v in gathers.items() if k.startswith("torch bf16")), None)
    if fp8_tp and bf_tp:
        out["tp_all_gather_bytes_fp8_over_bf16"] = fp8_tp / bf_tp
    for size in sorted({r["part"].rsplit(" ", 1)[1] for r in rows if r["part"].startswith("fsdp2")}):
        f8, f16 = gathers.get(f"FSDP2 FP8, FP8 all-gather, hidden {size}"), gathers.get(f"FSDP2 FP8, bf16 all-gather, hidden {size}")
        if f8 and f16:
            out[f"fsdp_all_gather_bytes_fp8_over_bf16_h{size}"] = f8 / f16
        # each in its fastest mode (eager or its blocks compiled)
        of_size = {n: r["ms"] for n, r in by.items() if n.startswith("FSDP2 ") and n.endswith(f"hidden {size}")}
        a = [ms for n, ms in of_size.items() if n.startswith("FSDP2 FP8, FP8 all-gather")]
        b = [ms for n, ms in of_size.items() if n.startswith("FSDP2 bf16")]
        if a and b:
            out[f"fsdp_fp8_over_bf16_ms_h{size}"] = min(a) / min(b)
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Spawn one process per GPU (2), run every variant, print the table and the ratios, write
    parallel.json and parallel.png."""
    fsdp_batch = getattr(args, "fsdp_batch", None)
    if fsdp_batch is not None and fsdp_batch < 1:
        raise ValueError(f"fp8ops.bench parallel: --fsdp-batch must be a positive number of sequences per GPU, "
                         f"got {fsdp_batch}")
    overlap = overlap_specs(args)
    if getattr(args, "no_seed", False) and args.no_fsdp:
        raise ValueError("fp8ops.bench parallel: --no-seed and --no-fsdp together leave nothing to run")
    n = torch.cuda.device_count()
    record: dict[str, Any] = {"suite": "parallel", "environment": environment(), "rows": [], "failed_checks": []}
    if n < 2 or not dist.is_nccl_available():
        record["failed_checks"].append(f"the parallel suite needs 2 CUDA GPUs and NCCL; found {n} GPU(s)")
        return record
    import torch.multiprocessing as mp

    opts = {"quick": args.quick, "steps": 3 if args.quick else args.steps, "no_torchao": args.no_torchao,
            "no_compile": args.no_compile, "no_fsdp": args.no_fsdp, "no_seed": getattr(args, "no_seed", False),
            "fsdp_batch": fsdp_batch, "fsdp_wrap": getattr(args, "fsdp_wrap", "block"), "profile": args.profile,
            "overlap": list(dict.fromkeys(overlap))}
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_worker, args=(2, d, opts), nprocs=2, join=True)
        with open(os.path.join(d, "rows.json")) as f:
            got = json.load(f)
    rows, failed = got["rows"], got["failed"]
    if not opts["no_fsdp"]:
        record["fsdp_wrap"] = opts["fsdp_wrap"]
    if got.get("carveout_check"):
        record["carveout_check_ms"] = got["carveout_check"]
        print("one FP8 GEMM (8192x4096x4096) by SMs left free: "
              + ", ".join(f"{k}: {v:.3f} ms" for k, v in got["carveout_check"].items()))
    ratios = _ratios(rows)
    for r in rows:
        for kind, v in r.pop("comm_bytes").items():
            r[f"{kind}_MiB"] = v / 2**20
    cols = [("part", "part", ""), ("variant", "variant", ""), ("ms", "ms/step", ".2f"), ("peak_mib", "peak MiB", ".0f"),
            ("all_gather_MiB", "all-gather MiB", ".1f"), ("reduce_scatter_MiB", "reduce-scatter MiB", ".1f"),
            ("all_reduce_MiB", "all-reduce MiB", ".2f")]
    print(format_table(rows, cols))
    print()
    for key, value in ratios.items():
        target = TARGETS.get(key)
        verdict = ""
        if target is not None:
            ok = value <= target if key == "tp_over_1gpu" else value >= target
            verdict = f" (target {'<=' if key == 'tp_over_1gpu' else '>='} {target}: {'met' if ok else 'MISSED'})"
        print(f"{key}: {value:.3f}{verdict}")
    for r in rows:
        prof = r.get("profile")
        if prof:
            kinds = ", ".join(f"{k} {v:.2f}" for k, v in prof["kernel_ms"].items())
            print(f"\nprofile of {r['variant']!r} (rank 0, per step): {prof['kernels_per_step']:.0f} kernels, span "
                  f"{prof['span_ms']:.2f} ms; kernel ms: {kinds}")
            for kname, ms in prof["top"]:
                print(f"  {ms:7.3f} ms  {kname}")
    record.update(rows=rows, ratios=ratios, failed_checks=failed, sizes={"seed": SEED_QUICK if args.quick else SEED,
                                                                         "gpt": _gpts(opts)})
    out = Path(args.out)
    write_json(out / "parallel.json", record)
    panels = []
    for part in dict.fromkeys(r["part"] for r in rows):
        mine = [r for r in rows if r["part"] == part]
        if mine:
            panels.append({"title": f"{part}: ms per step (per GPU)", "groups": [r["variant"] for r in mine],
                           "series": {"ms/step": [r["ms"] for r in mine]}})
    if panels:
        write_bar_chart(out / "parallel.png", panels, title=f"2 x {torch.cuda.get_device_name()}", ylabel="ms per step")
    return record
