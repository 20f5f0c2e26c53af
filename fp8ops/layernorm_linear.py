"""layernorm_linear: LayerNorm (or RMSNorm) fused with the FP8 linear layer that follows it.

Forward::

    ln  = norm(x) * g + beta                  one kernel: statistics in fp32, and the normalised
    lnq = q(ln), lnq^T                        output written directly as FP8 (+ its transposed copy
                                              for the wgrad GEMM) with amax(ln) in the same pass
    y   = dq(lnq . q(W)^T) + b                fprop GEMM

Backward::

    dln = dq(q(dy) . q(W))                    dgrad GEMM (E5M2 x E4M3)
    dW  = dq(q(dy)^T . lnq)                   wgrad GEMM, from the saved FP8 lnq^T
    dx, dg, dbeta = norm_backward(dln)        one pass for dx, persistent partial sums for dg/dbeta

No high-precision copy of the normalised output is written unless it is asked for
(``return_layernorm_output=True``) or a GEMM runs in high precision. With ``state=None`` and
``recipe=None`` the same fused norm kernels run with high-precision GEMMs (no FP8). With a
``weight_cache`` (:func:`fp8ops.quantize_weight`) q(W) and q(W)^T are the cached operands and W is
not quantized again.
"""

from __future__ import annotations

import inspect
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ._parallel import copy_to_tp, sequence_norm, tp_config
from ._glue import apply, autocast_dtype, autocast_inputs, cast, refuse_compiled_transform
from ._checks import check_norm_args, check_probe, check_residual, check_state_recipe, check_weight
from ._operands import (
    HIGH,
    NormCfg,
    bias_grad,
    cached_dgrad_operand,
    dgrad_weight,
    gemm_dgrad,
    gemm_fprop,
    gemm_wgrad,
    head_views,
    hp_linear,
    norm_backward,
    norm_operands,
    or_empty,
    quantize_grad_db,
    quantize_grad_heads,
    quantize_weight_operands,
)
from .fp8_linear import LinearState, WeightCache, _check_cache_transpose, _same_tensor, _same_weight, fp8_linear
from .quantize import QuantSpec
from .recipes import GemmSpec, Recipe
from .state import ScalingState

__all__ = ["LayerNormLinearState", "check_weight_cache", "layernorm_linear"]


class LayerNormLinearState(LinearState):
    """State of one :func:`layernorm_linear` call site: the roles of :class:`LinearState`, with
    ``input`` the normalised output (the GEMM's input).

    Example:
        >>> import fp8ops
        >>> st = fp8ops.LayerNormLinearState.init(fp8ops.DelayedScaling())
        >>> [st.input.role, st.weight.role, st.grad_output.role]
        ['forward', 'forward', 'backward']
    """


def check_weight_cache(cache: Any, weight: Tensor, wstate: ScalingState | None, recipe: Recipe | None, fp8: bool,
                       where: str, *, name: str = "weight_cache", weight_name: str = "weight",
                       role: str = "weight") -> None:
    """The checks of :func:`fp8ops.fp8_linear`'s ``weight_cache``, for a linear-family op ``where``
    (``layernorm_linear``, and ``fused_ln_mlp`` for each of its two caches).

    ``cache`` is the argument ``name`` (a :class:`fp8ops.WeightCache`) given for the weight
    argument ``weight_name``, whose scaling state is the role ``role`` (``wstate``) of the op's
    state: FP8 only (``fp8``: a state and a recipe were given), built with ``recipe``, with this
    role's scale tensor itself (a cache built before an ``fp8ops.update`` is stale), of the
    weight's shape, from this weight tensor (eager mode: under ``torch.compile`` an alias of the
    weight cannot be told from another tensor; the scale check holds there by identity).

    Raises:
        TypeError: ``cache`` is not a WeightCache.
        ValueError: any other mismatch; the message names ``where``, ``name`` and the fix.
    """
    if not fp8:
        raise ValueError(f"{where}: {name} is only meaningful with FP8 (a state and a recipe); pass {name}=None")
    if not isinstance(cache, WeightCache):
        raise TypeError(f"{where}: {name} must be a WeightCache from quantize_weight, got {type(cache).__name__}")
    assert wstate is not None  # fp8: check_state_recipe has checked the state
    rebuild = f"rebuild it with quantize_weight({weight_name}, state.{role}, recipe=...)"
    if cache.recipe != recipe:
        raise ValueError(f"{where}: {name} was built with another recipe ({cache.recipe!r}); {rebuild}")
    if not _same_tensor(cache.scale, wstate.scale):
        raise ValueError(f"{where}: {name} was built with another weight state (stale after fp8ops.update?); "
                         f"{rebuild} once per optimizer step")
    if tuple(cache.value.shape) != tuple(weight.shape):
        raise ValueError(f"{where}: {name} holds a {tuple(cache.value.shape)} weight, expected "
                         f"{tuple(weight.shape)} ({weight_name}'s shape)")
    if not torch.compiler.is_compiling() and not _same_weight(cache.weight, weight):
        raise ValueError(f"{where}: {name} was built from another weight tensor than {weight_name}; {rebuild}")
    _check_cache_transpose(cache, where, name)


