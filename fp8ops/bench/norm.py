"""LayerNorm / RMSNorm kernels vs torch eager, torch.compile and the device-copy ceiling.

Cases (bf16 input (M, K), bf16 weight and bias, random normal data, eps 1e-5):

- ``fwd``: forward with a bf16 output (the public :func:`fp8ops.norm.layer_norm` /
  :func:`~fp8ops.norm.rms_norm`). Bytes counted: 2 read + 2 written per element.
- ``fwd_fp8``: forward with an E4M3 output only (delayed scaling: a given scale; amax of the fp32
  output in the same pass), the input of an FP8 GEMM. Bytes: 2 read + 1 written.
- ``fwd_fp8_t``: the same, also writing the transposed FP8 copy. Bytes: 2 read + 2 written.
- ``bwd``: backward (dx, dweight, dbias) from saved statistics. Bytes: 2 (dy) + 2 (x) read + 2 (dx)
  written; the (G, K) partial sums of dweight / dbias are negligible and not counted.

Peers: ``torch eager`` (``F.layer_norm`` / ``F.rms_norm``; for the FP8 cases followed by
``(y.float() * scale).clamp(-448, 448).to(float8_e4m3fn)``, ``y.abs().amax()`` and
``q.t().contiguous()``; the backward is the aten backward kernel that autograd runs for the same call) and ``torch.compile``
of the same functions (the backward as the explicit formula, which is what Inductor generates for
it), ``fullgraph=True, dynamic=False``.

Every output is checked against an FP32 reference on the same data (the forward y and dx with the
rule "error <= 2 x the eager peer's error + atol", FP8 bytes against the saturating cast of the FP32
reference output, dweight / dbias relative errors); failures are recorded in ``failed_checks``.

``--sweep`` also times launch configurations of the fp8ops kernels through the launchers'
``config=`` argument (LayerNorm only) and reports the best per kernel and shape.
"""

from __future__ import annotations

import argparse
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from . import common

__all__ = ["add_arguments", "run"]

FP8 = torch.float8_e4m3fn
FMAX = 448.0
EPS = 1e-5
SHAPES = [(8192, 4096), (16384, 8192)]
QUICK_SHAPES = [(8192, 4096)]
NORMS = ("LayerNorm", "RMSNorm")
IMPLS = ("fp8ops", "torch eager", "torch.compile")
TARGETS = {"fwd_fp8": 0.85, "fwd_fp8_t": 0.85, "bwd": 0.75}

# (name, label, bytes counted per element, how the bytes are counted)
CASES = [
    ("fwd", "forward, bf16 out", 4, "2 B read + 2 B written"),
    ("fwd_fp8", "forward, FP8 out (delayed)", 3, "2 B read + 1 B written"),
    ("fwd_fp8_t", "forward, FP8 out + transpose (delayed)", 4, "2 B read + 2 B written (q and q^T)"),
    ("bwd", "backward (dx, dw, db)", 6, "2 B dy + 2 B x read + 2 B dx written"),
]

