"""Model-level composition harness: one small GPT trained for a few optimizer steps in each
execution mode, so that every mode can be compared with eager on the loss curve and on every
gradient.

The model is a stack of :func:`fp8ops.transformer_layer` between a token embedding and an
output head tied to it (:func:`fp8ops.tied_embedding`), with a final :func:`fp8ops.layer_norm`;
float32 master parameters are cast to the compute dtype on the way in. A step is what a user runs:
fresh probes, forward, backward (or a ``torch.func`` transform), :func:`fp8ops.update` of every
state, then the optimizer.

Modes (:data:`MODES`):

- ``"eager"``: plain autograd, ``loss.backward()``;
- ``"compile"``, ``"fullgraph"``, ``"reduce-overhead"``: the loss function under
  ``torch.compile`` (default, ``fullgraph=True``, ``mode="reduce-overhead"``) + ``.backward()``;
- ``"func.grad"``, ``"func.grad_and_value"``, ``"func.vjp"``: the loss differentiated by the
  ``torch.func`` transform with respect to the parameters and the probes, eagerly;
- ``"graph_step"``, ``"graph_step.fullgraph"``: the whole step (probes, forward, backward,
  optimizer, update) wrapped by :func:`fp8ops.graph_step`, so that on CUDA it is captured once the
  states are calibrated and replayed; ``.fullgraph`` compiles the loss (``fullgraph=True``) inside
  it. On a CPU the wrapper runs the step eagerly.

The graph modes need a capturable optimizer (``capturable=True`` AdamW, whose bias correction is
computed in tensors and rounds differently from the default's): compare them with an eager run
that uses it too (``train(..., capturable=True)``, ``eager_result(..., capturable=True)``).

Example:
    >>> import torch
    >>> from fp8ops.testing import composition as C
    >>> r = C.train("eager", recipe=None, dtype=torch.float32, device="cpu", steps=2)
    >>> len(r.losses)
    2
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils import _pytree as pytree

__all__ = ["MODES", "RECIPES", "Model", "StepResult", "check_compiled", "compare", "eager_result", "gpt_loss",
           "init_states", "make_model", "make_recipe", "max_rel_error", "probe_leaves", "train"]

MODES = ("eager", "compile", "fullgraph", "reduce-overhead", "func.grad", "func.grad_and_value", "func.vjp",
         "graph_step", "graph_step.fullgraph")
"""The execution modes :func:`train` knows."""

RECIPES = ("none", "delayed", "current", "rowwise")
"""Recipe names accepted by :func:`make_recipe`."""


def make_recipe(name: str) -> Any:
    """``None`` (no FP8), delayed scaling (history 4), per-tensor or per-row current scaling."""
    from fp8ops.recipes import CurrentScaling, DelayedScaling

    recipes = {
        "none": None,
        "delayed": DelayedScaling(amax_history_len=4),
        "current": CurrentScaling(),
        "rowwise": CurrentScaling(granularity="row"),
    }
    if name not in recipes:
        raise ValueError(f"make_recipe: name must be one of {RECIPES}, got {name!r}")
    return recipes[name]


@dataclass(frozen=True)
class Model:
    """A small GPT: its layer configuration, vocabulary, sequence length, layer count and data."""

    config: Any
    vocab: int
    seq: int
    layers: int
    tokens: Tensor  # (steps, B, S) int64
    targets: Tensor  # (steps, B, S) int64
    fp8_head: bool = False  # the tied head through fp8_linear (FP8 GEMMs under a recipe; state last)
    fused_loss: bool = False  # the bf16 head and its loss through fp8ops.linear_cross_entropy


def make_model(device: torch.device | str, *, layers: int = 2, hidden: int = 32, heads: int = 4, seq: int = 16,
               batch: int = 2, vocab: int = 64, steps: int = 8, seed: int = 0,
               fp8_head: bool = False, fused_loss: bool = False) -> tuple[Model, dict[str, Any]]:
    """A :class:`Model` and its float32 master parameters (leaves, ``requires_grad=False``).

    Built on the CPU from one generator (the same values on every device), then moved. The data
    is a fixed random token stream, one batch per step; the targets are the tokens shifted by one.
    ``fp8_head``: the output head (tied to the token embedding) runs through
    :func:`fp8ops.fp8_linear`, its GEMMs in FP8 under a recipe, with a state of its own after the
    layers' (:func:`init_states`); otherwise it is a matmul in the compute dtype, followed by
    ``F.cross_entropy``, or with ``fused_loss`` (not with ``fp8_head``) the head and the loss in one
    :func:`fp8ops.linear_cross_entropy`.
    """
    from fp8ops.transformer_layer import TransformerConfig, init_transformer_params

    config = TransformerConfig(hidden_size=hidden, ffn_hidden_size=4 * hidden, num_attention_heads=heads,
                               hidden_dropout=0.0, attention_dropout=0.0, self_attn_mask_type="causal")
    g = torch.Generator().manual_seed(seed)
    params: dict[str, Any] = {
        "tok": torch.randn(vocab, hidden, generator=g) * 0.5,
        "pos": torch.randn(seq, hidden, generator=g) * 0.1,
        "layers": [init_transformer_params(config, dtype=torch.float32, generator=g) for _ in range(layers)],
        "lnf.weight": torch.ones(hidden) + 0.1 * torch.randn(hidden, generator=g),
        "lnf.bias": 0.1 * torch.randn(hidden, generator=g),
    }
    stream = torch.randint(0, vocab, (steps, batch, seq + 1), generator=g)
    if fp8_head and fused_loss:
        raise ValueError("make_model: fused_loss fuses the high-precision head with its loss; it does not apply "
                         "with fp8_head=True")
    model = Model(config, vocab, seq, layers, stream[..., :-1].to(device), stream[..., 1:].to(device), fp8_head,
                  fused_loss)
    return model, pytree.tree_map(lambda t: t.to(device), params)


def init_states(model: Model, recipe: Any, device: torch.device | str, *, head_recipe: Any = None
                ) -> list[Any] | None:
    """The model's fresh scaling states: one per layer, then the head's (with ``fp8_head``; built
    for ``head_recipe`` when given, else ``recipe``); None without a recipe."""
    import fp8ops

    if recipe is None:
        return None
    states: list[Any] = [fp8ops.init_transformer_state(model.config, recipe, device=device)
                         for _ in range(model.layers)]
    if model.fp8_head:
        states.append(fp8ops.LinearState.init(recipe if head_recipe is None else head_recipe, device=device))
    return states


def gpt_loss(params: Mapping[str, Any], states: list[Any] | None, probes: list[Any] | None, tokens: Tensor,
             targets: Tensor, *, model: Model, recipe: Any, dtype: torch.dtype, head_recipe: Any = None,
             weight_caches: list[Any] | None = None) -> tuple[Tensor, list[Any] | None]:
    """Mean next-token cross-entropy of ``tokens`` (B, S) and the layers' new states (then the
    head's, with ``model.fp8_head``: quantized with ``head_recipe`` when given, else ``recipe``; an
    update of the states then takes the head's state with its own recipe).

    ``weight_caches``: one :func:`fp8ops.transformer_layer` ``weight_cache`` dict (or None) per
    layer. A cache refers to its weight tensor itself, so the layers' parameters must then be in
    ``dtype`` already (their conversion to ``dtype`` is then no copy)."""
    from fp8ops.norm import layer_norm
    from fp8ops.tied_embedding import tied_embedding
    from fp8ops.transformer_layer import transformer_layer

    if weight_caches is not None and (not isinstance(weight_caches, (list, tuple))
                                      or len(weight_caches) != len(params["layers"])):
        got = f"{len(weight_caches)} entries" if isinstance(weight_caches, (list, tuple)) else type(weight_caches).__name__
        raise ValueError(f"gpt_loss: weight_caches must be a list with one weight_cache dict (or None) per layer "
                         f"({len(params['layers'])}), got {got}")
    # the head is tied to the token embedding: one op sees both uses of the table, and its
    # backward adds the lookup's rows into the head's gradient
    rows, tied_head = tied_embedding(tokens, params["tok"])
    x = rows + params["pos"][: tokens.shape[1]]  # (B, S, H)
    x = x.to(dtype).transpose(0, 1)  # (S, B, H)
    new_states = []
    # Pre-norm: each layer hands on its residual stream unsummed, (m, s) with y = s + m, and the
    # next norm adds them in its own kernel (no residual add kernel between layers).
    chain = model.config.norm_position == "pre"
    residual = None
    for i, lp in enumerate(params["layers"]):
        lp = {k: v.to(dtype) for k, v in lp.items()}
        st = None if states is None else states[i]
        pr = None if probes is None else probes[i]
        wc = None if weight_caches is None else weight_caches[i]
        if chain:
            (x, residual), ns = transformer_layer(lp, x, st, config=model.config, recipe=recipe, probes=pr,
                                                  residual=residual, return_residual=True, weight_cache=wc)
        else:
            x, ns = transformer_layer(lp, x, st, config=model.config, recipe=recipe, probes=pr, weight_cache=wc)
        new_states.append(ns)
    lnf = (params["lnf.weight"].to(dtype), params["lnf.bias"].to(dtype), None)
    if residual is not None:
        (x, _), _ = layer_norm(x, *lnf, residual=residual)
    else:
        x, _ = layer_norm(x, *lnf)
    head = tied_head.to(dtype)
    if model.fp8_head:  # (S * B, V) logits from fp8_linear, the targets in the same (S, B) order
        from fp8ops.fp8_linear import fp8_linear

        st = None if states is None else states[model.layers]
        pr = None if probes is None else probes[model.layers]
        logits, hs = fp8_linear(x.reshape(-1, x.shape[-1]), head, None, st,
                                recipe=recipe if head_recipe is None else head_recipe, grad_probe=pr)
        new_states.append(hs)
        targets = targets.t()
    elif model.fused_loss:  # x (S, B, H) against the targets in the same (S, B) order
        from fp8ops.linear_cross_entropy import linear_cross_entropy

        loss = linear_cross_entropy(x, head, targets.t())
        return loss, (new_states if states is not None else None)
    else:
        logits = x.transpose(0, 1) @ head.t()  # (B, S, V)
    loss = F.cross_entropy(logits.float().reshape(-1, model.vocab), targets.reshape(-1))
    return loss, (new_states if states is not None else None)


@dataclass
class StepResult:
    """What :func:`train` recorded: the loss of every step, the gradients and probe gradients of
    the first step, the final states, the gradients of the last step and, for the graph modes,
    the wrapper's ``stats``."""

    losses: list[float]
    grads: dict[str, Any]
    probe_grads: Any
    states: Any
    last_grads: dict[str, Any] | None = None
    stats: dict[str, int] | None = None


