"""Tensor and sequence parallelism: the four collectives of Megatron-LM / Transformer Engine as
autograd Functions, and the checks of the ``tp_group`` / ``parallel_mode`` / ``sequence_parallel``
arguments shared by the linear ops.

With w ranks in the tensor-parallel group::

    copy_to_tp        y = x                     dx = all_reduce(dy)          (replicated input)
    reduce_from_tp    y = all_reduce(x)         dx = dy                      (row-parallel output)
    gather_seq        y = all_gather_0(x)       dx = reduce_scatter_0(dy)    (SP -> column input)
    scatter_seq       y = reduce_scatter_0(x)   dx = all_gather_0(dy)        (row output -> SP)

With FP8, ``gather_seq_fp8`` (forward) and ``scatter_seq_fp8`` (its backward) move FP8 bytes with
one scale shared by the group.

A column-parallel linear holds the (N/w, K) row shard of W and returns the last-dim shard of y; a
row-parallel linear holds the (N, K/w) column shard, takes the last-dim shard of x and sums the
partial outputs. With sequence parallelism the activations between the parallel regions are this
rank's contiguous slice of dim 0 (S/w rows of (S, B, H)), so the all-reduce splits into an
all-gather before the column GEMM and a reduce-scatter after the row GEMM.

The collectives are ``torch.distributed._functional_collectives`` (all_reduce, all_gather_single,
reduce_scatter_single, or their older names all_gather_tensor and reduce_scatter_tensor: traceable
by torch.compile, and run by gloo on the CPU).

References:
    Shoeybi et al., "Megatron-LM" (2019); Korthikanti et al., "Reducing Activation Recomputation
    in Large Transformer Models" (2022, sequence parallelism); NVIDIA Transformer Engine.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from .gemm import add_bias, bias_in_epilogue
from .norm import layer_norm, rms_norm
from .quantize import quantize_2d
from .recipes import compute_scale

__all__ = [
    "TP",
    "all_gather_async",
    "all_gather_scaled_mm",
    "check_divisible",
    "column_input",
    "copy_to_tp",
    "copy_to_tp_many",
    "enter_replicated",
    "exit_replicated",
    "check_fp8_gather_recipe",
    "fp8_all_gather_bytes",
    "fp8_group_quantize",
    "fused_sp_gemms",
    "gather_seq",
    "gather_seq_fp8",
    "overlap_carveout",
    "overlap_sm_carveout",
    "probe_sink",
    "reduce_from_tp",
    "reduce_scatter",
    "reduce_scatter_async",
    "row_fprop_chunks",
    "row_output",
    "scaled_mm_reduce_scatter",
    "scatter_seq",
    "scatter_seq_fp8",
    "sequence_norm",
    "tp_config",
    "transformer_shard_shapes",
    "transformer_split",
    "wait",
]

PARALLEL_MODES = ("column", "row")


def _fc() -> Any:
    import torch.distributed._functional_collectives as fc  # only when torch.distributed is used

    return fc


def _done(t: Tensor) -> Tensor:
    """The plain tensor of a functional collective's result (eager mode returns a lazy wrapper)."""
    fc = _fc()
    if isinstance(t, fc.AsyncCollectiveTensor):
        return t.wait()
    return t


# The functional all-gather and reduce-scatter of dim 0: named *_single in newer torch releases
# (2.13 warns on the *_tensor names), *_tensor in older ones (2.11).
GATHER_NAME, SCATTER_NAME = "all_gather_single", "reduce_scatter_single"


def _gather_fn() -> Any:
    fc = _fc()
    return getattr(fc, GATHER_NAME, None) or fc.all_gather_tensor


def _scatter_fn() -> Any:
    fc = _fc()
    return getattr(fc, SCATTER_NAME, None) or fc.reduce_scatter_tensor


def _all_reduce(t: Tensor, group: Any) -> Tensor:
    return _done(_fc().all_reduce(t.contiguous(), "sum", group))


def _all_gather(t: Tensor, group: Any) -> Tensor:
    return _done(_gather_fn()(t.contiguous(), 0, group))


def _reduce_scatter(t: Tensor, group: Any) -> Tensor:
    return _done(_scatter_fn()(t.contiguous(), "sum", 0, group))


def reduce_scatter_async(t: Tensor, group: Any) -> Tensor:
    """The sum of t over the group, this rank's dim-0 slice, still in flight: pass it to
    :func:`wait` before use (the work issued in between overlaps the communication)."""
    return _scatter_fn()(t.contiguous(), "sum", 0, group)


