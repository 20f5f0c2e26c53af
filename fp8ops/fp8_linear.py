"""fp8_linear: ``y = x @ W.T + b`` with FP8 GEMMs forward and backward, and explicit scaling state.

Three GEMMs (HYBRID format: E4M3 forward tensors, E5M2 gradients)::

    fprop  y  = x  . W^T     xq (M, K)  x  wq   (N, K)       E4M3 x E4M3
    dgrad  dx = dy . W       dyq (M, N) x  wq^T (K, N)       E5M2 x E4M3
    wgrad  dW = dy^T . x     dyq^T (N, M) x xq^T (K, M)      E5M2 x E4M3

Every operand is K-major (row-major with the contraction dimension last), the layout Hopper's FP8
tensor cores need; the transposed copies ``xq^T``, ``wq^T`` and ``dyq^T`` come from the same fused
quantize pass that writes ``xq``, ``wq`` and ``dyq``.
"""

from __future__ import annotations

import inspect
from typing import Any, ClassVar, NamedTuple

import attrs
import torch
from torch import Tensor
from torch.utils import _pytree as pytree

from ._parallel import (
    PARALLEL_MODES,
    all_gather_async,
    all_gather_scaled_mm,
    check_divisible,
    column_input,
    copy_to_tp,
    fp8_group_quantize,
    fused_sp_gemms,
    gather_seq_fp8,
    overlap_carveout,
    overlap_sm_carveout,
    probe_sink,
    reduce_scatter,
    reduce_scatter_async,
    row_fprop_chunks,
    row_output,
    scaled_mm_reduce_scatter,
    tp_config,
    wait,
)
from ._glue import apply, autocast_dtype, autocast_inputs, refuse_compiled_transform
from ._checks import check_device, check_float_tensor, check_probe, check_recipe, check_state_recipe
from .kernels._library import OPS
from ._operands import (
    bias_grad,
    cached_dgrad_operand,
    dgrad_weight,
    gemm_dgrad,
    gemm_fprop,
    gemm_wgrad,
    hp_linear,
    or_empty,
    quantize_grad_db,
    quantize_pair,
    quantize_weight_operands,
)
from .formats import Role
from .quantize import Float8Value, QuantSpec
from .recipes import GemmSpec, Recipe
from .state import OpState, ScalingState, validate_state

__all__ = ["LinearState", "WeightCache", "fp8_linear", "quantize_weight"]


class LinearState(OpState):
    """State of one :func:`fp8_linear` call site: ``input``, ``weight`` (forward), ``grad_output``.

    Build it with ``LinearState.init(recipe, device=...)``; its probe is a 0-d float32 zero.

    Example:
        >>> import fp8ops
        >>> st = fp8ops.LinearState.init(fp8ops.DelayedScaling())
        >>> [st.input.role, st.weight.role, st.grad_output.role]
        ['forward', 'forward', 'backward']
    """

    ROLES: ClassVar[dict[str, Role]] = {"input": "forward", "weight": "forward", "grad_output": "backward"}
    PROBE_ROLES: ClassVar[tuple[str, ...]] = ("grad_output",)
    input: ScalingState
    weight: ScalingState
    grad_output: ScalingState


@attrs.frozen(init=False, eq=False, repr=False)
class WeightCache:
    """An FP8 weight quantized once per optimizer step, for every micro-batch of that step.

    Built by :func:`quantize_weight`; holds the FP8 weight (N, K), its transposed copy (K, N) for
    the dgrad GEMM, its inverse scale, and what it was built from (the weight tensor itself, the
    recipe and the weight state's scale tensor), so that :func:`fp8_linear` refuses a cache from
    another weight, state or recipe. ``weight`` is a reference to the source tensor, not a copy.
    A cache whose ``value.data_t`` is None (one scale per tensor only) has its transposed copy
    written in the backward pass, from the FP8 bytes as they are then: the weight all-gathered in
    FP8 under FSDP2, whose bytes are gathered again for the backward pass, is built so.
    """

    value: Float8Value
    inv_scale_t: Tensor | None
    scale: Tensor
    recipe: Recipe
    weight: Tensor

    def __init__(self, value: Float8Value, inv_scale_t: Tensor | None, scale: Tensor, recipe: Recipe,
                 weight: Tensor) -> None:
        object.__setattr__(self, "value", value)
        object.__setattr__(self, "inv_scale_t", inv_scale_t)  # row-wise: (K, 1) scales of data_t
        object.__setattr__(self, "scale", scale)
        object.__setattr__(self, "recipe", recipe)
        object.__setattr__(self, "weight", weight)  # the source weight (a pytree child, not a copy)

    def __repr__(self) -> str:
        return f"WeightCache({self.value!r}, recipe={type(self.recipe).__name__})"


