"""Benchmarks of fp8ops against the peers a user would pick instead, and against measured ceilings.

Run a suite from the command line::

    python -m fp8ops.bench quantize [--out DIR] [--quick] [--sweep]

Each suite prints a table, writes ``<suite>.json`` (every number, the environment, the ceilings) and
``<suite>.png`` (a bar chart) into ``--out`` (default ``bench_out/``), and reports progress on
stderr. Timings are medians of many CUDA-event-timed iterations after warm-up, on random data,
rotating among input buffers so that the L2 cache does not serve the reads; memory-bound results
are reported as a fraction of the measured device-copy bandwidth. See ``docs/benchmarks/``.

A suite is a module ``fp8ops.bench.<name>`` listed in :data:`SUITES` that defines
``add_arguments(parser)`` (suite-specific options) and ``run(args) -> dict`` (the JSON record).
"""

from __future__ import annotations

__all__ = ["SUITES"]

SUITES: dict[str, str] = {
    "quantize": "fp8ops.bench.quantize",
    "linear": "fp8ops.bench.linear",
    "attention": "fp8ops.bench.attention",
    "norm": "fp8ops.bench.norm",
    "mlp": "fp8ops.bench.mlp",
    "layer": "fp8ops.bench.layer",
    "host": "fp8ops.bench.host",
    "step": "fp8ops.bench.step",
    "gpt": "fp8ops.bench.gpt",
    "parallel": "fp8ops.bench.parallel",
}
"""Suite name -> module implementing it (``add_arguments(parser)`` and ``run(args)``)."""
