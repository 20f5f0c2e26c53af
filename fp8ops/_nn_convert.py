"""Converting a plain ``torch.nn`` model to fp8ops modules and enabling FSDP2's FP8 all-gather of
their weights: :func:`convert`, :func:`default_convert_filter`, :func:`enable_fp8_all_gather`
(exported by :mod:`fp8ops.nn`, documented there)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ._checks import check_recipe
from ._fsdp import wrap_weights

if TYPE_CHECKING:  # pragma: no cover
    from .nn import FP8Module


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
    from .nn import Linear

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
    from .nn import LayerNormLinear, LayerNormMLP, Linear, TransformerLayer

    selected = [(fqn, m) for fqn, m in model.named_modules() if isinstance(m, (Linear, LayerNormLinear, LayerNormMLP,
                TransformerLayer)) and m.recipe is not None and (filter is None or filter(fqn, m))]
    if not selected:
        raise ValueError(f"{where}: found no fp8ops.nn.Linear, LayerNormLinear, LayerNormMLP or TransformerLayer "
                         f"with a recipe to all-gather in FP8 in the {type(model).__name__} given (or the filter "
                         f"selected none)")
    wrap_weights(model, selected, where)
    return [fqn for fqn, _ in selected]
