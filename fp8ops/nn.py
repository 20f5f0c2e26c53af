"""Thin ``torch.nn`` modules over the functional ops: parameters as ``nn.Parameter``, FP8 state inside.

Each module holds its parameters and the scaling state of its op (``module.fp8_state``, a plain
attribute replaced by the op's new state on every forward: the functional API's
``y, state = op(..., state)`` done for you). Only a training forward observes: in training mode
(``module.training``) with gradients enabled, a forward records its amaxes in the new state and
makes fresh probes (under ``torch.compile``: takes probes made ahead, see :func:`prepare_probes`),
kept for the update; in eval mode or under ``torch.no_grad()`` the op runs with
the current state, its new state is discarded and no probe is made, so evaluation passes never move
the training scales. After ``backward``, once per optimizer step, ``module.update_scaling()`` (or
:func:`update_scaling` on a whole model) folds the kept probes' gradients and the pending forward
amaxes into the state with :func:`fp8ops.update`::

    layer = fp8ops.nn.TransformerLayer(1024, 4096, 16, recipe=fp8ops.DelayedScaling())
    for batch in data:
        for micro in batch:                     # gradient accumulation: observations merge by max
            layer(micro).float().square().mean().backward()
        optimizer.step(); optimizer.zero_grad()
        fp8ops.nn.update_scaling(layer)         # once per optimizer step, after the backward(s)

``recipe=None`` disables FP8 (the ops run in the inputs' precision; there is no state).
``module.state_dict()`` holds the parameters; the scaling state has its own flat dict
(:meth:`scaling_state_dict` / :meth:`load_scaling_state_dict`, via :func:`fp8ops.state_dict`).
Under FSDP2, :func:`enable_fp8_all_gather` (before ``fully_shard``) makes the all-gathers move the
weights of :class:`Linear`, :class:`LayerNormLinear`, :class:`LayerNormMLP` and :class:`TransformerLayer` as FP8 bytes.
"""

from __future__ import annotations

import inspect
import math
import warnings
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils import _pytree as pytree

from ._checks import check_eps, check_normalization, check_recipe, check_zero_centered_gamma
from ._fsdp import gathered_fused_ln_mlp, gathered_layernorm_linear, gathered_linear, is_gathered, sharded_fp8_weight
from ._fsdp import gathered_transformer_layer, transformer_fp8_weights
from .layernorm_linear import LayerNormLinearState, layernorm_linear
from .fp8_linear import LinearState, fp8_linear
from .fused_ln_mlp import LayerNormMLPState, fused_ln_mlp
from .state import make_probes, merge
from .state_dict import load_state_dict, state_dict
from .update import update
from .transformer_layer import (
    TransformerConfig,
    _check_layout,
    init_transformer_params,
    init_transformer_state,
    transformer_layer,
)

__all__ = [
    "FP8Module",
    "LayerNormLinear",
    "LayerNormMLP",
    "Linear",
    "TransformerLayer",
    "convert",
    "default_convert_filter",
    "enable_fp8_all_gather",
    "prepare_probes",
    "update_scaling",
]

# a message for torch._dynamo.graph_break where it takes one
_GRAPH_BREAK_MSG = "msg" in inspect.signature(torch._dynamo.graph_break).parameters