def all_gather_async(t: Tensor, group: Any) -> Tensor:
    """The ranks' dim-0 slices of t concatenated in rank order, still in flight (see :func:`wait`)."""
    return _gather_fn()(t.contiguous(), 0, group)


wait = _done
reduce_scatter = _reduce_scatter

# Column chunks of the forward GEMM of a sequence-parallel, row-parallel FP8 linear (the fused path
# of fp8_linear): each chunk's partial sums are reduce-scattered while the next chunk is computed,
# and the chunks' slices are concatenated along the last dim. 1: one GEMM, then one reduce-scatter.
# A plain list read when an op is called (torch.compile guards on its value). The default is one
# GEMM: on two H200s the seed layer's captured TP=2+SP step took 8.06 / 8.14 ms with 2 / 4 chunks
# against 8.05 with one (docs/benchmarks/parallel.md). Where the pipelined GEMMs apply
# (FUSED_SP_GEMMS), they replace the chunks.
ROW_FPROP_CHUNKS = [1]


def row_fprop_chunks(n_out: int) -> int:
    """The column chunks for a row-parallel forward GEMM of ``n_out`` output columns: the setting of
    :data:`ROW_FPROP_CHUNKS` when it divides ``n_out`` into chunks of a multiple of 16 columns (what
    FP8 GEMMs take), else 1."""
    c = ROW_FPROP_CHUNKS[0]
    return c if c > 1 and n_out % c == 0 and (n_out // c) % 16 == 0 else 1


# SMs that a GEMM leaves free while a collective of the same op is in flight (the row-parallel
# forward chunks after the first; wgrad while dx is reduce-scattered), so that the collective's
# kernel need not wait for the GEMM's blocks to finish. Measured on two H100s: no gain on the seed
# layer's TP=2+SP step (docs/benchmarks/parallel.md), hence off. 0: every SM. A
# plain list read when an op is called, in eager mode and CUDA graph captures (torch.compile traces
# no host setting: compiled calls use every SM). Applied through cuBLAS's SM count target
# (torch._C._set_sm_carveout_experimental) around those GEMMs only.
OVERLAP_SM_CARVEOUT = [0]


class _Carveout:
    __slots__ = ("sms", "prev")

    def __init__(self, sms: int) -> None:
        self.sms = sms
        self.prev: int | None = None

    def __enter__(self) -> None:
        self.prev = torch._C._get_sm_carveout_experimental()
        with warnings.catch_warnings():  # torch announces the setting as experimental, once
            warnings.simplefilter("ignore")
            torch._C._set_sm_carveout_experimental(self.sms)

    def __exit__(self, *exc: Any) -> None:
        torch._C._set_sm_carveout_experimental(self.prev)


def overlap_carveout(sms: int) -> Any:
    """A context in which cuBLAS GEMMs leave ``sms`` SMs free for a collective in flight, restoring
    the previous setting on exit; a null context for 0."""
    return _Carveout(sms) if sms > 0 else contextlib.nullcontext()


def overlap_sm_carveout(device: torch.device) -> int:
    """The setting of :data:`OVERLAP_SM_CARVEOUT` for an op on ``device``: 0 off CUDA and under
    torch.compile."""
    sms = OVERLAP_SM_CARVEOUT[0]
    if not isinstance(sms, int) or sms < 0:
        raise ValueError(f"fp8ops._parallel.OVERLAP_SM_CARVEOUT: expected a number of SMs >= 0, got {sms!r}")
    return sms if device.type == "cuda" and not torch.compiler.is_compiling() else 0


# The sequence-parallel FP8 GEMMs fused with their collectives through torch's micro-pipelined
# symmetric-memory ops: an all-gather and the GEMM that consumes it (the column-parallel forward,
# the row-parallel dgrad) multiply this rank's rows while the other ranks' rows are copied over
# NVLink by the copy engines (torch.ops.symm_mem.fused_all_gather_scaled_matmul); a GEMM and the
# reduce-scatter of its output (the row-parallel forward) compute the other ranks' rows first, which
# they pull while this rank's rows are computed, then sum (fused_scaled_matmul_reduce_scatter).
# The same products and sums as the GEMM and the NCCL collective. Used in eager mode and CUDA graph
# captures, for CUDA tensors of an NCCL group, per-tensor scales, cuBLAS GEMMs and every dimension a
# multiple of 16, and groups whose ranks share one host with peer access between their GPUs
# (checked once per group); otherwise, and under torch.compile, the functional collectives. A plain
# list read when an op is called. On by default: on two H100s it took the seed layer's captured
# TP=2+SP step from 8.67 to 8.31 ms (docs/benchmarks/parallel.md).
FUSED_SP_GEMMS = [True]
_SYMM_GROUPS: dict[str, bool] = {}  # group name: its ranks can share symmetric memory
_SYMM_ENABLED: set[str] = set()


def fused_sp_gemms(device: torch.device, group: Any, mode: str, backends: tuple[str, ...], *dims: int) -> bool:
    """Whether a sequence-parallel linear on ``device`` runs its FP8 GEMMs and collectives as the
    fused symmetric-memory ops (see :data:`FUSED_SP_GEMMS`): recipe ``mode`` per-tensor, every
    backend cuBLAS, every GEMM dimension in ``dims`` a multiple of 16."""
    if not FUSED_SP_GEMMS[0] or device.type != "cuda" or torch.compiler.is_compiling() or mode == "rowwise":
        return False
    if any(b not in ("auto", "cublas") for b in backends) or any(d % 16 for d in dims):
        return False
    ok = _SYMM_GROUPS.get(getattr(group, "group_name", None))
    if ok is None:  # the group's first call: its backend, then (NCCL) the ranks' hosts and devices
        if dist.get_backend(group) != "nccl":
            _SYMM_GROUPS[group.group_name] = ok = False
        else:
            ok = _symm_check(group, device)
    return ok


def _symm_check(group: Any, device: torch.device) -> bool:
    """Whether the group's ranks share one host and each GPU can access every other's memory; the
    same answer on every rank (two small object all-gathers, once per group)."""
    import socket

    w = dist.get_world_size(group)
    dev = device.index if device.index is not None else torch.cuda.current_device()
    where: list[Any] = [None] * w
    dist.all_gather_object(where, (socket.gethostname(), dev), group=group)
    mine = all(h == where[0][0] for h, _ in where) and all(
        d == dev or torch.cuda.can_device_access_peer(dev, d) for _, d in where)
    every: list[Any] = [None] * w
    dist.all_gather_object(every, mine, group=group)
    _SYMM_GROUPS[group.group_name] = ok = all(every)
    return ok


def _symm_group(group: Any) -> str:
    """The group's name, its symmetric memory set up (torch versions that still ask for it)."""
    import torch.distributed._symmetric_memory as symm  # registers the torch.ops.symm_mem ops

    name = group.group_name
    enable = getattr(symm, "enable_symm_mem_for_group", None)
    if enable is not None and name not in _SYMM_ENABLED:
        with warnings.catch_warnings():  # deprecated, and a no-op, where no longer needed
            warnings.simplefilter("ignore")
            enable(name)
        _SYMM_ENABLED.add(name)
    return name


def all_gather_scaled_mm(a: Tensor, scale_a: Tensor, b: Tensor, scale_b: Tensor, bias: Tensor | None,
                         out_dtype: torch.dtype, fast_accum: bool, group: Any) -> tuple[Tensor, Tensor]:
    """(the ranks' FP8 rows ``a`` (M/w, K) gathered along dim 0 (M, K), ``(gathered @ b.T) * scale_a
    * scale_b (+ bias)`` (M, N)); ``b`` is (N, K) FP8, both scales per tensor. The GEMM of this
    rank's rows runs while the others are copied."""
    name = _symm_group(group)  # first: it registers the ops
    epilogue = bias_in_epilogue(bias, out_dtype)
    full, (y,) = torch.ops.symm_mem.fused_all_gather_scaled_matmul(
        a, [b.t()], scale_a, [scale_b], 0, name, [bias if epilogue else None], [None], [out_dtype], [fast_accum])
    if bias is not None and not epilogue:
        y = add_bias(y, bias, out_dtype)
    return full, y


def scaled_mm_reduce_scatter(a: Tensor, scale_a: Tensor, b: Tensor, scale_b: Tensor, out_dtype: torch.dtype,
                             fast_accum: bool, group: Any) -> Tensor:
    """``(a @ b.T) * scale_a * scale_b`` (M, N) summed over the group, this rank's (M/w, N) rows;
    ``a`` (M, K) and ``b`` (N, K) FP8, both scales per tensor. The other ranks' rows are computed
    first and pulled by them while this rank's rows are computed."""
    name = _symm_group(group)  # first: it registers the ops
    return torch.ops.symm_mem.fused_scaled_matmul_reduce_scatter(
        a, b.t(), scale_a, scale_b, "sum", 0, 0, name, [a.shape[0], b.shape[0]],
        out_dtype=out_dtype, use_fast_accum=fast_accum)


def _conjugate(name: str, fwd: Any, bwd: Any) -> Any:
    """An autograd.Function running the collective ``fwd(x, group)`` forward and its conjugate
    ``bwd(dy, group)`` backward (the four of Megatron-style tensor and sequence parallelism)."""

    def forward(x: Tensor, group: Any) -> Tensor:
        return fwd(x, group)

    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.group = inputs[1]

    def backward(ctx: Any, dy: Tensor) -> tuple[Any, ...]:
        with torch.no_grad():
            return bwd(dy, ctx.group), None

    body = {"forward": staticmethod(forward), "setup_context": staticmethod(setup_context),
            "backward": staticmethod(backward), "__module__": __name__}
    return type(name, (torch.autograd.Function,), body)


# copy-to-TP: identity forward, all-reduce backward; reduce-from-TP: the converse; gather-from-
# sequence: all-gather forward, reduce-scatter backward; scatter-to-sequence: the converse.
_CopyToTP = _conjugate("_CopyToTP", lambda x, g: x.view_as(x), _all_reduce)
_ReduceFromTP = _conjugate("_ReduceFromTP", _all_reduce, lambda dy, g: dy)
_GatherSeq = _conjugate("_GatherSeq", _all_gather, _reduce_scatter)
_ScatterSeq = _conjugate("_ScatterSeq", _reduce_scatter, _all_gather)


def check_fp8_gather_recipe(recipe: Any, where: str, subject: str = "", hint: str = "") -> None:
    """Raise unless ``recipe`` can use a weight all-gathered in FP8: one scale per tensor, and FP8
    fprop and dgrad GEMMs (the gathered weight replaces the high-precision one in both).
    ``subject`` starts the reason (e.g. "layer '1' has a recipe with "), ``hint`` ends it."""
    if recipe.mode == "rowwise":
        raise ValueError(f"{where}: {subject}row-wise scaling: one scale per row, and its dgrad operand needs "
                         f"per-column scales; an FP8 all-gather needs a per-tensor recipe (DelayedScaling or "
                         f"CurrentScaling(granularity='tensor')){hint}")
    if recipe.fprop.precision != "fp8" or recipe.dgrad.precision != "fp8":
        raise ValueError(f"{where}: {subject}fprop={recipe.fprop.precision!r}, dgrad={recipe.dgrad.precision!r}: "
                         f"the gathered FP8 weight replaces the high-precision weight in the fprop and dgrad "
                         f"GEMMs, which must then run in FP8{hint}")


def fp8_group_quantize(x2: Tensor, scale: Tensor, spec: Any, group: Any) -> tuple[Tensor, Tensor, Tensor]:
    """(this rank's (M/w, K) slice ``x2`` quantized with one scale for the group, as bytes (uint8),
    the inverse scale, amax of this rank's slice)."""
    # Step 1: one scale for the whole group: the state's (identical on every rank after
    # update(group=)), or from the group's amax (current scaling, an uncalibrated state).
    # A calibrated delayed scale needs no amax first: the cast observes it in the same pass.
    if spec.mode != "delayed" or not spec.calibrated:
        amax_g = _done(_fc().all_reduce(torch.ops.fp8ops.amax(x2), "max", group))
        scale = compute_scale(amax_g, torch.ones_like(amax_g), torch.finfo(spec.dtype).max, margin=spec.margin,
                              power_2_scale=spec.power_2)
    # Step 2: quantize this rank's slice with it.
    data, inv, _, amax = quantize_2d(x2, scale, spec._replace(mode="delayed", calibrated=True))
    return data.view(torch.uint8), inv, amax


def fp8_all_gather_bytes(x2: Tensor, scale: Tensor, spec: Any, group: Any) -> tuple[Tensor, Tensor, Tensor]:
    """(the ranks' (M/w, K) slices ``x2`` quantized with one scale for the group and all-gathered
    along dim 0 as (M, K) bytes (uint8), the inverse scale, amax of this rank's slice)."""
    data, inv, amax = fp8_group_quantize(x2, scale, spec, group)
    return _all_gather(data, group), inv, amax


def _fp8_all_gather(x: Tensor, scale: Tensor, spec: Any, group: Any) -> tuple[Tensor, Tensor]:
    """(x all-gathered along dim 0 as FP8 bytes and dequantized, amax of this rank's x)."""
    x2 = x.reshape(-1, x.shape[-1]).contiguous()  # (M/w, K)
    full, inv, amax = fp8_all_gather_bytes(x2, scale, spec, group)
    full = full.view(spec.dtype)  # (M, K)
    y = (full.to(torch.float32) * inv).to(x.dtype)
    return y.reshape(-1, *x.shape[1:]), amax


class _GatherSeqFP8(torch.autograd.Function):
    @staticmethod
    def forward(x: Tensor, scale: Tensor, spec: Any, group: Any) -> tuple[Tensor, Tensor]:  # type: ignore[override]
        return _fp8_all_gather(x, scale, spec, group)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.group = inputs[3]
        ctx.mark_non_differentiable(output[1])
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx: Any, dy: Tensor | None, _: Any) -> tuple[Any, ...]:  # type: ignore[override]
        if dy is None:
            return None, None, None, None
        with torch.no_grad():
            return _reduce_scatter(dy, ctx.group), None, None, None


