"""FP8 quantize kernels vs torch eager, torch.compile and the device-copy ceiling.

Cases (bf16 input of shape (M, K), E4M3 output, random normal data):

- ``delayed``: quantize with the scale of a calibrated delayed-scaling state; the amax is computed
  in the same pass. Bytes counted: 2 read + 1 written per element.
- ``delayed_t``: the same, also writing the transposed copy. Bytes: 2 read + 2 written.
- ``current``: current (just-in-time) per-tensor scaling. It makes two passes (amax, then cast: 5
  bytes actually move per element); it is counted with the logical 2 + 1 bytes, so its fraction of
  the copy ceiling says how close it gets to a one-pass cast.
- ``rowwise``: current scaling with one scale per row (one launch, each row block swept twice; the
  second sweep mostly hits L2). Bytes: 2 + 1.

Implementations: ``fp8ops`` (the public :func:`fp8ops.quantize`), ``torch eager`` (the same math
written with torch ops: ``(x.float() * scale).clamp(-448, 448).to(torch.float8_e4m3fn)`` plus
``x.abs().amax()`` and the inverse scale; ``.t().contiguous()`` for the transposed copy) and
``torch.compile`` of those eager functions (``fullgraph=True, dynamic=False``).

``--sweep`` also times launch configurations of each kernel (block sizes, warps, grouping) through
the launchers' ``config=`` argument, checks that every configuration gives the default's output,
and reports the best per kernel and shape, so the defaults in ``kernels/quantize.py`` can be tuned
from one run.
"""

from __future__ import annotations

import argparse
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from . import common

__all__ = ["add_arguments", "run"]

FP8 = torch.float8_e4m3fn
FMAX = 448.0
FLT_MAX = torch.finfo(torch.float32).max
SHAPES = [(8192, 4096), (16384, 16384)]
QUICK_SHAPES = [(8192, 4096)]
IMPLS = ("fp8ops", "torch eager", "torch.compile")

# (name, label, bytes counted per element, how the bytes are counted)
CASES = [
    ("delayed", "quantize (delayed)", 3, "2 B read + 1 B written; one pass"),
    ("delayed_t", "quantize+transpose (delayed)", 4, "2 B read + 2 B written (q and q^T); one pass"),
    ("current", "quantize (current, tensor)", 3, "logical 2 B read + 1 B written; two passes (amax, cast): 5 B move"),
    ("rowwise", "quantize (current, row)", 3, "2 B read + 1 B written; second sweep of each row block mostly from L2"),
]

