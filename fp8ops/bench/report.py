"""``python -m fp8ops.bench report RESULTS_DIR [--docs DIR]``: benchmark pages from JSON records.

For every ``<suite>.json`` in RESULTS_DIR (what ``python -m fp8ops.bench`` wrote on the GPU machine)
this copies the JSON and the ``<suite>.png`` beside it into ``--docs`` (default
``docs/benchmarks``) and writes ``<suite>.md`` there: a table of the rows, the environment, the
notes and failed checks. Every number on a generated page comes from the JSON. It overwrites the
``<suite>.md`` of each JSON it finds, hand-written analysis included: run it on a folder that holds
only the suites to regenerate, then restore any prose with git. Needs no GPU.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any

__all__ = ["add_arguments", "main", "render", "write_pages"]

# Preferred columns per suite (others are listed in the JSON only).
COLUMNS: dict[str, list[tuple[str, str, str]]] = {
    "quantize": [("shape", "shape", "s"), ("label", "case", "s"), ("impl", "implementation", "s"),
                 ("us", "µs", ".1f"), ("tbps", "TB/s", ".2f"), ("pct_copy", "% of copy", ".1f")],
    "linear": [("shape", "M x K -> N", "s"), ("impl", "implementation", "s"), ("fwd_us", "fwd µs", ".0f"),
               ("fwd_tflops", "fwd TFLOP/s", ".0f"), ("fwd_bwd_us", "fwd+bwd µs", ".0f"),
               ("fwd_bwd_tflops", "fwd+bwd TFLOP/s", ".0f"), ("vs_gemms", "/ 3 GEMMs", ".3f"),
               ("fwd_bwd_graph_us", "graph µs", ".0f"), ("graph_vs_gemms", "graph / 3 GEMMs", ".3f"),
               ("speedup_vs_torchao_tw", "× vs torchao tw", ".2f")],
}


def _fmt(v: Any, spec: str) -> str:
    if v is None:
        return "–"
    if spec == "s" or not isinstance(v, (int, float)):
        return str(v)
    return format(v, spec)


def _table(rows: list[dict[str, Any]], cols: list[tuple[str, str, str]]) -> str:
    cols = [c for c in cols if any(c[0] in r for r in rows)]
    head = "| " + " | ".join(c[1] for c in cols) + " |"
    sep = "| " + " | ".join("---" for _ in cols) + " |"
    body = ["| " + " | ".join(_fmt(r.get(k), f) for k, _, f in cols) + " |" for r in rows]
    return "\n".join([head, sep, *body])


def _auto_columns(rows: list[dict[str, Any]]) -> list[tuple[str, str, str]]:
    keys: list[str] = []
    for r in rows:
        for k, v in r.items():
            if k not in keys and isinstance(v, (str, int, float)) and not isinstance(v, bool):
                keys.append(k)
    return [(k, k, ".3g" if any(isinstance(r.get(k), float) for r in rows) else "s") for k in keys[:12]]


def _env_line(env: dict[str, Any]) -> str:
    keys = ("gpu", "torch", "triton", "cuda", "nvidia_smi", "date_utc")
    return "; ".join(f"{k}: {env[k]}" for k in keys if env.get(k))


def render(name: str, record: dict[str, Any], png: Path | None) -> str:
    rows = record.get("rows") or record.get("results") or []
    env = record.get("environment") or record.get("env") or {}
    from . import SUITES

    command = f"python -m fp8ops.bench {name}" if name in SUITES else f"python -m fp8ops.bench.{name}"
    lines = [f"# Benchmark: {name}", "", f"Measured with `{command}`. Environment: {_env_line(env)}.", ""]
    doc = record.get("description")
    if doc:
        lines += [doc, ""]
    ceiling = record.get("ceiling")
    if isinstance(ceiling, dict):
        for k, c in ceiling.items():
            if isinstance(c, dict) and "tbps" in c:
                lines.append(f"- Copy ceiling ({k}): {c['tbps']:.2f} TB/s, {c.get('what', '')}")
        lines.append("")
    if rows:
        lines += [_table(rows, COLUMNS.get(name) or _auto_columns(rows)), ""]
    for note in record.get("notes") or []:
        lines.append(f"- {note}")
    for f in record.get("failed_checks") or []:
        lines.append(f"- failed: {f}")
    if png is not None:
        lines += ["", f"![{name}]({png.name})"]
    lines += ["", f"Raw numbers: [{name}.json]({name}.json)."]
    return "\n".join(lines) + "\n"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``python -m fp8ops.bench report``."""
    parser.add_argument("results", metavar="RESULTS_DIR", help="folder with the <suite>.json (and .png) of a run")
    parser.add_argument("--docs", default="docs/benchmarks", metavar="DIR",
                        help="where the pages, JSON and plots go (default: docs/benchmarks)")


def write_pages(src: Path, dst: Path) -> list[Path]:
    """Copy each ``<suite>.json`` / ``.png`` of ``src`` into ``dst`` and write ``<suite>.md``; return the pages."""
    dst.mkdir(parents=True, exist_ok=True)
    pages = []
    for js in sorted(src.glob("*.json")):
        name = js.stem
        record = json.loads(js.read_text())
        shutil.copyfile(js, dst / js.name)
        png = src / f"{name}.png"
        if png.exists():
            shutil.copyfile(png, dst / png.name)
        (dst / f"{name}.md").write_text(render(name, record, dst / png.name if png.exists() else None))
        print(f"wrote {dst / (name + '.md')}")
        pages.append(dst / f"{name}.md")
    return pages


def main(args: argparse.Namespace) -> int:
    """Write the pages; exit status 1 if RESULTS_DIR holds no JSON record."""
    src = Path(args.results)
    if not src.is_dir():
        print(f"fp8ops.bench report: {src} is not a folder", file=sys.stderr)
        return 1
    if not write_pages(src, Path(args.docs)):
        print(f"fp8ops.bench report: no <suite>.json in {src}", file=sys.stderr)
        return 1
    return 0
