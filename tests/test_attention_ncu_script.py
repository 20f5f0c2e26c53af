"""scripts/attn_ncu.py's summary of an Nsight Compute CSV (the GPU part, profiling, needs ncu)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEAD = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size",'
        '"Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"\n')


def _script():
    spec = importlib.util.spec_from_file_location("attn_ncu", ROOT / "scripts" / "attn_ncu.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _row(i, kernel, metric, unit, value):
    return f'"{i}","1","python3","h","{kernel}","1","7","(384, 1, 1)","(132, 1, 1)","0","9.0","S","{metric}","{unit}","{value}"\n'


def test_summary_converts_durations_and_orders_stalls(tmp_path, capsys):
    csv = tmp_path / "ncu.csv"
    csv.write_text(
        "==PROF== Connected to process 1\n" + HEAD
        + _row(0, "_hopper_bwd_kernel", "Duration", "usecond", "5,479.5")
        + _row(0, "_hopper_bwd_kernel", "Compute (SM) Throughput", "%", "61.2")
        + _row(0, "_hopper_bwd_kernel", "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active",
               "%", "55.0")
        # two sections name a "Memory Throughput": the speed-of-light percentage is the one kept
        + _row(0, "_hopper_bwd_kernel", "Memory Throughput", "%", "80.5")
        + _row(0, "_hopper_bwd_kernel", "Memory Throughput", "byte/s", "1,142,474,654,926.23")
        + _row(0, "_hopper_bwd_kernel", "Local Memory Spilling Requests", "", "75,133,952")
        + _row(0, "_hopper_bwd_kernel", "smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio", "", "0.5")
        + _row(0, "_hopper_bwd_kernel", "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio",
               "", "1,234.5")
        + _row(1, "fill", "Duration", "nsecond", "324100"))
    _script().summarize(str(csv))
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 3, out
    assert "_hopper_bwd_kernel" in out[0] and "ms 5.479" in out[0] and "SM % 61.2" in out[0], out[0]
    assert "tensor pipe % 55.0" in out[0] and "mem % 80.5," in out[0], out[0]
    assert "spill requests 75,133,952" in out[0], out[0]
    assert out[1].split(": ")[1] == "long_scoreboard 1234.50; barrier 0.50", out[1]
    assert "fill" in out[2] and "ms 0.324" in out[2], out[2]
