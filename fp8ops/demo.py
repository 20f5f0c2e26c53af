"""``python -m fp8ops.demo``: train a small byte-level GPT twice, in BF16 and in FP8, and compare.

The corpus is the Python standard library's own ``.py`` files, read as bytes (vocabulary 256), so
every machine has it; files are shuffled by a fixed permutation of their sorted paths and every
tenth file is held out for validation. The model is a GPT: token + learned position embeddings, a
stack of :func:`fp8ops.transformer_layer` (causal self attention, pre-norm, gelu_tanh),
a final :func:`fp8ops.norm.layer_norm` and a head tied to the token embedding; AdamW with warm-up
and cosine decay, gradient clipping at 1.0, float32 master weights.

The same model (same initialization, same batches, same schedule) is trained twice:

- **BF16**: ``recipe=None``, every layer computes in bfloat16 (on the CPU in float32: the CPU
  reference kernels compute in float32, and the output says so);
- **FP8**: ``DelayedScaling`` (HYBRID: E4M3 forward, E5M2 gradients): the GEMMs of every layer run
  in FP8 (on the CPU emulated by the reference kernels), the rest as in the BF16 run. The scaling
  state is a value: each step makes fresh probes (:func:`fp8ops.make_probes`), the forward returns
  the new state, and :func:`fp8ops.update` folds in the probe gradients once per optimizer step.

On a GPU both runs take their fastest mode: the loss is compiled with ``torch.compile`` (``--no-compile``
runs it eagerly) and each training step (fresh probes, forward, backward, clipping, AdamW, update)
runs as one CUDA graph replay once warmed up (:func:`fp8ops.graph_step`; ``--no-cuda-graph`` runs
it eagerly). On the CPU the loss runs eagerly unless ``--compile`` is given.

Outputs: a live progress line, a final table (train loss, held-out loss, tokens/s, peak memory),
``demo.json`` (both curves and the final numbers) and ``demo_loss.png`` (both runs, train and
validation) in ``--out``.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import platform
import random
import resource
import sys
import sysconfig
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils import _pytree as pytree

import fp8ops

__all__ = [
    "PRESETS",
    "Corpus",
    "RunResult",
    "gpt_loss",
    "init_gpt",
    "load_corpus",
    "main",
    "train",
    "train_batches",
    "train_starts",
    "val_batches",
]

VOCAB = 256
VAL_EVERY_NTH_FILE = 10

# Defaults per device: the CPU size finishes both runs in under 3 minutes on 2 cores (import and
# data loading included); the GPU size takes a few minutes per run.
PRESETS: dict[str, dict[str, Any]] = {
    "cpu": {"steps": 200, "layers": 4, "hidden": 128, "heads": 4, "seq": 128, "batch": 16, "lr": 3e-3,
            "eval_every": 25, "eval_batches": 4},
    "cuda": {"steps": 2000, "layers": 6, "hidden": 512, "heads": 8, "seq": 256, "batch": 64, "lr": 1e-3,
             "eval_every": 100, "eval_batches": 16},
}


# ------------------------------------------------------------------------------------------------
# Data


@dataclass(frozen=True)
class Corpus:
    """Byte streams of the training and validation files (uint8, files joined by a blank line)."""

    train: Tensor
    val: Tensor
    train_files: int
    val_files: int
    root: str


def load_corpus(max_bytes: int | None = None) -> Corpus:
    """Read the standard library's ``.py`` files as bytes; hold out every tenth file.

    The sorted file list is shuffled by a fixed permutation (so that a byte cap still samples the
    whole library), then file ``i`` goes to validation when ``i % 10 == 0``. Deterministic on a
    given Python installation. ``max_bytes`` stops reading once that many bytes are in.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "__pycache__"}
    files = sorted(p for p in root.rglob("*.py") if not skip.intersection(p.relative_to(root).parts) and p.is_file())
    if not files:
        raise RuntimeError(f"fp8ops.demo: no .py files under the standard library folder {root}")
    random.Random(0).shuffle(files)
    train: list[bytes] = []
    val: list[bytes] = []
    total = 0
    for i, path in enumerate(files):
        try:
            data = path.read_bytes()
        except OSError:
            continue
        (val if i % VAL_EVERY_NTH_FILE == 0 else train).append(data)
        total += len(data)
        if max_bytes is not None and total >= max_bytes:
            break

    def stream(chunks: list[bytes]) -> Tensor:
        return torch.frombuffer(bytearray(b"\n\n".join(chunks)), dtype=torch.uint8)

    return Corpus(stream(train), stream(val), len(train), len(val), str(root))


