"""Which ``fp8ops.attention`` forward+backward calls of the bench variants can be captured in a CUDA
graph, and whether a call leaves objects in reference cycles (an autograd graph kept alive until
the garbage collector runs: its AccumulateGrad nodes, made on the stream of their call, make a
later backward on another stream wait on that one, which ends a capture).

For each variant, on fresh leaves (B = 2, H = 8, S = 2048, d = 128, bf16): two eager calls on the
default stream, the number of objects the collector then finds in cycles, then a capture of one call
(``torch.cuda.graph``), first without and then after ``gc.collect()``. Prints one JSON line per
variant (and writes them to ``--json``).

Usage: python scripts/attn_capture_probe.py [--json OUT.json]
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import warnings

import torch


def probe(variant: str) -> dict:
    B = importlib.import_module("fp8ops.bench.attention")
    S, H, D = 2048, 8, 128
    docs = B._documents(S, seed=S) if variant == "document" else None
    fn = B._fp8ops_fn(variant, S, H, docs)
    q, k, v, do = (torch.randn(2, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))

    def step() -> None:
        torch.autograd.grad(fn(q, k, v), (q, k, v), do)

    rec: dict = {"variant": variant}
    gc.collect()
    gc.disable()
    try:
        for _ in range(2):
            step()
        torch.cuda.synchronize()
        gc.set_debug(gc.DEBUG_SAVEALL)
        rec["cyclic_objects"] = gc.collect()
        kinds: dict[str, int] = {}
        for o in gc.garbage:
            kinds[type(o).__name__] = kinds.get(type(o).__name__, 0) + 1
        rec["cyclic_kinds"] = dict(sorted(kinds.items(), key=lambda kv: -kv[1])[:8])
        gc.garbage.clear()
        gc.set_debug(0)
        for collect in (False, True):
            step()  # leaves another call's objects behind, as a bench's warm-up does
            if collect:
                gc.collect()
            key = "capture_after_gc" if collect else "capture"
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g):
                        step()
                    g.replay()
                    torch.cuda.synchronize()
                    rec[key] = "ok"
                except Exception as exc:  # noqa: BLE001
                    rec[key] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
                    torch.cuda.synchronize()
            rec[key + "_warnings"] = sorted({str(w.message)[:80] for w in caught})
    finally:
        gc.enable()
    return rec


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default=None)
    p.add_argument("--variants", nargs="+", default=["none", "causal", "alibi", "softcap", "sliding_window", "document"])
    args = p.parse_args()
    out = []
    for v in args.variants:
        try:
            rec = probe(v)
        except Exception as exc:  # noqa: BLE001
            rec = {"variant": v, "error": f"{type(exc).__name__}: {str(exc)[:200]}"}
        print(json.dumps(rec), flush=True)
        out.append(rec)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": out}, f, indent=1)


if __name__ == "__main__":
    main()
