"""Host cost and kernels per call of every op, forward+backward, next to the torch equivalent.

At small sizes (128 tokens, hidden 256) the GPU finishes each kernel in a few µs, so the time a
Python loop of training calls takes is the host's: validation, state packing, autograd glue,
dispatch and kernel launches. Per case:

- ``host µs``: a loop of forward+backward calls (fresh probes each call, as in training) launched
  without synchronization, wall time per call; the device is idle most of the time, so this is
  CPU time of the call;
- ``kernels``: device operations (kernels, memsets, copies) per call, from ``torch.profiler``;
- ``device µs``: the sum of their durations per call.

Cases: ``fp8_linear`` (no FP8, delayed, current scaling), ``layernorm_linear``, ``fused_ln_mlp``,
``transformer_layer`` (no FP8 and delayed), ``attention`` (causal), ``layer_norm``,
``fp8ops.update`` of a transformer layer's state and ``make_probes``; peers: ``F.linear``,
``F.layer_norm`` + ``F.linear``, a torch MLP, the basic torch layer with SDPA, SDPA alone.

Targets printed: ``fp8_linear`` delayed forward+backward <= 150 µs, ``transformer_layer`` delayed
<= 1000 µs of host time. ``--profile`` also prints the top host functions (cProfile) of
``fp8_linear`` and ``transformer_layer``.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from .common import Progress, device_ops, environment, format_table, host_us, write_bar_chart, write_json

__all__ = ["TARGETS_US", "add_arguments", "cases", "run"]

TARGETS_US = {"fp8_linear delayed": 150.0, "transformer_layer delayed": 1000.0}
"""Host-time targets (µs per forward+backward call) of the named cases."""

T, H, FFN, HEADS, S = 128, 256, 1024, 4, 64  # tokens, hidden, ffn, heads; S x B = 64 x 2 for the layer


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of the host suite."""
    parser.add_argument("--profile", action="store_true",
                        help="also print the top host functions (cProfile) of fp8_linear and transformer_layer")
    parser.add_argument("--calls", type=int, default=200, help="timed calls per case (default 200)")


def _leaf(*shape: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, device="cuda") * scale).bfloat16().requires_grad_()


def _calibrated(state: Any, recipe: Any) -> Any:
    """``state`` (an op state or a pytree of them) calibrated, as after the first update."""
    import fp8ops
    from fp8ops.testing.states import calibrate
    from torch.utils import _pytree as pytree

    return pytree.tree_map(lambda s: calibrate(s, recipe) if isinstance(s, fp8ops.OpState) else s,
                           state, is_leaf=lambda s: isinstance(s, fp8ops.OpState))