def _windows(data: Tensor, starts: Tensor, seq: int, device: torch.device | None = None) -> tuple[Tensor, Tensor]:
    # (B, seq + 1) windows of the byte stream -> inputs (B, seq) and next-byte targets (B, seq)
    idx = starts[:, None] + torch.arange(seq + 1)
    w = data[idx].to(device).long()  # bytes travel as uint8
    return w[:, :-1], w[:, 1:]


def train_starts(data: Tensor, *, batch: int, seq: int, steps: int, seed: int) -> Tensor:
    """(steps, batch) random window starts in the training stream (the same for every run)."""
    if data.numel() < seq + 2:
        raise ValueError(f"fp8ops.demo: the training stream ({data.numel()} bytes) is shorter than --seq {seq}")
    g = torch.Generator().manual_seed(seed + 1)
    return torch.randint(0, data.numel() - seq - 1, (steps, batch), generator=g)


def train_batches(data: Tensor, *, batch: int, seq: int, steps: int, seed: int) -> list[tuple[Tensor, Tensor]]:
    """``steps`` batches ``(tokens, targets)``, each (batch, seq), of :func:`train_starts`'s windows."""
    return [_windows(data, s, seq) for s in train_starts(data, batch=batch, seq=seq, steps=steps, seed=seed)]


def val_batches(data: Tensor, *, batch: int, seq: int, count: int) -> list[tuple[Tensor, Tensor]]:
    """``count`` batches of windows spread evenly over the validation stream (fixed, seed-independent)."""
    if data.numel() < seq + 2:
        raise ValueError(f"fp8ops.demo: the validation stream ({data.numel()} bytes) is shorter than --seq {seq}")
    starts = torch.linspace(0, data.numel() - seq - 2, count * batch).long()
    return [_windows(data, s, seq) for s in starts.view(count, batch)]


# ------------------------------------------------------------------------------------------------
# Model


def make_config(hidden: int, heads: int) -> Any:
    """The layer configuration: causal self attention, pre-norm, gelu_tanh MLP (4x), no dropout."""
    from fp8ops.transformer_layer import TransformerConfig

    return TransformerConfig(hidden_size=hidden, ffn_hidden_size=4 * hidden, num_attention_heads=heads,
                             hidden_dropout=0.0, attention_dropout=0.0, normalization="LayerNorm",
                             activation="gelu_tanh", norm_position="pre", self_attn_mask_type="causal")


def init_gpt(config: Any, *, layers: int, seq: int, seed: int, device: torch.device) -> dict[str, Any]:
    """Float32 parameters ``{"tok", "pos", "layers": [...], "lnf.weight", "lnf.bias"}`` on ``device``.

    Built on the CPU from one generator (the same values on every device), then moved.
    """
    from fp8ops.transformer_layer import init_transformer_params

    g = torch.Generator().manual_seed(seed)
    h = config.hidden_size
    params: dict[str, Any] = {
        "tok": torch.randn(VOCAB, h, generator=g) * 0.02,
        "pos": torch.randn(seq, h, generator=g) * 0.01,
        "layers": [init_transformer_params(config, dtype=torch.float32, generator=g) for _ in range(layers)],
        "lnf.weight": torch.ones(h),
        "lnf.bias": torch.zeros(h),
    }
    return pytree.tree_map(lambda t: t.to(device).requires_grad_(), params)