SWEEP_SPACE: dict[str, list[dict[str, int]]] = {
    "cast": [{"BLOCK": b, "num_warps": w} for b in (2048, 4096, 8192) for w in (4, 8)],
    "cast_transpose": [
        {"BLOCK_M": m, "BLOCK_K": k, "GROUP_M": g, "num_warps": w}
        for m, k in ((32, 128), (64, 64), (64, 128), (128, 64), (128, 128))
        for w in (4, 8)
        for g in (1, 8)
    ],
    "cast_rowwise": [
        {"BLOCK_M": m, "BLOCK_K": k, "num_warps": w} for m in (1, 2, 4, 8) for k in (512, 1024, 2048) for w in (4, 8)
    ],
    "amax": [{"BLOCK": b, "num_warps": w} for b in (4096, 8192, 16384) for w in (4, 8)],
}
# Bytes per element each kernel must move (bf16 in, fp8 out).
SWEEP_BYTES = {"cast": 3, "cast_transpose": 4, "cast_rowwise": 3, "amax": 2}
# Where the launcher defaults live, to mark them in the sweep.
SWEEP_DEFAULT_NAMES = {"cast": "_CAST_CFG", "cast_transpose": "_CAST_T_CFG", "cast_rowwise": "_ROWWISE_CFG",
                       "amax": "_AMAX_CFG"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of this suite (``--out`` and ``--quick`` are shared by every suite)."""
    parser.add_argument("--sweep", action="store_true",
                        help="also time launcher configs (block sizes, warps) of each kernel; report the best")
    parser.add_argument("--samples", type=_at_least_3, default=None,
                        help="timed samples per measurement (default 30, 10 with --quick)")


def _at_least_3(text: str) -> int:
    n = int(text)
    if n < 3:
        raise argparse.ArgumentTypeError(f"must be an integer >= 3, got {text}")
    return n


# ------------------------------------------------------------------------------------------------
# The peers: the same math in torch ops (module-level functions, so torch.compile can trace them).


def eager_delayed(x: Tensor, scale: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Delayed-scaling quantize in torch ops: ``(q, amax, inv_scale)``."""
    q = (x.float() * scale).clamp(-FMAX, FMAX).to(FP8)
    return q, x.abs().amax().float(), scale.reciprocal()


def eager_delayed_t(x: Tensor, scale: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Delayed-scaling quantize + transposed copy in torch ops: ``(q, q_t, amax, inv_scale)``."""
    q = (x.float() * scale).clamp(-FMAX, FMAX).to(FP8)
    return q, q.t().contiguous(), x.abs().amax().float(), scale.reciprocal()


def _jit_scale(amax: Tensor) -> Tensor:
    # fmax / amax (clamped to the largest float32); 1 where the amax is 0 or not finite.
    s = torch.clamp(torch.full_like(amax, FMAX) / amax, max=FLT_MAX)
    return torch.where((amax > 0) & torch.isfinite(amax), s, torch.ones_like(amax))


def eager_current(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Current-scaling (per tensor) quantize in torch ops: ``(q, amax, inv_scale)``."""
    amax = x.abs().amax().float()
    scale = _jit_scale(amax)
    q = (x.float() * scale).clamp(-FMAX, FMAX).to(FP8)
    return q, amax, scale.reciprocal()


def eager_rowwise(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Row-wise current-scaling quantize in torch ops: ``(q, inv_scale (M, 1), amax)``."""
    row_amax = x.abs().amax(dim=1, keepdim=True).float()  # (M, 1)
    scale = _jit_scale(row_amax)
    q = (x.float() * scale).clamp(-FMAX, FMAX).to(FP8)
    return q, scale.reciprocal(), row_amax.amax()


_EAGER = {"delayed": eager_delayed, "delayed_t": eager_delayed_t, "current": eager_current, "rowwise": eager_rowwise}


# ------------------------------------------------------------------------------------------------
# Implementations of each case: (callable of one input tensor, extractor of (q, q_t) for checks).

Impl = tuple[Callable[[Tensor], Any], Callable[[Any], tuple[Tensor, Tensor | None]]]


def _impls(case: str, scale: Tensor, compiled: dict[str, Any]) -> dict[str, Impl]:
    import fp8ops

    delayed = fp8ops.DelayedScaling(fp8_format=fp8ops.Format.E4M3)
    current = fp8ops.CurrentScaling(fp8_format=fp8ops.Format.E4M3)
    rowwise = fp8ops.CurrentScaling(fp8_format=fp8ops.Format.E4M3, granularity="row")
    # A calibrated delayed-scaling state with a realistic scale (from the data's amax).
    state = delayed.init(role="forward", device="cuda").replace(calibrated=True, scale=scale)
    comp = compiled[case]

    def from_value(o: Any) -> tuple[Tensor, Tensor | None]:
        return o[0].data, o[0].data_t

    if case == "delayed":
        return {
            "fp8ops": (lambda x: fp8ops.quantize(x, state, recipe=delayed), from_value),
            "torch eager": (lambda x: eager_delayed(x, scale), lambda o: (o[0], None)),
            "torch.compile": (lambda x: comp(x, scale), lambda o: (o[0], None)),
        }
    if case == "delayed_t":
        return {
            "fp8ops": (lambda x: fp8ops.quantize(x, state, recipe=delayed, transpose=True), from_value),
            "torch eager": (lambda x: eager_delayed_t(x, scale), lambda o: (o[0], o[1])),
            "torch.compile": (lambda x: comp(x, scale), lambda o: (o[0], o[1])),
        }
    if case == "current":
        return {
            "fp8ops": (lambda x: fp8ops.quantize(x, None, recipe=current), from_value),
            "torch eager": (eager_current, lambda o: (o[0], None)),
            "torch.compile": (comp, lambda o: (o[0], None)),
        }
    if case == "rowwise":
        return {
            "fp8ops": (lambda x: fp8ops.quantize(x, None, recipe=rowwise), from_value),
            "torch eager": (eager_rowwise, lambda o: (o[0], None)),
            "torch.compile": (comp, lambda o: (o[0], None)),
        }
    raise ValueError(f"unknown case {case!r}")


def _mismatches(a: Tensor, b: Tensor) -> int:
    """Number of differing bytes between two FP8 tensors of one shape."""
    if a.shape != b.shape:
        return a.numel() if a.numel() else -1
    return int((a.view(torch.uint8) != b.view(torch.uint8)).sum())


def _make_inputs(shape: tuple[int, int]) -> list[Tensor]:
    M, K = shape

    def make(i: int) -> Tensor:
        g = torch.Generator(device="cuda").manual_seed(1234 + i)
        return torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=g)

    return common.input_sets(make, M * K * 2)


def _shape_name(shape: tuple[int, ...]) -> str:
    return "x".join(str(s) for s in shape)


# ------------------------------------------------------------------------------------------------
# Sweep of launcher configurations


def _sweep_space() -> dict[str, list[dict[str, Any]]]:
    """The configurations to time per kernel: :data:`SWEEP_SPACE` plus the launcher's default."""
    from fp8ops.kernels import quantize as kq

    space = {}
    for kernel, configs in SWEEP_SPACE.items():
        default = dict(getattr(kq, SWEEP_DEFAULT_NAMES[kernel], {}) or {})
        space[kernel] = list(configs) + ([default] if default and default not in configs else [])
    return space


def _sweep_launch(kernel: str, scale: Tensor) -> Callable[[Tensor, dict[str, Any] | None], tuple[Tensor, ...]]:
    from fp8ops.kernels import quantize as kq

    if kernel == "cast":
        return lambda x, cfg: kq.cast_launch(x, scale, None, 0, False, FP8, config=cfg)
    if kernel == "cast_transpose":
        return lambda x, cfg: kq.cast_transpose_launch(x, scale, None, 0, False, FP8, config=cfg)
    if kernel == "cast_rowwise":
        return lambda x, cfg: kq.cast_rowwise_launch(x, 0, False, FP8, config=cfg)
    if kernel == "amax":
        return lambda x, cfg: (kq.amax_launch(x, config=cfg),)
    raise ValueError(f"unknown kernel {kernel!r}")


def _same_outputs(a: tuple[Tensor, ...], b: tuple[Tensor, ...]) -> bool:
    for u, v in zip(a, b):
        if u.shape != v.shape or u.dtype != v.dtype:
            return False
        uu = u.view(torch.uint8) if u.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else u.view(torch.int32)
        vv = v.view(torch.uint8) if v.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else v.view(torch.int32)
        if not torch.equal(uu, vv):
            return False
    return True


def _run_sweep(shapes: list[tuple[int, int]], ceiling_tbps: float, samples: int, progress: common.Progress,
               failed: list[str], out: dict[str, Any], save: Callable[[], Any]) -> None:
    """Time every launcher config of :func:`_sweep_space` on each shape; fill ``out``
    (kernel -> shape -> results) and call ``save`` after each kernel."""
    from fp8ops.kernels import quantize as kq

    for shape in shapes:
        xs = _make_inputs(shape)
        amax0 = xs[0].abs().amax().float()
        scale = torch.clamp(torch.full_like(amax0, FMAX) / amax0, max=FLT_MAX)
        n = shape[0] * shape[1]
        for kernel, space in _sweep_space().items():
            launch = _sweep_launch(kernel, scale)
            default = dict(getattr(kq, SWEEP_DEFAULT_NAMES[kernel], {}) or {})
            ref = launch(xs[0], None)
            entries = []
            for cfg in space:
                progress.step(f"sweep {kernel} {_shape_name(shape)} {cfg}")
                entry: dict[str, Any] = {"config": cfg, "default": cfg == default}
                try:
                    got = launch(xs[0], cfg)
                    entry["correct"] = _same_outputs(got, ref)
                    del got
                    t = common.time_cuda(lambda x, c=cfg: launch(x, c), [(x,) for x in xs], samples=samples,
                                         on_fallback=progress.note)
                    entry.update(us=t.median_us, p20_us=t.p20_us, p80_us=t.p80_us,
                                 tbps=common.tbps(SWEEP_BYTES[kernel] * n, t.median_us))
                    entry["pct_copy"] = 100.0 * entry["tbps"] / ceiling_tbps
                    if not entry["correct"]:
                        failed.append(f"sweep {kernel} {_shape_name(shape)} {cfg}: "
                                      "output differs from the default config's")
                except Exception as exc:  # an invalid config (resources) is a result, not a crash
                    entry["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                    progress.note(f"config {cfg} failed: {entry['error']}")
                entries.append(entry)
                torch.cuda.empty_cache()
            ok = [e for e in entries if e.get("correct") and "us" in e]
            best = min(ok, key=lambda e: e["us"]) if ok else None
            dflt = next((e for e in entries if e["default"]), None)
            out.setdefault(kernel, {})[_shape_name(shape)] = {
                "bytes_per_element": SWEEP_BYTES[kernel],
                "default_config": default,
                "best": best,
                "default": dflt,
                "best_speedup_vs_default": (dflt["us"] / best["us"]) if best and dflt and "us" in dflt else None,
                "all": entries,
            }
            del ref
            save()
        del xs
        torch.cuda.empty_cache()


def _print_sweep(sweep: dict[str, Any]) -> None:
    rows = []
    for kernel, by_shape in sweep.items():
        for shape, s in by_shape.items():
            best, dflt = s["best"], s["default"]
            rows.append({
                "kernel": kernel,
                "shape": shape,
                "best config": _cfg_str(best["config"]) if best else "-",
                "best us": best["us"] if best else None,
                "best %copy": best["pct_copy"] if best else None,
                "default us": dflt.get("us") if dflt else None,
                "default %copy": dflt.get("pct_copy") if dflt else None,
                "gain": s["best_speedup_vs_default"],
            })
    print()
    print("Launcher config sweep (best correct config per kernel and shape; all configs in the JSON)")
    print(common.format_table(rows, [
        ("kernel", "kernel", ""), ("shape", "shape", ""), ("best config", "best config", ""),
        ("best us", "best µs", ".1f"), ("best %copy", "% copy", ".1f"),
        ("default us", "default µs", ".1f"), ("default %copy", "% copy", ".1f"), ("gain", "default/best", ".3f"),
    ]))


def _cfg_str(cfg: dict[str, Any]) -> str:
    return ",".join(f"{k}={v}" for k, v in cfg.items())


# ------------------------------------------------------------------------------------------------
# The suite


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the quantize suite; print the table; write quantize.json and quantize.png to ``args.out``."""
    t_start = time.perf_counter()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / "quantize.json"
    quick = bool(args.quick)
    shapes = QUICK_SHAPES if quick else SHAPES
    samples = args.samples or (10 if quick else 30)
    sweep_total = sum(len(v) for v in _sweep_space().values()) * len(shapes) if args.sweep else 0
    progress = common.Progress(2 + len(shapes) * (1 + len(CASES) * len(IMPLS)) + sweep_total, prefix="quantize ")

    env = common.environment()
    print(f"fp8ops.bench quantize | {common.describe_environment(env)}", flush=True)
    record: dict[str, Any] = {
        "suite": "quantize",
        "schema": 1,
        "partial": True,
        "env": env,
        "args": {"quick": quick, "sweep": bool(args.sweep), "samples": samples, "shapes": [list(s) for s in shapes]},
        "method": common.__doc__,
        "cases": {name: {"label": label, "bytes_per_element": b, "bytes": how} for name, label, b, how in CASES},
        "results": [],
        "failed_checks": [],
        "notes": [],
    }
    failed: list[str] = record["failed_checks"]
    notes: list[str] = record["notes"]

    # Step 1: the memory ceiling.
    progress.step("copy ceiling (device-to-device copy)")
    ceiling = common.copy_bandwidth(2**29 if quick else 2**30, samples=samples)
    record["ceiling"] = {"start": ceiling}
    cbw = ceiling["tbps"]
    print(f"copy ceiling: {cbw:.3f} TB/s ({ceiling['bytes'] / 2**20:.0f} MiB dst.copy_(src), read + written)",
          flush=True)
    common.write_json(json_path, record)

    compiled = {name: torch.compile(fn, fullgraph=True, dynamic=False) for name, fn in _EAGER.items()}
    rows: list[dict[str, Any]] = record["results"]

    # Step 2: every case, implementation and shape.
    for shape in shapes:
        M, K = shape
        n = M * K
        sname = _shape_name(shape)
        xs = _make_inputs(shape)
        amax0 = xs[0].abs().amax().float()
        scale = torch.clamp(torch.full_like(amax0, FMAX) / amax0, max=FLT_MAX)  # realistic delayed scale

        # A same-size reference: copying the bf16 input (2 B read + 2 B written per element).
        progress.step(f"{sname} copy_ of the bf16 input")
        dst = torch.empty_like(xs[0])
        t = common.time_cuda(lambda x: dst.copy_(x), [(x,) for x in xs], samples=samples, on_fallback=progress.note)
        rows.append({"shape": sname, "case": "copy", "label": "copy_ of the bf16 input (same size)",
                     "impl": "torch copy_", "bytes_per_element": 4, "us": t.median_us, "p20_us": t.p20_us,
                     "p80_us": t.p80_us, "call_us": t.call_us, "tbps": common.tbps(4 * n, t.median_us),
                     "pct_copy": 100.0 * common.tbps(4 * n, t.median_us) / cbw, "method": t.method,
                     "calls": t.calls, "buffers": t.buffers})
        del dst

        for case, label, bpe, _how in CASES:
            impls = _impls(case, scale, compiled)
            ref_q: Tensor | None = None
            ref_qt: Tensor | None = None
            for impl, (fn, extract) in impls.items():
                progress.step(f"{sname} {case} {impl}")
                row: dict[str, Any] = {"shape": sname, "case": case, "label": label, "impl": impl,
                                       "bytes_per_element": bpe}
                try:
                    # Correct first: every implementation's FP8 bytes against torch eager's.
                    q, qt = extract(fn(xs[0]))
                    if impl == "torch eager":
                        ref_q, ref_qt = q, qt
                    row["_q"], row["_qt"] = q, qt
                    t = common.time_cuda(lambda x, f=fn: f(x), [(x,) for x in xs], samples=samples,
                                         on_fallback=progress.note)
                    bw = common.tbps(bpe * n, t.median_us)
                    row.update(us=t.median_us, p20_us=t.p20_us, p80_us=t.p80_us, call_us=t.call_us, tbps=bw,
                               pct_copy=100.0 * bw / cbw, method=t.method, calls=t.calls, buffers=t.buffers)
                except Exception as exc:
                    row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                    progress.note(f"{sname} {case} {impl} failed: {row['error']}")
                    notes.append(f"{sname} {case} {impl}: {row['error']}")
                    if impl == "fp8ops":
                        failed.append(f"{sname} {case} fp8ops: {row['error']}")
                rows.append(row)
                torch.cuda.empty_cache()
            # Checks against the eager peer, then drop the kept outputs.
            case_rows = [r for r in rows if r["shape"] == sname and r["case"] == case]
            for r in case_rows:
                q, qt = r.pop("_q", None), r.pop("_qt", None)
                if ref_q is None or q is None or r["impl"] == "torch eager":
                    continue
                r["mismatched_bytes_vs_eager"] = _mismatches(q, ref_q)
                if case == "delayed_t" and qt is not None and ref_qt is not None:
                    r["mismatched_bytes_t_vs_eager"] = _mismatches(qt, ref_qt)
                bad = r["mismatched_bytes_vs_eager"] + r.get("mismatched_bytes_t_vs_eager", 0)
                if bad:
                    msg = f"{sname} {case} {r['impl']}: {bad} FP8 bytes differ from torch eager"
                    if case.startswith("delayed") and r["impl"] == "fp8ops":
                        # Same scale, same saturating round-to-nearest-even cast: must be bit-exact.
                        failed.append(msg)
                    else:
                        # Just-in-time scales may differ in the last bit (division rounding).
                        notes.append(msg + " (just-in-time scale rounding may differ)")
            ref_q = ref_qt = None
            base = next((r for r in case_rows if r["impl"] == "fp8ops" and "us" in r), None)
            for r in case_rows:
                if base is not None and "us" in r:
                    r["fp8ops_speedup"] = r["us"] / base["us"]
            common.write_json(json_path, record)
        del xs
        torch.cuda.empty_cache()

    # Step 3: the ceiling again (a drift between the two says the card's state changed mid-run).
    progress.step("copy ceiling again")
    ceiling_end = common.copy_bandwidth_again(cbw, notes, quick=quick, samples=samples)
    record["ceiling"]["end"] = ceiling_end

    # Output: table, JSON, plot.
    print()
    print(common.format_table(rows, [
        ("shape", "shape", ""), ("label", "case", ""), ("impl", "impl", ""),
        ("us", "µs", ".1f"), ("call_us", "call µs", ".1f"), ("tbps", "TB/s", ".3f"),
        ("pct_copy", "% copy", ".1f"), ("fp8ops_speedup", "fp8ops speedup", ".2f"),
    ]))
    print()
    legend = (
        "µs: median device time per call (CUDA-graph replays, inputs rotated to defeat L2; the JSON's "
        "'method' says 'events' where a graph could not be captured); call µs: per call launched from Python. "
        "TB/s counts bytes read + written: " + "; ".join(f"{c}: {h}" for c, _, _, h in CASES) + ". "
        f"% copy: of {cbw:.3f} TB/s measured by a device-to-device copy (again at the end: "
        f"{ceiling_end['tbps']:.3f} TB/s). fp8ops speedup: this row's time / fp8ops's time in the same case "
        "(above 1: fp8ops is faster)."
    )
    print(textwrap.fill(legend, width=110), flush=True)
    common.write_json(json_path, record)

    # Step 4: the launcher sweep (its results are written to the JSON as they come).
    if args.sweep:
        record["sweep"] = {}
        _run_sweep(shapes, cbw, max(10, samples // 2), progress, failed, record["sweep"],
                   lambda: common.write_json(json_path, record))
        _print_sweep(record["sweep"])
    for note in notes:
        print(f"note: {note}")

    record["partial"] = False
    record["elapsed_s"] = time.perf_counter() - t_start
    common.write_json(json_path, record)
    panels = []
    for shape in shapes:
        sname = _shape_name(shape)
        groups = [label for _, label, _, _ in CASES]
        series = {
            impl: [next((r.get("pct_copy") for r in rows if r["shape"] == sname and r["case"] == case
                         and r["impl"] == impl), None) for case, _, _, _ in CASES]
            for impl in IMPLS
        }
        panels.append({"title": f"bf16 {sname} -> E4M3", "groups": groups, "series": series})
    png = common.write_bar_chart(
        out_dir / "quantize.png", panels,
        title=f"FP8 quantize, % of copy bandwidth ({cbw:.2f} TB/s) | {env['gpu']} | torch {env['torch']} | "
              f"triton {env['triton']}",
        ylabel="% of device-copy bandwidth (bytes read + written)",
        hlines=[(100.0, "copy ceiling"), (88.0, "target 88%")],
    )
    print(f"wrote {json_path}" + (f" and {png}" if png else ""), flush=True)
    return record
