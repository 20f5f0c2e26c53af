"""Command line of the benchmark suites: ``python -m fp8ops.bench <suite> [--out DIR] [--quick]``.

``python -m fp8ops.bench report RESULTS_DIR [--docs DIR]`` writes the pages of ``docs/benchmarks/``
from a run's JSON records (no GPU needed; see :mod:`fp8ops.bench.report`).

Exit status: 0 on success; 1 if a suite reported a failed check (for example an output that
differs from its peer's) or cannot be imported; 2 if no CUDA device is available (the benchmarks
time GPU kernels).
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
from collections.abc import Sequence

from . import SUITES
from .common import cuda_unavailable_reason


def build_parser() -> argparse.ArgumentParser:
    """The argument parser: one sub-command per suite, sharing ``--out`` and ``--quick``."""
    parser = argparse.ArgumentParser(
        prog="python -m fp8ops.bench",
        description="Benchmark fp8ops against torch eager, torch.compile and measured ceilings "
        "(needs a CUDA GPU). Prints a table, writes <suite>.json and <suite>.png into --out.",
    )
    shared = argparse.ArgumentParser(add_help=False)
    shared.add_argument("--out", default="bench_out", metavar="DIR", help="output folder (default: bench_out/)")
    shared.add_argument("--quick", action="store_true", help="fewer sizes and iterations (a smoke run)")
    sub = parser.add_subparsers(dest="suite", metavar="<suite>", required=True)
    for name, module_name in SUITES.items():
        try:
            module = importlib.import_module(module_name)
        except Exception as exc:  # one broken suite must not take the others down
            p = sub.add_parser(name, parents=[shared], help=f"(cannot be imported: {type(exc).__name__}: {exc})")
            p.set_defaults(import_error=f"{module_name}: {type(exc).__name__}: {exc}")
            continue
        # the docstring's first sentence, which may wrap over several lines
        summary = " ".join((module.__doc__ or name).strip().split("\n\n")[0].split())
        summary = re.sub(r":\w+:`([^`]+)`", r"\1", summary).replace("``", "")  # plain text: no reST roles
        p = sub.add_parser(name, parents=[shared], help=summary, description=summary)
        module.add_arguments(p)
    from . import report

    p = sub.add_parser("report", help="write docs/benchmarks/<suite>.md pages from a run's JSON records (no GPU)",
                       description="For every <suite>.json in RESULTS_DIR: copy it and its <suite>.png into "
                       "--docs and write <suite>.md there (a table of its rows, the environment, notes and "
                       "failed checks). Overwrites that page, hand-written analysis included.")
    report.add_arguments(p)
    p.set_defaults(report=True)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv``, refuse cleanly without CUDA, run the suite; return the exit status."""
    args = build_parser().parse_args(argv)
    if getattr(args, "report", False):
        from . import report

        return report.main(args)
    if getattr(args, "import_error", None):
        print(f"fp8ops.bench: suite {args.suite!r} cannot be imported: {args.import_error}", file=sys.stderr)
        return 1
    reason = cuda_unavailable_reason()
    if reason is not None:
        print(f"fp8ops.bench: cannot run suite {args.suite!r}: {reason}", file=sys.stderr)
        return 2
    module = importlib.import_module(SUITES[args.suite])
    record = module.run(args)
    failed = record.get("failed_checks") or []
    if failed:
        print(f"fp8ops.bench: {len(failed)} check(s) failed:", file=sys.stderr)
        for f in failed:
            print(f"  - {f}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