pytree.register_pytree_node(
    WeightCache,
    lambda c: ([c.value, c.inv_scale_t, c.weight, c.scale], c.recipe),
    lambda ch, recipe: WeightCache(ch[0], ch[1], ch[3], recipe, ch[2]),
    serialized_type_name="fp8ops.WeightCache",
    flatten_with_keys_fn=lambda c: (
        [(pytree.GetAttrKey(n), getattr(c, n)) for n in ("value", "inv_scale_t", "weight", "scale")],
        c.recipe,
    ),
)


def _check_cache_transpose(cache: WeightCache, where: str, name: str) -> None:
    """A cache without its transposed copy (the dgrad operand transposed in the backward pass)
    must have one scale per tensor: the transpose of row-wise scaled bytes needs its own scales."""
    if cache.value.data_t is None and (cache.inv_scale_t is not None or cache.value.inv_scale.numel() != 1):
        raise ValueError(f"{where}: {name} has no transposed copy (value.data_t is None) but row-wise scales "
                         f"(inv_scale {tuple(cache.value.inv_scale.shape)}); build it with quantize_weight, "
                         f"which writes the transposed copy with its own scales")


def _unwrap(t: Tensor) -> Tensor:
    """``t`` with its torch.func wrappers (grad, vmap levels) removed."""
    functorch = torch._C._functorch
    while functorch.is_functorch_wrapped_tensor(t):
        t = functorch.get_unwrapped(t)
    return t


def _same_tensor(a: Tensor, b: Tensor) -> bool:
    """Identity of two tensors, looking through torch.func wrappers in eager mode."""
    if a is b:
        return True
    if torch.compiler.is_compiling():
        return False
    return _unwrap(a) is _unwrap(b)


def _same_weight(a: Tensor, b: Tensor) -> bool:
    """Whether ``b`` is the weight ``a`` (eager mode): the same tensor through torch.func wrappers,
    or an alias of it (``a.detach()``) viewing the same memory with the same dtype and layout."""
    if _same_tensor(a, b):
        return True
    a, b = _unwrap(a), _unwrap(b)
    if (a.device != b.device or a.dtype != b.dtype or a.shape != b.shape or a.stride() != b.stride()
            or a.storage_offset() != b.storage_offset()):
        return False
    try:
        ptr = a.untyped_storage().data_ptr()
        return ptr != 0 and ptr == b.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):  # tensor subclasses without a storage
        return False


class _Cfg(NamedTuple):
    """Static configuration of one fp8_linear call (plain constants)."""

    x_spec: QuantSpec
    w_spec: QuantSpec
    g_spec: QuantSpec
    fprop: GemmSpec
    dgrad: GemmSpec
    wgrad: GemmSpec
    has_probe: bool
    need_dx: bool
    need_dw: bool
    need_db: bool
    wgrad_dtype: torch.dtype
    use_cache: bool
    # Sequence parallelism fused into the op (None: x and y are whole). "column": x is this rank's
    # (M/w, K) slice, quantized with the group's scale and all-gathered as FP8 bytes that feed the
    # GEMMs as they are; dx is reduce-scattered. "row": y is reduce-scattered to (M/w, N); dy (M/w, N)
    # is quantized with the group's scale and all-gathered as FP8 bytes for dgrad and wgrad.
    sp: str | None = None
    # "row": the forward GEMM in this many column chunks, each reduce-scattered while the next one
    # is computed (_parallel.ROW_FPROP_CHUNKS).
    row_chunks: int = 1
    # SMs the GEMMs that overlap a collective of this op leave free (_parallel.OVERLAP_SM_CARVEOUT).
    carveout: int = 0
    # The collectives and the GEMMs next to them as the fused, pipelined ops (_parallel.FUSED_SP_GEMMS):
    # "column": the all-gather of x and fprop; "row": fprop and its reduce-scatter, dy's all-gather and dgrad.
    fused: bool = False


def _gathered_fp8(full: Tensor, dtype: torch.dtype, need_t: bool) -> tuple[Tensor, Tensor | None]:
    """(the ranks' FP8 slices gathered along dim 0 as ``dtype``, its K-major transpose or None);
    ``full``: an all-gather's result, in flight or done."""
    full = wait(full).view(dtype)  # (M, C)
    return full, (OPS.transpose_bytes(full) if need_t else None)


