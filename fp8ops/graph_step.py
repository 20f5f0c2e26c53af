"""graph_step: run a whole training step as one CUDA graph replay.

A training step over fp8ops states is a function of tensors with static shapes and no host
synchronization (fresh probes, forward, backward, ``fp8ops.update``, the optimizer): it can be
captured once in a CUDA graph and replayed, so that the host cost of a step is one graph launch
instead of a Python call, a dispatch and a launch per kernel.

The step is written as a function ``fn(carry, *args) -> (carry, outputs)``:

- ``carry`` is what the step reads and returns anew, typically the scaling states of the model
  (a pytree of tensors, :class:`fp8ops.ScalingState` / :class:`fp8ops.OpState` nodes); the
  captured graph writes the new carry into the same buffers it reads, so passing the returned
  carry back costs nothing;
- ``args`` are the step's inputs (a batch, targets): each call copies them into the graph's input
  buffers (one batched copy);
- ``outputs`` (a loss, metrics) are returned as fresh tensors.

Parameters and optimizer state live in the closure (``torch.nn`` modules and ``torch.optim``
optimizers update them in place); the optimizer must be capturable (``capturable=True``, or
``fused=True``, with a tensor learning rate if it changes).

When is a call captured? Calls are grouped by their signature: the pytree structure of
``(carry, args)`` (which includes each state's static ``calibrated`` flag), the shapes, dtypes and
devices of the tensors and the other leaves' values. The calls of a signature run eagerly until
one of them runs without synchronizing with the host (watched with
``torch.cuda.set_sync_debug_mode("warn")``): that warm-up call has compiled the Triton kernels,
set up cuBLAS and allocated the ``.grad`` tensors; the next call of the signature is captured and
replayed, and later ones only replay. The first step of delayed scaling synchronizes (the update
of an uncalibrated state reads its observation on the host to decide whether it becomes
calibrated), so a run starts eagerly, flips ``calibrated``, warms up once and captures.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import contextlib
import warnings

import torch
from torch import Tensor
from torch.utils import _pytree as pytree

from .kernels._library import AMAX_CHAIN, opaque_in_graphs

__all__ = ["GraphStep", "graph_step"]


def _meta(leaf: Any) -> Any:
    """What a leaf contributes to a call's signature."""
    if isinstance(leaf, Tensor):
        return (leaf.shape, leaf.dtype, leaf.device, leaf.requires_grad, leaf.stride())
    try:
        hash(leaf)
    except TypeError:
        return ("id", id(leaf))
    return ("value", type(leaf), leaf)


_SYNC_WARNING = "called a synchronizing CUDA operation"


def _watching_syncs(fn: Callable[[], Any]) -> tuple[Any, bool]:
    """``fn()`` and whether it synchronized with the host (torch's sync debug mode, set to "warn"
    for the call; the caller's other warnings are passed on)."""
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if previous == 0:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            result = fn()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    synced = False
    for w in caught:
        if _SYNC_WARNING in str(w.message):
            synced = True
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return result, synced


def _distinct_elements(t: Tensor) -> bool:
    """Whether t's strides give every element its own memory location (sorted by stride, each
    dim's stride exceeds the farthest offset the smaller ones reach): true for contiguous tensors,
    their transposes, slices and strided views; false for expanded (stride 0) tensors."""
    reach = 0
    for stride, size in sorted((st, n) for n, st in zip(t.shape, t.stride()) if n > 1):
        if stride <= reach:
            return False
        reach += stride * (size - 1)
    return True


def _static_copy(t: Any) -> Any:
    """A graph's own copy of a step's tensor argument, with the argument's strides: a step compiled
    with torch.compile guards on strides, and a copy laid out otherwise (a contiguous clone of a
    strided view, say) would recompile it inside the capture, where compiling cannot run. A tensor
    whose elements overlap (an expanded one) cannot be written in place and is copied contiguous."""
    if not isinstance(t, Tensor):
        return t
    src = t.detach()
    if _distinct_elements(src):
        copy = torch.empty_strided(src.shape, src.stride(), dtype=src.dtype, device=src.device)
        with torch.no_grad():
            copy.copy_(src)
    else:
        copy = src.clone()
    return copy.requires_grad_(t.requires_grad)


class _Entry:
    """One signature: its call count and, once captured, the graph and its buffers."""

    def __init__(self, eager_reason: str | None) -> None:
        self.eager_reason = eager_reason  # None: capturable
        self.calls = 0  # eager calls without a host sync
        self.synced = 0  # eager calls with one
        self.warned = False
        self.by_reference: list[bool] = []  # per arg leaf: used as it is (requires grad, mutated)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.args_spec: Any = None
        self.static_carry: list[Any] = []
        self.static_args: list[Any] = []
        self.carry_out: Any = None
        self.out_leaves: list[Any] = []
        self.out_spec: Any = None
        self.amax_words: list[Tensor] = []  # kept with the graph (kernels._library.AmaxChain.capturing)