def _compiled(fn: Any, mode: str, backend: str) -> Any:
    if mode == "compile":
        return torch.compile(fn, backend=backend)
    if mode in ("fullgraph", "graph_step.fullgraph"):
        return torch.compile(fn, backend=backend, fullgraph=True)
    if mode == "reduce-overhead":
        if backend != "inductor":  # CUDA graphs are an inductor mode
            return torch.compile(fn, backend=backend, fullgraph=True)
        return torch.compile(fn, mode="reduce-overhead", fullgraph=True)
    return fn


def _grads(params: list[Tensor]) -> dict[str, Tensor]:
    """Copies of the parameters' gradients, keyed by position."""
    return {str(i): p.grad.detach().clone() for i, p in enumerate(params)}


class LibraryAdamW:
    """``params`` stepped by :func:`fp8ops.adamw_` (one step count, a learning-rate tensor), in the
    interface of a torch optimizer that training steps use: ``zero_grad(set_to_none=True)``,
    ``step()``, ``param_groups``. Unlike torch's AdamW, which skips a parameter without a gradient and
    counts steps per parameter, it steps every parameter with one count, so a missing gradient is
    an error."""

    def __init__(self, params: list[Tensor], *, lr: float, weight_decay: float = 1e-2,
                 device: torch.device | str = "cuda") -> None:
        self.params = list(params)
        self.param_groups = [{"params": self.params}]
        self.exp_avgs = [torch.zeros_like(p) for p in self.params]
        self.exp_avg_sqs = [torch.zeros_like(p) for p in self.params]
        self.count = torch.zeros((), device=device)
        self.lr = torch.full((), lr, device=device)
        self.weight_decay = weight_decay

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        import fp8ops

        missing = [i for i, p in enumerate(self.params) if p.grad is None]
        if missing:  # one step count for all: a parameter skipped once would take the others' count after
            raise ValueError(f"LibraryAdamW.step: parameters {missing} have no gradient; every parameter must "
                             f"have one (they share one step count)")
        fp8ops.adamw_(self.params, [p.grad for p in self.params], self.exp_avgs, self.exp_avg_sqs, self.count,
                      lr=self.lr, weight_decay=self.weight_decay)