class _ScatterSeqFP8(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        y: Tensor, probe: Tensor | None, g_scale: Tensor, spec: Any, group: Any
    ) -> Tensor:
        return _reduce_scatter(y, group)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        _, probe, g_scale, spec, group = inputs
        ctx.save_for_backward(g_scale)
        ctx.spec, ctx.group, ctx.has_probe = spec, group, probe is not None

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        (g_scale,) = ctx.saved_tensors
        with torch.no_grad():
            dy_full, amax = _fp8_all_gather(dy, g_scale, ctx.spec, ctx.group)
        return dy_full, (amax if ctx.has_probe else None), None, None, None


class _ProbeSink(torch.autograd.Function):
    @staticmethod
    def forward(probe: Tensor) -> Tensor:  # type: ignore[override]
        return torch.zeros_like(probe)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> Tensor | None:  # type: ignore[override]
        return None


def scatter_seq_fp8(y: Tensor, probe: Tensor | None, g_scale: Tensor, spec: Any, group: Any) -> Tensor:
    """:func:`scatter_seq` whose backward all-gathers the output gradient as FP8 bytes, quantized
    with one scale for the group (``spec``: the gradient role's per-tensor spec; the state's
    ``g_scale`` when calibrated with a probe, else the group's current amax). amax of this
    rank's dy becomes the gradient of ``probe``; the op in front, given
    ``probe_sink(probe)``, quantizes the gathered gradient back to the same bytes and its own
    (dequantized) observation is dropped."""
    return _ScatterSeqFP8.apply(y, probe, g_scale, spec, group)