class FP8Module(torch.nn.Module):
    """Base of the fp8ops modules: a recipe, the scaling state and the probes of past forwards.

    Attributes:
        recipe: the FP8 recipe, or None (no FP8).
        fp8_state: the op's scaling state (None without a recipe); replaced on every training
            forward with gradients enabled (eval-mode and ``no_grad`` forwards leave it as is).
    """

    def __init__(self, recipe: Any) -> None:
        super().__init__()
        if recipe is not None:
            check_recipe(recipe, type(self).__name__)
        self.recipe = recipe
        self.fp8_state: Any = None
        self._probes: list[Any] = []
        # Probes made ahead, for training forwards that torch.compile traces (Dynamo makes no leaf
        # tensor that requires grad inside a graph): one at first, then as many as the last step's
        # forwards once a compiled forward took one (update_scaling refills; prepare_probes sets it).
        self._ready: list[Any] = []
        self._ready_size = 1
        self._ready_used = False

    def _init_state(self, device: torch.device | str | None) -> Any:
        raise NotImplementedError

    def _state_device(self) -> torch.device | None:
        p = next(iter(self.parameters()), None)
        return None if p is None else p.device

    def reset_scaling(self) -> None:
        """A fresh scaling state (uncalibrated) on the parameters' device; forget kept probes."""
        self.fp8_state = None if self.recipe is None else self._init_state(self._state_device())
        self._forget_probes()

    def _forget_probes(self) -> None:
        """Drop the kept probes; make the ready ones anew (for the current state and device)."""
        self._probes = []
        self._ready = [] if self.fp8_state is None else [make_probes(self.fp8_state) for _ in range(self._ready_size)]
        self._ready_used = False

    def _observing(self) -> bool:
        """Whether this forward records observations: FP8, training mode and gradients enabled."""
        return self.recipe is not None and self.training and torch.is_grad_enabled()

    def _next_probes(self) -> Any:
        """Probes for this forward (kept for :meth:`update_scaling`), or None when it does not
        observe (no recipe, eval mode or gradients disabled)."""
        if not self._observing():
            return None
        if torch.compiler.is_compiling():
            self._ready_used = True  # update_scaling keeps as many ready as this step's forwards
            if not self._ready:
                msg = (f"fp8ops.nn.{type(self).__name__}: under torch.compile a training forward takes probes made "
                       f"ahead (Dynamo makes no tensor that requires grad inside a graph), and this module has "
                       f"used the {self._ready_size} made for this step; call fp8ops.nn.prepare_probes(model, "
                       f"forwards=N), N the forwards per optimizer step, before the step (update_scaling keeps "
                       f"that many ready), or compile with fullgraph=False (the graph breaks here then)")
                torch._dynamo.graph_break(msg=msg) if _GRAPH_BREAK_MSG else torch._dynamo.graph_break()
                probes = make_probes(self.fp8_state)
            else:
                probes = self._ready.pop()
        else:
            probes = make_probes(self.fp8_state)
        self._probes.append(probes)
        return probes

    def _keep_state(self, new_state: Any) -> None:
        """Keep the op's new state when this forward observes; otherwise discard it."""
        if self._observing():
            self.fp8_state = new_state

    def _probe_grads(self) -> Any:
        """The max over the kept probes' gradients (zeros where a backward did not reach)."""
        grads = [pytree.tree_map(lambda p: p.grad if p.grad is not None else torch.zeros_like(p.detach()), probes)
                 for probes in self._probes]
        if not grads:
            return pytree.tree_map(lambda p: torch.zeros_like(p), make_probes(self.fp8_state, requires_grad=False))
        return merge(*grads)

    def update_scaling(self, *, group: Any = None) -> None:
        """Fold this module's observations into its scaling state: once per optimizer step.

        Call after the step's backward pass(es): the kept probes' gradients (max over the
        forwards since the last call) and the pending forward amaxes go through
        :func:`fp8ops.update` (the history rolls, scales are recomputed); the probes are dropped.
        A no-op without a recipe. For a model of several modules use :func:`update_scaling`
        (one call, one ``all_reduce`` with ``group``).
        """
        update_scaling(self, group=group)

    def scaling_state_dict(self) -> dict[str, Tensor]:
        """The scaling state as a flat ``dict[str, Tensor]`` (:func:`fp8ops.state_dict`); {} without a recipe."""
        return {} if self.fp8_state is None else state_dict(self.fp8_state)

    def load_scaling_state_dict(self, flat: dict[str, Tensor]) -> None:
        """Load a dict written by :meth:`scaling_state_dict` (of a module of the same kind and recipe).

        Raises:
            ValueError: the dict does not match this module's state (see :func:`fp8ops.load_state_dict`).
        """
        if self.fp8_state is None:
            if flat:
                raise ValueError(f"{type(self).__name__}.load_scaling_state_dict: this module has no recipe "
                                 f"(no FP8 state), got a non-empty scaling state dict")
            return
        self.fp8_state = load_state_dict(self.fp8_state, flat)
        self._forget_probes()

    def _apply(self, fn: Any, recurse: bool = True) -> Any:
        # .to()/.cuda() move the parameters; the state follows their device (it stays float32).
        out = super()._apply(fn, recurse)
        dev = self._state_device()
        if self.fp8_state is not None and dev is not None:
            self.fp8_state = pytree.tree_map(lambda t: t.to(dev), self.fp8_state)
            self._forget_probes()
        return out