def train(mode: str, *, recipe: Any, dtype: torch.dtype, device: torch.device | str, steps: int = 8,
          lr: float = 1e-2, backend: str = "inductor", model: Model | None = None,
          params: dict[str, Any] | None = None, capturable: bool | None = None,
          fp8_head: bool = False, fused_loss: bool = False, optimizer: str = "torch") -> StepResult:
    """Train the model for ``steps`` AdamW steps in ``mode``; see the module docstring.

    Args:
        mode: one of :data:`MODES`.
        recipe: an fp8ops recipe, or None (no FP8).
        dtype: the compute dtype (float32 or bfloat16); master parameters stay float32.
        device: where to run.
        steps: optimizer steps.
        lr: AdamW learning rate.
        backend: torch.compile backend of the compiled modes ("inductor", "aot_eager", ...).
        model, params: from :func:`make_model` (default: ``make_model(device, steps=steps,
            fp8_head=fp8_head, fused_loss=fused_loss)``).
        capturable: AdamW's ``capturable`` flag; default True for the graph modes on CUDA, else
            False.
        optimizer: "torch" (``torch.optim.AdamW``) or "fp8ops" (:func:`fp8ops.adamw_` over every
            parameter, :class:`LibraryAdamW`; ``capturable`` does not apply).

    Returns:
        A :class:`StepResult`.
    """
    import fp8ops

    if mode not in MODES:
        raise ValueError(f"train: mode must be one of {MODES}, got {mode!r}")
    if model is None or params is None:
        model, params = make_model(device, steps=steps, fp8_head=fp8_head, fused_loss=fused_loss)
    if model.tokens.shape[0] < steps:
        raise ValueError(f"train: the model's data holds {model.tokens.shape[0]} steps, asked for {steps}")
    leaves, spec = pytree.tree_flatten(params)
    master = [t.detach().clone().requires_grad_() for t in leaves]
    if capturable is None:
        capturable = mode.startswith("graph_step") and torch.device(device).type == "cuda"
    if optimizer not in ("torch", "fp8ops"):
        raise ValueError(f"train: optimizer must be 'torch' or 'fp8ops', got {optimizer!r}")
    opt: Any = (LibraryAdamW(master, lr=lr, weight_decay=0.0, device=device) if optimizer == "fp8ops"
                else torch.optim.AdamW(master, lr=lr, weight_decay=0.0, capturable=capturable))
    states = init_states(model, recipe, device)

    def loss_fn(ps: Any, st: Any, pr: Any, tokens: Tensor, targets: Tensor) -> tuple[Tensor, Any]:
        return gpt_loss(ps, st, pr, tokens, targets, model=model, recipe=recipe, dtype=dtype)

    compiled = _compiled(loss_fn, mode, backend)
    torch._dynamo.reset()
    losses: list[float] = []
    first_grads: dict[str, Any] = {}
    first_probe_grads: Any = None
    last_grads: dict[str, Any] = {}

    def record(step: int, loss: Tensor, probe_grads: Any) -> None:
        """The loss of every step, the (probe) gradients of the first step and of the last."""
        nonlocal first_grads, first_probe_grads, last_grads
        if step == 0:
            first_grads = _grads(master)
            first_probe_grads = pytree.tree_map(
                lambda t: t.detach().clone() if isinstance(t, Tensor) else t, probe_grads)
        losses.append(float(loss.detach()))
        if step == steps - 1:
            last_grads = _grads(master)

    stepper = None
    if mode.startswith("graph_step"):

        def whole_step(st: Any, tokens: Tensor, targets: Tensor) -> tuple[Any, Any]:
            opt.zero_grad(set_to_none=True)
            probes = None if st is None else fp8ops.make_probes(st)
            loss, ns = compiled(pytree.tree_unflatten(master, spec), st, probes, tokens, targets)
            loss.backward()
            pg = None if probes is None else pytree.tree_map(lambda p: p.grad, probes)
            opt.step()
            new = None if recipe is None else fp8ops.update(ns, recipe=recipe, grad_amax=pg)
            return new, (loss.detach(), pg)

        stepper = fp8ops.graph_step(whole_step)
    for step in range(steps):
        tokens, targets = model.tokens[step], model.targets[step]
        if stepper is not None:
            states, (loss, probe_grads) = stepper(states, tokens, targets)
            record(step, loss, probe_grads)  # the replay left this step's gradients in .grad
            continue
        p_tree = pytree.tree_unflatten(master, spec)
        if mode.startswith("func."):
            probes = None if states is None else fp8ops.make_probes(states, requires_grad=False)
            plain = pytree.tree_map(lambda t: t.detach(), p_tree)

            def f(ps: Any, pr: Any) -> tuple[Tensor, Any]:
                loss, ns = loss_fn(ps, states, pr, tokens, targets)
                return loss, (() if ns is None else ns)  # a transform's aux output holds no None

            # without a recipe there are no probes: differentiate the parameters alone
            args = (plain,) if probes is None else (plain, probes)
            fa = (lambda ps: f(ps, None)) if probes is None else f
            argnums = 0 if probes is None else (0, 1)
            if mode == "func.grad":
                grads, new_states = torch.func.grad(fa, argnums=argnums, has_aux=True)(*args)
                loss = fa(*args)[0].detach()  # the value, for the curve (an extra eager forward)
            elif mode == "func.grad_and_value":
                grads, (loss, new_states) = torch.func.grad_and_value(fa, argnums=argnums, has_aux=True)(*args)
            else:
                loss, vjp_fn, new_states = torch.func.vjp(fa, *args, has_aux=True)
                grads = vjp_fn(torch.ones_like(loss))
                grads = grads[0] if probes is None else grads
            g_params, g_probes = (grads, None) if probes is None else grads
            for m, g in zip(master, pytree.tree_leaves(g_params)):
                m.grad = g.detach().clone()
            probe_grads = g_probes
        else:
            probes = None if states is None else fp8ops.make_probes(states)
            loss, new_states = compiled(p_tree, states, probes, tokens, targets)
            loss.backward()
            probe_grads = None if probes is None else pytree.tree_map(lambda p: p.grad, probes)
        record(step, loss, probe_grads)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if recipe is not None:
            states = fp8ops.update(new_states, recipe=recipe, grad_amax=probe_grads)
    return StepResult(losses, first_grads, first_probe_grads, states, last_grads,
                      None if stepper is None else dict(stepper.stats))


