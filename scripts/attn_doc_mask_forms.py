"""What evaluating the document mask costs the attention kernels: the bench's document case (eight
documents of random lengths packed in each sequence, causal inside each) with the same block mask and
mask_mods that are the same function of (q, kv) for ids that never decrease:

- ``ids``: ``causal & document_mask(ids)``, the library's mask (int64 ids): for ids that never decrease
  its kernel twin reads the runs of equal ids derived from the ids at each call, one bound per tile
  row (``kv >= start[q]`` where queries run along the rows, ``q < end[kv]`` where keys do);
- ``ids_compare``: q >= kv and ids[q] == ids[kv] written as a user's mask_mod (what the library's twin
  did before: a load per query position and one per key position, made per score in the sm_90 code);
- ``start_by_q``: q >= kv and kv >= start[q] (start: the first position of q's document; loads by
  query position only);
- ``end_by_kv``: q >= kv and q < end[kv] (end: one past the last position of kv's document; loads by
  key position only);
- ``bound_causal_only``: q >= kv alone, with the document mask's block lists (not the same function:
  its outputs differ; the cost of the partial tiles with no load, a bound);
- ``flex_ids``: compiled FlexAttention with the bench's mask.

The forward holds a query tile's rows in each thread's registers and spreads the keys over the
columns, the backward the other way round, so the forms differ in how many loads each kernel makes
per score tile. One GPU, B = 8, H = 32, S = 8192, d = 128, bf16, the public op with
``backend="triton"``: forward and forward+backward ms of CUDA-graph replays (median of ten timings
of five replays after 60 replays; two rounds with the forms alternated) and each form's largest
difference from ``ids``'s output and gradients; then the library's mask and Flex's with replays
taken in turns (``_paired``). Writes ``$OUT/attention_doc_mask_forms.json`` (or ./).

    python scripts/attn_doc_mask_forms.py [FORM ...]   (default: every form; ``ids`` is always in)
"""

from __future__ import annotations

import json
import os
import sys

import attrs
import torch

import fp8ops
from fp8ops.attention.mod_math import modmath
from fp8ops.bench.attention import _documents, _flex_fn
from fp8ops.bench.common import capture_graph

A = fp8ops


