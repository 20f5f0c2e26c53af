"""A variable-length causal attention block: fp8ops on packed sequences vs nested tensors and padding.

Problem: a multi-head self-attention block, embedding E = 512, 8 heads of 64, a packed QKV
projection E -> 3E and an output projection E -> E (both with biases), bf16, causal, over N = 512
sequences (``--varlen-seqs``) whose lengths follow a Zipf(1.2) distribution
(``P(L = k) ~ k^-1.2``), drawn with a fixed seed and clipped to [1, 1024] (``--varlen-max-len``).
Timed: the forward, and forward+backward (gradients of the input and of the four parameters) of
the whole block, projections included. The same weights and the same tokens go through

- ``fp8ops packed``: the tokens packed (T, E) without padding, the projections as ``nn.Linear``,
  attention on (T, h, d) views through ``fp8ops.attention(..., cu_seqlens_q=..., max_seqlen_q=...,
  max_seqlen_kv=...)``; eager (where the op reads the offsets on the host once per call to check
  them, so the call cannot be captured in a CUDA graph: timed as plain launches) and under
  ``torch.compile`` (the offsets are not read);
- ``SDPA nested + compile``: a jagged nested tensor (``torch.nested.nested_tensor(...,
  layout=torch.jagged)``), (N, j, E) -> (N, h, j, d), ``F.scaled_dot_product_attention(...,
  is_causal=True)``, the block under ``torch.compile``;
- ``nn.MultiheadAttention padded + compile``: the sequences padded to the longest, ``batch_first``,
  ``key_padding_mask`` + a causal ``attn_mask``, under ``torch.compile``.

``ms`` is the median device time (CUDA-graph replays; plain launches where a call cannot be
captured), ``launch ms`` the same calls launched from Python without a graph; tokens/s count the
real (unpadded) tokens. "x" columns: the peer's time over fp8ops's. The outputs and all gradients
are checked against fp8ops eager on the first input set.
"""

from __future__ import annotations

import argparse
import importlib
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from . import common

__all__ = ["Case", "add_arguments", "cu_seqlens", "format_tables", "make_case", "padding_masks", "run_varlen",
           "step_fn", "write_chart", "zipf_lengths"]

EMBED = 512
HEADS = 8
SEQS = 512
QUICK_SEQS = 128
MAX_LEN = 1024
ALPHA = 1.2
FP8OPS_EAGER = "fp8ops packed (eager)"
FP8OPS_COMPILED = "fp8ops packed + compile"
NESTED = "SDPA nested + compile"
PADDED = "nn.MultiheadAttention padded + compile"
IMPLS = [FP8OPS_EAGER, FP8OPS_COMPILED, NESTED, PADDED]
DEVICE = "cuda"  # where the problem lives (the timing helpers need CUDA)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of the variable-length comparison (``--varlen``)."""
    parser.add_argument("--varlen-seqs", type=int, default=None,
                        help=f"--varlen: number of sequences (default {SEQS}; with --quick {QUICK_SEQS})")
    parser.add_argument("--varlen-max-len", type=int, default=MAX_LEN,
                        help=f"--varlen: longest sequence; longer draws are clipped (default {MAX_LEN})")
    parser.add_argument("--varlen-alpha", type=float, default=ALPHA,
                        help=f"--varlen: Zipf exponent of the lengths, > 1 (default {ALPHA})")
    parser.add_argument("--varlen-seed", type=int, default=0, help="--varlen: seed of the lengths (default 0)")