def max_rel_error(a: Mapping[str, Tensor], b: Mapping[str, Tensor]) -> tuple[float, str]:
    """The largest ``|a - b| / |a|`` (Frobenius norms) over matching entries, and its key."""
    worst, key = 0.0, ""
    for k, t in a.items():
        u = b[k]
        err = float((t.float() - u.float()).norm() / t.float().norm().clamp_min(1e-30))
        if not err <= worst:  # NaN counts as the worst
            worst, key = err if err == err else float("inf"), k
    return worst, key


def probe_leaves(r: StepResult) -> dict[str, Tensor]:
    """The first step's probe gradients as a flat ``{index: tensor}`` dict."""
    leaves = [t for t in pytree.tree_leaves(r.probe_grads) if isinstance(t, Tensor)]
    return {str(i): t for i, t in enumerate(leaves)}


def compare(want: StepResult, got: StepResult) -> dict[str, Any]:
    """Errors of ``got`` against ``want``: the worst parameter-gradient and probe-gradient relative
    errors of the first step (with the parameter's index) and the worst relative loss difference
    over the steps."""
    grad, key = max_rel_error(want.grads, got.grads)
    probe, _ = max_rel_error(probe_leaves(want), probe_leaves(got))
    loss = max(abs(a - b) / abs(a) for a, b in zip(want.losses, got.losses))
    return {"grad": grad, "grad_key": key, "probe": probe, "loss": loss}


