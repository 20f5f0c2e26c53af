"""Full training steps of real models: plain PyTorch bf16 vs fp8ops (bf16 and FP8), eager, compiled
and as one CUDA graph per step (:func:`fp8ops.graph_step`).

A step is what a training loop runs: fresh probes, forward, backward, fused AdamW (capturable,
tensor learning rate) and, with FP8, :func:`fp8ops.update`. Models (bf16 parameters):

- ``gpt2``: GPT-2-small size, 12 layers, hidden 768, 12 heads, ffn 3072, seq 1024, batch 8 (8192
  tokens), vocabulary 50304, causal, head tied to the embedding; the torch model is a nanoGPT-style
  ``nn.Module`` (``nn.Linear``, ``F.scaled_dot_product_attention``); the fp8ops model is the GPT of
  :mod:`fp8ops.testing.composition` (embeddings, :func:`fp8ops.transformer_layer` layers, a final
  :func:`fp8ops.layer_norm`, the tied head) at that size;
- ``seed``: the seed layer, one ``transformer_layer`` (hidden 4096, ffn 16384, 32 heads, seq 2048,
  batch 4, dropout 0.1), loss ``(y * dy).sum()`` with a fixed random ``dy``; torch: the basic layer
  with SDPA.

``--quick``: the same models at 2 layers, hidden 256 / seq 256.

Per variant: ``ms/step`` (wall time of a loop of steps, synchronized at its ends), ``host ms`` (the
time a step call takes to return when the GPU is idle at its start: for a replayed graph, the graph
launch), ``kernels`` (device operations per step, torch.profiler, eager variants) and ``device ms``
(their summed durations). For the graph variants, ``replay / kernels``: ms/step over the summed
kernel time of the eager step (the launch gaps a graph leaves).
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils import _pytree as pytree

from .common import Progress, device_ops, environment, format_table, write_bar_chart, write_json

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of the step suite."""
    parser.add_argument("--models", nargs="+", default=["gpt2", "seed"], choices=["gpt2", "seed"])
    parser.add_argument("--steps", type=int, default=20, help="timed steps per variant (default 20)")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile variants")
    parser.add_argument("--profile", action="store_true",
                        help="print the top CUDA kernels of each eager variant and of torch compile")


# ------------------------------------------------------------------------------------------------
# Models


class TorchBlock(torch.nn.Module):
    """A pre-norm GPT block in plain torch: SDPA causal attention and a gelu-tanh MLP."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = torch.nn.LayerNorm(hidden), torch.nn.LayerNorm(hidden)
        self.qkv, self.proj = torch.nn.Linear(hidden, 3 * hidden), torch.nn.Linear(hidden, hidden)
        self.fc1, self.fc2 = torch.nn.Linear(hidden, 4 * hidden), torch.nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, _ = x.shape
        h = self.qkv(self.ln1(x)).view(B, S, 3, self.heads, -1).permute(2, 0, 3, 1, 4)  # (3, B, h, S, d)
        a = F.scaled_dot_product_attention(h[0], h[1], h[2], is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(B, S, -1))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))


class TorchGPT(torch.nn.Module):
    """nanoGPT-style GPT in plain torch (pre-norm, SDPA causal, gelu tanh, tied head)."""

    def __init__(self, layers: int, hidden: int, heads: int, seq: int, vocab: int) -> None:
        super().__init__()
        self.wte = torch.nn.Embedding(vocab, hidden)
        self.wpe = torch.nn.Embedding(seq, hidden)
        self.blocks = torch.nn.ModuleList([TorchBlock(hidden, heads) for _ in range(layers)])
        self.lnf = torch.nn.LayerNorm(hidden)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        S = tokens.shape[1]
        x = self.wte(tokens) + self.wpe.weight[:S]
        for b in self.blocks:
            x = b(x)
        logits = self.lnf(x) @ self.wte.weight.t()
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


# ------------------------------------------------------------------------------------------------
# Variants: each returns (step, carry, batch) with step(carry, *batch) -> (carry, loss)


LR = 1e-4
"""The learning rate of every step's AdamW."""


def _optimizer(params: list[torch.Tensor], device: str = "cuda") -> torch.optim.Optimizer:
    if device != "cuda":  # the CPU tests of the step
        return torch.optim.AdamW(params, lr=LR)
    return torch.optim.AdamW(params, lr=torch.tensor(LR, device="cuda"), fused=True, capturable=True)


