"""Hypothesis strategies for fp8ops' property tests (and for tests of code built on fp8ops).

- :func:`shapes`: tensor shapes whose sides include 1, primes and non-multiples of 16, with a
  bounded element count (CPU-sized).
- :func:`float_tensors`: float tensors spanning many binades, optionally with special values
  (signed zeros, ±inf, NaN, values above the FP8 maxima, FP8- and dtype-subnormal magnitudes).
- :func:`recipes`: :class:`~fp8ops.DelayedScaling` / :class:`~fp8ops.CurrentScaling` over formats,
  margins, history lengths, amax algorithms and power-of-two scaling.
- :func:`scales`: positive float32 scales, powers of two and not.
- :func:`amaxes`: amax observations (0, NaN, ±inf-free or not, finite positive floats).
- :func:`scaling_states`: valid :class:`~fp8ops.ScalingState` values for a recipe.

Tensor contents come from a seeded ``torch.Generator`` (hypothesis draws the seed, the magnitude
band, the distribution and the positions of special values), so large tensors cost a handful of
draws; shrinking then works on shapes, bands and specials rather than on single elements.

Requires ``hypothesis`` (the ``test`` extra).

Example:
    >>> from hypothesis import given
    >>> from fp8ops.testing import strategies as fst
    >>> @given(x=fst.float_tensors(fst.shapes(), specials=True), r=fst.recipes())
    ... def test_something(x, r): ...
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from hypothesis import strategies as st
from torch import Tensor

from ..formats import E5M2_MAX, Format, Role
from ..recipes import CurrentScaling, DelayedScaling, Recipe
from ..state import ScalingState

__all__ = [
    "INTERESTING_SIDES",
    "SPECIALS",
    "amaxes",
    "float_tensors",
    "recipes",
    "scales",
    "scaling_states",
    "shapes",
]

INTERESTING_SIDES: tuple[int, ...] = (1, 2, 3, 5, 7, 13, 15, 16, 17, 31, 33, 48, 61, 64, 100, 127)
"""Sides that shapes favour: 1, primes, non-multiples of 16 and a few multiples of 16."""

SPECIALS: tuple[str, ...] = ("zero", "inf", "nan", "huge", "subnormal")
"""Kinds of special values :func:`float_tensors` can plant: signed zeros, ±inf, NaN, magnitudes
above the E5M2 maximum (57344, so above every FP8 maximum; capped at the dtype's maximum), and
subnormal magnitudes (of E4M3/E5M2 at scale 1, and of the tensor's own dtype)."""

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def shapes(
    min_dims: int = 1,
    max_dims: int = 3,
    *,
    min_side: int = 1,
    max_side: int = 127,
    max_numel: int = 4096,
) -> st.SearchStrategy[tuple[int, ...]]:
    """Tensor shapes with ``min_dims..max_dims`` dims and at most ``max_numel`` elements.

    Each side is drawn either from :data:`INTERESTING_SIDES` (1, primes, non-multiples of 16) or
    uniformly from ``min_side..max_side``, capped so the product stays within ``max_numel``.

    Args:
        min_dims, max_dims: number of dimensions (0 allowed: a scalar shape).
        min_side, max_side: bounds on each side (``min_side >= 1``).
        max_numel: bound on the number of elements; must be >= ``min_side ** max_dims``.

    Returns:
        A strategy of ``tuple[int, ...]``.

    Raises:
        ValueError: inconsistent bounds.

    Example:
        >>> from fp8ops.testing.strategies import shapes
        >>> s = shapes(2, 2).example()
        >>> len(s), s[0] * s[1] <= 4096
        (2, True)
    """
    if not 0 <= min_dims <= max_dims:
        raise ValueError(f"shapes: need 0 <= min_dims <= max_dims, got {min_dims}, {max_dims}")
    if not 1 <= min_side <= max_side:
        raise ValueError(f"shapes: need 1 <= min_side <= max_side, got {min_side}, {max_side}")
    if min_side**max_dims > max_numel:
        raise ValueError(f"shapes: max_numel={max_numel} is below min_side**max_dims = {min_side**max_dims}")

    @st.composite
    def _shapes(draw: Any) -> tuple[int, ...]:
        ndim = draw(st.integers(min_dims, max_dims))
        out: list[int] = []
        numel = 1
        for i in range(ndim):
            rest = ndim - i - 1
            cap = min(max_side, max_numel // (numel * min_side**rest))
            nice = [s for s in INTERESTING_SIDES if min_side <= s <= cap]
            choices = st.integers(min_side, cap)
            side = draw(st.sampled_from(nice) | choices if nice else choices)
            out.append(side)
            numel *= side
        return tuple(out)

    return _shapes()


def _exp_bounds(dtype: torch.dtype) -> tuple[int, int]:
    fi = torch.finfo(dtype)
    return int(math.log2(fi.smallest_normal)), int(math.floor(math.log2(fi.max)))


def float_tensors(
    shape: Sequence[int] | st.SearchStrategy[tuple[int, ...]],
    dtype: torch.dtype | st.SearchStrategy[torch.dtype] = torch.float32,
    *,
    min_exp: int = -16,
    max_exp: int = 16,
    max_span: int = 24,
    specials: bool | Sequence[str] = False,
    max_specials: int = 6,
    device: torch.device | str = "cpu",
) -> st.SearchStrategy[Tensor]:
    """Float tensors whose magnitudes span binades between ``2**min_exp`` and ``2**max_exp``.

    A draw picks a band ``[2**lo, 2**hi]`` (``hi - lo <= max_span``), a distribution
    ("log": sign x 2**uniform(lo, hi); "normal": a Gaussian of std 2**hi; "grid": small integers x
    2**lo, exactly representable; "const": one value repeated) and a seed; then plants up to
    ``max_specials`` special values at drawn positions.

    Args:
        shape: a shape, or a strategy of shapes (e.g. :func:`shapes`).
        dtype: float32, bfloat16 or float16, or a strategy of them. The band is clipped to the
            dtype's normal range.
        min_exp, max_exp: bounds of the magnitude band, as powers of two.
        max_span: the widest band one draw may use, in binades.
        specials: False (none), True (all of :data:`SPECIALS`) or a subset of :data:`SPECIALS`.
        max_specials: the most special values planted in one tensor.
        device: where the tensor is made.

    Returns:
        A strategy of tensors of ``shape`` and ``dtype`` (contiguous, ``requires_grad=False``).

    Raises:
        ValueError: an unknown dtype or special kind, or ``min_exp > max_exp``.

    Example:
        >>> import torch
        >>> from fp8ops.testing.strategies import float_tensors
        >>> x = float_tensors((4, 5), torch.bfloat16, specials=("nan",)).example()
        >>> x.shape, x.dtype
        (torch.Size([4, 5]), torch.bfloat16)
    """
    if min_exp > max_exp:
        raise ValueError(f"float_tensors: min_exp ({min_exp}) > max_exp ({max_exp})")
    if max_span < 0:
        raise ValueError(f"float_tensors: max_span must be >= 0, got {max_span}")
    if specials is True:
        kinds: tuple[str, ...] = SPECIALS
    elif specials is False:
        kinds = ()
    else:
        kinds = tuple(specials)
        unknown = [k for k in kinds if k not in SPECIALS]
        if unknown:
            raise ValueError(f"float_tensors: unknown special kinds {unknown}; choose from {SPECIALS}")
    if isinstance(dtype, torch.dtype) and dtype not in _FLOAT_DTYPES:
        raise ValueError(f"float_tensors: dtype must be float32, bfloat16 or float16, got {dtype}")
    shape_st = shape if isinstance(shape, st.SearchStrategy) else st.just(tuple(int(s) for s in shape))
    dtype_st = dtype if isinstance(dtype, st.SearchStrategy) else st.just(dtype)

    @st.composite
    def _tensors(draw: Any) -> Tensor:
        shp = tuple(draw(shape_st))
        dt = draw(dtype_st)
        if dt not in _FLOAT_DTYPES:
            raise ValueError(f"float_tensors: dtype must be float32, bfloat16 or float16, got {dt}")
        dmin, dmax = _exp_bounds(dt)
        e_lo, e_hi = max(min_exp, dmin), min(max_exp, dmax - 1)
        if e_lo > e_hi:  # the requested band lies outside the dtype's range: use its nearest end
            e_lo = e_hi = e_hi if min_exp > e_hi else e_lo
        lo = draw(st.integers(e_lo, e_hi))
        hi = draw(st.integers(lo, min(e_hi, lo + max_span)))
        kind = draw(st.sampled_from(("log", "normal", "grid", "const")))
        seed = draw(st.integers(0, 2**31 - 1))
        n = math.prod(shp)
        g = torch.Generator().manual_seed(seed)
        if kind == "log":
            mag = torch.exp2(lo + (hi - lo) * torch.rand(n, generator=g, dtype=torch.float64))
            sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).to(torch.float64)
            v = sign * mag
        elif kind == "normal":
            v = torch.randn(n, generator=g, dtype=torch.float64) * 2.0**hi
        elif kind == "grid":
            v = torch.randint(-16, 17, (n,), generator=g).to(torch.float64) * 2.0**lo
        else:
            c = draw(st.floats(2.0**lo, 2.0**hi, width=32)) * draw(st.sampled_from((1.0, -1.0)))
            v = torch.full((n,), c, dtype=torch.float64)
        fi = torch.finfo(dt)
        v = v.clamp(-fi.max, fi.max)  # a wide Gaussian or grid must not overflow a narrow dtype
        if kinds and n:
            planted = draw(
                st.lists(st.tuples(st.integers(0, n - 1), st.sampled_from(kinds), st.booleans()), max_size=max_specials)
            )
            for pos, what, neg in planted:
                sgn = -1.0 if neg else 1.0
                if what == "zero":
                    val = sgn * 0.0
                elif what == "inf":
                    val = sgn * math.inf
                elif what == "nan":
                    val = math.nan
                elif what == "huge":
                    top = math.log2(fi.max)
                    e = draw(st.floats(math.log2(E5M2_MAX) + 0.01, top - 0.01))
                    val = sgn * min(2.0**e, fi.max)
                else:  # subnormal: of E4M3/E5M2 at scale 1 (2**-16 .. 2**-7), or of the dtype itself
                    if draw(st.booleans()):
                        val = sgn * 2.0 ** draw(st.floats(-16.0, -7.0))
                    else:
                        val = sgn * fi.smallest_normal * draw(st.floats(0.0, 1.0, exclude_min=True, exclude_max=True))
                v[pos] = val
        return v.to(dt).reshape(shp).to(device)

    return _tensors()


def recipes(
    *,
    kinds: Sequence[str] = ("delayed", "current"),
    formats: Sequence[Format] = tuple(Format),
    granularities: Sequence[str] = ("tensor", "row"),
    max_margin: int = 3,
    max_history_len: int = 8,
    amax_compute_algos: Sequence[str] = ("max", "most_recent"),
    power_2_scale: bool | None = None,
) -> st.SearchStrategy[Recipe]:
    """Recipes: :class:`~fp8ops.DelayedScaling` and / or :class:`~fp8ops.CurrentScaling`.

    Args:
        kinds: which recipe classes: "delayed", "current".
        formats: the :class:`~fp8ops.Format` values to draw from.
        granularities: for CurrentScaling: "tensor" and / or "row".
        max_margin: margins are drawn from ``0..max_margin``.
        max_history_len: DelayedScaling history lengths are drawn from ``1..max_history_len``.
        amax_compute_algos: DelayedScaling's "max" and / or "most_recent".
        power_2_scale: fixed value, or None to draw it.

    Returns:
        A strategy of hashable, validated recipes.

    Example:
        >>> from fp8ops.testing.strategies import recipes
        >>> r = recipes(kinds=("delayed",)).example()
        >>> r.mode
        'delayed'
    """
    bad = [k for k in kinds if k not in ("delayed", "current")]
    if bad or not kinds:
        raise ValueError(f"recipes: kinds must be a non-empty subset of ('delayed', 'current'), got {tuple(kinds)}")
    p2 = st.booleans() if power_2_scale is None else st.just(power_2_scale)
    fmt = st.sampled_from(tuple(formats))
    margin = st.integers(0, max_margin)
    options: list[st.SearchStrategy[Recipe]] = []
    if "delayed" in kinds:
        options.append(
            st.builds(
                DelayedScaling,
                fp8_format=fmt,
                margin=margin,
                amax_history_len=st.integers(1, max_history_len),
                amax_compute_algo=st.sampled_from(tuple(amax_compute_algos)),
                power_2_scale=p2,
            )
        )
    if "current" in kinds:
        options.append(
            st.builds(
                CurrentScaling,
                fp8_format=fmt,
                margin=margin,
                power_2_scale=p2,
                granularity=st.sampled_from(tuple(granularities)),
            )
        )
    return st.one_of(options)


def scales(*, min_exp: int = -12, max_exp: int = 12, pow2: bool | None = None) -> st.SearchStrategy[Tensor]:
    """Positive float32 scales as 0-d tensors: ``2**e`` or ``m * 2**e`` with ``m`` in (1, 2).

    Args:
        min_exp, max_exp: the exponent range.
        pow2: True for powers of two only, False for non-powers only, None for both.

    Returns:
        A strategy of 0-d float32 tensors, finite and > 0.

    Example:
        >>> from fp8ops.testing.strategies import scales
        >>> s = scales(pow2=True).example()
        >>> s.dtype, bool(s > 0)
        (torch.float32, True)
    """
    if min_exp > max_exp or min_exp < -126 or max_exp > 127:
        raise ValueError(f"scales: need -126 <= min_exp <= max_exp <= 127, got {min_exp}, {max_exp}")

    @st.composite
    def _scales(draw: Any) -> Tensor:
        e = draw(st.integers(min_exp, max_exp))
        is_pow2 = draw(st.booleans()) if pow2 is None else pow2
        m = 1.0 if is_pow2 else draw(st.floats(1.0, 2.0, exclude_min=True, exclude_max=True, width=32))
        return torch.tensor(m * 2.0**e, dtype=torch.float32)

    return _scales()


def amaxes(
    *,
    allow_zero: bool = True,
    allow_nonfinite: bool = True,
    min_exp: int = -20,
    max_exp: int = 20,
) -> st.SearchStrategy[float]:
    """Amax observations as Python floats exactly representable in float32.

    Draws finite positive values between ``2**min_exp`` and ``2**max_exp``, and optionally 0.0,
    NaN and +inf (what a step that saw nothing, a NaN or an overflow reports).

    Example:
        >>> from fp8ops.testing.strategies import amaxes
        >>> a = amaxes(allow_zero=False, allow_nonfinite=False).example()
        >>> a > 0
        True
    """
    finite = st.floats(2.0**min_exp, 2.0**max_exp, width=32)
    options: list[st.SearchStrategy[float]] = [finite]
    if allow_zero:
        options.append(st.just(0.0))
    if allow_nonfinite:
        options.append(st.sampled_from((math.nan, math.inf)))
    return st.one_of(options)


def scaling_states(
    recipe: Recipe,
    *,
    role: Role = "forward",
    calibrated: bool | None = None,
    pending: bool = True,
    device: torch.device | str = "cpu",
) -> st.SearchStrategy[ScalingState]:
    """Valid :class:`~fp8ops.ScalingState` values for ``recipe``: random history, scale, pending amax.

    The history has the recipe's length and holds finite amaxes and zeros (as any sequence of
    updates leaves it); the scale comes from :func:`scales`; ``pending_amax`` is 0 or a finite amax.

    Args:
        recipe: gives the history length.
        role: "forward" or "backward".
        calibrated: fixed, or None to draw it.
        pending: whether ``pending_amax`` may be non-zero.
        device: where the tensors are made.

    Example:
        >>> import fp8ops
        >>> from fp8ops.testing.strategies import scaling_states
        >>> s = scaling_states(fp8ops.DelayedScaling(amax_history_len=3)).example()
        >>> s.amax_history.shape
        torch.Size([3])
    """

    @st.composite
    def _states(draw: Any) -> ScalingState:
        finite = amaxes(allow_nonfinite=False)
        hist = draw(st.lists(finite, min_size=recipe.history_len, max_size=recipe.history_len))
        scale = draw(scales())
        pend = draw(finite) if pending else 0.0
        cal = draw(st.booleans()) if calibrated is None else calibrated
        return ScalingState(
            torch.tensor(hist, dtype=torch.float32, device=device),
            scale.to(device),
            torch.tensor(pend, dtype=torch.float32, device=device),
            role=role,
            calibrated=cal,
        )

    return _states()