def zipf_lengths(n: int, *, alpha: float = ALPHA, max_len: int = MAX_LEN, seed: int = 0) -> Tensor:
    """(n,) int64 sequence lengths drawn from Zipf(alpha), clipped to [1, max_len].

    ``P(L = k) = k^-alpha / zeta(alpha)`` for ``1 <= k < max_len``; the rest of the mass (every draw
    >= max_len) lands on ``max_len``. Deterministic for a given seed (a CPU generator).
    """
    if not alpha > 1.0:
        raise ValueError(f"zipf_lengths: alpha must be > 1 (Zipf's normalisation diverges otherwise), got {alpha}")
    if n < 1 or max_len < 1:
        raise ValueError(f"zipf_lengths: n and max_len must be >= 1, got {n} and {max_len}")
    a = torch.tensor(alpha, dtype=torch.float64)
    zeta = torch.special.zeta(a, torch.tensor(1.0, dtype=torch.float64))
    head = torch.arange(1, max_len, dtype=torch.float64).pow(-a) / zeta
    probs = torch.cat([head, (1.0 - head.sum()).clamp_min(0.0).reshape(1)])
    g = torch.Generator().manual_seed(seed)
    return torch.multinomial(probs, n, replacement=True, generator=g) + 1


def cu_seqlens(lengths: Tensor, device: torch.device | str = "cpu") -> Tensor:
    """(N + 1,) int32 start offsets of sequences of ``lengths`` packed back to back (0 first)."""
    cu = torch.zeros(lengths.numel() + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lengths, 0)
    return cu.to(device)


def padding_masks(lengths: Tensor, max_len: int, device: torch.device | str = "cpu") -> tuple[Tensor, Tensor]:
    """``(key_padding_mask, attn_mask)`` of ``nn.MultiheadAttention`` for sequences padded to
    ``max_len``: (N, max_len) True at padding, and the (max_len, max_len) causal mask, True where a
    query may not look (key after query)."""
    pos = torch.arange(max_len)
    kpm = pos[None, :] >= lengths[:, None]
    causal = pos[None, :] > pos[:, None]
    return kpm.to(device), causal.to(device)