class GraphStep:
    """A training step that replays a CUDA graph once warmed up; see :func:`graph_step`.

    Attributes:
        stats: counts of ``eager`` calls, ``captures`` and ``replays`` so far.
    """

    def __init__(self, fn: Callable[..., Any], *, warmup: int = 1, args_by_reference: Iterable[int] = ()) -> None:
        if not callable(fn):
            raise TypeError(f"graph_step: fn must be callable (a step fn(carry, *args) -> (carry, outputs)), "
                            f"got {type(fn).__name__}")
        if not isinstance(warmup, int) or isinstance(warmup, bool) or warmup < 1:
            raise ValueError(f"graph_step: warmup must be an int >= 1 (eager calls before the capture), got {warmup!r}")
        try:
            positions = tuple(args_by_reference)
        except TypeError:
            raise TypeError(f"graph_step: args_by_reference must be an iterable of argument positions (ints), "
                            f"got {type(args_by_reference).__name__}") from None
        bad = [i for i in positions if not isinstance(i, int) or isinstance(i, bool) or i < 0]
        if bad:
            raise ValueError(f"graph_step: args_by_reference must hold positions of the step's arguments after the "
                             f"carry (ints >= 0: 0 is the first argument after the carry), got {bad[0]!r}")
        self._fn = fn
        self._warmup = warmup
        self._args_by_reference = frozenset(positions)
        self._entries: dict[Any, _Entry] = {}
        self._last: _Entry | None = None
        self.stats = {"eager": 0, "captures": 0, "replays": 0}

    # --------------------------------------------------------------------------------------------

    def __call__(self, carry: Any, *args: Any) -> tuple[Any, Any]:
        last = self._last
        if last is not None and last.graph is not None and carry is last.carry_out:
            # The steady state: the carry is the one the graph returned; only the args are checked.
            arg_leaves, args_spec = pytree.tree_flatten(args)
            if args_spec == last.args_spec and all(
                    _meta(a) == _meta(s) for a, s in zip(arg_leaves, last.static_args)):
                return self._replay(last, None, arg_leaves)
        carry_leaves, carry_spec = pytree.tree_flatten(carry)
        arg_leaves, args_spec = pytree.tree_flatten(args)
        key = (repr(carry_spec), repr(args_spec), tuple(_meta(x) for x in carry_leaves),
               tuple(_meta(x) for x in arg_leaves))
        entry = self._entries.get(key)
        if entry is None:
            last_ref = max(self._args_by_reference, default=-1)
            if last_ref >= len(args):
                raise ValueError(f"graph_step: args_by_reference names argument {last_ref} (0 is the first after "
                                 f"the carry), but the step was called with {len(args)} argument(s) after the carry")
            entry = self._entries[key] = _Entry(self._eager_reason(carry_leaves + arg_leaves))
        self._last = entry
        if entry.graph is not None:
            return self._replay(entry, carry_leaves, arg_leaves)
        if entry.eager_reason is not None or entry.calls < self._warmup:
            return self._eager(entry, carry, carry_spec, args, arg_leaves)
        return self._capture(entry, carry_leaves, carry_spec, arg_leaves, args_spec)

    @staticmethod
    def _eager_reason(leaves: list[Any]) -> str | None:
        tensors = [t for t in leaves if isinstance(t, Tensor)]
        if torch.compiler.is_compiling() or torch._C._functorch.maybe_current_level() is not None:
            return "called under torch.compile or a torch.func transform"
        if not tensors or any(t.device.type != "cuda" for t in tensors):
            return "not every tensor argument is on a CUDA device"
        if len({t.device for t in tensors}) > 1:
            return "tensor arguments on several CUDA devices"
        return None

    def _call_fn(self, carry: Any, args: tuple[Any, ...]) -> tuple[Any, Any]:
        result = self._fn(carry, *args)
        if not (isinstance(result, tuple) and len(result) == 2):
            raise TypeError(f"graph_step: the step must return a pair (carry, outputs), got {type(result).__name__}"
                            + (f" of length {len(result)}" if isinstance(result, tuple) else ""))
        return result

    def _forced_leaves(self, args: tuple[Any, ...]) -> set[int]:
        """Indices (among the flattened args' leaves) of the leaves of the ``args_by_reference`` arguments."""
        if not self._args_by_reference:
            return set()
        forced: set[int] = set()
        start = 0
        for i, a in enumerate(args):
            n = len(pytree.tree_leaves(a))
            if i in self._args_by_reference:
                forced.update(range(start, start + n))
            start += n
        return forced

    def _eager(self, entry: _Entry, carry: Any, carry_spec: Any, args: tuple[Any, ...],
               arg_leaves: list[Any]) -> tuple[Any, Any]:
        self.stats["eager"] += 1
        if entry.eager_reason is not None:
            return self._call_fn(carry, args)
        versions = [a._version if isinstance(a, Tensor) else None for a in arg_leaves]
        # a graph compiled here is for the capture: the library ops as opaque calls (not once the
        # signature has given up on capturing, below)
        with opaque_in_graphs() if not entry.warned else contextlib.nullcontext():
            (new_carry, out), synced = _watching_syncs(lambda: self._call_fn(carry, args))
        if synced:  # a call that synchronized would fail under capture: warm up again
            entry.synced += 1
            if entry.synced >= 3 and not entry.warned:
                entry.warned = True
                warnings.warn(
                    "graph_step: the step synchronized with the host on 3 calls of the same signature, so it keeps "
                    "running eagerly (no CUDA graph). Find the sync with torch.cuda.set_sync_debug_mode('error'): "
                    ".item(), float(t), .tolist(), a tensor built from a Python number on the GPU "
                    "(torch.tensor(x, device='cuda')), data-dependent shapes", stacklevel=3)
        else:
            entry.calls += 1
            # Arguments the step changes in place (or that require grad: parameters) are used as
            # they are in the graph, not copied: the caller sees the changes.
            forced = self._forced_leaves(args)
            entry.by_reference = [isinstance(a, Tensor) and (a.requires_grad or a._version != v or i in forced)
                                  for i, (a, v) in enumerate(zip(arg_leaves, versions))]
            if repr(pytree.tree_flatten(new_carry)[1]) != repr(carry_spec):
                entry.eager_reason = "the step returns a carry of another structure than it takes"
        return new_carry, out

    def _capture(self, entry: _Entry, carry_leaves: list[Any], carry_spec: Any, arg_leaves: list[Any],
                 args_spec: Any) -> tuple[Any, Any]:
        entry.args_spec = args_spec
        entry.static_carry = [_static_copy(t) for t in carry_leaves]
        entry.static_args = [a if ref else _static_copy(a) for a, ref in zip(arg_leaves, entry.by_reference)]
        graph = torch.cuda.CUDAGraph()
        try:
            with (torch.cuda.graph(graph), AMAX_CHAIN.capturing(torch.device("cuda")) as amax_words,
                  opaque_in_graphs()):
                # the amax words of the captured kernels are zeroed by the kernel before them, in the graph
                entry.amax_words = amax_words  # the last one, zeroed at every replay, lives with the graph
                new_carry, out = self._call_fn(pytree.tree_unflatten(entry.static_carry, carry_spec),
                                               pytree.tree_unflatten(entry.static_args, args_spec))
                # the same structure as the carry: the warm-up call of this signature checked it
                new_leaves = pytree.tree_leaves(new_carry)
                pairs = [(d, s) for d, s in zip(entry.static_carry, new_leaves) if isinstance(d, Tensor) and d is not s]
                with torch.no_grad():
                    if pairs:
                        torch._foreach_copy_([d for d, _ in pairs], [s for _, s in pairs])
                entry.out_leaves, entry.out_spec = pytree.tree_flatten(out)
        except Exception as exc:
            raise RuntimeError(
                f"graph_step: capturing the step in a CUDA graph failed ({type(exc).__name__}: "
                f"{str(exc).splitlines()[0] if str(exc) else ''}). A captured step must not synchronize with the "
                "host (.item(), .tolist(), float(t), printing a CUDA tensor, data-dependent shapes), must use a "
                "capturable optimizer (capturable=True or fused=True) and CUDA tensors only; run it without "
                "graph_step to find the culprit (torch.cuda.set_sync_debug_mode('error') reports syncs)"
            ) from exc
        entry.graph = graph
        entry.carry_out = pytree.tree_unflatten(entry.static_carry, carry_spec)
        self.stats["captures"] += 1
        graph.replay()  # capturing records the step without running it: run it now
        self.stats["replays"] += 1
        return entry.carry_out, self._outputs(entry)

    def _replay(self, entry: _Entry, carry_leaves: list[Any] | None, arg_leaves: list[Any]) -> tuple[Any, Any]:
        dst, src = [], []
        if carry_leaves is not None:
            for s, c in zip(entry.static_carry, carry_leaves):
                if isinstance(s, Tensor) and s is not c:
                    dst.append(s)
                    src.append(c)
        for s, a, ref in zip(entry.static_args, arg_leaves, entry.by_reference):
            if not isinstance(s, Tensor) or s is a:
                continue
            if ref:
                raise ValueError(
                    "graph_step: an argument that requires grad, that the step changes in place or that "
                    "args_by_reference names must be the same tensor at every call (the graph uses it as it is); "
                    "write new values into it in place, or pass it through the closure or the carry instead")
            dst.append(s)
            src.append(a)
        if dst:
            with torch.no_grad():
                torch._foreach_copy_(dst, src)
        assert entry.graph is not None
        entry.graph.replay()
        self.stats["replays"] += 1
        return entry.carry_out, self._outputs(entry)

    @staticmethod
    def _outputs(entry: _Entry) -> Any:
        # The graph's output buffers are overwritten by the next replay: hand out copies.
        with torch.no_grad():
            outs = [o.clone() if isinstance(o, Tensor) else o for o in entry.out_leaves]
        return pytree.tree_unflatten(outs, entry.out_spec)


