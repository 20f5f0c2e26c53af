"""The distributed benchmark suite (``fp8ops.bench parallel``) checked without GPUs: which variants
a run builds, and the errors for options that leave nothing to run."""

from __future__ import annotations

import argparse
import importlib
import re

import pytest

P = importlib.import_module("fp8ops.bench.parallel")


def _opts(**kw):
    base = {"quick": False, "steps": 10, "no_torchao": False, "no_compile": False, "no_fsdp": False,
            "no_seed": False, "fsdp_batch": None, "fsdp_wrap": "block", "profile": False,
            "overlap": ["c2", "s16+hp", "nf"]}
    base.update(kw)
    return base


def test_variants_by_part_and_fsdp_batch():
    every = P._variants(_opts(), 0, 2, None)
    parts = [part for part, _, _ in every]
    assert parts.count("seed") == 9 and sum(p.startswith("fsdp2") for p in parts) == 12
    fsdp = [name for part, name, _ in every if part == "fsdp2 gpt 2048"]
    assert fsdp == [f"FSDP2 {k}{m}, hidden 2048" for m in ("", " + compile")
                    for k in ("bf16", "FP8, bf16 all-gather", "FP8, FP8 all-gather")]
    eager_only = [name for part, name, _ in P._variants(_opts(no_compile=True), 0, 2, None) if part.startswith("fsdp2")]
    assert len(eager_only) == 6 and not any("compile" in n for n in eager_only)
    overlapped = [name for _, name, _ in every if "overlap" in name]
    assert overlapped == ["fp8ops FP8, TP=2+SP, graph, overlap c2", "fp8ops FP8, TP=2+SP, graph, overlap s16+hp",
                          "fp8ops FP8, TP=2+SP, graph, overlap nf"]
    assert [P._overlap_of(n) for n in ("fp8ops FP8, TP=2+SP, graph", *overlapped)] == [
        (1, 0, False, True), (2, 0, False, True), (1, 16, True, True), (1, 0, False, False)]
    assert P._overlap_of("x, overlap c4+s32+nf") == (4, 32, False, False)
    assert sum(part == "seed" for part, _, _ in P._variants(_opts(overlap=[]), 0, 2, None)) == 6
    fsdp_only = P._variants(_opts(no_seed=True), 0, 2, None)
    assert [name for _, name, _ in fsdp_only] == [name for part, name, _ in every if part != "seed"]
    seed_only = P._variants(_opts(no_fsdp=True, no_torchao=True), 0, 2, None)
    assert {part for part, _, _ in seed_only} == {"seed"} and len(seed_only) == 8
    assert [g["batch"] for g in P._gpts(_opts())] == [4, 4]
    assert [g["batch"] for g in P._gpts(_opts(fsdp_batch=8))] == [8, 8]
    assert [g["hidden"] for g in P._gpts(_opts(fsdp_batch=8))] == [2048, 4096]
    assert P.GPTS[0]["batch"] == 4  # the defaults are not modified


def test_options_that_leave_nothing_or_no_batch_raise():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="x")
    parser.add_argument("--quick", action="store_true")
    P.add_arguments(parser)
    with pytest.raises(ValueError, match="--no-seed and --no-fsdp"):
        P.run(parser.parse_args(["--no-seed", "--no-fsdp"]))
    with pytest.raises(ValueError, match="--fsdp-batch must be a positive"):
        P.run(parser.parse_args(["--fsdp-batch", "0"]))
    with pytest.raises(ValueError, match=r"--overlap 'c1\+nf'.*got 'c1'"):
        P.run(parser.parse_args(["--row-chunks", "2", "1"]))  # --row-chunks N: --overlap c<N>+nf
    for bad, part in (("c1", "c1"), ("s0+hp", "s0"), ("c2+x", "x"), ("hp+", "")):
        with pytest.raises(ValueError, match=rf"--overlap '{re.escape(bad)}'.*c<N> .*N >= 2.*s<N>.*got '{part}'"):
            P.run(parser.parse_args(["--overlap", "c2", bad]))