class _Block(nn.Module):
    """Self-attention with a packed QKV projection and an output projection (the weights only)."""

    def __init__(self, embed: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.packed_proj = nn.Linear(embed, 3 * embed)
        self.out_proj = nn.Linear(embed, embed)


class Case:
    """One variable-length problem: lengths, offsets, masks, the weights, and the three blocks.

    ``fp8ops(x)``: x (T, E) packed; ``nested(x)``: x a jagged nested tensor (N, j, E);
    ``padded(x)``: x (N, L, E) padded to the longest sequence. Each returns the block's output in
    its input's form; ``to_packed`` brings any of them back to (T, E).
    """

    def __init__(self, lengths: Tensor, *, embed: int, heads: int, device: torch.device | str,
                 dtype: torch.dtype, causal: bool = True, seed: int = 0) -> None:
        self.lengths = lengths.to(torch.int64).cpu()
        self.device = torch.device(device)
        self.dtype = dtype
        self.causal = causal
        self.embed = embed
        self.heads = heads
        self.tokens = int(self.lengths.sum())
        self.max_len = int(self.lengths.max())
        self.min_len = int(self.lengths.min())
        self.cu = cu_seqlens(self.lengths, device)
        self.kpm, self.attn_mask = padding_masks(self.lengths, self.max_len, device)
        n = self.lengths.numel()
        self.seq_idx = torch.repeat_interleave(torch.arange(n), self.lengths).to(device)  # (T,)
        self.pos_idx = (torch.arange(self.tokens) - torch.repeat_interleave(self.cu[:-1].cpu().long(),
                                                                             self.lengths)).to(device)  # (T,)
        self._attention = importlib.import_module("fp8ops.attention").attention
        with torch.random.fork_rng(devices=[]):  # the weights from ``seed``, the global generator untouched
            torch.manual_seed(seed)
            block = _Block(embed, heads)
            mha = nn.MultiheadAttention(embed, heads, bias=True, batch_first=True)
        with torch.no_grad():  # the same weights in both modules
            mha.in_proj_weight.copy_(block.packed_proj.weight)
            mha.in_proj_bias.copy_(block.packed_proj.bias)
            mha.out_proj.weight.copy_(block.out_proj.weight)
            mha.out_proj.bias.copy_(block.out_proj.bias)
        self.block = block.to(device=device, dtype=dtype)
        self.mha = mha.to(device=device, dtype=dtype)

    def params(self, impl: str) -> list[Tensor]:
        """The parameters of an implementation, in one order: QKV weight, bias, output weight, bias."""
        if impl == PADDED:
            m = self.mha
            return [m.in_proj_weight, m.in_proj_bias, m.out_proj.weight, m.out_proj.bias]
        b = self.block
        return [b.packed_proj.weight, b.packed_proj.bias, b.out_proj.weight, b.out_proj.bias]

    def fp8ops(self, x: Tensor) -> Tensor:
        h, d = self.heads, self.embed // self.heads
        qkv = self.block.packed_proj(x).unflatten(-1, (3, h, d))  # (T, 3, h, d)
        q, k, v = qkv.unbind(1)  # (T, h, d) views
        o, _ = self._attention(q, k, v, causal=self.causal, cu_seqlens_q=self.cu, max_seqlen_q=self.max_len,
                                max_seqlen_kv=self.max_len, backend="triton")
        return self.block.out_proj(o.flatten(-2))  # (T, E)

    def nested(self, x: Tensor) -> Tensor:
        h, d = self.heads, self.embed // self.heads
        q, k, v = self.block.packed_proj(x).chunk(3, dim=-1)  # (N, j, E) each
        q, k, v = (t.unflatten(-1, (h, d)).transpose(1, 2) for t in (q, k, v))  # (N, h, j, d)
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.block.out_proj(o.transpose(1, 2).flatten(-2))  # (N, j, E)

    def padded(self, x: Tensor) -> Tensor:
        return self.mha(x, x, x, key_padding_mask=self.kpm, attn_mask=self.attn_mask if self.causal else None,
                        need_weights=False)[0]  # (N, L, E)

    def inputs(self, impl: str, i: int) -> tuple[Tensor, Tensor]:
        """(x, dy) of input set ``i`` in the form ``impl`` takes; the same values for every impl."""
        g = torch.Generator(device=self.device).manual_seed(i)
        xv, dyv = (torch.randn(self.tokens, self.embed, device=self.device, dtype=self.dtype, generator=g)
                   for _ in range(2))
        if impl == NESTED:
            x = torch.nested.nested_tensor(list(xv.split(self.lengths.tolist())), layout=torch.jagged,
                                           requires_grad=True)
            return x, dyv  # dy packed (T, E): the gradient of the output's values (see step_fn)
        if impl == PADDED:
            shape = (self.lengths.numel(), self.max_len, self.embed)
            x, dy = (torch.zeros(shape, device=self.device, dtype=self.dtype) for _ in range(2))
            x[self.seq_idx, self.pos_idx] = xv
            dy[self.seq_idx, self.pos_idx] = dyv  # padded positions get no gradient, as with a masked loss
            return x.requires_grad_(), dy
        return xv.requires_grad_(), dyv

    def to_packed(self, t: Tensor) -> Tensor:
        """A packed (T, E), nested (N, j, E) or padded (N, L, E) tensor as packed (T, E)."""
        if t.is_nested:
            return t.values()
        if t.dim() == 3:
            return t[self.seq_idx, self.pos_idx]
        return t


def make_case(lengths: Tensor, *, embed: int = EMBED, heads: int = HEADS, device: torch.device | str = DEVICE,
              dtype: torch.dtype = torch.bfloat16, causal: bool = True, seed: int = 0) -> Case:
    """The problem for ``lengths`` (see :class:`Case`)."""
    return Case(lengths, embed=embed, heads=heads, device=device, dtype=dtype, causal=causal, seed=seed)


def step_fn(case: Case, impl: str, fn: Any) -> Any:
    """``step(x, dy)``: forward and backward of ``fn``, gradients of x and of the parameters."""
    params = case.params(impl)

    def step(x: Tensor, dy: Tensor) -> Any:
        out = fn(x)
        # A nested output is differentiated through its packed values: dy need not carry the
        # output's ragged dimension, which a compiled graph may give a symbol of its own.
        return torch.autograd.grad(out.values() if out.is_nested else out, (x, *params), dy)

    return step


def _forward(case: Case, impl: str) -> Any:
    if impl == FP8OPS_EAGER:
        return case.fp8ops
    torch._dynamo.reset()  # one compiled function at a time: no recompile limit across the impls
    return torch.compile({FP8OPS_COMPILED: case.fp8ops, NESTED: case.nested, PADDED: case.padded}[impl])


def run_varlen(args: argparse.Namespace, *, samples: int, notes: list[str], failed: list[str]) -> dict[str, Any]:
    """Time the four implementations; return the record (rows, speed-ups, targets)."""
    quick = bool(getattr(args, "quick", False))
    n = getattr(args, "varlen_seqs", None) or (QUICK_SEQS if quick else SEQS)
    max_len = getattr(args, "varlen_max_len", MAX_LEN)
    alpha = getattr(args, "varlen_alpha", ALPHA)
    seed = getattr(args, "varlen_seed", 0)
    lengths = zipf_lengths(n, alpha=alpha, max_len=max_len, seed=seed)
    case = make_case(lengths, device=DEVICE)
    padded_tokens = n * case.max_len
    progress = common.Progress(len(IMPLS), prefix="attention varlen")
    rows: list[dict[str, Any]] = []
    ref: dict[str, Tensor] = {}
    t0 = time.perf_counter()
    for impl in IMPLS:
        progress.step(f"{impl}: {n} sequences, {case.tokens} tokens, longest {case.max_len}")
        try:
            fn = _forward(case, impl)
            step = step_fn(case, impl, fn)
            sets = [case.inputs(impl, i) for i in range(2)]
            # Check: output and every gradient against fp8ops eager on the first input set.
            x, dy = sets[0]
            got = {"out": case.to_packed(fn(x).detach())}
            grads = step(x, dy)
            got |= {"dx": case.to_packed(grads[0]), "dW_qkv": grads[1], "db_qkv": grads[2], "dW_out": grads[3],
                    "db_out": grads[4]}
            got = {k: v.float() for k, v in got.items()}
            if impl == FP8OPS_EAGER:
                ref = got
            for k, v in got.items():
                if k in ref and impl != FP8OPS_EAGER:
                    err = common.rel_err(v, ref[k])
                    if not err <= 2e-2:
                        failed.append(f"varlen: {impl} and {FP8OPS_EAGER} differ in {k} (relative error {err:.3g})")
            del x, dy, grads, got
            graph = impl != FP8OPS_EAGER  # eager fp8ops reads the offsets on the host: not capturable
            label = f"varlen {impl}"
            fwd = common.time_cuda(fn, [s[:1] for s in sets], samples=samples, use_graph=graph,
                                   on_fallback=lambda m: notes.append(f"{label}: {m}"))
            fb = common.time_cuda(step, sets, samples=samples, use_graph=graph,
                                  on_fallback=lambda m: notes.append(f"{label}: {m}"))
        except Exception as exc:
            msg = f"varlen {impl}: {type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
            progress.note(f"skipped: {msg}")
            notes.append(f"skipped: {msg}")
            continue
        finally:
            torch.cuda.empty_cache()
        rows.append({
            "impl": impl, "tokens": case.tokens, "computed_tokens": padded_tokens if impl == PADDED else case.tokens,
            "fwd_ms": fwd.median_us / 1e3, "fwd_launch_ms": fwd.call_us / 1e3,
            "fwd_mtok_s": case.tokens / fwd.median_us, "fwd_bwd_ms": fb.median_us / 1e3,
            "fwd_bwd_launch_ms": fb.call_us / 1e3, "fwd_bwd_mtok_s": case.tokens / fb.median_us,
            "method": fb.method, "fwd_timing": fwd.as_dict(), "fwd_bwd_timing": fb.as_dict(),
        })
    torch._dynamo.reset()
    speedups, targets = _speedups(rows)
    return {
        "description": (f"Variable-length causal attention block: E = {EMBED}, {HEADS} heads, bf16, {n} sequences "
                        f"with Zipf({alpha:g}) lengths clipped to [1, {max_len}] (seed {seed}): {case.tokens} tokens, "
                        f"longest {case.max_len}, mean {case.tokens / n:.1f}, {padded_tokens} once padded. ms: device "
                        f"time (graph replays; plain launches for fp8ops eager); launch ms: plain launches; Mtok/s: "
                        f"real tokens; 'x': the peer's time over fp8ops's."),
        "config": {"embed": EMBED, "heads": HEADS, "sequences": n, "alpha": alpha, "max_len": max_len,
                   "seed": seed, "tokens": case.tokens, "longest": case.max_len, "shortest": case.min_len,
                   "padded_tokens": padded_tokens, "samples": samples},
        "lengths": lengths.tolist(), "rows": rows, "speedups": speedups, "targets": targets,
        "seconds": time.perf_counter() - t0,
    }


def _speedups(rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """fp8ops over each peer (peer time / fp8ops time); the target: faster than SDPA on nested tensors."""
    by = {r["impl"]: r for r in rows}
    out = []
    for f in (FP8OPS_EAGER, FP8OPS_COMPILED):
        for p in (NESTED, PADDED):
            if f in by and p in by:
                a, b = by[f], by[p]
                out.append({"fp8ops": f, "peer": p, "fwd_x": b["fwd_ms"] / a["fwd_ms"],
                            "fwd_bwd_x": b["fwd_bwd_ms"] / a["fwd_bwd_ms"],
                            "fwd_bwd_launch_x": b["fwd_bwd_launch_ms"] / a["fwd_bwd_launch_ms"]})
    targets = [dict(s, target=1.0, met="yes" if s["fwd_x"] > 1.0 and s["fwd_bwd_x"] > 1.0 else "MISS")
               for s in out if s["peer"] == NESTED]
    return out, targets


ROW_COLUMNS = [("impl", "implementation", "s"), ("computed_tokens", "tokens computed", ""),
               ("fwd_ms", "fwd ms", ".3f"), ("fwd_launch_ms", "fwd launch ms", ".3f"),
               ("fwd_mtok_s", "fwd Mtok/s", ".1f"), ("fwd_bwd_ms", "fwd+bwd ms", ".3f"),
               ("fwd_bwd_launch_ms", "f+b launch ms", ".3f"), ("fwd_bwd_mtok_s", "fwd+bwd Mtok/s", ".1f"),
               ("method", "timing", "s")]
SPEEDUP_COLUMNS = [("fp8ops", "fp8ops", "s"), ("peer", "peer", "s"), ("fwd_x", "fwd x", ".2f"),
                   ("fwd_bwd_x", "f+b x", ".2f"), ("fwd_bwd_launch_x", "f+b launch x", ".2f")]


def format_tables(rec: dict[str, Any]) -> str:
    """The rows, the speed-ups of fp8ops and the target lines, as text."""
    table = common.format_table(rec["rows"], ROW_COLUMNS) if rec["rows"] else "(no implementation ran; see the notes)"
    parts = [rec["description"], "", table]
    if rec["speedups"]:
        parts += ["", "fp8ops speed-up (peer time / fp8ops time):",
                  common.format_table(rec["speedups"], SPEEDUP_COLUMNS)]
    for t in rec["targets"]:
        parts.append(f"target: {t['fp8ops']} faster than {t['peer']}: fwd {t['fwd_x']:.2f}x, "
                     f"fwd+bwd {t['fwd_bwd_x']:.2f}x: {t['met']}")
    return "\n".join(parts)


def write_chart(path: Path, rec: dict[str, Any]) -> None:
    """A PNG: million tokens per second of each implementation, forward and forward+backward."""
    if not rec["rows"]:
        return
    panels = [{"title": title, "groups": [title], "series": {r["impl"]: [r[key]] for r in rec["rows"]}}
              for key, title in (("fwd_mtok_s", "fwd"), ("fwd_bwd_mtok_s", "fwd+bwd"))]
    cfg = rec["config"]
    common.write_bar_chart(path, panels, ylabel="million tokens / s",
                           title=f"variable-length causal attention block (bf16, E {cfg['embed']}, {cfg['heads']} "
                                 f"heads): {cfg['sequences']} sequences, {cfg['tokens']} tokens")