def _row_fprop(xq: Tensor | None, x_inv: Tensor | None, x: Tensor, wq: Tensor | None, w_inv: Tensor | None,
               w: Tensor, cfg: _Cfg, group: Any) -> Tensor:
    """A row-parallel forward GEMM (no bias) reduce-scattered along dim 0: (M/w, N). In
    ``cfg.row_chunks`` column chunks, each chunk's reduce-scatter runs while the next chunk's GEMM
    does (that GEMM leaving ``cfg.carveout`` SMs to it); the same sums either way (a column of y is
    one dot product over this rank's K)."""
    if cfg.fused:
        return scaled_mm_reduce_scatter(xq, x_inv, wq, w_inv, x.dtype, cfg.fprop.fast_accum, group)
    if cfg.row_chunks == 1:
        return reduce_scatter(gemm_fprop(xq, x_inv, x, wq, w_inv, w, None, cfg.fprop, x.dtype), group)
    n = w.shape[0] // cfg.row_chunks
    parts = []
    for c in range(cfg.row_chunks):  # the chunks after the first run while a reduce-scatter is in flight
        with overlap_carveout(cfg.carveout if c else 0):
            y = gemm_fprop(xq, x_inv, x, None if wq is None else wq[c * n:(c + 1) * n], w_inv,
                           w[c * n:(c + 1) * n], None, cfg.fprop, x.dtype)
        parts.append(reduce_scatter_async(y, group))
    return torch.cat([wait(p) for p in parts], dim=1)


