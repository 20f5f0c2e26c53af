"""fake_quantize: a differentiable FP8 quantize-dequantize with the full state protocol.

Forward: ``y = dequantize(quantize(x))`` with the input's state (E4M3 under HYBRID). Backward:
``dx = dequantize(quantize(dy))`` with the output-gradient state (E5M2 under HYBRID), a
straight-through estimator through the rounding; ``amax(dy)`` leaves as the gradient of
``grad_probe``. It is the smallest op that exercises every part of the state design, and the tool
for studying a recipe's numerics on any model (insert it where a GEMM would quantize).
"""

from __future__ import annotations

import inspect
from typing import Any, ClassVar

import torch
from torch import Tensor

from .formats import Role
from ._glue import apply, cast, refuse_compiled_transform
from ._checks import check_float_tensor, check_probe, check_recipe
from .quantize import QuantSpec, quantize_2d
from .recipes import Recipe
from .state import OpState, ScalingState, validate_state

__all__ = ["FakeQuantState", "fake_quantize"]


class FakeQuantState(OpState):
    """State of one :func:`fake_quantize` call site: ``input`` (forward) and ``grad_output`` (backward).

    Build it with ``FakeQuantState.init(recipe, device=...)``. Its probe is a 0-d float32 zero.

    Example:
        >>> import fp8ops
        >>> st = fp8ops.FakeQuantState.init(fp8ops.DelayedScaling())
        >>> st.grad_output.role
        'backward'
    """

    ROLES: ClassVar[dict[str, Role]] = {"input": "forward", "grad_output": "backward"}
    PROBE_ROLES: ClassVar[tuple[str, ...]] = ("grad_output",)
    input: ScalingState
    grad_output: ScalingState


def _qdq(x: Tensor, scale: Tensor | None, spec: QuantSpec) -> tuple[Tensor, Tensor]:
    K = x.shape[-1]
    data, inv, _, amax = quantize_2d(x.reshape(-1, K), scale, spec)
    y = cast(data.to(torch.float32) * inv, x.dtype)
    return y.reshape(x.shape), amax


class _FakeQuantize(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(  # type: ignore[override]
        x: Tensor,
        in_scale: Tensor,
        grad_scale: Tensor,
        probe: Tensor | None,
        in_spec: QuantSpec,
        grad_spec: QuantSpec,
    ) -> tuple[Tensor, Tensor]:
        return _qdq(x, in_scale, in_spec)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        _, _, grad_scale, probe, _, grad_spec = inputs
        ctx.save_for_backward(grad_scale)
        ctx.grad_spec = grad_spec
        ctx.has_probe = probe is not None
        ctx.mark_non_differentiable(output[1])

    @staticmethod
    def backward(ctx: Any, dy: Tensor, _damax: Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        (grad_scale,) = ctx.saved_tensors
        with torch.no_grad():
            if ctx.has_probe:
                dx, amax = _qdq(dy, grad_scale, ctx.grad_spec)
            else:
                # No probe: the gradient is quantized with current scaling, and nothing is recorded.
                spec = ctx.grad_spec
                dx, amax = _qdq(dy, None, spec._replace(mode="current"))
        return dx, None, None, (amax if ctx.has_probe else None), None, None


# Under torch.compile and torch.func, autograd.Function.apply binds the arguments with
# inspect.signature(forward) on every call; a stored signature makes that lookup immediate (eager
# calls skip the binding: _glue.apply).
_FakeQuantize.forward.__signature__ = inspect.signature(_FakeQuantize.forward)  # type: ignore[attr-defined]


def fake_quantize(
    x: Tensor,
    state: FakeQuantState,
    *,
    recipe: Recipe,
    grad_probe: Tensor | None = None,
) -> tuple[Tensor, FakeQuantState]:
    """Differentiable FP8 quantize-dequantize of ``x``, with FP8 quantization of its gradient.

    Math::

        y  = dq(q(x;  s_in))          s_in   = state.input.scale (delayed) or just in time
        dx = dq(q(dy; s_grad))        s_grad = state.grad_output.scale, or current scaling without a probe
        grad of grad_probe = amax(dy)

    Args:
        x: (..., K) float32, bfloat16 or float16. ``torch.autocast`` does not change it: like
            ``torch.fake_quantize_per_tensor_affine`` (an elementwise op on no autocast list), y
            keeps x's dtype; a GEMM that consumes y casts it to the autocast dtype itself.
        state: a :class:`FakeQuantState` built with ``recipe``.
        recipe: the scaling recipe.
        grad_probe: a 0-d float32 zero. Under plain autograd a fresh leaf with
            ``requires_grad=True`` per forward (see :func:`fp8ops.make_probes`); under
            ``torch.func`` an argument you differentiate with respect to. Its gradient is
            ``amax(dy)``, to pass to :func:`fp8ops.update`. Without a probe the gradient is
            quantized with current scaling and not recorded.

    Returns:
        ``(y, new_state)``: y has the shape and dtype of x; ``new_state.input.pending_amax`` has
        this call's ``amax(x)`` max-merged in. The input state is not modified.

    Raises:
        TypeError, ValueError: bad input (the message names the argument and the fix).

    Example:
        >>> import torch, fp8ops
        >>> r = fp8ops.DelayedScaling()
        >>> st = fp8ops.FakeQuantState.init(r)
        >>> x = torch.randn(4, 8, requires_grad=True)
        >>> probe = torch.zeros((), requires_grad=True)
        >>> y, st = fp8ops.fake_quantize(x, st, recipe=r, grad_probe=probe)
        >>> (y * 3.0).sum().backward()
        >>> probe.grad
        tensor(3.)
        >>> st = fp8ops.update(st, recipe=r, grad_amax=probe.grad)
        >>> st.grad_output.scale  # 57344 / 3
        tensor(19114.6660)

    Note:
        ``torch.compile`` around ``torch.func.grad`` of a function that calls this op raises an
        error (the ops are opaque to the compiler); compile the loss and call ``.backward()``, or
        use ``torch.func`` eagerly.
    """
    where = "fake_quantize"
    check_float_tensor(x, "x", where, min_dim=1)
    check_recipe(recipe, where)
    if not isinstance(state, FakeQuantState):
        raise TypeError(f"{where}: state must be a FakeQuantState (FakeQuantState.init(recipe)), got {type(state).__name__}")
    if recipe.mode == "rowwise":
        raise ValueError(f"{where}: row-wise scaling is not supported here; use CurrentScaling(granularity='tensor')")
    validate_state(state.input, where=f"{where}: state.input", device=x.device, recipe=recipe)
    validate_state(state.grad_output, where=f"{where}: state.grad_output", device=x.device, recipe=recipe)
    check_probe(grad_probe, where, device=x.device)
    in_scale, grad_scale = state.input.scale, state.grad_output.scale
    if grad_scale is in_scale:
        # The same tensor twice breaks autograd.Function under torch.compile.
        grad_scale = grad_scale.clone()
    in_spec = QuantSpec.of(recipe, "forward", state.input.calibrated)
    grad_spec = QuantSpec.of(recipe, "backward", state.grad_output.calibrated)
    refuse_compiled_transform(where, x)
    y, amax = apply(_FakeQuantize, x, in_scale, grad_scale, grad_probe, in_spec, grad_spec)
    return y, state.replace(input=state.input._observe_amax(amax))
