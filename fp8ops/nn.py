"""Thin ``torch.nn`` modules over the functional ops: parameters as ``nn.Parameter``, FP8 state inside.

Each module holds its parameters and the scaling state of its op (``module.fp8_state``, a plain
attribute replaced by the op's new state on every forward: the functional API's
``y, state = op(..., state)`` done for you). Only a training forward observes: in training mode
(``module.training``) with gradients enabled, a forward records its amaxes in the new state and
makes fresh probes, kept for the update; in eval mode or under ``torch.no_grad()`` the op runs with
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

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils import _pytree as pytree

from ._checks import check_eps, check_normalization, check_recipe, check_zero_centered_gamma
from ._fsdp import gathered_fused_ln_mlp, gathered_layernorm_linear, gathered_linear, is_gathered, sharded_fp8_weight
from ._fsdp import gathered_transformer_layer, transformer_fp8_weights, wrap_weights
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
    "update_scaling",
]


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

    def _init_state(self, device: torch.device | str | None) -> Any:
        raise NotImplementedError

    def _state_device(self) -> torch.device | None:
        p = next(iter(self.parameters()), None)
        return None if p is None else p.device

    def reset_scaling(self) -> None:
        """A fresh scaling state (uncalibrated) on the parameters' device; forget kept probes."""
        self.fp8_state = None if self.recipe is None else self._init_state(self._state_device())
        self._probes = []

    def _observing(self) -> bool:
        """Whether this forward records observations: FP8, training mode and gradients enabled."""
        return self.recipe is not None and self.training and torch.is_grad_enabled()

    def _next_probes(self) -> Any:
        """Probes for this forward (kept for :meth:`update_scaling`), or None when it does not
        observe (no recipe, eval mode or gradients disabled)."""
        if not self._observing():
            return None
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
        self._probes = []

    def _apply(self, fn: Any, recurse: bool = True) -> Any:
        # .to()/.cuda() move the parameters; the state follows their device (it stays float32).
        out = super()._apply(fn, recurse)
        dev = self._state_device()
        if self.fp8_state is not None and dev is not None:
            self.fp8_state = pytree.tree_map(lambda t: t.to(dev), self.fp8_state)
            self._probes = []
        return out


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
    for recipe, mods in by_recipe.items():
        states = [m.fp8_state for m in mods]
        grads = [m._probe_grads() for m in mods]
        new = update(states, recipe=recipe, grad_amax=grads, group=group)
        for m, s in zip(mods, new):
            m.fp8_state = s
            m._probes = []


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


# ------------------------------------------------------------------------------------------------
# Converting a plain torch.nn model


def default_convert_filter(fqn: str, module: torch.nn.Linear) -> bool:
    """The default ``filter`` of :func:`convert`: both features multiples of 16.

    FP8 GEMMs on NVIDIA GPUs (``torch._scaled_mm`` / cuBLASLt) need the inner and outer dims of
    each operand to be multiples of 16; a layer with other sizes (a 50257-wide LM head, a 3-class
    classifier) is left as ``torch.nn.Linear``. On CPU every size runs, so a ``filter`` returning
    True converts everything there.
    """
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