def graph_step(fn: Callable[..., Any], *, warmup: int = 1, args_by_reference: Iterable[int] = ()) -> GraphStep:
    """Wrap a training step so that, once warmed up, each call replays one CUDA graph.

    ``fn(carry, *args) -> (new_carry, outputs)``: ``carry`` is the state the step carries from one
    call to the next (the fp8ops scaling states; any pytree of tensors), ``args`` the step's inputs
    (a batch), ``outputs`` what it reports (a loss). Parameters, gradients and the optimizer live
    in ``fn``'s closure and are updated in place (use a capturable optimizer: ``capturable=True``
    or ``fused=True``; keep a changing learning rate in a tensor).

    The wrapper returns what ``fn`` returns. The returned carry's tensors are the graph's own
    buffers: pass the carry back to the next call (free), or read it, but do not change it in place
    while the wrapper is in use. ``outputs`` are fresh copies. Arguments are copied into the
    graph's input buffers, except those that require grad, that the step changes in place
    (detected on the warm-up call) or that ``args_by_reference`` names: those are used as they are
    and must be the same tensors at every call (a loop that already writes each batch into a buffer
    of its own passes that buffer this way and saves the copy).

    Calls run eagerly (and are never captured) on CPU tensors, under ``torch.compile`` or a
    ``torch.func`` transform, and while the carry holds an uncalibrated scaling state; the first
    ``warmup`` calls of each signature run eagerly too. So on a CPU this is ``fn`` itself.

    Args:
        fn: the step, ``fn(carry, *args) -> (carry, outputs)``; free of host synchronization once
            the states are calibrated.
        warmup: eager calls of a signature before it is captured (default 1).
        args_by_reference: positions of arguments after the carry (0: the first) whose tensors
            the graph reads as they are instead of copying them at each call; the caller passes
            the same tensors at every call and changes their values in place.

    Returns:
        A :class:`GraphStep`; call it as ``fn``. ``.stats`` counts eager calls, captures and replays.

    Raises:
        TypeError: ``fn`` is not callable, or returns something other than a pair.
        ValueError: ``warmup`` or ``args_by_reference`` is invalid; a call passes another tensor
            where the graph reads one by reference.
        RuntimeError: the capture failed (a host sync in the step, a non-capturable optimizer);
            the message says what to look for.

    Example:
        >>> import torch, fp8ops
        >>> r = fp8ops.DelayedScaling()
        >>> w = torch.randn(8, 16, requires_grad=True)
        >>> opt = torch.optim.SGD([w], lr=0.1)
        >>> def step(state, x):
        ...     opt.zero_grad(set_to_none=True)
        ...     probe = torch.zeros((), requires_grad=True)
        ...     y, state = fp8ops.fp8_linear(x, w, None, state, recipe=r, grad_probe=probe)
        ...     loss = y.square().mean()
        ...     loss.backward()
        ...     opt.step()
        ...     return fp8ops.update(state, recipe=r, grad_amax=probe.grad), loss.detach()
        >>> train = fp8ops.graph_step(step)
        >>> state = fp8ops.LinearState.init(r)
        >>> for _ in range(3):
        ...     state, loss = train(state, torch.randn(4, 16))
        >>> train.stats  # on a CPU every call is eager; on a GPU: eager, eager, then a capture
        {'eager': 3, 'captures': 0, 'replays': 0}
    """
    return GraphStep(fn, warmup=warmup, args_by_reference=args_by_reference)
