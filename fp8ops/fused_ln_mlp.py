"""fused_ln_mlp: LayerNorm -> fc1 -> activation -> fc2 with FP8 GEMMs and fused producers.

Forward (M tokens, K hidden, F ffn; C = F, or 2F for gated activations)::

    lnq, lnq^T = q(norm(x))                   norm kernel writes the FP8 operand of fc1
    h          = dq(lnq . q(W1)^T) + b1       (M, C), input precision
    aq, aq^T   = q(act(h))                    activation kernel writes the FP8 operand of fc2
    y          = dq(aq . q(W2)^T) + b2        (M, K2)

Backward::

    dyq, dyq^T = q(dy)                        (E5M2)
    da  = dq(dyq . q(W2));  dW2 = dq(dyq^T . aq^T);  db2 = sum(dy)
    dhq, dhq^T = q(da * act'(h)), db1         dact kernel writes the FP8 gradient of fc1 and db1
    dln = dq(dhq . q(W1));  dW1 = dq(dhq^T . lnq^T)
    dx, dg, dbeta = norm_backward(dln)

Saved for the backward: x, the norm statistics, lnq^T, the FP8 weights' transposed copies, h and
aq^T. ``recompute="activation"`` (with FP8) stores fc1's output in FP8 instead, hq = q(h) (E4M3,
role ``fc1_output``), and saves neither h nor aq^T: the forward's activation reads dq(hq), and the
backward recomputes aq^T from hq (same scale, same bits) and the activation gradient from dq(hq)::

    hq = q(h);  aq = q(act(dq(hq)))           forward: the activation's input is the stored hq
    aq^T = q(act(dq(hq)))^T;  dh = da * act'(dq(hq))     backward

so the backward is the gradient of exactly the function the forward computed. Seven tensor roles
are quantized, each with its own scaling state (``fc1_output`` only with recompute); the two
gradient roles report through one probe of shape (2,) (``make_probes``). A ``weight_cache`` pair
(:func:`fp8ops.quantize_weight` of W1 and W2) replaces q(W1), q(W2) and their transposed copies
with the cached operands.
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any, ClassVar, NamedTuple

import torch
from torch import Tensor

from . import activation as _activation
from .attention.checks import _seed_tensor
from .reference import norm as _ref_norm
from ._parallel import copy_to_tp, row_output, sequence_norm, tp_config
from ._glue import apply, autocast_dtype, autocast_inputs, refuse_compiled_transform
from ._checks import (
    check_float_tensor,
    check_norm_args,
    check_probe,
    check_residual,
    check_residual_dropout,
    check_state_recipe,
    check_weight,
)
from .formats import Role
from ._operands import (
    HIGH,
    NormCfg,
    act_operands,
    bias_grad,
    cached_dgrad_operand,
    dact_operands,
    dgrad_weight,
    gemm_dgrad,
    gemm_fprop,
    gemm_wgrad,
    norm_backward,
    norm_backward_dropout,
    norm_operands,
    or_empty,
    quantize_grad_db,
    quantize_weight_operands,
)
from .quantize import QuantSpec, quantize_2d
from .recipes import GemmSpec, Recipe
from .fp8_linear import LinearState, WeightCache, fp8_linear
from .layernorm_linear import check_weight_cache
from .kernels._library import OPS
from .state import OpState, ScalingState

__all__ = ["LayerNormMLPState", "fused_ln_mlp"]

_ops = OPS


class LayerNormMLPState(OpState):
    """State of one :func:`fused_ln_mlp` call site: input, weight and output gradient of fc1 and fc2,
    and fc1's output.

    ``fc1_input`` is the normalised input, ``fc2_input`` the activation's output, ``fc1_output``
    the FP8 copy of fc1's output that ``recompute="activation"`` stores (observed only then). The
    probe of a ``LayerNormMLPState`` (from :func:`fp8ops.make_probes`) has shape (2,): amax of
    fc1's and of fc2's output gradient.

    Example:
        >>> import fp8ops
        >>> st = fp8ops.LayerNormMLPState.init(fp8ops.DelayedScaling())
        >>> fp8ops.make_probes(st).shape
        torch.Size([2])
    """

    ROLES: ClassVar[dict[str, Role]] = {
        "fc1_input": "forward", "fc1_weight": "forward", "fc1_grad_output": "backward",
        "fc2_input": "forward", "fc2_weight": "forward", "fc2_grad_output": "backward",
        "fc1_output": "forward",
    }
    PROBE_ROLES: ClassVar[tuple[str, ...]] = ("fc1_grad_output", "fc2_grad_output")
    fc1_input: ScalingState
    fc1_weight: ScalingState
    fc1_grad_output: ScalingState
    fc2_input: ScalingState
    fc2_weight: ScalingState
    fc2_grad_output: ScalingState
    fc1_output: ScalingState


class _Cfg(NamedTuple):
    """Static configuration of one fused_ln_mlp call (plain constants)."""

    norm: NormCfg
    act: str
    fp8: bool
    recompute: bool
    specs: tuple[QuantSpec | None, ...]  # fc1_input, fc1_weight, fc1_grad, fc2_input, fc2_weight, fc2_grad, fc1_output
    fprop: GemmSpec
    dgrad: GemmSpec
    wgrad: GemmSpec
    has_probe: bool
    need_dx: bool  # any gradient through the norm: x, its weight or its bias
    need_dw1: bool
    need_db1: bool
    need_dw2: bool
    need_db2: bool
    cache1: bool  # W1's FP8 operands come from a WeightCache
    cache2: bool  # W2's
    drop_p: float = 0.0  # dropout on x before the residual add (with a seed)

    @property
    def need_dh(self) -> bool:
        """Whether the gradient must flow back through the activation into fc1's output."""
        return self.need_dx or self.need_dw1 or self.need_db1