class _Cfg(NamedTuple):
    """Static configuration of one layernorm_linear call (plain constants)."""

    norm: NormCfg
    fp8: bool
    x_spec: QuantSpec | None
    w_spec: QuantSpec | None
    g_spec: QuantSpec | None
    fprop: GemmSpec
    dgrad: GemmSpec
    wgrad: GemmSpec
    has_probe: bool
    return_ln: bool
    need_dx: bool  # any gradient through the norm: x, its weight or its bias
    need_dw: bool
    need_db: bool
    use_cache: bool  # the weight's FP8 operands come from a WeightCache
    heads: tuple[int, int, int, int] | None = None  # (B, hq, hkv, d): y returned as attention's head views


class _LayerNormLinear(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(  # type: ignore[override]
        x: Tensor,  # (M, K)
        r: Tensor | None,  # (M, K) residual: the norm reads s = x + r
        ln_w: Tensor,  # (K,)
        ln_b: Tensor | None,  # (K,)
        w: Tensor,  # (N, K)
        bias: Tensor | None,  # (N,)
        x_scale: Tensor | None,
        w_scale: Tensor | None,
        g_scale: Tensor | None,
        probe: Tensor | None,
        c_data: Tensor | None,  # (N, K) cached FP8 weight
        c_data_t: Tensor | None,  # (K, N)
        c_inv: Tensor | None,
        c_inv_t: Tensor | None,  # row-wise (K, 1) scales of c_data_t, else None
        cfg: _Cfg,
    ) -> tuple[Tensor, ...]:
        fp8_fwd = cfg.fprop.precision == "fp8"
        need_xt = cfg.need_dw and cfg.wgrad.precision == "fp8"
        need_wt = cfg.need_dx and cfg.dgrad.precision == "fp8" and not cfg.use_cache
        need_hp = cfg.return_ln or not fp8_fwd or (cfg.need_dw and cfg.wgrad.precision != "fp8")
        # Step 1: the norm, writing the FP8 GEMM operand (and its transpose) directly; with a
        # residual it also writes s = x + r, which it normalises.
        ln, lnq, ln_inv, lnq_t, ln_inv_t, ln_amax, mean, rstd, s = norm_operands(
            x, ln_w, ln_b, cfg.norm, x_scale, cfg.x_spec, need_q=fp8_fwd, need_t=need_xt, need_hp=need_hp, residual=r
        )
        # Step 2: the weight, from the cache or quantized now (with its transpose for dgrad).
        if cfg.use_cache:
            # the cached transposed copy is saved from the inputs in setup_context
            wq, w_inv, wq_t, w_inv_t = c_data, c_inv, None, None
            w_amax = torch.zeros((), dtype=torch.float32, device=x.device)
        else:
            wq, w_inv, wq_t, w_inv_t, w_amax = quantize_weight_operands(w, w_scale, cfg.w_spec, fp8_fwd, need_wt)
        # Step 3: the forward GEMM.
        y = gemm_fprop(lnq, ln_inv, ln, wq, w_inv, w, bias, cfg.fprop, x.dtype)
        if not need_wt:
            wq_t = w_inv_t = None
        rest = (or_empty(ln, x), or_empty(s, x), ln_amax, w_amax, mean, rstd, or_empty(lnq_t, x),
                or_empty(ln_inv_t, x), or_empty(wq_t, x), or_empty(w_inv_t, x))
        if cfg.heads is None:
            return (y, *rest)
        # attention's q, k, v views of y: their gradients come back separately (backward, Step 1)
        q4, k4, v4 = head_views(y, *cfg.heads)
        return (q4, *rest, k4, v4)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        x, r, ln_w, _, w, bias, _, _, g_scale, _, c_data, c_data_t, c_inv, c_inv_t, cfg = inputs
        _, ln, s, _, _, mean, rstd, lnq_t, ln_inv_t, wq_t, w_inv_t = output[:11]
        ctx.w_t_later = False
        if cfg.use_cache and cfg.need_dx and cfg.dgrad.precision == "fp8":
            wq_t, w_inv_t, ctx.w_t_later = cached_dgrad_operand(c_data, c_data_t, c_inv, c_inv_t)
        # one call: a second mark_non_differentiable replaces the first set
        ctx.mark_non_differentiable(*output[3:11], *(() if cfg.return_ln else (ln,)), *(() if r is not None else (s,)))
        # No zero gradients for the outputs that never get one; dy or dln_out may then be None.
        ctx.set_materialize_grads(False)
        ctx.y_shape = output[0].shape
        ctx.head_shapes = None if cfg.heads is None else tuple(o.shape for o in (output[0], *output[11:]))
        keep_ln = cfg.need_dw and cfg.wgrad.precision != "fp8"
        keep_w = cfg.need_dx and cfg.dgrad.precision != "fp8"
        ctx.save_for_backward(
            (s if r is not None else x) if cfg.need_dx else None, ln_w, mean, rstd, lnq_t, ln_inv_t, wq_t, w_inv_t, g_scale,
            ln if keep_ln else None, w if keep_w else None,
        )
        ctx.cfg = cfg
        ctx.has_residual = r is not None
        ctx.dtypes = (x.dtype, w.dtype, None if bias is None else bias.dtype)

    @staticmethod
    def backward(ctx: Any, dy: Tensor | None, dln_out: Tensor | None, ds: Tensor | None,  # type: ignore[override]
                 *rest: Any) -> tuple[Any, ...]:
        # x is the normalised input (s = x + r with a residual); ds: the gradient that reached s
        # directly (the residual stream), added into dx by the norm's backward.
        if not ctx.has_residual:
            ds = None
        x, ln_w, mean, rstd, lnq_t, ln_inv_t, wq_t, w_inv_t, g_scale, ln, w = ctx.saved_tensors
        cfg: _Cfg = ctx.cfg
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        dx = dln_w = dln_b = dw = db = None
        with torch.no_grad():
            fp8_dgrad = cfg.need_dx and cfg.dgrad.precision == "fp8"
            fp8_wgrad = cfg.need_dw and cfg.wgrad.precision == "fp8"
            if cfg.heads is None:
                if dy is None:  # only the returned norm output is used downstream
                    dy = torch.zeros(ctx.y_shape, dtype=x_dtype, device=ln_w.device)
                dy = dy.contiguous()
            # Step 1: quantize dy (and its transpose) in one pass; its amax is the observation.
            if cfg.heads is not None:
                # dy is [dq | dk | dv]: quantized (transpose and bias sums too) in one pass over the
                # three gradients where attention wrote them; the GEMMs take only the FP8 operands.
                parts = tuple(g if g is not None else torch.zeros(shape, dtype=x_dtype, device=ln_w.device)
                              for g, shape in zip((dy, rest[-2], rest[-1]), ctx.head_shapes))
                dyq, dy_inv, dyq_t, dy_inv_t, dy_amax, db = quantize_grad_heads(
                    *parts, g_scale, cfg.g_spec, cfg.has_probe, b_dtype or torch.float32)
                dy = None
                if not cfg.need_db:
                    db = None
            elif cfg.fp8:  # the bias gradient from the same pass where it writes dy's transposed copy
                dyq, dy_inv, dyq_t, dy_inv_t, dy_amax, db = quantize_grad_db(
                    dy, g_scale, cfg.g_spec, cfg.has_probe, fp8_dgrad, fp8_wgrad, cfg.need_db, b_dtype or torch.float32
                )
            else:
                dyq = dy_inv = dyq_t = dy_inv_t = dy_amax = None
            # Step 2: wgrad and the bias gradient.
            if cfg.need_dw:
                dw = gemm_wgrad(dyq_t, dy_inv_t, dy, lnq_t, ln_inv_t, ln, cfg.wgrad, w_dtype)
            if cfg.need_db and db is None:
                db = bias_grad(dy, b_dtype)
            # Step 3: dgrad into the norm's output, then the norm's backward.
            if cfg.need_dx:
                dln = gemm_dgrad(dyq, dy_inv, dy, dgrad_weight(wq_t, ctx.w_t_later), w_inv_t, w, cfg.dgrad, x_dtype)
                if cfg.return_ln and dln_out is not None:
                    dln = dln + dln_out
                dx, dln_w, dln_b = norm_backward(dln, x, ln_w, mean, rstd, cfg.norm, ds)
        if ctx.has_residual and dx is None:  # nothing flowed back through the norm
            dx = ds
        probe_grad = dy_amax if cfg.has_probe else None
        return (dx, dx if ctx.has_residual else None, dln_w, dln_b, dw, db, None, None, None, probe_grad, None, None,
                None, None, None)


_LayerNormLinear.forward.__signature__ = inspect.signature(_LayerNormLinear.forward)  # type: ignore[attr-defined]


def _check_qkv_heads(qkv_heads: Any, x: Any, weight: Any, return_ln: bool, tp_group: Any, where: str) -> None:
    """Validate ``qkv_heads`` (whether the backward takes the three gradients as they come is
    :func:`_heads_fused`'s)."""
    if (not isinstance(qkv_heads, tuple) or len(qkv_heads) != 3
            or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in qkv_heads)):
        raise TypeError(f"{where}: qkv_heads must be a tuple (hq, hkv, d) of ints > 0, got {qkv_heads!r}")
    hq, hkv, d = qkv_heads
    if not isinstance(x, Tensor) or x.dim() != 3:
        raise ValueError(f"{where}: qkv_heads needs x as (S, B, K), got shape "
                         f"{tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__}")
    if not isinstance(weight, Tensor) or weight.dim() != 2 or weight.shape[0] != (hq + 2 * hkv) * d:
        raise ValueError(f"{where}: qkv_heads={qkv_heads} needs a weight of (hq + 2 hkv) d = {(hq + 2 * hkv) * d} "
                         f"rows, got {tuple(weight.shape) if isinstance(weight, Tensor) else type(weight).__name__}")
    if return_ln or tp_group is not None:
        raise ValueError(f"{where}: qkv_heads is not available with return_layernorm_output or tp_group")


