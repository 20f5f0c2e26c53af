"""The seed transformer layer, forward+backward: fp8ops vs the basic layer, torch.compile, torchao.

Problem (the seed's): hidden H = 4096, ffn F = 16384, 32 heads (head dim 128), sequence S = 2048,
batch B = 4 (T = 8192 tokens), layout (S, B, H), pre-norm, gelu_tanh, biases, no attention mask,
dropout 0.1 on the attention probabilities and on the attention block's output (``--dropout``),
bf16 (the basic layer also in fp16, as in the seed). ``--quick``: H 1024, F 4096, 8 heads, S 1024,
B 2.

Implementations (all from the same weights):

- ``basic fp16`` / ``basic bf16``: the seed's ``BasicTransformerLayer`` (plain ``torch.nn``, two
  ``bmm`` and a softmax for attention; :mod:`fp8ops.reference.transformer_layer`);
- ``basic SDPA bf16``: the same with ``F.scaled_dot_product_attention``; ``+ compile``: under
  ``torch.compile``;
- ``torchao tensorwise + compile`` / ``torchao rowwise + compile``: the basic SDPA layer with its
  four Linear modules converted by ``torchao.float8.convert_to_float8_training``, compiled;
- ``fp8ops bf16``: :func:`fp8ops.transformer_layer` with ``recipe=None``;
  ``fp8ops delayed`` (state calibrated by one real step; each step runs fresh probes, the forward,
  the backward and :func:`fp8ops.update`, whose new state the next step runs with),
  ``fp8ops current`` (per-tensor current scaling, its state updated likewise), ``fp8ops current row-wise``, ``fp8ops delayed + compile``
  (``torch.compile(fullgraph=True)``), all with ``dropout_seed=None`` (the attention dropout mask from
  torch's generator, as in the peers: ``attention(backend="auto")`` may run SDPA); with dropout on,
  also ``fp8ops delayed, explicit dropout seed`` (a mask reproducible from a seed tensor per step: the
  Triton attention kernels).

Measured: the step time (median of CUDA-event-timed plain launches after warm-up, each step started
on an idle GPU, as in a loop that synchronizes every step, e.g. to log the loss; ``back to back µs``:
the per-step time of 8 steps launched without a synchronization between them, the steady state of
a loop that does not, where the host prepares a step while the GPU runs the one before; ``graph µs``
and ``graph b2b µs``: the same two timings of the step captured once as a CUDA graph and replayed
through :func:`fp8ops.graph_step`, its state carried from call to call, dropout included, for the
rows of :data:`GRAPH_ROWS`; ``--no-graph`` skips them), the
peak memory of one step (``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``
minus what was allocated before, parameter gradients cleared), and the ratio to torchao tensorwise
+ compile and to the basic fp16 layer.

Physical-limit estimate, from numbers measured in the same run:

    t_limit = sum over the 4 linear layers of the 3 GEMMs through ``torch._scaled_mm`` (fprop with
              fast accumulation, dgrad and wgrad without, on pre-quantized operands)
            + attention forward+backward (the faster of fp8ops attention and cuDNN / flash SDPA,
              without dropout)
            + elementwise bytes / device-copy bandwidth

The elementwise bytes are what a fully fused FP8 layer must still move outside GEMMs and attention
(bf16 = 2 bytes, FP8 = 1 byte; each FP8 operand also written transposed for its wgrad GEMM):
forward LN1 (read x, write q, q^T: 4·TH), attention output cast (4·TH), proj output + residual +
LN2 (read 2, read residual, write sum, write q, q^T: 8·TH), activation + cast (read h 2·TC, write
q, q^T 2·TF), fc2 output + residual (6·TH); backward: dy cast (4·TH), activation backward (read da
2·TF, read h 2·TC, write q, q^T 2·TC), LN2 backward (read dy, s, residual grad, write dx: 8·TH),
its cast (4·TH), dqkv cast (12·TH), LN1 backward (8·TH); every weight read once and written as
q and q^T (4 bytes per element). Total 58·TH + 6·TC + 4·TF + 4·W (C = fc1 rows). Each measured row
is printed as a multiple of t_limit.

Targets printed: fp8ops delayed >= 1.3x torchao tensorwise + compile, >= 2.0x basic fp16 (as
launched, and with each implementation in its fastest mode, as launched or as a graph), and peak
memory <= torchao tensorwise + compile's.

Checks (``failed_checks``): with dropout off (eval mode), the outputs and input gradients of the
fp8ops variants against the basic SDPA bf16 layer, relative error (norm of the difference over the
peer's norm): < 2e-2 for fp8ops bf16; FP8: output < 0.1, input gradient < 0.2 (gradients pass E5M2
casts, half-ulp 2^-3). ``--profile`` prints the top CUDA kernels of one fp8ops delayed step (torch.profiler).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.utils import _pytree as pytree

from . import common

__all__ = ["add_arguments", "run"]

SEED = {"hidden": 4096, "ffn": 16384, "heads": 32, "seq": 2048, "batch": 4}
QUICK = {"hidden": 1024, "ffn": 4096, "heads": 8, "seq": 1024, "batch": 2}
TORCHAO = "torchao tensorwise + compile"
BASIC_FP16 = "basic fp16"
FP8OPS = "fp8ops delayed"
FP8OPS_MODES = (FP8OPS, "fp8ops delayed + compile")
"""The rows whose fastest mode is fp8ops delayed's fastest mode in the targets."""
GRAPH_ROWS = (BASIC_FP16, "basic SDPA bf16 + compile", TORCHAO, FP8OPS, "fp8ops delayed + compile")
"""The rows also timed as one CUDA graph per step (:func:`fp8ops.graph_step`)."""
TARGETS = {"vs_torchao": 1.3, "vs_basic_fp16": 2.0}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of this suite."""
    parser.add_argument("--dropout", type=float, default=0.1,
                        help="attention and hidden dropout of every implementation (default 0.1, the seed's)")
    parser.add_argument("--no-graph", action="store_true",
                        help="skip the graph rows (each step one CUDA graph through fp8ops.graph_step)")
    parser.add_argument("--no-torchao", action="store_true", help="skip the torchao peers")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile cases")
    parser.add_argument("--profile", action="store_true",
                        help="print the top CUDA kernels of one fp8ops delayed step (torch.profiler)")
    parser.add_argument("--samples", type=int, default=None, help="timed samples per case (default 15, 6 with --quick)")


# ------------------------------------------------------------------------------------------------
# Cases: each is (step(x, dy) -> y, parameters) with a training and an eval (no dropout) variant


def seed_layer_inputs(dropout: float, device: str = "cuda") -> tuple[Any, dict[str, Tensor], Tensor, Tensor]:
    """The seed layer as the measurement scripts take it: ``(config, seed_state, x, dy)``, the
    :class:`TransformerConfig` of :data:`SEED` with ``dropout`` for the hidden and attention
    dropouts, the seed layer's fp32 CPU parameters (``torch.manual_seed(0)``), a bf16 (S, B, H) input
    that requires grad and a bf16 output gradient scaled by 1e-2 (generator seed 1)."""
    from fp8ops.reference.transformer_layer import BasicTransformerLayer
    from fp8ops.transformer_layer import TransformerConfig

    S, B, H, F, h = SEED["seq"], SEED["batch"], SEED["hidden"], SEED["ffn"], SEED["heads"]
    config = TransformerConfig(hidden_size=H, ffn_hidden_size=F, num_attention_heads=h, hidden_dropout=dropout,
                               attention_dropout=dropout)
    torch.manual_seed(0)
    seed_state = {k: v.clone() for k, v in BasicTransformerLayer(H, F, h).state_dict().items()}
    g = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(S, B, H, device=device, generator=g).bfloat16().requires_grad_()
    dy = (torch.randn(S, B, H, device=device, generator=g) * 1e-2).bfloat16()
    return config, seed_state, x, dy


def _basic(seed_state: dict[str, Tensor], dims: dict[str, int], dropout: float, impl: str,
           dtype: torch.dtype) -> torch.nn.Module:
    from fp8ops.reference.transformer_layer import BasicTransformerLayer

    m = BasicTransformerLayer(dims["hidden"], dims["ffn"], dims["heads"], attention_dropout=dropout,
                              hidden_dropout=dropout, attention_impl=impl)
    m.load_state_dict(seed_state)
    return m.to(device="cuda", dtype=dtype)


def _module_case(m: torch.nn.Module, compiled: bool) -> tuple[Any, Any, list[Tensor]]:
    fn = torch.compile(m) if compiled else m

    def step(x: Tensor, dy: Tensor) -> Tensor:
        m.train()
        y = fn(x)
        y.backward(dy)
        return y.detach()  # keeps no autograd graph alive between steps (CUDA-graph capture needs that)

    def eval_step(x: Tensor, dy: Tensor) -> Tensor:
        m.eval()
        y = fn(x)
        y.backward(dy)
        m.train()
        return y.detach()

    params = list(m.parameters())

    def carry_step(carry: Any, x: Tensor, dy: Tensor) -> tuple[Any, tuple[()]]:
        for t in [*params, x]:
            t.grad = None
        step(x, dy)
        return carry, ()

    step.carry_step = (carry_step, None)  # type: ignore[attr-defined]  # for the graph rows
    return step, eval_step, params


def _torchao_case(m: torch.nn.Module, recipe_name: str) -> tuple[Any, Any, list[Tensor]]:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    convert_to_float8_training(m, config=Float8LinearConfig.from_recipe_name(recipe_name))
    return _module_case(m, compiled=True)


def _fp8ops_case(seed_state: dict[str, Tensor], config: Any, recipe: Any, x0: Tensor, dy0: Tensor, *,
                 compiled: bool = False, explicit_seed: bool = False, device: str = "cuda"
                 ) -> tuple[Any, Any, list[Tensor]]:
    """``(step, eval_step, params)`` of the fp8ops layer. A training step with a recipe is what the
    training loop runs for the layer: fresh probes (delayed scaling), forward, backward and
    :func:`fp8ops.update` of the state it carries to the next step; the eval step does not observe."""
    import fp8ops
    from fp8ops.transformer_layer import (
        init_transformer_state,
        params_from_basic_layer,
        transformer_layer,
    )

    params = {k: v.to(device=device, dtype=x0.dtype).requires_grad_()
              for k, v in params_from_basic_layer(seed_state, config).items()}
    state = None
    probes_on = recipe is not None and recipe.mode == "delayed"
    if recipe is not None:
        # One real step calibrates the state (first-step current scaling), as in training.
        state = init_transformer_state(config, recipe, device=device)
        probes = fp8ops.make_probes(state)
        y, new_state = transformer_layer(params, x0, state, config=config, recipe=recipe, probes=probes)
        y.backward(dy0)
        grads = pytree.tree_map(lambda p: p.grad, probes)
        state = fp8ops.update(new_state, recipe=recipe, grad_amax=grads)
        for t in [*params.values(), x0]:
            t.grad = None
        del y, new_state, probes, grads

    def layer(x: Tensor, st: Any, probes: Any, seed: Tensor, training: bool) -> tuple[Tensor, Any]:
        # dropout_seed=None (the default): the attention dropout mask comes from torch's generator,
        # as in the peers, and attention(backend="auto") may run SDPA; an explicit seed (a mask
        # reproducible from the seed alone) runs fp8ops's Triton attention.
        return transformer_layer(params, x, st, config=config, recipe=recipe, probes=probes, training=training,
                                 dropout_seed=seed if explicit_seed else None)

    if compiled:
        torch._dynamo.reset()
    fn = torch.compile(layer, fullgraph=True) if compiled else layer
    seeds = torch.randint(0, 2**31 - 1, (64,), device=device, dtype=torch.int64)
    count = [0]
    carry = [state]

    def run_step(x: Tensor, dy: Tensor, training: bool) -> Tensor:
        st = carry[0]
        probes = fp8ops.make_probes(st) if probes_on and training else None
        count[0] += 1
        y, new_state = fn(x, st, probes, seeds[count[0] % 64:count[0] % 64 + 1], training)
        y.backward(dy)
        if training and recipe is not None:  # the state the next step runs with
            carry[0] = fp8ops.update(new_state, recipe=recipe, grad_amax=probes)
        return y.detach()

    def step(x: Tensor, dy: Tensor) -> Tensor:
        return run_step(x, dy, True)

    def eval_step(x: Tensor, dy: Tensor) -> Tensor:
        return run_step(x, dy, False)

    def carry_step(st: Any, x: Tensor, dy: Tensor) -> tuple[Any, tuple[()]]:
        # the training step with its state passed in and returned, for fp8ops.graph_step; the
        # dropout mask comes from torch's generator (an explicit seed would be frozen in a capture)
        for t in [*params.values(), x]:
            t.grad = None
        probes = fp8ops.make_probes(st) if probes_on else None
        y, new_state = fn(x, st, probes, seeds[:1], True)
        y.backward(dy)
        if recipe is not None:
            new_state = fp8ops.update(new_state, recipe=recipe, grad_amax=probes)
        return new_state, ()

    step.state = lambda: carry[0]  # type: ignore[attr-defined]  # for tests
    if not explicit_seed:
        step.carry_step = (carry_step, state)  # type: ignore[attr-defined]  # for the graph rows
    return step, eval_step, list(params.values())


# ------------------------------------------------------------------------------------------------
# The physical limit


def elementwise_bytes(T: int, H: int, F: int, C: int) -> dict[str, float]:
    """Bytes a fully fused FP8 layer moves outside GEMMs and attention (see the module docstring)."""
    W = 3 * H * H + H * H + C * H + H * F
    return {"activations_TH": 58.0 * T * H, "mlp_TC_TF": 6.0 * T * C + 4.0 * T * F, "weights": 4.0 * W,
            "total": 58.0 * T * H + 6.0 * T * C + 4.0 * T * F + 4.0 * W}


def _attention_time(B: int, h: int, S: int, d: int, samples: int, notes: list[str]) -> dict[str, float]:
    """fwd+bwd µs of fp8ops attention and SDPA (cuDNN, flash) at (B, h, S, d) bf16, no mask, no dropout."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import fp8ops

    g = torch.Generator(device="cuda").manual_seed(7)
    q, k, v = (torch.randn(B, h, S, d, device="cuda", generator=g).bfloat16().requires_grad_() for _ in range(3))
    do = torch.randn(B, h, S, d, device="cuda", generator=g).bfloat16()

    def fwd_bwd(fn: Any) -> Any:
        def step(q: Tensor, k: Tensor, v: Tensor, do: Tensor) -> None:
            q.grad = k.grad = v.grad = None
            fn(q, k, v).backward(do)

        return step

    def sdpa(backend: Any) -> Any:
        def fn(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(q, k, v)

        return fn

    cases = {"fp8ops attention": lambda q, k, v: fp8ops.attention(q, k, v)[0],
             "SDPA cuDNN": sdpa(SDPBackend.CUDNN_ATTENTION), "SDPA flash": sdpa(SDPBackend.FLASH_ATTENTION)}
    out = {}
    for name, fn in cases.items():
        try:
            out[name] = common.time_cuda(fwd_bwd(fn), [(q, k, v, do)], samples=samples).median_us
        except Exception as exc:  # noqa: BLE001  (a backend may not support the shape or this GPU)
            notes.append(f"attention limit: {name} failed: {type(exc).__name__}: {str(exc)[:200]}")
    return out


def physical_limit(dims: dict[str, int], C: int, samples: int, notes: list[str]) -> dict[str, Any]:
    """Measure the three parts of the physical-limit estimate; return them and their sum (µs)."""
    from .linear import _gemm_ceiling

    H, F, h, S, B = dims["hidden"], dims["ffn"], dims["heads"], dims["seq"], dims["batch"]
    T = S * B
    gemms = {}
    for name, (K, N) in {"qkv": (H, 3 * H), "proj": (H, H), "fc1": (H, C), "fc2": (F, H)}.items():
        gemms[name] = _gemm_ceiling(T, K, N, samples)
    gemm_us = sum(sum(g.values()) for g in gemms.values())
    gemm_flops = sum(6.0 * T * K * N for K, N in ((H, 3 * H), (H, H), (H, C), (F, H)))
    attn = _attention_time(B, h, S, H // h, samples, notes)
    attn_best = min(attn, key=attn.get) if attn else None
    attn_us = attn[attn_best] if attn_best else float("nan")
    attn_flops = 4.0 * B * h * S * S * (H // h) * 3.5
    copy = common.copy_bandwidth()
    eb = elementwise_bytes(T, H, F, C)
    elem_us = eb["total"] / copy["tbps"] / 1e6
    return {"gemm_us": gemm_us, "gemms": gemms, "gemm_tflops": gemm_flops / gemm_us / 1e6,
            "attention_us": attn_us, "attention": attn, "attention_best": attn_best,
            "attention_tflops": attn_flops / attn_us / 1e6, "copy_tbps": copy["tbps"], "elementwise_bytes": eb,
            "elementwise_us": elem_us, "total_us": gemm_us + attn_us + elem_us,
            "flops": gemm_flops + attn_flops}


# ------------------------------------------------------------------------------------------------
# The suite


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the suite; print the table; write layer.json and layer.png; return the record."""
    import fp8ops
    from fp8ops.reference.transformer_layer import BasicTransformerLayer
    from fp8ops.transformer_layer import TransformerConfig

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    samples = args.samples or (6 if args.quick else 15)
    dims = QUICK if args.quick else SEED
    H, Fh, h, S, B = dims["hidden"], dims["ffn"], dims["heads"], dims["seq"], dims["batch"]
    T = S * B
    p = args.dropout
    env = common.environment()
    print(common.describe_environment(env))
    print(f"layer: hidden {H}, ffn {Fh}, {h} heads, seq {S}, batch {B} ({T} tokens), pre-norm, gelu_tanh, "
          f"no mask, dropout {p:g}")
    config = TransformerConfig(hidden_size=H, ffn_hidden_size=Fh, num_attention_heads=h, hidden_dropout=p,
                               attention_dropout=p)
    torch.manual_seed(0)
    seed_state = {k: v.clone() for k, v in BasicTransformerLayer(H, Fh, h).state_dict().items()}  # fp32, CPU
    with torch.no_grad():  # random LayerNorm affine and biases, not ones/zeros
        for k, v in seed_state.items():
            if k.endswith("bias"):
                v.normal_(0.0, 0.02)
            elif k.startswith("ln") and k.endswith("weight"):
                v.normal_(1.0, 0.1)

    def basic(impl: str, dtype: torch.dtype) -> torch.nn.Module:
        return _basic(seed_state, dims, p, impl, dtype)

    impls: list[tuple[str, torch.dtype, Any]] = [
        (BASIC_FP16, torch.float16, lambda x0, dy0: _module_case(basic("bmm", torch.float16), False)),
        ("basic bf16", torch.bfloat16, lambda x0, dy0: _module_case(basic("bmm", torch.bfloat16), False)),
        ("basic SDPA bf16", torch.bfloat16, lambda x0, dy0: _module_case(basic("sdpa", torch.bfloat16), False)),
    ]
    if not args.no_compile:
        impls.append(("basic SDPA bf16 + compile", torch.bfloat16,
                      lambda x0, dy0: _module_case(basic("sdpa", torch.bfloat16), True)))
    if not args.no_torchao and not args.no_compile:
        try:
            import torchao  # noqa: F401

            for name in ("tensorwise", "rowwise"):
                impls.append((f"torchao {name} + compile", torch.bfloat16,
                              lambda x0, dy0, n=name: _torchao_case(basic("sdpa", torch.bfloat16), n)))
        except Exception as exc:  # noqa: BLE001  (torchao missing or incompatible: say so, keep going)
            print(f"torchao unavailable: {type(exc).__name__}: {exc}")
    impls += [
        ("fp8ops bf16", torch.bfloat16, lambda x0, dy0: _fp8ops_case(seed_state, config, None, x0, dy0)),
        (FP8OPS, torch.bfloat16,
         lambda x0, dy0: _fp8ops_case(seed_state, config, fp8ops.DelayedScaling(), x0, dy0)),
        ("fp8ops current", torch.bfloat16,
         lambda x0, dy0: _fp8ops_case(seed_state, config, fp8ops.CurrentScaling(), x0, dy0)),
        ("fp8ops current row-wise", torch.bfloat16,
         lambda x0, dy0: _fp8ops_case(seed_state, config, fp8ops.CurrentScaling(granularity="row"), x0, dy0)),
    ]
    if p > 0:
        impls.append(("fp8ops delayed, explicit dropout seed", torch.bfloat16,
                      lambda x0, dy0: _fp8ops_case(seed_state, config, fp8ops.DelayedScaling(), x0, dy0,
                                                   explicit_seed=True)))
    if not args.no_compile:
        impls.append(("fp8ops delayed + compile", torch.bfloat16,
                      lambda x0, dy0: _fp8ops_case(seed_state, config, fp8ops.DelayedScaling(), x0, dy0,
                                                   compiled=True)))
    progress = common.Progress(len(impls) + 1 + int(args.profile), prefix="layer")
    use_graph = not args.no_graph
    rows: list[dict[str, Any]] = []
    failed: list[str] = []
    notes: list[str] = []
    t0 = time.perf_counter()
    g = torch.Generator(device="cuda").manual_seed(1)
    base_sets = [(torch.randn(S, B, H, device="cuda", generator=g), torch.randn(S, B, H, device="cuda", generator=g)
                  * 1e-2) for _ in range(2)]
    checks: dict[str, tuple[Tensor, Tensor]] = {}
    for label, dtype, make in impls:
        progress.step(label)
        x_sets = [(x.to(dtype).requires_grad_(), dy.to(dtype)) for x, dy in base_sets]
        try:
            step, eval_step, params = make(*x_sets[0])
            fn = common.clearing_grads(step, params)
            if label in ("basic SDPA bf16", "fp8ops bf16", FP8OPS, "fp8ops current", "fp8ops current row-wise"):
                x, dy = x_sets[0]
                y = common.clearing_grads(eval_step, params)(x, dy)
                checks[label] = (y.detach().clone(), x.grad.detach().clone())
            fn(*x_sets[0])
            te = common.time_cuda(fn, x_sets, samples=samples, use_graph=False)
            b2b = statistics.median(common._loop_times(fn, x_sets, 8, max(3, samples // 3)))
            peak = common.step_peak_bytes(step, params, *x_sets[0])
            graph = None
            if use_graph and label in GRAPH_ROWS and hasattr(step, "carry_step"):
                try:
                    graph = _graph_times(step, x_sets[0], samples, notes, label)
                except Exception as exc:  # noqa: BLE001  (the eager row stands; the graph's failure is a check)
                    msg = f"{label}, graph: {type(exc).__name__}: {str(exc)[:300]}"
                    progress.note(f"failed: {msg}")
                    failed.append(msg)
        except Exception as exc:  # noqa: BLE001  (recorded as a failed check)
            msg = f"{label}: {type(exc).__name__}: {str(exc)[:300]}"
            progress.note(f"failed: {msg}")
            failed.append(msg)
            continue
        finally:
            torch.cuda.synchronize()
        rows.append({"impl": label, "step_us": te.median_us, "b2b_us": b2b,
                     "graph_us": None if graph is None else graph["step_us"],
                     "graph_b2b_us": None if graph is None else graph["b2b_us"],
                     "graph_stats": None if graph is None else graph["stats"],
                     "peak_mib": peak / 2**20, "peak_bytes": peak, "timing": te.as_dict()})
        del step, eval_step, params, fn, x_sets
        gc.collect()
        torch.cuda.empty_cache()

    progress.step("physical limit: _scaled_mm GEMMs, attention, copy bandwidth")
    C = config.ffn_hidden_size * (2 if config.activation in ("swiglu", "geglu", "reglu") else 1)
    try:
        limit: dict[str, Any] | None = physical_limit(dims, C, samples, notes)
    except Exception as exc:  # noqa: BLE001  (recorded as a failed check; the rows stand)
        failed.append(f"physical limit: {type(exc).__name__}: {str(exc)[:300]}")
        limit = None
    _ratios(rows, limit)
    for n in notes:
        print(f"  note: {n}")
    failed += _checks(checks)
    cols = [("impl", "implementation", "s"), ("step_us", "fwd+bwd µs", ".0f"), ("b2b_us", "back to back µs", ".0f"),
            ("graph_us", "graph µs", ".0f"), ("graph_b2b_us", "graph b2b µs", ".0f"),
            ("tflops", "TFLOP/s", ".0f"), ("x_limit", "x limit", ".2f"), ("speedup_vs_torchao", "x torchao tw", ".3f"),
            ("speedup_vs_basic_fp16", "x basic fp16", ".3f"), ("b2b_speedup_vs_torchao", "b2b x torchao", ".3f"),
            ("b2b_speedup_vs_basic_fp16", "b2b x fp16", ".3f"), ("peak_mib", "peak MiB", ".0f"),
            ("memory_vs_torchao", "mem / torchao", ".3f")]
    print()
    print(common.format_table(rows, cols))
    if limit is not None:
        _print_limit(limit)
    targets = _targets(rows)
    for t in targets:
        print(t["line"])
    profile = None
    if args.profile:
        progress.step("profile of one fp8ops delayed step")
        try:
            profile = _profile(seed_state, config, base_sets[0])
        except Exception as exc:  # noqa: BLE001  (recorded as a failed check)
            failed.append(f"profile: {type(exc).__name__}: {str(exc)[:300]}")
        else:
            print(profile)
            (out / "layer_profile.txt").write_text(profile + "\n")
    record = {"suite": "layer", "environment": env, "dims": dims, "dropout": p, "rows": rows, "limit": limit,
              "targets": targets, "failed_checks": failed, "notes": notes, "profile": profile,
              "seconds": time.perf_counter() - t0}
    common.write_json(out / "layer.json", record)
    try:
        names = [r["impl"] for r in rows]
        panels = [{"title": "forward + backward time (ms)", "groups": names,
                   "series": {"step": [r["step_us"] / 1e3 for r in rows]}},
                  {"title": "peak memory of a step (GiB)", "groups": names,
                   "series": {"peak": [r["peak_bytes"] / 2**30 for r in rows]}}]
        hlines = [] if limit is None else [(limit["total_us"] / 1e3, "physical limit (ms)")]
        common.write_bar_chart(out / "layer.png", panels, title=f"transformer layer H {H}, F {Fh}, {h} heads, "
                               f"S {S}, B {B}", ylabel="ms | GiB", hlines=hlines)
    except Exception as exc:  # noqa: BLE001  (the plot is a convenience; the JSON and the table are the record)
        print(f"plot skipped: {type(exc).__name__}: {exc}")
    return record


def _print_limit(limit: dict[str, Any]) -> None:
    eb = limit["elementwise_bytes"]
    print(f"\nphysical limit {limit['total_us']:.0f} µs = GEMMs {limit['gemm_us']:.0f} µs (_scaled_mm, "
          f"{limit['gemm_tflops']:.0f} TFLOP/s) + attention {limit['attention_us']:.0f} µs "
          f"({limit['attention_best']}, "
          f"{limit['attention_tflops']:.0f} TFLOP/s) + elementwise {limit['elementwise_us']:.0f} µs "
          f"({eb['total'] / 1e9:.2f} GB at {limit['copy_tbps']:.2f} TB/s copy bandwidth)")


def _checks(checks: dict[str, tuple[Tensor, Tensor]]) -> list[str]:
    failed = []
    ref = checks.get("basic SDPA bf16")
    if ref is None:
        return ["checks: the basic SDPA bf16 layer did not run; nothing to compare with"]
    # (label, bound on the output, bound on the input gradient)
    for label, *bounds in (("fp8ops bf16", 2e-2, 2e-2), (FP8OPS, 0.1, 0.2), ("fp8ops current", 0.1, 0.2),
                           ("fp8ops current row-wise", 0.1, 0.2)):
        if label not in checks:
            continue
        for i, what in enumerate(("output", "input gradient")):
            bound = bounds[i]
            err = common.rel_err(checks[label][i], ref[i])
            print(f"  check {label} vs basic SDPA bf16 (no dropout): {what} relative error {err:.2e} (bound {bound:g})")
            if not err < bound:
                failed.append(f"{label}: {what} differs from basic SDPA bf16: relative error {err:.3e} > {bound:g}")
    return failed


def _ratios(rows: list[dict[str, Any]], limit: dict[str, Any] | None) -> None:
    """Add to each row its TFLOP/s and multiple of the limit, its speed-ups over torchao tensorwise +
    compile and over the basic fp16 layer (as launched from an idle GPU, back to back, and with each
    in its fastest mode: as launched or as a graph, fp8ops delayed eager or compiled), and its
    memory over torchao's."""
    for r in rows:
        if limit is not None:
            r["tflops"] = limit["flops"] / r["step_us"] / 1e6
            r["x_limit"] = r["step_us"] / limit["total_us"]
        for key, peer in (("speedup_vs_torchao", TORCHAO), ("speedup_vs_basic_fp16", BASIC_FP16)):
            pr = next((q for q in rows if q["impl"] == peer), None)
            if pr is not None:
                r[key] = pr["step_us"] / r["step_us"]
                r[f"b2b_{key}"] = pr["b2b_us"] / r["b2b_us"]
                mine = [q for q in rows if q["impl"] in FP8OPS_MODES] if r["impl"] == FP8OPS else [r]
                r[f"best_{key}"] = (_best(pr, "step_us", "graph_us")
                                    / min(_best(q, "step_us", "graph_us") for q in mine))
                r[f"best_b2b_{key}"] = (_best(pr, "b2b_us", "graph_b2b_us")
                                        / min(_best(q, "b2b_us", "graph_b2b_us") for q in mine))
        pr = next((q for q in rows if q["impl"] == TORCHAO), None)
        if pr is not None:
            r["memory_vs_torchao"] = r["peak_bytes"] / pr["peak_bytes"]


def _best(row: dict[str, Any], *keys: str) -> float:
    return min(row[k] for k in keys if row.get(k) is not None)


def _graph_times(step: Any, xs: tuple[Tensor, Tensor], samples: int, notes: list[str], label: str
                 ) -> dict[str, Any] | None:
    """The step as one CUDA graph (:func:`fp8ops.graph_step`, its state carried from call to call),
    timed as the eager rows: each step started on an idle GPU, and back to back; None (with a note)
    where the graph never replayed."""
    import fp8ops

    fn, carry0 = step.carry_step
    graphed = fp8ops.graph_step(fn, args_by_reference=(1,))  # dy read in place (x requires grad: too)
    carry = [carry0]

    def call(x: Tensor, dy: Tensor) -> None:
        carry[0], _ = graphed(carry[0], x, dy)

    try:
        te = common.time_cuda(call, [xs], samples=samples, use_graph=False)
        b2b = statistics.median(common._loop_times(call, [xs], 8, max(3, samples // 3)))
    finally:
        torch.cuda.synchronize()
    stats = dict(graphed.stats)
    if not stats["replays"]:
        notes.append(f"{label}: the graph row never replayed ({stats}); not recorded")
        return None
    return {"step_us": te.median_us, "b2b_us": b2b, "stats": stats}


def _targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    r = next((q for q in rows if q["impl"] == FP8OPS), None)
    out = []
    for timing, prefix in (("each step started on an idle GPU", ""), ("steps back to back", "b2b_"),
                           ("fastest mode of each (as launched or as a graph; fp8ops eager or compiled), each step "
                            "started on an idle GPU", "best_"),
                           ("fastest mode of each (as launched or as a graph; fp8ops eager or compiled), steps back "
                            "to back", "best_b2b_")):
        for key, peer in (("vs_torchao", TORCHAO), ("vs_basic_fp16", BASIC_FP16)):
            want = TARGETS[key]
            got = None if r is None else r.get(f"{prefix}speedup_{key}")
            met = None if got is None else got >= want
            shown = "not measured" if got is None else f"{got:.3f}x -> {'met' if met else 'NOT met'}"
            out.append({"target": f"{FP8OPS} >= {want}x {peer} ({timing})", "value": got, "met": met,
                        "line": f"target: {FP8OPS} >= {want}x {peer} ({timing}): {shown}"})
    got = None if r is None else r.get("memory_vs_torchao")
    met = None if got is None else got <= 1.0
    shown = "not measured" if got is None else f"{got:.2f}x -> {'met' if met else 'NOT met'}"
    out.append({"target": f"{FP8OPS} peak memory <= {TORCHAO}", "value": got, "met": met,
                "line": f"target: {FP8OPS} peak memory <= {TORCHAO}: {shown}"})
    return out


def _profile(seed_state: dict[str, Tensor], config: Any, base: tuple[Tensor, Tensor]) -> str:
    """Top CUDA kernels (by self device time) of one fp8ops delayed step, after two warm-up steps."""
    from torch.profiler import ProfilerActivity, profile

    import fp8ops

    x, dy = base[0].bfloat16().requires_grad_(), base[1].bfloat16()
    step, _, params = _fp8ops_case(seed_state, config, fp8ops.DelayedScaling(), x, dy)
    fn = common.clearing_grads(step, params)
    for _ in range(2):
        fn(x, dy)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn(x, dy)
        torch.cuda.synchronize()
    events = prof.key_averages()
    for key in ("self_device_time_total", "self_cuda_time_total"):
        try:
            return events.table(sort_by=key, row_limit=30, max_name_column_width=80)
        except (AttributeError, KeyError, ValueError):  # the key's name differs between torch versions
            pass
    return events.table(row_limit=30)


if __name__ == "__main__":
    import sys

    _p = argparse.ArgumentParser(prog="python -m fp8ops.bench.layer")
    _p.add_argument("--out", default="bench_out")
    _p.add_argument("--quick", action="store_true")
    add_arguments(_p)
    _rec = run(_p.parse_args())
    sys.exit(1 if _rec["failed_checks"] else 0)