# Called from eager code (a compiled forward that broke its graph at this call), the probe
# bookkeeping runs as it is: Dynamo would otherwise compile it as a function of its own, twice per
# module class, and reach its recompile limit with four classes in a model's second step. Traced
# from a compiled forward it is inlined as before.
_skip_code = getattr(torch._dynamo.eval_frame, "skip_code", None)
if _skip_code is not None:
    _skip_code(FP8Module._next_probes.__code__)


def update_scaling(modules: torch.nn.Module | Iterable[torch.nn.Module], *, group: Any = None) -> None:
    """Run :meth:`FP8Module.update_scaling` for every fp8ops module in ``modules`` at once.

    Once per optimizer step, after the backward pass(es). Modules are found with ``.modules()``;
    those sharing a recipe are updated in one :func:`fp8ops.update` call (one batched
    ``all_reduce(MAX)`` over ``group`` when given).

    Args:
        modules: a module (searched recursively) or an iterable of modules.
        group: a ``torch.distributed`` process group to max-reduce the observations over, or None.

    Raises:
        ValueError: ``group`` is None but a module's weight is sharded over several ranks and
            all-gathered in FP8 (:func:`enable_fp8_all_gather`): its ranks would drift apart in
            scale.

    Example:
        >>> import torch, fp8ops
        >>> r = fp8ops.DelayedScaling()
        >>> model = torch.nn.Sequential(fp8ops.nn.Linear(16, 32, recipe=r), fp8ops.nn.Linear(32, 8, recipe=r))
        >>> model(torch.randn(4, 16)).sum().backward()
        >>> fp8ops.nn.update_scaling(model)
        >>> bool(model[1].fp8_state.grad_output.calibrated)
        True
    """
    roots = [modules] if isinstance(modules, torch.nn.Module) else list(modules)
    found: dict[int, FP8Module] = {}
    for root in roots:
        for m in root.modules():
            if isinstance(m, FP8Module) and m.recipe is not None:
                found.setdefault(id(m), m)
    if group is None:
        gathered = [type(m).__name__ for m in found.values()
                    if any(sharded_fp8_weight(p) for p in m.parameters(recurse=isinstance(m, TransformerLayer)))]
        if gathered:
            raise ValueError(f"update_scaling: group is None, but {len(gathered)} module(s) have weights that "
                             f"fully_shard all-gathers in FP8 (enable_fp8_all_gather); pass group= (the process "
                             f"group the weights are sharded over) so that every rank quantizes its shard with the "
                             f"same scale")
    by_recipe: dict[Any, list[FP8Module]] = {}
    for m in found.values():
        by_recipe.setdefault(m.recipe, []).append(m)
    short = [m for m in found.values() if m._ready_used and len(m._probes) > m._ready_size]
    if short:
        m = short[0]
        warnings.warn(
            f"update_scaling: under torch.compile {type(m).__name__} ran {len(m._probes)} training forwards this "
            f"step with {m._ready_size} probe set(s) made ready, so the graph broke to make the others eagerly "
            f"({len(short)} module(s)); Dynamo keeps that break in the compiled code, and later forwards run as "
            f"several graphs; call fp8ops.nn.prepare_probes(model, forwards={len(m._probes)}) before the first step "
            f"for one graph per forward", stacklevel=2)
    for recipe, mods in by_recipe.items():
        states = [m.fp8_state for m in mods]
        grads = [m._probe_grads() for m in mods]
        new = update(states, recipe=recipe, grad_amax=grads, group=group)
        for m, s in zip(mods, new):
            m.fp8_state = s
            if m._ready_used:  # compiled forwards took ready probes: as many ready for the next step
                m._ready_size = max(m._ready_size, len(m._probes))
                m._forget_probes()
            else:
                m._probes = []