SWEEP_SPACE: dict[str, list[dict[str, int]]] = {
    "fwd_fp8": [{"BLOCK_M": m, "num_warps": w, "PROGRAMS_PER_SM": p} for m in (1, 2, 4) for w in (4, 8, 16)
                for p in (1, 2, 4)],
    "fwd_fp8_t": [
        {"BLOCK_M": m, "BLOCK_K": k, "num_warps": w}
        for m, k in ((16, 128), (16, 256), (32, 64), (32, 128), (64, 64), (32, 256))
        for w in (4, 8)
    ],
    "bwd": [{"BLOCK_M": m, "num_warps": w, "PROGRAMS_PER_SM": p} for m in (1, 2, 4) for w in (4, 8, 16)
            for p in (1, 2)],
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of this suite (``--out`` and ``--quick`` are shared by every suite)."""
    parser.add_argument("--sweep", action="store_true",
                        help="also time launch configs of the fp8ops kernels (LayerNorm); report the best")
    parser.add_argument("--samples", type=int, default=None,
                        help="timed samples per measurement (default 20, 10 with --quick)")
    probe = parser.add_argument_group("probe mode (replaces the timed comparison)")
    probe.add_argument("--probe", action="store_true",
                       help="time the default and the previous default launch of each norm kernel (LayerNorm and "
                       "RMSNorm), check their outputs against each other, print the results")
    probe.add_argument("--probe-cases", default=None, metavar="CASES",
                       help="comma-separated cases of --probe among fwd,fwd_t,bwd (default: all)")


# ------------------------------------------------------------------------------------------------
# The peers (module-level functions, so torch.compile can trace them).


def eager_fwd(x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
    """LayerNorm (b given) or RMSNorm (b None) with torch's functional ops."""
    K = x.shape[-1]
    if b is None:
        return F.rms_norm(x, (K,), w, EPS)
    return F.layer_norm(x, (K,), w, b, EPS)


def eager_fwd_fp8(x: Tensor, w: Tensor, b: Tensor | None, scale: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Norm, then the FP8 cast with a given scale: ``(q, amax, inv_scale)``."""
    y = eager_fwd(x, w, b)
    q = (y.float() * scale).clamp(-FMAX, FMAX).to(FP8)
    return q, y.abs().amax().float(), scale.reciprocal()


def eager_fwd_fp8_t(x: Tensor, w: Tensor, b: Tensor | None, scale: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Norm, FP8 cast and transposed copy: ``(q, q_t, amax, inv_scale)``."""
    q, amax, inv = eager_fwd_fp8(x, w, b, scale)
    return q, q.t().contiguous(), amax, inv


def formula_bwd(dy: Tensor, x: Tensor, w: Tensor, mean: Tensor | None, rstd: Tensor
                ) -> tuple[Tensor, Tensor, Tensor | None]:
    """The norm backward written with torch ops (fp32 math): ``(dx, dw, db)``."""
    xf = x.float()
    xh = (xf if mean is None else xf - mean[:, None]) * rstd[:, None]
    dyf = dy.float()
    gdy = dyf * w.float()
    c2 = (gdy * xh).mean(dim=1, keepdim=True)
    if mean is None:
        dx = (gdy - xh * c2) * rstd[:, None]
        db = None
    else:
        dx = (gdy - gdy.mean(dim=1, keepdim=True) - xh * c2) * rstd[:, None]
        db = dyf.sum(0).to(w.dtype)
    return dx.to(x.dtype), (dyf * xh).sum(0).to(w.dtype), db


_COMPILED: dict[str, Callable[..., Any]] = {}


def _compiled(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    if name not in _COMPILED:
        _COMPILED[name] = torch.compile(fn, fullgraph=True, dynamic=False)
    return _COMPILED[name]


# ------------------------------------------------------------------------------------------------
# Inputs and references


def _make_inputs(shape: tuple[int, int], rms: bool) -> list[dict[str, Tensor]]:
    M, K = shape

    def make(i: int) -> dict[str, Tensor]:
        g = torch.Generator(device="cuda").manual_seed(4321 + i)
        d = {
            "x": torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=g) * 2 + 0.5,
            "dy": torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=g),
            "w": (1 + 0.1 * torch.randn(K, device="cuda", generator=g)).to(torch.bfloat16),
        }
        d["b"] = None if rms else (0.1 * torch.randn(K, device="cuda", generator=g)).to(torch.bfloat16)
        return d

    return common.input_sets(make, M * K * 2 * 2)


def _reference(d: dict[str, Tensor], rms: bool) -> dict[str, Tensor]:
    """FP32 forward (y32, mean, rstd) and backward of one input set."""
    from fp8ops.reference import norm as R

    x, w, b, dy = d["x"], d["w"], d["b"], d["dy"]
    _, _, _, _, amax, _, mean, rstd = R.norm_fwd(x, None, w, b, EPS, rms, False, False, None, None, 0, False,
                                                  None, False)
    xf = x.float()
    xh = (xf if rms else xf - mean[:, None]) * rstd[:, None]
    y32 = xh * w.float() + (0 if b is None else b.float())
    dx, dw, db = R.norm_bwd(dy, xf, w.float(), mean, rstd, None, rms, False, not rms)
    return {"y32": y32, "amax": amax, "mean": mean, "rstd": rstd, "dx": dx, "dw": dw, "db": db}


def _maxerr(a: Tensor, ref: Tensor) -> float:
    return float((a.float() - ref.float()).abs().max())


def _relerr(a: Tensor, ref: Tensor) -> float:
    return float((a.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30))


# ------------------------------------------------------------------------------------------------
# Implementations: (callable of one input set, checker of its output against the reference)


def _impls(case: str, rms: bool, scale: Tensor, stats: list[tuple[Tensor, Tensor]]
           ) -> dict[str, Callable[[int, dict[str, Tensor]], Any]]:
    import fp8ops.norm as N

    ops = torch.ops.fp8ops
    if case == "fwd":
        fn = _compiled(f"fwd_{rms}", eager_fwd)

        def ours_fwd(i: int, d: dict[str, Tensor]) -> Any:
            return N.rms_norm(d["x"], d["w"], None, eps=EPS) if rms else N.layer_norm(d["x"], d["w"], d["b"], None, eps=EPS)

        return {"fp8ops": ours_fwd,
                "torch eager": lambda i, d: eager_fwd(d["x"], d["w"], d["b"]),
                "torch.compile": lambda i, d: fn(d["x"], d["w"], d["b"])}
    if case in ("fwd_fp8", "fwd_fp8_t"):
        t = case == "fwd_fp8_t"
        peer = eager_fwd_fp8_t if t else eager_fwd_fp8
        fn = _compiled(f"{case}_{rms}", peer)
        return {
            "fp8ops": lambda i, d: ops.norm_fwd(d["x"], None, d["w"], d["b"], EPS, rms, False, False, scale, None,
                                                0, False, FP8, t),
            "torch eager": lambda i, d: peer(d["x"], d["w"], d["b"], scale),
            "torch.compile": lambda i, d: fn(d["x"], d["w"], d["b"], scale),
        }
    if case == "bwd":
        fn = _compiled(f"bwd_{rms}", formula_bwd)

        def ours_bwd(i: int, d: dict[str, Tensor]) -> Any:
            mean, rstd = stats[i]
            return ops.norm_bwd(d["dy"], d["x"], d["w"], mean, rstd, None, rms, False, not rms)

        def compiled_bwd(i: int, d: dict[str, Tensor]) -> Any:
            mean, rstd = stats[i]
            return fn(d["dy"], d["x"], d["w"], None if rms else mean, rstd)

        return {"fp8ops": ours_bwd, "torch eager": _eager_bwd, "torch.compile": compiled_bwd}
    raise ValueError(f"unknown case {case!r}")


_EAGER_STATS: dict[int, tuple[Tensor, ...]] = {}


def _eager_bwd(i: int, d: dict[str, Tensor]) -> Any:
    """The aten backward kernels that autograd runs for F.layer_norm / F.rms_norm, from the
    statistics of the matching aten forward (computed once per input set)."""
    x, w, b, dy = d["x"], d["w"], d["b"], d["dy"]
    K = x.shape[-1]
    aten = torch.ops.aten
    if b is None and x.device.type != "cuda":  # the fused RMSNorm kernels are CUDA-only
        r = torch.rsqrt(x.float().square().mean(dim=1) + EPS)
        return formula_bwd(dy, x, w, None, r)[:2]
    if i not in _EAGER_STATS:
        if b is None:
            _EAGER_STATS[i] = tuple(aten._fused_rms_norm(x, [K], w, EPS)[1:])
        else:
            _EAGER_STATS[i] = tuple(aten.native_layer_norm(x, [K], w, b, EPS)[1:])
    st = _EAGER_STATS[i]
    if b is None:
        return aten._fused_rms_norm_backward(dy, x, [K], st[0], w, [True, True])
    return aten.native_layer_norm_backward(dy, x, [K], st[0], st[1], w, b, [True, True, True])


def _check(case: str, impl: str, out: Any, ref: dict[str, Tensor], peer_err: dict[str, float], scale: Tensor,
           rms: bool) -> tuple[dict[str, Any], list[str]]:
    """Errors of one implementation's output vs the FP32 reference, and failed-check messages
    (only fp8ops's outputs can fail; the peers' errors set the bounds)."""
    info: dict[str, Any] = {}
    bad: list[str] = []
    ours = impl == "fp8ops"
    if case == "fwd":
        e = _maxerr(out, ref["y32"])
        info["y_max_err"] = e
        if not ours:
            peer_err.setdefault("y", e)
        elif e > 2 * peer_err.get("y", e) + 1e-3:
            bad.append(f"y error {e:.3g} > 2 x eager's {peer_err.get('y'):.3g} + 1e-3")
    elif case in ("fwd_fp8", "fwd_fp8_t"):
        q = out[2] if ours else out[0]
        qref = (ref["y32"] * scale).clamp(-FMAX, FMAX).to(FP8)
        mism = int((q.view(torch.uint8) != qref.view(torch.uint8)).sum())
        info["fp8_bytes_differing_from_fp32_reference"] = mism
        frac = mism / q.numel()
        if ours:
            if frac > 1e-3:
                bad.append(f"{mism} FP8 bytes ({100 * frac:.3f} %) differ from the cast of the FP32 reference")
            amax = out[4]
            if abs(float(amax) / float(ref["amax"]) - 1) > 1e-5:
                bad.append(f"amax {float(amax)} != reference {float(ref['amax'])}")
            if case == "fwd_fp8_t" and not torch.equal(out[3].view(torch.uint8), q.t().view(torch.uint8)):
                bad.append("q_t is not the transpose of q")
    elif case == "bwd":
        dx = out[0]
        e = _maxerr(dx, ref["dx"])
        info["dx_max_err"] = e
        info["dw_rel_err"] = _relerr(out[1], ref["dw"])
        if not ours:
            peer_err.setdefault("dx", e)
        else:
            if e > 2 * peer_err.get("dx", e) + 1e-3:
                bad.append(f"dx error {e:.3g} > 2 x eager's {peer_err.get('dx'):.3g} + 1e-3")
            if info["dw_rel_err"] > 1e-2:
                bad.append(f"dweight relative error {info['dw_rel_err']:.3g} > 1e-2")
            if not rms:
                info["db_rel_err"] = _relerr(out[2], ref["db"])
                if info["db_rel_err"] > 1e-2:
                    bad.append(f"dbias relative error {info['db_rel_err']:.3g} > 1e-2")
    return info, bad


def _shape_name(shape: tuple[int, ...]) -> str:
    return "x".join(str(s) for s in shape)


# ------------------------------------------------------------------------------------------------
# Launcher-config sweep


def _sweep(shapes: list[tuple[int, int]], cbw: float, samples: int, progress: common.Progress,
           failed: list[str], out: dict[str, Any], save: Callable[[], Any]) -> None:
    from fp8ops.kernels import norm as kn

    for shape in shapes:
        M, K = shape
        sname = _shape_name(shape)
        sets = _make_inputs(shape, False)
        scale = torch.tensor(448.0 / 8.0, device="cuda")
        stats = []
        for d in sets:
            o = kn.norm_fwd_launch(d["x"], None, d["w"], d["b"], EPS, False, False, False, None, None, 0, False,
                                   None, False)
            stats.append((o[6], o[7]))
        for kernel, space in SWEEP_SPACE.items():
            bpe = {"fwd_fp8": 3, "fwd_fp8_t": 4, "bwd": 6}[kernel]

            def launch(i: int, d: dict[str, Tensor], cfg: dict[str, Any] | None, kernel: str = kernel,
                       stats: list[tuple[Tensor, Tensor]] = stats, scale: Tensor = scale) -> Any:
                if kernel == "bwd":
                    return kn.norm_bwd_launch(d["dy"], d["x"], d["w"], stats[i][0], stats[i][1], None, False, False,
                                              True, config=cfg)
                return kn.norm_fwd_launch(d["x"], None, d["w"], d["b"], EPS, False, False, False, scale, None, 0,
                                          False, FP8, kernel == "fwd_fp8_t", config=cfg)

            ref = launch(0, sets[0], None)
            entries = []
            for cfg in space:
                progress.step(f"sweep {kernel} {sname} {cfg}")
                entry: dict[str, Any] = {"config": cfg}
                try:
                    got = launch(0, sets[0], cfg)
                    if kernel == "bwd":
                        ok = _maxerr(got[0], ref[0]) <= 1e-2 and _relerr(got[1], ref[1]) < 1e-4
                    else:
                        # other block shapes reduce in another order: a few roundings may flip
                        ok = int((got[2].view(torch.uint8) != ref[2].view(torch.uint8)).sum()) <= M * K // 10000
                    entry["correct"] = bool(ok)
                    t = common.time_cuda(lambda i, c=cfg, f=launch, s=sets: f(i, s[i], c), [(i,) for i in range(len(sets))],
                                         samples=samples, on_fallback=progress.note)
                    entry.update(us=t.median_us, tbps=common.tbps(bpe * M * K, t.median_us))
                    entry["pct_copy"] = 100.0 * entry["tbps"] / cbw
                    if not ok:
                        failed.append(f"sweep {kernel} {sname} {cfg}: output differs from the default config's")
                except Exception as exc:  # noqa: BLE001  (an invalid config is a result, not a crash)
                    entry["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                    progress.note(f"config {cfg} failed: {entry['error']}")
                entries.append(entry)
            ok_entries = [e for e in entries if e.get("correct") and "us" in e]
            best = min(ok_entries, key=lambda e: e["us"]) if ok_entries else None
            out.setdefault(kernel, {})[sname] = {"best": best, "all": entries}
            print(f"sweep {kernel} {sname}: best {best}", flush=True)
            save()
        del sets
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------------
# The suite


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the norm suite; print the table; write norm.json and norm.png to ``args.out``.

    ``--probe`` runs :mod:`fp8ops.bench.norm_probe` instead.
    """
    if getattr(args, "probe", False):
        from . import norm_probe

        return norm_probe.run(args)
    t_start = time.perf_counter()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / "norm.json"
    quick = bool(args.quick)
    shapes = QUICK_SHAPES if quick else SHAPES
    samples = getattr(args, "samples", None) or (10 if quick else 20)
    sweep = bool(getattr(args, "sweep", False))
    sweep_total = sum(len(v) for v in SWEEP_SPACE.values()) * len(shapes) if sweep else 0
    progress = common.Progress(2 + len(shapes) * (1 + len(NORMS) * len(CASES) * len(IMPLS)) + sweep_total,
                               prefix="norm ")
    env = common.environment()
    print(f"fp8ops.bench norm | {common.describe_environment(env)}", flush=True)
    record: dict[str, Any] = {
        "suite": "norm",
        "schema": 1,
        "partial": True,
        "env": env,
        "args": {"quick": quick, "sweep": sweep, "samples": samples, "shapes": [list(s) for s in shapes]},
        "method": common.__doc__,
        "cases": {name: {"label": label, "bytes_per_element": b, "bytes": how} for name, label, b, how in CASES},
        "targets_fraction_of_copy": TARGETS,
        "results": [],
        "failed_checks": [],
        "notes": [],
    }
    failed: list[str] = record["failed_checks"]
    notes: list[str] = record["notes"]
    rows: list[dict[str, Any]] = record["results"]

    # Step 1: the memory ceiling.
    progress.step("copy ceiling (device-to-device copy)")
    ceiling = common.copy_bandwidth(2**29 if quick else 2**30, samples=samples)
    record["ceiling"] = {"start": ceiling}
    cbw = ceiling["tbps"]
    print(f"copy ceiling: {cbw:.3f} TB/s", flush=True)
    common.write_json(json_path, record)

    # Step 2: every shape, norm, case and implementation.
    for shape in shapes:
        M, K = shape
        n = M * K
        sname = _shape_name(shape)
        progress.step(f"{sname} copy_ of the bf16 input")
        xs = [torch.randn(M, K, device="cuda", dtype=torch.bfloat16) for _ in range(common.num_buffers(2 * n))]
        dst = torch.empty_like(xs[0])
        t = common.time_cuda(lambda x, dst=dst: dst.copy_(x), [(x,) for x in xs], samples=samples, on_fallback=progress.note)
        bw = common.tbps(4 * n, t.median_us)
        rows.append({"shape": sname, "norm": "-", "case": "copy", "label": "copy_ of the bf16 input (same size)",
                     "impl": "torch copy_", "us": t.median_us, "tbps": bw, "pct_copy": 100.0 * bw / cbw})
        del xs, dst
        for norm in NORMS:
            rms = norm == "RMSNorm"
            sets = _make_inputs(shape, rms)
            refs = [_reference(d, rms) for d in sets[:1]]
            scale = (FMAX / refs[0]["amax"]).to(torch.float32)  # a realistic delayed scale
            stats = [torch.ops.fp8ops.norm_fwd(d["x"], None, d["w"], d["b"], EPS, rms, False, False, None, None, 0,
                                               False, None, False)[6:8] for d in sets]
            _EAGER_STATS.clear()
            for case, label, bpe, _how in CASES:
                peer_err: dict[str, float] = {}
                impls = _impls(case, rms, scale, stats)
                for impl in ("torch eager", "torch.compile", "fp8ops"):  # peers first: they set the bounds
                    fn = impls[impl]
                    progress.step(f"{sname} {norm} {case} {impl}")
                    row: dict[str, Any] = {"shape": sname, "norm": norm, "case": case, "label": label, "impl": impl,
                                           "bytes_per_element": bpe}
                    try:
                        info, bad = _check(case, impl, fn(0, sets[0]), refs[0], peer_err, scale, rms)
                        row.update(info)
                        for b in bad:
                            failed.append(f"{sname} {norm} {case} {impl}: {b}")
                        t = common.time_cuda(lambda i, f=fn, s=sets: f(i, s[i]), [(i,) for i in range(len(sets))],
                                             samples=samples, on_fallback=progress.note)
                        bw = common.tbps(bpe * n, t.median_us)
                        row.update(us=t.median_us, p20_us=t.p20_us, p80_us=t.p80_us, call_us=t.call_us, tbps=bw,
                                   pct_copy=100.0 * bw / cbw, method=t.method, calls=t.calls, buffers=t.buffers)
                    except Exception as exc:  # noqa: BLE001  (recorded as a failed check)
                        row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                        progress.note(f"{sname} {norm} {case} {impl} failed: {row['error']}")
                        notes.append(f"{sname} {norm} {case} {impl}: {row['error']}")
                        if impl == "fp8ops":
                            failed.append(f"{sname} {norm} {case} fp8ops: {row['error']}")
                    rows.append(row)
                    torch.cuda.empty_cache()
                case_rows = [r for r in rows if r["shape"] == sname and r["norm"] == norm and r["case"] == case]
                base = next((r for r in case_rows if r["impl"] == "fp8ops" and "us" in r), None)
                for r in case_rows:
                    if base is not None and "us" in r:
                        r["fp8ops_speedup"] = r["us"] / base["us"]
                if base is not None and case in TARGETS:
                    base["target_fraction"] = TARGETS[case]
                    base["meets_target"] = base["pct_copy"] >= 100 * TARGETS[case]
                common.write_json(json_path, record)
            _EAGER_STATS.clear()
            del sets, refs, stats
            torch.cuda.empty_cache()

    # Step 3: the ceiling again (a drift says the card's state changed mid-run).
    progress.step("copy ceiling again")
    ceiling_end = common.copy_bandwidth_again(cbw, notes, quick=quick, samples=samples)
    record["ceiling"]["end"] = ceiling_end
    print()
    print(common.format_table(rows, [
        ("shape", "shape", ""), ("norm", "norm", ""), ("label", "case", ""), ("impl", "impl", ""),
        ("us", "µs", ".1f"), ("tbps", "TB/s", ".3f"), ("pct_copy", "% copy", ".1f"),
        ("fp8ops_speedup", "fp8ops speedup", ".2f"),
    ]))
    print()
    legend = (
        "µs: median device time per call (CUDA-graph replays, inputs rotated to defeat L2). TB/s counts logical "
        "bytes read + written: " + "; ".join(f"{c}: {h}" for c, _, _, h in CASES) + ". "
        f"% copy: of {cbw:.3f} TB/s measured by a device-to-device copy (again at the end: "
        f"{ceiling_end['tbps']:.3f} TB/s). Targets: FP8-out forward >= 85 %, backward >= 75 % of copy."
    )
    print(textwrap.fill(legend, width=110), flush=True)
    common.write_json(json_path, record)

    # Step 4: the launcher sweep.
    if sweep:
        record["sweep"] = {}
        _sweep(shapes, cbw, max(5, samples // 2), progress, failed, record["sweep"],
               lambda: common.write_json(json_path, record))
    for note in notes:
        print(f"note: {note}")
    record["partial"] = False
    record["elapsed_s"] = time.perf_counter() - t_start
    common.write_json(json_path, record)
    panels = []
    for shape in shapes:
        sname = _shape_name(shape)
        for norm in NORMS:
            series = {
                impl: [next((r.get("pct_copy") for r in rows if r["shape"] == sname and r["norm"] == norm
                             and r["case"] == case and r["impl"] == impl), None) for case, _, _, _ in CASES]
                for impl in IMPLS
            }
            panels.append({"title": f"{norm} bf16 {sname}", "groups": [c for c, _, _, _ in CASES], "series": series})
    png = common.write_bar_chart(
        out_dir / "norm.png", panels,
        title=f"LayerNorm / RMSNorm, % of copy bandwidth ({cbw:.2f} TB/s) | {env['gpu']} | torch {env['torch']} | "
              f"triton {env['triton']}",
        ylabel="% of device-copy bandwidth (logical bytes read + written)",
        hlines=[(100.0, "copy ceiling"), (85.0, "FP8 fwd target 85%"), (75.0, "bwd target 75%")],
    )
    print(f"wrote {json_path}" + (f" and {png}" if png else ""), flush=True)
    return record


def _main() -> int:
    parser = argparse.ArgumentParser(prog="python -m fp8ops.bench.norm", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench_out", metavar="DIR", help="output folder (default: bench_out/)")
    parser.add_argument("--quick", action="store_true", help="one size, fewer iterations (a smoke run)")
    add_arguments(parser)
    args = parser.parse_args()
    reason = common.cuda_unavailable_reason()
    if reason is not None:
        print(f"fp8ops.bench norm: {reason}")
        return 2
    record = run(args)
    for f in record.get("failed_checks") or []:
        print(f"failed: {f}")
    return 1 if record.get("failed_checks") else 0


if __name__ == "__main__":
    raise SystemExit(_main())