FUSED_ADAMW = "fp8ops FP8 + fused AdamW"
"""The gpt build whose layers' GEMM weights are stepped by :func:`fp8ops.adamw_quantize_` and its
other parameters by :func:`fp8ops.adamw_`."""
FUSED_LOSS = "fp8ops FP8, fused loss"
"""The ``fp8ops FP8`` GPT with its head and loss in one :func:`fp8ops.linear_cross_entropy` (the other
fp8ops GPT builds: the head as a matmul and torch's ``F.cross_entropy``, as the torch model)."""
FUSED_ALL = "fp8ops FP8, fused loss + AdamW"
""":data:`FUSED_ADAMW` with the head and loss of :data:`FUSED_LOSS`: the library's own loss and
optimizer."""
TORCH_LIBRARY_ADAMW = "torch + fp8ops AdamW"
"""The torch bf16 GPT stepped by :func:`fp8ops.adamw_` instead of torch's fused AdamW: what the
library's optimizer alone gives a model without FP8."""


def _library_adamw(params: list[torch.Tensor], device: str = "cuda") -> Any:
    """``params`` stepped by :func:`fp8ops.adamw_` with the coefficients of :func:`_optimizer`."""
    from fp8ops.testing.composition import LibraryAdamW

    return LibraryAdamW(params, lr=LR, device=device)