def test_overlap_none_or_no_spec_times_no_overlap_variant():
    parser = argparse.ArgumentParser()
    P.add_arguments(parser)
    assert P.overlap_specs(parser.parse_args([])) == list(P.OVERLAP_DEFAULT)
    assert P.overlap_specs(parser.parse_args(["--overlap", "none"])) == []
    assert P.overlap_specs(parser.parse_args(["--overlap"])) == []
    assert P.overlap_specs(parser.parse_args(["--overlap", "none", "--row-chunks", "2"])) == ["c2+nf"]
    with pytest.raises(ValueError, match=r"--overlap none .*takes no other SPEC, got 'none c2'"):
        P.overlap_specs(parser.parse_args(["--overlap", "none", "c2"]))


def test_ratios_use_the_default_variant_and_report_overlaps():
    """The targets' ratios come from the default TP variants; each overlap variant is reported
    against the default graph step."""
    rows = [{"variant": v, "part": "seed", "ms": ms, "comm_bytes": {}} for v, ms in [
        ("fp8ops FP8, 1 GPU, graph", 13.0), ("fp8ops FP8, TP=2+SP, graph", 8.0),
        ("fp8ops FP8, TP=2+SP, graph, overlap c2+s16", 6.0), ("torch bf16, DTensor TP=2+SP + compile", 12.0)]]
    rows += [{"variant": v, "part": "fsdp2 gpt 2048", "ms": ms, "comm_bytes": {"all_gather": b}} for v, ms, b in [
        ("FSDP2 bf16, hidden 2048", 30.0, 4.0), ("FSDP2 FP8, bf16 all-gather, hidden 2048", 60.0, 4.0),
        ("FSDP2 FP8, FP8 all-gather, hidden 2048", 70.0, 2.0), ("FSDP2 bf16 + compile, hidden 2048", 20.0, 4.0),
        ("FSDP2 FP8, FP8 all-gather + compile, hidden 2048", 25.0, 2.0)]]
    r = P._ratios(rows)
    assert r["tp_over_1gpu"] == pytest.approx(8.0 / 13.0) and r["vs_bf16_tp"] == pytest.approx(1.5)
    assert r["overlap_c2+s16_over_default"] == pytest.approx(0.75)
    # FSDP2: each in its fastest mode (compiled here); bytes of the eager variants
    assert r["fsdp_fp8_over_bf16_ms_h2048"] == pytest.approx(25.0 / 20.0)
    assert r["fsdp_all_gather_bytes_fp8_over_bf16_h2048"] == pytest.approx(0.5)


def test_collective_bytes_count_functional_c10d_and_pipelined_ops():
    """Bytes per step by kind: a functional collective's input; a c10d op inside a functional one
    counted once; the pipelined all-gather GEMM's FP8 rows, the pipelined reduce-scatter's (M, N)
    partial sums as bf16."""
    from types import SimpleNamespace as NS

    def ev(name, shapes, dtypes, start, dur, thread=1):
        return NS(name=lambda: name, shapes=lambda: shapes, dtypes=lambda: dtypes, start_thread_id=lambda: thread,
                  start_ns=lambda: start, duration_ns=lambda: dur)

    events = [
        ev("_c10d_functional::all_gather_into_tensor", [[1024, 4096], []], ["unsigned char", ""], 0, 100),
        ev("c10d::_allgather_base_", [[2048, 4096], [1024, 4096]], ["unsigned char", "unsigned char"], 10, 50),
        ev("c10d::_reduce_scatter_base_", [[512, 64], [1024, 64]], ["float", "float"], 200, 10),
        ev("symm_mem::fused_all_gather_scaled_matmul", [[1024, 4096], [4096, 6144]],
           ["c10::Float8_e4m3fn", "c10::Float8_e4m3fn"], 300, 10),
        ev("symm_mem::fused_scaled_matmul_reduce_scatter", [[2048, 2048], [2048, 4096]],
           ["c10::Float8_e4m3fn", "c10::Float8_e4m3fn"], 400, 10),
        ev("aten::mm", [[4, 4]], ["float"], 500, 1),
    ]
    prof = NS(profiler=NS(kineto_results=NS(events=lambda: events)))
    got = P._collective_bytes(prof, 2)
    assert got == {"all_gather": (1024 * 4096 + 1024 * 4096) / 2, "reduce_scatter": (1024 * 64 * 4 + 2048 * 4096 * 2) / 2}