def probe_sink(probe: Tensor | None) -> Tensor | None:
    """A zero probe whose gradient goes nowhere (see :func:`scatter_seq_fp8`)."""
    return None if probe is None else _ProbeSink.apply(probe)


def gather_seq_fp8(x: Tensor, scale: Tensor, spec: Any, group: Any) -> tuple[Tensor, Tensor]:
    """:func:`gather_seq` through FP8: ``(x', amax)`` with x' the gathered dequantized FP8 values
    and amax that of this rank's x (its observation).

    Each rank quantizes its slice with one scale shared by the group (``spec`` a per-tensor
    :class:`fp8ops.quantize.QuantSpec`), the FP8 bytes are all-gathered (a quarter of float32's
    bytes, half of bfloat16's) and dequantized. x' is made of FP8 values times 1/scale, so the
    op that consumes it with the same scale quantizes it back to the same FP8 bytes. dx is
    reduce-scattered in high precision."""
    return _GatherSeqFP8.apply(x, scale, spec, group)


# Inside enter_replicated() / exit_replicated() (a layer whose replicated parameters went through
# copy_to_tp_many), copy_to_tp leaves tensors as they are. A plain counter that torch.compile traces:
# the forward of one tensor-parallel layer runs on one thread (one process per rank).
_REPLICATED = [0]


