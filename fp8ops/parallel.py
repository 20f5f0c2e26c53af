"""Tensor-parallel shards of :func:`fp8ops.transformer_layer`'s parameters and their inverse, and
the FP8 all-gather of a weight sharded along its rows (FSDP-style): :func:`all_gather_weight`.

Rank r of w holds (d = head dim, h_q query heads, h_kv key/value heads, F the MLP width)::

    qkv.weight  rows [q heads r·h_q/w .. | k heads r·h_kv/w .. | v heads r·h_kv/w ..]  column-parallel
    q/k/v       the same heads of the unfused weights (and biases)
    proj.weight columns of the same query heads                                    row-parallel
    fc1.weight  rows r·F/w .. (r+1)·F/w (gated: those rows of each half a and b)   column-parallel
    fc2.weight  columns r·F/w .. (r+1)·F/w                                         row-parallel
    norms, proj.bias, fc2.bias  replicated

Call ``transformer_layer(shard, x, state, ..., tp_group=group)`` with ``rank`` the rank in ``group``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from . import _parallel
from ._checks import check_float_tensor, check_recipe
from ._parallel import (
    _reduce_scatter,
    check_fp8_gather_recipe,
    fp8_all_gather_bytes,
    transformer_shard_shapes,
    transformer_split,
)
from .activation import GATED
from .fp8_linear import LinearState, WeightCache
from .quantize import Float8Value, QuantSpec
from .recipes import Recipe
from .state import ScalingState, validate_state
from .transformer_layer import TransformerConfig

__all__ = ["CommOptions", "all_gather_weight", "comm_options", "gather_transformer_params", "set_comm_options",
           "shard_transformer_params"]


class CommOptions(NamedTuple):
    """How the sequence-parallel linears overlap their collectives with their GEMMs (see
    :func:`set_comm_options`)."""

    pipelined_gemms: bool
    sm_carveout: int
    row_chunks: int


def _comm_now() -> CommOptions:
    return CommOptions(bool(_parallel.FUSED_SP_GEMMS[0]), int(_parallel.OVERLAP_SM_CARVEOUT[0]),
                       int(_parallel.ROW_FPROP_CHUNKS[0]))


def set_comm_options(*, pipelined_gemms: bool | None = None, sm_carveout: int | None = None,
                     row_chunks: int | None = None) -> CommOptions:
    """Set how the sequence-parallel FP8 linears overlap communication and GEMMs, for the calls
    that follow (read at each call; a setting left None keeps its value). Returns the previous
    options, which ``set_comm_options(**old._asdict())`` restores.

    Args:
        pipelined_gemms: run each all-gather with the GEMM that consumes it, and each row-parallel
            GEMM with its reduce-scatter, as torch's pipelined symmetric-memory ops where they
            apply (default True; docs/parallel.md says where). False: NCCL collectives.
        sm_carveout: SMs that a GEMM running while a collective of its op is in flight leaves free
            (cuBLAS's SM count target; default 0, every SM).
        row_chunks: the row-parallel forward GEMM in this many column chunks, each reduce-scattered
            while the next is computed, where the pipelined GEMMs do not apply (default 1).

    Eager mode and CUDA graph captures only: compiled calls use the functional collectives and
    every SM. Measured on two H100s: docs/benchmarks/parallel.md.

    Example:
        >>> import fp8ops
        >>> old = fp8ops.parallel.set_comm_options(pipelined_gemms=False)
        >>> old.pipelined_gemms, fp8ops.parallel.set_comm_options(**old._asdict()).pipelined_gemms
        (True, False)
    """
    where = "fp8ops.parallel.set_comm_options"
    if pipelined_gemms is not None and not isinstance(pipelined_gemms, bool):
        raise TypeError(f"{where}: pipelined_gemms must be a bool, got {pipelined_gemms!r}")
    for name, value, low in (("sm_carveout", sm_carveout, 0), ("row_chunks", row_chunks, 1)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < low):
            raise ValueError(f"{where}: {name} must be an int >= {low}, got {value!r}")
    old = _comm_now()
    if pipelined_gemms is not None:
        _parallel.FUSED_SP_GEMMS[0] = pipelined_gemms
    if sm_carveout is not None:
        _parallel.OVERLAP_SM_CARVEOUT[0] = sm_carveout
    if row_chunks is not None:
        _parallel.ROW_FPROP_CHUNKS[0] = row_chunks
    return old


@contextlib.contextmanager
def comm_options(*, pipelined_gemms: bool | None = None, sm_carveout: int | None = None,
                 row_chunks: int | None = None) -> Iterator[CommOptions]:
    """:func:`set_comm_options` for the calls inside the block (the previous options come back
    on exit, also on an exception); yields the options in force.

    Example:
        >>> import fp8ops
        >>> with fp8ops.parallel.comm_options(pipelined_gemms=False, row_chunks=2) as opts:
        ...     opts
        CommOptions(pipelined_gemms=False, sm_carveout=0, row_chunks=2)
    """
    old = set_comm_options(pipelined_gemms=pipelined_gemms, sm_carveout=sm_carveout, row_chunks=row_chunks)
    try:
        yield _comm_now()
    finally:
        set_comm_options(**old._asdict())


def _layout(cfg: TransformerConfig) -> dict[str, tuple[int, tuple[int, ...]] | None]:
    return transformer_split(cfg, cfg.activation in GATED)


def _check(where: str, config: object, world_size: object) -> TransformerConfig:
    if not isinstance(config, TransformerConfig):
        raise TypeError(f"{where}: config must be a fp8ops.TransformerConfig, got {type(config).__name__}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"{where}: world_size must be a positive int, got {world_size!r}")
    transformer_shard_shapes(config, world_size, False, where)  # raises on uneven splits
    return config


def _check_keys(where: str, name: str, d: object, shapes: dict[str, tuple[int, ...]]) -> Mapping[str, Tensor]:
    if not isinstance(d, Mapping):
        raise TypeError(f"{where}: {name} must be a dict[str, Tensor], got {type(d).__name__}")
    extra = [k for k in d if k not in shapes]
    if extra:
        raise ValueError(f"{where}: {name} has keys {extra} that the config does not have (expected a subset of "
                         f"{list(shapes)})")
    for k, t in d.items():
        if not isinstance(t, Tensor) or tuple(t.shape) != shapes[k]:
            got = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(f"{where}: {name}[{k!r}] must have shape {shapes[k]}, got {got}")
    return d


def shard_transformer_params(
    params: Mapping[str, Tensor],
    config: TransformerConfig,
    *,
    rank: int,
    world_size: int,
) -> dict[str, Tensor]:
    """This rank's tensor-parallel shard of a full :func:`fp8ops.transformer_layer` parameter dict.

    The shard is what ``transformer_layer(shard, x, state, config=config, ..., tp_group=group)``
    takes on rank ``rank`` of a group of ``world_size`` ranks (the layout is in this module's
    docstring): QKV and fc1 are split by output rows, the projection and fc2 by input columns,
    the norms and the row-parallel biases are replicated. The shard's tensors are slices of the
    given ones (views where one slice suffices, else new tensors); gradients flow back to
    ``params`` through them. Works as well on a dict of gradients (any subset of the keys).

    Args:
        params: the full parameter dict (``config.param_shapes()``), or a subset of it.
        config: the layer's :class:`fp8ops.TransformerConfig` (the full, unsharded one).
        rank: this rank's index in the tensor-parallel group, 0 <= rank < world_size.
        world_size: the size of the tensor-parallel group; it must divide the query heads, the
            key/value heads (``num_gqa_groups``) and ``ffn_hidden_size``.

    Returns:
        A new ``dict[str, Tensor]`` with the same keys.

    Raises:
        TypeError, ValueError: a bad config, rank or world size, keys or shapes that do not
            match the config, or a world size that does not divide the heads, the GQA groups or
            the MLP width.

    Example:
        >>> import fp8ops
        >>> cfg = fp8ops.TransformerConfig(hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
        ...                                num_gqa_groups=2)
        >>> params = fp8ops.init_transformer_params(cfg)
        >>> shards = [fp8ops.shard_transformer_params(params, cfg, rank=r, world_size=2) for r in range(2)]
        >>> tuple(shards[0]["qkv.weight"].shape), tuple(shards[0]["fc2.weight"].shape)
        ((32, 32), (32, 32))
        >>> full = fp8ops.gather_transformer_params(shards, cfg)
        >>> all(bool((full[k] == params[k]).all()) for k in params)
        True
    """
    where = "shard_transformer_params"
    cfg = _check(where, config, world_size)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"{where}: rank must be an int in [0, {world_size}), got {rank!r}")
    _check_keys(where, "params", params, cfg.param_shapes())
    layout = _layout(cfg)
    out: dict[str, Tensor] = {}
    for key, t in params.items():
        spec = layout[key]
        if spec is None:
            out[key] = t
            continue
        dim, sizes = spec
        pieces, start = [], 0
        for n in sizes:
            part = n // world_size
            pieces.append(t.narrow(dim, start + rank * part, part))
            start += n
        out[key] = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim)
    return out


def gather_transformer_params(
    shards: Sequence[Mapping[str, Tensor]],
    config: TransformerConfig,
) -> dict[str, Tensor]:
    """The full parameter dict from the shards of every rank: the inverse of
    :func:`shard_transformer_params`.

    Gathers parameters or their gradients (e.g. the shards' ``.grad`` collected with
    ``torch.distributed.all_gather_object``). Replicated entries (norms, ``proj.bias``,
    ``fc2.bias``) are taken from ``shards[0]``; under tensor parallelism their gradients are
    already equal on every rank.

    Args:
        shards: one dict per rank, in rank order (``len(shards)`` is the world size), each with
            the same keys (a subset of ``config.param_shapes()``) and the shard's shapes.
        config: the layer's full :class:`fp8ops.TransformerConfig`.

    Returns:
        A new ``dict[str, Tensor]`` with the full shapes of ``config.param_shapes()``.

    Raises:
        TypeError, ValueError: no shards, shards with different keys, or shapes that are not the
            shard shapes for ``len(shards)`` ranks.

    Example:
        >>> import fp8ops
        >>> cfg = fp8ops.TransformerConfig(hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
        ...                                activation="swiglu")
        >>> params = fp8ops.init_transformer_params(cfg)
        >>> shards = [fp8ops.shard_transformer_params(params, cfg, rank=r, world_size=4) for r in range(4)]
        >>> tuple(shards[1]["fc1.weight"].shape)            # 64 / 4 rows of each swiglu half
        (32, 32)
        >>> bool((fp8ops.gather_transformer_params(shards, cfg)["fc1.weight"] == params["fc1.weight"]).all())
        True
    """
    where = "gather_transformer_params"
    if isinstance(shards, Mapping) or not isinstance(shards, Sequence) or len(shards) == 0:
        raise TypeError(f"{where}: shards must be a non-empty list of dicts, one per rank, got {type(shards).__name__}")
    world = len(shards)
    cfg = _check(where, config, world)
    local_shapes = transformer_shard_shapes(cfg, world, cfg.activation in GATED, where)
    keys = list(_check_keys(where, "shards[0]", shards[0], local_shapes))
    for r, s in enumerate(shards):
        _check_keys(where, f"shards[{r}]", s, local_shapes)
        if set(s) != set(keys):
            raise ValueError(f"{where}: shards[{r}] has keys {sorted(s)}, shards[0] has {sorted(keys)}")
    layout = _layout(cfg)
    out: dict[str, Tensor] = {}
    for key in keys:
        spec = layout[key]
        if spec is None:
            out[key] = shards[0][key]
            continue
        dim, sizes = spec
        segments = []
        for i, n in enumerate(sizes):
            part, start = n // world, sum(sizes[:i]) // world
            segments += [s[key].narrow(dim, start, part) for s in shards]
        out[key] = torch.cat(segments, dim)
    return out


class _GatherWeightFP8(torch.autograd.Function):
    """Forward: quantize the row shard with the group's scale, all-gather the FP8 bytes, write the
    transposed copy; return a zero-stride stand-in for the full weight (its gradient, dW, is what
    fp8_linear's wgrad GEMM writes) and the FP8 operands. Backward: reduce-scatter dW."""

    @staticmethod
    def forward(  # type: ignore[override]
        shard: Tensor, scale: Tensor, spec: QuantSpec, group: Any, average: bool
    ) -> tuple[Tensor, ...]:
        # every rank quantizes its rows with the group's scale, as the full weight would be
        full, inv, amax = fp8_all_gather_bytes(shard.contiguous(), scale, spec, group)  # (N, K) FP8 bytes
        full_t = torch.ops.fp8ops.transpose_bytes(full)  # (K, N): the dgrad GEMM's K-major operand
        N, K = full.shape
        stand_in = torch.zeros((), dtype=shard.dtype, device=shard.device).expand(N, K)
        return stand_in, full.view(spec.dtype), full_t.view(spec.dtype), inv, amax

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.group, ctx.average = inputs[3], inputs[4]
        ctx.mark_non_differentiable(*output[1:])
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx: Any, dw: Tensor | None, *_: Any) -> tuple[Any, ...]:  # type: ignore[override]
        if dw is None:
            return None, None, None, None, None
        with torch.no_grad():
            g = _reduce_scatter(dw, ctx.group)  # (N/w, K): this rank's rows of the summed dW
            if ctx.average:
                g = g / dist.get_world_size(ctx.group)
        return g, None, None, None, None


def all_gather_weight(
    shard: Tensor,
    state: ScalingState | LinearState,
    *,
    recipe: Recipe,
    group: Any,
    average: bool = True,
) -> tuple[WeightCache, ScalingState | LinearState]:
    """All-gather a row-sharded weight in FP8, as a :class:`fp8ops.WeightCache` for
    :func:`fp8ops.fp8_linear` (FSDP-style sharding with FP8 communication).

    Each rank holds rows ``r·N/w .. (r+1)·N/w`` of the (N, K) weight (``W.chunk(w, dim=0)[r]``, the
    way FSDP2 shards dim 0). The shard is quantized with one scale for the whole group, the FP8
    bytes are all-gathered (half of bfloat16's bytes, a quarter of float32's) and the transposed
    FP8 copy for the dgrad GEMM is written from them: no high-precision copy of the full weight is
    made. The cache's ``weight`` is a zero-stride stand-in of shape (N, K): pass it as
    ``fp8_linear``'s ``weight`` with ``weight_cache=cache``; the (N, K) weight gradient that
    ``fp8_linear`` computes is reduce-scattered back to the shard (averaged over the group by
    default, as DDP and FSDP2 average).

    The scale: a calibrated delayed state's scale, which ``fp8ops.update(..., group=group)`` keeps
    identical on every rank (it max-reduces the ranks' observations, here the amax of each shard,
    so the update sees the full weight's amax); with current scaling or an uncalibrated state, the
    scale of the group's amax (one all-reduce of a scalar). Either way the gathered FP8 weight is
    the one ``quantize_weight`` makes from the full weight.

    Args:
        shard: (N/w, K) float32, bfloat16 or float16; this rank's rows. Usually a parameter.
        state: the weight's :class:`ScalingState` (``linear_state.weight``), or the whole
            :class:`LinearState`.
        recipe: a per-tensor recipe (delayed or current scaling) with FP8 fprop and dgrad GEMMs
            (the cache replaces the high-precision weight in both).
        group: the ``torch.distributed`` process group the weight is sharded over.
        average: divide the reduce-scattered gradient by the group size (default True).

    Returns:
        ``(cache, new_state)``: the :class:`WeightCache` of the full weight, and the state (same
        type as given) with the amax of this rank's shard observed.

    Raises:
        TypeError, ValueError: a bad shard, state, recipe or group (the message names it).

    Example:
        >>> import os, tempfile, torch, torch.distributed as dist, fp8ops
        >>> f = os.path.join(tempfile.mkdtemp(), "init")
        >>> dist.init_process_group("gloo", init_method=f"file://{f}", rank=0, world_size=1)
        >>> r = fp8ops.DelayedScaling()
        >>> st = fp8ops.LinearState.init(r)
        >>> shard = torch.randn(32, 16, requires_grad=True)       # world size 1: the whole weight
        >>> cache, st = fp8ops.all_gather_weight(shard, st, recipe=r, group=dist.group.WORLD)
        >>> x = torch.randn(4, 16)
        >>> y, st = fp8ops.fp8_linear(x, cache.weight, None, st, recipe=r, weight_cache=cache)
        >>> y.sum().backward()
        >>> shard.grad.shape, cache.value.data.dtype
        (torch.Size([32, 16]), torch.float8_e4m3fn)
        >>> dist.destroy_process_group()
    """
    where = "all_gather_weight"
    check_float_tensor(shard, "shard", where)
    check_recipe(recipe, where)
    if shard.dim() != 2:
        raise ValueError(f"{where}: shard must be 2-D (N/w, K), this rank's rows of the weight, got shape "
                         f"{tuple(shard.shape)}")
    check_fp8_gather_recipe(recipe, where)
    if not dist.is_available() or not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"{where}: group must be a torch.distributed.ProcessGroup (e.g. dist.group.WORLD), "
                        f"got {type(group).__name__}")
    if not isinstance(average, bool):
        raise TypeError(f"{where}: average must be a bool, got {average!r}")
    ws = state.weight if isinstance(state, LinearState) else state
    validate_state(ws, where=f"{where}: state", device=shard.device, recipe=recipe)
    spec = QuantSpec.of(recipe, "forward", ws.calibrated)
    stand_in, data, data_t, inv, amax = _GatherWeightFP8.apply(shard, ws.scale, spec, group, average)
    cache = WeightCache(Float8Value(data, inv, data_t), None, ws.scale, recipe, stand_in)
    new_ws = ws.observe(amax)
    return cache, (state.replace(weight=new_ws) if isinstance(state, LinearState) else new_ws)