class _FP8Linear(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(  # type: ignore[override]
        x: Tensor,  # (M, K)
        w: Tensor,  # (N, K)
        bias: Tensor | None,  # (N,)
        x_scale: Tensor,
        w_scale: Tensor,
        g_scale: Tensor,
        probe: Tensor | None,
        c_data: Tensor | None,  # (N, K) cached FP8 weight
        c_data_t: Tensor | None,  # (K, N)
        c_inv: Tensor | None,
        c_inv_t: Tensor | None,  # row-wise (K, 1) scales of c_data_t, else None
        cfg: _Cfg,
        group: Any = None,  # the tensor-parallel group when cfg.sp
    ) -> tuple[Tensor, ...]:

        fp8_fwd = cfg.fprop.precision == "fp8"
        need_xt = cfg.need_dw and cfg.wgrad.precision == "fp8"
        need_wt = cfg.need_dx and cfg.dgrad.precision == "fp8" and not cfg.use_cache
        # Step 1: quantize x (and its transpose for wgrad) in one pass; column-parallel SP: this
        # rank's slice with the group's scale, the FP8 bytes gathered (all three GEMMs are FP8).
        if cfg.sp == "column":
            data, x_inv, x_amax = fp8_group_quantize(x, x_scale, cfg.x_spec, group)
            xq = data if cfg.fused else all_gather_async(data, group)  # in flight while the weight is quantized
            x_inv_t = x_inv
        elif fp8_fwd or need_xt:
            xq, x_inv, xq_t, x_inv_t, x_amax = quantize_pair(x, x_scale, cfg.x_spec, need_xt)
        else:
            xq = x_inv = xq_t = x_inv_t = None
            x_amax = OPS.amax(x)
        # Step 2: the weight, from the cache or quantized now (with its transpose for dgrad).
        if cfg.use_cache:
            # the cached operands are saved from the inputs in setup_context
            wq, w_inv, wq_t, w_inv_t = c_data, c_inv, None, None
            w_amax = torch.zeros((), dtype=torch.float32, device=x.device)
        else:
            wq, w_inv, wq_t, w_inv_t, w_amax = quantize_weight_operands(w, w_scale, cfg.w_spec, fp8_fwd, need_wt)
        # Step 3: the forward GEMM; row-parallel SP: the partial sums reduce-scattered to this rank's
        # rows; column-parallel SP: on the gathered rows (fused: this rank's rows while the others arrive).
        if cfg.sp == "column" and cfg.fused:
            full, y = all_gather_scaled_mm(xq.view(cfg.x_spec.dtype), x_inv, wq, w_inv, bias, x.dtype,
                                           cfg.fprop.fast_accum, group)
            xq, xq_t = _gathered_fp8(full, cfg.x_spec.dtype, need_xt)
        elif cfg.sp == "row":
            y = _row_fprop(xq, x_inv, x, wq, w_inv, w, cfg, group)
        else:
            if cfg.sp == "column":
                xq, xq_t = _gathered_fp8(xq, cfg.x_spec.dtype, need_xt)
            y = gemm_fprop(xq, x_inv, x, wq, w_inv, w, bias, cfg.fprop, x.dtype)
        if not need_xt:
            xq_t = x_inv_t = None
        if not need_wt:
            wq_t = w_inv_t = None
        return (y, x_amax, w_amax, or_empty(xq_t, x), or_empty(x_inv_t, x), or_empty(wq_t, x),
                or_empty(w_inv_t, x))

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        x, w, bias, _, _, g_scale, _, c_data, c_data_t, c_inv, c_inv_t, cfg, *rest = inputs
        ctx.group = rest[0] if rest else None
        ctx.mark_non_differentiable(*output[1:])
        ctx.set_materialize_grads(False)  # no zero gradients for the outputs that never get one
        _, _, _, xq_t, x_inv_t, wq_t, w_inv_t = output
        ctx.w_t_later = False
        if cfg.use_cache:
            wq_t, w_inv_t, ctx.w_t_later = cached_dgrad_operand(c_data, c_data_t, c_inv, c_inv_t)
        keep_x = cfg.need_dw and cfg.wgrad.precision != "fp8"
        keep_w = cfg.need_dx and cfg.dgrad.precision != "fp8"
        ctx.save_for_backward(
            xq_t, x_inv_t, wq_t, w_inv_t, g_scale, x if keep_x else None, w if keep_w else None
        )
        ctx.cfg = cfg
        ctx.x_dtype = x.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype

    @staticmethod
    def backward(ctx: Any, dy: Tensor, *_: Any) -> tuple[Any, ...]:  # type: ignore[override]
        xq_t, x_inv_t, wq_t, w_inv_t, g_scale, x, w = ctx.saved_tensors
        cfg: _Cfg = ctx.cfg
        with torch.no_grad():
            dy = dy.contiguous()
            fp8_dgrad = cfg.need_dx and cfg.dgrad.precision == "fp8"
            fp8_wgrad = cfg.need_dw and cfg.wgrad.precision == "fp8"
            wq_t = dgrad_weight(wq_t, ctx.w_t_later and fp8_dgrad)
            # Step 1: quantize dy (and its transpose for wgrad) in one pass; its amax is the observation.
            # Row-parallel SP: this rank's (M/w, N) slice with the group's scale, the FP8 bytes gathered.
            dx = dw = db = None
            if cfg.sp == "row":
                data, dy_inv, dy_amax = fp8_group_quantize(dy, g_scale, cfg.g_spec, ctx.group)
                if cfg.fused and cfg.need_dx:  # the gather and dgrad in one pipelined op
                    full, dx = all_gather_scaled_mm(data.view(cfg.g_spec.dtype), dy_inv, wq_t, w_inv_t, None,
                                                    ctx.x_dtype, cfg.dgrad.fast_accum, ctx.group)
                    dyq, dyq_t = _gathered_fp8(full, cfg.g_spec.dtype, fp8_wgrad)
                else:
                    dyq, dyq_t = _gathered_fp8(all_gather_async(data, ctx.group), cfg.g_spec.dtype, fp8_wgrad)
                dy_inv_t = dy_inv
            else:  # the bias gradient from the same pass where it writes dy's transposed copy
                dyq, dy_inv, dyq_t, dy_inv_t, dy_amax, db = quantize_grad_db(
                    dy, g_scale, cfg.g_spec, cfg.has_probe, fp8_dgrad, fp8_wgrad, cfg.need_db,
                    ctx.bias_dtype or torch.float32,
                )
            # Step 2: dgrad, then (column-parallel SP) its reduce-scatter in flight while wgrad runs.
            if cfg.need_dx and dx is None:
                dx = gemm_dgrad(dyq, dy_inv, dy, wq_t, w_inv_t, w, cfg.dgrad, ctx.x_dtype)
                if cfg.sp == "column":
                    dx = reduce_scatter_async(dx, ctx.group)
            if cfg.need_dw:
                with overlap_carveout(cfg.carveout if cfg.sp == "column" and dx is not None else 0):
                    dw = gemm_wgrad(dyq_t, dy_inv_t, dy, xq_t, x_inv_t, x, cfg.wgrad, cfg.wgrad_dtype)
            if cfg.need_db and db is None:  # row-parallel SP: dy was gathered, not quantized here
                db = bias_grad(dy, ctx.bias_dtype)
            if cfg.sp == "column" and dx is not None:
                dx = wait(dx)
        probe_grad = dy_amax if cfg.has_probe else None
        return dx, dw, db, None, None, None, probe_grad, None, None, None, None, None, None


# Under torch.compile and torch.func, autograd.Function.apply binds the arguments with
# inspect.signature(forward) on every call; a stored signature makes that lookup immediate (eager
# calls skip the binding: _glue.apply).
_FP8Linear.forward.__signature__ = inspect.signature(_FP8Linear.forward)  # type: ignore[attr-defined]


def quantize_weight(
    weight: Tensor,
    state: ScalingState | LinearState,
    *,
    recipe: Recipe,
) -> tuple[WeightCache, Any]:
    """Quantize a weight once per optimizer step, for :func:`fp8_linear`'s ``weight_cache``.

    Writes the FP8 weight (N, K) and its transposed copy (K, N) in one pass and records amax(W).

    Args:
        weight: (N, K) float32, bfloat16 or float16.
        state: the weight's :class:`ScalingState` (``linear_state.weight``), or the whole
            :class:`LinearState`.
        recipe: the recipe the state was built with.

    Returns:
        ``(cache, new_state)``: a :class:`WeightCache`, and the state (same type as given) with
        amax(W) recorded. Pass ``new_state`` on (it holds the observation) and the cache to every
        ``fp8_linear`` call of this step, with this same ``weight`` tensor (the cache keeps a
        reference to it and :func:`fp8_linear` refuses another one).

    Example:
        >>> import torch, fp8ops
        >>> r = fp8ops.DelayedScaling()
        >>> st = fp8ops.LinearState.init(r)
        >>> w = torch.randn(32, 16)
        >>> qw, st = fp8ops.quantize_weight(w, st, recipe=r)
        >>> qw.value.data.shape, qw.value.data_t.shape
        (torch.Size([32, 16]), torch.Size([16, 32]))
    """
    where = "quantize_weight"
    check_float_tensor(weight, "weight", where)
    check_recipe(recipe, where)
    if weight.dim() != 2:
        raise ValueError(f"{where}: weight must be 2-D (N, K), got shape {tuple(weight.shape)}")
    ws = state.weight if isinstance(state, LinearState) else state
    validate_state(ws, where=f"{where}: state", device=weight.device, recipe=recipe)
    spec = QuantSpec.of(recipe, "forward", ws.calibrated)
    q, inv, q_t, inv_t, amax = quantize_pair(weight.detach(), ws.scale, spec, True)
    cache = WeightCache(Float8Value(q, inv, q_t), inv_t if spec.mode == "rowwise" else None, ws.scale, recipe, weight)
    new_ws = ws._observe_amax(amax)
    return cache, (state.replace(weight=new_ws) if isinstance(state, LinearState) else new_ws)


def fp8_linear(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    state: LinearState | None,
    *,
    recipe: Recipe | None,
    grad_probe: Tensor | None = None,
    weight_cache: WeightCache | None = None,
    wgrad_dtype: torch.dtype | None = None,
    tp_group: Any = None,
    parallel_mode: str | None = None,
    sequence_parallel: bool = False,
) -> tuple[Tensor, LinearState | None]:
    """FP8 linear layer ``y = x @ weight.T + bias`` with FP8 GEMMs in forward and backward.

    Math::

        y  = dq(q(x) . q(W)^T) + b                       fprop  (E4M3 x E4M3 under HYBRID)
        dx = dq(q(dy) . q(W))                            dgrad  (E5M2 x E4M3)
        dW = dq(q(dy)^T . q(x))                          wgrad  (E5M2 x E4M3)
        db = sum_rows(dy);   grad of grad_probe = amax(dy)

    Each GEMM's precision, accumulation mode and backend come from ``recipe.fprop``,
    ``recipe.dgrad`` and ``recipe.wgrad`` (:class:`GemmSpec`).

    With ``state=None`` and ``recipe=None`` there is no FP8: ``y`` is
    ``torch.nn.functional.linear(x, weight.to(x.dtype), bias.to(x.dtype))`` and the new state is
    None (as in :func:`fp8ops.layernorm_linear` and :func:`fp8ops.fused_ln_mlp`). With K = 0
    nothing is quantized or observed: ``y`` is the bias broadcast to (..., N) (zeros without one),
    as ``torch.nn.functional.linear`` gives, and the state comes back unchanged.

    Inside ``torch.autocast`` it computes as ``torch.nn.functional.linear`` does there: x, weight
    and bias are cast to the autocast dtype (outside the autograd Function, so their gradients
    reach them in their own dtype) and y has the autocast dtype; with FP8 the cast tensors are
    quantized. A ``weight_cache`` is used as built (the weight is not cast).

    Args:
        x: (..., K) float32, bfloat16 or float16; y has the same dtype (the autocast dtype inside
            ``torch.autocast``).
        weight: (N, K) float32, bfloat16 or float16, on x's device. Its gradient has ``wgrad_dtype``.
        bias: (N,) on x's device, or None.
        state: the :class:`LinearState` of this call site, or None together with ``recipe=None``
            for no FP8.
        recipe: the scaling recipe the state was built with, or None (no FP8).
        grad_probe: a 0-d float32 zero on x's device whose gradient becomes amax(dy) (see
            :func:`fp8ops.make_probes`); without one, dy is quantized with current scaling. Only
            with FP8.
        weight_cache: a :class:`WeightCache` from :func:`quantize_weight` of this ``weight`` for
            this step; the weight is then not quantized again (its gradient still flows to
            ``weight``). Only with FP8.
        wgrad_dtype: dtype the wgrad GEMM writes; default ``weight.dtype``. To accumulate FP32
            weight gradients, differentiate FP32 (master) weights: they are quantized directly
            and the wgrad GEMM writes FP32, with no separate cast.
        tp_group: a ``torch.distributed`` process group for tensor parallelism, or None.
        parallel_mode: with ``tp_group``, ``"column"`` (``weight`` is this rank's (N/w, K) row
            shard, ``bias`` its (N/w,) shard, y the last-dim shard) or ``"row"`` (``weight`` is
            the (N, K/w) column shard, x the last-dim shard, ``bias`` the full (N,); y is summed
            over the group and the bias added once).
        sequence_parallel: with ``tp_group``, x of a column-parallel call and y of a row-parallel
            call are this rank's slice of dim 0 (the sequence): the column-parallel x is
            all-gathered before the GEMM (dx reduce-scattered), the row-parallel y reduce-scattered
            after it (dy all-gathered). With a per-tensor FP8 recipe both all-gathers move FP8
            bytes, quantized with one scale for the group. The state observes this rank's amaxes;
            ``fp8ops.update(..., group=tp_group)`` makes the states of the group identical. See
            ``docs/parallel.md``.

    Returns:
        ``(y, new_state)``: y (..., N); ``new_state`` with amax(x) and amax(W) max-merged into
        the pending observations (amax(W) is recorded by :func:`quantize_weight` when a cache is
        used); None without FP8. The input state is not modified.

    Raises:
        TypeError, ValueError: bad input (the message names the argument and the fix).

    Example:
        >>> import torch, fp8ops
        >>> r = fp8ops.DelayedScaling()
        >>> st = fp8ops.LinearState.init(r)
        >>> x = torch.randn(4, 3, 32, requires_grad=True)
        >>> w = torch.randn(48, 32, requires_grad=True)
        >>> probe = torch.zeros((), requires_grad=True)
        >>> y, st = fp8ops.fp8_linear(x, w, None, st, recipe=r, grad_probe=probe)
        >>> y.shape
        torch.Size([4, 3, 48])
        >>> y.sum().backward()
        >>> st = fp8ops.update(st, recipe=r, grad_amax=probe.grad)
        >>> bool(st.grad_output.scale == 57344.0)  # amax(dy) = 1
        True

    References:
        Micikevicius et al., "FP8 Formats for Deep Learning" (2022); NVIDIA Transformer Engine.
    """
    where = "fp8_linear"
    check_float_tensor(x, "x", where)
    check_float_tensor(weight, "weight", where)
    tp = tp_config(where, tp_group, parallel_mode, sequence_parallel, modes=PARALLEL_MODES)
    if tp is not None:
        kw = {"recipe": recipe, "grad_probe": grad_probe, "weight_cache": weight_cache, "wgrad_dtype": wgrad_dtype}
        fp8_comm = tp.sp and check_state_recipe(state, recipe, LinearState, x, where) and recipe.mode != "rowwise"
        if fp8_comm and _fused_sp(recipe, x):
            # The collectives inside the op: FP8 bytes straight into the GEMMs (no dequantized copy),
            # dx's reduce-scatter overlapping the wgrad GEMM.
            if parallel_mode == "row":
                check_divisible(where, "the sequence length (dim 0 of x)", x.shape[0], tp.world)
                if bias is not None:
                    check_float_tensor(bias, "bias", where)
                    if tuple(bias.shape) != (weight.shape[0],):
                        raise ValueError(f"{where}: bias must have shape (N,) = ({weight.shape[0]},), "
                                         f"got {tuple(bias.shape)}")
                    check_device(bias, "bias", x, where)
                y, new_state = _fp8_linear(x, weight, None, state, recipe, grad_probe, weight_cache, wgrad_dtype,
                                           where, ("row", tp.group, tp.world))
                if bias is not None:
                    y = y + copy_to_tp(bias, tp.group).to(y.dtype)  # type: ignore[union-attr]
                return y, new_state
            if x.dim() < 2:
                raise ValueError(f"{where}: with sequence_parallel, x must be (S/w, ..., K), got shape {tuple(x.shape)}")
            return _fp8_linear(x, weight, bias, state, recipe, grad_probe, weight_cache, wgrad_dtype, where,
                               ("column", tp.group, tp.world))
        if parallel_mode == "column":
            if fp8_comm:
                # FP8 all-gather: x is quantized on the slice with the group's scale; the op quantizes
                # the gathered values back to the same bytes. The state observes amax of the slice.
                assert state is not None and recipe is not None
                spec = QuantSpec.of(recipe, "forward", state.input.calibrated)
                xg, amax = gather_seq_fp8(x, state.input.scale, spec, tp.group)
                y, new_state = fp8_linear(xg, weight, bias, state, **kw)
                return y, new_state.replace(input=state.input._observe_amax(amax))  # type: ignore[union-attr]
            return fp8_linear(column_input(x, tp, where), weight, bias, state, **kw)
        fp8_grad = None
        if fp8_comm:
            # FP8 all-gather of dy in the backward: the true amax of this rank's dy reaches the probe
            # through the reduce-scatter; the op's own probe gets a sink (it sees dequantized values).
            assert state is not None and recipe is not None
            check_probe(grad_probe, where, device=x.device)
            spec = QuantSpec.of(recipe, "backward", state.grad_output.calibrated and grad_probe is not None)
            fp8_grad = (grad_probe, state.grad_output.scale, spec)
            kw["grad_probe"] = probe_sink(grad_probe)
        y, new_state = fp8_linear(x, weight, None, state, **kw)
        if bias is not None:
            check_float_tensor(bias, "bias", where)
            if tuple(bias.shape) != (weight.shape[0],):
                raise ValueError(f"{where}: bias must have shape (N,) = ({weight.shape[0]},), got {tuple(bias.shape)}")
        return row_output(y, bias, tp, where, fp8_grad), new_state
    ac = autocast_dtype(x.device.type)
    if ac is not None:
        # torch.autocast: compute as F.linear does, in the autocast dtype. The casts stay outside the
        # autograd Function (gradients flow back to the originals in their dtype); a cached FP8
        # weight is used as it is (its source weight is not cast: the cache checks identity).
        if wgrad_dtype == weight.dtype:
            wgrad_dtype = None  # the gradient reaches weight in its dtype through the cast
        if weight_cache is None:
            x, weight, bias = autocast_inputs(ac, x, weight, bias)
        else:
            x, bias = autocast_inputs(ac, x, bias)
        with torch.autocast(x.device.type, enabled=False):
            return fp8_linear(x, weight, bias, state, recipe=recipe, grad_probe=grad_probe,
                              weight_cache=weight_cache, wgrad_dtype=wgrad_dtype)
    return _fp8_linear(x, weight, bias, state, recipe, grad_probe, weight_cache, wgrad_dtype, where, None)


def _fused_sp(recipe: Recipe, x: Tensor) -> bool:
    """Whether a sequence-parallel FP8 linear runs its collectives inside the op: all three GEMMs
    in FP8 (the gathered bytes feed them as they are), outside torch.autocast."""
    return (recipe.fprop.precision == recipe.dgrad.precision == recipe.wgrad.precision == "fp8"
            and autocast_dtype(x.device.type) is None and x.dim() >= 1 and x.shape[-1] > 0)


def _fp8_linear(x: Tensor, weight: Tensor, bias: Tensor | None, state: LinearState | None, recipe: Recipe | None,
                grad_probe: Tensor | None, weight_cache: WeightCache | None, wgrad_dtype: torch.dtype | None,
                where: str, sp: tuple[str, Any, int] | None) -> tuple[Tensor, LinearState | None]:
    """fp8_linear after the tensor-parallel and autocast dispatch; ``sp`` = (mode, group, world)
    runs the sequence-parallel collectives inside the op (FP8 states only)."""
    if x.dim() < 1:
        raise ValueError(f"{where}: x must be (..., K), got a 0-d tensor")
    if weight.dim() != 2:
        raise ValueError(f"{where}: weight must be 2-D (N, K), got shape {tuple(weight.shape)}")
    N, K = weight.shape
    if x.shape[-1] != K:
        raise ValueError(f"{where}: x has K={x.shape[-1]} in its last dimension but weight is (N, K) = {tuple(weight.shape)}")
    check_device(weight, "weight", x, where)
    if bias is not None:
        check_float_tensor(bias, "bias", where)
        if tuple(bias.shape) != (N,):
            raise ValueError(f"{where}: bias must have shape (N,) = ({N},), got {tuple(bias.shape)}")
        check_device(bias, "bias", x, where)
    fp8 = check_state_recipe(state, recipe, LinearState, x, where)
    check_probe(grad_probe, where, device=x.device)
    if grad_probe is not None and not fp8:
        raise ValueError(f"{where}: grad_probe is only meaningful with FP8 (a state and a recipe); pass grad_probe=None")
    wgrad_dtype = weight.dtype if wgrad_dtype is None else wgrad_dtype
    if wgrad_dtype != weight.dtype:
        raise ValueError(
            f"{where}: wgrad_dtype={wgrad_dtype} but weight is {weight.dtype}; autograd keeps a gradient "
            f"in its parameter's dtype, so differentiate a {wgrad_dtype} weight (e.g. the FP32 master "
            f"weight: it is quantized directly and the wgrad GEMM writes {wgrad_dtype})"
        )
    use_cache = weight_cache is not None
    if use_cache:
        if not fp8:
            raise ValueError(f"{where}: weight_cache is only meaningful with FP8 (a state and a recipe); "
                             f"pass weight_cache=None")
        if not isinstance(weight_cache, WeightCache):
            raise TypeError(f"{where}: weight_cache must be a WeightCache from quantize_weight, got {type(weight_cache).__name__}")
        assert state is not None  # fp8: check_state_recipe has checked it
        if weight_cache.recipe != recipe:
            raise ValueError(f"{where}: weight_cache was built with another recipe ({weight_cache.recipe!r}); rebuild it with quantize_weight")
        if not _same_tensor(weight_cache.scale, state.weight.scale):
            raise ValueError(
                f"{where}: weight_cache was built with another weight state (stale after fp8ops.update?); "
                f"rebuild it with quantize_weight(weight, state.weight, recipe=...) once per optimizer step"
            )
        if tuple(weight_cache.value.shape) != (N, K):
            raise ValueError(f"{where}: weight_cache holds a {tuple(weight_cache.value.shape)} weight, expected {(N, K)}")
        # Eager mode only: under torch.compile an alias of the weight cannot be told from another
        # tensor (the scale check above holds there by identity).
        if not torch.compiler.is_compiling() and not _same_weight(weight_cache.weight, weight):
            raise ValueError(f"{where}: weight_cache was built from another weight tensor; "
                             f"rebuild it with quantize_weight(weight, ...)")
        _check_cache_transpose(weight_cache, where, "weight_cache")
    if not fp8 or K == 0:
        # No FP8, or nothing to quantize (K = 0: y is the bias broadcast, and the amax of an empty
        # tensor, 0, is no observation): torch's linear, and the state as given.
        return hp_linear(x, weight, bias), state
    assert state is not None and recipe is not None

    grad_on = torch.is_grad_enabled()
    cfg = _Cfg(
        x_spec=QuantSpec.of(recipe, "forward", state.input.calibrated),
        w_spec=QuantSpec.of(recipe, "forward", state.weight.calibrated),
        g_spec=QuantSpec.of(recipe, "backward", state.grad_output.calibrated),
        fprop=recipe.fprop,
        dgrad=recipe.dgrad,
        wgrad=recipe.wgrad,
        has_probe=grad_probe is not None,
        need_dx=grad_on and x.requires_grad,
        need_dw=grad_on and weight.requires_grad,
        need_db=grad_on and bias is not None and bias.requires_grad,
        wgrad_dtype=wgrad_dtype,
        use_cache=use_cache,
    )
    lead = x.shape[:-1]
    if sp is not None:
        # column: x is (S/w, ..., K) and y (S, ..., N); row: x is (S, ..., K) and y (S/w, ..., N)
        lead = (x.shape[0] * sp[2] if sp[0] == "column" else x.shape[0] // sp[2], *x.shape[1:-1])
        if sp[0] == "row":  # dy is gathered with the group's scale: a recorded one needs a probe
            cfg = cfg._replace(g_spec=QuantSpec.of(recipe, "backward", state.grad_output.calibrated and cfg.has_probe),
                               row_chunks=row_fprop_chunks(N))
        rows = x.numel() // K
        dims = (rows, K, N) if sp[0] == "column" else (rows, rows // sp[2], K, N)
        fused = (recipe.fprop.precision == recipe.dgrad.precision == "fp8"
                 and fused_sp_gemms(x.device, sp[1], recipe.mode, (recipe.fprop.backend, recipe.dgrad.backend), *dims))
        cfg = cfg._replace(sp=sp[0], carveout=overlap_sm_carveout(x.device), fused=fused)
    x2 = x.reshape(-1, K)
    x_scale, w_scale, g_scale = state.input.scale, state.weight.scale, state.grad_output.scale
    # autograd.Function under torch.compile rejects one tensor passed twice.
    if w_scale is x_scale:
        w_scale = w_scale.clone()
    if g_scale is x_scale or g_scale is w_scale:
        g_scale = g_scale.clone()
    c = weight_cache.value if use_cache else None
    refuse_compiled_transform(where, x)
    y, x_amax, w_amax, *_ = apply(
        _FP8Linear, x2, weight, bias, x_scale, w_scale, g_scale, grad_probe,
        c.data if c is not None else None,
        c.data_t if c is not None else None,
        c.inv_scale if c is not None else None,
        weight_cache.inv_scale_t if use_cache else None,
        cfg,
        None if sp is None else sp[1],
    )
    new_state = state.replace(
        input=state.input._observe_amax(x_amax),
        weight=state.weight if use_cache else state.weight._observe_amax(w_amax),
    )
    return y.reshape(*lead, N), new_state