def gpt_loss(
    params: dict[str, Any],
    states: list[Any] | None,
    probes: list[Any] | None,
    tokens: Tensor,
    targets: Tensor,
    *,
    config: Any,
    recipe: Any,
    dtype: torch.dtype,
    training: bool = True,
) -> tuple[Tensor, list[Any] | None]:
    """Mean next-byte cross-entropy of ``tokens`` (B, S) against ``targets`` (B, S), and new states.

    The float32 master parameters are cast to ``dtype`` on the way in (gradients flow back to them);
    with ``recipe`` the layers' GEMMs run in FP8 and their new scaling states are returned.
    """
    from fp8ops.norm import layer_norm
    from fp8ops.transformer_layer import transformer_layer

    S = tokens.shape[1]
    x = F.embedding(tokens, params["tok"]) + params["pos"][:S]  # (B, S, H)
    x = x.to(dtype).transpose(0, 1).contiguous()  # (S, B, H): the layer's "sbhd" layout
    new_states = []
    for i, lp in enumerate(params["layers"]):
        lp = {k: v.to(dtype) for k, v in lp.items()}
        st = None if states is None else states[i]
        pr = None if probes is None else probes[i]
        x, ns = transformer_layer(lp, x, st, config=config, recipe=recipe, probes=pr, training=training)
        new_states.append(ns)
    x, _ = layer_norm(x, params["lnf.weight"].to(dtype), params["lnf.bias"].to(dtype), None,
                      eps=config.layernorm_epsilon)
    logits = x.transpose(0, 1) @ params["tok"].to(dtype).t()  # (B, S, V), head tied to the embedding
    loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))
    return loss, (new_states if states is not None else None)


# ------------------------------------------------------------------------------------------------
# Training