_EAGER: dict[tuple[str, str, str], StepResult] = {}


def eager_result(recipe: str, dtype: torch.dtype, device: str, *, capturable: bool = False,
                 fp8_head: bool = False, fused_loss: bool = False) -> StepResult:
    """:func:`train` in eager mode for a recipe name (see :func:`make_recipe`), computed once per
    (recipe, dtype, device, capturable, fp8_head, fused_loss) in a process."""
    key = (recipe, str(dtype), device, capturable, fp8_head, fused_loss)
    if key not in _EAGER:
        _EAGER[key] = train("eager", recipe=make_recipe(recipe), dtype=dtype, device=device, capturable=capturable,
                            fp8_head=fp8_head, fused_loss=fused_loss)
    return _EAGER[key]


FP32_GRAD_TOL, FP32_LOSS_TOL = 1e-4, 1e-5
"""Bounds of a compiled float32 run against eager: reassociation only."""


def check_compiled(got: StepResult, recipe: str, dtype: torch.dtype, device: str, *, what: str,
                   capturable: bool = False, fp8_head: bool = False, fused_loss: bool = False) -> dict[str, Any]:
    """Assert that a compiled run ``got`` stays on eager's numbers; return the errors.

    Float32: :data:`FP32_GRAD_TOL` / :data:`FP32_LOSS_TOL`. Bfloat16: the fused casts of a compiler
    round differently and FP8 quantization can move an element across a rounding boundary (one
    E5M2 step is 25 %), so the bound is twice the distance between eager bfloat16 and eager float32
    for the same recipe; and the compiled run must be no farther from eager float32 than 1.5 times
    eager bfloat16 is (no bias).
    """
    want = eager_result(recipe, dtype, device, capturable=capturable, fp8_head=fp8_head, fused_loss=fused_loss)
    e = compare(want, got)
    if dtype == torch.float32:
        grad_tol, loss_tol = FP32_GRAD_TOL, FP32_LOSS_TOL
    else:
        ref = eager_result(recipe, torch.float32, device, capturable=capturable, fp8_head=fp8_head,
                           fused_loss=fused_loss)
        noise = compare(ref, want)
        grad_tol, loss_tol = 2 * noise["grad"], 2 * noise["loss"]
        own = compare(ref, got)["grad"]
        e["vs_fp32"], e["eager_vs_fp32"] = own, noise["grad"]
        assert own <= 1.5 * noise["grad"], (
            f"{what}: {own:.2e} from eager float32, eager bfloat16 is {noise['grad']:.2e} (a bias)")
    e["grad_tol"], e["loss_tol"] = grad_tol, loss_tol
    assert e["grad"] <= grad_tol, f"{what}: parameter {e['grad_key']} gradient error {e['grad']:.2e} > {grad_tol:.2e}"
    assert e["probe"] <= grad_tol, f"{what}: probe gradient error {e['probe']:.2e} > {grad_tol:.2e}"
    assert e["loss"] <= loss_tol, f"{what}: loss curves differ by {e['loss']:.2e} > {loss_tol:.2e}"
    return e