def forms(ids: torch.Tensor) -> dict:
    S = ids.shape[0]
    pos = torch.arange(S, device=ids.device)
    first = torch.zeros(int(ids.max()) + 1, dtype=torch.int64, device=ids.device).scatter_reduce(
        0, ids, pos, "amin", include_self=False)
    last = torch.zeros_like(first).scatter_reduce(0, ids, pos, "amax", include_self=False)
    start, end = first[ids].to(torch.int32), (last[ids] + 1).to(torch.int32)

    def start_by_q(b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
        return (q_idx >= kv_idx) & (kv_idx >= modmath.load(start, q_idx))

    def end_by_kv(b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
        return (q_idx >= kv_idx) & (q_idx < modmath.load(end, kv_idx))

    def ids_compare(b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
        return (q_idx >= kv_idx) & (modmath.load(ids, q_idx) == modmath.load(ids, kv_idx))

    return {"ids": A.and_masks(A.causal_mask(), A.document_mask(ids)), "ids_compare": A.MaskMod(ids_compare),
            "start_by_q": A.MaskMod(start_by_q), "end_by_kv": A.MaskMod(end_by_kv),
            # not the same function: with the document mask's block lists, the cost of no load at all
            "bound_causal_only": A.causal_mask()}


def _replay_ms(body) -> float:
    """Median of ten timings of five CUDA-graph replays of ``body`` (ms per replay), after 60
    replays: the steady state (``scripts/attn_fwd_replay_spread.py``: the first few dozen replays
    after the GPU idled run faster)."""
    graph = capture_graph(body, body)
    for _ in range(60):
        graph.replay()
    times = []
    for _ in range(10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(5):
            graph.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 5)
    del graph
    return sorted(times)[5]


def _paired(bodies: dict, rounds: int = 30) -> dict:
    """Replays of two graphs taken in turns (five of one, five of the other, the order swapped every
    round, after 60 replays of each): per-round ms of each and the median of the per-round ratios
    (second / first), which a drift of the GPU's speed over the run (clocks, temperature, the fast
    replays after an idle GPU) shifts for both alike."""
    graphs = {name: capture_graph(body, body) for name, body in bodies.items()}
    for g in graphs.values():
        for _ in range(60):
            g.replay()
    names = list(graphs)
    ms: dict = {n: [] for n in names}
    for r in range(rounds):
        for n in (names if r % 2 == 0 else names[::-1]):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(5):
                graphs[n].replay()
            b.record()
            torch.cuda.synchronize()
            ms[n].append(a.elapsed_time(b) / 5)
    del graphs
    ratios = sorted(y / x for x, y in zip(ms[names[0]], ms[names[1]]))
    return {"ms": ms, "median_ms": {n: sorted(v)[len(v) // 2] for n, v in ms.items()},
            "median_ratio": ratios[len(ratios) // 2], "ratio_range": [ratios[0], ratios[-1]]}


def main(picked: list[str]) -> dict:
    B, H, S, d = 8, 32, 8192, 128
    ids = _documents(S, seed=S).cuda()
    masks = forms(ids)
    unknown = sorted(set(picked) - set(masks) - {"flex_ids"})
    if unknown:
        raise SystemExit(f"attn_doc_mask_forms.py: unknown form(s) {unknown}; the forms: {[*masks, 'flex_ids']}")
    if picked:
        masks = {name: mm for name, mm in masks.items() if name in ("ids", *picked)}
    bms = {name: A.create_block_mask(mm, None, None, S, S, device="cuda") for name, mm in masks.items()
           if name != "bound_causal_only"}
    if "bound_causal_only" in masks:
        bms["bound_causal_only"] = attrs.evolve(bms["ids"], mask_mod=masks["bound_causal_only"])
    fns = {name: (lambda q, k, v, bm=bm: A.attention(q, k, v, block_mask=bm, backend="triton")[0])
           for name, bm in bms.items()}
    # FlexAttention compiled with the same mask (the bench's peer)
    if not picked or "flex_ids" in picked:
        fns["flex_ids"] = _flex_fn("document", S, H, ids, gqa=False)
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, S, d, device="cuda", dtype=torch.bfloat16).requires_grad_() for _ in range(3))
    do = torch.randn(B, H, S, d, device="cuda", dtype=torch.bfloat16)
    res: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "B": B, "H": H, "S": S, "d": d,
                 "forms": {}}
    ref = None
    for rnd in range(2):
        for name in (list(fns) if rnd == 0 else list(reversed(list(fns)))):
            fn = fns[name]
            with torch.no_grad():
                out = fn(q, k, v)
            grads = torch.autograd.grad(fn(q, k, v), (q, k, v), do)
            if ref is None:
                ref = (out, grads)
            diff = [float((a.float() - r.float()).abs().max()) for a, r in zip((out, *grads), (ref[0], *ref[1]))]
            del out, grads

            def fwd(fn=fn):
                with torch.no_grad():
                    fn(q, k, v)

            def fwd_bwd(fn=fn):
                torch.autograd.grad(fn(q, k, v), (q, k, v), do)

            f, fb = _replay_ms(fwd), _replay_ms(fwd_bwd)
            r = res["forms"].setdefault(name, {"fwd_graph_median": [], "fwd_bwd_graph_median": []})
            r["fwd_graph_median"].append(f)
            r["fwd_bwd_graph_median"].append(fb)
            r["max_diff_out_dq_dk_dv"] = diff
            print(rnd, name, f"fwd {f:.3f}  f+b {fb:.3f}  bwd {fb - f:.3f}", "diff", [f"{x:.1e}" for x in diff],
                  flush=True)
    # the library's mask against Flex, replays taken in turns (forward, then forward+backward)
    for what in ("fwd", "fwd_bwd") if "flex_ids" in fns else ():
        bodies = {}
        for name in ("ids", "flex_ids"):
            fn = fns[name]
            if what == "fwd":
                def body(fn=fn):
                    with torch.no_grad():
                        fn(q, k, v)
            else:
                def body(fn=fn):
                    torch.autograd.grad(fn(q, k, v), (q, k, v), do)
            bodies[name] = body
        p = res.setdefault("paired_ids_flex", {})[what] = _paired(bodies)
        print("paired", what, {n: f"{t:.3f}" for n, t in p["median_ms"].items()},
              f"Flex / fp8ops {p['median_ratio']:.3f} ({p['ratio_range'][0]:.3f}-{p['ratio_range'][1]:.3f})",
              flush=True)
    return res


if __name__ == "__main__":
    record = main(sys.argv[1:])
    path = os.path.join(os.environ.get("OUT", "."), "attention_doc_mask_forms.json")
    with open(path, "w") as fh:
        json.dump(record, fh, indent=1)
    print("wrote", path)