def _heads_fused(qkv_heads: tuple[int, int, int], weight: Tensor, recipe: Any, fp8: bool) -> bool:
    """Whether the backward quantizes the head views' gradients in one pass: a per-tensor FP8
    recipe with FP8 dgrad and wgrad GEMMs, head widths the kernel tiles."""
    from .kernels.quantize import heads_block_k

    return (fp8 and recipe.mode != "rowwise" and recipe.dgrad.precision == "fp8" and recipe.wgrad.precision == "fp8"
            and weight.shape[1] > 0 and heads_block_k(*qkv_heads) is not None)


def layernorm_linear(
    x: Tensor,
    ln_weight: Tensor,
    ln_bias: Tensor | None,
    weight: Tensor,
    bias: Tensor | None,
    state: LayerNormLinearState | None,
    *,
    recipe: Recipe | None,
    normalization: str = "LayerNorm",
    eps: float = 1e-5,
    zero_centered_gamma: bool = False,
    return_layernorm_output: bool = False,
    grad_probe: Tensor | None = None,
    weight_cache: WeightCache | None = None,
    tp_group: Any = None,
    parallel_mode: str | None = None,
    sequence_parallel: bool = False,
    residual: Tensor | None = None,
    qkv_heads: tuple[int, int, int] | None = None,
) -> tuple[Any, LayerNormLinearState | None]:
    """LayerNorm / RMSNorm followed by an FP8 linear layer, with the norm writing the FP8 operand.

    Math::

        ln = (x - mean(x)) * rstd * g + beta        LayerNorm (RMSNorm: x * rstd * g, rstd = 1/rms(x))
        y  = dq(q(ln) . q(W)^T) + b                 g = ln_weight (+ 1 with zero_centered_gamma)

    Gradients of x, ln_weight, ln_bias, weight and bias; the grad of ``grad_probe`` is amax(dy).
    The GEMMs follow ``recipe.fprop/dgrad/wgrad`` as in :func:`fp8ops.fp8_linear`.

    Args:
        x: (..., K) float32, bfloat16 or float16; y has the same dtype. Inside ``torch.autocast``
            x, ln_weight, ln_bias, weight and bias are cast to the autocast dtype first (as
            ``F.linear(F.layer_norm(x, ...))`` gives y there; the norm's statistics stay float32)
            and y (and the normalised output) have the autocast dtype.
        ln_weight: (K,) the norm's scale g; ln_bias: (K,) or None (None for RMSNorm).
        weight: (N, K); bias: (N,) or None.
        state: the :class:`LayerNormLinearState` of this call site, or None together with
            ``recipe=None`` for no FP8 (the fused norm kernels with high-precision GEMMs).
        recipe: the recipe the state was built with.
        normalization: ``"LayerNorm"`` or ``"RMSNorm"``.
        eps: added to the variance (mean square for RMSNorm); a finite number > 0.
        zero_centered_gamma: a bool; the norm multiplies by ``1 + ln_weight``.
        return_layernorm_output: also return the normalised output (differentiable).
        grad_probe: a 0-d float32 zero on x's device whose gradient becomes amax(dy); without
            one, dy is quantized with current scaling.
        weight_cache: a :class:`fp8ops.WeightCache` of this ``weight`` for this optimizer step,
            from ``fp8ops.quantize_weight(weight, state, recipe=recipe)`` (which records amax(W)
            in the returned state); the weight is then not quantized again, in the forward GEMM
            and the dgrad GEMM alike, and its gradient still flows to ``weight``. The same rules
            as :func:`fp8ops.fp8_linear`'s: only with FP8, built with this recipe and the
            state's current weight scale (rebuild it after every ``fp8ops.update``), from this
            weight tensor. Inside ``torch.autocast`` ``weight`` is not cast (the cache is used
            as built).
        tp_group: a ``torch.distributed`` process group for tensor parallelism, or None.
        parallel_mode: with ``tp_group``, ``"column"``: ``weight`` is this rank's (N/w, K) row
            shard, ``bias`` its (N/w,) shard, y the last-dim shard; the norm's parameters are
            replicated (their gradients are summed over the group). A row-parallel norm is not
            supported (the norm needs the whole hidden dimension).
        sequence_parallel: with ``tp_group``, x is this rank's slice of dim 0 (the sequence): the
            norm runs on the slice (unfused: :func:`fp8ops.layer_norm` / :func:`fp8ops.rms_norm`),
            and :func:`fp8ops.fp8_linear` all-gathers its output before the GEMM (FP8 bytes with
            a per-tensor recipe). Not with ``return_layernorm_output``.
        residual: (..., K) of x's shape and dtype, or None: the op normalises ``s = x + residual``
            (added in fp32, rounded to x's dtype, as ``x + residual`` gives) and returns s too: the
            residual stream of a pre-norm block whose previous branch output is x. The norm kernel
            writes s in the same pass and, in the backward, adds the gradient that reaches s
            directly into its dx. With ``tp_group`` and no sequence parallelism (or K = 0) the add
            runs in front, unfused; with ``sequence_parallel`` the slice's norm kernel adds it.
        qkv_heads: ``(hq, hkv, d)`` with x (S, B, K) and N = (hq + 2 hkv) d: y is returned as
            attention's head views ``(q, k, v)``, (B, hq, S, d), (B, hkv, S, d) and (B, hkv, S, d)
            views of the projection (its last dim [q heads | k heads | v heads]), as
            ``torch.nn.functional.scaled_dot_product_attention`` takes them. Under a per-tensor FP8
            recipe (FP8 dgrad and wgrad GEMMs) the backward then reads their three gradients where
            they arrive and quantizes them in one pass (``fp8ops::cast_transpose_heads``, the bias
            gradient from the same pass) instead of autograd concatenating them first; otherwise the
            views are taken of y as it is. Not with ``return_layernorm_output`` or ``tp_group``.

    All tensors must be on x's device.

    Returns:
        ``(y, new_state)`` with y (..., N), or ``((y, ln_out), new_state)`` with
        ``return_layernorm_output``; with a residual, s follows: ``((y, s), new_state)`` or
        ``((y, ln_out, s), new_state)``; ``new_state`` has amax(ln) and amax(W) recorded (None
        without FP8; amax(W) is recorded by :func:`fp8ops.quantize_weight` when a cache is
        used). With K = 0 the normalised output is empty, y is the bias broadcast to (..., N)
        (zeros without one) and the state comes back unchanged (nothing is observed).

    Raises:
        TypeError, ValueError: bad input (the message names the argument and the fix).

    Example:
        >>> import torch, fp8ops
        >>> r = fp8ops.DelayedScaling()
        >>> st = fp8ops.LayerNormLinearState.init(r)
        >>> x = torch.randn(4, 32, requires_grad=True)
        >>> g, beta, w = torch.ones(32), torch.zeros(32), torch.randn(48, 32, requires_grad=True)
        >>> probe = torch.zeros((), requires_grad=True)
        >>> y, st = fp8ops.layernorm_linear(x, g, beta, w, None, st, recipe=r, grad_probe=probe)
        >>> y.shape
        torch.Size([4, 48])
        >>> y.sum().backward()
        >>> bool(probe.grad == 1.0)
        True

    References:
        Ba et al., "Layer Normalization" (2016); Zhang & Sennrich, "Root Mean Square Layer
        Normalization" (2019); NVIDIA Transformer Engine ``LayerNormLinear``.
    """
    where = "layernorm_linear"
    if qkv_heads is not None:
        _check_qkv_heads(qkv_heads, x, weight, return_layernorm_output, tp_group, where)
    tp = tp_config(where, tp_group, parallel_mode, sequence_parallel, modes=("column",))
    if residual is not None:
        check_residual(residual, x, where)
        # the add in front, unfused (a sequence-parallel norm's kernel adds it itself)
        if (tp is not None and not tp.sp) or (isinstance(x, Tensor) and x.shape[-1:] == (0,)):
            s = x + residual
            out, new_state = layernorm_linear(
                s, ln_weight, ln_bias, weight, bias, state, recipe=recipe, normalization=normalization, eps=eps,
                zero_centered_gamma=zero_centered_gamma, return_layernorm_output=return_layernorm_output,
                grad_probe=grad_probe, weight_cache=weight_cache, tp_group=tp_group, parallel_mode=parallel_mode,
                sequence_parallel=sequence_parallel)
            return ((*out, s) if return_layernorm_output else (out, s)), new_state
    if tp is not None:
        if return_layernorm_output:
            raise ValueError(f"{where}: return_layernorm_output is not supported with tp_group (the norm output "
                             f"is replicated and its gradient would be summed over the group)")
        check_norm_args(x, ln_weight, ln_bias, normalization, eps, zero_centered_gamma, where)
        g = tp.group
        if tp.sp:
            # SP: the norm on this rank's slice (its parameters' gradients are partial sums; with a
            # residual its kernel writes x + residual too), then the column-parallel GEMM all-gathers
            # its output (FP8 bytes with a per-tensor recipe).
            ln = sequence_norm(x, ln_weight, ln_bias, normalization, eps, zero_centered_gamma, g, residual)
            if residual is not None:
                ln, s = ln
            out, new_state = fp8_linear(ln, weight, bias, state, recipe=recipe, grad_probe=grad_probe,
                                        weight_cache=weight_cache, tp_group=g, parallel_mode="column",
                                        sequence_parallel=True)
            return ((out, s) if residual is not None else out), new_state
        return layernorm_linear(
            copy_to_tp(x, g), copy_to_tp(ln_weight, g), copy_to_tp(ln_bias, g), weight, bias,
            state, recipe=recipe, normalization=normalization, eps=eps, zero_centered_gamma=zero_centered_gamma,
            grad_probe=grad_probe, weight_cache=weight_cache)
    ac = autocast_dtype(x.device.type) if isinstance(x, Tensor) else None
    if ac is not None:
        # torch.autocast: every floating input in the autocast dtype (outside the autograd Function,
        # so gradients reach the originals in their dtype), then the op with autocast off inside. A
        # cached FP8 weight is used as it is (its source weight is not cast: the cache checks identity).
        x, ln_weight, ln_bias, bias, residual = autocast_inputs(ac, x, ln_weight, ln_bias, bias, residual)
        if weight_cache is None:
            (weight,) = autocast_inputs(ac, weight)
        with torch.autocast(x.device.type, enabled=False):
            return layernorm_linear(
                x, ln_weight, ln_bias, weight, bias, state, recipe=recipe, normalization=normalization, eps=eps,
                zero_centered_gamma=zero_centered_gamma, return_layernorm_output=return_layernorm_output,
                grad_probe=grad_probe, weight_cache=weight_cache, residual=residual, qkv_heads=qkv_heads)
    K = check_norm_args(x, ln_weight, ln_bias, normalization, eps, zero_centered_gamma, where)
    N = check_weight(weight, bias, K, x, "weight", where)
    fp8 = check_state_recipe(state, recipe, LayerNormLinearState, x, where)
    check_probe(grad_probe, where, device=x.device)
    if qkv_heads is not None and not _heads_fused(qkv_heads, weight, recipe, fp8):
        # the views of y as it is: autograd concatenates their gradients
        out, new_state = layernorm_linear(
            x, ln_weight, ln_bias, weight, bias, state, recipe=recipe, normalization=normalization, eps=eps,
            zero_centered_gamma=zero_centered_gamma, grad_probe=grad_probe, weight_cache=weight_cache,
            residual=residual)
        y = out[0] if residual is not None else out
        views = head_views(y, x.shape[1], *qkv_heads)
        return ((views, out[1]) if residual is not None else views), new_state
    if grad_probe is not None and not fp8:
        raise ValueError(f"{where}: grad_probe is only meaningful with FP8 (a state and a recipe); pass grad_probe=None")
    use_cache = weight_cache is not None
    if use_cache:
        check_weight_cache(weight_cache, weight, None if state is None else state.weight, recipe, fp8, where)
    if K == 0:
        # Nothing to normalise or quantize: the normalised output is empty and y is the bias
        # broadcast (zeros without one), as torch.nn.functional.linear gives; nothing is observed.
        ln0 = x * cast(ln_weight, x.dtype)
        if ln_bias is not None:
            ln0 = ln0 + cast(ln_bias, x.dtype)
        y0 = hp_linear(ln0, weight, bias)
        return ((y0, ln0) if return_layernorm_output else y0), state
    grad_on = torch.is_grad_enabled()
    need_norm_grad = grad_on and (x.requires_grad or ln_weight.requires_grad
                                  or (ln_bias is not None and ln_bias.requires_grad)
                                  or (residual is not None and residual.requires_grad))
    if fp8:
        assert state is not None and recipe is not None
        specs = (QuantSpec.of(recipe, "forward", state.input.calibrated),
                 QuantSpec.of(recipe, "forward", state.weight.calibrated),
                 QuantSpec.of(recipe, "backward", state.grad_output.calibrated))
        gemms = (recipe.fprop, recipe.dgrad, recipe.wgrad)
        scales = (state.input.scale, state.weight.scale, state.grad_output.scale)
    else:
        specs, gemms, scales = (None, None, None), (HIGH, HIGH, HIGH), (None, None, None)
    cfg = _Cfg(
        norm=NormCfg(normalization == "RMSNorm", float(eps), bool(zero_centered_gamma), ln_bias is not None),
        fp8=fp8, x_spec=specs[0], w_spec=specs[1], g_spec=specs[2],
        fprop=gemms[0], dgrad=gemms[1], wgrad=gemms[2],
        has_probe=grad_probe is not None, return_ln=bool(return_layernorm_output),
        need_dx=need_norm_grad, need_dw=grad_on and weight.requires_grad,
        need_db=grad_on and bias is not None and bias.requires_grad, use_cache=use_cache,
        heads=None if qkv_heads is None else (x.shape[1], *qkv_heads),
    )
    x_scale, w_scale, g_scale = scales
    if fp8:  # autograd.Function under torch.compile rejects one tensor passed twice
        if w_scale is x_scale:
            w_scale = w_scale.clone()
        if g_scale is x_scale or g_scale is w_scale:
            g_scale = g_scale.clone()
    lead = x.shape[:-1]
    refuse_compiled_transform(where, x)
    c = weight_cache.value if weight_cache is not None else None
    y, ln, s, ln_amax, w_amax, *outs = apply(
        _LayerNormLinear, x.reshape(-1, K), None if residual is None else residual.reshape(-1, K), ln_weight, ln_bias, weight, bias, x_scale, w_scale, g_scale, grad_probe,
        None if c is None else c.data, None if c is None else c.data_t, None if c is None else c.inv_scale,
        None if weight_cache is None else weight_cache.inv_scale_t, cfg,
    )
    if qkv_heads is not None:
        y = (y, *outs[-2:])  # q, k, v
    else:
        y = y.reshape(*lead, N)
    new_state = None
    if fp8:
        assert state is not None
        new_state = state.replace(input=state.input._observe_amax(ln_amax),
                                  weight=state.weight if use_cache else state.weight._observe_amax(w_amax))
    out: Any = y
    if return_layernorm_output:
        out = (y, ln.reshape(*lead, K))
    if residual is not None:
        out = (*out, s.reshape(*lead, K)) if return_layernorm_output else (y, s.reshape(*lead, K))
    return out, new_state