def convert(model: torch.nn.Module, recipe: Any, *,
            filter: Callable[[str, torch.nn.Linear], bool] | None = None) -> torch.nn.Module:  # noqa: A002
    """Swap the ``torch.nn.Linear`` layers of ``model`` for :class:`fp8ops.nn.Linear`, in place.

    Each selected layer is replaced (``setattr`` on its parent) by
    ``fp8ops.nn.Linear.from_linear(layer, recipe=recipe)``, which holds the layer's own
    ``weight`` and ``bias`` ``Parameter`` objects: values (initialisation), dtype, device and
    identity are kept, so ``model.state_dict()`` keys and ``model.named_parameters()`` are
    unchanged and an optimizer built before the conversion trains the converted model. A layer
    reachable under several names (shared) is converted once and replaced under every name.
    Subclasses of ``torch.nn.Linear`` (e.g. ``NonDynamicallyQuantizableLinear`` inside
    ``torch.nn.MultiheadAttention``, which calls its weight directly) are left alone: only exact
    ``torch.nn.Linear`` instances are converted. LayerNorm + Linear pairs stay two modules.

    After the conversion, train as with any fp8ops module: call :func:`update_scaling` on the
    model once per optimizer step, after the backward pass(es). Eval-mode and ``no_grad``
    forwards record no amaxes (see the module docstring).

    Args:
        model: the module tree to convert (also a single ``torch.nn.Linear`` inside a container;
            ``model`` itself is never replaced).
        recipe: the FP8 recipe of the new modules (one recipe: one :func:`fp8ops.update` call).
        filter: ``filter(fqn, layer) -> bool`` selects the layers to convert (``fqn`` as in
            ``model.named_modules()``, e.g. ``"blocks.0.mlp.fc"``); e.g. keep the LM head in high
            precision with ``lambda fqn, m: fqn != "lm_head" and default_convert_filter(fqn, m)``.
            None means :func:`default_convert_filter` (in and out features multiples of 16).

    Returns:
        ``model`` itself (converted in place). The converted layers are its
        :class:`fp8ops.nn.Linear` modules:
        ``[n for n, m in model.named_modules() if isinstance(m, fp8ops.nn.Linear)]``; those left
        in high precision are the ones still of type ``torch.nn.Linear``.

    Raises:
        TypeError: ``model`` is not a ``torch.nn.Module``, ``model`` itself is a ``torch.nn.Linear``
            (there is no parent to swap it in: use :meth:`Linear.from_linear`), or ``filter`` is not
            callable.

    Example:
        >>> import torch, fp8ops
        >>> model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 10))
        >>> w = model[0].weight
        >>> model = fp8ops.nn.convert(model, fp8ops.DelayedScaling())   # in place; returns model
        >>> [n for n, m in model.named_modules() if isinstance(m, fp8ops.nn.Linear)]  # 10 outputs: kept
        ['0']
        >>> model[0].weight is w, type(model[2]) is torch.nn.Linear
        (True, True)
    """
    where = "fp8ops.nn.convert"
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{where}: model must be a torch.nn.Module, got {type(model).__name__}")
    if type(model) is torch.nn.Linear:
        raise TypeError(f"{where}: model is itself a torch.nn.Linear (nothing holds it to swap it in); use "
                        f"fp8ops.nn.Linear.from_linear(model, recipe=...)")
    if recipe is not None:
        check_recipe(recipe, where)
    select = default_convert_filter if filter is None else filter
    if not callable(select):
        raise TypeError(f"{where}: filter must be a callable (fqn, module) -> bool, got {type(select).__name__}")
    # Decide first (named_modules lists a shared module once, under its first name), then swap.
    new: dict[int, Linear] = {}
    for fqn, m in model.named_modules():
        if type(m) is torch.nn.Linear and id(m) not in new and select(fqn, m):
            new[id(m)] = Linear.from_linear(m, recipe=recipe)
    for parent in list(model.modules()):
        for name, child in list(parent._modules.items()):
            if child is not None and id(child) in new:
                setattr(parent, name, new[id(child)])
    return model


# ------------------------------------------------------------------------------------------------
# FP8 all-gather of the weights under FSDP2