def enter_replicated() -> None:
    _REPLICATED[0] += 1


def exit_replicated() -> None:
    _REPLICATED[0] -= 1


def copy_to_tp(x: Tensor | None, group: Any) -> Tensor | None:
    """x as it is; its gradient is summed over the group (a replicated input of a sharded op)."""
    if x is None or _REPLICATED[0]:
        return x
    return _CopyToTP.apply(x, group)


class _CopyToTPMany(torch.autograd.Function):
    @staticmethod
    def forward(group: Any, *xs: Tensor) -> tuple[Tensor, ...]:  # type: ignore[override]
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.group = inputs[0]
        ctx.meta = [(x.shape, x.dtype) for x in inputs[1:]]
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Any, ...]:  # type: ignore[override]
        with torch.no_grad():
            dev = next((g.device for g in grads if g is not None), None)
            if dev is None:
                return (None, *grads)
            flat = torch.cat([(g if g is not None else torch.zeros(shape, dtype=dtype, device=dev))
                              .reshape(-1).to(torch.float32) for g, (shape, dtype) in zip(grads, ctx.meta)])
            flat = _all_reduce(flat, ctx.group)
            out, i = [], 0
            for shape, dtype in ctx.meta:
                n = shape.numel()
                out.append(flat[i:i + n].view(shape).to(dtype))
                i += n
        return (None, *out)