@dataclass
class RunResult:
    """What one training run produced."""

    label: str
    precision: str
    train_loss: list[float]
    val_steps: list[int]
    val_loss: list[float]
    tokens_per_s: float
    peak_memory_bytes: int
    peak_memory_what: str
    seconds: float
    compiled: bool
    states: Any = field(default=None, repr=False)
    cuda_graph: bool = False

    @property
    def final_train_loss(self) -> float:
        """Mean train loss over the last tenth of the steps (at least 1, at most 50 steps)."""
        k = max(1, min(50, len(self.train_loss) // 10))
        return sum(self.train_loss[-k:]) / k

    def as_dict(self) -> dict[str, Any]:
        return {
            "label": self.label, "precision": self.precision, "train_loss": self.train_loss,
            "val_steps": self.val_steps, "val_loss": self.val_loss, "final_train_loss": self.final_train_loss,
            "final_val_loss": self.val_loss[-1] if self.val_loss else None, "tokens_per_s": self.tokens_per_s,
            "peak_memory_bytes": self.peak_memory_bytes, "peak_memory_what": self.peak_memory_what,
            "seconds": self.seconds, "compiled": self.compiled, "cuda_graph": self.cuda_graph,
        }


def _lr_at(step: int, steps: int, lr: float) -> float:
    # linear warm-up over 5% of the steps, then cosine decay to 10% of the peak
    warm = max(1, steps // 20)
    if step < warm:
        return lr * (step + 1) / warm
    t = (step - warm) / max(1, steps - warm)
    return lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * t)))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _max_rss_bytes() -> int:
    # ru_maxrss is KiB on Linux, bytes on macOS
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def train(
    *,
    fp8: bool,
    corpus: Corpus,
    device: torch.device,
    steps: int,
    layers: int,
    hidden: int,
    heads: int,
    seq: int,
    batch: int,
    lr: float,
    eval_every: int,
    eval_batches: int = 4,
    seed: int = 0,
    compile: bool = False,
    cuda_graph: bool = True,
    on_progress: Callable[[str], None] | None = None,
) -> RunResult:
    """Train the GPT for ``steps`` steps (BF16 or FP8) and return the curves and the final numbers.

    With ``cuda_graph`` (the default) on a GPU, each step runs through :func:`fp8ops.graph_step`.
    """
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    recipe = fp8ops.DelayedScaling() if fp8 else None
    label = "FP8" if fp8 else "BF16"
    rest = "bf16" if dtype == torch.bfloat16 else "float32"
    if fp8:
        where = "Triton kernels" if device.type == "cuda" else "emulated by the CPU reference kernels"
        precision = f"FP8 GEMMs (E4M3 fwd / E5M2 grad, delayed scaling; {where}), rest {rest}"
    else:
        precision = "bf16 compute" if dtype == torch.bfloat16 else "float32 (CPU; bf16 autocast off)"
    precision += ", fp32 master weights"

    config = make_config(hidden, heads)
    params = init_gpt(config, layers=layers, seq=seq, seed=seed, device=device)
    leaves = pytree.tree_leaves(params)
    decay = [p for p in leaves if p.dim() >= 2]
    no_decay = [p for p in leaves if p.dim() < 2]
    graphed = cuda_graph and device.type == "cuda"
    # a captured step reads the learning rate from a tensor (set before each step) and needs a
    # capturable optimizer
    lr_t = torch.tensor(lr, device=device) if graphed else None
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr_t if lr_t is not None else lr, betas=(0.9, 0.95), fused=device.type == "cuda",
                            capturable=graphed)
    states = None
    if fp8:
        from fp8ops.transformer_layer import init_transformer_state

        states = [init_transformer_state(config, recipe, device=device) for _ in range(layers)]

    loss_fn: Callable[..., tuple[Tensor, Any]] = functools.partial(gpt_loss, config=config, recipe=recipe, dtype=dtype)
    compiled = False
    if compile:
        torch._dynamo.reset()  # each run compiles afresh (the runs share gpt_loss's code object)
        loss_fn = torch.compile(loss_fn)
        compiled = True
    def train_step(st: Any, x: Tensor, y: Tensor) -> tuple[Any, Tensor]:
        """One optimizer step: fresh probes, forward, backward, clipping, AdamW, fp8ops.update."""
        opt.zero_grad(set_to_none=True)
        probes = fp8ops.make_probes(st) if fp8 else None  # fresh probes for every forward
        loss, new_states = loss_fn(params, st, probes, x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(leaves, 1.0)
        opt.step()
        if fp8:  # once per optimizer step: forward observations + probe gradients in, new scales out
            st = fp8ops.update(new_states, recipe=recipe, grad_amax=pytree.tree_map(lambda p: p.grad, probes))
        return st, loss.detach()

    stepper: Callable[..., tuple[Any, Tensor]] = fp8ops.graph_step(train_step) if graphed else train_step
    starts = train_starts(corpus.train, batch=batch, seq=seq, steps=steps, seed=seed)
    vbatches = [(x.to(device), y.to(device)) for x, y in val_batches(corpus.val, batch=batch, seq=seq,
                                                                     count=eval_batches)]

    def evaluate() -> float:
        with torch.no_grad():
            total = torch.zeros((), device=device)
            for x, y in vbatches:
                loss, _ = loss_fn(params, states, None, x, y, training=False)
                total = total + loss.float()
            return float(total / len(vbatches))

    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    tokens_per_step = batch * seq
    # steps kept out of tokens/s: kernel compilation, warm-up (compiled: the graphs of the first
    # step, where the delayed-scaling state is not calibrated yet, and of the second)
    warm = min(steps, max(3 if compiled or graphed else 1, min(10, steps // 10)))
    log_every = max(1, min(eval_every, steps // 20 or 1))
    losses: list[Tensor] = []
    val_steps: list[int] = [0]
    val_loss: list[float] = []
    try:
        val_loss.append(evaluate())
    except Exception:
        if not compiled:
            raise
        loss_fn, compiled = _fall_back(loss_fn, on_progress)
        val_loss.append(evaluate())
    counted_time, counted_tokens = 0.0, 0
    t_start = time.perf_counter()
    t_mark, last = time.perf_counter(), 0
    for step in range(steps):
        x, y = _windows(corpus.train, starts[step], seq, device)
        if lr_t is not None:
            lr_t.fill_(_lr_at(step, steps, lr))
        else:
            for g in opt.param_groups:
                g["lr"] = _lr_at(step, steps, lr)
        try:
            states, loss = stepper(states, x, y)
        except Exception:
            if not compiled or step > 0:
                raise
            loss_fn, compiled = _fall_back(loss_fn, on_progress)  # train_step reads loss_fn when called
            states, loss = stepper(states, x, y)
        losses.append(loss)
        done = step + 1
        evaluating = done % eval_every == 0 or done == steps
        if done == warm or done % log_every == 0 or evaluating:
            _sync(device)
            now = time.perf_counter()
            rate = (done - last) * tokens_per_step / max(now - t_mark, 1e-9)
            if done > warm:
                counted_time += now - t_mark
                counted_tokens += (done - last) * tokens_per_step
            last = done
            msg = f"{label:<4} step {done:>5}/{steps}  loss {losses[-1].item():.4f}  {rate:>9,.0f} tokens/s"
            if evaluating:
                val_steps.append(done)
                val_loss.append(evaluate())
                msg += f"  val {val_loss[-1]:.4f}"
            if on_progress is not None:
                on_progress(msg)
            t_mark = time.perf_counter()
    seconds = time.perf_counter() - t_start
    if counted_time > 0:
        tokens_per_s = counted_tokens / counted_time
    else:  # too few steps to leave out the warm-up ones
        tokens_per_s = steps * tokens_per_step / max(seconds, 1e-9)
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
        peak_what = "torch.cuda.max_memory_allocated during this run"
    else:
        peak = _max_rss_bytes()
        peak_what = "max resident set size of the process so far (CPU: getrusage, includes earlier runs)"
    return RunResult(label, precision, [float(v) for v in torch.stack(losses).tolist()] if losses else [],
                     val_steps, val_loss, tokens_per_s, peak, peak_what, seconds, compiled, states, graphed)


def _fall_back(loss_fn: Any, on_progress: Callable[[str], None] | None) -> tuple[Any, bool]:
    # torch.compile could not build the loss here (no C++ compiler, an unsupported op): run eagerly
    exc = sys.exc_info()[1]
    if on_progress is not None:
        on_progress(f"torch.compile failed ({type(exc).__name__}: {str(exc).splitlines()[0][:200]}); "
                    "running eagerly")
    return getattr(loss_fn, "_torchdynamo_orig_callable", loss_fn), False


# ------------------------------------------------------------------------------------------------
# Output


def results_table(results: Sequence[RunResult]) -> str:
    """The final table: one row per run."""
    heads = ["run", "final train loss", "val loss", "tokens/s", "peak memory"]
    rows = [[r.label, f"{r.final_train_loss:.4f}", f"{r.val_loss[-1]:.4f}" if r.val_loss else "-",
             f"{r.tokens_per_s:,.0f}", f"{r.peak_memory_bytes / 2**20:,.0f} MiB"] for r in results]
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(heads)]

    def line(items: Sequence[str]) -> str:
        return "  ".join(s.ljust(w) if i == 0 else s.rjust(w) for i, (s, w) in enumerate(zip(items, widths)))

    lines = [line(heads), line(["-" * w for w in widths])] + [line(r) for r in rows]
    return "\n".join(lines + [""] + [f"{r.label}: {r.precision}" for r in results])


def write_plot(path: Path, results: Sequence[RunResult], title: str) -> Path | None:
    """Loss curves of every run (train: thin line, validation: markers) as a PNG; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(8, 5))
    colors = {"BF16": "tab:blue", "FP8": "tab:orange"}
    for r in results:
        c = colors.get(r.label)
        steps = range(1, len(r.train_loss) + 1)
        ax.plot(steps, r.train_loss, color=c, alpha=0.35, linewidth=0.8, label=f"{r.label} train")
        k = max(1, len(r.train_loss) // 50)  # a running mean to read the trend
        if k > 1:
            run = [sum(r.train_loss[max(0, i - k + 1):i + 1]) / (i - max(0, i - k + 1) + 1)
                   for i in range(len(r.train_loss))]
            ax.plot(steps, run, color=c, linewidth=1.4, label=f"{r.label} train (mean of {k})")
        ax.plot(r.val_steps, r.val_loss, color=c, marker="o", markersize=3.5, linestyle="--", linewidth=1.0,
                label=f"{r.label} validation")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats / byte)")
    ax.set_title(title, fontsize=9)
    ax.grid(linewidth=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


class _ProgressLine:
    """A live progress line: rewritten in place on a terminal, one line per update otherwise."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.tty = hasattr(stream, "isatty") and stream.isatty()
        self.width = 0

    def __call__(self, msg: str) -> None:
        if self.tty:
            self.stream.write("\r" + msg.ljust(self.width))
            self.width = len(msg)
        else:
            self.stream.write(msg + "\n")
        self.stream.flush()

    def end(self) -> None:
        if self.tty and self.width:
            self.stream.write("\n")
            self.stream.flush()
        self.width = 0


# ------------------------------------------------------------------------------------------------
# Command line


def build_parser() -> argparse.ArgumentParser:
    """The command line; size defaults come from :data:`PRESETS` for the chosen device."""
    p = argparse.ArgumentParser(prog="python -m fp8ops.demo", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps per run")
    p.add_argument("--layers", type=int, default=None, help="transformer layers")
    p.add_argument("--hidden", type=int, default=None, help="hidden size (the MLP is 4x)")
    p.add_argument("--heads", type=int, default=None, help="attention heads")
    p.add_argument("--seq", type=int, default=None, help="sequence length in bytes")
    p.add_argument("--batch", type=int, default=None, help="sequences per step")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (warm-up, cosine decay)")
    p.add_argument("--eval-every", type=int, default=None, help="steps between validation evaluations")
    p.add_argument("--eval-batches", type=int, default=None, help="validation batches per evaluation")
    p.add_argument("--seed", type=int, default=0, help="seed of initialization and batch order")
    p.add_argument("--out", default="demo_out", help="folder for demo.json and demo_loss.png")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile the loss, falling back to eager on failure (default: on a GPU only; "
                        "--no-compile runs it eagerly)")
    p.add_argument("--no-cuda-graph", action="store_true",
                   help="on a GPU, run each training step eagerly instead of replaying it as a CUDA graph")
    p.add_argument("--max-data-mb", type=float, default=None, help="read at most this many MB of source files")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo; return the exit status (0, or 1 if a run produced a non-finite loss)."""
    t_start = time.perf_counter()
    args = build_parser().parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        print("fp8ops.demo: --device cuda, but no CUDA device is available; use --device cpu", file=sys.stderr)
        return 2
    preset = PRESETS["cuda" if device.type == "cuda" else "cpu"]
    cfg = {k: (getattr(args, k) if getattr(args, k) is not None else v) for k, v in preset.items()}
    if cfg["hidden"] % cfg["heads"]:
        print(f"fp8ops.demo: --hidden ({cfg['hidden']}) must be a multiple of --heads ({cfg['heads']})",
              file=sys.stderr)
        return 2
    for k in ("steps", "layers", "hidden", "heads", "seq", "batch", "eval_every", "eval_batches"):
        if cfg[k] < 1:
            print(f"fp8ops.demo: --{k.replace('_', '-')} must be >= 1, got {cfg[k]}", file=sys.stderr)
            return 2
    out = Path(args.out)
    print(f"fp8ops {fp8ops.__version__} | torch {torch.__version__} | python {platform.python_version()} | "
          f"device {device}" + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else
                                f" ({os.cpu_count()} cores, {torch.get_num_threads()} threads)"))

    t0 = time.perf_counter()
    max_bytes = None if args.max_data_mb is None else int(args.max_data_mb * 1e6)
    corpus = load_corpus(max_bytes)
    print(f"data: {corpus.root}/**/*.py as bytes: train {corpus.train.numel() / 1e6:.1f} MB "
          f"({corpus.train_files} files), validation {corpus.val.numel() / 1e6:.1f} MB ({corpus.val_files} files)"
          f", read in {time.perf_counter() - t0:.1f} s")
    n_params = cfg["layers"] * 12 * cfg["hidden"] ** 2 + (VOCAB + cfg["seq"]) * cfg["hidden"]
    print(f"model: GPT, {cfg['layers']} layers, hidden {cfg['hidden']}, {cfg['heads']} heads, ffn "
          f"{4 * cfg['hidden']}, seq {cfg['seq']}, vocab {VOCAB} (bytes), about {n_params / 1e6:.2f} M parameters;"
          f" batch {cfg['batch']}, {cfg['steps']} steps, AdamW lr {cfg['lr']:g}, seed {args.seed}\n")

    progress = _ProgressLine(sys.stdout)
    results: list[RunResult] = []
    for fp8 in (False, True):
        r = train(fp8=fp8, corpus=corpus, device=device, steps=cfg["steps"], layers=cfg["layers"],
                  hidden=cfg["hidden"], heads=cfg["heads"], seq=cfg["seq"], batch=cfg["batch"], lr=cfg["lr"],
                  eval_every=cfg["eval_every"], eval_batches=cfg["eval_batches"], seed=args.seed,
                  compile=device.type == "cuda" if args.compile is None else args.compile,
                  cuda_graph=not args.no_cuda_graph, on_progress=progress)
        progress.end()
        print(f"{r.label} run: {r.seconds:.1f} s\n")
        results.append(r)

    print(results_table(results))
    print("\nfinal train loss: mean over the last tenth of the steps (at most 50); val loss: held-out files, "
          f"{cfg['eval_batches']} batches of {cfg['batch']} x {cfg['seq']} bytes; tokens/s: training steps only "
          "(first steps and evaluation left out); peak memory: " + results[0].peak_memory_what)
    base, f8 = results
    if base.val_loss and f8.val_loss:
        print(f"FP8 - BF16: val loss {f8.val_loss[-1] - base.val_loss[-1]:+.4f}, "
              f"tokens/s x{f8.tokens_per_s / base.tokens_per_s:.2f}")

    title = (f"byte-level GPT on the Python standard library: {cfg['layers']} layers, hidden {cfg['hidden']}, "
             f"seq {cfg['seq']}, batch {cfg['batch']} ({device.type})")
    record = {
        "config": {**cfg, "seed": args.seed, "device": str(device), "compile": args.compile,
                   "cuda_graph": device.type == "cuda" and not args.no_cuda_graph, "vocab": VOCAB,
                   "ffn": 4 * cfg["hidden"]},
        "environment": {"fp8ops": fp8ops.__version__, "torch": torch.__version__,
                        "python": platform.python_version(),
                        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else
                        platform.processor() or platform.machine(), "cpu_count": os.cpu_count()},
        "data": {"root": corpus.root, "train_bytes": corpus.train.numel(), "val_bytes": corpus.val.numel(),
                 "train_files": corpus.train_files, "val_files": corpus.val_files},
        "runs": {r.label: r.as_dict() for r in results},
        "seconds": time.perf_counter() - t_start,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "demo.json").write_text(json.dumps(_json_safe(record), indent=1) + "\n")
    png = write_plot(out / "demo_loss.png", results, title)
    print(f"\nwrote {out / 'demo.json'}" + (f" and {png}" if png else
                                           " (no plot: matplotlib is not installed; pip install matplotlib)"))
    print(f"total {time.perf_counter() - t_start:.1f} s")
    finite = all(math.isfinite(v) for r in results for v in r.train_loss + r.val_loss)
    if not finite:
        print("fp8ops.demo: a run produced a non-finite loss", file=sys.stderr)
    return 0 if finite else 1


def _json_safe(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj


if __name__ == "__main__":
    raise SystemExit(main())