def prepare_probes(modules: torch.nn.Module | Iterable[torch.nn.Module], *, forwards: int) -> None:
    """Make ``forwards`` probes ready in every fp8ops module with a recipe, for training forwards
    that ``torch.compile`` traces.

    A training forward needs fresh probes (leaf tensors that require grad, one per forward: their
    gradients are the output-gradient amaxes). Dynamo does not make such tensors inside a graph, so a
    compiled forward takes one made ahead: each module keeps one ready, and after a step whose
    compiled forwards took them :func:`update_scaling` keeps as many ready as that step's forwards.
    With several forwards per optimizer step (gradient accumulation, a module called twice) and
    ``fullgraph=True``, call this once before the first step (with ``fullgraph=False`` the graph
    breaks at a module that has none left, and it makes them eagerly). Eager forwards make their own.
    Dynamo specializes on how many probes are left, so each forward of a step compiles its own graph,
    twice (before and after the first update flips the state's ``calibrated`` flag): with more than 4
    forwards per step ``fullgraph=True`` exceeds Dynamo's default recompile limit (8) and raises;
    raise ``torch._dynamo.config.recompile_limit`` to at least twice the forwards per step.

    Args:
        modules: a module (searched recursively) or an iterable of modules.
        forwards: the training forwards of each module per optimizer step, >= 1.

    Example:
        >>> import torch, fp8ops
        >>> model = torch.nn.Sequential(fp8ops.nn.Linear(16, 16, recipe=fp8ops.DelayedScaling()))
        >>> fp8ops.nn.prepare_probes(model, forwards=2)      # two micro-batches per step
        >>> step = torch.compile(model, fullgraph=True, backend="aot_eager")
        >>> for micro in torch.randn(2, 4, 16):
        ...     step(micro).square().mean().backward()
        >>> fp8ops.nn.update_scaling(model)
        >>> bool(model[0].fp8_state.grad_output.calibrated)
        True
    """
    if isinstance(forwards, bool) or not isinstance(forwards, int) or forwards < 1:
        raise ValueError(f"fp8ops.nn.prepare_probes: forwards must be an int >= 1 (training forwards per "
                         f"optimizer step), got {forwards!r}")
    roots = [modules] if isinstance(modules, torch.nn.Module) else list(modules)
    for root in roots:
        for m in root.modules():
            if isinstance(m, FP8Module) and m.recipe is not None:
                m._ready_size = forwards
                m._forget_probes()


def _factory(device: Any, dtype: Any) -> dict[str, Any]:
    return {"device": device, "dtype": dtype if dtype is not None else torch.get_default_dtype()}


def _init_linear(weight: Tensor, bias: Tensor | None) -> None:
    # torch.nn.Linear's initialisation
    torch.nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
    if bias is not None:
        bound = 1.0 / math.sqrt(weight.shape[1]) if weight.shape[1] > 0 else 0.0
        torch.nn.init.uniform_(bias, -bound, bound)