def copy_to_tp_many(tensors: dict[str, Tensor], group: Any) -> dict[str, Tensor]:
    """:func:`copy_to_tp` of every tensor of ``tensors`` through one autograd node: their gradients
    are summed over the group in one float32 all-reduce, once the last of them is known."""
    if not tensors:
        return {}
    keys = list(tensors)
    outs = _CopyToTPMany.apply(group, *(tensors[k] for k in keys))
    return dict(zip(keys, outs))


def reduce_from_tp(x: Tensor, group: Any) -> Tensor:
    """The sum of x over the group; the gradient passes through."""
    return _ReduceFromTP.apply(x, group)


def gather_seq(x: Tensor, group: Any) -> Tensor:
    """The ranks' dim-0 slices of x concatenated in rank order; the gradient is reduce-scattered."""
    return _GatherSeq.apply(x, group)


def scatter_seq(x: Tensor, group: Any) -> Tensor:
    """This rank's dim-0 slice of the sum of x over the group; the gradient is all-gathered."""
    return _ScatterSeq.apply(x, group)


class TP(NamedTuple):
    """A checked tensor-parallel setting: the group, its size and this rank's index in it."""

    group: Any
    world: int
    rank: int
    sp: bool


def tp_config(where: str, tp_group: Any, parallel_mode: Any, sequence_parallel: Any, *,
              modes: tuple[str | None, ...] = (None,)) -> TP | None:
    """The :class:`TP` of an op's arguments, or None when ``tp_group`` is None (no parallelism).

    ``modes`` lists the ``parallel_mode`` values the op accepts with a ``tp_group`` (None: the op
    splits itself, as fused_ln_mlp does); without a group only None is accepted."""
    if tp_group is None and parallel_mode is None and sequence_parallel is False:
        return None  # the common case, first: no parallelism
    if not isinstance(sequence_parallel, bool):
        raise TypeError(f"{where}: sequence_parallel must be a bool, got {sequence_parallel!r}")
    if parallel_mode not in (None, *PARALLEL_MODES):
        raise ValueError(f"{where}: parallel_mode must be one of {[None, *PARALLEL_MODES]}, got {parallel_mode!r}")
    if tp_group is None:
        if parallel_mode is not None or sequence_parallel:
            raise ValueError(f"{where}: parallel_mode={parallel_mode!r} and sequence_parallel={sequence_parallel} "
                             f"need tp_group (a torch.distributed process group); pass tp_group, or leave both unset")
        return None
    if not dist.is_available() or not isinstance(tp_group, dist.ProcessGroup):
        raise TypeError(f"{where}: tp_group must be a torch.distributed.ProcessGroup (e.g. "
                        f"dist.group.WORLD or device_mesh.get_group('tp')), got {type(tp_group).__name__}")
    if parallel_mode not in modes:
        raise ValueError(f"{where}: with tp_group, parallel_mode must be one of {list(modes)}, got {parallel_mode!r}")
    return TP(tp_group, dist.get_world_size(tp_group), dist.get_rank(tp_group), sequence_parallel)


def check_divisible(where: str, what: str, n: int, world: int) -> int:
    """``n // world``; a ValueError naming ``what`` when the tensor-parallel size does not divide n."""
    if n % world != 0:
        raise ValueError(f"{where}: {what} ({n}) must be divisible by the tensor-parallel size ({world}); "
                         f"uneven splits are not supported")
    return n // world