def _fused_adamw_step(loss_of: Callable[..., Any], params: dict[str, Any], states: list[Any], recipe: Any,
                      mode: str, eager_first: bool, device: str) -> tuple[Callable[..., Any], Any]:
    """``(step, carry)`` of a GPT whose layers' GEMM weights are stepped by
    :func:`fp8ops.adamw_quantize_`, which also writes each weight's FP8 copy (under the scale that
    the step's :func:`fp8ops.update` just computed) for the next forward's ``weight_cache``; the
    other parameters (embeddings, norms, biases) by :func:`fp8ops.adamw_` (:func:`_library_adamw`).
    The same AdamW coefficients for all. ``loss_of(states, probes, caches, *batch)``; the first caches come from
    :func:`fp8ops.quantize_weight`. The step function's ``caches(states)`` builds the caches that
    a forward from ``states`` would take, and ``stepped`` is (the parameters, the optimizer of the
    other parameters, the weights stepped by the fused one), for tests."""
    import fp8ops
    from fp8ops._transformer_checks import WEIGHT_ROLES

    lr = torch.full((), LR, device=device)
    fused = []  # (layer, parameter key, state key, role, weight, exp_avg, exp_avg_sq, step count, FP8 buffers)
    states = [dict(s) for s in states]
    for i, lp in enumerate(params["layers"]):
        if "qkv.weight" not in lp:  # separate q, k, v weights share one state role: one cast each would not do
            raise ValueError("_fused_adamw_step: the layers need fused QKV weights (fuse_qkv_params=True)")
        for key in (k for k in WEIGHT_ROLES if k in lp):  # the GEMM weights: key -> (state key, role)
            skey, role = WEIGHT_ROLES[key]
            w = lp[key]
            cache, rs = fp8ops.quantize_weight(w, getattr(states[i][skey], role), recipe=recipe)
            states[i][skey] = states[i][skey].replace(**{role: rs})
            fused.append((i, key, skey, role, w, torch.zeros_like(w), torch.zeros_like(w),
                          torch.zeros((), device=device), cache.value))
    taken = {id(f[4]) for f in fused}
    opt = _library_adamw([p for p in pytree.tree_leaves(params) if id(p) not in taken], device)
    compiled = torch.compile(loss_of, fullgraph=True) if mode.startswith("compile") else loss_of
    first = [True] if eager_first else []

    def caches(st: list[Any]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = [{} for _ in st]
        for i, key, skey, role, w, *_, value in fused:
            out[i][key] = fp8ops.WeightCache(value, None, getattr(st[i][skey], role).scale, recipe, w)
        return out

    def fused_step(st: Any, *b: torch.Tensor) -> tuple[Any, torch.Tensor]:
        opt.zero_grad(set_to_none=True)
        for f in fused:
            f[4].grad = None
        probes = fp8ops.make_probes(st)
        fn = loss_of if first else compiled  # the first step (fresh states) eagerly, as in _variant
        first.clear()
        loss, ns = fn(st, probes, caches(st), *b)
        loss.backward()
        # the update first: the optimizer casts each weight under the next step's scale
        ns = [dict(s) for s in fp8ops.update(ns, recipe=recipe, grad_amax=pytree.tree_map(lambda p: p.grad, probes))]
        opt.step()
        nc = caches(ns)
        for i, key, skey, role, w, m, v, t, _ in fused:
            _, rs = fp8ops.adamw_quantize_(w, w.grad, m, v, t, getattr(ns[i][skey], role), recipe=recipe, lr=lr,
                                           out=nc[i][key])
            ns[i][skey] = ns[i][skey].replace(**{role: rs})
        return ns, loss.detach()

    fused_step.caches = caches  # type: ignore[attr-defined]
    fused_step.stepped = (params, opt, [f[4] for f in fused])  # type: ignore[attr-defined]
    return fused_step, states


def _variant(model: str, impl: str, mode: str, size: dict[str, int], eager_first: bool = True,
             device: str = "cuda") -> tuple[Callable[..., Any], Any, tuple[Any, ...]]:
    """``(step, carry, batch)`` of ``model`` ("gpt2": a GPT of ``size``; "seed": the seed layer) for
    ``impl`` ("torch", "torchao" (gpt2 only), "fp8ops bf16", "fp8ops FP8", "fp8ops FP8, FP8 head" (gpt2
    only: the tied output head through ``fp8_linear`` too), :data:`FUSED_LOSS` (gpt2 only: the head and
    its loss through ``linear_cross_entropy``), :data:`FUSED_ADAMW` (gpt2 only: the
    layers' GEMM weights stepped by :func:`fp8ops.adamw_quantize_`, :func:`_fused_adamw_step`),
    :data:`FUSED_ALL` (both), :data:`TORCH_LIBRARY_ADAMW` (the torch GPT stepped by
    :func:`fp8ops.adamw_`)); ``mode`` starting with
    "compile" compiles the model (torch) or the loss (fp8ops, ``fullgraph=True``); ``eager_first``:
    an fp8ops step's first call, over uncalibrated states, runs the loss eagerly (it is then compiled
    once, for calibrated states); ``device``: "cuda", or "cpu" for tests of the fp8ops builds."""
    import fp8ops

    recipe = fp8ops.DelayedScaling() if impl.startswith("fp8ops FP8") else None
    g = torch.Generator(device=device).manual_seed(1)
    if model == "gpt2":
        L, H, heads, S, B, V = (size[k] for k in ("layers", "hidden", "heads", "seq", "batch", "vocab"))
        tokens = torch.randint(0, V, (B, S), device=device, generator=g)
        targets = torch.randint(0, V, (B, S), device=device, generator=g)
        batch: tuple[Any, ...] = (tokens, targets)
        if impl in ("torch", "torchao", TORCH_LIBRARY_ADAMW):
            net = TorchGPT(L, H, heads, S, V).cuda().bfloat16()
            if impl == "torchao":  # float8 tensorwise training of every block's Linear (the head stays bf16)
                from torchao.float8 import Float8LinearConfig, convert_to_float8_training

                convert_to_float8_training(net, config=Float8LinearConfig.from_recipe_name("tensorwise"))
            loss_fn: Callable[..., Any] = torch.compile(net) if mode.startswith("compile") else net
            opt = (_library_adamw(list(net.parameters())) if impl == TORCH_LIBRARY_ADAMW
                   else _optimizer(list(net.parameters())))

            def torch_step(carry: Any, tok: torch.Tensor, tgt: torch.Tensor) -> tuple[Any, torch.Tensor]:
                opt.zero_grad(set_to_none=True)
                loss = loss_fn(tok, tgt)
                loss.backward()
                opt.step()
                return carry, loss.detach()

            return torch_step, None, batch
        from fp8ops.testing import composition

        fp8_head = impl == "fp8ops FP8, FP8 head"
        gpt, params = composition.make_model(device, layers=L, hidden=H, heads=heads, seq=S, batch=B, vocab=V,
                                             steps=1, fp8_head=fp8_head, fused_loss=impl in (FUSED_LOSS, FUSED_ALL))
        params = pytree.tree_map(lambda t: t.bfloat16().requires_grad_(), params)
        states = composition.init_states(gpt, recipe, device)

        if impl in (FUSED_ADAMW, FUSED_ALL):
            def loss_cached(st: Any, pr: Any, wc: Any, tok: torch.Tensor, tgt: torch.Tensor) -> Any:
                return composition.gpt_loss(params, st, pr, tok, tgt, model=gpt, recipe=recipe, dtype=torch.bfloat16,
                                            weight_caches=wc)

            step, carry = _fused_adamw_step(loss_cached, params, states, recipe, mode, eager_first, device)
            return step, carry, batch

        def loss_of(st: Any, pr: Any, tok: torch.Tensor, tgt: torch.Tensor) -> Any:
            return composition.gpt_loss(params, st, pr, tok, tgt, model=gpt, recipe=recipe, dtype=torch.bfloat16)
    else:
        H, F_, heads, S, B = (size[k] for k in ("hidden", "ffn", "heads", "seq", "batch"))
        x = torch.randn(S, B, H, device=device, generator=g).bfloat16().requires_grad_()
        dy = (torch.randn(S, B, H, device=device, generator=g) * 1e-2).bfloat16()
        batch = (x, dy)
        if impl == "torch":
            from fp8ops.reference.transformer_layer import BasicTransformerLayer

            net = BasicTransformerLayer(H, F_, heads, attention_dropout=0.1, hidden_dropout=0.1,
                                        attention_impl="sdpa").cuda().bfloat16()
            fwd: Callable[..., Any] = torch.compile(net) if mode.startswith("compile") else net
            opt = _optimizer(list(net.parameters()))

            def torch_layer_step(carry: Any, xx: torch.Tensor, d: torch.Tensor) -> tuple[Any, torch.Tensor]:
                opt.zero_grad(set_to_none=True)
                y = fwd(xx)
                y.backward(d)
                opt.step()
                return carry, y.detach().float().square().mean()

            return torch_layer_step, None, batch
        cfg = fp8ops.TransformerConfig(hidden_size=H, ffn_hidden_size=F_, num_attention_heads=heads,
                                       hidden_dropout=0.1, attention_dropout=0.1)
        params = {k: v.to(device).bfloat16().requires_grad_() for k, v in fp8ops.init_transformer_params(cfg).items()}
        states = None if recipe is None else fp8ops.init_transformer_state(cfg, recipe, device=device)

        def loss_of(st: Any, pr: Any, xx: torch.Tensor, d: torch.Tensor) -> Any:
            y, ns = fp8ops.transformer_layer(params, xx, st, config=cfg, recipe=recipe, probes=pr)
            return (y.float() * d.float()).sum(), ns

    opt = _optimizer(pytree.tree_leaves(params), device)
    compiled = torch.compile(loss_of, fullgraph=True) if mode.startswith("compile") else loss_of

    first = [True] if eager_first else []

    def fp8ops_step(st: Any, *b: torch.Tensor) -> tuple[Any, torch.Tensor]:
        opt.zero_grad(set_to_none=True)
        probes = None if st is None else fp8ops.make_probes(st)
        # the first step (its states are fresh, uncalibrated) runs eagerly, so that the loss is
        # compiled once, for the calibrated states its update makes (docs/scaling_state.md)
        fn = loss_of if first and st is not None else compiled
        first.clear()
        loss, ns = fn(st, probes, *b)
        loss.backward()
        opt.step()
        if st is not None:
            ns = fp8ops.update(ns, recipe=recipe, grad_amax=pytree.tree_map(lambda p: p.grad, probes))
        return ns, loss.detach()

    return fp8ops_step, states, batch


VARIANTS = [
    ("torch", "eager"), ("torch", "compile"), ("torch", "compile + graph"),
    ("fp8ops bf16", "eager"), ("fp8ops bf16", "graph"),
    ("fp8ops FP8", "eager"), ("fp8ops FP8", "graph"), ("fp8ops FP8", "compile + graph"),
]

SIZES = {
    "gpt2": {"layers": 12, "hidden": 768, "heads": 12, "seq": 1024, "batch": 8, "vocab": 50304},
    "seed": {"hidden": 4096, "ffn": 16384, "heads": 32, "seq": 2048, "batch": 4},
}
QUICK = {
    "gpt2": {"layers": 2, "hidden": 256, "heads": 4, "seq": 256, "batch": 4, "vocab": 8192},
    "seed": {"hidden": 1024, "ffn": 4096, "heads": 8, "seq": 512, "batch": 2},
}


def _measure(step: Callable[..., Any], carry: Any, batch: tuple[Any, ...], steps: int,
             profile: str | None = None) -> tuple[dict[str, Any], Any]:
    """Time ``step``: 4 warm-up steps, the host time of 5 steps started on an idle GPU, ``steps``
    timed steps, then the device operations of 2 steps. Returns (the record, the last carry)."""
    for _ in range(4):  # warm-up: compilation, calibration, the capture
        carry, loss = step(carry, *batch)
    torch.cuda.synchronize()
    host = []
    for _ in range(5):
        t0 = time.perf_counter()
        carry, loss = step(carry, *batch)
        host.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        carry, loss = step(carry, *batch)
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) / steps * 1e3
    state = {"carry": carry}

    def one() -> None:
        state["carry"], _ = step(state["carry"], *batch)

    kernels, device_us = device_ops(one, 2, table=profile)
    return ({"ms": ms, "host_ms": sorted(host)[len(host) // 2] * 1e3, "kernels": kernels,
             "device_ms": device_us / 1e3, "loss": float(loss)}, state["carry"])


def measure_variant(build: Callable[[], tuple[Callable[..., Any], Any, tuple[Any, ...]]], mode: str, steps: int,
                    tag: str, failed: list[str], progress: Progress, profile: str | None = None,
                    args_by_reference: tuple[int, ...] = ()) -> dict[str, Any] | None:
    """Build a variant's ``(step, carry, batch)``, run the step as built or, for a ``mode``
    containing "graph", through :func:`fp8ops.graph_step`, and time it (:func:`_measure`; graph
    modes also record ``graph_stats``). Returns the record, or None after appending a message
    naming ``tag`` to ``failed`` (an exception, or a graph that never replayed), so that one failing
    variant does not hide the others. Resets Dynamo first and frees the variant's memory after.
    ``args_by_reference``: passed to :func:`fp8ops.graph_step` (arguments the graph reads in place)."""
    import fp8ops

    torch._dynamo.reset()
    try:
        step, carry, batch = build()
        fn = fp8ops.graph_step(step, args_by_reference=args_by_reference) if "graph" in mode else step
        r, _ = _measure(fn, carry, batch, steps, profile)
        if "graph" in mode:
            r["graph_stats"] = dict(fn.stats)  # type: ignore[union-attr]
            if not fn.stats["replays"]:  # type: ignore[union-attr]
                raise RuntimeError(f"never captured ({fn.stats})")  # type: ignore[union-attr]
        return r
    except Exception as exc:  # noqa: BLE001  (one failing variant must not hide the others)
        failed.append(f"{tag}: {type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}")
        progress.note(failed[-1])
        return None
    finally:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Time every variant of every model; print the tables; write step.json and step.png."""

    sizes = QUICK if args.quick else SIZES
    variants = [v for v in VARIANTS if not (args.no_compile and "compile" in v[1])]
    progress = Progress(len(args.models) * len(variants), prefix="step")
    rows: list[dict[str, Any]] = []
    failed: list[str] = []
    for model in args.models:
        for impl, mode in variants:
            progress.step(f"{model}: {impl} {mode}")
            show = args.profile and (mode == "eager" or (impl == "torch" and mode == "compile"))
            r = measure_variant(lambda: _variant(model, impl, mode, sizes[model]), mode, args.steps,  # noqa: B023
                                f"{model} {impl} {mode}", failed, progress, f"{model} {impl} {mode}" if show else None)
            if r is None:
                continue
            if not math.isfinite(r["loss"]):
                failed.append(f"{model} {impl} {mode}: non-finite loss")
            rows.append({"model": model, "impl": impl, "mode": mode, **r})
    for model in args.models:
        mine = [r for r in rows if r["model"] == model]
        base = next((r for r in mine if r["impl"] == "torch" and r["mode"] == "eager"), None)
        best_torch = min((r["ms"] for r in mine if r["impl"] == "torch"), default=None)
        for r in mine:
            if base is not None:
                r["vs_torch_eager"] = base["ms"] / r["ms"]
            if best_torch is not None:
                r["vs_best_torch"] = best_torch / r["ms"]
            if "graph" in r["mode"]:
                eager = next((e for e in mine if e["impl"] == r["impl"] and e["mode"] == "eager"), None)
                if eager is not None and eager["device_ms"] > 0:
                    r["replay_over_kernels"] = r["ms"] / eager["device_ms"]
    cols = [("model", "model", ""), ("impl", "impl", ""), ("mode", "mode", ""), ("ms", "ms/step", ".2f"),
            ("host_ms", "host ms", ".2f"), ("kernels", "kernels", ".0f"), ("device_ms", "device ms", ".2f"),
            ("vs_best_torch", "x best torch", ".2f"), ("vs_torch_eager", "x torch eager", ".2f"),
            ("replay_over_kernels", "replay/kernels", ".3f")]
    print(format_table(rows, cols))
    record = {"suite": "step", "environment": environment(), "sizes": sizes, "rows": rows, "failed_checks": failed}
    out = Path(args.out)
    write_json(out / "step.json", record)
    panels = []
    for model in args.models:
        mine = [r for r in rows if r["model"] == model]
        panels.append({"title": f"{model}: ms per training step", "groups": [f"{r['impl']}\n{r['mode']}" for r in mine],
                       "series": {"ms/step": [r["ms"] for r in mine]}})
    write_bar_chart(out / "step.png", panels, title=f"full training steps ({torch.cuda.get_device_name()})",
                    ylabel="ms per step")
    return record