def _weight_operands(cached: bool, c_data: Tensor | None, c_inv: Tensor | None, w: Tensor, s_w: Tensor | None,
                     sp_w: Any, fp8_fwd: bool, need_t: bool) -> tuple[Any, ...]:
    """(q, inv, q_t, inv_t, amax) of a weight: the cached FP8 weight as it is (its transposed copy
    is saved in setup_context; its amax was recorded by quantize_weight, a zero here), or the
    weight quantized now."""
    if cached:
        return c_data, c_inv, None, None, torch.zeros((), dtype=torch.float32, device=w.device)
    return quantize_weight_operands(w, s_w, sp_w, fp8_fwd, need_t)


class _FusedLNMLP(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(  # type: ignore[override]
        x: Tensor,  # (M, K)
        r: Tensor | None,  # (M, K) residual: the norm reads s = x + r
        seed: Tensor | None,  # () int64 seed of the dropout on x (cfg.drop_p), or None
        ln_w: Tensor,  # (K,)
        ln_b: Tensor | None,  # (K,)
        w1: Tensor,  # (C, K)
        b1: Tensor | None,  # (C,)
        w2: Tensor,  # (K2, F)
        b2: Tensor | None,  # (K2,)
        s_x1: Tensor | None,  # () scales of the seven roles (None without FP8)
        s_w1: Tensor | None,
        s_g1: Tensor | None,
        s_x2: Tensor | None,
        s_w2: Tensor | None,
        s_g2: Tensor | None,
        s_h1: Tensor | None,
        probes: Tensor | None,  # (2,)
        c1_data: Tensor | None,  # (C, K) cached FP8 W1
        c1_data_t: Tensor | None,  # (K, C)
        c1_inv: Tensor | None,
        c1_inv_t: Tensor | None,  # row-wise (K, 1) scales of c1_data_t, else None
        c2_data: Tensor | None,  # (K2, F) cached FP8 W2
        c2_data_t: Tensor | None,  # (F, K2)
        c2_inv: Tensor | None,
        c2_inv_t: Tensor | None,  # row-wise (F, 1) scales of c2_data_t, else None
        cfg: _Cfg,
    ) -> tuple[Tensor, ...]:
        sp_x1, sp_w1, _, sp_x2, sp_w2, _, sp_h1 = cfg.specs
        fp8_fwd = cfg.fprop.precision == "fp8"
        fp8_wgrad, fp8_dgrad = cfg.wgrad.precision == "fp8", cfg.dgrad.precision == "fp8"
        # Step 1: the norm writes fc1's FP8 operand (and its transpose for fc1's wgrad).
        # With a residual the kernel also writes s = x + r, which it normalises.
        ln, lnq, ln_inv, lnq_t, ln_inv_t, ln_amax, mean, rstd, s = norm_operands(
            x, ln_w, ln_b, cfg.norm, s_x1, sp_x1, need_q=fp8_fwd, need_t=cfg.need_dw1 and fp8_wgrad,
            need_hp=not fp8_fwd or (cfg.need_dw1 and not fp8_wgrad), residual=r,
            dropout=None if seed is None else (seed, cfg.drop_p),
        )
        # Step 2: fc1, its weight from the cache (its transposed copy is saved in setup_context) or
        # quantized now.
        w1q, w1_inv, w1q_t, w1_inv_t, w1_amax = _weight_operands(
            cfg.cache1, c1_data, c1_inv, w1, s_w1, sp_w1, fp8_fwd, cfg.need_dx and fp8_dgrad)
        h = gemm_fprop(lnq, ln_inv, ln, w1q, w1_inv, w1, b1, cfg.fprop, x.dtype)  # (M, C)
        h_inv = h_amax = None
        if cfg.recompute and cfg.fp8:
            # Step 2b: fc1's output in FP8 (per tensor): what is stored, and what the activation reads.
            assert sp_h1 is not None
            h, h_inv, _, h_amax = quantize_2d(h, s_h1, sp_h1)
        # Step 3: the activation writes fc2's FP8 operand (and, unless recomputed, its transpose).
        keep_a_t = cfg.need_dw2 and fp8_wgrad and not cfg.recompute
        keep_a_hp = cfg.need_dw2 and not fp8_wgrad and not cfg.recompute
        a, aq, a_inv, aq_t, a_inv_t, a_amax, a_amax_in = act_operands(
            h, cfg.act, s_x2, sp_x2, need_q=fp8_fwd, need_t=keep_a_t, need_hp=not fp8_fwd or keep_a_hp,
            h_inv=h_inv, hp_dtype=x.dtype,
        )
        # Step 4: fc2, its weight as fc1's.
        w2q, w2_inv, w2q_t, w2_inv_t, w2_amax = _weight_operands(
            cfg.cache2, c2_data, c2_inv, w2, s_w2, sp_w2, fp8_fwd, cfg.need_dh and fp8_dgrad)
        y = gemm_fprop(aq, a_inv, a, w2q, w2_inv, w2, b2, cfg.fprop, x.dtype)
        if not (cfg.need_dx and fp8_dgrad):
            w1q_t = w1_inv_t = None
        if not (cfg.need_dh and fp8_dgrad):
            w2q_t = w2_inv_t = None
        e = x
        return (
            y, or_empty(s, e), ln_amax, w1_amax, a_amax, w2_amax, or_empty(h_amax, e), mean, rstd,
            or_empty(lnq_t, e), or_empty(ln_inv_t, e), or_empty(ln if cfg.need_dw1 and not fp8_wgrad else None, e),
            or_empty(w1q_t, e), or_empty(w1_inv_t, e), h, or_empty(h_inv, e),
            or_empty(aq_t, e), or_empty(a_inv_t, e), or_empty(a if keep_a_hp else None, e),
            or_empty(a_amax_in, e), or_empty(w2q_t, e), or_empty(w2_inv_t, e),
        )

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        (x, r, seed, ln_w, _, w1, b1, w2, b2, _, _, s_g1, s_x2, _, s_g2, _, _, c1_data, c1_data_t, c1_inv, c1_inv_t,
         c2_data, c2_data_t, c2_inv, c2_inv_t, cfg) = inputs
        ctx.mark_non_differentiable(*output[2 if r is not None else 1:])  # y, and s = x + r with a residual
        # The other outputs never get a gradient: without this, autograd would allocate a zero
        # gradient of each one's shape (the FP8 operands saved for backward among them) per step.
        ctx.set_materialize_grads(False)
        (_, s, _, _, _, _, _, mean, rstd, lnq_t, ln_inv_t, ln, w1q_t, w1_inv_t, h, h_inv, aq_t, a_inv_t, a, a_amax_in,
         w2q_t, w2_inv_t) = output
        fp8_dgrad = cfg.dgrad.precision == "fp8"
        later1 = later2 = False
        if cfg.cache1 and cfg.need_dx and fp8_dgrad:
            w1q_t, w1_inv_t, later1 = cached_dgrad_operand(c1_data, c1_data_t, c1_inv, c1_inv_t)
        if cfg.cache2 and cfg.need_dh and fp8_dgrad:
            w2q_t, w2_inv_t, later2 = cached_dgrad_operand(c2_data, c2_data_t, c2_inv, c2_inv_t)
        ctx.w_t_later = (later1, later2)
        ctx.save_for_backward(
            (s if r is not None else x) if cfg.need_dx else None, ln_w, mean, rstd, lnq_t, ln_inv_t, ln, w1q_t, w1_inv_t,
            w1 if cfg.need_dx and not fp8_dgrad else None,
            h, h_inv, aq_t, a_inv_t, a, a_amax_in, w2q_t, w2_inv_t,
            w2 if cfg.need_dh and not fp8_dgrad else None,
            s_g1, s_x2, s_g2, seed,
        )
        ctx.cfg = cfg
        ctx.has_residual = r is not None
        ctx.dtypes = (x.dtype, w1.dtype, None if b1 is None else b1.dtype, w2.dtype, None if b2 is None else b2.dtype)

    @staticmethod
    def backward(ctx: Any, dy: Tensor | None, ds: Tensor | None, *_: Any) -> tuple[Any, ...]:  # type: ignore[override]
        # x is the normalised input: s = x + r with a residual. ds: the gradient that reached s
        # directly (the residual stream), None when s is not used or there is no residual.
        if not ctx.has_residual:
            ds = None
        (x, ln_w, mean, rstd, lnq_t, ln_inv_t, ln, w1q_t, w1_inv_t, w1, h, h_inv, aq_t, a_inv_t, a, a_amax_in,
         w2q_t, w2_inv_t, w2, s_g1, s_x2, s_g2, seed) = ctx.saved_tensors
        cfg: _Cfg = ctx.cfg
        x_dtype, w1_dtype, b1_dtype, w2_dtype, b2_dtype = ctx.dtypes
        _, _, sp_g1, sp_x2, _, sp_g2, _ = cfg.specs
        h_inv = h_inv if h_inv.numel() else None  # h holds FP8 codes when recompute stored it in FP8
        fp8_dgrad, fp8_wgrad = cfg.dgrad.precision == "fp8", cfg.wgrad.precision == "fp8"
        dx = dx_branch = dln_w = dln_b = dw1 = db1 = dw2 = db2 = None
        dh_amax = None
        if dy is None:  # only s = x + r reached the loss: its gradient passes to x and r; nothing observed
            return (_dropped(ds, seed, cfg.drop_p), ds, None, *(None,) * 23)
        with torch.no_grad():
            dy = dy.contiguous()
            # Step 1: quantize dy (and its transpose) in one pass; its amax is fc2's observation.
            if cfg.fp8:  # db2 from the same pass where it writes dy's transposed copy
                dyq, dy_inv, dyq_t, dy_inv_t, dy_amax, db2 = quantize_grad_db(
                    dy, s_g2, sp_g2, cfg.has_probe, cfg.need_dh and fp8_dgrad, cfg.need_dw2 and fp8_wgrad,
                    cfg.need_db2, b2_dtype or torch.float32,
                )
            else:
                dyq = dy_inv = dyq_t = dy_inv_t = dy_amax = None
            # Step 2: fc2's wgrad (recomputing the activation's operand if it was not kept) and db2.
            # Transients are dropped as soon as they are used: this backward is one autograd node,
            # so its saved tensors live until it returns and only the transients can go early.
            if cfg.need_dw2:
                if cfg.recompute:
                    a, _, _, aq_t, a_inv_t, _, _ = act_operands(
                        h, cfg.act, s_x2, sp_x2, need_q=False, need_t=fp8_wgrad, need_hp=not fp8_wgrad,
                        amax_in=a_amax_in if a_amax_in.numel() else None, h_inv=h_inv, hp_dtype=x_dtype,
                    )
                dw2 = gemm_wgrad(dyq_t, dy_inv_t, dy, aq_t, a_inv_t, a, cfg.wgrad, w2_dtype)
                del aq_t, a
            del dyq_t
            if cfg.need_db2 and db2 is None:
                db2 = bias_grad(dy, b2_dtype)
            if cfg.need_dh:
                # Step 3: fc2's dgrad, then dact fused with the FP8 cast of fc1's output gradient.
                da = gemm_dgrad(dyq, dy_inv, dy, dgrad_weight(w2q_t, ctx.w_t_later[1]), w2_inv_t, w2, cfg.dgrad,
                                x_dtype)  # (M, F)
                del dyq, dy
                q1, q1_t = cfg.need_dx and fp8_dgrad, cfg.need_dw1 and fp8_wgrad
                dh, dhq, dh_inv, dhq_t, dh_inv_t, dh_amax, db1_32 = dact_operands(
                    da, h, cfg.act, s_g1, sp_g1, cfg.has_probe, need_q=q1, need_t=q1_t,
                    need_hp=(cfg.need_dx and not q1) or (cfg.need_dw1 and not q1_t), dbias=cfg.need_db1,
                    h_inv=h_inv, hp_dtype=x_dtype,
                )
                del da
                if cfg.need_db1:
                    db1 = db1_32.to(b1_dtype)
                # Step 4: fc1's dgrad and the norm's backward first, so that dhq is freed before
                # fc1's wgrad allocates its (C, K) output.
                if cfg.need_dx:
                    dln = gemm_dgrad(dhq, dh_inv, dh, dgrad_weight(w1q_t, ctx.w_t_later[0]), w1_inv_t, w1, cfg.dgrad,
                                     x_dtype)
                    del dhq
                    if seed is not None:  # s = dropout(x) + r: dx is the residual's, dx_branch x's
                        dx, dx_branch, dln_w, dln_b = norm_backward_dropout(dln, x, ln_w, mean, rstd, cfg.norm, ds,
                                                                            (seed, cfg.drop_p))
                    else:
                        dx, dln_w, dln_b = norm_backward(dln, x, ln_w, mean, rstd, cfg.norm, ds)
                        dx_branch = dx
                    del dln
                if cfg.need_dw1:
                    dw1 = gemm_wgrad(dhq_t, dh_inv_t, dh, lnq_t, ln_inv_t, ln, cfg.wgrad, w1_dtype)
        probe_grad = None
        if cfg.has_probe:
            assert dy_amax is not None
            if dh_amax is None:
                dh_amax = torch.zeros_like(dy_amax)
            probe_grad = torch.stack([dh_amax.reshape(()), dy_amax.reshape(())])
        if ctx.has_residual and dx is None:  # nothing flowed back through the norm
            dx = ds
            dx_branch = _dropped(ds, seed, cfg.drop_p)
        return (dx_branch, dx if ctx.has_residual else None, None, dln_w, dln_b, dw1, db1, dw2, db2, None, None, None,
                None, None, None, None, probe_grad, *(None,) * 8, None)


def _dropped(ds: Tensor | None, seed: Tensor | None, p: float) -> Tensor | None:
    """The gradient of x for a gradient ``ds`` of s = dropout(x) + r that did not pass through the
    norm: ``ds * keep / (1 - p)`` (the norm kernels' mask), or ds without dropout."""
    if ds is None or seed is None:
        return ds
    M, K = ds.shape
    return (ds.to(torch.float32) * _ref_norm.branch_scale(seed, M, K, p, ds.device)).to(ds.dtype)


_FusedLNMLP.forward.__signature__ = inspect.signature(_FusedLNMLP.forward)  # type: ignore[attr-defined]


def _weight_caches(weight_cache: Any, fc1_weight: Tensor, fc2_weight: Tensor, state: Any, recipe: Any, fp8: bool,
                   where: str) -> tuple[WeightCache | None, WeightCache | None]:
    """``weight_cache`` checked (as :func:`fp8ops.fp8_linear` checks its own), as ``(fc1's, fc2's)``."""
    if weight_cache is None:
        return None, None
    if not fp8:
        raise ValueError(f"{where}: weight_cache is only meaningful with FP8 (a state and a recipe); "
                         f"pass weight_cache=None")
    if not isinstance(weight_cache, (tuple, list)) or len(weight_cache) != 2:
        raise TypeError(f"{where}: weight_cache must be a pair (fc1's, fc2's) of WeightCache from quantize_weight "
                        f"(or None for a weight quantized in the op), got {type(weight_cache).__name__}"
                        f"{f' of length {len(weight_cache)}' if isinstance(weight_cache, (tuple, list)) else ''}")
    for i, (c, w) in enumerate(zip(weight_cache, (fc1_weight, fc2_weight))):
        if c is not None:
            role = f"fc{i + 1}_weight"
            check_weight_cache(c, w, getattr(state, role), recipe, fp8, where, name=f"weight_cache[{i}]",
                               weight_name=role, role=role)
    return weight_cache[0], weight_cache[1]


def _sequence_parallel(x: Tensor, ln_weight: Tensor, ln_bias: Tensor | None, fc1_weight: Tensor,
                       fc1_bias: Tensor | None, fc2_weight: Tensor, fc2_bias: Tensor | None, state: Any, recipe: Any,
                       normalization: str, activation: str, eps: float, zero_centered_gamma: bool, recompute: Any,
                       grad_probe: Tensor | None, weight_cache: Any, tp_group: Any, residual: Tensor | None
                       ) -> tuple[Any, LayerNormMLPState | None]:
    """fused_ln_mlp under sequence parallelism, unfused: norm on the slice -> fc1 (column-parallel)
    -> activation -> fc2 (row-parallel), with the states of fc1 and fc2 as two LinearStates. With a
    residual the norm's kernel writes s = x + residual, and the output is ``(y, s)``."""
    where = "fused_ln_mlp"
    if recompute is not None:
        raise ValueError(f"{where}: recompute={recompute!r} is not supported with sequence_parallel; "
                         f"pass recompute=None")
    fp8 = check_state_recipe(state, recipe, LayerNormMLPState, x, where)
    check_probe(grad_probe, where, shape=(2,), name="grad_probe", device=x.device)
    _activation.check_activation(activation, where)
    c1, c2 = _weight_caches(weight_cache, fc1_weight, fc2_weight, state, recipe, fp8, where)
    # Step 1: the norm on this rank's slice; its parameters' gradients are partial sums over the group.
    ln = sequence_norm(x, ln_weight, ln_bias, normalization, eps, zero_centered_gamma, tp_group, residual)
    s = None
    if residual is not None:
        ln, s = ln
    # Step 2: fc1 (all-gathers ln), the activation, fc2 (reduce-scatters y), each with its LinearState.
    st1 = st2 = None
    if fp8:
        st1 = LinearState(input=state.fc1_input, weight=state.fc1_weight, grad_output=state.fc1_grad_output)
        st2 = LinearState(input=state.fc2_input, weight=state.fc2_weight, grad_output=state.fc2_grad_output)
    p1, p2 = (None, None) if grad_probe is None else (grad_probe[0], grad_probe[1])
    tp = {"tp_group": tp_group, "sequence_parallel": True}
    h, st1 = fp8_linear(ln, fc1_weight, fc1_bias, st1, recipe=recipe, grad_probe=p1, weight_cache=c1,
                        parallel_mode="column", **tp)
    y, st2 = fp8_linear(_activation.activation(h, activation), fc2_weight, fc2_bias, st2, recipe=recipe,
                        grad_probe=p2, weight_cache=c2, parallel_mode="row", **tp)
    out = y if s is None else (y, s)
    if not fp8:
        return out, None
    assert st1 is not None and st2 is not None
    return out, state.replace(fc1_input=st1.input, fc1_weight=st1.weight, fc2_input=st2.input, fc2_weight=st2.weight)


def fused_ln_mlp(
    x: Tensor,
    ln_weight: Tensor,
    ln_bias: Tensor | None,
    fc1_weight: Tensor,
    fc1_bias: Tensor | None,
    fc2_weight: Tensor,
    fc2_bias: Tensor | None,
    state: LayerNormMLPState | None,
    *,
    recipe: Recipe | None,
    normalization: str = "LayerNorm",
    activation: str = "gelu_tanh",
    eps: float = 1e-5,
    zero_centered_gamma: bool = False,
    recompute: str | None = None,
    grad_probe: Tensor | None = None,
    grad_probes: Tensor | None = None,
    weight_cache: tuple[WeightCache | None, WeightCache | None] | None = None,
    tp_group: Any = None,
    sequence_parallel: bool = False,
    residual: Tensor | None = None,
    residual_dropout: float = 0.0,
    dropout_seed: int | Tensor | None = None,
) -> tuple[Any, LayerNormMLPState | None]:
    """LayerNorm (or RMSNorm) -> fc1 -> activation -> fc2, with FP8 GEMMs and fused FP8 producers.

    Math::

        y = fc2(act(fc1(norm(x))))          fc(t) = dq(q(t) . q(W)^T) + b
        with a residual: s = x + residual, y = fc2(act(fc1(norm(s))))
        with residual_dropout p: s = x * keep / (1 - p) + residual
        gated activations split fc1's output h = [a | b] (first half a): swiglu = silu(a) * b,
        geglu = gelu_tanh(a) * b, reglu = relu(a) * b

    The norm kernel writes fc1's FP8 input, the activation kernel writes fc2's FP8 input (and its
    amax), and in the backward the dact kernel writes fc1's FP8 output gradient and fc1's bias
    gradient; no high-precision copy of the normalised input, the activation or dh is written.

    Args:
        x: (..., K) float32, bfloat16 or float16; y has the same dtype. Inside ``torch.autocast``
            x and every weight and bias are cast to the autocast dtype first (as
            ``F.linear(act(F.linear(F.layer_norm(x, ...))))`` gives y there) and y has the
            autocast dtype.
        ln_weight: (K,); ln_bias: (K,) or None (None for RMSNorm).
        fc1_weight: (C, K) with C = F, or 2F for gated activations; fc1_bias: (C,) or None.
        fc2_weight: (K2, F); fc2_bias: (K2,) or None.
        state: the :class:`LayerNormMLPState` of this call site, or None with ``recipe=None``
            for no FP8 (fused norm and activation kernels, high-precision GEMMs).
        recipe: the recipe the state was built with.
        normalization: ``"LayerNorm"`` or ``"RMSNorm"``.
        activation: one of gelu, gelu_tanh, relu, squared_relu, silu, qgelu, swiglu, geglu, reglu.
        eps, zero_centered_gamma: as in :func:`fp8ops.layer_norm`.
        recompute: None, or ``"activation"``: store fc1's output h in FP8 (forward format, role
            ``fc1_output``; per-tensor current scaling under a row-wise recipe) instead of h in
            the input precision and the activation's FP8 copy, and recompute that copy in the
            backward. The activation reads the stored FP8 h in forward too, so forward and
            backward agree; the output differs from ``recompute=None`` by the FP8 rounding of h.
            Saves M x C bytes plus M x F bytes of FP8 per call (bf16 input). Without FP8
            (``recipe=None``) h is stored in the input precision.
        grad_probe: this op's probe, a (2,) float32 zero (``make_probes(state)``) whose gradient
            becomes ``[amax(dh), amax(dy)]`` (fc1's and fc2's output gradients); without it the
            output gradients are quantized with current scaling. (Every op calls its probe
            ``grad_probe``; a pytree of probes, as ``transformer_layer`` takes, is ``probes``.)
        grad_probes: the old name of ``grad_probe``; still accepted, with a ``DeprecationWarning``.
        weight_cache: FP8 weights quantized once per optimizer step, as
            :func:`fp8ops.fp8_linear`'s ``weight_cache``: a pair ``(cache1, cache2)`` for
            ``fc1_weight`` and ``fc2_weight``, each a :class:`fp8ops.WeightCache` from
            ``fp8ops.quantize_weight(fc1_weight, state.fc1_weight, recipe=recipe)`` (for
            ``fc2_weight``, with ``state.fc2_weight``) or None (that weight is quantized in the
            op). ``quantize_weight`` returns the weight role's state with amax(W) recorded: put it
            back with ``state.replace(fc1_weight=...)``. A cached weight is not quantized again
            (forward and dgrad GEMMs) and its gradient still flows to it. Only with FP8; each
            cache must be built with this recipe and the role's current scale (rebuild after
            every ``fp8ops.update``) from this weight tensor. Inside ``torch.autocast`` a cached
            weight is not cast.
        tp_group: a ``torch.distributed`` process group for tensor parallelism, or None. fc1 is
            column-parallel and fc2 row-parallel: ``fc1_weight`` is this rank's (C/w, K) shard
            (for gated activations the rows of both halves a and b of this rank, a first; see
            :func:`fp8ops.shard_transformer_params`), ``fc1_bias`` its shard, ``fc2_weight`` the
            (K2, F/w) column shard; the norm's parameters and ``fc2_bias`` are replicated. y is
            summed over the group, ``fc2_bias`` added once.
        sequence_parallel: with ``tp_group``, x and y are this rank's slice of dim 0 (the
            sequence). The op then runs unfused: the norm on the slice, fc1 as a column-parallel
            :func:`fp8ops.fp8_linear` (which all-gathers the norm output), the activation, fc2 as
            a row-parallel one (reduce-scatter; dy all-gathered in the backward); with a
            per-tensor FP8 recipe both all-gathers move FP8 bytes. Not with ``recompute``.
        residual: (..., K) of x's shape and dtype, or None: the op normalises ``s = x + residual``
            (added in fp32 and rounded to x's dtype, as ``x + residual`` gives) and returns s too,
            the next residual stream of a pre-norm block (``s = x + attn; y = s + mlp(s)``). The
            norm kernel writes s in the same pass, and in the backward it adds the gradient that
            reaches s directly to the norm's dx: no separate add kernel either way. With
            ``tp_group`` and no sequence parallelism the add runs in front of the op, unfused; with
            ``sequence_parallel`` the norm on this rank's slice adds it in its kernel.
        residual_dropout: dropout probability in [0, 1) on x before the residual add (a
            pre-norm block's ``s = residual + dropout(attn)``), applied in the norm's kernel: the
            keep mask is a hash of ``(dropout_seed, row, column)`` over x's (M, K) rows
            (``fp8ops.reference.norm.branch_keep``, the attention dropout's hash), so nothing is
            stored and the backward's norm kernel writes x's gradient ``ds * keep / (1 - p)`` next
            to the residual's. Needs a residual; not with ``tp_group`` (drop x before the call).
            0 (the default): no dropout.
        dropout_seed: the seed of that mask: an int, a 1-element integer tensor, or None (drawn
            from torch's generator on x's device, so ``torch.manual_seed`` reproduces it, and a
            CUDA-graph replay draws a new one). Ignored without ``residual_dropout``.

    Returns:
        ``(y, new_state)``, or ``((y, s), new_state)`` with a residual: y (..., K2); ``new_state`` with the amaxes of the normalised input,
        W1, the activation output and W2 recorded (None without FP8; the amax of a cached weight
        is recorded by :func:`fp8ops.quantize_weight`).

    Raises:
        TypeError, ValueError: bad input (the message names the argument and the fix).

    Example:
        >>> import torch, fp8ops
        >>> r = fp8ops.DelayedScaling()
        >>> st = fp8ops.LayerNormMLPState.init(r)
        >>> x = torch.randn(8, 32, requires_grad=True)
        >>> g, beta = torch.ones(32), torch.zeros(32)
        >>> w1, w2 = torch.randn(128, 32) / 6, torch.randn(32, 64) / 8   # swiglu: fc1 writes 2 x 64
        >>> probes = fp8ops.make_probes(st)
        >>> y, st = fp8ops.fused_ln_mlp(x, g, beta, w1, None, w2, None, st, recipe=r,
        ...                             activation="swiglu", grad_probe=probes)
        >>> y.shape
        torch.Size([8, 32])
        >>> y.sum().backward()
        >>> probes.grad.shape
        torch.Size([2])

    References:
        Shazeer, "GLU Variants Improve Transformer" (2020); NVIDIA Transformer Engine ``LayerNormMLP``.
    """
    where = "fused_ln_mlp"
    if grad_probes is not None:
        if grad_probe is not None:
            raise TypeError(f"{where}: pass grad_probe only (grad_probes is its old name), got both")
        warnings.warn(f"{where}: grad_probes is renamed grad_probe (one name for an op's probe in every op); "
                      f"grad_probes will be removed in the next release", DeprecationWarning, stacklevel=2)
        grad_probe = grad_probes
    tp = tp_config(where, tp_group, None, sequence_parallel)
    check_residual_dropout(residual_dropout, residual, where)
    if residual_dropout > 0:
        if tp is not None:
            raise ValueError(f"{where}: residual_dropout is not supported with tp_group; apply the dropout to x "
                             f"before the call and pass residual_dropout=0")
    if residual is not None:
        check_residual(residual, x, where)
        if tp is not None and not tp.sp:  # the add in front of the tensor-parallel op, unfused
            s = x + residual
            y, new_state = fused_ln_mlp(
                s, ln_weight, ln_bias, fc1_weight, fc1_bias, fc2_weight, fc2_bias, state, recipe=recipe,
                normalization=normalization, activation=activation, eps=eps, zero_centered_gamma=zero_centered_gamma,
                recompute=recompute, grad_probe=grad_probe, weight_cache=weight_cache, tp_group=tp_group,
                sequence_parallel=sequence_parallel)
            return (y, s), new_state
    if tp is not None:
        check_norm_args(x, ln_weight, ln_bias, normalization, eps, zero_centered_gamma, where)
        if fc2_bias is not None:
            check_float_tensor(fc2_bias, "fc2_bias", where)
        g = tp.group
        if tp.sp:
            return _sequence_parallel(x, ln_weight, ln_bias, fc1_weight, fc1_bias, fc2_weight, fc2_bias, state,
                                      recipe, normalization, activation, eps, zero_centered_gamma, recompute,
                                      grad_probe, weight_cache, tp_group, residual)
        y, new_state = fused_ln_mlp(
            copy_to_tp(x, g), copy_to_tp(ln_weight, g), copy_to_tp(ln_bias, g), fc1_weight, fc1_bias,
            fc2_weight, None, state, recipe=recipe, normalization=normalization, activation=activation, eps=eps,
            zero_centered_gamma=zero_centered_gamma, recompute=recompute, grad_probe=grad_probe,
            weight_cache=weight_cache)
        if fc2_bias is not None and tuple(fc2_bias.shape) != (y.shape[-1],):
            raise ValueError(f"{where}: fc2_bias must have shape (K2,) = ({y.shape[-1]},), got {tuple(fc2_bias.shape)}")
        return row_output(y, fc2_bias, tp, where), new_state
    ac = autocast_dtype(x.device.type) if isinstance(x, Tensor) else None
    if ac is not None:
        # torch.autocast: every floating input in the autocast dtype (outside the autograd Function,
        # so gradients reach the originals in their dtype), then the op with autocast off inside. A
        # cached FP8 weight is used as it is (its source weight is not cast: the cache checks identity).
        x, ln_weight, ln_bias, fc1_bias, fc2_bias, residual = autocast_inputs(ac, x, ln_weight, ln_bias, fc1_bias,
                                                                              fc2_bias, residual)
        c1, c2 = weight_cache if isinstance(weight_cache, (tuple, list)) and len(weight_cache) == 2 else (None, None)
        if c1 is None:
            (fc1_weight,) = autocast_inputs(ac, fc1_weight)
        if c2 is None:
            (fc2_weight,) = autocast_inputs(ac, fc2_weight)
        with torch.autocast(x.device.type, enabled=False):
            return fused_ln_mlp(
                x, ln_weight, ln_bias, fc1_weight, fc1_bias, fc2_weight, fc2_bias, state, recipe=recipe,
                normalization=normalization, activation=activation, eps=eps,
                zero_centered_gamma=zero_centered_gamma, recompute=recompute, grad_probe=grad_probe,
                weight_cache=weight_cache, residual=residual, residual_dropout=residual_dropout,
                dropout_seed=dropout_seed)
    K = check_norm_args(x, ln_weight, ln_bias, normalization, eps, zero_centered_gamma, where)
    _activation.check_activation(activation, where)
    C = check_weight(fc1_weight, fc1_bias, K, x, "fc1_weight", where)
    gated = activation in _activation.GATED
    if gated and C % 2:
        raise ValueError(
            f"{where}: activation {activation!r} is gated and splits fc1's output in two halves, "
            f"but fc1_weight has an odd number of rows ({C}); use 2 x ffn rows"
        )
    F = C // 2 if gated else C
    K2 = check_weight(fc2_weight, fc2_bias, F, x, "fc2_weight", where)
    fp8 = check_state_recipe(state, recipe, LayerNormMLPState, x, where)
    if recompute not in (None, "activation"):
        raise ValueError(f"{where}: recompute must be None or 'activation', got {recompute!r}")
    check_probe(grad_probe, where, shape=(2,), name="grad_probe", device=x.device)
    if grad_probe is not None and not fp8:
        raise ValueError(f"{where}: grad_probe is only meaningful with FP8 (a state and a recipe); pass None")
    c1, c2 = _weight_caches(weight_cache, fc1_weight, fc2_weight, state, recipe, fp8, where)
    grad_on = torch.is_grad_enabled()

    def needs(t: Tensor | None) -> bool:
        return grad_on and t is not None and t.requires_grad

    if fp8:
        assert state is not None and recipe is not None
        roles = tuple(LayerNormMLPState.ROLES)
        specs = tuple(QuantSpec.of(recipe, LayerNormMLPState.ROLES[n], getattr(state, n).calibrated) for n in roles)
        if specs[-1].mode == "rowwise":  # fc1's stored output is dequantized per tensor by the activation kernels
            specs = (*specs[:-1], specs[-1]._replace(mode="current"))
        gemms = (recipe.fprop, recipe.dgrad, recipe.wgrad)
        scales: list[Tensor | None] = []
        for n in roles:  # autograd.Function under torch.compile rejects one tensor passed twice
            s = getattr(state, n).scale
            scales.append(s.clone() if any(s is o for o in scales) else s)
    else:
        specs, gemms, scales = (None,) * 7, (HIGH, HIGH, HIGH), [None] * 7
    cfg = _Cfg(
        norm=NormCfg(normalization == "RMSNorm", float(eps), bool(zero_centered_gamma), ln_bias is not None),
        act=activation, fp8=fp8, recompute=recompute == "activation", specs=specs,
        fprop=gemms[0], dgrad=gemms[1], wgrad=gemms[2], has_probe=grad_probe is not None,
        need_dx=needs(x) or needs(residual) or needs(ln_weight) or needs(ln_bias),
        need_dw1=needs(fc1_weight), need_db1=needs(fc1_bias),
        need_dw2=needs(fc2_weight), need_db2=needs(fc2_bias), cache1=c1 is not None, cache2=c2 is not None,
        drop_p=float(residual_dropout),
    )
    seed = _seed_tensor(dropout_seed, x.device, where) if residual_dropout > 0 else None
    lead = x.shape[:-1]
    refuse_compiled_transform(where, x)
    cached: list[Tensor | None] = []
    for c in (c1, c2):
        cached += [None] * 4 if c is None else [c.value.data, c.value.data_t, c.value.inv_scale, c.inv_scale_t]
    r2 = None if residual is None else residual.reshape(-1, K)
    y, s2, ln_amax, w1_amax, a_amax, w2_amax, h_amax, *_ = apply(
        _FusedLNMLP, x.reshape(-1, K), r2, seed, ln_weight, ln_bias, fc1_weight, fc1_bias, fc2_weight, fc2_bias, *scales,
        grad_probe, *cached, cfg
    )
    new_state = None
    if fp8:
        assert state is not None
        seen = {"fc1_input": ln_amax, "fc2_input": a_amax}
        if c1 is None:  # a cached weight's amax is recorded by quantize_weight
            seen["fc1_weight"] = w1_amax
        if c2 is None:
            seen["fc2_weight"] = w2_amax
        if cfg.recompute:  # fc1's output was quantized (stored in FP8) only then
            seen["fc1_output"] = h_amax
        new_state = state.replace(**{n: getattr(state, n)._observe_amax(a) for n, a in seen.items()})
    if residual is not None:
        return (y.reshape(*lead, K2), s2.reshape(*lead, K)), new_state
    return y.reshape(*lead, K2), new_state

