"""Shared machinery of the benchmark suites: timing, ceilings, environment, tables, JSON, plots.

Timing method (``time_cuda``):

- warm-up calls first (Triton compilation, ``torch.compile`` tracing, allocator growth stay out);
- the calls rotate among several input sets whose total size is several times the L2 cache, so
  every call reads its input from device memory, as it would inside a model;
- a sample is a CUDA graph of ``calls`` back-to-back calls, replayed between two CUDA events: this
  is device time, without host launch gaps; the reported time per call is the median over many
  samples, divided by ``calls``;
- ``call_us`` is the same loop launched from Python without a graph (events around the loop): it
  equals the device time when the host keeps ahead of the GPU, and is larger when the host launch
  path (Python, dispatch) is the bottleneck.

The memory ceiling is a large device-to-device copy (``dst.copy_(src)``), counting bytes read plus
bytes written; memory-bound kernels are reported as a fraction of it.
"""

from __future__ import annotations

import datetime
import gc
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "Progress",
    "Timing",
    "copy_bandwidth",
    "cuda_unavailable_reason",
    "device_events",
    "device_ops",
    "environment",
    "format_table",
    "host_us",
    "input_sets",
    "num_buffers",
    "time_cuda",
    "write_bar_chart",
    "write_json",
]


def cuda_unavailable_reason() -> str | None:
    """None if a CUDA device can be used, else a sentence saying why not and what to do."""
    if torch.version.cuda is None:
        return (
            f"this torch ({torch.__version__}) is built without CUDA; the benchmarks time GPU kernels: "
            "run them on a machine with an NVIDIA GPU and a CUDA build of torch "
            "(for example: bash scripts/gpu_check.sh OUTDIR)"
        )
    if not torch.cuda.is_available():
        return (
            "no CUDA device is available (torch.cuda.is_available() is False); the benchmarks time GPU "
            "kernels: run them on a machine with an NVIDIA GPU (for example: bash scripts/gpu_check.sh OUTDIR)"
        )
    return None


# ------------------------------------------------------------------------------------------------
# Progress