def enable_fp8_all_gather(model: torch.nn.Module, *,
                          filter: Callable[[str, FP8Module], bool] | None = None) -> list[str]:  # noqa: A002
    """Make FSDP2's ``fully_shard`` all-gather the weights of the model's linear-family layers in FP8.

    Call it before ``fully_shard``. Each selected layer's GEMM weights (``weight`` of :class:`Linear`
    and :class:`LayerNormLinear`; ``fc1_weight`` and ``fc2_weight`` of :class:`LayerNormMLP`;
    ``qkv.weight`` (fused only), ``proj.weight``, ``fc1.weight``, ``fc2.weight`` of :class:`TransformerLayer`) are
    replaced by parameters of the same values, dtype and ``requires_grad`` (a tensor subclass that
    wraps the same memory) with FSDP2's all-gather hooks; norms and biases are gathered in their
    own dtype. Under ``fully_shard`` each rank then quantizes its row shard of an
    (N, K) weight with one scale for the group, the all-gather moves the FP8 bytes (one byte per
    element: half of bfloat16's traffic, a quarter of float32's) and the transposed FP8 copy for
    the dgrad GEMM is written from them; no high-precision copy of the full weight is made. The
    layer's forward feeds those bytes to its op (:func:`fp8ops.fp8_linear`,
    :func:`fp8ops.layernorm_linear`, :func:`fp8ops.fused_ln_mlp`, :func:`fp8ops.transformer_layer`) as its ``weight_cache``, and the
    (N, K) weight gradient it computes is the unsharded parameter's gradient, which FSDP2
    reduce-scatters (in the param dtype, or ``reduce_dtype``) as usual.

    The scale is the weight role's (``layer.fp8_state.weight``, ``.fc1_weight``, ``.fc2_weight``, ``["proj"].weight``...)
    when it is a calibrated delayed scale, or, with current scaling and before the first update,
    that of the group's amax (one ``all_reduce(MAX)`` of a scalar per weight and all-gather). Each
    rank's weight role observes the amax of its shard; :func:`update_scaling` with ``group=``
    (required: it raises without one) max-reduces it with the other observations in its one
    ``all_reduce`` per step, so the state sees the full weight's amax and the scales stay identical
    on every rank. The gathered FP8 weight is the one the layer would quantize from the full weight.

    Outside ``fully_shard`` (before it, or without it) the weight behaves as a plain tensor and the
    layer runs as before. A weight tied between selected layers stays tied; one tied to any other
    module (an embedding) or parameter, which would read it as its FP8 value, is refused. The
    sharded parameters are ``DTensor`` shards as usual (``.full_tensor()`` gathers one in high
    precision). The parameters are new ``Parameter`` objects: build the optimizer after
    ``fully_shard``, as FSDP2 requires anyway.

    Covered: :class:`Linear` (including those made by :func:`convert`), :class:`LayerNormLinear`,
    :class:`LayerNormMLP` and :class:`TransformerLayer` (unfused q, k, v weights, quantized together, are gathered in their own dtype).

    Args:
        model: the module tree (``model`` itself may be a covered layer).
        filter: ``filter(fqn, layer) -> bool`` selects among the covered layers with a recipe
            (``fqn`` as in ``model.named_modules()``); None selects them all. Layers without a
            recipe are never selected (nothing of theirs is FP8).

    Returns:
        The qualified names of the selected layers, in ``named_modules()`` order (``""`` for
        ``model`` itself).

    Raises:
        TypeError: ``model`` is not a ``torch.nn.Module``, or ``filter`` is not callable.
        ValueError: no covered layer with a recipe is selected; a selected layer's recipe
            scales per row (the gathered weight needs one scale per tensor) or runs its fprop or
            dgrad GEMM in high precision (the FP8 weight replaces the high-precision one in both);
            a selected weight is tied to a module that is not a selected layer (an embedding would
            read it as its FP8 value); or ``fully_shard`` has already sharded a selected weight.

    Example:
        >>> import os, tempfile, torch, torch.distributed as dist, fp8ops
        >>> from torch.distributed.device_mesh import init_device_mesh
        >>> from torch.distributed.fsdp import fully_shard
        >>> f = os.path.join(tempfile.mkdtemp(), "init")
        >>> dist.init_process_group("gloo", init_method=f"file://{f}", rank=0, world_size=1)
        >>> r = fp8ops.DelayedScaling()
        >>> model = torch.nn.Sequential(fp8ops.nn.Linear(16, 32, recipe=r), fp8ops.nn.Linear(32, 8, recipe=r))
        >>> fp8ops.nn.enable_fp8_all_gather(model)
        ['0', '1']
        >>> mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        >>> for layer in model:
        ...     _ = fully_shard(layer, mesh=mesh)
        >>> _ = fully_shard(model, mesh=mesh)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> model(torch.randn(4, 16)).square().mean().backward()     # the weights move as FP8 bytes
        >>> opt.step(); opt.zero_grad()
        >>> fp8ops.nn.update_scaling(model, group=dist.group.WORLD)
        >>> model[0].weight.full_tensor().shape, bool(model[0].fp8_state.weight.calibrated)
        (torch.Size([32, 16]), True)
        >>> dist.destroy_process_group()
    """
    where = "fp8ops.nn.enable_fp8_all_gather"
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{where}: model must be a torch.nn.Module, got {type(model).__name__}")
    if filter is not None and not callable(filter):
        raise TypeError(f"{where}: filter must be a callable (fqn, module) -> bool, got {type(filter).__name__}")
    selected = [(fqn, m) for fqn, m in model.named_modules() if isinstance(m, (Linear, LayerNormLinear, LayerNormMLP,
                TransformerLayer)) and m.recipe is not None and (filter is None or filter(fqn, m))]
    if not selected:
        raise ValueError(f"{where}: found no fp8ops.nn.Linear, LayerNormLinear, LayerNormMLP or TransformerLayer "
                         f"with a recipe to all-gather in FP8 in the {type(model).__name__} given (or the filter "
                         f"selected none)")
    wrap_weights(model, selected, where)
    return [fqn for fqn, _ in selected]