class Linear(FP8Module):
    """``y = x W^T + b`` through :func:`fp8ops.fp8_linear` (FP8 GEMMs forward and backward).

    Args:
        in_features: K.
        out_features: N.
        bias: whether to learn a bias (N,).
        recipe: FP8 recipe, or None for ``torch.nn.functional.linear``.
        device, dtype: of the parameters (initialised as ``torch.nn.Linear``'s).

    Shapes: x (..., K) -> y (..., N). Parameters ``weight`` (N, K), ``bias`` (N,).

    Example:
        >>> import torch, fp8ops
        >>> lin = fp8ops.nn.Linear(32, 16, recipe=fp8ops.DelayedScaling())
        >>> y = lin(torch.randn(4, 32))
        >>> y.sum().backward(); lin.update_scaling()
        >>> y.shape, bool(lin.fp8_state.input.calibrated)
        (torch.Size([4, 16]), True)
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, recipe: Any = None,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__(recipe)
        fk = _factory(device, dtype)
        self.in_features, self.out_features = in_features, out_features
        self.weight = torch.nn.Parameter(torch.empty(out_features, in_features, **fk))
        self.bias = torch.nn.Parameter(torch.empty(out_features, **fk)) if bias else None
        _init_linear(self.weight, self.bias)
        self.reset_scaling()

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, *, recipe: Any) -> Linear:
        """A :class:`Linear` over the parameters of a ``torch.nn.Linear``: the same ``Parameter`` objects.

        ``weight`` and ``bias`` are ``linear.weight`` and ``linear.bias`` themselves (not copies:
        their values, dtype, device, ``requires_grad`` and identity are kept, so an optimizer built
        on ``linear.parameters()`` trains the new module); the training flag is copied and the
        scaling state is fresh, on the weight's device. Hooks registered on ``linear`` are not
        carried over. :func:`convert` uses this for a whole model.

        Example:
            >>> import torch, fp8ops
            >>> lin = torch.nn.Linear(32, 16)
            >>> m = fp8ops.nn.Linear.from_linear(lin, recipe=fp8ops.DelayedScaling())
            >>> m.weight is lin.weight, m.bias is lin.bias
            (True, True)
        """
        if not isinstance(linear, torch.nn.Linear):
            raise TypeError(f"Linear.from_linear: expected a torch.nn.Linear, got {type(linear).__name__}")
        m = cls.__new__(cls)
        FP8Module.__init__(m, recipe)
        m.in_features, m.out_features = linear.in_features, linear.out_features
        m.register_parameter("weight", linear.weight)
        m.register_parameter("bias", linear.bias)
        m.train(linear.training)
        m.reset_scaling()
        return m

    _FP8_WEIGHTS = ("weight",)  # all-gathered in FP8 under enable_fp8_all_gather (the name is the state role)

    def _init_state(self, device: Any) -> Any:
        return LinearState.init(self.recipe, device=device)

    def forward(self, x: Tensor) -> Tensor:
        if self.recipe is None:
            return F.linear(x, self.weight, self.bias)
        op = gathered_linear if is_gathered(self.weight) else fp8_linear  # all-gathered in FP8 by fully_shard
        y, new_state = op(x, self.weight, self.bias, self.fp8_state, recipe=self.recipe, grad_probe=self._next_probes())
        self._keep_state(new_state)
        return y

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, " \
               f"recipe={self.recipe!r}"


def _norm_params(module: torch.nn.Module, size: int, normalization: str, bias: bool, zero_centered_gamma: bool,
                 eps: float, fk: dict[str, Any]) -> None:
    where = type(module).__name__
    check_normalization(normalization, where)
    check_zero_centered_gamma(zero_centered_gamma, where)
    check_eps(eps, where)
    fill = 0.0 if zero_centered_gamma else 1.0
    module.layer_norm_weight = torch.nn.Parameter(torch.full((size,), fill, **fk))
    has_bias = bias and normalization == "LayerNorm"
    module.layer_norm_bias = torch.nn.Parameter(torch.zeros(size, **fk)) if has_bias else None


class LayerNormLinear(FP8Module):
    """LayerNorm (or RMSNorm) then a linear layer, through :func:`fp8ops.layernorm_linear`.

    Args:
        in_features: K.
        out_features: N.
        eps: norm epsilon.
        bias: biases for the linear layer and the LayerNorm.
        normalization: "LayerNorm" or "RMSNorm".
        zero_centered_gamma: the norm scales by ``1 + layer_norm_weight``.
        return_layernorm_output: forward returns ``(y, ln_out)``.
        recipe: FP8 recipe, or None (no FP8).
        device, dtype: of the parameters.

    Parameters: ``layer_norm_weight`` (K,), ``layer_norm_bias`` (K,) (LayerNorm with bias),
    ``weight`` (N, K), ``bias`` (N,).

    Example:
        >>> import torch, fp8ops
        >>> m = fp8ops.nn.LayerNormLinear(32, 96, recipe=fp8ops.CurrentScaling())
        >>> m(torch.randn(8, 2, 32)).shape
        torch.Size([8, 2, 96])
    """

    def __init__(self, in_features: int, out_features: int, eps: float = 1e-5, bias: bool = True, *,
                 normalization: str = "LayerNorm", zero_centered_gamma: bool = False,
                 return_layernorm_output: bool = False, recipe: Any = None,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__(recipe)
        fk = _factory(device, dtype)
        self.in_features, self.out_features = in_features, out_features
        self.eps, self.normalization, self.zero_centered_gamma = eps, normalization, zero_centered_gamma
        self.return_layernorm_output = return_layernorm_output
        _norm_params(self, in_features, normalization, bias, zero_centered_gamma, eps, fk)
        self.weight = torch.nn.Parameter(torch.empty(out_features, in_features, **fk))
        self.bias = torch.nn.Parameter(torch.empty(out_features, **fk)) if bias else None
        _init_linear(self.weight, self.bias)
        self.reset_scaling()

    _FP8_WEIGHTS = ("weight",)

    def _init_state(self, device: Any) -> Any:
        return LayerNormLinearState.init(self.recipe, device=device)

    def forward(self, x: Tensor) -> Any:
        op = gathered_layernorm_linear if is_gathered(self.weight) else layernorm_linear
        out, new_state = op(
            x, self.layer_norm_weight, self.layer_norm_bias, self.weight, self.bias, self.fp8_state,
            recipe=self.recipe, normalization=self.normalization, eps=self.eps,
            zero_centered_gamma=self.zero_centered_gamma, return_layernorm_output=self.return_layernorm_output,
            grad_probe=self._next_probes())
        self._keep_state(new_state)
        return out


class LayerNormMLP(FP8Module):
    """LayerNorm (or RMSNorm) -> fc1 -> activation -> fc2, through :func:`fp8ops.fused_ln_mlp`.

    Args:
        hidden_size: H (input and output width).
        ffn_hidden_size: F (fc1 has 2F outputs for gated activations).
        eps: norm epsilon.
        bias: biases for fc1, fc2 and the LayerNorm.
        normalization: "LayerNorm" or "RMSNorm".
        activation: one of ``fp8ops.activation.ACTIVATIONS`` (default "gelu_tanh").
        zero_centered_gamma: the norm scales by ``1 + layer_norm_weight``.
        recompute: None, or "activation" (see :func:`fp8ops.fused_ln_mlp`).
        recipe: FP8 recipe, or None (no FP8).
        device, dtype: of the parameters.

    Parameters: ``layer_norm_weight``, ``layer_norm_bias``, ``fc1_weight`` (C, H), ``fc1_bias``,
    ``fc2_weight`` (H, F), ``fc2_bias``.

    Example:
        >>> import torch, fp8ops
        >>> m = fp8ops.nn.LayerNormMLP(32, 64, activation="swiglu", recipe=fp8ops.DelayedScaling())
        >>> m.fc1_weight.shape, m(torch.randn(8, 32)).shape
        (torch.Size([128, 32]), torch.Size([8, 32]))
    """

    def __init__(self, hidden_size: int, ffn_hidden_size: int, eps: float = 1e-5, bias: bool = True, *,
                 normalization: str = "LayerNorm", activation: str = "gelu_tanh", zero_centered_gamma: bool = False,
                 recompute: str | None = None, recipe: Any = None,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__(recipe)
        from .activation import GATED, check_activation

        check_activation(activation, "LayerNormMLP")
        fk = _factory(device, dtype)
        self.hidden_size, self.ffn_hidden_size = hidden_size, ffn_hidden_size
        self.eps, self.normalization, self.activation = eps, normalization, activation
        self.zero_centered_gamma, self.recompute = zero_centered_gamma, recompute
        C = 2 * ffn_hidden_size if activation in GATED else ffn_hidden_size
        _norm_params(self, hidden_size, normalization, bias, zero_centered_gamma, eps, fk)
        self.fc1_weight = torch.nn.Parameter(torch.empty(C, hidden_size, **fk))
        self.fc1_bias = torch.nn.Parameter(torch.empty(C, **fk)) if bias else None
        self.fc2_weight = torch.nn.Parameter(torch.empty(hidden_size, ffn_hidden_size, **fk))
        self.fc2_bias = torch.nn.Parameter(torch.empty(hidden_size, **fk)) if bias else None
        _init_linear(self.fc1_weight, self.fc1_bias)
        _init_linear(self.fc2_weight, self.fc2_bias)
        self.reset_scaling()

    _FP8_WEIGHTS = ("fc1_weight", "fc2_weight")

    def _init_state(self, device: Any) -> Any:
        return LayerNormMLPState.init(self.recipe, device=device)

    def forward(self, x: Tensor) -> Tensor:
        op = gathered_fused_ln_mlp if is_gathered(self.fc1_weight, self.fc2_weight) else fused_ln_mlp
        y, new_state = op(
            x, self.layer_norm_weight, self.layer_norm_bias, self.fc1_weight, self.fc1_bias, self.fc2_weight,
            self.fc2_bias, self.fp8_state, recipe=self.recipe, normalization=self.normalization,
            activation=self.activation, eps=self.eps, zero_centered_gamma=self.zero_centered_gamma,
            recompute=self.recompute, grad_probe=self._next_probes())
        self._keep_state(new_state)
        return y


class _Group(torch.nn.Module):
    """Holds the parameters of one prefix ("ln1", "qkv", ...) so that names match the functional keys."""


class TransformerLayer(FP8Module):
    """The transformer encoder layer of :func:`fp8ops.transformer_layer` as a module.

    Parameter names are exactly the keys of :func:`fp8ops.init_transformer_params`
    (``ln1.weight``, ``qkv.weight``, ``proj.weight``, ``ln2.weight``, ``fc1.weight``, ...), so
    ``dict(module.named_parameters())`` is the functional ``params`` and
    ``module.load_state_dict(fp8ops.params_from_basic_layer(seed.state_dict(), module.config))``
    loads the seed layer's weights. Dropout follows ``module.training``.

    Args:
        hidden_size, ffn_hidden_size, num_attention_heads: as :class:`fp8ops.TransformerConfig`.
        recipe: FP8 recipe, or None (no FP8).
        device, dtype: of the parameters.
        generator: for reproducible initial weights (:func:`fp8ops.init_transformer_params`).
        layout: "sbh" (default: x and y are (S, B, H), sequence first) or "bsh" (batch first:
            (B, S, H)); see :func:`fp8ops.transformer_layer`. Kept as ``module.layout``.
        **config: the other :class:`fp8ops.TransformerConfig` fields (``num_gqa_groups``,
            ``normalization``, ``activation``, ``self_attn_mask_type``, dropouts, ...).

    Shapes (forward): x (S, B, H) -> (S, B, H) ((B, S, H) with ``layout="bsh"``), or packed
    (T, H) with ``cu_seqlens``.

    Example:
        >>> import torch, fp8ops
        >>> layer = fp8ops.nn.TransformerLayer(32, 64, 4, recipe=fp8ops.DelayedScaling(), hidden_dropout=0.0)
        >>> y = layer(torch.randn(8, 2, 32))
        >>> y.square().mean().backward()
        >>> layer.update_scaling()
        >>> y.shape, sorted(layer.fp8_state)
        (torch.Size([8, 2, 32]), ['mlp', 'proj', 'qkv'])
    """

    def __init__(self, hidden_size: int, ffn_hidden_size: int, num_attention_heads: int, *, recipe: Any = None,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None,
                 generator: torch.Generator | None = None, layout: str = "sbh", **config: Any) -> None:
        cfg = TransformerConfig(hidden_size=hidden_size, ffn_hidden_size=ffn_hidden_size,
                                num_attention_heads=num_attention_heads, **config)
        _check_layout(layout, "TransformerLayer")
        super().__init__(recipe)
        self.config = cfg
        self.layout = layout
        params = init_transformer_params(cfg, dtype=_factory(device, dtype)["dtype"], device=device,
                                         generator=generator)
        for key, t in params.items():
            group, name = key.split(".")
            if not hasattr(self, group):
                self.add_module(group, _Group())
            getattr(self, group).register_parameter(name, torch.nn.Parameter(t))
        self.reset_scaling()

    @classmethod
    def from_config(cls, config: TransformerConfig, *, recipe: Any = None, device: torch.device | str | None = None,
                    dtype: torch.dtype | None = None, generator: torch.Generator | None = None,
                    layout: str = "sbh") -> TransformerLayer:
        """A layer for an existing :class:`fp8ops.TransformerConfig` (``layout`` as the constructor's)."""
        fields = {f.name: getattr(config, f.name) for f in config.__attrs_attrs__}  # type: ignore[attr-defined]
        return cls(recipe=recipe, device=device, dtype=dtype, generator=generator, layout=layout, **fields)

    def _init_state(self, device: Any) -> Any:
        return init_transformer_state(self.config, self.recipe, device=device)

    def params(self) -> dict[str, Tensor]:
        """The functional ``params`` dict: ``{"ln1.weight": Parameter, ...}``."""
        return dict(self.named_parameters())

    @property
    def _FP8_WEIGHTS(self) -> dict[str, str]:  # all-gathered in FP8 under enable_fp8_all_gather: name -> role
        return transformer_fp8_weights(self.config)

    def forward(self, x: Tensor, attention_mask: Tensor | None = None, *, block_mask: Any = None,
                cu_seqlens: Tensor | None = None, max_seqlen: int | None = None,
                dropout_seed: int | Tensor | None = None, residual: Tensor | None = None,
                return_residual: bool = False) -> Any:
        params = self.params()  # residual / return_residual: as in fp8ops.transformer_layer
        y, new_state = (gathered_transformer_layer if is_gathered(*params.values()) else transformer_layer)(
            params, x, self.fp8_state, config=self.config, recipe=self.recipe, probes=self._next_probes(),
            attention_mask=attention_mask, block_mask=block_mask, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
            training=self.training, dropout_seed=dropout_seed, layout=self.layout, residual=residual,
            return_residual=return_residual)
        self._keep_state(new_state)
        return y

    def extra_repr(self) -> str:
        return f"config={self.config!r}, layout={self.layout!r}, recipe={self.recipe!r}"


from ._nn_convert import convert, default_convert_filter, enable_fp8_all_gather  # noqa: E402

for _f in (convert, default_convert_filter, enable_fp8_all_gather):
    _f.__module__ = __name__  # documented here (fp8ops.nn)
del _f
