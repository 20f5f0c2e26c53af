"""The spread of single CUDA-graph replays of the attention forward: the bench's document case (and
causal as a control), fp8ops against compiled FlexAttention, each replay timed by itself with CUDA
events, back to back and with a synchronisation between replays, with the SM clock (NVML) sampled
along the way. One GPU, B = 8, H = 32, S = 8192, d = 128, bf16, inputs that require gradients (as
``python -m fp8ops.bench attention`` times its forward). Prints quantiles (and a coarse histogram)
per case and writes ``$OUT/attention_fwd_replay_spread.json`` (or ./) with every replay's time.

    python scripts/attn_fwd_replay_spread.py [--replays N] [--rest S]

``--rest S``: only fp8ops's document forward, replayed back to back, then again after S seconds idle.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from fp8ops.bench.attention import _documents, _flex_fn, _fp8ops_fn
from fp8ops.bench.common import capture_graph


def _clock() -> int | None:
    try:
        return int(torch.cuda.clock_rate())
    except Exception:  # no NVML
        return None


def spread(fn, args, replays: int, sync_between: bool) -> dict:
    graph = capture_graph(lambda: fn(*args), lambda: fn(*args))
    for _ in range(10):
        graph.replay()
    torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(replays)]
    clocks = []
    for i, (a, b) in enumerate(ev):
        a.record()
        graph.replay()
        b.record()
        if sync_between:
            torch.cuda.synchronize()
        if i % 20 == 0:
            clocks.append(_clock())
    torch.cuda.synchronize()
    ms = [a.elapsed_time(b) for a, b in ev]
    del graph
    s = sorted(ms)
    q = {f"p{p}": s[min(len(s) - 1, int(p / 100 * len(s)))] for p in (0, 10, 20, 50, 80, 90, 100)}
    return {"quantiles_ms": q, "replay_ms": ms, "sm_clock_mhz": clocks}


def rest_and_repeat(replays: int, rest_s: float) -> dict:
    """The document forward of fp8ops replayed back to back, then after ``rest_s`` seconds idle,
    again: whether a slower steady state recovers with rest (per-replay ms of both runs)."""
    import time

    B, H, S, d = 8, 32, 8192, 128
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, S, d, device="cuda", dtype=torch.bfloat16).requires_grad_() for _ in range(3))
    fn = _fp8ops_fn("document", S, H, _documents(S, seed=S))
    graph = capture_graph(lambda: fn(q, k, v), lambda: fn(q, k, v))
    runs = []
    for _ in range(2):
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(replays)]
        for a, b in ev:
            a.record()
            graph.replay()
            b.record()
        torch.cuda.synchronize()
        runs.append([a.elapsed_time(b) for a, b in ev])
        print("run", " ".join(f"{x:.2f}" for x in runs[-1][::max(1, replays // 40)]), flush=True)
        time.sleep(rest_s)
    return {"rest_s": rest_s, "runs_ms": runs}


def main(replays: int) -> dict:
    B, H, S, d = 8, 32, 8192, 128
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, S, d, device="cuda", dtype=torch.bfloat16).requires_grad_() for _ in range(3))
    docs = _documents(S, seed=S)
    res: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cases": {}}
    for variant in ("document", "causal"):
        fns = {"fp8ops": _fp8ops_fn(variant, S, H, docs if variant == "document" else None),
               "Flex (compiled)": _flex_fn(variant, S, H, docs if variant == "document" else None, gqa=False)}
        for name, fn in fns.items():
            for sync_between in (False, True):
                key = f"{variant} {name} {'sync' if sync_between else 'back-to-back'}"
                r = res["cases"][key] = spread(fn, (q, k, v), replays, sync_between)
                qs = r["quantiles_ms"]
                lo, hi = qs["p0"], qs["p100"]
                bins = [0] * 10
                for x in r["replay_ms"]:
                    bins[min(9, int((x - lo) / max(hi - lo, 1e-9) * 10))] += 1
                print(f"{key:<40}", " ".join(f"{k}={v:.3f}" for k, v in qs.items()), "hist", bins,
                      "clock", r["sm_clock_mhz"][:3], flush=True)
    return res


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--replays", type=int, default=200)
    p.add_argument("--rest", type=float, default=None, metavar="S",
                   help="only the fp8ops document forward: replays, S seconds idle, replays again")
    a = p.parse_args()
    record = rest_and_repeat(a.replays, a.rest) if a.rest is not None else main(a.replays)
    path = os.path.join(os.environ.get("OUT", "."), "attention_fwd_replay_spread.json")
    with open(path, "w") as f:
        json.dump(record, f)
    print("wrote", path)