def cases() -> dict[str, Callable[[], None]]:
    """Name -> one forward+backward call (fresh probes), all on CUDA in bf16."""
    import fp8ops
    from fp8ops.reference.transformer_layer import BasicTransformerLayer

    delayed, current = fp8ops.DelayedScaling(), fp8ops.CurrentScaling()
    x, w, b = _leaf(T, H), _leaf(H, H, scale=0.06), _leaf(H, scale=0.1)
    g, beta = _leaf(H), _leaf(H)
    w1, b1, w2, b2 = _leaf(FFN, H, scale=0.06), _leaf(FFN), _leaf(H, FFN, scale=0.03), _leaf(H)
    lin_d = _calibrated(fp8ops.LinearState.init(delayed, device="cuda"), delayed)
    lin_c = fp8ops.LinearState.init(current, device="cuda")
    lnl = _calibrated(fp8ops.LayerNormLinearState.init(delayed, device="cuda"), delayed)
    mlp = _calibrated(fp8ops.LayerNormMLPState.init(delayed, device="cuda"), delayed)
    cfg = fp8ops.TransformerConfig(hidden_size=H, ffn_hidden_size=FFN, num_attention_heads=HEADS,
                                   hidden_dropout=0.0, attention_dropout=0.0, self_attn_mask_type="causal")
    params = {k: v.cuda().bfloat16().requires_grad_() for k, v in fp8ops.init_transformer_params(cfg).items()}
    tst = _calibrated(fp8ops.init_transformer_state(cfg, delayed, device="cuda"), delayed)
    xl = _leaf(S, T // S, H)
    basic = BasicTransformerLayer(H, FFN, HEADS, attention_dropout=0.0, hidden_dropout=0.0,
                                  attention_impl="sdpa").cuda().bfloat16()
    q, k, v = (_leaf(2, HEADS, S, H // HEADS) for _ in range(3))

    def back(y: torch.Tensor) -> None:
        y.backward(torch.ones_like(y))

    def linear_fp8(state: Any, recipe: Any) -> None:
        p = torch.zeros((), device="cuda", requires_grad=True)
        back(fp8ops.fp8_linear(x, w, b, state, recipe=recipe, grad_probe=p)[0])

    def layer(state: Any, recipe: Any) -> None:
        probes = fp8ops.make_probes(state) if state is not None else None
        back(fp8ops.transformer_layer(params, xl, state, config=cfg, recipe=recipe, probes=probes)[0])

    def lnl_call() -> None:
        p = torch.zeros((), device="cuda", requires_grad=True)
        back(fp8ops.layernorm_linear(x, g, beta, w, b, lnl, recipe=delayed, grad_probe=p)[0])

    def mlp_call() -> None:
        ps = fp8ops.make_probes(mlp)
        back(fp8ops.fused_ln_mlp(x, g, beta, w1, b1, w2, b2, mlp, recipe=delayed, grad_probes=ps)[0])

    def torch_mlp() -> None:
        back(F.linear(F.gelu(F.linear(F.layer_norm(x, (H,), g, beta), w1, b1), approximate="tanh"), w2, b2))

    def update_call() -> None:
        fp8ops.update(tst, recipe=delayed, grad_amax=fp8ops.make_probes(tst, requires_grad=False))

    return {
        "torch F.linear": lambda: back(F.linear(x, w, b)),
        "fp8_linear no FP8": lambda: back(fp8ops.fp8_linear(x, w, b, None, recipe=None)[0]),
        "fp8_linear delayed": lambda: linear_fp8(lin_d, delayed),
        "fp8_linear current": lambda: linear_fp8(lin_c, current),
        "torch F.layer_norm + F.linear": lambda: back(F.linear(F.layer_norm(x, (H,), g, beta), w, b)),
        "layernorm_linear delayed": lnl_call,
        "torch MLP (LN, fc1, gelu, fc2)": torch_mlp,
        "fused_ln_mlp delayed": mlp_call,
        "torch basic layer (SDPA)": lambda: back(basic(xl)),
        "transformer_layer no FP8": lambda: layer(None, None),
        "transformer_layer delayed": lambda: layer(tst, delayed),
        "torch SDPA causal": lambda: back(F.scaled_dot_product_attention(q, k, v, is_causal=True)),
        "attention causal (triton)": lambda: back(fp8ops.attention(q, k, v, causal=True, backend="triton")[0]),
        "torch F.layer_norm": lambda: back(F.layer_norm(x, (H,), g, beta)),
        "layer_norm": lambda: back(fp8ops.layer_norm(x, g, beta, None)[0]),
        "update (transformer_layer state)": update_call,
        "make_probes (transformer_layer state)": lambda: fp8ops.make_probes(tst),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Time every case, print the table and the targets, write host.json and host.png."""
    torch.manual_seed(0)
    todo = cases()
    calls = 20 if args.quick else args.calls
    progress = Progress(len(todo), prefix="host")
    rows = []
    for name, fn in todo.items():
        progress.step(name)
        h, _ = host_us(fn, calls, repeats=3, warmup=5)
        n, d = device_ops(fn, 5)
        rows.append({"case": name, "host_us": h, "kernels": n, "device_us": d})
    failed = []
    lines = []
    for name, target in TARGETS_US.items():
        got = next(r["host_us"] for r in rows if r["case"] == name)
        ok = got <= target
        lines.append(f"target {name} host <= {target:.0f} µs: {got:.0f} µs ({'met' if ok else f'missed by {got / target:.2f}x'})")
    print(format_table(rows, [("case", "case", ""), ("host_us", "host µs", ".0f"), ("kernels", "kernels", ".0f"),
                              ("device_us", "device µs", ".0f")]))
    print("\n".join(lines))
    if args.profile:
        c = cases()
        for name in ("fp8_linear delayed", "transformer_layer delayed"):
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(50):
                c[name]()
            prof.disable()
            torch.cuda.synchronize()
            print(f"\n==== cProfile: {name}, 50 calls ====")
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    record = {"suite": "host", "environment": environment(), "shape": {"tokens": T, "hidden": H, "ffn": FFN,
              "heads": HEADS, "seq": S}, "rows": rows, "targets": lines, "failed_checks": failed}
    out = Path(args.out)
    write_json(out / "host.json", record)
    write_bar_chart(out / "host.png", [{"title": "host µs per forward+backward call", "groups": [r["case"] for r in rows],
                                        "series": {"host µs": [r["host_us"] for r in rows]}}],
                    title=f"fp8ops host cost per call ({torch.cuda.get_device_name()})", ylabel="µs")
    return record