def _run_one_rank(script: str, timeout: int) -> str:
    """The stdout of ``script`` run as one gloo rank in a process of its own (no GPU), given a free port."""
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    out = subprocess.run([sys.executable, "-c", script, port], capture_output=True, text=True, timeout=timeout,
                         env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


_WRAP_SCRIPT = """
import os, sys, warnings
import torch.distributed as dist
warnings.filterwarnings("ignore")
os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", sys.argv[1]
dist.init_process_group("gloo", rank=0, world_size=1)
from torch.distributed.fsdp import FSDPModule
from fp8ops.bench.parallel import _fsdp_gpt
size = {"layers": 2, "hidden": 32, "heads": 2, "seq": 8, "batch": 2, "vocab": 64}
for wrap in ("block", "linear"):
    step, _, batch = _fsdp_gpt(size, 0, 1, "FP8, FP8 all-gather", device="cpu", wrap=wrap)
    groups = sorted(n for n, m in step.model.named_modules() if isinstance(m, FSDPModule))
    _, loss = step(None, *batch)
    print(wrap, groups, bool(loss.isfinite()))
dist.destroy_process_group()
"""


def test_fsdp_gpt_wraps_each_block_or_each_linear():
    """The FSDP2 GPT's groups: each transformer block then the root (default), or each Linear then
    the root (``--fsdp-wrap linear``); one FP8 all-gather step runs on the CPU with gloo."""
    lines = dict(line.split(" ", 1) for line in _run_one_rank(_WRAP_SCRIPT, 300).strip().splitlines())
    blocks = "['', 'blocks.0', 'blocks.1'] True"
    linears = [f"blocks.{i}.{n}" for i in range(2) for n in ("fc1", "fc2", "proj", "qkv")]
    assert lines == {"block": blocks, "linear": f"{sorted(['', *linears])} True"}
    with pytest.raises(ValueError, match="the FSDP2 wrap must be 'block' or 'linear', got 'layer'"):
        P._fsdp_gpt({}, 0, 1, "bf16", device="cpu", wrap="layer")


_COMPILE_SCRIPT = """
import os, sys, warnings
import torch, torch.distributed as dist
warnings.filterwarnings("ignore")
os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", sys.argv[1]
dist.init_process_group("gloo", rank=0, world_size=1)
from fp8ops.bench.parallel import _fsdp_gpt
size = {"layers": 2, "hidden": 64, "heads": 2, "seq": 16, "batch": 2, "vocab": 64}
from torch._dynamo.utils import counters
for kind in ("bf16", "FP8, bf16 all-gather", "FP8, FP8 all-gather"):
    runs = []
    for backend in (None, "aot_eager"):
        torch._dynamo.reset()
        counters.clear()
        step, _, batch = _fsdp_gpt(size, 0, 1, kind, device="cpu", compile_backend=backend)
        losses = [float(step(None, *batch)[1]) for _ in range(3)]
        runs.append((losses, [p.full_tensor().clone() for p in step.model.parameters()]))
    same = runs[0][0] == runs[1][0] and all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))
    print(kind, "same" if same else "differ", runs[0][0][0] > runs[0][0][-1], "breaks",
          sum(counters["graph_break"].values()))
torch._dynamo.reset()
step, _, batch = _fsdp_gpt(size, 0, 1, "FP8, FP8 all-gather", device="cpu")
eager = [float(step(None, *batch)[1]) for _ in range(2)]
torch._dynamo.reset()
step, _, batch = _fsdp_gpt(size, 0, 1, "FP8, FP8 all-gather", device="cpu")
for block in step.model.blocks:
    block.compile(fullgraph=True, backend="aot_eager")
print("fullgraph", "same" if [float(step(None, *batch)[1]) for _ in range(2)] == eager else "differ")
dist.destroy_process_group()
"""


def test_fsdp_gpt_compiled_blocks_train_as_eager():
    """Each FSDP2 block compiled (``compile_backend``, aot_eager on CPU): three training steps give the
    eager losses and parameters bit for bit for bf16, FP8 with bf16 all-gathers and FP8 all-gather
    (the fp8ops.nn modules traced whole, taking probes made ahead; with FP8 all-gathers, over the
    unsharded weight's inner tensors), with no graph break; blocks compiled with ``fullgraph=True``
    over FP8-gathered weights train as eager too."""
    out = _run_one_rank(_COMPILE_SCRIPT, 600)
    assert out.strip().splitlines() == [
        "bf16 same True breaks 0", "FP8, bf16 all-gather same True breaks 0", "FP8, FP8 all-gather same True breaks 0",
        "fullgraph same"], out
