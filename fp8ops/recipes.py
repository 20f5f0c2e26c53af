"""Scaling recipes: static, hashable configuration that owns the scaling math.

A recipe builds states (``recipe.init(role=...)``) and updates them once per optimizer step
(``recipe.update(state, grad_amax=...)``; :func:`fp8ops.update` does a whole model at once). Ops
read from the recipe only how to quantize: with the scale in the state (delayed scaling), with a
scale computed just in time from the tensor's own amax (current scaling), or per row.

Scale rule (Transformer Engine's)::

    amax  = max(history)                     # or history[0] ("most_recent"), or a callable
    scale = fp8_max / amax / 2**margin       # optionally rounded down to a power of two
    scale = old scale   if amax == 0 or amax is not finite

New recipes subclass :class:`Recipe` and need no kernel change.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

import attrs
import torch
from torch import Tensor

from .formats import Format, Role, check_role
from .state import ScalingState, _check_built_for
from .update import _grad_amax_leaf

__all__ = ["CurrentScaling", "DelayedScaling", "GemmSpec", "Recipe", "compute_scale"]

_FLT_MAX = torch.finfo(torch.float32).max
_FLT_TINY = torch.finfo(torch.float32).tiny
_INF = float("inf")

QuantMode = Literal["delayed", "current", "rowwise"]


def compute_scale(
    amax: Tensor,
    old_scale: Tensor,
    fp8_max: float | Tensor,
    *,
    margin: int = 0,
    power_2_scale: bool = False,
) -> Tensor:
    """``fp8_max / amax / 2**margin``, keeping ``old_scale`` where amax is 0 or not finite.

    A quotient that overflows float32 (a tiny amax) becomes the largest float32, one that
    underflows (a huge margin) the smallest normal float32; with
    ``power_2_scale`` the result is rounded down to a power of two (exactly, from its exponent).
    Works elementwise on tensors of any shape.

    Example:
        >>> import torch
        >>> from fp8ops import compute_scale
        >>> compute_scale(torch.tensor([7.0, 0.0]), torch.tensor([1.0, 3.0]), 448.0)
        tensor([64.,  3.])
    """
    amax = amax.to(torch.float32)
    # tensor / tensor is one correctly rounded division (a Python number over a tensor would be
    # reciprocal-then-multiply: two roundings); the kernels compute the same quotient.
    if isinstance(fp8_max, Tensor) or torch.compiler.is_compiling():
        fmax = torch.as_tensor(fp8_max, dtype=torch.float32, device=amax.device)
    else:  # eager: a fill, not a copy from host memory (that would synchronize the host with a GPU)
        fmax = torch.full((), float(fp8_max), dtype=torch.float32, device=amax.device)
    sf = (fmax / amax) / (2.0**margin)
    # keep the scale a normal float32: a tiny amax overflows the quotient, a huge margin underflows it
    sf = torch.clamp(sf, min=_FLT_TINY, max=_FLT_MAX)
    if power_2_scale:
        sf = _pow2_floor(sf)
    valid = (amax > 0) & (amax < _INF)  # finite and positive (NaN compares False)
    return torch.where(valid, sf, old_scale.to(torch.float32))


def _pow2_floor(x: Tensor) -> Tensor:
    # Keep the exponent bits of a positive float32, clear the mantissa: 2**floor(log2(x)).
    bits = x.contiguous().view(torch.int32) & 0x7F800000
    return bits.view(torch.float32)


def _check_format(inst: Any, attribute: Any, value: Any) -> None:
    if not isinstance(value, Format):
        raise TypeError(f"{type(inst).__name__}: fp8_format must be a fp8ops.Format, got {value!r}")


def _check_margin(inst: Any, attribute: Any, value: Any) -> None:
    # attrs runs validators after every field is set, fp8_format's (defined first) before this one.
    fmt = inst.fp8_format
    hi = fmt.max_margin()
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= hi:
        raise ValueError(
            f"{type(inst).__name__}: margin must be an int in [0, {hi}] for fp8_format={fmt} "
            f"(fp8_max / 2**margin must stay at least the format's smallest normal number, "
            f"or whole tensors flush to zero), got {value!r}"
        )


def _check_bool(inst: Any, attribute: Any, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{type(inst).__name__}: {attribute.name} must be a bool, got {value!r}")


def _check_precision(inst: Any, attribute: Any, value: Any) -> None:
    if value not in ("fp8", "high"):
        raise ValueError(f"GemmSpec: precision must be 'fp8' or 'high', got {value!r}")


def _check_backend(inst: Any, attribute: Any, value: Any) -> None:
    if value not in ("auto", "triton", "cublas"):
        raise ValueError(f"GemmSpec: backend must be 'auto', 'triton' or 'cublas', got {value!r}")


@attrs.frozen(kw_only=True)
class GemmSpec:
    """How one GEMM of a linear layer runs (forward ``fprop``, ``dgrad`` or ``wgrad``).

    Args:
        precision: "fp8" (FP8 operands, the default) or "high" (the unquantized operands in
            their own dtype, e.g. bf16: a per-GEMM precision escape).
        fast_accum: FP8 accumulation mode. True is the tensor cores' fast mode (cuBLAS's
            ``use_fast_accum``, Triton's default on Hopper); False promotes partial sums to
            float32 regularly (Transformer Engine's split accumulator), slower but more precise.
        backend: "auto" (the measured-faster one for the shape), "triton" (fp8ops's GEMM
            kernel) or "cublas" (``torch._scaled_mm``). On the CPU both run the reference.

    Example:
        >>> import fp8ops
        >>> r = fp8ops.DelayedScaling(wgrad=fp8ops.GemmSpec(precision="high"))
        >>> r.wgrad.precision, r.dgrad.fast_accum
        ('high', False)
    """

    precision: Literal["fp8", "high"] = attrs.field(default="fp8", validator=_check_precision)
    fast_accum: bool = attrs.field(default=False, validator=_check_bool)
    backend: Literal["auto", "triton", "cublas"] = attrs.field(default="auto", validator=_check_backend)


def _check_gemm(inst: Any, attribute: Any, value: Any) -> None:
    if not isinstance(value, GemmSpec):
        raise TypeError(f"{type(inst).__name__}: {attribute.name} must be a fp8ops.GemmSpec, got {value!r}")


_FPROP_DEFAULT = GemmSpec(fast_accum=True)
_GRAD_DEFAULT = GemmSpec(fast_accum=False)


class Recipe:
    """Base class of scaling recipes (subclasses are ``attrs.frozen``, keyword-only, hashable).

    A recipe defines ``fp8_format``, ``margin``, ``power_2_scale``, the quantization ``mode``
    ("delayed", "current" or "rowwise"), :meth:`init` and the scale rule used by :meth:`update`.
    """

    fp8_format: Format
    margin: int
    power_2_scale: bool
    fprop: GemmSpec
    dgrad: GemmSpec
    wgrad: GemmSpec

    @property
    def mode(self) -> QuantMode:
        raise NotImplementedError

    @property
    def history_len(self) -> int:
        raise NotImplementedError

    def dtype(self, role: Role) -> torch.dtype:
        """The FP8 dtype used for tensors of ``role``."""
        return self.fp8_format.dtype(role)

    def fp8_max(self, role: Role) -> float:
        """The largest finite value of :meth:`dtype` for ``role``."""
        return self.fp8_format.max(role)

    def init(self, *, role: Role = "forward", device: torch.device | str | None = None) -> ScalingState:
        """A fresh state for a tensor of ``role``: empty history, scale 1, nothing pending.

        The state records this recipe's FP8 dtype for ``role`` and its ``mode``: ops and updates
        refuse it with a recipe of another dtype or mode. A delayed-scaling state starts
        uncalibrated (the first step quantizes with current scaling).
        """
        check_role(role, where=f"{type(self).__name__}.init")
        return ScalingState._make(
            torch.zeros(self.history_len, dtype=torch.float32, device=device),
            torch.ones((), dtype=torch.float32, device=device),
            torch.zeros((), dtype=torch.float32, device=device),
            role,
            self.mode != "delayed",
            self.dtype(role),
            self.mode,
        )

    def amax_from_history(self, history: Tensor) -> Tensor:
        """Reduce ``history`` (..., L), index 0 newest, to the amax the scale is computed from."""
        return history.amax(-1)

    def scale_from_amax(self, amax: Tensor, old_scale: Tensor, fp8_max: Tensor) -> Tensor:
        """The new scale; the default is :func:`compute_scale` with this recipe's margin."""
        return compute_scale(amax, old_scale, fp8_max, margin=self.margin, power_2_scale=self.power_2_scale)

    def update(self, state: ScalingState, grad_amax: Tensor | None = None) -> ScalingState:
        """One optimizer step's update of one state.

        The observation is ``max(state.pending_amax, grad_amax)``; a non-finite observation is
        recorded as 0 (no information), so NaN/Inf never enter the history; the history rolls
        (the observation becomes index 0); the scale is recomputed; ``pending_amax`` is cleared.
        An uncalibrated state that observed nothing (0 or non-finite) is left as it is, pending
        cleared, and stays uncalibrated (see :func:`fp8ops.update`). ``grad_amax`` may be a probe
        itself (a leaf that requires grad): its ``.grad`` is used.
        """
        where = f"{type(self).__name__}.update"
        if not isinstance(state, ScalingState):
            raise TypeError(f"{where}: state must be a ScalingState, got {type(state).__name__}")
        g = _grad_amax_leaf(grad_amax, where=f"{where}: grad_amax")
        obs = state.pending_amax
        if g is not None:
            obs = torch.maximum(obs, g.detach().to(torch.float32))
            state = state.replace(observed=True)
        return self.update_many([state], obs.reshape(1))[0]

    def update_many(self, states: Sequence[ScalingState], obs: Tensor) -> list[ScalingState]:
        """Batched :meth:`update`: ``obs`` (S,) holds one merged observation per state, or (2, S)
        two observations per state (a pending and a gradient amax), merged by their maximum.

        Host sync: only when some uncalibrated state was observed (``observed`` not False), one
        read of those states' observations (whether each saw anything decides its static
        ``calibrated``); calibrated and unobserved states never sync.

        On a GPU, in eager mode and with the default ``amax_from_history`` and ``scale_from_amax``
        (``amax_compute_algo`` "max" or "most_recent", no ``scaling_factor_compute_algo``), the
        arithmetic of all states runs in one kernel (``kernels/_update.py``) instead of a dozen
        torch operations; the histories and scales of states that the previous update returned
        are read where they are, without a stack.
        """
        where = f"{type(self).__name__}.update"
        for s in states:
            if not isinstance(s, ScalingState):
                raise TypeError(f"{where}: expected ScalingStates, got a {type(s).__name__}")
            _check_built_for(s, self, where=where)
        return self._update_built(states, obs)

    def _update_built(self, states: Sequence[ScalingState], obs: Tensor) -> list[ScalingState]:
        """:meth:`update_many` of states already checked to be ScalingStates built for this recipe
        (``fp8ops.update`` checks each one as it collects them)."""
        where = f"{type(self).__name__}.update"
        for s in states:
            L = s.amax_history.shape[-1]
            if L != self.history_len:
                raise ValueError(
                    f"{where}: state.amax_history has length {L} but this recipe "
                    f"keeps {self.history_len}; build the state with this recipe's init()"
                )
        if not states:
            return []
        S = len(states)
        device = states[0].amax_history.device
        fmax = _constants(tuple(self.fp8_max(s.role) for s in states), device)
        if obs.dim() == 2 and tuple(obs.shape) != (2, S):
            raise ValueError(f"{where}: obs must have shape ({S},) or (2, {S}), got {tuple(obs.shape)}")
        algo = self._fused_algo()
        zeros_out = None
        if algo is not None and device.type == "cuda" and _eager_kernels_ok(obs, states):
            from fp8ops.kernels._update import scale_update_launch

            hist, new_scale, seen, zeros_out = scale_update_launch(
                obs.to(dtype=torch.float32).reshape(-1), _rows([s.amax_history for s in states]), _rows([s.scale for s in states]), fmax,
                margin=self.margin, power_2=self.power_2_scale, most_recent=algo == "most_recent")
        else:
            hist = torch.stack([s.amax_history for s in states])  # (S, L)
            scale = torch.stack([s.scale for s in states])  # (S,)
            o = obs.to(device=device, dtype=torch.float32)
            o = o.amax(0) if o.dim() == 2 else o.reshape(S)  # NaN propagates, as in torch.maximum
            # (x.abs() < inf is isfinite in two kernels instead of four; NaN compares False)
            finite = o.abs() < _INF
            seen = finite & (o > 0)  # (S,) the step observed something
            # A non-finite observation is recorded as 0 ("no information"): it never enters the history.
            o = torch.where(finite, o, 0.0)
            hist = torch.cat([o[:, None], hist[:, :-1]], dim=1)
            amax = self.amax_from_history(hist)
            _check_result(amax, (S,), where=where, what=self._amax_algo_name(),
                          of=f"a history of shape {tuple(hist.shape)}", hint="reduce over the last dim only, e.g. h.amax(-1)")
            new_scale = self.scale_from_amax(amax, scale, fmax)
            _check_result(new_scale, (S,), where=where, what=self._scale_algo_name(), of=f"amaxes of shape {(S,)}",
                          hint="compute elementwise")
        # An update that observed nothing must not calibrate a state: `calibrated` is static, so
        # this reads the observations of the uncalibrated states on the host (first steps only).
        # A state no op observed (static `observed` False) saw nothing, no read needed.
        skip = {j for j, s in enumerate(states) if not s.calibrated and s.observed is False}
        uncal = [j for j, s in enumerate(states) if not s.calibrated and s.observed is not False]
        if uncal:
            flags = seen[uncal].tolist()
            skip |= {j for j, f in zip(uncal, flags) if not f}
        # every cleared pending amax is a view of one zero vector: one kernel, not one per state;
        # the per-state rows come from one unbind each (one dispatcher call, not one per state)
        zeros = (zeros_out if zeros_out is not None else torch.zeros(S, dtype=torch.float32, device=device)).unbind(0)
        cleared = [zeros[j] if s.pending_amax.dim() == 0 and s.pending_amax.device == hist.device
                   else torch.zeros_like(s.pending_amax) for j, s in enumerate(states)]
        hist_rows, scale_rows = hist.unbind(0), new_scale.unbind(0)
        return [
            s.replace(pending_amax=cleared[j], observed=False)
            if j in skip
            else s.replace(
                amax_history=hist_rows[j],
                scale=scale_rows[j],
                pending_amax=cleared[j],
                calibrated=True,
                observed=False,
            )
            for j, s in enumerate(states)
        ]

    def _fused_algo(self) -> str | None:
        """"max" or "most_recent" when this recipe's update is the default arithmetic that the
        fused kernel computes (``amax_from_history`` and ``scale_from_amax`` not overridden), else None."""
        cls = type(self)
        if cls.amax_from_history is Recipe.amax_from_history and cls.scale_from_amax is Recipe.scale_from_amax:
            return "max"
        return None

    def _amax_algo_name(self) -> str:
        return "amax_from_history"

    def _scale_algo_name(self) -> str:
        return "scale_from_amax"


def _eager_kernels_ok(obs: Tensor, states: Sequence[ScalingState]) -> bool:
    """Whether the fused update kernel may run: eager mode (torch.compile traces the torch
    operations, which Inductor fuses itself), no torch.func transform, plain float32 tensors on
    one device, histories of at most 4096 steps."""
    if torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active():
        return False
    dev = obs.device
    if states[0].amax_history.shape[-1] > 4096:  # the kernel keeps a whole history row in registers
        return False
    return type(obs) is Tensor and all(
        type(s.amax_history) is Tensor and type(s.scale) is Tensor and s.amax_history.device == dev
        and s.scale.device == dev and s.amax_history.dtype == torch.float32 and s.scale.dtype == torch.float32
        for s in states)


def _rows(ts: Sequence[Tensor]) -> Tensor:
    """``torch.stack(ts)``, or, when the tensors are already consecutive rows of one buffer (as the
    rows an update returned are), that buffer viewed as (len(ts), ...) without a copy."""
    first = ts[0]
    n = first.numel()
    if first.dim() <= 1 and (first.dim() == 0 or first.stride(0) == 1):
        base, off = first.untyped_storage().data_ptr(), first.storage_offset()
        if all(t.shape == first.shape and (t.dim() == 0 or t.stride(0) == 1) and t.untyped_storage().data_ptr() == base
               and t.storage_offset() == off + j * n for j, t in enumerate(ts)):
            return first.as_strided((len(ts), *first.shape), (n, *first.stride()))
    return torch.stack(list(ts))


_CONSTANTS: dict[tuple[torch.device, tuple[float, ...]], Tensor] = {}


def _constants(values: tuple[float, ...], device: torch.device) -> Tensor:
    """``torch.tensor(values)`` on ``device``, made once per device and values in eager mode: a
    tensor built from host memory on a GPU is a synchronizing copy, which must not happen in every
    step (nor inside a CUDA graph capture). Under torch.compile it is a traced constant."""
    if device.type == "cpu" or torch.compiler.is_compiling():
        return torch.tensor(values, dtype=torch.float32, device=device)
    key = (device, values)
    t = _CONSTANTS.get(key)
    if t is None:
        t = _CONSTANTS[key] = torch.tensor(values, dtype=torch.float32, device=device)
    return t


def _check_result(t: Any, want: tuple[int, ...], *, where: str, what: str, of: str, hint: str) -> None:
    """A recipe hook's result must be a tensor of one value per state: it must not mix states."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{where}: {what} must return a Tensor, got {type(t).__name__}")
    if tuple(t.shape) != want:
        raise ValueError(
            f"{where}: {what} must map {of} to shape {want}, one value per state, got shape {tuple(t.shape)} "
            f"(one state's scale must not depend on another's amax: {hint})"
        )


def _check_history_len(inst: Any, attribute: Any, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"DelayedScaling: amax_history_len must be an int >= 1, got {value!r}")


def _check_amax_algo(inst: Any, attribute: Any, value: Any) -> None:
    if not (value in ("max", "most_recent") or callable(value)):
        raise ValueError(f"DelayedScaling: amax_compute_algo must be 'max', 'most_recent' or a callable, got {value!r}")


def _check_sf_algo(inst: Any, attribute: Any, value: Any) -> None:
    if value is not None and not callable(value):
        raise TypeError(f"DelayedScaling: scaling_factor_compute_algo must be None or a callable, got {value!r}")


@attrs.frozen(kw_only=True)
class DelayedScaling(Recipe):
    """Delayed scaling: quantize with the scale from past steps' amaxes (Transformer Engine's).

    The op reads the scale from the state and computes the amax in the same pass as the cast (one
    launch); the amax is recorded, and the scale changes only in :meth:`update`, once per
    optimizer step. A state that no update has seen observe anything (``calibrated=False``) is
    quantized with current scaling, so the first step calibrates instead of using scale 1.

    Args:
        fp8_format: :class:`Format`; default HYBRID (E4M3 forward, E5M2 gradients).
        margin: the scale is divided by ``2**margin``; at most ``fp8_format.max_margin()`` (14 for
            E4M3 and HYBRID, 29 for E5M2), beyond which a tensor's largest value would land below
            the format's smallest normal number.
        amax_history_len: steps kept in ``amax_history``.
        amax_compute_algo: "max" (over the history), "most_recent", or a callable mapping a
            history (..., L) with index 0 newest to the amax (...).
        scaling_factor_compute_algo: None, or a callable ``(amax, old_scale, fp8_max, recipe) ->
            scale`` replacing ``fp8_max / amax / 2**margin``; elementwise over tensors. An amax of 0
            or non-finite still keeps the old scale.
        power_2_scale: round scales down to a power of two (exact scaling, no mantissa error).
        fprop, dgrad, wgrad: :class:`GemmSpec` of each GEMM of a linear layer (precision,
            accumulation mode, backend); defaults: fast accumulation for fprop, full precision
            for dgrad and wgrad.

    Raises:
        TypeError, ValueError: an argument out of its domain (the message names it).

    Example:
        >>> import torch, fp8ops
        >>> r = fp8ops.DelayedScaling(amax_history_len=4, margin=1)
        >>> s = r.init(role="forward").observe(torch.tensor(3.5))
        >>> r.update(s).scale  # 448 / 3.5 / 2
        tensor(64.)
    """

    fp8_format: Format = attrs.field(default=Format.HYBRID, validator=_check_format)
    margin: int = attrs.field(default=0, validator=_check_margin)
    amax_history_len: int = attrs.field(default=16, validator=_check_history_len)
    amax_compute_algo: str | Callable[[Tensor], Tensor] = attrs.field(default="max", validator=_check_amax_algo)
    scaling_factor_compute_algo: Callable[..., Tensor] | None = attrs.field(default=None, validator=_check_sf_algo)
    power_2_scale: bool = attrs.field(default=False, validator=_check_bool)
    fprop: GemmSpec = attrs.field(default=_FPROP_DEFAULT, validator=_check_gemm)
    dgrad: GemmSpec = attrs.field(default=_GRAD_DEFAULT, validator=_check_gemm)
    wgrad: GemmSpec = attrs.field(default=_GRAD_DEFAULT, validator=_check_gemm)

    @property
    def mode(self) -> QuantMode:
        return "delayed"

    @property
    def history_len(self) -> int:
        return self.amax_history_len

    def _fused_algo(self) -> str | None:
        cls = type(self)
        if (self.scaling_factor_compute_algo is None and not callable(self.amax_compute_algo)
                and cls.amax_from_history is DelayedScaling.amax_from_history
                and cls.scale_from_amax is DelayedScaling.scale_from_amax):
            return str(self.amax_compute_algo)
        return None

    def _amax_algo_name(self) -> str:
        return "amax_compute_algo" if callable(self.amax_compute_algo) else "amax_from_history"

    def _scale_algo_name(self) -> str:
        return "scale_from_amax" if self.scaling_factor_compute_algo is None else "scaling_factor_compute_algo"

    def amax_from_history(self, history: Tensor) -> Tensor:
        if self.amax_compute_algo == "max":
            return history.amax(-1)
        if self.amax_compute_algo == "most_recent":
            return history[..., 0]
        return self.amax_compute_algo(history)  # type: ignore[operator]

    def scale_from_amax(self, amax: Tensor, old_scale: Tensor, fp8_max: Tensor) -> Tensor:
        if self.scaling_factor_compute_algo is None:
            return super().scale_from_amax(amax, old_scale, fp8_max)
        sf = self.scaling_factor_compute_algo(amax, old_scale, fp8_max, self)
        # Checked here: torch.where below would broadcast a single value to every state.
        _check_result(sf, tuple(amax.shape), where=f"{type(self).__name__}.update", what="scaling_factor_compute_algo",
                      of=f"amaxes of shape {tuple(amax.shape)}", hint="compute elementwise")
        sf = sf.to(torch.float32)
        if self.power_2_scale:
            sf = _pow2_floor(sf)
        ok = torch.isfinite(amax) & (amax > 0) & torch.isfinite(sf) & (sf > 0)
        return torch.where(ok, sf, old_scale)


def _check_granularity(inst: Any, attribute: Any, value: Any) -> None:
    if value not in ("tensor", "row"):
        raise ValueError(f"CurrentScaling: granularity must be 'tensor' or 'row', got {value!r}")


@attrs.frozen(kw_only=True)
class CurrentScaling(Recipe):
    """Current (just-in-time) scaling: the scale comes from the tensor's own amax.

    ``granularity="tensor"``: one scale per tensor, an amax pass then a cast (two launches).
    ``granularity="row"``: one scale per row of the (M, K) view, one launch. The state, if one is
    passed, records the amax for monitoring and gives the scale used when the amax is 0 or not
    finite; its history has length 1.

    Args:
        fp8_format: :class:`Format`; default HYBRID.
        margin: the scale is divided by ``2**margin``; at most ``fp8_format.max_margin()``.
        power_2_scale: round scales down to a power of two.
        granularity: "tensor" or "row".
        fprop, dgrad, wgrad: :class:`GemmSpec` of each GEMM of a linear layer.

    Example:
        >>> import torch, fp8ops
        >>> q, _ = fp8ops.quantize(torch.tensor([[1.0, -2.0]]), None, recipe=fp8ops.CurrentScaling())
        >>> q.inv_scale  # 2 / 448
        tensor(0.0045)
    """

    fp8_format: Format = attrs.field(default=Format.HYBRID, validator=_check_format)
    margin: int = attrs.field(default=0, validator=_check_margin)
    power_2_scale: bool = attrs.field(default=False, validator=_check_bool)
    granularity: Literal["tensor", "row"] = attrs.field(default="tensor", validator=_check_granularity)
    fprop: GemmSpec = attrs.field(default=_FPROP_DEFAULT, validator=_check_gemm)
    dgrad: GemmSpec = attrs.field(default=_GRAD_DEFAULT, validator=_check_gemm)
    wgrad: GemmSpec = attrs.field(default=_GRAD_DEFAULT, validator=_check_gemm)

    @property
    def mode(self) -> QuantMode:
        return "current" if self.granularity == "tensor" else "rowwise"

    @property
    def history_len(self) -> int:
        return 1