def sequence_norm(x: Tensor, weight: Tensor, bias: Tensor | None, normalization: str, eps: float,
                  zero_centered_gamma: bool, group: Any, residual: Tensor | None = None) -> Any:
    """The norm in front of a column-parallel GEMM under sequence parallelism: on this rank's slice
    of the sequence, with the replicated weight and bias, whose gradients are summed over the group.
    With a residual (this rank's slice too): ``(norm(x + residual), x + residual)``, the sum written
    by the norm's kernel (and its gradient added into dx by the norm's backward)."""
    kw: dict[str, Any] = {"eps": eps, "zero_centered_gamma": zero_centered_gamma, "residual": residual}
    if normalization == "RMSNorm":
        out, _ = rms_norm(x, copy_to_tp(weight, group), None, **kw)
    else:
        out, _ = layer_norm(x, copy_to_tp(weight, group), copy_to_tp(bias, group), None, **kw)
    return out


def column_input(x: Tensor, tp: TP, where: str) -> Tensor:
    """The input of a column-parallel GEMM: x gathered along the sequence (SP), or x replicated."""
    if tp.sp:
        if x.dim() < 2:
            raise ValueError(f"{where}: with sequence_parallel, x must be (S/w, ..., K), got shape {tuple(x.shape)}")
        return gather_seq(x, tp.group)
    return copy_to_tp(x, tp.group)  # type: ignore[return-value]


def row_output(y: Tensor, bias: Tensor | None, tp: TP, where: str, fp8_grad: tuple[Any, ...] | None = None
               ) -> Tensor:
    """A row-parallel GEMM's partial output summed over the group (reduce-scattered along the
    sequence with SP; ``fp8_grad`` = (probe, g_scale, spec): its gradient all-gathered in FP8),
    plus the bias once."""
    if tp.sp:
        check_divisible(where, "the sequence length (dim 0 of x)", y.shape[0], tp.world)
        y = scatter_seq(y, tp.group) if fp8_grad is None else scatter_seq_fp8(y, *fp8_grad, tp.group)
    else:
        y = reduce_from_tp(y, tp.group)
    if bias is not None:
        # With SP each rank adds the bias to its slice: its gradient is a partial sum.
        b = copy_to_tp(bias, tp.group) if tp.sp else bias
        y = y + b.to(y.dtype)  # type: ignore[union-attr]
    return y



def transformer_split(cfg: Any, gated: bool) -> dict[str, tuple[int, tuple[int, ...]] | None]:
    """For each parameter of a transformer_layer config: (the dim that tensor parallelism splits,
    the full sizes of its segments, each split w ways), or None (replicated)."""
    d, hq, hkv, F = cfg.head_dim, cfg.num_attention_heads, cfg.num_kv_heads, cfg.ffn_hidden_size
    split = {"qkv": (0, (hq * d, hkv * d, hkv * d)), "q": (0, (hq * d,)), "k": (0, (hkv * d,)),
             "v": (0, (hkv * d,)), "fc1": (0, (F, F) if gated else (F,))}
    out: dict[str, tuple[int, tuple[int, ...]] | None] = {}
    for key in cfg.param_shapes():
        name, kind = key.split(".")
        if name in split:
            out[key] = split[name]
        elif kind == "weight" and name in ("proj", "fc2"):
            out[key] = (1, (hq * d,) if name == "proj" else (F,))
        else:
            out[key] = None
    return out


def transformer_shard_shapes(cfg: Any, world: int, gated: bool, where: str) -> dict[str, tuple[int, ...]]:
    """The parameter shapes of one rank's shard; a ValueError when ``world`` does not divide the
    query heads, the key/value heads or the MLP width. Plain Python (no config is built), so that
    torch.compile traces it."""
    check_divisible(where, "num_attention_heads", cfg.num_attention_heads, world)
    check_divisible(where, "the key/value heads (num_gqa_groups)", cfg.num_kv_heads, world)
    check_divisible(where, "ffn_hidden_size", cfg.ffn_hidden_size, world)
    shapes = dict(cfg.param_shapes())
    for key, spec in transformer_split(cfg, gated).items():
        if spec is not None:
            shape = list(shapes[key])
            shape[spec[0]] //= world
            shapes[key] = tuple(shape)
    return shapes