class Progress:
    """A progress line per step on stderr: ``[  3/24  12.5s] what``."""

    def __init__(self, total: int, *, prefix: str = "") -> None:
        self.total = total
        self.done = 0
        self.prefix = prefix
        self.t0 = time.perf_counter()

    def step(self, what: str) -> None:
        """Report that the next step (``what``) starts."""
        self.done += 1
        width = len(str(self.total))
        elapsed = time.perf_counter() - self.t0
        print(
            f"{self.prefix}[{self.done:>{width}}/{self.total} {elapsed:6.1f}s] {what}",
            file=sys.stderr,
            flush=True,
        )

    def note(self, message: str) -> None:
        """A side message (a warning, a skipped item) on the same stream."""
        print(f"{self.prefix}  {message}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------------
# Inputs


def l2_bytes() -> int:
    """The L2 cache size of the current device (50 MiB if torch does not report it)."""
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return int(getattr(props, "L2_cache_size", 0) or 50 * 2**20)


def num_buffers(bytes_per_set: int, *, l2: int | None = None, factor: int = 4, lo: int = 2, hi: int = 16) -> int:
    """How many input sets to rotate among so that together they are ``factor`` times the L2."""
    l2 = l2_bytes() if l2 is None else l2
    n = math.ceil(factor * l2 / max(1, bytes_per_set))
    return max(lo, min(hi, n))


def input_sets(make: Callable[[int], Any], bytes_per_set: int) -> list[Any]:
    """``[make(0), make(1), ...]``: enough independent input sets to defeat the L2 cache."""
    return [make(i) for i in range(num_buffers(bytes_per_set))]


# ------------------------------------------------------------------------------------------------
# Timing


@dataclass(frozen=True)
class Timing:
    """Time per call of a timed function, in microseconds.

    Attributes:
        median_us: median over samples of device time per call (the headline number).
        p20_us, p80_us: 20th and 80th percentiles (the spread).
        samples: timed samples; calls: calls per sample; buffers: input sets rotated among.
        method: "cuda-graph" (graph replays between events) or "events" (plain launches between
            events, the fallback when the calls cannot be captured in a graph).
        call_us: median time per call when launched from Python without a graph.
    """

    median_us: float
    p20_us: float
    p80_us: float
    samples: int
    calls: int
    buffers: int
    method: str
    call_us: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _run_calls(fn: Callable[..., Any], arg_sets: Sequence[Sequence[Any]], count: int) -> None:
    n = len(arg_sets)
    out = None
    for i in range(count):
        out = fn(*arg_sets[i % n])
    del out


def _quantile(values: Sequence[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def _loop_times(fn: Callable[..., Any], arg_sets: Sequence[Sequence[Any]], count: int, samples: int) -> list[float]:
    """Per-call times (µs) of ``samples`` loops of ``count`` plain launches, events around each loop."""
    times = []
    for _ in range(samples):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        _run_calls(fn, arg_sets, count)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / count)
    return times


def capture_graph(warm: Callable[[], Any], body: Callable[[], Any]) -> torch.cuda.CUDAGraph:
    """A CUDA graph of ``body()``, captured after ``warm()`` ran on a side stream (capture needs the
    first calls, allocator warm-up and lazy initialisation, made outside it)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        warm()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    return graph


def replay_wall_ms(graph: torch.cuda.CUDAGraph, replays: int, warmup: int) -> float:
    """Wall ms per replay of ``graph`` over a synchronized loop of ``replays``, after ``warmup``."""
    for _ in range(warmup):
        graph.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(replays):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / replays * 1e3


def _graph_times(
    fn: Callable[..., Any], arg_sets: Sequence[Sequence[Any]], count: int, samples: int, warmup: int
) -> list[float]:
    """Per-call times (µs) of ``samples`` replays of a graph of ``count`` calls."""
    graph = capture_graph(lambda: _run_calls(fn, arg_sets, len(arg_sets)), lambda: _run_calls(fn, arg_sets, count))
    try:
        for _ in range(warmup):
            graph.replay()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(samples)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(samples)]
        for s, e in zip(starts, ends):
            s.record()
            graph.replay()
            e.record()
        torch.cuda.synchronize()
        return [s.elapsed_time(e) * 1e3 / count for s, e in zip(starts, ends)]
    finally:
        del graph


def host_us(fn: Callable[[], Any], calls: int = 200, *, repeats: int = 1, warmup: int = 10) -> tuple[float, float]:
    """(host µs, wall µs) per call of a loop of ``calls`` calls of ``fn``.

    Host: the loop launched without synchronization (the CPU time of a call while the GPU keeps
    up); wall: until the GPU has finished too. With ``repeats``, the best of that many loops (the
    machine's other work only ever adds time).
    """
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    best = (math.inf, math.inf)
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        host = (time.perf_counter() - t0) / calls * 1e6
        torch.cuda.synchronize()
        best = min(best, (host, (time.perf_counter() - t0) / calls * 1e6))
    return best


def device_events(fn: Callable[[], Any], calls: int = 2, *, table: str | None = None) -> list[Any]:
    """The device operations (kernels, memsets, copies) of ``calls`` calls of ``fn`` from
    torch.profiler, in order of their start. ``table``: also print the top kernels under that title."""
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    if table is not None:
        print(f"\n==== top CUDA kernels, {calls} calls: {table} ====")
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=15, max_name_column_width=70))
    evs = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return sorted(evs, key=lambda e: e.time_range.start)


def device_ops(fn: Callable[[], Any], calls: int = 2, *, table: str | None = None) -> tuple[float, float]:
    """(device operations per call, their summed duration in µs per call) of ``fn``
    (:func:`device_events`)."""
    evs = device_events(fn, calls, table=table)
    return len(evs) / calls, sum(e.device_time for e in evs) / calls


def time_cuda(
    fn: Callable[..., Any],
    arg_sets: Sequence[Sequence[Any]],
    *,
    samples: int = 30,
    warmup: int = 3,
    target_sample_us: float = 2000.0,
    max_calls: int = 256,
    use_graph: bool = True,
    on_fallback: Callable[[str], None] | None = None,
) -> Timing:
    """Median device time of ``fn(*arg_sets[i % len(arg_sets)])`` per call.

    Args:
        fn: the function to time; it must launch its work on the current stream and not
            synchronize with the host (no ``.item()``), or graph capture falls back to events.
        arg_sets: the input sets rotated among (see :func:`input_sets`).
        samples: timed samples (the median is over these).
        warmup: untimed warm-up calls (per input set) and graph replays.
        target_sample_us: each sample holds enough calls to last about this long (event resolution).
        max_calls: most calls per sample.
        use_graph: time graph replays (device time); False times plain launches.
        on_fallback: called with a message when graph capture fails and events are used instead.

    Returns:
        A :class:`Timing`.
    """
    n = len(arg_sets)
    if n == 0:
        raise ValueError("time_cuda: arg_sets is empty")
    # Step 1: warm up, then estimate the time of one call to size the samples.
    for _ in range(warmup):
        _run_calls(fn, arg_sets, n)
    torch.cuda.synchronize()
    est = statistics.median(_loop_times(fn, arg_sets, n, 3))
    calls = max(1, min(max_calls, math.ceil(target_sample_us / max(est, 1e-3))))
    calls = n * math.ceil(calls / n)  # whole rotations: consecutive samples start on another buffer
    # Step 2: plain launches (host launch path included when it is the bottleneck).
    loop = _loop_times(fn, arg_sets, calls, max(3, samples // 6))
    call_us = statistics.median(loop)
    # Step 3: graph replays (device time).
    method = "events"
    times = loop
    if use_graph:
        try:
            times = _graph_times(fn, arg_sets, calls, samples, warmup)
            method = "cuda-graph"
        except Exception as exc:  # capture is not possible for every function (host syncs)
            torch.cuda.synchronize()
            if on_fallback is not None:
                on_fallback(f"graph capture failed ({type(exc).__name__}: {exc}); timing plain launches")
            times = _loop_times(fn, arg_sets, calls, samples)
    torch.cuda.synchronize()
    return Timing(
        median_us=statistics.median(times),
        p20_us=_quantile(times, 0.2),
        p80_us=_quantile(times, 0.8),
        samples=len(times),
        calls=calls,
        buffers=n,
        method=method,
        call_us=call_us,
    )


def copy_bandwidth(nbytes: int = 2**30, *, samples: int = 30) -> dict[str, Any]:
    """The memory ceiling: a device-to-device copy of ``nbytes``, bytes read + written per second.

    The copy moves 4-byte elements (a 1-byte copy runs well below the memory bandwidth) and is timed
    both as graph replays and as plain launches; the faster of the two is the ceiling.

    Returns:
        ``{"bytes": nbytes, "bytes_moved": 2 * nbytes, "us": ..., "tbps": ..., "timing": {...}}``.
    """
    src = torch.randint(-(2**31), 2**31 - 1, (nbytes // 4,), dtype=torch.int32, device="cuda")  # random, never zeros
    dst = torch.empty_like(src)
    timings = [time_cuda(lambda s: dst.copy_(s), [(src,)], samples=samples, max_calls=16, use_graph=g)
               for g in (True, False)]
    t = min(timings, key=lambda t: t.median_us)
    del src, dst
    torch.cuda.empty_cache()
    return {
        "what": "dst.copy_(src), int32, device to device (faster of graph replays and plain launches)",
        "bytes": nbytes,
        "bytes_moved": 2 * nbytes,
        "us": t.median_us,
        "tbps": 2 * nbytes / t.median_us / 1e6,
        "timing": t.as_dict(),
        "all_timings": [x.as_dict() for x in timings],
    }


def copy_bandwidth_again(start_tbps: float, notes: list[str], *, quick: bool, samples: int) -> dict[str, Any]:
    """The copy ceiling measured again at the end of a run; a drift of more than 3 % from
    ``start_tbps`` (the card's state changed mid-run) is added to ``notes``."""
    end = copy_bandwidth(2**29 if quick else 2**30, samples=samples)
    drift = abs(end["tbps"] / start_tbps - 1.0)
    if drift > 0.03:
        notes.append(f"copy ceiling moved by {100 * drift:.1f}% during the run "
                     f"({start_tbps:.3f} -> {end['tbps']:.3f} TB/s): treat small differences as noise")
    return end


def tbps(nbytes: float, us: float) -> float:
    """Bytes over microseconds, in TB/s (1e12 bytes per second)."""
    return nbytes / us / 1e6


# ------------------------------------------------------------------------------------------------
# Environment


def _run(cmd: Sequence[str], cwd: str | None = None) -> str | None:
    try:
        out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=20, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def environment() -> dict[str, Any]:
    """GPU, driver, CUDA, torch, triton and fp8ops versions, and the source revision."""
    import fp8ops

    dev = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(dev)
    try:
        import triton

        triton_version: str | None = triton.__version__
    except ImportError:
        triton_version = None
    smi = _run(["nvidia-smi", f"--id={dev}", "--query-gpu=driver_version,clocks.max.sm,clocks.max.mem,power.limit",
                "--format=csv,noheader"])
    here = os.path.dirname(os.path.abspath(__file__))
    return {
        "gpu": props.name,
        "capability": f"{props.major}.{props.minor}",
        "sm_count": props.multi_processor_count,
        "memory_gib": round(props.total_memory / 2**30, 1),
        "l2_bytes": l2_bytes(),
        "nvidia_smi": smi,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton_version,
        "python": platform.python_version(),
        "fp8ops": getattr(fp8ops, "__version__", None),
        "git_commit": _run(["git", "rev-parse", "HEAD"], cwd=here),
        "git_dirty": bool(_run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here)),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def describe_environment(env: dict[str, Any]) -> str:
    """One line naming the GPU and versions, for the top of a table."""
    return (
        f"{env['gpu']} (sm_{env['capability'].replace('.', '')}, {env['sm_count']} SMs, "
        f"L2 {env['l2_bytes'] / 2**20:.0f} MiB) | torch {env['torch']} | CUDA {env['cuda']} | "
        f"triton {env['triton']} | fp8ops {env['fp8ops']}"
    )


# ------------------------------------------------------------------------------------------------
# Output


def _cell(value: Any, fmt: str) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return format(value, fmt) if fmt else str(value)


def format_table(rows: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str, str]]) -> str:
    """A plain-text table. ``columns``: ``(key, header, format spec)``; "" formats with ``str``.

    Text columns are left-aligned, numeric columns right-aligned; a missing value prints ``-``.
    """
    cells = [[_cell(r.get(k), f) for k, _, f in columns] for r in rows]
    heads = [h for _, h, _ in columns]
    widths = [max([len(h)] + [len(c[i]) for c in cells]) for i, h in enumerate(heads)]
    numeric = [all(isinstance(r.get(k), (int, float)) or r.get(k) is None for r in rows) for k, _, _ in columns]

    def line(items: Sequence[str]) -> str:
        return "  ".join(s.rjust(w) if num else s.ljust(w) for s, w, num in zip(items, widths, numeric)).rstrip()

    out = [line(heads), line(["-" * w for w in widths])]
    out += [line(c) for c in cells]
    return "\n".join(out)


def _json_safe(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    if isinstance(obj, (torch.dtype, torch.Size, Path)):
        return str(obj)
    return obj


def write_json(path: str | os.PathLike[str], record: dict[str, Any]) -> Path:
    """Write ``record`` as indented JSON (non-finite floats become null); return the path."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(_json_safe(record), indent=2, allow_nan=False) + "\n")
    return p


def write_bar_chart(
    path: str | os.PathLike[str],
    panels: Sequence[dict[str, Any]],
    *,
    title: str,
    ylabel: str,
    hlines: Sequence[tuple[float, str]] = (),
) -> Path | None:
    """A PNG of grouped bar charts, one panel per entry of ``panels``.

    Each panel is ``{"title": str, "groups": [str], "series": {name: [value or None per group]}}``.
    ``hlines`` are ``(y, label)`` reference lines (a ceiling, a target). matplotlib is imported
    here (Agg backend); without it the plot is skipped with a message and None is returned.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("fp8ops.bench: matplotlib is not installed; skipping the plot (pip install matplotlib)",
              file=sys.stderr)
        return None
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.8), squeeze=False, sharey=True)
    for ax, panel in zip(axes[0], panels):
        groups = panel["groups"]
        series = panel["series"]
        width = 0.8 / max(1, len(series))
        for j, (name, values) in enumerate(series.items()):
            xs = [i - 0.4 + width * (j + 0.5) for i in range(len(groups))]
            ys = [v if v is not None and math.isfinite(v) else 0.0 for v in values]
            bars = ax.bar(xs, ys, width, label=name)
            for b, v in zip(bars, values):
                if v is not None and math.isfinite(v):
                    ax.annotate(f"{v:.0f}", (b.get_x() + b.get_width() / 2, b.get_height()),
                                ha="center", va="bottom", fontsize=7)
        for y, label in hlines:
            ax.axhline(y, linestyle="--", linewidth=0.8, color="gray")
            ax.annotate(label, (len(groups) - 0.5, y), ha="right", va="bottom", fontsize=7, color="gray")
        ax.set_xticks(range(len(groups)))
        ax.set_xticklabels(groups, rotation=20, ha="right", fontsize=8)
        ax.set_title(panel["title"], fontsize=10)
        ax.grid(axis="y", linewidth=0.3)
    axes[0][0].set_ylabel(ylabel)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(p, dpi=120)
    plt.close(fig)
    return p


# ------------------------------------------------------------------------------------------------
# Training-step helpers shared by the layer-level suites


def clearing_grads(step: Callable[[torch.Tensor, torch.Tensor], Any], params: Sequence[torch.Tensor]
                   ) -> Callable[[torch.Tensor, torch.Tensor], Any]:
    """``step(x, dy)`` preceded by ``p.grad = None`` for every parameter and for ``x``, as after
    ``optimizer.zero_grad(set_to_none=True)``: every timed step allocates its gradients anew."""

    def fn(x: torch.Tensor, dy: torch.Tensor) -> Any:
        for p in params:
            p.grad = None
        x.grad = None
        return step(x, dy)

    return fn


def step_peak_bytes(step: Callable[[torch.Tensor, torch.Tensor], Any], params: Sequence[torch.Tensor],
                    x: torch.Tensor, dy: torch.Tensor) -> int:
    """Peak memory of one ``step(x, dy)`` above what is allocated before it (gradients cleared)."""
    for p in params:
        p.grad = None
    x.grad = None
    gc.collect()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    y = step(x, dy)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del y
    for p in params:
        p.grad = None
    x.grad = None
    return int(peak)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """``|a - b| / |b|`` (Frobenius norms, float32)."""
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))
